// The decoder-only transformer (Llama / Qwen2 / Qwen3 / Mistral; the math is in
// tools/model/decoder_compute.h) as the engine trains it: its params under their Hugging Face names,
// in groups "embed", "layers.0" .. "layers.{L-1}" and "head" (the final norm and, untied,
// lm_head; a tied head's matrix is the embedding, in "embed"), and one Decoder per rank that runs
// forward and backward on the engine's bit16 weights in place, adding gradients into its grad
// slots as backward produces them.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "shardswap/allocator.h"
#include "shardswap/dtype.h"
#include "shardswap/engine.h"
#include "model/decoder_compute.h"

namespace shardswap {

/// The largest sizes a DecoderShape may have: far above any published model (Llama 3.1 405B has
/// 126 layers, hidden 16384, intermediate 53248, 128 heads; vocabularies reach 262144), and low
/// enough that a mistyped config.json (num_hidden_layers = 1e9) is refused before the model's
/// param list, let alone its memory, is made, and that no count of elements or bytes made from a
/// shape overflows 64 bits.
struct DecoderShapeLimits {
  static constexpr int layers = 1 << 17;            ///< 131072
  static constexpr int hidden = 1 << 20;            ///< 1048576
  static constexpr int intermediate = 1 << 22;      ///< 4194304
  static constexpr int vocab = 1 << 24;             ///< 16777216
  static constexpr int heads = 1 << 16;             ///< 65536 (kv_heads: at most heads)
  static constexpr int head_dim = 1 << 16;          ///< 65536
  static constexpr std::int64_t q_width = 1 << 20;  ///< heads x head_dim
  /// Params in all (decoder_param_count): 2^48, about 2.8e14, 700 times Llama 3.1 405B's.
  static constexpr std::int64_t params = std::int64_t{1} << 48;
};

// validate_decoder_shape(shape, where), the decoder's shape rules: in decoder_compute.h, beside
// DecoderShape, so that the CUDA backend's layout (decoder_cuda.h, compiled by nvcc) uses it too.

/// One param: its Hugging Face name, shape [out, in] and group.
struct DecoderParam {
  lm::dec::ParamId id;
  std::string name;
  std::vector<std::int64_t> shape;
  std::string group;
};
/// Every param in declaration (forward) order: the embedding, each layer's (input_layernorm,
/// q/k/v projections with their biases where the shape has them, q_norm after q and k_norm
/// after k where it has those, o_proj,
/// post_attention_layernorm, gate, up, down), the final norm, lm_head unless tied.
std::vector<DecoderParam> decoder_params(const DecoderShape& shape);
/// "model.layers.3.self_attn.q_proj.weight" and so on.
std::string decoder_param_name(lm::dec::ParamId id);
/// "embed", "layers.0", ..., "head": the declaration order.
std::vector<std::string> decoder_groups(const DecoderShape& shape);
/// The elements of decoder_params(shape), counted without making the list.
std::int64_t decoder_param_count(const DecoderShape& shape);
/// decoder_param_count without validate_decoder_shape, for a reader that checks the count itself
/// to name its own keys: exact for sizes each within DecoderShapeLimits (no overflow then).
std::int64_t decoder_param_count_unchecked(const DecoderShape& shape);
/// FLOPs of one forward + backward over `tokens` positions of sequences of `seq_len` with every
/// group active, as MFU is usually counted (PaLM's appendix B): 6 N per token for the N params
/// plus 12 L (H hd) seq_len for attention's two matrix products, the causal mask not discounted.
double decoder_step_flops(const DecoderShape& shape, std::int64_t tokens, int seq_len);

/// Precision options (docs/models.md): values a backend keeps in the weights' dtype instead of
/// fp32, each rounded as a bit16 store leaves it: fewer bytes, not the same bits. Off by default.
struct DecoderPrecision {
  /// model.bit16_logits: the head's logits, before the cross-entropy.
  bool bit16_logits = false;
  /// model.bit16_swiglu_grad: the gradient at SwiGLU's output (the down projection's input
  /// gradient), before SwiGLU's backward.
  bool bit16_swiglu_grad = false;
  /// model.bit16_residual: the residual stream and the activation gradients that run along it
  /// (each layer's input and post-attention sums, the products added into them, the gradient at
  /// each norm's output and the stream's gradient).
  bool bit16_residual = false;
};

/// How make_decoder builds a decoder beyond its shape and batch: the model.* keys of a run
/// (docs/config.md) that change what a backend keeps or runs. The defaults are every key left out.
struct DecoderOptions {
  /// model.recompute_layers: the lowest layers keep only their input for backward and run their
  /// forward again there (the same bits in fewer activation bytes).
  int recompute_layers = 0;
  /// model.loss_chunk_rows: token rows of logits the cross-entropy holds at once; 0 is the
  /// backend's own (1024 on CUDA, 64 on the CPU). More rows: more activation bytes (rows x vocab
  /// x 4), fewer passes over the head's fp32 gradient.
  int loss_chunk_rows = 0;
  /// model.keep_norm_outputs (CUDA backend): each layer's two norm outputs kept from forward for
  /// its weight gradients, not made again in backward; the same bits in 2 x tokens x hidden x 2
  /// more activation bytes a kept layer (check_decoder_options).
  bool keep_norm_outputs = false;
  DecoderPrecision precision;
  /// model.attention: the CUDA backend's attention (check_decoder_options).
  lm::dec::Attention attention = lm::dec::Attention::automatic;
};

/// Token ids of `sequences` rows of `seq_len`: inputs and the targets that follow them.
struct DecoderBatch {
  int sequences = 0;
  int seq_len = 0;
  std::vector<std::int32_t> inputs;   ///< sequences * seq_len, row-major
  std::vector<std::int32_t> targets;  ///< sequences * seq_len
  /// Empty: every row is one stream (positions 0 .. seq_len - 1). Else sequences * seq_len
  /// positions that keep documents apart (lm::dec::Batch::positions).
  std::vector<std::int32_t> positions;
};

class Decoder {
 public:
  virtual ~Decoder() = default;

  /// Initial values of a model from scratch, a pure function of (seed, param name) as
  /// transformers initialises these models: matrices and the embedding N(0, 0.02), norm weights
  /// 1, biases 0.
  static void init(const DecoderShape& shape, const ParamInfo& param, std::span<float> values,
                   std::uint64_t seed);

  /// Forward + backward of one micro-batch (1 <= sequences <= max_sequences, 1 <= seq_len <=
  /// the model's seq_len): adds loss_scale() times `grad_weight` times the gradient of the mean
  /// loss over the counted targets (those not kIgnoredTarget) into the grad slots of the active
  /// groups, calling grad_slot(name) just before writing a param's gradient and grad_ready(name)
  /// right after. Backward stops below the lowest active group. Returns that mean loss (0 when
  /// no target counts). grad_weight lets a trainer weigh micro-batches by their counted targets,
  /// so that the gradients summed over micro-batches and ranks are those of the mean over the
  /// global batch. Throws ConfigError for a malformed batch (naming the token id out of range)
  /// or weights / slots of a dtype or size the model was not made for.
  virtual double train_step(Engine& engine, const DecoderBatch& batch, double grad_weight = 1.0) = 0;
  /// Mean loss only (validation); no gradients.
  virtual double loss(const Engine& engine, const DecoderBatch& batch) = 0;
  /// Every position's logits, [sequences * seq_len, vocab] (tests and export checks).
  virtual std::vector<float> logits(const Engine& engine, const DecoderBatch& batch) = 0;
  /// The backend's phase timing (lm::dec::Compute::time_phases): on the CUDA backend only.
  virtual void time_phases(bool on) = 0;
  virtual lm::dec::PhaseTimes take_phase_times() = 0;

  /// Exact bytes of Tag::activation (requested) that the model made by make_decoder with
  /// `options` holds in its MemorySpace for batches of up to max_sequences x seq_len (the
  /// options that size it: recompute_layers, loss_chunk_rows and keep_norm_outputs).
  static std::int64_t activation_bytes(const DecoderShape& shape, int max_sequences,
                                       int seq_len, DType dtype, DeviceKind device,
                                       const DecoderOptions& options = {});
};

/// Throws ConfigError naming the key of `options` that a decoder of `shape` on `device` cannot
/// honour: model.attention, anything but automatic on the host (the CPU backend has one
/// attention of its own), a cuDNN one where the build has no cuDNN or head_dim rules it out
/// (lm::dec::cuda_attention); model.keep_norm_outputs on the host (the CPU backend makes each
/// norm's output again in backward). BackendUnavailable for a CUDA device in a build without
/// CUDA.
void check_decoder_options(const DecoderShape& shape, const DecoderOptions& options,
                           DeviceKind device);

/// The CPU (Eigen) backend when space.device() is the host, the CUDA one (cuBLAS GEMMs, own
/// fused kernels and attention) on a CUDA device. All activation and workspace memory
/// is allocated once, here, from `space` with Tag::activation (activation_bytes() of it,
/// exactly). `dtype` is the weights' (the engine's config dtype: bf16 or fp16). Throws
/// ConfigError for a bad shape, max_sequences or seq_len < 1, seq_len above max_positions or a
/// dtype that is not bit16; BackendUnavailable for a CUDA space in a build without CUDA.
/// `options`: the run's model keys (DecoderOptions); one the device cannot honour is refused
/// as check_decoder_options says.
std::unique_ptr<Decoder> make_decoder(const DecoderShape& shape, int max_sequences, int seq_len,
                                      DType dtype, MemorySpace& space,
                                      const DecoderOptions& options = {});

}  // namespace shardswap
