// The decoder's CUDA backend (the math is decoder_compute.h's): CudaCompute, which runs the
// model on its one device block (the layout of decoder_cuda.h), and the choice of attention.
// Every projection is a cuBLAS GEMM (cublasGemmEx, bit16 inputs, fp32 accumulation,
// CUBLAS_COMPUTE_32F); weight gradients are written by the GEMM straight into the engine's grad
// slot (beta = 1, alpha = grad scale / tokens). Small kernels do the rest, one file per op in
// tools/model/cuda/ (launched through kernels.h): embedding gather, RMSNorm, Qwen3's per-head q/k
// RMSNorm, bias + RoPE, causal GQA attention (flash style), SwiGLU, the chunked cross-entropy,
// bias and norm gradients and the embedding gradient.
//
// Precision: the residual stream (R: fp32, or the weights' type T with model.bit16_residual, as
// transformers' bf16 models and llm.q keep it), the GEMM products added into it and the
// activation gradients along it (dz at a norm's output, dx the stream's) are of R; the other GEMM
// outputs that feed a reduction, norm statistics and the softmaxes are fp32; GEMM inputs and
// attention's operands are rounded to T, as a bf16 model in transformers rounds them (the
// layout sizes the regions of R for R: cuda_bytes with bit16_residual).
// Activation gradients are those of the summed loss, O(1) per token whatever the batch or the
// loss scale, so fp16 neither underflows nor overflows there; grad_scale / tokens enters only
// where a param gradient is written.
//
// Reproducibility: no atomics. Sums over tokens (bias and norm gradients) are fixed two-pass
// trees; attention's dK and dV are summed by the block that owns the key tile, over queries in
// order; the embedding gradient sums each column of a token over its positions in order;
// cuBLAS is deterministic for a given handle, stream and workspace. Two runs give the same bits.
//
// Ordering: everything is queued on cudaStreamPerThread (the engine's contract); the host waits
// only to read the loss (or the logits) back: train_step for the loss alone, copied as the head
// makes it, so that it returns with its backward still running on the GPU.
//
// Attention: cuDNN's fused flash attention where the build has cuDNN (cudnn_attention.h) and
// head_dim is a multiple of 8, else (or with model.attention = "own") the own kernels
// (attention_forward.cu, attention_backward.cu). A batch that keeps documents apart
// (Batch::positions) goes through cuDNN too wherever the rest of the run does
// (cuda_apart_through_cudnn; the own kernels, which take each row's first key, otherwise), in
// calls of padded length classes (apart_calls.h: each document a sequence of its own, gathered
// into padded buffers in the act and dact scratch and scattered back, apart.cu). cuDNN keeps lse
// as [sequence, head, position] (the kept lse of documents apart is [token, head], as the own
// kernels keep it) and writes dQ, dK, dV in the operands' type (rounded from its fp32 sums,
// where the own kernels keep fp32), which the RoPE backward reads as they are. Its backward is
// the deterministic one (dP in its workspace, in calls of a few sequences) unless
// model.attention = "cudnn-atomic" asks for the one that sums dQ over key tiles with atomics,
// whose runs differ in the last bits.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "support/cuda_check.h"
#include "shardswap/error.h"
#include "model/cublas_check.cuh"
#include "model/cuda/kernels.h"
#include "model/cuda/loss_readback.h"
#include "model/cuda/phase_clock.h"
#include "model/cuda/profile_window.h"
#include "model/apart_calls.h"
#include "model/decoder_cuda.h"

namespace shardswap::lm::dec {
namespace {

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
template <class T>
constexpr DType dtype_of();
template <>
constexpr DType dtype_of<__nv_bfloat16>() {
  return DType::bf16;
}
template <>
constexpr DType dtype_of<__half>() {
  return DType::f16;
}

// Calls f(G{}) with G the device type of a gradient slot: fp32 or the weights' type T.
template <class T, class F>
void with_slot_type(const GradSlot& slot, ParamId id, F&& f) {
  if (slot.data == nullptr)
    throw ConfigError("decoder (cuda): the grad slot of " + param_name(id) + " is null");
  if (slot.dtype == DType::f32) return f(float{});
  if (slot.dtype == dtype_of<T>()) return f(T{});
  throw ConfigError("decoder (cuda): the grad slot of " + param_name(id) + " is " +
                    dtype_name(slot.dtype) + ", neither fp32 nor the weights' " +
                    dtype_name(dtype_of<T>()));
}

cudaDataType_t slot_type(DType t) {
  return t == DType::f32 ? CUDA_R_32F : t == DType::bf16 ? CUDA_R_16BF : CUDA_R_16F;
}

// Row-major C[M, N] = alpha op(A) op(B) + beta C, with A stored [M, K] (or [K, M] when
// transposed) with row length lda, and B likewise: cuBLAS is column-major, so it computes
// C^T = op(B)^T op(A)^T on the same memory, the operands swapped.
void gemm(cublasHandle_t handle, bool trans_a, bool trans_b, int m, int n, int k, float alpha,
          const void* a, cudaDataType_t at, long long lda, const void* b, cudaDataType_t bt,
          long long ldb, float beta, void* c, cudaDataType_t ct, long long ldc) {
  SHARDSWAP_CUBLAS_CHECK(cublasGemmEx(handle, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                                      trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, n, m, k, &alpha, b, bt,
                                      static_cast<int>(ldb), a, at, static_cast<int>(lda), &beta,
                                      c, ct, static_cast<int>(ldc), CUBLAS_COMPUTE_32F,
                                      CUBLAS_GEMM_DEFAULT));
}

// The device `p` lives on, made current on the calling thread.
int use_device_of(const void* p) {
  cudaPointerAttributes attr{};
  SHARDSWAP_CUDA_CHECK(cudaPointerGetAttributes(&attr, p));
  if (attr.type != cudaMemoryTypeDevice)
    throw ConfigError("make_cuda_compute: the block is not device memory");
  SHARDSWAP_CUDA_CHECK(cudaSetDevice(attr.device));
  return attr.device;
}

template <class T, class R>
class CudaCompute final : public Compute {
 public:
  CudaCompute(const DecoderShape& s, int max_sequences, int seq_len, int recompute,
              int loss_rows, bool keep_norms, std::byte* memory, Attention attention,
              bool bit16_logits, bool bit16_swiglu_grad, bool apart_through_cudnn)
      : s_(s),
        bit16_logits_(bit16_logits),
        bit16_swiglu_grad_(bit16_swiglu_grad),
        keep_norms_(keep_norms),
        max_sequences_(max_sequences),
        seq_len_(seq_len),
        recompute_(recompute),
        n_max_(static_cast<std::size_t>(max_sequences) * static_cast<std::size_t>(seq_len)),
        loss_rows_(cuda_loss_rows(loss_rows, n_max_)),
        mem_(memory),
        l_(cuda_layout(s, max_sequences, seq_len, recompute, loss_rows, keep_norms,
                       kBit16Residual)),
        device_(use_device_of(memory)),  // current before the handle is made on it
        cublas_(memory + l_.workspace, kCudaCublasWorkspaceBytes),
        inv_freq_(rope_inv_freq(s)) {
    if (attention != Attention::own) {
      std::byte* scratch = memory + l_.attn_scratch;
      std::size_t bytes = cuda_cudnn_scratch_bytes(s, max_sequences, seq_len);
      deterministic_ = attention == Attention::cudnn;
      if (!deterministic_) {  // the fp32 dQ accumulator first, the workspace after it
        const std::size_t dq32 = cuda_cudnn_dq32_bytes(s, max_sequences, seq_len);
        dq32_ = reinterpret_cast<float*>(scratch);
        scratch += dq32;
        bytes -= dq32;
      }
      cudnn_ = std::make_unique<CudnnAttention>(scratch, bytes);
      // The largest batch's plans now, so that a shape cuDNN refuses fails here.
      cudnn_->prepare(attention_shape(max_sequences, seq_len));
      if (apart_through_cudnn) apart_tokens_ = cuda_apart_call_tokens(s, max_sequences, seq_len);
    }
    SHARDSWAP_CUDA_CHECK(cudaMemcpyAsync(at(l_.inv_freq), inv_freq_.data(),
                                         inv_freq_.size() * sizeof(float), cudaMemcpyHostToDevice,
                                         cudaStreamPerThread));
  }

  double train_step(const Weights& w, const Batch& b, double grad_scale, GradSink& sink) override {
    check(w, b, "train_step");
    SHARDSWAP_CUDA_CHECK(cudaSetDevice(device_));
    prepare_attention(b);
    profile_.before_step();
    upload(b);
    clock_.begin();
    forward(w, b);
    const int lowest = lowest_active_group(sink);
    // The embedding gradient's grouping is sorted on the host while the GPU runs the forward
    // queued above (sorting before it left the GPU idle for the sort: ~0.7 ms a 16K-token batch).
    if (lowest == 0) upload_embedding_order(b);
    {
      const HeadUse head(w, {w.final_norm, w.head});
      check_head(w, *head);
      final_norm(*head, b);
      clock_.mark(PhaseClock::head);
      head_and_loss((*head).head, b, lowest <= s_.layers + 1 ? &sink : nullptr, grad_scale,
                    nullptr);
      loss_.queue(at<double>(l_.mean_loss));
      clock_.mark(PhaseClock::backward);
      if (lowest <= s_.layers + 1) final_norm_backward(*head, b, grad_scale, sink, lowest);
    }
    if (lowest <= s_.layers + 1) backward(w, b, grad_scale, sink, lowest);
    clock_.mark(PhaseClock::done);
    // The host waits for the loss only, not for the backward queued after it: the caller's next
    // work (engine.step()'s bookkeeping, the next micro-batch) is queued while the GPU runs it.
    const double loss = loss_.wait();
    clock_.add_step();
    return loss;
  }

  void time_phases(bool on) override { clock_.enable(on); }
  PhaseTimes take_phase_times() override { return clock_.take(); }

  double loss(const Weights& w, const Batch& b) override {
    check(w, b, "loss");
    SHARDSWAP_CUDA_CHECK(cudaSetDevice(device_));
    prepare_attention(b);
    upload(b);
    forward(w, b);
    {
      const HeadUse head(w, {w.final_norm, w.head});
      check_head(w, *head);
      final_norm(*head, b);
      head_and_loss((*head).head, b, nullptr, 0.0, nullptr);
    }
    return read_loss();
  }

  void logits(const Weights& w, const Batch& b, float* out) override {
    check(w, b, "logits");
    if (out == nullptr) throw ConfigError("decoder (cuda): logits: the output is null");
    SHARDSWAP_CUDA_CHECK(cudaSetDevice(device_));
    prepare_attention(b);
    upload(b);
    forward(w, b);
    {
      const HeadUse head(w, {w.final_norm, w.head});
      check_head(w, *head);
      final_norm(*head, b);
      head_and_loss((*head).head, b, nullptr, 0.0, out);
    }
    SHARDSWAP_CUDA_CHECK(cudaStreamSynchronize(cudaStreamPerThread));
  }

 private:
  using K = ParamKind;
  static constexpr cudaDataType_t t16 = cuda_type<T>();
  // The residual stream's type: fp32, or T (model.bit16_residual); then dx is its own GEMM
  // input, no rounded copy in d16.
  static constexpr bool kBit16Residual = !std::is_same_v<R, float>;
  static constexpr cudaDataType_t r_type = kBit16Residual ? t16 : CUDA_R_32F;

  template <class U = float>
  U* at(std::size_t offset) const {
    return reinterpret_cast<U*>(mem_ + offset);
  }
  static const T* cw(const void* p) { return static_cast<const T*>(p); }
  // A kept region holds n_max_ rows of `width` per slot: slot i's start at i n_max_ width.
  template <class U>
  U* rows_at(std::size_t offset, std::size_t i, std::int64_t width) const {
    return at<U>(offset) + i * n_max_ * static_cast<std::size_t>(width);
  }
  // Layer l's rows of a per-layer region: in its slot (cuda_slot_of: the recomputed layers share
  // slot 0). Only xs holds every layer.
  template <class U>
  U* layer(std::size_t offset, int l, std::int64_t width) const {
    return rows_at<U>(offset, cuda_slot_of(l, recompute_), width);
  }
  R* xs(int l) const { return rows_at<R>(l_.xs, static_cast<std::size_t>(l), s_.hidden); }
  // Layer l's gate|up rows [n, 2I]: gate at columns [0, I), up at [I, 2I).
  T* gate_up(int l) const { return layer<T>(l_.gate_up, l, 2 * std::int64_t{s_.intermediate}); }
  // Whether Wup follows Wgate in memory (the group's declaration order, as a layer's params lie
  // unless a source hands them out elsewhere): then [Wgate; Wup] is one [2I, D] matrix.
  bool gate_up_together(const LayerWeights& lw) const {
    return cw(lw.up) == cw(lw.gate) + static_cast<std::size_t>(s_.intermediate) * s_.hidden;
  }
  R* ys(int l) const { return layer<R>(l_.ys, l, s_.hidden); }
  // Where layer l's attention norm (which = 0) or MLP norm (1) writes its output: its slot's
  // kept rows with model.keep_norm_outputs, else the scratch `normed`, which backward fills
  // again for the weight gradients.
  T* norm_out(int l, int which) const {
    if (!keep_norms_) return at<T>(l_.normed);
    return layer<T>(l_.norms, l, 2 * std::int64_t{s_.hidden}) +
           static_cast<std::size_t>(which) * n_max_ * static_cast<std::size_t>(s_.hidden);
  }
  float* rstd_attn(int l) const { return layer<float>(l_.rstd_attn, l, 1); }
  float* rstd_mlp(int l) const { return layer<float>(l_.rstd_mlp, l, 1); }
  float* rstd_final() const { return at(l_.rstd_final); }
  // qk_norm's kept rows: H + K head rows a token.
  T* qk_hat(int l) const {
    return layer<T>(l_.qk_hat, l, std::int64_t{s_.heads + s_.kv_heads} * s_.head_dim);
  }
  float* qk_rstd(int l) const { return layer<float>(l_.qk_rstd, l, s_.heads + s_.kv_heads); }
  float* lse(int l) const {
    return at(l_.lse) + cuda_slot_of(l, recompute_) * cuda_lse_stride(n_max_, s_.heads);
  }
  std::int64_t qkv_width() const { return s_.q_width() + 2 * s_.kv_width(); }

  // Refuses, before anything is queued, a batch or weights this backend cannot run.
  void check(const Weights& w, const Batch& b, const char* call) const {
    const std::string where = std::string("decoder (cuda): ") + call + ": ";
    if (b.sequences < 1 || b.sequences > max_sequences_)
      throw ConfigError(where + "batch of " + std::to_string(b.sequences) +
                        " sequences: not in [1, max_sequences = " +
                        std::to_string(max_sequences_) + "]");
    if (b.seq_len < 1 || b.seq_len > seq_len_)
      throw ConfigError(where + "seq_len = " + std::to_string(b.seq_len) + ": not in [1, " +
                        std::to_string(seq_len_) + "]");
    if (b.inputs == nullptr || b.targets == nullptr)
      throw ConfigError(where + "the batch's inputs or targets are null");
    if (const std::int64_t i = bad_position(b); i >= 0)
      throw ConfigError(where + "position " + std::to_string(b.positions[i]) + " of token " +
                        std::to_string(i) +
                        ": a row starts at 0 and a position is 0 or the one before plus 1");
    const auto n = static_cast<std::size_t>(b.sequences) * static_cast<std::size_t>(b.seq_len);
    for (std::size_t i = 0; i < n; ++i)
      for (const auto* ids : {b.inputs, b.targets})
        if ((ids[i] < 0 || ids[i] >= s_.vocab) && !(ids == b.targets && ids[i] == kIgnoredTarget))
          throw ConfigError(where + (ids == b.inputs ? "inputs[" : "targets[") +
                            std::to_string(i) + "] = " + std::to_string(ids[i]) +
                            ": not a token id below vocab = " + std::to_string(s_.vocab));
    if (w.dtype != dtype_of<T>())
      throw ConfigError(where + "weights of dtype " + dtype_name(w.dtype) + ", the backend's is " +
                        dtype_name(dtype_of<T>()));
    const std::size_t listed = w.source != nullptr ? 0 : static_cast<std::size_t>(s_.layers);
    if (w.layers.size() != listed)
      throw ConfigError(where + std::to_string(w.layers.size()) + " layers of weights" +
                        (w.source != nullptr ? " beside a weight source" : "") +
                        ", the shape has " + std::to_string(listed));
    if (w.source != nullptr && (w.embed || w.final_norm || w.head))
      throw ConfigError(where + "embed, final_norm or head weight given beside a weight source");
    if (w.source == nullptr && (w.embed == nullptr || w.final_norm == nullptr || w.head == nullptr))
      throw ConfigError(where + "embed, final_norm or head weight is null");
    if (w.source == nullptr && s_.tied && w.head != w.embed)
      throw ConfigError(where + "the head is tied, but its weight is not the embedding");
    for (std::size_t l = 0; l < w.layers.size(); ++l)
      check_layer(w.layers[l], static_cast<int>(l), where);
  }

  // A layer's weights as the shape needs them (checked as they are acquired from a source).
  void check_layer(const LayerWeights& lw, int l, const std::string& where) const {
    const bool any_null = !lw.attn_norm || !lw.q || !lw.k || !lw.v || !lw.o || !lw.mlp_norm ||
                          !lw.gate || !lw.up || !lw.down;
    const bool biases = lw.q_bias && lw.k_bias && lw.v_bias;
    const bool no_biases = !lw.q_bias && !lw.k_bias && !lw.v_bias;
    if (any_null || (s_.qkv_bias ? !biases : !no_biases))
      throw ConfigError(where + "layers." + std::to_string(l) +
                        ": a weight is null, or q/k/v biases do not match qkv_bias");
    const bool head_norms = lw.q_norm && lw.k_norm;
    const bool no_head_norms = !lw.q_norm && !lw.k_norm;
    if (s_.qk_norm ? !head_norms : !no_head_norms)
      throw ConfigError(where + "layers." + std::to_string(l) +
                        ": q_norm/k_norm weights do not match qk_norm");
  }

  // The head's weights or the embedding as a source handed them out (listed ones were checked
  // up front).
  void check_head(const Weights& w, const HeadWeights& h) const {
    if (w.source != nullptr && (h.final_norm == nullptr || h.head == nullptr))
      throw ConfigError("decoder (cuda): the weight source gave a null final_norm or head");
  }
  void check_embed(const Weights& w, const void* embed) const {
    if (w.source != nullptr && embed == nullptr)
      throw ConfigError("decoder (cuda): the weight source gave a null embedding");
  }

  // Layer l's weights as a source handed them out, checked (listed ones were, up front).
  void check_handed_out(const Weights& w, const LayerUse& use, int l) const {
    if (w.source != nullptr) check_layer(*use, l, "decoder (cuda): ");
  }

  // Tokens, targets (and documents' positions) to the device, and the batch's counted targets.
  void upload(const Batch& b) {
    const auto n = static_cast<std::size_t>(b.sequences) * static_cast<std::size_t>(b.seq_len);
    counted_ = counted_targets(b);
    const cudaStream_t stream = cudaStreamPerThread;
    SHARDSWAP_CUDA_CHECK(cudaMemcpyAsync(at<int>(l_.tokens), b.inputs, n * sizeof(int),
                                         cudaMemcpyHostToDevice, stream));
    SHARDSWAP_CUDA_CHECK(cudaMemcpyAsync(at<int>(l_.targets), b.targets, n * sizeof(int),
                                         cudaMemcpyHostToDevice, stream));
    doc_positions_ = b.positions != nullptr ? at<int>(l_.positions) : nullptr;
    if (doc_positions_ != nullptr)
      SHARDSWAP_CUDA_CHECK(cudaMemcpyAsync(doc_positions_, b.positions, n * sizeof(int),
                                           cudaMemcpyHostToDevice, stream));
    // The documents of prepare_attention's calls, when they go through cuDNN.
    if (apart_cudnn()) {
      apart_docs_ = apart_document_table(apart_);
      SHARDSWAP_CUDA_CHECK(cudaMemcpyAsync(at<int>(l_.documents), apart_docs_.data(),
                                           apart_docs_.size() * sizeof(int),
                                           cudaMemcpyHostToDevice, stream));
    }
  }

  // The embedding gradient's grouping of the uploaded batch: its positions sorted by token (in
  // order within a token), each distinct token's row and where its positions start.
  void upload_embedding_order(const Batch& b) {
    const auto n = static_cast<std::size_t>(b.sequences) * static_cast<std::size_t>(b.seq_len);
    const cudaStream_t stream = cudaStreamPerThread;
    positions_.resize(n);
    for (std::size_t i = 0; i < n; ++i) positions_[i] = static_cast<int>(i);
    std::stable_sort(positions_.begin(), positions_.end(),
                     [&](int x, int y) { return b.inputs[x] < b.inputs[y]; });
    rows_.clear();
    starts_.clear();
    for (std::size_t e = 0; e < n; ++e)
      if (e == 0 || b.inputs[positions_[e]] != b.inputs[positions_[e - 1]]) {
        rows_.push_back(b.inputs[positions_[e]]);
        starts_.push_back(static_cast<int>(e));
      }
    starts_.push_back(static_cast<int>(n));
    // Pageable host memory: each copy has read its source when the call returns.
    SHARDSWAP_CUDA_CHECK(cudaMemcpyAsync(at<int>(l_.embed_rows), rows_.data(),
                                         rows_.size() * sizeof(int), cudaMemcpyHostToDevice,
                                         stream));
    SHARDSWAP_CUDA_CHECK(cudaMemcpyAsync(at<int>(l_.embed_starts), starts_.data(),
                                         starts_.size() * sizeof(int), cudaMemcpyHostToDevice,
                                         stream));
    SHARDSWAP_CUDA_CHECK(cudaMemcpyAsync(at<int>(l_.embed_positions), positions_.data(),
                                         n * sizeof(int), cudaMemcpyHostToDevice, stream));
  }

  // out[n, o] (= or +=, of type ct) = in16[n, i] W^T for W [o, i].
  void linear(int n, int o, int i, const T* in, long long ld_in, const void* w, float beta,
              void* out, cudaDataType_t ct, long long ld_out) {
    gemm(cublas_.get(), false, true, n, o, i, 1.0f, in, t16, ld_in, w, t16, i, beta, out, ct,
         ld_out);
  }
  // din[n, i] (= or +=, of R) = dout16[n, o] W for W [o, i]: the gradient at a norm's output.
  void linear_input_grad(int n, int o, int i, const T* dout, long long ld_dout, const void* w,
                         float beta, R* din) {
    gemm(cublas_.get(), false, false, n, i, o, 1.0f, dout, t16, ld_dout, w, t16, i, beta, din,
         r_type, i);
  }

  void rms_norm(const R* x, const void* w, int n, T* y, float* rstd_out) {
    launch_rms_norm_forward<T, R>(x, cw(w), n, s_.hidden, static_cast<float>(s_.rms_eps), y,
                                  rstd_out);
  }
  // Wq|Wk|Wv as one [(H + 2K) hd, D] matrix, so that the projections are one GEMM each way:
  // the weights themselves where the group holds them back to back (no biases or head norms
  // between), else a copy of them in the wqkv scratch (made again at each use: another layer's
  // may be there).
  const T* qkv_weights(const LayerWeights& lw) {
    const std::size_t d = static_cast<std::size_t>(s_.hidden);
    const std::size_t q = s_.q_width() * d, kv = s_.kv_width() * d;
    const T* wq = cw(lw.q);
    if (cw(lw.k) == wq + q && cw(lw.v) == wq + q + kv) return wq;
    T* out = at<T>(l_.wqkv);
    const cudaStream_t stream = cudaStreamPerThread;
    SHARDSWAP_CUDA_CHECK(cudaMemcpyAsync(out, lw.q, q * sizeof(T), cudaMemcpyDeviceToDevice, stream));
    SHARDSWAP_CUDA_CHECK(
        cudaMemcpyAsync(out + q, lw.k, kv * sizeof(T), cudaMemcpyDeviceToDevice, stream));
    SHARDSWAP_CUDA_CHECK(
        cudaMemcpyAsync(out + q + kv, lw.v, kv * sizeof(T), cudaMemcpyDeviceToDevice, stream));
    return out;
  }
  // sum = residual + sum (sum holds a GEMM's product), then the norm of it as rms_norm.
  void residual_rms_norm(const R* residual, R* sum, const void* w, int n, T* y,
                         float* rstd_out) {
    launch_residual_rms_norm_forward<T, R>(residual, sum, cw(w), n, s_.hidden,
                                           static_cast<float>(s_.rms_eps), y, rstd_out);
  }

  void forward(const Weights& w, const Batch& b) {
    const int n = b.sequences * b.seq_len, d = s_.hidden, half = s_.head_dim / 2;
    launch_rope_table(at(l_.inv_freq), b.seq_len, half, at(l_.rope_cos), at(l_.rope_sin));
    {
      const EmbedUse embed(w, w.embed);
      check_embed(w, *embed);
      launch_embed_forward<T, R>(cw(*embed), at<int>(l_.tokens), n, d, xs(0));
    }
    for (int l = 0; l < s_.layers; ++l) {
      const LayerUse use(w, l);
      check_handed_out(w, use, l);
      forward_layer(*use, b, l, false);
    }
  }

  // The final norm of x_L into `normed`, the head's input. forward() left x_L as the last down
  // projection's product: the residual sum is made here, in the norm's pass.
  void final_norm(const HeadWeights& h, const Batch& b) {
    const int L = s_.layers, n = b.sequences * b.seq_len;
    if (L == 0) {
      rms_norm(xs(0), h.final_norm, n, at<T>(l_.normed), rstd_final());
      return;
    }
    residual_rms_norm(ys(L - 1), xs(L), h.final_norm, n, at<T>(l_.normed), rstd_final());
  }

  // Layer l's forward from x_l into its slot, and x_{l+1}. A residual sum is made by the norm
  // that reads it (residual_rms_norm): the GEMM writes its product where the sum goes, the norm
  // adds the residual in place. So in forward, x_l (l > 0) holds only the previous layer's down
  // projection when this layer starts, and x_{l+1} only this layer's when it ends (the next
  // layer's norm, or final_norm, completes it); a recompute starts from the finished x_l. A
  // recompute (at the start of the layer's backward) stops at what backward reads, gate and up:
  // act and x_{l+1} are not rewritten, and no phase is marked (its time counts in backward MLP).
  // It writes only the slot (qk_hat and qk_rstd too, with qk_norm; the norms' outputs with
  // model.keep_norm_outputs) and the scratch normed and qkv32, both rewritten by backward before
  // it reads them.
  void forward_layer(const LayerWeights& lw, const Batch& b, int l, bool recompute) {
    const int n = b.sequences * b.seq_len, d = s_.hidden, in = s_.intermediate;
    const int qw = static_cast<int>(s_.q_width()), kw = static_cast<int>(s_.kv_width());
    const long long width = qkv_width();
    const auto mark = [&](PhaseClock::Phase p) {
      if (!recompute) clock_.mark(p);
    };
    T* normed = norm_out(l, 0);
    float* qkv = at(l_.qkv32);
    T* q = layer<T>(l_.q, l, qw);
    T* k = layer<T>(l_.k, l, kw);
    T* v = layer<T>(l_.v, l, kw);
    T* o = layer<T>(l_.o, l, qw);
    mark(PhaseClock::forward);
    if (recompute || l == 0)
      rms_norm(xs(l), lw.attn_norm, n, normed, rstd_attn(l));
    else  // x_l = y_{l-1} + the down projection the previous layer left in x_l
      residual_rms_norm(ys(l - 1), xs(l), lw.attn_norm, n, normed, rstd_attn(l));
    linear(n, static_cast<int>(width), d, normed, d, qkv_weights(lw), 0.0f, qkv, CUDA_R_32F,
           width);
    // Qwen3: each q and k head normalised in place, before RoPE (no biases with it:
    // check_cuda_shape).
    if (s_.qk_norm)
      launch_head_norm_forward<T>(qkv, width, n, s_.heads, s_.kv_heads, s_.head_dim,
                                  cw(lw.q_norm), cw(lw.k_norm), static_cast<float>(s_.rms_eps),
                                  qk_hat(l), qk_rstd(l));
    launch_qkv_forward<T>(n, qkv, cw(lw.q_bias), cw(lw.k_bias), cw(lw.v_bias), at(l_.rope_cos),
                          at(l_.rope_sin), b.seq_len, s_.heads, s_.kv_heads, s_.head_dim, q, k,
                          v, doc_positions_);
    mark(PhaseClock::attention_forward);
    attention(b, q, k, v, o, lse(l));
    mark(PhaseClock::forward);
    // y = x + o Wo^T: the product into y, the sum (of R) made by the MLP norm's pass.
    linear(n, d, qw, o, qw, lw.o, 0.0f, ys(l), r_type, d);
    mark(PhaseClock::forward_mlp);
    normed = norm_out(l, 1);
    residual_rms_norm(xs(l), ys(l), lw.mlp_norm, n, normed, rstd_mlp(l));
    T* gate = gate_up(l);
    T* up = gate + in;
    if (gate_up_together(lw)) {  // gate|up [n, 2I] = normed (Wgate|Wup)^T
      linear(n, 2 * in, d, normed, d, lw.gate, 0.0f, gate, t16, 2 * in);
    } else {
      linear(n, in, d, normed, d, lw.gate, 0.0f, gate, t16, 2 * in);
      linear(n, in, d, normed, d, lw.up, 0.0f, up, t16, 2 * in);
    }
    if (recompute) return;
    launch_swiglu_forward<T>(gate, up, n, in, 2 * in, at<T>(l_.act));
    // x_{l+1} = y + act Wdown^T: the product here, the sum by the next norm's pass.
    linear(n, d, in, at<T>(l_.act), in, lw.down, 0.0f, xs(l + 1), r_type, d);
  }

  AttentionShape attention_shape(int sequences, int seq_len) const {
    return cuda_attention_shape(s_, sequences, seq_len, dtype_of<T>(), deterministic_);
  }
  // Plans for the batch's shape before anything is queued (a refusal changes nothing): the
  // batch's, or with documents apart each call's (the calls kept for upload and the layers).
  void prepare_attention(const Batch& b) {
    if (!cudnn_) return;
    if (b.positions == nullptr) {
      cudnn_->prepare(attention_shape(b.sequences, b.seq_len));
      return;
    }
    if (apart_tokens_ == 0) return;  // the own kernels
    ApartCalls calls = plan_apart_calls(b.positions, b.sequences, b.seq_len, apart_tokens_);
    for (const ApartCall& c : calls.calls) cudnn_->prepare(attention_shape(c.sequences, c.seq_len));
    apart_ = std::move(calls);
  }
  // cuDNN for the uploaded batch: documents apart too unless their calls do not fit.
  bool use_cudnn() const { return cudnn_ && (doc_positions_ == nullptr || apart_cudnn()); }
  // The uploaded batch keeps documents apart and sends them to cuDNN's padded calls
  // (apart_tokens_ > 0 only with cuDNN).
  bool apart_cudnn() const { return doc_positions_ != nullptr && apart_tokens_ > 0; }

  void attention(const Batch& b, const T* q, const T* k, const T* v, T* o, float* lse) {
    if (!use_cudnn()) {
      launch_attention_forward<T>(b.sequences, b.seq_len, s_.heads, s_.kv_heads, s_.head_dim, q,
                                  k, v, o, lse, doc_positions_);
    } else if (apart_cudnn()) {
      apart_forward(q, k, v, o, lse);
    } else {
      cudnn_->forward(attention_shape(b.sequences, b.seq_len), {q, k, v, o, lse});
    }
  }

  // A call's padded buffers in the act and dact scratch (cuda_apart_call_tokens rows each).
  struct ApartBuffers {
    T *q, *k, *v, *o, *dout, *dqkv;  // dqkv: dq|dk|dv side by side, rows of qkv_width()
    float* lse;                      // cuDNN's [sequences, heads, seq_len]
  };
  ApartBuffers apart_buffers() const {
    const auto rows = static_cast<std::size_t>(apart_tokens_);
    const std::size_t qw = s_.q_width(), kw = s_.kv_width();
    std::byte* next = mem_ + l_.act;
    const auto take = [&](std::size_t elements, std::size_t size) {
      std::byte* at = next;
      next += (rows * elements * size + 255) / 256 * 256;
      return at;
    };
    ApartBuffers a{};
    a.q = reinterpret_cast<T*>(take(qw, sizeof(T)));
    a.k = reinterpret_cast<T*>(take(kw, sizeof(T)));
    a.v = reinterpret_cast<T*>(take(kw, sizeof(T)));
    a.o = reinterpret_cast<T*>(take(qw, sizeof(T)));
    a.dout = reinterpret_cast<T*>(take(qw, sizeof(T)));
    a.dqkv = reinterpret_cast<T*>(take(qw + 2 * kw, sizeof(T)));
    a.lse = reinterpret_cast<float*>(take(static_cast<std::size_t>(s_.heads), sizeof(float)));
    return a;  // within [act, dx): cuda_apart_call_tokens left 7 x 256 bytes for the rounding
  }

  // Documents apart through cuDNN, forward: each call's documents gathered, attended to and o
  // and lse scattered back (lse as [token, head]).
  void apart_forward(const T* q, const T* k, const T* v, T* o, float* lse) {
    const ApartBuffers a = apart_buffers();
    const int qw = static_cast<int>(s_.q_width()), kw = static_cast<int>(s_.kv_width());
    for (const ApartCall& c : apart_.calls) {
      const int* docs = at<int>(l_.documents) + 2 * static_cast<std::size_t>(c.first);
      ApartTensors<T> in;
      in.count = 3;
      in.t[0] = {q, a.q, qw, qw};
      in.t[1] = {k, a.k, kw, kw};
      in.t[2] = {v, a.v, kw, kw};
      launch_apart_gather<T>(docs, c.count, c.sequences, c.seq_len, in, nullptr, nullptr,
                             s_.heads);
      const AttentionForward io{a.q, a.k, a.v, a.o, a.lse};
      cudnn_->forward(attention_shape(c.sequences, c.seq_len), io);
      ApartTensors<T> out;
      out.count = 1;
      out.t[0] = {a.o, o, qw, qw};
      launch_apart_scatter<T>(docs, c.count, c.sequences, c.seq_len, out, a.lse, lse, s_.heads);
    }
  }

  // Backward: q, k, v, o, dout and lse gathered (the padding's lse 0, its rows zero: they add
  // nothing), dq|dk|dv of the documents' rows scattered into g16.
  void apart_backward(const T* q, const T* k, const T* v, const T* o, const T* dout,
                      const float* lse, T* g16) {
    const ApartBuffers a = apart_buffers();
    const int qw = static_cast<int>(s_.q_width()), kw = static_cast<int>(s_.kv_width());
    const int width = static_cast<int>(qkv_width());
    for (const ApartCall& c : apart_.calls) {
      const int* docs = at<int>(l_.documents) + 2 * static_cast<std::size_t>(c.first);
      ApartTensors<T> in;
      in.count = 5;
      in.t[0] = {q, a.q, qw, qw};
      in.t[1] = {k, a.k, kw, kw};
      in.t[2] = {v, a.v, kw, kw};
      in.t[3] = {o, a.o, qw, qw};
      in.t[4] = {dout, a.dout, qw, qw};
      launch_apart_gather<T>(docs, c.count, c.sequences, c.seq_len, in, lse, a.lse, s_.heads);
      const AttentionBackward io{a.q,    a.k,         a.v,         a.o,   a.dout,      a.lse,
                                 a.dqkv, a.dqkv + qw, a.dqkv + qw + kw, dq32_, at(l_.delta)};
      cudnn_->backward(attention_shape(c.sequences, c.seq_len), io);
      ApartTensors<T> out;
      out.count = 1;
      out.t[0] = {a.dqkv, g16, width, width};
      launch_apart_scatter<T>(docs, c.count, c.sequences, c.seq_len, out, nullptr, nullptr,
                              s_.heads);
    }
  }

  // The head over chunks of token rows: logits, per-row loss and the mean loss; with a sink,
  // also the head's weight gradient (when its group is active) and the gradient at the final
  // norm's output into dz; with `out`, the logits rows copied to the host.
  void head_and_loss(const void* head, const Batch& b, GradSink* sink, double grad_scale,
                     float* out) {
    const int n = b.sequences * b.seq_len, d = s_.hidden, vocab = s_.vocab;
    const cublasHandle_t cb = cublas_.get();
    const T* f = at<T>(l_.normed);
    // fp32 logits (their gradient in place in T, rows 2 V apart), or T's with
    // model.bit16_logits (the gradient in place, rows V apart).
    void* logits = at(l_.logits);
    const T* dlogits = at<T>(l_.logits);
    const long long ld_grad = bit16_logits_ ? vocab : 2LL * vocab;
    const float alpha = mean_factor(grad_scale);
    const bool head_matrix =
        sink != nullptr && sink->active(s_.tied ? 0 : s_.layers + 1);
    const ParamId head_id{s_.tied ? K::embed : K::head};
    GradSlot slot{};
    if (head_matrix) {
      slot = sink->open(head_id);
      with_slot_type<T>(slot, head_id, [](auto) {});
    }
    for (int r0 = 0; r0 < n; r0 += loss_rows_) {
      const int rows = std::min(loss_rows_, n - r0);
      gemm(cb, false, true, rows, vocab, d, 1.0f, f + static_cast<long long>(r0) * d, t16, d,
           head, t16, d, 0.0f, logits, bit16_logits_ ? t16 : CUDA_R_32F, vocab);
      if (out != nullptr) copy_logits_out(out + static_cast<long long>(r0) * vocab, rows, vocab);
      if (bit16_logits_)
        launch_cross_entropy_rows<T, T>(static_cast<T*>(logits), rows, vocab,
                                        at<int>(l_.targets) + r0, at(l_.row_loss) + r0,
                                        sink != nullptr);
      else
        launch_cross_entropy_rows<T, float>(static_cast<float*>(logits), rows, vocab,
                                            at<int>(l_.targets) + r0, at(l_.row_loss) + r0,
                                            sink != nullptr);
      if (sink == nullptr) continue;
      if (head_matrix)  // slot [V, D] += alpha dlogits^T f
        gemm(cb, true, false, vocab, d, rows, alpha, dlogits, t16, ld_grad,
             f + static_cast<long long>(r0) * d, t16, d, 1.0f, slot.data, slot_type(slot.dtype),
             d);
      gemm(cb, false, false, rows, d, vocab, 1.0f, dlogits, t16, ld_grad, head, t16, d,
           0.0f, at<R>(l_.dz) + static_cast<long long>(r0) * d, r_type, d);
    }
    // Closed here even when tied: one slot is open at a time (a stage-2 bucket is reduced once
    // backward moves on to another group); the lookup's gradient opens the embedding again.
    if (head_matrix) sink->close(head_id);
    launch_mean_of(at(l_.row_loss), n, static_cast<double>(counted_), at<double>(l_.mean_loss));
  }

  // The chunk's logits rows (as the loss sees them) to the host as fp32: bit16 ones through a
  // host copy, widened there (logits() only: tests and export checks).
  void copy_logits_out(float* out, int rows, int vocab) {
    const auto count = static_cast<std::size_t>(rows) * static_cast<std::size_t>(vocab);
    const cudaStream_t stream = cudaStreamPerThread;
    if (!bit16_logits_) {
      SHARDSWAP_CUDA_CHECK(cudaMemcpyAsync(out, at(l_.logits), sizeof(float) * count,
                                           cudaMemcpyDeviceToHost, stream));
      return;
    }
    std::vector<T> rows16(count);
    SHARDSWAP_CUDA_CHECK(cudaMemcpyAsync(rows16.data(), at<T>(l_.logits), sizeof(T) * count,
                                         cudaMemcpyDeviceToHost, stream));
    SHARDSWAP_CUDA_CHECK(cudaStreamSynchronize(stream));
    for (std::size_t i = 0; i < count; ++i) out[i] = static_cast<float>(rows16[i]);
  }

  double read_loss() const {
    double loss = 0.0;
    SHARDSWAP_CUDA_CHECK(cudaMemcpyAsync(&loss, at<double>(l_.mean_loss), sizeof(double),
                                         cudaMemcpyDeviceToHost, cudaStreamPerThread));
    SHARDSWAP_CUDA_CHECK(cudaStreamSynchronize(cudaStreamPerThread));
    return loss;
  }

  int lowest_active_group(const GradSink& sink) const {
    int group = 0;
    while (group <= s_.layers + 1 && !sink.active(group)) ++group;
    return group;
  }

  // slot [rows, cols] += alpha dy^T x for dy [n, rows] (row length ld_dy), x [n, cols]: the
  // weight gradient, written by the GEMM into the slot in its own dtype.
  void weight_grad(GradSink& sink, ParamId id, int n, int rows, int cols, float alpha,
                   const T* dy, long long ld_dy, const T* x, long long ld_x) {
    const GradSlot slot = sink.open(id);
    with_slot_type<T>(slot, id, [](auto) {});
    gemm(cublas_.get(), true, false, rows, cols, n, alpha, dy, t16, ld_dy, x, t16, ld_x, 1.0f,
         slot.data, slot_type(slot.dtype), cols);
    sink.close(id);
  }

  // Qwen3's q/k head norms, backward, from g32's q|k columns = the gradient at their output
  // (RoPE's backward): when `active`, their weight gradients, slot [hd] += alpha sum over the
  // tokens and the norm's heads of dz xhat (k_norm's, then q_norm's: both read dz before it is
  // replaced); then in place the gradient at their input into g32 and, rounded, g16, which the
  // projections' GEMMs read.
  void head_norm_backward(const LayerWeights& lw, int l, int n, bool active, GradSink& sink,
                          float alpha, float* g32, T* g16) {
    const int heads = s_.heads, kv_heads = s_.kv_heads, hd = s_.head_dim;
    const long long width = qkv_width();
    if (active) {
      const int chunks = (n + kCudaRowsPerPartial - 1) / kCudaRowsPerPartial;
      launch_head_norm_partials<T>(g32, width, qk_hat(l), n, heads + kv_heads, heads, kv_heads,
                                   hd, at(l_.partials));
      finish(sink, {K::k_norm, l}, chunks, hd, alpha);
      launch_head_norm_partials<T>(g32, width, qk_hat(l), n, heads + kv_heads, 0, heads, hd,
                                   at(l_.partials));
      finish(sink, {K::q_norm, l}, chunks, hd, alpha);
    }
    launch_head_norm_backward<T>(g32, g16, width, n, heads, kv_heads, hd, cw(lw.q_norm),
                                 cw(lw.k_norm), qk_hat(l), qk_rstd(l));
  }

  // slot += alpha * the column sums whose partials are at columns [first, first + w) of the
  // partials region (rows `stride` floats apart: w unless given).
  void finish(GradSink& sink, ParamId id, int chunks, int w, float alpha, int first = 0,
              int stride = 0) {
    const GradSlot slot = sink.open(id);
    with_slot_type<T>(slot, id, [&](auto g) {
      using G = decltype(g);
      launch_finish_columns<G>(at(l_.partials) + first, chunks, w, stride > 0 ? stride : w,
                               alpha, static_cast<G*>(slot.data));
    });
    sink.close(id);
  }

  // An RMSNorm's backward from dz at its output, in one pass over dz and x: with `with_dx`, dx
  // (= or +=) the gradient at its input, and, where dx is fp32, rounded into d16 (every later
  // use of dx but the embedding's gradient starts from d16()); with `grad`, its weight gradient,
  // slot [D] += alpha sum_t dz x rstd.
  void norm_backward(const R* dz, const R* x, const float* r, const void* w, int n,
                     bool with_dx, bool accumulate, GradSink& sink, std::optional<ParamId> grad,
                     float alpha) {
    if (!with_dx && !grad) return;
    launch_rms_norm_backward<T, R>(dz, x, r, cw(w), n, s_.hidden,
                                   with_dx ? at<R>(l_.dx) : nullptr, accumulate,
                                   with_dx && !kBit16Residual ? at<T>(l_.d16) : nullptr,
                                   grad ? at(l_.partials) : nullptr);
    if (grad)
      finish(sink, *grad, (n + kCudaNormRowsPerPartial - 1) / kCudaNormRowsPerPartial, s_.hidden,
             alpha);
  }
  // dx as a GEMM input: its rounded copy, or dx itself where the stream is T.
  T* d16() const { return kBit16Residual ? at<T>(l_.dx) : at<T>(l_.d16); }
  static std::optional<ParamId> if_active(bool active, ParamId id) {
    return active ? std::optional<ParamId>(id) : std::nullopt;
  }

  // Entered with dz = the gradient at the final norm's output (head_and_loss): the final
  // norm's weight gradient, and dz carried to x_L when a layer wants gradients.
  void final_norm_backward(const HeadWeights& h, const Batch& b, double grad_scale,
                           GradSink& sink, int lowest) {
    const int n = b.sequences * b.seq_len, L = s_.layers;
    const float alpha = mean_factor(grad_scale);
    R* dz = at<R>(l_.dz);
    norm_backward(dz, xs(L), rstd_final(), h.final_norm, n, lowest <= L, false, sink,
                  if_active(sink.active(L + 1), {K::final_norm}), alpha);
  }

  // The layers' backward from the gradient at x_L (final_norm_backward).
  void backward(const Weights& w, const Batch& b, double grad_scale, GradSink& sink, int lowest) {
    const int n = b.sequences * b.seq_len, d = s_.hidden, in = s_.intermediate;
    const int L = s_.layers;
    const int qw = static_cast<int>(s_.q_width()), kw = static_cast<int>(s_.kv_width());
    const long long width = qkv_width();
    const float alpha = mean_factor(grad_scale);
    R *dx = at<R>(l_.dx), *dz = at<R>(l_.dz);
    float* g32 = at(l_.qkv32);
    T *d16 = this->d16(), *g16 = at<T>(l_.qkv16);
    T *act = at<T>(l_.act), *dout = at<T>(l_.dout);

    for (int l = L - 1; l >= 0 && l + 1 >= lowest; --l) {
      const LayerUse use(w, l);
      check_handed_out(w, use, l);
      const LayerWeights& lw = *use;
      const bool active = sink.active(l + 1);
      clock_.mark(PhaseClock::backward_mlp);
      // A recomputed layer's activations, from x_l, into the slot the recomputed layers share;
      // the highest of them still has its own there from forward.
      if (l < recompute_ - 1) forward_layer(lw, b, l, true);
      T* gate = gate_up(l);
      T* up = gate + in;
      // MLP: x_{l+1} = y + act Wdown^T, act = silu(gate) * up, gate|up = rmsnorm(y) W^T.
      // d16 = dx rounded by the norm backward that made dx (dx itself when it is T).
      // act (recomputed) for the down projection's weight gradient in the same pass as SwiGLU's
      // backward. Its output's gradient in fp32, or (model.bit16_swiglu_grad) in T in the same
      // region: half the bytes written and read.
      gemm(cublas_.get(), false, false, n, in, d, 1.0f, d16, t16, d, lw.down, t16, in, 0.0f,
           at(l_.dact), bit16_swiglu_grad_ ? t16 : CUDA_R_32F, in);
      if (bit16_swiglu_grad_)
        launch_swiglu_backward<T, T>(at<T>(l_.dact), gate, up, active ? act : nullptr, n, in,
                                     2 * in);
      else
        launch_swiglu_backward<T, float>(at(l_.dact), gate, up, active ? act : nullptr, n, in,
                                         2 * in);
      if (active) {
        weight_grad(sink, {K::down, l}, n, d, in, alpha, d16, d, act, in);
        T* const normed = norm_out(l, 1);
        if (!keep_norms_) rms_norm(ys(l), lw.mlp_norm, n, normed, nullptr);
        weight_grad(sink, {K::gate, l}, n, in, d, alpha, gate, 2 * in, normed, d);
        weight_grad(sink, {K::up, l}, n, in, d, alpha, up, 2 * in, normed, d);
      }
      if (gate_up_together(lw)) {  // dz = dgate|dup (Wgate|Wup): one GEMM over 2I
        linear_input_grad(n, 2 * in, d, gate, 2 * in, lw.gate, 0.0f, dz);
      } else {
        linear_input_grad(n, in, d, gate, 2 * in, lw.gate, 0.0f, dz);
        linear_input_grad(n, in, d, up, 2 * in, lw.up, 1.0f, dz);
      }
      norm_backward(dz, ys(l), rstd_mlp(l), lw.mlp_norm, n, true, true, sink,  // dx: now at y
                    if_active(active, {K::mlp_norm, l}), alpha);
      // Attention: y = x + o Wo^T.
      clock_.mark(PhaseClock::backward);
      const T* q = layer<T>(l_.q, l, qw);
      const T* k = layer<T>(l_.k, l, kw);
      const T* v = layer<T>(l_.v, l, kw);
      const T* o = layer<T>(l_.o, l, qw);
      const float* lse = this->lse(l);
      // d16 = dx rounded by the norm backward that made dx (dx itself when it is T).
      if (active) weight_grad(sink, {K::o, l}, n, d, qw, alpha, d16, d, o, qw);
      gemm(cublas_.get(), false, false, n, qw, d, 1.0f, d16, t16, d, lw.o, t16, qw, 0.0f, dout,
           t16, qw);
      clock_.mark(PhaseClock::attention_backward);
      const bool in_g16 = attention_backward(b, q, k, v, o, dout, lse, g32, g16, width);
      clock_.mark(PhaseClock::backward);
      // RoPE's backward into g16; into g32 too only for Qwen3's head norms, which read it; and
      // for a trained layer's biases their partial column sums in the same pass.
      float* const g_kept = s_.qk_norm ? g32 : nullptr;
      float* const bias_partials = active && s_.qkv_bias ? at(l_.partials) : nullptr;
      if (in_g16)
        launch_qkv_backward<T, T>(n, g16, g_kept, at(l_.rope_cos), at(l_.rope_sin), b.seq_len,
                                  s_.heads, s_.kv_heads, s_.head_dim, g16, doc_positions_,
                                  bias_partials);
      else
        launch_qkv_backward<T, float>(n, g32, g_kept, at(l_.rope_cos), at(l_.rope_sin),
                                      b.seq_len, s_.heads, s_.kv_heads, s_.head_dim, g16,
                                      doc_positions_, bias_partials);
      if (s_.qk_norm) head_norm_backward(lw, l, n, active, sink, alpha, g32, g16);
      if (active) {
        T* const normed = norm_out(l, 0);
        if (!keep_norms_) rms_norm(xs(l), lw.attn_norm, n, normed, nullptr);
        // The three biases' partials (made by RoPE's backward above, one row of q|k|v columns
        // a chunk) finished into their slots in the order the params are declared.
        const int chunks = (n + kCudaRowsPerPartial - 1) / kCudaRowsPerPartial;
        const int wi = static_cast<int>(width);
        weight_grad(sink, {K::q, l}, n, qw, d, alpha, g16, width, normed, d);
        if (s_.qkv_bias) finish(sink, {K::q_bias, l}, chunks, qw, alpha, 0, wi);
        weight_grad(sink, {K::k, l}, n, kw, d, alpha, g16 + qw, width, normed, d);
        if (s_.qkv_bias) finish(sink, {K::k_bias, l}, chunks, kw, alpha, qw, wi);
        weight_grad(sink, {K::v, l}, n, kw, d, alpha, g16 + qw + kw, width, normed, d);
        if (s_.qkv_bias) finish(sink, {K::v_bias, l}, chunks, kw, alpha, qw + kw, wi);
      }
      // dz = dq|dk|dv (Wq|Wk|Wv): one GEMM over the three projections' rows.
      linear_input_grad(n, static_cast<int>(width), d, g16, width, qkv_weights(lw), 0.0f, dz);
      norm_backward(dz, xs(l), rstd_attn(l), lw.attn_norm, n, l + 1 > lowest, true, sink,  // x_l
                    if_active(active, {K::attn_norm, l}), alpha);
    }
    if (lowest > 0) return;
    const ParamId id{K::embed};
    const GradSlot slot = sink.open(id);  // tied: a second time, after the head's gradient
    with_slot_type<T>(slot, id, [&](auto g) {
      using G = decltype(g);
      launch_embed_backward<G, R>(dx, at<int>(l_.embed_rows), static_cast<int>(rows_.size()),
                               at<int>(l_.embed_starts), at<int>(l_.embed_positions), d, alpha,
                               static_cast<G*>(slot.data));
    });
    sink.close(id);
  }

  // dq|dk|dv (rows `width` apart): in T into g16 with cuDNN (returns true), else in fp32 into
  // g32 (false).
  bool attention_backward(const Batch& b, const T* q, const T* k, const T* v, const T* o,
                          const T* dout, const float* lse, float* g32, T* g16, long long width) {
    if (apart_cudnn()) {
      apart_backward(q, k, v, o, dout, lse, g16);
      return true;
    }
    if (use_cudnn()) {
      const long long qw = s_.q_width(), kw = s_.kv_width();
      cudnn_->backward(attention_shape(b.sequences, b.seq_len),
                       {q, k, v, o, dout, lse, g16, g16 + qw, g16 + qw + kw, dq32_,
                        at(l_.delta)});
      return true;
    }
    launch_attention_backward<T>(b.sequences, b.seq_len, s_.heads, s_.kv_heads, s_.head_dim, q,
                                 k, v, o, dout, lse, at(l_.delta), g32, width, doc_positions_);
    return false;
  }

  DecoderShape s_;
  bool bit16_logits_;       // model.bit16_logits: the head's logits in T, not fp32
  bool bit16_swiglu_grad_;  // model.bit16_swiglu_grad: SwiGLU's output gradient in T
  bool keep_norms_;         // model.keep_norm_outputs: norm_out
  int max_sequences_, seq_len_;
  int recompute_;  // the lowest layers that run their forward again in backward
  std::size_t n_max_;
  int loss_rows_;  // token rows of the cross-entropy's chunk (model.loss_chunk_rows)
  std::byte* mem_;
  CudaLayout l_;
  int device_;
  detail::CublasHandle cublas_;
  std::vector<float> inv_freq_;
  std::vector<int> positions_, rows_, starts_;  // the embedding gradient's grouping (host)
  std::size_t counted_ = 0;  // the uploaded batch's counted targets (not kIgnoredTarget)
  int* doc_positions_ = nullptr;  // the uploaded batch's positions on the device (documents apart)
  // Documents apart through cuDNN: the padded rows a call may take (0: the own kernels take
  // such batches: cuda_apart_through_cudnn), the prepared batch's calls and their documents as
  // uploaded (start, length pairs).
  long long apart_tokens_ = 0;
  ApartCalls apart_;
  std::vector<int> apart_docs_;

  // What a param gradient of the mean loss over the counted targets is multiplied by.
  float mean_factor(double grad_scale) const {
    return counted_ == 0 ? 0.0f : static_cast<float>(grad_scale / static_cast<double>(counted_));
  }
  ProfileWindow profile_;                  // SHARDSWAP_CUDA_PROFILE_STEPS
  PhaseClock clock_;                       // train_step's phases (time_phases)
  LossReadback loss_;                      // train_step's loss, read before its backward ends
  std::unique_ptr<CudnnAttention> cudnn_;  // null: the own kernels
  bool deterministic_ = false;             // cuDNN's deterministic backward
  float* dq32_ = nullptr;                  // its atomic backward's fp32 dQ (in the scratch)
};

}  // namespace

Attention cuda_attention(const DecoderShape& s, Attention requested) {
  // cuDNN's fused attention wants 16-byte head vectors.
  const bool fits = s.head_dim % 8 == 0 && s.head_dim <= kCudaMaxHeadDim;
  switch (requested) {
    case Attention::automatic:
      return cudnn_attention_available() && fits ? Attention::cudnn : Attention::own;
    case Attention::own:
      return Attention::own;
    case Attention::cudnn:
    case Attention::cudnn_atomic: {
      const std::string asked =
          std::string("model.attention = \"") + attention_key_value(requested) + "\"";
      if (!cudnn_attention_available())
        throw ConfigError(asked + ": this build has no cuDNN (SHARDSWAP_CUDNN)");
      if (!fits)
        throw ConfigError(asked + ": head_dim = " + std::to_string(s.head_dim) +
                          " is not a multiple of 8 up to " + std::to_string(kCudaMaxHeadDim) +
                          ", as cuDNN's fused attention needs");
      return requested;
    }
  }
  throw ConfigError("model.attention: not a value cuda_attention knows");
}

std::string cuda_attention_name(const DecoderShape& s, Attention requested) {
  const Attention a = cuda_attention(s, requested);
  if (a == Attention::own)
    return std::string("own kernels (") +
           (requested == Attention::own     ? "model.attention = \"own\""
            : !cudnn_attention_available() ? "this build has no cuDNN"
                                           : "head_dim is not a multiple of 8") +
           ")";
  const long v = CudnnAttention::version();  // major * 10000 + minor * 100 + patch (cuDNN 9)
  return "cuDNN " + std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." +
         std::to_string(v % 100) + " fused flash attention" +
         (a == Attention::cudnn
              ? ", deterministic backward"
              : " (model.attention = \"cudnn-atomic\": its backward sums dQ with atomics, "
                "two runs may differ in the last bits)");
}

bool cuda_apart_through_cudnn(const DecoderShape& s, int max_sequences, int seq_len,
                              Attention requested) {
  return cuda_attention(s, requested) != Attention::own &&
         cuda_apart_call_tokens(s, max_sequences, seq_len) > 0;
}

std::string cuda_apart_attention_name(const DecoderShape& s, int max_sequences, int seq_len,
                                      Attention requested) {
  if (cuda_attention(s, requested) == Attention::own)
    return "the decoder's own attention kernels, as for every batch of this run";
  if (!cuda_apart_through_cudnn(s, max_sequences, seq_len, requested))
    return "the decoder's own attention kernels (a padded row of " + std::to_string(seq_len) +
           " tokens does not fit the scratch that holds cuDNN's calls)";
  return "cuDNN, each document a sequence of its own, padded to its length class";
}

std::unique_ptr<Compute> make_cuda_compute(const DecoderShape& s, int max_sequences, int seq_len,
                                           DType dtype, void* memory, std::size_t bytes,
                                           int recompute, Precision precision,
                                           Attention requested, int loss_rows, bool keep_norms) {
  for (const auto& [what, of] : {std::pair{"logits", precision.logits},
                                 std::pair{"SwiGLU's gradient", precision.swiglu_grad},
                                 std::pair{"the residual stream", precision.residual}})
    if (of != DType::f32 && of != dtype)
      throw ConfigError(std::string("make_cuda_compute: ") + what + " of dtype " +
                        dtype_name(of) + ": fp32 or the weights' " + dtype_name(dtype));
  const bool bit16_logits = precision.logits != DType::f32,
             bit16_swiglu_grad = precision.swiglu_grad != DType::f32,
             bit16_residual = precision.residual != DType::f32;
  const std::size_t expected =
      cuda_bytes(s, max_sequences, seq_len, recompute, loss_rows, keep_norms, bit16_residual);
  if (bytes != expected)
    throw ConfigError("make_cuda_compute: the block has " + std::to_string(bytes) +
                      " bytes, the layout " + std::to_string(expected));
  if (memory == nullptr) throw ConfigError("make_cuda_compute: the block is null");
  if (reinterpret_cast<std::uintptr_t>(memory) % 256 != 0)
    throw ConfigError("make_cuda_compute: the block is not 256-byte aligned");
  auto* base = static_cast<std::byte*>(memory);
  const Attention attention = cuda_attention(s, requested);
  const bool apart = cuda_apart_through_cudnn(s, max_sequences, seq_len, requested);
  // T the weights' type, R the residual stream's (fp32, or T).
  const auto make = [&](auto weights, auto stream) -> std::unique_ptr<Compute> {
    using T = decltype(weights);
    using R = decltype(stream);
    return std::make_unique<CudaCompute<T, R>>(s, max_sequences, seq_len, recompute, loss_rows,
                                               keep_norms, base, attention, bit16_logits,
                                               bit16_swiglu_grad, apart);
  };
  switch (dtype) {
    case DType::bf16:
      return bit16_residual ? make(__nv_bfloat16{}, __nv_bfloat16{})
                            : make(__nv_bfloat16{}, float{});
    case DType::f16:
      return bit16_residual ? make(__half{}, __half{}) : make(__half{}, float{});
    default:
      break;
  }
  throw ConfigError(std::string("make_cuda_compute: dtype ") + dtype_name(dtype) +
                    " is not bf16 or fp16");
}

}  // namespace shardswap::lm::dec
