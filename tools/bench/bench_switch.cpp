// `shardswap bench switch`: a stack of `layers` groups of four dim x dim bf16 matrices, two
// active at a time (ZeRO-2, AdamW, world size 1); each switch replaces both active layers. The
// time per switch (set_active, including the device work it queues) is compared with the bytes a
// switch must touch divided by the copy bandwidth measured in the same run:
//   drop:        per param activated: zero the gradient partition (2 B), seed the fp32 master
//                from bf16 (read 2 B, write 4 B), zero two moments (8 B) = 16 B;
//   keep_device: zero the gradient partition (2 B);
//   keep_host:   upload master and moments (12 B) and download the outgoing ones (12 B), over
//                the host link, reported without a bound.
// Timing starts after one full round of switches (every layer visited once), so that each timed
// switch brings back layers that were kept: the steady state of a switching run.
// Where the time goes: the host-staging allocator the engine keeps keep_host state in is timed
// (allocate: cudaHostAlloc or a cache hit; deallocate: into the cache or cudaFreeHost), and so
// are the host copies. When that allocator caches, keep_host runs a second time with the cache
// emptied after every free (trim), as every free was before the cache: the same binary shows
// what the cache buys.
// After the switches the memory stats must equal the engine's plan, and the host allocator's
// reserved peak must not exceed its live peak (PASS), or the row is void.
#include "bench/bench_switch.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <memory>
#include <mutex>
#include <optional>

#include "engine/backend_ops.h"
#include "shardswap/backend.h"
#include "shardswap/engine.h"
#include "shardswap/error.h"
#include "files/output_file.h"

namespace shardswap {

namespace {

struct Options {
  std::string backend = cuda_device_count() > 0 ? "cuda" : "cpu";
  int layers = 32;
  int dim = 4096;
  int switches = 20;
  std::string json;
};

Options parse(const std::vector<std::string>& args) {
  Options o;
  for (std::size_t i = 0; i < args.size(); ++i) {
    const auto value = [&]() -> const std::string& {
      if (i + 1 >= args.size())
        throw ConfigError(fmt::format("bench switch: {} needs a value", args[i]));
      return args[++i];
    };
    const auto number = [&](int lo) {
      const std::string& v = value();
      int n = 0;
      try {
        n = std::stoi(v);
      } catch (const std::exception&) {
        throw ConfigError(fmt::format("bench switch: {} '{}' is not a number", args[i - 1], v));
      }
      if (n < lo) throw ConfigError(fmt::format("bench switch: {} must be >= {}", args[i - 1], lo));
      return n;
    };
    if (args[i] == "--backend")
      o.backend = value();
    else if (args[i] == "--layers")
      o.layers = number(4);
    else if (args[i] == "--dim")
      o.dim = number(1);
    else if (args[i] == "--switches")
      o.switches = number(1);
    else if (args[i] == "--json")
      o.json = value();
    else
      throw ConfigError(fmt::format("bench switch: unknown argument '{}'", args[i]));
  }
  return o;
}

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// What the timed allocators below add up, for the engine of one row.
struct HostTraffic {
  std::mutex mu;
  double alloc_ms = 0, free_ms = 0, copy_ms = 0;  // host-staging allocate / deallocate; copies
  std::int64_t live = 0, live_peak = 0;           // host-staging bytes handed out
  std::int64_t reserved_peak = 0;                 // host-staging reserved_bytes(), sampled
  bool cache = true;  // false: trim() after every deallocate (no cache, as before it)

  void start_row(bool with_cache) {
    std::lock_guard lock(mu);
    alloc_ms = free_ms = copy_ms = 0;
    live_peak = live;
    reserved_peak = 0;
    cache = with_cache;
  }
};

// Wraps the bench's device allocator (timing its host copies) and the host-staging allocators it
// hands out (timing their allocate and deallocate, tracking their live and reserved bytes).
class TimedAllocator final : public Allocator {
 public:
  TimedAllocator(std::unique_ptr<Allocator> inner, std::shared_ptr<HostTraffic> traffic,
                 bool staging)
      : inner_(std::move(inner)), traffic_(std::move(traffic)), staging_(staging) {}

  Block allocate(std::size_t requested) override {
    if (!staging_) return inner_->allocate(requested);  // device memory: recycled, not timed
    const auto t0 = Clock::now();
    const Block block = inner_->allocate(requested);
    const double ms = ms_since(t0);
    std::lock_guard lock(traffic_->mu);
    traffic_->alloc_ms += ms;
    traffic_->live += static_cast<std::int64_t>(block.bytes);
    traffic_->live_peak = std::max(traffic_->live_peak, traffic_->live);
    traffic_->reserved_peak =
        std::max(traffic_->reserved_peak, static_cast<std::int64_t>(inner_->reserved_bytes()));
    return block;
  }
  void deallocate(Block block) noexcept override {
    if (!staging_) {
      inner_->deallocate(block);
      return;
    }
    bool cache = true;
    {
      std::lock_guard lock(traffic_->mu);
      cache = traffic_->cache;
    }
    const auto t0 = Clock::now();
    inner_->deallocate(block);
    if (!cache) inner_->trim();
    const double ms = ms_since(t0);
    std::lock_guard lock(traffic_->mu);
    traffic_->free_ms += ms;
    traffic_->live -= static_cast<std::int64_t>(block.bytes);
  }
  std::size_t reserved_bytes() const override { return inner_->reserved_bytes(); }
  std::size_t cached_bytes() const override { return inner_->cached_bytes(); }
  std::size_t trim() noexcept override { return inner_->trim(); }
  DeviceKind device() const override { return inner_->device(); }
  std::string name() const override { return inner_->name(); }
  void upload(void* dst, const void* src, std::size_t bytes) override {
    const auto t0 = Clock::now();
    inner_->upload(dst, src, bytes);
    add_copy(ms_since(t0));
  }
  void download(void* dst, const void* src, std::size_t bytes) override {
    const auto t0 = Clock::now();
    inner_->download(dst, src, bytes);
    add_copy(ms_since(t0));
  }
  std::unique_ptr<Allocator> host_staging() const override {
    return std::make_unique<TimedAllocator>(inner_->host_staging(), traffic_, true);
  }

 private:
  void add_copy(double ms) {
    if (staging_) return;  // host-to-host copies (checkpoint restore), not a switch's traffic
    std::lock_guard lock(traffic_->mu);
    traffic_->copy_ms += ms;
  }
  std::unique_ptr<Allocator> inner_;
  std::shared_ptr<HostTraffic> traffic_;
  bool staging_;
};

// Whether the backend's host-staging allocator keeps freed blocks (capabilities are data).
bool host_staging_caches(const MemorySpace& space) {
  auto probe = space.host_staging_allocator();
  probe->deallocate(probe->allocate(1));
  return probe->cached_bytes() > 0;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double copy_bandwidth(MemorySpace& space, const DeviceOps& k) {
  constexpr std::size_t bytes = std::size_t{1} << 30;
  Buffer a = space.allocate(bytes, Tag::other, "bench copy source");
  Buffer b = space.allocate(bytes, Tag::other, "bench copy destination");
  k.fill_zero(a.data(), bytes);
  std::vector<double> times;
  for (int i = 0; i < 8; ++i) {
    k.synchronize();
    const auto t0 = std::chrono::steady_clock::now();
    k.copy(b.data(), a.data(), bytes);
    k.synchronize();
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(times.begin(), times.end());
  return 2.0 * static_cast<double>(bytes) / times[times.size() / 2];  // read + written
}

// One row of the table: a deactivation policy, and for keep_host whether the pinned staging
// cache is on.
struct Row {
  DeactivatePolicy policy;
  bool host_cache;
};

// What the timed switches of one row took: each switch's time and the host allocator's share.
struct SwitchTimes {
  std::vector<double> ms, alloc_ms, free_ms, copy_ms;
  std::int64_t after_first = 0;  // requested bytes after the first timed switch
};

// `warmup` switches, then `switches` timed ones, two layers at a time in order around the model.
SwitchTimes time_switches(Engine& engine, HostTraffic& traffic,
                          const std::vector<std::string>& groups, DeactivatePolicy policy,
                          int switches, int warmup) {
  const int layers = static_cast<int>(groups.size());
  SwitchTimes t;
  int next = 2;
  for (int s = 0; s < switches + warmup; ++s) {
    const std::vector<std::string> wanted{groups[next % layers], groups[(next + 1) % layers]};
    next += 2;
    double a0 = 0, f0 = 0, c0 = 0;
    {
      std::lock_guard lock(traffic.mu);
      a0 = traffic.alloc_ms;
      f0 = traffic.free_ms;
      c0 = traffic.copy_ms;
    }
    const SwitchReport r = engine.set_active(wanted, policy);
    if (s < warmup) continue;
    t.ms.push_back(r.seconds * 1e3);
    std::lock_guard lock(traffic.mu);
    t.alloc_ms.push_back(traffic.alloc_ms - a0);
    t.free_ms.push_back(traffic.free_ms - f0);
    t.copy_ms.push_back(traffic.copy_ms - c0);
    if (s == warmup) t.after_first = engine.memory_stats().requested.current;
  }
  return t;
}

// Where one row runs: the rank's communicator and memory, the table's shape and yardstick.
struct Bench {
  const Options& o;
  Communicator& comm;
  MemorySpace& space;
  const Backend& backend;
  HostTraffic& traffic;
  std::vector<std::string> groups;
  double bandwidth;
  int warmup;
  std::ostream& out;
};

// Times one row on a new engine, so that no row starts with what the previous one kept
// (keep_device leaves every visited layer's state on the device); prints its line and returns
// its JSON.
nlohmann::json bench_row(const Bench& b, const Row& kind) {
  const Options& o = b.o;
  const DeactivatePolicy policy = kind.policy;
  const bool keep_host = policy == DeactivatePolicy::keep_host;
  const std::string label = std::string(deactivate_policy_name(policy)) +
                            (keep_host && !kind.host_cache ? " (no cache)" : "");
  b.traffic.start_row(kind.host_cache);
  EngineConfig cfg;
  cfg.stage = 2;
  cfg.optimizer.type = OptimizerType::adamw;
  Engine engine(cfg, b.comm, b.space, b.backend);
  for (int l = 0; l < o.layers; ++l)
    for (const char* m : {"q", "k", "v", "o"})
      engine.add_param(fmt::format("layers.{}.{}", l, m), {o.dim, o.dim},
                       b.groups[static_cast<std::size_t>(l)]);
  engine.build([](const ParamInfo&, std::span<float> v) { std::fill(v.begin(), v.end(), 0.01f); },
               std::vector<std::string>{b.groups[0], b.groups[1]});
  const SwitchTimes t = time_switches(engine, b.traffic, b.groups, policy, o.switches, b.warmup);
  const double per_param = policy == DeactivatePolicy::drop          ? 16.0
                           : policy == DeactivatePolicy::keep_device ? 2.0
                                                                     : 24.0;
  const double bytes = 2 * 4.0 * o.dim * o.dim * per_param;
  const bool bounded = !keep_host;
  const double bound = 1.5 * bytes / b.bandwidth * 1e3 + 1.0;
  const auto stats = engine.memory_stats();
  const auto plan = engine.plan();
  bool pass = true;
  for (Tag t : kAllTags) pass = pass && stats.tag(t).requested.current == plan.of(t);
  std::int64_t host_live_peak = 0, host_reserved_peak = 0;
  {
    std::lock_guard lock(b.traffic.mu);
    host_live_peak = b.traffic.live_peak;
    host_reserved_peak = b.traffic.reserved_peak;
  }
  // The cache may hold freed blocks, never more than the engine once had live at a time.
  pass = pass && host_reserved_peak <= host_live_peak;
  const double med = median(t.ms);
  const double med_alloc = median(t.alloc_ms), med_free = median(t.free_ms),
               med_copy = median(t.copy_ms);
  b.out << fmt::format(
      "{:>18} {:>10.3f} {:>12.4g} {:>12} {:>10} {:>9.3f} {:>9.3f} {:>9.3f} {:>9.2f} {:>6}\n",
      label, med, bytes, bounded ? fmt::format("{:.3f}", bound) : "-",
      bounded ? fmt::format("{:.3f}", med / bound) : "-", med_alloc, med_free, med_copy,
      static_cast<double>(host_reserved_peak) / 1e9, pass ? "PASS" : "FAIL");
  return {{"policy", deactivate_policy_name(policy)},
          {"host_cache", kind.host_cache},
          {"ms_per_switch", med},
          {"host_alloc_ms", med_alloc},
          {"host_free_ms", med_free},
          {"host_copy_ms", med_copy},
          {"host_live_peak_bytes", host_live_peak},
          {"host_reserved_peak_bytes", host_reserved_peak},
          {"bytes", bytes},
          {"bound_ms", bounded ? nlohmann::json(bound) : nlohmann::json(nullptr)},
          {"copy_tbps", b.bandwidth / 1e12},
          {"allocated_after_1_bytes", t.after_first},
          {"allocated_after_n_bytes", stats.requested.current},
          {"switches", o.switches},
          {"warmup_switches", b.warmup},
          {"check", pass ? "PASS" : "FAIL"}};
}

}  // namespace

int bench_switch(const std::vector<std::string>& args, std::ostream& out) {
  const Options o = parse(args);
  const Backend backend = backend_from_name(o.backend, "--backend");
  std::optional<OutputFile> json_file;  // checked before the benchmark runs
  if (!o.json.empty()) json_file.emplace("--json", o.json);
  nlohmann::json rows = nlohmann::json::array();
  bool all_pass = true;
  run_ranks(
      1,
      [&](int rank, Communicator& comm) {
        auto traffic = std::make_shared<HostTraffic>();
        MemorySpace space(
            rank, std::make_unique<TimedAllocator>(backend.make_allocator(rank), traffic, false));
        Bench b{o, comm, space, backend, *traffic, {}, copy_bandwidth(space, device_ops(backend)),
                (o.layers + 1) / 2 + 1,  // a full round: every layer visited once
                out};
        for (int l = 0; l < o.layers; ++l) b.groups.push_back(fmt::format("layers.{}", l));
        out << fmt::format(
            "bench switch: backend {}, {} layers of 4 x {}x{} bf16, 2 active, copy {:.3f} TB/s; "
            "median of {} switches after {} warm-up\n",
            backend.name(), o.layers, o.dim, o.dim, b.bandwidth / 1e12, o.switches, b.warmup);
        out << fmt::format("{:>18} {:>10} {:>12} {:>12} {:>10} {:>9} {:>9} {:>9} {:>9} {:>6}\n",
                           "policy", "ms/switch", "bytes", "bound ms", "ms/bound", "halloc ms",
                           "hfree ms", "copy ms", "host GB", "check");
        std::vector<Row> row_kinds{{DeactivatePolicy::drop, true},
                                   {DeactivatePolicy::keep_device, true},
                                   {DeactivatePolicy::keep_host, true}};
        if (host_staging_caches(space)) row_kinds.push_back({DeactivatePolicy::keep_host, false});
        for (const Row& kind : row_kinds) {
          rows.push_back(bench_row(b, kind));
          all_pass = all_pass && rows.back()["check"] == "PASS";
        }
      },
      backend);
  if (json_file) {
    json_file->write(
        nlohmann::json{{"layers", o.layers}, {"dim", o.dim}, {"rows", rows}}.dump(2) + "\n");
    json_file->commit();
  }
  return all_pass ? 0 : 1;
}

}  // namespace shardswap
