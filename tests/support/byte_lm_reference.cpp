#include "tests/support/byte_lm_reference.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <random>

#include "shardswap/engine.h"
#include "shardswap/error.h"

namespace shardswap::test_support {

namespace {

constexpr int V = 256;
constexpr double kEps = 1e-5;

double gelu(double x) {
  const double k = std::sqrt(2.0 / M_PI);
  return 0.5 * x * (1.0 + std::tanh(k * (x + 0.044715 * x * x * x)));
}

// d/dx of gelu above: product rule on x * (1 + tanh(inner)) / 2.
double gelu_derivative(double x) {
  const double k = std::sqrt(2.0 / M_PI);
  const double inner = k * (x + 0.044715 * x * x * x);
  const double t = std::tanh(inner);
  const double dinner = k * (1.0 + 3.0 * 0.044715 * x * x);
  return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * dinner;
}

// One sample's LayerNorm: normalized values and 1/std.
struct Norm {
  std::vector<double> xhat;
  double rstd = 0.0;
};

Norm normalize(const std::vector<double>& x) {
  const auto d = static_cast<double>(x.size());
  double mean = 0.0;
  for (double v : x) mean += v;
  mean /= d;
  double var = 0.0;
  for (double v : x) var += (v - mean) * (v - mean);
  var /= d;
  Norm n;
  n.rstd = 1.0 / std::sqrt(var + kEps);
  for (double v : x) n.xhat.push_back((v - mean) * n.rstd);
  return n;
}

// Gradient at the input of y = xhat * g + b given dy; adds dg, db.
std::vector<double> normalize_backward(const Norm& n, const std::vector<double>& g,
                                       const std::vector<double>& dy, std::vector<double>& dg,
                                       std::vector<double>& db) {
  const std::size_t d = dy.size();
  std::vector<double> dxhat(d);
  double mean_dxhat = 0.0, mean_dxhat_xhat = 0.0;
  for (std::size_t k = 0; k < d; ++k) {
    dg[k] += dy[k] * n.xhat[k];
    db[k] += dy[k];
    dxhat[k] = dy[k] * g[k];
    mean_dxhat += dxhat[k];
    mean_dxhat_xhat += dxhat[k] * n.xhat[k];
  }
  mean_dxhat /= static_cast<double>(d);
  mean_dxhat_xhat /= static_cast<double>(d);
  std::vector<double> dx(d);
  for (std::size_t k = 0; k < d; ++k)
    dx[k] = n.rstd * (dxhat[k] - mean_dxhat - n.xhat[k] * mean_dxhat_xhat);
  return dx;
}

std::string L(int i, const char* what) {
  return fmt::format("layers.{}.{}", i, what);
}

// The forward pass of one sample, everything backward needs kept.
struct SampleForward {
  std::vector<std::vector<double>> h;  // h_0 .. h_L
  std::vector<Norm> norm;
  std::vector<std::vector<double>> y, u, a;
  Norm final_norm;
  std::vector<double> fy, probs;
  double loss = 0.0;
};

SampleForward forward(const ByteLmShape& s, const ParamValues& w, const TokenBatch& b, int n) {
  const int c = s.context, d = s.width, hd = s.hidden;
  SampleForward f;
  std::vector<double> h0(static_cast<std::size_t>(d), 0.0);
  const auto& e = w.at("embed.weight");
  for (int j = 0; j < c; ++j) {
    const int row = j * V + b.context[static_cast<std::size_t>(n * c + j)];
    for (int k = 0; k < d; ++k) h0[k] += e[static_cast<std::size_t>(row * d + k)];
  }
  f.h.push_back(h0);
  for (int i = 0; i < s.depth; ++i) {
    const auto& x = f.h.back();
    const auto& g = w.at(L(i, "norm.weight"));
    const auto& bb = w.at(L(i, "norm.bias"));
    const auto& w1 = w.at(L(i, "fc1.weight"));
    const auto& b1 = w.at(L(i, "fc1.bias"));
    const auto& w2 = w.at(L(i, "fc2.weight"));
    const auto& b2 = w.at(L(i, "fc2.bias"));
    Norm nrm = normalize(x);
    std::vector<double> y(static_cast<std::size_t>(d)), u(static_cast<std::size_t>(hd)),
        a(static_cast<std::size_t>(hd));
    for (int k = 0; k < d; ++k) y[k] = nrm.xhat[k] * g[k] + bb[k];
    for (int m = 0; m < hd; ++m) {
      double acc = b1[m];
      for (int k = 0; k < d; ++k) acc += w1[static_cast<std::size_t>(m * d + k)] * y[k];
      u[m] = acc;
      a[m] = gelu(acc);
    }
    std::vector<double> next = x;
    for (int k = 0; k < d; ++k) {
      double acc = b2[k];
      for (int m = 0; m < hd; ++m) acc += w2[static_cast<std::size_t>(k * hd + m)] * a[m];
      next[k] += acc;
    }
    f.norm.push_back(std::move(nrm));
    f.y.push_back(std::move(y));
    f.u.push_back(std::move(u));
    f.a.push_back(std::move(a));
    f.h.push_back(std::move(next));
  }
  const auto& fg = w.at("final_norm.weight");
  const auto& fb = w.at("final_norm.bias");
  const auto& head = w.at("head.weight");
  f.final_norm = normalize(f.h.back());
  f.fy.resize(static_cast<std::size_t>(d));
  for (int k = 0; k < d; ++k) f.fy[k] = f.final_norm.xhat[k] * fg[k] + fb[k];
  std::vector<double> z(V);
  double zmax = -1e300;
  for (int v = 0; v < V; ++v) {
    double acc = 0.0;
    for (int k = 0; k < d; ++k) acc += head[static_cast<std::size_t>(v * d + k)] * f.fy[k];
    z[v] = acc;
    zmax = std::max(zmax, acc);
  }
  double sum = 0.0;
  for (int v = 0; v < V; ++v) sum += std::exp(z[v] - zmax);
  const double lse = zmax + std::log(sum);
  f.loss = lse - z[b.target[static_cast<std::size_t>(n)]];
  for (int v = 0; v < V; ++v) f.probs.push_back(std::exp(z[v] - lse));
  return f;
}

}  // namespace

std::map<std::string, RefParam> byte_lm_reference_params(const ByteLmShape& s) {
  const std::int64_t c = s.context, d = s.width, h = s.hidden;
  std::map<std::string, RefParam> p;
  p["embed.weight"] = {{c * V, d}, "embed"};
  for (int i = 0; i < s.depth; ++i) {
    const auto g = fmt::format("layers.{}", i);
    p[L(i, "norm.weight")] = {{d}, g};
    p[L(i, "norm.bias")] = {{d}, g};
    p[L(i, "fc1.weight")] = {{h, d}, g};
    p[L(i, "fc1.bias")] = {{h}, g};
    p[L(i, "fc2.weight")] = {{d, h}, g};
    p[L(i, "fc2.bias")] = {{d}, g};
  }
  p["final_norm.weight"] = {{d}, "head"};
  p["final_norm.bias"] = {{d}, "head"};
  p["head.weight"] = {{V, d}, "head"};
  return p;
}

double byte_lm_reference_loss(const ByteLmShape& s, const ParamValues& w, const TokenBatch& b) {
  double total = 0.0;
  for (int n = 0; n < b.size; ++n) total += forward(s, w, b, n).loss;
  return total / b.size;
}

RefGradients byte_lm_reference_gradients(const ByteLmShape& s, const ParamValues& w,
                                         const TokenBatch& b) {
  const int c = s.context, d = s.width, hd = s.hidden;
  RefGradients out;
  for (const auto& [name, p] : byte_lm_reference_params(s)) {
    std::int64_t numel = 1;
    for (auto e : p.shape) numel *= e;
    out.grads[name].assign(static_cast<std::size_t>(numel), 0.0);
  }
  auto& G = out.grads;
  const double inv_n = 1.0 / b.size;
  for (int n = 0; n < b.size; ++n) {
    const SampleForward f = forward(s, w, b, n);
    out.loss += f.loss * inv_n;
    // logits: (softmax - onehot) / batch
    std::vector<double> dz(V);
    for (int v = 0; v < V; ++v)
      dz[v] = (f.probs[v] - (v == b.target[static_cast<std::size_t>(n)] ? 1.0 : 0.0)) * inv_n;
    const auto& head = w.at("head.weight");
    std::vector<double> dfy(static_cast<std::size_t>(d), 0.0);
    for (int v = 0; v < V; ++v)
      for (int k = 0; k < d; ++k) {
        G["head.weight"][static_cast<std::size_t>(v * d + k)] += dz[v] * f.fy[k];
        dfy[k] += head[static_cast<std::size_t>(v * d + k)] * dz[v];
      }
    std::vector<double> dh = normalize_backward(f.final_norm, w.at("final_norm.weight"), dfy,
                                                G["final_norm.weight"], G["final_norm.bias"]);
    for (int i = s.depth - 1; i >= 0; --i) {
      const auto& w1 = w.at(L(i, "fc1.weight"));
      const auto& w2 = w.at(L(i, "fc2.weight"));
      auto& gw1 = G[L(i, "fc1.weight")];
      auto& gw2 = G[L(i, "fc2.weight")];
      auto& gb1 = G[L(i, "fc1.bias")];
      auto& gb2 = G[L(i, "fc2.bias")];
      std::vector<double> du(static_cast<std::size_t>(hd), 0.0);
      for (int k = 0; k < d; ++k) {
        gb2[k] += dh[k];
        for (int m = 0; m < hd; ++m) {
          gw2[static_cast<std::size_t>(k * hd + m)] += dh[k] * f.a[i][m];
          du[m] += w2[static_cast<std::size_t>(k * hd + m)] * dh[k];  // d loss / d a
        }
      }
      for (int m = 0; m < hd; ++m) du[m] *= gelu_derivative(f.u[i][m]);
      std::vector<double> dy(static_cast<std::size_t>(d), 0.0);
      for (int m = 0; m < hd; ++m) {
        gb1[m] += du[m];
        for (int k = 0; k < d; ++k) {
          gw1[static_cast<std::size_t>(m * d + k)] += du[m] * f.y[i][k];
          dy[k] += w1[static_cast<std::size_t>(m * d + k)] * du[m];
        }
      }
      const std::vector<double> dx = normalize_backward(
          f.norm[i], w.at(L(i, "norm.weight")), dy, G[L(i, "norm.weight")], G[L(i, "norm.bias")]);
      for (int k = 0; k < d; ++k) dh[k] += dx[k];  // the residual path adds
    }
    auto& ge = G["embed.weight"];
    for (int j = 0; j < c; ++j) {
      const int row = j * V + b.context[static_cast<std::size_t>(n * c + j)];
      for (int k = 0; k < d; ++k) ge[static_cast<std::size_t>(row * d + k)] += dh[k];
    }
  }
  return out;
}

double normalized_error(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return INFINITY;
  double diff = 0.0, norm = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    diff += (a[i] - b[i]) * (a[i] - b[i]);
    norm += b[i] * b[i];
  }
  return norm > 0.0 ? std::sqrt(diff / norm) : std::sqrt(diff);
}

ParamValues random_byte_lm_weights(const ByteLmShape& s, std::uint64_t seed) {
  ParamValues w;
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  for (const auto& [name, p] : byte_lm_reference_params(s)) {  // map order: deterministic
    std::int64_t numel = 1;
    for (auto e : p.shape) numel *= e;
    double center = 0.0, scale = 0.2;  // biases
    if (name.ends_with("norm.weight")) {
      center = 1.0;
      scale = 0.3;
    } else if (name == "embed.weight") {
      scale = 0.5;
    } else if (name.ends_with(".weight")) {  // fc and head: [out, in]
      scale = 1.5 / std::sqrt(static_cast<double>(p.shape[1]));
    }
    auto& v = w[name];
    for (std::int64_t i = 0; i < numel; ++i) v.push_back(center + scale * u(rng));
  }
  return w;
}

TokenBatch random_token_batch(const ByteLmShape& s, int size, std::uint64_t seed) {
  std::mt19937_64 rng(seed * 7919 + 17);
  TokenBatch b;
  b.size = size;
  for (int i = 0; i < size * s.context; ++i) b.context.push_back(static_cast<std::uint8_t>(rng()));
  for (int i = 0; i < size; ++i) b.target.push_back(static_cast<std::uint8_t>(rng()));
  return b;
}

std::vector<ByteLmCase> byte_lm_one_rank_dtype_cases() {
  std::vector<ByteLmCase> cases;
  for (int stage : {1, 2})
    for (DType dtype : {DType::bf16, DType::f16})
      for (std::optional<DType> grad : {std::optional<DType>{}, std::optional<DType>{DType::f32}}) {
        ByteLmCase c;
        c.stage = stage;
        c.dtype = dtype;
        c.grad_dtype = grad;
        cases.push_back(c);
      }
  return cases;
}

ByteLmCheck check_byte_lm(const ByteLmCase& c, const Backend& backend) {
  constexpr double kLr = 1000.0;  // large steps: (before - after) / lr keeps fp32 precision
  EngineConfig cfg;
  cfg.stage = c.stage;
  cfg.dtype = c.dtype;
  cfg.grad_dtype = c.grad_dtype;
  cfg.optimizer.type = OptimizerType::sgd;
  cfg.optimizer.lr = kLr;
  cfg.loss_scale.dynamic = false;
  cfg.loss_scale.static_scale = 1024.0;  // fp16 only: the model must apply it
  // Buckets just above the largest param (the embedding), so stage 2 cycles through them.
  cfg.reduce_bucket_bytes = static_cast<std::size_t>(c.shape.context) * V * c.shape.width * 4;
  const ParamValues init = random_byte_lm_weights(c.shape, 99);
  const auto params = byte_lm_reference_params(c.shape);
  const auto is_trained = [&](const std::string& group) {
    return c.active.empty() || std::find(c.active.begin(), c.active.end(), group) != c.active.end();
  };

  ByteLmCheck out;
  ParamValues before, after;  // bit16 weights at build; masters after the step (trained params)
  for (const auto& [name, p] : params)
    if (is_trained(p.group)) after[name].assign(init.at(name).size(), NAN);
  std::vector<TokenBatch> batches;
  std::vector<double> losses(static_cast<std::size_t>(c.world_size));
  for (int r = 0; r < c.world_size; ++r)
    batches.push_back(random_token_batch(c.shape, c.batch, 1000 + static_cast<std::uint64_t>(r)));
  std::mutex mu;
  run_ranks(
      c.world_size,
      [&](int rank, Communicator& comm) {
        MemorySpace space(rank, backend.make_allocator(rank));
        Engine engine(cfg, comm, space, backend);
        ByteLm::declare(c.shape, engine);
        std::optional<std::vector<std::string>> active;
        if (!c.active.empty()) active = c.active;
        engine.build(
            [&](const ParamInfo& info, std::span<float> values) {
              const auto& v = init.at(info.name);
              for (std::size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(v[i]);
            },
            active);
        auto model = make_byte_lm(c.shape, c.max_batch, c.dtype, space);
        const bool bytes_match =
            space.stats().tag(Tag::activation).requested.current ==
            ByteLm::activation_bytes(c.shape, c.max_batch, c.dtype, space.device());
        ParamValues mine;
        for (const auto& [name, p] : params) {
          const auto w = engine.read_weight(name);
          mine[name].assign(w.begin(), w.end());
        }
        const TokenBatch& batch = batches[static_cast<std::size_t>(rank)];
        const double eval = model->loss(engine, batch);
        const double loss = model->train_step(engine, batch);
        const bool applied = engine.step().applied;
        std::lock_guard lock(mu);
        out.activation_bytes_match = out.activation_bytes_match && bytes_match;
        out.eval_loss_matches = out.eval_loss_matches && eval == loss;
        out.steps_applied += applied ? 1 : 0;
        losses[static_cast<std::size_t>(rank)] = loss;
        for (const auto& [name, p] : params) {
          if (!is_trained(p.group)) {
            const auto w = engine.read_weight(name);
            out.frozen_unchanged =
                out.frozen_unchanged && std::equal(w.begin(), w.end(), mine[name].begin());
            continue;
          }
          for (const auto& piece : engine.master_pieces(name))
            for (std::size_t k = 0; k < piece.values.size(); ++k)
              after[name][static_cast<std::size_t>(piece.param_offset) + k] = piece.values[k];
        }
        if (rank == 0) before = std::move(mine);
      },
      backend);

  ParamValues mean_grad;
  for (int r = 0; r < c.world_size; ++r) {
    const auto ref =
        byte_lm_reference_gradients(c.shape, before, batches[static_cast<std::size_t>(r)]);
    out.loss_error = std::max(out.loss_error,
                              std::abs(losses[static_cast<std::size_t>(r)] - ref.loss) / ref.loss);
    for (const auto& [name, g] : ref.grads) {
      auto& m = mean_grad[name];
      m.resize(g.size(), 0.0);
      for (std::size_t i = 0; i < g.size(); ++i) m[i] += g[i] / c.world_size;
    }
  }
  for (const auto& [name, master] : after) {
    std::vector<double> grad(master.size());
    for (std::size_t i = 0; i < grad.size(); ++i) grad[i] = (before.at(name)[i] - master[i]) / kLr;
    const double err = normalized_error(grad, mean_grad.at(name));  // NaN if a piece is missing
    out.grad_errors[name] = err;
    if (!(err <= out.worst_grad_error)) {
      out.worst_grad_error = std::isnan(err) ? INFINITY : err;
      out.worst_param = name;
    }
  }
  return out;
}

}  // namespace shardswap::test_support
