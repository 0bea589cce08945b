// The byte LM on the CUDA backend: loss and every gradient against the float64 reference
// through a real Engine (bf16 and fp16, bit16 and fp32 slots, 1 and 2 ranks sharing the GPU,
// stage 1 and 2, frozen groups), bitwise equal runs, activation memory exactly as planned and no
// device memory taken by cuBLAS beside it, the cuBLAS rate, and a short training run on text.
#define CATCH_CONFIG_EXTERNAL_INTERFACES  // Catch2 v2: listeners outside main.cpp
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <mutex>
#include <string>
#include <vector>

#include "shardswap/backend.h"
#include "shardswap/engine.h"
#include "shardswap/allocator.h"
#include "shardswap/error.h"
#include "tests/catch_compat.h"
#include "tests/gpu/device_memory_guard.h"
#include "tests/support/byte_lm_reference.h"
#include "tools/lm/byte_lm.h"
#include "tools/lm/text_data.h"

using namespace shardswap;
using test_support::ByteLmCase;
using test_support::ByteLmCheck;

namespace {

using test::ListenerBase;

// cuBLAS loads its kernels into device memory on first use and keeps them until the process
// ends (as NCCL does, which main.cpp warms up): load them before the first test case, so that
// the per-test-case checks of free device memory see only what tests allocate.
struct CublasWarmUp : ListenerBase {
  using ListenerBase::ListenerBase;
  void testRunStarting(Catch::TestRunInfo const& info) override {
    ListenerBase::testRunStarting(info);
    if (cuda_device_count() > 0)
      for (DType t : {DType::bf16, DType::f16}) measure_cublas_gemm_tflops(512, 512, 512, t);
  }
};

// GEMM inputs (activations and their gradients) are rounded to the weights' type on the GPU,
// so errors grow beyond the CPU's (which rounds only the slot). A CPU emulation of these rounding
// points (double math, bit16 where the GPU rounds) gave worst gradient errors of 5e-3 (bf16) and
// 7e-4 (fp16) and loss errors of 2e-4 and 7e-6 on these shapes; a wrong formula gives order 1.
double grad_tolerance(DType dtype) {
  return dtype == DType::bf16 ? 2e-2 : 4e-3;
}
double loss_tolerance(DType dtype) {
  return dtype == DType::bf16 ? 2e-3 : 2e-4;
}

ByteLmCheck check(const ByteLmCase& c) {
  CAPTURE(c.world_size, c.stage, dtype_name(c.dtype), dtype_name(c.grad_dtype.value_or(c.dtype)),
          c.active);
  const ByteLmCheck r = test_support::check_byte_lm(c, cuda_backend());
  CAPTURE(r.loss_error, r.worst_grad_error, r.worst_param);
  std::printf(
      "cuda byte LM vs reference: %d rank(s), stage %d, %s weights, %s grads: loss error "
      "%.2e, worst gradient error %.2e (%s)\n",
      c.world_size, c.stage, dtype_name(c.dtype), dtype_name(c.grad_dtype.value_or(c.dtype)),
      r.loss_error, r.worst_grad_error, r.worst_param.c_str());
  REQUIRE(r.steps_applied == c.world_size);
  REQUIRE(r.activation_bytes_match);
  REQUIRE(r.eval_loss_matches);
  REQUIRE(r.frozen_unchanged);
  REQUIRE(r.loss_error < loss_tolerance(c.dtype));
  REQUIRE(r.worst_grad_error < grad_tolerance(c.dtype));
  REQUIRE(!r.grad_errors.empty());
  return r;
}

struct Run {
  std::vector<double> losses;
  std::vector<std::vector<float>> weights;  // rank 0's, every param, after the last step
};

// A few AdamW steps of 2 in-process ranks sharing the GPU, stage 2, from the init.
Run train_briefly(const ByteLmShape& shape, int batch, int steps) {
  EngineConfig cfg;
  cfg.dtype = DType::bf16;
  cfg.optimizer.lr = 1e-3;
  cfg.reduce_bucket_bytes = std::size_t{1} << 20;
  const Backend backend = cuda_backend();
  Run run;
  std::mutex mu;
  run_ranks(
      2,
      [&](int rank, Communicator& comm) {
        MemorySpace space(rank, backend.make_allocator(rank));
        Engine engine(cfg, comm, space, backend);
        ByteLm::declare(shape, engine);
        engine.build([&](const ParamInfo& p, std::span<float> v) { ByteLm::init(shape, p, v, 3); });
        auto model = make_byte_lm(shape, batch, cfg.dtype, space);
        std::vector<double> losses;
        for (int t = 0; t < steps; ++t) {
          losses.push_back(model->train_step(
              engine, test_support::random_token_batch(shape, batch, 100 * t + rank)));
          engine.step();
        }
        if (rank != 0) return;
        std::lock_guard lock(mu);
        run.losses = losses;
        for (const auto& p : engine.params()) run.weights.push_back(engine.read_weight(p.name));
      },
      backend);
  return run;
}

}  // namespace

CATCH_REGISTER_LISTENER(CublasWarmUp)

TEST_CASE("cuda: byte LM matches the float64 reference, bf16 and fp16, one rank, stage 1 and 2") {
  const test::DeviceMemoryGuard guard;
  for (const ByteLmCase& c : test_support::byte_lm_one_rank_dtype_cases())
    REQUIRE(check(c).grad_errors.size() == test_support::byte_lm_reference_params(c.shape).size());
  guard.require_returned();
}

TEST_CASE("cuda: byte LM matches the float64 reference with 2 ranks sharing the GPU") {
  const test::DeviceMemoryGuard guard;
  for (int stage : {1, 2})
    for (DType dtype : {DType::bf16, DType::f16}) {
      ByteLmCase c;
      c.world_size = 2;
      c.stage = stage;
      c.dtype = dtype;
      c.batch = 40;  // more than one partial of the column sums (64 rows) on 2 ranks: 80
      c.max_batch = 100;
      check(c);
    }
  guard.require_returned();
}

TEST_CASE("cuda: byte LM gives frozen groups no gradients and the active ones the reference's") {
  const test::DeviceMemoryGuard guard;
  for (const std::vector<std::string>& active :
       {std::vector<std::string>{"head", "layers.1"}, std::vector<std::string>{"embed", "layers.1"},
        std::vector<std::string>{"layers.0"}, std::vector<std::string>{"head"}}) {
    ByteLmCase c;
    c.shape.depth = 3;
    c.stage = 2;
    c.active = active;
    c.grad_dtype = DType::f32;
    const ByteLmCheck r = check(c);
    for (const auto& [name, err] : r.grad_errors) {
      const auto group = test_support::byte_lm_reference_params(c.shape).at(name).group;
      REQUIRE(std::find(active.begin(), active.end(), group) != active.end());
    }
  }
  guard.require_returned();
}

TEST_CASE("cuda: byte LM matches the reference with a larger batch and shape (many partials)") {
  const test::DeviceMemoryGuard guard;
  ByteLmCase c;
  c.shape = {5, 96, 160, 2};  // widths not multiples of 128: partial blocks of the column sums
  c.batch = 300;              // several chunks (64 rows) of the column sums
  c.max_batch = 300;
  c.grad_dtype = DType::f32;
  check(c);
  guard.require_returned();
}

TEST_CASE("cuda: two byte LM runs from the same start give the same bits") {
  const test::DeviceMemoryGuard guard;
  const ByteLmShape shape{8, 64, 256, 2};
  const Run a = train_briefly(shape, 256, 5), b = train_briefly(shape, 256, 5);
  REQUIRE(a.losses.size() == 5);
  REQUIRE(a.losses == b.losses);
  REQUIRE(a.weights.size() == b.weights.size());
  for (std::size_t p = 0; p < a.weights.size(); ++p) REQUIRE(a.weights[p] == b.weights[p]);
  REQUIRE(a.losses.back() < a.losses.front() + 1.0);  // sane: it trained, not diverged
  guard.require_returned();
}

TEST_CASE("cuda: byte LM activation memory is exactly activation_bytes; cuBLAS's own is bounded") {
  const test::DeviceMemoryGuard guard;
  const ByteLmShape shape{8, 128, 512, 4};
  const Backend backend = cuda_backend();
  run_ranks(
      1,
      [&](int rank, Communicator& comm) {
        MemorySpace space(rank, backend.make_allocator(rank));
        EngineConfig cfg;
        cfg.reduce_bucket_bytes = std::size_t{1} << 22;
        Engine engine(cfg, comm, space, backend);
        ByteLm::declare(shape, engine);
        engine.build([&](const ParamInfo& p, std::span<float> v) { ByteLm::init(shape, p, v, 1); });
        const TokenBatch batch = test_support::random_token_batch(shape, 64, 1);
        {  // warm up: cuBLAS's and our kernels load once per process
          auto warm = make_byte_lm(shape, 64, DType::bf16, space);
          warm->train_step(engine, batch);
          engine.zero_grad();
        }
        for (int max_batch : {64, 1000}) {
          const auto free_before = cuda_device_memory(0).free;
          auto model = make_byte_lm(shape, max_batch, DType::bf16, space);
          const auto built = static_cast<std::int64_t>(free_before - cuda_device_memory(0).free);
          const auto planned =
              ByteLm::activation_bytes(shape, max_batch, DType::bf16, DeviceKind::cuda);
          RANK_REQUIRE(space.stats().tag(Tag::activation).requested.current == planned);
          model->train_step(engine, batch);
          engine.zero_grad();
          const auto taken = static_cast<std::int64_t>(free_before - cuda_device_memory(0).free);
          // Beside the counted bytes, each cuBLAS handle keeps device memory of its own even with
          // our workspace set: 67.8 MB on an H200 (e1d46ad), about a 64 MiB default workspace.
          // It is outside every MemorySpace, so outside the plan: bounded here so that growth
          // shows, and to be removed by sharing one handle per device.
          std::printf(
              "byte LM max_batch %d: activation bytes %lld, device memory taken %lld after "
              "construction, %lld after a step\n",
              max_batch, static_cast<long long>(planned), static_cast<long long>(built),
              static_cast<long long>(taken));
          RANK_REQUIRE(taken <= planned + (std::int64_t{72} << 20));
          model.reset();
          RANK_REQUIRE(space.stats().tag(Tag::activation).requested.current == 0);
        }
      },
      backend);
  guard.require_returned();
}

TEST_CASE("cuda: measure_cublas_gemm_tflops reports a bf16 rate") {
  const test::DeviceMemoryGuard guard;
  const double tflops = measure_cublas_gemm_tflops(4096, 4096, 4096, DType::bf16);
  std::printf("cuBLAS bf16 GEMM 4096^3: %.1f TFLOP/s\n", tflops);
  REQUIRE(std::isfinite(tflops));
  REQUIRE(tflops > 10.0);  // any tensor-core GPU; an H200 gives several hundred
  REQUIRE_THROWS_AS(measure_cublas_gemm_tflops(0, 16, 16, DType::bf16), ConfigError);
  REQUIRE_THROWS_AS(measure_cublas_gemm_tflops(16, 16, 16, DType::f32), ConfigError);
  guard.require_returned();
}

TEST_CASE("cuda: byte LM at the default shape trains on GPL-3 and reports its rate") {
  const test::DeviceMemoryGuard guard;
  const ByteLmShape shape;  // 8, 128, 512, 4
  constexpr int kBatch = 512, kSteps = 300;
  const ByteCorpus corpus("/usr/share/common-licenses/GPL-3", shape.context);
  const Backend backend = cuda_backend();
  double before = 0, after = 0, seconds = 0;
  run_ranks(
      1,
      [&](int rank, Communicator& comm) {
        MemorySpace space(rank, backend.make_allocator(rank));
        EngineConfig cfg;
        cfg.optimizer.lr = 2e-3;
        cfg.gradient_clipping = 1.0;
        cfg.reduce_bucket_bytes = std::size_t{1} << 22;
        Engine engine(cfg, comm, space, backend);
        ByteLm::declare(shape, engine);
        engine.build([&](const ParamInfo& p, std::span<float> v) { ByteLm::init(shape, p, v, 1); });
        auto model = make_byte_lm(shape, kBatch, cfg.dtype, space);
        const auto val = [&] {
          double sum = 0;
          for (int i = 0; i < 4; ++i) sum += model->loss(engine, corpus.val_batch(i, kBatch));
          return sum / 4;
        };
        before = val();
        std::vector<TokenBatch> batches;
        for (int t = 0; t < kSteps; ++t) batches.push_back(corpus.train_batch(0, t, 0, kBatch));
        const auto start = std::chrono::steady_clock::now();
        for (int t = 0; t < kSteps; ++t) {
          model->train_step(engine, batches[static_cast<std::size_t>(t)]);
          engine.step();
        }
        seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        after = val();
      },
      backend);
  const double rate = kBatch * kSteps / seconds;
  std::printf(
      "cuda byte LM default shape, batch %d: validation loss %.3f -> %.3f in %d steps; "
      "%.0f samples/s, %.2f TFLOP/s of GEMM (cuBLAS 4096^3: %.0f)\n",
      kBatch, before, after, kSteps, rate,
      byte_lm_step_flops(shape, kBatch) * kSteps / seconds / 1e12,
      measure_cublas_gemm_tflops(4096, 4096, 4096, DType::bf16));
  REQUIRE(after < 3.0);
  REQUIRE(after < before - 2.0);
  guard.require_returned();
}
