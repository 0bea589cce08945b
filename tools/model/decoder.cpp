// The decoder's params (Hugging Face names, shapes, groups), its initial values, and the
// engine-facing Decoder: weights looked up by name and checked, grad slots handed to the backend
// in the order it asks for them, frozen groups told to it.
#include "model/decoder.h"

#include <fmt/format.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <string_view>
#include <tuple>

#include "shardswap/error.h"
#include "model/decoder_cpu.h"
#include "model/decoder_cuda.h"
#include "model/init_random.h"

namespace shardswap {

namespace {

using lm::dec::ParamId;
using lm::dec::ParamKind;

std::string layer_group(int i) {
  return fmt::format("layers.{}", i);
}

int group_index(const DecoderShape& s, const ParamId& id) {
  switch (id.kind) {
    case ParamKind::embed:
      return 0;
    case ParamKind::final_norm:
    case ParamKind::head:
      return s.layers + 1;
    default:
      return 1 + id.layer;
  }
}

std::vector<std::int64_t> param_shape(const DecoderShape& s, ParamKind kind) {
  const std::int64_t d = s.hidden, i = s.intermediate, v = s.vocab, q = s.q_width(),
                     kv = s.kv_width();
  switch (kind) {
    case ParamKind::embed:
    case ParamKind::head:
      return {v, d};
    case ParamKind::attn_norm:
    case ParamKind::mlp_norm:
    case ParamKind::final_norm:
      return {d};
    case ParamKind::q:
      return {q, d};
    case ParamKind::q_bias:
      return {q};
    case ParamKind::q_norm:
    case ParamKind::k_norm:
      return {s.head_dim};
    case ParamKind::k:
    case ParamKind::v:
      return {kv, d};
    case ParamKind::k_bias:
    case ParamKind::v_bias:
      return {kv};
    case ParamKind::o:
      return {d, q};
    case ParamKind::gate:
    case ParamKind::up:
      return {i, d};
    case ParamKind::down:
      return {d, i};
  }
  return {};
}

std::int64_t numel_of(const std::vector<std::int64_t>& shape) {
  std::int64_t n = 1;
  for (const auto x : shape) n *= x;
  return n;
}

bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

// Hands the backend the engine's grad slots by param, checking each slot's dtype and size. A
// tied embedding's slot is opened by the head's gradient and held until the lookup's is added.
class EngineSink final : public lm::dec::GradSink {
 public:
  EngineSink(Engine& engine, const DecoderShape& shape, DType dtype)
      : engine_(engine), shape_(shape), dtype_(dtype) {
    active_.push_back(engine.is_active("embed"));
    for (int i = 0; i < shape.layers; ++i) active_.push_back(engine.is_active(layer_group(i)));
    active_.push_back(engine.is_active("head"));
  }
  bool active(int group) const override { return active_.at(static_cast<std::size_t>(group)); }
  lm::dec::GradSlot open(ParamId param) override {
    const auto name = decoder_param_name(param);
    View& slot = param.kind == ParamKind::embed ? embed_slot_ : slot_;
    slot = engine_.grad_slot(name);
    const auto numel = static_cast<std::size_t>(numel_of(param_shape(shape_, param.kind)));
    if (slot.dtype() != dtype_ && slot.dtype() != DType::f32)
      throw ConfigError(fmt::format(
          "Decoder::train_step: the grad slot of '{}' is {}; this model writes {} or fp32 "
          "gradients",
          name, dtype_name(slot.dtype()), dtype_name(dtype_)));
    if (slot.count() != numel)
      throw ConfigError(fmt::format(
          "Decoder::train_step: the grad slot of '{}' has {} elements, the model's param {}",
          name, slot.count(), numel));
    return {slot.raw(), slot.dtype()};
  }
  void close(ParamId param) override {
    engine_.grad_ready(decoder_param_name(param));
    (param.kind == ParamKind::embed ? embed_slot_ : slot_) = View();
  }

 private:
  Engine& engine_;
  const DecoderShape& shape_;
  DType dtype_;
  std::vector<bool> active_;
  View slot_;        // the open slot of a param other than the embedding
  View embed_slot_;  // the embedding's, open across backward when the head is tied
};

class EngineDecoder final : public Decoder {
 public:
  EngineDecoder(const DecoderShape& shape, int max_sequences, int seq_len, DType dtype,
                Buffer memory)
      : shape_(shape),
        max_sequences_(max_sequences),
        seq_len_(seq_len),
        dtype_(dtype),
        memory_(std::move(memory)) {}
  void set_compute(std::unique_ptr<lm::dec::Compute> compute) { compute_ = std::move(compute); }

  double train_step(Engine& engine, const DecoderBatch& batch, double grad_weight) override {
    const auto b = check(batch, "Decoder::train_step");
    EngineWeightSource source(*this, engine, "Decoder::train_step");
    const auto w = weights(engine, "Decoder::train_step", source);
    EngineSink sink(engine, shape_, dtype_);
    if (!(grad_weight >= 0.0) || !std::isfinite(grad_weight))
      throw ConfigError(fmt::format("Decoder::train_step: grad_weight {} must be finite and >= 0",
                                    grad_weight));
    return compute_->train_step(w, b, engine.loss_scale() * grad_weight, sink);
  }
  double loss(const Engine& engine, const DecoderBatch& batch) override {
    const auto b = check(batch, "Decoder::loss");
    EngineWeightSource source(*this, engine, "Decoder::loss");
    return compute_->loss(weights(engine, "Decoder::loss", source), b);
  }
  std::vector<float> logits(const Engine& engine, const DecoderBatch& batch) override {
    const auto b = check(batch, "Decoder::logits");
    std::vector<float> out(batch.inputs.size() * static_cast<std::size_t>(shape_.vocab));
    EngineWeightSource source(*this, engine, "Decoder::logits");
    compute_->logits(weights(engine, "Decoder::logits", source), b, out.data());
    return out;
  }
  void time_phases(bool on) override { compute_->time_phases(on); }
  lm::dec::PhaseTimes take_phase_times() override { return compute_->take_phase_times(); }

 private:
  lm::dec::Batch check(const DecoderBatch& batch, const char* fn) const {
    if (batch.sequences < 1 || batch.sequences > max_sequences_)
      throw ConfigError(fmt::format("{}: {} sequences is outside [1, max_sequences = {}]", fn,
                                    batch.sequences, max_sequences_));
    if (batch.seq_len < 1 || batch.seq_len > seq_len_)
      throw ConfigError(fmt::format("{}: seq_len {} is outside [1, the model's seq_len {}]", fn,
                                    batch.seq_len, seq_len_));
    const auto n = static_cast<std::size_t>(batch.sequences) *
                   static_cast<std::size_t>(batch.seq_len);
    if (batch.inputs.size() != n || batch.targets.size() != n)
      throw ConfigError(fmt::format(
          "{}: a batch of {} x {} tokens needs {} inputs and targets, it has {} and {}", fn,
          batch.sequences, batch.seq_len, n, batch.inputs.size(), batch.targets.size()));
    if (!batch.positions.empty() && batch.positions.size() != n)
      throw ConfigError(fmt::format("{}: a batch of {} tokens has {} positions (none, or one each)",
                                    fn, n, batch.positions.size()));
    for (const auto* ids : {&batch.inputs, &batch.targets})
      for (std::size_t i = 0; i < n; ++i)
        if (((*ids)[i] < 0 || (*ids)[i] >= shape_.vocab) &&
            !(ids == &batch.targets && (*ids)[i] == lm::dec::kIgnoredTarget))
          throw ConfigError(fmt::format("{}: {} token {} is {}, outside the vocabulary [0, {})",
                                        fn, ids == &batch.inputs ? "input" : "target", i,
                                        (*ids)[i], shape_.vocab));
    const lm::dec::Batch b{batch.sequences, batch.seq_len, batch.inputs.data(),
                           batch.targets.data(),
                           batch.positions.empty() ? nullptr : batch.positions.data()};
    if (const std::int64_t i = lm::dec::bad_position(b); i >= 0)
      throw ConfigError(fmt::format(
          "{}: position {} of token {} (row {}, column {}): a row starts at 0 and a position is "
          "0 (a document's start) or the one before plus 1",
          fn, batch.positions[static_cast<std::size_t>(i)], i, i / batch.seq_len,
          i % batch.seq_len));
    return b;
  }

  const void* weight(const Engine& engine, ParamId id, const char* fn) const {
    const auto name = decoder_param_name(id);
    const View v = engine.weight(name);
    const auto numel = static_cast<std::size_t>(numel_of(param_shape(shape_, id.kind)));
    if (v.dtype() != dtype_ || v.count() != numel)
      throw ConfigError(fmt::format(
          "{}: weight '{}' is {} x {}; the model was made for {} x {} (decoder_params and "
          "the engine's dtype)",
          fn, name, dtype_name(v.dtype()), v.count(), dtype_name(dtype_), numel));
    return v.raw();
  }

  lm::dec::LayerWeights layer_weights(const Engine& engine, int l, const char* fn) const {
    const auto bias = [&](ParamKind kind) {
      return shape_.qkv_bias ? weight(engine, {kind, l}, fn) : nullptr;
    };
    const auto head_norm = [&](ParamKind kind) {
      return shape_.qk_norm ? weight(engine, {kind, l}, fn) : nullptr;
    };
    lm::dec::LayerWeights lw;
    lw.attn_norm = weight(engine, {ParamKind::attn_norm, l}, fn);
    lw.q = weight(engine, {ParamKind::q, l}, fn);
    lw.q_bias = bias(ParamKind::q_bias);
    lw.q_norm = head_norm(ParamKind::q_norm);
    lw.k = weight(engine, {ParamKind::k, l}, fn);
    lw.k_bias = bias(ParamKind::k_bias);
    lw.k_norm = head_norm(ParamKind::k_norm);
    lw.v = weight(engine, {ParamKind::v, l}, fn);
    lw.v_bias = bias(ParamKind::v_bias);
    lw.o = weight(engine, {ParamKind::o, l}, fn);
    lw.mlp_norm = weight(engine, {ParamKind::mlp_norm, l}, fn);
    lw.gate = weight(engine, {ParamKind::gate, l}, fn);
    lw.up = weight(engine, {ParamKind::up, l}, fn);
    lw.down = weight(engine, {ParamKind::down, l}, fn);
    return lw;
  }

  // With frozen groups' weights on the host, each part comes through the engine's windows:
  // fetched just before its use, released right after (a no-op for an active group). With the
  // update overlapping the forward, the fetch orders the model's stream after the group's update.
  class EngineWeightSource final : public lm::dec::WeightSource {
   public:
    EngineWeightSource(const EngineDecoder& model, const Engine& engine, const char* fn)
        : model_(model), engine_(engine), fn_(fn) {}
    lm::dec::LayerWeights acquire(int l) override {
      engine_.fetch_weights(layer_group(l));
      try {
        return model_.layer_weights(engine_, l, fn_);
      } catch (...) {
        engine_.release_weights(layer_group(l));
        throw;
      }
    }
    void release(int l) override { engine_.release_weights(layer_group(l)); }
    const void* acquire_embed() override {
      engine_.fetch_weights("embed");
      try {
        return model_.weight(engine_, {ParamKind::embed}, fn_);
      } catch (...) {
        engine_.release_weights("embed");
        throw;
      }
    }
    void release_embed() override { engine_.release_weights("embed"); }
    // Tied, the head's matrix is the embedding: both groups in, the two windows.
    lm::dec::HeadWeights acquire_head() override {
      const bool tied = model_.shape_.tied;
      engine_.fetch_weights("head");
      try {
        if (tied) engine_.fetch_weights("embed");
        try {
          return {model_.weight(engine_, {ParamKind::final_norm}, fn_),
                  model_.weight(engine_, {tied ? ParamKind::embed : ParamKind::head}, fn_)};
        } catch (...) {
          if (tied) engine_.release_weights("embed");
          throw;
        }
      } catch (...) {
        engine_.release_weights("head");
        throw;
      }
    }
    void release_head() override {
      engine_.release_weights("head");
      if (model_.shape_.tied) engine_.release_weights("embed");
    }

   private:
    const EngineDecoder& model_;
    const Engine& engine_;
    const char* fn_;
  };

  // `source` serves every part when frozen groups' weights are on the host or the update
  // overlaps the forward.
  lm::dec::Weights weights(const Engine& engine, const char* fn,
                           EngineWeightSource& source) const {
    lm::dec::Weights w;
    w.dtype = dtype_;
    // Each part asked for just before its use: a frozen group's weights come in through a window,
    // and with the update overlapping the forward, a group's wait for its own update only.
    if (engine.config().frozen_weight_placement == Placement::host ||
        engine.config().overlap_update) {
      w.source = &source;
      return w;
    }
    w.embed = weight(engine, {ParamKind::embed}, fn);
    for (int l = 0; l < shape_.layers; ++l) w.layers.push_back(layer_weights(engine, l, fn));
    w.final_norm = weight(engine, {ParamKind::final_norm}, fn);
    w.head = shape_.tied ? w.embed : weight(engine, {ParamKind::head}, fn);
    return w;
  }

  DecoderShape shape_;
  int max_sequences_;
  int seq_len_;
  DType dtype_;
  Buffer memory_;  // the activation block; outlives compute_
  std::unique_ptr<lm::dec::Compute> compute_;
};

// The elements of decoder_params(s) for sizes within DecoderShapeLimits (each term is then below
// 2^45 and the sum below 2^62: no overflow).
std::int64_t count_params(const DecoderShape& s) {
  const std::int64_t d = s.hidden, i = s.intermediate, v = s.vocab, q = s.q_width(),
                     kv = s.kv_width();
  const std::int64_t layer =
      2 * d + q * d + 2 * kv * d + d * q + 3 * i * d + (s.qkv_bias ? q + 2 * kv : 0) +
      (s.qk_norm ? 2 * std::int64_t{s.head_dim} : 0);
  return v * d + s.layers * layer + d + (s.tied ? 0 : v * d);
}

}  // namespace

void validate_decoder_shape(const DecoderShape& s, std::string_view where) {
  const auto fail = [where](const char* field, const std::string& value, const std::string& why) {
    throw ConfigError(fmt::format("{}: DecoderShape.{} = {} {}", where, field, value, why));
  };
  using Limits = DecoderShapeLimits;
  const std::tuple<const char*, int, int> sizes[] = {
      {"vocab", s.vocab, Limits::vocab},
      {"hidden", s.hidden, Limits::hidden},
      {"intermediate", s.intermediate, Limits::intermediate},
      {"layers", s.layers, Limits::layers},
      {"heads", s.heads, Limits::heads},
      {"kv_heads", s.kv_heads, Limits::heads},
      {"head_dim", s.head_dim, Limits::head_dim},
      {"max_positions", s.max_positions, INT_MAX}};
  for (const auto& [name, value, most] : sizes) {
    if (value < 1) fail(name, fmt::format("{}", value), "must be at least 1");
    if (value > most)
      fail(name, fmt::format("{}", value),
           fmt::format("is above {}, the most DecoderShapeLimits allows", most));
  }
  if (s.q_width() > Limits::q_width)
    fail("heads", fmt::format("{}", s.heads),
         fmt::format("x head_dim = {} is {}, above {}, the most DecoderShapeLimits allows",
                     s.head_dim, s.q_width(), Limits::q_width));
  if (const auto params = count_params(s); params > Limits::params)
    fail("layers", fmt::format("{}", s.layers),
         fmt::format("makes {} params (hidden {}, intermediate {}, vocab {}), above {}, the most "
                     "DecoderShapeLimits allows",
                     params, s.hidden, s.intermediate, s.vocab, Limits::params));
  if (s.heads % s.kv_heads != 0)
    fail("kv_heads", fmt::format("{}", s.kv_heads), fmt::format("must divide heads = {}", s.heads));
  if (s.head_dim % 2 != 0) fail("head_dim", fmt::format("{}", s.head_dim), "must be even (RoPE)");
  if (s.qk_norm && s.qkv_bias)  // no model has both (Qwen3's biases come with o_proj's)
    fail("qk_norm", "true", "with qkv_bias: q/k norms after q/k biases are not implemented");
  if (!(s.rms_eps > 0.0) || !std::isfinite(s.rms_eps))
    fail("rms_eps", fmt::format("{}", s.rms_eps), "must be positive");
  if (!(s.rope_theta > 0.0) || !std::isfinite(s.rope_theta))
    fail("rope_theta", fmt::format("{}", s.rope_theta), "must be positive");
  if (s.rope_scaling != RopeScaling::none && (!(s.rope_factor > 0.0) || !std::isfinite(s.rope_factor)))
    fail("rope_factor", fmt::format("{}", s.rope_factor), "must be positive");
  if (s.rope_scaling == RopeScaling::llama3) {
    if (!(s.rope_high_freq_factor > s.rope_low_freq_factor) || !(s.rope_low_freq_factor > 0.0))
      fail("rope_high_freq_factor", fmt::format("{}", s.rope_high_freq_factor),
           fmt::format("must be above rope_low_freq_factor = {} > 0", s.rope_low_freq_factor)
               .c_str());
    if (s.rope_original_max_positions < 1)
      fail("rope_original_max_positions", fmt::format("{}", s.rope_original_max_positions),
           "must be at least 1");
  }
}

std::string decoder_param_name(ParamId id) {
  return lm::dec::param_name(id);
}

std::vector<DecoderParam> decoder_params(const DecoderShape& s) {
  validate_decoder_shape(s);
  std::vector<DecoderParam> out;
  const auto add = [&](ParamKind kind, int layer) {
    const ParamId id{kind, layer};
    const int g = group_index(s, id);
    out.push_back({id, decoder_param_name(id), param_shape(s, kind),
                   g == 0 ? std::string("embed")
                          : g == s.layers + 1 ? std::string("head") : layer_group(g - 1)});
  };
  add(ParamKind::embed, -1);
  for (int l = 0; l < s.layers; ++l) {
    for (const auto kind :
         {ParamKind::attn_norm, ParamKind::q, ParamKind::q_bias, ParamKind::q_norm, ParamKind::k,
          ParamKind::k_bias, ParamKind::k_norm, ParamKind::v, ParamKind::v_bias, ParamKind::o,
          ParamKind::mlp_norm, ParamKind::gate, ParamKind::up, ParamKind::down}) {
      const bool bias = kind == ParamKind::q_bias || kind == ParamKind::k_bias ||
                        kind == ParamKind::v_bias;
      const bool head_norm = kind == ParamKind::q_norm || kind == ParamKind::k_norm;
      if ((!bias || s.qkv_bias) && (!head_norm || s.qk_norm)) add(kind, l);
    }
  }
  add(ParamKind::final_norm, -1);
  if (!s.tied) add(ParamKind::head, -1);
  return out;
}

std::vector<std::string> decoder_groups(const DecoderShape& shape) {
  std::vector<std::string> groups{"embed"};
  for (int i = 0; i < shape.layers; ++i) groups.push_back(layer_group(i));
  groups.emplace_back("head");
  return groups;
}

std::int64_t decoder_param_count(const DecoderShape& shape) {
  validate_decoder_shape(shape);
  return count_params(shape);
}

std::int64_t decoder_param_count_unchecked(const DecoderShape& shape) {
  return count_params(shape);
}

double decoder_step_flops(const DecoderShape& s, std::int64_t tokens, int seq_len) {
  const double n = static_cast<double>(decoder_param_count(s));
  const double attention = 12.0 * s.layers * static_cast<double>(s.q_width()) * seq_len;
  return (6.0 * n + attention) * static_cast<double>(tokens);
}

void Decoder::init(const DecoderShape& shape, const ParamInfo& param, std::span<float> values,
                   std::uint64_t seed) {
  (void)shape;
  const std::string_view name = param.name;
  std::mt19937_64 rng = lm::param_rng(name, seed);
  // input_layernorm, post_attention_layernorm, q_norm, k_norm, norm
  if (ends_with(name, "norm.weight")) {
    std::fill(values.begin(), values.end(), 1.0f);
  } else if (ends_with(name, ".bias")) {
    std::fill(values.begin(), values.end(), 0.0f);
  } else if (ends_with(name, ".weight")) {  // the embedding and every projection
    for (auto& v : values) v = static_cast<float>(0.02 * lm::normal01(rng));
  } else {
    throw ConfigError(fmt::format("Decoder::init: '{}' is not a param of the decoder", name));
  }
}

std::int64_t Decoder::activation_bytes(const DecoderShape& shape, int max_sequences,
                                       int seq_len, DType dtype, DeviceKind device,
                                       const DecoderOptions& options) {
  validate_decoder_shape(shape);
  // (cpu_bytes and cuda_bytes check recompute_layers' range and loss_chunk_rows' sign.)
  if (device != DeviceKind::cuda && options.keep_norm_outputs)
    check_decoder_options(shape, options, device);  // throws, naming the key
  if (max_sequences < 1)
    throw ConfigError(fmt::format(
        "Decoder::activation_bytes: max_sequences = {} must be at least 1", max_sequences));
  if (seq_len < 1 || seq_len > shape.max_positions)
    throw ConfigError(fmt::format(
        "Decoder::activation_bytes: seq_len = {} is outside [1, max_positions = {}]", seq_len,
        shape.max_positions));
  if (!is_bit16(dtype))
    throw ConfigError(fmt::format("Decoder::activation_bytes: dtype {} is not bf16 or fp16",
                                  dtype_name(dtype)));
  return static_cast<std::int64_t>(device == DeviceKind::cuda
                                       ? lm::dec::cuda_bytes(shape, max_sequences, seq_len,
                                                             options.recompute_layers,
                                                             options.loss_chunk_rows,
                                                             options.keep_norm_outputs,
                                                             options.precision.bit16_residual)
                                       : lm::dec::cpu_bytes(shape, max_sequences, seq_len,
                                                            options.recompute_layers,
                                                            options.loss_chunk_rows));
}

void check_decoder_options(const DecoderShape& shape, const DecoderOptions& options,
                           DeviceKind device) {
  const lm::dec::Attention attention = options.attention;
  if (device == DeviceKind::cuda) {
    (void)lm::dec::cuda_attention(shape, attention);
    return;
  }
  if (options.keep_norm_outputs)
    throw ConfigError(
        "model.keep_norm_outputs = true: a CUDA backend's choice; the CPU backend makes each "
        "norm's output again in backward (leave the key out, or false)");
  if (attention != lm::dec::Attention::automatic)
    throw ConfigError(fmt::format(
        "model.attention = \"{}\": picks among the CUDA backend's attentions; the CPU backend "
        "has one of its own (leave the key out, or \"auto\")",
        lm::dec::attention_key_value(attention)));
}

std::unique_ptr<Decoder> make_decoder(const DecoderShape& shape, int max_sequences, int seq_len,
                                      DType dtype, MemorySpace& space,
                                      const DecoderOptions& options) {
  check_decoder_options(shape, options, space.device());
  const auto bytes = static_cast<std::size_t>(Decoder::activation_bytes(
      shape, max_sequences, seq_len, dtype, space.device(), options));  // validates
  Buffer memory = space.allocate(
      bytes, Tag::activation,
      fmt::format("decoder activations ({} x {} tokens)", max_sequences, seq_len));
  void* const base = memory.data();
  const DecoderPrecision& precision = options.precision;
  const lm::dec::Precision kept{precision.bit16_logits ? dtype : DType::f32,
                                precision.bit16_swiglu_grad ? dtype : DType::f32,
                                precision.bit16_residual ? dtype : DType::f32};
  auto model = std::make_unique<EngineDecoder>(shape, max_sequences, seq_len, dtype,
                                               std::move(memory));
  if (space.device() == DeviceKind::cuda)
    model->set_compute(
        lm::dec::make_cuda_compute(shape, max_sequences, seq_len, dtype, base, bytes,
                                   options.recompute_layers, kept, options.attention,
                                   options.loss_chunk_rows, options.keep_norm_outputs));
  else
    model->set_compute(lm::dec::make_cpu_compute(shape, max_sequences, seq_len, base, bytes,
                                                 options.recompute_layers, kept,
                                                 options.loss_chunk_rows));
  return model;
}

}  // namespace shardswap
