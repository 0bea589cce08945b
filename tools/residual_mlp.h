// The CPU quickstart model: a residual MLP regressing a fixed random teacher network.
//   h0 = W_in x;  h_{i+1} = h_i + W2_i tanh(W1_i h_i + b1_i);  y = W_out h_L;  loss = mean (y -
//   t)^2
// Each residual block is one layer group ("layers.i"); the input projection and the head are
// groups of their own. Forward and backward run in fp32 (Eigen) on the host, reading the engine's
// bit16 weights in place: this model needs the cpu backend.
#pragma once

#include <Eigen/Dense>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "engine/engine.h"

namespace shardswap {

struct MlpShape {
  int input_dim = 32;
  int width = 128;
  int hidden = 256;
  int depth = 4;
  int output_dim = 8;
};

class ResidualMlp {
 public:
  explicit ResidualMlp(MlpShape shape) : shape_(shape) {}

  /// Declares every param with its group.
  void declare(Engine& engine) const;
  /// Initial values: uniform(+-1/sqrt(fan_in)), residual outputs scaled down, biases zero.
  void init(const ParamInfo& param, std::span<float> values, std::uint64_t seed) const;
  /// Forward and backward on one micro-batch (inputs: input_dim x batch). Adds loss_scale times
  /// the gradient of the mean squared error into the engine's grad slots (head first, as
  /// backward produces them) and returns the unscaled loss.
  double train_step(Engine& engine, const Eigen::MatrixXf& x, const Eigen::MatrixXf& target);
  /// Loss only, no gradients.
  double loss(const Engine& engine, const Eigen::MatrixXf& x, const Eigen::MatrixXf& target) const;

  const MlpShape& shape() const { return shape_; }

 private:
  Eigen::MatrixXf weight(const Engine& engine, const std::string& name) const;
  void add_grad(Engine& engine, const std::string& name, const Eigen::MatrixXf& grad) const;
  MlpShape shape_;
};

/// The regression task: targets from a fixed random two-layer teacher plus noise.
class TeacherTask {
 public:
  TeacherTask(const MlpShape& shape, std::uint64_t seed, double noise);
  /// A batch for (rank, step): inputs input_dim x batch and targets output_dim x batch.
  void batch(int rank, std::int64_t step, int batch_size, Eigen::MatrixXf& x,
             Eigen::MatrixXf& target) const;

 private:
  std::uint64_t seed_;
  double noise_;
  Eigen::MatrixXf a1_, a2_;
};

}  // namespace shardswap
