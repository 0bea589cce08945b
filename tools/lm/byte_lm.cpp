// The byte LM's shape, declaration and init, the engine-facing ByteLm (weights by name, grad
// slots in backward order, frozen groups), and the CPU backend: fp32 Eigen on the host, the
// bit16 weights upcast one group at a time into scratch memory of the activation block.
#include "tools/lm/byte_lm.h"

#include <fmt/format.h>

#include <Eigen/Dense>
#include <algorithm>
#include <cmath>
#include <numbers>
#include <random>
#include <string_view>

#include "shardswap/error.h"
#include "optimizer/optimizer.h"
#include "tools/lm/byte_lm_compute.h"
#include "tools/lm/init_random.h"

namespace shardswap {

namespace {

constexpr int kVocab = lm::kVocab;
constexpr float kLnEps = 1e-5f;

lm::Dims dims_of(const ByteLmShape& s) {
  return {s.context, s.width, s.hidden, s.depth};
}

std::string layer_group(int i) {
  return fmt::format("layers.{}", i);
}

bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

// ---- names ----

std::string param_name(lm::ParamId p) {
  using K = lm::ParamKind;
  const auto layer = [&](const char* what) { return fmt::format("layers.{}.{}", p.layer, what); };
  switch (p.kind) {
    case K::embed:
      return "embed.weight";
    case K::norm_weight:
      return layer("norm.weight");
    case K::norm_bias:
      return layer("norm.bias");
    case K::fc1_weight:
      return layer("fc1.weight");
    case K::fc1_bias:
      return layer("fc1.bias");
    case K::fc2_weight:
      return layer("fc2.weight");
    case K::fc2_bias:
      return layer("fc2.bias");
    case K::final_norm_weight:
      return "final_norm.weight";
    case K::final_norm_bias:
      return "final_norm.bias";
    case K::head_weight:
      return "head.weight";
  }
  return {};
}

std::int64_t param_numel(const ByteLmShape& s, lm::ParamKind kind) {
  using K = lm::ParamKind;
  const std::int64_t c = s.context, d = s.width, h = s.hidden;
  switch (kind) {
    case K::embed:
      return c * kVocab * d;
    case K::fc1_weight:
    case K::fc2_weight:
      return h * d;
    case K::fc1_bias:
      return h;
    case K::head_weight:
      return kVocab * d;
    default:  // norms and fc2 bias
      return d;
  }
}

// Every param in declaration (forward) order, with its shape and group.
struct ParamDecl {
  lm::ParamId id;
  std::vector<std::int64_t> shape;
  std::string group;
};

std::vector<ParamDecl> param_decls(const ByteLmShape& s) {
  using K = lm::ParamKind;
  const std::int64_t c = s.context, d = s.width, h = s.hidden;
  std::vector<ParamDecl> out;
  out.push_back({{K::embed}, {c * kVocab, d}, "embed"});
  for (int i = 0; i < s.depth; ++i) {
    const auto g = layer_group(i);
    out.push_back({{K::norm_weight, i}, {d}, g});
    out.push_back({{K::norm_bias, i}, {d}, g});
    out.push_back({{K::fc1_weight, i}, {h, d}, g});
    out.push_back({{K::fc1_bias, i}, {h}, g});
    out.push_back({{K::fc2_weight, i}, {d, h}, g});
    out.push_back({{K::fc2_bias, i}, {d}, g});
  }
  out.push_back({{K::final_norm_weight}, {d}, "head"});
  out.push_back({{K::final_norm_bias}, {d}, "head"});
  out.push_back({{K::head_weight}, {kVocab, d}, "head"});
  return out;
}

// ---- the CPU backend ----

using Mat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic>;  // [features, samples]
using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;  // params
using MapM = Eigen::Map<Mat>;
using MapR = Eigen::Map<RowMat>;
using MapV = Eigen::Map<Eigen::VectorXf>;

// GELU, tanh form, and its derivative over whole arrays: Eigen's vectorized tanh is several
// times faster than std::tanh per element, which dominated the forward pass.
constexpr float kGeluK = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluC = 0.044715f;

template <class X>
auto gelu_tanh(const X& x) {
  return (kGeluK * (x + kGeluC * x.cube())).tanh();
}

template <class X>
auto gelu(const X& x) {
  return 0.5f * x * (1.0f + gelu_tanh(x));
}

// d gelu / dx = (1 + t) / 2 + x (1 - t^2) k (1 + 3 c x^2) / 2 with t the tanh above.
template <class X, class T>
auto gelu_grad(const X& x, const T& t) {
  return 0.5f * (1.0f + t) +
         0.5f * x * (1.0f - t.square()) * kGeluK * (1.0f + 3.0f * kGeluC * x.square());
}

// Byte offsets of the CPU backend's fp32 regions for n = max_batch samples. Activations are
// [features, samples] column-major (one sample's vector contiguous); `weights` holds one group's
// weights upcast to fp32, `grad` one param's gradient before it is added into its slot.
struct CpuLayout {
  std::size_t hs;                      // (depth + 1) * n * d: h_0 .. h_L
  std::size_t ln_y, ln_mean, ln_rstd;  // per layer: n * d, n, n
  std::size_t u, a;                    // per layer: n * h (fc1 + bias), n * h (gelu)
  std::size_t fy, fmean, frstd;        // final norm: n * d, n, n
  std::size_t probs;                   // n * 256: logits, then softmax
  std::size_t dh, dy, da;              // n * d, n * d, n * h
  std::size_t weights, grad;           // max over groups; max(h * d, 256 * d)
  std::size_t bytes;
};

CpuLayout cpu_layout(const lm::Dims& s, int max_batch) {
  const auto n = static_cast<std::size_t>(max_batch), d = static_cast<std::size_t>(s.width),
             h = static_cast<std::size_t>(s.hidden), depth = static_cast<std::size_t>(s.depth),
             v = static_cast<std::size_t>(kVocab);
  const std::size_t layer_params = 2 * d + h * d + h + d * h + d, head_params = 2 * d + v * d;
  lm::Arena a;
  CpuLayout l{};
  l.hs = a.take<float>((depth + 1) * n * d);
  l.ln_y = a.take<float>(depth * n * d);
  l.ln_mean = a.take<float>(depth * n);
  l.ln_rstd = a.take<float>(depth * n);
  l.u = a.take<float>(depth * n * h);
  l.a = a.take<float>(depth * n * h);
  l.fy = a.take<float>(n * d);
  l.fmean = a.take<float>(n);
  l.frstd = a.take<float>(n);
  l.probs = a.take<float>(n * v);
  l.dh = a.take<float>(n * d);
  l.dy = a.take<float>(n * d);
  l.da = a.take<float>(n * h);
  l.weights = a.take<float>(std::max(layer_params, head_params));
  l.grad = a.take<float>(std::max(h * d, v * d));
  l.bytes = a.bytes();
  return l;
}

class CpuCompute final : public lm::Compute {
 public:
  CpuCompute(const lm::Dims& dims, int max_batch, std::byte* memory)
      : s_(dims), max_batch_(max_batch), mem_(memory), l_(cpu_layout(dims, max_batch)) {}

  double loss(const lm::Weights& w, const lm::Batch& b) override { return forward(w, b); }

  double train_step(const lm::Weights& w, const lm::Batch& b, double grad_scale,
                    lm::GradSink& sink) override {
    const double loss = forward(w, b);
    backward(w, b, grad_scale, sink);
    return loss;
  }

 private:
  float* at(std::size_t offset) const { return reinterpret_cast<float*>(mem_ + offset); }

  // One layer's weights, upcast to fp32 in the weights region.
  struct Layer {
    MapV g, b;  // norm
    MapR w1;    // [h, d]
    MapV b1;
    MapR w2;  // [d, h]
    MapV b2;
  };
  Layer upcast_layer(const lm::Weights& w, int i) const {
    const int d = s_.width, h = s_.hidden;
    const auto& lw = w.layers[static_cast<std::size_t>(i)];
    float* p = at(l_.weights);
    float* const g = upcast(p, lw.norm_weight, d, w.dtype);
    float* const b = upcast(p, lw.norm_bias, d, w.dtype);
    float* const w1 = upcast(p, lw.fc1_weight, h * d, w.dtype);
    float* const b1 = upcast(p, lw.fc1_bias, h, w.dtype);
    float* const w2 = upcast(p, lw.fc2_weight, d * h, w.dtype);
    float* const b2 = upcast(p, lw.fc2_bias, d, w.dtype);
    return {MapV(g, d), MapV(b, d), MapR(w1, h, d), MapV(b1, h), MapR(w2, d, h), MapV(b2, d)};
  }
  struct Head {
    MapV g, b;
    MapR w;  // [256, d]
  };
  Head upcast_head(const lm::Weights& w) const {
    const int d = s_.width;
    float* p = at(l_.weights);
    float* const g = upcast(p, w.final_norm_weight, d, w.dtype);
    float* const b = upcast(p, w.final_norm_bias, d, w.dtype);
    float* const h = upcast(p, w.head_weight, kVocab * d, w.dtype);
    return {MapV(g, d), MapV(b, d), MapR(h, kVocab, d)};
  }
  // Casts `count` bit16 values to fp32 at `cursor` and advances it.
  static float* upcast(float*& cursor, const void* src, int count, DType dtype) {
    float* const out = cursor;
    cpu_device_ops().cast(out, DType::f32, src, dtype, static_cast<std::size_t>(count));
    cursor += count;
    return out;
  }

  // Per-layer regions hold max_batch samples each: layer i's starts at i * per(features).
  std::size_t per(int features) const {
    return static_cast<std::size_t>(features) * static_cast<std::size_t>(max_batch_);
  }
  MapM hs(int i, int n) const { return MapM(at(l_.hs) + i * per(s_.width), s_.width, n); }

  // LayerNorm of each column of x into y (fp32), keeping mean and 1/std for backward.
  static void layer_norm(const MapM& x, const MapV& g, const MapV& b, MapM y, float* mean,
                         float* rstd) {
    for (Eigen::Index s = 0; s < x.cols(); ++s) {
      const float m = x.col(s).mean();
      const float var = (x.col(s).array() - m).square().mean();
      const float r = 1.0f / std::sqrt(var + kLnEps);
      y.col(s) = ((x.col(s).array() - m) * r * g.array() + b.array()).matrix();
      mean[s] = m;
      rstd[s] = r;
    }
  }

  // Given dy (gradient at the norm's output): when `grads` is given, writes the gradients of
  // its bias and weight there (d floats each, bias first); when dx is given, adds the gradient
  // at its input to dx.
  static void layer_norm_backward(const MapM& x, const MapV& g, const float* mean,
                                  const float* rstd, const MapM& dy, float* grads, MapM* dx) {
    const Eigen::Index d = x.rows();
    float* const db = grads;
    float* const dg = grads == nullptr ? nullptr : grads + d;
    if (grads != nullptr) {
      MapV(dg, d).setZero();
      MapV(db, d).setZero();
    }
    for (Eigen::Index s = 0; s < x.cols(); ++s) {
      const auto xhat = (x.col(s).array() - mean[s]) * rstd[s];
      if (grads != nullptr) {
        MapV(dg, d).array() += dy.col(s).array() * xhat;
        MapV(db, d) += dy.col(s);
      }
      if (dx == nullptr) continue;
      const auto dxhat = dy.col(s).array() * g.array();
      const float m1 = dxhat.mean(), m2 = (dxhat * xhat).mean();
      dx->col(s).array() += rstd[s] * (dxhat - m1 - xhat * m2);
    }
  }

  double forward(const lm::Weights& w, const lm::Batch& b) {
    const int n = b.size, c = s_.context, d = s_.width, h = s_.hidden;
    // h0: one embedding row per context slot, gathered from bit16 and summed in fp32.
    MapM h0 = hs(0, n);
    h0.setZero();
    float* row = at(l_.grad);  // free during forward
    const auto row_bytes = static_cast<std::size_t>(d) * dtype_size(w.dtype);
    for (int s = 0; s < n; ++s)
      for (int j = 0; j < c; ++j) {
        const auto r = static_cast<std::size_t>(j * kVocab + b.context[s * c + j]);
        cpu_device_ops().cast(row, DType::f32, static_cast<const std::byte*>(w.embed) + r * row_bytes,
                           w.dtype, static_cast<std::size_t>(d));
        h0.col(s) += MapV(row, d);
      }
    for (int i = 0; i < s_.depth; ++i) {
      const Layer lw = upcast_layer(w, i);
      const MapM x = hs(i, n);
      MapM y(at(l_.ln_y) + i * per(d), d, n), u(at(l_.u) + i * per(h), h, n),
          a(at(l_.a) + i * per(h), h, n);
      layer_norm(x, lw.g, lw.b, y, at(l_.ln_mean) + i * per(1), at(l_.ln_rstd) + i * per(1));
      u.noalias() = lw.w1 * y;
      u.colwise() += lw.b1;
      a.array() = gelu(u.array());
      MapM next = hs(i + 1, n);
      next = x;
      next.noalias() += lw.w2 * a;
      next.colwise() += lw.b2;
    }
    const Head hw = upcast_head(w);
    MapM fy(at(l_.fy), d, n), z(at(l_.probs), kVocab, n);
    layer_norm(hs(s_.depth, n), hw.g, hw.b, fy, at(l_.fmean), at(l_.frstd));
    z.noalias() = hw.w * fy;
    // Cross-entropy; the logits become probabilities for backward.
    double total = 0.0;
    for (int s = 0; s < n; ++s) {
      const float m = z.col(s).maxCoeff();
      const float lse = m + std::log((z.col(s).array() - m).exp().sum());
      total += static_cast<double>(lse - z(b.target[s], s));
      z.col(s) = (z.col(s).array() - lse).exp().matrix();
    }
    return total / n;
  }

  // Scales the fp32 gradient in the grad region by alpha and adds it into the slot.
  void emit(lm::GradSink& sink, lm::ParamId id, std::size_t count, float alpha) const {
    float* const g = at(l_.grad);
    MapV(g, static_cast<Eigen::Index>(count)) *= alpha;
    const lm::GradSlot slot = sink.open(id);
    cpu_device_ops().accumulate(slot.data, slot.dtype, g, DType::f32, count);
    sink.close(id);
  }

  // Activation gradients are those of the summed loss (O(1) per sample); alpha = scale / n
  // turns them into the scaled gradient of the mean as each param gradient is emitted.
  void backward(const lm::Weights& w, const lm::Batch& b, double grad_scale, lm::GradSink& sink) {
    const int n = b.size, c = s_.context, d = s_.width, h = s_.hidden, depth = s_.depth;
    const int head = depth + 1;
    const int lowest = lm::lowest_active_group(sink, depth);
    if (lowest > head) return;  // every group frozen
    const float alpha = static_cast<float>(grad_scale / n);
    using K = lm::ParamKind;

    MapM dz(at(l_.probs), kVocab, n);
    for (int s = 0; s < n; ++s) dz(b.target[s], s) -= 1.0f;
    const Head hw = upcast_head(w);
    MapM fy(at(l_.fy), d, n), dy(at(l_.dy), d, n), dh(at(l_.dh), d, n);
    float* const g = at(l_.grad);
    const bool head_active = sink.active(head);
    if (head_active) {
      MapR(g, kVocab, d).noalias() = dz * fy.transpose();
      emit(sink, {K::head_weight}, static_cast<std::size_t>(kVocab) * d, alpha);
    }
    dy.noalias() = hw.w.transpose() * dz;
    dh.setZero();
    MapM* const dh_in = lowest < head ? &dh : nullptr;
    // The final norm's weight and bias gradients go to the grad region side by side.
    layer_norm_backward(hs(depth, n), hw.g, at(l_.fmean), at(l_.frstd), dy,
                        head_active ? g : nullptr, dh_in);
    if (head_active) {
      emit_vector(sink, {K::final_norm_bias}, g, d, alpha);
      emit_vector(sink, {K::final_norm_weight}, g + d, d, alpha);
    }
    for (int i = depth - 1; i >= 0 && i + 1 >= lowest; --i) {
      const Layer lw = upcast_layer(w, i);
      const bool active = sink.active(i + 1);
      const MapM y(at(l_.ln_y) + i * per(d), d, n), u(at(l_.u) + i * per(h), h, n);
      MapM a(at(l_.a) + i * per(h), h, n), da(at(l_.da), h, n);
      if (active) {
        MapV(g, d) = dh.rowwise().sum();
        emit(sink, {K::fc2_bias, i}, static_cast<std::size_t>(d), alpha);
        MapR(g, d, h).noalias() = dh * a.transpose();
        emit(sink, {K::fc2_weight, i}, static_cast<std::size_t>(d) * h, alpha);
      }
      da.noalias() = lw.w2.transpose() * dh;
      // a is spent (fc2's weight gradient was its last use): it keeps the tanh, computed once.
      a.array() = gelu_tanh(u.array());
      da.array() *= gelu_grad(u.array(), a.array());
      if (active) {
        MapV(g, h) = da.rowwise().sum();
        emit(sink, {K::fc1_bias, i}, static_cast<std::size_t>(h), alpha);
        MapR(g, h, d).noalias() = da * y.transpose();
        emit(sink, {K::fc1_weight, i}, static_cast<std::size_t>(h) * d, alpha);
      }
      dy.noalias() = lw.w1.transpose() * da;
      MapM* const dx = i + 1 > lowest ? &dh : nullptr;  // the residual passes dh on unchanged
      layer_norm_backward(hs(i, n), lw.g, at(l_.ln_mean) + i * per(1), at(l_.ln_rstd) + i * per(1),
                          dy, active ? g : nullptr, dx);
      if (active) {
        emit_vector(sink, {K::norm_bias, i}, g, d, alpha);
        emit_vector(sink, {K::norm_weight, i}, g + d, d, alpha);
      }
    }
    if (lowest > 0) return;
    // Embedding: slot j's table gets, per row (byte), the sum of dh over the samples with that
    // byte in slot j; one table at a time through the grad region.
    const lm::GradSlot slot = sink.open({K::embed});
    const auto table = static_cast<std::size_t>(kVocab) * d;
    for (int j = 0; j < c; ++j) {
      MapR t(g, kVocab, d);
      t.setZero();
      for (int s = 0; s < n; ++s) t.row(b.context[s * c + j]) += dh.col(s).transpose();
      t *= alpha;
      cpu_device_ops().accumulate(
          static_cast<std::byte*>(slot.data) + j * table * dtype_size(slot.dtype), slot.dtype, g,
          DType::f32, table);
    }
    sink.close({K::embed});
  }

  // emit() for a vector that is not at the start of the grad region (layer_norm_backward
  // leaves two there).
  void emit_vector(lm::GradSink& sink, lm::ParamId id, float* v, int count, float alpha) const {
    MapV(v, count) *= alpha;
    const lm::GradSlot slot = sink.open(id);
    cpu_device_ops().accumulate(slot.data, slot.dtype, v, DType::f32, static_cast<std::size_t>(count));
    sink.close(id);
  }

  lm::Dims s_;
  int max_batch_;
  std::byte* mem_;
  CpuLayout l_;
};

// ---- the engine-facing model ----

// Hands the backend the engine's grad slots by param, checking each slot's dtype and size.
class EngineSink final : public lm::GradSink {
 public:
  EngineSink(Engine& engine, const ByteLmShape& shape, DType dtype)
      : engine_(engine), shape_(shape), dtype_(dtype) {
    active_.push_back(engine.is_active("embed"));
    for (int i = 0; i < shape.depth; ++i) active_.push_back(engine.is_active(layer_group(i)));
    active_.push_back(engine.is_active("head"));
  }
  bool active(int group) const override { return active_.at(static_cast<std::size_t>(group)); }
  lm::GradSlot open(lm::ParamId param) override {
    const auto name = param_name(param);
    slot_ = engine_.grad_slot(name);
    const auto numel = static_cast<std::size_t>(param_numel(shape_, param.kind));
    if (slot_.dtype() != dtype_ && slot_.dtype() != DType::f32)
      throw ConfigError(fmt::format(
          "ByteLm::train_step: the grad slot of '{}' is {}; this model writes {} or fp32 "
          "gradients",
          name, dtype_name(slot_.dtype()), dtype_name(dtype_)));
    if (slot_.count() != numel)
      throw ConfigError(fmt::format(
          "ByteLm::train_step: the grad slot of '{}' has {} elements, the model's param {}", name,
          slot_.count(), numel));
    return {slot_.raw(), slot_.dtype()};
  }
  void close(lm::ParamId param) override {
    engine_.grad_ready(param_name(param));
    slot_ = View();
  }

 private:
  Engine& engine_;
  const ByteLmShape& shape_;
  DType dtype_;
  std::vector<bool> active_;
  View slot_;  // the open slot, held until its gradient is complete
};

class EngineByteLm final : public ByteLm {
 public:
  EngineByteLm(const ByteLmShape& shape, int max_batch, DType dtype, Buffer memory)
      : shape_(shape), max_batch_(max_batch), dtype_(dtype), memory_(std::move(memory)) {}
  void set_compute(std::unique_ptr<lm::Compute> compute) { compute_ = std::move(compute); }

  double train_step(Engine& engine, const TokenBatch& batch) override {
    check(batch, "ByteLm::train_step");
    const lm::Weights w = weights(engine, "ByteLm::train_step");
    EngineSink sink(engine, shape_, dtype_);
    return compute_->train_step(w, {batch.size, batch.context.data(), batch.target.data()},
                                engine.loss_scale(), sink);
  }

  double loss(const Engine& engine, const TokenBatch& batch) override {
    check(batch, "ByteLm::loss");
    return compute_->loss(weights(engine, "ByteLm::loss"),
                          {batch.size, batch.context.data(), batch.target.data()});
  }

 private:
  void check(const TokenBatch& batch, const char* fn) const {
    if (batch.size < 1 || batch.size > max_batch_)
      throw ConfigError(fmt::format("{}: batch size {} is outside [1, max_batch = {}]", fn,
                                    batch.size, max_batch_));
    const auto n = static_cast<std::size_t>(batch.size);
    if (batch.context.size() != n * static_cast<std::size_t>(shape_.context) ||
        batch.target.size() != n)
      throw ConfigError(fmt::format(
          "{}: a batch of {} samples needs {} context bytes and {} targets, it has {} and {}", fn,
          n, n * static_cast<std::size_t>(shape_.context), n, batch.context.size(),
          batch.target.size()));
  }

  const void* weight(const Engine& engine, lm::ParamId id, const char* fn) const {
    const auto name = param_name(id);
    const View v = engine.weight(name);
    const auto numel = static_cast<std::size_t>(param_numel(shape_, id.kind));
    if (v.dtype() != dtype_ || v.count() != numel)
      throw ConfigError(fmt::format(
          "{}: weight '{}' is {} x {}; the model was made for {} x {} (ByteLm::declare and "
          "the engine's dtype)",
          fn, name, dtype_name(v.dtype()), v.count(), dtype_name(dtype_), numel));
    return v.raw();
  }

  lm::Weights weights(const Engine& engine, const char* fn) const {
    using K = lm::ParamKind;
    lm::Weights w;
    w.dtype = dtype_;
    w.embed = weight(engine, {K::embed}, fn);
    for (int i = 0; i < shape_.depth; ++i)
      w.layers.push_back(
          {weight(engine, {K::norm_weight, i}, fn), weight(engine, {K::norm_bias, i}, fn),
           weight(engine, {K::fc1_weight, i}, fn), weight(engine, {K::fc1_bias, i}, fn),
           weight(engine, {K::fc2_weight, i}, fn), weight(engine, {K::fc2_bias, i}, fn)});
    w.final_norm_weight = weight(engine, {K::final_norm_weight}, fn);
    w.final_norm_bias = weight(engine, {K::final_norm_bias}, fn);
    w.head_weight = weight(engine, {K::head_weight}, fn);
    return w;
  }

  ByteLmShape shape_;
  int max_batch_;
  DType dtype_;
  Buffer memory_;  // the activation block; outlives compute_
  std::unique_ptr<lm::Compute> compute_;
};

}  // namespace

void validate_byte_lm_shape(const ByteLmShape& s) {
  const std::pair<const char*, int> fields[] = {
      {"context", s.context}, {"width", s.width}, {"hidden", s.hidden}, {"depth", s.depth}};
  for (const auto& [name, value] : fields)
    if (value < 1)
      throw ConfigError(fmt::format(
          "validate_byte_lm_shape: ByteLmShape.{} = {} must be at least 1", name, value));
}

std::vector<std::string> byte_lm_groups(const ByteLmShape& shape) {
  std::vector<std::string> groups{"embed"};
  for (int i = 0; i < shape.depth; ++i) groups.push_back(layer_group(i));
  groups.emplace_back("head");
  return groups;
}

std::int64_t byte_lm_param_count(const ByteLmShape& shape) {
  std::int64_t total = 0;
  for (const auto& p : param_decls(shape)) total += param_numel(shape, p.id.kind);
  return total;
}

double byte_lm_step_flops(const ByteLmShape& s, int batch) {
  // Forward: fc1 and fc2 (2 d h each) per layer and the head (2 d 256) per sample; backward
  // twice that (input and weight gradients).
  const double d = s.width, h = s.hidden;
  const double forward = s.depth * 4.0 * d * h + 2.0 * d * kVocab;
  return 3.0 * forward * batch;
}

void ByteLm::declare(const ByteLmShape& shape, Engine& engine) {
  validate_byte_lm_shape(shape);
  for (auto& p : param_decls(shape)) engine.add_param(param_name(p.id), p.shape, p.group);
}

void ByteLm::init(const ByteLmShape& shape, const ParamInfo& param, std::span<float> values,
                  std::uint64_t seed) {
  const std::string_view name = param.name;
  std::mt19937_64 rng = lm::param_rng(name, seed);
  const auto uniform = [&](double bound) {
    for (auto& v : values) v = static_cast<float>(bound * (2.0 * lm::uniform01(rng) - 1.0));
  };
  if (name == "embed.weight") {
    for (auto& v : values) v = static_cast<float>(0.02 * lm::normal01(rng));
  } else if (ends_with(name, "norm.weight")) {  // layers.i.norm and final_norm
    std::fill(values.begin(), values.end(), 1.0f);
  } else if (ends_with(name, ".bias")) {
    std::fill(values.begin(), values.end(), 0.0f);
  } else if (ends_with(name, ".fc1.weight")) {
    uniform(1.0 / std::sqrt(static_cast<double>(shape.width)));
  } else if (ends_with(name, ".fc2.weight")) {
    uniform(1.0 / std::sqrt(static_cast<double>(shape.hidden)) / std::sqrt(2.0 * shape.depth));
  } else if (name == "head.weight") {
    uniform(1.0 / std::sqrt(static_cast<double>(shape.width)));
  } else {
    throw ConfigError(fmt::format("ByteLm::init: '{}' is not a param of the byte LM", name));
  }
}

std::int64_t ByteLm::activation_bytes(const ByteLmShape& shape, int max_batch, DType dtype,
                                      DeviceKind device) {
  validate_byte_lm_shape(shape);
  if (max_batch < 1)
    throw ConfigError(
        fmt::format("ByteLm::activation_bytes: max_batch = {} must be at least 1", max_batch));
  if (!is_bit16(dtype))
    throw ConfigError(
        fmt::format("ByteLm::activation_bytes: dtype {} is not bf16 or fp16", dtype_name(dtype)));
  const auto dims = dims_of(shape);
  const std::size_t bytes = device == DeviceKind::cuda ? lm::cuda_layout(dims, max_batch).bytes
                                                       : cpu_layout(dims, max_batch).bytes;
  return static_cast<std::int64_t>(bytes);
}

double measure_cublas_gemm_tflops(int m, int n, int k, DType dtype) {
  if (m < 1 || n < 1 || k < 1)
    throw ConfigError(
        fmt::format("measure_cublas_gemm_tflops: sizes {} x {} x {} must be positive", m, n, k));
  if (!is_bit16(dtype))
    throw ConfigError(
        fmt::format("measure_cublas_gemm_tflops: dtype {} is not bf16 or fp16", dtype_name(dtype)));
  return lm::cublas_gemm_tflops(m, n, k, dtype);
}

std::unique_ptr<ByteLm> make_byte_lm(const ByteLmShape& shape, int max_batch, DType dtype,
                                     MemorySpace& space) {
  const auto bytes = static_cast<std::size_t>(
      ByteLm::activation_bytes(shape, max_batch, dtype, space.device()));  // validates
  const bool cuda = space.device() == DeviceKind::cuda;
  Buffer memory = space.allocate(bytes, Tag::activation,
                                 fmt::format("byte LM activations (max_batch {})", max_batch));
  auto* const base = memory.as<std::byte>();
  auto model = std::make_unique<EngineByteLm>(shape, max_batch, dtype, std::move(memory));
  const auto dims = dims_of(shape);
  if (cuda)
    model->set_compute(lm::make_cuda_compute(dims, max_batch, dtype, base, bytes));
  else
    model->set_compute(std::make_unique<CpuCompute>(dims, max_batch, base));
  return model;
}

}  // namespace shardswap
