#include "trainer/device_budget.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <fstream>
#include <map>
#include <memory>
#include <utility>

#include <unistd.h>

#include "shardswap/engine.h"
#include "shardswap/error.h"
#include "shardswap/schedule.h"
#include "support/quoted.h"
#include "trainer/process_launch.h"
#include "trainer/run_model.h"
#include "trainer/train.h"

namespace shardswap {

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// What a run on a GPU holds outside its plan when shardswap.device_reserve is not given: on an
// NVIDIA H200 the CUDA context (526.8 MiB) and what one NCCL communicator, the libraries' state
// and kernel code took by step 1 (691-848 MiB) came to 1.19-1.34 GiB in the Qwen2.5 7B and 14B
// runs of docs/benchmarks.md; rounded up. The run measures what it really holds after step 1
// and warns if it is more (Trainer::check_reserve).
constexpr std::int64_t kCudaReserve = std::int64_t{1536} << 20;

// The rates the search estimates step times by, an NVIDIA H200's as measured (docs/benchmarks.md):
// the whole step's model FLOPs (MFU 0.42 of its 989 TFLOP/s in Qwen2.5 full fine-tunes), the
// streamed update of state on the host (master and state up and down, both directions of PCIe:
// 98 GB/s) and the CPU update (2.2 Gparam/s over 16 cores). They order arrangements; the step
// times printed beside them are estimates and say so.
constexpr double kModelFlopsPerS = 4.0e14;
constexpr double kStreamedBytesPerS = 98e9;
constexpr double kCpuParamsPerS = 2.2e9;
// The norms backward makes again (model.keep_norm_outputs spares them): the 48 of a Qwen2.5-0.5B
// step (micro 8, seq 2048) moved their 4.2 GB in 1.33 ms (kernel profile, docs/benchmarks.md).
constexpr double kNormBytesPerS = 3.2e12;
// Gradients on the host: each micro-batch's windows come down whole and (after the first) go up
// whole, one direction at a time, not overlapped with the model: half the link's two-way rate.
constexpr double kWindowBytesPerS = kStreamedBytesPerS / 2;

std::string gib(std::int64_t bytes) {
  return fmt::format("{:.2f} GiB", static_cast<double>(bytes) / kGiB);
}

// The budget's keys, or nothing when shardswap.device_memory is absent.
std::optional<DeviceBudget> read_budget(ConfigReader& c, const TrainConfig& t) {
  constexpr std::string_view kMemory = "shardswap.device_memory";
  constexpr std::string_view kReserve = "shardswap.device_reserve";
  // A size as text, or a whole number of bytes (the reserve may be 0).
  const auto size_of = [&](std::string_view key, double least) -> std::int64_t {
    const nlohmann::json::json_pointer at("/" + std::string(key.substr(0, key.find('.'))) + "/" +
                                          std::string(key.substr(key.find('.') + 1)));
    if (c.json().at(at).is_string()) {
      const std::string text = c.string(key, "");
      if (least == 0.0 && text == "0") return 0;
      try {
        return parse_byte_size(text, key);
      } catch (const ConfigError& e) {
        c.rethrow_naming_file(e);
      }
    }
    const double bytes = c.number(key, 0.0);
    if (!(bytes >= least && bytes <= 9.0e18) || bytes != std::floor(bytes))
      c.fail(key, fmt::format("{}", bytes),
             fmt::format("expected a whole number of bytes >= {}, or a size such as \"24GiB\"",
                         least));
    return static_cast<std::int64_t>(bytes);
  };
  if (!c.has(kMemory)) {
    if (c.has(kReserve))
      c.fail(kReserve, "is part of a device budget: give shardswap.device_memory too");
    return std::nullopt;
  }
  DeviceBudget b;
  b.memory = size_of(kMemory, 1.0);
  b.memory_text = c.json().at(nlohmann::json::json_pointer("/shardswap/device_memory")).dump();
  b.reserve = c.has(kReserve) ? size_of(kReserve, 0.0)
                              : (t.backend.kind == DeviceKind::cuda ? kCudaReserve : 0);
  // In-process ranks on a GPU share it (one process per rank, or NCCL's threads, have one each).
  const bool shared_gpu = t.backend.kind == DeviceKind::cuda && t.comm == CommKind::in_process;
  b.ranks_per_device = shared_gpu ? t.world_size : 1;
  b.host_memory = t.host_memory;
  // The processes of a launch on this machine share its memory, as do in-process ranks.
  const std::optional<ProcessLaunch> launch = process_launch_from_env();
  b.ranks_on_machine = launch ? std::max(1, launch->local_size) : t.world_size;
  if (b.reserve >= b.memory)
    c.fail(kMemory, b.memory_text,
           fmt::format("the budget ({}) leaves nothing for the plan once the {} held outside it "
                       "(shardswap.device_reserve) are counted",
                       gib(b.memory), gib(b.reserve)));
  return b;
}

// The active sets whose plans bound every step's: step 0's and, with layer switching, the
// largest each switch can make: LISA's always-active groups with its gamma largest layers,
// BAdam's with each block, every entry of an explicit schedule. In declaration order.
std::vector<std::vector<std::string>> bounding_active_sets(
    const TrainConfig& t, const std::vector<ParamDeclaration>& ps) {
  const LayerSchedule& schedule = *t.schedule;
  std::vector<std::vector<std::string>> sets{schedule.active_at(0)};
  if (!schedule.enabled()) return sets;
  const LayerSwitchingConfig& c = schedule.config();
  const std::vector<std::string> groups = t.model->groups();
  const auto in_order = [&](std::vector<std::string> chosen) {
    chosen.insert(chosen.end(), c.always_active.begin(), c.always_active.end());
    std::vector<std::string> out;
    for (const auto& g : groups)
      if (std::find(chosen.begin(), chosen.end(), g) != chosen.end()) out.push_back(g);
    return out;
  };
  if (c.type == SwitchingType::lisa) {
    std::map<std::string, std::int64_t> elements;
    for (const auto& p : ps) {
      std::int64_t n = 1;
      for (const auto d : p.shape) n *= d;
      elements[p.group] += n;
    }
    std::vector<std::string> layers = c.layers;
    std::stable_sort(layers.begin(), layers.end(),
                     [&](const auto& a, const auto& b) { return elements[a] > elements[b]; });
    layers.resize(static_cast<std::size_t>(c.gamma));
    sets.push_back(in_order(layers));
  } else if (c.type == SwitchingType::badam) {
    for (const auto& block : c.layers) sets.push_back(in_order({block}));
  } else if (c.type == SwitchingType::explicit_list) {
    for (const auto& [step, active] : c.steps) sets.push_back(in_order(active));
  }
  return sets;
}

// The largest device plan of `engine` over ranks and bounding active sets. Under keep_device a
// group's state stays on the device once it has been active: counted for every group the
// schedule can activate (an upper bound); kept state on the host (keep_host, or any keep policy
// with the state on the host) bounds the host plan alike. `shard_elements`: the largest shard a
// step updates; `host_bytes`: the largest host plan; `host_grad_bytes`: the largest gradient
// buffers on the host.
std::int64_t largest_engine_plan(const TrainConfig& t, const EngineConfig& engine,
                                 std::int64_t* shard_elements, std::int64_t* host_bytes,
                                 std::int64_t* host_grad_bytes = nullptr) {
  std::int64_t most = 0, shard = 0, host = 0, host_grads = 0;
  const auto declarations = t.model->declarations();
  const auto sets = bounding_active_sets(t, declarations);
  const bool keeps = t.schedule->enabled() && t.schedule->policy() != DeactivatePolicy::drop;
  const bool keeps_on_device = keeps && t.schedule->policy() == DeactivatePolicy::keep_device &&
                               engine.optimizer_placement == Placement::device;
  const bool keeps_on_host = keeps && !keeps_on_device;
  for (int r = 0; r < t.world_size; ++r) {
    std::int64_t every_state = 0;
    if (keeps_on_device || keeps_on_host) {
      const MemoryPlan all = plan_memory(engine, t.world_size, r, declarations);
      every_state = all.of(Tag::master32) + all.of(Tag::optim_state);
      if (keeps_on_host) host = std::max(host, all.host_total());
    }
    for (const auto& active : sets) {
      const MemoryPlan p = plan_memory(engine, t.world_size, r, declarations, active);
      const std::int64_t state = p.of(Tag::master32) + p.of(Tag::optim_state);
      most = std::max(most, p.total() + (keeps_on_device ? every_state - state : 0));
      host = std::max(host, p.host_total());
      host_grads = std::max(host_grads, p.host_of(Tag::grad));
      shard = std::max(shard, (p.of(Tag::master32) + p.host_of(Tag::master32)) /
                                  static_cast<std::int64_t>(engine.optimizer.master_bytes()));
    }
  }
  if (shard_elements) *shard_elements = shard;
  if (host_bytes) *host_bytes = host;
  if (host_grad_bytes) *host_grad_bytes = host_grads;
  return most;
}

// The config's model with `recompute` layers recomputed and its norm outputs kept or not.
std::shared_ptr<const RunModel> arranged_model(const TrainConfig& t, int recompute, bool keep) {
  std::shared_ptr<const RunModel> model = t.model;
  if (recompute != model->recompute_layers()) model = model->with_recompute(recompute);
  if (keep != model->keeps_norms()) model = model->with_kept_norms(keep);
  return model;
}

const char* placement_words(Placement p) {
  return p == Placement::host ? "state on the host" : "state on the device";
}

// `micro`: the config's micro-batch; another is named with its accumulation.
std::string describe(const Arrangement& a, int layers, int micro) {
  return fmt::format(
      "{}{}{}, {} of {} layers recomputed{}",
      a.micro == micro ? ""
                       : fmt::format("micro-batch {} x {} accumulated, ", a.micro, a.accumulation),
      placement_words(a.optimizer), a.gradients == Placement::host ? ", gradients on the host" : "",
      a.recompute_layers, layers, a.keep_norms ? ", norm outputs kept" : "");
}

}  // namespace

std::int64_t parse_byte_size(std::string_view text, std::string_view key) {
  const auto fail = [&]() -> std::int64_t {
    throw ConfigError(fmt::format(
        "{} = {}: expected a size such as \"24GiB\", \"1.5GB\" or \"512MiB\" (B, kB, MB, GB, TB "
        "in powers of 1000; KiB, MiB, GiB, TiB in powers of 1024), or a whole number of bytes",
        key, quote_value(text)));
  };
  std::size_t i = 0;
  while (i < text.size() && (std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.'))
    ++i;
  const std::string number(text.substr(0, i));
  if (number.empty() || std::count(number.begin(), number.end(), '.') > 1 || number == ".")
    return fail();
  std::string_view unit = text.substr(i);
  while (!unit.empty() && unit.front() == ' ') unit.remove_prefix(1);
  static constexpr std::pair<std::string_view, double> kUnits[] = {
      {"", 1.0},          {"B", 1.0},    {"kB", 1e3},           {"KB", 1e3},
      {"MB", 1e6},        {"GB", 1e9},   {"TB", 1e12},          {"KiB", 1024.0},
      {"MiB", 1048576.0}, {"GiB", kGiB}, {"TiB", kGiB * 1024.0}};
  const auto u = std::find_if(std::begin(kUnits), std::end(kUnits),
                              [&](const auto& k) { return k.first == unit; });
  if (u == std::end(kUnits)) return fail();
  const double bytes = std::stod(number) * u->second;
  if (!(bytes >= 1.0 && bytes <= 9.0e18)) return fail();
  return static_cast<std::int64_t>(std::ceil(bytes));
}

std::int64_t machine_memory_bytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGE_SIZE);
  std::int64_t bytes = pages > 0 && page > 0 ? std::int64_t{pages} * page : 0;
  std::ifstream limit("/sys/fs/cgroup/memory.max");
  std::int64_t cgroup = 0;
  if (limit >> cgroup && cgroup > 0 && (bytes == 0 || cgroup < bytes)) bytes = cgroup;
  return bytes;
}

std::int64_t read_host_memory(ConfigReader& c) {
  constexpr std::string_view kHost = "shardswap.host_memory";
  if (!c.has(kHost)) return machine_memory_bytes();
  if (c.json().at(nlohmann::json::json_pointer("/shardswap/host_memory")).is_string()) {
    try {
      return parse_byte_size(c.string(kHost, ""), kHost);
    } catch (const ConfigError& e) {
      c.rethrow_naming_file(e);
    }
  }
  const double bytes = c.number(kHost, 0.0);
  if (!(bytes >= 1.0 && bytes <= 9.0e18) || bytes != std::floor(bytes))
    c.fail(kHost, fmt::format("{}", bytes),
           "expected a whole number of bytes >= 1, or a size such as \"64GiB\"");
  return static_cast<std::int64_t>(bytes);
}

std::vector<std::string> BudgetChoice::lines() const {
  const auto& b = budget;
  std::vector<std::string> out;
  out.push_back(fmt::format(
      "device budget {} (shardswap.device_memory {}): {} of it held outside the plan "
      "(shardswap.device_reserve: CUDA context, NCCL, libraries), {} for the plan of each rank "
      "({} rank{} a GPU)",
      gib(b.memory), b.memory_text, gib(b.reserve), gib(b.per_rank()), b.ranks_per_device,
      b.ranks_per_device == 1 ? "" : "s"));
  const auto row = [&](const char* what, const Arrangement& a) {
    return fmt::format("  {} ({}): plan {} bytes ({}), {}; estimated step {:.3f} s", what,
                       describe(a, recomputable, configured.micro), a.plan_bytes, gib(a.plan_bytes),
                       a.plan_bytes <= b.per_rank() ? "fits" : "does not fit", a.step_s());
  };
  out.push_back(row("as configured", configured));
  out.push_back(row("chosen", chosen));
  if (other_placement)
    out.push_back(row("the fastest with the state placed otherwise", *other_placement));
  else if (placement_free)
    out.push_back(fmt::format("  with the {} no arrangement fits",
                              placement_words(chosen.optimizer == Placement::host
                                                  ? Placement::device
                                                  : Placement::host)));
  if (frozen_weights_on_host)
    out.push_back(
        "  frozen layers' weights on the host (shardswap.frozen_weight_placement, as configured): "
        "every plan holds the active groups' weights and two windows on the device; the "
        "estimates leave out the windows' copies over the link");
  if (host_excluded > 0)
    out.push_back(fmt::format(
        "  left out: {} arrangement{} within the device budget whose host memory ({} ranks on "
        "this machine) the host's {} cannot hold (shardswap.host_memory)",
        host_excluded, host_excluded == 1 ? "" : "s", b.ranks_on_machine, gib(b.host_memory)));
  std::vector<std::string> searched;
  if (placement_free) searched.emplace_back("where the master and optimizer state live");
  if (gradients_free) searched.emplace_back("where the gradients live");
  if (recompute_free) searched.emplace_back("how many layers are recomputed");
  if (keep_norms_free) searched.emplace_back("whether the norms' outputs are kept");
  if (micro_free && chosen.micro != configured.micro)
    searched.emplace_back("the micro-batch (the same global batch; a smaller one only when no "
                          "arrangement at a larger one fits: the estimate does not count a smaller "
                          "one's slower GEMMs)");
  out.push_back(fmt::format(
      "  searched: {} ({} arrangements, {} within the budget); chosen as the fastest by "
      "estimate: forward and backward at {:.0f} TFLOP/s, a recomputed layer's forward again "
      "in backward, {}state on the host streamed at {:.0f} GB/s ({:.0f} bytes a param) or "
      "updated on the CPU at {:.1f} Gparam/s (an NVIDIA H200's measured rates){}",
      searched.empty() ? std::string("nothing (the config sets every choice)")
                       : fmt::format("{}", fmt::join(searched, " and ")),
      arrangements, fitting, kModelFlopsPerS / 1e12,
      keep_norms_free ? fmt::format("kept norm outputs sparing backward's norms at {:.1f} TB/s, ",
                                    kNormBytesPerS / 1e12)
                      : std::string(),
      kStreamedBytesPerS / 1e9, streamed_bytes_per_param, kCpuParamsPerS / 1e9,
      gradients_free || chosen.gradients == Placement::host
          ? fmt::format(", gradients on the host down and up each micro-batch at {:.0f} GB/s",
                        kWindowBytesPerS / 1e9)
          : std::string()));
  return out;
}

std::optional<BudgetChoice> apply_device_budget(ConfigReader& c, TrainConfig& t) {
  const std::optional<DeviceBudget> budget = read_budget(c, t);
  if (!budget) return std::nullopt;
  BudgetChoice choice;
  choice.budget = *budget;
  // An update overlapping the next forward needs the state on the device: the search keeps it
  // there rather than turn the asked-for overlap off.
  choice.placement_free = !c.has("zero_optimization.offload_optimizer") && !t.engine.overlap_update;
  choice.recompute_free = !c.has("model.recompute_layers") && t.model->recomputable_layers() > 0;
  choice.recomputable = t.model->recomputable_layers();
  choice.keep_norms_free =
      !c.has("model.keep_norm_outputs") && t.model->kept_norms_saved_bytes(1, t.backend.kind) > 0.0;
  // Up and down: the master as stored and each state slot (24 bytes for AdamW's fp32 master, m
  // and v; 12 with bf16 m and v and the master as its low halves).
  choice.streamed_bytes_per_param =
      2.0 * (static_cast<double>(t.engine.optimizer.master_bytes()) +
             t.engine.optimizer.state_slots() *
                 static_cast<double>(t.engine.optimizer.state_bytes()));

  choice.micro_free = c.has("train_batch_size") && !c.has("train_micro_batch_size_per_gpu") &&
                      !c.has("gradient_accumulation_steps");

  // Where the state and the gradients live: the config's, or what the search may choose.
  // Gradients go to the host only beside the state, on one rank.
  choice.frozen_weights_on_host = t.engine.frozen_weight_placement == Placement::host;
  choice.gradients_free = !c.has("shardswap.gradient_placement") && t.world_size == 1 &&
                          (choice.placement_free ||
                           t.engine.optimizer_placement == Placement::host);
  std::vector<std::pair<Placement, Placement>> placements{
      {t.engine.optimizer_placement, t.engine.gradient_placement}};
  if (choice.placement_free)
    placements = {{Placement::device, Placement::device}, {Placement::host, Placement::device}};
  if (choice.gradients_free) placements.emplace_back(Placement::host, Placement::host);
  std::vector<int> recomputes{t.model->recompute_layers()};
  if (choice.recompute_free) {
    recomputes.clear();
    for (int r = 0; r <= choice.recomputable; ++r) recomputes.push_back(r);
  }
  std::vector<bool> keeps{t.model->keeps_norms()};
  if (choice.keep_norms_free) keeps = {false, true};
  const double layers = std::max(1, choice.recomputable);
  // Every arrangement at one micro-batch, the global batch kept.
  const auto arrangements_at = [&](int micro, int accumulation) {
    const double compute_s = accumulation * t.model->micro_flops(micro) / kModelFlopsPerS;
    std::vector<Arrangement> all;
    for (const auto& [placement, gradients] : placements) {
      EngineConfig engine = t.engine;
      engine.optimizer_placement = placement;
      engine.gradient_placement = gradients;
      std::int64_t shard = 0, host = 0, host_grads = 0;
      const std::int64_t engine_bytes = largest_engine_plan(t, engine, &shard, &host, &host_grads);
      double update_s = 0.0;
      if (placement == Placement::host)
        update_s = engine.offload_update == OffloadUpdate::cpu
                       ? static_cast<double>(shard) / kCpuParamsPerS
                       : static_cast<double>(shard) * choice.streamed_bytes_per_param /
                             kStreamedBytesPerS;
      for (const int r : recomputes)
        for (const bool keep : keeps) {
          Arrangement a;
          a.optimizer = placement;
          a.gradients = gradients;
          a.gradients_s = 2.0 * accumulation * static_cast<double>(host_grads) / kWindowBytesPerS;
          a.recompute_layers = r;
          a.keep_norms = keep;
          a.micro = micro;
          a.accumulation = accumulation;
          const auto model = arranged_model(t, r, keep);
          a.plan_bytes =
              engine_bytes + model->activation_bytes(micro, t.engine.dtype, t.backend.kind);
          a.machine_bytes = (host + (t.backend.kind == DeviceKind::host ? a.plan_bytes : 0)) *
                            budget->ranks_on_machine;
          // A recomputed layer runs its forward twice: a third more of its forward and
          // backward. Kept norm outputs spare backward's norms their bytes.
          a.compute_s =
              compute_s * (1.0 + r / (3.0 * layers)) -
              (keep ? accumulation * t.model->kept_norms_saved_bytes(micro, t.backend.kind) /
                          kNormBytesPerS
                    : 0.0);
          a.update_s = update_s;
          all.push_back(a);
        }
    }
    return all;
  };
  // The micro-batches that keep the global batch, the config's first, then smaller ones.
  const int micro = t.batches.micro_samples;
  const std::int64_t per_rank_samples =
      std::int64_t{micro} * t.batches.gradient_accumulation_steps;
  std::vector<std::pair<int, int>> micros{{micro, t.batches.gradient_accumulation_steps}};
  for (int m = micro - 1; m >= 1; --m)
    if (per_rank_samples % m == 0) micros.emplace_back(m, static_cast<int>(per_rank_samples / m));

  const auto faster = [](const Arrangement* best, const Arrangement& a) {
    return !best || a.step_s() < best->step_s() ||
           (a.step_s() == best->step_s() && a.plan_bytes < best->plan_bytes);
  };
  // Each micro-batch's arrangements, kept whole (reserved: pointers into them stay valid).
  std::vector<std::vector<Arrangement>> at_micro;
  at_micro.reserve(micros.size());
  at_micro.push_back(arrangements_at(micros.front().first, micros.front().second));
  const Arrangement* smallest = &at_micro.front().front();
  for (const auto& a : at_micro.front()) {
    if (a.optimizer == t.engine.optimizer_placement && a.gradients == t.engine.gradient_placement &&
        a.recompute_layers == t.model->recompute_layers() && a.keep_norms == t.model->keeps_norms())
      choice.configured = a;
    if (a.plan_bytes < smallest->plan_bytes) smallest = &a;
  }
  // The fastest by estimate that fits, the smaller plan among equals; and the same among those
  // of each placement. A smaller micro-batch only when none at a larger one fits; when the
  // config fixes the micro-batch, the largest smaller one that fits is only named.
  const Arrangement* best = nullptr;
  const Arrangement* best_of[2] = {nullptr, nullptr};  // by Placement
  std::optional<Arrangement> fits_smaller;
  std::optional<Arrangement> host_smallest;  // within the device budget, not the host's memory
  for (std::size_t i = 0; i < micros.size() && !best && !fits_smaller; ++i) {
    if (i > 0) at_micro.push_back(arrangements_at(micros[i].first, micros[i].second));
    const bool searched = i == 0 || choice.micro_free;
    for (const auto& a : at_micro.back()) {
      if (a.plan_bytes > budget->per_rank()) continue;
      if (budget->host_memory > 0 && a.machine_bytes > budget->host_memory) {
        if (searched) ++choice.host_excluded;
        if (searched && (!host_smallest || a.machine_bytes < host_smallest->machine_bytes))
          host_smallest = a;
        continue;
      }
      if (i > 0 && !choice.micro_free) {
        if (!fits_smaller || faster(&*fits_smaller, a)) fits_smaller = a;
        continue;
      }
      ++choice.fitting;
      if (faster(best, a)) best = &a;
      const auto at = a.optimizer == Placement::host ? 1 : 0;
      if (faster(best_of[at], a)) best_of[at] = &a;
    }
    if (searched) choice.arrangements += static_cast<int>(at_micro.back().size());
  }
  if (!best && choice.micro_free)  // the smallest at the smallest micro-batch searched
    for (const auto& a : at_micro.back())
      if (a.plan_bytes < smallest->plan_bytes || smallest->micro != a.micro) smallest = &a;
  if (!best && host_smallest)  // the device budget holds some: the host is what lacks
    c.fail("shardswap.device_memory", budget->memory_text,
           fmt::format("no arrangement fits this host: {} arrangement{} within the device budget "
                       "need{} more host memory than the {} its {} rank{} may take "
                       "(shardswap.host_memory; the machine's memory unless given): the least, "
                       "{}, needs {}: refused before anything is allocated",
                       choice.host_excluded, choice.host_excluded == 1 ? "" : "s",
                       choice.host_excluded == 1 ? "s" : "", gib(budget->host_memory),
                       budget->ranks_on_machine, budget->ranks_on_machine == 1 ? "" : "s",
                       describe(*host_smallest, choice.recomputable, micro),
                       gib(host_smallest->machine_bytes)));
  if (!best) {
    const std::int64_t needed = smallest->plan_bytes * budget->ranks_per_device + budget->reserve;
    c.fail(
        "shardswap.device_memory", budget->memory_text,
        fmt::format("no arrangement fits: the smallest, {}, plans {} bytes ({}) a rank; with "
                    "the {} held outside the plan it needs a budget of at least {} bytes "
                    "({}){}{}: refused before anything is allocated",
                    describe(*smallest, choice.recomputable, micro), smallest->plan_bytes,
                    gib(smallest->plan_bytes), gib(budget->reserve), needed, gib(needed),
                    choice.placement_free && choice.recompute_free
                        ? ""
                        : " (the config fixes zero_optimization.offload_optimizer or "
                          "model.recompute_layers: leaving them out lets the search vary them)",
                    fits_smaller
                        ? fmt::format(
                              "; at train_micro_batch_size_per_gpu = {} with "
                              "gradient_accumulation_steps = {} (the same global batch) {} "
                              "plans {} bytes ({}) and fits: give train_batch_size alone to "
                              "let the search choose the micro-batch",
                              fits_smaller->micro, fits_smaller->accumulation,
                              describe(*fits_smaller, choice.recomputable, 0),
                              fits_smaller->plan_bytes, gib(fits_smaller->plan_bytes))
                        : std::string()));
  }
  choice.chosen = *best;
  if (const Arrangement* other = best_of[best->optimizer == Placement::host ? 0 : 1])
    choice.other_placement = *other;
  t.engine.optimizer_placement = best->optimizer;
  t.engine.gradient_placement = best->gradients;
  t.batches.micro_samples = best->micro;
  t.batches.gradient_accumulation_steps = best->accumulation;
  t.engine.gradient_accumulation_steps = best->accumulation;
  t.model = arranged_model(t, best->recompute_layers, best->keep_norms);
  return choice;
}

MemorySpace& cap_to_budget(MemorySpace& space, const std::optional<BudgetChoice>& budget) {
  if (budget) {
    const DeviceBudget& b = budget->budget;
    space.set_limit(
        b.per_rank(),
        fmt::format(
            "shardswap.device_memory {} less {} outside the plan{}", b.memory_text, gib(b.reserve),
            b.ranks_per_device > 1 ? fmt::format(", shared by {} ranks", b.ranks_per_device) : ""));
  }
  return space;
}

}  // namespace shardswap
