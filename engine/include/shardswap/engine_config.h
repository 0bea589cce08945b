// What an Engine is asked to do: ZeRO stage, precision, layout, buckets, optimizer, scaling.
#pragma once

#include <cstddef>
#include <optional>
#include <string_view>

#include "shardswap/dtype.h"
#include "shardswap/loss_scaler.h"
#include "shardswap/optimizer_config.h"
#include "shardswap/layout_order.h"

namespace shardswap {

/// What a bf16 step does when the gradients hold Inf or NaN (fp16 always skips: overflow is
/// the dynamic loss scaler's signal to back off).
enum class NonFinitePolicy {
  skip,   ///< the step is not applied (weights, masters, optimizer state untouched), as fp16
  error,  ///< step() throws Error naming the step, after dropping the gradients
};
/// "skip", "error". Throws ConfigError "KEY = \"NAME\": expected skip or error" otherwise.
NonFinitePolicy nonfinite_policy_from_name(std::string_view name, std::string_view key);
const char* nonfinite_policy_name(NonFinitePolicy policy);

/// Where a kind of state lives.
enum class Placement {
  device,  ///< the rank's MemorySpace (the GPU on CUDA)
  host,    ///< host memory beside it (pinned or pageable: EngineConfig::pin_host_memory)
};
/// "device" or "host".
const char* placement_name(Placement placement);

/// How the update of state placed on the host runs.
enum class OffloadUpdate {
  streamed,  ///< master and state stream through two device slots: up, the device kernel, down
  cpu,       ///< on the CPU over its cores; the gradients come down, the bit16 weights go up
};
/// "streamed", "cpu". Throws ConfigError "KEY = \"NAME\": expected streamed or cpu" otherwise.
OffloadUpdate offload_update_from_name(std::string_view name, std::string_view key);
const char* offload_update_name(OffloadUpdate way);

struct EngineConfig {
  /// 1: fp32 master and optimizer state sharded, full bit16 gradients kept until the step.
  /// 2: gradients also sharded: reduced in buckets into their owners' partitions as they come.
  int stage = 2;
  DType dtype = DType::bf16;  ///< bit16 type of params (bf16 or fp16)
  /// Type gradients are accumulated and kept in: `dtype` (when unset), or fp32 (DeepSpeed's
  /// data_types.grad_accum_dtype).
  std::optional<DType> grad_dtype;
  /// Type gradients travel in (communication_data_type); unset: the gradient type, reduced in
  /// place. bf16/fp16 with fp32 gradients: compressed through one reused bucket-sized buffer, so
  /// peak memory grows by at most one bucket, whatever the model size.
  std::optional<DType> comm_dtype;
  DType grad_type() const { return grad_dtype.value_or(dtype); }
  DType comm_type() const { return comm_dtype.value_or(grad_type()); }
  bool compressed() const { return comm_type() != grad_type(); }
  std::size_t alignment_bytes = 256;
  /// Capacity of each of the two stage-2 reduce buckets, in bytes. (The JSON key
  /// zero_optimization.reduce_bucket_size counts elements, as in DeepSpeed.)
  std::size_t reduce_bucket_bytes = std::size_t{1} << 26;
  LayoutOrder order = LayoutOrder::declaration;  ///< round_robin_gradients in DeepSpeed
  /// Stage 2: a bucket's reduction runs alongside the backward that fills the next bucket
  /// (zero_optimization.overlap_comm); false waits for each reduction as it is issued.
  bool overlap_comm = true;
  /// shardswap.overlap_update: step() returns once the update is queued, on a stream of its own,
  /// so that the caller's next forward runs beside it. Engine::weight and fetch_weights order the
  /// calling thread's stream after their group's update, every other call that reads or writes
  /// the engine's buffers after the whole update; a View kept from before step() must be fetched
  /// again before it is read (the decoder asks for each layer's just before its use). Needs the
  /// optimizer state on the device. The same bits as false.
  bool overlap_update = false;
  /// Gradients are averaged over ranks and over this many micro-batches per step.
  int gradient_accumulation_steps = 1;
  double gradient_clipping = 0.0;  ///< max global norm; 0 turns clipping off
  OptimizerConfig optimizer;
  /// Used when dtype is fp16; bf16 runs use a static scale of 1.
  LossScaleConfig loss_scale;
  /// bf16 only (shardswap.nonfinite): skip the step or fail it when gradients are not finite.
  NonFinitePolicy nonfinite = NonFinitePolicy::skip;
  /// Where every group's fp32 master and optimizer state live, active or kept
  /// (zero_optimization.offload_optimizer.device: "cpu" is host). On the host the update runs
  /// as offload_update says, with the device kernel's arithmetic either way (the same bits).
  Placement optimizer_placement = Placement::device;
  /// shardswap.offload_update. streamed: master and state go up, a chunk of at most
  /// offload_chunk_elements at a time, into one of two device slots, are updated by the device
  /// kernel, and come down, the copies of one chunk overlapping the update of the next (1.9x the
  /// cpu way's rate on an NVIDIA H200 host with 16 cores, docs/benchmarks.md). cpu: the gradient
  /// partition comes down and the updated bit16 shard goes up through two host staging buffers,
  /// the CPU updating in between over offload_threads threads.
  OffloadUpdate offload_update = OffloadUpdate::streamed;
  /// Where the active groups' gradient buffers live (shardswap.gradient_placement). host: in host
  /// memory (pinned as pin_host_memory says), the device holding two windows of them that grad
  /// slots point into, each filled from the host when it opens and written back when it moves,
  /// so the sums are the device's, bit for bit; the step reads them through the update's device
  /// slots. Needs optimizer_placement = host and one rank.
  Placement gradient_placement = Placement::device;
  /// Where frozen groups' bit16 weights live (shardswap.frozen_weight_placement). host: every
  /// group's weights have a home in host memory (pinned as pin_host_memory says); an active
  /// group's are on the device too (the step updates them there; its home is written when it is
  /// deactivated), a frozen group's only on the host. A frozen group's weights reach the device
  /// through two windows, each as large as the largest group: Engine::fetch_weights fills one
  /// (and the other, ahead, with the next frozen group the same way) and weight() points into it
  /// until release_weights. For LISA's middle layers on a device that cannot hold them all.
  Placement frozen_weight_placement = Placement::device;
  /// Host memory of the engine's state (offloaded, or kept under keep_host) is page-locked
  /// (offload_optimizer.pin_memory): copies to and from the GPU run at full PCIe bandwidth. False:
  /// pageable memory, which the system may swap; CUDA copies through its own bounce buffer.
  /// No effect on the CPU backend.
  bool pin_host_memory = true;
  /// Elements per chunk of an offloaded update: the size of its slots or staging buffers (capped
  /// at the largest shard when build() runs).
  std::size_t offload_chunk_elements = std::size_t{1} << 24;
  /// Threads of the update on the host (shardswap.offload_threads); 0: every core the machine
  /// has. Ranks sharing a machine should split its cores between them.
  unsigned offload_threads = 0;

  /// Throws ConfigError "NAME = VALUE: what is wrong" for the first bad value, NAME being its
  /// field, in the field's unit ("EngineConfig.reduce_bucket_bytes = 128 bytes: ...",
  /// "EngineConfig.optimizer.lr = -0.1: ..."). The Engine constructor calls it.
  void validate() const;
  /// The same, naming the JSON key under `prefix` in the key's unit
  /// ("zero_optimization.reduce_bucket_size = 64 elements: ...", "optimizer.params.lr"; dtype,
  /// which the JSON gives as bf16.enabled / fp16.enabled, is named "dtype"): for a config read
  /// from JSON.
  void validate(std::string_view prefix) const;
};

}  // namespace shardswap
