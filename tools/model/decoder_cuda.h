// The decoder's CUDA backend (tools/model/cuda/; a stub throwing BackendUnavailable in a build
// without CUDA): its memory layout, whose byte count the plan uses, and its factory.
// C++17 and free of the engine so that nvcc compiles it.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "shardswap/error.h"
#include "model/cudnn_attention.h"
#include "model/decoder_compute.h"

namespace shardswap::lm::dec {

/// Token rows of fp32 logits the cross-entropy holds at once ([rows, vocab]) unless a run asks
/// for another count (model.loss_chunk_rows): 594 MiB for a 152k vocabulary. Each chunk adds its
/// head gradient into the fp32 [vocab, hidden] slot (read and written whole), so fewer, larger
/// chunks are faster: at Qwen2.5-0.5B, 8 x 2048 tokens, chunks of 128 rows made the head and
/// loss 98 ms of a 241 ms step on an H200, chunks of 1024 29 ms (docs/benchmarks.md).
inline constexpr int kCudaLossChunkRows = 1024;
/// The rows of a chunk for a requested count (model.loss_chunk_rows; 0: kCudaLossChunkRows) and
/// batches of up to n tokens.
inline int cuda_loss_rows(int requested, std::size_t n) {
  const auto rows = static_cast<std::size_t>(requested > 0 ? requested : kCudaLossChunkRows);
  return static_cast<int>(std::min(rows, n));
}
/// Rows per partial sum of the deterministic column sums (bias and head-norm gradients):
/// partials of this many token rows, then one ordered sum of the partials.
inline constexpr int kCudaRowsPerPartial = 64;
/// The same for the RMSNorm weights' gradients, whose backward runs a block per partial: fewer
/// rows a block give it blocks enough to fill the GPU (1024 at 16,384 tokens, 384 at 6,144).
inline constexpr int kCudaNormRowsPerPartial = 16;
/// The attention kernel keeps a head's vector spread over a warp, at most 4 values a lane.
inline constexpr int kCudaMaxHeadDim = 128;
/// cuBLAS workspace, handed to cuBLAS from the block so that it allocates none itself (32 MiB:
/// cuBLAS's own default on Hopper).
inline constexpr std::size_t kCudaCublasWorkspaceBytes = std::size_t{32} << 20;

/// Byte offsets of the backend's regions in its one block, for n = max_sequences * seq_len
/// tokens. "b16" regions hold the weights' type (bf16 or fp16): GEMM inputs and attention's
/// operands; norm statistics and reductions are fp32; "r" regions, the residual stream and the
/// gradients along it, fp32 or (model.bit16_residual) the weights' type.
struct CudaLayout {
  std::size_t inv_freq;       // f32 head_dim / 2 (RoPE), uploaded once
  std::size_t rope_cos, rope_sin;  // f32 seq_len head_dim / 2: RoPE's angles, once a forward
  std::size_t tokens;         // i32 n: the batch's inputs
  std::size_t targets;        // i32 n
  std::size_t positions;      // i32 n: the batch's positions (documents apart), when it has them
  std::size_t embed_rows;     // i32 n: the distinct input tokens, ascending
  std::size_t embed_starts;   // i32 n + 1: where each one's positions start in embed_positions
  std::size_t embed_positions;  // i32 n: positions grouped by token, ascending within a token
  std::size_t documents;  // i32 2 n: (start, length) of each document, documents apart through
                          // cuDNN (tools/model/apart_calls.h)
  // Kept from forward for backward. xs holds every layer's input; the other per-layer regions
  // hold S = cuda_kept_slots(L, R) slots, layer l's at cuda_slot_of(l, R) (R = recompute_layers:
  // the lowest R layers share slot 0 and refill it in backward).
  std::size_t xs;    // r (L + 1) n D: the residual stream entering each layer, then x_L
  std::size_t ys;    // r S n D: the residual stream after attention
  std::size_t rstd_attn, rstd_mlp;  // f32 S n: 1 / rms of the attention and MLP norms' rows
  std::size_t rstd_final;           // f32 n: of the final norm's
  std::size_t q, k, v;  // b16 S n H hd, S n K hd, S n K hd: after bias, head norm and RoPE
  std::size_t o;        // b16 S n H hd: attention's output
  std::size_t lse;      // f32 S cuda_lse_stride(n, H): logsumexp of each attention row
  // qk_norm (Qwen3) only, 0 bytes without: each q and k head's normalised values before their
  // weight, x / rms(x) (what the norms' backward and weight gradients read: kept, as q and k
  // are, since the projections' fp32 rows are scratch), H q heads then K k heads a token.
  std::size_t qk_hat;   // b16 S n (H + K) hd
  std::size_t qk_rstd;  // f32 S n (H + K): 1 / rms of each of those head rows
  std::size_t gate_up;  // b16 S n 2I: the MLP's two input projections, a token's gate row
                        // then its up row (one GEMM writes both where Wgate|Wup lie together)
  // model.keep_norm_outputs only, 0 bytes without: the two norms' outputs of each slot (n D of
  // the attention's norm, then n D of the MLP's), the inputs of the q|k|v and gate|up weight
  // gradients, which backward otherwise makes again in `normed`.
  std::size_t norms;    // b16 S 2 n D
  // Scratch, one of each:
  std::size_t normed;  // b16 n D: a norm's output (recomputed in backward unless kept)
  std::size_t qkv32;   // f32 n (H + 2K) hd: q|k|v projections; in backward dq|dk|dv
  std::size_t qkv16;   // b16 n (H + 2K) hd: dq|dk|dv before RoPE, as GEMM inputs
  std::size_t wqkv;    // b16 (H + 2K) hd D: Wq|Wk|Wv side by side, where they are not already
                       // (biases or head norms between them in the group)
  std::size_t act;     // b16 n I: silu(gate) * up
  std::size_t dact;    // f32 n I: its gradient
  // act and dact together (free while attention runs, forward and backward) also hold a call's
  // padded buffers when documents apart go through cuDNN (cuda_apart_call_tokens).
  std::size_t dx;      // r n D: gradient of the residual stream
  std::size_t dz;      // r n D: gradient at a norm's output
  std::size_t d16;     // b16 n D: dx rounded, a GEMM input (0 bytes where dx is b16 itself)
  std::size_t dout;    // b16 n H hd: gradient of attention's output
  std::size_t delta;   // f32 n H: rowsum(dout * o) per head
  std::size_t logits;  // f32 cuda_loss_rows(.., n) V; its rows' gradient in place (b16)
  std::size_t row_loss;   // f32 n
  std::size_t mean_loss;  // f64 1
  std::size_t partials;   // f32 max(ceil(n / kCudaRowsPerPartial) (H + 2K) hd,
                          //         ceil(n / kCudaNormRowsPerPartial) D)
  std::size_t workspace;  // kCudaCublasWorkspaceBytes
  // Attention through cuDNN (a build with cuDNN; 0 bytes in one without):
  std::size_t attn_scratch;  // cuda_cudnn_scratch_bytes: its workspace (and fp32 dQ, atomic form)
  std::size_t bytes;      // total
};

/// Floats between layers' lse rows: n H rounded up to 16 bytes, as cuDNN wants its tensors.
inline std::size_t cuda_lse_stride(std::size_t n, int heads) {
  return (n * static_cast<std::size_t>(heads) + 3) / 4 * 4;
}

/// Throws ConfigError naming the field or argument the CUDA backend cannot run: the decoder's
/// shape rules (validate_decoder_shape), then the backend's own limits.
inline void check_cuda_shape(const DecoderShape& s, int max_sequences, int seq_len) {
  const auto fail = [](const std::string& what) {
    throw ConfigError("decoder (cuda): " + what);
  };
  if (max_sequences < 1) fail("max_sequences = " + std::to_string(max_sequences) + ": not >= 1");
  if (max_sequences > 65535)  // a grid dimension of the attention kernels
    fail("max_sequences = " + std::to_string(max_sequences) + ": above 65535");
  if (seq_len < 1) fail("seq_len = " + std::to_string(seq_len) + ": not >= 1");
  validate_decoder_shape(s, "decoder (cuda)");
  // transformers adds q_proj's and k_proj's biases before the head norms; this backend adds
  // them in RoPE's kernel, after. validate_decoder_shape refuses the pair for every backend;
  // this backend would be wrong without that rule, so it keeps its own.
  if (s.qkv_bias && s.qk_norm)
    fail("qkv_bias with qk_norm: q/k biases before the per-head q/k norms are not supported");
  if (s.heads > 65535) fail("heads = " + std::to_string(s.heads) + ": above 65535");
  if (s.head_dim > kCudaMaxHeadDim)
    fail("head_dim = " + std::to_string(s.head_dim) + ": above " +
         std::to_string(kCudaMaxHeadDim) + ", the most the attention kernels hold");
  if (seq_len > s.max_positions)
    fail("seq_len = " + std::to_string(seq_len) + " is above max_position_embeddings = " +
         std::to_string(s.max_positions));
  if (std::int64_t{max_sequences} * seq_len > (std::int64_t{1} << 30))
    fail("max_sequences * seq_len = " + std::to_string(std::int64_t{max_sequences} * seq_len) +
         " tokens: above 2^30");
}

/// The dP bytes the decoder gives one call of cuDNN's deterministic backward: the batch goes in
/// calls of as many sequences as fit, one at least. 1 GiB holds the whole batch of the Qwen2.5
/// 0.5B-7B shapes at seq 2048 (the 0.5B's 8 sequences: 896 MiB), one call a layer: at 256 MiB
/// (cudnn-frontend's default bound) the 0.5B went in 4 calls, 0.23 ms a layer slower
/// (docs/models.md).
inline constexpr std::size_t kCudaDeterministicDpBytes = std::size_t{1} << 30;

/// The decoder's attention problem for cuDNN: sequences x seq_len tokens of s's heads, on the
/// backend's rows (q, o and dout of H hd, k and v of K hd, dq|dk|dv side by side in one row).
inline AttentionShape cuda_attention_shape(const DecoderShape& s, int sequences, int seq_len,
                                           DType dtype, bool deterministic) {
  AttentionShape a;
  a.sequences = sequences;
  a.seq_len = seq_len;
  a.heads = s.heads;
  a.kv_heads = s.kv_heads;
  a.head_dim = s.head_dim;
  a.dtype = dtype;
  a.q_ld = s.q_width();
  a.kv_ld = s.kv_width();
  a.grad_ld = s.q_width() + 2 * s.kv_width();
  a.deterministic = deterministic;
  return a;
}

/// The fp32 dQ accumulator of cuDNN's atomic backward, at the start of the cuDNN scratch.
inline std::size_t cuda_cudnn_dq32_bytes(const DecoderShape& s, int max_sequences, int seq_len) {
  const std::size_t n = static_cast<std::size_t>(max_sequences) * static_cast<std::size_t>(seq_len);
  return (n * static_cast<std::size_t>(s.q_width()) * sizeof(float) + 255) / 256 * 256;
}

/// cuDNN's scratch for batches of up to max_sequences x seq_len tokens, enough for either
/// backward: the atomic one's fp32 dQ and workspace, or the deterministic one's workspace for
/// calls of as many sequences as kCudaDeterministicDpBytes of dP allows (one call's worth at
/// least).
inline std::size_t cuda_cudnn_scratch_bytes(const DecoderShape& s, int max_sequences, int seq_len) {
  const std::size_t n = static_cast<std::size_t>(max_sequences) * static_cast<std::size_t>(seq_len);
  const std::size_t atomic = cuda_cudnn_dq32_bytes(s, max_sequences, seq_len) +
                             cudnn_attention_workspace_bytes(n, s.heads, s.head_dim);
  // (Workspace sizes do not depend on the dtype.)
  const AttentionShape a = cuda_attention_shape(s, max_sequences, seq_len, DType::bf16, true);
  int per_call = cudnn_attention_deterministic_sequences(
      a, kCudaDeterministicDpBytes + cudnn_attention_workspace_bytes(n, s.heads, s.head_dim));
  for (int c = 1; per_call == 0; ++c)  // not even one call within the bound: the smallest call
    if (cudnn_attention_deterministic_sequences(
            a, cudnn_attention_deterministic_workspace_bytes(c, seq_len, s.heads, s.head_dim)) > 0)
      per_call = c;
  return std::max(atomic, cudnn_attention_deterministic_workspace_bytes(per_call, seq_len, s.heads,
                                                                         s.head_dim));
}

/// Slots of per-layer activations the backend keeps when the lowest `recompute` of `layers`
/// layers keep only their input and run their forward again in backward: one each for the
/// others, one shared by the recomputed ones.
inline std::size_t cuda_kept_slots(int layers, int recompute) {
  return static_cast<std::size_t>(recompute == 0 ? layers : layers - recompute + 1);
}
/// Layer l's slot: its own, or slot 0 for a recomputed layer.
inline std::size_t cuda_slot_of(int l, int recompute) {
  return static_cast<std::size_t>(recompute == 0 ? l : l < recompute ? 0 : l - recompute + 1);
}

inline CudaLayout cuda_layout(const DecoderShape& s, int max_sequences, int seq_len,
                              int recompute, int loss_rows = 0, bool keep_norms = false,
                              bool bit16_residual = false) {
  check_cuda_shape(s, max_sequences, seq_len);
  if (recompute < 0 || recompute > s.layers)
    throw ConfigError("decoder (cuda): recompute_layers = " + std::to_string(recompute) +
                      " is outside [0, layers = " + std::to_string(s.layers) + "]");
  if (loss_rows < 0)
    throw ConfigError("decoder (cuda): loss_chunk_rows = " + std::to_string(loss_rows) +
                      " is negative");
  struct Arena {  // regions at multiples of 256 bytes
    std::size_t bytes = 0;
    std::size_t take(std::size_t count, std::size_t size) {
      const std::size_t at = bytes;
      bytes += (count * size + 255) / 256 * 256;
      return at;
    }
  } a;
  constexpr std::size_t f32 = 4, b16 = 2, i32 = 4;
  const std::size_t stream = bit16_residual ? b16 : f32;  // the "r" regions' element
  const auto n = static_cast<std::size_t>(max_sequences) * static_cast<std::size_t>(seq_len);
  const auto d = static_cast<std::size_t>(s.hidden), in = static_cast<std::size_t>(s.intermediate),
             layers = static_cast<std::size_t>(s.layers), h = static_cast<std::size_t>(s.heads),
             v = static_cast<std::size_t>(s.vocab);
  const auto qw = static_cast<std::size_t>(s.q_width()),
             kw = static_cast<std::size_t>(s.kv_width());
  const auto rows = static_cast<std::size_t>(cuda_loss_rows(loss_rows, n));
  const std::size_t partials = (n + kCudaRowsPerPartial - 1) / kCudaRowsPerPartial,
                    norm_partials = (n + kCudaNormRowsPerPartial - 1) / kCudaNormRowsPerPartial;
  CudaLayout l{};
  l.inv_freq = a.take(static_cast<std::size_t>(s.head_dim / 2), f32);
  l.rope_cos = a.take(static_cast<std::size_t>(seq_len) * (s.head_dim / 2), f32);
  l.rope_sin = a.take(static_cast<std::size_t>(seq_len) * (s.head_dim / 2), f32);
  l.tokens = a.take(n, i32);
  l.targets = a.take(n, i32);
  l.positions = a.take(n, i32);
  l.embed_rows = a.take(n, i32);
  l.embed_starts = a.take(n + 1, i32);
  l.embed_positions = a.take(n, i32);
  l.documents = a.take(2 * n, i32);
  const std::size_t slots = cuda_kept_slots(s.layers, recompute);
  l.xs = a.take((layers + 1) * n * d, stream);
  l.ys = a.take(slots * n * d, stream);
  l.rstd_attn = a.take(slots * n, f32);
  l.rstd_mlp = a.take(slots * n, f32);
  l.rstd_final = a.take(n, f32);
  l.q = a.take(slots * n * qw, b16);
  l.k = a.take(slots * n * kw, b16);
  l.v = a.take(slots * n * kw, b16);
  l.o = a.take(slots * n * qw, b16);
  l.lse = a.take(slots * cuda_lse_stride(n, s.heads), f32);
  const std::size_t head_rows = s.qk_norm ? n * (h + static_cast<std::size_t>(s.kv_heads)) : 0;
  l.qk_hat = a.take(slots * head_rows * static_cast<std::size_t>(s.head_dim), b16);
  l.qk_rstd = a.take(slots * head_rows, f32);
  l.gate_up = a.take(slots * n * 2 * in, b16);
  l.norms = a.take(keep_norms ? slots * 2 * n * d : 0, b16);
  l.normed = a.take(n * d, b16);
  l.qkv32 = a.take(n * (qw + 2 * kw), f32);
  l.qkv16 = a.take(n * (qw + 2 * kw), b16);
  l.wqkv = a.take((qw + 2 * kw) * d, b16);
  l.act = a.take(n * in, b16);
  l.dact = a.take(n * in, f32);
  l.dx = a.take(n * d, stream);
  l.dz = a.take(n * d, stream);
  l.d16 = a.take(bit16_residual ? 0 : n * d, b16);
  l.dout = a.take(n * qw, b16);
  l.delta = a.take(n * h, f32);
  l.logits = a.take(rows * v, f32);
  l.row_loss = a.take(n, f32);
  l.mean_loss = a.take(1, 8);
  l.partials = a.take(std::max(partials * (qw + 2 * kw), norm_partials * d), f32);
  l.workspace = a.take(kCudaCublasWorkspaceBytes, 1);
  // Kept whichever attention a run picks (model.attention): the plan of a build does not
  // depend on it. Whether the build has cuDNN is a link-time choice
  // (cudnn_attention.cpp or its stub), the same for every target of one build.
  l.attn_scratch = a.take(
      cudnn_attention_available() ? cuda_cudnn_scratch_bytes(s, max_sequences, seq_len) : 0, 1);
  l.bytes = a.bytes;
  return l;
}

/// Documents apart through cuDNN (tools/model/apart_calls.h): the bytes one padded row takes in
/// a call's buffers, q, k, v, o, dout and dq|dk|dv in the weights' type and lse in fp32.
inline std::size_t cuda_apart_row_bytes(const DecoderShape& s) {
  const auto qw = static_cast<std::size_t>(s.q_width());
  const auto kw = static_cast<std::size_t>(s.kv_width());
  return 2 * (4 * qw + 4 * kw) + 4 * static_cast<std::size_t>(s.heads);
}

/// The padded rows one cuDNN call of documents apart may take: as many as the act and dact
/// scratch holds (the call's buffers live there, each at a multiple of 256 bytes), at most the
/// batch's n tokens (what cuDNN's workspace, dQ and delta regions are sized for); 0 when that is
/// not one row of seq_len, and batches that keep documents apart then run the own kernels.
inline long long cuda_apart_call_tokens(const DecoderShape& s, int max_sequences, int seq_len) {
  const CudaLayout l = cuda_layout(s, max_sequences, seq_len, 0);
  const std::size_t arena = l.dx - l.act, slack = 7 * 256;
  const long long n = static_cast<long long>(max_sequences) * seq_len;
  const long long fit =
      arena > slack ? static_cast<long long>((arena - slack) / cuda_apart_row_bytes(s)) : 0;
  const long long tokens = std::min(n, fit);
  return tokens >= seq_len ? tokens : 0;
}

/// Exact bytes of the CUDA backend's device block for batches of up to max_sequences x seq_len
/// tokens with the lowest `recompute` layers recomputed in backward: every activation it keeps,
/// its scratch, the chunked cross-entropy's logits rows (cuda_loss_rows(loss_rows, tokens) of
/// them), with keep_norms (model.keep_norm_outputs) each kept layer's two norm outputs, the
/// residual stream and its gradients in the weights' type with bit16_residual
/// (model.bit16_residual; else fp32), the cuBLAS workspace and, with cuDNN, its fp32 dQ and
/// workspace. Nothing else is allocated on the device by train_step or loss. Throws ConfigError
/// as check_cuda_shape, or naming recompute_layers outside [0, layers] or a negative
/// loss_chunk_rows.
inline std::size_t cuda_bytes(const DecoderShape& s, int max_sequences, int seq_len,
                              int recompute = 0, int loss_rows = 0, bool keep_norms = false,
                              bool bit16_residual = false) {
  return cuda_layout(s, max_sequences, seq_len, recompute, loss_rows, keep_norms, bit16_residual)
      .bytes;
}

/// The attention the backend runs for shape s when a run asks for `requested` (model.attention):
/// cudnn, cudnn_atomic or own, never automatic. automatic is cudnn where the build has cuDNN and
/// head_dim is a multiple of 8 (every Llama, Qwen2, Qwen3 and Mistral checkpoint), else own.
/// Throws ConfigError naming model.attention for a cuDNN value where the build or head_dim rules
/// cuDNN out. cuDNN's atomic backward: 4% more tokens/s at Qwen2.5-0.5B on 2026-12-01
/// (docs/benchmarks.md); runs may differ in the last bits.
Attention cuda_attention(const DecoderShape& s, Attention requested = Attention::automatic);
/// What cuda_attention picks, in words: "cuDNN 9.14.0 fused flash attention, deterministic
/// backward", the same with the atomic backward's warning, or "own kernels (...why...)".
/// BackendUnavailable in a build without CUDA.
std::string cuda_attention_name(const DecoderShape& s,
                                Attention requested = Attention::automatic);

/// Whether batches that keep documents apart go to cuDNN in padded length-class calls
/// (tools/model/apart_calls.h) rather than to the own kernels: where cuda_attention(s, requested)
/// is cuDNN and cuda_apart_call_tokens > 0 (docs/data.md). ConfigError as cuda_attention;
/// BackendUnavailable in a build without CUDA.
bool cuda_apart_through_cudnn(const DecoderShape& s, int max_sequences, int seq_len,
                              Attention requested);
/// The same in words, for the run's first lines: cuDNN's padded calls, or the own kernels and why.
std::string cuda_apart_attention_name(const DecoderShape& s, int max_sequences, int seq_len,
                                      Attention requested = Attention::automatic);

/// The backend's own attention kernels alone (what it runs without cuDNN), on packed rows:
/// q, o [sequences * seq_len, heads * head_dim], k, v [.., kv_heads * head_dim] of dtype
/// (bf16 or fp16), lse fp32 [sequences * seq_len, heads]; backward writes fp32 dq, dk, dv at
/// column 0, H hd and (H + K) hd of rows `ld` long, with delta fp32 [tokens, heads] as scratch.
/// Queued on cudaStreamPerThread. For tests against cuDNN's.
void own_attention_forward(DType dtype, int sequences, int seq_len, int heads, int kv_heads,
                           int head_dim, const void* q, const void* k, const void* v, void* o,
                           float* lse);
void own_attention_backward(DType dtype, int sequences, int seq_len, int heads, int kv_heads,
                            int head_dim, const void* q, const void* k, const void* v,
                            const void* o, const void* dout, const float* lse, float* delta,
                            float* grads, long long ld);

/// The backend on [memory, memory + bytes) of the device that holds it (bytes ==
/// cuda_bytes(..., recompute); the block must outlive the backend). dtype is the weights' type, bf16 or
/// fp16. Batches may have fewer sequences and a shorter seq_len than configured. Everything is
/// queued on cudaStreamPerThread; the host waits only to read the loss (or logits) back.
/// Defined in cuda/cuda_compute.cu, or in the stub of a build without CUDA (BackendUnavailable).
/// The lowest `recompute` layers keep only their input and run their forward again at the start
/// of their backward (model.recompute_layers): the same bits in cuda_bytes(..., recompute).
/// `precision`: fp32 everywhere (the default), or in the weights' dtype the head's logits
/// (model.bit16_logits: half the bytes the head writes and the cross-entropy reads), the
/// gradient at SwiGLU's output (model.bit16_swiglu_grad: half the bytes the down projection's
/// input-gradient GEMM writes and SwiGLU's backward reads) and the residual stream with its
/// gradients (model.bit16_residual: xs, ys, dz and dx in the weights' type, the norms and the
/// GEMMs that write the stream moving half the bytes; bytes as cuda_bytes gives them with it);
/// the loss and gradients then change in the last bits. Any other dtype is a ConfigError.
/// `attention`: model.attention, resolved by cuda_attention (whose ConfigError it throws).
/// `loss_rows`: the cross-entropy's chunk (model.loss_chunk_rows; 0: kCudaLossChunkRows), and
/// `keep_norms` (model.keep_norm_outputs: each layer's norm outputs kept from forward for the
/// weight gradients, not made again in backward; the same bits), as cuda_bytes was given them.
std::unique_ptr<Compute> make_cuda_compute(const DecoderShape& s, int max_sequences, int seq_len,
                                           DType dtype, void* memory, std::size_t bytes,
                                           int recompute = 0, Precision precision = {},
                                           Attention attention = Attention::automatic,
                                           int loss_rows = 0, bool keep_norms = false);

}  // namespace shardswap::lm::dec
