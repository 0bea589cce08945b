// The decoder's CUDA backend (tools/model/decoder_cuda.h) against a float64 host reference on
// random weights and tokens: logits, loss and every gradient over shapes that cover GQA and
// multi-head attention, q/k/v biases, Qwen3's per-head q/k norms, a tied head, llama3 RoPE
// scaling, head dims of 1 to 4 lanes a warp, one to 128 positions and several sequences; frozen
// groups; bitwise equal runs; no device memory beyond cuda_bytes; refusals. The reference itself
// is checked by finite differences.
#define CATCH_CONFIG_EXTERNAL_INTERFACES  // Catch2 v2: listeners outside main.cpp
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "shardswap/error.h"
#include "tests/catch_compat.h"
#include "tests/support/decoder_reference.h"
#include "model/decoder_cuda.h"

using namespace shardswap;
using namespace shardswap::lm::dec;

namespace {

using Vec = std::vector<double>;

// ---- the float64 reference (decoder_compute.h's math, written out) ----

struct LayerParams {
  Vec attn_norm, q, q_bias, q_norm, k, k_bias, k_norm, v, v_bias, o, mlp_norm, gate, up, down;
};
struct Params {
  Vec embed, final_norm, head;  // head empty when tied
  std::vector<LayerParams> layers;
};

struct ParamSpec {
  ParamId id;
  std::string name;
  std::size_t size;
  int group;
};

std::vector<ParamSpec> param_specs(const DecoderShape& s) {
  const auto d = static_cast<std::size_t>(s.hidden), in = static_cast<std::size_t>(s.intermediate),
             qw = static_cast<std::size_t>(s.q_width()), kw = static_cast<std::size_t>(s.kv_width()),
             v = static_cast<std::size_t>(s.vocab);
  std::vector<ParamSpec> p{{{ParamKind::embed}, "embed", v * d, 0}};
  for (int l = 0; l < s.layers; ++l) {
    const std::string at = "layers." + std::to_string(l) + ".";
    const auto add = [&](ParamKind kind, const char* name, std::size_t size) {
      p.push_back({{kind, l}, at + name, size, l + 1});
    };
    add(ParamKind::attn_norm, "attn_norm", d);
    add(ParamKind::q, "q", qw * d);
    if (s.qkv_bias) add(ParamKind::q_bias, "q_bias", qw);
    if (s.qk_norm) add(ParamKind::q_norm, "q_norm", static_cast<std::size_t>(s.head_dim));
    add(ParamKind::k, "k", kw * d);
    if (s.qkv_bias) add(ParamKind::k_bias, "k_bias", kw);
    if (s.qk_norm) add(ParamKind::k_norm, "k_norm", static_cast<std::size_t>(s.head_dim));
    add(ParamKind::v, "v", kw * d);
    if (s.qkv_bias) add(ParamKind::v_bias, "v_bias", kw);
    add(ParamKind::o, "o", d * qw);
    add(ParamKind::mlp_norm, "mlp_norm", d);
    add(ParamKind::gate, "gate", in * d);
    add(ParamKind::up, "up", in * d);
    add(ParamKind::down, "down", d * in);
  }
  p.push_back({{ParamKind::final_norm}, "final_norm", d, s.layers + 1});
  if (!s.tied) p.push_back({{ParamKind::head}, "head", v * d, s.layers + 1});
  return p;
}

Vec& param(Params& p, ParamId id) {
  if (id.layer < 0) {
    switch (id.kind) {
      case ParamKind::embed:
        return p.embed;
      case ParamKind::final_norm:
        return p.final_norm;
      default:
        return p.head;
    }
  }
  LayerParams& l = p.layers[static_cast<std::size_t>(id.layer)];
  switch (id.kind) {
    case ParamKind::attn_norm:
      return l.attn_norm;
    case ParamKind::q:
      return l.q;
    case ParamKind::q_bias:
      return l.q_bias;
    case ParamKind::q_norm:
      return l.q_norm;
    case ParamKind::k:
      return l.k;
    case ParamKind::k_bias:
      return l.k_bias;
    case ParamKind::k_norm:
      return l.k_norm;
    case ParamKind::v:
      return l.v;
    case ParamKind::v_bias:
      return l.v_bias;
    case ParamKind::o:
      return l.o;
    case ParamKind::mlp_norm:
      return l.mlp_norm;
    case ParamKind::gate:
      return l.gate;
    case ParamKind::up:
      return l.up;
    default:
      return l.down;
  }
}

const Vec& param(const Params& p, ParamId id) {
  return param(const_cast<Params&>(p), id);
}

ParamSpec spec_named(const DecoderShape& s, const std::string& name) {
  for (const ParamSpec& spec : param_specs(s))
    if (spec.name == name) return spec;
  FAIL("no param " << name);
  return {};
}

Params zeros_like(const DecoderShape& s) {
  Params p;
  p.layers.resize(static_cast<std::size_t>(s.layers));
  for (const ParamSpec& spec : param_specs(s)) param(p, spec.id).assign(spec.size, 0.0);
  return p;
}

// y[n, o] = x[n, i] w[o, i]^T (+ bias)
Vec linear(const Vec& x, const Vec& w, int n, int o, int i, const Vec* bias = nullptr) {
  Vec y(static_cast<std::size_t>(n) * o);
  for (int t = 0; t < n; ++t)
    for (int r = 0; r < o; ++r) {
      double acc = bias ? (*bias)[r] : 0.0;
      for (int k = 0; k < i; ++k) acc += x[t * i + k] * w[r * i + k];
      y[t * o + r] = acc;
    }
  return y;
}
// dx[n, i] (+)= dy[n, o] w[o, i]; dw[o, i] += dy^T x when dw is given.
void linear_back(const Vec& dy, const Vec& w, const Vec& x, int n, int o, int i, Vec& dx,
                 Vec* dw, Vec* dbias = nullptr) {
  for (int t = 0; t < n; ++t)
    for (int r = 0; r < o; ++r) {
      const double g = dy[t * o + r];
      for (int k = 0; k < i; ++k) {
        dx[t * i + k] += g * w[r * i + k];
        if (dw) (*dw)[r * i + k] += g * x[t * i + k];
      }
      if (dbias) (*dbias)[r] += g;
    }
}

Vec rms_norm(const Vec& x, const Vec& w, int n, int d, double eps, Vec& rstd) {
  Vec y(x.size());
  rstd.assign(static_cast<std::size_t>(n), 0.0);
  for (int t = 0; t < n; ++t) {
    double sq = 0;
    for (int k = 0; k < d; ++k) sq += x[t * d + k] * x[t * d + k];
    rstd[t] = 1.0 / std::sqrt(sq / d + eps);
    for (int k = 0; k < d; ++k) y[t * d + k] = x[t * d + k] * rstd[t] * w[k];
  }
  return y;
}
// dx += the gradient at the norm's input; dw += its weight gradient.
void rms_norm_back(const Vec& dz, const Vec& x, const Vec& rstd, const Vec& w, int n, int d,
                   Vec& dx, Vec& dw) {
  for (int t = 0; t < n; ++t) {
    double mean = 0;
    for (int k = 0; k < d; ++k) mean += dz[t * d + k] * w[k] * x[t * d + k] * rstd[t];
    mean /= d;
    for (int k = 0; k < d; ++k) {
      const double xhat = x[t * d + k] * rstd[t];
      dx[t * d + k] += rstd[t] * (dz[t * d + k] * w[k] - xhat * mean);
      dw[k] += dz[t * d + k] * xhat;
    }
  }
}

// Rotate-half RoPE on x [n, heads * hd] in place; `inverse` applies the transpose. Token t is at
// position positions[t] (documents apart), or t % seq_len without them.
void rope(Vec& x, const DecoderShape& s, int heads, int seq_len, bool inverse,
          const std::vector<std::int32_t>& positions) {
  const std::vector<float> inv_freq = rope_inv_freq(s);
  const int hd = s.head_dim, half = hd / 2, n = static_cast<int>(x.size()) / (heads * hd);
  for (int t = 0; t < n; ++t)
    for (int h = 0; h < heads; ++h)
      for (int i = 0; i < half; ++i) {
        const int pos = positions.empty() ? t % seq_len : positions[static_cast<std::size_t>(t)];
        const float angle = static_cast<float>(pos) * inv_freq[i];  // as transformers
        const double c = std::cos(static_cast<double>(angle)),
                     sn = (inverse ? -1.0 : 1.0) * std::sin(static_cast<double>(angle));
        double& a = x[static_cast<std::size_t>(t) * heads * hd + h * hd + i];
        double& b = x[static_cast<std::size_t>(t) * heads * hd + h * hd + i + half];
        const double na = a * c - b * sn, nb = b * c + a * sn;
        a = na;
        b = nb;
      }
}

struct Tokens {
  int sequences = 0, seq_len = 0;
  std::vector<std::int32_t> inputs, targets;
  std::vector<std::int32_t> positions;  // empty: one stream a row; else documents apart
};

struct RefResult {
  double loss = 0;
  Vec logits;
  Params grads;  // of grad_scale * the mean loss
};

RefResult reference(const DecoderShape& s, const Params& w, const Tokens& b, double grad_scale) {
  const int n = b.sequences * b.seq_len, d = s.hidden, in = s.intermediate, V = s.vocab;
  const int H = s.heads, K = s.kv_heads, hd = s.head_dim, T = b.seq_len, G = H / K;
  const int qw = H * hd, kw = K * hd;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  // The first key row i of sequence sq sees: 0, or its document's first token.
  const auto first_key = [&](int sq, int i) {
    return b.positions.empty() ? 0 : i - b.positions[static_cast<std::size_t>(sq * T + i)];
  };
  struct Saved {
    Vec x, a, r1, q, k, v, p, o, y, bn, r2, gate, up, act;
    Vec q_in, k_in, rq, rk;  // qk_norm: q and k before their head norms, and 1 / rms per head
  };
  std::vector<Saved> saved(static_cast<std::size_t>(s.layers));
  Vec x(static_cast<std::size_t>(n) * d);
  for (int t = 0; t < n; ++t)
    for (int k = 0; k < d; ++k) x[t * d + k] = w.embed[b.inputs[t] * d + k];
  for (int l = 0; l < s.layers; ++l) {
    const LayerParams& lw = w.layers[l];
    Saved& sv = saved[l];
    sv.x = x;
    sv.a = rms_norm(x, lw.attn_norm, n, d, s.rms_eps, sv.r1);
    sv.q = linear(sv.a, lw.q, n, qw, d, s.qkv_bias ? &lw.q_bias : nullptr);
    sv.k = linear(sv.a, lw.k, n, kw, d, s.qkv_bias ? &lw.k_bias : nullptr);
    sv.v = linear(sv.a, lw.v, n, kw, d, s.qkv_bias ? &lw.v_bias : nullptr);
    if (s.qk_norm) {  // each head's hd values a row: [n, H hd] is [n H, hd]
      sv.q_in = sv.q;
      sv.k_in = sv.k;
      sv.q = rms_norm(sv.q_in, lw.q_norm, n * H, hd, s.rms_eps, sv.rq);
      sv.k = rms_norm(sv.k_in, lw.k_norm, n * K, hd, s.rms_eps, sv.rk);
    }
    rope(sv.q, s, H, T, false, b.positions);
    rope(sv.k, s, K, T, false, b.positions);
    sv.p.assign(static_cast<std::size_t>(b.sequences) * H * T * T, 0.0);
    sv.o.assign(static_cast<std::size_t>(n) * qw, 0.0);
    for (int sq = 0; sq < b.sequences; ++sq)
      for (int h = 0; h < H; ++h)
        for (int i = 0; i < T; ++i) {
          double* p = &sv.p[((static_cast<std::size_t>(sq) * H + h) * T + i) * T];
          const double* qi = &sv.q[(sq * T + i) * qw + h * hd];
          double m = -1e300;
          const int lo = first_key(sq, i);
          for (int j = lo; j <= i; ++j) {
            const double* kj = &sv.k[(sq * T + j) * kw + (h / G) * hd];
            double dot = 0;
            for (int e = 0; e < hd; ++e) dot += qi[e] * kj[e];
            p[j] = dot * scale;
            m = std::max(m, p[j]);
          }
          double sum = 0;
          for (int j = lo; j <= i; ++j) sum += p[j] = std::exp(p[j] - m);
          for (int j = lo; j <= i; ++j) {
            p[j] /= sum;
            for (int e = 0; e < hd; ++e)
              sv.o[(sq * T + i) * qw + h * hd + e] +=
                  p[j] * sv.v[(sq * T + j) * kw + (h / G) * hd + e];
          }
        }
    sv.y = linear(sv.o, lw.o, n, d, qw);
    for (std::size_t e = 0; e < x.size(); ++e) sv.y[e] += x[e];
    sv.bn = rms_norm(sv.y, lw.mlp_norm, n, d, s.rms_eps, sv.r2);
    sv.gate = linear(sv.bn, lw.gate, n, in, d);
    sv.up = linear(sv.bn, lw.up, n, in, d);
    sv.act.resize(sv.gate.size());
    for (std::size_t e = 0; e < sv.act.size(); ++e)
      sv.act[e] = sv.gate[e] / (1.0 + std::exp(-sv.gate[e])) * sv.up[e];
    x = linear(sv.act, lw.down, n, d, in);
    for (std::size_t e = 0; e < x.size(); ++e) x[e] += sv.y[e];
  }
  Vec rf;
  const Vec f = rms_norm(x, w.final_norm, n, d, s.rms_eps, rf);
  const Vec& head = s.tied ? w.embed : w.head;
  RefResult r;
  r.logits = linear(f, head, n, V, d);
  r.grads = zeros_like(s);
  Params& g = r.grads;
  Vec dlogits(r.logits.size(), 0.0);
  // The mean over the counted targets (a target below 0 is ignored: no loss, no gradient).
  int counted = 0;
  for (int t = 0; t < n; ++t) counted += b.targets[t] >= 0 ? 1 : 0;
  for (int t = 0; t < n; ++t) {
    if (b.targets[t] < 0) continue;
    const double* z = &r.logits[static_cast<std::size_t>(t) * V];
    double m = -1e300, sum = 0;
    for (int c = 0; c < V; ++c) m = std::max(m, z[c]);
    for (int c = 0; c < V; ++c) sum += std::exp(z[c] - m);
    const double lse = m + std::log(sum);
    r.loss += (lse - z[b.targets[t]]) / counted;
    for (int c = 0; c < V; ++c)
      dlogits[t * V + c] =
          grad_scale * (std::exp(z[c] - lse) - (c == b.targets[t] ? 1.0 : 0.0)) / counted;
  }
  Vec df(f.size(), 0.0);
  linear_back(dlogits, head, f, n, V, d, df, s.tied ? &g.embed : &g.head);
  Vec dx(x.size(), 0.0);
  rms_norm_back(df, x, rf, w.final_norm, n, d, dx, g.final_norm);
  for (int l = s.layers - 1; l >= 0; --l) {
    const LayerParams& lw = w.layers[l];
    LayerParams& lg = g.layers[l];
    const Saved& sv = saved[l];
    Vec dact(sv.act.size(), 0.0);
    linear_back(dx, lw.down, sv.act, n, d, in, dact, &lg.down);
    Vec dgate(dact.size()), dup(dact.size());
    for (std::size_t e = 0; e < dact.size(); ++e) {
      const double gt = sv.gate[e], sig = 1.0 / (1.0 + std::exp(-gt));
      dgate[e] = dact[e] * sv.up[e] * sig * (1.0 + gt * (1.0 - sig));
      dup[e] = dact[e] * gt * sig;
    }
    Vec dbn(sv.bn.size(), 0.0);
    linear_back(dgate, lw.gate, sv.bn, n, in, d, dbn, &lg.gate);
    linear_back(dup, lw.up, sv.bn, n, in, d, dbn, &lg.up);
    Vec dy = dx;
    rms_norm_back(dbn, sv.y, sv.r2, lw.mlp_norm, n, d, dy, lg.mlp_norm);
    Vec dout(sv.o.size(), 0.0);
    linear_back(dy, lw.o, sv.o, n, d, qw, dout, &lg.o);
    Vec dq(sv.q.size(), 0.0), dk(sv.k.size(), 0.0), dv(sv.v.size(), 0.0);
    for (int sq = 0; sq < b.sequences; ++sq)
      for (int h = 0; h < H; ++h)
        for (int i = 0; i < T; ++i) {
          const double* p = &sv.p[((static_cast<std::size_t>(sq) * H + h) * T + i) * T];
          const std::size_t qi = static_cast<std::size_t>(sq * T + i) * qw + h * hd;
          Vec dp(static_cast<std::size_t>(i) + 1);
          double mean = 0;
          const int lo = first_key(sq, i);
          for (int j = lo; j <= i; ++j) {
            const std::size_t kj = static_cast<std::size_t>(sq * T + j) * kw + (h / G) * hd;
            for (int e = 0; e < hd; ++e) dp[j] += dout[qi + e] * sv.v[kj + e];
            mean += p[j] * dp[j];
          }
          for (int j = lo; j <= i; ++j) {
            const std::size_t kj = static_cast<std::size_t>(sq * T + j) * kw + (h / G) * hd;
            const double ds = p[j] * (dp[j] - mean) * scale;
            for (int e = 0; e < hd; ++e) {
              dq[qi + e] += ds * sv.k[kj + e];
              dk[kj + e] += ds * sv.q[qi + e];
              dv[kj + e] += p[j] * dout[qi + e];
            }
          }
        }
    rope(dq, s, H, T, true, b.positions);
    rope(dk, s, K, T, true, b.positions);
    if (s.qk_norm) {
      Vec dq_in(dq.size(), 0.0), dk_in(dk.size(), 0.0);
      rms_norm_back(dq, sv.q_in, sv.rq, lw.q_norm, n * H, hd, dq_in, lg.q_norm);
      rms_norm_back(dk, sv.k_in, sv.rk, lw.k_norm, n * K, hd, dk_in, lg.k_norm);
      dq = std::move(dq_in);
      dk = std::move(dk_in);
    }
    Vec da(sv.a.size(), 0.0);
    linear_back(dq, lw.q, sv.a, n, qw, d, da, &lg.q, s.qkv_bias ? &lg.q_bias : nullptr);
    linear_back(dk, lw.k, sv.a, n, kw, d, da, &lg.k, s.qkv_bias ? &lg.k_bias : nullptr);
    linear_back(dv, lw.v, sv.a, n, kw, d, da, &lg.v, s.qkv_bias ? &lg.v_bias : nullptr);
    dx = dy;
    rms_norm_back(da, sv.x, sv.r1, lw.attn_norm, n, d, dx, lg.attn_norm);
  }
  for (int t = 0; t < n; ++t)
    for (int k = 0; k < d; ++k) g.embed[b.inputs[t] * d + k] += dx[t * d + k];
  return r;
}

// ---- random models and batches ----

// Round to the nearest bf16 / fp16 (ties to even), so host and device hold the same weights.
double round_to(DType t, double x) {
  if (t == DType::f16) {  // 11 significant bits, or multiples of 2^-24 below 2^-14
    if (std::fabs(x) < std::ldexp(1.0, -14)) return std::nearbyint(std::ldexp(x, 24)) / (1 << 24);
    int e = 0;
    const double m = std::frexp(x, &e);
    return std::ldexp(std::nearbyint(std::ldexp(m, 11)), e - 11);
  }
  float f = static_cast<float>(x);
  std::uint32_t u = 0;
  std::memcpy(&u, &f, 4);
  u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&f, &u, 4);
  return f;
}
// The bits of x, which is already a value of type t (round_to).
std::uint16_t bits_of(DType t, double x) {
  if (t == DType::bf16) {
    const float f = static_cast<float>(x);
    std::uint32_t u = 0;
    std::memcpy(&u, &f, 4);
    return static_cast<std::uint16_t>(u >> 16);
  }
  const std::uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  const double a = std::fabs(x);
  if (a < std::ldexp(1.0, -14))
    return static_cast<std::uint16_t>(sign | std::lround(std::ldexp(a, 24)));
  int e = 0;
  const double m = std::frexp(a, &e);  // a = m 2^e, m in [0.5, 1)
  const auto mantissa = static_cast<std::uint16_t>(std::lround((m * 2.0 - 1.0) * 1024.0));
  return static_cast<std::uint16_t>(sign | ((e - 1 + 15) << 10) | mantissa);
}
double value_of(DType t, std::uint16_t b) {
  if (t == DType::bf16) {
    const std::uint32_t u = static_cast<std::uint32_t>(b) << 16;
    float f = 0;
    std::memcpy(&f, &u, 4);
    return f;
  }
  const int exponent = (b >> 10) & 31, mantissa = b & 1023;
  const double v = exponent == 0 ? std::ldexp(mantissa, -24)
                                 : std::ldexp(1024 + mantissa, exponent - 25);
  return (b & 0x8000) ? -v : v;
}

// Weights of useful size: norms around 1, biases around 0, matrices that give attention
// scores of order 1 to a few (far from uniform) and unit-variance activations.
Params random_params(const DecoderShape& s, DType dtype, unsigned seed) {
  std::mt19937 rng(seed);
  Params p = zeros_like(s);
  for (const ParamSpec& spec : param_specs(s)) {
    const ParamKind kind = spec.id.kind;
    double lo = -1, hi = 1;
    const double fan_in = kind == ParamKind::o      ? static_cast<double>(s.q_width())
                          : kind == ParamKind::down ? s.intermediate
                                                    : s.hidden;
    if (kind == ParamKind::attn_norm || kind == ParamKind::mlp_norm ||
        kind == ParamKind::final_norm || kind == ParamKind::q_norm ||
        kind == ParamKind::k_norm) {
      lo = 0.7, hi = 1.3;
    } else if (kind == ParamKind::q_bias || kind == ParamKind::k_bias ||
               kind == ParamKind::v_bias) {
      lo = -0.5, hi = 0.5;
    } else if (kind != ParamKind::embed) {
      const double a = (kind == ParamKind::q || kind == ParamKind::k ? 2.0 : 1.7) /
                       std::sqrt(fan_in);
      lo = -a, hi = a;
    }
    std::uniform_real_distribution<double> u(lo, hi);
    for (double& v : param(p, spec.id)) v = round_to(dtype, u(rng));
  }
  return p;
}

Tokens random_tokens(const DecoderShape& s, int sequences, int seq_len, unsigned seed) {
  std::mt19937 rng(seed);
  // A small vocabulary slice repeats tokens (several positions per embedding row).
  std::uniform_int_distribution<int> u(0, s.vocab - 1);
  Tokens b{sequences, seq_len, {}, {}, {}};
  for (int i = 0; i < sequences * seq_len; ++i) {
    b.inputs.push_back(u(rng));
    b.targets.push_back(u(rng));
  }
  return b;
}

// ---- the device side ----

void cuda_ok(cudaError_t status, const char* what) {
  if (status != cudaSuccess)
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
}

struct DeviceBlock {
  void* p = nullptr;
  explicit DeviceBlock(std::size_t bytes) {
    cuda_ok(cudaMalloc(&p, std::max<std::size_t>(bytes, 1)), "cudaMalloc");
    cuda_ok(cudaMemset(p, 0, bytes), "cudaMemset");
  }
  DeviceBlock(const DeviceBlock&) = delete;
  DeviceBlock& operator=(const DeviceBlock&) = delete;
  ~DeviceBlock() { cudaFree(p); }
};

// The params as device bit16 tensors.
// The weights on the device, each param in a block of its own, or (packed) all in one block
// back to back in declaration order, each start 256-byte aligned, as an engine group holds them:
// the backend joins q|k|v and gate|up into one GEMM where they lie together, and must give the
// reference's results both ways.
struct DeviceParams {
  std::map<std::string, std::unique_ptr<DeviceBlock>> blocks;
  Weights w;
  DeviceParams(const DecoderShape& s, const Params& p, DType dtype, bool packed = false) {
    w.dtype = dtype;
    w.layers.resize(static_cast<std::size_t>(s.layers));
    const auto aligned = [](std::size_t bytes) { return (bytes + 255) / 256 * 256; };
    std::size_t total = 0;
    for (const ParamSpec& spec : param_specs(s)) total += aligned(param(p, spec.id).size() * 2);
    if (packed) blocks["all"] = std::make_unique<DeviceBlock>(total);
    std::size_t offset = 0;
    for (const ParamSpec& spec : param_specs(s)) {
      const Vec& v = param(p, spec.id);
      std::vector<std::uint16_t> bits(v.size());
      for (std::size_t i = 0; i < v.size(); ++i) bits[i] = bits_of(dtype, v[i]);
      void* at = nullptr;
      if (packed) {
        at = static_cast<std::byte*>(blocks["all"]->p) + offset;
        offset += aligned(bits.size() * 2);
      } else {
        auto block = std::make_unique<DeviceBlock>(bits.size() * 2);
        at = block->p;
        blocks[spec.name] = std::move(block);
      }
      cuda_ok(cudaMemcpy(at, bits.data(), bits.size() * 2, cudaMemcpyHostToDevice), "cudaMemcpy");
      const auto l = static_cast<std::size_t>(std::max(spec.id.layer, 0));
      switch (spec.id.kind) {
        case ParamKind::embed: w.embed = at; break;
        case ParamKind::final_norm: w.final_norm = at; break;
        case ParamKind::head: w.head = at; break;
        default: lm::dec::layer_weight(w.layers[l], spec.id.kind) = at; break;
      }
    }
    if (s.tied) w.head = w.embed;
  }
};

std::string name_of(const DecoderShape& s, ParamId id) {
  for (const ParamSpec& spec : param_specs(s))
    if (spec.id.kind == id.kind && spec.id.layer == id.layer) return spec.name;
  return "unknown param";
}

// Zeroed device slots for the params of the active groups; records every open and close and
// any misuse: a frozen param's slot asked for, a slot opened while another is open (the engine
// reduces a stage-2 bucket once backward moves on), opened twice (only a tied embedding is
// opened again: for its head gradient and for its lookup's), closed without being open.
class SlotSink final : public GradSink {
 public:
  SlotSink(const DecoderShape& s, std::set<int> active, DType dtype)
      : s_(s), active_(std::move(active)), dtype_(dtype) {
    for (const ParamSpec& spec : param_specs(s))
      if (active_.count(spec.group) != 0)
        slots_[spec.name] = std::make_unique<DeviceBlock>(spec.size * dtype_size(dtype));
  }
  bool active(int group) const override { return active_.count(group) != 0; }
  GradSlot open(ParamId id) override {
    const std::string name = name_of(s_, id);
    const auto slot = slots_.find(name);
    if (slot == slots_.end()) {
      problems.push_back("opened " + name + ", which has no slot (frozen)");
      return {};
    }
    if (!open_now_.empty()) problems.push_back("opened " + name + " while " + open_now_ + " is open");
    const bool again_allowed = s_.tied && id.kind == ParamKind::embed;
    if (opened.count(name) != 0 && !again_allowed) problems.push_back("opened " + name + " twice");
    opened.insert(name);
    open_now_ = name;
    return {slot->second->p, dtype_};
  }
  void close(ParamId id) override {
    const std::string name = name_of(s_, id);
    if (open_now_ != name) problems.push_back("closed " + name + ", which is not open");
    closed.insert(name);
    open_now_.clear();
  }
  Vec read(const std::string& name) const {
    const ParamSpec spec = spec_named(s_, name);
    Vec out(spec.size);
    if (dtype_ == DType::f32) {
      std::vector<float> f(spec.size);
      cuda_ok(cudaMemcpy(f.data(), slots_.at(name)->p, spec.size * 4, cudaMemcpyDeviceToHost),
              "cudaMemcpy");
      std::copy(f.begin(), f.end(), out.begin());
    } else {
      std::vector<std::uint16_t> b(spec.size);
      cuda_ok(cudaMemcpy(b.data(), slots_.at(name)->p, spec.size * 2, cudaMemcpyDeviceToHost),
              "cudaMemcpy");
      for (std::size_t i = 0; i < b.size(); ++i) out[i] = value_of(dtype_, b[i]);
    }
    return out;
  }
  std::vector<std::string> problems;
  std::set<std::string> opened, closed;

 private:
  DecoderShape s_;
  std::set<int> active_;
  DType dtype_;
  std::map<std::string, std::unique_ptr<DeviceBlock>> slots_;
  std::string open_now_;  // the slot open at the moment, if any
};

// ||got - want|| / ||want||; the absolute ||got|| where want is zero (e.g. q and k at one
// position per sequence, where attention is constant).
double normalized_error(const Vec& got, const Vec& want) {
  double diff = 0, norm = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    diff += (got[i] - want[i]) * (got[i] - want[i]);
    norm += want[i] * want[i];
  }
  return norm == 0 ? std::sqrt(diff) : std::sqrt(diff / norm);
}

struct Case {
  const char* label;
  DecoderShape shape;
  int max_sequences, seq_len;  // configured
  int sequences, batch_len;    // the batch (at most the configured)
  DType dtype = DType::bf16;
  DType slot_dtype = DType::f32;
};

DecoderShape small_shape() {
  DecoderShape s;
  s.vocab = 150;
  s.hidden = 64;
  s.intermediate = 96;
  s.layers = 2;
  s.heads = 4;
  s.kv_heads = 2;
  s.head_dim = 16;
  s.max_positions = 256;
  s.rms_eps = 1e-5;
  return s;
}

std::vector<Case> shape_cases() {
  std::vector<Case> cases;
  {  // Llama 3: GQA, llama3 RoPE scaling whose bands all occur at these positions
    Case c{"llama3 GQA, 3 x 17", small_shape(), 3, 17, 3, 17};
    c.shape.vocab = 302;  // two rounds of the cross-entropy's in-place gradient, a column a thread
    c.shape.rope_scaling = RopeScaling::llama3;
    c.shape.rope_factor = 8.0;
    c.shape.rope_original_max_positions = 32;
    cases.push_back(c);
  }
  {  // Qwen2: q/k/v biases, tied head, multi-head (K == H), head_dim 32 (one lane's worth)
    Case c{"qwen2 tied, K == H, 2 x 128", small_shape(), 2, 128, 2, 128};
    c.shape.family = DecoderFamily::qwen2;
    c.shape.vocab = 2100;  // three rounds of its in-place gradient, 4 columns a thread
    c.shape.qkv_bias = true;
    c.shape.tied = true;
    c.shape.kv_heads = 4;
    c.shape.head_dim = 32;
    c.shape.rope_theta = 1e6;
    cases.push_back(c);
  }
  {  // Qwen2 untied with one kv head, head_dim 80 (3 lanes), a batch below the configured size
    Case c{"qwen2 untied, K = 1, hd 80, 2 x 45 of 3 x 60", small_shape(), 3, 60, 2, 45};
    c.shape.qkv_bias = true;
    c.shape.heads = 2;
    c.shape.kv_heads = 1;
    c.shape.head_dim = 80;
    cases.push_back(c);
  }
  {  // Mistral-like with head_dim 128 (4 lanes, the limit), odd-sized heads of work
    Case c{"mistral hd 128, 3 x 33", small_shape(), 3, 33, 3, 33};
    c.shape.family = DecoderFamily::mistral;
    c.shape.heads = 2;
    c.shape.kv_heads = 2;
    c.shape.head_dim = 128;
    cases.push_back(c);
  }
  {  // one position per sequence, head_dim 12 (part of a lane row), fp16, bit16 slots; an
     // intermediate size that is not a multiple of 8 (SwiGLU one element a thread), a hidden
     // size that is not a multiple of 4 (the norms one column a lane; the other cases take 4)
    Case c{"fp16, 3 x 1, hd 12, D 66, I 90, fp16 slots", small_shape(), 3, 1, 3, 1, DType::f16,
           DType::f16};
    c.shape.hidden = 66;
    c.shape.intermediate = 90;
    c.shape.head_dim = 12;
    c.shape.heads = 6;
    c.shape.kv_heads = 3;
    cases.push_back(c);
  }
  {  // more token rows than one chunk of the cross-entropy (kCudaLossChunkRows)
    Case c{"llama, 5 x 256: two chunks of the loss's rows", small_shape(), 5, 256, 5, 256};
    static_assert(5 * 256 > kCudaLossChunkRows);
    cases.push_back(c);
  }
  {  // linear RoPE scaling, bf16 slots, more layers, head_dim 64 (2 lanes)
    Case c{"linear rope, 4 layers, hd 64, bf16 slots, 3 x 40", small_shape(), 3, 40, 3, 40,
           DType::bf16, DType::bf16};
    c.shape.layers = 4;
    c.shape.head_dim = 64;
    c.shape.rope_scaling = RopeScaling::linear;
    c.shape.rope_factor = 2.0;
    cases.push_back(c);
  }
  {  // Qwen3 (as Qwen3-0.6B): per-head q/k norms, no biases, tied, GQA, a head_dim (32) that is
     // not hidden / heads (16); the head norms a 4-pack on 8 lanes
    Case c{"qwen3 qk_norm tied, GQA, hd 32, 3 x 40", small_shape(), 3, 40, 3, 40};
    c.shape.family = DecoderFamily::qwen3;
    c.shape.qk_norm = true;
    c.shape.tied = true;
    c.shape.head_dim = 32;
    c.shape.rope_theta = 1e6;
    cases.push_back(c);
  }
  {  // Qwen3 untied with head_dim 128 (the head norms a 4-pack on every lane, attention's 4
     // lanes), bf16 slots, a batch below the configured size
    Case c{"qwen3 qk_norm untied, hd 128, bf16 slots, 2 x 30 of 3 x 33", small_shape(), 3, 33, 2,
           30, DType::bf16, DType::bf16};
    c.shape.family = DecoderFamily::qwen3;
    c.shape.qk_norm = true;
    c.shape.head_dim = 128;
    c.shape.rope_theta = 1e6;
    cases.push_back(c);
  }
  {  // Qwen3 in fp16 with head_dim 10 (not a multiple of 4: the head norms one value a lane),
     // one kv head, fp16 slots
    Case c{"qwen3 qk_norm fp16, K = 1, hd 10, fp16 slots, 2 x 24", small_shape(), 2, 24, 2, 24,
           DType::f16, DType::f16};
    c.shape.family = DecoderFamily::qwen3;
    c.shape.qk_norm = true;
    c.shape.kv_heads = 1;
    c.shape.head_dim = 10;
    cases.push_back(c);
  }
  return cases;
}

// The shape case whose label starts with `prefix`.
Case shape_case(const std::string& prefix) {
  for (const Case& c : shape_cases())
    if (std::string(c.label).rfind(prefix, 0) == 0) return c;
  FAIL("no shape case " << prefix);
  return {};
}

// GEMM inputs and attention operands are rounded to bit16 on the GPU (as in a bf16 model in
// transformers). Normalized (L2) errors against float64 measured on an H200 (these shapes and
// seeds): bf16 logits 4.8e-3 to 7.8e-3, gradients up to 1.8e-2 (2.3e-2 in the frozen cases);
// fp16 logits 4.3e-4, gradients 7.5e-4: the errors scale with the type's precision, a wrong
// formula gives order 1. The worst are k and its bias: softmax is invariant to a per-row shift of
// the scores, so k's bias gradient is what little RoPE leaves of a cancellation.
double grad_tolerance(DType dtype) {
  return dtype == DType::bf16 ? 3e-2 : 5e-3;
}
double logits_tolerance(DType dtype) {
  return dtype == DType::bf16 ? 1e-2 : 2e-3;
}

struct CudaRun {
  double loss = 0, eval_loss = 0;
  std::vector<float> logits;
  std::map<std::string, Vec> grads;
  std::vector<std::string> problems;
  std::set<std::string> opened;
};

CudaRun run_cuda(const Case& c, const Params& p, const Tokens& b, double grad_scale,
                 const std::set<int>& active, int recompute = 0, bool packed = false,
                 Precision precision = {}, Attention attention = Attention::automatic,
                 int loss_rows = 0, bool keep_norms = false) {
  const DeviceParams dev(c.shape, p, c.dtype, packed);
  const std::size_t bytes = cuda_bytes(c.shape, c.max_sequences, c.seq_len, recompute, loss_rows,
                                       keep_norms, precision.residual != DType::f32);
  DeviceBlock block(bytes);
  auto compute = make_cuda_compute(c.shape, c.max_sequences, c.seq_len, c.dtype, block.p, bytes,
                                   recompute, precision, attention, loss_rows, keep_norms);
  const Batch batch{b.sequences, b.seq_len, b.inputs.data(), b.targets.data(),
                    b.positions.empty() ? nullptr : b.positions.data()};
  SlotSink sink(c.shape, active, c.slot_dtype);
  CudaRun r;
  r.loss = compute->train_step(dev.w, batch, grad_scale, sink);
  for (const ParamSpec& spec : param_specs(c.shape))
    if (active.count(spec.group) != 0) r.grads[spec.name] = sink.read(spec.name);
  r.problems = sink.problems;
  r.opened = sink.opened;
  if (sink.opened != sink.closed) r.problems.push_back("an opened slot was not closed");
  r.eval_loss = compute->loss(dev.w, batch);
  r.logits.resize(static_cast<std::size_t>(b.sequences) * b.seq_len * c.shape.vocab);
  compute->logits(dev.w, batch, r.logits.data());
  return r;
}

// `got` ran cleanly and is `want` to the bit: loss, eval loss, logits, the slots it opened and
// every gradient.
void require_same_bits(const CudaRun& got, const CudaRun& want) {
  CAPTURE(got.problems);
  REQUIRE(got.problems.empty());
  REQUIRE(got.loss == want.loss);
  REQUIRE(got.eval_loss == want.eval_loss);
  REQUIRE(got.logits == want.logits);
  REQUIRE(got.opened == want.opened);
  REQUIRE(got.grads == want.grads);
}

std::set<int> all_groups(const DecoderShape& s) {
  std::set<int> g;
  for (int i = 0; i <= s.layers + 1; ++i) g.insert(i);
  return g;
}

constexpr double kGradScale = 2.5;

// Case c's weights and batch at the seeds the float64-reference cases share, and the
// reference's logits, loss and gradients for them.
struct Referenced {
  Params p;
  Tokens b;
  RefResult ref;
};
Referenced referenced(const Case& c) {
  Referenced r{random_params(c.shape, c.dtype, 11),
               random_tokens(c.shape, c.sequences, c.batch_len, 12), {}};
  r.ref = reference(c.shape, r.p, r.b, kGradScale);
  return r;
}

// Every param's gradient within the dtype's tolerance of the reference's (each REQUIREd, named);
// the worst normalized error and its param, for the case's printed line.
std::pair<double, std::string> require_grads_near(const Case& c, const CudaRun& got,
                                                  const RefResult& ref) {
  std::pair<double, std::string> worst{0.0, ""};
  for (const ParamSpec& spec : param_specs(c.shape)) {
    const double err = normalized_error(got.grads.at(spec.name), param(ref.grads, spec.id));
    CAPTURE(spec.name, err);
    REQUIRE(err < grad_tolerance(c.dtype));
    if (err > worst.first) worst = {err, spec.name};
  }
  return worst;
}

// The backend's kernels (and the cuBLAS kernels for its GEMMs) load into device memory on first
// use and stay until the process ends (2 MiB on an H200): load them before the first test case,
// so that the suite's per-test-case check of free device memory sees only what tests allocate.
using test::ListenerBase;
struct DecoderKernelWarmUp : ListenerBase {
  using ListenerBase::ListenerBase;
  void testRunStarting(Catch::TestRunInfo const& info) override {
    ListenerBase::testRunStarting(info);
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) return;
    try {
      for (const Case& c : shape_cases()) {  // every dtype, slot type and head_dim class
        const DeviceParams dev(c.shape, random_params(c.shape, c.dtype, 1), c.dtype);
        const std::size_t bytes = cuda_bytes(c.shape, c.max_sequences, c.seq_len);
        const DeviceBlock block(bytes);
        auto compute =
            make_cuda_compute(c.shape, c.max_sequences, c.seq_len, c.dtype, block.p, bytes);
        const Tokens b = random_tokens(c.shape, c.sequences, c.batch_len, 2);
        const Batch batch{b.sequences, b.seq_len, b.inputs.data(), b.targets.data(), nullptr};
        SlotSink sink(c.shape, all_groups(c.shape), c.slot_dtype);
        compute->train_step(dev.w, batch, 1.0, sink);
      }
    } catch (const std::exception& e) {
      std::printf("decoder warm-up failed (the test cases will say why): %s\n", e.what());
    }
  }
};

}  // namespace

CATCH_REGISTER_LISTENER(DecoderKernelWarmUp)

TEST_CASE("decoder reference: its gradients match finite differences of its loss",
          "[decoder][gpu]") {
  struct Variant {
    bool tied, qk_norm;
  };
  for (const Variant variant :
       {Variant{false, false}, Variant{true, false}, Variant{false, true}}) {
    const bool tied = variant.tied, qk_norm = variant.qk_norm;
    DecoderShape s;
    s.vocab = 11;
    s.hidden = 8;
    s.intermediate = 12;
    s.layers = 2;
    s.heads = 4;
    s.kv_heads = 2;
    s.head_dim = qk_norm ? 6 : 4;  // Qwen3's: not hidden / heads
    s.qkv_bias = !qk_norm;         // (Qwen3 has none; the CUDA backend refuses both)
    s.qk_norm = qk_norm;
    if (qk_norm) s.family = DecoderFamily::qwen3;
    s.tied = tied;
    s.rope_scaling = RopeScaling::llama3;
    s.rope_factor = 4.0;
    s.rope_original_max_positions = 8;
    Params p = random_params(s, DType::bf16, 7);
    const Tokens b = random_tokens(s, 2, 5, 8);
    const RefResult r = reference(s, p, b, 1.0);
    std::mt19937 rng(9);
    double worst = 0;
    for (const ParamSpec& spec : param_specs(s)) {
      Vec& v = param(p, spec.id);
      const Vec& g = param(r.grads, spec.id);
      for (int trial = 0; trial < 4; ++trial) {
        const std::size_t i = std::uniform_int_distribution<std::size_t>(0, v.size() - 1)(rng);
        const double keep = v[i], h = 1e-5;
        v[i] = keep + h;
        const double up = reference(s, p, b, 1.0).loss;
        v[i] = keep - h;
        const double down = reference(s, p, b, 1.0).loss;
        v[i] = keep;
        const double fd = (up - down) / (2 * h);
        const double err = std::fabs(fd - g[i]) / std::max(1e-3, std::fabs(fd));
        CAPTURE(spec.name, i, fd, g[i]);
        REQUIRE(err < 1e-5);
        worst = std::max(worst, err);
      }
    }
    std::printf(
        "decoder reference (tied %d, qk_norm %d): worst relative finite-difference error %.2e\n",
        tied, qk_norm, worst);
  }
}

TEST_CASE("cuda decoder: logits, loss and every gradient match the float64 reference",
          "[decoder][gpu]") {
  for (const Case& c : shape_cases()) for (const bool packed : {false, true}) {
    CAPTURE(c.label, packed);
    const auto [p, b, ref] = referenced(c);
    const CudaRun got = run_cuda(c, p, b, kGradScale, all_groups(c.shape), 0, packed);
    CAPTURE(got.problems);
    REQUIRE(got.problems.empty());
    const double loss_error = std::fabs(got.loss - ref.loss) / ref.loss;
    const double logits_error =
        normalized_error(Vec(got.logits.begin(), got.logits.end()), ref.logits);
    const auto [worst, worst_name] = require_grads_near(c, got, ref);
    std::printf(
        "cuda decoder %s%s: loss error %.2e, logits error %.2e, worst gradient error %.2e (%s)\n",
        c.label, packed ? " (weights packed)" : "", loss_error, logits_error, worst,
        worst_name.c_str());
    REQUIRE(got.opened.size() == param_specs(c.shape).size());
    REQUIRE(loss_error < logits_tolerance(c.dtype));
    REQUIRE(got.eval_loss == got.loss);  // loss() runs the same forward
    REQUIRE(logits_error < logits_tolerance(c.dtype));
  }
}

// model.bit16_logits: the head's GEMM writes its logits in the weights' dtype and the
// cross-entropy reads them. The logits it hands out are values of that dtype, its loss is the
// float64 cross-entropy of them, and logits and gradients stay within the float64 reference's
// tolerances (the reference keeps exact logits).
TEST_CASE("cuda decoder: bit16 logits are the loss's logits and stay within the float64 "
          "reference's tolerances",
          "[decoder][gpu]") {
  for (const Case& c : shape_cases()) {
    CAPTURE(c.label);
    const auto [p, b, ref] = referenced(c);
    const CudaRun got =
        run_cuda(c, p, b, kGradScale, all_groups(c.shape), 0, false, {.logits = c.dtype});
    CAPTURE(got.problems);
    REQUIRE(got.problems.empty());
    const auto v = static_cast<std::size_t>(c.shape.vocab);
    const std::size_t rows = got.logits.size() / v;
    for (const float z : got.logits)
      REQUIRE(value_of(c.dtype, bits_of(c.dtype, z)) == static_cast<double>(z));
    const double want =
        test_support::decoder_mean_cross_entropy(got.logits.data(), rows, v, b.targets.data());
    CAPTURE(got.loss, want, ref.loss);
    REQUIRE(std::fabs(got.loss - want) / want < 1e-5);
    REQUIRE(std::fabs(got.loss - ref.loss) / ref.loss < logits_tolerance(c.dtype));
    REQUIRE(normalized_error(Vec(got.logits.begin(), got.logits.end()), ref.logits) <
            logits_tolerance(c.dtype));
    const double worst = require_grads_near(c, got, ref).first;
    std::printf("cuda decoder %s, bit16 logits: loss error %.2e, worst gradient error %.2e\n",
                c.label, std::fabs(got.loss - ref.loss) / ref.loss, worst);
  }
}

// model.bit16_swiglu_grad: the down projection's input-gradient GEMM writes the gradient at
// SwiGLU's output in the weights' dtype and SwiGLU's backward reads it. The forward is the
// default's (the same loss, to the bit); every gradient stays within the float64 reference's
// tolerances, and some move.
TEST_CASE("cuda decoder: a bit16 SwiGLU gradient keeps the loss and stays within the float64 "
          "reference's tolerances",
          "[decoder][gpu]") {
  for (const Case& c : shape_cases()) {
    CAPTURE(c.label);
    const auto [p, b, ref] = referenced(c);
    const CudaRun fp32 = run_cuda(c, p, b, kGradScale, all_groups(c.shape));
    const CudaRun got =
        run_cuda(c, p, b, kGradScale, all_groups(c.shape), 0, false, {.swiglu_grad = c.dtype});
    CAPTURE(got.problems);
    REQUIRE(got.problems.empty());
    REQUIRE(got.loss == fp32.loss);
    const double worst = require_grads_near(c, got, ref).first;
    bool moved = false;
    for (const auto& [name, g] : got.grads) moved = moved || g != fp32.grads.at(name);
    REQUIRE(moved);
    std::printf("cuda decoder %s, bit16 SwiGLU gradient: worst gradient error %.2e\n", c.label,
                worst);
  }
}

// model.bit16_residual: the residual stream (each layer's input and post-attention sums, the o
// and down projections' products written into them), the gradient at each norm's output and the
// stream's gradient are kept in the weights' dtype. The loss and every gradient move, and stay
// within the float64 reference's tolerances; recomputed layers (which start again from the kept
// T inputs) give the same bits, with every group and with LISA's top layer and head alone.
TEST_CASE("cuda decoder: a bit16 residual stream stays within the float64 reference's "
          "tolerances, and recomputed layers keep its bits",
          "[decoder][gpu]") {
  for (const Case& c : shape_cases()) {
    CAPTURE(c.label);
    const auto [p, b, ref] = referenced(c);
    const Precision bit16{.residual = c.dtype};
    const CudaRun fp32 = run_cuda(c, p, b, kGradScale, all_groups(c.shape));
    const CudaRun got = run_cuda(c, p, b, kGradScale, all_groups(c.shape), 0, false, bit16);
    CAPTURE(got.problems);
    REQUIRE(got.problems.empty());
    const double loss_error = std::fabs(got.loss - ref.loss) / ref.loss;
    const double logits_error =
        normalized_error(Vec(got.logits.begin(), got.logits.end()), ref.logits);
    std::printf("cuda decoder %s, bit16 residual: loss error %.2e (fp32 stream %.2e), logits "
                "error %.2e\n",
                c.label, loss_error, std::fabs(fp32.loss - ref.loss) / ref.loss, logits_error);
    const auto [worst, worst_name] = require_grads_near(c, got, ref);
    std::printf("cuda decoder %s, bit16 residual: worst gradient error %.2e (%s)\n", c.label,
                worst, worst_name.c_str());
    // The stream's roundings (2^-9 relative in bf16, two sums a layer) add up along the layers:
    // the bf16 logits' error reached 1.06e-2 at the 4-layer case (an NVIDIA H100, 2026-12-05),
    // over the fp32 stream's bound of 1e-2; twice that is this option's bound. fp16's (6.6e-4)
    // stays within the default's.
    const double logits_bound = c.dtype == DType::bf16 ? 2e-2 : logits_tolerance(c.dtype);
    REQUIRE(loss_error < logits_tolerance(c.dtype));
    REQUIRE(logits_error < logits_bound);
    REQUIRE(got.eval_loss == got.loss);  // loss() runs the same forward
    REQUIRE(got.loss != fp32.loss);
    bool moved = false;
    for (const auto& [name, g] : got.grads) moved = moved || g != fp32.grads.at(name);
    REQUIRE(moved);
    const int L = c.shape.layers;
    for (const std::set<int>& active : {all_groups(c.shape), std::set<int>{L, L + 1}}) {
      CAPTURE(std::vector<int>(active.begin(), active.end()));
      require_same_bits(run_cuda(c, p, b, kGradScale, active, L, false, bit16),
                        run_cuda(c, p, b, kGradScale, active, 0, false, bit16));
    }
  }
}

// model.attention: the own kernels at every shape, and cuDNN's atomic backward wherever cuDNN
// runs, stay within the float64 reference's tolerances as the default (cuDNN's deterministic
// backward where it runs) does.
TEST_CASE("cuda decoder: each model.attention stays within the float64 reference's tolerances",
          "[decoder][gpu]") {
  for (const Case& c : shape_cases())
    for (const Attention a : {Attention::own, Attention::cudnn_atomic}) {
      if (a == Attention::cudnn_atomic && cuda_attention(c.shape) != Attention::cudnn) continue;
      CAPTURE(c.label, attention_key_value(a));
      const auto [p, b, ref] = referenced(c);
      const CudaRun got = run_cuda(c, p, b, kGradScale, all_groups(c.shape), 0, false, {}, a);
      CAPTURE(got.problems);
      REQUIRE(got.problems.empty());
      const double loss_error = std::fabs(got.loss - ref.loss) / ref.loss;
      REQUIRE(loss_error < logits_tolerance(c.dtype));
      REQUIRE(normalized_error(Vec(got.logits.begin(), got.logits.end()), ref.logits) <
              logits_tolerance(c.dtype));
      const auto [worst, worst_name] = require_grads_near(c, got, ref);
      std::printf("cuda decoder %s, model.attention = %s: loss error %.2e, worst gradient error "
                  "%.2e (%s)\n",
                  c.label, attention_key_value(a), loss_error, worst, worst_name.c_str());
    }
}

// model.loss_chunk_rows: chunks of 64 rows and one chunk of the whole batch give the default's
// loss and logits up to summation order, and with fp32 slots an untied head's gradient too: its
// inputs are the same rows, only grouped into other GEMMs. The other gradients are checked against
// the float64 reference alone: cuBLAS may pick another kernel for another row count, and the hidden
// state's gradient it sums in another order is rounded to bf16 before the layers' backward, so
// one-ulp flips spread through them (up to 5.0e-3 apart from the default's on an H200,
// 2026-12-05). The block is sized for the chunk, the batch's tokens at most.
TEST_CASE("cuda decoder: the loss's chunk of rows changes the block's bytes, not the loss or the "
          "gradients",
          "[decoder][gpu]") {
  for (const Case& c : shape_cases()) {
    CAPTURE(c.label);
    const auto [p, b, ref] = referenced(c);
    const CudaRun plain = run_cuda(c, p, b, kGradScale, all_groups(c.shape));
    const int tokens = c.max_sequences * c.seq_len;
    CHECK(cuda_bytes(c.shape, c.max_sequences, c.seq_len, 0, 64) <=
          cuda_bytes(c.shape, c.max_sequences, c.seq_len));
    CHECK(cuda_bytes(c.shape, c.max_sequences, c.seq_len, 0, tokens) ==
          cuda_bytes(c.shape, c.max_sequences, c.seq_len, 0, tokens + 1000));
    for (const int rows : {64, tokens}) {
      CAPTURE(rows);
      const CudaRun got =
          run_cuda(c, p, b, kGradScale, all_groups(c.shape), 0, false, {}, {}, rows);
      CAPTURE(got.problems);
      REQUIRE(got.problems.empty());
      REQUIRE(std::fabs(got.loss - plain.loss) < 1e-5 * plain.loss);
      REQUIRE(normalized_error(Vec(got.logits.begin(), got.logits.end()),
                               Vec(plain.logits.begin(), plain.logits.end())) < 1e-5);
      if (c.slot_dtype == DType::f32 && !c.shape.tied)  // bit16 slots round each chunk's sum
        REQUIRE(normalized_error(got.grads.at("head"), plain.grads.at("head")) < 1e-5);
      require_grads_near(c, got, ref);
    }
  }
}

TEST_CASE("cuda decoder: ignored targets add nothing, the loss and gradients are the reference's "
          "mean over the others",
          "[decoder][gpu]") {
  Case c{"masked", small_shape(), 2, 20, 2, 20};
  c.shape.qkv_bias = true;
  Params p = random_params(c.shape, c.dtype, 31);
  Tokens b = random_tokens(c.shape, c.sequences, c.batch_len, 32);
  for (std::size_t i = 0; i < b.targets.size(); ++i)
    if ((i / 3) % 2 == 0) b.targets[i] = lm::dec::kIgnoredTarget;
  const RefResult ref = reference(c.shape, p, b, kGradScale);
  const CudaRun got = run_cuda(c, p, b, kGradScale, all_groups(c.shape));
  CAPTURE(got.problems);
  REQUIRE(got.problems.empty());
  const double loss_error = std::fabs(got.loss - ref.loss) / ref.loss;
  const double worst = require_grads_near(c, got, ref).first;
  std::printf("cuda decoder, half the targets ignored: loss error %.2e, worst gradient error %.2e\n",
              loss_error, worst);
  REQUIRE(loss_error < logits_tolerance(c.dtype));
  REQUIRE(got.eval_loss == got.loss);
  // Every target ignored: loss 0 and no gradient.
  for (auto& t : b.targets) t = lm::dec::kIgnoredTarget;
  const CudaRun none = run_cuda(c, p, b, kGradScale, all_groups(c.shape));
  REQUIRE(none.problems.empty());
  REQUIRE(none.loss == 0.0);
  for (const ParamSpec& spec : param_specs(c.shape))
    for (const double g : none.grads.at(spec.name)) REQUIRE(g == 0.0);
}

// Documents apart: every attention within the float64 reference's tolerances. With
// model.attention "auto" (where the build and shape have cuDNN: cuda_apart_through_cudnn),
// "cudnn" or "cudnn-atomic" the documents go to cuDNN in padded calls of length classes
// (tools/model/apart_calls.h): rows of 70 tokens make classes of 64 and 70; these small shapes'
// act and dact scratch holds 152 (qwen2), 76 (qwen3) and 203 (fp16) padded rows, so most calls
// hold one or two documents and a class takes several calls.
std::vector<Case> apart_cases() {
  Case qwen2{"documents apart, qwen2", small_shape(), 3, 70, 3, 70};
  qwen2.shape.qkv_bias = true;
  Case qwen3{"documents apart, qwen3", small_shape(), 3, 70, 2, 64};
  qwen3.shape.family = DecoderFamily::qwen3;
  qwen3.shape.qk_norm = true;
  qwen3.shape.head_dim = 32;
  Case fp16{"documents apart, fp16, whole rows among them", small_shape(), 4, 70, 4, 70};
  fp16.dtype = DType::f16;
  return {qwen2, qwen3, fp16};
}

// Rows cut into documents of 1 to `longest` tokens (a row's first token starts one), and with
// `whole`, the last row one document.
void cut_into_documents(Tokens& b, int longest, bool whole, std::mt19937& rng) {
  b.positions.clear();
  for (int r = 0; r < b.sequences; ++r)
    for (int col = 0, pos = 0; col < b.seq_len; ++col, ++pos) {
      const bool last_whole = whole && r == b.sequences - 1;
      if (col > 0 && !last_whole &&
          (rng() % 12 == 0 || pos == longest)) pos = 0;
      b.positions.push_back(pos);
    }
}

TEST_CASE("cuda decoder: documents apart, as positions cut the rows, match the float64 reference",
          "[decoder][gpu]") {
  unsigned seed = 41;
  for (const Case& c : apart_cases()) {
    CAPTURE(c.label);
    Params p = random_params(c.shape, c.dtype, seed++);
    Tokens b = random_tokens(c.shape, c.sequences, c.batch_len, seed++);
    std::mt19937 rng(seed++);
    const bool fp16 = c.dtype == DType::f16;
    cut_into_documents(b, fp16 ? 70 : 40, fp16, rng);
    const RefResult ref = reference(c.shape, p, b, kGradScale);
    Tokens joined = b;
    joined.positions.clear();
    // The positions matter: without them the same tokens give other logits.
    REQUIRE(normalized_error(reference(c.shape, p, joined, kGradScale).logits, ref.logits) > 1e-2);
    const bool cudnn = cuda_attention(c.shape) == Attention::cudnn;
    std::map<Attention, CudaRun> runs;
    for (const Attention a :
         {Attention::automatic, Attention::own, Attention::cudnn, Attention::cudnn_atomic}) {
      if (a != Attention::automatic && a != Attention::own && !cudnn) continue;
      CAPTURE(attention_key_value(a));
      const CudaRun got =
          run_cuda(c, p, b, kGradScale, all_groups(c.shape), 0, false, {}, a);
      CAPTURE(got.problems);
      REQUIRE(got.problems.empty());
      const double loss_error = std::fabs(got.loss - ref.loss) / ref.loss;
      const double logits_error =
          normalized_error(Vec(got.logits.begin(), got.logits.end()), ref.logits);
      const double worst = require_grads_near(c, got, ref).first;
      std::printf("cuda decoder %s, model.attention = %s: loss error %.2e, logits error %.2e, "
                  "worst gradient error %.2e\n",
                  c.label, attention_key_value(a), loss_error, logits_error, worst);
      REQUIRE(loss_error < logits_tolerance(c.dtype));
      REQUIRE(logits_error < logits_tolerance(c.dtype));
      REQUIRE(got.eval_loss == got.loss);
      runs.emplace(a, got);
    }
    // "auto" is "cudnn" for documents apart, to the bit, where the build and shape have cuDNN
    // (else the own kernels); "cudnn" took the documents (its dq, dk, dv are rounded where the
    // own kernels' are fp32: other bits), not the own kernels behind its name.
    require_same_bits(runs.at(Attention::automatic),
                      runs.at(cudnn ? Attention::cudnn : Attention::own));
    if (cudnn) {
      REQUIRE(cuda_apart_through_cudnn(c.shape, c.max_sequences, c.seq_len, Attention::cudnn));
      REQUIRE(runs.at(Attention::cudnn).grads != runs.at(Attention::own).grads);
    }
    // A batch without positions after one with them: the backend's own state follows the batch.
    const CudaRun plain = run_cuda(c, p, joined, kGradScale, all_groups(c.shape));
    REQUIRE(normalized_error(Vec(plain.logits.begin(), plain.logits.end()),
                             reference(c.shape, p, joined, kGradScale).logits) <
            logits_tolerance(c.dtype));
  }
}

// cuDNN's padded calls live in the act and dact scratch while attention runs, which a
// recomputed layer's forward (at the start of its backward) reaches too: documents apart through
// cuDNN give the same bits twice, and with every layer recomputed.
TEST_CASE("cuda decoder: documents apart through cuDNN give the same bits twice and recomputed",
          "[decoder][gpu]") {
  unsigned seed = 61;
  for (const Case& c : apart_cases()) {
    if (cuda_attention(c.shape) != Attention::cudnn) continue;
    CAPTURE(c.label);
    const Params p = random_params(c.shape, c.dtype, seed++);
    Tokens b = random_tokens(c.shape, c.sequences, c.batch_len, seed++);
    std::mt19937 rng(seed++);
    cut_into_documents(b, 70, true, rng);
    const auto run = [&](int recompute) {
      return run_cuda(c, p, b, kGradScale, all_groups(c.shape), recompute, false, {},
                      Attention::cudnn);
    };
    const CudaRun first = run(0);
    REQUIRE(first.problems.empty());
    require_same_bits(run(0), first);
    require_same_bits(run(c.shape.layers), first);
  }
}

TEST_CASE("cuda decoder: frozen groups open no slot, the active ones get the reference's",
          "[decoder][gpu]") {
  for (int variant = 0; variant < 4; ++variant) {
    const bool tied = variant % 2 == 1, qk_norm = variant >= 2;
    Case c{"frozen", small_shape(), 2, 20, 2, 20};
    c.shape.layers = 3;
    c.shape.tied = tied;
    c.shape.qkv_bias = !qk_norm;  // Qwen2's biases or Qwen3's head norms
    c.shape.qk_norm = qk_norm;
    Params p = random_params(c.shape, c.dtype, 21);
    const Tokens b = random_tokens(c.shape, c.sequences, c.batch_len, 22);
    const RefResult ref = reference(c.shape, p, b, kGradScale);
    const int head = c.shape.layers + 1;
    for (const std::set<int>& active : {std::set<int>{head}, std::set<int>{2}, std::set<int>{0},
                                        std::set<int>{1, head}, std::set<int>{}}) {
      CAPTURE(tied, qk_norm, std::vector<int>(active.begin(), active.end()));
      const CudaRun got = run_cuda(c, p, b, kGradScale, active);
      CAPTURE(got.problems);
      REQUIRE(got.problems.empty());
      std::set<std::string> expected;
      for (const ParamSpec& spec : param_specs(c.shape))
        if (active.count(spec.group) != 0) expected.insert(spec.name);
      REQUIRE(got.opened == expected);
      for (const std::string& name : expected) {
        CAPTURE(name);
        REQUIRE(normalized_error(got.grads.at(name), param(ref.grads, spec_named(c.shape, name).id)) <
                grad_tolerance(c.dtype));
      }
      REQUIRE(std::fabs(got.loss - ref.loss) / ref.loss < logits_tolerance(c.dtype));
    }
  }
}

TEST_CASE("cuda decoder: two runs from the same weights and tokens give the same bits",
          "[decoder][gpu]") {
  // Biases, tied, 128 positions: every kernel but the head norms; and those.
  for (const Case& c : {shape_cases()[1], shape_case("qwen3 qk_norm tied")}) {
    CAPTURE(c.label);
    Params p = random_params(c.shape, c.dtype, 31);
    const Tokens b = random_tokens(c.shape, c.sequences, c.batch_len, 32);
    const CudaRun first = run_cuda(c, p, b, kGradScale, all_groups(c.shape));
    const CudaRun second = run_cuda(c, p, b, kGradScale, all_groups(c.shape));
    REQUIRE(first.problems.empty());
    require_same_bits(second, first);
  }
}

TEST_CASE("cuda decoder: recomputed layers give the same bits in fewer bytes",
          "[decoder][gpu]") {
  for (const Case& c : shape_cases()) {
    CAPTURE(c.label);
    const Params p = random_params(c.shape, c.dtype, 51);
    const Tokens b = random_tokens(c.shape, c.sequences, c.batch_len, 52);
    const int L = c.shape.layers, head = L + 1;
    // Every group; and LISA's embed + head + top layer (backward through every layer, gradients
    // for few).
    for (const std::set<int>& active : {all_groups(c.shape), std::set<int>{0, L, head}}) {
      CAPTURE(std::vector<int>(active.begin(), active.end()));
      const CudaRun kept = run_cuda(c, p, b, kGradScale, active);
      REQUIRE(kept.problems.empty());
      const std::size_t all_kept = cuda_bytes(c.shape, c.max_sequences, c.seq_len);
      for (int r = 1; r <= L; ++r) {
        CAPTURE(r);
        require_same_bits(run_cuda(c, p, b, kGradScale, active, r), kept);
        // r layers share one slot: r - 1 layers' activations fewer.
        const std::size_t bytes = cuda_bytes(c.shape, c.max_sequences, c.seq_len, r);
        if (r == 1)
          REQUIRE(bytes == all_kept);
        else
          REQUIRE(bytes < cuda_bytes(c.shape, c.max_sequences, c.seq_len, r - 1));
      }
    }
  }
}

// model.keep_norm_outputs: the norms' outputs kept from forward are the ones backward made again,
// so every bit is the same, with every group and with LISA's, alone and beside recomputed
// layers (whose shared slot then holds them too); the block grows by 2 tokens x hidden values
// a kept slot.
TEST_CASE("cuda decoder: kept norm outputs give the same bits in their own bytes",
          "[decoder][gpu]") {
  for (const Case& c : shape_cases()) {
    CAPTURE(c.label);
    const Params p = random_params(c.shape, c.dtype, 61);
    const Tokens b = random_tokens(c.shape, c.sequences, c.batch_len, 62);
    const int L = c.shape.layers, head = L + 1;
    for (const std::set<int>& active : {all_groups(c.shape), std::set<int>{0, L, head}}) {
      CAPTURE(std::vector<int>(active.begin(), active.end()));
      for (const int recompute : {0, L}) {
        CAPTURE(recompute);
        const CudaRun made = run_cuda(c, p, b, kGradScale, active, recompute);
        require_same_bits(
            run_cuda(c, p, b, kGradScale, active, recompute, false, {}, {}, 0, true), made);
        const std::size_t slots = cuda_kept_slots(L, recompute);
        const std::size_t norms = slots * 2 * static_cast<std::size_t>(c.max_sequences) *
                                  c.seq_len * c.shape.hidden * dtype_size(c.dtype);
        const std::size_t more =
            cuda_bytes(c.shape, c.max_sequences, c.seq_len, recompute, 0, true) -
            cuda_bytes(c.shape, c.max_sequences, c.seq_len, recompute);
        REQUIRE(more >= norms);
        REQUIRE(more < norms + 256);  // the region's rounding to 256 bytes
      }
    }
  }
}

// Hands each layer's weights out through one device window: copied in at acquire, set to 0xFF
// (NaN) at release, both queued on the model's stream, so work the backend queued on a layer
// after its release reads NaN instead of the weights.
class WindowSource final : public lm::dec::WeightSource {
 public:
  WindowSource(const DecoderShape& s, const DeviceParams& dev, DType dtype)
      : dev_(dev), tied_(s.tied) {
    std::size_t layer = 0, head = 0;
    for (const ParamSpec& spec : param_specs(s)) {
      sizes_[spec.id.kind] = spec.size * dtype_size(dtype);
      if (spec.id.layer == 0) {
        offsets_[spec.id.kind] = layer;
        layer += (spec.size * dtype_size(dtype) + 255) / 256 * 256;
      }
      if (spec.id.kind == ParamKind::embed) embed_bytes_ = spec.size * dtype_size(dtype);
      if (spec.id.kind == ParamKind::final_norm) norm_bytes_ = (spec.size * 2 + 255) / 256 * 256;
    }
    head = norm_bytes_ + embed_bytes_;  // the head matrix is the embedding's size
    bytes_ = std::max({layer, embed_bytes_, head});
    window_ = std::make_unique<DeviceBlock>(bytes_);
  }
  const void* acquire_embed() override {
    calls.push_back(-1);
    return copy_in(0, dev_.w.embed, embed_bytes_);
  }
  void release_embed() override { poison(); }
  lm::dec::HeadWeights acquire_head() override {
    calls.push_back(-2);
    const void* norm = copy_in(0, dev_.w.final_norm, sizes_.at(ParamKind::final_norm));
    return {norm, copy_in(norm_bytes_, tied_ ? dev_.w.embed : dev_.w.head, embed_bytes_)};
  }
  void release_head() override { poison(); }
  lm::dec::LayerWeights acquire(int l) override {
    calls.push_back(l);
    const lm::dec::LayerWeights& from = dev_.w.layers[static_cast<std::size_t>(l)];
    lm::dec::LayerWeights to;
    const auto copy = [&](const void* p, ParamKind kind) -> const void* {
      if (p == nullptr) return nullptr;
      void* at = static_cast<std::byte*>(window_->p) + offsets_.at(kind);
      cuda_ok(cudaMemcpyAsync(at, p, sizes_.at(kind), cudaMemcpyDeviceToDevice,
                              cudaStreamPerThread),
              "cudaMemcpyAsync");
      return at;
    };
    lm::dec::LayerWeights source = from;
    for (const ParamKind kind : lm::dec::kLayerKinds)
      lm::dec::layer_weight(to, kind) = copy(lm::dec::layer_weight(source, kind), kind);
    return to;
  }
  void release(int) override { poison(); }
  std::vector<int> calls;  // layers, -1 the embedding, -2 the head

 private:
  const void* copy_in(std::size_t offset, const void* from, std::size_t bytes) {
    void* at = static_cast<std::byte*>(window_->p) + offset;
    cuda_ok(cudaMemcpyAsync(at, from, bytes, cudaMemcpyDeviceToDevice, cudaStreamPerThread),
            "cudaMemcpyAsync");
    return at;
  }
  void poison() {
    cuda_ok(cudaMemsetAsync(window_->p, 0xFF, bytes_, cudaStreamPerThread), "cudaMemsetAsync");
  }
  const DeviceParams& dev_;
  bool tied_;
  std::size_t embed_bytes_ = 0, norm_bytes_ = 0;
  std::map<ParamKind, std::size_t> offsets_, sizes_;
  std::unique_ptr<DeviceBlock> window_;
  std::size_t bytes_ = 0;
};

TEST_CASE("cuda decoder: weights handed out a part at a time by a weight source give the same bits",
          "[decoder][gpu]") {
  for (const Case& c : shape_cases()) {
    CAPTURE(c.label);
    const Params p = random_params(c.shape, c.dtype, 61);
    const Tokens b = random_tokens(c.shape, c.sequences, c.batch_len, 62);
    const int L = c.shape.layers, head = L + 1;
    const DeviceParams dev(c.shape, p, c.dtype);
    const Batch batch{b.sequences, b.seq_len, b.inputs.data(), b.targets.data(),
                      b.positions.empty() ? nullptr : b.positions.data()};
    for (int recompute : {0, L}) {
      for (const std::set<int>& active : {all_groups(c.shape), std::set<int>{0, L, head}}) {
        CAPTURE(recompute, std::vector<int>(active.begin(), active.end()));
        const std::size_t bytes = cuda_bytes(c.shape, c.max_sequences, c.seq_len, recompute);
        DeviceBlock block(bytes);
        auto compute = make_cuda_compute(c.shape, c.max_sequences, c.seq_len, c.dtype, block.p,
                                         bytes, recompute);
        SlotSink want(c.shape, active, c.slot_dtype);
        const double loss = compute->train_step(dev.w, batch, kGradScale, want);
        WindowSource source(c.shape, dev, c.dtype);
        Weights w = dev.w;
        w.layers.clear();
        w.embed = w.final_norm = w.head = nullptr;
        w.source = &source;
        SlotSink got(c.shape, active, c.slot_dtype);
        REQUIRE(compute->train_step(w, batch, kGradScale, got) == loss);
        REQUIRE(got.problems.empty());
        for (const ParamSpec& spec : param_specs(c.shape))
          if (active.count(spec.group) != 0) {
            CAPTURE(spec.name);
            REQUIRE(got.read(spec.name) == want.read(spec.name));
          }
        // The embedding, forward up every layer, the head once (from the final norm to its
        // backward), backward down every one (the embedding is active).
        std::vector<int> calls = {-1};
        for (int l = 0; l < L; ++l) calls.push_back(l);
        calls.push_back(-2);
        for (int l = L; l-- > 0;) calls.push_back(l);
        REQUIRE(source.calls == calls);
        REQUIRE(compute->loss(w, batch) == compute->loss(dev.w, batch));
      }
    }
  }
}

TEST_CASE("cuda decoder: a step uses the cuda_bytes block and no other device memory",
          "[decoder][gpu]") {
  const auto free_now = [] {
    std::size_t free = 0, total = 0;
    cuda_ok(cudaMemGetInfo(&free, &total), "cudaMemGetInfo");
    return static_cast<std::int64_t>(free);
  };
  // Llama; and Qwen3, whose head norms keep two regions more.
  for (const Case& c : {shape_cases()[0], shape_case("qwen3 qk_norm tied")}) {
    CAPTURE(c.label);
    Params p = random_params(c.shape, c.dtype, 41);
    const Tokens b = random_tokens(c.shape, c.sequences, c.batch_len, 42);
    const DeviceParams dev(c.shape, p, c.dtype);
    const std::size_t bytes = cuda_bytes(c.shape, c.max_sequences, c.seq_len);
    DeviceBlock block(bytes);
    SlotSink sink(c.shape, all_groups(c.shape), DType::f32);
    const Batch batch{b.sequences, b.seq_len, b.inputs.data(), b.targets.data(), nullptr};
    const std::int64_t before = free_now();
    // cuDNN by name where the build has it: documents apart go through it too (below).
    const Attention attention = cuda_attention(c.shape);
    auto compute = make_cuda_compute(c.shape, c.max_sequences, c.seq_len, c.dtype, block.p,
                                     bytes, 0, {}, attention);
    const std::int64_t built = free_now();
    compute->train_step(dev.w, batch, 1.0, sink);  // warm: our kernels and cuBLAS's load once
    const std::int64_t warm = free_now();
    for (int step = 0; step < 3; ++step) {
      compute->train_step(dev.w, batch, 1.0, sink);
      compute->loss(dev.w, batch);
      REQUIRE(free_now() == warm);
    }
    // Documents apart: cuDNN's padded calls live in the block's act and dact scratch. Their
    // first step builds plans (and cuDNN may load kernels for them), later ones take nothing.
    const bool as_asked =  // (own: no cuDNN for this build or shape)
        attention == Attention::own ||
        cuda_apart_through_cudnn(c.shape, c.max_sequences, c.seq_len, attention);
    REQUIRE(as_asked);
    Tokens cut = b;
    std::mt19937 rng(43);
    cut_into_documents(cut, 12, false, rng);
    const Batch apart{cut.sequences, cut.seq_len, cut.inputs.data(), cut.targets.data(),
                      cut.positions.data()};
    compute->train_step(dev.w, apart, 1.0, sink);
    const std::int64_t warm_apart = free_now();
    for (int step = 0; step < 3; ++step) {
      compute->train_step(dev.w, apart, 1.0, sink);
      compute->loss(dev.w, apart);
      REQUIRE(free_now() == warm_apart);
    }
    std::printf(
        "cuda decoder %s: block %zu bytes; its cuBLAS (and cuDNN) handles took %lld bytes of "
        "their own, the first step %lld, later steps 0\n",
        c.label, bytes, static_cast<long long>(before - built),
        static_cast<long long>(built - warm));
    // The handles' own device memory is outside the block. With CUBLAS_WORKSPACE_CONFIG=:0:0
    // (tests/gpu/main.cpp) cuBLAS keeps no pool per handle: 4 MiB once per process (without it,
    // 64 MiB a handle on an H200, cuBLAS 13: tools/probes/cublas_memory.cu). Bounded so that
    // growth shows.
    REQUIRE(before - warm <= (std::int64_t{16} << 20));
  }
  // The head norms' regions are all qk_norm adds: xhat in bit16 and 1 / rms in fp32 for each
  // of the H + K head rows of a token, in every kept slot.
  const Case c = shape_case("qwen3 qk_norm tied");
  DecoderShape plain = c.shape;
  plain.qk_norm = false;
  for (int r : {0, 1, 2}) {
    const std::size_t rows = cuda_kept_slots(c.shape.layers, r) *
                             static_cast<std::size_t>(c.max_sequences * c.seq_len) *
                             static_cast<std::size_t>(c.shape.heads + c.shape.kv_heads);
    const auto rounded = [](std::size_t b) { return (b + 255) / 256 * 256; };
    CAPTURE(r);
    REQUIRE(cuda_bytes(c.shape, c.max_sequences, c.seq_len, r) ==
            cuda_bytes(plain, c.max_sequences, c.seq_len, r) +
                rounded(rows * static_cast<std::size_t>(c.shape.head_dim) * 2) +
                rounded(rows * 4));
  }
}

TEST_CASE("cuda decoder: refuses a block, shape or batch it cannot run, naming it",
          "[decoder][gpu]") {
  DecoderShape s = small_shape();
  s.head_dim = 160;
  REQUIRE(test::contains(test::message_of<ConfigError>([&] { cuda_bytes(s, 2, 8); }),
                         "head_dim = 160"));
  s = small_shape();
  s.kv_heads = 3;
  REQUIRE(test::contains(test::message_of<ConfigError>([&] { cuda_bytes(s, 2, 8); }),
                         "kv_heads = 3"));
  s = small_shape();
  s.qkv_bias = true;
  s.qk_norm = true;
  REQUIRE(test::contains(test::message_of<ConfigError>([&] { cuda_bytes(s, 2, 8); }),
                         "qk_norm"));
  s = small_shape();
  REQUIRE(test::contains(test::message_of<ConfigError>([&] { cuda_bytes(s, 2, 300); }),
                         "max_position_embeddings"));
  for (int r : {-1, s.layers + 1})
    REQUIRE(test::contains(test::message_of<ConfigError>([&] { cuda_bytes(s, 2, 8, r); }),
                           "recompute_layers = " + std::to_string(r)));
  const std::size_t bytes = cuda_bytes(s, 2, 8);
  DeviceBlock block(bytes);
  REQUIRE(test::contains(test::message_of<ConfigError>([&] {
                           make_cuda_compute(s, 2, 8, DType::bf16, block.p, bytes - 256);
                         }),
                         "make_cuda_compute"));
  REQUIRE_THROWS_AS(make_cuda_compute(s, 2, 8, DType::f32, block.p, bytes), ConfigError);
  auto compute = make_cuda_compute(s, 2, 8, DType::bf16, block.p, bytes);
  Params p = random_params(s, DType::bf16, 51);
  const DeviceParams dev(s, p, DType::bf16);
  const Tokens too_long = random_tokens(s, 2, 9, 52), too_many = random_tokens(s, 3, 8, 53);
  SlotSink sink(s, all_groups(s), DType::f32);
  const Batch long_batch{2, 9, too_long.inputs.data(), too_long.targets.data()};
  const Batch many_batch{3, 8, too_many.inputs.data(), too_many.targets.data()};
  REQUIRE(test::contains(
      test::message_of<ConfigError>([&] { compute->train_step(dev.w, long_batch, 1.0, sink); }),
      "seq_len = 9"));
  REQUIRE(test::contains(
      test::message_of<ConfigError>([&] { compute->loss(dev.w, many_batch); }),
      "3 sequences"));
  Tokens bad = random_tokens(s, 2, 8, 54);
  bad.targets[5] = s.vocab;
  const Batch bad_batch{2, 8, bad.inputs.data(), bad.targets.data()};
  REQUIRE(test::contains(
      test::message_of<ConfigError>([&] { compute->train_step(dev.w, bad_batch, 1.0, sink); }),
      "targets[5] = 150"));
  // Head-norm weights where the shape has none, and none where it has them.
  const Tokens good = random_tokens(s, 2, 8, 55);
  const Batch batch{2, 8, good.inputs.data(), good.targets.data(), nullptr};
  Weights extra = dev.w;
  extra.layers[1].q_norm = extra.layers[1].attn_norm;
  REQUIRE(test::contains(
      test::message_of<ConfigError>([&] { compute->train_step(extra, batch, 1.0, sink); }),
      "layers.1: q_norm/k_norm weights do not match qk_norm"));
  REQUIRE(sink.opened.empty());  // refused before anything was queued
  // One backend at a time: with cuDNN, a second handle's plans alive beside the first's keep 8
  // MiB of loaded kernels for the rest of the process (seen on an H200, cuDNN 9).
  compute.reset();
  DecoderShape q3 = small_shape();
  q3.family = DecoderFamily::qwen3;
  q3.qk_norm = true;
  const std::size_t q3_bytes = cuda_bytes(q3, 2, 8);
  DeviceBlock q3_block(q3_bytes);
  auto q3_compute = make_cuda_compute(q3, 2, 8, DType::bf16, q3_block.p, q3_bytes);
  const DeviceParams q3_dev(q3, random_params(q3, DType::bf16, 56), DType::bf16);
  Weights missing = q3_dev.w;
  missing.layers[0].k_norm = nullptr;
  SlotSink q3_sink(q3, all_groups(q3), DType::f32);
  REQUIRE(test::contains(
      test::message_of<ConfigError>([&] { q3_compute->train_step(missing, batch, 1.0, q3_sink); }),
      "layers.0: q_norm/k_norm weights do not match qk_norm"));
  REQUIRE(q3_sink.opened.empty());
}
