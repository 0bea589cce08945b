// Master and optimizer state in host memory on the CUDA backend, streamed through the device or
// updated on the CPU: the float64 reference under every policy, the bits of the state on the
// device (streamed: copies overlapping the kernel over many chunks; cpu: the CPU update against
// the CUDA kernel, over several threads on a shard past HostUpdater's split), and device and
// host bytes planned = held, in pinned or pageable memory. Also the update overlapping the next
// forward (overlap_update): the bits of one that does not.
#include <fmt/format.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <mutex>
#include <utility>
#include <string>
#include <vector>

#include "optimizer/optimizer.h"
#include "shardswap/backend.h"
#include "shardswap/engine.h"
#include "tests/catch_compat.h"
#include "tests/support/reference_check.h"
#include "tests/support/plan_held.h"
#include "tests/support/small_models.h"

using namespace shardswap;
using test_support::require_plan_held;
using test_support::add_cosine_grads;
using test_support::Case;
using test_support::sine_init;

namespace {

// Two ranks on GPU 0, groups of 1.2M elements (shards of 600K: past HostUpdater's split, so the
// update runs over several threads and chunks of 256K), switches under `policy`, 12 steps.
TrainingState run(Placement placement, DeactivatePolicy policy, bool pinned,
                  OffloadUpdate way = OffloadUpdate::streamed,
                  MasterStorage master = MasterStorage::fp32, DType state_dtype = DType::f32) {
  TrainingState out;
  std::mutex mu;
  run_ranks(
      2,
      [&](int rank, Communicator& comm) {
        MemorySpace space(rank, make_cuda_allocator(0));
        EngineConfig cfg;
        cfg.optimizer.lr = 0.01;
        cfg.optimizer.weight_decay = 0.1;
        cfg.optimizer_placement = placement;
        cfg.pin_host_memory = pinned;
        cfg.offload_update = way;
        cfg.offload_chunk_elements = 1 << 18;
        cfg.optimizer.master = master;
        cfg.optimizer.state_dtype = state_dtype;
        Engine e(cfg, comm, space, cuda_backend());
        for (int l = 0; l < 4; ++l) {
          e.add_param(fmt::format("layers.{}.w", l), {1000, 1200}, fmt::format("layers.{}", l));
          e.add_param(fmt::format("layers.{}.norm", l), {1200}, fmt::format("layers.{}", l));
          e.set_param_weight_decay(fmt::format("layers.{}.norm", l), 0.0);
        }
        e.build(sine_init, std::vector<std::string>{"layers.0", "layers.1"});
        require_plan_held(e, "after build");
        for (int step = 0; step < 12; ++step) {
          if (step % 4 == 3)
            e.set_active({"layers.0", fmt::format("layers.{}", 1 + (step / 4) % 3)}, policy);
          require_plan_held(e, fmt::format("before step {}", step + 1));
          add_cosine_grads(e, rank, step);
          e.step();
          require_plan_held(e, fmt::format("after step {}", step + 1));
        }
        e.set_active(e.groups(), policy);
        TrainingState s = e.training_state(true);
        if (placement == Placement::host) {
          const std::string report = e.memory_report();
          if (report.find(pinned ? "memory (pinned host)" : "memory (host)") == std::string::npos)
            throw std::runtime_error("the host space is not the memory asked for:\n" + report);
        }
        std::lock_guard lock(mu);
        if (rank == 0) out = std::move(s);
      },
      cuda_backend());
  return out;
}

}  // namespace

TEST_CASE("cuda: state on the host matches the float64 reference under every policy") {
  for (DeactivatePolicy policy :
       {DeactivatePolicy::drop, DeactivatePolicy::keep_host, DeactivatePolicy::keep_device})
    for (int stage : {1, 2})
      for (OffloadUpdate way : {OffloadUpdate::streamed, OffloadUpdate::cpu}) {
        Case c{4, stage, DType::bf16, OptimizerType::adamw};
        c.switches = test_support::switching_schedule();
        c.policy = policy;
        c.optimizer_placement = Placement::host;
        c.offload_update = way;
        CAPTURE(deactivate_policy_name(policy), stage, offload_update_name(way));
        test_support::check_against_reference(c, cuda_backend());
      }
}

TEST_CASE("cuda: state on the host gives the bits of the state on the device, pinned or not") {
  for (DeactivatePolicy policy : {DeactivatePolicy::drop, DeactivatePolicy::keep_host}) {
    CAPTURE(deactivate_policy_name(policy));
    const TrainingState device = run(Placement::device, policy, true);
    for (const auto& [pinned, way] : {std::pair{true, OffloadUpdate::streamed},
                                      std::pair{false, OffloadUpdate::streamed},
                                      std::pair{true, OffloadUpdate::cpu},
                                      std::pair{false, OffloadUpdate::cpu}}) {
      CAPTURE(pinned, offload_update_name(way));
      const TrainingState host = run(Placement::host, policy, pinned, way);
      REQUIRE(host.groups.size() == device.groups.size());
      for (std::size_t i = 0; i < host.groups.size(); ++i) {
        CAPTURE(host.groups[i].group);
        REQUIRE(host.groups[i].step == device.groups[i].step);
        REQUIRE(host.groups[i].master == device.groups[i].master);
        REQUIRE(host.groups[i].state == device.groups[i].state);
      }
      REQUIRE(host.weights == device.weights);
    }
  }
}

TEST_CASE("cuda: the master as bf16 weights and low halves keeps the fp32 masters' bits, on the "
          "device and on the host both ways") {
  for (DType state_dtype : {DType::f32, DType::bf16}) {
    CAPTURE(dtype_name(state_dtype));
    const TrainingState f32 = run(Placement::device, DeactivatePolicy::keep_host, true,
                                  OffloadUpdate::streamed, MasterStorage::fp32, state_dtype);
    const TrainingState device = run(Placement::device, DeactivatePolicy::keep_host, true,
                                     OffloadUpdate::streamed, MasterStorage::bf16_remainder,
                                     state_dtype);
    for (OffloadUpdate way : {OffloadUpdate::streamed, OffloadUpdate::cpu}) {
      CAPTURE(offload_update_name(way));
      const TrainingState host = run(Placement::host, DeactivatePolicy::keep_host, true, way,
                                     MasterStorage::bf16_remainder, state_dtype);
      for (std::size_t i = 0; i < host.groups.size(); ++i) {
        REQUIRE(host.groups[i].master == device.groups[i].master);
        REQUIRE(host.groups[i].state == device.groups[i].state);
      }
      REQUIRE(host.weights == device.weights);
    }
    // The gradients here do not depend on the weights: rank 0's masters stay the fp32 masters'
    // bits, and a weight (every rank's) differs only as a tie does: the fp32 run's even (ties to
    // even), this one's one bf16 ulp further from zero (ties away from zero).
    for (std::size_t i = 0; i < f32.groups.size(); ++i)
      REQUIRE(f32.groups[i].master == device.groups[i].master);
    std::size_t differ = 0, not_a_tie = 0;
    for (std::size_t p = 0; p < f32.weights.size(); ++p)
      for (std::size_t b = 0; b + 1 < f32.weights[p].size(); b += 2) {
        std::uint16_t x = 0, y = 0;
        std::memcpy(&x, f32.weights[p].data() + b, 2);
        std::memcpy(&y, device.weights[p].data() + b, 2);
        differ += x != y;
        not_a_tie += x != y && !((x & 1u) == 0 && y == x + 1);
      }
    CAPTURE(differ);
    REQUIRE(not_a_tie == 0);
  }
}

namespace {

// One rank on GPU 0, groups of 1.2M elements (each two gradient windows of the 1.2M-element
// param, which move within a group), 3 micro-batches a step, clipping at every step, switches
// under keep_host, 12 steps; the grad norms and the final state.
std::pair<TrainingState, std::vector<double>> one_rank_run(Placement state, Placement grads,
                                                          OffloadUpdate way, DType grad_dtype) {
  std::pair<TrainingState, std::vector<double>> out;
  run_ranks(
      1,
      [&](int rank, Communicator& comm) {
        MemorySpace space(rank, make_cuda_allocator(0));
        EngineConfig cfg;
        cfg.optimizer.lr = 0.01;
        cfg.optimizer.weight_decay = 0.1;
        cfg.optimizer_placement = state;
        cfg.gradient_placement = grads;
        cfg.offload_update = way;
        cfg.offload_chunk_elements = 1 << 18;
        cfg.grad_dtype = grad_dtype;
        cfg.reduce_bucket_bytes = 256;  // grown to the largest param
        cfg.gradient_accumulation_steps = 3;
        cfg.gradient_clipping = 1e-3;
        Engine e(cfg, comm, space, cuda_backend());
        for (int l = 0; l < 4; ++l) {
          e.add_param(fmt::format("layers.{}.w", l), {1000, 1200}, fmt::format("layers.{}", l));
          e.add_param(fmt::format("layers.{}.norm", l), {1200}, fmt::format("layers.{}", l));
        }
        e.build(sine_init, std::vector<std::string>{"layers.0", "layers.1"});
        require_plan_held(e, "after build");
        for (int step = 0; step < 12; ++step) {
          if (step % 4 == 3)
            e.set_active({"layers.0", fmt::format("layers.{}", 1 + (step / 4) % 3)},
                         DeactivatePolicy::keep_host);
          for (int micro = 0; micro < 3; ++micro) add_cosine_grads(e, micro, 3 * step + micro);
          const StepResult r = e.step();
          if (!(r.grad_norm > 1e-3)) throw std::runtime_error("the clip coefficient is not below 1");
          out.second.push_back(r.grad_norm);
          require_plan_held(e, fmt::format("after step {}", step + 1));
        }
        e.set_active(e.groups(), DeactivatePolicy::keep_host);
        out.first = e.training_state(true);
      },
      cuda_backend());
  return out;
}

}  // namespace

TEST_CASE("cuda: gradients on the host give the bits of gradients on the device") {
  for (DType grad_dtype : {DType::bf16, DType::f32}) {
    CAPTURE(dtype_name(grad_dtype));
    const auto device =
        one_rank_run(Placement::device, Placement::device, OffloadUpdate::streamed, grad_dtype);
    for (OffloadUpdate way : {OffloadUpdate::streamed, OffloadUpdate::cpu}) {
      CAPTURE(offload_update_name(way));
      const auto host = one_rank_run(Placement::host, Placement::host, way, grad_dtype);
      REQUIRE(host.second == device.second);  // the norms, bit for bit (no NaN here)
      for (std::size_t i = 0; i < host.first.groups.size(); ++i) {
        CAPTURE(host.first.groups[i].group);
        REQUIRE(host.first.groups[i].master == device.first.groups[i].master);
        REQUIRE(host.first.groups[i].state == device.first.groups[i].state);
      }
      REQUIRE(host.first.weights == device.first.weights);
    }
  }
}

namespace {

// `ranks` ranks on GPU 0 with the frozen groups' weights where `weights` says: a model that
// reads every layer's weights on the device in forward (summing them into a carry) and backward
// (adding the carry and the layer's own weights into its gradients), so a window read before its
// fill lands, or filled with the wrong layer, changes the bits -- and so does a layer read before
// its update lands when the update overlaps the next forward (`overlap`; with `rows` = 4000 a
// group is 4.8M elements, and its update takes longer than the model's read of it). Switches
// under keep_host; rank 0's grad norms and final state.
std::pair<TrainingState, std::vector<double>> fetching_run(Placement weights, Placement state,
                                                          bool overlap = false, int ranks = 1,
                                                          std::int64_t rows = 1000) {
  std::pair<TrainingState, std::vector<double>> out;
  run_ranks(
      ranks,
      [&](int rank, Communicator& comm) {
        MemorySpace space(rank, make_cuda_allocator(0));
        MemorySpace scratch(rank, make_cuda_allocator(0));  // the model's carry, outside the plan
        EngineConfig cfg;
        cfg.optimizer.lr = 0.01;
        cfg.frozen_weight_placement = weights;
        cfg.optimizer_placement = state;
        cfg.overlap_update = overlap;
        cfg.gradient_accumulation_steps = 2;
        Engine e(cfg, comm, space, cuda_backend());
        const int layers = 6;
        for (int l = 0; l < layers; ++l) {
          e.add_param(fmt::format("layers.{}.w", l), {rows, 1200}, fmt::format("layers.{}", l));
          e.add_param(fmt::format("layers.{}.norm", l), {1200}, fmt::format("layers.{}", l));
        }
        e.build(sine_init, std::vector<std::string>{"layers.1", "layers.4"});
        require_plan_held(e, "after build");
        const DeviceOps& ops = cuda_device_ops();
        Buffer carry = scratch.allocate(static_cast<std::size_t>(rows) * 1200 * sizeof(float),
                                        Tag::other, "carry");
        for (int step = 0; step < 8; ++step) {
          if (step % 3 == 2)
            e.set_active({fmt::format("layers.{}", step % layers),
                          fmt::format("layers.{}", (step + 3) % layers)},
                         DeactivatePolicy::keep_host);
          for (int micro = 0; micro < 2; ++micro) {
            ops.fill_zero(carry.data(), carry.bytes());
            for (int l = 0; l < layers; ++l) {
              const auto g = fmt::format("layers.{}", l);
              e.fetch_weights(g);
              const View w = e.weight(g + ".w");
              ops.accumulate(carry.data(), DType::f32, w.raw(), w.dtype(), w.count());
              e.release_weights(g);
            }
            for (int l = layers; l-- > 0;) {
              const auto g = fmt::format("layers.{}", l);
              e.fetch_weights(g);
              const View w = e.weight(g + ".w"), norm = e.weight(g + ".norm");
              if (e.is_active(g)) {
                const View slot = e.grad_slot(g + ".w");
                ops.accumulate(slot.raw(), slot.dtype(), carry.data(), DType::f32, slot.count());
                ops.accumulate(slot.raw(), slot.dtype(), w.raw(), w.dtype(), w.count());
                e.grad_ready(g + ".w");
                const View ns = e.grad_slot(g + ".norm");
                ops.accumulate(ns.raw(), ns.dtype(), norm.raw(), norm.dtype(), norm.count());
                e.grad_ready(g + ".norm");
              }
              ops.accumulate(carry.data(), DType::f32, w.raw(), w.dtype(), w.count());
              e.release_weights(g);
            }
          }
          const StepResult r = e.step();
          if (rank == 0) out.second.push_back(r.grad_norm);
          require_plan_held(e, "after a step");
        }
        e.set_active(e.groups(), DeactivatePolicy::keep_host);
        const TrainingState state_now = e.training_state(rank == 0);
        if (rank == 0) out.first = state_now;
      },
      cuda_backend());
  return out;
}

void require_same_run(const std::pair<TrainingState, std::vector<double>>& a,
                      const std::pair<TrainingState, std::vector<double>>& b) {
  REQUIRE(a.second == b.second);  // the norms, bit for bit
  REQUIRE(a.first.groups.size() == b.first.groups.size());
  for (std::size_t i = 0; i < a.first.groups.size(); ++i) {
    CAPTURE(a.first.groups[i].group);
    REQUIRE(a.first.groups[i].master == b.first.groups[i].master);
    REQUIRE(a.first.groups[i].state == b.first.groups[i].state);
  }
  REQUIRE(a.first.weights == b.first.weights);
}

}  // namespace

TEST_CASE("cuda: an update overlapping the next forward gives the bits of one that does not, "
          "weights on the device or on the host, on one rank and two") {
  for (int ranks : {1, 2})
    for (Placement weights : {Placement::device, Placement::host}) {
      CAPTURE(ranks, weights == Placement::host);
      require_same_run(fetching_run(weights, Placement::device, true, ranks, 4000),
                       fetching_run(weights, Placement::device, false, ranks, 4000));
    }
}

TEST_CASE("cuda: frozen weights on the host give the bits of frozen weights on the device") {
  for (Placement state : {Placement::device, Placement::host}) {
    CAPTURE(state == Placement::host);
    require_same_run(fetching_run(Placement::host, state), fetching_run(Placement::device, state));
  }
}
