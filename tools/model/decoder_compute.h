// The decoder-only transformer (Llama / Qwen2 / Qwen3 / Mistral architecture) at the seam between the
// engine-facing model (tools/model/decoder.h: names, groups, grad slots) and its compute backends
// (CPU: tools/model/decoder_cpu.cpp). C++17 and free of Eigen and the engine so that nvcc compiles
// it: weights and slots travel as raw pointers (device pointers for a device backend), the batch
// as host token ids.
//
// The model, as Hugging Face transformers computes it (LlamaForCausalLM, Qwen2ForCausalLM,
// Qwen3ForCausalLM, MistralForCausalLM), for a batch of B sequences of T tokens:
//   x_0 = embed[tokens]                                             [B*T, D]
//   per layer l:
//     a = rmsnorm(x_l) * input_layernorm                            eps = rms_eps
//     q = a Wq^T (+ bq), k = a Wk^T (+ bk), v = a Wv^T (+ bv)       heads H, kv_heads K, head_dim hd
//     (qk_norm, Qwen3: each head's q_h = rmsnorm(q_h) * q_norm, k_g = rmsnorm(k_g) * k_norm,
//      over its hd features, eps = rms_eps)
//     q, k = rope(q), rope(k) at positions 0..T-1 of each sequence  (rotate-half convention)
//     o_h = softmax(q_h k_g^T / sqrt(hd) + causal mask) v_g         g = h / (H / K)
//     (documents apart, Batch::positions: a token's position is its place in its document, and
//      the causal mask also hides the tokens of earlier documents, as transformers does with
//      position_ids that restart: each document is computed as if alone)
//     y = x_l + o Wo^T
//     b = rmsnorm(y) * post_attention_layernorm
//     x_{l+1} = y + (silu(b Wgate^T) * (b Wup^T)) Wdown^T
//   f = rmsnorm(x_L) * norm
//   logits = f Whead^T (Whead = embed when tied)                    [B*T, V]
//   loss = mean over the B*T positions of -log softmax(logits)[target]
// Weight matrices are row-major [out, in], as Hugging Face stores them.
#pragma once

#include <stdexcept>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "shardswap/dtype.h"

namespace shardswap {

enum class DecoderFamily { llama, qwen2, qwen3, mistral };
enum class RopeScaling { none, linear, llama3 };

/// Everything that fixes the decoder's parameters and arithmetic (Hugging Face config.json
/// fields in brackets).
struct DecoderShape {
  DecoderFamily family = DecoderFamily::llama;  ///< [model_type]
  int vocab = 256;                              ///< [vocab_size]
  int hidden = 128;                             ///< D [hidden_size]
  int intermediate = 384;                       ///< [intermediate_size]
  int layers = 4;                               ///< [num_hidden_layers]
  int heads = 4;                                ///< H [num_attention_heads]
  int kv_heads = 2;                             ///< K [num_key_value_heads], divides H
  int head_dim = 32;                            ///< hd [head_dim], even; default D / H
  int max_positions = 2048;                     ///< [max_position_embeddings]
  double rms_eps = 1e-6;                        ///< [rms_norm_eps]
  double rope_theta = 10000.0;                  ///< [rope_theta]
  RopeScaling rope_scaling = RopeScaling::none; ///< [rope_scaling.rope_type]
  double rope_factor = 1.0;                     ///< [rope_scaling.factor] (linear, llama3)
  double rope_low_freq_factor = 1.0;            ///< [rope_scaling.low_freq_factor] (llama3)
  double rope_high_freq_factor = 4.0;           ///< [rope_scaling.high_freq_factor] (llama3)
  int rope_original_max_positions = 8192;  ///< [rope_scaling.original_max_position_embeddings]
  bool qkv_bias = false;  ///< biases on q, k, v only (Qwen2) [attention_bias / model_type]
  /// RMSNorm of each q and k head over its head_dim features, before RoPE, with weights
  /// q_norm, k_norm [head_dim] shared by the heads (Qwen3) [model_type]
  bool qk_norm = false;
  bool tied = false;      ///< the head is the embedding [tie_word_embeddings]

  std::int64_t q_width() const { return std::int64_t{heads} * head_dim; }
  std::int64_t kv_width() const { return std::int64_t{kv_heads} * head_dim; }
};

/// The decoder's shape rules, one list for every reader and backend (defined in
/// tools/model/decoder.cpp): throws ConfigError "WHERE: DecoderShape.FIELD = VALUE why" naming the
/// first field out of range: a size not positive or above DecoderShapeLimits (decoder.h), kv_heads
/// not dividing heads, an odd head_dim, rms_eps or rope_theta not positive and finite (as
/// transformers accepts any theta above 0), a RoPE factor not positive...; or, for a shape whose
/// fields are each in range, the param count above DecoderShapeLimits::params. The backends add
/// only their own limits (the CUDA kernels' head_dim, a grid's dimensions).
void validate_decoder_shape(const DecoderShape& shape,
                            std::string_view where = "validate_decoder_shape");

/// RoPE's inverse frequencies inv_freq[i], i < head_dim / 2, as transformers computes them
/// (float32: 1 / theta^(2i / hd), then the scaling of its rope_type); the angle of position p
/// is float(p) * inv_freq[i] in float32, as transformers multiplies them.
inline std::vector<float> rope_inv_freq(const DecoderShape& s) {
  const int half = s.head_dim / 2;
  std::vector<float> f(static_cast<std::size_t>(half));
  for (int i = 0; i < half; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(s.head_dim);
    f[static_cast<std::size_t>(i)] = static_cast<float>(
        1.0 / std::pow(static_cast<double>(static_cast<float>(s.rope_theta)),
                       static_cast<double>(exponent)));
  }
  if (s.rope_scaling == RopeScaling::linear) {
    for (auto& x : f) x = static_cast<float>(x / s.rope_factor);
  } else if (s.rope_scaling == RopeScaling::llama3) {
    // Long wavelengths are slowed by `factor`, short ones kept, those between interpolated.
    const double pi = 3.14159265358979323846;
    const double old_len = s.rope_original_max_positions;
    const double low_wavelen = old_len / s.rope_low_freq_factor;
    const double high_wavelen = old_len / s.rope_high_freq_factor;
    for (auto& x : f) {
      const double wavelen = 2.0 * pi / x;
      if (wavelen > low_wavelen) {
        x = static_cast<float>(x / s.rope_factor);
      } else if (wavelen >= high_wavelen) {
        const double smooth = (old_len / wavelen - s.rope_low_freq_factor) /
                              (s.rope_high_freq_factor - s.rope_low_freq_factor);
        x = static_cast<float>((1.0 - smooth) * x / s.rope_factor + smooth * x);
      }
    }
  }
  return f;
}

namespace lm::dec {

/// A param by its place in the model; declaration (forward) order is the order of this enum
/// within a layer (biases right after their weight), embed first and head last.
enum class ParamKind {
  embed,          // model.embed_tokens.weight            [V, D]
  attn_norm,      // model.layers.N.input_layernorm.weight [D]
  q,              // model.layers.N.self_attn.q_proj.weight [H*hd, D]
  q_bias,         //                        q_proj.bias     [H*hd]
  q_norm,         //                        q_norm.weight   [hd] (qk_norm)
  k,              //                        k_proj.weight   [K*hd, D]
  k_bias,         //                        k_proj.bias     [K*hd]
  k_norm,         //                        k_norm.weight   [hd] (qk_norm)
  v,              //                        v_proj.weight   [K*hd, D]
  v_bias,         //                        v_proj.bias     [K*hd]
  o,              //                        o_proj.weight   [D, H*hd]
  mlp_norm,       // model.layers.N.post_attention_layernorm.weight [D]
  gate,           // model.layers.N.mlp.gate_proj.weight  [I, D]
  up,             //                   up_proj.weight     [I, D]
  down,           //                   down_proj.weight   [D, I]
  final_norm,     // model.norm.weight                     [D]
  head,           // lm_head.weight                        [V, D] (absent when tied)
};
struct ParamId {
  ParamKind kind;
  int layer = -1;  ///< for the layer params
};

/// The param's Hugging Face name ("model.layers.3.self_attn.q_proj.weight"), which is also its
/// name in the engine (tools/model/decoder_names.cpp).
std::string param_name(ParamId id);

struct LayerWeights {
  const void* attn_norm = nullptr;
  const void* q = nullptr;
  const void* q_bias = nullptr;  ///< null without qkv_bias
  const void* q_norm = nullptr;  ///< null without qk_norm
  const void* k = nullptr;
  const void* k_bias = nullptr;
  const void* k_norm = nullptr;  ///< null without qk_norm
  const void* v = nullptr;
  const void* v_bias = nullptr;
  const void* o = nullptr;
  const void* mlp_norm = nullptr;
  const void* gate = nullptr;
  const void* up = nullptr;
  const void* down = nullptr;
};

/// Every layer param's kind, in declaration order (ParamKind's attn_norm .. down).
inline constexpr ParamKind kLayerKinds[] = {
    ParamKind::attn_norm, ParamKind::q,      ParamKind::q_bias, ParamKind::q_norm,
    ParamKind::k,         ParamKind::k_bias, ParamKind::k_norm, ParamKind::v,
    ParamKind::v_bias,    ParamKind::o,      ParamKind::mlp_norm, ParamKind::gate,
    ParamKind::up,        ParamKind::down};

/// The field of `lw` that holds a layer param of `kind` (one of kLayerKinds): code that fills or
/// copies a LayerWeights walks kLayerKinds instead of naming each field. Throws
/// std::invalid_argument for embed, final_norm and head.
inline const void*& layer_weight(LayerWeights& lw, ParamKind kind) {
  switch (kind) {
    case ParamKind::attn_norm: return lw.attn_norm;
    case ParamKind::q: return lw.q;
    case ParamKind::q_bias: return lw.q_bias;
    case ParamKind::q_norm: return lw.q_norm;
    case ParamKind::k: return lw.k;
    case ParamKind::k_bias: return lw.k_bias;
    case ParamKind::k_norm: return lw.k_norm;
    case ParamKind::v: return lw.v;
    case ParamKind::v_bias: return lw.v_bias;
    case ParamKind::o: return lw.o;
    case ParamKind::mlp_norm: return lw.mlp_norm;
    case ParamKind::gate: return lw.gate;
    case ParamKind::up: return lw.up;
    case ParamKind::down: return lw.down;
    default: break;
  }
  throw std::invalid_argument("layer_weight: not a layer param's kind");
}

/// The head's weights: the final norm and the head matrix (the embedding when tied).
struct HeadWeights {
  const void* final_norm = nullptr;
  const void* head = nullptr;
};

/// Where the weights come from when they are not all on the device at once (frozen groups kept
/// in host memory): each part acquired just before its use and released right after, one part at
/// a time -- the embedding for the lookup, layer l for its forward or backward pass, the head
/// (tied: with the embedding) from the final norm through the loss to the final norm's
/// backward.
class WeightSource {
 public:
  virtual ~WeightSource() = default;
  virtual LayerWeights acquire(int layer) = 0;
  virtual void release(int layer) = 0;
  virtual const void* acquire_embed() = 0;
  virtual void release_embed() = 0;
  virtual HeadWeights acquire_head() = 0;
  virtual void release_head() = 0;
};

/// Every weight, all of `dtype` (bf16 or fp16; the CPU backend also takes fp32).
struct Weights {
  DType dtype = DType::bf16;
  /// With a `source`, embed, final_norm and head are null and `layers` empty: the source hands
  /// each part out in turn.
  WeightSource* source = nullptr;
  const void* embed = nullptr;
  std::vector<LayerWeights> layers;
  const void* final_norm = nullptr;
  const void* head = nullptr;  ///< == embed when tied
};

/// A part of the weights for the length of its use: from `w`, or acquired from w.source and
/// released when it goes (on an exception too; a release cannot fail but for a broken source).
template <class Part, Part (WeightSource::*Acquire)(), void (WeightSource::*Release)()>
class PartUse {
 public:
  PartUse(const Weights& w, Part listed)
      : source_(w.source), part_(source_ != nullptr ? (source_->*Acquire)() : listed) {}
  ~PartUse() {
    if (source_ == nullptr) return;
    try {
      (source_->*Release)();
    } catch (...) {
    }
  }
  PartUse(const PartUse&) = delete;
  PartUse& operator=(const PartUse&) = delete;
  const Part& operator*() const { return part_; }

 private:
  WeightSource* source_;
  Part part_;
};
/// The embedding matrix, for the lookup.
using EmbedUse =
    PartUse<const void*, &WeightSource::acquire_embed, &WeightSource::release_embed>;
/// The final norm and the head matrix.
using HeadUse = PartUse<HeadWeights, &WeightSource::acquire_head, &WeightSource::release_head>;

/// Layer l's weights for the length of one layer's pass: from `w.layers`, or acquired from
/// w.source and released when it goes (on an exception too).
class LayerUse {
 public:
  LayerUse(const Weights& w, int layer)
      : source_(w.source),
        layer_(layer),
        weights_(source_ != nullptr ? source_->acquire(layer)
                                    : w.layers[static_cast<std::size_t>(layer)]) {}
  ~LayerUse() {
    if (source_ == nullptr) return;
    try {
      source_->release(layer_);
    } catch (...) {  // the acquire succeeded: a release cannot fail but for a broken source
    }
  }
  LayerUse(const LayerUse&) = delete;
  LayerUse& operator=(const LayerUse&) = delete;
  const LayerWeights& operator*() const { return weights_; }
  const LayerWeights* operator->() const { return &weights_; }

 private:
  WeightSource* source_;
  int layer_;
  LayerWeights weights_;
};

struct GradSlot {
  void* data = nullptr;
  DType dtype = DType::f32;  ///< the weights' dtype or fp32
};

/// Groups by index: 0 embed, 1 + l layers.l, layers + 1 head (final norm and, untied, lm_head;
/// a tied head's matrix is the embedding and belongs to group 0).
class GradSink {
 public:
  virtual ~GradSink() = default;
  virtual bool active(int group) const = 0;
  /// The slot to add the param's gradient into, asked for just before it is written and
  /// closed right after: one slot open at a time (the engine reduces a stage-2 bucket when
  /// backward moves on to another group). A tied embedding's head and lookup gradients are
  /// summed by the backend and written once, at the end of backward.
  virtual GradSlot open(ParamId param) = 0;
  /// The gradient in the slot is complete (on a device: queued on the calling thread's stream).
  virtual void close(ParamId param) = 0;
};

/// Where a backend keeps values in fewer bits than fp32 (precision options, each fp32 unless a
/// run asks: docs/models.md). Each is fp32 or a bit16 dtype (the CUDA backend: the weights');
/// the CPU backend rounds each value to it and back, as a bit16 store leaves it.
struct Precision {
  DType logits = DType::f32;       ///< the head's logits (model.bit16_logits)
  DType swiglu_grad = DType::f32;  ///< the gradient at SwiGLU's output (model.bit16_swiglu_grad)
  /// The residual stream and its gradient (model.bit16_residual): each layer's input x and
  /// post-attention y, the o and down projections' products added into them, the gradient at
  /// every norm's output (dz) and the residual stream's (dx).
  DType residual = DType::f32;
};

/// model.attention: which attention the CUDA backend runs (docs/models.md). `automatic` is
/// cuDNN's fused flash attention with its deterministic backward where the build has cuDNN and
/// head_dim allows it, else the backend's own kernels; `cudnn_atomic` is cuDNN's with the
/// backward that sums dQ over key tiles with atomics (faster; two runs may differ in the last
/// bits). The CPU backend has one attention of its own and takes `automatic` only.
enum class Attention { automatic, cudnn, cudnn_atomic, own };

/// The config's spelling of each: "auto", "cudnn", "cudnn-atomic", "own".
inline const char* attention_key_value(Attention a) {
  switch (a) {
    case Attention::cudnn: return "cudnn";
    case Attention::cudnn_atomic: return "cudnn-atomic";
    case Attention::own: return "own";
    case Attention::automatic: break;
  }
  return "auto";
}

/// A target the loss is not on (a prompt's token under a loss mask): its row adds nothing to the
/// loss or the gradients, and the mean is over the other targets.
inline constexpr std::int32_t kIgnoredTarget = -1;

/// Host token ids: `sequences` rows of `seq_len`; targets[i] is the token that follows
/// inputs[i], or kIgnoredTarget. Every other id is in [0, vocab) (checked by the engine-facing
/// model). positions (null: 0 .. seq_len - 1 in every row) packs documents apart: positions[i]
/// is token i's place in its document, 0 at a row's start and where a document starts, else
/// positions[i - 1] + 1 (check_positions); token i then attends to tokens i - positions[i] .. i.
struct Batch {
  int sequences = 0;
  int seq_len = 0;
  const std::int32_t* inputs = nullptr;
  const std::int32_t* targets = nullptr;
  const std::int32_t* positions = nullptr;
};

/// The first token, in the batch's row-major order, at which b.positions breaks the rule above
/// (-1 when it holds or positions is null): what a backend refuses naming the token.
inline std::int64_t bad_position(const Batch& b) {
  if (b.positions == nullptr) return -1;
  const auto n = static_cast<std::int64_t>(b.sequences) * b.seq_len;
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int32_t p = b.positions[i];
    const bool row_start = i % b.seq_len == 0;
    if (row_start ? p != 0 : (p != 0 && p != b.positions[i - 1] + 1)) return i;
  }
  return -1;
}

/// The targets of `b` the loss is on (not kIgnoredTarget): the count the loss is the mean over.
inline std::size_t counted_targets(const Batch& b) {
  const auto n = static_cast<std::size_t>(b.sequences) * static_cast<std::size_t>(b.seq_len);
  std::size_t counted = 0;
  for (std::size_t i = 0; i < n; ++i) counted += b.targets[i] != kIgnoredTarget ? 1 : 0;
  return counted;
}

/// GPU milliseconds of train_step's phases, summed over the steps since the last
/// take_phase_times (the CUDA backend with time_phases on; zeros elsewhere). forward and
/// backward are what the MLPs and attention leave (embedding, norms, q/k/v/o projections,
/// RoPE); the MLPs (norm, gate/up/down, SwiGLU) and attention have their own; head is the
/// chunked head and loss, with its gradients.
struct PhaseTimes {
  double forward = 0, forward_mlp = 0, attention_forward = 0, head = 0, backward_mlp = 0,
         backward = 0, attention_backward = 0;
  int steps = 0;
};

class Compute {
 public:
  virtual ~Compute() = default;
  /// Whether train_step records its phases' GPU time (CUDA events, read after the step's loss
  /// is read back: no wait of their own). A backend without it ignores this.
  virtual void time_phases(bool on) { (void)on; }
  virtual PhaseTimes take_phase_times() { return {}; }
  /// Forward and backward: adds grad_scale times the gradient of the mean loss into the slots
  /// of the active groups. Frozen groups get no weight-gradient work; backward stops below the
  /// lowest active group. Returns the mean loss.
  virtual double train_step(const Weights& w, const Batch& batch, double grad_scale,
                            GradSink& sink) = 0;
  /// The mean loss only (validation); no gradients.
  virtual double loss(const Weights& w, const Batch& batch) = 0;
  /// The logits of every position, row-major [sequences * seq_len, vocab], into host memory
  /// (a test and export check; allocates what it needs itself, outside the plan).
  virtual void logits(const Weights& w, const Batch& batch, float* out) = 0;
};

}  // namespace lm::dec
}  // namespace shardswap
