// The in-process communicator: every collective against a float64 reference computed here, for
// world sizes 1..8 and all dtypes, plus ordering, reproducibility, mismatches and aborts.
// Catch2 assertions are not thread-safe, so ranks only record what they see; the test thread
// checks.
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <vector>

#include "shardswap/communicator.h"
#include "shardswap/error.h"
#include "memory/host_types.h"
#include "tests/catch_compat.h"
#include "tests/support/typed_values.h"

using namespace shardswap;
using test_support::to_double;

namespace {

const int kWorldSizes[] = {1, 2, 3, 4, 8};
// Element counts for all_reduce, reduce and broadcast: mostly not divisible by the world sizes,
// some below them, one spanning several of the implementation's 256-element blocks.
const std::size_t kCounts[] = {1, 5, 7, 13, 1001};
// Per-rank chunk sizes for reduce_scatter and all_gather.
const std::size_t kChunks[] = {0, 1, 3, 7, 300};

template <class T>
using PerRank = std::vector<std::vector<T>>;

/// Rounds once to T (bit16 types round to nearest even). The values used here make the float
/// step on the way to bit16 exact, so this is a single rounding.
template <class T>
T round_to(double x) {
  return T(x);
}

/// Non-zero values +-k/16, k in 1..128: exact in every dtype, and a sum of up to 8 of them has at
/// most 11 significant bits, so it is exact in fp32 and the float64 reference is the exact sum.
template <class T>
std::vector<T> exact_values(std::size_t n, std::mt19937_64& rng) {
  std::uniform_int_distribution<int> k(1, 128), sign(0, 1);
  std::vector<T> v(n);
  for (T& x : v) x = round_to<T>((sign(rng) ? -1.0 : 1.0) * k(rng) / 16.0);
  return v;
}

template <class T>
PerRank<T> exact_per_rank(int world, std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  PerRank<T> data;
  for (int r = 0; r < world; ++r) data.push_back(exact_values<T>(n, rng));
  return data;
}

/// The float64 reference of `op` over ranks for element i, rounded once to T.
template <class T>
T reference(ReduceOp op, const PerRank<T>& data, std::size_t i) {
  double acc = to_double(data[0][i]);
  for (std::size_t q = 1; q < data.size(); ++q) {
    const double v = to_double(data[q][i]);
    acc = op == ReduceOp::max ? std::max(acc, v) : acc + v;
  }
  if (op == ReduceOp::avg) acc /= static_cast<double>(data.size());
  return round_to<T>(acc);
}

/// Empty if equal bit for bit, otherwise a description of the first difference.
template <class T>
std::string first_difference(const std::vector<T>& got, const std::vector<T>& want) {
  if (got.size() != want.size()) {
    return fmt::format("size {} instead of {}", got.size(), want.size());
  }
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0) {
      return fmt::format("element {} of {}: got {}, expected {}", i, got.size(), to_double(got[i]),
                         to_double(want[i]));
    }
  }
  return "";
}

std::uint64_t seed_of(int world, std::size_t count, int salt) {
  return 1000003u * static_cast<std::uint64_t>(world) + 7919u * count +
         static_cast<std::uint64_t>(salt);
}

template <class T>
void check_all_reduce(ReduceOp op) {
  for (int world : kWorldSizes) {
    for (std::size_t count : kCounts) {
      CAPTURE(world, count, reduce_op_name(op));
      PerRank<T> data = exact_per_rank<T>(world, count, seed_of(world, count, 1));
      std::vector<T> want(count);
      for (std::size_t i = 0; i < count; ++i) want[i] = reference(op, data, i);
      run_ranks(world, [&](int r, Communicator& comm) {
        comm.all_reduce(data[r].data(), count, dtype_of<T>(), op);
      });
      for (int r = 0; r < world; ++r) {
        CAPTURE(r);
        CHECK(first_difference(data[r], want) == "");
      }
    }
  }
}

template <class T>
void check_reduce_scatter(ReduceOp op, bool in_place) {
  for (int world : kWorldSizes) {
    for (std::size_t chunk : kChunks) {
      CAPTURE(world, chunk, reduce_op_name(op), in_place);
      const PerRank<T> send = exact_per_rank<T>(world, world * chunk, seed_of(world, chunk, 2));
      PerRank<T> buf = send;  // in place: the send buffers; out of place: unused
      PerRank<T> recv(world, std::vector<T>(chunk, T(0.0f)));
      run_ranks(world, [&](int r, Communicator& comm) {
        if (in_place) {
          comm.reduce_scatter(buf[r].data(), buf[r].data() + r * chunk, chunk, dtype_of<T>(), op);
        } else {
          comm.reduce_scatter(send[r].data(), recv[r].data(), chunk, dtype_of<T>(), op);
        }
      });
      for (int r = 0; r < world; ++r) {
        CAPTURE(r);
        std::vector<T> want(chunk);
        for (std::size_t i = 0; i < chunk; ++i) want[i] = reference(op, send, r * chunk + i);
        std::vector<T> got = recv[r];
        if (in_place) got.assign(buf[r].begin() + r * chunk, buf[r].begin() + (r + 1) * chunk);
        CHECK(first_difference(got, want) == "");
      }
    }
  }
}

template <class T>
void check_reduce(ReduceOp op) {
  for (int world : kWorldSizes) {
    for (std::size_t count : kCounts) {
      for (int root = 0; root < world; ++root) {
        CAPTURE(world, count, root, reduce_op_name(op));
        const PerRank<T> before = exact_per_rank<T>(world, count, seed_of(world, count, 3));
        PerRank<T> data = before;
        run_ranks(world, [&](int r, Communicator& comm) {
          comm.reduce(data[r].data(), count, dtype_of<T>(), op, root);
        });
        for (int r = 0; r < world; ++r) {
          CAPTURE(r);
          std::vector<T> want = before[r];
          if (r == root) {
            for (std::size_t i = 0; i < count; ++i) want[i] = reference(op, before, i);
          }
          CHECK(first_difference(data[r], want) == "");
        }
      }
    }
  }
}

template <class T>
void check_all_gather(bool in_place) {
  for (int world : kWorldSizes) {
    for (std::size_t chunk : kChunks) {
      CAPTURE(world, chunk, in_place);
      const PerRank<T> send = exact_per_rank<T>(world, chunk, seed_of(world, chunk, 4));
      // Receive buffers start with unrelated values, in place too (except each rank's own chunk).
      PerRank<T> recv = exact_per_rank<T>(world, world * chunk, seed_of(world, chunk, 5));
      std::vector<T> want;
      for (int q = 0; q < world; ++q) want.insert(want.end(), send[q].begin(), send[q].end());
      if (in_place) {
        for (int r = 0; r < world; ++r)
          std::copy(send[r].begin(), send[r].end(), recv[r].begin() + r * chunk);
      }
      run_ranks(world, [&](int r, Communicator& comm) {
        const T* from = in_place ? recv[r].data() + r * chunk : send[r].data();
        comm.all_gather(from, recv[r].data(), chunk, dtype_of<T>());
      });
      for (int r = 0; r < world; ++r) {
        CAPTURE(r);
        CHECK(first_difference(recv[r], want) == "");
      }
    }
  }
}

template <class T>
void check_broadcast() {
  for (int world : kWorldSizes) {
    for (std::size_t count : kCounts) {
      for (int root = 0; root < world; ++root) {
        CAPTURE(world, count, root);
        PerRank<T> data = exact_per_rank<T>(world, count, seed_of(world, count, 6));
        const std::vector<T> want = data[root];
        run_ranks(world, [&](int r, Communicator& comm) {
          comm.broadcast(data[r].data(), count, dtype_of<T>(), root);
        });
        for (int r = 0; r < world; ++r) {
          CAPTURE(r);
          CHECK(first_difference(data[r], want) == "");
        }
      }
    }
  }
}

struct Deliberate : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// Rank 2 of 4 throws before its all_reduce while the others wait in theirs. Returns what
/// run_ranks rethrew and fills `others` with what the other ranks caught.
std::string run_with_failing_rank(std::vector<std::string>& others) {
  others.assign(4, "");
  return test::message_of<Deliberate>([&] {
    run_ranks(4, [&](int r, Communicator& comm) {
      if (r == 2) throw Deliberate("rank 2 failed on purpose");
      float x = 1.0f;
      try {
        comm.all_reduce(&x, 1, DType::f32, ReduceOp::sum);
      } catch (const CommError& e) {
        others[r] = e.what();
        throw;
      }
    });
  });
}

}  // namespace

TEST_CASE("reduce_op_name names every reduction", "[comm]") {
  CHECK(std::string(reduce_op_name(ReduceOp::sum)) == "sum");
  CHECK(std::string(reduce_op_name(ReduceOp::avg)) == "avg");
  CHECK(std::string(reduce_op_name(ReduceOp::max)) == "max");
}

TEST_CASE("A group needs at least one rank", "[comm]") {
  CHECK(test::contains(test::message_of<ConfigError>([] { InProcessGroup g(0); }),
                       "InProcessGroup: world_size must be at least 1, got 0"));
  CHECK_THROWS_AS(InProcessGroup(-3), ConfigError);
  CHECK_THROWS_AS(run_ranks(0, [](int, Communicator&) {}), ConfigError);
}

TEST_CASE("A group hands out one communicator per rank and rejects other ranks", "[comm]") {
  InProcessGroup group(3);
  CHECK(group.world_size() == 3);
  for (int r = 0; r < 3; ++r) {
    CHECK(group.rank(r).rank() == r);
    CHECK(group.rank(r).world_size() == 3);
  }
  CHECK(test::contains(test::message_of<ConfigError>([&] { group.rank(3); }),
                       "InProcessGroup::rank: rank 3 is out of range for world size 3"));
  CHECK_THROWS_AS(group.rank(-1), ConfigError);
}

TEMPLATE_TEST_CASE("all_reduce with sum leaves the sum over ranks on every rank", "[comm]", float,
                   double, bf16_t, f16_t) {
  check_all_reduce<TestType>(ReduceOp::sum);
}

TEMPLATE_TEST_CASE("reduce_scatter out of place gives rank r the sum of chunk r", "[comm]", float,
                   double, bf16_t, f16_t) {
  check_reduce_scatter<TestType>(ReduceOp::sum, /*in_place=*/false);
}

TEMPLATE_TEST_CASE("reduce_scatter in place writes the sum into chunk r of rank r's buffer",
                   "[comm]", float, double, bf16_t, f16_t) {
  check_reduce_scatter<TestType>(ReduceOp::sum, /*in_place=*/true);
}

TEMPLATE_TEST_CASE("reduce leaves the sum on the root and other ranks' data unchanged", "[comm]",
                   float, double, bf16_t, f16_t) {
  check_reduce<TestType>(ReduceOp::sum);
}

TEMPLATE_TEST_CASE("all_gather out of place puts rank r's data at chunk r on every rank", "[comm]",
                   float, double, bf16_t, f16_t) {
  check_all_gather<TestType>(/*in_place=*/false);
}

TEMPLATE_TEST_CASE("all_gather in place fills every other rank's chunk", "[comm]", float, double,
                   bf16_t, f16_t) {
  check_all_gather<TestType>(/*in_place=*/true);
}

TEMPLATE_TEST_CASE("broadcast copies the root's data to every rank", "[comm]", float, double,
                   bf16_t, f16_t) {
  check_broadcast<TestType>();
}

TEMPLATE_TEST_CASE("avg divides the sum by the world size before rounding", "[comm]", float, double,
                   bf16_t, f16_t) {
  check_all_reduce<TestType>(ReduceOp::avg);
  check_reduce_scatter<TestType>(ReduceOp::avg, /*in_place=*/false);
  check_reduce<TestType>(ReduceOp::avg);
}

TEMPLATE_TEST_CASE("max takes the element-wise maximum over ranks", "[comm]", float, double, bf16_t,
                   f16_t) {
  check_all_reduce<TestType>(ReduceOp::max);
  check_reduce_scatter<TestType>(ReduceOp::max, /*in_place=*/true);
  check_reduce<TestType>(ReduceOp::max);
}

TEMPLATE_TEST_CASE("max propagates NaN from any rank", "[comm]", float, double, bf16_t, f16_t) {
  using T = TestType;
  const T nan = T(std::numeric_limits<float>::quiet_NaN());
  // Element 0: NaN on the first rank; 1: in the middle; 2: on the last; 3: none.
  PerRank<T> data = {{nan, T(1.0f), T(2.0f), T(3.0f)},
                     {T(5.0f), nan, T(1.0f), T(-4.0f)},
                     {T(4.0f), T(6.0f), nan, T(7.0f)}};
  run_ranks(3, [&](int r, Communicator& comm) {
    comm.all_reduce(data[r].data(), 4, dtype_of<T>(), ReduceOp::max);
  });
  for (int r = 0; r < 3; ++r) {
    CAPTURE(r);
    CHECK(std::isnan(to_double(data[r][0])));
    CHECK(std::isnan(to_double(data[r][1])));
    CHECK(std::isnan(to_double(data[r][2])));
    CHECK(to_double(data[r][3]) == 7.0);
  }
}

TEST_CASE("bit16 sums accumulate in fp32 and round once at the end", "[comm]") {
  // 1 + h + h with h half an ulp of 1: rounding after each addition would give 1 (ties to even);
  // rounding once gives 1 + ulp.
  auto check = [](auto one) {
    using T = decltype(one);
    const double ulp = std::is_same_v<T, bf16_t> ? std::ldexp(1.0, -7) : std::ldexp(1.0, -10);
    PerRank<T> data = {{T(1.0f)}, {round_to<T>(ulp / 2)}, {round_to<T>(ulp / 2)}};
    run_ranks(3, [&](int r, Communicator& comm) {
      comm.all_reduce(data[r].data(), 1, dtype_of<T>(), ReduceOp::sum);
    });
    for (int r = 0; r < 3; ++r) CHECK(to_double(data[r][0]) == 1.0 + ulp);
  };
  check(bf16_t(1.0f));
  check(f16_t(1.0f));
}

TEST_CASE("Ranks are summed in rank order 0..N-1 whichever rank does the work", "[comm]") {
  // Values of very different magnitudes make fp32 sums depend on the order; the expected value is
  // the left fold over ranks 0..N-1 in fp32 (bf16: then rounded once). 1000 elements so that every
  // rank computes a chunk of the all_reduce.
  const int world = 8;
  const std::size_t n = 1000;
  std::mt19937_64 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-12, 12);
  PerRank<float> f32(world, std::vector<float>(n));
  PerRank<bf16_t> b16(world, std::vector<bf16_t>(n));
  std::vector<float> want_f32(n);
  std::vector<bf16_t> want_b16(n);
  for (std::size_t i = 0; i < n; ++i) {
    float sum_f32 = 0.0f, sum_b16 = 0.0f;
    for (int r = 0; r < world; ++r) {
      f32[r][i] = std::ldexp(normal(rng), exponent(rng));
      b16[r][i] = bf16_t(std::ldexp(normal(rng), exponent(rng)));
      sum_f32 = r == 0 ? f32[r][i] : sum_f32 + f32[r][i];
      sum_b16 = r == 0 ? static_cast<float>(b16[r][i]) : sum_b16 + static_cast<float>(b16[r][i]);
    }
    want_f32[i] = sum_f32;
    want_b16[i] = bf16_t(sum_b16);
  }
  PerRank<float> scattered(world, std::vector<float>(n / world));
  run_ranks(world, [&](int r, Communicator& comm) {
    comm.reduce_scatter(f32[r].data(), scattered[r].data(), n / world, DType::f32, ReduceOp::sum);
    comm.all_reduce(f32[r].data(), n, DType::f32, ReduceOp::sum);
    comm.all_reduce(b16[r].data(), n, DType::bf16, ReduceOp::sum);
  });
  for (int r = 0; r < world; ++r) {
    CAPTURE(r);
    CHECK(first_difference(f32[r], want_f32) == "");
    CHECK(first_difference(b16[r], want_b16) == "");
    CHECK(first_difference(scattered[r],
                           std::vector<float>(want_f32.begin() + r * (n / world),
                                              want_f32.begin() + (r + 1) * (n / world))) == "");
  }
}

TEST_CASE("A rank may reuse its buffers as soon as a collective returns", "[comm]") {
  // Every collective gets new inputs, written right after the previous one returned; a rank still
  // reading another's buffer would see the wrong values. Values are small integers (exact).
  const int world = 4, iterations = 200;
  const std::size_t chunk = 64, n = world * chunk;
  std::vector<int> wrong(world, 0);
  run_ranks(world, [&](int r, Communicator& comm) {
    std::vector<float> send(n), recv(n);
    int step = 0;
    float base = 0.0f;
    // Rank q's input for this step is base + q, so the sum over ranks is:
    auto sum = [&] { return world * base + world * (world - 1) / 2.0f; };
    auto next_input = [&] {
      base = static_cast<float>(++step * world);
      std::fill(send.begin(), send.end(), base + r);
    };
    for (int k = 0; k < iterations; ++k) {
      const int root = k % world;
      next_input();
      comm.reduce_scatter(send.data(), recv.data(), chunk, DType::f32, ReduceOp::sum);
      for (std::size_t i = 0; i < chunk; ++i) wrong[r] += recv[i] != sum();
      next_input();
      comm.all_gather(send.data(), recv.data(), chunk, DType::f32);
      for (std::size_t i = 0; i < n; ++i) wrong[r] += recv[i] != base + i / chunk;
      next_input();
      comm.all_reduce(send.data(), n, DType::f32, ReduceOp::sum);
      for (std::size_t i = 0; i < n; ++i) wrong[r] += send[i] != sum();
      next_input();
      comm.reduce(send.data(), n, DType::f32, ReduceOp::sum, root);
      for (std::size_t i = 0; i < n; ++i) wrong[r] += send[i] != (r == root ? sum() : base + r);
      next_input();
      comm.broadcast(send.data(), n, DType::f32, root);
      for (std::size_t i = 0; i < n; ++i) wrong[r] += send[i] != base + root;
    }
  });
  for (int r = 0; r < world; ++r) CHECK(wrong[r] == 0);
}

TEST_CASE("Reductions are reproducible bit for bit across runs", "[comm]") {
  // Arbitrary data (sums are not exact), so any change of order between runs would show.
  const int world = 8;
  const std::size_t n = 4099;
  std::mt19937_64 rng(42);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  PerRank<float> f32(world, std::vector<float>(n));
  PerRank<bf16_t> b16(world, std::vector<bf16_t>(n));
  for (int r = 0; r < world; ++r) {
    for (std::size_t i = 0; i < n; ++i) {
      f32[r][i] = normal(rng) * std::exp2(static_cast<float>(i % 20));
      b16[r][i] = bf16_t(normal(rng));
    }
  }
  auto run_once = [&] {
    PerRank<float> a = f32;
    PerRank<bf16_t> b = b16;
    std::vector<std::vector<float>> scattered(world, std::vector<float>(n / world));
    run_ranks(world, [&](int r, Communicator& comm) {
      comm.all_reduce(a[r].data(), n, DType::f32, ReduceOp::sum);
      comm.all_reduce(b[r].data(), n, DType::bf16, ReduceOp::avg);
      comm.reduce_scatter(f32[r].data(), scattered[r].data(), n / world, DType::f32, ReduceOp::sum);
    });
    return std::make_tuple(a, b, scattered);
  };
  const auto [a1, b1, s1] = run_once();
  const auto [a2, b2, s2] = run_once();
  for (int r = 0; r < world; ++r) {
    CAPTURE(r);
    CHECK(first_difference(a1[r], a2[r]) == "");
    CHECK(first_difference(b1[r], b2[r]) == "");
    CHECK(first_difference(s1[r], s2[r]) == "");
    // And every rank holds the same all_reduce result.
    CHECK(first_difference(a1[r], a1[0]) == "");
    CHECK(first_difference(b1[r], b1[0]) == "");
  }
}

TEST_CASE("barrier returns only after every rank has arrived", "[comm]") {
  for (int world : kWorldSizes) {
    CAPTURE(world);
    std::atomic<int> arrived{0};
    std::vector<int> seen(world);
    run_ranks(world, [&](int r, Communicator& comm) {
      arrived.fetch_add(1);
      comm.barrier();
      seen[r] = arrived.load();
    });
    for (int r = 0; r < world; ++r) CHECK(seen[r] == world);
  }
}

TEST_CASE("Different collectives on two ranks fail every rank with CommError naming both calls",
          "[comm]") {
  std::vector<std::string> caught(2);
  run_ranks(2, [&](int r, Communicator& comm) {
    std::vector<bf16_t> buf(16);
    try {
      if (r == 0) {
        comm.all_gather(buf.data(), buf.data(), 8, DType::bf16);
      } else {
        comm.reduce_scatter(buf.data(), buf.data() + 8, 8, DType::bf16, ReduceOp::sum);
      }
    } catch (const CommError& e) {
      caught[r] = e.what();
    }
  });
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r, caught[r]);
    CHECK(test::contains(caught[r],
                         "InProcessGroup: rank 1 called reduce_scatter(count=8, bf16, "
                         "sum) while rank 0 called all_gather(count=8, bf16)"));
  }
}

TEST_CASE("A difference in count, dtype, op or root is a mismatch on every rank", "[comm]") {
  // Rank 2 of 3 deviates in one argument; the expected text names its call.
  struct Case {
    std::function<void(Communicator&, bool deviate, std::vector<double>&)> call;
    std::string deviant;
  };
  const std::vector<Case> cases = {
      {[](Communicator& c, bool d, std::vector<double>& b) {
         c.all_reduce(b.data(), d ? 5 : 6, DType::f64, ReduceOp::sum);
       },
       "rank 2 called all_reduce(count=5, fp64, sum) while rank 0 called all_reduce(count=6, "
       "fp64, sum)"},
      {[](Communicator& c, bool d, std::vector<double>& b) {
         c.all_reduce(b.data(), 4, d ? DType::f32 : DType::f64, ReduceOp::sum);
       },
       "rank 2 called all_reduce(count=4, fp32, sum)"},
      {[](Communicator& c, bool d, std::vector<double>& b) {
         c.reduce(b.data(), 4, DType::f64, d ? ReduceOp::max : ReduceOp::sum, 0);
       },
       "rank 2 called reduce(count=4, fp64, max, root=0)"},
      {[](Communicator& c, bool d, std::vector<double>& b) {
         c.broadcast(b.data(), 4, DType::f64, d ? 1 : 0);
       },
       "rank 2 called broadcast(count=4, fp64, root=1) while rank 0 called broadcast(count=4, "
       "fp64, root=0)"},
      {[](Communicator& c, bool d, std::vector<double>& b) {
         if (d) {
           c.barrier();
         } else {
           c.broadcast(b.data(), 4, DType::f64, 0);
         }
       },
       "rank 2 called barrier() while rank 0 called broadcast"},
  };
  for (const Case& k : cases) {
    CAPTURE(k.deviant);
    std::vector<std::string> caught(3);
    run_ranks(3, [&](int r, Communicator& comm) {
      std::vector<double> buf(16, 1.0);
      try {
        k.call(comm, r == 2, buf);
      } catch (const CommError& e) {
        caught[r] = e.what();
      }
    });
    for (int r = 0; r < 3; ++r) {
      CAPTURE(r, caught[r]);
      CHECK(test::contains(caught[r], k.deviant));
    }
  }
}

TEST_CASE("The group remains usable after a mismatch", "[comm]") {
  std::vector<float> result(3);
  run_ranks(3, [&](int r, Communicator& comm) {
    float x = 1.0f;
    try {
      comm.all_reduce(&x, r == 1 ? 2 : 1, DType::f32, ReduceOp::sum);
    } catch (const CommError&) {
    }
    comm.all_reduce(&x, 1, DType::f32, ReduceOp::sum);
    result[r] = x;
  });
  for (int r = 0; r < 3; ++r) CHECK(result[r] == 3.0f);
}

TEST_CASE("run_ranks rethrows the exception of a rank that failed, with its type", "[comm]") {
  std::vector<std::string> others;
  CHECK(run_with_failing_rank(others) == "rank 2 failed on purpose");
}

TEST_CASE("Ranks blocked in a collective get CommError when another rank fails", "[comm]") {
  std::vector<std::string> others;
  run_with_failing_rank(others);
  for (int r : {0, 1, 3}) {
    CAPTURE(r, others[r]);
    CHECK(test::contains(others[r], "all_reduce(count=1, fp32, sum): rank " + std::to_string(r) +
                                        " aborted: run_ranks: rank 2 failed: rank 2 failed on "
                                        "purpose"));
  }
}

TEST_CASE("abort fails the collective in progress and every later one", "[comm]") {
  InProcessGroup group(2);
  std::string in_progress;
  std::thread waiter([&] {
    try {
      group.rank(0).barrier();  // rank 1 never comes
    } catch (const CommError& e) {
      in_progress = e.what();
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // usually lets rank 0 block first
  group.abort("stopped by the test");
  group.abort("a second reason is ignored");
  waiter.join();
  CHECK(in_progress == "barrier(): rank 0 aborted: stopped by the test");
  float x = 0.0f;
  CHECK(test::message_of<CommError>([&] {
          group.rank(1).all_reduce(&x, 1, DType::f32, ReduceOp::sum);
        }) == "all_reduce(count=1, fp32, sum): rank 1 aborted: stopped by the test");
}

TEST_CASE("A root outside the group is a ConfigError", "[comm]") {
  InProcessGroup single(1);
  float x = 0.0f;
  CHECK(test::message_of<ConfigError>([&] {
          single.rank(0).reduce(&x, 1, DType::f32, ReduceOp::sum, 1);
        }) == "reduce(count=1, fp32, sum, root=1): root 1 is out of range for world size 1");
  CHECK_THROWS_AS(single.rank(0).broadcast(&x, 1, DType::f32, -1), ConfigError);
  // With several ranks, every rank that passes the bad root fails at once; nobody waits.
  std::vector<std::string> caught(3);
  run_ranks(3, [&](int r, Communicator& comm) {
    float y = 0.0f;
    try {
      comm.broadcast(&y, 1, DType::f32, 3);
    } catch (const ConfigError& e) {
      caught[r] = e.what();
    }
  });
  for (int r = 0; r < 3; ++r) {
    CHECK(caught[r] == "broadcast(count=1, fp32, root=3): root 3 is out of range for world size 3");
  }
}

TEST_CASE("A null buffer with a non-zero count is a ConfigError", "[comm]") {
  InProcessGroup single(1);
  Communicator& comm = single.rank(0);
  float x = 0.0f;
  CHECK(test::message_of<ConfigError>([&] {
          comm.all_reduce(nullptr, 4, DType::f32, ReduceOp::sum);
        }) == "all_reduce(count=4, fp32, sum): data is null");
  CHECK_THROWS_AS(comm.all_gather(&x, nullptr, 1, DType::f32), ConfigError);
  comm.all_reduce(nullptr, 0, DType::f32, ReduceOp::sum);  // nothing to touch, nothing to check
}
