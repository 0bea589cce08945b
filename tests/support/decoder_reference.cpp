#include "tests/support/decoder_reference.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numbers>
#include <random>

#include "shardswap/error.h"

namespace shardswap::test_support {

namespace {

using Vec = std::vector<double>;

std::string L(int l, const char* what) {
  return fmt::format("model.layers.{}.{}", l, what);
}

const Vec& get(const DecoderValues& w, const std::string& name) {
  const auto it = w.find(name);
  if (it == w.end()) throw ConfigError(fmt::format("decoder reference: no value for '{}'", name));
  return it->second;
}

// y = W x (+ b) for W row-major [out, in].
Vec linear(const Vec& W, const Vec& x, std::size_t out, const Vec* bias = nullptr) {
  const std::size_t in = x.size();
  Vec y(out, 0.0);
  for (std::size_t o = 0; o < out; ++o) {
    double acc = bias != nullptr ? (*bias)[o] : 0.0;
    for (std::size_t i = 0; i < in; ++i) acc += W[o * in + i] * x[i];
    y[o] = acc;
  }
  return y;
}

Vec rms_norm(const Vec& x, const Vec& weight, double eps) {
  double ms = 0.0;
  for (double v : x) ms += v * v;
  ms /= static_cast<double>(x.size());
  const double inv = 1.0 / std::sqrt(ms + eps);
  Vec y(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) y[i] = x[i] * inv * weight[i];
  return y;
}

// Qwen3's per-head norm: each head's head_dim values of x normalized on their own.
void head_rms_norm(Vec& x, int heads, int head_dim, const Vec& weight, double eps) {
  for (int h = 0; h < heads; ++h) {
    const auto first = x.begin() + static_cast<std::ptrdiff_t>(h) * head_dim;
    const Vec y = rms_norm(Vec(first, first + head_dim), weight, eps);
    std::copy(y.begin(), y.end(), first);
  }
}

// Rotates each head's halves [x1, x2] into [x1 cos - x2 sin, x2 cos + x1 sin].
void rope(Vec& x, int heads, int head_dim, int position, const std::vector<float>& inv_freq) {
  const int half = head_dim / 2;
  for (int h = 0; h < heads; ++h)
    for (int i = 0; i < half; ++i) {
      // transformers forms the angle as a float32 product; the reference does the same, so
      // that only the arithmetic of the backends differs.
      const float angle = static_cast<float>(position) * inv_freq[static_cast<std::size_t>(i)];
      const double c = std::cos(static_cast<double>(angle));
      const double s = std::sin(static_cast<double>(angle));
      double& a = x[static_cast<std::size_t>(h * head_dim + i)];
      double& b = x[static_cast<std::size_t>(h * head_dim + half + i)];
      const double x1 = a, x2 = b;
      a = x1 * c - x2 * s;
      b = x2 * c + x1 * s;
    }
}

}  // namespace

std::int64_t DecoderRefParam::numel() const {
  std::int64_t n = 1;
  for (auto e : shape) n *= e;
  return n;
}

std::vector<DecoderRefParam> decoder_reference_params(const DecoderShape& s) {
  const std::int64_t V = s.vocab, D = s.hidden, I = s.intermediate,
                     Q = std::int64_t{s.heads} * s.head_dim,
                     KV = std::int64_t{s.kv_heads} * s.head_dim;
  std::vector<DecoderRefParam> out;
  out.push_back({"model.embed_tokens.weight", {V, D}, 0});
  for (int l = 0; l < s.layers; ++l) {
    const int g = 1 + l;
    out.push_back({L(l, "input_layernorm.weight"), {D}, g});
    out.push_back({L(l, "self_attn.q_proj.weight"), {Q, D}, g});
    if (s.qkv_bias) out.push_back({L(l, "self_attn.q_proj.bias"), {Q}, g});
    if (s.qk_norm) out.push_back({L(l, "self_attn.q_norm.weight"), {s.head_dim}, g});
    out.push_back({L(l, "self_attn.k_proj.weight"), {KV, D}, g});
    if (s.qkv_bias) out.push_back({L(l, "self_attn.k_proj.bias"), {KV}, g});
    if (s.qk_norm) out.push_back({L(l, "self_attn.k_norm.weight"), {s.head_dim}, g});
    out.push_back({L(l, "self_attn.v_proj.weight"), {KV, D}, g});
    if (s.qkv_bias) out.push_back({L(l, "self_attn.v_proj.bias"), {KV}, g});
    out.push_back({L(l, "self_attn.o_proj.weight"), {D, Q}, g});
    out.push_back({L(l, "post_attention_layernorm.weight"), {D}, g});
    out.push_back({L(l, "mlp.gate_proj.weight"), {I, D}, g});
    out.push_back({L(l, "mlp.up_proj.weight"), {I, D}, g});
    out.push_back({L(l, "mlp.down_proj.weight"), {D, I}, g});
  }
  out.push_back({"model.norm.weight", {D}, s.layers + 1});
  if (!s.tied) out.push_back({"lm_head.weight", {V, D}, s.layers + 1});
  return out;
}

std::vector<float> decoder_reference_inv_freq(const DecoderShape& s) {
  const int half = s.head_dim / 2;
  std::vector<float> out;
  for (int i = 0; i < half; ++i) {
    double f = std::pow(s.rope_theta, -2.0 * i / s.head_dim);
    if (s.rope_scaling == RopeScaling::linear) f /= s.rope_factor;
    if (s.rope_scaling == RopeScaling::llama3) {
      // Wavelengths longer than original / low_freq_factor are stretched by `factor`, those
      // shorter than original / high_freq_factor kept, and those between blended linearly in
      // original / wavelength.
      const double wavelength = 2.0 * std::numbers::pi / f;
      const double original = s.rope_original_max_positions;
      if (wavelength > original / s.rope_low_freq_factor) {
        f /= s.rope_factor;
      } else if (wavelength >= original / s.rope_high_freq_factor) {
        const double t = (original / wavelength - s.rope_low_freq_factor) /
                         (s.rope_high_freq_factor - s.rope_low_freq_factor);
        f = (1.0 - t) * f / s.rope_factor + t * f;
      }
    }
    out.push_back(static_cast<float>(f));
  }
  return out;
}

DecoderRefOutput decoder_reference_forward(const DecoderShape& s, const DecoderValues& w,
                                           const DecoderTokens& tokens) {
  const int T = tokens.seq_len, D = s.hidden, V = s.vocab, H = s.heads, K = s.kv_heads,
            hd = s.head_dim;
  const auto Q = static_cast<std::size_t>(H * hd), KV = static_cast<std::size_t>(K * hd),
             I = static_cast<std::size_t>(s.intermediate);
  const std::vector<float> inv_freq = decoder_reference_inv_freq(s);
  const Vec& embed = get(w, "model.embed_tokens.weight");
  const Vec& head = s.tied ? embed : get(w, "lm_head.weight");
  DecoderRefOutput out;
  double total = 0.0;
  std::int64_t counted = 0;  // targets the loss is on
  for (int b = 0; b < tokens.sequences; ++b) {
    // Each token's place in its document: its RoPE position, and how many tokens before it
    // attention sees.
    std::vector<int> pos(static_cast<std::size_t>(T));
    for (int t = 0; t < T; ++t)
      pos[static_cast<std::size_t>(t)] =
          tokens.positions.empty() ? t : tokens.positions[static_cast<std::size_t>(b * T + t)];
    // The residual stream of each position of this sequence.
    std::vector<Vec> x(static_cast<std::size_t>(T));
    for (int t = 0; t < T; ++t) {
      const auto tok = static_cast<std::size_t>(tokens.inputs[static_cast<std::size_t>(b * T + t)]);
      x[static_cast<std::size_t>(t)].assign(
          embed.begin() + static_cast<std::ptrdiff_t>(tok * D),
          embed.begin() + static_cast<std::ptrdiff_t>((tok + 1) * D));
    }
    for (int l = 0; l < s.layers; ++l) {
      const Vec& attn_norm = get(w, L(l, "input_layernorm.weight"));
      const Vec& wq = get(w, L(l, "self_attn.q_proj.weight"));
      const Vec& wk = get(w, L(l, "self_attn.k_proj.weight"));
      const Vec& wv = get(w, L(l, "self_attn.v_proj.weight"));
      const Vec* bq = s.qkv_bias ? &get(w, L(l, "self_attn.q_proj.bias")) : nullptr;
      const Vec* bk = s.qkv_bias ? &get(w, L(l, "self_attn.k_proj.bias")) : nullptr;
      const Vec* bv = s.qkv_bias ? &get(w, L(l, "self_attn.v_proj.bias")) : nullptr;
      const Vec* q_norm = s.qk_norm ? &get(w, L(l, "self_attn.q_norm.weight")) : nullptr;
      const Vec* k_norm = s.qk_norm ? &get(w, L(l, "self_attn.k_norm.weight")) : nullptr;
      const Vec& wo = get(w, L(l, "self_attn.o_proj.weight"));
      const Vec& mlp_norm = get(w, L(l, "post_attention_layernorm.weight"));
      const Vec& wgate = get(w, L(l, "mlp.gate_proj.weight"));
      const Vec& wup = get(w, L(l, "mlp.up_proj.weight"));
      const Vec& wdown = get(w, L(l, "mlp.down_proj.weight"));
      std::vector<Vec> q(static_cast<std::size_t>(T)), k(q.size()), v(q.size());
      for (int t = 0; t < T; ++t) {
        const auto ut = static_cast<std::size_t>(t);
        const Vec a = rms_norm(x[ut], attn_norm, s.rms_eps);
        q[ut] = linear(wq, a, Q, bq);
        k[ut] = linear(wk, a, KV, bk);
        v[ut] = linear(wv, a, KV, bv);
        if (s.qk_norm) {
          head_rms_norm(q[ut], H, hd, *q_norm, s.rms_eps);
          head_rms_norm(k[ut], K, hd, *k_norm, s.rms_eps);
        }
        rope(q[ut], H, hd, pos[ut], inv_freq);
        rope(k[ut], K, hd, pos[ut], inv_freq);
      }
      // Every position's attention reads the k, v of the positions before it, so the residual
      // is updated only once all of them are computed.
      std::vector<Vec> attn(q.size());
      for (int t = 0; t < T; ++t) {
        const auto ut = static_cast<std::size_t>(t);
        Vec o(Q, 0.0);
        for (int h = 0; h < H; ++h) {
          const int g = h / (H / K);
          // Scores of positions first..t (its document's, up to it), then their softmax.
          const int first = t - pos[ut];
          Vec score(static_cast<std::size_t>(t - first + 1));
          for (int j = first; j <= t; ++j) {
            double dot = 0.0;
            for (int e = 0; e < hd; ++e)
              dot += q[ut][static_cast<std::size_t>(h * hd + e)] *
                     k[static_cast<std::size_t>(j)][static_cast<std::size_t>(g * hd + e)];
            score[static_cast<std::size_t>(j - first)] = dot / std::sqrt(static_cast<double>(hd));
          }
          const double m = *std::max_element(score.begin(), score.end());
          double sum = 0.0;
          for (double& sc : score) sum += (sc = std::exp(sc - m));
          for (int j = first; j <= t; ++j)
            for (int e = 0; e < hd; ++e)
              o[static_cast<std::size_t>(h * hd + e)] +=
                  score[static_cast<std::size_t>(j - first)] / sum *
                  v[static_cast<std::size_t>(j)][static_cast<std::size_t>(g * hd + e)];
        }
        attn[ut] = linear(wo, o, static_cast<std::size_t>(D));
      }
      for (int t = 0; t < T; ++t) {
        const auto ut = static_cast<std::size_t>(t);
        for (int e = 0; e < D; ++e)
          x[ut][static_cast<std::size_t>(e)] += attn[ut][static_cast<std::size_t>(e)];
        const Vec bn = rms_norm(x[ut], mlp_norm, s.rms_eps);
        const Vec gate = linear(wgate, bn, I);
        const Vec up = linear(wup, bn, I);
        Vec act(I);
        for (std::size_t e = 0; e < I; ++e) act[e] = gate[e] / (1.0 + std::exp(-gate[e])) * up[e];
        const Vec mlp = linear(wdown, act, static_cast<std::size_t>(D));
        for (int e = 0; e < D; ++e)
          x[ut][static_cast<std::size_t>(e)] += mlp[static_cast<std::size_t>(e)];
      }
    }
    for (int t = 0; t < T; ++t) {
      const Vec f =
          rms_norm(x[static_cast<std::size_t>(t)], get(w, "model.norm.weight"), s.rms_eps);
      const Vec z = linear(head, f, static_cast<std::size_t>(V));
      const double m = *std::max_element(z.begin(), z.end());
      double sum = 0.0;
      for (double e : z) sum += std::exp(e - m);
      out.logits.insert(out.logits.end(), z.begin(), z.end());
      const std::int32_t id = tokens.targets[static_cast<std::size_t>(b * T + t)];
      if (id < 0) continue;  // kIgnoredTarget: no loss on it
      total += m + std::log(sum) - z[static_cast<std::size_t>(id)];
      ++counted;
    }
  }
  out.loss = counted == 0 ? 0.0 : total / static_cast<double>(counted);
  return out;
}

double decoder_reference_gradient(const DecoderShape& s, DecoderValues& w,
                                  const DecoderTokens& tokens, const std::string& name,
                                  std::size_t index, double h) {
  double& value = w.at(name).at(index);
  const double at = value;
  value = at + h;
  const double plus = decoder_reference_forward(s, w, tokens).loss;
  value = at - h;
  const double minus = decoder_reference_forward(s, w, tokens).loss;
  value = at;
  return (plus - minus) / (2.0 * h);
}

DecoderValues random_decoder_weights(const DecoderShape& s, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  DecoderValues out;
  for (const auto& p : decoder_reference_params(s)) {
    Vec v(static_cast<std::size_t>(p.numel()));
    const bool norm = p.shape.size() == 1 && p.name.find("bias") == std::string::npos;
    const bool bias = p.name.find("bias") != std::string::npos;
    const double fan_in = static_cast<double>(p.shape.back());
    for (double& e : v) {
      if (norm)
        e = 1.0 + 0.2 * normal(rng);
      else if (bias)
        e = 0.3 * normal(rng);
      else if (p.name == "model.embed_tokens.weight")
        e = 0.7 * normal(rng);
      else
        e = normal(rng) / std::sqrt(fan_in);
    }
    out[p.name] = std::move(v);
  }
  return out;
}

DecoderTokens random_decoder_tokens(const DecoderShape& s, int sequences, int seq_len,
                                    std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<std::int32_t> id(0, s.vocab - 1);
  DecoderTokens t{sequences, seq_len, {}, {}, {}};
  for (int i = 0; i < sequences * seq_len; ++i) {
    t.inputs.push_back(id(rng));
    t.targets.push_back(id(rng));
  }
  return t;
}

double decoder_mean_cross_entropy(const float* logits, std::size_t rows, std::size_t vocab,
                                  const std::int32_t* targets) {
  double sum = 0.0;
  std::size_t counted = 0;
  for (std::size_t r = 0; r < rows; ++r) {
    if (targets[r] < 0) continue;
    const float* z = logits + r * vocab;
    const double top = *std::max_element(z, z + vocab);
    double exps = 0.0;
    for (std::size_t k = 0; k < vocab; ++k) exps += std::exp(z[k] - top);
    sum += top + std::log(exps) - z[static_cast<std::size_t>(targets[r])];
    ++counted;
  }
  return counted == 0 ? 0.0 : sum / static_cast<double>(counted);
}

double decoder_normalized_error(const std::vector<double>& a, const std::vector<double>& b) {
  double diff = 0.0, norm = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    diff += (a[i] - b[i]) * (a[i] - b[i]);
    norm += b[i] * b[i];
  }
  return norm > 0.0 ? std::sqrt(diff / norm) : std::sqrt(diff);
}

}  // namespace shardswap::test_support
