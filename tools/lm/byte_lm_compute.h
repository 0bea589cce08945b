// The seam between the engine-facing ByteLm (byte_lm.cpp: names, grad slots, frozen groups) and
// its compute backends (the CPU one in byte_lm.cpp, the CUDA one in byte_lm_cuda.cu). C++17 and
// free of Eigen and the engine so that nvcc compiles it: weights and slots travel as raw pointers
// (device pointers for CUDA), the batch as host bytes.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "shardswap/dtype.h"

namespace shardswap::lm {

inline constexpr int kVocab = 256;

/// ByteLmShape without the engine's headers.
struct Dims {
  int context = 0, width = 0, hidden = 0, depth = 0;
};

/// A param by its place in the model. Backward emits, per layer from the top: fc2 bias, fc2
/// weight, fc1 bias, fc1 weight, norm bias, norm weight (the reverse of declaration order).
enum class ParamKind {
  embed,
  norm_weight,
  norm_bias,
  fc1_weight,
  fc1_bias,
  fc2_weight,
  fc2_bias,
  final_norm_weight,
  final_norm_bias,
  head_weight,
};
struct ParamId {
  ParamKind kind;
  int layer = -1;  ///< for the layer params
};

struct LayerWeights {
  const void* norm_weight = nullptr;
  const void* norm_bias = nullptr;
  const void* fc1_weight = nullptr;
  const void* fc1_bias = nullptr;
  const void* fc2_weight = nullptr;
  const void* fc2_bias = nullptr;
};

/// Every weight, all of `dtype` (bf16 or fp16).
struct Weights {
  DType dtype = DType::bf16;
  const void* embed = nullptr;
  std::vector<LayerWeights> layers;
  const void* final_norm_weight = nullptr;
  const void* final_norm_bias = nullptr;
  const void* head_weight = nullptr;
};

struct GradSlot {
  void* data = nullptr;
  DType dtype = DType::f32;  ///< the weights' dtype or fp32
};

/// Where backward puts gradients. Groups by index: 0 embed, 1 + i layers.i, depth + 1 head.
class GradSink {
 public:
  virtual ~GradSink() = default;
  virtual bool active(int group) const = 0;
  /// The slot to add the param's gradient into, asked for just before it is written.
  virtual GradSlot open(ParamId param) = 0;
  /// The gradient in the slot is complete (on a device: queued on the calling thread's stream).
  virtual void close(ParamId param) = 0;
};

/// The lowest group that backward must reach (below it no gradient is wanted): 0 embed, 1 + i
/// layers.i, depth + 1 head; depth + 2 when every group is frozen.
inline int lowest_active_group(const GradSink& sink, int depth) {
  int group = 0;
  while (group <= depth + 1 && !sink.active(group)) ++group;
  return group;
}

/// Host bytes: size * context, then size targets. 1 <= size <= max_batch (checked by ByteLm).
struct Batch {
  int size = 0;
  const std::uint8_t* context = nullptr;
  const std::uint8_t* target = nullptr;
};

class Compute {
 public:
  virtual ~Compute() = default;
  /// Forward and backward: adds grad_scale times the gradient of the mean loss into the slots
  /// of the active groups, in backward order, and down to the lowest active group only.
  /// Returns the mean loss.
  virtual double train_step(const Weights& w, const Batch& batch, double grad_scale,
                            GradSink& sink) = 0;
  virtual double loss(const Weights& w, const Batch& batch) = 0;
};

/// Carves one block into regions, each starting at a multiple of 256 bytes; the total is what
/// the model allocates, so planning and allocating cannot disagree.
class Arena {
 public:
  template <class T>
  std::size_t take(std::size_t count) {
    const std::size_t at = bytes_;
    bytes_ += (count * sizeof(T) + 255) / 256 * 256;
    return at;
  }
  std::size_t bytes() const { return bytes_; }

 private:
  std::size_t bytes_ = 0;
};

/// Samples per block of the first pass of the deterministic column sums (bias and norm
/// gradients): partial sums of this many rows, then one ordered sum of the partials.
inline constexpr int kRowsPerPartial = 64;
/// cuBLAS workspace, handed to cuBLAS from the activation block so that it allocates none
/// itself (32 MiB: cuBLAS's own default on Hopper).
inline constexpr std::size_t kCublasWorkspaceBytes = std::size_t{32} << 20;

/// Byte offsets of the CUDA backend's regions for `n` = max_batch samples. bit16 (2-byte)
/// regions are GEMM inputs; the residual stream and GEMM outputs are fp32.
struct CudaLayout {
  std::size_t context, target;         // uint8: n * c, n
  std::size_t hs;                      // f32: (depth + 1) * n * d, h_0 .. h_L
  std::size_t ln_y, ln_mean, ln_rstd;  // per layer: b16 n * d, f32 n, f32 n
  std::size_t u, a;                    // per layer: f32 n * h (fc1 + bias), b16 n * h (gelu)
  std::size_t fy, fmean, frstd;        // final norm: b16 n * d, f32 n, f32 n
  std::size_t logits, dlogits;         // f32 n * 256, b16 n * 256
  std::size_t sample_loss, mean_loss;  // f32 n, f64 1
  std::size_t dh, dh16, dy, da, du16;  // f32 n*d, b16 n*d, f32 n*d, f32 n*h, b16 n*h
  std::size_t partials;                // f32 2 * ceil(n / kRowsPerPartial) * max(d, h)
  std::size_t workspace;               // kCublasWorkspaceBytes
  std::size_t bytes;                   // total
};

inline CudaLayout cuda_layout(const Dims& s, int max_batch) {
  using b16 = std::uint16_t;
  const auto n = static_cast<std::size_t>(max_batch), c = static_cast<std::size_t>(s.context),
             d = static_cast<std::size_t>(s.width), h = static_cast<std::size_t>(s.hidden),
             depth = static_cast<std::size_t>(s.depth), v = static_cast<std::size_t>(kVocab);
  const std::size_t chunks = (n + kRowsPerPartial - 1) / kRowsPerPartial;
  Arena a;
  CudaLayout l{};
  l.context = a.take<std::uint8_t>(n * c);
  l.target = a.take<std::uint8_t>(n);
  l.hs = a.take<float>((depth + 1) * n * d);
  l.ln_y = a.take<b16>(depth * n * d);
  l.ln_mean = a.take<float>(depth * n);
  l.ln_rstd = a.take<float>(depth * n);
  l.u = a.take<float>(depth * n * h);
  l.a = a.take<b16>(depth * n * h);
  l.fy = a.take<b16>(n * d);
  l.fmean = a.take<float>(n);
  l.frstd = a.take<float>(n);
  l.logits = a.take<float>(n * v);
  l.dlogits = a.take<b16>(n * v);
  l.sample_loss = a.take<float>(n);
  l.mean_loss = a.take<double>(1);
  l.dh = a.take<float>(n * d);
  l.dh16 = a.take<b16>(n * d);
  l.dy = a.take<float>(n * d);
  l.da = a.take<float>(n * h);
  l.du16 = a.take<b16>(n * h);
  l.partials = a.take<float>(2 * chunks * std::max(d, h));
  l.workspace = a.take<std::byte>(kCublasWorkspaceBytes);
  l.bytes = a.bytes();
  return l;
}

// Defined in byte_lm_cuda.cu, or in the stub of a build without CUDA (which throws
// BackendUnavailable):

/// The CUDA backend on the block [memory, memory + bytes) of the current device, bytes ==
/// cuda_layout(dims, max_batch).bytes.
std::unique_ptr<Compute> make_cuda_compute(const Dims& dims, int max_batch, DType dtype,
                                           void* memory, std::size_t bytes);
/// measure_cublas_gemm_tflops (byte_lm.h) once byte_lm.cpp has checked its arguments.
double cublas_gemm_tflops(int m, int n, int k, DType dtype);

}  // namespace shardswap::lm
