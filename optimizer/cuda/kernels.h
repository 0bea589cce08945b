// Launchers of the CUDA optimizer kernels (kernels.cu), declared in plain C++ so that backend.cpp,
// compiled by the host compiler, calls them while Eigen and fmt (which nvcc handles badly) stay
// out of the .cu file. Every launch is queued on the thread's work stream (support/work_stream.h) and
// checked; none waits for the kernel.
#pragma once

#include <cstddef>

#include "optimizer/update_scalars.h"

namespace shardswap::detail {

/// The element types the kernels read and write (DType without fp64).
enum class Elem { f32, bf16, f16 };

/// One shard update: `param` is bf16 or fp16, `grad` of the same type or fp32; the state fp32 or
/// bf16 (read into fp32, stored rounded to nearest even); `state0` is null for SGD without
/// momentum (and then never touched). `master` holds fp32 values, or with `master_low` (bf16
/// params only) the low halves of the fp32 masters whose high halves are the params
/// (optimizer/master_split.h).
struct UpdateLaunch {
  void* master;
  void* state0;
  void* state1;
  const void* grad;
  void* param;
  Elem param_elem;
  Elem grad_elem;
  std::size_t count;  ///< > 0
  Elem state_elem;
  bool master_low;
};

void launch_adam(const AdamScalars& s, const UpdateLaunch& t);
void launch_sgd(const SgdScalars& s, const UpdateLaunch& t);

/// The most spans one launch_sum_squares call takes (its table travels as a kernel argument).
constexpr int kMaxSquaresSpans = 64;

/// One launch for up to kMaxSquaresSpans spans of n elements of type e: span i is cut into
/// blocks[i] <= max_blocks blocks as a launch of its own would cut it (the same sums in the same
/// order), and its block b writes the sum over its elements of (double(x) * scale)^2 to
/// partials[i * max_blocks + b], in memory the device can write (pinned host memory). An empty
/// span gets no block (blocks[i] = 0).
void launch_sum_squares(const void* const* data, const std::size_t* counts, int n, Elem e,
                        double scale, double* partials, int max_blocks, int* blocks);
/// Block b writes 1 to flags[b] if one of its elements is Inf or NaN, else 0.
int launch_find_inf_or_nan(const void* x, Elem e, std::size_t count, int* flags, int max_blocks);

/// dst[i] = dst_e(float(src[i])); the two types differ.
void launch_cast(void* dst, Elem dst_e, const void* src, Elem src_e, std::size_t count);
/// dst[i] = dst_e(float(dst[i]) + float(src[i])).
void launch_accumulate(void* dst, Elem dst_e, const void* src, Elem src_e, std::size_t count);

}  // namespace shardswap::detail
