#include "tests/support/compression_peak.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <vector>

#include "shardswap/engine.h"

namespace shardswap::test_support {

namespace {

std::int64_t peak_of_run(const Backend& backend, std::int64_t params, int stage, DType wire,
                         int world_size, std::int64_t* bucket) {
  constexpr int kLayers = 8;
  const auto width = static_cast<std::int64_t>(std::sqrt(static_cast<double>(params) / kLayers));
  EngineConfig cfg;
  cfg.stage = stage;
  cfg.dtype = DType::bf16;
  cfg.grad_dtype = DType::f32;
  cfg.comm_dtype = wire;
  cfg.reduce_bucket_bytes = static_cast<std::size_t>(width * width * 4);  // one layer's grads
  std::int64_t peak = 0;
  std::mutex mu;
  run_ranks(
      world_size,
      [&](int rank, Communicator& comm) {
        MemorySpace space(rank, backend.make_allocator(rank));
        Engine engine(cfg, comm, space, backend);
        for (int l = 0; l < kLayers; ++l)
          engine.add_param(fmt::format("layers.{}.weight", l), {width, width},
                           fmt::format("layers.{}", l));
        engine.build([](const ParamInfo&, std::span<float> v) {
          for (std::size_t i = 0; i < v.size(); ++i) v[i] = 0.01f * static_cast<float>(i % 97);
        });
        std::vector<float> grad(static_cast<std::size_t>(width * width));
        for (std::size_t i = 0; i < grad.size(); ++i)
          grad[i] = 0.001f * static_cast<float>(static_cast<int>(i % 31) - 15);
        for (int step = 0; step < 2; ++step) {
          for (int l = kLayers - 1; l >= 0; --l) {
            const auto name = fmt::format("layers.{}.weight", l);
            const View slot = engine.grad_slot(name);
            space.write<float>(slot, grad);
            engine.grad_ready(name);
          }
          engine.step();
        }
        std::lock_guard lock(mu);
        peak = std::max(peak, space.stats().allocated.peak);
        *bucket = static_cast<std::int64_t>(cfg.reduce_bucket_bytes);
      },
      backend);
  return peak;
}

}  // namespace

PeakPair compression_peaks(const Backend& backend, std::int64_t params, int stage, DType wire,
                           int world_size) {
  PeakPair p;
  p.off = peak_of_run(backend, params, stage, DType::f32, world_size, &p.bucket);
  p.on = peak_of_run(backend, params, stage, wire, world_size, &p.bucket);
  return p;
}

}  // namespace shardswap::test_support
