// Update rules on flat shards: one fused pass per shard reads the fp32 master, the optimizer
// state and the bit16 gradient (upcast in registers, never copied to fp32) and writes the master,
// the state and the bit16 param copy.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "shardswap/dtype.h"
#include "shardswap/optimizer_config.h"

namespace shardswap {

/// Per-step scalars of one shard update.
struct StepArgs {
  std::int64_t step = 1;      ///< this group's step count after this update (1 for the first)
  double lr = 1e-3;           ///< learning rate of this step (after any schedule)
  double weight_decay = 0.0;  ///< this group's weight decay
  float grad_scale = 1.0f;    ///< multiplies each upcast gradient: 1 / (loss scale * ranks *
                              ///< micro-steps), times the clipping coefficient
};

/// The tensors of one shard update, `count` elements each. `state0`/`state1` are the optimizer
/// state slots (nullptr when the rule has fewer), of `state_dtype`: fp32, or bf16 (read into fp32,
/// updated in fp32 and stored rounded to nearest even; the master update uses the fp32 values of
/// this step, so from the same inputs it gives the fp32 state's master and param bits). `param` is
/// bit16 of `dtype`; `grad` is of `grad_dtype`: the same bit16 type, or fp32 when gradients are
/// accumulated in fp32. The master is `master` (fp32 values) or, when the config's master is
/// MasterStorage::bf16_remainder, `master_low`: the low 16 bits of each fp32 master value, whose
/// high bits are the bf16 `param`'s (master_split.h); the update reads both and writes both.
struct ShardTensors {
  float* master = nullptr;
  void* state0 = nullptr;
  void* state1 = nullptr;
  const void* grad = nullptr;
  void* param = nullptr;
  DType dtype = DType::bf16;
  DType grad_dtype = DType::bf16;
  std::size_t count = 0;
  DType state_dtype = DType::f32;
  std::uint16_t* master_low = nullptr;  ///< last: positional initializers end before it
};

/// One stretch of a shard update whose fp32 master and state live in host memory (`t.master`,
/// `t.state0`, `t.state1`) while the gradient and the bit16 param are in the backend's memory
/// (`t.grad`, `t.param`), with its own step arguments (a group's step count, a weight decay).
/// With StreamedTensors::slot_grad set, `t.grad` is in host memory too and goes up with them.
struct StreamedPiece {
  StepArgs args;
  ShardTensors t;
};

/// Pieces streamed through two slots in the backend's memory, `chunk` elements each (state slots
/// null where the rule has fewer), one chunk at a time: up, the fused update, down. The pieces
/// form one pipeline: chunk k of all of them, in order, goes through slot k % 2.
struct StreamedTensors {
  std::vector<StreamedPiece> pieces;
  void* slot_master[2] = {nullptr, nullptr};  ///< fp32 masters, or their low halves
  void* slot_state0[2] = {nullptr, nullptr};  ///< of the pieces' state_dtype (one for all)
  void* slot_state1[2] = {nullptr, nullptr};
  /// Null: the pieces' gradients are in the backend's memory. Set: they are in host memory and
  /// go up into these (of the pieces' grad_dtype), never down.
  void* slot_grad[2] = {nullptr, nullptr};
  std::size_t chunk = 0;
};

/// `count` elements in a backend's memory, from `data`.
struct ConstSpan {
  const void* data = nullptr;
  std::size_t count = 0;
};

/// The kernels one backend provides, on that backend's memory. Capabilities are data: the engine
/// calls through this table and never asks which backend it runs on. Kernels of a device backend
/// are queued on the calling thread's stream (cudaStreamPerThread; between begin_side and end_side
/// its side stream) in call order; a function giving a value (sum_squares, has_inf_or_nan) waits
/// for its result.
/// "any" below means fp32, bf16 or fp16; conversions round to nearest even.
struct DeviceOps {
  const char* name;
  /// The fused update (Adam, AdamW or SGD per config) of one shard, in one pass.
  void (*update)(const OptimizerConfig& config, const StepArgs& args, const ShardTensors& t);
  /// update() of a shard streamed through slots (StreamedTensors), with the bits update() gives
  /// in place. Returns when the host's master and state hold the result; on CUDA the copies of
  /// one chunk overlap the update of the next (two copy streams, ordered by events).
  void (*update_streamed)(const OptimizerConfig& config, const StreamedTensors& s);
  /// sums[i] = the sum over spans[i]'s elements x of (double(x) * scale)^2, every span of
  /// `dtype` (any); Inf/NaN make a sum non-finite. A device backend queues the spans' reductions
  /// together and waits once for a batch of them (not once a span: the engine's gradient norm
  /// sums every group's partition), each sum the bits it has alone.
  void (*sum_squares)(const ConstSpan* spans, std::size_t n, DType dtype, double scale,
                      double* sums);
  /// True if any of the `count` values (any dtype) is Inf or NaN.
  bool (*has_inf_or_nan)(const void* data, DType dtype, std::size_t count);
  /// dst[i] = dst_dtype(src[i]), both of any dtype.
  void (*cast)(void* dst, DType dst_dtype, const void* src, DType src_dtype, std::size_t count);
  /// dst[i] = dst_dtype(float(dst[i]) + float(src[i])), both of any dtype: accumulates a reduced
  /// gradient into a partition.
  void (*accumulate)(void* dst, DType dst_dtype, const void* src, DType src_dtype,
                     std::size_t count);
  void (*fill_zero)(void* dst, std::size_t bytes);
  /// Copy within the backend's memory.
  void (*copy)(void* dst, const void* src, std::size_t bytes);
  /// Waits until every kernel this thread queued has finished (no-op on the CPU).
  void (*synchronize)();
  /// Copies `bytes` between host memory and the backend's, either way, on this thread's copy
  /// queue: after the work the thread queued so far on its stream, in order with the queue's
  /// other copies, the caller not waiting (the CPU backend copies at once). Returns the copy's
  /// mark, counting up from 1.
  std::uint64_t (*queue_copy)(void* dst, const void* src, std::size_t bytes);
  /// Makes this thread's stream wait until the queued copy `mark` (and every one before it) is
  /// done; 0 waits for nothing.
  void (*await_copy)(std::uint64_t mark);
  /// Waits on the host until every copy this thread queued is done.
  void (*finish_copies)();
  /// Until end_side, queues this thread's later work (kernels, copies, collectives) on its side
  /// stream, after the work queued so far on its stream, so that what the caller queues on its
  /// stream meanwhile runs beside it: the engine's update beside the next forward
  /// (EngineConfig::overlap_update). The CPU backend runs all work at once; there these four
  /// only count the marks.
  void (*begin_side)();
  void (*end_side)();
  /// Marks the side work queued so far (between begin_side and end_side); returns the mark,
  /// counting up from 1.
  std::uint64_t (*mark_side)();
  /// Makes this thread's stream wait until side mark `mark` is done; 0 waits for nothing.
  void (*await_side)(std::uint64_t mark);
};

/// The CPU backend (Eigen), always present.
const DeviceOps& cpu_device_ops();
/// The CUDA backend. Throws BackendUnavailable in a build without CUDA.
const DeviceOps& cuda_device_ops();

/// Gradient clipping by global norm: max_norm / (norm + 1e-6) when norm > max_norm > 0, else 1.
double clip_coefficient(double total_norm, double max_norm);

}  // namespace shardswap
