// The per-call scalars of the fused update, computed once on the host in double and rounded to
// fp32, so that every backend's kernel starts from the same bits. Plain structs without Eigen or
// fmt: the CUDA kernels take them by value.
#pragma once

namespace shardswap {

struct OptimizerConfig;
struct StepArgs;

/// Adam and AdamW with the bias corrections folded in as torch.optim.Adam does:
///   g = grad * grad_scale + l2 * master;  master -= lr_wd * master;
///   m = beta1 * m + one_minus_beta1 * g;  v = beta2 * v + one_minus_beta2 * g * g;
///   master -= step_size * m / (sqrt(v) * inv_sqrt_bc2 + eps).
/// Adam has lr_wd = 0 (L2 on the gradient), AdamW l2 = 0 (decoupled decay): with no weight decay
/// both terms add exactly zero, so the kernels need no branch.
struct AdamScalars {
  float beta1, one_minus_beta1, beta2, one_minus_beta2;
  float step_size;     ///< lr / (1 - beta1^step)
  float inv_sqrt_bc2;  ///< 1 / sqrt(1 - beta2^step)
  float eps, l2, lr_wd, grad_scale;
};

/// SGD as torch.optim.SGD: g = grad * grad_scale + wd * master; without momentum
/// master -= lr * g; with it, buf = g on the first step and momentum * buf +
/// one_minus_dampening * g after, then master -= lr * (nesterov ? g + momentum * buf : buf).
struct SgdScalars {
  float momentum, one_minus_dampening, lr, wd, grad_scale;
  bool has_momentum, first, nesterov;
};

AdamScalars adam_scalars(const OptimizerConfig& config, const StepArgs& args);
SgdScalars sgd_scalars(const OptimizerConfig& config, const StepArgs& args);

}  // namespace shardswap
