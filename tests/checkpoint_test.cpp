// Checkpoints: exact resume across a save in the middle of a layer-switch schedule (stages 1 and
// 2, bf16, fp16 with dynamic loss scaling, drop / keep_host / keep_device), resharding to other
// world sizes, bad checkpoints refused with the file named and the engine unchanged, and the
// safetensors export read back by a reader written here.
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include <sys/stat.h>

#include "optimizer/optimizer.h"
#include "engine/engine_internals.h"
#include "shardswap/checkpoint.h"
#include "shardswap/engine.h"
#include "shardswap/error.h"
#include "partition/flat_layout.h"
#include "tests/catch_compat.h"
#include "tests/support/scratch_folder.h"
#include "cli/ckpt.h"

using namespace shardswap;
using test_support::ScratchFolder;
namespace fs = std::filesystem;

namespace {

// Sizes chosen so that, with 64-byte alignment, params straddle shard boundaries at world sizes
// 2, 3 and 4 and the last shards are padded.
struct Decl {
  std::string name;
  std::vector<std::int64_t> shape;
  std::string group;
};
const std::vector<Decl> kModel = {
    {"embed.weight", {29, 7}, "embed"},    {"layers.0.fc1", {7, 23}, "layers.0"},
    {"layers.0.norm", {7}, "layers.0"},    {"layers.1.fc1", {7, 19}, "layers.1"},
    {"layers.1.fc2", {19, 7}, "layers.1"}, {"layers.2.fc1", {7, 31}, "layers.2"},
    {"layers.3.fc1", {13, 11}, "layers.3"}, {"layers.3.norm", {11}, "layers.3"},
    {"head.weight", {7, 29}, "head"},
};
const std::vector<std::string> kAll = {"embed", "layers.0", "layers.1", "layers.2", "layers.3",
                                       "head"};

// Switches on both sides of the save point (after step 5): groups leave at 3 (kept or dropped
// over the save), one comes back at 6, all at 9.
std::vector<std::string> active_at(int step) {
  if (step < 3) return {"embed", "layers.0", "layers.1", "head"};
  if (step < 6) return {"layers.2", "head"};
  if (step < 9) return {"layers.0", "layers.3", "head"};
  return kAll;
}

constexpr int kSteps = 12;
constexpr int kSavedAt = 5;   // steps done before the save
constexpr int kSamples = 12;  // per step over all ranks: world 1, 2, 3, 4 split it evenly

struct Setup {
  int stage = 2;
  DType dtype = DType::bf16;
  std::optional<DType> grad_dtype;
  DeactivatePolicy policy = DeactivatePolicy::keep_host;
  double clip = 0.5;  // triggers: the norm and its reduction are part of what must resume
  /// Lighter state: bf16 m and v, and the master as the bf16 weight and its low half.
  bool light_state = false;
  Placement placement = Placement::device;
};

EngineConfig config_of(const Setup& s, int world) {
  EngineConfig cfg;
  cfg.stage = s.stage;
  cfg.dtype = s.dtype;
  cfg.grad_dtype = s.grad_dtype;
  cfg.alignment_bytes = 64;
  cfg.reduce_bucket_bytes = 1024;  // smaller than most groups: buckets cycle
  cfg.gradient_accumulation_steps = kSamples / world;
  cfg.gradient_clipping = s.clip;
  cfg.optimizer.type = OptimizerType::adamw;
  cfg.optimizer.lr = 0.01;
  cfg.optimizer.weight_decay = 0.1;
  // fp16: a scale that overflows at first and after every growth, so steps are skipped and the
  // scale both halves and doubles on both sides of the save.
  cfg.loss_scale.dynamic = true;
  cfg.loss_scale.initial_scale = 8192.0;
  cfg.loss_scale.window = 3;
  cfg.loss_scale.hysteresis = 2;
  if (s.light_state) {
    cfg.optimizer.state_dtype = DType::bf16;
    cfg.optimizer.master = MasterStorage::bf16_remainder;
  }
  cfg.optimizer_placement = s.placement;
  cfg.offload_chunk_elements = 97;
  return cfg;
}

std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// A gradient with 7 significant bits and magnitude in [2^-4, 2): sums of 12 are exact in fp32.
float grad_value(int sample, int step, std::size_t param, std::size_t i) {
  const auto h = mix((std::uint64_t(sample) << 52) ^ (std::uint64_t(step) << 40) ^
                     (std::uint64_t(param) << 32) ^ i);
  const float m = 1.0f + static_cast<float>(h & 127u) / 128.0f;
  const int e = -static_cast<int>((h >> 20) % 5);
  return ((h >> 40) & 1 ? -1.0f : 1.0f) * std::ldexp(m, e);
}

void declare(Engine& e) {
  for (const auto& d : kModel) e.add_param(d.name, d.shape, d.group);
}

void build(Engine& e, std::uint64_t seed) {
  declare(e);
  e.build(
      [seed](const ParamInfo& p, std::span<float> v) {
        for (std::size_t i = 0; i < v.size(); ++i)
          v[i] = static_cast<float>(static_cast<double>(mix(seed ^ (p.numel << 20) ^ i) % 2001) /
                                        1000.0 -
                                    1.0);
      },
      active_at(0));
}

// Steps [from, to) of the schedule; rank r of `world` takes samples r*A .. r*A + A - 1.
std::vector<StepResult> train(Engine& e, const Setup& s, int from, int to) {
  const int world = e.world_size(), per_rank = kSamples / world;
  std::vector<StepResult> results;
  for (int t = from; t < to; ++t) {
    if (active_at(t) != e.active_groups()) e.set_active(active_at(t), s.policy);
    for (int m = 0; m < per_rank; ++m) {
      const int sample = e.rank() * per_rank + m;
      for (std::size_t p = kModel.size(); p-- > 0;) {
        if (!e.is_active(kModel[p].group)) continue;
        View slot = e.grad_slot(kModel[p].name);
        std::vector<float> g(slot.count());
        for (std::size_t i = 0; i < g.size(); ++i)
          g[i] = grad_value(sample, t, p, i) * static_cast<float>(e.loss_scale());
        cpu_device_ops().accumulate(slot.raw(), slot.dtype(), g.data(), DType::f32, g.size());
        e.grad_ready(kModel[p].name);
      }
      e.finish_backward();
    }
    results.push_back(e.step());
  }
  return results;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  // An empty vector's data() may be null, which memcmp must not be given even for 0 bytes.
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * 4) == 0);
}

// Throws (naming what differs) unless the two states are equal bit for bit.
void require_same_state(const TrainingState& a, const TrainingState& b, const std::string& what) {
  const auto fail = [&](const std::string& why) {
    throw std::runtime_error(fmt::format("{}: {}", what, why));
  };
  if (a.groups.size() != b.groups.size()) fail("group count");
  for (std::size_t i = 0; i < a.groups.size(); ++i) {
    const auto &x = a.groups[i], &y = b.groups[i];
    if (x.active != y.active || x.kept != y.kept || x.step != y.step)
      fail(fmt::format("group {}: activity or step ({} vs {})", x.group, x.step, y.step));
    if (!same_bits(x.master, y.master)) fail(fmt::format("group {}: master", x.group));
    if (!same_bits(x.state, y.state)) fail(fmt::format("group {}: optimizer state", x.group));
  }
  if (a.weights != b.weights) fail("bit16 weights");
  if (a.scaler.scale != b.scaler.scale || a.scaler.clean_steps != b.scaler.clean_steps ||
      a.scaler.hysteresis_left != b.scaler.hysteresis_left)
    fail("loss scaler");
  if (a.lr != b.lr) fail("lr");
}

void require_same_results(const StepResult& a, const StepResult& b, int step) {
  if (a.applied != b.applied || std::memcmp(&a.grad_norm, &b.grad_norm, 8) != 0 ||
      a.clip_coef != b.clip_coef || a.loss_scale != b.loss_scale)
    throw std::runtime_error(fmt::format("step {}: step results differ (norm {} vs {})", step,
                                         a.grad_norm, b.grad_norm));
}

void require_stats_equal_plan(const Engine& e) {
  const auto stats = e.memory_stats();
  const auto plan = e.plan();
  for (Tag t : kAllTags)
    if (stats.tag(t).requested.current != plan.of(t))
      throw std::runtime_error(fmt::format("rank {}: {} holds {} bytes, the plan says {}",
                                           e.rank(), tag_name(t),
                                           stats.tag(t).requested.current, plan.of(t)));
}

// The folder a test saves into, removed when the test leaves it, passing or failing.
ScratchFolder scratch(const std::string& name) {
  return ScratchFolder("shardswap-ckpt-test-" + name);
}

struct RunOutput {
  std::vector<TrainingState> states;          // per rank, after the last step
  std::vector<std::vector<StepResult>> steps;  // per rank
};

// Steps [0, to) straight.
RunOutput run_straight(const Setup& s, int world, int to) {
  RunOutput out;
  out.states.resize(world);
  out.steps.resize(world);
  run_ranks(world, [&](int rank, Communicator& comm) {
    MemorySpace space(rank, make_host_allocator());
    Engine e(config_of(s, world), comm, space);
    build(e, 1);
    out.steps[rank] = train(e, s, 0, to);
    out.states[rank] = e.training_state(true);
  });
  return out;
}

// Steps [0, kSavedAt) at `world`, saved into `dir`.
void run_and_save(const Setup& s, int world, const fs::path& dir) {
  run_ranks(world, [&](int rank, Communicator& comm) {
    MemorySpace space(rank, make_host_allocator());
    Engine e(config_of(s, world), comm, space);
    build(e, 1);
    train(e, s, 0, kSavedAt);
    SaveOptions options;
    options.extra = {{"step", kSavedAt}};
    save_checkpoint(e, dir, options);
  });
}

// A new engine (new group, memory and init) at `world`, loaded from `dir`, then steps
// [kSavedAt, to).
RunOutput load_and_continue(const Setup& s, int world, const fs::path& dir, int to) {
  RunOutput out;
  out.states.resize(world);
  out.steps.resize(world);
  run_ranks(world, [&](int rank, Communicator& comm) {
    MemorySpace space(rank, make_host_allocator());
    Engine e(config_of(s, world), comm, space);
    build(e, 99);  // other weights: the checkpoint must replace them all
    const LoadedCheckpoint loaded = load_checkpoint(e, dir);
    RANK_REQUIRE(loaded.extra.at("step") == kSavedAt);
    RANK_REQUIRE(e.active_groups() == active_at(kSavedAt - 1));
    require_stats_equal_plan(e);
    out.steps[rank] = train(e, s, static_cast<int>(loaded.extra.at("step")), to);
    out.states[rank] = e.training_state(true);
  });
  return out;
}

std::string setup_name(const Setup& s) {
  return fmt::format("stage{}-{}-{}{}{}", s.stage, dtype_name(s.dtype),
                     deactivate_policy_name(s.policy), s.light_state ? "-light" : "",
                     s.placement == Placement::host ? "-host" : "");
}

void check_exact_resume(const Setup& s, int world) {
  const ScratchFolder folder = scratch(setup_name(s));
  const auto dir = folder / "ckpt";
  const RunOutput straight = run_straight(s, world, kSteps);
  run_and_save(s, world, dir);
  const RunOutput resumed = load_and_continue(s, world, dir, kSteps);
  for (int r = 0; r < world; ++r) {
    require_same_state(straight.states[r], resumed.states[r], fmt::format("rank {}", r));
    for (int t = kSavedAt; t < kSteps; ++t)
      require_same_results(straight.steps[r][t], resumed.steps[r][t - kSavedAt], t);
  }
  // The run really trained: the weights moved from their init, and the fp16 runs skipped steps
  // and changed their scale on both sides of the save.
  const RunOutput start = run_straight(s, world, 0);
  CHECK(start.states[0].weights != straight.states[0].weights);
  if (s.dtype == DType::f16) {
    const auto& st = straight.steps[0];
    const auto skipped = [&](int a, int b) {
      return std::count_if(st.begin() + a, st.begin() + b, [](auto& r) { return !r.applied; });
    };
    const auto changed = [&](int a, int b) {
      for (int t = a + 1; t < b; ++t)
        if (st[t].loss_scale != st[t - 1].loss_scale) return true;
      return false;
    };
    CHECK(skipped(0, kSavedAt) > 0);
    CHECK(skipped(kSavedAt, kSteps) > 0);
    CHECK(changed(0, kSavedAt));
    CHECK(changed(kSavedAt, kSteps));
  }
}

}  // namespace

TEST_CASE("a run resumed from a checkpoint equals the straight run bit for bit, bf16") {
  for (int stage : {1, 2})
    for (auto policy :
         {DeactivatePolicy::drop, DeactivatePolicy::keep_host, DeactivatePolicy::keep_device}) {
      Setup s;
      s.stage = stage;
      s.policy = policy;
      INFO(setup_name(s));
      check_exact_resume(s, 2);
    }
}

TEST_CASE("a run resumed from a checkpoint equals the straight run bit for bit, fp16 with "
          "dynamic loss scaling") {
  for (int stage : {1, 2})
    for (auto policy :
         {DeactivatePolicy::drop, DeactivatePolicy::keep_host, DeactivatePolicy::keep_device}) {
      Setup s;
      s.stage = stage;
      s.dtype = DType::f16;
      s.policy = policy;
      INFO(setup_name(s));
      check_exact_resume(s, 2);
    }
}

TEST_CASE("a run resumed from a checkpoint equals the straight run bit for bit, with bf16 m and v "
          "and the master as low halves, on the device and on the host") {
  for (Placement placement : {Placement::device, Placement::host})
    for (auto policy : {DeactivatePolicy::drop, DeactivatePolicy::keep_host}) {
      Setup s;
      s.light_state = true;
      s.placement = placement;
      s.policy = policy;
      INFO(setup_name(s));
      check_exact_resume(s, 2);
    }
}

TEST_CASE("a resumed run equals the straight run at world sizes 1 and 3 too") {
  Setup s;
  s.policy = DeactivatePolicy::keep_device;
  check_exact_resume(s, 1);
  s.stage = 1;
  check_exact_resume(s, 3);
}

namespace {

// Every param's full fp32 master and optimizer slots, reassembled from the ranks' shards.
struct FullState {
  std::map<std::string, std::vector<float>> master, m, v;
  std::map<std::string, std::vector<float>> weights;  // bit16 widened
  std::map<std::string, std::int64_t> step;
};

FullState assemble(const RunOutput& run, const Setup& s, int world) {
  FullState full;
  for (int r = 0; r < world; ++r) {
    const auto& st = run.states[r];
    for (std::size_t gi = 0; gi < st.groups.size(); ++gi) {
      const auto& g = st.groups[gi];
      full.step[g.group] = g.step;
      if (g.master.empty()) continue;
      std::vector<std::int64_t> numels;
      std::vector<const Decl*> members;
      for (const auto& d : kModel)
        if (d.group == g.group) {
          members.push_back(&d);
          std::int64_t n = 1;
          for (auto x : d.shape) n *= x;
          numels.push_back(n);
        }
      LayoutOptions o;
      o.alignment_bytes = 64;
      o.world_size = world;
      const auto layout = FlatLayout::build(numels, o);
      const auto shard = Shard::of(layout, r);
      for (const auto& f : shard.fragments) {
        const auto& name = members[f.param]->name;
        for (auto* map : {&full.master, &full.m, &full.v})
          (*map)[name].resize(static_cast<std::size_t>(numels[f.param]));
        for (std::int64_t k = 0; k < f.count; ++k) {
          full.master[name][f.param_offset + k] = g.master[f.shard_offset + k];
          full.m[name][f.param_offset + k] = g.state[f.shard_offset + k];
          full.v[name][f.param_offset + k] = g.state[shard.numel() + f.shard_offset + k];
        }
      }
    }
    for (std::size_t p = 0; p < kModel.size(); ++p) {
      std::vector<float> w(st.weights[p].size() / 2);
      cpu_device_ops().cast(w.data(), DType::f32, st.weights[p].data(), s.dtype, w.size());
      full.weights[kModel[p].name] = w;
    }
  }
  return full;
}

// Largest |a - b| / max(|a|, 1e-3) over every element of every param.
double max_difference(const std::map<std::string, std::vector<float>>& a,
                      const std::map<std::string, std::vector<float>>& b, bool& bitwise) {
  double worst = 0.0;
  REQUIRE(a.size() == b.size());
  for (const auto& [name, x] : a) {
    const auto& y = b.at(name);
    REQUIRE(x.size() == y.size());
    bitwise = bitwise && same_bits(x, y);
    for (std::size_t i = 0; i < x.size(); ++i)
      worst = std::max(worst, std::abs(static_cast<double>(x[i]) - y[i]) /
                                  std::max(std::abs(static_cast<double>(x[i])), 1e-3));
  }
  return worst;
}

}  // namespace

TEST_CASE("a checkpoint saved at world size 4 continues at world sizes 1, 2 and 3 like at 4") {
  // fp32 gradients of values whose sums are exact: the ranks' different splits of the samples
  // and of the shards change only the order of the grad-norm partial sums (float64), so the
  // continuations may differ from the reference in the last bits of the clip coefficient.
  Setup s;
  s.grad_dtype = DType::f32;
  s.policy = DeactivatePolicy::keep_host;
  const ScratchFolder folder = scratch("reshard");
  const auto& root = folder.path();
  run_and_save(s, 4, root / "w4");
  const RunOutput reference = load_and_continue(s, 4, root / "w4", kSteps);
  const FullState ref = assemble(reference, s, 4);
  for (int world : {1, 2, 3}) {
    Setup here = s;
    here.stage = world == 3 ? 1 : 2;  // the stage may change as well
    const RunOutput run = load_and_continue(here, world, root / "w4", kSteps);
    const FullState got = assemble(run, here, world);
    bool bitwise = true;
    const double master = max_difference(ref.master, got.master, bitwise);
    const double m = max_difference(ref.m, got.m, bitwise);
    const double v = max_difference(ref.v, got.v, bitwise);
    const double w = max_difference(ref.weights, got.weights, bitwise);
    std::cout << fmt::format(
        "reshard 4 -> {}: max normalized difference master {:.3g}, exp_avg {:.3g}, "
        "exp_avg_sq {:.3g}, bit16 weights {:.3g}; bitwise equal: {}\n",
        world, master, m, v, w, bitwise ? "yes" : "no");
    CHECK(master <= 1e-6);
    CHECK(m <= 1e-5);
    CHECK(v <= 1e-5);
    CHECK(w <= 1.0 / 128);  // at most one bf16 rounding step apart
    CHECK(got.step == ref.step);
    CHECK(run.steps[0].size() == reference.steps[0].size());
    for (std::size_t t = 0; t < run.steps[0].size(); ++t)
      CHECK(run.steps[0][t].grad_norm == Approx(reference.steps[0][t].grad_norm).epsilon(1e-12));
  }
}

// ---- bad checkpoints ----

namespace {

struct Damaged {
  const ScratchFolder folder = scratch("damaged");
  const fs::path root = folder.path();
  const fs::path good = root / "good";  // a valid checkpoint at world size 2
  Damaged() { run_and_save(Setup{}, 2, good); }
  fs::path copy(const std::string& name) const {
    const fs::path to = root / name;
    fs::remove_all(to);
    fs::copy(good, to, fs::copy_options::recursive);
    return to;
  }
};

void flip_byte(const fs::path& file, std::size_t at) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(at));
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x10);
  f.seekp(static_cast<std::streamoff>(at));
  f.write(&c, 1);
}

// Loads `dir` into a trained world-2 engine whose state differs from the checkpoint's; returns
// the error message after checking that the engine (state and memory) is unchanged.
std::string load_error(const fs::path& dir, const Setup& s = Setup{}) {
  std::vector<std::string> messages(2);
  run_ranks(2, [&](int rank, Communicator& comm) {
    MemorySpace space(rank, make_host_allocator());
    Engine e(config_of(s, 2), comm, space);
    build(e, 7);
    train(e, s, 0, 7);  // another active set and state than the checkpoint's
    const TrainingState before = e.training_state(true);
    const auto bytes = e.memory_stats().requested.current;
    messages[rank] = test::rank_message_of<Error>([&] { load_checkpoint(e, dir); });
    require_same_state(before, e.training_state(true), "engine after a refused load");
    RANK_REQUIRE(e.memory_stats().requested.current == bytes);
    train(e, s, 7, 8);  // and it still trains
  });
  return messages[0];
}

}  // namespace

TEST_CASE("a truncated rank file is refused, naming the file, the engine unchanged") {
  Damaged d;
  const auto dir = d.copy("truncated");
  const auto file = dir / "rank-00001-of-00002.bin";
  fs::resize_file(file, fs::file_size(file) - 100);
  const auto msg = load_error(dir);
  CHECK(test::contains(msg, file.string()));
  CHECK(test::contains(msg, "truncated"));
}

TEST_CASE("a flipped byte in any file is refused by its checksum, naming the file") {
  Damaged d;
  for (const std::string name : {"rank-00000-of-00002.bin", "weights.bin", "metadata.json"}) {
    const auto dir = d.copy("flipped-" + name);
    const auto file = dir / name;
    flip_byte(file, fs::file_size(file) - 40);  // inside the data (metadata: its text)
    const auto msg = load_error(dir);
    INFO(msg);
    CHECK(test::contains(msg, file.string()));
    CHECK(test::contains(msg, "checksum mismatch"));
  }
}

TEST_CASE("a checkpoint of another model is refused, naming the metadata file") {
  Damaged d;
  std::vector<std::string> messages(2);
  run_ranks(2, [&](int rank, Communicator& comm) {
    MemorySpace space(rank, make_host_allocator());
    Engine e(config_of(Setup{}, 2), comm, space);
    for (const auto& decl : kModel)
      e.add_param(decl.name, decl.name == "head.weight" ? std::vector<std::int64_t>{7, 30}
                                                        : decl.shape,
                  decl.group);
    e.build([](const ParamInfo&, std::span<float> v) { std::fill(v.begin(), v.end(), 0.5f); });
    const TrainingState before = e.training_state(true);
    messages[rank] = test::rank_message_of<ConfigError>([&] { load_checkpoint(e, d.good); });
    require_same_state(before, e.training_state(true), "engine after a refused load");
  });
  INFO(messages[0]);
  CHECK(test::contains(messages[0], (d.good / "metadata.json").string()));
  CHECK(test::contains(messages[0], "different model"));
  CHECK(test::contains(messages[0], "head.weight 7x29"));
  // Another optimizer too.
  Setup sgd;
  std::vector<std::string> sgd_messages(1);
  run_ranks(1, [&](int rank, Communicator& comm) {
    MemorySpace space(rank, make_host_allocator());
    EngineConfig cfg = config_of(sgd, 1);
    cfg.optimizer.type = OptimizerType::sgd;
    cfg.optimizer.momentum = 0.9;
    Engine e(cfg, comm, space);
    build(e, 3);
    sgd_messages[0] = test::rank_message_of<ConfigError>([&] { load_checkpoint(e, d.good); });
  });
  CHECK(test::contains(sgd_messages[0], "optimizer 'AdamW' saved, 'SGD' here"));
}

TEST_CASE("a checkpoint with a rank file missing is refused, naming the file") {
  Damaged d;
  const auto dir = d.copy("missing");
  fs::remove(dir / "rank-00001-of-00002.bin");
  const auto msg = load_error(dir);
  CHECK(test::contains(msg, (dir / "rank-00001-of-00002.bin").string()));
  CHECK(test::contains(msg, "missing"));
}

TEST_CASE("a directory that is not a checkpoint is refused, naming it") {
  Damaged d;
  const auto empty = d.root / "empty";
  fs::create_directories(empty);
  CHECK(test::contains(load_error(empty), "not a ShardSwap checkpoint"));
  const auto other = d.root / "other";
  fs::create_directories(other);
  std::ofstream(other / "metadata.json") << "{\"hello\": 1}\n";
  const auto msg = load_error(other);
  CHECK(test::contains(msg, (other / "metadata.json").string()));
  CHECK(test::contains(msg, "not a ShardSwap checkpoint"));
  CHECK(test::contains(load_error(d.root / "nonexistent"), "is not a directory"));
}

namespace {

// A file that reports a full disk once the whole save has written `budget` bytes.
struct DiskFull {
  std::mutex mu;
  std::int64_t budget = 0;
};

class FullDiskFile : public CheckpointFile {
 public:
  FullDiskFile(const fs::path& path, DiskFull& disk)
      : real_(open_checkpoint_file(path)), disk_(disk) {}
  void write(const void* data, std::size_t bytes) override {
    {
      std::lock_guard lock(disk_.mu);
      disk_.budget -= static_cast<std::int64_t>(bytes);
      if (disk_.budget < 0) throw Error("No space left on device (simulated)");
    }
    real_->write(data, bytes);
  }
  void commit() override { real_->commit(); }

 private:
  std::unique_ptr<CheckpointFile> real_;
  DiskFull& disk_;
};

}  // namespace

TEST_CASE("a save that fills the disk fails naming the file and leaves the previous one intact") {
  const ScratchFolder folder = scratch("diskfull");
  const auto& root = folder.path();
  const auto previous = root / checkpoint_name(5);
  run_and_save(Setup{}, 2, previous);
  const auto size_of = [](const fs::path& dir) {
    std::uintmax_t sum = 0;
    for (const auto& f : fs::directory_iterator(dir)) sum += f.file_size();
    return sum;
  };
  const auto total = size_of(previous);
  for (std::int64_t budget : {std::int64_t{0}, std::int64_t{3000},
                              static_cast<std::int64_t>(total) - 100}) {
    DiskFull disk;
    disk.budget = budget;
    std::vector<std::string> messages(2);
    for (const auto& target : {root / checkpoint_name(9), previous}) {  // new, and replacing
      run_ranks(2, [&](int rank, Communicator& comm) {
        MemorySpace space(rank, make_host_allocator());
        Engine e(config_of(Setup{}, 2), comm, space);
        build(e, 1);
        train(e, Setup{}, 0, 9);
        SaveOptions options;
        options.open = [&](const fs::path& p) { return std::make_unique<FullDiskFile>(p, disk); };
        messages[rank] =
            test::rank_message_of<Error>([&] { save_checkpoint(e, target, options); });
      });
      INFO(messages[0] + " | " + messages[1]);
      // The rank that hit the full disk names its file; so at least one of the two does.
      const bool named = test::contains(messages[0], root.string() + "/step-") ||
                         test::contains(messages[1], root.string() + "/step-");
      CHECK(named);
      CHECK((test::contains(messages[0], "No space left") ||
             test::contains(messages[1], "No space left")));
      CHECK(!fs::exists(root / checkpoint_name(9)));
      for (const auto& entry : fs::directory_iterator(root))
        CHECK(entry.path().filename().string().find(".tmp-") == std::string::npos);
      // The previous checkpoint still loads and is the same bytes.
      CHECK(size_of(previous) == total);
      read_checkpoint_tensors(previous, true);  // verifies every checksum
      disk.budget = budget;
    }
  }
}

TEST_CASE("saving over an existing checkpoint and pruning keep the newest complete ones") {
  const ScratchFolder folder = scratch("prune");
  const auto& root = folder.path();
  for (int step : {2, 4, 6, 8}) run_and_save(Setup{}, 2, root / checkpoint_name(step));
  run_and_save(Setup{}, 2, root / checkpoint_name(8));  // replaced in place
  fs::create_directories(root / (checkpoint_name(10) + ".tmp-save"));  // an interrupted save
  prune_checkpoints(root, 2, "");
  const auto left = list_checkpoints(root);
  REQUIRE(left.size() == 2);
  CHECK(left[0].filename() == checkpoint_name(6));
  CHECK(left[1].filename() == checkpoint_name(8));
  CHECK(!fs::exists(root / (checkpoint_name(10) + ".tmp-save")));
  CHECK(read_checkpoint_metadata(left[1]).at("extra").at("step") == kSavedAt);
}

// ---- safetensors ----

namespace {

// An independent reader of the safetensors layout: 8-byte little-endian header length, a JSON
// header {name: {dtype, shape, data_offsets}}, then the data.
struct Tensor {
  std::string dtype;
  std::vector<std::int64_t> shape;
  std::vector<double> values;
};

double half_to_double(std::uint16_t h, bool bf16) {
  if (bf16) {
    const std::uint32_t bits = std::uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
  const int sign = h >> 15, exp = (h >> 10) & 31, frac = h & 1023;
  double v = exp == 0 ? std::ldexp(frac, -24) : std::ldexp(1024 + frac, exp - 25);
  return sign ? -v : v;  // no Inf/NaN in these weights
}

std::map<std::string, Tensor> read_safetensors(const fs::path& path, nlohmann::json& metadata) {
  std::ifstream in(path, std::ios::binary);
  std::vector<unsigned char> bytes((std::istreambuf_iterator<char>(in)), {});
  REQUIRE(bytes.size() >= 8);
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[i];
  REQUIRE((8 + n) % 8 == 0);  // the header is padded so the data starts 8-aligned
  const auto header = nlohmann::json::parse(bytes.begin() + 8, bytes.begin() + 8 + n);
  const std::size_t data = 8 + n;
  std::map<std::string, Tensor> out;
  std::int64_t expected_begin = 0;
  std::vector<std::pair<std::int64_t, std::int64_t>> ranges;
  for (const auto& [name, t] : header.items()) {
    if (name == "__metadata__") {
      metadata = t;
      continue;
    }
    Tensor x;
    x.dtype = t.at("dtype");
    x.shape = t.at("shape").get<std::vector<std::int64_t>>();
    const auto begin = t.at("data_offsets")[0].get<std::int64_t>();
    const auto end = t.at("data_offsets")[1].get<std::int64_t>();
    ranges.emplace_back(begin, end);
    std::int64_t count = 1;
    for (auto e : x.shape) count *= e;
    const int width = x.dtype == "F32" ? 4 : 2;
    REQUIRE(end - begin == count * width);
    REQUIRE(data + static_cast<std::size_t>(end) <= bytes.size());
    for (std::int64_t i = 0; i < count; ++i) {
      const unsigned char* p = bytes.data() + data + begin + i * width;
      if (width == 4) {
        std::uint32_t u = p[0] | p[1] << 8 | p[2] << 16 | std::uint32_t(p[3]) << 24;
        float f;
        std::memcpy(&f, &u, 4);
        x.values.push_back(f);
      } else {
        x.values.push_back(half_to_double(std::uint16_t(p[0] | p[1] << 8), x.dtype == "BF16"));
      }
    }
    out[name] = std::move(x);
  }
  // The data is covered without gaps or overlaps, to the end of the file.
  std::sort(ranges.begin(), ranges.end());
  for (const auto& [b, e] : ranges) {
    REQUIRE(b == expected_begin);
    expected_begin = e;
  }
  REQUIRE(data + static_cast<std::size_t>(expected_begin) == bytes.size());
  return out;
}

}  // namespace

TEST_CASE("the safetensors export holds the checkpoint's weights and masters, as declared") {
  for (DType dtype : {DType::bf16, DType::f16}) {
    Setup s;
    s.dtype = dtype;
    const ScratchFolder folder = scratch("safetensors");
    const auto& root = folder.path();
    run_and_save(s, 2, root / "ckpt");
    // The reference: the weights and masters of the same engine, read through the Engine API.
    std::map<std::string, std::vector<float>> weights, masters;
    run_ranks(2, [&](int rank, Communicator& comm) {
      MemorySpace space(rank, make_host_allocator());
      Engine e(config_of(s, 2), comm, space);
      build(e, 5);
      load_checkpoint(e, root / "ckpt");
      if (rank != 0) return;
      for (const auto& d : kModel) weights[d.name] = e.read_weight(d.name);
    });
    // Masters of groups with state, from a world-1 engine that holds all of them.
    run_ranks(1, [&](int rank, Communicator& comm) {
      MemorySpace space(rank, make_host_allocator());
      Engine e(config_of(s, 1), comm, space);
      build(e, 5);
      load_checkpoint(e, root / "ckpt");
      for (const auto& d : kModel) {
        std::vector<float> m = e.read_weight(d.name);  // a group without state: its weights
        for (const auto& piece : e.master_pieces(d.name))
          std::copy(piece.values.begin(), piece.values.end(), m.begin() + piece.param_offset);
        if (!e.is_active(d.group)) {
          const auto st = e.training_state(false);
          for (std::size_t gi = 0; gi < st.groups.size(); ++gi)
            if (st.groups[gi].group == d.group && !st.groups[gi].master.empty()) {
              // kept: its master lies in the group's flat shard (world 1: the whole layout)
              const auto& layout = EngineInternals::layout(e, d.group);
              std::size_t index = 0;
              for (const auto& p : e.params())
                if (p.group == d.group) {
                  if (p.name == d.name) break;
                  ++index;
                }
              const auto off = layout.entry_of(index).offset;
              std::copy(st.groups[gi].master.begin() + off,
                        st.groups[gi].master.begin() + off + static_cast<std::int64_t>(m.size()),
                        m.begin());
            }
        }
        masters[d.name] = m;
      }
    });
    for (bool master : {false, true}) {
      const auto file = root / (master ? "master.safetensors" : "model.safetensors");
      std::ostringstream log;
      std::vector<std::string> args = {"export", (root / "ckpt").string(), "--out", file.string()};
      if (master) args.push_back("--master");
      REQUIRE(ckpt_command(args, log) == 0);
      nlohmann::json meta;
      const auto tensors = read_safetensors(file, meta);
      REQUIRE(tensors.size() == kModel.size());
      CHECK(meta.at("format") == "pt");
      for (const auto& d : kModel) {
        const auto& t = tensors.at(d.name);
        CHECK(t.shape == d.shape);
        CHECK(t.dtype == (master ? "F32" : dtype == DType::bf16 ? "BF16" : "F16"));
        const auto& want = master ? masters.at(d.name) : weights.at(d.name);
        REQUIRE(t.values.size() == want.size());
        for (std::size_t i = 0; i < want.size(); ++i)
          if (t.values[i] != static_cast<double>(want[i])) {
            FAIL(fmt::format("{}[{}]: {} in the file, {} in the engine", d.name, i, t.values[i],
                             want[i]));
          }
      }
    }
    std::ostringstream summary;
    REQUIRE(ckpt_command({"inspect", (root / "ckpt").string()}, summary) == 0);
    INFO(summary.str());
    CHECK(test::contains(summary.str(), "world size 2"));
    CHECK(test::contains(summary.str(), "layers.2"));
  }
}

// ---- one save, one identity; crash windows; lineage; what a reader may be handed ----

namespace {

// A new world-`world` engine (seed 1) trained for `steps` steps and saved into `dir`; returns
// each rank's state at the save and the directory written.
struct Saved {
  fs::path path;
  std::vector<TrainingState> states;
};

Saved save_after(int world, int steps, const fs::path& dir, const SaveOptions& given = {}) {
  Saved out;
  out.states.resize(world);
  std::mutex mu;
  run_ranks(world, [&](int rank, Communicator& comm) {
    MemorySpace space(rank, make_host_allocator());
    Engine e(config_of(Setup{}, world), comm, space);
    build(e, 1);
    train(e, Setup{}, 0, steps);
    SaveOptions options = given;
    options.extra["step"] = steps;
    const fs::path written = save_checkpoint(e, dir, options);
    out.states[rank] = e.training_state(true);
    std::lock_guard lock(mu);
    out.path = written;
  });
  return out;
}

// Loads `dir` into a new world-`world` engine (other init); each rank's state after the load.
std::vector<TrainingState> load_states(int world, const fs::path& dir,
                                       LoadedCheckpoint* loaded = nullptr) {
  std::vector<TrainingState> states(world);
  run_ranks(world, [&](int rank, Communicator& comm) {
    MemorySpace space(rank, make_host_allocator());
    Engine e(config_of(Setup{}, world), comm, space);
    build(e, 42);
    const LoadedCheckpoint l = load_checkpoint(e, dir);
    if (rank == 0 && loaded) *loaded = l;
    states[rank] = e.training_state(true);
  });
  return states;
}

void require_states(const std::vector<TrainingState>& want, const std::vector<TrainingState>& got,
                    const std::string& what) {
  REQUIRE(want.size() == got.size());
  for (std::size_t r = 0; r < want.size(); ++r)
    require_same_state(want[r], got[r], fmt::format("{}, rank {}", what, r));
}

// The error every reader without an engine gives for `dir`: read_checkpoint_tensors (weights,
// masters) and describe_checkpoint must all refuse it, with the same message.
std::string inspect_error(const fs::path& dir) {
  const auto weights =
      test::rank_message_of<ConfigError>([&] { read_checkpoint_tensors(dir, false); });
  const auto masters =
      test::rank_message_of<ConfigError>([&] { read_checkpoint_tensors(dir, true); });
  const auto described = test::rank_message_of<ConfigError>([&] { describe_checkpoint(dir); });
  CHECK(weights == described);
  CHECK(test::contains(masters, dir.string()));
  return weights;
}

}  // namespace

TEST_CASE(
    "files of another save copied into a checkpoint are refused by load and inspect, "
    "naming the file") {
  const ScratchFolder folder = scratch("mixed");
  const auto& root = folder.path();
  save_after(2, 3, root / checkpoint_name(10));
  save_after(2, 5, root / checkpoint_name(20));
  const auto mixed = [&](const std::string& name, const std::vector<std::string>& files) {
    const fs::path dir = root / name;
    fs::copy(root / checkpoint_name(10), dir, fs::copy_options::recursive);
    for (const auto& f : files)
      fs::copy_file(root / checkpoint_name(20) / f, dir / f, fs::copy_options::overwrite_existing);
    return dir;
  };
  const std::string save20 =
      read_checkpoint_metadata(root / checkpoint_name(20)).at("save_id").get<std::string>();
  const std::string save10 =
      read_checkpoint_metadata(root / checkpoint_name(10)).at("save_id").get<std::string>();
  CHECK(save10 != save20);
  CHECK(save10.size() == 32);
  {
    const auto dir =
        mixed("all-bins", {"weights.bin", "rank-00000-of-00002.bin", "rank-00001-of-00002.bin"});
    for (const auto& msg : {load_error(dir), inspect_error(dir)}) {
      INFO(msg);
      CHECK(test::contains(msg, dir.string() + "/"));
      CHECK(test::contains(msg, "belongs to save " + save20.substr(0, 8)));
      CHECK(test::contains(msg, "this checkpoint's save " + save10.substr(0, 8)));
    }
  }
  for (const std::string file : {"rank-00001-of-00002.bin", "weights.bin"}) {
    const auto dir = mixed("one-" + file, {file});
    for (const auto& msg : {load_error(dir), inspect_error(dir)}) {
      INFO(msg);
      CHECK(test::contains(msg, "'" + (dir / file).string() + "' belongs to save"));
    }
  }
  // The untouched ones still load and inspect.
  read_checkpoint_tensors(root / checkpoint_name(10), true);
  CHECK(test::contains(describe_checkpoint(root / checkpoint_name(20)), save20));
}

TEST_CASE("a checkpoint of the previous format version is refused with a message saying so") {
  Damaged d;
  const auto dir = d.copy("version1");
  const auto path = dir / "metadata.json";
  std::ifstream in(path, std::ios::binary);
  const std::string text((std::istreambuf_iterator<char>(in)), {});
  in.close();
  const std::string middle = "\",\"metadata\":";
  const auto body = text.find(middle) + middle.size();
  auto meta = nlohmann::json::parse(text.substr(body, text.size() - body - 2));
  meta["format_version"] = 1;
  const std::string inner = meta.dump(1);
  std::ofstream(path, std::ios::binary | std::ios::trunc)
      << "{\"format\":\"shardswap-checkpoint\",\"fnv1a64\":\""
      << fmt::format("{:016x}", fnv1a64(inner.data(), inner.size())) << middle << inner << "}\n";
  const auto msg = load_error(dir);
  INFO(msg);
  CHECK(test::contains(msg, path.string()));
  CHECK(test::contains(msg, "format version 1"));
  CHECK(test::contains(inspect_error(dir), "format version 1"));
}

namespace {

// Rewrites the metadata of the checkpoint in `dir` as a forger would: `change` edits the parsed
// metadata, the string "deep" in its text is replaced by `deep` (a value nlohmann could not write
// without recursing), and the checksum is made anew, so only the reader's own checks stand.
void forge_metadata(const fs::path& dir, const std::function<void(nlohmann::json&)>& change,
                    const std::string& deep = "") {
  const auto path = dir / "metadata.json";
  std::ifstream in(path, std::ios::binary);
  const std::string text((std::istreambuf_iterator<char>(in)), {});
  in.close();
  const std::string middle = "\",\"metadata\":";
  const auto body = text.find(middle) + middle.size();
  auto meta = nlohmann::json::parse(text.substr(body, text.size() - body - 2));
  change(meta);
  std::string inner = meta.dump(1);
  if (const auto at = inner.find("\"deep\""); !deep.empty() && at != std::string::npos)
    inner.replace(at, 6, deep);
  std::ofstream(path, std::ios::binary | std::ios::trunc)
      << "{\"format\":\"shardswap-checkpoint\",\"fnv1a64\":\""
      << fmt::format("{:016x}", fnv1a64(inner.data(), inner.size())) << middle << inner << "}\n";
}

double seconds_of(const std::function<void()>& fn) {
  const auto start = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

TEST_CASE(
    "a checkpoint whose extra nests 100,000 levels is refused by load and inspect in under "
    "a second, naming the file, the position and the key path") {
  // Valid checksum, 0.2 MB: it crashed inspect and load (recursion in dump and in
  // decode_byte_strings).
  Damaged d;
  const auto dir = d.copy("deep");
  forge_metadata(
      dir, [](nlohmann::json& m) { m["extra"]["nested"] = "deep"; },
      std::string(100'000, '[') + std::string(100'000, ']'));
  const std::string where = (dir / "metadata.json").string() + ":";
  const std::string what =
      ": metadata.extra.nested[0][0][0] ... [0][0][0]: nested deeper than 1024 levels of objects "
      "and lists, the most a checkpoint's metadata may have";
  std::string inspected;
  const double inspect_seconds = seconds_of(
      [&] { inspected = test::message_of<ConfigError>([&] { describe_checkpoint(dir); }); });
  std::vector<std::string> loaded(2);
  std::vector<double> load_seconds(2);
  run_ranks(2, [&](int rank, Communicator& comm) {
    MemorySpace space(rank, make_host_allocator());
    Engine e(config_of(Setup{}, 2), comm, space);
    build(e, 7);
    load_seconds[rank] = seconds_of([&] {
      loaded[rank] = test::rank_message_of<ConfigError>([&] { load_checkpoint(e, dir); });
    });
  });
  for (const auto& m : {inspected, loaded[0], loaded[1], load_error(dir), inspect_error(dir)}) {
    CAPTURE(m);
    CHECK(test::contains(m, where));
    CHECK(test::contains(m, what));
    CHECK(m.size() < 400);
  }
  CAPTURE(inspect_seconds, load_seconds[0], load_seconds[1]);
  CHECK(inspect_seconds < 1.0);
  CHECK(load_seconds[0] < 1.0);
  CHECK(load_seconds[1] < 1.0);
}

TEST_CASE(
    "a metadata field missing, of the wrong type or out of range is refused by load and "
    "inspect naming the field") {
  Damaged d;
  const auto file = [](const fs::path& dir) {
    return "'" + (dir / "metadata.json").string() + "'";
  };
  const std::vector<std::pair<std::function<void(nlohmann::json&)>, std::string>> cases = {
      {[](auto& m) {
         m["extra"] = {1, 2};
       },
       "field 'extra': expected an object, got [1,2]"},
      {[](auto& m) { m.erase("shardswap_version"); }, "field 'shardswap_version' is missing"},
      {[](auto& m) { m["world_size"] = "2"; },
       "field 'world_size': expected an integer, got \"2\""},
      {[](auto& m) { m["loss_scaler"]["hysteresis_left"] = std::int64_t{1} << 40; },
       "field 'hysteresis_left': expected an integer, got 1099511627776"},
      {[](auto& m) { m["groups"][0]["step"] = 1e300; },
       "field 'step': expected an integer, got 1e+300"},
      {[](auto& m) {
         m["active"] = {"a", 1};
       },
       "field 'active': expected a list of strings, got [\"a\",1]"},
      {[](auto& m) { m["files"] = {1}; }, "field 'files': expected a list of objects, got [1]"},
  };
  for (std::size_t i = 0; i < cases.size(); ++i) {
    const auto dir = d.copy(fmt::format("field-{}", i));
    forge_metadata(dir, cases[i].first);
    for (const auto& m : {load_error(dir), inspect_error(dir)}) {
      CAPTURE(i, m);
      CHECK(test::contains(m, file(dir) + ": " + cases[i].second));
      CHECK(!test::contains(m, "json.exception"));
    }
  }
}

TEST_CASE(
    "save_checkpoint refuses an extra nested deeper than a load reads back, writing "
    "nothing") {
  const ScratchFolder folder = scratch("deep-extra");
  const auto nested = [](std::size_t levels) {
    nlohmann::json extra = nlohmann::json::object();
    nlohmann::json* node = &extra;
    for (std::size_t level = 2; level <= levels; ++level)
      node = &((*node)["a"] = nlohmann::json::object());
    return extra;
  };
  // 1022 levels below the metadata's own two: the deepest that loads.
  SaveOptions ok;
  ok.extra = nested(1022);
  const Saved saved = save_after(2, 2, folder.path() / "ok", ok);
  LoadedCheckpoint loaded;
  load_states(2, saved.path, &loaded);
  CHECK(loaded.extra.at("a") == ok.extra.at("a"));
  for (const std::size_t levels : {1023, 100'000}) {
    SaveOptions options;
    options.extra = nested(levels);
    const auto dir = folder.path() / fmt::format("deep-{}", levels);
    std::vector<std::string> messages(2);
    run_ranks(2, [&](int rank, Communicator& comm) {
      MemorySpace space(rank, make_host_allocator());
      Engine e(config_of(Setup{}, 2), comm, space);
      build(e, 1);
      messages[rank] =
          test::rank_message_of<ConfigError>([&] { save_checkpoint(e, dir, options); });
    });
    CAPTURE(levels, messages[0]);
    CHECK(messages[0] == messages[1]);
    CHECK(test::contains(messages[0],
                         "save_checkpoint: SaveOptions::extra: a.a.a.a.a.a ... "
                         ".a.a.a: nested deeper than 1022 levels"));
    CHECK(!fs::exists(dir));
  }
  // A byte string is stored as {"bytes_hex": ...}, one level deeper than it was given.
  SaveOptions bytes;
  bytes.extra = nested(1022);
  nlohmann::json* node = &bytes.extra;
  while (!(*node)["a"].empty()) node = &(*node)["a"];  // to the object on level 1021
  (*node)["a"]["a"] = std::string("\xff");             // a string in the object on level 1022
  std::vector<std::string> messages(2);
  run_ranks(2, [&](int rank, Communicator& comm) {
    MemorySpace space(rank, make_host_allocator());
    Engine e(config_of(Setup{}, 2), comm, space);
    build(e, 1);
    messages[rank] = test::rank_message_of<ConfigError>(
        [&] { save_checkpoint(e, folder.path() / "bytes", bytes); });
  });
  CAPTURE(messages[0]);
  CHECK(test::contains(messages[0], "(as stored)"));
}

TEST_CASE(
    "a save interrupted at any rename or removal is completed or rolled back, and latest "
    "loads the saved state bit for bit") {
  const ScratchFolder folder = scratch("crash");
  const auto& src = folder.path();
  // Saved side by side, so that their save sequence numbers are 1, 2, 3.
  const Saved earlier = save_after(2, 4, src / checkpoint_name(4));  // an older checkpoint
  const Saved s1 = save_after(2, 6, src / checkpoint_name(6));  // what DIR held before the save
  const Saved s2 = save_after(2, 8, src / checkpoint_name(8));  // what the interrupted save wrote
  const std::map<std::string, fs::path> copies = {{"s1", src / checkpoint_name(6)},
                                                  {"s2", src / checkpoint_name(8)},
                                                  {"partial", src / "partial"},
                                                  {"half-removed", src / "half-removed"}};
  // A save killed while writing: rank files, no metadata yet.
  fs::copy(copies.at("s2"), src / "partial", fs::copy_options::recursive);
  fs::remove(src / "partial" / "metadata.json");
  // A removal killed half way: metadata and weights left, one rank file gone.
  fs::copy(copies.at("s1"), src / "half-removed", fs::copy_options::recursive);
  fs::remove(src / "half-removed" / "rank-00000-of-00002.bin");

  const std::string name = checkpoint_name(8);
  struct Case {
    const char* what;
    const char *dir, *tmp, *old;  // copied from src (nullptr: absent)
    const Saved* expected;        // what latest must load
    std::string expected_name;
  };
  const std::vector<Case> cases = {
      {"first save, killed while writing", nullptr, "partial", nullptr, &earlier,
       checkpoint_name(4)},
      {"first save, killed before its rename", nullptr, "s2", nullptr, &s2, name},
      {"replacing save, killed while writing", "s1", "partial", nullptr, &s1, name},
      {"replacing save, killed before the first rename", "s1", "s2", nullptr, &s1, name},
      {"replacing save, killed after DIR -> DIR.old-save", nullptr, "s2", "s1", &s2, name},
      {"replacing save, killed after DIR.tmp-save -> DIR", "s2", nullptr, "s1", &s2, name},
      {"replacing save, killed while removing DIR.old-save", "s2", nullptr, "half-removed", &s2,
       name},
      {"an old copy beside an incomplete new one", nullptr, "partial", "s1", &s1, name},
  };
  for (const auto& c : cases) {
    INFO(c.what);
    const ScratchFolder root_folder = scratch("crash-root");
    const auto& root = root_folder.path();
    fs::copy(src / checkpoint_name(4), root / checkpoint_name(4), fs::copy_options::recursive);
    const auto place = [&](const char* from, const std::string& to) {
      if (from) fs::copy(copies.at(from), root / to, fs::copy_options::recursive);
    };
    place(c.dir, name);
    place(c.tmp, name + ".tmp-save");
    place(c.old, name + ".old-save");
    const auto actions = recover_checkpoints(root);
    for (const auto& a : actions) UNSCOPED_INFO(a);
    for (const auto& entry : fs::directory_iterator(root))
      CHECK(entry.path().filename().string().find('.') == std::string::npos);
    const auto latest = latest_checkpoint(root);
    REQUIRE(latest.has_value());
    CHECK(latest->path.filename() == c.expected_name);
    LoadedCheckpoint loaded;
    require_states(c.expected->states, load_states(2, latest->path, &loaded), c.what);
    CHECK(recover_checkpoints(root).empty());  // nothing left to do
  }
  // The save after such a crash must not delete the only complete copy, even when it fails.
  {
    const ScratchFolder root_folder = scratch("crash-then-full");
    const auto& root = root_folder.path();
    fs::copy(copies.at("s2"), root / (name + ".tmp-save"), fs::copy_options::recursive);
    fs::copy(copies.at("s1"), root / (name + ".old-save"), fs::copy_options::recursive);
    DiskFull disk;
    disk.budget = 2000;
    SaveOptions options;
    options.open = [&](const fs::path& p) { return std::make_unique<FullDiskFile>(p, disk); };
    CHECK_THROWS_AS(save_after(2, 9, root / name, options), Error);
    const auto latest = latest_checkpoint(root);
    REQUIRE(latest.has_value());
    CHECK(latest->path.filename() == name);
    require_states(s2.states, load_states(2, latest->path), "after the failed save");
  }
}

namespace {

// One run as the trainer makes it, at world size 1: a new engine (loaded from `resume` if
// given, then its lr set to `lr`), saving under `root` every `every` steps up to `to`, pruning
// to `keep` of its own after each save.
struct RunSaves {
  std::map<int, fs::path> paths;
  std::map<int, TrainingState> states;
};

RunSaves run_saving(const fs::path& root, const std::string& run_id, const fs::path& resume, int to,
                    int every, int keep, double lr) {
  RunSaves out;
  run_ranks(1, [&](int rank, Communicator& comm) {
    MemorySpace space(rank, make_host_allocator());
    Engine e(config_of(Setup{}, 1), comm, space);
    build(e, 1);
    int from = 0;
    std::optional<CheckpointParent> parent;
    if (!resume.empty()) {
      const LoadedCheckpoint loaded = load_checkpoint(e, resume);
      from = loaded.extra.at("step").get<int>();
      parent = CheckpointParent{loaded.run_id, from};
    }
    e.set_lr(lr);
    for (int t = from; t < to; t += every) {
      train(e, Setup{}, t, t + every);
      SaveOptions options;
      options.extra = {{"step", t + every}};
      options.run_id = run_id;
      options.parent = parent;
      out.paths[t + every] = save_checkpoint(e, root / checkpoint_name(t + every), options);
      prune_checkpoints(root, keep, run_id);
      out.states[t + every] = e.training_state(true);
    }
  });
  return out;
}

}  // namespace

TEST_CASE(
    "a run resumed from an older step prunes only its own checkpoints, never replaces "
    "another run's, and is latest") {
  const ScratchFolder folder = scratch("lineage");
  const auto& root = folder.path();
  const std::string a = new_random_id(), b = new_random_id();
  REQUIRE(a.size() == 32);
  REQUIRE(a.substr(0, 8) != b.substr(0, 8));
  const RunSaves run_a = run_saving(root, a, {}, 30, 10, 3, 0.01);
  const RunSaves run_b = run_saving(root, b, run_a.paths.at(10), 30, 5, 3, 0.02);
  // A's checkpoints all survive, with A's state.
  for (int step : {10, 20, 30}) {
    INFO(step);
    const auto& path = run_a.paths.at(step);
    CHECK(path.filename() == checkpoint_name(step));
    const auto meta = read_checkpoint_metadata(path);
    CHECK(meta.at("run_id") == a);
    CHECK(meta.at("parent").is_null());
    require_states({run_a.states.at(step)}, load_states(1, path), "A");
  }
  // B's newest 3 survive; a name A holds got B's suffix.
  CHECK(!fs::exists(run_b.paths.at(15)));
  for (int step : {20, 25, 30}) {
    INFO(step);
    const auto& path = run_b.paths.at(step);
    CHECK(path.filename() ==
          (step == 25 ? checkpoint_name(25) : checkpoint_name(step) + "-" + b.substr(0, 8)));
    const auto meta = read_checkpoint_metadata(path);
    CHECK(meta.at("run_id") == b);
    CHECK(meta.at("parent") == nlohmann::json({{"run_id", a}, {"step", 10}}));
    require_states({run_b.states.at(step)}, load_states(1, path), "B");
  }
  CHECK(list_checkpoints(root).size() == 6);
  const auto latest = latest_checkpoint(root);
  REQUIRE(latest.has_value());
  CHECK(latest->path == run_b.paths.at(30));
  CHECK(latest->run_id == b);
  CHECK(latest->step == 30);
}

TEST_CASE(
    "a partly deleted checkpoint never lists as complete, and prune leftovers are "
    "removed by the next prune") {
  const ScratchFolder folder = scratch("prune-interrupted");
  const auto& root = folder.path();
  SaveOptions options;
  options.run_id = new_random_id();
  for (int step : {2, 4, 6}) save_after(2, step, root / checkpoint_name(step), options);
  // What remove_all can leave when killed: the rank files gone, the metadata kept.
  for (int r = 0; r < 2; ++r)
    fs::remove(root / checkpoint_name(2) / fmt::format("rank-{:05}-of-00002.bin", r));
  // What an interrupted prune leaves: renamed out of the checkpoint names, then partly removed.
  fs::rename(root / checkpoint_name(4), root / (checkpoint_name(4) + ".prune"));
  fs::remove(root / (checkpoint_name(4) + ".prune") / "weights.bin");
  const auto listed = list_checkpoints(root);
  REQUIRE(listed.size() == 1);
  CHECK(listed[0].filename() == checkpoint_name(6));
  const auto scan = scan_checkpoints(root);
  REQUIRE(scan.skipped.size() == 1);
  CHECK(test::contains(scan.skipped[0], (root / checkpoint_name(2)).string()));
  CHECK(test::contains(scan.skipped[0], "rank-00000-of-00002.bin"));
  prune_checkpoints(root, 3, options.run_id);
  CHECK(!fs::exists(root / (checkpoint_name(4) + ".prune")));
  CHECK(list_checkpoints(root).size() == 1);
}

TEST_CASE("a directory or a FIFO in place of a checkpoint file is refused, naming it") {
  Damaged d;
  for (const std::string file : {"weights.bin", "rank-00001-of-00002.bin", "metadata.json"})
    for (const bool fifo : {false, true}) {
      const auto dir = d.copy(fmt::format("{}-{}", fifo ? "fifo" : "dir", file));
      const auto path = dir / file;
      fs::remove(path);
      if (fifo)
        REQUIRE(::mkfifo(path.c_str(), 0644) == 0);
      else
        fs::create_directory(path);
      for (const auto& msg : {load_error(dir), inspect_error(dir)}) {
        INFO(msg);
        CHECK(test::contains(msg, "'" + path.string() + "'"));
        CHECK(test::contains(msg, fifo ? "a FIFO" : "a directory"));
      }
    }
}

namespace {

// Random JSON whose strings and keys hold arbitrary bytes, and objects that look like the
// encoding's own ({"bytes_hex": ...}, {"object_entries": ...}).
nlohmann::json random_json(std::uint64_t& seed, int depth) {
  const auto next = [&] { return seed = mix(seed); };
  const auto bytes = [&] {
    std::string s(next() % 6, '\0');
    for (auto& c : s)
      c = static_cast<char>(next() % 3 == 0 ? 0x80 + next() % 128 : 'a' + next() % 26);
    return s;
  };
  switch (depth > 3 ? next() % 3 : next() % 6) {
    case 0:
      return static_cast<std::int64_t>(next() % 1000);
    case 1:
      return bytes();
    case 2:
      return nullptr;
    case 3: {
      nlohmann::json a = nlohmann::json::array();
      for (auto n = next() % 4; n > 0; --n) a.push_back(random_json(seed, depth + 1));
      return a;
    }
    case 4:
      return {{next() % 2 ? "bytes_hex" : "object_entries", random_json(seed, depth + 1)}};
    default: {
      nlohmann::json o = nlohmann::json::object();
      for (auto n = next() % 4; n > 0; --n) o[bytes()] = random_json(seed, depth + 1);
      return o;
    }
  }
}

}  // namespace

TEST_CASE("strings that are not UTF-8 survive encoding to JSON text and back, byte for byte") {
  int encoded_some = 0;
  for (std::uint64_t i = 0; i < 2000; ++i) {
    std::uint64_t seed = i;
    const nlohmann::json original = random_json(seed, 0);
    const std::string text = encode_byte_strings(original).dump();  // throws if not UTF-8
    encoded_some += test::contains(text, "bytes_hex") || test::contains(text, "object_entries");
    const nlohmann::json back = decode_byte_strings(nlohmann::json::parse(text));
    if (back != original) FAIL(fmt::format("input {}: {} came back differently", i, text));
  }
  CHECK(encoded_some > 200);
}

TEST_CASE(
    "a config and trainer state with bytes that are not UTF-8 are saved, into a directory "
    "named so, and read back exactly") {
  const ScratchFolder folder = scratch("bytes");
  const fs::path root = folder / "ck_\xe9";
  const nlohmann::json config = {{"checkpoint", {{"dir", root.string()}}},
                                 {"tensorboard", {{"log\xff", "x"}}}};
  SaveOptions options;
  options.config = config;
  options.extra = {{"path", "/data/\xc3\x28.bin"}, {"lookalike", {{"bytes_hex", "41"}}}};
  const Saved saved = save_after(1, 3, root / checkpoint_name(3), options);
  LoadedCheckpoint loaded;
  require_states(saved.states, load_states(1, saved.path, &loaded), "after the load");
  nlohmann::json extra = options.extra;
  extra["step"] = 3;
  CHECK(loaded.extra == extra);
  const auto meta = read_checkpoint_metadata(saved.path);
  CHECK(decode_byte_strings(meta.at("config")) == config);
  CHECK(decode_byte_strings(meta.at("extra")) == extra);
  const std::string summary = describe_checkpoint(saved.path);
  INFO(summary);
  CHECK(test::contains(summary, "2f646174612fc3282e62696e"));  // "/data/\xc3\x28.bin" in hex
  CHECK(list_checkpoints(root).size() == 1);
}
