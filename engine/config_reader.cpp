#include "shardswap/config_reader.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>

#include "shardswap/error.h"
#include "shardswap/json_reader.h"

namespace shardswap {

namespace {

// One step of a key path: an object key followed by zero or more list indices ("schedule[2]").
struct PathStep {
  std::string key;
  std::vector<std::size_t> indices;
};

std::vector<PathStep> parse_path(std::string_view path) {
  const auto malformed = [&](std::string_view why) -> ConfigError {
    return ConfigError(fmt::format("{}: malformed key path: {}", path, why));
  };
  std::vector<PathStep> steps;
  std::size_t start = 0;
  while (true) {
    const auto dot = path.find('.', start);
    const std::string_view part = path.substr(start, dot - start);
    const auto bracket = part.find('[');
    PathStep step{std::string(part.substr(0, bracket)), {}};
    if (step.key.empty()) throw malformed("a key is empty");
    for (auto pos = bracket; pos != std::string_view::npos;) {
      const auto close = part.find(']', pos);
      if (close == std::string_view::npos || close == pos + 1) throw malformed("expected [index]");
      std::size_t index = 0;
      for (const char ch : part.substr(pos + 1, close - pos - 1)) {
        if (ch < '0' || ch > '9') throw malformed("an index must be a non-negative integer");
        if (index > 100'000'000) throw malformed("an index is too large");
        index = index * 10 + static_cast<std::size_t>(ch - '0');
      }
      step.indices.push_back(index);
      pos = close + 1;
      if (pos == part.size()) break;
      if (part[pos] != '[') throw malformed("expected '.' or '[' after ']'");
    }
    steps.push_back(std::move(step));
    if (dot == std::string_view::npos) break;
    start = dot + 1;
  }
  return steps;
}

// Edit distance counting a swap of neighbours as one edit (optimal string alignment), for
// suggesting the key a misspelt one was meant to be: "widht" is one edit from "width".
std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::vector<std::size_t>> d(a.size() + 1, std::vector<std::size_t>(b.size() + 1));
  for (std::size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (std::size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i)
    for (std::size_t j = 1; j <= b.size(); ++j) {
      d[i][j] = std::min(
          {d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1])
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  return d[a.size()][b.size()];
}

// "a.b[0].c" -> {"a.b[0]", "c"}; "a" -> {"", "a"}.
std::pair<std::string_view, std::string_view> split_parent(std::string_view path) {
  const auto dot = path.rfind('.');
  if (dot == std::string_view::npos) return {{}, path};
  return {path.substr(0, dot), path.substr(dot + 1)};
}

bool holds_objects(const nlohmann::json& j) {
  return j.is_array() &&
         std::any_of(j.begin(), j.end(), [](const nlohmann::json& x) { return x.is_object(); });
}

// Recursive, and bounded: a ConfigReader never holds a config nested deeper than kMaxDepth (its
// constructor and set() refuse one), so neither does this or nlohmann's dump() and copy.
// `budget` bounds the bytes of the paths collected: a 16 MiB file of long keys nested 250 deep
// with many leaves would otherwise spell out gigabytes of paths.
void collect_leaves(const nlohmann::json& j, const std::string& prefix,
                    std::vector<std::string>& out, std::size_t& budget, const std::string& source) {
  if (j.is_object() && !j.empty()) {
    for (const auto& [key, value] : j.items())
      collect_leaves(value, prefix.empty() ? key : prefix + "." + key, out, budget, source);
  } else if (holds_objects(j)) {
    // Keys inside a list of objects can be misspelt like any other: report them one by one.
    for (std::size_t i = 0; i < j.size(); ++i)
      collect_leaves(j[i], fmt::format("{}[{}]", prefix, i), out, budget, source);
  } else {
    if (prefix.size() > budget)
      throw ConfigError(fmt::format(
          "{}: its key paths (every leaf's, spelt out) exceed {} MiB, from '{}...' on: a config "
          "this large cannot be checked key by key",
          source, ConfigReader::kMaxFileBytes >> 20, prefix.substr(0, 64)));
    budget -= prefix.size();
    out.push_back(prefix);
  }
}

// The first `max` bytes of `text`, not cutting a UTF-8 sequence, with "..." if anything was cut.
std::string clipped(std::string_view text, std::size_t max) {
  if (text.size() <= max) return std::string(text);
  while (max > 0 && (static_cast<unsigned char>(text[max]) & 0xC0) == 0x80) --max;
  return std::string(text.substr(0, max)) + "...";
}

// "KEY: nested deeper than ...", for a container at key path `steps` one level too deep.
std::string too_deep(const std::vector<JsonPathStep>& steps) {
  return fmt::format(
      "{}: nested deeper than {} levels of objects and lists, the most a config "
      "may have",
      json_path_text(steps), ConfigReader::kMaxDepth);
}

// What a config's text may be. A file's size is bounded where it is read (from_file); text
// handed to from_text is already in memory.
JsonLimits config_limits(std::size_t max_depth) {
  return JsonLimits{max_depth, std::numeric_limits<std::size_t>::max(), "a config"};
}

}  // namespace

ConfigReader::ConfigReader(nlohmann::json root, std::string source)
    : root_(std::move(root)), source_(std::move(source)) {
  if (!root_.is_object())
    throw ConfigError(fmt::format("{}: the top level must be a JSON object {{...}}", source_));
  if (const auto steps = json_deeper_than(root_, kMaxDepth))
    throw ConfigError(naming_file(too_deep(*steps)));
}

ConfigReader ConfigReader::from_file(const std::string& path) {
  return from_text(read_json_text(path, kMaxFileBytes, "config file"), path);
}

ConfigReader ConfigReader::from_text(std::string_view text, std::string source) {
  // nlohmann keeps the last of repeated keys without a word; DeepSpeed refuses them, and so does
  // the reader: a repeated key usually means one of the two values is not the one the author
  // meant.
  auto root = parse_json(text, source, config_limits(kMaxDepth));
  return ConfigReader(std::move(root), std::move(source));
}

std::string ConfigReader::naming_file(std::string_view message) const {
  return fmt::format("{}: {}", source_, message);
}

void ConfigReader::fail(std::string_view path, std::string_view why) const {
  throw ConfigError(naming_file(fmt::format("{}: {}", path, why)));
}

void ConfigReader::fail(std::string_view path, std::string_view value, std::string_view why) const {
  throw ConfigError(naming_file(fmt::format("{} = {}: {}", path, value, why)));
}

std::optional<std::string> ConfigReader::written(std::string_view path) const {
  const auto* node = find(path);
  if (node == nullptr) return std::nullopt;
  return node->dump();
}

void ConfigReader::fail_value(std::string_view path, std::string_view why) const {
  const auto value = written(path);
  if (!value) fail(path, why);
  fail(path, *value, why);
}

void ConfigReader::rethrow_naming_file(const std::exception& e) const {
  const std::string_view what = e.what();
  // Already named: "SOURCE: ..." or, for a JSON syntax error, "SOURCE:LINE:COLUMN: ...".
  if (what.substr(0, source_.size() + 1) == source_ + ":") throw ConfigError(std::string(what));
  throw ConfigError(naming_file(what));
}

const nlohmann::json* ConfigReader::find(std::string_view path) const {
  const nlohmann::json* node = &root_;
  for (const auto& step : parse_path(path)) {
    if (!node->is_object()) return nullptr;
    auto it = node->find(step.key);
    if (it == node->end()) return nullptr;
    node = &*it;
    for (const auto index : step.indices) {
      if (!node->is_array() || index >= node->size()) return nullptr;
      node = &(*node)[index];
    }
  }
  return node;
}

bool ConfigReader::has(std::string_view path) const {
  return find(path) != nullptr;
}

bool ConfigReader::is_auto(std::string_view path) const {
  const auto* node = find(path);
  return node != nullptr && node->is_string() && node->get_ref<const std::string&>() == "auto";
}

void ConfigReader::expect_object(std::string_view path) const {
  const auto* node = find(path);
  if (node != nullptr && !node->is_object()) fail(path, node->dump(), "must be an object {...}");
}

void ConfigReader::resolve_auto(std::string path, nlohmann::json value, std::string why) {
  resolved_autos_.insert_or_assign(std::move(path), ResolvedAuto{std::move(value), std::move(why)});
}

const nlohmann::json* ConfigReader::value_read(std::string_view path, const std::string& fallback) {
  read_.emplace(path);
  const auto* node = find(path);
  if (node == nullptr || !node->is_string() || node->get_ref<const std::string&>() != "auto")
    return node;
  if (const auto it = resolved_autos_.find(path); it != resolved_autos_.end()) {
    warn(path, "\"auto\"",
         fmt::format("ShardSwap uses {} {}", it->second.value.dump(), it->second.why));
    return &it->second.value;
  }
  // Nothing says what the placeholder stands for here: Hugging Face's Trainer leaves it in place
  // (and DeepSpeed would refuse it), so ShardSwap's own default is the best guess, said as such.
  warn(path, "\"auto\"",
       fmt::format("not a key Hugging Face's Trainer fills in; ShardSwap uses its default, {}",
                   fallback));
  return nullptr;
}

void ConfigReader::warn(std::string_view path, std::string_view why) {
  if (!warned_.emplace(path).second) return;
  warnings_.push_back(naming_file(fmt::format("{}: {}", path, why)));
}

void ConfigReader::warn(std::string_view path, std::string_view value, std::string_view why) {
  if (!warned_.emplace(path).second) return;
  warnings_.push_back(naming_file(fmt::format("{} = {}: {}", path, value, why)));
}

double ConfigReader::number(std::string_view path, double fallback) {
  const auto* node = value_read(path, fmt::format("{}", fallback));
  if (node == nullptr) return fallback;
  if (!node->is_number()) fail(path, node->dump(), "must be a number");
  return node->get<double>();
}

std::int64_t ConfigReader::integer(std::string_view path, std::int64_t fallback) {
  const auto* node = value_read(path, fmt::format("{}", fallback));
  if (node == nullptr) return fallback;
  if (node->is_number_integer()) return node->get<std::int64_t>();
  if (node->is_number_float()) {
    const double v = node->get<double>();
    if (std::isfinite(v) && v == std::floor(v) && std::fabs(v) < 9.2e18)
      return static_cast<std::int64_t>(v);
  }
  fail(path, node->dump(), "must be an integer");
}

bool ConfigReader::boolean(std::string_view path, bool fallback) {
  const auto* node = value_read(path, fmt::format("{}", fallback));
  if (node == nullptr) return fallback;
  if (!node->is_boolean()) fail(path, node->dump(), "must be true or false");
  return node->get<bool>();
}

std::string ConfigReader::string(std::string_view path, const std::string& fallback) {
  const auto* node = value_read(path, fmt::format("'{}'", fallback));
  if (node == nullptr) return fallback;
  if (!node->is_string()) fail(path, node->dump(), "must be a string");
  return node->get<std::string>();
}

std::vector<double> ConfigReader::numbers(std::string_view path,
                                          const std::vector<double>& fallback) {
  const auto* node = value_read(path, fmt::format("[{}]", fmt::join(fallback, ", ")));
  if (node == nullptr) return fallback;
  std::vector<double> out;
  if (node->is_array())
    for (const auto& x : *node) {
      if (!x.is_number()) fail(path, node->dump(), "must be a list of numbers");
      out.push_back(x.get<double>());
    }
  else
    fail(path, node->dump(), "must be a list of numbers");
  return out;
}

std::vector<std::string> ConfigReader::strings(std::string_view path,
                                               const std::vector<std::string>& fallback) {
  const auto* node = value_read(path, fmt::format("[{}]", fmt::join(fallback, ", ")));
  if (node == nullptr) return fallback;
  const auto refuse = [&] { fail(path, node->dump(), "must be a list of strings"); };
  if (!node->is_array()) refuse();
  std::vector<std::string> out;
  for (const auto& x : *node) {
    if (!x.is_string()) refuse();
    out.push_back(x.get<std::string>());
  }
  return out;
}

std::size_t ConfigReader::array_size(std::string_view path) {
  const auto* node = find(path);
  if (node == nullptr) {
    read_.emplace(path);
    return 0;
  }
  if (!node->is_array()) fail(path, node->dump(), "must be a list");
  // A list without objects is one leaf (see unread_keys): this read covers it.
  if (!holds_objects(*node)) read_.emplace(path);
  return node->size();
}

void ConfigReader::set(std::string_view assignment) {
  const auto eq = assignment.find('=');
  if (eq == std::string_view::npos || eq == 0)
    throw ConfigError(fmt::format("--set '{}': expected key.path=value", clipped(assignment, 60)));
  const std::string path(assignment.substr(0, eq));
  const std::string_view text = assignment.substr(eq + 1);
  const auto refuse = [&](std::string_view why) {
    return ConfigError(fmt::format("--set '{}': {}", clipped(assignment, 60), why));
  };
  const auto steps = parse_path(path);
  // Each key and each index is a level below the top-level object: the value's own objects and
  // lists get what is left of kMaxDepth.
  std::vector<JsonPathStep> levels;
  for (const auto& step : steps) {
    levels.push_back(JsonPathStep{step.key});
    for (const auto index : step.indices) levels.push_back(JsonPathStep{{}, index, true});
  }
  if (levels.size() > kMaxDepth) {
    levels.resize(kMaxDepth);
    throw refuse(too_deep(levels));
  }
  nlohmann::json value;
  try {
    value = parse_json(text, "", config_limits(kMaxDepth - levels.size()));
  } catch (const JsonError& e) {
    levels.insert(levels.end(), e.path().begin(), e.path().end());
    switch (e.kind()) {
      case JsonError::Kind::syntax:
        value = std::string(text);  // a bare word: a string
        break;
      case JsonError::Kind::too_deep:
        throw refuse(too_deep(levels));
      case JsonError::Kind::repeated_key:
        throw refuse(fmt::format("{}: the key appears twice", json_path_text(levels)));
      default:
        // A number beyond double's range: refused, not kept as the string "1e309".
        throw refuse(fmt::format("{}: {}", json_path_text(levels), e.reason()));
    }
  }
  // Edit a copy, so a refused override leaves the config as it was. A missing key is created.
  nlohmann::json updated = root_;
  nlohmann::json* node = &updated;
  for (const auto& step : steps) {
    if (!node->is_object() && !node->is_null())
      throw refuse(fmt::format("'{}' lies under a value that is not an object", step.key));
    node = &(*node)[step.key];
    for (const auto index : step.indices) {
      if (!node->is_array() || index >= node->size())
        throw refuse(
            fmt::format("{}[{}] is not an element of a list in the config", step.key, index));
      node = &(*node)[index];
    }
  }
  *node = std::move(value);
  root_ = std::move(updated);
  overrides_.emplace_back(assignment);
}

std::vector<std::string> ConfigReader::unread_keys() const {
  std::vector<std::string> leaves;
  std::size_t budget = kMaxFileBytes;
  collect_leaves(root_, "", leaves, budget, source_);
  std::vector<std::string> unread;
  for (const auto& leaf : leaves) {
    // A leaf counts as read if it or anything above it was read: "a.b[0].c", "a.b[0]", "a.b", "a".
    bool read = false;
    for (std::string p = leaf; !p.empty() && !read;) {
      read = read_.count(p) > 0;
      const auto cut = p.find_last_of(".[");
      p = cut == std::string::npos ? std::string() : p.substr(0, cut);
    }
    if (!read) unread.push_back(leaf);
  }
  return unread;
}

std::optional<std::string> ConfigReader::closest_read_key(std::string_view path) const {
  const auto [parent, name] = split_parent(path);
  std::optional<std::string> best;
  // One edit for short names, two for long ones: beyond that a guess misleads more than it helps.
  std::size_t best_distance = name.size() >= 8 ? 3 : 2;
  for (const auto& key : read_) {
    const auto [key_parent, key_name] = split_parent(key);
    if (key_parent != parent || key == path) continue;
    const auto d = edit_distance(name, key_name);
    if (d < best_distance) {
      best_distance = d;
      best = key;
    }
  }
  return best;
}

}  // namespace shardswap
