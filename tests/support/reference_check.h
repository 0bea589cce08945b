// The float64 reference check of the sharded engine, shared by the CPU and GPU suites.
#pragma once

#include <optional>

#include "shardswap/backend.h"
#include "shardswap/engine.h"

namespace shardswap::test_support {

struct Case {
  int world_size;
  int stage;
  DType dtype;
  OptimizerType optimizer;
  LayoutOrder order = LayoutOrder::declaration;
  /// NCCL instead of in-process ranks: world size 1 on the backend's GPU, or one process driving
  /// GPUs 0..world_size-1, a thread per rank (the backend's allocator is then not used).
  bool nccl = false;
  /// A rank of a multi-process group (mpirun): this process runs rank comm->rank() of
  /// world_size on the calling thread's current GPU; masters and weights are compared across
  /// ranks through `comm` (every rank must make the same checks). Takes precedence over `nccl`.
  Communicator* comm = nullptr;
  bool overlap_comm = true;  ///< EngineConfig::overlap_comm
  std::optional<DType> grad_dtype = {};  ///< fp32: gradients accumulated in fp32
  std::optional<DType> comm_dtype = {};  ///< bf16/fp16 with fp32 gradients: compression
  /// Layer switching: (step, active groups) in increasing steps, the first at step 0 (the groups
  /// active at build); the last entry must make every group active (the check reads masters).
  /// Groups: embed, layers.0, layers.1, head. Empty: every group active throughout.
  std::vector<std::pair<int, std::vector<std::string>>> switches = {};
  DeactivatePolicy policy = DeactivatePolicy::drop;
  /// EngineConfig::optimizer_placement, and the offload chunk (small: chunks really cycle).
  Placement optimizer_placement = Placement::device;
  OffloadUpdate offload_update = OffloadUpdate::streamed;
  std::size_t offload_chunk_elements = 100;
  /// OptimizerConfig::state_dtype: bf16 stores m and v (SGD's buffer) rounded after every step,
  /// as the reference does. Its tolerance is wider (1e-4): a value within a float rounding of a
  /// bf16 tie rounds the other way in double, one bf16 ulp (2^-8) of that element's m or v; the
  /// check then also requires the engine to lie four times further from the fp32 state's
  /// reference (it has teeth). tests/optimizer_test.cpp holds the kernels to the bits of a
  /// per-element float reference.
  DType state_dtype = DType::f32;
  /// OptimizerConfig::master: bf16_remainder keeps the same fp32 masters (the reference's
  /// tolerance); the weights are then checked against the masters' high halves (ties rounded
  /// away from zero) instead of rounding to nearest even.
  MasterStorage master = MasterStorage::fp32;
};

/// A schedule over the reference model's groups that drops, brings back and finally reactivates
/// every group (shared by the CPU and GPU suites).
inline std::vector<std::pair<int, std::vector<std::string>>> switching_schedule() {
  return {{0, {"head", "layers.0"}},
          {4, {"head", "layers.1"}},
          {9, {"embed", "head", "layers.0"}},
          {14, {"embed", "head", "layers.0", "layers.1"}}};
}

/// The cases every multi-GPU mode checks (several processes, or one driving several GPUs):
/// stages 1 and 2, bf16 and fp16, with and without overlap, layer switching, compression. Bit16
/// sums are exact only for two ranks (NCCL rounds at each hop, the reference once), so wider
/// worlds accumulate and reduce fp32 gradients, whose sums of these values are exact.
std::vector<Case> multi_gpu_cases(int world_size);

/// Runs 20 steps of the engine on `backend` and REQUIREs its fp32 masters to match an unsharded
/// float64 reference (normalized error <= 1e-6), its bit16 weights to be its masters rounded, and
/// every rank's weights to agree.
void check_against_reference(const Case& c, const Backend& backend);

}  // namespace shardswap::test_support
