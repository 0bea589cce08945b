// Layer-switching schedules: which groups are active at each step, for LISA, BAdam and explicit
// tables. Every random choice comes from the small PRNG below, never from <random>'s
// distributions (their output differs between standard libraries): every rank, compiler and
// platform must compute the same active sets, and a resumed run must find the same ones.
//
// What each type reads (the other keys are ignored, never half-used):
// - "none": nothing, not even checked, so switching can be turned off by changing the type alone.
// - "lisa": interval, gamma, layers, always_active, seed.
// - "badam": interval, layers (the blocks, in order), always_active, order, seed (random order).
// - "explicit": schedule, and always_active, united with every entry. `layers` must be empty and
//   lisa/badam refuse a non-empty `schedule`: a list that would be ignored is a mistake to name.
#include "shardswap/schedule.h"
#include "support/quoted.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <climits>
#include <numeric>
#include <string_view>
#include <unordered_map>

#include "shardswap/error.h"

namespace shardswap {

namespace {

constexpr std::uint64_t kGolden = 0x9E3779B97F4A7C15ull;

// The splitmix64 output function (Steele, Lea, Flood 2014): a bijection of 64-bit words.
std::uint64_t mix64(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// splitmix64: 64-bit unsigned arithmetic only, so its output is the same everywhere.
class SplitMix64 {
 public:
  explicit SplitMix64(std::uint64_t state) : state_(state) {}

  std::uint64_t next() {
    state_ += kGolden;
    return mix64(state_);
  }

  /// Uniform in [0, bound), bound >= 1, without modulo bias: the 2^64 mod bound smallest words
  /// are rejected, so the accepted ones are a whole number of copies of [0, bound).
  std::uint64_t below(std::uint64_t bound) {
    const std::uint64_t rejected = (std::uint64_t{0} - bound) % bound;  // 2^64 mod bound
    while (true) {
      const std::uint64_t word = next();
      if (word >= rejected) return word % bound;
    }
  }

 private:
  std::uint64_t state_;
};

// Domains keep LISA draws and BAdam orders independent for one seed.
constexpr std::uint64_t kLisaDomain = 0x6c697361;     // "lisa"
constexpr std::uint64_t kBadamDomain = 0x626164616d;  // "badam"

/// The generator of period (LISA) or epoch (BAdam) `index`: a function of (seed, index) alone.
SplitMix64 stream(std::uint64_t seed, std::uint64_t domain, std::uint64_t index) {
  return SplitMix64(mix64(mix64(seed ^ domain) + index));
}

/// `count` distinct indices of [0, n), uniformly (partial Fisher–Yates); count = n gives a
/// uniformly random permutation.
std::vector<std::size_t> draw_distinct(SplitMix64& rng, std::size_t n, std::size_t count) {
  std::vector<std::size_t> pool(n);
  std::iota(pool.begin(), pool.end(), std::size_t{0});
  for (std::size_t i = 0; i < count; ++i)
    std::swap(pool[i], pool[i + static_cast<std::size_t>(rng.below(n - i))]);
  pool.resize(count);
  return pool;
}

/// "input, layers.0, layers.1" or, for long lists, "input, layers.0, ..., head (34 groups)".
std::string group_list(const std::vector<std::string>& groups) {
  if (groups.size() <= 6) return fmt::format("{}", fmt::join(groups, ", "));
  return fmt::format("{}, {}, ..., {} ({} groups)", groups[0], groups[1], groups.back(),
                     groups.size());
}

/// Each name's first position in `names`. Hashed, not searched: a model may have 100,000
/// groups, and every check below is then linear in the names, not quadratic.
using NameIndex = std::unordered_map<std::string_view, std::size_t>;
NameIndex index_of(const std::vector<std::string>& names) {
  NameIndex index;
  index.reserve(names.size());
  for (std::size_t i = 0; i < names.size(); ++i) index.emplace(names[i], i);
  return index;
}

/// Every name of `names` (the list at config key `key`) is a group, and none repeats.
void check_names(const std::vector<std::string>& names, const std::string& key,
                 const std::vector<std::string>& groups, const NameIndex& group_index) {
  NameIndex seen;
  seen.reserve(names.size());
  for (std::size_t i = 0; i < names.size(); ++i) {
    if (!group_index.contains(names[i]))
      throw ConfigError(fmt::format("{}[{}] = {}: not a group of the model (groups: {})", key, i,
                                    quote_value(names[i]), group_list(groups)));
    const auto [first, inserted] = seen.emplace(names[i], i);
    if (!inserted)
      throw ConfigError(fmt::format("{}[{}] = {}: repeats {}[{}]", key, i, quote_value(names[i]),
                                    key.substr(key.rfind('.') + 1), first->second));
  }
}

void validate(const LayerSwitchingConfig& c, const std::vector<std::string>& groups,
              const NameIndex& group_index) {
  if (group_index.size() != groups.size())
    for (std::size_t i = 0; i < groups.size(); ++i)
      if (group_index.at(groups[i]) != i)
        throw ConfigError(
            fmt::format("LayerSchedule: the model declares group '{}' twice", groups[i]));

  if (c.type == SwitchingType::none) return;
  check_names(c.always_active, "layer_switching.always_active", groups, group_index);

  if (c.type == SwitchingType::explicit_list) {
    if (!c.layers.empty())
      throw ConfigError(
          "layer_switching.layers: not used by type \"explicit\": list the active groups of each "
          "period in layer_switching.schedule");
    if (c.steps.empty())
      throw ConfigError(
          "layer_switching.schedule: empty, but type \"explicit\" needs at least the entry for "
          "step 0");
    for (std::size_t i = 0; i < c.steps.size(); ++i) {
      const auto& [step, active] = c.steps[i];
      if (i == 0 && step != 0)
        throw ConfigError(
            fmt::format("layer_switching.schedule[0].step = {}: must be 0: the schedule says "
                        "what is active from the first step on",
                        step));
      if (i > 0 && step <= c.steps[i - 1].first)
        throw ConfigError(
            fmt::format("layer_switching.schedule[{}].step = {}: does not come after "
                        "schedule[{}].step = {}",
                        i, step, i - 1, c.steps[i - 1].first));
      check_names(active, fmt::format("layer_switching.schedule[{}].active", i), groups,
                  group_index);
      if (active.empty() && c.always_active.empty())
        throw ConfigError(
            fmt::format("layer_switching.schedule[{}].active = []: empty, and so is "
                        "layer_switching.always_active: no group would train from step {} on",
                        i, step));
    }
    return;
  }

  // lisa, badam
  const char* type = switching_type_name(c.type);
  if (!c.steps.empty())
    throw ConfigError(
        fmt::format("layer_switching.schedule: only used by type \"explicit\", not {}", quote_value(type)));
  if (c.interval < 1)
    throw ConfigError(
        fmt::format("layer_switching.interval = {}: must be >= 1 (steps)", c.interval));
  if (c.layers.empty())
    throw ConfigError(fmt::format(
        "layer_switching.layers = []: empty, but {} needs the layers to switch between", type));
  check_names(c.layers, "layer_switching.layers", groups, group_index);
  const NameIndex layers = index_of(c.layers);
  for (std::size_t i = 0; i < c.always_active.size(); ++i)
    if (layers.contains(c.always_active[i]))
      throw ConfigError(
          fmt::format("layer_switching.always_active[{}] = {}: also in layer_switching.layers", i,
                      quote_value(c.always_active[i])));
  if (c.type == SwitchingType::lisa) {
    if (c.gamma < 1)
      throw ConfigError(fmt::format("layer_switching.gamma = {}: must be >= 1", c.gamma));
    if (static_cast<std::size_t>(c.gamma) > c.layers.size())
      throw ConfigError(
          fmt::format("layer_switching.gamma = {}: larger than the {} layers to sample from",
                      c.gamma, c.layers.size()));
  }
}

void check_step(std::int64_t step, const char* caller) {
  if (step < 0)
    throw ConfigError(fmt::format("LayerSchedule::{}: step {} must be >= 0", caller, step));
}

}  // namespace

SwitchingType switching_type_from_name(std::string_view name, std::string_view key) {
  if (name == "none") return SwitchingType::none;
  if (name == "lisa") return SwitchingType::lisa;
  if (name == "badam") return SwitchingType::badam;
  if (name == "explicit") return SwitchingType::explicit_list;
  throw ConfigError(fmt::format("{} = {}: expected none, lisa, badam or explicit", key, quote_value(name)));
}

const char* switching_type_name(SwitchingType type) {
  switch (type) {
    case SwitchingType::none:
      return "none";
    case SwitchingType::lisa:
      return "lisa";
    case SwitchingType::badam:
      return "badam";
    case SwitchingType::explicit_list:
      return "explicit";
  }
  return "?";
}

BlockOrder block_order_from_name(std::string_view name, std::string_view key) {
  if (name == "ascending") return BlockOrder::ascending;
  if (name == "descending") return BlockOrder::descending;
  if (name == "random") return BlockOrder::random;
  throw ConfigError(fmt::format("{} = {}: expected ascending, descending or random", key, quote_value(name)));
}

const char* block_order_name(BlockOrder order) {
  switch (order) {
    case BlockOrder::ascending:
      return "ascending";
    case BlockOrder::descending:
      return "descending";
    case BlockOrder::random:
      return "random";
  }
  return "?";
}

LayerSchedule::LayerSchedule(LayerSwitchingConfig config, std::vector<std::string> groups)
    : config_(std::move(config)), groups_(std::move(groups)) {
  const NameIndex index = index_of(groups_);
  validate(config_, groups_, index);
  for (const auto& [name, position] : index) group_index_.emplace(name, position);
}

std::vector<std::string> LayerSchedule::active_at(std::int64_t step) const {
  check_step(step, "active_at");
  if (!enabled()) return groups_;

  const auto& c = config_;
  std::vector<bool> active(groups_.size(), false);
  const auto mark = [&](const std::string& name) { active[group_index_.at(name)] = true; };
  for (const auto& name : c.always_active) mark(name);

  if (c.type == SwitchingType::explicit_list) {
    // The last entry starting at or before `step`; entry 0 starts at 0.
    const auto after =
        std::upper_bound(c.steps.begin(), c.steps.end(), step,
                         [](std::int64_t s, const auto& entry) { return s < entry.first; });
    for (const auto& name : std::prev(after)->second) mark(name);
  } else {
    const auto period = static_cast<std::uint64_t>(step / c.interval);
    const std::size_t n = c.layers.size();
    if (c.type == SwitchingType::lisa) {
      auto rng = stream(c.seed, kLisaDomain, period);
      for (const auto i : draw_distinct(rng, n, static_cast<std::size_t>(c.gamma)))
        mark(c.layers[i]);
    } else {  // badam: one block per period, every block once per epoch of n periods
      const auto j = static_cast<std::size_t>(period % n);
      const auto epoch = period / n;
      if (c.order == BlockOrder::ascending) {
        mark(c.layers[j]);
      } else if (c.order == BlockOrder::descending) {
        mark(c.layers[n - 1 - j]);
      } else {
        auto rng = stream(c.seed, kBadamDomain, epoch);
        mark(c.layers[draw_distinct(rng, n, n)[j]]);
      }
    }
  }

  std::vector<std::string> out;
  for (std::size_t g = 0; g < groups_.size(); ++g)
    if (active[g]) out.push_back(groups_[g]);
  return out;
}

bool LayerSchedule::boundary(std::int64_t step) const {
  check_step(step, "boundary");
  if (!enabled()) return false;
  if (config_.type == SwitchingType::explicit_list)
    return std::any_of(config_.steps.begin(), config_.steps.end(),
                       [&](const auto& entry) { return entry.first == step; });
  return step % config_.interval == 0;
}

namespace {

LayerSwitchingConfig read(ConfigReader& c) {
  LayerSwitchingConfig cfg;
  // Names become enums here, so an unknown one is refused naming the file and the key.
  cfg.type = switching_type_from_name(
      c.string("layer_switching.type", switching_type_name(cfg.type)), "layer_switching.type");
  cfg.interval = c.integer("layer_switching.interval", cfg.interval);
  const auto gamma = c.integer("layer_switching.gamma", cfg.gamma);
  if (gamma < INT_MIN || gamma > INT_MAX)
    c.fail("layer_switching.gamma", fmt::format("{}", gamma), "out of range");
  cfg.gamma = static_cast<int>(gamma);
  cfg.layers = c.strings("layer_switching.layers", {});
  cfg.always_active = c.strings("layer_switching.always_active", {});
  cfg.order = block_order_from_name(c.string("layer_switching.order", block_order_name(cfg.order)),
                                    "layer_switching.order");
  const auto seed = c.integer("layer_switching.seed", 0);
  if (seed < 0) c.fail("layer_switching.seed", fmt::format("{}", seed), "must be >= 0");
  cfg.seed = static_cast<std::uint64_t>(seed);
  cfg.policy = deactivate_policy_from_name(
      c.string("layer_switching.policy", deactivate_policy_name(cfg.policy)),
      "layer_switching.policy");

  const std::string schedule = "layer_switching.schedule";
  const auto entries = c.array_size(schedule);
  for (std::size_t i = 0; i < entries; ++i) {
    const auto entry = fmt::format("{}[{}]", schedule, i);
    for (const char* key : {".step", ".active"})
      if (!c.has(entry + key))
        c.fail(entry + key,
               "missing: each entry of layer_switching.schedule is an object "
               "{\"step\": first step, \"active\": [groups]}");
    const auto step = c.integer(entry + ".step", 0);
    cfg.steps.emplace_back(step, c.strings(entry + ".active", {}));
  }
  return cfg;
}

}  // namespace

LayerSwitchingConfig layer_switching_from_json(ConfigReader& config) {
  try {
    return read(config);
  } catch (const ConfigError& e) {
    // The *_from_name functions know the key but not the file: add it.
    config.rethrow_naming_file(e);
  }
}

}  // namespace shardswap
