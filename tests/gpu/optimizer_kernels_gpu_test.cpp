// The CUDA optimizer kernels against the CPU kernels, the reference backend: the same 20 update
// steps from the same data for every rule, param dtype and gradient dtype, bit for bit (an
// offloaded run, updated on the host, must give an on-device run's bits: issue 31); the
// reductions, casts and accumulation for every dtype (pair). Each runs on shapes that take the
// 16-byte vector path only, the vector path and a tail, unaligned pointers (every element singly),
// fewer elements than one vector unit, and more vector units than the grid has threads (the
// grid-stride loop).
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "shardswap/allocator.h"
#include "shardswap/error.h"
#include "memory/host_types.h"
#include "optimizer/master_split.h"
#include "optimizer/optimizer.h"
#include "tests/catch_compat.h"
#include "tests/gpu/device_memory_guard.h"

using namespace shardswap;

namespace {

const DType bit16_types[] = {DType::bf16, DType::f16};
const DType any_types[] = {DType::f32, DType::bf16, DType::f16};

Allocator& gpu() {
  static const std::unique_ptr<Allocator> allocator = make_cuda_allocator(0);
  return *allocator;
}

// n elements of fp32, bf16 or fp16 in host memory; set() rounds to nearest even (Eigen).
class Host {
 public:
  Host(DType dtype, std::size_t n) : dtype_(dtype), bytes_(n * dtype_size(dtype)) {}
  DType dtype() const { return dtype_; }
  std::size_t size() const { return bytes_.size() / dtype_size(dtype_); }
  std::size_t bytes() const { return bytes_.size(); }
  void* data() { return bytes_.data(); }
  const void* data() const { return bytes_.data(); }
  float* f32() { return reinterpret_cast<float*>(bytes_.data()); }

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
  float value(std::size_t i) const {
    const std::uint32_t b = bits(i);
    switch (dtype_) {
      case DType::bf16:
        return static_cast<float>(std::bit_cast<bf16_t>(static_cast<std::uint16_t>(b)));
      case DType::f16:
        return static_cast<float>(std::bit_cast<f16_t>(static_cast<std::uint16_t>(b)));
      default:
        return std::bit_cast<float>(b);
    }
  }
  void set(std::size_t i, float f) { set_bits(i, encode(dtype_, f)); }

  static std::uint32_t encode(DType d, float f) {
    switch (d) {
      case DType::bf16:
        return std::bit_cast<std::uint16_t>(bf16_t(f));
      case DType::f16:
        return std::bit_cast<std::uint16_t>(f16_t(f));
      default:
        return std::bit_cast<std::uint32_t>(f);
    }
  }

 private:
  DType dtype_;
  std::vector<unsigned char> bytes_;
};

// Values in +-[lo, hi], random sign.
Host random_host(std::mt19937& rng, DType d, std::size_t n, float lo, float hi) {
  std::uniform_real_distribution<float> mag(lo, hi);
  std::bernoulli_distribution negative(0.5);
  Host h(d, n);
  for (std::size_t i = 0; i < n; ++i) h.set(i, negative(rng) ? -mag(rng) : mag(rng));
  return h;
}

// n elements on the GPU, `offset` elements into a fresh 256-byte aligned block: offset 1 makes
// the pointer unaligned for 16-byte vectors.
class Device {
 public:
  Device(DType dtype, std::size_t n, std::size_t offset)
      : dtype_(dtype), n_(n), offset_(offset), block_(gpu().allocate((n + offset + 1) * 4)) {}
  Device(const Host& h, std::size_t offset) : Device(h.dtype(), h.size(), offset) { upload(h); }
  ~Device() { gpu().deallocate(block_); }
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  void* get() const {
    return static_cast<unsigned char*>(block_.ptr) + offset_ * dtype_size(dtype_);
  }
  float* f32() const { return static_cast<float*>(get()); }
  void upload(const Host& h) const { gpu().upload(get(), h.data(), h.bytes()); }
  Host download() const {
    Host h(dtype_, n_);
    gpu().download(h.data(), get(), h.bytes());
    return h;
  }

 private:
  DType dtype_;
  std::size_t n_, offset_;
  Block block_;
};

struct Shape {
  std::size_t n;
  std::size_t offset;
  const char* what;
};

const Shape shapes[] = {
    {4104, 0, "vector path only"},
    {4099, 0, "vector path and a tail of 3"},
    {4099, 1, "unaligned pointers: every element singly"},
    {7, 0, "fewer elements than one vector unit"},
};
// More 8-element units than 132 SMs x 8 blocks x 256 threads, and a tail of 5.
const Shape grid_stride{3'000'005, 0, "more vector units than grid threads"};

// Same bits, or both NaN (the backends may pick different NaN payloads).
std::size_t mismatches(const Host& got, const Host& ref) {
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const bool both_nan = std::isnan(got.value(i)) && std::isnan(ref.value(i));
    wrong += !both_nan && got.bits(i) != ref.bits(i);
  }
  return wrong;
}

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

// Runs `steps` updates on the CPU and the CUDA kernels from the same data and gradients; after
// every step the master, the state and the bit16 param have the same bits on both (or are NaN on
// both). Both round every operation to float in the same order, with no fused multiply-add and a
// correctly rounded sqrt (optimizer/cpu/kernels.cpp: EIGEN_FAST_MATH 0, -ffp-contract=off), so
// no rule, SGD included, has a reason to differ by even one ulp.
// With MasterStorage::bf16_remainder (bf16 params) the master is the param and low halves on
// both, split from the same random fp32 values.
void check_update_agrees(const OptimizerConfig& rule, double lr, double wd, DType dtype,
                         DType grad_dtype, const Shape& shape, int steps,
                         DType state_dtype = DType::f32,
                         MasterStorage storage = MasterStorage::fp32) {
  OptimizerConfig config = rule;
  config.master = storage;
  config.validate();
  const bool low = storage == MasterStorage::bf16_remainder;
  INFO("param dtype " << dtype_name(dtype) << ", grad dtype " << dtype_name(grad_dtype)
                      << ", state dtype " << dtype_name(state_dtype) << ", master "
                      << master_storage_name(storage) << ", " << shape.n << " elements, "
                      << shape.what);
  const std::size_t n = shape.n;
  const int slots = config.state_slots();
  constexpr float grad_scale = 0.37f;
  std::mt19937 rng(1234);

  Host master = random_host(rng, DType::f32, n, 0.05f, 1.0f);
  Host state0(state_dtype, n), state1(state_dtype, n), param(dtype, n);  // zeros
  Host low_half(DType::bf16, n);  // 16-bit words
  if (low)
    for (std::size_t i = 0; i < n; ++i) {
      const auto h = detail::split_master(master.bits(i));
      param.set_bits(i, h.weight);
      low_half.set_bits(i, h.low);
    }
  const Device d_master(master, shape.offset), d_state0(state0, shape.offset),
      d_state1(state1, shape.offset), d_param(param, shape.offset),
      d_low(low_half, shape.offset);
  const Device d_grad(grad_dtype, n, shape.offset);

  for (std::int64_t step = 1; step <= steps; ++step) {
    INFO("step " << step);
    Host grad = random_host(rng, grad_dtype, n, 0.01f, 2.0f);
    d_grad.upload(grad);
    const StepArgs args{step, lr, wd, grad_scale};
    ShardTensors on_cpu{master.f32(), slots >= 1 ? state0.data() : nullptr,
                        slots >= 2 ? state1.data() : nullptr, grad.data(), param.data(), dtype,
                        grad_dtype, n};
    ShardTensors on_gpu{d_master.f32(), slots >= 1 ? d_state0.get() : nullptr,
                        slots >= 2 ? d_state1.get() : nullptr, d_grad.get(), d_param.get(), dtype,
                        grad_dtype, n};
    on_cpu.state_dtype = on_gpu.state_dtype = state_dtype;
    if (low) {
      on_cpu.master = on_gpu.master = nullptr;
      on_cpu.master_low = static_cast<std::uint16_t*>(low_half.data());
      on_gpu.master_low = static_cast<std::uint16_t*>(d_low.get());
    }
    cpu_device_ops().update(config, args, on_cpu);
    cuda_device_ops().update(config, args, on_gpu);

    if (low)  // raw words: a low half is no number, so no NaN may pass as equal
      CHECK(std::memcmp(d_low.download().data(), low_half.data(), low_half.bytes()) == 0);
    else
      CHECK(mismatches(d_master.download(), master) == 0);
    if (slots >= 1) CHECK(mismatches(d_state0.download(), state0) == 0);
    if (slots >= 2) CHECK(mismatches(d_state1.download(), state1) == 0);
    CHECK(mismatches(d_param.download(), param) == 0);
  }
}

// Every param, gradient and state type (fp32, and bf16 where the rule has state), and with bf16
// params the master as fp32 values and as low halves.
void check_rule(const OptimizerConfig& config, double lr, double wd) {
  for (DType dtype : bit16_types)
    for (DType grad_dtype : {dtype, DType::f32})
      for (DType state_dtype : {DType::f32, DType::bf16})
        for (MasterStorage storage : {MasterStorage::fp32, MasterStorage::bf16_remainder}) {
          if (state_dtype == DType::bf16 && config.state_slots() == 0) continue;
          if (storage == MasterStorage::bf16_remainder && dtype != DType::bf16) continue;
          for (const Shape& shape : shapes)
            check_update_agrees(config, lr, wd, dtype, grad_dtype, shape, 20, state_dtype,
                                storage);
        }
}

}  // namespace

// --- update rules ---------------------------------------------------------------------------

TEST_CASE("cuda: the kernel table is named cuda") {
  CHECK(std::string(cuda_device_ops().name) == "cuda");
  CHECK_NOTHROW(cuda_device_ops().synchronize());
}

TEST_CASE("cuda: Adam gives the CPU kernels' bits over 20 steps, with and without L2") {
  check_rule(make(OptimizerType::adam), 1e-2, 0.0);
  check_rule(make(OptimizerType::adam), 1e-2, 0.1);
  OptimizerConfig c = make(OptimizerType::adam);
  c.beta1 = 0.0;
  c.beta2 = 0.95;
  c.eps = 1e-3;
  check_rule(c, 1e-2, 0.0);
}

TEST_CASE("cuda: AdamW gives the CPU kernels' bits over 20 steps, with and without decay") {
  check_rule(make(OptimizerType::adamw), 1e-2, 0.0);
  check_rule(make(OptimizerType::adamw), 1e-2, 0.1);
}

TEST_CASE("cuda: plain SGD gives the CPU kernels' bits, with and without weight decay") {
  check_rule(sgd(0.0, 0.0, false), 0.05, 0.0);
  check_rule(sgd(0.0, 0.0, false), 0.05, 0.01);
}

TEST_CASE("cuda: SGD with momentum, nesterov or dampening gives the CPU kernels' bits") {
  check_rule(sgd(0.9, 0.0, false), 0.05, 0.0);
  check_rule(sgd(0.9, 0.0, false), 0.05, 0.01);
  check_rule(sgd(0.9, 0.0, true), 0.05, 0.0);
  check_rule(sgd(0.9, 0.0, true), 0.05, 0.01);
  check_rule(sgd(0.8, 0.3, false), 0.05, 0.01);
}

TEST_CASE("cuda: an update longer than one grid-stride pass gives the CPU kernels' bits") {
  check_update_agrees(make(OptimizerType::adamw), 1e-2, 0.1, DType::bf16, DType::bf16, grid_stride,
                      3);
  check_update_agrees(make(OptimizerType::adam), 1e-2, 0.0, DType::f16, DType::f32, grid_stride, 3);
  check_update_agrees(sgd(0.9, 0.0, true), 0.05, 0.01, DType::bf16, DType::f32, grid_stride, 3);
  check_update_agrees(make(OptimizerType::adamw), 1e-2, 0.1, DType::bf16, DType::bf16, grid_stride,
                      3, DType::bf16, MasterStorage::bf16_remainder);
}

TEST_CASE("cuda: update rejects what the CPU kernels reject, before touching the device") {
  float* none = nullptr;
  const ShardTensors f32_param{none, none, none, none, none, DType::f32, DType::bf16, 1};
  CHECK(test::contains(test::message_of<ConfigError>([&] {
                         cuda_device_ops().update(make(OptimizerType::sgd), StepArgs{}, f32_param);
                       }),
                       "fp32"));
  const ShardTensors f64_grad{none, none, none, none, none, DType::bf16, DType::f64, 1};
  CHECK(test::contains(test::message_of<ConfigError>([&] {
                         cuda_device_ops().update(make(OptimizerType::sgd), StepArgs{}, f64_grad);
                       }),
                       "fp64"));
  const ShardTensors mixed{none, none, none, none, none, DType::f16, DType::bf16, 1};
  CHECK(test::contains(test::message_of<ConfigError>([&] {
                         cuda_device_ops().update(make(OptimizerType::sgd), StepArgs{}, mixed);
                       }),
                       "grad dtype bf16 does not go with param dtype fp16"));
  const ShardTensors null_master{none, none, none, none, none, DType::bf16, DType::bf16, 1};
  CHECK(test::contains(test::message_of<ConfigError>([&] {
                         cuda_device_ops().update(make(OptimizerType::sgd), StepArgs{}, null_master);
                       }),
                       "master"));
  CHECK(test::contains(test::message_of<ConfigError>([&] {
                         cuda_device_ops().update(make(OptimizerType::sgd), StepArgs{0}, null_master);
                       }),
                       "step = 0"));
  CHECK_NOTHROW(cuda_device_ops().update(
      make(OptimizerType::adam), StepArgs{},
      ShardTensors{none, none, none, none, none, DType::bf16, DType::bf16, 0}));
  CHECK_THROWS_AS(cuda_device_ops().cast(nullptr, DType::f32, nullptr, DType::f64, 1), ConfigError);
  CHECK_THROWS_AS(cuda_device_ops().accumulate(nullptr, DType::f32, nullptr, DType::bf16, 1),
                  ConfigError);
  const ConstSpan null_span{nullptr, 1};
  double sum = 0.0;
  CHECK_THROWS_AS(cuda_device_ops().sum_squares(&null_span, 1, DType::f32, 1.0, &sum), ConfigError);
  CHECK_NOTHROW(cuda_device_ops().synchronize());  // nothing reached the device
}

// --- reductions -----------------------------------------------------------------------------

// A backend's sum_squares of one span.
double squares_of(const DeviceOps& ops, const void* data, DType dtype, std::size_t count,
                  double scale) {
  const ConstSpan span{data, count};
  double sum = -1.0;
  ops.sum_squares(&span, 1, dtype, scale, &sum);
  return sum;
}

// The sums differ only in the order of additions (sequential on the CPU, a tree on the GPU);
// missing or doubling one element of 3M would change them by about 3e-7.
TEST_CASE("cuda: sum_squares agrees with the CPU to 1e-10 and holds no device memory after") {
  std::vector<Shape> all(std::begin(shapes), std::end(shapes));
  all.push_back(grid_stride);
  all.push_back({1, 0, "one element"});
  {  // first launches load the kernels (lazy module loading): not memory held by the kernels
    const Host x(DType::f32, 64);
    const Device d(x, 0);
    for (DType dtype : any_types) squares_of(cuda_device_ops(), d.get(), dtype, 16, 1.0);
  }
  const test::DeviceMemoryGuard guard;
  for (DType dtype : any_types) {
    for (const Shape& shape : all) {
      INFO(dtype_name(dtype) << ", " << shape.n << " elements, " << shape.what);
      std::mt19937 rng(7);
      const Host x = random_host(rng, dtype, shape.n, 1e-3f, 100.0f);
      const Device d(x, shape.offset);
      const double scale = 1.0 / 4096.0 / 3.0;
      const double expected = squares_of(cpu_device_ops(), x.data(), dtype, x.size(), scale);
      const double got = squares_of(cuda_device_ops(), d.get(), dtype, x.size(), scale);
      CHECK(std::abs(got - expected) <= 1e-10 * expected);
    }
    CHECK(squares_of(cuda_device_ops(), nullptr, dtype, 0, 1.0) == 0.0);
  }
  guard.require_returned();
}

TEST_CASE("cuda: sum_squares is not finite when the data holds an Inf or a NaN") {
  for (DType dtype : any_types) {
    INFO("dtype " << dtype_name(dtype));
    std::mt19937 rng(9);
    Host x = random_host(rng, dtype, 4099, 1e-3f, 10.0f);
    x.set(4097, INFINITY);
    const Device inf(x, 0);
    CHECK_FALSE(std::isfinite(squares_of(cuda_device_ops(), inf.get(), dtype, x.size(), 1.0)));
    x.set(1000, NAN);
    const Device nan(x, 0);
    CHECK(std::isnan(squares_of(cuda_device_ops(), nan.get(), dtype, x.size(), 1.0)));
  }
}

// The engine's gradient norm queues every piece's reduction before it waits: more spans than
// one wait's batch (64), of sizes from empty to several grids, unaligned ones among them.
TEST_CASE("cuda: sum_squares of 150 spans gives each the bits it has alone, waiting once a batch") {
  std::mt19937 rng(13);
  std::uniform_int_distribution<std::size_t> length(0, 300000);
  const double scale = 1.0 / 4096.0 / 3.0;
  for (DType dtype : {DType::bf16, DType::f32}) {
    INFO("dtype " << dtype_name(dtype));
    std::vector<Host> hosts;
    std::vector<std::unique_ptr<Device>> devices;
    std::vector<ConstSpan> spans;
    for (int i = 0; i < 150; ++i) {
      const std::size_t n = i == 7 ? 0 : i == 70 ? 5 << 20 : length(rng);
      hosts.push_back(random_host(rng, dtype, n, 1e-3f, 100.0f));
      devices.push_back(std::make_unique<Device>(hosts.back(), i % 3 == 1 ? 1 : 0));
      spans.push_back({devices.back()->get(), n});
    }
    std::vector<double> sums(spans.size(), -1.0);
    cuda_device_ops().sum_squares(spans.data(), spans.size(), dtype, scale, sums.data());
    for (std::size_t i = 0; i < spans.size(); ++i) {
      INFO("span " << i << ", " << spans[i].count << " elements");
      CHECK(sums[i] == squares_of(cuda_device_ops(), spans[i].data, dtype, spans[i].count, scale));
      const double cpu =
          squares_of(cpu_device_ops(), hosts[i].data(), dtype, hosts[i].size(), scale);
      CHECK(std::abs(sums[i] - cpu) <= 1e-10 * cpu);
    }
    CHECK(sums[7] == 0.0);
    spans[100].data = nullptr;  // refused before anything is queued or written
    std::fill(sums.begin(), sums.end(), -1.0);
    CHECK_THROWS_AS(
        cuda_device_ops().sum_squares(spans.data(), spans.size(), dtype, scale, sums.data()),
        ConfigError);
    for (double s : sums) CHECK(s == -1.0);
  }
}

TEST_CASE("cuda: has_inf_or_nan finds an Inf or NaN at any position and nothing in finite data") {
  struct Special {
    const char* name;
    std::uint32_t f32, bf16, f16;
  };
  const Special specials[] = {{"+Inf", 0x7F800000u, 0x7F80, 0x7C00},
                              {"-Inf", 0xFF800000u, 0xFF80, 0xFC00},
                              {"quiet NaN", 0x7FC00000u, 0x7FC0, 0x7E00},
                              {"signalling NaN", 0x7F800001u, 0x7F81, 0x7C01},
                              {"negative NaN", 0xFFC00001u, 0xFFC1, 0xFE01}};
  for (DType dtype : any_types) {
    for (const Shape& shape : shapes) {
      INFO(dtype_name(dtype) << ", " << shape.n << " elements, " << shape.what);
      std::mt19937 rng(11);
      Host x = random_host(rng, dtype, shape.n, 1e-3f, 100.0f);
      x.set_bits(3, dtype == DType::f32    ? 0x7F7FFFFFu  // the largest finite values
                    : dtype == DType::bf16 ? 0x7F7Fu
                                           : 0x7BFFu);
      const Device finite(x, shape.offset);
      CHECK_FALSE(cuda_device_ops().has_inf_or_nan(finite.get(), dtype, x.size()));
      CHECK_FALSE(cuda_device_ops().has_inf_or_nan(nullptr, dtype, 0));
      for (const Special& s : specials) {
        for (std::size_t pos : {std::size_t{0}, std::size_t{1}, shape.n / 2, shape.n - 1}) {
          INFO(s.name << " at " << pos);
          Host y = x;
          y.set_bits(pos, dtype == DType::f32 ? s.f32 : dtype == DType::bf16 ? s.bf16 : s.f16);
          const Device d(y, shape.offset);
          CHECK(cuda_device_ops().has_inf_or_nan(d.get(), dtype, y.size()));
          CHECK_FALSE(cuda_device_ops().has_inf_or_nan(d.get(), dtype, pos));  // just before it
        }
      }
    }
  }
}

TEST_CASE("cuda: has_inf_or_nan finds a NaN beyond the first grid-stride pass") {
  for (DType dtype : any_types) {
    INFO("dtype " << dtype_name(dtype));
    std::mt19937 rng(12);
    Host x = random_host(rng, dtype, grid_stride.n, 1e-3f, 100.0f);
    const Device finite(x, 0);
    CHECK_FALSE(cuda_device_ops().has_inf_or_nan(finite.get(), dtype, x.size()));
    x.set(x.size() - 9, NAN);  // in the last vector unit
    const Device nan(x, 0);
    CHECK(cuda_device_ops().has_inf_or_nan(nan.get(), dtype, x.size()));
  }
}

// --- casts, accumulation, fill and copy -----------------------------------------------------

namespace {

// Source data for casts: every bit pattern of a bit16 type, or for fp32 random bits (NaNs
// included) and values around the bf16/fp16 ranges, ties and subnormals.
Host cast_source(DType dtype, std::size_t n) {
  std::mt19937 rng(5);
  Host h(dtype, n);
  std::uniform_int_distribution<std::uint32_t> bits(0, 0xFFFFFFFFu);
  std::uniform_real_distribution<float> exponent(-30.0f, 20.0f);
  for (std::size_t i = 0; i < n; ++i) {
    if (dtype != DType::f32) {
      h.set_bits(i, static_cast<std::uint32_t>(i % 65536));
    } else if (i % 2 == 0) {
      h.set_bits(i, bits(rng));
    } else {
      h.set(i, (i % 4 == 1 ? 1.0f : -1.0f) * std::exp2(exponent(rng)));
    }
  }
  if (dtype == DType::f32 && n > 16) {
    const float edges[] = {1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, 1.0f + 0x1p-11f, 0x1p-25f,
                           3 * 0x1p-25f,   65504.0f,           65519.0f,        65520.0f,
                           -0.0f,          INFINITY,           -INFINITY};
    for (std::size_t k = 0; k < std::size(edges); ++k) h.set(k, edges[k]);
  }
  return h;
}

}  // namespace

TEST_CASE("cuda: cast agrees with the CPU bit for bit for every pair of dtypes") {
  std::vector<Shape> all(std::begin(shapes), std::end(shapes));
  all.push_back({65536 + 3, 0, "every bit16 pattern, and a tail"});
  all.push_back(grid_stride);
  for (DType dst_dtype : any_types)
    for (DType src_dtype : any_types)
      for (const Shape& shape : all) {
        INFO(dtype_name(src_dtype)
             << " -> " << dtype_name(dst_dtype) << ", " << shape.n << " elements, " << shape.what);
        const Host src = cast_source(src_dtype, shape.n);
        Host expected(dst_dtype, shape.n);
        cpu_device_ops().cast(expected.data(), dst_dtype, src.data(), src_dtype, shape.n);
        const Device d_src(src, shape.offset);
        const Device d_dst(dst_dtype, shape.n, 0);  // src unaligned alone also takes the slow path
        cuda_device_ops().cast(d_dst.get(), dst_dtype, d_src.get(), src_dtype, shape.n);
        CHECK(mismatches(d_dst.download(), expected) == 0);
      }
}

TEST_CASE("cuda: accumulate agrees with the CPU bit for bit for every pair of dtypes") {
  std::vector<Shape> all(std::begin(shapes), std::end(shapes));
  all.push_back(grid_stride);
  for (DType dst_dtype : any_types)
    for (DType src_dtype : any_types)
      for (const Shape& shape : all) {
        INFO(dtype_name(src_dtype) << " into " << dtype_name(dst_dtype) << ", " << shape.n
                                   << " elements, " << shape.what);
        std::mt19937 rng(3);
        Host dst = random_host(rng, dst_dtype, shape.n, 1e-3f, 5e4f);  // fp16 sums may overflow
        const Host src = random_host(rng, src_dtype, shape.n, 1e-3f, 5e4f);
        const Device d_dst(dst, shape.offset), d_src(src, shape.offset);
        cpu_device_ops().accumulate(dst.data(), dst_dtype, src.data(), src_dtype, shape.n);
        cuda_device_ops().accumulate(d_dst.get(), dst_dtype, d_src.get(), src_dtype, shape.n);
        CHECK(mismatches(d_dst.download(), dst) == 0);
      }
}

TEST_CASE("cuda: fill_zero clears and copy duplicates exactly the bytes asked") {
  Host pattern(DType::f32, 1024);
  for (std::size_t i = 0; i < pattern.size(); ++i) pattern.set(i, static_cast<float>(i) + 0.5f);
  const Device a(pattern, 0), b(DType::f32, 1024, 0);
  cuda_device_ops().fill_zero(b.get(), 4096);
  cuda_device_ops().fill_zero(static_cast<unsigned char*>(a.get()) + 6, 1000);  // odd edges
  cuda_device_ops().copy(static_cast<unsigned char*>(b.get()) + 3, a.get(), 2001);
  cuda_device_ops().fill_zero(nullptr, 0);
  cuda_device_ops().copy(nullptr, nullptr, 0);
  const Host got_a = a.download(), got_b = b.download();
  std::vector<unsigned char> expect_a(4096), expect_b(4096, 0);
  std::memcpy(expect_a.data(), pattern.data(), 4096);
  std::memset(expect_a.data() + 6, 0, 1000);
  std::memcpy(expect_b.data() + 3, expect_a.data(), 2001);
  CHECK(std::memcmp(got_a.data(), expect_a.data(), 4096) == 0);
  CHECK(std::memcmp(got_b.data(), expect_b.data(), 4096) == 0);
  CHECK_THROWS_AS(cuda_device_ops().fill_zero(nullptr, 4), ConfigError);
}
