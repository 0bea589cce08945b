// The MPI communicator (shardswap/mpi.h), run under `mpirun -np N` (tests/CMakeLists.txt): every
// collective, dtype and op, in place and not, gives each rank the same bytes as rank `rank` of
// the in-process backend gets from the same inputs (which every process can make: rank q's
// input is a pure function of q). Plus: zero counts, calls that disagree across ranks, bad
// arguments, and the timeout. Every rank runs every test case in the same order (they are
// collectives), so assertions never stop a case early: CHECK, not REQUIRE.
#define CATCH_CONFIG_RUNNER
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "memory/host_types.h"
#include "shardswap/communicator.h"
#include "shardswap/error.h"
#include "shardswap/mpi.h"
#include "tests/catch_compat.h"

using namespace shardswap;

namespace {

Communicator* world = nullptr;  // this process's rank, made in main()

const DType kDTypes[] = {DType::f32, DType::bf16, DType::f16, DType::f64};
const ReduceOp kOps[] = {ReduceOp::sum, ReduceOp::avg, ReduceOp::max};

using Bytes = std::vector<std::byte>;

/// `count` values of `dtype` in [-2, 2), a pure function of (seed, rank).
Bytes random_values(DType dtype, std::size_t count, int rank, unsigned seed) {
  std::mt19937 gen(seed * 7919u + static_cast<unsigned>(rank));
  std::uniform_real_distribution<double> uniform(-2.0, 2.0);
  Bytes out(count * dtype_size(dtype));
  for (std::size_t i = 0; i < count; ++i) {
    const double v = uniform(gen);
    std::byte* at = out.data() + i * dtype_size(dtype);
    switch (dtype) {
      case DType::f32: {
        const float x = static_cast<float>(v);
        std::memcpy(at, &x, sizeof x);
        break;
      }
      case DType::f64:
        std::memcpy(at, &v, sizeof v);
        break;
      case DType::bf16: {
        const bf16_t x(static_cast<float>(v));
        std::memcpy(at, &x, sizeof x);
        break;
      }
      case DType::f16: {
        const f16_t x(static_cast<float>(v));
        std::memcpy(at, &x, sizeof x);
        break;
      }
    }
  }
  return out;
}

bool all_zero(const Bytes& b) {
  for (std::byte x : b)
    if (x != std::byte{0}) return false;
  return true;
}

/// What a collective does to one rank's buffer, given that rank's communicator.
using Collective = std::function<void(Communicator& comm, Bytes& buffer)>;

/// Rank `rank`'s buffer after `op` on the in-process backend, every rank's buffer made by `make`.
Bytes in_process_result(const std::function<Bytes(int rank)>& make, const Collective& op) {
  const int n = world->world_size();
  std::vector<Bytes> buffers(static_cast<std::size_t>(n));
  run_ranks(n, [&](int r, Communicator& comm) {
    buffers[static_cast<std::size_t>(r)] = make(r);
    op(comm, buffers[static_cast<std::size_t>(r)]);
  });
  return buffers[static_cast<std::size_t>(world->rank())];
}

/// Runs `op` over MPI on this rank's buffer and checks the bytes equal the in-process backend's
/// for this rank, and are not all zero.
void check_same_bits(const std::string& what, const std::function<Bytes(int rank)>& make,
                     const Collective& op) {
  Bytes mine = make(world->rank());
  op(*world, mine);
  const Bytes expected = in_process_result(make, op);
  INFO(what << " on rank " << world->rank() << " of " << world->world_size());
  CHECK(mine.size() == expected.size());
  CHECK(std::memcmp(mine.data(), expected.data(), std::min(mine.size(), expected.size())) == 0);
  CHECK_FALSE(all_zero(mine));
}

std::string name_of(DType d, ReduceOp op) {
  return fmt::format("{} {}", dtype_name(d), reduce_op_name(op));
}

}  // namespace

TEST_CASE("mpi all_reduce gives every rank the in-process backend's bits for every dtype and op") {
  // Counts not divisible by the world size, below it, and across the 256-element blocks.
  for (const std::size_t count :
       {std::size_t{1}, std::size_t{3}, std::size_t{1000}, std::size_t{4099}})
    for (const DType d : kDTypes)
      for (const ReduceOp op : kOps)
        check_same_bits(
            fmt::format("all_reduce(count={}, {})", count, name_of(d, op)),
            [&](int r) { return random_values(d, count, r, 1); },
            [&](Communicator& c, Bytes& b) { c.all_reduce(b.data(), count, d, op); });
}

TEST_CASE("mpi reduce_scatter gives each rank its reduced chunk, in place or not") {
  const auto n = static_cast<std::size_t>(world->world_size());
  for (const std::size_t chunk : {std::size_t{1}, std::size_t{257}})
    for (const DType d : kDTypes)
      for (const ReduceOp op : kOps) {
        const std::size_t esize = dtype_size(d);
        const auto make = [&](int r) { return random_values(d, chunk * n, r, 2); };
        // Out of place: the result goes to a buffer of its own (returned as the rank's bytes).
        check_same_bits(fmt::format("reduce_scatter(recv_count={}, {})", chunk, name_of(d, op)),
                        make, [&](Communicator& c, Bytes& b) {
                          Bytes recv(chunk * esize);
                          c.reduce_scatter(b.data(), recv.data(), chunk, d, op);
                          b = recv;
                        });
        // In place: recv is this rank's chunk of send.
        check_same_bits(
            fmt::format("reduce_scatter in place(recv_count={}, {})", chunk, name_of(d, op)), make,
            [&](Communicator& c, Bytes& b) {
              std::byte* own = b.data() + static_cast<std::size_t>(c.rank()) * chunk * esize;
              c.reduce_scatter(b.data(), own, chunk, d, op);
              b = Bytes(own, own + chunk * esize);
            });
      }
}

TEST_CASE(
    "mpi reduce gives the root the in-process bits and leaves the other ranks' data as it was") {
  const int last = world->world_size() - 1;
  for (const int root : {0, last})
    for (const DType d : kDTypes)
      for (const ReduceOp op : kOps) {
        const auto make = [&](int r) { return random_values(d, 515, r, 3); };
        check_same_bits(fmt::format("reduce(root={}, {})", root, name_of(d, op)), make,
                        [&](Communicator& c, Bytes& b) { c.reduce(b.data(), 515, d, op, root); });
        Bytes mine = make(world->rank());  // every rank calls it: it is a collective
        world->reduce(mine.data(), 515, d, op, root);
        if (world->rank() != root) CHECK(mine == make(world->rank()));
      }
}

TEST_CASE("mpi all_gather puts rank q's chunk at chunk q on every rank, in place or not") {
  const auto n = static_cast<std::size_t>(world->world_size());
  for (const std::size_t chunk : {std::size_t{1}, std::size_t{300}})
    for (const DType d : kDTypes) {
      const std::size_t esize = dtype_size(d);
      const auto send = [&](int r) { return random_values(d, chunk, r, 4); };
      check_same_bits(fmt::format("all_gather(send_count={}, {})", chunk, dtype_name(d)), send,
                      [&](Communicator& c, Bytes& b) {
                        Bytes recv(chunk * n * esize);
                        c.all_gather(b.data(), recv.data(), chunk, d);
                        b = recv;
                      });
      // In place: each rank's chunk already at its place in a recv buffer of garbage elsewhere.
      const auto placed = [&](int r) {
        Bytes recv = random_values(d, chunk * n, r + 1000, 5);
        const Bytes own = send(r);
        std::memcpy(recv.data() + static_cast<std::size_t>(r) * chunk * esize, own.data(),
                    own.size());
        return recv;
      };
      check_same_bits(fmt::format("all_gather in place(send_count={}, {})", chunk, dtype_name(d)),
                      placed, [&](Communicator& c, Bytes& b) {
                        c.all_gather(b.data() + static_cast<std::size_t>(c.rank()) * chunk * esize,
                                     b.data(), chunk, d);
                      });
    }
}

TEST_CASE("mpi broadcast gives every rank the root's bytes") {
  for (const int root : {0, world->world_size() - 1})
    for (const DType d : kDTypes)
      check_same_bits(
          fmt::format("broadcast(root={}, {})", root, dtype_name(d)),
          [&](int r) { return random_values(d, 777, r, 6); },
          [&](Communicator& c, Bytes& b) { c.broadcast(b.data(), 777, d, root); });
}

TEST_CASE("mpi max keeps a NaN that any rank holds, as the in-process backend does") {
  const auto make = [](int r) {
    Bytes b = random_values(DType::f32, 64, r, 7);
    if (r == 1) {
      const float nan = std::numeric_limits<float>::quiet_NaN();
      std::memcpy(b.data() + 5 * sizeof(float), &nan, sizeof nan);
    }
    return b;
  };
  check_same_bits("all_reduce(max) with a NaN on rank 1", make, [](Communicator& c, Bytes& b) {
    c.all_reduce(b.data(), 64, DType::f32, ReduceOp::max);
  });
}

TEST_CASE("mpi collectives of zero elements and the barrier complete on every rank") {
  float x = 1.0f;
  world->all_reduce(nullptr, 0, DType::f32, ReduceOp::sum);
  world->reduce_scatter(nullptr, nullptr, 0, DType::bf16, ReduceOp::avg);
  world->reduce(nullptr, 0, DType::f16, ReduceOp::max, 0);
  world->all_gather(nullptr, nullptr, 0, DType::f64);
  world->broadcast(nullptr, 0, DType::f32, 0);
  world->barrier();
  world->broadcast(&x, 1, DType::f32, 0);
  CHECK(x == 1.0f);
  CHECK(world->device() == DeviceKind::host);
}

TEST_CASE("mpi calls that disagree across ranks fail on every rank naming both calls") {
  std::vector<float> data(10, 1.0f);
  const std::size_t count = world->rank() == 1 ? 9 : 8;
  const std::string message = test::message_of<CommError>(
      [&] { world->all_reduce(data.data(), count, DType::f32, ReduceOp::sum); });
  CHECK(test::contains(message, "rank 1 called all_reduce(count=9, fp32, sum)"));
  CHECK(test::contains(message, "while rank 0 called all_reduce(count=8, fp32, sum)"));
  // Nothing moved, nothing is left in flight: the communicator goes on working.
  float one = 1.0f;
  world->all_reduce(&one, 1, DType::f32, ReduceOp::sum);
  CHECK(one == static_cast<float>(world->world_size()));
}

TEST_CASE("mpi arguments that can never work are refused before waiting for the others") {
  float x = 0.0f;
  const std::string root = test::message_of<ConfigError>(
      [&] { world->broadcast(&x, 1, DType::f32, world->world_size()); });
  CHECK(test::contains(root, "root"));
  CHECK(test::contains(root, "out of range"));
  const std::string null = test::message_of<ConfigError>(
      [&] { world->all_reduce(nullptr, 4, DType::f32, ReduceOp::sum); });
  CHECK(test::contains(null, "data is null"));
  world->barrier();  // still in step
}

TEST_CASE(
    "mpi a rank waiting longer than the timeout fails naming the collective, then stays failed") {
  auto comm = make_mpi_communicator(std::chrono::milliseconds(300));
  world->barrier();
  if (comm->rank() == 0) {
    const auto start = std::chrono::steady_clock::now();
    const std::string message = test::message_of<CommError>([&] { comm->barrier(); });
    const double waited =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    CHECK(test::contains(message, "rank 0 of"));
    CHECK(test::contains(message, "barrier()"));
    CHECK(test::contains(message, "timed out after 300 ms"));
    CHECK(waited < 1.2);  // the others arrive only after 1.5 s
    CHECK(test::message_of<CommError>([&] { comm->check(); }) == message);
    float x = 0.0f;
    CHECK(test::contains(
        test::message_of<CommError>([&] { comm->broadcast(&x, 1, DType::f32, 0); }), "timed out"));
  } else {
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    comm->barrier();  // joins what rank 0 left in flight, so it completes
    CHECK_NOTHROW(comm->check());
  }
  world->barrier();
}

int main(int argc, char* argv[]) {
  // One communicator for the whole run: MPI is initialized once and finalized when it goes.
  auto comm = make_mpi_communicator();
  world = comm.get();
  const int failed = Catch::Session().run(argc, argv);
  world->barrier();
  return failed;
}
