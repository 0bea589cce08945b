// `shardswap bench switch`: a stack of `layers` groups of four dim x dim bf16 matrices, two
// active at a time (ZeRO-2, AdamW, world size 1); each switch replaces both active layers. The
// time per switch (set_active, including the device work it queues) is compared with the bytes a
// switch must touch divided by the copy bandwidth measured in the same run:
//   drop:        per param activated: zero the gradient partition (2 B), seed the fp32 master
//                from bf16 (read 2 B, write 4 B), zero two moments (8 B) = 16 B;
//   keep_device: zero the gradient partition (2 B);
//   keep_host:   upload master and moments (12 B) and download the outgoing ones (12 B), over
//                the host link, reported without a bound.
// After the switches the memory stats must equal the engine's plan (PASS), or the row is void.
#include "tools/bench_switch.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <fstream>

#include "engine/backend.h"
#include "engine/engine.h"
#include "memory/error.h"

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
        throw ConfigError(fmt::format("bench_switch: {} needs a value", args[i]));
      return args[++i];
    };
    const auto number = [&](int lo) {
      const std::string& v = value();
      int n = 0;
      try {
        n = std::stoi(v);
      } catch (const std::exception&) {
        throw ConfigError(fmt::format("bench_switch: {} '{}' is not a number", args[i - 1], v));
      }
      if (n < lo) throw ConfigError(fmt::format("bench_switch: {} must be >= {}", args[i - 1], lo));
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
      throw ConfigError(fmt::format("bench_switch: unknown argument '{}'", args[i]));
  }
  return o;
}

double copy_bandwidth(MemorySpace& space, const OptimizerKernels& k) {
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

}  // namespace

int bench_switch(const std::vector<std::string>& args, std::ostream& out) {
  const Options o = parse(args);
  const Backend backend = backend_from_name(o.backend, "--backend");
  nlohmann::json rows = nlohmann::json::array();
  bool all_pass = true;
  run_ranks(
      1,
      [&](int rank, Communicator& comm) {
        MemorySpace space(rank, backend.make_allocator(rank));
        const double bandwidth = copy_bandwidth(space, *backend.kernels);
        std::vector<std::string> groups;
        for (int l = 0; l < o.layers; ++l) groups.push_back(fmt::format("layers.{}", l));
        const double params_per_layer = 4.0 * o.dim * o.dim;
        out << fmt::format(
            "bench switch: backend {}, {} layers of 4 x {}x{} bf16, 2 active, copy {:.3f} TB/s\n",
            backend.name, o.layers, o.dim, o.dim, bandwidth / 1e12);
        out << fmt::format("{:>12} {:>10} {:>12} {:>12} {:>10} {:>6}\n", "policy", "ms/switch",
                           "bytes", "bound ms", "ms/bound", "check");
        for (DeactivatePolicy policy :
             {DeactivatePolicy::drop, DeactivatePolicy::keep_device, DeactivatePolicy::keep_host}) {
          // A new engine per policy, so that no policy starts with what the previous one kept
          // (keep_device leaves every visited layer's state on the device).
          EngineConfig cfg;
          cfg.stage = 2;
          cfg.optimizer.type = OptimizerType::adamw;
          Engine engine(cfg, comm, space, *backend.kernels);
          for (int l = 0; l < o.layers; ++l)
            for (const char* m : {"q", "k", "v", "o"})
              engine.add_param(fmt::format("layers.{}.{}", l, m), {o.dim, o.dim},
                               groups[static_cast<std::size_t>(l)]);
          engine.build(
              [](const ParamInfo&, std::span<float> v) { std::fill(v.begin(), v.end(), 0.01f); },
              std::vector<std::string>{groups[0], groups[1]});
          int next = 2;
          std::vector<double> ms;
          std::int64_t after_first = 0;  // requested bytes after the first timed switch
          for (int s = 0; s < o.switches + 2; ++s) {
            const std::vector<std::string> wanted{groups[next % o.layers],
                                                  groups[(next + 1) % o.layers]};
            next += 2;
            const SwitchReport r = engine.set_active(wanted, policy);
            if (s >= 2) ms.push_back(r.seconds * 1e3);  // two warm-up switches
            if (s == 2) after_first = engine.memory_stats().requested.current;
          }
          std::sort(ms.begin(), ms.end());
          const double median = ms[ms.size() / 2];
          const double per_param = policy == DeactivatePolicy::drop          ? 16.0
                                   : policy == DeactivatePolicy::keep_device ? 2.0
                                                                             : 24.0;
          const double bytes = 2 * params_per_layer * per_param;
          const bool bounded = policy != DeactivatePolicy::keep_host;
          const double bound = 1.5 * bytes / bandwidth * 1e3 + 1.0;
          const auto stats = engine.memory_stats();
          const auto plan = engine.plan();
          bool pass = true;
          for (Tag t : kAllTags) pass = pass && stats.tag(t).requested.current == plan.of(t);
          all_pass = all_pass && pass;
          out << fmt::format(
              "{:>12} {:>10.3f} {:>12.4g} {:>12} {:>10} {:>6}\n", deactivate_policy_name(policy),
              median, bytes, bounded ? fmt::format("{:.3f}", bound) : "-",
              bounded ? fmt::format("{:.3f}", median / bound) : "-", pass ? "PASS" : "FAIL");
          rows.push_back({{"policy", deactivate_policy_name(policy)},
                          {"ms_per_switch", median},
                          {"bytes", bytes},
                          {"bound_ms", bounded ? nlohmann::json(bound) : nlohmann::json(nullptr)},
                          {"copy_tbps", bandwidth / 1e12},
                          {"allocated_after_1_bytes", after_first},
                          {"allocated_after_n_bytes", stats.requested.current},
                          {"switches", o.switches},
                          {"check", pass ? "PASS" : "FAIL"}});
        }
      },
      *backend.collectives);
  if (!o.json.empty()) {
    std::ofstream f(o.json);
    if (!f) throw ConfigError(fmt::format("bench_switch: --json: cannot write '{}'", o.json));
    f << nlohmann::json{{"layers", o.layers}, {"dim", o.dim}, {"rows", rows}}.dump(2) << "\n";
  }
  return all_pass ? 0 : 1;
}

}  // namespace shardswap
