// Specification of optimizer/: the CPU update rules against an independent float64 reference
// (torch.optim formulas) and, bit for bit, against the CUDA kernels' per-element float arithmetic;
// HostUpdater against one cpu_device_ops().update; the casts and reductions against bit-level
// rounding written here, loss scaling and config validation.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "shardswap/dtype.h"
#include "shardswap/error.h"
#include "shardswap/loss_scaler.h"
#include "optimizer/host_updater.h"
#include "optimizer/master_split.h"
#include "optimizer/optimizer.h"
#include "optimizer/update_scalars.h"
#include "tests/catch_compat.h"

using namespace shardswap;

namespace {

// --- bit16 by hand, independent of Eigen ----------------------------------------------------

std::uint16_t round_bf16(float f) {
  const std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<std::uint16_t>((x >> 16) | 0x40);
  const std::uint32_t lsb = (x >> 16) & 1u;  // ties go to the even neighbour
  return static_cast<std::uint16_t>((x + 0x7FFFu + lsb) >> 16);
}

std::uint16_t round_f16(float f) {
  const std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  const auto sign = static_cast<std::uint16_t>((x >> 16) & 0x8000u);
  const std::uint32_t abs = x & 0x7FFFFFFFu;
  if (abs > 0x7F800000u) return sign | 0x7E00;  // NaN
  const int exp = static_cast<int>(abs >> 23) - 127;
  std::uint32_t mant = abs & 0x7FFFFFu;
  if (exp > 15) return sign | 0x7C00;  // Inf, or finite beyond the fp16 range
  auto round_shift = [](std::uint32_t m, int shift) {
    const std::uint32_t kept = m >> shift;
    const std::uint32_t rest = m & ((1u << shift) - 1);
    const std::uint32_t half = 1u << (shift - 1);
    return kept + ((rest > half || (rest == half && (kept & 1u))) ? 1u : 0u);
  };
  if (exp >= -14) {  // normal; a carry out of the mantissa correctly bumps the exponent (or to Inf)
    const std::uint32_t h = (static_cast<std::uint32_t>(exp + 15) << 10) | (mant >> 13);
    const std::uint32_t rest = mant & 0x1FFFu;
    const bool up = rest > 0x1000u || (rest == 0x1000u && (h & 1u));
    return sign | static_cast<std::uint16_t>(h + (up ? 1 : 0));
  }
  if (exp < -25) return sign;  // below half the smallest subnormal
  mant |= 0x800000u;           // subnormal: value / 2^-24 = mant * 2^(exp + 1)
  return sign | static_cast<std::uint16_t>(round_shift(mant, -(exp + 1)));
}

double decode_bf16(std::uint16_t b) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16);
}

double decode_f16(std::uint16_t b) {
  const double sign = (b & 0x8000) ? -1.0 : 1.0;
  const int exp = (b >> 10) & 0x1F;
  const int mant = b & 0x3FF;
  if (exp == 0x1F) return mant ? std::numeric_limits<double>::quiet_NaN() : sign * INFINITY;
  if (exp == 0) return sign * std::ldexp(mant, -24);
  return sign * std::ldexp(1024 + mant, exp - 25);
}

std::uint16_t round_to(DType d, float f) {
  return d == DType::bf16 ? round_bf16(f) : round_f16(f);
}
double decode(DType d, std::uint16_t b) {
  return d == DType::bf16 ? decode_bf16(b) : decode_f16(b);
}

const DType bit16_types[] = {DType::bf16, DType::f16};
const DType any_types[] = {DType::f32, DType::bf16, DType::f16};

// Host data of fp32, bf16 or fp16, rounded by this file's functions.
class Data {
 public:
  Data(DType dtype, std::size_t n) : dtype_(dtype), bytes_(n * dtype_size(dtype)) {}
  DType dtype() const { return dtype_; }
  std::size_t size() const { return bytes_.size() / dtype_size(dtype_); }
  void* data() { return bytes_.data(); }
  const void* data() const { return bytes_.data(); }

  std::uint32_t bits(std::size_t i) const {
    if (dtype_ == DType::f32) {
      std::uint32_t b;
      std::memcpy(&b, bytes_.data() + 4 * i, 4);
      return b;
    }
    std::uint16_t b;
    std::memcpy(&b, bytes_.data() + 2 * i, 2);
    return b;
  }
  void set_bits(std::size_t i, std::uint32_t b) {
    if (dtype_ == DType::f32) {
      std::memcpy(bytes_.data() + 4 * i, &b, 4);
    } else {
      const auto h = static_cast<std::uint16_t>(b);
      std::memcpy(bytes_.data() + 2 * i, &h, 2);
    }
  }
  /// The exact value.
  double value(std::size_t i) const {
    return dtype_ == DType::f32 ? std::bit_cast<float>(bits(i))
                                : decode(dtype_, static_cast<std::uint16_t>(bits(i)));
  }
  /// Stores f rounded to nearest even (exactly for fp32).
  void set(std::size_t i, float f) { set_bits(i, encode(dtype_, f)); }

  static std::uint32_t encode(DType d, float f) {
    return d == DType::f32 ? std::bit_cast<std::uint32_t>(f) : round_to(d, f);
  }

 private:
  DType dtype_;
  std::vector<unsigned char> bytes_;
};

// Values in +-[lo, hi]: random sign, never near zero.
std::vector<float> random_values(std::mt19937& rng, std::size_t n, float lo, float hi) {
  std::uniform_real_distribution<float> mag(lo, hi);
  std::bernoulli_distribution negative(0.5);
  std::vector<float> v(n);
  for (float& x : v) x = negative(rng) ? -mag(rng) : mag(rng);
  return v;
}

std::vector<std::uint16_t> random_bit16(std::mt19937& rng, DType d, std::size_t n, float lo,
                                        float hi) {
  std::vector<std::uint16_t> out;
  for (float x : random_values(rng, n, lo, hi)) out.push_back(round_to(d, x));
  return out;
}

Data random_typed(std::mt19937& rng, DType d, std::size_t n, float lo, float hi) {
  Data out(d, n);
  const std::vector<float> v = random_values(rng, n, lo, hi);
  for (std::size_t i = 0; i < n; ++i) out.set(i, v[i]);
  return out;
}

double normalized_error(const std::vector<float>& x, const std::vector<double>& ref) {
  double diff = 0, norm = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    diff += (x[i] - ref[i]) * (x[i] - ref[i]);
    norm += ref[i] * ref[i];
  }
  return std::sqrt(diff / norm);
}

// --- float64 reference of torch.optim, in its textbook form ---------------------------------

struct Reference {
  OptimizerConfig config;
  std::vector<double> master, state0, state1;

  void step(std::int64_t step, double lr, double wd, const std::vector<double>& grad) {
    const auto t = static_cast<double>(step);
    for (std::size_t i = 0; i < master.size(); ++i) {
      double g = grad[i];
      double& p = master[i];
      if (config.type == OptimizerType::sgd) {
        if (wd != 0) g += wd * p;
        double d = g;
        if (config.momentum != 0) {
          double& buf = state0[i];
          buf = step == 1 ? g : config.momentum * buf + (1 - config.dampening) * g;
          d = config.nesterov ? g + config.momentum * buf : buf;
        }
        p -= lr * d;
        continue;
      }
      if (config.type == OptimizerType::adamw) {
        p -= lr * wd * p;
      } else if (wd != 0) {
        g += wd * p;
      }
      double& m = state0[i];
      double& v = state1[i];
      m = config.beta1 * m + (1 - config.beta1) * g;
      v = config.beta2 * v + (1 - config.beta2) * g * g;
      const double mhat = m / (1 - std::pow(config.beta1, t));
      const double vhat = v / (1 - std::pow(config.beta2, t));
      p -= lr * mhat / (std::sqrt(vhat) + config.eps);
    }
  }
};

// Runs 20 steps of the CPU kernel and of the reference on the same random gradients (of the
// param's bit16 type and fp32, for bf16 and fp16 params) and checks, after every step, the master
// and state against the reference and the bit16 param against the kernel's own master rounded to
// nearest even.
void check_against_reference(const OptimizerConfig& config, double lr, double wd) {
  config.validate();
  for (DType dtype : bit16_types)
    for (DType grad_dtype : {dtype, DType::f32}) {
      INFO("param dtype " << dtype_name(dtype) << ", grad dtype " << dtype_name(grad_dtype));
      constexpr std::size_t n = 1031;  // not a multiple of any vector width
      constexpr float grad_scale = 0.37f;
      std::mt19937 rng(1234);
      const int slots = config.state_slots();

      std::vector<float> master = random_values(rng, n, 0.05f, 1.0f);
      std::vector<float> state0(slots >= 1 ? n : 0, 0.0f), state1(slots >= 2 ? n : 0, 0.0f);
      std::vector<std::uint16_t> param(n, 0);
      Reference ref{config, std::vector<double>(master.begin(), master.end()),
                    std::vector<double>(n, 0.0), std::vector<double>(n, 0.0)};

      for (std::int64_t step = 1; step <= 20; ++step) {
        INFO("step " << step);
        const Data grad = random_typed(rng, grad_dtype, n, 0.01f, 2.0f);
        std::vector<double> ref_grad(n);
        for (std::size_t i = 0; i < n; ++i) ref_grad[i] = grad.value(i) * grad_scale;
        ref.step(step, lr, wd, ref_grad);

        const ShardTensors t{master.data(),
                             slots >= 1 ? state0.data() : nullptr,
                             slots >= 2 ? state1.data() : nullptr,
                             grad.data(),
                             param.data(),
                             dtype,
                             grad_dtype,
                             n};
        cpu_device_ops().update(config, StepArgs{step, lr, wd, grad_scale}, t);

        CHECK(normalized_error(master, ref.master) <= 1e-6);
        if (slots >= 1) CHECK(normalized_error(state0, ref.state0) <= 1e-6);
        if (slots >= 2) CHECK(normalized_error(state1, ref.state1) <= 1e-6);
        std::size_t misrounded = 0;
        for (std::size_t i = 0; i < n; ++i) misrounded += param[i] != round_to(dtype, master[i]);
        CHECK(misrounded == 0);
      }
    }
}

// --- the update of one element, one float rounding per operation ---------------------------

// Each operation alone, rounded to float, out of line: no build of this file can fuse a multiply
// into the add after it (an FMA under -march=native and GCC's default -ffp-contract=fast), as the
// CUDA kernels' __fmul_rn and __fadd_rn never do.
[[gnu::noinline]] float mul_rn(float a, float b) {
  return a * b;
}
[[gnu::noinline]] float add_rn(float a, float b) {
  return a + b;
}
[[gnu::noinline]] float sub_rn(float a, float b) {
  return a - b;
}
[[gnu::noinline]] float div_rn(float a, float b) {
  return a / b;
}
[[gnu::noinline]] float sqrt_rn(float a) {
  return std::sqrt(a);
}

// adam_element and sgd_element of optimizer/cuda/kernels.cu, written again in plain C++.
void adam_element(const AdamScalars& s, float grad, float& p, float& m, float& v) {
  const float g = add_rn(mul_rn(grad, s.grad_scale), mul_rn(s.l2, p));
  p = sub_rn(p, mul_rn(s.lr_wd, p));
  m = add_rn(mul_rn(s.beta1, m), mul_rn(s.one_minus_beta1, g));
  v = add_rn(mul_rn(s.beta2, v), mul_rn(mul_rn(s.one_minus_beta2, g), g));
  const float denom = add_rn(mul_rn(sqrt_rn(v), s.inv_sqrt_bc2), s.eps);
  p = sub_rn(p, div_rn(mul_rn(s.step_size, m), denom));
}

void sgd_element(const SgdScalars& s, float grad, float& p, float& buf) {
  const float g = add_rn(mul_rn(grad, s.grad_scale), mul_rn(s.wd, p));
  if (!s.has_momentum) {
    p = sub_rn(p, mul_rn(s.lr, g));
    return;
  }
  buf = s.first ? g : add_rn(mul_rn(s.momentum, buf), mul_rn(s.one_minus_dampening, g));
  p = sub_rn(p, mul_rn(s.lr, s.nesterov ? add_rn(g, mul_rn(s.momentum, buf)) : buf));
}

// Elements [from, end) whose bits differ.
std::size_t bit_mismatches(const std::vector<float>& got, const std::vector<float>& ref,
                           std::size_t from = 0) {
  std::size_t wrong = 0;
  for (std::size_t i = from; i < ref.size(); ++i)
    wrong += std::bit_cast<std::uint32_t>(got[i]) != std::bit_cast<std::uint32_t>(ref[i]);
  return wrong;
}

// Runs 5 CPU updates and the per-element reference from the same random master, state and
// gradients, and requires the same bits after every step: master, state and bit16 param. For
// both bit16 types and both gradient types, on lengths whose tails fall after 4-, 8- and 16-wide
// vectors and after the kernel's 512-element chunks, from a vector-aligned start or not.
void check_bits_of_reference(const OptimizerConfig& config, double lr, double wd) {
  config.validate();
  const int slots = config.state_slots();
  for (DType dtype : bit16_types)
    for (DType grad_dtype : {dtype, DType::f32})
      for (std::size_t n : {1, 15, 17, 513, 1031})
        for (std::size_t at : {0, 1}) {
          INFO("param dtype " << dtype_name(dtype) << ", grad dtype " << dtype_name(grad_dtype)
                              << ", " << n << " elements from element " << at);
          std::mt19937 rng(4321);
          std::vector<float> master = random_values(rng, at + n, 0.05f, 1.0f);
          std::vector<float> state0 = random_values(rng, at + n, 1e-4f, 1e-2f);
          std::vector<float> state1 = random_values(rng, at + n, 1e-6f, 1e-4f);
          for (float& x : state1) x = std::abs(x);  // Adam's second moment
          std::vector<std::uint16_t> param(at + n, 0);
          std::vector<float> ref_master = master, ref0 = state0, ref1 = state1;
          for (std::int64_t step = 1; step <= 5; ++step) {
            INFO("step " << step);
            const Data grad = random_typed(rng, grad_dtype, at + n, 0.01f, 2.0f);
            const StepArgs args{step, lr, wd, 0.37f};
            cpu_device_ops().update(
                config, args,
                ShardTensors{
                    master.data() + at, slots >= 1 ? state0.data() + at : nullptr,
                    slots >= 2 ? state1.data() + at : nullptr,
                    static_cast<const unsigned char*>(grad.data()) + at * dtype_size(grad_dtype),
                    param.data() + at, dtype, grad_dtype, n});
            for (std::size_t i = at; i < at + n; ++i) {
              const auto g = static_cast<float>(grad.value(i));
              if (config.type == OptimizerType::sgd) {
                sgd_element(sgd_scalars(config, args), g, ref_master[i], ref0[i]);
              } else {
                adam_element(adam_scalars(config, args), g, ref_master[i], ref0[i], ref1[i]);
              }
            }
            CHECK(bit_mismatches(master, ref_master, at) == 0);
            if (slots >= 1) CHECK(bit_mismatches(state0, ref0, at) == 0);
            if (slots >= 2) CHECK(bit_mismatches(state1, ref1, at) == 0);
            std::size_t misrounded = 0;
            for (std::size_t i = at; i < at + n; ++i)
              misrounded += param[i] != round_to(dtype, ref_master[i]);
            CHECK(misrounded == 0);
          }
        }
}

// A shard of random host data for HostUpdater against cpu_device_ops().update: both state slots
// are present whatever the rule (one that needs fewer ignores them).
struct HostShard {
  DType dtype;
  std::vector<float> master, state0, state1;
  Data grad;
  std::vector<std::uint16_t> param;

  HostShard(std::mt19937& rng, DType param_dtype, DType grad_dtype, std::size_t n)
      : dtype(param_dtype),
        master(random_values(rng, n, 0.05f, 1.0f)),
        state0(random_values(rng, n, 1e-4f, 1e-2f)),
        state1(random_values(rng, n, 1e-6f, 1e-4f)),
        grad(random_typed(rng, grad_dtype, n, 0.01f, 2.0f)),
        param(n, 0) {
    for (float& x : state1) x = std::abs(x);
  }
  ShardTensors tensors() {
    return {master.data(), state0.data(), state1.data(), grad.data(),
            param.data(),  dtype,         grad.dtype(),  master.size()};
  }
  bool same_bits(const HostShard& o) const {
    return bit_mismatches(master, o.master) == 0 && bit_mismatches(state0, o.state0) == 0 &&
           bit_mismatches(state1, o.state1) == 0 && param == o.param;
  }
};

OptimizerConfig make(OptimizerType type) {
  OptimizerConfig c;
  c.type = type;
  return c;
}

OptimizerConfig sgd(double momentum, double dampening, bool nesterov) {
  OptimizerConfig c = make(OptimizerType::sgd);
  c.momentum = momentum;
  c.dampening = dampening;
  c.nesterov = nesterov;
  return c;
}

}  // namespace

// --- update rules ---------------------------------------------------------------------------

TEST_CASE("Adam matches the float64 reference over 20 steps") {
  check_against_reference(make(OptimizerType::adam), 1e-2, 0.0);
}

TEST_CASE("Adam with weight decay adds the L2 term to the gradient") {
  check_against_reference(make(OptimizerType::adam), 1e-2, 0.1);
}

TEST_CASE("AdamW matches the float64 reference over 20 steps without weight decay") {
  check_against_reference(make(OptimizerType::adamw), 1e-2, 0.0);
}

TEST_CASE("AdamW decays the master weights decoupled from the gradient") {
  check_against_reference(make(OptimizerType::adamw), 1e-2, 0.1);
}

TEST_CASE("Adam with beta1 = 0 and a large eps follows the reference") {
  OptimizerConfig c = make(OptimizerType::adam);
  c.beta1 = 0.0;
  c.beta2 = 0.95;
  c.eps = 1e-3;
  check_against_reference(c, 1e-2, 0.0);
}

TEST_CASE("plain SGD matches the float64 reference and needs no state") {
  check_against_reference(sgd(0.0, 0.0, false), 0.05, 0.0);
}

TEST_CASE("plain SGD with weight decay adds the L2 term to the gradient") {
  check_against_reference(sgd(0.0, 0.0, false), 0.05, 0.01);
}

TEST_CASE("SGD with momentum starts the buffer at the first gradient") {
  check_against_reference(sgd(0.9, 0.0, false), 0.05, 0.0);
}

TEST_CASE("SGD with momentum and weight decay follows the reference") {
  check_against_reference(sgd(0.9, 0.0, false), 0.05, 0.01);
}

TEST_CASE("SGD with nesterov momentum looks ahead along the buffer") {
  check_against_reference(sgd(0.9, 0.0, true), 0.05, 0.0);
}

TEST_CASE("SGD with nesterov momentum and weight decay follows the reference") {
  check_against_reference(sgd(0.9, 0.0, true), 0.05, 0.01);
}

TEST_CASE("SGD with dampening scales new gradients from the second step on") {
  check_against_reference(sgd(0.8, 0.3, false), 0.05, 0.01);
}

TEST_CASE("grad_scale multiplies every upcast gradient") {
  for (DType dtype : bit16_types) {
    INFO("dtype " << dtype_name(dtype));
    const std::vector<std::uint16_t> grad = {round_to(dtype, 1.5f), round_to(dtype, -0.75f),
                                             round_to(dtype, 3.0f)};
    std::vector<float> master(3, 0.0f);
    std::vector<std::uint16_t> param(3);
    cpu_device_ops().update(
        sgd(0.0, 0.0, false), StepArgs{1, 1.0, 0.0, 0.25f},
        ShardTensors{master.data(), nullptr, nullptr, grad.data(), param.data(), dtype, dtype, 3});
    CHECK(master == std::vector<float>{-0.375f, 0.1875f, -0.75f});
  }
}

TEST_CASE("fp32 gradients enter the update at full precision, never rounded to bit16") {
  for (DType dtype : bit16_types) {
    INFO("param dtype " << dtype_name(dtype));
    const std::vector<float> grad = {1.0f + 0x1p-20f, -3.0f - 0x1p-18f};  // not bit16 values
    std::vector<float> master(2, 0.0f);
    std::vector<std::uint16_t> param(2);
    cpu_device_ops().update(sgd(0.0, 0.0, false), StepArgs{1, 1.0, 0.0, 0.5f},
                         ShardTensors{master.data(), nullptr, nullptr, grad.data(), param.data(),
                                      dtype, DType::f32, 2});
    CHECK(master == std::vector<float>{-0.5f - 0x1p-21f, 1.5f + 0x1p-19f});
    CHECK(param[0] == round_to(dtype, master[0]));
    CHECK(param[1] == round_to(dtype, master[1]));
  }
}

// --- the bits of the update: what the CUDA kernels compute --------------------------------

TEST_CASE("Adam's CPU update rounds each operation as the CUDA kernel does, bit for bit") {
  check_bits_of_reference(make(OptimizerType::adam), 1e-2, 0.0);
  check_bits_of_reference(make(OptimizerType::adam), 1e-2, 0.1);
  OptimizerConfig c = make(OptimizerType::adam);
  c.beta1 = 0.0;
  c.beta2 = 0.95;
  c.eps = 1e-3;
  check_bits_of_reference(c, 1e-2, 0.0);
}

TEST_CASE("AdamW's CPU update rounds each operation as the CUDA kernel does, bit for bit") {
  check_bits_of_reference(make(OptimizerType::adamw), 1e-2, 0.0);
  check_bits_of_reference(make(OptimizerType::adamw), 1e-2, 0.1);
}

TEST_CASE("SGD's CPU update rounds each operation as the CUDA kernel does, bit for bit") {
  check_bits_of_reference(sgd(0.0, 0.0, false), 0.05, 0.01);
  check_bits_of_reference(sgd(0.9, 0.0, false), 0.05, 0.01);
  check_bits_of_reference(sgd(0.9, 0.0, true), 0.05, 0.01);
  check_bits_of_reference(sgd(0.8, 0.3, false), 0.05, 0.01);
}

TEST_CASE("the backends are named") {
  CHECK(std::string(cpu_device_ops().name) == "cpu");
  CHECK_NOTHROW(cpu_device_ops().synchronize());
}

TEST_CASE("an update of zero elements touches nothing") {
  for (DType dtype : bit16_types) {
    for (OptimizerType type : {OptimizerType::adam, OptimizerType::adamw, OptimizerType::sgd}) {
      CHECK_NOTHROW(cpu_device_ops().update(
          make(type), StepArgs{},
          ShardTensors{nullptr, nullptr, nullptr, nullptr, nullptr, dtype, DType::f32, 0}));
    }
  }
}

TEST_CASE(
    "update rejects a param dtype that is not bit16, an fp64 gradient, a missing state slot and "
    "step 0") {
  float master = 1, m = 0;
  std::uint16_t grad = 0, param = 0;
  const ShardTensors no_v{&master, &m, nullptr, &grad, &param, DType::bf16, DType::bf16, 1};
  CHECK(test::contains(test::message_of<ConfigError>([&] {
                         cpu_device_ops().update(make(OptimizerType::adam), StepArgs{}, no_v);
                       }),
                       "state1"));
  ShardTensors f32 = no_v;
  f32.dtype = DType::f32;
  CHECK(test::contains(test::message_of<ConfigError>([&] {
                         cpu_device_ops().update(make(OptimizerType::sgd), StepArgs{}, f32);
                       }),
                       "fp32"));
  const ShardTensors plain{&master, nullptr, nullptr, &grad, &param, DType::bf16, DType::bf16, 1};
  CHECK(test::contains(test::message_of<ConfigError>([&] {
                         cpu_device_ops().update(make(OptimizerType::sgd), StepArgs{0}, plain);
                       }),
                       "step = 0"));
  ShardTensors f64_grad = plain;
  f64_grad.grad_dtype = DType::f64;
  CHECK(test::contains(test::message_of<ConfigError>([&] {
                         cpu_device_ops().update(make(OptimizerType::sgd), StepArgs{}, f64_grad);
                       }),
                       "fp64"));
}

TEST_CASE("update refuses gradients of the other bit16 type instead of misreading them") {
  float master = 1;
  std::uint16_t grad = 0, param = 0;
  for (DType dtype : bit16_types) {
    const DType other = dtype == DType::bf16 ? DType::f16 : DType::bf16;
    const ShardTensors t{&master, nullptr, nullptr, &grad, &param, dtype, other, 1};
    const std::string msg = test::message_of<ConfigError>(
        [&] { cpu_device_ops().update(make(OptimizerType::sgd), StepArgs{}, t); });
    INFO(msg);
    CHECK(test::contains(msg, "cpu_device_ops().update: grad dtype"));
    CHECK(test::contains(msg, dtype_name(other)));
  }
}

// --- HostUpdater: the update of host shards over a pool of threads ------------------------

TEST_CASE("HostUpdater with 1, 2, 3 or 7 threads gives the bits of one cpu_device_ops().update") {
  const OptimizerConfig rules[] = {make(OptimizerType::adam), make(OptimizerType::adamw),
                                   sgd(0.9, 0.0, true)};
  const std::size_t lengths[] = {1, 63, 64, 65, 100003, std::size_t{1} << 20};
  std::vector<std::unique_ptr<HostUpdater>> updaters;
  for (unsigned threads : {1u, 2u, 3u, 7u})
    updaters.push_back(std::make_unique<HostUpdater>(threads));
  for (const OptimizerConfig& config : rules)
    for (std::size_t n : lengths)
      for (DType dtype : bit16_types) {
        const DType grad_dtype = dtype == DType::bf16 ? DType::bf16 : DType::f32;
        INFO(optimizer_type_name(config.type)
             << ", " << n << " elements, param dtype " << dtype_name(dtype));
        std::mt19937 rng(99);
        const HostShard start(rng, dtype, grad_dtype, n);
        HostShard expected = start;
        for (std::int64_t step = 1; step <= 2; ++step)
          cpu_device_ops().update(config, StepArgs{step, 1e-2, 0.1, 0.37f}, expected.tensors());
        for (const auto& updater : updaters) {
          INFO(updater->threads() << " threads");
          HostShard got = start;
          for (std::int64_t step = 1; step <= 2; ++step)
            updater->update(config, StepArgs{step, 1e-2, 0.1, 0.37f}, got.tensors());
          CHECK(got.same_bits(expected));
        }
      }
}

TEST_CASE("HostUpdater uses every hardware thread when asked for 0") {
  CHECK(HostUpdater().threads() == std::max(1u, std::thread::hardware_concurrency()));
  CHECK(HostUpdater(5).threads() == 5);
}

TEST_CASE(
    "HostUpdaters destroyed right after an update, on several threads at once, lose nothing") {
  const OptimizerConfig config = make(OptimizerType::adamw);
  std::mt19937 rng(5);
  const HostShard start(rng, DType::bf16, DType::bf16, 300001);
  HostShard expected = start;
  cpu_device_ops().update(config, StepArgs{}, expected.tensors());
  // Catch2's checks are not thread-safe: each thread counts its wrong results.
  std::vector<int> wrong(4, 0);
  std::vector<std::thread> callers;
  for (unsigned c = 0; c < wrong.size(); ++c) {
    callers.emplace_back([&, c] {
      for (int round = 0; round < 10; ++round) {
        HostShard got = start;
        HostUpdater(c + 2).update(config, StepArgs{}, got.tensors());
        wrong[c] += !got.same_bits(expected);
      }
    });
  }
  for (std::thread& caller : callers) caller.join();
  CHECK(wrong == std::vector<int>(wrong.size(), 0));
}

TEST_CASE("HostUpdater refuses what cpu_device_ops().update refuses, before changing anything") {
  std::mt19937 rng(6);
  const HostShard start(rng, DType::bf16, DType::bf16, std::size_t{1} << 20);
  HostShard shard = start;
  HostUpdater updater(3);
  const auto refused = [&](const OptimizerConfig& config, const StepArgs& args,
                           const ShardTensors& t) {
    return test::message_of<ConfigError>([&] { updater.update(config, args, t); });
  };
  ShardTensors no_v = shard.tensors();
  no_v.state1 = nullptr;
  CHECK(refused(make(OptimizerType::adam), StepArgs{}, no_v) ==
        "HostUpdater::update: state1 is null for 1048576 elements of a shard");
  CHECK(test::contains(refused(make(OptimizerType::adamw), StepArgs{0}, shard.tensors()),
                       "step = 0"));
  ShardTensors f16_grad = shard.tensors();
  f16_grad.grad_dtype = DType::f16;
  CHECK(test::contains(refused(make(OptimizerType::sgd), StepArgs{}, f16_grad),
                       "grad dtype fp16 does not go with param dtype bf16"));
  ShardTensors f32_param = shard.tensors();
  f32_param.dtype = DType::f32;
  CHECK(test::contains(refused(make(OptimizerType::sgd), StepArgs{}, f32_param), "fp32"));
  CHECK(shard.same_bits(start));
  CHECK_NOTHROW(updater.update(
      make(OptimizerType::adam), StepArgs{},
      ShardTensors{nullptr, nullptr, nullptr, nullptr, nullptr, DType::bf16, DType::bf16, 0}));
}

TEST_CASE("an exception in a pool thread reaches the caller after every part has finished") {
  ForkJoinPool pool(4);
  std::vector<int> done(4, 0);
  const auto work = [&](unsigned part) {
    if (part == 2 || part == 3) throw std::runtime_error("part " + std::to_string(part));
    done[part] = 1;
  };
  CHECK(test::message_of<std::runtime_error>([&] { pool.run(4, work); }) == "part 2");
  CHECK(done == std::vector<int>{1, 1, 0, 0});
  std::vector<int> again(4, 0);
  pool.run(3, [&](unsigned part) { again[part] = 1; });  // the pool still runs jobs
  CHECK(again == std::vector<int>{1, 1, 1, 0});
}

// --- reductions, casts and copies -----------------------------------------------------------

// sum_squares of one span.
double squares_of(const void* data, DType dtype, std::size_t count, double scale) {
  const ConstSpan span{data, count};
  double sum = -1.0;
  cpu_device_ops().sum_squares(&span, 1, dtype, scale, &sum);
  return sum;
}

TEST_CASE("sum_squares accumulates the scaled upcast values in double") {
  for (DType dtype : bit16_types) {
    INFO("dtype " << dtype_name(dtype));
    std::mt19937 rng(7);
    const std::vector<std::uint16_t> x = random_bit16(rng, dtype, 4099, 1e-3f, 100.0f);
    const double scale = 1.0 / 4096.0 / 3.0;
    double expected = 0;
    for (std::uint16_t b : x) expected += (decode(dtype, b) * scale) * (decode(dtype, b) * scale);
    const double got = squares_of(x.data(), dtype, x.size(), scale);
    CHECK(std::abs(got - expected) <= 1e-12 * expected);
    CHECK(squares_of(nullptr, dtype, 0, scale) == 0.0);
  }
}

TEST_CASE("sum_squares of fp32 data accumulates the scaled values in double") {
  std::mt19937 rng(8);
  const std::vector<float> x = random_values(rng, 4099, 1e-3f, 100.0f);
  const double scale = 1.0 / 4096.0 / 3.0;
  double expected = 0;
  for (float f : x) expected += (static_cast<double>(f) * scale) * (static_cast<double>(f) * scale);
  const double got = squares_of(x.data(), DType::f32, x.size(), scale);
  CHECK(std::abs(got - expected) <= 1e-12 * expected);
  CHECK(squares_of(nullptr, DType::f32, 0, scale) == 0.0);
}

TEST_CASE("sum_squares is not finite when the data holds an Inf or a NaN") {
  for (DType dtype : any_types) {
    INFO("dtype " << dtype_name(dtype));
    std::mt19937 rng(9);
    Data x = random_typed(rng, dtype, 100, 1e-3f, 10.0f);
    x.set(37, INFINITY);
    CHECK_FALSE(std::isfinite(squares_of(x.data(), dtype, x.size(), 1.0)));
    x.set(37, NAN);
    CHECK(std::isnan(squares_of(x.data(), dtype, x.size(), 1.0)));
  }
}

TEST_CASE("sum_squares gives each span its own sum, and a null span changes no sum") {
  std::mt19937 rng(11);
  const double scale = 1.0 / 4096.0;
  std::vector<Data> data;
  for (std::size_t n : {std::size_t{5}, std::size_t{0}, std::size_t{4099}, std::size_t{1}})
    data.push_back(random_typed(rng, DType::bf16, n, 1e-3f, 100.0f));
  std::vector<ConstSpan> spans;
  for (const Data& x : data) spans.push_back({x.data(), x.size()});
  std::vector<double> sums(spans.size(), -1.0);
  cpu_device_ops().sum_squares(spans.data(), spans.size(), DType::bf16, scale, sums.data());
  for (std::size_t i = 0; i < spans.size(); ++i) {
    INFO("span " << i);
    CHECK(sums[i] == squares_of(data[i].data(), DType::bf16, data[i].size(), scale));
  }
  CHECK(sums[1] == 0.0);
  CHECK(sums[2] > 0.0);

  spans[2].data = nullptr;
  std::fill(sums.begin(), sums.end(), -1.0);
  CHECK(test::contains(test::message_of<ConfigError>([&] {
                         cpu_device_ops().sum_squares(spans.data(), spans.size(), DType::bf16,
                                                      scale, sums.data());
                       }),
                       "spans[2].data is null for 4099 elements"));
  for (double s : sums) CHECK(s == -1.0);  // refused before any sum was written
  CHECK(test::contains(test::message_of<ConfigError>([&] {
                         cpu_device_ops().sum_squares(nullptr, 2, DType::bf16, scale, sums.data());
                       }),
                       "spans is null for 2 spans"));
  CHECK_NOTHROW(cpu_device_ops().sum_squares(nullptr, 0, DType::bf16, scale, nullptr));
}

TEST_CASE("has_inf_or_nan finds an Inf or NaN at any position and nothing in finite data") {
  struct Special {
    const char* name;
    std::uint16_t bf16, f16;
  };
  const Special specials[] = {{"+Inf", 0x7F80, 0x7C00},
                              {"-Inf", 0xFF80, 0xFC00},
                              {"quiet NaN", 0x7FC0, 0x7E00},
                              {"signalling NaN", 0x7F81, 0x7C01},
                              {"negative NaN", 0xFFC1, 0xFE01}};
  for (DType dtype : bit16_types) {
    INFO("dtype " << dtype_name(dtype));
    std::mt19937 rng(11);
    std::vector<std::uint16_t> x = random_bit16(rng, dtype, 1000, 1e-3f, 100.0f);
    x[3] = dtype == DType::bf16 ? 0x7F7F : 0x7BFF;  // the largest finite values are not flagged
    x[4] = dtype == DType::bf16 ? 0xFF7F : 0xFBFF;
    CHECK_FALSE(cpu_device_ops().has_inf_or_nan(x.data(), dtype, x.size()));
    CHECK_FALSE(cpu_device_ops().has_inf_or_nan(nullptr, dtype, 0));
    for (const Special& s : specials) {
      for (std::size_t pos : {std::size_t{0}, std::size_t{1}, std::size_t{517}, x.size() - 1}) {
        INFO(s.name << " at " << pos);
        std::vector<std::uint16_t> y = x;
        y[pos] = dtype == DType::bf16 ? s.bf16 : s.f16;
        CHECK(cpu_device_ops().has_inf_or_nan(y.data(), dtype, y.size()));
        CHECK_FALSE(cpu_device_ops().has_inf_or_nan(y.data(), dtype, pos));  // just before it
      }
    }
  }
}

TEST_CASE("has_inf_or_nan finds an fp32 Inf or NaN at any position and nothing in finite data") {
  const std::uint32_t specials[] = {0x7F800000u, 0xFF800000u, 0x7FC00000u, 0x7F800001u,
                                    0xFFC00001u};
  std::mt19937 rng(12);
  std::vector<float> x = random_values(rng, 1000, 1e-3f, 100.0f);
  x[3] = std::numeric_limits<float>::max();
  x[4] = -std::numeric_limits<float>::max();
  x[5] = std::numeric_limits<float>::denorm_min();
  CHECK_FALSE(cpu_device_ops().has_inf_or_nan(x.data(), DType::f32, x.size()));
  CHECK_FALSE(cpu_device_ops().has_inf_or_nan(nullptr, DType::f32, 0));
  for (std::uint32_t s : specials) {
    for (std::size_t pos : {std::size_t{0}, std::size_t{1}, std::size_t{517}, x.size() - 1}) {
      INFO("bits " << s << " at " << pos);
      std::vector<float> y = x;
      y[pos] = std::bit_cast<float>(s);
      CHECK(cpu_device_ops().has_inf_or_nan(y.data(), DType::f32, y.size()));
      CHECK_FALSE(cpu_device_ops().has_inf_or_nan(y.data(), DType::f32, pos));
    }
  }
}

TEST_CASE("a cast from fp32 to bit16 rounds to nearest even, ties and subnormals included") {
  std::mt19937 rng(5);
  std::vector<float> src = random_values(rng, 3000, 1e-9f, 7e4f);
  std::uniform_int_distribution<std::uint32_t> bits(0, 0xFFFFFFFFu);
  for (int i = 0; i < 3000; ++i) {
    const float f = std::bit_cast<float>(bits(rng));
    if (!std::isnan(f)) src.push_back(f);
  }
  // exact ties between two bf16 / fp16 neighbours, an fp16 subnormal tie, the fp16 overflow edge
  for (float f :
       {1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, 1.0f + 0x1p-11f, 1.0f + 3 * 0x1p-11f, 0x1p-25f,
        3 * 0x1p-25f, 65504.0f, 65519.0f, 65520.0f, -0.0f, 0.0f, INFINITY, -INFINITY})
    src.push_back(f);
  for (DType dtype : bit16_types) {
    INFO("dtype " << dtype_name(dtype));
    std::vector<std::uint16_t> dst(src.size());
    cpu_device_ops().cast(dst.data(), dtype, src.data(), DType::f32, src.size());
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < src.size(); ++i) wrong += dst[i] != round_to(dtype, src[i]);
    CHECK(wrong == 0);
  }
}

TEST_CASE("every bit16 value survives a cast to fp32 and back") {
  for (DType dtype : bit16_types) {
    INFO("dtype " << dtype_name(dtype));
    std::vector<std::uint16_t> all(65536);
    for (std::size_t i = 0; i < all.size(); ++i) all[i] = static_cast<std::uint16_t>(i);
    std::vector<float> wide(all.size());
    cpu_device_ops().cast(wide.data(), DType::f32, all.data(), dtype, all.size());
    std::vector<std::uint16_t> back(all.size());
    cpu_device_ops().cast(back.data(), dtype, wide.data(), DType::f32, wide.size());
    std::size_t wrong_value = 0, wrong_bits = 0;
    for (std::size_t i = 0; i < all.size(); ++i) {
      const double exact = decode(dtype, all[i]);
      if (std::isnan(exact)) {
        wrong_value += !std::isnan(wide[i]);
        wrong_bits += !std::isnan(decode(dtype, back[i]));  // a NaN stays a NaN
      } else {
        wrong_value += static_cast<double>(wide[i]) != exact;
        wrong_bits += back[i] != all[i];
      }
    }
    CHECK(wrong_value == 0);
    CHECK(wrong_bits == 0);
  }
}

TEST_CASE("a cast between bf16 and fp16 goes through fp32 and rounds once") {
  for (DType src_dtype : bit16_types) {
    const DType dst_dtype = src_dtype == DType::bf16 ? DType::f16 : DType::bf16;
    INFO(dtype_name(src_dtype) << " -> " << dtype_name(dst_dtype));
    std::vector<std::uint16_t> all(65536);
    for (std::size_t i = 0; i < all.size(); ++i) all[i] = static_cast<std::uint16_t>(i);
    std::vector<std::uint16_t> dst(all.size());
    cpu_device_ops().cast(dst.data(), dst_dtype, all.data(), src_dtype, all.size());
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < all.size(); ++i) {
      const double exact = decode(src_dtype, all[i]);
      if (std::isnan(exact)) {
        wrong += !std::isnan(decode(dst_dtype, dst[i]));  // a NaN stays a NaN
      } else {
        wrong += dst[i] != round_to(dst_dtype, static_cast<float>(exact));
      }
    }
    CHECK(wrong == 0);
  }
}

TEST_CASE("a cast within one dtype copies the bits unchanged") {
  for (DType dtype : any_types) {
    INFO("dtype " << dtype_name(dtype));
    std::mt19937 rng(13);
    Data src(dtype, 1001), dst(dtype, 1001);
    std::uniform_int_distribution<std::uint32_t> bits(0, 0xFFFFFFFFu);
    for (std::size_t i = 0; i < src.size(); ++i) src.set_bits(i, bits(rng));  // NaNs included
    cpu_device_ops().cast(dst.data(), dtype, src.data(), dtype, src.size());
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < src.size(); ++i) wrong += dst.bits(i) != src.bits(i);
    CHECK(wrong == 0);
  }
}

TEST_CASE("cast and accumulate reject fp64 and null data, and accept zero elements") {
  float x = 0;
  double d = 0;
  CHECK(test::contains(
      test::message_of<ConfigError>([&] { cpu_device_ops().cast(&d, DType::f64, &x, DType::f32, 1); }),
      "fp64"));
  CHECK(test::contains(test::message_of<ConfigError>(
                           [&] { cpu_device_ops().accumulate(&x, DType::f32, &d, DType::f64, 1); }),
                       "fp64"));
  CHECK(test::contains(test::message_of<ConfigError>(
                           [&] { cpu_device_ops().cast(nullptr, DType::bf16, &x, DType::f32, 1); }),
                       "dst is null"));
  CHECK(test::contains(test::message_of<ConfigError>([&] {
                         cpu_device_ops().accumulate(&x, DType::f32, nullptr, DType::bf16, 1);
                       }),
                       "src is null"));
  CHECK(test::contains(
      test::message_of<ConfigError>([&] { squares_of(&d, DType::f64, 1, 1.0); }),
      "fp64"));
  CHECK_NOTHROW(cpu_device_ops().cast(nullptr, DType::bf16, nullptr, DType::f32, 0));
  CHECK_NOTHROW(cpu_device_ops().accumulate(nullptr, DType::f16, nullptr, DType::f32, 0));
}

TEST_CASE("accumulate_bit16 adds in fp32 and rounds once") {
  for (DType dtype : bit16_types) {
    INFO("dtype " << dtype_name(dtype));
    std::mt19937 rng(3);
    std::vector<std::uint16_t> dst = random_bit16(rng, dtype, 2001, 1e-3f, 50.0f);
    const std::vector<std::uint16_t> src = random_bit16(rng, dtype, 2001, 1e-3f, 50.0f);
    std::vector<std::uint16_t> expected(dst.size());
    for (std::size_t i = 0; i < dst.size(); ++i) {
      const float sum =
          static_cast<float>(decode(dtype, dst[i])) + static_cast<float>(decode(dtype, src[i]));
      expected[i] = round_to(dtype, sum);
    }
    cpu_device_ops().accumulate(dst.data(), dtype, src.data(), dtype, dst.size());
    CHECK(dst == expected);
  }
}

TEST_CASE("accumulate adds any dtype into any dtype in fp32 and rounds once") {
  for (DType dst_dtype : any_types)
    for (DType src_dtype : any_types) {
      INFO(dtype_name(src_dtype) << " into " << dtype_name(dst_dtype));
      std::mt19937 rng(4);
      Data dst = random_typed(rng, dst_dtype, 2001, 1e-3f, 50.0f);
      const Data src = random_typed(rng, src_dtype, 2001, 1e-3f, 50.0f);
      std::vector<std::uint32_t> expected(dst.size());
      for (std::size_t i = 0; i < dst.size(); ++i) {
        const float sum = static_cast<float>(dst.value(i)) + static_cast<float>(src.value(i));
        expected[i] = Data::encode(dst_dtype, sum);
      }
      cpu_device_ops().accumulate(dst.data(), dst_dtype, src.data(), src_dtype, dst.size());
      std::size_t wrong = 0;
      for (std::size_t i = 0; i < dst.size(); ++i) wrong += dst.bits(i) != expected[i];
      CHECK(wrong == 0);
    }
}

TEST_CASE("a cast from bf16 or fp16 to fp32 and from fp32 to fp32 is exact") {
  for (DType src_dtype : any_types) {
    INFO("dtype " << dtype_name(src_dtype));
    std::mt19937 rng(14);
    const Data src = random_typed(rng, src_dtype, 1001, 1e-6f, 1e4f);
    std::vector<float> dst(src.size());
    cpu_device_ops().cast(dst.data(), DType::f32, src.data(), src_dtype, src.size());
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < src.size(); ++i) wrong += dst[i] != src.value(i);
    CHECK(wrong == 0);
  }
}

TEST_CASE("fill_zero clears and copy duplicates exactly the bytes asked") {
  std::vector<unsigned char> a(64, 0xAB), b(64, 0xCD);
  cpu_device_ops().fill_zero(a.data() + 8, 16);
  for (std::size_t i = 0; i < a.size(); ++i) CHECK(a[i] == (i >= 8 && i < 24 ? 0 : 0xAB));
  cpu_device_ops().copy(b.data(), a.data(), 32);
  CHECK(std::memcmp(b.data(), a.data(), 32) == 0);
  CHECK(b[32] == 0xCD);
  cpu_device_ops().fill_zero(nullptr, 0);
  cpu_device_ops().copy(nullptr, nullptr, 0);
  CHECK_THROWS_AS(cpu_device_ops().fill_zero(nullptr, 4), ConfigError);
  CHECK_THROWS_AS(cpu_device_ops().copy(a.data(), nullptr, 4), ConfigError);
}

// --- clipping, names, state, validation -----------------------------------------------------

TEST_CASE("clip_coefficient shrinks only a norm above a positive max_norm") {
  CHECK(clip_coefficient(4.0, 1.0) == 1.0 / (4.0 + 1e-6));
  CHECK(clip_coefficient(0.5, 1.0) == 1.0);
  CHECK(clip_coefficient(1.0, 1.0) == 1.0);
  CHECK(clip_coefficient(100.0, 0.0) == 1.0);  // max_norm 0 turns clipping off
}

TEST_CASE("state_slots counts the fp32 state values per element") {
  CHECK(make(OptimizerType::adam).state_slots() == 2);
  CHECK(make(OptimizerType::adamw).state_slots() == 2);
  CHECK(sgd(0.9, 0.0, false).state_slots() == 1);
  CHECK(sgd(0.0, 0.0, false).state_slots() == 0);
}

TEST_CASE("optimizer type names round-trip and are case-insensitive") {
  for (OptimizerType type : {OptimizerType::adam, OptimizerType::adamw, OptimizerType::sgd}) {
    CHECK(optimizer_type_from_name(optimizer_type_name(type), "optimizer.type") == type);
  }
  CHECK(optimizer_type_from_name("adamw", "optimizer.type") == OptimizerType::adamw);
  CHECK(optimizer_type_from_name("ADAM", "optimizer.type") == OptimizerType::adam);
  CHECK(optimizer_type_from_name("sgd", "optimizer.type") == OptimizerType::sgd);
}

TEST_CASE("an unknown optimizer type names the key, the value and the choices") {
  const std::string msg =
      test::message_of<ConfigError>([] { optimizer_type_from_name("Adagrad", "optimizer.type"); });
  CHECK(msg == "optimizer.type = \"Adagrad\": unknown optimizer type; expected Adam, AdamW or SGD");
}

TEST_CASE("OptimizerConfig::validate accepts the defaults and names each bad key") {
  CHECK_NOTHROW(OptimizerConfig{}.validate());
  CHECK_NOTHROW(sgd(0.9, 0.0, true).validate());
  struct Bad {
    const char* key;
    void (*spoil)(OptimizerConfig&);
  };
  const Bad bad[] = {
      {"optimizer.params.lr", [](OptimizerConfig& c) { c.lr = -0.1; }},
      {"optimizer.params.lr", [](OptimizerConfig& c) { c.lr = INFINITY; }},
      {"optimizer.params.lr", [](OptimizerConfig& c) { c.lr = NAN; }},
      {"optimizer.params.betas[0]", [](OptimizerConfig& c) { c.beta1 = 1.0; }},
      {"optimizer.params.betas[0]", [](OptimizerConfig& c) { c.beta1 = -0.1; }},
      {"optimizer.params.betas[1]", [](OptimizerConfig& c) { c.beta2 = 1.5; }},
      {"optimizer.params.betas[1]", [](OptimizerConfig& c) { c.beta2 = NAN; }},
      {"optimizer.params.eps", [](OptimizerConfig& c) { c.eps = 0.0; }},
      {"optimizer.params.eps", [](OptimizerConfig& c) { c.eps = INFINITY; }},
      {"optimizer.params.weight_decay", [](OptimizerConfig& c) { c.weight_decay = -1e-4; }},
      {"optimizer.params.momentum", [](OptimizerConfig& c) { c.momentum = -0.5; }},
      {"optimizer.params.dampening", [](OptimizerConfig& c) { c.dampening = 1.5; }},
      {"optimizer.params.dampening", [](OptimizerConfig& c) { c.dampening = -0.1; }},
      {"optimizer.params.nesterov", [](OptimizerConfig& c) { c.nesterov = true; }},
      {"optimizer.params.nesterov",
       [](OptimizerConfig& c) {
         c.nesterov = true;
         c.momentum = 0.9;
         c.dampening = 0.1;
       }},
  };
  for (const Bad& b : bad) {
    OptimizerConfig c;
    b.spoil(c);
    const std::string msg = test::message_of<ConfigError>([&] { c.validate("optimizer.params"); });
    INFO(msg);
    // "KEY = VALUE: rule": the shape the config reader prefixes with the file.
    CHECK(msg.rfind(std::string(b.key) + " = ", 0) == 0);
    CHECK(!test::contains(msg, "::"));
  }
}

TEST_CASE("OptimizerConfig::validate reports a negative lr with its value and the rule") {
  OptimizerConfig c;
  c.lr = -0.1;
  CHECK(test::message_of<ConfigError>([&] { c.validate("optimizer.params"); }) ==
        "optimizer.params.lr = -0.1: must be >= 0");
  CHECK(test::message_of<ConfigError>([&] { c.validate(); }) ==
        "OptimizerConfig.lr = -0.1: must be >= 0");
  CHECK(test::contains(test::message_of<ConfigError>([&] { c.validate("groups[2]"); }),
                       "groups[2].lr"));
}

// --- loss scaling ---------------------------------------------------------------------------

namespace {

LossScaleConfig dynamic_config(double initial, int window, int hysteresis, double min_scale) {
  LossScaleConfig c;
  c.initial_scale = initial;
  c.window = window;
  c.hysteresis = hysteresis;
  c.min_scale = min_scale;
  return c;
}

}  // namespace

TEST_CASE(
    "a dynamic scaler skips every overflowed step and halves only at the second overflow "
    "with hysteresis 2") {
  LossScaler s(dynamic_config(65536, 1000, 2, 1));
  CHECK_FALSE(s.update(true));
  CHECK(s.scale() == 65536);
  CHECK(s.hysteresis_left() == 1);
  CHECK_FALSE(s.update(true));
  CHECK(s.scale() == 32768);
  CHECK(s.hysteresis_left() == 2);  // restored after the halving
  CHECK_FALSE(s.update(true));
  CHECK(s.scale() == 32768);
}

TEST_CASE("clean steps between overflows do not restore hysteresis") {
  LossScaler s(dynamic_config(1024, 10, 2, 1));
  CHECK_FALSE(s.update(true));
  CHECK(s.update(false));
  CHECK(s.update(false));
  CHECK_FALSE(s.update(true));
  CHECK(s.scale() == 512);
}

TEST_CASE("a dynamic scaler doubles its scale after window consecutive clean steps") {
  LossScaler s(dynamic_config(1024, 3, 2, 1));
  CHECK(s.update(false));
  CHECK(s.update(false));
  CHECK(s.scale() == 1024);
  CHECK(s.clean_steps() == 2);
  CHECK(s.update(false));
  CHECK(s.scale() == 2048);
  CHECK(s.clean_steps() == 0);
  for (int i = 0; i < 3; ++i) s.update(false);
  CHECK(s.scale() == 4096);
}

TEST_CASE("an overflow restarts the count of clean steps") {
  LossScaler s(dynamic_config(1024, 3, 5, 1));
  s.update(false);
  s.update(false);
  s.update(true);
  CHECK(s.clean_steps() == 0);
  s.update(false);
  s.update(false);
  CHECK(s.scale() == 1024);
  s.update(false);
  CHECK(s.scale() == 2048);
}

TEST_CASE("a full clean window restores hysteresis") {
  LossScaler s(dynamic_config(1024, 2, 2, 1));
  s.update(true);
  CHECK(s.hysteresis_left() == 1);
  s.update(false);
  s.update(false);
  CHECK(s.scale() == 2048);
  CHECK(s.hysteresis_left() == 2);
}

TEST_CASE("the dynamic scale never falls below min_scale") {
  LossScaler s(dynamic_config(8, 1000, 1, 2));
  s.update(true);
  CHECK(s.scale() == 4);
  s.update(true);
  CHECK(s.scale() == 2);
  CHECK_FALSE(s.update(true));
  CHECK(s.scale() == 2);
}

TEST_CASE("a static scaler keeps its scale but still skips overflowed steps") {
  LossScaleConfig c;
  c.dynamic = false;
  c.static_scale = 128;
  c.window = 2;
  c.hysteresis = 1;
  LossScaler s(c);
  CHECK(s.scale() == 128);
  CHECK_FALSE(s.update(true));
  CHECK(s.scale() == 128);
  for (int i = 0; i < 5; ++i) CHECK(s.update(false));
  CHECK(s.scale() == 128);
}

TEST_CASE("LossScaleConfig::validate accepts the defaults and names each bad key") {
  CHECK_NOTHROW(LossScaleConfig{}.validate());
  struct Bad {
    const char* key;
    void (*spoil)(LossScaleConfig&);
  };
  const Bad bad[] = {
      {"fp16.initial_scale_power", [](LossScaleConfig& c) { c.initial_scale = 0; }},
      {"fp16.initial_scale_power", [](LossScaleConfig& c) { c.initial_scale = INFINITY; }},
      {"fp16.loss_scale",
       [](LossScaleConfig& c) {
         c.dynamic = false;
         c.static_scale = -1;
       }},
      {"fp16.loss_scale",
       [](LossScaleConfig& c) {
         c.dynamic = false;
         c.static_scale = NAN;
       }},
      {"fp16.loss_scale_window", [](LossScaleConfig& c) { c.window = 0; }},
      {"fp16.hysteresis", [](LossScaleConfig& c) { c.hysteresis = 0; }},
      {"fp16.min_loss_scale", [](LossScaleConfig& c) { c.min_scale = 0; }},
  };
  for (const Bad& b : bad) {
    LossScaleConfig c;
    b.spoil(c);
    const std::string msg = test::message_of<ConfigError>([&] { c.validate("fp16"); });
    INFO(msg);
    CHECK(msg.rfind(std::string(b.key) + " = ", 0) == 0);
    CHECK(!test::contains(msg, "::"));
  }
  LossScaleConfig bad_window;
  bad_window.window = 0;
  CHECK_THROWS_AS(LossScaler(bad_window), ConfigError);
}

// --- optimizer state in bf16 (ShardTensors::state_dtype) -----------------------------------

namespace {

// The state as bf16 bits, of values drawn like HostShard's (m signed, v positive).
std::vector<std::uint16_t> bf16_state(std::mt19937& rng, std::size_t n, float lo, float hi,
                                      bool positive) {
  std::vector<std::uint16_t> out;
  for (float x : random_values(rng, n, lo, hi))
    out.push_back(round_bf16(positive ? std::abs(x) : x));
  return out;
}

std::vector<float> widened(const std::vector<std::uint16_t>& bf16) {
  std::vector<float> out;
  for (auto b : bf16) out.push_back(static_cast<float>(decode_bf16(b)));
  return out;
}

// AdamW's update of `t` (bf16 params and gradients) streamed in two pieces, split at element
// 40000, through two slots of 1000 elements in `slots`: per slot the master (`master_bytes` an
// element: fp32 values or low halves) and two state slots of t.state_dtype.
StreamedTensors two_pieces(const ShardTensors& t, const StepArgs& args,
                           std::vector<std::byte>& slots, std::size_t master_bytes) {
  constexpr std::size_t at = 40000, chunk = 1000;
  const std::size_t state_bytes = dtype_size(t.state_dtype);
  ShardTensors first = t, second = t;
  first.count = at;
  if (second.master != nullptr) second.master += at;
  if (second.master_low != nullptr) second.master_low += at;
  second.state0 = static_cast<std::byte*>(t.state0) + at * state_bytes;
  second.state1 = static_cast<std::byte*>(t.state1) + at * state_bytes;
  second.grad = static_cast<const std::uint16_t*>(t.grad) + at;
  second.param = static_cast<std::uint16_t*>(t.param) + at;
  second.count = t.count - at;
  StreamedTensors s;
  s.pieces = {{args, first}, {args, second}};
  const std::size_t per_slot = chunk * (master_bytes + 2 * state_bytes);
  slots.assign(2 * per_slot, std::byte{0});
  for (std::size_t k = 0; k < 2; ++k) {
    std::byte* slot = slots.data() + k * per_slot;
    s.slot_master[k] = slot;
    s.slot_state0[k] = slot + chunk * master_bytes;
    s.slot_state1[k] = slot + chunk * (master_bytes + state_bytes);
  }
  s.chunk = chunk;
  return s;
}

// Adam, AdamW, SGD with momentum and dampening, Nesterov SGD: every rule with state.
const OptimizerConfig& nth_rule(int i) {
  static const OptimizerConfig rules[] = {make(OptimizerType::adam), make(OptimizerType::adamw),
                                          sgd(0.9, 0.1, false), sgd(0.9, 0.0, true)};
  return rules[i];
}

}  // namespace

TEST_CASE("bf16 state: each step gives the per-element reference's bits with m and v read "
          "from bf16 and stored rounded to nearest even") {
  for (int r = 0; r < 4; ++r) {
    const OptimizerConfig& config = nth_rule(r);
    const int slots = config.state_slots();
    for (DType dtype : bit16_types)
      for (DType grad_dtype : {dtype, DType::f32})
        for (std::size_t n : {1, 17, 513, 1031}) {
          INFO(optimizer_type_name(config.type) << " (rule " << r << "), param "
                                                << dtype_name(dtype) << ", grad "
                                                << dtype_name(grad_dtype) << ", " << n);
          std::mt19937 rng(77);
          std::vector<float> master = random_values(rng, n, 0.05f, 1.0f);
          std::vector<std::uint16_t> m = bf16_state(rng, n, 1e-4f, 1e-2f, false);
          std::vector<std::uint16_t> v = bf16_state(rng, n, 1e-6f, 1e-4f, true);
          std::vector<std::uint16_t> param(n, 0);
          std::vector<float> ref_master = master;
          std::vector<std::uint16_t> ref_m = m, ref_v = v;
          for (std::int64_t step = 1; step <= 5; ++step) {
            INFO("step " << step);
            const Data grad = random_typed(rng, grad_dtype, n, 0.01f, 2.0f);
            const StepArgs args{step, 1e-2, 0.1, 0.37f};
            ShardTensors t{master.data(), slots >= 1 ? m.data() : nullptr,
                           slots >= 2 ? v.data() : nullptr, grad.data(), param.data(), dtype,
                           grad_dtype, n};
            t.state_dtype = DType::bf16;
            cpu_device_ops().update(config, args, t);
            for (std::size_t i = 0; i < n; ++i) {
              const auto g = static_cast<float>(grad.value(i));
              float m_i = static_cast<float>(decode_bf16(ref_m[i]));
              float v_i = static_cast<float>(decode_bf16(ref_v[i]));
              if (config.type == OptimizerType::sgd) {
                sgd_element(sgd_scalars(config, args), g, ref_master[i], m_i);
              } else {
                adam_element(adam_scalars(config, args), g, ref_master[i], m_i, v_i);
              }
              if (slots >= 1) ref_m[i] = round_bf16(m_i);
              if (slots >= 2) ref_v[i] = round_bf16(v_i);
            }
            CHECK(bit_mismatches(master, ref_master) == 0);
            if (slots >= 1) CHECK(m == ref_m);
            if (slots >= 2) CHECK(v == ref_v);
            std::size_t misrounded = 0;
            for (std::size_t i = 0; i < n; ++i)
              misrounded += param[i] != round_to(dtype, ref_master[i]);
            CHECK(misrounded == 0);
          }
        }
  }
}

TEST_CASE("bf16 state: one step from the same values gives the fp32 state's master and param, "
          "and its m and v rounded") {
  for (int r = 0; r < 4; ++r) {
    const OptimizerConfig& config = nth_rule(r);
    const int slots = config.state_slots();
    INFO("rule " << r);
    constexpr std::size_t n = 4099;
    std::mt19937 rng(5);
    const std::vector<float> master = random_values(rng, n, 0.05f, 1.0f);
    const std::vector<std::uint16_t> m = bf16_state(rng, n, 1e-4f, 1e-2f, false);
    const std::vector<std::uint16_t> v = bf16_state(rng, n, 1e-6f, 1e-4f, true);
    const Data grad = random_typed(rng, DType::bf16, n, 0.01f, 2.0f);
    const StepArgs args{3, 1e-2, 0.1, 0.37f};  // not the first step: SGD reads its buffer
    std::vector<float> master32 = master, m32 = widened(m), v32 = widened(v);
    std::vector<std::uint16_t> param32(n), param16(n);
    cpu_device_ops().update(config, args,
                            ShardTensors{master32.data(), m32.data(), v32.data(), grad.data(),
                                         param32.data(), DType::bf16, DType::bf16, n});
    std::vector<float> master16 = master;
    std::vector<std::uint16_t> m16 = m, v16 = v;
    ShardTensors t{master16.data(), m16.data(), v16.data(), grad.data(), param16.data(),
                   DType::bf16, DType::bf16, n};
    t.state_dtype = DType::bf16;
    cpu_device_ops().update(config, args, t);
    CHECK(bit_mismatches(master16, master32) == 0);
    CHECK(param16 == param32);
    std::size_t state_off = 0;
    for (std::size_t i = 0; i < n; ++i) {
      if (slots >= 1) state_off += m16[i] != round_bf16(m32[i]);
      if (slots >= 2) state_off += v16[i] != round_bf16(v32[i]);
    }
    CHECK(state_off == 0);
  }
}

TEST_CASE("bf16 state: HostUpdater's threads and the streamed chunks give one update's bits") {
  const OptimizerConfig& config = nth_rule(1);  // AdamW: two slots
  constexpr std::size_t n = 100003;
  std::mt19937 rng(8);
  const std::vector<float> master = random_values(rng, n, 0.05f, 1.0f);
  const std::vector<std::uint16_t> m = bf16_state(rng, n, 1e-4f, 1e-2f, false);
  const std::vector<std::uint16_t> v = bf16_state(rng, n, 1e-6f, 1e-4f, true);
  const Data grad = random_typed(rng, DType::bf16, n, 0.01f, 2.0f);
  struct Run {
    std::vector<float> master;
    std::vector<std::uint16_t> m, v, param;
    ShardTensors t;
  };
  const auto fresh = [&] {
    Run run{master, m, v, std::vector<std::uint16_t>(n), {}};
    run.t = ShardTensors{run.master.data(), run.m.data(), run.v.data(), grad.data(),
                         run.param.data(), DType::bf16, DType::bf16, n};
    run.t.state_dtype = DType::bf16;
    return run;
  };
  const StepArgs args{2, 1e-2, 0.1, 0.37f};
  Run one = fresh();
  cpu_device_ops().update(config, args, one.t);
  const auto same = [&](const Run& got) {
    return bit_mismatches(got.master, one.master) == 0 && got.m == one.m && got.v == one.v &&
           got.param == one.param;
  };
  for (unsigned threads : {2u, 3u}) {
    INFO(threads << " threads");
    Run split = fresh();
    HostUpdater(threads).update(config, args, split.t);
    CHECK(same(split));
  }
  // Streamed through two slots of 1000 elements, in two pieces: the slots hold bf16 state.
  Run streamed = fresh();
  std::vector<std::byte> slots;
  StreamedTensors s = two_pieces(streamed.t, args, slots, sizeof(float));
  cpu_device_ops().update_streamed(config, s);
  CHECK(same(streamed));
  // Pieces of two state dtypes cannot share the slots.
  s.pieces[1].t.state_dtype = DType::f32;
  const auto msg =
      test::message_of<ConfigError>([&] { cpu_device_ops().update_streamed(config, s); });
  CHECK(msg.find("state dtypes bf16 and fp32") != std::string::npos);
}

TEST_CASE("a state dtype other than fp32 or bf16 is refused, naming it") {
  std::vector<float> master(8, 1.0f), m(8), v(8);
  std::vector<std::uint16_t> grad(8), param(8);
  ShardTensors t{master.data(), m.data(), v.data(), grad.data(), param.data(), DType::bf16,
                 DType::bf16, 8};
  t.state_dtype = DType::f16;
  const auto msg = test::message_of<ConfigError>(
      [&] { cpu_device_ops().update(make(OptimizerType::adamw), StepArgs{}, t); });
  CHECK(msg.find("state dtype fp16 is not fp32 or bf16") != std::string::npos);
}

// --- the master as the bf16 weight and its low half (MasterStorage::bf16_remainder) ---------

TEST_CASE("bf16_remainder: a master splits into a bf16 weight and a low half that join to its "
          "bits, the weight its nearest bf16 with ties away from zero") {
  std::mt19937 rng(3);
  std::size_t not_joined = 0, off_nearest = 0, ties = 0, tie_not_away = 0, nan_not_canonical = 0;
  for (std::uint32_t high = 0; high < 0x10000u; ++high)
    for (std::uint32_t low : {0u, 1u, 0x7FFFu, 0x8000u, 0x8001u, 0xFFFFu,
                              static_cast<std::uint32_t>(rng() & 0xFFFFu)}) {
      const std::uint32_t bits = (high << 16) | low;
      const float x = std::bit_cast<float>(bits);
      const detail::MasterHalves h = detail::split_master(bits);
      if (std::isnan(x)) {
        nan_not_canonical += h.weight != 0x7FC0 || h.low != 0;
        continue;
      }
      not_joined += detail::join_master(h.weight, h.low) != bits;
      if (low == 0x8000u && (high & 1u) == 0) {  // a tie ties-to-even would round down
        ++ties;
        tie_not_away += h.weight != high + 1;
      } else {
        off_nearest += h.weight != round_bf16(x);
      }
    }
  CHECK(not_joined == 0);
  CHECK(off_nearest == 0);
  CHECK(ties > 30000);
  CHECK(tie_not_away == 0);
  CHECK(nan_not_canonical == 0);
}

namespace {

// Every rule: the stateful ones and plain SGD.
const OptimizerConfig& rule_with_master(int i, MasterStorage master) {
  static OptimizerConfig rules[2][5];
  OptimizerConfig& c = rules[master == MasterStorage::fp32 ? 0 : 1][i];
  c = i < 4 ? nth_rule(i) : make(OptimizerType::sgd);
  c.master = master;
  return c;
}

}  // namespace

TEST_CASE("bf16_remainder: every step's master joined from weight and low half has the fp32 "
          "master's bits, the weight its high half") {
  for (int r = 0; r < 5; ++r)
    for (DType state_dtype : {DType::f32, DType::bf16})
      for (DType grad_dtype : {DType::bf16, DType::f32})
        for (std::size_t n : {1, 17, 513, 4099}) {
          const OptimizerConfig& f32 = rule_with_master(r, MasterStorage::fp32);
          const OptimizerConfig& low = rule_with_master(r, MasterStorage::bf16_remainder);
          const int slots = f32.state_slots();
          INFO("rule " << r << ", state " << dtype_name(state_dtype) << ", grad "
                       << dtype_name(grad_dtype) << ", " << n);
          std::mt19937 rng(11);
          std::vector<float> master = random_values(rng, n, 0.05f, 1.0f);
          std::vector<std::uint16_t> weight(n), low_half(n), param32(n);
          for (std::size_t i = 0; i < n; ++i) {
            const auto h = detail::split_master(std::bit_cast<std::uint32_t>(master[i]));
            weight[i] = h.weight;
            low_half[i] = h.low;
          }
          const std::size_t state_bytes = dtype_size(state_dtype);
          std::vector<std::byte> state(2 * n * state_bytes);
          {
            std::vector<float> s = random_values(rng, 2 * n, 1e-6f, 1e-2f);
            for (std::size_t i = n; i < 2 * n; ++i) s[i] = std::abs(s[i]);  // v >= 0
            for (std::size_t i = 0; i < 2 * n; ++i) {
              if (state_dtype == DType::f32) {
                std::memcpy(state.data() + 4 * i, &s[i], 4);
              } else {
                const std::uint16_t b = round_bf16(s[i]);
                std::memcpy(state.data() + 2 * i, &b, 2);
              }
            }
          }
          std::vector<std::byte> state32 = state;
          std::size_t ties_seen = 0;
          for (std::int64_t step = 1; step <= 5; ++step) {
            INFO("step " << step);
            const Data grad = random_typed(rng, grad_dtype, n, 0.01f, 2.0f);
            const StepArgs args{step, 1e-2, 0.1, 0.37f};
            ShardTensors a{master.data(), slots >= 1 ? state32.data() : nullptr,
                           slots >= 2 ? state32.data() + n * state_bytes : nullptr, grad.data(),
                           param32.data(), DType::bf16, grad_dtype, n};
            a.state_dtype = state_dtype;
            cpu_device_ops().update(f32, args, a);
            ShardTensors b{nullptr, slots >= 1 ? state.data() : nullptr,
                           slots >= 2 ? state.data() + n * state_bytes : nullptr, grad.data(),
                           weight.data(), DType::bf16, grad_dtype, n};
            b.state_dtype = state_dtype;
            b.master_low = low_half.data();
            cpu_device_ops().update(low, args, b);
            std::size_t not_joined = 0, not_high = 0, off_param = 0;
            for (std::size_t i = 0; i < n; ++i) {
              const auto bits = std::bit_cast<std::uint32_t>(master[i]);
              not_joined += detail::join_master(weight[i], low_half[i]) != bits;
              not_high += weight[i] != detail::split_master(bits).weight;
              const bool tie = (bits & 0xFFFFu) == 0x8000u && ((bits >> 16) & 1u) == 0;
              ties_seen += tie;
              off_param += !tie && weight[i] != param32[i];
            }
            CHECK(not_joined == 0);
            CHECK(not_high == 0);
            CHECK(off_param == 0);
            CHECK(state == state32);
          }
          CAPTURE(ties_seen);  // ties are rare: the equality above is the test's content
        }
}

TEST_CASE("bf16_remainder: HostUpdater's threads and the streamed chunks give one update's bits") {
  const OptimizerConfig& config = rule_with_master(1, MasterStorage::bf16_remainder);  // AdamW
  constexpr std::size_t n = 100003;
  std::mt19937 rng(9);
  const std::vector<float> master = random_values(rng, n, 0.05f, 1.0f);
  const std::vector<float> m = random_values(rng, n, 1e-4f, 1e-2f);
  std::vector<float> v = random_values(rng, n, 1e-6f, 1e-4f);
  for (float& x : v) x = std::abs(x);
  const Data grad = random_typed(rng, DType::bf16, n, 0.01f, 2.0f);
  struct Run {
    std::vector<std::uint16_t> weight, low;
    std::vector<float> m, v;
    ShardTensors t;
  };
  const auto fresh = [&] {
    Run run{std::vector<std::uint16_t>(n), std::vector<std::uint16_t>(n), m, v, {}};
    for (std::size_t i = 0; i < n; ++i) {
      const auto h = detail::split_master(std::bit_cast<std::uint32_t>(master[i]));
      run.weight[i] = h.weight;
      run.low[i] = h.low;
    }
    run.t = ShardTensors{nullptr, run.m.data(), run.v.data(), grad.data(), run.weight.data(),
                         DType::bf16, DType::bf16, n};
    run.t.master_low = run.low.data();
    return run;
  };
  const StepArgs args{2, 1e-2, 0.1, 0.37f};
  Run one = fresh();
  cpu_device_ops().update(config, args, one.t);
  const auto same = [&](const Run& got) {
    return got.weight == one.weight && got.low == one.low &&
           bit_mismatches(got.m, one.m) == 0 && bit_mismatches(got.v, one.v) == 0;
  };
  REQUIRE(!same(fresh()));  // the update changed something
  for (unsigned threads : {2u, 3u}) {
    INFO(threads << " threads");
    Run split = fresh();
    HostUpdater(threads).update(config, args, split.t);
    CHECK(same(split));
  }
  // Streamed through two slots of 1000 elements in two pieces: the master slots hold low halves.
  Run streamed = fresh();
  std::vector<std::byte> slots;
  cpu_device_ops().update_streamed(config, two_pieces(streamed.t, args, slots, 2));
  CHECK(same(streamed));
}

TEST_CASE("bf16_remainder: fp16 params and a missing low half are refused, naming them") {
  std::vector<float> m(8), v(8);
  std::vector<std::uint16_t> grad(8), param(8), low(8);
  const OptimizerConfig& config = rule_with_master(1, MasterStorage::bf16_remainder);
  ShardTensors t{nullptr, m.data(), v.data(), grad.data(), param.data(), DType::f16, DType::f16, 8};
  t.master_low = low.data();
  CHECK(test::message_of<ConfigError>([&] { cpu_device_ops().update(config, StepArgs{}, t); })
            .find("master kept as bf16_remainder needs bf16 params, not fp16") !=
        std::string::npos);
  t.dtype = t.grad_dtype = DType::bf16;
  t.master_low = nullptr;
  CHECK(test::message_of<ConfigError>([&] { cpu_device_ops().update(config, StepArgs{}, t); })
            .find("master_low is null for 8 elements") != std::string::npos);
  CHECK(std::string(master_storage_name(MasterStorage::bf16_remainder)) == "bf16_remainder");
}
