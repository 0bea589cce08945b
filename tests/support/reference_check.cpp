// The sharded engine against an unsharded float64 reference written here, independently of
// optimizer/ and partition/, on any backend: 20 steps with global-norm clipping that triggers.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "optimizer/master_split.h"
#include "optimizer/optimizer.h"
#include "shardswap/nccl.h"
#include "shardswap/engine.h"
#include "shardswap/error.h"
#include "tests/catch_compat.h"
#include "tests/support/reference_check.h"

namespace shardswap::test_support {

namespace {

struct Decl {
  std::string name;
  std::vector<std::int64_t> shape;
  std::string group;
  std::int64_t numel() const {
    std::int64_t n = 1;
    for (auto e : shape) n *= e;
    return n;
  }
};

// Sizes chosen so that, with 64-byte alignment, params straddle shard boundaries at every world
// size here and the last shard is padded; one group has a param smaller than the world size.
const std::vector<Decl> kModel = {
    {"embed.weight", {37, 11}, "embed"},  {"layers.0.w", {19, 23}, "layers.0"},
    {"layers.0.b", {19}, "layers.0"},     {"layers.0.v", {5, 61}, "layers.0"},
    {"layers.1.w", {29, 17}, "layers.1"}, {"layers.1.b", {3}, "layers.1"},
    {"head.weight", {11, 41}, "head"},
};

// Rounds x to `bits` significant bits, ties to even, with no quantum below 2^min_exponent
// (subnormals). Values here never reach the overflow range.
double round_significand(double x, int bits, int min_exponent) {
  if (x == 0.0) return 0.0;
  int e = 0;
  std::frexp(x, &e);
  const double quantum = std::ldexp(1.0, std::max(e - bits, min_exponent));
  return std::nearbyint(x / quantum) * quantum;  // default rounding mode: half to even
}

// bf16: 8 significant bits, smallest subnormal 2^-133; fp16: 11 bits, smallest subnormal 2^-24.
double round16(double x, DType t) {
  return t == DType::bf16 ? round_significand(x, 8, -133) : round_significand(x, 11, -24);
}

std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// A gradient value exactly representable in `t`, magnitude in [2^-4, 2): sums of up to 8 of
// them are exact in fp32, so the reference may sum in float64 and round once.
double grad_value(int rank, int step, std::size_t param, std::int64_t i, DType t) {
  const auto h =
      mix((static_cast<std::uint64_t>(rank) << 56) ^ (static_cast<std::uint64_t>(step) << 40) ^
          (param << 32) ^ static_cast<std::uint64_t>(i));
  const int mantissa_bits = t == DType::bf16 ? 7 : 10;
  const double m = 1.0 + static_cast<double>(h & ((1u << mantissa_bits) - 1)) /
                             static_cast<double>(1u << mantissa_bits);
  const int e = -static_cast<int>((h >> 20) % 5);
  const double sign = (h >> 40) & 1 ? -1.0 : 1.0;
  // Bias by parameter so the gradient has a direction Adam can follow.
  return sign * std::ldexp(m, e);
}

double init_value(std::size_t param, std::int64_t i) {
  const auto h = mix(0xabcdef ^ (param << 32) ^ static_cast<std::uint64_t>(i));
  return (static_cast<double>(h % 2000001) / 1000000.0 - 1.0) * 0.9 + (param % 2 ? 0.3 : -0.2);
}

constexpr int kSteps = 20;
constexpr double kLossScale = 1024.0;  // fp16 only; static here, dynamic scaling is tested apart
constexpr double kClip = 12.0;

EngineConfig make_config(const Case& c) {
  EngineConfig cfg;
  cfg.stage = c.stage;
  cfg.dtype = c.dtype;
  cfg.alignment_bytes = 64;
  cfg.reduce_bucket_bytes = 1024;  // smaller than most groups: buckets really cycle
  cfg.order = c.order;
  cfg.gradient_clipping = kClip;
  cfg.optimizer.type = c.optimizer;
  cfg.optimizer.lr = c.optimizer == OptimizerType::sgd ? 0.05 : 0.01;
  cfg.optimizer.beta1 = 0.9;
  cfg.optimizer.beta2 = 0.99;
  cfg.optimizer.eps = 1e-8;
  cfg.optimizer.weight_decay = 0.05;
  cfg.optimizer.momentum = 0.9;
  cfg.optimizer.nesterov = c.optimizer == OptimizerType::sgd;
  cfg.grad_dtype = c.grad_dtype;
  cfg.comm_dtype = c.comm_dtype;
  cfg.loss_scale.dynamic = false;
  cfg.loss_scale.static_scale = kLossScale;
  cfg.overlap_comm = c.overlap_comm;
  cfg.optimizer_placement = c.optimizer_placement;
  cfg.offload_update = c.offload_update;
  cfg.offload_chunk_elements = c.offload_chunk_elements;
  cfg.optimizer.state_dtype = c.state_dtype;
  cfg.optimizer.master = c.master;
  return cfg;
}

// ---- the float64 reference ----

const std::vector<std::string> kGroups = {"embed", "layers.0", "layers.1", "head"};

// The groups active at step t under the case's switches.
std::vector<std::string> active_at(const Case& c, int t) {
  if (c.switches.empty()) return kGroups;
  std::vector<std::string> active;
  for (const auto& [step, groups] : c.switches)
    if (step <= t) active = groups;
  return active;
}

bool contains(const std::vector<std::string>& v, const std::string& x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

struct Reference {
  std::vector<std::vector<double>> master, m, v;
  std::map<std::string, int> steps;         // each group's optimizer step count
  std::map<std::string, bool> active;       // after the last switch
  std::map<std::string, bool> state_valid;  // false once dropped: reseed on activation

  explicit Reference(DType t) {
    for (std::size_t p = 0; p < kModel.size(); ++p) {
      std::vector<double> w(static_cast<std::size_t>(kModel[p].numel()));
      for (std::size_t i = 0; i < w.size(); ++i)
        w[i] = round16(init_value(p, static_cast<std::int64_t>(i)), t);
      master.push_back(w);
      m.emplace_back(w.size(), 0.0);
      v.emplace_back(w.size(), 0.0);
    }
    for (const auto& g : kGroups) {
      steps[g] = 0;
      active[g] = false;
      state_valid[g] = false;  // a group's first activation seeds its master from bit16
    }
  }

  // Applies the active set of step t as the engine's set_active does.
  void switch_to(const Case& c, int t) {
    const auto wanted = active_at(c, t);
    for (const auto& g : kGroups) {
      const bool want = contains(wanted, g);
      if (active[g] && !want && c.policy == DeactivatePolicy::drop) {
        state_valid[g] = false;
        steps[g] = 0;
      }
      if (!active[g] && want && !state_valid[g]) {  // fresh: master from the bit16 weights
        for (std::size_t p = 0; p < kModel.size(); ++p)
          if (kModel[p].group == g)
            for (std::size_t i = 0; i < master[p].size(); ++i) {
              master[p][i] = round16(master[p][i], c.dtype);
              m[p][i] = v[p][i] = 0.0;
            }
        state_valid[g] = true;
      }
      active[g] = want;
    }
  }

  void step(const Case& c, const EngineConfig& cfg, int t) {
    switch_to(c, t);
    const double scale = c.dtype == DType::f16 ? kLossScale : 1.0;
    std::vector<std::vector<double>> g(kModel.size());
    double squares = 0.0;
    for (std::size_t p = 0; p < kModel.size(); ++p) {
      if (!active[kModel[p].group]) continue;
      g[p].resize(master[p].size());
      for (std::size_t i = 0; i < g[p].size(); ++i) {
        double sum = 0.0;
        for (int r = 0; r < c.world_size; ++r)
          sum += grad_value(r, t, p, static_cast<std::int64_t>(i), c.dtype);
        // Gradients travel (and are summed once, exactly, then rounded) in the wire type.
        const DType wire = cfg.comm_type();
        const double reduced = is_bit16(wire) ? round16(sum, wire) : sum;
        g[p][i] = reduced / (scale * c.world_size);
        squares += g[p][i] * g[p][i];
      }
    }
    const double norm = std::sqrt(squares);
    const double coef = norm > kClip ? kClip / (norm + 1e-6) : 1.0;
    const auto& o = cfg.optimizer;
    for (const auto& grp : kGroups)
      if (active[grp]) ++steps[grp];
    for (std::size_t p = 0; p < kModel.size(); ++p)
      for (std::size_t i = 0; i < g[p].size(); ++i) {  // empty for frozen groups
        const double step = steps[kModel[p].group];
        double& w = master[p][i];
        double gi = g[p][i] * coef;
        // bf16 state: this step's values update the weight, the stored ones are rounded.
        const auto stored = [&](double x) {
          return c.state_dtype == DType::bf16 ? round16(x, DType::bf16) : x;
        };
        if (c.optimizer == OptimizerType::sgd) {
          gi += o.weight_decay * w;
          double& buf = m[p][i];
          const double b = step == 1 ? gi : o.momentum * buf + gi;
          w -= o.lr * (gi + o.momentum * b);  // nesterov
          buf = stored(b);
          continue;
        }
        if (c.optimizer == OptimizerType::adamw) w *= 1.0 - o.lr * o.weight_decay;
        if (c.optimizer == OptimizerType::adam) gi += o.weight_decay * w;
        const double mn = o.beta1 * m[p][i] + (1 - o.beta1) * gi;
        const double vn = o.beta2 * v[p][i] + (1 - o.beta2) * gi * gi;
        const double mhat = mn / (1 - std::pow(o.beta1, step));
        const double vhat = vn / (1 - std::pow(o.beta2, step));
        w -= o.lr * mhat / (std::sqrt(vhat) + o.eps);
        m[p][i] = stored(mn);
        v[p][i] = stored(vn);
      }
  }
};

// ---- the engine, on world_size threads ----

struct EngineRun {
  std::vector<std::vector<double>> master;               // assembled from every rank's pieces
  std::vector<std::vector<int>> covered;                 // how many ranks supplied each element
  std::vector<std::vector<std::vector<float>>> weights;  // [rank][param] bit16 weights as float
  bool weights_are_rounded_master = true;
  bool weights_agree_across_processes = true;  // mpirun: this rank's weights equal rank 0's
  int steps_applied = 0;
};

/// mpirun: every process holds only its own masters. Sums the pieces (and the coverage counts)
/// over ranks in float64 on the device, and compares this rank's bit16 weights with rank 0's.
void combine_across_processes(EngineRun& out, Communicator& comm, MemorySpace& space, int rank) {
  std::vector<double> flat;
  for (std::size_t p = 0; p < out.master.size(); ++p) {
    flat.insert(flat.end(), out.master[p].begin(), out.master[p].end());
    for (int k : out.covered[p]) flat.push_back(k);
  }
  Buffer sums = space.allocate(flat.size() * sizeof(double), Tag::other, "reference: pieces");
  space.upload(sums.data(), flat.data(), flat.size() * sizeof(double));
  comm.all_reduce(sums.data(), flat.size(), DType::f64, ReduceOp::sum);
  space.download(flat.data(), sums.data(), flat.size() * sizeof(double));
  std::size_t at = 0;
  for (std::size_t p = 0; p < out.master.size(); ++p) {
    for (auto& v : out.master[p]) v = flat[at++];
    for (auto& k : out.covered[p]) k = static_cast<int>(flat[at++]);
  }
  std::vector<float> mine;
  for (const auto& w : out.weights[0]) mine.insert(mine.end(), w.begin(), w.end());
  Buffer root = space.allocate(mine.size() * sizeof(float), Tag::other, "reference: weights");
  space.upload(root.data(), mine.data(), mine.size() * sizeof(float));
  comm.broadcast(root.data(), mine.size(), DType::f32, 0);
  std::vector<float> theirs(mine.size());
  space.download(theirs.data(), root.data(), theirs.size() * sizeof(float));
  out.weights_agree_across_processes = rank == 0 || theirs == mine;
}

EngineRun run_engine(const Case& c, const Backend& backend) {
  const EngineConfig cfg = make_config(c);
  EngineRun out;
  for (const auto& d : kModel) {
    out.master.emplace_back(static_cast<std::size_t>(d.numel()), 0.0);
    out.covered.emplace_back(static_cast<std::size_t>(d.numel()), 0);
  }
  out.weights.resize(static_cast<std::size_t>(c.world_size));
  std::mutex mu;
  // One GPU per rank: the rank's own device (its thread made it current).
  const bool gpu_per_rank = c.comm != nullptr || (c.nccl && c.world_size > 1);
  auto per_rank = [&](int rank, Communicator& comm) {
    int device = 0;
    if (c.comm != nullptr) {
      device = -1;  // the current one
    } else if (gpu_per_rank) {
      device = rank;
      cuda_set_device(device);
    }
    MemorySpace space(rank, gpu_per_rank ? make_cuda_allocator(device < 0 ? cuda_current_device()
                                                                           : device)
                                         : backend.make_allocator(rank));
    Engine engine(cfg, comm, space, backend);
    for (const auto& d : kModel) engine.add_param(d.name, d.shape, d.group);
    engine.build(
        [&](const ParamInfo& info, std::span<float> values) {
          std::size_t p = 0;
          while (kModel[p].name != info.name) ++p;
          for (std::size_t i = 0; i < values.size(); ++i)
            values[i] = static_cast<float>(init_value(p, static_cast<std::int64_t>(i)));
        },
        active_at(c, 0));
    int applied = 0;
    for (int t = 0; t < kSteps; ++t) {
      for (const auto& [step, groups] : c.switches)
        if (step == t && t > 0) engine.set_active(groups, c.policy);
      for (std::size_t p = kModel.size(); p-- > 0;) {  // backward order
        if (!engine.is_active(kModel[p].group)) continue;
        View slot = engine.grad_slot(kModel[p].name);
        std::vector<float> g(slot.count());
        for (std::size_t i = 0; i < g.size(); ++i)
          g[i] = static_cast<float>(grad_value(rank, t, p, static_cast<std::int64_t>(i), c.dtype));
        std::vector<std::byte> staged(slot.bytes());
        cpu_device_ops().cast(staged.data(), slot.dtype(), g.data(), DType::f32, g.size());
        space.upload(slot.raw(), staged.data(), staged.size());
        engine.grad_ready(kModel[p].name);
      }
      applied += engine.step().applied ? 1 : 0;
    }
    std::lock_guard lock(mu);
    out.steps_applied = applied;
    auto& weights = out.weights[c.comm != nullptr ? 0 : static_cast<std::size_t>(rank)];
    for (std::size_t p = 0; p < kModel.size(); ++p) {
      std::vector<float> values = engine.read_weight(kModel[p].name);
      for (const auto& piece : engine.master_pieces(kModel[p].name))
        for (std::size_t k = 0; k < piece.values.size(); ++k) {
          const auto i = static_cast<std::size_t>(piece.param_offset) + k;
          out.master[p][i] = piece.values[k];
          ++out.covered[p][i];
          const double rounded =
              c.master == MasterStorage::fp32
                  ? round16(piece.values[k], c.dtype)
                  : static_cast<double>(std::bit_cast<float>(
                        std::uint32_t{detail::split_master(std::bit_cast<std::uint32_t>(
                                          piece.values[k])).weight}
                        << 16));
          if (static_cast<double>(values[i]) != rounded) out.weights_are_rounded_master = false;
        }
      weights.push_back(std::move(values));
    }
    if (c.comm != nullptr) combine_across_processes(out, comm, space, rank);
  };
  if (c.comm != nullptr) {
    out.weights.assign(1, {});
    per_rank(c.comm->rank(), *c.comm);
  } else if (c.nccl && c.world_size == 1) {
    auto comms = make_nccl_communicators({0});
    per_rank(0, *comms.at(0));
  } else if (c.nccl) {
    std::vector<int> devices(static_cast<std::size_t>(c.world_size));
    for (int r = 0; r < c.world_size; ++r) devices[static_cast<std::size_t>(r)] = r;
    auto comms = make_nccl_communicators(devices);
    // A rank that throws leaves its peers waiting inside NCCL: a failure here can hang, which
    // the GPU check's timeout turns into a failure.
    std::vector<std::exception_ptr> errors(devices.size());
    std::vector<std::thread> threads;
    for (int r = 0; r < c.world_size; ++r)
      threads.emplace_back([&, r] {
        try {
          per_rank(r, *comms[static_cast<std::size_t>(r)]);
        } catch (...) {
          errors[static_cast<std::size_t>(r)] = std::current_exception();
        }
      });
    for (auto& t : threads) t.join();
    for (auto& e : errors)
      if (e) std::rethrow_exception(e);
  } else {
    run_ranks(c.world_size, per_rank, backend);
  }
  return out;
}

}  // namespace

std::vector<Case> multi_gpu_cases(int world) {
  std::vector<Case> cases;
  const auto add = [&](Case c) {
    if (world > 2) c.grad_dtype = DType::f32;
    cases.push_back(std::move(c));
  };
  for (int stage : {1, 2})
    for (DType dtype : {DType::bf16, DType::f16})
      for (bool overlap : {true, false}) {
        if (stage == 1 && !overlap) continue;  // overlap only changes stage 2
        Case c{world, stage, dtype, OptimizerType::adamw};
        c.overlap_comm = overlap;
        add(c);
      }
  for (int stage : {1, 2}) {
    Case c{world, stage, DType::bf16, OptimizerType::adam};
    c.switches = switching_schedule();
    c.policy = DeactivatePolicy::keep_device;
    add(c);
  }
  if (world == 2) {
    Case c{world, 2, DType::bf16, OptimizerType::adamw};
    c.grad_dtype = DType::f32;
    c.comm_dtype = DType::bf16;
    cases.push_back(c);
  }
  return cases;
}

void check_against_reference(const Case& c, const Backend& backend) {
  CAPTURE(backend.name(), c.world_size, c.stage, dtype_name(c.dtype),
          optimizer_type_name(c.optimizer), c.order == LayoutOrder::round_robin, c.nccl,
          c.comm != nullptr, c.overlap_comm,
          dtype_name(make_config(c).grad_type()), dtype_name(make_config(c).comm_type()));
  if (c.comm != nullptr) REQUIRE(c.comm->world_size() == c.world_size);
  const EngineConfig cfg = make_config(c);
  Reference ref(c.dtype);
  for (int t = 0; t < kSteps; ++t) ref.step(c, cfg, t);
  const EngineRun run = run_engine(c, backend);
  REQUIRE(run.steps_applied == kSteps);

  double diff = 0.0, norm = 0.0, moved = 0.0;
  Reference start(c.dtype);
  for (std::size_t p = 0; p < kModel.size(); ++p)
    for (std::size_t i = 0; i < ref.master[p].size(); ++i) {
      REQUIRE(run.covered[p][i] == 1);  // every element owned by exactly one rank
      diff += std::pow(run.master[p][i] - ref.master[p][i], 2);
      norm += std::pow(ref.master[p][i], 2);
      moved += std::pow(ref.master[p][i] - start.master[p][i], 2);
    }
  const double rel = std::sqrt(diff / norm);
  CAPTURE(rel, std::sqrt(moved / norm));
  REQUIRE(std::sqrt(moved / norm) > 1e-3);  // the weights really moved: the check has teeth
  const double tolerance = c.state_dtype == DType::f32 ? 1e-6 : 1e-4;
  REQUIRE(rel <= tolerance);
  if (c.state_dtype != DType::f32) {
    // The engine is nearer this reference than the fp32 state's: the rounding is really done.
    Case f32 = c;
    f32.state_dtype = DType::f32;
    Reference other(c.dtype);
    for (int t = 0; t < kSteps; ++t) other.step(f32, make_config(f32), t);
    double from_f32 = 0.0;
    for (std::size_t p = 0; p < kModel.size(); ++p)
      for (std::size_t i = 0; i < ref.master[p].size(); ++i)
        from_f32 += std::pow(run.master[p][i] - other.master[p][i], 2);
    CAPTURE(std::sqrt(from_f32 / norm));
    REQUIRE(std::sqrt(from_f32 / norm) > 4 * rel);
  }
  REQUIRE(run.weights_are_rounded_master);
  REQUIRE(run.weights_agree_across_processes);
  for (int r = 1; r < static_cast<int>(run.weights.size()); ++r)
    REQUIRE(run.weights[static_cast<std::size_t>(r)] == run.weights[0]);
}

}  // namespace shardswap::test_support
