// The decoder's CPU backend: fp32 Eigen on the host. Activations are row-major [tokens,
// features] as Hugging Face lays them out, so a chunk of token rows is contiguous for the chunked
// cross-entropy. Bit16 weights are upcast one group at a time into scratch of the block.
//
// What backward keeps from forward, per layer: the residual stream x, the normalized inputs'
// 1/rms, q and k after RoPE, v, the attention output, the post-attention residual y, gate and up;
// with qk_norm (Qwen3) also q and k before their per-head norm and each head row's 1/rms.
// Norm outputs, silu(gate) * up and the attention probabilities are recomputed (the latter from
// the per-row log-sum-exp), which keeps activations O(tokens x width) per layer instead of
// O(tokens x seq_len x heads).
//
// Gradients: dlogits carry grad_scale / tokens, so everything below them is already scaled. Each
// param's gradient is formed in fp32 scratch and added into its slot once; a tied embedding's
// head and lookup parts are summed in fp32 first and written at the end of backward, so that a
// bit16 slot is rounded once.
#include "model/decoder_cpu.h"

#include <fmt/format.h>

#include <Eigen/Dense>
#include <algorithm>
#include <cmath>

#include "shardswap/elements.h"
#include "shardswap/error.h"

namespace shardswap::lm::dec {

namespace {

using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using MapR = Eigen::Map<RowMat>;
using CMapR = Eigen::Map<const RowMat>;
// One head's columns of a [tokens, heads * head_dim] matrix.
using HeadMap = Eigen::Map<RowMat, 0, Eigen::OuterStride<>>;
using MapRow = Eigen::Map<Eigen::RowVectorXf>;
using CMapRow = Eigen::Map<const Eigen::RowVectorXf>;

constexpr std::size_t kAlign = 64;

// Carves one block into regions, each starting at a multiple of 64 bytes; the total is what the
// backend needs, so planning and allocating cannot disagree.
class Arena {
 public:
  std::size_t take_floats(std::size_t count) {
    const std::size_t at = bytes_;
    bytes_ += (count * sizeof(float) + kAlign - 1) / kAlign * kAlign;
    return at;
  }
  std::size_t bytes() const { return bytes_; }

 private:
  std::size_t bytes_ = 0;
};

// Floats of a tensor in the upcast region, rounded so that every tensor starts 64-byte aligned.
std::size_t padded(std::size_t floats) {
  constexpr std::size_t per = kAlign / sizeof(float);
  return (floats + per - 1) / per * per;
}

struct Sizes {
  std::size_t n, t, d, inter, q, kv, v, h, k, half, layers;
};

Sizes sizes_of(const DecoderShape& s, int max_sequences, int seq_len) {
  const auto z = [](auto x) { return static_cast<std::size_t>(x); };
  return {z(max_sequences) * z(seq_len),
          z(seq_len),
          z(s.hidden),
          z(s.intermediate),
          z(s.q_width()),
          z(s.kv_width()),
          z(s.vocab),
          z(s.heads),
          z(s.kv_heads),
          z(s.head_dim / 2),
          z(s.layers)};
}

std::size_t layer_upcast_floats(const Sizes& z, bool bias, bool qk_norm) {
  std::size_t f = 2 * padded(z.d) + padded(z.q * z.d) + 2 * padded(z.kv * z.d) + padded(z.d * z.q) +
                  3 * padded(z.inter * z.d);
  if (bias) f += padded(z.q) + 2 * padded(z.kv);
  if (qk_norm) f += 2 * padded(2 * z.half);
  return f;
}

// Where layer l keeps its activations for backward: its own slot, or, for the lowest
// `recompute` layers (which keep only x_l and run their forward again in backward), the one
// slot they share. Slots: 0 .. kept_slots - 1.
std::size_t kept_slots(std::size_t layers, std::size_t recompute) {
  return recompute == 0 ? layers : layers - recompute + 1;
}
std::size_t slot_of(int l, std::size_t recompute) {
  const auto layer = static_cast<std::size_t>(l);
  return recompute == 0 ? layer : layer < recompute ? 0 : layer - recompute + 1;
}

// Byte offsets of the regions (fp32 all) for n = max_sequences * seq_len tokens. xs holds
// x_l's rows at l * n * d; the other per-layer regions hold a slot's rows at slot * n * width.
struct Layout {
  std::size_t rope_cos, rope_sin;               // seq_len * hd/2
  std::size_t xs;                               // (layers + 1) * n * d: x_0 .. x_L
  // Per slot (kept_slots of them):
  std::size_t ys;                               // n * d: after attention's residual
  std::size_t rstd_attn, rstd_mlp, rstd_final;  // n, n per slot; final n
  std::size_t qs, ks, vs, os;   // n * (q, kv, kv, q): q, k after RoPE; attention out
  std::size_t q_raw, k_raw;     // n * (q, kv): q, k before their per-head norm (qk_norm; else 0)
  std::size_t rstd_q, rstd_k;   // n * (heads, kv_heads): 1/rms of each head row (qk_norm)
  std::size_t lse;              // n * heads: attention rows' log-sum-exp
  std::size_t gates, ups;       // n * I
  std::size_t normed, act;      // scratch n * d (a norm's output), n * I (silu(gate) * up)
  std::size_t dx, dn;           // n * d: residual gradient, gradient at a norm's output
  std::size_t dq, dk, dv, d_o;  // n * (q, kv, kv, q)
  std::size_t dgate, dup;       // n * I
  std::size_t d_head;           // n * q: a per-head norm's input gradient (qk_norm)
  std::size_t head_norm_grads;  // 2 hd: q_norm's and k_norm's gradients (qk_norm)
  std::size_t scores, dscores;  // seq_len^2: one (sequence, head)'s probabilities
  std::size_t logits;           // cpu_loss_rows(.., n) * V
  std::size_t weights;          // one group's weights upcast
  std::size_t grad;             // one layer param's gradient
  std::size_t head_grad;        // V * d: the head's gradient, then the lookup's
  std::size_t bytes;
};

// The rows of the cross-entropy's chunk for a requested count (0: kLossChunkRows) and batches
// of up to n tokens.
std::size_t cpu_loss_rows(int requested, std::size_t n) {
  return std::min(static_cast<std::size_t>(requested > 0 ? requested : kLossChunkRows), n);
}

Layout layout_of(const DecoderShape& s, int max_sequences, int seq_len, int recompute,
                 int loss_rows) {
  const Sizes z = sizes_of(s, max_sequences, seq_len);
  const std::size_t n = z.n, d = z.d, L = z.layers;
  const std::size_t S = kept_slots(L, static_cast<std::size_t>(recompute));
  Arena a;
  Layout l{};
  l.rope_cos = a.take_floats(z.t * z.half);
  l.rope_sin = a.take_floats(z.t * z.half);
  l.xs = a.take_floats((L + 1) * n * d);
  l.ys = a.take_floats(S * n * d);
  l.rstd_attn = a.take_floats(S * n);
  l.rstd_mlp = a.take_floats(S * n);
  l.rstd_final = a.take_floats(n);
  l.qs = a.take_floats(S * n * z.q);
  l.ks = a.take_floats(S * n * z.kv);
  l.vs = a.take_floats(S * n * z.kv);
  l.os = a.take_floats(S * n * z.q);
  const std::size_t qk = s.qk_norm ? 1 : 0;
  l.q_raw = a.take_floats(qk * S * n * z.q);
  l.k_raw = a.take_floats(qk * S * n * z.kv);
  l.rstd_q = a.take_floats(qk * S * n * z.h);
  l.rstd_k = a.take_floats(qk * S * n * z.k);
  l.lse = a.take_floats(S * n * z.h);
  l.gates = a.take_floats(S * n * z.inter);
  l.ups = a.take_floats(S * n * z.inter);
  l.normed = a.take_floats(n * d);
  l.act = a.take_floats(n * z.inter);
  l.dx = a.take_floats(n * d);
  l.dn = a.take_floats(n * d);
  l.dq = a.take_floats(n * z.q);
  l.dk = a.take_floats(n * z.kv);
  l.dv = a.take_floats(n * z.kv);
  l.d_o = a.take_floats(n * z.q);
  l.dgate = a.take_floats(n * z.inter);
  l.dup = a.take_floats(n * z.inter);
  l.d_head = a.take_floats(qk * n * z.q);
  l.head_norm_grads = a.take_floats(qk * 4 * z.half);
  l.scores = a.take_floats(z.t * z.t);
  l.dscores = a.take_floats(z.t * z.t);
  l.logits = a.take_floats(cpu_loss_rows(loss_rows, n) * z.v);
  l.weights = a.take_floats(
      std::max(layer_upcast_floats(z, s.qkv_bias, s.qk_norm), padded(d) + z.v * d));
  l.grad = a.take_floats(std::max({z.q * d, z.kv * d, z.inter * d}));
  l.head_grad = a.take_floats(z.v * d);
  l.bytes = a.bytes();
  return l;
}

void validate(const DecoderShape& s, int max_sequences, int seq_len, int recompute,
              int loss_rows, const char* fn) {
  if (recompute < 0 || recompute > s.layers)
    throw ConfigError(fmt::format("{}: recompute_layers = {} is outside [0, layers = {}]", fn,
                                  recompute, s.layers));
  if (loss_rows < 0)
    throw ConfigError(fmt::format("{}: loss_chunk_rows = {} is negative", fn, loss_rows));
  validate_decoder_shape(s, fn);
  if (max_sequences < 1)
    throw ConfigError(fmt::format("{}: max_sequences = {} must be at least 1", fn, max_sequences));
  if (seq_len < 1 || seq_len > s.max_positions)
    throw ConfigError(
        fmt::format("{}: seq_len = {} is outside [1, DecoderShape.max_positions = {}]", fn, seq_len,
                    s.max_positions));
}

// y = (x / rms(x)) * w per row, keeping 1/rms for backward.
void rms_norm(const float* x, std::size_t rows, std::size_t d, const float* w, float eps, float* y,
              float* rstd) {
  const CMapRow weight(w, static_cast<Eigen::Index>(d));
  for (std::size_t r = 0; r < rows; ++r) {
    const CMapRow xr(x + r * d, static_cast<Eigen::Index>(d));
    const float ms = xr.squaredNorm() / static_cast<float>(d);
    const float inv = 1.0f / std::sqrt(ms + eps);
    MapRow(y + r * d, static_cast<Eigen::Index>(d)) = (xr * inv).cwiseProduct(weight);
    rstd[r] = inv;
  }
}

// y = (x * rstd) * w with the rstd forward kept: the norm's output again for backward.
void rms_norm_again(const float* x, std::size_t rows, std::size_t d, const float* w,
                    const float* rstd, float* y) {
  const CMapRow weight(w, static_cast<Eigen::Index>(d));
  for (std::size_t r = 0; r < rows; ++r)
    MapRow(y + r * d, static_cast<Eigen::Index>(d)) =
        (CMapRow(x + r * d, static_cast<Eigen::Index>(d)) * rstd[r]).cwiseProduct(weight);
}

// Given dy at the norm's output: when dw is given, writes the weight's gradient there (summed
// over rows in order); when dx is given, adds the gradient at the input to it.
void rms_norm_backward(const float* x, std::size_t rows, std::size_t d, const float* w,
                       const float* rstd, const float* dy, float* dw, float* dx) {
  const auto D = static_cast<Eigen::Index>(d);
  const CMapRow weight(w, D);
  if (dw != nullptr) MapRow(dw, D).setZero();
  for (std::size_t r = 0; r < rows; ++r) {
    const CMapRow xr(x + r * d, D), dyr(dy + r * d, D);
    if (dw != nullptr) MapRow(dw, D) += (xr * rstd[r]).cwiseProduct(dyr);
    if (dx == nullptr) continue;
    // d/dx of x * (mean(x^2) + eps)^-1/2 applied to g = dy * w.
    const auto g = dyr.cwiseProduct(weight);  // an expression: nothing allocated per row
    const float inv = rstd[r];
    const float coef = inv * inv * inv * g.dot(xr) / static_cast<float>(d);
    MapRow(dx + r * d, D) += g * inv - xr * coef;
  }
}

class CpuCompute final : public Compute {
 public:
  CpuCompute(const DecoderShape& s, int max_sequences, int seq_len, int recompute,
             int loss_rows, std::byte* memory, Precision precision)
      : s_(s),
        max_sequences_(max_sequences),
        seq_len_(seq_len),
        recompute_(static_cast<std::size_t>(recompute)),
        logits_(precision.logits),
        swiglu_grad_(precision.swiglu_grad),
        residual_(precision.residual),
        z_(sizes_of(s, max_sequences, seq_len)),
        loss_rows_(cpu_loss_rows(loss_rows, z_.n)),
        mem_(memory),
        l_(layout_of(s, max_sequences, seq_len, recompute, loss_rows)) {
    // cos / sin of float(p) * inv_freq[i], the product in float32 as transformers forms it.
    const std::vector<float> inv_freq = rope_inv_freq(s);
    float* const c = at(l_.rope_cos);
    float* const sn = at(l_.rope_sin);
    for (std::size_t p = 0; p < z_.t; ++p)
      for (std::size_t i = 0; i < z_.half; ++i) {
        const float angle = static_cast<float>(p) * inv_freq[i];
        c[p * z_.half + i] = static_cast<float>(std::cos(static_cast<double>(angle)));
        sn[p * z_.half + i] = static_cast<float>(std::sin(static_cast<double>(angle)));
      }
  }

  double train_step(const Weights& w, const Batch& b, double grad_scale, GradSink& sink) override {
    check(w, b, "decoder CPU train_step");
    if (!std::isfinite(grad_scale))
      throw ConfigError(
          fmt::format("decoder CPU train_step: grad_scale = {} is not finite", grad_scale));
    forward_layers(w, b);
    const int lowest = lowest_active_group(sink);
    const bool backward = lowest <= s_.layers + 1;
    const int embed_group = 0, head_group = s_.layers + 1;
    const bool head_matrix = s_.tied ? sink.active(embed_group) : sink.active(head_group);
    // The gradient of the mean loss over the counted targets times grad_scale, folded into
    // dlogits once (none counted: no gradient).
    const std::size_t counted = counted_targets(b);
    const float alpha =
        counted == 0 ? 0.0f : static_cast<float>(grad_scale / static_cast<double>(counted));
    const double loss = head_forward(w, b, backward ? &alpha : nullptr, head_matrix);
    if (backward) backward_pass(w, b, sink, lowest, head_matrix);
    return loss;
  }

  double loss(const Weights& w, const Batch& b) override {
    check(w, b, "decoder CPU loss");
    forward_layers(w, b);
    return head_forward(w, b, nullptr, false);
  }

  void logits(const Weights& w, const Batch& b, float* out) override {
    check(w, b, "decoder CPU logits");
    if (out == nullptr) throw ConfigError("decoder CPU logits: the output pointer is null");
    forward_layers(w, b);
    const Head hw = upcast_head(w);
    const std::size_t n = tokens(b);
    final_norm(hw, n);
    for (std::size_t r0 = 0; r0 < n; r0 += loss_rows_) {
      const std::size_t rows = std::min(loss_rows_, n - r0);
      MapR(out + r0 * z_.v, rows_i(rows), cols(z_.v)).noalias() =
          CMapR(at(l_.normed) + r0 * z_.d, rows_i(rows), cols(z_.d)) * hw.w.transpose();
      if (logits_ != DType::f32) round_through(logits_, out + r0 * z_.v, rows * z_.v);
    }
  }

 private:
  static Eigen::Index rows_i(std::size_t r) { return static_cast<Eigen::Index>(r); }
  static Eigen::Index cols(std::size_t c) { return static_cast<Eigen::Index>(c); }
  float* at(std::size_t offset) const { return reinterpret_cast<float*>(mem_ + offset); }
  std::size_t tokens(const Batch& b) const {
    return static_cast<std::size_t>(b.sequences) * static_cast<std::size_t>(b.seq_len);
  }
  // x_l's rows (region xs, l in [0, layers]).
  float* layer_at(std::size_t region, int l, std::size_t width) const {
    return at(region) + static_cast<std::size_t>(l) * z_.n * width;
  }
  // Layer l's rows of a per-slot region of `width` features (slot_of).
  float* slot_at(std::size_t region, int l, std::size_t width) const {
    return at(region) + slot_of(l, recompute_) * z_.n * width;
  }

  int lowest_active_group(const GradSink& sink) const {
    int g = 0;
    while (g <= s_.layers + 1 && !sink.active(g)) ++g;
    return g;
  }

  void check(const Weights& w, const Batch& b, const char* fn) const {
    if (b.sequences < 1 || b.sequences > max_sequences_)
      throw ConfigError(fmt::format("{}: batch of {} sequences is outside [1, max_sequences = {}]",
                                    fn, b.sequences, max_sequences_));
    if (b.seq_len < 1 || b.seq_len > seq_len_)
      throw ConfigError(fmt::format("{}: batch seq_len = {} is outside [1, seq_len = {}]", fn,
                                    b.seq_len, seq_len_));
    if (b.inputs == nullptr || b.targets == nullptr)
      throw ConfigError(fmt::format("{}: the batch's inputs or targets are null", fn));
    if (const std::int64_t i = bad_position(b); i >= 0)
      throw ConfigError(fmt::format(
          "{}: position {} of token {}: a row starts at 0 and a position is 0 or the one before "
          "plus 1",
          fn, b.positions[i], i));
    if (w.dtype != DType::bf16 && w.dtype != DType::f16 && w.dtype != DType::f32)
      throw ConfigError(
          fmt::format("{}: weights of dtype {}; this backend takes bf16, fp16 or fp32", fn,
                      dtype_name(w.dtype)));
    const std::size_t listed = w.source != nullptr ? 0 : static_cast<std::size_t>(s_.layers);
    if (w.layers.size() != listed)
      throw ConfigError(fmt::format("{}: weights of {} layers{} for a model of {}", fn,
                                    w.layers.size(),
                                    w.source != nullptr ? " beside a weight source" : "",
                                    s_.layers));
    const auto need = [&](const void* p, ParamId id) {
      if (p == nullptr)
        throw ConfigError(fmt::format("{}: weight '{}' is null", fn, param_name(id)));
    };
    if (w.source != nullptr && (w.embed || w.final_norm || w.head))
      throw ConfigError(fmt::format(
          "{}: embed, final_norm or head weight given beside a weight source", fn));
    if (w.source == nullptr) {
      need(w.embed, {ParamKind::embed});
      need(w.final_norm, {ParamKind::final_norm});
      if (s_.tied) {
        if (w.head != w.embed)
          throw ConfigError(fmt::format(
              "{}: the head is tied to the embedding, but weight 'lm_head.weight' is not "
              "'model.embed_tokens.weight'",
              fn));
      } else {
        need(w.head, {ParamKind::head});
      }
    }
    for (std::size_t l = 0; l < w.layers.size(); ++l)
      check_layer(w.layers[l], static_cast<int>(l), fn);
    const auto v = static_cast<std::int32_t>(s_.vocab);
    const std::size_t n = tokens(b);
    for (std::size_t i = 0; i < n; ++i)
      if (b.inputs[i] < 0 || b.inputs[i] >= v ||
          ((b.targets[i] < 0 || b.targets[i] >= v) && b.targets[i] != kIgnoredTarget))
        throw ConfigError(
            fmt::format("{}: token {} of the batch (input {}, target {}) is outside "
                        "[0, vocab = {})",
                        fn, i, b.inputs[i], b.targets[i], v));
  }

  // Layer l's weights as the shape needs them (checked as they are acquired from a source).
  void check_layer(const LayerWeights& lw, int l, std::string_view fn) const {
    const auto need = [&](const void* p, ParamId id) {
      if (p == nullptr)
        throw ConfigError(fmt::format("{}: weight '{}' is null", fn, param_name(id)));
    };
    {
      const std::pair<const void*, ParamKind> all[] = {{lw.attn_norm, ParamKind::attn_norm},
                                                       {lw.q, ParamKind::q},
                                                       {lw.k, ParamKind::k},
                                                       {lw.v, ParamKind::v},
                                                       {lw.o, ParamKind::o},
                                                       {lw.mlp_norm, ParamKind::mlp_norm},
                                                       {lw.gate, ParamKind::gate},
                                                       {lw.up, ParamKind::up},
                                                       {lw.down, ParamKind::down}};
      for (const auto& [p, kind] : all) need(p, {kind, l});
      const std::pair<const void*, ParamKind> biases[] = {{lw.q_bias, ParamKind::q_bias},
                                                          {lw.k_bias, ParamKind::k_bias},
                                                          {lw.v_bias, ParamKind::v_bias}};
      for (const auto& [p, kind] : biases) {
        if (s_.qkv_bias) need(p, {kind, l});
        if (!s_.qkv_bias && p != nullptr)
          throw ConfigError(fmt::format("{}: weight '{}' is given but the model has no qkv bias",
                                        fn, param_name({kind, l})));
      }
      const std::pair<const void*, ParamKind> head_norms[] = {{lw.q_norm, ParamKind::q_norm},
                                                              {lw.k_norm, ParamKind::k_norm}};
      for (const auto& [p, kind] : head_norms) {
        if (s_.qk_norm) need(p, {kind, l});
        if (!s_.qk_norm && p != nullptr)
          throw ConfigError(fmt::format(
              "{}: weight '{}' is given but the model has no q/k norm", fn, param_name({kind, l})));
      }
    }
  }

  // ---- weights upcast to fp32 ----

  // Casts `count` weights to fp32 at the cursor and advances it to the next aligned slot.
  static const float* upcast(float*& cursor, const void* src, std::size_t count, DType dtype) {
    float* const out = cursor;
    convert_elements(out, DType::f32, src, dtype, count);
    cursor += padded(count);
    return out;
  }

  struct Layer {
    const float *attn_norm, *q, *q_bias, *q_norm, *k, *k_bias, *k_norm, *v, *v_bias, *o, *mlp_norm,
        *gate, *up, *down;
  };
  Layer upcast_layer(const Weights& w, int l) const {
    const LayerUse use(w, l);  // a source's weights are needed only while they are cast here
    const LayerWeights& lw = *use;
    if (w.source != nullptr) check_layer(lw, l, "decoder CPU");
    const std::size_t d = z_.d, q = z_.q, kv = z_.kv, in = z_.inter;
    float* p = at(l_.weights);
    Layer out{};
    out.attn_norm = upcast(p, lw.attn_norm, d, w.dtype);
    out.q = upcast(p, lw.q, q * d, w.dtype);
    out.k = upcast(p, lw.k, kv * d, w.dtype);
    out.v = upcast(p, lw.v, kv * d, w.dtype);
    if (s_.qkv_bias) {
      out.q_bias = upcast(p, lw.q_bias, q, w.dtype);
      out.k_bias = upcast(p, lw.k_bias, kv, w.dtype);
      out.v_bias = upcast(p, lw.v_bias, kv, w.dtype);
    }
    if (s_.qk_norm) {
      out.q_norm = upcast(p, lw.q_norm, 2 * z_.half, w.dtype);
      out.k_norm = upcast(p, lw.k_norm, 2 * z_.half, w.dtype);
    }
    out.o = upcast(p, lw.o, d * q, w.dtype);
    out.mlp_norm = upcast(p, lw.mlp_norm, d, w.dtype);
    out.gate = upcast(p, lw.gate, in * d, w.dtype);
    out.up = upcast(p, lw.up, in * d, w.dtype);
    out.down = upcast(p, lw.down, d * in, w.dtype);
    return out;
  }

  struct Head {
    const float* norm;
    CMapR w;  // [V, d]: lm_head, or the embedding when tied
  };
  Head upcast_head(const Weights& w) const {
    const HeadUse use(w, {w.final_norm, w.head});  // a source's only while they are cast
    const HeadWeights& h = *use;
    if (w.source != nullptr && (h.final_norm == nullptr || h.head == nullptr))
      throw ConfigError("decoder CPU: the weight source gave a null final_norm or head");
    float* p = at(l_.weights);
    const float* norm = upcast(p, h.final_norm, z_.d, w.dtype);
    const float* m = upcast(p, h.head, z_.v * z_.d, w.dtype);
    return {norm, CMapR(m, cols(z_.v), cols(z_.d))};
  }

  // ---- forward ----

  // Token r's RoPE position: its place in its document, or in its row.
  static std::size_t position(const Batch& b, std::size_t r) {
    return b.positions != nullptr ? static_cast<std::size_t>(b.positions[r])
                                  : r % static_cast<std::size_t>(b.seq_len);
  }
  // The first key position (in its row) that token `i` of row `seq` attends to.
  static std::size_t first_key(const Batch& b, std::size_t seq, std::size_t i) {
    return b.positions != nullptr ? i - position(b, seq * static_cast<std::size_t>(b.seq_len) + i)
                                  : 0;
  }

  void rope(float* x, const Batch& b, std::size_t width) const {
    const std::size_t hd = 2 * z_.half, heads = width / hd, n = tokens(b);
    const float* const cs = at(l_.rope_cos);
    const float* const sn = at(l_.rope_sin);
    for (std::size_t r = 0; r < n; ++r) {
      const std::size_t p = position(b, r);
      const float* c = cs + p * z_.half;
      const float* s = sn + p * z_.half;
      for (std::size_t h = 0; h < heads; ++h) {
        float* const x1 = x + r * width + h * hd;
        float* const x2 = x1 + z_.half;
        for (std::size_t i = 0; i < z_.half; ++i) {
          const float a = x1[i], b = x2[i];
          x1[i] = a * c[i] - b * s[i];
          x2[i] = b * c[i] + a * s[i];
        }
      }
    }
  }

  // The transpose of rope(): the gradient before the rotation from the one after it.
  void rope_backward(float* g, const Batch& b, std::size_t width) const {
    const std::size_t hd = 2 * z_.half, heads = width / hd, n = tokens(b);
    const float* const cs = at(l_.rope_cos);
    const float* const sn = at(l_.rope_sin);
    for (std::size_t r = 0; r < n; ++r) {
      const std::size_t p = position(b, r);
      const float* c = cs + p * z_.half;
      const float* s = sn + p * z_.half;
      for (std::size_t h = 0; h < heads; ++h) {
        float* const g1 = g + r * width + h * hd;
        float* const g2 = g1 + z_.half;
        for (std::size_t i = 0; i < z_.half; ++i) {
          const float a = g1[i], b = g2[i];
          g1[i] = a * c[i] + b * s[i];
          g2[i] = b * c[i] - a * s[i];
        }
      }
    }
  }

  HeadMap head_block(float* base, std::size_t seq, std::size_t head, std::size_t width,
                     std::size_t t) const {
    const std::size_t hd = 2 * z_.half;
    return HeadMap(base + seq * t * width + head * hd, cols(t), cols(hd),
                   Eigen::OuterStride<>(cols(width)));
  }

  // Causal softmax attention of every (sequence, head), keeping each row's log-sum-exp. Row i
  // sees keys first_key .. i (all of them before it, or those of its document).
  void attention(int l, const Batch& b) const {
    const std::size_t t = static_cast<std::size_t>(b.seq_len), group = z_.h / z_.k;
    const float scale = 1.0f / std::sqrt(static_cast<float>(2 * z_.half));
    float* const q = slot_at(l_.qs, l, z_.q);
    float* const k = slot_at(l_.ks, l, z_.kv);
    float* const v = slot_at(l_.vs, l, z_.kv);
    float* const o = slot_at(l_.os, l, z_.q);
    float* const lse = slot_at(l_.lse, l, z_.h);
    MapR p(at(l_.scores), cols(t), cols(t));
    for (std::size_t seq = 0; seq < static_cast<std::size_t>(b.sequences); ++seq)
      for (std::size_t h = 0; h < z_.h; ++h) {
        const std::size_t g = h / group;
        p.noalias() = head_block(q, seq, h, z_.q, t) * head_block(k, seq, g, z_.kv, t).transpose();
        float* const row_lse = lse + (seq * z_.h + h) * t;
        for (std::size_t i = 0; i < t; ++i) {
          auto row = p.row(cols(i));
          const std::size_t lo = first_key(b, seq, i);
          auto seen = row.segment(cols(lo), cols(i + 1 - lo));
          const float m = seen.maxCoeff() * scale;
          // Scale, subtract the maximum and exponentiate the positions seen; mask the rest.
          seen = (seen.array() * scale - m).exp().matrix();
          const float sum = seen.sum();
          seen /= sum;
          row.head(cols(lo)).setZero();
          row.tail(cols(t - i - 1)).setZero();
          row_lse[i] = m + std::log(sum);
        }
        head_block(o, seq, h, z_.q, t).noalias() = p * head_block(v, seq, g, z_.kv, t);
      }
  }

  // Fills x_1 .. x_L from the batch's tokens.
  void forward_layers(const Weights& w, const Batch& b) const {
    const std::size_t n = tokens(b), d = z_.d;
    float* const x0 = at(l_.xs);
    const std::size_t row_bytes = d * dtype_size(w.dtype);
    {
      const EmbedUse embed(w, w.embed);
      if (*embed == nullptr) throw ConfigError("decoder CPU: the weight source gave a null embedding");
      for (std::size_t r = 0; r < n; ++r)
        convert_elements(x0 + r * d, DType::f32,
                         static_cast<const std::byte*>(*embed) +
                             static_cast<std::size_t>(b.inputs[r]) * row_bytes,
                         w.dtype, d);
    }
    // x_0 is a row of the embedding, a value of the weights' dtype: under model.bit16_residual
    // that is the residual's (make_decoder gives it the weights' dtype), so it needs no rounding.
    // Weights of another dtype (a direct caller's) are rounded as a bit16 stream would hold them.
    if (residual_ != DType::f32 && w.dtype != residual_) round_through(residual_, x0, n * d);
    for (int l = 0; l < s_.layers; ++l) forward_layer(upcast_layer(w, l), b, l, true);
  }

  // Layer l's forward from x_l into its slot and, with write_next, x_{l+1}. Run again in
  // backward for a recomputed layer (write_next false: x_{l+1} is kept): the same operations on
  // the same x_l and weights, so the same bits.
  void forward_layer(const Layer& lw, const Batch& b, int l, bool write_next) const {
    const std::size_t n = tokens(b), d = z_.d;
    const float eps = static_cast<float>(s_.rms_eps);
    float* const normed = at(l_.normed);
    const float* const x = layer_at(l_.xs, l, d);
    // `normed` holds the attention's norm output, then the MLP's.
    rms_norm(x, n, d, lw.attn_norm, eps, normed, slot_at(l_.rstd_attn, l, 1));
    const CMapR a(normed, rows_i(n), cols(d));
    // With qk_norm the projections go to q_raw, k_raw, and their per-head norms to qs, ks.
    MapR q(slot_at(s_.qk_norm ? l_.q_raw : l_.qs, l, z_.q), rows_i(n), cols(z_.q));
    MapR k(slot_at(s_.qk_norm ? l_.k_raw : l_.ks, l, z_.kv), rows_i(n), cols(z_.kv));
    MapR v(slot_at(l_.vs, l, z_.kv), rows_i(n), cols(z_.kv));
    q.noalias() = a * CMapR(lw.q, cols(z_.q), cols(d)).transpose();
    k.noalias() = a * CMapR(lw.k, cols(z_.kv), cols(d)).transpose();
    v.noalias() = a * CMapR(lw.v, cols(z_.kv), cols(d)).transpose();
    if (s_.qkv_bias) {
      q.rowwise() += CMapRow(lw.q_bias, cols(z_.q));
      k.rowwise() += CMapRow(lw.k_bias, cols(z_.kv));
      v.rowwise() += CMapRow(lw.v_bias, cols(z_.kv));
    }
    float* const q_out = slot_at(l_.qs, l, z_.q);
    float* const k_out = slot_at(l_.ks, l, z_.kv);
    if (s_.qk_norm) {  // a head's hd values are one row of the [n * heads, hd] view
      rms_norm(q.data(), n * z_.h, 2 * z_.half, lw.q_norm, eps, q_out, slot_at(l_.rstd_q, l, z_.h));
      rms_norm(k.data(), n * z_.k, 2 * z_.half, lw.k_norm, eps, k_out, slot_at(l_.rstd_k, l, z_.k));
    }
    rope(q_out, b, z_.q);
    rope(k_out, b, z_.kv);
    attention(l, b);
    MapR y(slot_at(l_.ys, l, d), rows_i(n), cols(d));
    residual_sum(y, x,
                 CMapR(slot_at(l_.os, l, z_.q), rows_i(n), cols(z_.q)) *
                     CMapR(lw.o, cols(d), cols(z_.q)).transpose());
    rms_norm(y.data(), n, d, lw.mlp_norm, eps, normed, slot_at(l_.rstd_mlp, l, 1));
    MapR gate(slot_at(l_.gates, l, z_.inter), rows_i(n), cols(z_.inter));
    MapR up(slot_at(l_.ups, l, z_.inter), rows_i(n), cols(z_.inter));
    gate.noalias() = a * CMapR(lw.gate, cols(z_.inter), cols(d)).transpose();
    up.noalias() = a * CMapR(lw.up, cols(z_.inter), cols(d)).transpose();
    if (!write_next) return;
    MapR act(at(l_.act), rows_i(n), cols(z_.inter));
    act.array() = gate.array() * (1.0f + (-gate.array()).exp()).inverse() * up.array();
    MapR next(layer_at(l_.xs, l + 1, d), rows_i(n), cols(d));
    residual_sum(next, y.data(), act * CMapR(lw.down, cols(d), cols(z_.inter)).transpose());
  }

  // out = in + product, a sum of the residual stream (in: x_l or y, rows as out's). In fp32 the
  // product accumulates onto a copy of `in`; under model.bit16_residual out = round(in +
  // round(product)), as a bit16 GEMM output added into a bit16 stream leaves it.
  template <typename Product>
  void residual_sum(MapR& out, const float* in, const Product& product) const {
    const CMapR source(in, out.rows(), out.cols());
    if (residual_ == DType::f32) {
      out = source;
      out.noalias() += product;
      return;
    }
    const auto count = static_cast<std::size_t>(out.size());
    out.noalias() = product;
    round_through(residual_, out.data(), count);
    out += source;
    round_through(residual_, out.data(), count);
  }

  // f = rmsnorm(x_L) * norm into the normed scratch.
  void final_norm(const Head& hw, std::size_t n) const {
    rms_norm(layer_at(l_.xs, s_.layers, z_.d), n, z_.d, hw.norm, static_cast<float>(s_.rms_eps),
             at(l_.normed), at(l_.rstd_final));
  }

  // The final norm, the head and the mean cross-entropy, a chunk of rows at a time. With
  // `alpha` (training), also the gradient at the final norm's output into dn, already times
  // alpha, and, with head_matrix, the head matrix's gradient into head_grad.
  double head_forward(const Weights& w, const Batch& b, const float* alpha, bool head_matrix) {
    const Head hw = upcast_head(w);
    const std::size_t n = tokens(b), d = z_.d, v = z_.v;
    final_norm(hw, n);
    MapR head_grad(at(l_.head_grad), cols(v), cols(d));
    if (head_matrix) head_grad.setZero();
    double total = 0.0;
    for (std::size_t r0 = 0; r0 < n; r0 += loss_rows_) {
      const std::size_t rows = std::min(loss_rows_, n - r0);
      const CMapR f(at(l_.normed) + r0 * d, rows_i(rows), cols(d));
      MapR z(at(l_.logits), rows_i(rows), cols(v));
      z.noalias() = f * hw.w.transpose();
      if (logits_ != DType::f32) round_through(logits_, z.data(), rows * v);
      for (std::size_t r = 0; r < rows; ++r) {
        auto row = z.row(cols(r));
        const float m = row.maxCoeff();
        const float lse = m + std::log((row.array() - m).exp().sum());
        if (b.targets[r0 + r] == kIgnoredTarget) {  // nothing to the loss or the gradient
          if (alpha != nullptr) row.setZero();
          continue;
        }
        const auto target = static_cast<Eigen::Index>(b.targets[r0 + r]);
        total += static_cast<double>(lse - row(target));
        if (alpha == nullptr) continue;
        // d loss / d logits = softmax - onehot(target), times alpha.
        row = ((row.array() - lse).exp() * *alpha).matrix();
        row(target) -= *alpha;
      }
      if (alpha == nullptr) continue;
      MapR(at(l_.dn) + r0 * d, rows_i(rows), cols(d)).noalias() = z * hw.w;
      round_residual(at(l_.dn) + r0 * d, rows * d);
      if (head_matrix) head_grad.noalias() += z.transpose() * f;
    }
    const std::size_t counted = counted_targets(b);
    return counted == 0 ? 0.0 : total / static_cast<double>(counted);
  }

  // Each value rounded to `dtype` and back, as a GEMM or a sum with a bit16 output leaves it
  // (the logits under model.bit16_logits, SwiGLU's output gradient under
  // model.bit16_swiglu_grad, the residual stream and its gradients under model.bit16_residual).
  static void round_through(DType dtype, float* values, std::size_t count) {
    for (std::size_t i = 0; i < count; ++i) {
      std::uint16_t bits = 0;
      convert_elements(&bits, dtype, values + i, DType::f32, 1);
      convert_elements(values + i, DType::f32, &bits, dtype, 1);
    }
  }

  // A gradient along the residual stream (dx, or dn at a norm's output) as a bit16 one is
  // stored under model.bit16_residual; untouched in fp32.
  void round_residual(float* values, std::size_t count) const {
    if (residual_ != DType::f32) round_through(residual_, values, count);
  }

  // ---- backward ----

  void emit(GradSink& sink, ParamId id, const float* g, std::size_t count) const {
    const GradSlot slot = sink.open(id);
    if (slot.data == nullptr)
      throw ConfigError(
          fmt::format("decoder CPU train_step: the grad slot of '{}' is null", param_name(id)));
    accumulate_elements(slot.data, slot.dtype, g, DType::f32, count);
    sink.close(id);
  }

  // dW = dy^T x for y = x W^T: [out, in] into the grad region, then into the slot.
  void emit_weight(GradSink& sink, ParamId id, const float* dy, const float* x, std::size_t n,
                   std::size_t out, std::size_t in) const {
    float* const g = at(l_.grad);
    MapR(g, cols(out), cols(in)).noalias() =
        CMapR(dy, rows_i(n), cols(out)).transpose() * CMapR(x, rows_i(n), cols(in));
    emit(sink, id, g, out * in);
  }

  // A bias's gradient: dy's column sums.
  void emit_bias(GradSink& sink, ParamId id, const float* dy, std::size_t n,
                 std::size_t width) const {
    float* const g = at(l_.grad);
    MapRow(g, cols(width)) = CMapR(dy, rows_i(n), cols(width)).colwise().sum();
    emit(sink, id, g, width);
  }

  // A per-head norm's backward over `rows` head rows of hd (x: its input, kept from forward):
  // `grad` goes from the gradient at its output to the one at its input, and the weight's
  // gradient (summed over every head row) into dw when given.
  void head_norm_backward(const float* x, const float* rstd, const float* w, std::size_t rows,
                          float* grad, float* dw) const {
    const std::size_t hd = 2 * z_.half;
    float* const dx = at(l_.d_head);
    MapR(dx, rows_i(rows), cols(hd)).setZero();
    rms_norm_backward(x, rows, hd, w, rstd, grad, dw, dx);
    std::copy(dx, dx + rows * hd, grad);
  }

  // Gradients of q, k, v (after RoPE) from that of the attention output (d_o).
  void attention_backward(int l, const Batch& b) const {
    const std::size_t t = static_cast<std::size_t>(b.seq_len), n = tokens(b), group = z_.h / z_.k;
    const float scale = 1.0f / std::sqrt(static_cast<float>(2 * z_.half));
    float* const q = slot_at(l_.qs, l, z_.q);
    float* const k = slot_at(l_.ks, l, z_.kv);
    float* const v = slot_at(l_.vs, l, z_.kv);
    float* const o = slot_at(l_.os, l, z_.q);
    const float* const lse = slot_at(l_.lse, l, z_.h);
    float* const dq = at(l_.dq);
    float* const dk = at(l_.dk);
    float* const dv = at(l_.dv);
    float* const d_o = at(l_.d_o);
    MapR(dk, rows_i(n), cols(z_.kv)).setZero();
    MapR(dv, rows_i(n), cols(z_.kv)).setZero();
    MapR p(at(l_.scores), cols(t), cols(t)), ds(at(l_.dscores), cols(t), cols(t));
    for (std::size_t seq = 0; seq < static_cast<std::size_t>(b.sequences); ++seq)
      for (std::size_t h = 0; h < z_.h; ++h) {
        const std::size_t g = h / group;
        const HeadMap qh = head_block(q, seq, h, z_.q, t), kg = head_block(k, seq, g, z_.kv, t),
                      vg = head_block(v, seq, g, z_.kv, t), oh = head_block(o, seq, h, z_.q, t),
                      doh = head_block(d_o, seq, h, z_.q, t);
        // The probabilities again, from the scores and each row's log-sum-exp.
        p.noalias() = qh * kg.transpose();
        const float* const row_lse = lse + (seq * z_.h + h) * t;
        for (std::size_t i = 0; i < t; ++i) {
          auto row = p.row(cols(i));
          const std::size_t lo = first_key(b, seq, i);
          auto seen = row.segment(cols(lo), cols(i + 1 - lo));
          seen = (seen.array() * scale - row_lse[i]).exp().matrix();
          row.head(cols(lo)).setZero();
          row.tail(cols(t - i - 1)).setZero();
        }
        head_block(dv, seq, g, z_.kv, t).noalias() += p.transpose() * doh;
        ds.noalias() = doh * vg.transpose();
        // d scores = P * (dP - rowsum(dO * O)), the softmax's Jacobian row by row.
        for (std::size_t i = 0; i < t; ++i) {
          const float dot = doh.row(cols(i)).dot(oh.row(cols(i)));
          ds.row(cols(i)).array() = p.row(cols(i)).array() * (ds.row(cols(i)).array() - dot);
        }
        ds *= scale;
        head_block(dq, seq, h, z_.q, t).noalias() = ds * kg;
        head_block(dk, seq, g, z_.kv, t).noalias() += ds.transpose() * qh;
      }
  }

  void backward_pass(const Weights& w, const Batch& b, GradSink& sink, int lowest,
                     bool head_matrix) {
    const std::size_t n = tokens(b), d = z_.d, v = z_.v;
    const int head_group = s_.layers + 1;
    float* const dx = at(l_.dx);
    float* const dn = at(l_.dn);
    float* const g = at(l_.grad);
    // The head group: the head matrix, then the final norm. A tied head's matrix is the
    // embedding: its gradient stays in head_grad (fp32), the lookup's joins it there and the
    // slot is written once at the end. The engine's slot is never held open across other
    // params' gradients: a stage-2 bucket is reduced once backward moves on to another group.
    if (head_matrix && !s_.tied) emit(sink, {ParamKind::head}, at(l_.head_grad), v * d);
    {
      const Head hw = upcast_head(w);
      const float* const x_last = layer_at(l_.xs, s_.layers, d);
      const bool active = sink.active(head_group);
      if (lowest < head_group) MapR(dx, rows_i(n), cols(d)).setZero();
      rms_norm_backward(x_last, n, d, hw.norm, at(l_.rstd_final), dn, active ? g : nullptr,
                        lowest < head_group ? dx : nullptr);
      if (lowest < head_group) round_residual(dx, n * d);
      if (active) emit(sink, {ParamKind::final_norm}, g, d);
    }
    for (int l = s_.layers - 1; l >= 0 && l + 1 >= lowest; --l)
      layer_backward(w, b, sink, l, sink.active(l + 1), l + 1 > lowest);
    if (lowest > 0) return;
    // The lookup: each input token's row gets its position's gradient, in token order.
    MapR table(at(l_.head_grad), cols(v), cols(d));
    if (!s_.tied) table.setZero();
    for (std::size_t r = 0; r < n; ++r)
      table.row(static_cast<Eigen::Index>(b.inputs[r])) += CMapRow(dx + r * d, cols(d));
    emit(sink, {ParamKind::embed}, table.data(), v * d);
  }

  // Layer l's backward from dx (the gradient at x_{l+1}); leaves the one at x_l in dx when
  // `below` (a lower group wants gradients). A frozen layer only carries dx through.
  void layer_backward(const Weights& w, const Batch& b, GradSink& sink, int l, bool active,
                      bool below) {
    const std::size_t n = tokens(b), d = z_.d, in = z_.inter;
    const Layer lw = upcast_layer(w, l);
    // A recomputed layer's activations, from x_l, into the slot the lowest layers share.
    if (static_cast<std::size_t>(l) < recompute_) forward_layer(lw, b, l, false);
    float* const dx = at(l_.dx);
    float* const dn = at(l_.dn);
    float* const normed = at(l_.normed);
    float* const g = at(l_.grad);
    const float* const y = slot_at(l_.ys, l, d);
    const float* const x = layer_at(l_.xs, l, d);
    const MapR dxm(dx, rows_i(n), cols(d));
    // MLP: x_{l+1} = y + (silu(gate) * up) Wdown^T.
    const CMapR gate(slot_at(l_.gates, l, in), rows_i(n), cols(in));
    const CMapR up(slot_at(l_.ups, l, in), rows_i(n), cols(in));
    MapR act(at(l_.act), rows_i(n), cols(in));
    MapR dgate(at(l_.dgate), rows_i(n), cols(in)), dup(at(l_.dup), rows_i(n), cols(in));
    // act holds sigmoid(gate) first, then silu(gate) * up for the down projection's gradient.
    act.array() = (1.0f + (-gate.array()).exp()).inverse();
    dgate.noalias() = dxm * CMapR(lw.down, cols(d), cols(in));  // d(silu(gate) * up)
    if (swiglu_grad_ != DType::f32) round_through(swiglu_grad_, dgate.data(), n * in);
    dup.array() = dgate.array() * gate.array() * act.array();
    dgate.array() *= up.array() * act.array() * (1.0f + gate.array() * (1.0f - act.array()));
    if (active) {
      act.array() = gate.array() * act.array() * up.array();
      emit_weight(sink, {ParamKind::down, l}, dx, act.data(), n, d, in);
      rms_norm_again(y, n, d, lw.mlp_norm, slot_at(l_.rstd_mlp, l, 1), normed);
      emit_weight(sink, {ParamKind::up, l}, dup.data(), normed, n, in, d);
      emit_weight(sink, {ParamKind::gate, l}, dgate.data(), normed, n, in, d);
    }
    MapR dnm(dn, rows_i(n), cols(d));
    dnm.noalias() = dgate * CMapR(lw.gate, cols(in), cols(d));
    dnm.noalias() += dup * CMapR(lw.up, cols(in), cols(d));
    round_residual(dn, n * d);
    // dx becomes the gradient at y: the residual's plus the norm's.
    rms_norm_backward(y, n, d, lw.mlp_norm, slot_at(l_.rstd_mlp, l, 1), dn, active ? g : nullptr,
                      dx);
    round_residual(dx, n * d);
    if (active) emit(sink, {ParamKind::mlp_norm, l}, g, d);
    // Attention: y = x + o Wo^T.
    MapR d_o(at(l_.d_o), rows_i(n), cols(z_.q));
    d_o.noalias() = dxm * CMapR(lw.o, cols(d), cols(z_.q));
    if (active) emit_weight(sink, {ParamKind::o, l}, dx, slot_at(l_.os, l, z_.q), n, d, z_.q);
    attention_backward(l, b);
    float* const dq = at(l_.dq);
    float* const dk = at(l_.dk);
    float* const dv = at(l_.dv);
    rope_backward(dq, b, z_.q);
    rope_backward(dk, b, z_.kv);
    // With q/k norms, dq and dk go from the norms' outputs to their inputs, and the norms'
    // weight gradients wait in head_norm_grads to be written in backward order.
    float* const q_norm_grad = at(l_.head_norm_grads);
    float* const k_norm_grad = q_norm_grad + 2 * z_.half;
    if (s_.qk_norm && (active || below)) {
      head_norm_backward(slot_at(l_.k_raw, l, z_.kv), slot_at(l_.rstd_k, l, z_.k), lw.k_norm,
                         n * z_.k, dk, active ? k_norm_grad : nullptr);
      head_norm_backward(slot_at(l_.q_raw, l, z_.q), slot_at(l_.rstd_q, l, z_.h), lw.q_norm,
                         n * z_.h, dq, active ? q_norm_grad : nullptr);
    }
    if (active) {
      rms_norm_again(x, n, d, lw.attn_norm, slot_at(l_.rstd_attn, l, 1), normed);
      if (s_.qkv_bias) emit_bias(sink, {ParamKind::v_bias, l}, dv, n, z_.kv);
      emit_weight(sink, {ParamKind::v, l}, dv, normed, n, z_.kv, d);
      if (s_.qk_norm) emit(sink, {ParamKind::k_norm, l}, k_norm_grad, 2 * z_.half);
      if (s_.qkv_bias) emit_bias(sink, {ParamKind::k_bias, l}, dk, n, z_.kv);
      emit_weight(sink, {ParamKind::k, l}, dk, normed, n, z_.kv, d);
      if (s_.qk_norm) emit(sink, {ParamKind::q_norm, l}, q_norm_grad, 2 * z_.half);
      if (s_.qkv_bias) emit_bias(sink, {ParamKind::q_bias, l}, dq, n, z_.q);
      emit_weight(sink, {ParamKind::q, l}, dq, normed, n, z_.q, d);
    }
    if (!active && !below) return;
    dnm.noalias() = CMapR(dq, rows_i(n), cols(z_.q)) * CMapR(lw.q, cols(z_.q), cols(d));
    dnm.noalias() += CMapR(dk, rows_i(n), cols(z_.kv)) * CMapR(lw.k, cols(z_.kv), cols(d));
    dnm.noalias() += CMapR(dv, rows_i(n), cols(z_.kv)) * CMapR(lw.v, cols(z_.kv), cols(d));
    round_residual(dn, n * d);
    rms_norm_backward(x, n, d, lw.attn_norm, slot_at(l_.rstd_attn, l, 1), dn, active ? g : nullptr,
                      below ? dx : nullptr);
    if (below) round_residual(dx, n * d);
    if (active) emit(sink, {ParamKind::attn_norm, l}, g, d);
  }

  DecoderShape s_;
  int max_sequences_, seq_len_;
  std::size_t recompute_;  // the lowest layers that run their forward again in backward
  DType logits_;       // fp32, or bf16 / fp16 with model.bit16_logits (see round_through)
  DType swiglu_grad_;  // fp32, or bf16 / fp16 with model.bit16_swiglu_grad
  // fp32, or bf16 / fp16 with model.bit16_residual: x, y and the sums into them, dn and dx
  DType residual_;
  Sizes z_;
  std::size_t loss_rows_;  // token rows of the cross-entropy's chunk (model.loss_chunk_rows)
  std::byte* mem_;
  Layout l_;
};

}  // namespace

std::size_t cpu_bytes(const DecoderShape& s, int max_sequences, int seq_len,
                      int recompute_layers, int loss_rows) {
  validate(s, max_sequences, seq_len, recompute_layers, loss_rows, "cpu_bytes");
  return layout_of(s, max_sequences, seq_len, recompute_layers, loss_rows).bytes;
}

std::unique_ptr<Compute> make_cpu_compute(const DecoderShape& s, int max_sequences, int seq_len,
                                          void* memory, std::size_t bytes,
                                          int recompute_layers, Precision precision,
                                          int loss_rows) {
  validate(s, max_sequences, seq_len, recompute_layers, loss_rows, "make_cpu_compute");
  for (const auto& [what, dtype] : {std::pair{"logits", precision.logits},
                                    std::pair{"SwiGLU's gradient", precision.swiglu_grad},
                                    std::pair{"the residual stream", precision.residual}})
    if (dtype != DType::f32 && !is_bit16(dtype))
      throw ConfigError(fmt::format("make_cpu_compute: {} of dtype {}: fp32, bf16 or fp16", what,
                                    dtype_name(dtype)));
  const std::size_t need =
      layout_of(s, max_sequences, seq_len, recompute_layers, loss_rows).bytes;
  if (memory == nullptr || bytes < need)
    throw ConfigError(
        fmt::format("make_cpu_compute: a block of {} bytes at {}; the backend needs {} (cpu_bytes)",
                    bytes, memory, need));
  if (reinterpret_cast<std::uintptr_t>(memory) % kAlign != 0)
    throw ConfigError(
        fmt::format("make_cpu_compute: the block at {} is not {}-byte aligned", memory, kAlign));
  return std::make_unique<CpuCompute>(s, max_sequences, seq_len, recompute_layers, loss_rows,
                                      static_cast<std::byte*>(memory), precision);
}

}  // namespace shardswap::lm::dec
