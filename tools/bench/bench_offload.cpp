// `shardswap bench offload` (bench_offload.h): the options, the host rows, the table and the
// JSON; the CUDA rows are offload_cuda.cpp's. Host memory is written first by the threads that
// update it, so that on a machine of several NUMA nodes each thread's share is local to it.
#include "bench/bench_offload.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>

#include "bench/counts.h"
#include "bench/offload_rows.h"
#include "files/output_file.h"
#include "memory/host_types.h"
#include "optimizer/host_updater.h"
#include "shardswap/allocator.h"
#include "shardswap/error.h"

namespace shardswap {

OptimizerConfig offload_config() {
  OptimizerConfig c;
  c.type = OptimizerType::adamw;
  c.lr = 1e-3;
  c.weight_decay = 0.01;
  return c;
}

StepArgs offload_args() {
  const OptimizerConfig c = offload_config();
  return StepArgs{10, c.lr, c.weight_decay, 1.0f};
}

namespace {

std::vector<float> random_floats(std::mt19937& rng, float lo, float hi, bool any_sign) {
  std::uniform_real_distribution<float> mag(lo, hi);
  std::bernoulli_distribution negative(0.5);
  std::vector<float> v(OffloadData::kPeriod);
  for (float& x : v) x = any_sign && negative(rng) ? -mag(rng) : mag(rng);
  return v;
}

}  // namespace

OffloadData make_offload_data() {
  std::mt19937 rng(20261203);
  OffloadData d;
  d.master = random_floats(rng, 0.05f, 1.0f, true);
  d.m = random_floats(rng, 1e-4f, 1e-2f, true);
  d.v = random_floats(rng, 1e-6f, 1e-4f, false);
  for (float g : random_floats(rng, 1e-3f, 1e-1f, true))
    d.grad.push_back(std::bit_cast<std::uint16_t>(bf16_t(g)));
  d.next_master = d.master;
  d.next_m = d.m;
  d.next_v = d.v;
  d.next_param.assign(OffloadData::kPeriod, 0);
  cpu_device_ops().update(
      offload_config(), offload_args(),
      ShardTensors{d.next_master.data(), d.next_m.data(), d.next_v.data(), d.grad.data(),
                   d.next_param.data(), DType::bf16, DType::bf16, OffloadData::kPeriod});
  return d;
}

void fill_periodic(void* dst, const void* period, std::size_t elem, std::size_t begin,
                   std::size_t end) {
  auto* out = static_cast<unsigned char*>(dst);
  const auto* in = static_cast<const unsigned char*>(period);
  for (std::size_t i = begin; i < end;) {
    const std::size_t at = i % OffloadData::kPeriod;
    const std::size_t n = std::min(OffloadData::kPeriod - at, end - i);
    std::memcpy(out + i * elem, in + at * elem, n * elem);
    i += n;
  }
}

bool equals_periodic(const void* got, const void* period, std::size_t elem, std::size_t n) {
  const auto* g = static_cast<const unsigned char*>(got);
  for (std::size_t i = 0; i < n; i += OffloadData::kPeriod) {
    const std::size_t len = std::min(OffloadData::kPeriod, n - i);
    if (std::memcmp(g + i * elem, period, len * elem) != 0) return false;
  }
  return true;
}

double median_seconds(int iters, const std::function<void()>& f) {
  for (int i = 0; i < kWarmup; ++i) f();
  std::vector<double> t;
  for (int i = 0; i < iters; ++i) {
    const auto start = std::chrono::steady_clock::now();
    f();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(t.begin(), t.end());
  return t.size() % 2 ? t[t.size() / 2] : (t[t.size() / 2 - 1] + t[t.size() / 2]) / 2;
}

namespace {

struct Options {
  std::string backend;
  std::size_t params = std::size_t{256} << 20;
  unsigned threads = 0;  ///< 0: every hardware thread
  int iters = 10;
  std::string json;
};

// A decimal count from 1 to 999999.
int parse_positive(const std::string& flag, const std::string& v) {
  const bool digits = !v.empty() && v.size() <= 6 &&
                      std::all_of(v.begin(), v.end(), [](char c) { return c >= '0' && c <= '9'; });
  if (!digits || std::stoi(v) < 1)
    throw ConfigError(fmt::format("bench offload: {} '{}' is not a count >= 1", flag, v));
  return std::stoi(v);
}

Options parse(const std::vector<std::string>& args) {
  Options o;
  for (std::size_t i = 0; i < args.size(); ++i) {
    const auto value = [&]() -> const std::string& {
      if (i + 1 >= args.size())
        throw ConfigError(fmt::format("bench offload: {} needs a value", args[i]));
      return args[++i];
    };
    if (args[i] == "--backend") {
      o.backend = value();
      if (o.backend != "cpu" && o.backend != "cuda")
        throw ConfigError(
            fmt::format("bench offload: --backend '{}' is not cpu or cuda", o.backend));
    } else if (args[i] == "--params") {
      o.params = parse_count(value(), "bench offload: --params");
    } else if (args[i] == "--threads") {
      o.threads = static_cast<unsigned>(parse_positive("--threads", value()));
    } else if (args[i] == "--iters") {
      o.iters = parse_positive("--iters", value());
    } else if (args[i] == "--json") {
      o.json = value();
    } else {
      throw ConfigError(fmt::format("bench offload: unknown argument '{}'", args[i]));
    }
  }
  if (o.backend.empty()) o.backend = cuda_device_count() > 0 ? "cuda" : "cpu";
  return o;
}

// A block of host memory (4096-byte aligned, not initialized) given back when it goes.
class HostBuffer {
 public:
  HostBuffer(Allocator& allocator, std::size_t bytes)
      : allocator_(allocator), block_(allocator.allocate(bytes)) {}
  ~HostBuffer() { allocator_.deallocate(block_); }
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  unsigned char* get() const { return static_cast<unsigned char*>(block_.ptr); }
  float* f32() const { return static_cast<float*>(block_.ptr); }

 private:
  Allocator& allocator_;
  Block block_;
};

// Calls f(begin, end) on each thread of `pool` with its share of [0, n): whole blocks of
// HostUpdater::kBlock elements shared out as HostUpdater shares a shard over as many threads, so
// that the thread that first writes a page is the one that updates it.
void for_ranges(ForkJoinPool& pool, std::size_t n,
                const std::function<void(std::size_t, std::size_t)>& f) {
  const std::size_t blocks = (n + HostUpdater::kBlock - 1) / HostUpdater::kBlock;
  const auto parts = static_cast<unsigned>(std::min<std::size_t>(pool.threads(), blocks));
  pool.run(parts, [&](unsigned part) {
    f(blocks * part / parts * HostUpdater::kBlock,
      std::min(n, blocks * (part + 1) / parts * HostUpdater::kBlock));
  });
}

// The update's tensors over n params in host memory.
struct HostState {
  HostState(Allocator& a, std::size_t params)
      : master(a, params * 4),
        m(a, params * 4),
        v(a, params * 4),
        grad(a, params * 2),
        param(a, params * 2),
        n(params) {}
  HostBuffer master, m, v, grad, param;
  std::size_t n;

  ShardTensors tensors() const {
    return {master.f32(), m.f32(), v.f32(), grad.get(), param.get(), DType::bf16, DType::bf16, n};
  }
  // OffloadData's starting values, each page written by the thread that will update it.
  void reset(const OffloadData& d, ForkJoinPool& pool) const {
    for_ranges(pool, n, [&](std::size_t begin, std::size_t end) {
      fill_periodic(master.get(), d.master.data(), 4, begin, end);
      fill_periodic(m.get(), d.m.data(), 4, begin, end);
      fill_periodic(v.get(), d.v.data(), 4, begin, end);
      fill_periodic(grad.get(), d.grad.data(), 2, begin, end);
      std::memset(param.get() + begin * 2, 0, (end - begin) * 2);
    });
  }
  // True when every element holds its value after one step from reset().
  bool stepped_once(const OffloadData& d) const {
    return equals_periodic(master.get(), d.next_master.data(), 4, n) &&
           equals_periodic(m.get(), d.next_m.data(), 4, n) &&
           equals_periodic(v.get(), d.next_v.data(), 4, n) &&
           equals_periodic(param.get(), d.next_param.data(), 2, n);
  }
};

// memcpy on the pool's threads, each of its share, of a buffer of 14 B/param: the bytes read +
// written equal the update's 28 B/param. Checked: the copy equals its source.
OffloadRow copy_row(Allocator& a, ForkJoinPool& pool, const OffloadData& d, std::size_t n,
                    int iters) {
  const std::size_t floats = (n * kUpdateBytesPerParam / 2 + 3) / 4;
  const HostBuffer src(a, floats * 4), dst(a, floats * 4);
  for_ranges(pool, floats, [&](std::size_t begin, std::size_t end) {
    fill_periodic(src.get(), d.master.data(), 4, begin, end);
    std::memset(dst.get() + begin * 4, 0, (end - begin) * 4);
  });
  OffloadRow row{"host copy (memcpy, read + write)", pool.threads()};
  row.seconds = median_seconds(iters, [&] {
    for_ranges(pool, floats, [&](std::size_t begin, std::size_t end) {
      std::memcpy(dst.get() + begin * 4, src.get() + begin * 4, (end - begin) * 4);
    });
  });
  row.bytes = 2.0 * static_cast<double>(floats * 4);
  row.ok = std::memcmp(dst.get(), src.get(), floats * 4) == 0;
  return row;
}

// The update through `updater`: checked after one step from the start, then timed (the state
// goes on stepping). Its ratio: GB/s over the copy's.
OffloadRow update_row(std::string name, HostUpdater& updater, const HostState& s,
                      const OffloadData& d, ForkJoinPool& pool, int iters, const OffloadRow& copy) {
  s.reset(d, pool);
  updater.update(offload_config(), offload_args(), s.tensors());
  OffloadRow row{std::move(name), updater.threads()};
  row.ok = s.stepped_once(d);
  row.seconds =
      median_seconds(iters, [&] { updater.update(offload_config(), offload_args(), s.tensors()); });
  row.params = s.n;
  row.bytes = static_cast<double>(kUpdateBytesPerParam * s.n);
  row.ratio = (row.bytes / row.seconds) / (copy.bytes / copy.seconds);
  return row;
}

std::string cell(bool shown, const std::string& text) {
  return shown ? text : "-";
}

// The table's columns, every row's cells as text.
constexpr const char* kRowFormat = "{:<41} {:>7} {:>9} {:>8} {:>7} {:>8} {:>6} {:>6}\n";

void print_row(std::ostream& out, const OffloadRow& r) {
  const double per_param = r.params > 0 ? r.bytes / static_cast<double>(r.params) : 0;
  out << fmt::format(
      kRowFormat, r.name, cell(r.threads > 0, std::to_string(r.threads)),
      fmt::format("{:.3f}", r.seconds * 1e3),
      cell(r.params > 0, fmt::format("{:.3f}", static_cast<double>(r.params) / r.seconds / 1e9)),
      cell(r.params > 0, fmt::format("{:.0f}", per_param)),
      fmt::format("{:.2f}", r.bytes / r.seconds / 1e9),
      cell(r.ratio.has_value(), fmt::format("{:.3f}", r.ratio.value_or(0))),
      cell(r.ok.has_value(), r.ok.value_or(false) ? "ok" : "FAILED"));
  out.flush();
}

nlohmann::json row_json(const OffloadRow& r) {
  nlohmann::json j = {{"name", r.name},       {"threads", r.threads},
                      {"seconds", r.seconds}, {"params", r.params},
                      {"bytes", r.bytes},     {"gbps", r.bytes / r.seconds / 1e9}};
  if (r.params > 0) j["params_per_s"] = static_cast<double>(r.params) / r.seconds;
  if (r.ratio) j["ratio"] = *r.ratio;
  if (r.ok) j["check"] = *r.ok ? "ok" : "FAILED";
  return j;
}

}  // namespace

int bench_offload(const std::vector<std::string>& args, std::ostream& out) {
  const Options o = parse(args);
  const bool cuda = o.backend == "cuda";
  if (cuda) cuda_set_device(0);  // before the host rows: a build without CUDA fails here

  std::optional<OutputFile> json_file;  // checked before the benchmark runs
  if (!o.json.empty()) json_file.emplace("--json", o.json);

  HostUpdater updater(o.threads);
  ForkJoinPool pool(updater.threads());
  const OffloadData data = make_offload_data();
  out << fmt::format(
      "bench offload: {} params of AdamW (bf16 grad and param, fp32 master, m, v), {} threads,\n"
      "  median of {} after {} warm-up\n"
      "  check: after one step from the same inputs, every element has the bits of one\n"
      "    cpu_device_ops().update (ok), else FAILED and the row's numbers are void\n"
      "  ratio: a host update's GB/s over the host copy's; an offload way's params/s over the\n"
      "    on-device update's\n",
      count_label(o.params), updater.threads(), o.iters, kWarmup);
  out << fmt::format(kRowFormat, "row", "threads", "ms", "Gparam/s", "B/param", "GB/s", "ratio",
                     "check");
  nlohmann::json rows = nlohmann::json::array();
  bool all_ok = true;
  const auto emit = [&](const OffloadRow& r) {
    print_row(out, r);
    rows.push_back(row_json(r));
    all_ok = all_ok && r.ok.value_or(true);
  };
  {
    const std::unique_ptr<Allocator> host = make_host_allocator(4096);
    const OffloadRow copy = copy_row(*host, pool, data, o.params, o.iters);
    emit(copy);
    const HostState state(*host, o.params);
    emit(update_row("host update (HostUpdater)", updater, state, data, pool, o.iters, copy));
    HostUpdater one(1);
    emit(update_row("host update (1 thread)", one, state, data, pool, o.iters, copy));
  }
  if (cuda) cuda_offload_rows(data, updater, o.params, o.iters, emit);

  if (json_file) {
    const nlohmann::json doc = {{"benchmark", "offload"}, {"backend", o.backend},
                                {"params", o.params},     {"threads", updater.threads()},
                                {"iters", o.iters},       {"warmup", kWarmup},
                                {"rule", "AdamW"},        {"param_dtype", "bf16"},
                                {"grad_dtype", "bf16"},   {"rows", rows}};
    json_file->write(doc.dump(2) + "\n");
    json_file->commit();
  }
  return all_ok ? 0 : 1;
}

}  // namespace shardswap
