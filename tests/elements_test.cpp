// shardswap/elements.h against an independent reference: every finite bf16 and fp16 value
// decoded from its bits in double, and the nearest one to each input found by search (ties to
// the even significand) — no rounding arithmetic shared with the library's kernels.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "shardswap/dtype.h"
#include "shardswap/elements.h"
#include "shardswap/error.h"
#include "tests/catch_compat.h"

namespace {

using shardswap::DType;

// The value of 16 bits as `type` (bf16: the top half of an fp32; fp16: IEEE binary16), in double.
double decode(std::uint16_t bits, DType type) {
  const bool negative = (bits & 0x8000) != 0;
  const int exp_bits = type == DType::bf16 ? 8 : 5, mant_bits = 15 - exp_bits;
  const int bias = (1 << (exp_bits - 1)) - 1;
  const int e = (bits >> mant_bits) & ((1 << exp_bits) - 1);
  const int m = bits & ((1 << mant_bits) - 1);
  if (e == (1 << exp_bits) - 1)
    return m != 0 ? std::numeric_limits<double>::quiet_NaN()
                  : (negative ? -1 : 1) * std::numeric_limits<double>::infinity();
  const double magnitude = e == 0 ? std::ldexp(m, 1 - bias - mant_bits)
                                  : std::ldexp((1 << mant_bits) + m, e - bias - mant_bits);
  return negative ? -magnitude : magnitude;
}

// Round to nearest, ties to the even bit pattern, over the table of every non-negative finite
// value of the type; past the largest finite value by half an ulp or more: infinity.
struct Nearest {
  explicit Nearest(DType type) : type(type) {
    for (std::uint32_t b = 0; b < 0x8000; ++b) {
      const double v = decode(static_cast<std::uint16_t>(b), type);
      if (std::isfinite(v)) table.push_back({v, static_cast<std::uint16_t>(b)});
    }
    std::sort(table.begin(), table.end());
  }
  std::uint16_t operator()(double x) const {
    const std::uint16_t sign = std::signbit(x) ? 0x8000 : 0;
    const double a = std::fabs(x);
    const auto& top = table.back();
    const double half_ulp = (top.first - table[table.size() - 2].first) / 2;
    if (a >= top.first + half_ulp) return sign | (type == DType::bf16 ? 0x7f80 : 0x7c00);
    auto hi = std::lower_bound(table.begin(), table.end(), std::pair{a, std::uint16_t{0}});
    if (hi == table.end()) return sign | top.second;
    if (hi->first == a || hi == table.begin()) return sign | hi->second;
    const auto lo = std::prev(hi);
    const double dlo = a - lo->first, dhi = hi->first - a;
    if (dlo < dhi) return sign | lo->second;
    if (dhi < dlo) return sign | hi->second;
    return sign | ((lo->second & 1) == 0 ? lo->second : hi->second);
  }
  DType type;
  std::vector<std::pair<double, std::uint16_t>> table;
};

std::vector<float> random_floats(std::size_t n, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> mantissa(-2.0f, 2.0f);
  std::uniform_int_distribution<int> exponent(-30, 20);  // fp16's subnormals, overflow past 65504
  std::vector<float> x(n);
  for (auto& v : x) v = std::ldexp(mantissa(rng), exponent(rng));
  return x;
}

}  // namespace

TEST_CASE("convert_elements rounds fp32 to bf16 and fp16 to nearest even, and widens exactly") {
  const auto x = random_floats(20000, 7);
  for (const DType type : {DType::bf16, DType::f16}) {
    const Nearest nearest(type);
    std::vector<std::uint16_t> out(x.size());
    shardswap::convert_elements(out.data(), type, x.data(), DType::f32, x.size());
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < x.size(); ++i) wrong += out[i] != nearest(x[i]);
    CHECK(wrong == 0);
    std::vector<float> back(x.size());
    shardswap::convert_elements(back.data(), DType::f32, out.data(), type, x.size());
    for (std::size_t i = 0; i < x.size(); ++i) wrong += back[i] != static_cast<float>(decode(out[i], type));
    CHECK(wrong == 0);
  }
}

TEST_CASE("accumulate_elements adds in fp32 and rounds once into a bit16 slot") {
  const auto g = random_floats(5000, 11);
  const auto start = random_floats(5000, 12);
  for (const DType type : {DType::bf16, DType::f16}) {
    const Nearest nearest(type);
    std::vector<std::uint16_t> slot(g.size());
    for (std::size_t i = 0; i < g.size(); ++i) slot[i] = nearest(start[i] / 1024);
    const auto before = slot;
    shardswap::accumulate_elements(slot.data(), type, g.data(), DType::f32, g.size());
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < g.size(); ++i) {
      const float sum = static_cast<float>(decode(before[i], type)) + g[i];  // the fp32 add
      wrong += slot[i] != nearest(sum);
    }
    CHECK(wrong == 0);
  }
}

TEST_CASE("convert_elements and accumulate_elements refuse fp64 and null data, writing nothing") {
  std::vector<float> src{1.5f, -2.25f}, dst{7.0f, 7.0f};
  double wide[2] = {1, 2};
  using shardswap::ConfigError;
  CHECK(test::contains(test::message_of<ConfigError>([&] {
                         shardswap::convert_elements(dst.data(), DType::f32, wide, DType::f64, 2);
                       }),
                       "convert_elements: src is fp64"));
  CHECK(test::contains(test::message_of<ConfigError>([&] {
                         shardswap::accumulate_elements(nullptr, DType::bf16, src.data(),
                                                        DType::f32, 2);
                       }),
                       "accumulate_elements: dst is null for 2 elements"));
  CHECK_THROWS_AS(shardswap::convert_elements(dst.data(), DType::f32, nullptr, DType::bf16, 1),
                  ConfigError);
  CHECK(dst == std::vector<float>{7.0f, 7.0f});
  shardswap::convert_elements(nullptr, DType::bf16, nullptr, DType::f32, 0);  // nothing to do
}
