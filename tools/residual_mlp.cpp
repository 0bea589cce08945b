#include "tools/residual_mlp.h"

#include <fmt/format.h>

#include <cmath>
#include <functional>

namespace shardswap {

namespace {

template <class T>
Eigen::MatrixXf upcast(const View& v, int rows, int cols) {
  using Bit16Matrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  return Eigen::Map<const Bit16Matrix>(v.data<T>(), rows, cols).template cast<float>();
}

template <class T>
void accumulate(const View& slot, const Eigen::MatrixXf& grad) {
  // Params are row-major [rows, cols]; Eigen's default is column-major.
  Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> g = grad;
  T* out = slot.data<T>();
  for (Eigen::Index i = 0; i < g.size(); ++i) out[i] = T(static_cast<float>(out[i]) + g.data()[i]);
}

}  // namespace

void ResidualMlp::declare(Engine& engine) const {
  const auto& s = shape_;
  engine.add_param("input.weight", {s.width, s.input_dim}, "input");
  for (int i = 0; i < s.depth; ++i) {
    const auto group = fmt::format("layers.{}", i);
    engine.add_param(group + ".fc1.weight", {s.hidden, s.width}, group);
    engine.add_param(group + ".fc1.bias", {s.hidden}, group);
    engine.add_param(group + ".fc2.weight", {s.width, s.hidden}, group);
  }
  engine.add_param("head.weight", {s.output_dim, s.width}, "head");
}

void ResidualMlp::init(const ParamInfo& param, std::span<float> values, std::uint64_t seed) const {
  if (param.shape.size() == 1) {  // biases
    std::fill(values.begin(), values.end(), 0.0f);
    return;
  }
  std::mt19937_64 rng(seed ^ std::hash<std::string>{}(param.name));
  const double fan_in = static_cast<double>(param.shape[1]);
  double bound = 1.0 / std::sqrt(fan_in);
  if (param.name.find("fc2") != std::string::npos) bound /= std::sqrt(2.0 * shape_.depth);
  std::uniform_real_distribution<double> u(-bound, bound);
  for (auto& v : values) v = static_cast<float>(u(rng));
}

Eigen::MatrixXf ResidualMlp::weight(const Engine& engine, const std::string& name) const {
  const View v = engine.weight(name);
  const auto& info = engine.params();
  int rows = 0, cols = 1;
  for (const auto& p : info)
    if (p.name == name) {
      rows = static_cast<int>(p.shape[0]);
      cols = p.shape.size() > 1 ? static_cast<int>(p.shape[1]) : 1;
    }
  return v.dtype() == DType::bf16 ? upcast<bf16_t>(v, rows, cols) : upcast<f16_t>(v, rows, cols);
}

void ResidualMlp::add_grad(Engine& engine, const std::string& name,
                           const Eigen::MatrixXf& grad) const {
  const View slot = engine.grad_slot(name);
  switch (slot.dtype()) {
    case DType::bf16:
      accumulate<bf16_t>(slot, grad);
      break;
    case DType::f16:
      accumulate<f16_t>(slot, grad);
      break;
    default:
      accumulate<float>(slot, grad);
      break;
  }
  engine.grad_ready(name);
}

double ResidualMlp::loss(const Engine& engine, const Eigen::MatrixXf& x,
                         const Eigen::MatrixXf& target) const {
  Eigen::MatrixXf h = weight(engine, "input.weight") * x;
  for (int i = 0; i < shape_.depth; ++i) {
    const auto g = fmt::format("layers.{}", i);
    Eigen::MatrixXf a =
        ((weight(engine, g + ".fc1.weight") * h).colwise() + weight(engine, g + ".fc1.bias").col(0))
            .array()
            .tanh()
            .matrix();
    h += weight(engine, g + ".fc2.weight") * a;
  }
  const Eigen::MatrixXf y = weight(engine, "head.weight") * h;
  return static_cast<double>((y - target).squaredNorm()) / static_cast<double>(y.size());
}

double ResidualMlp::train_step(Engine& engine, const Eigen::MatrixXf& x,
                               const Eigen::MatrixXf& target) {
  const int depth = shape_.depth;
  std::vector<Eigen::MatrixXf> hs{weight(engine, "input.weight") * x};
  std::vector<Eigen::MatrixXf> as, w1s, w2s;
  for (int i = 0; i < depth; ++i) {
    const auto g = fmt::format("layers.{}", i);
    w1s.push_back(weight(engine, g + ".fc1.weight"));
    w2s.push_back(weight(engine, g + ".fc2.weight"));
    Eigen::MatrixXf a =
        ((w1s.back() * hs.back()).colwise() + weight(engine, g + ".fc1.bias").col(0))
            .array()
            .tanh()
            .matrix();
    hs.push_back(hs.back() + w2s.back() * a);
    as.push_back(std::move(a));
  }
  const Eigen::MatrixXf w_out = weight(engine, "head.weight");
  const Eigen::MatrixXf y = w_out * hs.back();
  const Eigen::MatrixXf diff = y - target;
  const double loss = static_cast<double>(diff.squaredNorm()) / static_cast<double>(y.size());

  // Backward, emitting each group's gradients as soon as they are known (head first).
  const float scale = static_cast<float>(engine.loss_scale());
  const Eigen::MatrixXf dy = diff * (2.0f * scale / static_cast<float>(y.size()));
  if (engine.is_active("head")) add_grad(engine, "head.weight", dy * hs.back().transpose());
  Eigen::MatrixXf dh = w_out.transpose() * dy;
  for (int i = depth - 1; i >= 0; --i) {
    const auto g = fmt::format("layers.{}", i);
    const Eigen::MatrixXf du =
        ((w2s[i].transpose() * dh).array() * (1.0f - as[i].array().square())).matrix();
    if (engine.is_active(g)) {  // a frozen layer passes gradients through but keeps none
      add_grad(engine, g + ".fc2.weight", dh * as[i].transpose());
      add_grad(engine, g + ".fc1.bias", du.rowwise().sum());
      add_grad(engine, g + ".fc1.weight", du * hs[i].transpose());
    }
    dh += w1s[i].transpose() * du;
  }
  if (engine.is_active("input")) add_grad(engine, "input.weight", dh * x.transpose());
  return loss;
}

TeacherTask::TeacherTask(const MlpShape& shape, std::uint64_t seed, double noise)
    : seed_(seed), noise_(noise) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  const int hidden = 64;
  a1_ = Eigen::MatrixXf::NullaryExpr(hidden, shape.input_dim, [&] { return n(rng); }) /
        std::sqrt(static_cast<float>(shape.input_dim));
  a2_ = Eigen::MatrixXf::NullaryExpr(shape.output_dim, hidden, [&] { return n(rng); }) /
        std::sqrt(static_cast<float>(hidden));
}

void TeacherTask::batch(int rank, std::int64_t step, int batch_size, Eigen::MatrixXf& x,
                        Eigen::MatrixXf& target) const {
  std::mt19937_64 rng(seed_ * 1000003u + static_cast<std::uint64_t>(step) * 4099u +
                      static_cast<std::uint64_t>(rank));
  std::normal_distribution<float> n(0.0f, 1.0f);
  x = Eigen::MatrixXf::NullaryExpr(a1_.cols(), batch_size, [&] { return n(rng); });
  target = a2_ * (a1_ * x).array().tanh().matrix();
  target += Eigen::MatrixXf::NullaryExpr(target.rows(), target.cols(),
                                         [&] { return static_cast<float>(noise_) * n(rng); });
}

}  // namespace shardswap
