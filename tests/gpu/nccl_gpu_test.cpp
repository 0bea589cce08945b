// The NCCL communicator: every collective against a float64 host reference, with one rank on
// GPU 0 and, where the machine has several GPUs, one rank per GPU (one thread each). Values are
// small integers, so every partial sum is exact in every dtype, bf16 included, whatever order
// NCCL sums in; only avg over a world size that is not a power of two is compared with a
// tolerance. Catch2 assertions are not thread-safe: rank threads record what they see and the
// test thread checks.
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "shardswap/nccl.h"
#include "shardswap/allocator.h"
#include "shardswap/error.h"
#include "memory/host_types.h"
#include "tests/catch_compat.h"
#include "tests/support/typed_values.h"

using namespace shardswap;

namespace {

const ReduceOp kOps[] = {ReduceOp::sum, ReduceOp::avg, ReduceOp::max};

using test_support::to_double;

/// Element i of rank r's data in test `seed`: an integer in [-8, 8]. Sums over up to 8 ranks stay
/// within [-64, 64], exact in bf16 (8 significant bits) and in every other dtype.
double value(int seed, int r, std::size_t i) {
  const std::size_t k = (i * 7 + static_cast<std::size_t>(r * 13 + seed * 5)) % 17;
  return static_cast<double>(k) - 8.0;
}

template <class T>
std::vector<T> values(int seed, int r, std::size_t n, std::size_t first = 0) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = T(value(seed, r, first + i));
  return v;
}

/// op over ranks 0..world-1 of value(seed, r, i), in float64.
double reference(ReduceOp op, int seed, int world, std::size_t i) {
  double acc = value(seed, 0, i);
  for (int r = 1; r < world; ++r) {
    const double v = value(seed, r, i);
    acc = op == ReduceOp::max ? std::max(acc, v) : acc + v;
  }
  return op == ReduceOp::avg ? acc / world : acc;
}

/// Exact for sum and max. avg: NCCL multiplies each input by 1/world rounded to the dtype, then
/// sums; exact when world is a power of two, else within a few roundings of the largest term.
template <class T>
double tolerance(ReduceOp op, int world) {
  if (op != ReduceOp::avg || (world & (world - 1)) == 0) return 0.0;
  const double eps = std::is_same_v<T, double>   ? std::numeric_limits<double>::epsilon()
                     : std::is_same_v<T, float>  ? std::numeric_limits<float>::epsilon()
                     : std::is_same_v<T, bf16_t> ? 1.0 / 128
                                                 : 1.0 / 1024;
  return 8.0 * world * eps;  // |inputs| <= 8, so |each term| <= 8 / world
}

const char* type_name(DType t) {
  return dtype_name(t);
}

/// Device memory on one GPU, freed when it goes. Copies run on the calling thread's
/// cudaStreamPerThread (through the allocator) and wait for it: a download therefore waits for
/// the collectives before it, which is what makes the checks below test their ordering too.
class DeviceArray {
 public:
  DeviceArray(Allocator& allocator, std::size_t bytes)
      : allocator_(allocator), block_(allocator.allocate(bytes)) {}
  ~DeviceArray() { allocator_.deallocate(block_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;

  std::byte* data() { return static_cast<std::byte*>(block_.ptr); }

  template <class T>
  void upload(const std::vector<T>& v, std::size_t offset_elems = 0) {
    allocator_.upload(data() + offset_elems * sizeof(T), v.data(), v.size() * sizeof(T));
  }
  template <class T>
  std::vector<T> download(std::size_t n, std::size_t offset_elems = 0) {
    std::vector<T> v(n);
    allocator_.download(v.data(), data() + offset_elems * sizeof(T), n * sizeof(T));
    return v;
  }

 private:
  Allocator& allocator_;
  Block block_;
};

/// What one rank saw that it did not expect; at most a few lines per check, so a wrong
/// collective does not print a million lines.
class Findings {
 public:
  template <class T>
  void compare(const std::string& what, const std::vector<T>& got,
               const std::function<double(std::size_t)>& expected, double tol) {
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < got.size(); ++i) {
      const double g = to_double(got[i]), e = expected(i);
      if (std::abs(g - e) <= tol) continue;
      if (++wrong <= 3)
        lines_.push_back(fmt::format("{}: element {} is {}, expected {}", what, i, g, e));
    }
    if (wrong > 3) lines_.push_back(fmt::format("{}: {} elements wrong in all", what, wrong));
  }
  void add(std::string line) { lines_.push_back(std::move(line)); }
  const std::vector<std::string>& lines() const { return lines_; }

 private:
  std::vector<std::string> lines_;
};

/// Runs fn(rank, comm, allocator, findings) on one thread per GPU (all visible GPUs, up to 8),
/// then checks on this thread that no rank found anything wrong or threw.
void on_every_gpu(const std::function<void(Communicator&, Allocator&, Findings&)>& fn) {
  const int world = std::min(cuda_device_count(), 8);
  std::vector<int> devices;
  for (int d = 0; d < world; ++d) devices.push_back(d);
  auto comms = make_nccl_communicators(devices);
  REQUIRE(static_cast<int>(comms.size()) == world);
  std::vector<Findings> findings(static_cast<std::size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      Findings& f = findings[static_cast<std::size_t>(r)];
      try {
        auto allocator = make_cuda_allocator(r);
        Communicator& comm = *comms[static_cast<std::size_t>(r)];
        if (comm.rank() != r || comm.world_size() != world) {
          f.add(fmt::format("rank {} reports rank {} of {}", r, comm.rank(), comm.world_size()));
        }
        fn(comm, *allocator, f);
      } catch (const std::exception& e) {
        f.add(fmt::format("threw: {}", e.what()));
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < world; ++r) {
    INFO("rank " << r << " of " << world);
    for (const auto& line : findings[static_cast<std::size_t>(r)].lines()) UNSCOPED_INFO(line);
    CHECK(findings[static_cast<std::size_t>(r)].lines().empty());
  }
}

bool several_gpus() {
  if (cuda_device_count() >= 2) return true;
  WARN("only one GPU is visible: the multi-GPU NCCL checks did not run");
  return false;
}

// The checks below run unchanged on one rank and on every GPU.

template <class T>
void check_all_reduce(Communicator& comm, Allocator& a, Findings& f) {
  const int world = comm.world_size(), r = comm.rank();
  const DType dtype = dtype_of<T>();
  int seed = 0;
  for (std::size_t count : {std::size_t{1}, std::size_t{1001}, std::size_t{(1 << 20) + 3}}) {
    for (ReduceOp op : kOps) {
      ++seed;
      DeviceArray d(a, count * sizeof(T));
      d.upload(values<T>(seed, r, count));
      comm.all_reduce(d.data(), count, dtype, op);
      f.compare(
          fmt::format("all_reduce(count={}, {}, {})", count, type_name(dtype), reduce_op_name(op)),
          d.download<T>(count), [&](std::size_t i) { return reference(op, seed, world, i); },
          tolerance<T>(op, world));
    }
  }
}

template <class T>
void check_reduce_scatter(Communicator& comm, Allocator& a, Findings& f) {
  const int world = comm.world_size(), r = comm.rank();
  const DType dtype = dtype_of<T>();
  int seed = 10;
  for (std::size_t chunk : {std::size_t{1}, std::size_t{300}, std::size_t{(1 << 18) + 1}}) {
    const std::size_t total = chunk * static_cast<std::size_t>(world);
    const std::size_t mine = chunk * static_cast<std::size_t>(r);
    for (ReduceOp op : kOps) {
      for (bool in_place : {false, true}) {
        ++seed;
        DeviceArray send(a, total * sizeof(T));
        send.upload(values<T>(seed, r, total));
        std::unique_ptr<DeviceArray> out;
        std::byte* recv = send.data() + mine * sizeof(T);
        if (!in_place) {
          out = std::make_unique<DeviceArray>(a, chunk * sizeof(T));
          recv = out->data();
        }
        comm.reduce_scatter(send.data(), recv, chunk, dtype, op);
        const auto got = in_place ? send.download<T>(chunk, mine) : out->download<T>(chunk);
        f.compare(
            fmt::format("reduce_scatter(count={}, {}, {}{})", chunk, type_name(dtype),
                        reduce_op_name(op), in_place ? ", in place" : ""),
            got, [&](std::size_t i) { return reference(op, seed, world, mine + i); },
            tolerance<T>(op, world));
      }
    }
  }
}

template <class T>
void check_reduce(Communicator& comm, Allocator& a, Findings& f) {
  const int world = comm.world_size(), r = comm.rank();
  const DType dtype = dtype_of<T>();
  int seed = 30;
  for (int root : {0, world - 1}) {
    for (std::size_t count : {std::size_t{7}, std::size_t{100003}}) {
      for (ReduceOp op : kOps) {
        ++seed;
        DeviceArray d(a, count * sizeof(T));
        d.upload(values<T>(seed, r, count));
        comm.reduce(d.data(), count, dtype, op, root);
        const std::string what = fmt::format("reduce(count={}, {}, {}, root={})", count,
                                             type_name(dtype), reduce_op_name(op), root);
        if (r == root) {
          f.compare(
              what, d.download<T>(count),
              [&](std::size_t i) { return reference(op, seed, world, i); },
              tolerance<T>(op, world));
        } else {
          f.compare(
              what + " left a non-root's data", d.download<T>(count),
              [&](std::size_t i) { return value(seed, r, i); }, 0.0);
        }
      }
    }
  }
}

template <class T>
void check_all_gather(Communicator& comm, Allocator& a, Findings& f) {
  const int world = comm.world_size(), r = comm.rank();
  const DType dtype = dtype_of<T>();
  int seed = 50;
  for (std::size_t chunk : {std::size_t{1}, std::size_t{300}, std::size_t{(1 << 18) + 1}}) {
    const std::size_t total = chunk * static_cast<std::size_t>(world);
    const std::size_t mine = chunk * static_cast<std::size_t>(r);
    for (bool in_place : {false, true}) {
      ++seed;
      // Rank q's chunk holds value(seed, q, q * chunk + i): the gathered buffer then reads
      // value(seed, i / chunk, i) at every i.
      const auto own = values<T>(seed, r, chunk, mine);
      DeviceArray recv(a, total * sizeof(T));
      std::unique_ptr<DeviceArray> in;
      const std::byte* send = recv.data() + mine * sizeof(T);
      if (in_place) {
        recv.upload(own, mine);
      } else {
        in = std::make_unique<DeviceArray>(a, chunk * sizeof(T));
        in->upload(own);
        send = in->data();
      }
      comm.all_gather(send, recv.data(), chunk, dtype);
      f.compare(
          fmt::format("all_gather(count={}, {}{})", chunk, type_name(dtype),
                      in_place ? ", in place" : ""),
          recv.download<T>(total),
          [&](std::size_t i) { return value(seed, static_cast<int>(i / chunk), i); }, 0.0);
    }
  }
}

template <class T>
void check_broadcast(Communicator& comm, Allocator& a, Findings& f) {
  const int world = comm.world_size(), r = comm.rank();
  const DType dtype = dtype_of<T>();
  int seed = 70;
  for (int root : {0, world - 1}) {
    for (std::size_t count : {std::size_t{5}, std::size_t{(1 << 20) + 7}}) {
      ++seed;
      DeviceArray d(a, count * sizeof(T));
      d.upload(values<T>(seed, r, count));
      comm.broadcast(d.data(), count, dtype, root);
      f.compare(
          fmt::format("broadcast(count={}, {}, root={})", count, type_name(dtype), root),
          d.download<T>(count), [&](std::size_t i) { return value(seed, root, i); }, 0.0);
    }
  }
}

template <template <class> class Check>
void for_every_dtype(Communicator& comm, Allocator& a, Findings& f) {
  Check<float>::run(comm, a, f);
  Check<double>::run(comm, a, f);
  Check<bf16_t>::run(comm, a, f);
  Check<f16_t>::run(comm, a, f);
}

// Class-template wrappers, so for_every_dtype can take "the check" as one argument.
template <class T>
struct AllReduce {
  static void run(Communicator& c, Allocator& a, Findings& f) { check_all_reduce<T>(c, a, f); }
};
template <class T>
struct ReduceScatter {
  static void run(Communicator& c, Allocator& a, Findings& f) { check_reduce_scatter<T>(c, a, f); }
};
template <class T>
struct Reduce {
  static void run(Communicator& c, Allocator& a, Findings& f) { check_reduce<T>(c, a, f); }
};
template <class T>
struct AllGather {
  static void run(Communicator& c, Allocator& a, Findings& f) { check_all_gather<T>(c, a, f); }
};
template <class T>
struct Broadcast {
  static void run(Communicator& c, Allocator& a, Findings& f) { check_broadcast<T>(c, a, f); }
};

/// Runs fn on one NCCL rank on GPU 0, on this thread.
void on_gpu0(const std::function<void(Communicator&, Allocator&, Findings&)>& fn) {
  auto comms = make_nccl_communicators({0});
  REQUIRE(comms.size() == 1);
  auto allocator = make_cuda_allocator(0);
  Findings f;
  fn(*comms[0], *allocator, f);
  for (const auto& line : f.lines()) UNSCOPED_INFO(line);
  CHECK(f.lines().empty());
}

}  // namespace

// ---- One rank on GPU 0 ----

TEST_CASE("nccl: one GPU is rank 0 of a world of size 1") {
  auto comms = make_nccl_communicators({0});
  REQUIRE(comms.size() == 1);
  CHECK(comms[0]->rank() == 0);
  CHECK(comms[0]->world_size() == 1);
}

TEST_CASE("nccl: on one GPU, all_reduce returns the data for sum, avg and max in every dtype") {
  on_gpu0(for_every_dtype<AllReduce>);
}

TEST_CASE("nccl: on one GPU, reduce_scatter copies send into recv, out of place and in place") {
  on_gpu0(for_every_dtype<ReduceScatter>);
}

TEST_CASE("nccl: on one GPU, reduce keeps the data at root 0") {
  on_gpu0(for_every_dtype<Reduce>);
}

TEST_CASE("nccl: on one GPU, all_gather copies send into recv, out of place and in place") {
  on_gpu0(for_every_dtype<AllGather>);
}

TEST_CASE("nccl: on one GPU, broadcast keeps the data") {
  on_gpu0(for_every_dtype<Broadcast>);
}

TEST_CASE("nccl: on one GPU, barrier returns and collectives still work after it") {
  on_gpu0([](Communicator& comm, Allocator& a, Findings& f) {
    comm.barrier();
    comm.barrier();
    check_all_reduce<float>(comm, a, f);
    comm.barrier();
  });
}

TEST_CASE("nccl: collectives with a zero count do nothing, even on null buffers") {
  auto comms = make_nccl_communicators({0});
  Communicator& comm = *comms[0];
  comm.all_reduce(nullptr, 0, DType::f32, ReduceOp::sum);
  comm.reduce_scatter(nullptr, nullptr, 0, DType::bf16, ReduceOp::avg);
  comm.reduce(nullptr, 0, DType::f16, ReduceOp::max, 0);
  comm.all_gather(nullptr, nullptr, 0, DType::f64);
  comm.broadcast(nullptr, 0, DType::f32, 0);
  comm.barrier();
}

TEST_CASE("nccl: a collective runs after the caller's queued work and before its later work") {
  // A large copy is queued on cudaStreamPerThread without waiting for it, then a reduce_scatter
  // (a copy, on one rank) reads what it wrote, then a copy back is queued: correct data means
  // the communicator's stream waited for the first copy and the second waited for it, with no
  // host synchronization in between.
  auto comms = make_nccl_communicators({0});
  Communicator& comm = *comms[0];
  auto allocator = make_cuda_allocator(0);
  const std::size_t n = std::size_t{32} << 20;  // 128 MiB of float32
  const std::size_t bytes = n * sizeof(float);
  DeviceArray send(*allocator, bytes), recv(*allocator, bytes);
  float* host_in = nullptr;
  float* host_out = nullptr;
  REQUIRE(cudaMallocHost(&host_in, bytes) == cudaSuccess);
  REQUIRE(cudaMallocHost(&host_out, bytes) == cudaSuccess);
  std::size_t wrong = 0;
  for (int round = 1; round <= 3; ++round) {
    for (std::size_t i = 0; i < n; ++i) host_in[i] = static_cast<float>((i + round) % 1000);
    REQUIRE(cudaMemset(recv.data(), 0xff, bytes) == cudaSuccess);  // NaNs: stale data shows
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    REQUIRE(cudaMemcpyAsync(send.data(), host_in, bytes, cudaMemcpyHostToDevice,
                            cudaStreamPerThread) == cudaSuccess);
    comm.reduce_scatter(send.data(), recv.data(), n, DType::f32, ReduceOp::sum);
    REQUIRE(cudaMemcpyAsync(host_out, recv.data(), bytes, cudaMemcpyDeviceToHost,
                            cudaStreamPerThread) == cudaSuccess);
    REQUIRE(cudaStreamSynchronize(cudaStreamPerThread) == cudaSuccess);
    for (std::size_t i = 0; i < n; ++i) wrong += host_out[i] != host_in[i] ? 1 : 0;
  }
  cudaFreeHost(host_in);
  cudaFreeHost(host_out);
  CHECK(wrong == 0);
}

TEST_CASE("nccl: a root out of range and a null buffer are ConfigErrors naming the collective") {
  auto comms = make_nccl_communicators({0});
  Communicator& comm = *comms[0];
  auto allocator = make_cuda_allocator(0);
  DeviceArray d(*allocator, 64);
  auto message = test::message_of<ConfigError>(
      [&] { comm.reduce(d.data(), 4, DType::bf16, ReduceOp::sum, 1); });
  CHECK(test::contains(message, "reduce("));
  CHECK(test::contains(message, "root 1"));
  message = test::message_of<ConfigError>([&] { comm.broadcast(d.data(), 4, DType::f32, -1); });
  CHECK(test::contains(message, "broadcast("));
  message = test::message_of<ConfigError>(
      [&] { comm.all_reduce(nullptr, 4, DType::f32, ReduceOp::sum); });
  CHECK(test::contains(message, "all_reduce("));
  CHECK(test::contains(message, "null"));
  message = test::message_of<ConfigError>(
      [&] { comm.reduce_scatter(d.data(), nullptr, 4, DType::f32, ReduceOp::sum); });
  CHECK(test::contains(message, "reduce_scatter("));
  message =
      test::message_of<ConfigError>([&] { comm.all_gather(nullptr, d.data(), 4, DType::f32); });
  CHECK(test::contains(message, "all_gather("));
  // The communicator is still usable afterwards.
  comm.barrier();
}

TEST_CASE("nccl: recv overlapping send other than in place is a ConfigError") {
  auto comms = make_nccl_communicators({0});
  Communicator& comm = *comms[0];
  auto allocator = make_cuda_allocator(0);
  DeviceArray d(*allocator, 64 * sizeof(float));
  auto message = test::message_of<ConfigError>(
      [&] { comm.reduce_scatter(d.data(), d.data() + 4, 8, DType::f32, ReduceOp::sum); });
  CHECK(test::contains(message, "in place"));
  message = test::message_of<ConfigError>(
      [&] { comm.all_gather(d.data() + 4, d.data(), 8, DType::f32); });
  CHECK(test::contains(message, "in place"));
}

TEST_CASE("nccl: make_nccl_communicators rejects no devices, unknown devices and repeats") {
  CHECK(
      test::contains(test::message_of<ConfigError>([] { make_nccl_communicators({}); }), "empty"));
  const int count = cuda_device_count();
  CHECK(test::contains(test::message_of<ConfigError>([&] { make_nccl_communicators({count}); }),
                       "does not exist"));
  CHECK(test::contains(test::message_of<ConfigError>([] { make_nccl_communicators({-1}); }),
                       "does not exist"));
  CHECK(test::contains(test::message_of<ConfigError>([] {
                         make_nccl_communicators({0, 0});
                       }),
                       "twice"));
}

TEST_CASE("nccl: make_nccl_communicators leaves the calling thread's current GPU as it was") {
  const int last = cuda_device_count() - 1;
  REQUIRE(cudaSetDevice(last) == cudaSuccess);
  { auto comms = make_nccl_communicators({0}); }
  int current = -1;
  REQUIRE(cudaGetDevice(&current) == cudaSuccess);
  CHECK(current == last);
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
}

// ---- One rank per GPU, one thread each ----

TEST_CASE("nccl: on every GPU, all_reduce matches the float64 reference in every dtype") {
  if (several_gpus()) on_every_gpu(for_every_dtype<AllReduce>);
}

TEST_CASE("nccl: on every GPU, reduce_scatter matches the reference, out of place and in place") {
  if (several_gpus()) on_every_gpu(for_every_dtype<ReduceScatter>);
}

TEST_CASE("nccl: on every GPU, reduce gives root the reference and leaves the others' data") {
  if (several_gpus()) on_every_gpu(for_every_dtype<Reduce>);
}

TEST_CASE(
    "nccl: on every GPU, all_gather assembles every rank's chunk, out of place and in place") {
  if (several_gpus()) on_every_gpu(for_every_dtype<AllGather>);
}

TEST_CASE("nccl: on every GPU, broadcast gives every rank root's data") {
  if (several_gpus()) on_every_gpu(for_every_dtype<Broadcast>);
}

TEST_CASE("nccl: on every GPU, barriers between collectives keep them in step") {
  if (!several_gpus()) return;
  on_every_gpu([](Communicator& comm, Allocator& a, Findings& f) {
    for (int i = 0; i < 3; ++i) {
      comm.barrier();
      check_reduce_scatter<bf16_t>(comm, a, f);
      comm.barrier();
      check_all_gather<bf16_t>(comm, a, f);
    }
    comm.barrier();
  });
}

// ---- The timeout: a watchdog per communicator ----

namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;
using std::chrono::steady_clock;

double seconds_since(steady_clock::time_point t) {
  return std::chrono::duration<double>(steady_clock::now() - t).count();
}

/// Runs fn on its own thread and waits at most `limit` for it, so that a test of hangs cannot
/// hang: past the limit the process exits with a message (a stuck thread cannot be stopped, and
/// unwinding would free what it still uses).
void within(seconds limit, const std::string& what, const std::function<void()>& fn) {
  std::mutex mutex;
  std::condition_variable cv;
  bool done = false;
  std::exception_ptr error;
  std::thread worker([&] {
    try {
      fn();
    } catch (...) {
      error = std::current_exception();
    }
    std::lock_guard lock(mutex);
    done = true;
    cv.notify_all();
  });
  {
    std::unique_lock lock(mutex);
    if (!cv.wait_for(lock, limit, [&] { return done; })) {
      std::fprintf(stderr, "FATAL: %s did not finish within %lld s: it hangs\n", what.c_str(),
                   static_cast<long long>(limit.count()));
      std::fflush(stderr);
      std::_Exit(3);
    }
  }
  worker.join();
  if (error) std::rethrow_exception(error);
}

/// Rank r's random floats in [-1, 1) for test `seed`.
std::vector<float> random_floats(int seed, int r, std::size_t n) {
  std::mt19937 rng(static_cast<std::uint32_t>(seed * 1000 + r));
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

}  // namespace

TEST_CASE(
    "nccl: with a timeout, a rank whose peer skips an all_reduce gets CommError naming it, "
    "and nothing hangs") {
  if (!several_gpus()) return;
  constexpr std::size_t n = (1 << 20) + 5;
  const milliseconds timeout(2000);
  struct Seen {
    std::vector<std::string> problems;  // anything unexpected
    std::string error;                  // rank 0: check()'s CommError after the stuck all_reduce
    std::string later;                  // rank 0: a later all_reduce's CommError
    double seconds = -1.0;              // rank 0: from issuing the stuck all_reduce to the error
  };
  std::vector<Seen> seen(2);
  double destroy_seconds = -1.0;
  within(seconds(120), "the skipped all_reduce test", [&] {
    auto comms = make_nccl_communicators({0, 1}, timeout);
    std::atomic<bool> rank0_done{false};
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        Seen& s = seen[static_cast<std::size_t>(r)];
        try {
          if (cudaSetDevice(r) != cudaSuccess) throw std::runtime_error("cudaSetDevice failed");
          auto allocator = make_cuda_allocator(r);
          Communicator& comm = *comms[static_cast<std::size_t>(r)];
          DeviceArray d(*allocator, n * sizeof(float));
          // One all_reduce both make (and NCCL connects for): a sum of two floats rounds once,
          // so it equals the float64 sum rounded to float.
          const auto a = random_floats(1, 0, n), b = random_floats(1, 1, n);
          d.upload(r == 0 ? a : b);
          comm.all_reduce(d.data(), n, DType::f32, ReduceOp::sum);
          const auto got = d.download<float>(n);
          for (std::size_t i = 0; i < n; ++i) {
            const float want = static_cast<float>(static_cast<double>(a[i]) + b[i]);
            if (got[i] != want) {
              s.problems.push_back(
                  fmt::format("the shared all_reduce: element {} is {}, not {}", i, got[i], want));
              break;
            }
          }
          if (r == 1) {
            // Alive but never joins the next all_reduce; keeps its buffers until rank 0 is done.
            const auto start = steady_clock::now();
            while (!rank0_done && seconds_since(start) < 60)
              std::this_thread::sleep_for(milliseconds(10));
            return;
          }
          const auto start = steady_clock::now();
          comm.all_reduce(d.data(), n, DType::f32, ReduceOp::sum);  // rank 1 never joins
          // The engine's kind of host wait: it returns once the watchdog has aborted the
          // communicator (its kernel ends), not forever later.
          const cudaError_t synced = cudaStreamSynchronize(cudaStreamPerThread);
          if (synced != cudaSuccess)
            s.problems.push_back(fmt::format("cudaStreamSynchronize after the abort: {}",
                                             cudaGetErrorString(synced)));
          try {
            comm.check();
            s.problems.push_back("check() did not throw after the stuck all_reduce");
          } catch (const CommError& e) {
            s.error = e.what();
            s.seconds = seconds_since(start);
          }
          try {
            comm.all_reduce(d.data(), n, DType::f32, ReduceOp::sum);
            s.problems.push_back("an all_reduce after the abort did not throw");
          } catch (const CommError& e) {
            s.later = e.what();
          }
        } catch (const std::exception& e) {
          s.problems.push_back(fmt::format("threw: {}", e.what()));
        }
        if (r == 0) rank0_done = true;
      });
    }
    for (auto& t : threads) t.join();
    const auto start = steady_clock::now();
    comms.clear();  // rank 0's was aborted by its watchdog, rank 1's is idle
    destroy_seconds = seconds_since(start);
  });
  for (int r = 0; r < 2; ++r) {
    INFO("rank " << r);
    for (const auto& line : seen[static_cast<std::size_t>(r)].problems) UNSCOPED_INFO(line);
    CHECK(seen[static_cast<std::size_t>(r)].problems.empty());
  }
  const Seen& s = seen[0];
  CAPTURE(s.error, s.later, s.seconds, destroy_seconds);
  CHECK(test::contains(s.error, "NcclCommunicator::check(): "));
  CHECK(test::contains(s.error, "rank 0 of 2 on device 0"));
  CHECK(test::contains(s.error, fmt::format("all_reduce(count={}, fp32, sum)", n)));
  CHECK(test::contains(s.error, "timeout of 2000 ms"));
  CHECK(test::contains(s.later,
                       fmt::format("NcclCommunicator::all_reduce(count={}, fp32, sum): ", n)));
  CHECK(test::contains(s.later, "timeout of 2000 ms"));
  CHECK(s.seconds >= 1.9);  // not before the timeout
  CHECK(s.seconds < 30.0);  // and soon after it
  CHECK(destroy_seconds < 30.0);
  WARN(
      fmt::format("stuck all_reduce: CommError after {:.2f} s (timeout 2 s); communicators "
                  "destroyed in {:.3f} s",
                  s.seconds, destroy_seconds));
}

TEST_CASE("nccl: with a timeout, collectives that complete give bit-identical results to none") {
  const int world = std::min(cuda_device_count(), 8);
  std::vector<int> devices;
  for (int d = 0; d < world; ++d) devices.push_back(d);
  constexpr std::size_t n = 4099;  // odd, so that chunks are uneven
  constexpr int kRepeats = 200;    // enough to reuse the watchdog's events many times over
  struct Run {
    std::vector<std::vector<std::vector<float>>> outputs;  // [rank][collective]
    std::vector<std::string> problems;
    double seconds = 0.0;  // rank 0's kRepeats all_reduces
  };
  const auto run = [&](milliseconds timeout) {
    Run out;
    out.outputs.resize(static_cast<std::size_t>(world));
    auto comms = make_nccl_communicators(devices, timeout);
    std::mutex mutex;
    std::vector<std::thread> threads;
    for (int r = 0; r < world; ++r) {
      threads.emplace_back([&, r] {
        auto& mine = out.outputs[static_cast<std::size_t>(r)];
        try {
          if (cudaSetDevice(r) != cudaSuccess) throw std::runtime_error("cudaSetDevice failed");
          auto allocator = make_cuda_allocator(r);
          Communicator& comm = *comms[static_cast<std::size_t>(r)];
          const auto w = static_cast<std::size_t>(world);
          DeviceArray d(*allocator, w * n * sizeof(float));
          const auto start = steady_clock::now();
          for (int k = 0; k < kRepeats; ++k) {
            d.upload(random_floats(k, r, n));
            comm.all_reduce(d.data(), n, DType::f32, ReduceOp::sum);
            if (k % 50 == 0) mine.push_back(d.download<float>(n));
          }
          mine.push_back(d.download<float>(n));
          if (r == 0) out.seconds = seconds_since(start);
          d.upload(random_floats(kRepeats + 1, r, w * n));
          comm.reduce_scatter(d.data(), d.data() + r * n * sizeof(float), n, DType::f32,
                              ReduceOp::avg);
          mine.push_back(d.download<float>(n, static_cast<std::size_t>(r) * n));
          d.upload(random_floats(kRepeats + 2, r, n), static_cast<std::size_t>(r) * n);
          comm.all_gather(d.data() + r * n * sizeof(float), d.data(), n, DType::f32);
          mine.push_back(d.download<float>(w * n));
          // A group of reduces to every root (one watched entry), deferred work and a barrier.
          d.upload(random_floats(kRepeats + 3, r, w * n));
          comm.group_start();
          for (int q = 0; q < world; ++q)
            comm.reduce(d.data() + q * n * sizeof(float), n, DType::f32, ReduceOp::sum, q);
          comm.group_end();
          mine.push_back(d.download<float>(n, static_cast<std::size_t>(r) * n));
          comm.set_deferred(true);
          d.upload(random_floats(kRepeats + 4, r, n));
          comm.broadcast(d.data(), n, DType::f32, world - 1);
          comm.join();
          comm.set_deferred(false);
          mine.push_back(d.download<float>(n));
          comm.barrier();
          comm.check();
        } catch (const std::exception& e) {
          std::lock_guard lock(mutex);
          out.problems.push_back(fmt::format("rank {} threw: {}", r, e.what()));
        }
      });
    }
    for (auto& t : threads) t.join();
    return out;
  };
  Run without, with;
  within(seconds(300), "the bit-identical timeout test", [&] {
    without = run(milliseconds(0));
    with = run(milliseconds(30000));
  });
  for (const auto& line : without.problems) UNSCOPED_INFO("without a timeout: " << line);
  for (const auto& line : with.problems) UNSCOPED_INFO("with a timeout: " << line);
  REQUIRE(without.problems.empty());
  REQUIRE(with.problems.empty());
  for (int r = 0; r < world; ++r) {
    INFO("rank " << r << " of " << world);
    const auto& a = without.outputs[static_cast<std::size_t>(r)];
    const auto& b = with.outputs[static_cast<std::size_t>(r)];
    REQUIRE(a.size() == b.size());
    for (std::size_t c = 0; c < a.size(); ++c) {
      INFO("output " << c);
      CHECK(a[c] == b[c]);
    }
  }
  // Results are right, not only alike: the first all_reduce against float64.
  std::vector<double> want(n, 0.0);
  for (int r = 0; r < world; ++r) {
    const auto v = random_floats(0, r, n);
    for (std::size_t i = 0; i < n; ++i) want[i] += v[i];
  }
  Findings f;
  f.compare(
      "all_reduce(count=4099, fp32, sum)", without.outputs[0][0],
      [&](std::size_t i) { return want[i]; },
      4.0 * world * world * std::numeric_limits<float>::epsilon());
  for (const auto& line : f.lines()) UNSCOPED_INFO(line);
  CHECK(f.lines().empty());
  WARN(
      fmt::format("{} all_reduces of {} floats on {} GPU(s), each uploaded first: {:.3f} s "
                  "without a timeout, {:.3f} s with one",
                  kRepeats, n, world, without.seconds, with.seconds));
}
