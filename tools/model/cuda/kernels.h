// The host launchers of the decoder's CUDA kernels, one .cu file per op (tools/model/cuda/):
// CudaCompute (cuda_compute.cu) calls these, never a kernel. Each launcher picks its kernel's
// variant (the elements a thread or lane moves, from the operands' alignment) and launch
// configuration, queues it on cudaStreamPerThread and checks the launch (DeviceError). T is the
// weights' type (__nv_bfloat16 or __half), G a grad slot's (float or T); each file instantiates
// its launchers for those types. Activations are row-major [token, feature], token = sequence *
// seq_len + position. Plain C++17 declarations: nvcc and the host compiler both read it.
#pragma once

namespace shardswap::lm::dec {

// embedding.cu
/// x0[t, :] = table[tokens[t], :] in R (the residual stream's type: float, or T), for n tokens
/// of width d.
template <class T, class R>
void launch_embed_forward(const T* table, const int* tokens, int n, int d, R* x0);
/// slot[rows[u], :] += alpha * the sum of dx (of R) over positions[starts[u] .. starts[u + 1]),
/// for each of the `distinct` input tokens u.
template <class G, class R>
void launch_embed_backward(const R* dx, const int* rows, int distinct, const int* starts,
                           const int* positions, int d, float alpha, G* slot);

// rms_norm.cu (R: the residual stream's type, float or T; fp32 arithmetic either way)
/// y = x / rms(x) * w per row in T; rstd (when not null) = 1 / rms.
template <class T, class R>
void launch_rms_norm_forward(const R* x, const T* w, int n, int d, float eps, T* y, float* rstd);
/// The residual sum and its norm in one pass: sum = residual + sum (sum holds a GEMM's product
/// on entry; the sum stored in R), then y and rstd of that sum as stored, as
/// launch_rms_norm_forward.
template <class T, class R>
void launch_residual_rms_norm_forward(const R* residual, R* sum, const T* w, int n, int d,
                                      float eps, T* y, float* rstd);
/// From dz at the norm's output, in one pass: when dx is not null, dx (= or += with accumulate)
/// the gradient at its input, and the new dx rounded to T into d16 when d16 is not null; when
/// partials is not null, partials [chunks, d] of the column sums of dz * x * rstd (its weight
/// gradient), chunks of kCudaNormRowsPerPartial rows, for launch_finish_columns.
template <class T, class R>
void launch_rms_norm_backward(const R* dz, const R* x, const float* rstd, const T* w, int n,
                              int d, R* dx, bool accumulate, T* d16, float* partials);

// rope_qkv.cu
/// cos and sin of RoPE's angles pos * inv_freq[f], [seq_len, half] each.
void launch_rope_table(const float* inv_freq, int seq_len, int half, float* cos_out,
                       float* sin_out);
/// q, k (biased and rotated) and v (biased) in T from the fp32 projections qkv [n, (H + 2K) hd];
/// a bias may be null. Token t's RoPE position is positions[t] (device; documents apart) or,
/// with positions null, t % seq_len.
template <class T>
void launch_qkv_forward(int n, const float* qkv, const T* bq, const T* bk, const T* bv,
                        const float* rope_cos, const float* rope_sin, int seq_len, int heads,
                        int kv_heads, int hd, T* q, T* k, T* v, const int* positions);
/// RoPE's backward from dq|dk|dv in `in` (In: fp32 or T; may be g or g16): the gradient at the
/// projections rounded into g16, into g (fp32) unless g is null, and unless partials is null
/// partials [chunks, (H + 2K) hd] of its column sums (the biases' gradients), chunks of
/// kCudaRowsPerPartial rows, for launch_finish_columns. Positions as launch_qkv_forward's.
template <class T, class In>
void launch_qkv_backward(int n, const In* in, float* g, const float* rope_cos,
                         const float* rope_sin, int seq_len, int heads, int kv_heads, int hd,
                         T* g16, const int* positions, float* partials);

// head_norm.cu: Qwen3's RMSNorm of each q and k head (DecoderShape::qk_norm), before RoPE.
/// In place on the fp32 projections qkv [n, (H + 2K) hd] (rows ld apart), each of the H q heads
/// and K k heads of a token (contiguous at its row's start) x -> x r w, r = 1 / rms(x) over the
/// head's hd values, w = wq for a q head, wk for a k head; xhat [n (H + K), hd] = x r in T and
/// rstd [n (H + K)] = r, for the backward.
template <class T>
void launch_head_norm_forward(float* qkv, long long ld, int n, int heads, int kv_heads, int hd,
                              const T* wq, const T* wk, float eps, T* xhat, float* rstd);
/// From dz at the norms' output in g's q|k columns (fp32, rows ld apart), in place the gradient
/// at their input into g and rounded to T into g16 (the same rows).
template <class T>
void launch_head_norm_backward(float* g, T* g16, long long ld, int n, int heads, int kv_heads,
                               int hd, const T* wq, const T* wk, const T* xhat,
                               const float* rstd);
/// partials [chunks, hd] of one head norm's weight gradient: the sum of dz * xhat over the
/// chunk's kCudaRowsPerPartial tokens and over heads [first, first + count) of each token's
/// per_token = H + K (dz: head h of token t at t ld + h hd; xhat as the forward's).
template <class T>
void launch_head_norm_partials(const float* dz, long long ld, const T* xhat, int n,
                               int per_token, int first, int count, int hd, float* partials);

// attention_forward.cu, attention_backward.cu: the own causal GQA attention.
/// o [n, H hd] in T and lse fp32 [n, H] from q [n, H hd], k, v [n, K hd]. With positions
/// (device, [n]; null: none), token i attends to tokens i - positions[i] .. i of its row only
/// (documents apart, lm::dec::Batch::positions).
template <class T>
void launch_attention_forward(int sequences, int seq_len, int heads, int kv_heads, int hd,
                              const T* q, const T* k, const T* v, T* o, float* lse,
                              const int* positions);
/// dq, dk, dv in fp32 at columns 0, H hd and (H + K) hd of `grads` (rows ld long); delta fp32
/// [n, H] is scratch. Positions as launch_attention_forward's.
template <class T>
void launch_attention_backward(int sequences, int seq_len, int heads, int kv_heads, int hd,
                               const T* q, const T* k, const T* v, const T* o, const T* dout,
                               const float* lse, float* delta, float* grads, long long ld,
                               const int* positions);

// apart.cu: documents apart through cuDNN (tools/model/apart_calls.h), a call's rows moved
// between the batch and padded buffers. A call is `sequences` padded sequences of seq_len rows;
// padded row r is position r % seq_len of document r / seq_len, whose (start, length) pair is
// docs[2 (r / seq_len)] (device ints; `count` documents, the sequences past them all padding).
/// One tensor: rows of `width` elements, `ld` apart on the batch's side and packed on the padded
/// side. width and ld multiples of 8, pointers 16-byte aligned (the launchers check).
template <class T>
struct ApartTensor {
  const T* from;
  T* to;
  int width;
  long long ld;
};
inline constexpr int kApartMaxTensors = 5;
template <class T>
struct ApartTensors {
  int count = 0;
  ApartTensor<T> t[kApartMaxTensors];
};
/// The padded rows of each tensor (from the batch, to the padded buffer): a document's rows, and
/// zeros past its length. With lse_to, also lse_to [sequences, heads, seq_len] (cuDNN's layout)
/// from lse_from [batch rows, heads], 0 on the padding.
template <class T>
void launch_apart_gather(const int* docs, int count, int sequences, int seq_len,
                         const ApartTensors<T>& tensors, const float* lse_from, float* lse_to,
                         int heads);
/// The reverse, for the documents' rows only (from the padded buffer, to the batch): lse_to
/// [batch rows, heads] from lse_from in cuDNN's layout, when lse_to is not null.
template <class T>
void launch_apart_scatter(const int* docs, int count, int sequences, int seq_len,
                          const ApartTensors<T>& tensors, const float* lse_from, float* lse_to,
                          int heads);

// swiglu.cu
/// act [rows, width] = silu(gate) * up, gate and up rows of width elements ld apart.
template <class T>
void launch_swiglu_forward(const T* gate, const T* up, int rows, int width, long long ld,
                           T* act);
/// gate and up (as the forward's) replaced by their gradients from dact [rows, width] (D: fp32,
/// or T under model.bit16_swiglu_grad); act recomputed when not null.
template <class T, class D>
void launch_swiglu_backward(const D* dact, T* gate, T* up, T* act, int rows, int width,
                            long long ld);

// cross_entropy.cu
/// row_loss[r] = logsumexp(z_r) - z_r[targets[r]] for `rows` rows of logits [rows, vocab] of
/// type L (fp32, or T); with grad, each row replaced in place by softmax(z_r) - onehot in T at
/// the row's start. A row whose target is kIgnoredTarget has loss 0 and a zero gradient.
template <class T, class L>
void launch_cross_entropy_rows(L* logits, int rows, int vocab, const int* targets,
                               float* row_loss, bool grad);
/// *out = the sum of loss[0 .. n) in fp64 over `denominator` (the counted targets; 0 gives 0).
void launch_mean_of(const float* loss, int n, double denominator, double* out);

// column_sums.cu
/// slot[k] += alpha * the sum of partials[0 .. chunks)[k] in a fixed order (the same bits run to
/// run), a chunk's partials stride floats apart (also the head norms').
template <class G>
void launch_finish_columns(const float* partials, int chunks, int w, int stride, float alpha,
                           G* slot);

}  // namespace shardswap::lm::dec
