// The built-in byte-level language model: an MLP n-gram LM over bytes (no attention).
//   h0 = sum_j E[j*256 + byte_j]                      (one embedding table per context slot)
//   h_{i+1} = h_i + fc2(gelu(fc1(LayerNorm(h_i))))     (GELU tanh form, LayerNorm eps 1e-5)
//   logits = head(LayerNorm(h_L)); loss = mean cross-entropy of the next byte
// Groups: "embed", "layers.0" .. "layers.{depth-1}", "head". Params are row-major [out, in].
// One ByteLm per rank computes forward and backward on the host (Eigen, fp32) or on a CUDA
// device (cuBLAS, bit16 GEMM inputs, fp32 residual stream), reading the engine's bit16 weights in
// place and adding gradients into its grad slots as backward produces them.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "shardswap/engine.h"
#include "shardswap/allocator.h"
#include "shardswap/dtype.h"

namespace shardswap {

struct ByteLmShape {
  int context = 8;   ///< bytes of context per sample (c)
  int width = 128;   ///< residual stream (d)
  int hidden = 512;  ///< MLP hidden size (h)
  int depth = 4;     ///< residual blocks
};

/// Throws ConfigError naming the first field that is not positive.
void validate_byte_lm_shape(const ByteLmShape& shape);

/// `size` samples: `context` bytes each and the byte that follows.
struct TokenBatch {
  int size = 0;
  std::vector<std::uint8_t> context;  ///< size * shape.context, row-major (sample, slot)
  std::vector<std::uint8_t> target;   ///< size
};

/// "embed", "layers.0", ..., "head": the declaration order.
std::vector<std::string> byte_lm_groups(const ByteLmShape& shape);
std::int64_t byte_lm_param_count(const ByteLmShape& shape);
/// GEMM flops of one forward + backward over `batch` samples with every group active (2 per
/// multiply-add; the embedding lookup, norms and the softmax are not counted), for reporting
/// achieved TFLOP/s.
double byte_lm_step_flops(const ByteLmShape& shape, int batch);

class ByteLm {
 public:
  virtual ~ByteLm() = default;

  /// Declares every param with its group, in forward order (backward emits them in reverse).
  static void declare(const ByteLmShape& shape, Engine& engine);
  /// Initial values, a pure function of (seed, param name): embed N(0, 0.02); fc weights
  /// uniform(+-1/sqrt(fan_in)), fc2 further divided by sqrt(2 depth); norm weights 1; biases 0;
  /// head uniform(+-1/sqrt(width)). The same on every platform (no std:: distributions).
  static void init(const ByteLmShape& shape, const ParamInfo& param, std::span<float> values,
                   std::uint64_t seed);

  /// Forward + backward of one micro-batch (1 <= size <= max_batch): adds loss_scale() times the
  /// gradient of the mean loss into the engine's grad slots of the active groups, calling
  /// grad_slot(name) just before writing a param's gradient and grad_ready(name) right after, in
  /// backward order (head first, embed last). Backward stops below the lowest active group.
  /// Returns the mean loss. Throws ConfigError for a malformed batch or weights / gradient slots
  /// of a dtype this model was not made for.
  virtual double train_step(Engine& engine, const TokenBatch& batch) = 0;
  /// Mean loss only (validation); no gradients.
  virtual double loss(const Engine& engine, const TokenBatch& batch) = 0;

  /// Exact bytes of Tag::activation (requested) the model made by make_byte_lm for `max_batch`
  /// holds in its MemorySpace: activations, backward scratch and, on CUDA, the cuBLAS workspace.
  static std::int64_t activation_bytes(const ByteLmShape& shape, int max_batch, DType dtype,
                                       DeviceKind device);
};

/// CPU (Eigen) when space.device() is the host, CUDA (cuBLAS) when it is a CUDA device. All
/// activation and workspace memory is allocated once, here, from `space` with Tag::activation
/// (activation_bytes() of it, exactly). `dtype` is the weights' (the engine's config dtype: bf16
/// or fp16). Throws ConfigError for a bad shape, max_batch < 1 or a dtype that is not bit16;
/// BackendUnavailable for a CUDA space in a build without CUDA.
std::unique_ptr<ByteLm> make_byte_lm(const ByteLmShape& shape, int max_batch, DType dtype,
                                     MemorySpace& space);

/// The rate of a bit16 GEMM (m x k times k x n, fp32 accumulation) through cuBLAS on the
/// current device, in TFLOP/s: a few warm-up calls, then the mean of several timed ones on
/// random data. Its buffers are cudaMalloc'ed for the call and freed (outside any MemorySpace).
/// Throws ConfigError for a non-positive size or a dtype that is not bit16; BackendUnavailable
/// in a build without CUDA.
double measure_cublas_gemm_tflops(int m, int n, int k, DType dtype);

}  // namespace shardswap
