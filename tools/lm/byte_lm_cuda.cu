// The byte LM's CUDA backend. Every linear layer is a cuBLAS GEMM (cublasGemmEx, bit16 inputs,
// fp32 accumulation); weight gradients are written by the GEMM straight into the engine's grad
// slot (beta = 1, alpha = loss scale / batch). Small kernels do the rest: embedding gather,
// LayerNorm, bias + GELU, softmax cross-entropy, bias and norm gradients, the embedding gradient.
//
// Precision: the residual stream, GEMM outputs and every reduction are fp32; GEMM inputs
// (activations and their gradients) are rounded to the weights' bit16 type. Activation
// gradients are those of the summed loss, O(1) per sample whatever the batch or loss scale, so
// fp16 neither underflows nor overflows there; loss scale / batch enters only where a param
// gradient is written.
//
// Reproducibility: no atomics anywhere. Sums over samples (bias and norm gradients) are fixed
// two-pass trees (partials of kRowsPerPartial rows, then the partials in order); the embedding
// gradient is one warp per table row, summing the samples that hit it in sample order; cuBLAS is
// deterministic for a given handle, stream and workspace. Two runs give the same bits.
//
// Ordering: everything is queued on cudaStreamPerThread (the engine's contract); the host
// waits only to read the loss back at the end of a call.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>

#include "memory/cuda/cuda_check.h"
#include "shardswap/error.h"
#include "tools/lm/byte_lm_compute.h"
#include "tools/lm/cublas_check.cuh"

namespace shardswap {
namespace lm {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kWarpsPerBlock = 8;
constexpr float kLnEps = 1e-5f;

// ---- element conversions ----

__device__ __forceinline__ float to_float(float x) {
  return x;
}
__device__ __forceinline__ float to_float(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
__device__ __forceinline__ float to_float(__half x) {
  return __half2float(x);
}

template <class T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}

template <class T>
constexpr cudaDataType_t cuda_type();
template <>
constexpr cudaDataType_t cuda_type<__nv_bfloat16>() {
  return CUDA_R_16BF;
}
template <>
constexpr cudaDataType_t cuda_type<__half>() {
  return CUDA_R_16F;
}

cudaDataType_t cuda_type_of(DType t) {
  switch (t) {
    case DType::f32:
      return CUDA_R_32F;
    case DType::bf16:
      return CUDA_R_16BF;
    case DType::f16:
      return CUDA_R_16F;
    default:
      break;
  }
  throw ConfigError(std::string("byte LM (cuda): dtype ") + dtype_name(t) +
                    " is not fp32, bf16 or fp16");
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int offset = 16; offset > 0; offset >>= 1)
    v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offset));
  return v;
}

__device__ __forceinline__ float gelu_tanh(float x) {
  constexpr float k = 0.7978845608028654f;  // sqrt(2 / pi)
  return tanhf(k * (x + 0.044715f * x * x * x));
}

// ---- kernels (n samples; row-major [sample, feature] activations) ----

// h0[s, k] = sum_j E[j * 256 + ctx[s, j], k]
template <class T>
__global__ void embed_forward(const T* __restrict__ table, const std::uint8_t* __restrict__ ctx,
                              int n, int c, int d, float* __restrict__ h0) {
  const long long count = static_cast<long long>(n) * d;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const long long s = i / d, k = i % d;
    float acc = 0.0f;
    for (int j = 0; j < c; ++j)
      acc += to_float(table[(static_cast<long long>(j) * kVocab + ctx[s * c + j]) * d + k]);
    h0[i] = acc;
  }
}

// One warp per row: y = (x - mean) / std * g + b in T; keeps mean and 1/std.
template <class T>
__global__ void layer_norm_forward(const float* __restrict__ x, const T* __restrict__ g,
                                   const T* __restrict__ b, int n, int d, T* __restrict__ y,
                                   float* __restrict__ mean, float* __restrict__ rstd) {
  const int row = blockIdx.x * kWarpsPerBlock + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= n) return;
  const float* xr = x + static_cast<long long>(row) * d;
  float sum = 0.0f;
  for (int k = lane; k < d; k += 32) sum += xr[k];
  const float m = warp_sum(sum) / d;
  float sq = 0.0f;
  for (int k = lane; k < d; k += 32) sq += (xr[k] - m) * (xr[k] - m);
  const float r = rsqrtf(warp_sum(sq) / d + kLnEps);
  T* yr = y + static_cast<long long>(row) * d;
  for (int k = lane; k < d; k += 32)
    yr[k] = from_float<T>((xr[k] - m) * r * to_float(g[k]) + to_float(b[k]));
  if (lane == 0) {
    mean[row] = m;
    rstd[row] = r;
  }
}

// One warp per row, given dy at the norm's output: dx (= or +=) the gradient at its input.
template <class T>
__global__ void layer_norm_backward(const float* __restrict__ dy, const float* __restrict__ x,
                                    const float* __restrict__ mean, const float* __restrict__ rstd,
                                    const T* __restrict__ g, int n, int d, float* __restrict__ dx,
                                    bool accumulate) {
  const int row = blockIdx.x * kWarpsPerBlock + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= n) return;
  const long long base = static_cast<long long>(row) * d;
  const float m = mean[row], r = rstd[row];
  float s1 = 0.0f, s2 = 0.0f;
  for (int k = lane; k < d; k += 32) {
    const float dxhat = dy[base + k] * to_float(g[k]);
    s1 += dxhat;
    s2 += dxhat * (x[base + k] - m) * r;
  }
  const float m1 = warp_sum(s1) / d, m2 = warp_sum(s2) / d;
  for (int k = lane; k < d; k += 32) {
    const float xhat = (x[base + k] - m) * r;
    const float v = r * (dy[base + k] * to_float(g[k]) - m1 - xhat * m2);
    dx[base + k] = accumulate ? dx[base + k] + v : v;
  }
}

// u[s, m] += b1[m]; a = gelu(u) in T.
template <class T>
__global__ void bias_gelu(float* __restrict__ u, const T* __restrict__ bias, int n, int h,
                          T* __restrict__ a) {
  const long long count = static_cast<long long>(n) * h;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const float v = u[i] + to_float(bias[i % h]);
    u[i] = v;
    a[i] = from_float<T>(0.5f * v * (1.0f + gelu_tanh(v)));
  }
}

// next (holding fc2's output) += prev + b2.
template <class T>
__global__ void residual_bias(float* __restrict__ next, const float* __restrict__ prev,
                              const T* __restrict__ bias, int n, int d) {
  const long long count = static_cast<long long>(n) * d;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<long long>(gridDim.x) * blockDim.x)
    next[i] += prev[i] + to_float(bias[i % d]);
}

// da *= gelu'(u) (fp32, for the bias gradient) and du16 = T(da) (the GEMM input).
template <class T>
__global__ void gelu_backward(float* __restrict__ da, const float* __restrict__ u,
                              T* __restrict__ du16, long long count) {
  constexpr float k = 0.7978845608028654f;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const float x = u[i], t = gelu_tanh(x);
    const float grad =
        0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * k * (1.0f + 3.0f * 0.044715f * x * x);
    const float v = da[i] * grad;
    da[i] = v;
    du16[i] = from_float<T>(v);
  }
}

template <class T>
__global__ void to_bit16(const float* __restrict__ x, T* __restrict__ y, long long count) {
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<long long>(gridDim.x) * blockDim.x)
    y[i] = from_float<T>(x[i]);
}

// One warp per sample: loss = logsumexp(z) - z[target]; dz = softmax(z) - onehot (the gradient
// of the summed loss) in T when dz is not null.
template <class T>
__global__ void cross_entropy(const float* __restrict__ logits, const std::uint8_t* __restrict__ t,
                              int n, float* __restrict__ loss, T* __restrict__ dz) {
  constexpr int kPerLane = kVocab / 32;
  const int row = blockIdx.x * kWarpsPerBlock + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= n) return;
  const float* z = logits + static_cast<long long>(row) * kVocab;
  float v[kPerLane];
  float m = -INFINITY;
  for (int q = 0; q < kPerLane; ++q) {
    v[q] = z[lane + 32 * q];
    m = fmaxf(m, v[q]);
  }
  m = warp_max(m);
  float sum = 0.0f;
  for (int q = 0; q < kPerLane; ++q) sum += expf(v[q] - m);
  const float lse = m + logf(warp_sum(sum));
  const int target = t[row];
  if (lane == 0) loss[row] = lse - z[target];
  if (dz == nullptr) return;
  T* out = dz + static_cast<long long>(row) * kVocab;
  for (int q = 0; q < kPerLane; ++q) {
    const int col = lane + 32 * q;
    out[col] = from_float<T>(expf(v[q] - lse) - (col == target ? 1.0f : 0.0f));
  }
}

// One block: out = mean of loss[0..n) in double, by a fixed tree.
__global__ void mean_of(const float* __restrict__ loss, int n, double* __restrict__ out) {
  __shared__ double partial[256];
  double acc = 0.0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) acc += loss[i];
  partial[threadIdx.x] = acc;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
    if (threadIdx.x < stride) partial[threadIdx.x] += partial[threadIdx.x + stride];
    __syncthreads();
  }
  if (threadIdx.x == 0) *out = partial[0] / n;
}

// First pass of a column sum of x [n, w]: partials[chunk * stride + k] = sum over the chunk's
// kRowsPerPartial rows.
__global__ void column_partials(const float* __restrict__ x, int n, int w,
                                float* __restrict__ partials, int stride) {
  const int k = blockIdx.y * blockDim.x + threadIdx.x, chunk = blockIdx.x;
  if (k >= w) return;
  const int end = min(n, (chunk + 1) * kRowsPerPartial);
  float acc = 0.0f;
  for (int s = chunk * kRowsPerPartial; s < end; ++s) acc += x[static_cast<long long>(s) * w + k];
  partials[chunk * stride + k] = acc;
}

// First pass of the norm's param gradients: per chunk, sum dy (bias) at [0, d) and
// sum dy * xhat (weight) at [d, 2d) of the chunk's 2d partials.
__global__ void norm_partials(const float* __restrict__ dy, const float* __restrict__ x,
                              const float* __restrict__ mean, const float* __restrict__ rstd, int n,
                              int d, float* __restrict__ partials) {
  const int k = blockIdx.y * blockDim.x + threadIdx.x, chunk = blockIdx.x;
  if (k >= d) return;
  const int end = min(n, (chunk + 1) * kRowsPerPartial);
  float db = 0.0f, dg = 0.0f;
  for (int s = chunk * kRowsPerPartial; s < end; ++s) {
    const long long i = static_cast<long long>(s) * d + k;
    db += dy[i];
    dg += dy[i] * (x[i] - mean[s]) * rstd[s];
  }
  partials[chunk * 2 * d + k] = db;
  partials[chunk * 2 * d + d + k] = dg;
}

// Second pass: slot[k] += alpha * (partials summed over the chunks, in order).
template <class G>
__global__ void finish_columns(const float* __restrict__ partials, int chunks, int stride, int w,
                               float alpha, G* __restrict__ slot) {
  const int k = blockIdx.x * blockDim.x + threadIdx.x;
  if (k >= w) return;
  float acc = 0.0f;
  for (int b = 0; b < chunks; ++b) acc += partials[b * stride + k];
  slot[k] = from_float<G>(to_float(slot[k]) + alpha * acc);
}

// One warp per table row r = j * 256 + byte: the sum of dh over the samples whose slot j holds
// that byte, in sample order (ballot over 32 samples at a time), added into the slot times
// alpha. Rows no sample uses are left untouched.
template <class G>
__global__ void embed_backward(const float* __restrict__ dh, const std::uint8_t* __restrict__ ctx,
                               int n, int c, int d, float alpha, G* __restrict__ slot) {
  constexpr int kPerLane = 4;
  const int row = blockIdx.x * kWarpsPerBlock + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= c * kVocab) return;
  const int j = row / kVocab;
  const std::uint8_t byte = static_cast<std::uint8_t>(row % kVocab);
  for (int k0 = 0; k0 < d; k0 += 32 * kPerLane) {
    float acc[kPerLane] = {};
    bool any = false;
    for (int s0 = 0; s0 < n; s0 += 32) {
      const int s = s0 + lane;
      unsigned hits = __ballot_sync(kFullMask, s < n && ctx[s * c + j] == byte);
      any = any || hits != 0;
      while (hits != 0) {
        const int bit = __ffs(hits) - 1;
        hits &= hits - 1;
        const float* src = dh + static_cast<long long>(s0 + bit) * d;
        for (int q = 0; q < kPerLane; ++q) {
          const int k = k0 + lane + 32 * q;
          if (k < d) acc[q] += src[k];
        }
      }
    }
    if (!any) return;  // the same for every feature chunk
    G* out = slot + static_cast<long long>(row) * d;
    for (int q = 0; q < kPerLane; ++q) {
      const int k = k0 + lane + 32 * q;
      if (k < d) out[k] = from_float<G>(to_float(out[k]) + alpha * acc[q]);
    }
  }
}

// ---- launching ----

int blocks_for(long long count, int threads = 256) {
  const long long b = (count + threads - 1) / threads;
  return static_cast<int>(b < 65535 * 8 ? b : 65535 * 8);
}
int warp_blocks(int rows) {
  return (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
}
void check_launch() {
  SHARDSWAP_CUDA_CHECK(cudaGetLastError());
}

// Calls f(G{}) with G the device type of a gradient slot.
template <class F>
void with_slot_type(DType t, F&& f) {
  switch (t) {
    case DType::f32:
      return f(float{});
    case DType::bf16:
      return f(__nv_bfloat16{});
    case DType::f16:
      return f(__half{});
    default:
      break;
  }
  throw ConfigError(std::string("byte LM (cuda): gradient slot of dtype ") + dtype_name(t));
}

// Owns a cuBLAS handle (not copyable) on cudaStreamPerThread with a given workspace.
class CublasHandle {
 public:
  CublasHandle(void* workspace, std::size_t bytes) {
    SHARDSWAP_CUBLAS_CHECK(cublasCreate(&handle_));
    try {
      // setStream resets the workspace to cuBLAS's own pool: set ours after it, so that cuBLAS
      // allocates nothing.
      SHARDSWAP_CUBLAS_CHECK(cublasSetStream(handle_, cudaStreamPerThread));
      SHARDSWAP_CUBLAS_CHECK(cublasSetWorkspace(handle_, workspace, bytes));
    } catch (...) {
      cublasDestroy(handle_);
      throw;
    }
  }
  CublasHandle(const CublasHandle&) = delete;
  CublasHandle& operator=(const CublasHandle&) = delete;
  ~CublasHandle() {
    const cublasStatus_t status = cublasDestroy(handle_);
    if (status != CUBLAS_STATUS_SUCCESS)
      std::fprintf(stderr, "warning: cublasDestroy failed: %s\n", cublasGetStatusName(status));
  }
  cublasHandle_t get() const { return handle_; }

 private:
  cublasHandle_t handle_ = nullptr;
};

// Row-major C[M, N] = alpha op(A) op(B) + beta C, with A stored [M, K] (or [K, M] when
// transposed) with row length lda, and B likewise: cuBLAS is column-major, so it computes
// C^T = op(B)^T op(A)^T on the same memory, the operands swapped.
void gemm(cublasHandle_t handle, bool trans_a, bool trans_b, int m, int n, int k, float alpha,
          const void* a, cudaDataType_t at, int lda, const void* b, cudaDataType_t bt, int ldb,
          float beta, void* c, cudaDataType_t ct, int ldc) {
  SHARDSWAP_CUBLAS_CHECK(cublasGemmEx(
      handle, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, n, m, k,
      &alpha, b, bt, ldb, a, at, lda, &beta, c, ct, ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

// The device `p` lives on, made current on the calling thread.
int use_device_of(const void* p) {
  cudaPointerAttributes attr{};
  SHARDSWAP_CUDA_CHECK(cudaPointerGetAttributes(&attr, p));
  if (attr.type != cudaMemoryTypeDevice)
    throw ConfigError("make_byte_lm: the activation memory is not device memory");
  SHARDSWAP_CUDA_CHECK(cudaSetDevice(attr.device));
  return attr.device;
}

template <class T>
class CudaCompute final : public Compute {
 public:
  CudaCompute(const Dims& dims, int max_batch, std::byte* memory)
      : s_(dims),
        max_batch_(static_cast<std::size_t>(max_batch)),
        mem_(memory),
        l_(cuda_layout(dims, max_batch)),
        device_(use_device_of(memory)),  // current before the handle is made on it
        cublas_(memory + l_.workspace, kCublasWorkspaceBytes) {}

  double loss(const Weights& w, const Batch& b) override {
    SHARDSWAP_CUDA_CHECK(cudaSetDevice(device_));
    forward(w, b, false);
    return read_loss();
  }

  double train_step(const Weights& w, const Batch& b, double grad_scale, GradSink& sink) override {
    SHARDSWAP_CUDA_CHECK(cudaSetDevice(device_));
    forward(w, b, true);
    backward(w, b, grad_scale, sink);
    return read_loss();
  }

 private:
  template <class U = float>
  U* at(std::size_t offset) const {
    return reinterpret_cast<U*>(mem_ + offset);
  }
  static const T* cw(const void* p) { return static_cast<const T*>(p); }
  // Per-layer regions hold max_batch samples each: layer i's starts at i * per(features).
  std::size_t per(int features) const { return static_cast<std::size_t>(features) * max_batch_; }
  float* hs(int i) const { return at(l_.hs) + i * per(s_.width); }

  void forward(const Weights& w, const Batch& b, bool keep_grad) {
    const int n = b.size, c = s_.context, d = s_.width, h = s_.hidden;
    const cudaStream_t stream = cudaStreamPerThread;
    const cublasHandle_t cb = cublas_.get();
    constexpr cudaDataType_t t16 = cuda_type<T>();
    auto* ctx = at<std::uint8_t>(l_.context);
    auto* tgt = at<std::uint8_t>(l_.target);
    SHARDSWAP_CUDA_CHECK(cudaMemcpyAsync(ctx, b.context, static_cast<std::size_t>(n) * c,
                                         cudaMemcpyHostToDevice, stream));
    SHARDSWAP_CUDA_CHECK(cudaMemcpyAsync(tgt, b.target, static_cast<std::size_t>(n),
                                         cudaMemcpyHostToDevice, stream));
    embed_forward<T><<<blocks_for(static_cast<long long>(n) * d), 256, 0, stream>>>(
        cw(w.embed), ctx, n, c, d, hs(0));
    check_launch();
    for (int i = 0; i < s_.depth; ++i) {
      const LayerWeights& lw = w.layers[static_cast<std::size_t>(i)];
      T* y = at<T>(l_.ln_y) + i * per(d);
      float* u = at(l_.u) + i * per(h);
      T* a = at<T>(l_.a) + i * per(h);
      layer_norm_forward<T><<<warp_blocks(n), 32 * kWarpsPerBlock, 0, stream>>>(
          hs(i), cw(lw.norm_weight), cw(lw.norm_bias), n, d, y, at(l_.ln_mean) + i * per(1),
          at(l_.ln_rstd) + i * per(1));
      check_launch();
      gemm(cb, false, true, n, h, d, 1.0f, y, t16, d, lw.fc1_weight, t16, d, 0.0f, u, CUDA_R_32F,
           h);
      bias_gelu<T><<<blocks_for(static_cast<long long>(n) * h), 256, 0, stream>>>(
          u, cw(lw.fc1_bias), n, h, a);
      check_launch();
      gemm(cb, false, true, n, d, h, 1.0f, a, t16, h, lw.fc2_weight, t16, h, 0.0f, hs(i + 1),
           CUDA_R_32F, d);
      residual_bias<T><<<blocks_for(static_cast<long long>(n) * d), 256, 0, stream>>>(
          hs(i + 1), hs(i), cw(lw.fc2_bias), n, d);
      check_launch();
    }
    T* fy = at<T>(l_.fy);
    layer_norm_forward<T><<<warp_blocks(n), 32 * kWarpsPerBlock, 0, stream>>>(
        hs(s_.depth), cw(w.final_norm_weight), cw(w.final_norm_bias), n, d, fy, at(l_.fmean),
        at(l_.frstd));
    check_launch();
    gemm(cb, false, true, n, kVocab, d, 1.0f, fy, t16, d, w.head_weight, t16, d, 0.0f,
         at(l_.logits), CUDA_R_32F, kVocab);
    cross_entropy<T><<<warp_blocks(n), 32 * kWarpsPerBlock, 0, stream>>>(
        at(l_.logits), tgt, n, at(l_.sample_loss), keep_grad ? at<T>(l_.dlogits) : nullptr);
    check_launch();
    mean_of<<<1, 256, 0, stream>>>(at(l_.sample_loss), n, at<double>(l_.mean_loss));
    check_launch();
  }

  double read_loss() const {
    double loss = 0.0;
    SHARDSWAP_CUDA_CHECK(cudaMemcpyAsync(&loss, at<double>(l_.mean_loss), sizeof(double),
                                         cudaMemcpyDeviceToHost, cudaStreamPerThread));
    SHARDSWAP_CUDA_CHECK(cudaStreamSynchronize(cudaStreamPerThread));
    return loss;
  }

  // slot [rows, cols] += alpha * dy^T x for dy [n, rows], x [n, cols] (both T): the weight
  // gradient, written by the GEMM into the slot in its own dtype.
  void weight_grad(GradSink& sink, ParamId id, int n, int rows, int cols, float alpha, const T* dy,
                   const T* x) {
    const GradSlot slot = sink.open(id);
    gemm(cublas_.get(), true, false, rows, cols, n, alpha, dy, cuda_type<T>(), rows, x,
         cuda_type<T>(), cols, 1.0f, slot.data, cuda_type_of(slot.dtype), cols);
    sink.close(id);
  }

  // slot [w] += alpha * column sums of x [n, w] (fp32).
  void column_grad(GradSink& sink, ParamId id, int n, int w, float alpha, const float* x) {
    const cudaStream_t stream = cudaStreamPerThread;
    const int chunks = (n + kRowsPerPartial - 1) / kRowsPerPartial;
    column_partials<<<dim3(chunks, (w + 127) / 128), 128, 0, stream>>>(x, n, w, at(l_.partials), w);
    check_launch();
    finish(sink, id, chunks, w, w, alpha, at(l_.partials));
  }

  // The norm's bias and weight gradients (bias first, as backward emits them).
  void norm_grads(GradSink& sink, ParamId bias, ParamId weight, int n, float alpha, const float* dy,
                  const float* x, const float* mean, const float* rstd) {
    const int d = s_.width;
    const int chunks = (n + kRowsPerPartial - 1) / kRowsPerPartial;
    norm_partials<<<dim3(chunks, (d + 127) / 128), 128, 0, cudaStreamPerThread>>>(
        dy, x, mean, rstd, n, d, at(l_.partials));
    check_launch();
    finish(sink, bias, chunks, 2 * d, d, alpha, at(l_.partials));
    finish(sink, weight, chunks, 2 * d, d, alpha, at(l_.partials) + d);
  }

  void finish(GradSink& sink, ParamId id, int chunks, int stride, int w, float alpha,
              const float* partials) {
    const GradSlot slot = sink.open(id);
    with_slot_type(slot.dtype, [&](auto g) {
      using G = decltype(g);
      finish_columns<G><<<(w + 255) / 256, 256, 0, cudaStreamPerThread>>>(
          partials, chunks, stride, w, alpha, static_cast<G*>(slot.data));
    });
    check_launch();
    sink.close(id);
  }

  void backward(const Weights& w, const Batch& b, double grad_scale, GradSink& sink) {
    const int n = b.size, c = s_.context, d = s_.width, h = s_.hidden, depth = s_.depth;
    const int head = depth + 1;
    const int lowest = lowest_active_group(sink, depth);
    if (lowest > head) return;  // every group frozen
    const float alpha = static_cast<float>(grad_scale / n);
    const cudaStream_t stream = cudaStreamPerThread;
    const cublasHandle_t cb = cublas_.get();
    constexpr cudaDataType_t t16 = cuda_type<T>();
    using K = ParamKind;
    const T* dz = at<T>(l_.dlogits);
    float *dh = at(l_.dh), *dy = at(l_.dy), *da = at(l_.da);
    T *dh16 = at<T>(l_.dh16), *du16 = at<T>(l_.du16);

    const bool head_active = sink.active(head);
    if (head_active) weight_grad(sink, {K::head_weight}, n, kVocab, d, alpha, dz, at<T>(l_.fy));
    gemm(cb, false, false, n, d, kVocab, 1.0f, dz, t16, kVocab, w.head_weight, t16, d, 0.0f, dy,
         CUDA_R_32F, d);
    if (head_active)
      norm_grads(sink, {K::final_norm_bias}, {K::final_norm_weight}, n, alpha, dy, hs(depth),
                 at(l_.fmean), at(l_.frstd));
    if (lowest < head) {
      layer_norm_backward<T><<<warp_blocks(n), 32 * kWarpsPerBlock, 0, stream>>>(
          dy, hs(depth), at(l_.fmean), at(l_.frstd), cw(w.final_norm_weight), n, d, dh, false);
      check_launch();
    }
    for (int i = depth - 1; i >= 0 && i + 1 >= lowest; --i) {
      const LayerWeights& lw = w.layers[static_cast<std::size_t>(i)];
      const bool active = sink.active(i + 1);
      const T* y = at<T>(l_.ln_y) + i * per(d);
      const float* u = at(l_.u) + i * per(h);
      const T* a = at<T>(l_.a) + i * per(h);
      const float* mean = at(l_.ln_mean) + i * per(1);
      const float* rstd = at(l_.ln_rstd) + i * per(1);
      to_bit16<T><<<blocks_for(static_cast<long long>(n) * d), 256, 0, stream>>>(
          dh, dh16, static_cast<long long>(n) * d);
      check_launch();
      if (active) {
        column_grad(sink, {K::fc2_bias, i}, n, d, alpha, dh);
        weight_grad(sink, {K::fc2_weight, i}, n, d, h, alpha, dh16, a);
      }
      gemm(cb, false, false, n, h, d, 1.0f, dh16, t16, d, lw.fc2_weight, t16, h, 0.0f, da,
           CUDA_R_32F, h);
      gelu_backward<T><<<blocks_for(static_cast<long long>(n) * h), 256, 0, stream>>>(
          da, u, du16, static_cast<long long>(n) * h);
      check_launch();
      if (active) {
        column_grad(sink, {K::fc1_bias, i}, n, h, alpha, da);
        weight_grad(sink, {K::fc1_weight, i}, n, h, d, alpha, du16, y);
      }
      gemm(cb, false, false, n, d, h, 1.0f, du16, t16, h, lw.fc1_weight, t16, d, 0.0f, dy,
           CUDA_R_32F, d);
      if (active)
        norm_grads(sink, {K::norm_bias, i}, {K::norm_weight, i}, n, alpha, dy, hs(i), mean, rstd);
      if (i + 1 > lowest) {  // the residual passes dh on; the norm's input gradient adds
        layer_norm_backward<T><<<warp_blocks(n), 32 * kWarpsPerBlock, 0, stream>>>(
            dy, hs(i), mean, rstd, cw(lw.norm_weight), n, d, dh, true);
        check_launch();
      }
    }
    if (lowest > 0) return;
    const GradSlot slot = sink.open({K::embed});
    with_slot_type(slot.dtype, [&](auto g) {
      using G = decltype(g);
      embed_backward<G><<<warp_blocks(c * kVocab), 32 * kWarpsPerBlock, 0, stream>>>(
          dh, at<std::uint8_t>(l_.context), n, c, d, alpha, static_cast<G*>(slot.data));
    });
    check_launch();
    sink.close({K::embed});
  }

  Dims s_;
  std::size_t max_batch_;
  std::byte* mem_;
  CudaLayout l_;
  int device_;
  CublasHandle cublas_;
};

}  // namespace

std::unique_ptr<Compute> make_cuda_compute(const Dims& dims, int max_batch, DType dtype,
                                           void* memory, std::size_t bytes) {
  if (bytes != cuda_layout(dims, max_batch).bytes)
    throw ConfigError("make_byte_lm: the activation block does not match the CUDA layout");
  auto* base = static_cast<std::byte*>(memory);
  switch (dtype) {
    case DType::bf16:
      return std::make_unique<CudaCompute<__nv_bfloat16>>(dims, max_batch, base);
    case DType::f16:
      return std::make_unique<CudaCompute<__half>>(dims, max_batch, base);
    default:
      break;
  }
  throw ConfigError(std::string("make_byte_lm: dtype ") + dtype_name(dtype) +
                    " is not bf16 or fp16");
}

}  // namespace lm

namespace {

__global__ void fill_random(void* data, bool bf16, long long count, unsigned seed) {
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    unsigned x = static_cast<unsigned>(i) * 2654435761u ^ seed;
    x ^= x >> 15;
    x *= 2246822519u;
    x ^= x >> 13;
    const float v = static_cast<float>(x & 0xffff) / 65536.0f - 0.5f;
    if (bf16)
      static_cast<__nv_bfloat16*>(data)[i] = __float2bfloat16_rn(v);
    else
      static_cast<__half*>(data)[i] = __float2half_rn(v);
  }
}

// cudaMalloc'ed for one call; freed when it goes out of scope.
struct DeviceScratch {
  void* ptr = nullptr;
  explicit DeviceScratch(std::size_t bytes) { SHARDSWAP_CUDA_CHECK(cudaMalloc(&ptr, bytes)); }
  DeviceScratch(const DeviceScratch&) = delete;
  DeviceScratch& operator=(const DeviceScratch&) = delete;
  ~DeviceScratch() { SHARDSWAP_CUDA_WARN(cudaFree(ptr)); }
};

struct Event {
  cudaEvent_t e = nullptr;
  Event() { SHARDSWAP_CUDA_CHECK(cudaEventCreate(&e)); }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  ~Event() { SHARDSWAP_CUDA_WARN(cudaEventDestroy(e)); }
};

}  // namespace

double lm::cublas_gemm_tflops(int m, int n, int k, DType dtype) {
  constexpr int kWarmup = 3, kTimed = 10;
  const auto mm = static_cast<std::size_t>(m), nn = static_cast<std::size_t>(n),
             kk = static_cast<std::size_t>(k);
  DeviceScratch a(mm * kk * 2), b(kk * nn * 2), c(mm * nn * 2),
      workspace(lm::kCublasWorkspaceBytes);
  const bool bf16 = dtype == DType::bf16;
  const cudaStream_t stream = cudaStreamPerThread;
  fill_random<<<1024, 256, 0, stream>>>(a.ptr, bf16, static_cast<long long>(mm * kk), 1u);
  fill_random<<<1024, 256, 0, stream>>>(b.ptr, bf16, static_cast<long long>(kk * nn), 2u);
  lm::check_launch();
  lm::CublasHandle handle(workspace.ptr, lm::kCublasWorkspaceBytes);
  const cudaDataType_t t = bf16 ? CUDA_R_16BF : CUDA_R_16F;
  const auto run = [&] {  // C[m, n] = A[m, k] B[k, n]
    lm::gemm(handle.get(), false, false, m, n, k, 1.0f, a.ptr, t, k, b.ptr, t, n, 0.0f, c.ptr, t,
             n);
  };
  for (int i = 0; i < kWarmup; ++i) run();
  Event start, stop;
  SHARDSWAP_CUDA_CHECK(cudaEventRecord(start.e, stream));
  for (int i = 0; i < kTimed; ++i) run();
  SHARDSWAP_CUDA_CHECK(cudaEventRecord(stop.e, stream));
  SHARDSWAP_CUDA_CHECK(cudaEventSynchronize(stop.e));
  float ms = 0.0f;
  SHARDSWAP_CUDA_CHECK(cudaEventElapsedTime(&ms, start.e, stop.e));
  return 2.0 * static_cast<double>(m) * n * k * kTimed / (ms * 1e-3) / 1e12;
}

}  // namespace shardswap
