// The NCCL communicator: every collective against a float64 host reference, with one rank on
// GPU 0 and, where the machine has several GPUs, one rank per GPU (one thread each). Values are
// small integers, so every partial sum is exact in every dtype, bf16 included, whatever order
// NCCL sums in; only avg over a world size that is not a power of two is compared with a
// tolerance. Catch2 assertions are not thread-safe: rank threads record what they see and the
// test thread checks.
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "engine/comm/nccl.h"
#include "memory/allocator.h"
#include "memory/error.h"
#include "memory/host_types.h"
#include "tests/catch_compat.h"

using namespace shardswap;

namespace {

const ReduceOp kOps[] = {ReduceOp::sum, ReduceOp::avg, ReduceOp::max};

template <class T>
double to_double(T x) {
  if constexpr (std::is_same_v<T, double>) {
    return x;
  } else {
    return static_cast<double>(static_cast<float>(x));
  }
}

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
