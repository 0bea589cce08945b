// The page-locked host allocator behind keep_host (CudaAllocator::host_staging()): a freed block
// is reused for a request of the same size, reserved bytes are live + cached and never exceed the
// high-water mark of live bytes, trim() and the destructor give cached blocks back to the driver;
// and keep_host switching on reused blocks ends bit for bit where keep_device does.
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "memory/host_types.h"
#include "shardswap/backend.h"
#include "shardswap/engine.h"
#include "shardswap/allocator.h"
#include "tests/catch_compat.h"
#include "tests/support/forwarding_allocator.h"

using namespace shardswap;

namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;

std::unique_ptr<Allocator> pinned_host() {
  return make_cuda_allocator(0)->host_staging();
}

// Asks the driver, not the allocator: is `p` in a page-locked allocation it knows?
bool driver_knows_pinned(const void* p) {
  cudaPointerAttributes attributes{};
  const cudaError_t status = cudaPointerGetAttributes(&attributes, p);
  if (status != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return attributes.type == cudaMemoryTypeHost;
}

std::size_t rounded(std::size_t bytes) {
  return (bytes + 511) / 512 * 512;  // the allocator's granule
}

}  // namespace

TEST_CASE("pinned host: a freed block is handed out again for a request of its size") {
  auto host = pinned_host();
  const std::size_t request = 5 * kMiB + 3;
  const Block a = host->allocate(request);
  REQUIRE(a.bytes == rounded(request));
  REQUIRE(driver_knows_pinned(a.ptr));
  std::memset(a.ptr, 0x5a, a.bytes);
  host->deallocate(a);
  REQUIRE(host->cached_bytes() == a.bytes);
  REQUIRE(host->reserved_bytes() == a.bytes);
  REQUIRE(driver_knows_pinned(a.ptr));  // kept, not freed

  const Block b = host->allocate(request - 1);  // a different request, the same rounded size
  REQUIRE(b.ptr == a.ptr);
  REQUIRE(b.bytes == a.bytes);
  REQUIRE(host->cached_bytes() == 0);
  REQUIRE(host->reserved_bytes() == b.bytes);
  host->deallocate(b);

  // A smaller request does not take the larger block, and pinning it anew would exceed the
  // high-water mark (one block of 5 MiB): the cached block goes back to the driver first.
  const Block c = host->allocate(kMiB);
  REQUIRE(c.bytes == kMiB);
  REQUIRE(host->cached_bytes() == 0);
  REQUIRE(host->reserved_bytes() == kMiB);
  host->deallocate(c);
}

TEST_CASE("pinned host: reserved is live plus cached and never exceeds the peak of live bytes") {
  auto host = pinned_host();
  std::mt19937 rng(20261130);
  // Rounded sizes of 4, 6, 9 and 11 MiB: no sum of cached blocks equals another size, so a drop
  // of cached_bytes() by exactly the block's size can only be a block taken from the cache.
  const std::size_t sizes[] = {4 * kMiB, 6 * kMiB, 9 * kMiB, 11 * kMiB};
  struct Live {
    Block block;
    unsigned char fill;
  };
  std::vector<Live> live;
  std::size_t live_bytes = 0, peak = 0, allocations = 0, reused = 0;
  std::vector<Block> freed;  // blocks deallocated so far (their addresses may come back)
  for (int op = 0; op < 600; ++op) {
    const bool allocate = live.empty() || (live.size() < 10 && rng() % 2 == 0);
    if (allocate) {
      const std::size_t request = sizes[rng() % 4] - rng() % 512;  // same rounded size
      const std::size_t cached_before = host->cached_bytes();
      const Block b = host->allocate(request);
      ++allocations;
      REQUIRE(b.bytes == rounded(request));
      REQUIRE(driver_knows_pinned(b.ptr));
      if (host->cached_bytes() < cached_before && host->cached_bytes() + b.bytes == cached_before) {
        ++reused;
        // A block from the cache is one this test gave back, of the same size.
        const bool known = std::any_of(freed.begin(), freed.end(), [&](const Block& f) {
          return f.ptr == b.ptr && f.bytes == b.bytes;
        });
        REQUIRE(known);
      }
      // No live block overlaps another: each carries its own byte, checked when it is freed.
      const auto fill = static_cast<unsigned char>(op % 251 + 1);
      std::memset(b.ptr, fill, b.bytes);
      live.push_back({b, fill});
      live_bytes += b.bytes;
      peak = std::max(peak, live_bytes);
    } else {
      const std::size_t i = rng() % live.size();
      const Live l = live[i];
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
      const auto* bytes = static_cast<const unsigned char*>(l.block.ptr);
      REQUIRE(
          std::all_of(bytes, bytes + l.block.bytes, [&](unsigned char x) { return x == l.fill; }));
      host->deallocate(l.block);
      freed.push_back(l.block);
      live_bytes -= l.block.bytes;
    }
    CAPTURE(op, live_bytes, peak, host->cached_bytes());
    REQUIRE(host->reserved_bytes() == live_bytes + host->cached_bytes());
    REQUIRE(host->reserved_bytes() <= peak);
  }
  INFO("allocations " << allocations << ", served from the cache " << reused);
  REQUIRE(reused > 0);
  REQUIRE(reused < allocations);
  for (const Live& l : live) host->deallocate(l.block);
  REQUIRE(host->reserved_bytes() == host->cached_bytes());
  REQUIRE(host->reserved_bytes() <= peak);
}

TEST_CASE("pinned host: trim gives every cached block back to the driver") {
  auto host = pinned_host();
  const Block a = host->allocate(2 * kMiB);
  const Block b = host->allocate(3 * kMiB);
  const Block c = host->allocate(4 * kMiB);
  host->deallocate(a);
  host->deallocate(c);
  REQUIRE(host->cached_bytes() == 6 * kMiB);
  REQUIRE(host->reserved_bytes() == 9 * kMiB);
  REQUIRE(host->trim() == 6 * kMiB);
  REQUIRE(host->cached_bytes() == 0);
  REQUIRE(host->reserved_bytes() == 3 * kMiB);
  REQUIRE_FALSE(driver_knows_pinned(a.ptr));
  REQUIRE_FALSE(driver_knows_pinned(c.ptr));
  REQUIRE(driver_knows_pinned(b.ptr));  // live blocks are not touched
  REQUIRE(host->trim() == 0);
  host->deallocate(b);
  REQUIRE(host->trim() == 3 * kMiB);
  REQUIRE(host->reserved_bytes() == 0);
}

TEST_CASE("pinned host: destroying the allocator gives its cached blocks back to the driver") {
  auto host = pinned_host();
  const Block a = host->allocate(2 * kMiB);
  host->deallocate(a);
  REQUIRE(driver_knows_pinned(a.ptr));
  host.reset();
  REQUIRE_FALSE(driver_knows_pinned(a.ptr));
}

namespace {

// What one rank's host-staging allocator did (the engine's keep_host space).
struct StagingRecord {
  std::size_t allocations = 0, from_cache = 0;
  std::int64_t live = 0, live_peak = 0, reserved_peak = 0;
};

// Wraps the device allocator so that the host-staging allocator it hands the engine is watched.
class WatchedAllocator final : public test_support::ForwardingAllocator {
 public:
  WatchedAllocator(std::unique_ptr<Allocator> inner, StagingRecord* record, bool staging)
      : ForwardingAllocator(std::move(inner)), record_(record), staging_(staging) {}
  Block allocate(std::size_t requested) override {
    const std::size_t cached_before = inner().cached_bytes();
    const Block b = inner().allocate(requested);
    if (staging_) {
      ++record_->allocations;
      if (inner().cached_bytes() + b.bytes == cached_before) ++record_->from_cache;
      record_->live += static_cast<std::int64_t>(b.bytes);
      record_->live_peak = std::max(record_->live_peak, record_->live);
      record_->reserved_peak =
          std::max(record_->reserved_peak, static_cast<std::int64_t>(inner().reserved_bytes()));
    }
    return b;
  }
  void deallocate(Block block) noexcept override {
    inner().deallocate(block);
    if (staging_) record_->live -= static_cast<std::int64_t>(block.bytes);
  }
  std::unique_ptr<Allocator> host_staging() const override {
    return std::make_unique<WatchedAllocator>(inner().host_staging(), record_, true);
  }

 private:
  StagingRecord* record_;
  bool staging_;
};

struct SwitchRun {
  std::vector<TrainingState> states;  // per rank, every group active at the end
  std::vector<StagingRecord> staging;
  bool weights_moved = false;
};

// 2 in-process ranks on GPU 0, 6 equal layers, 2 active at a time, a random pair per step, 24
// steps of random gradients, switching under `policy`; then every layer active.
SwitchRun run_switching(DeactivatePolicy policy) {
  constexpr int kWorld = 2, kLayers = 6, kSteps = 24;
  SwitchRun run;
  run.states.resize(kWorld);
  run.staging.resize(kWorld);
  std::vector<std::string> layers;
  for (int l = 0; l < kLayers; ++l) layers.push_back(fmt::format("layers.{}", l));
  std::mutex mu;
  run_ranks(
      kWorld,
      [&](int rank, Communicator& comm) {
        MemorySpace space(rank, std::make_unique<WatchedAllocator>(make_cuda_allocator(0),
                                                                   &run.staging[rank], false));
        EngineConfig cfg;
        cfg.stage = 2;
        cfg.optimizer.type = OptimizerType::adamw;
        Engine e(cfg, comm, space, cuda_backend());
        for (const auto& g : layers) {
          e.add_param(g + ".w", {96, 80}, g);
          e.add_param(g + ".b", {80}, g);
        }
        e.build(
            [](const ParamInfo& p, std::span<float> v) {
              std::mt19937 rng(static_cast<std::uint32_t>(std::hash<std::string>{}(p.name)));
              std::uniform_real_distribution<float> u(-0.5f, 0.5f);
              for (auto& x : v) x = u(rng);
            },
            std::vector<std::string>{layers[0], layers[1]});
        const std::vector<float> before = e.read_weight("layers.3.w");
        std::mt19937 pick(7);  // the same schedule on every rank and in every run
        for (int step = 0; step < kSteps; ++step) {
          const auto a = static_cast<std::size_t>(pick() % kLayers);
          const auto b = (a + 1 + pick() % (kLayers - 1)) % kLayers;
          e.set_active({layers[a], layers[b]}, policy);
          for (const auto& g : {layers[std::max(a, b)], layers[std::min(a, b)]})
            for (const auto& name : {g + ".b", g + ".w"}) {
              const View slot = e.grad_slot(name);
              std::mt19937 rng(static_cast<std::uint32_t>(
                  std::hash<std::string>{}(fmt::format("{} {} {}", name, step, rank))));
              std::uniform_real_distribution<float> u(-1.0f, 1.0f);
              std::vector<bf16_t> values(slot.count());
              for (auto& x : values) x = bf16_t(u(rng));
              space.write<bf16_t>(slot, values);
              e.grad_ready(name);
            }
          e.step();
        }
        e.set_active(layers, policy);
        run.states[rank] = e.training_state(true);
        const bool moved = e.read_weight("layers.3.w") != before;
        std::lock_guard lock(mu);
        run.weights_moved = run.weights_moved || moved;
      },
      cuda_backend());
  return run;
}

bool same_state(const TrainingState& x, const TrainingState& y) {
  if (x.groups.size() != y.groups.size() || x.weights != y.weights) return false;
  for (std::size_t i = 0; i < x.groups.size(); ++i) {
    const auto &a = x.groups[i], &b = y.groups[i];
    // Bitwise: float == would let -0.0 equal 0.0.
    const auto bits_equal = [](const std::vector<float>& u, const std::vector<float>& v) {
      return u.size() == v.size() && std::memcmp(u.data(), v.data(), u.size() * 4) == 0;
    };
    if (a.group != b.group || a.step != b.step || !bits_equal(a.master, b.master) ||
        !bits_equal(a.state, b.state))
      return false;
  }
  return true;
}

}  // namespace

TEST_CASE("cuda: keep_host switching on reused pinned blocks ends bit for bit as keep_device") {
  const SwitchRun host = run_switching(DeactivatePolicy::keep_host);
  const SwitchRun device = run_switching(DeactivatePolicy::keep_device);
  const SwitchRun drop = run_switching(DeactivatePolicy::drop);
  REQUIRE(host.weights_moved);
  for (int rank = 0; rank < 2; ++rank) {
    CAPTURE(rank);
    const StagingRecord& r = host.staging[static_cast<std::size_t>(rank)];
    CAPTURE(r.allocations, r.from_cache, r.live_peak, r.reserved_peak);
    REQUIRE(r.from_cache > 0);                // the cache was used ...
    REQUIRE(r.reserved_peak <= r.live_peak);  // ... without raising the pinned peak
    REQUIRE(r.live == 0);                     // every kept copy went back on activation
    REQUIRE(same_state(host.states[static_cast<std::size_t>(rank)],
                       device.states[static_cast<std::size_t>(rank)]));
    // The check has teeth: forgetting the state (drop) ends elsewhere.
    REQUIRE_FALSE(same_state(host.states[static_cast<std::size_t>(rank)],
                             drop.states[static_cast<std::size_t>(rank)]));
  }
}
