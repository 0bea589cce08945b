// `shardswap bench optimizer`: how close the fused AdamW update comes to the backend's copy
// bandwidth. Backend-agnostic: memory comes from an Allocator, work goes through the kernel table,
// and the clock is read around kernels.synchronize(). Every row is checked in the same run against
// a host float64 step on the same data (a wrong result voids the row's numbers).
#include "bench/bench_optimizer.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "shardswap/allocator.h"
#include "shardswap/error.h"
#include "bench/counts.h"
#include "memory/host_types.h"
#include "optimizer/optimizer.h"
#include "files/output_file.h"

namespace shardswap {

namespace {

constexpr std::size_t kCopyBytes = std::size_t{1} << 30;  // 1 GiB of fp32, as in DEVICE.md
// Bytes one AdamW update moves per param: reads master, m, v (fp32) and the bf16 gradient;
// writes master, m, v and the bf16 param: 4 * 3 + 2 + 4 * 3 + 2.
constexpr std::size_t kUpdateBytesPerParam = 28;
constexpr std::size_t kPattern = std::size_t{1} << 20;  // elements uploaded; the rest are copies
constexpr std::size_t kWindow = 4096;                   // elements checked at each of 3 places
constexpr int kWarmup = 3;

struct Options {
  std::string backend;
  std::vector<std::size_t> sizes_params;  ///< --sizes: params (elements) per row
  int iters = 20;
  std::string json;
};

Options parse(const std::vector<std::string>& args) {
  Options o;
  std::string sizes;
  for (std::size_t i = 0; i < args.size(); ++i) {
    const auto value = [&]() -> const std::string& {
      if (i + 1 >= args.size())
        throw ConfigError(fmt::format("bench optimizer: {} needs a value", args[i]));
      return args[++i];
    };
    if (args[i] == "--backend") {
      o.backend = value();
      if (o.backend != "cpu" && o.backend != "cuda")
        throw ConfigError(
            fmt::format("bench optimizer: --backend '{}' is not cpu or cuda", o.backend));
    } else if (args[i] == "--sizes") {
      sizes = value();
    } else if (args[i] == "--iters") {
      const std::string& v = value();
      const bool digits =
          !v.empty() && v.size() <= 6 &&
          std::all_of(v.begin(), v.end(), [](char c) { return c >= '0' && c <= '9'; });
      if (!digits || std::stoi(v) < 1)
        throw ConfigError(fmt::format("bench optimizer: --iters '{}' is not a count >= 1", v));
      o.iters = std::stoi(v);
    } else if (args[i] == "--json") {
      o.json = value();
    } else {
      throw ConfigError(fmt::format("bench optimizer: unknown argument '{}'", args[i]));
    }
  }
  if (o.backend.empty()) o.backend = cuda_device_count() > 0 ? "cuda" : "cpu";
  if (sizes.empty()) sizes = o.backend == "cuda" ? "64M,256M,1G" : "4M,16M";
  std::size_t start = 0;
  while (start <= sizes.size()) {
    const std::size_t end = std::min(sizes.find(',', start), sizes.size());
    o.sizes_params.push_back(
        parse_count(sizes.substr(start, end - start), "bench optimizer: --sizes"));
    start = end + 1;
  }
  return o;
}

// One block of the backend's memory, given back when it goes.
class Allocation {
 public:
  Allocation(Allocator& allocator, std::size_t bytes)
      : allocator_(allocator), block_(allocator.allocate(bytes)) {}
  ~Allocation() { allocator_.deallocate(block_); }
  Allocation(const Allocation&) = delete;
  Allocation& operator=(const Allocation&) = delete;
  unsigned char* get() const { return static_cast<unsigned char*>(block_.ptr); }

 private:
  Allocator& allocator_;
  Block block_;
};

// Fills count elements of elem bytes at dst with `pattern` repeated: element i holds
// pattern[i % kPattern]. One upload, then copies on the backend that double the filled part.
void fill_repeating(Allocator& a, const DeviceOps& k, unsigned char* dst,
                    const void* pattern, std::size_t count, std::size_t elem) {
  std::size_t filled = std::min(kPattern, count);
  a.upload(dst, pattern, filled * elem);
  while (filled < count) {
    const std::size_t n = std::min(filled, count - filled);
    k.copy(dst + filled * elem, dst, n * elem);
    filled += n;
  }
  k.synchronize();
}

std::vector<float> random_floats(std::mt19937& rng, float lo, float hi, bool any_sign) {
  std::uniform_real_distribution<float> mag(lo, hi);
  std::bernoulli_distribution negative(0.5);
  std::vector<float> v(kPattern);
  for (float& x : v) x = any_sign && negative(rng) ? -mag(rng) : mag(rng);
  return v;
}

// Median of the times of `iters` calls of f, each followed by kernels.synchronize(), after
// kWarmup untimed ones; in seconds.
template <class F>
double median_seconds(const DeviceOps& k, int iters, F&& f) {
  for (int i = 0; i < kWarmup; ++i) f();
  k.synchronize();
  std::vector<double> t;
  for (int i = 0; i < iters; ++i) {
    const auto start = std::chrono::steady_clock::now();
    f();
    k.synchronize();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(t.begin(), t.end());
  return t.size() % 2 ? t[t.size() / 2] : (t[t.size() / 2 - 1] + t[t.size() / 2]) / 2;
}

double normalized_error(const std::vector<double>& got, const std::vector<double>& ref) {
  double diff = 0, norm = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    diff += (got[i] - ref[i]) * (got[i] - ref[i]);
    norm += ref[i] * ref[i];
  }
  return norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
}

struct Row {
  std::size_t params = 0;
  double copy_s = 0, update_s = 0;
  double copy_tbps = 0, update_tbps = 0;
  bool copy_ok = false;
  double master_error = 0, m_error = 0, v_error = 0;
  std::size_t param_mismatches = 0;
  bool pass() const {
    // Float rounding of one step stays near 1e-7; any error in the rule is orders larger.
    return copy_ok && master_error <= 1e-6 && m_error <= 1e-6 && v_error <= 1e-6 &&
           param_mismatches == 0;
  }
};

// kernels.copy of kCopyBytes of fp32 into another buffer; bytes read + written per second.
void measure_copy(Allocator& a, const DeviceOps& k, int iters,
                  const std::vector<float>& pattern, Row& row) {
  const std::size_t count = kCopyBytes / sizeof(float);
  const Allocation src(a, kCopyBytes), dst(a, kCopyBytes);
  fill_repeating(a, k, src.get(), pattern.data(), count, sizeof(float));
  k.fill_zero(dst.get(), kCopyBytes);
  row.copy_s = median_seconds(k, iters, [&] { k.copy(dst.get(), src.get(), kCopyBytes); });
  row.copy_tbps = 2.0 * static_cast<double>(kCopyBytes) / row.copy_s / 1e12;
  row.copy_ok = true;
  std::vector<float> window(kWindow);
  for (std::size_t at : {std::size_t{0}, count / 2 + 5, count - kWindow}) {
    a.download(window.data(), dst.get() + at * sizeof(float), kWindow * sizeof(float));
    for (std::size_t i = 0; i < kWindow; ++i)
      row.copy_ok = row.copy_ok && std::bit_cast<std::uint32_t>(window[i]) ==
                                       std::bit_cast<std::uint32_t>(pattern[(at + i) % kPattern]);
  }
}

// The fused AdamW update of n params: bf16 gradient and param, fp32 master, m and v, at step 10
// so that m and v are not zero. The first call is checked against a host float64 step.
void measure_update(Allocator& a, const DeviceOps& k, int iters, std::size_t n, Row& row) {
  std::mt19937 rng(20261129);
  const std::vector<float> master0 = random_floats(rng, 0.05f, 1.0f, true);
  const std::vector<float> m0 = random_floats(rng, 1e-4f, 1e-2f, true);
  const std::vector<float> v0 = random_floats(rng, 1e-6f, 1e-4f, false);
  std::vector<bf16_t> grad0;
  for (float g : random_floats(rng, 1e-3f, 1e-1f, true)) grad0.push_back(bf16_t(g));

  const Allocation master(a, n * 4), m(a, n * 4), v(a, n * 4), grad(a, n * 2), param(a, n * 2);
  fill_repeating(a, k, master.get(), master0.data(), n, 4);
  fill_repeating(a, k, m.get(), m0.data(), n, 4);
  fill_repeating(a, k, v.get(), v0.data(), n, 4);
  fill_repeating(a, k, grad.get(), grad0.data(), n, 2);
  k.fill_zero(param.get(), n * 2);

  OptimizerConfig config;
  config.type = OptimizerType::adamw;
  config.lr = 1e-3;
  config.weight_decay = 0.01;
  const StepArgs args{10, config.lr, config.weight_decay, 1.0f};
  ShardTensors t;
  t.master = reinterpret_cast<float*>(master.get());
  t.state0 = reinterpret_cast<float*>(m.get());
  t.state1 = reinterpret_cast<float*>(v.get());
  t.grad = grad.get();
  t.param = param.get();
  t.dtype = DType::bf16;
  t.grad_dtype = DType::bf16;
  t.count = n;

  k.update(config, args, t);
  k.synchronize();
  const std::size_t w = std::min(kWindow, n);
  std::vector<double> got_p, got_m, got_v, ref_p, ref_m, ref_v;
  std::vector<float> fp(w), fm(w), fv(w);
  std::vector<bf16_t> bp(w);
  const double t_step = static_cast<double>(args.step);
  for (std::size_t at : {std::size_t{0}, n / 2 - w / 2, n - w}) {
    a.download(fp.data(), master.get() + at * 4, w * 4);
    a.download(fm.data(), m.get() + at * 4, w * 4);
    a.download(fv.data(), v.get() + at * 4, w * 4);
    a.download(bp.data(), param.get() + at * 2, w * 2);
    for (std::size_t i = 0; i < w; ++i) {
      const std::size_t j = (at + i) % kPattern;
      const double g = static_cast<float>(grad0[j]);
      double p = master0[j], mu = m0[j], nu = v0[j];
      p -= config.lr * config.weight_decay * p;
      mu = config.beta1 * mu + (1 - config.beta1) * g;
      nu = config.beta2 * nu + (1 - config.beta2) * g * g;
      const double mhat = mu / (1 - std::pow(config.beta1, t_step));
      const double vhat = nu / (1 - std::pow(config.beta2, t_step));
      p -= config.lr * mhat / (std::sqrt(vhat) + config.eps);
      ref_p.push_back(p);
      ref_m.push_back(mu);
      ref_v.push_back(nu);
      got_p.push_back(fp[i]);
      got_m.push_back(fm[i]);
      got_v.push_back(fv[i]);
      row.param_mismatches +=
          std::bit_cast<std::uint16_t>(bp[i]) != std::bit_cast<std::uint16_t>(bf16_t(fp[i]));
    }
  }
  row.master_error = normalized_error(got_p, ref_p);
  row.m_error = normalized_error(got_m, ref_m);
  row.v_error = normalized_error(got_v, ref_v);

  row.update_s = median_seconds(k, iters, [&] { k.update(config, args, t); });
  row.update_tbps =
      static_cast<double>(kUpdateBytesPerParam) * static_cast<double>(n) / row.update_s / 1e12;
}

}  // namespace

int bench_optimizer(const std::vector<std::string>& args, std::ostream& out) {
  const Options o = parse(args);
  const bool cuda = o.backend == "cuda";
  const DeviceOps& k = cuda ? cuda_device_ops() : cpu_device_ops();
  const std::unique_ptr<Allocator> a = cuda ? make_cuda_allocator(0) : make_host_allocator();

  std::optional<OutputFile> json_file;  // checked before the benchmark runs
  if (!o.json.empty()) json_file.emplace("--json", o.json);

  out << fmt::format(
      "bench optimizer: backend {} ({}), median of {} iterations after {} warm-up\n"
      "  copy:   kernels.copy of 1 GiB fp32, bytes read + written\n"
      "  update: AdamW, bf16 grad and param, fp32 master/m/v, {} bytes/param; checked against a "
      "float64 step\n",
      k.name, a->name(), o.iters, kWarmup, kUpdateBytesPerParam);
  out << fmt::format("{:>10} {:>10} {:>10} {:>11} {:>12} {:>6}\n", "params", "copy TB/s",
                     "update ms", "update TB/s", "update/copy", "check");
  out.flush();

  std::mt19937 rng(7);
  const std::vector<float> copy_pattern = random_floats(rng, 1e-3f, 1e3f, true);
  nlohmann::json rows = nlohmann::json::array();
  bool all_pass = true;
  for (std::size_t n : o.sizes_params) {
    Row row;
    row.params = n;
    measure_copy(*a, k, o.iters, copy_pattern, row);
    measure_update(*a, k, o.iters, n, row);
    const double ratio = row.update_tbps / row.copy_tbps;
    all_pass = all_pass && row.pass();
    out << fmt::format("{:>10} {:>10.4g} {:>10.4g} {:>11.4g} {:>12.3f} {:>6}\n", count_label(n),
                       row.copy_tbps, row.update_s * 1e3, row.update_tbps, ratio,
                       row.pass() ? "PASS" : "FAIL");
    if (!row.pass()) {
      out << fmt::format(
          "    FAIL: copy {}, normalized error master {:.3g} m {:.3g} v {:.3g} (limit 1e-6), "
          "{} bf16 params not the rounded master; this row's numbers are void\n",
          row.copy_ok ? "ok" : "wrong", row.master_error, row.m_error, row.v_error,
          row.param_mismatches);
    }
    out.flush();
    rows.push_back({{"params", n},
                    {"label", count_label(n)},
                    {"copy_ms", row.copy_s * 1e3},
                    {"copy_tbps", row.copy_tbps},
                    {"update_ms", row.update_s * 1e3},
                    {"update_tbps", row.update_tbps},
                    {"ratio", ratio},
                    {"check", row.pass() ? "PASS" : "FAIL"},
                    {"copy_ok", row.copy_ok},
                    {"master_error", row.master_error},
                    {"m_error", row.m_error},
                    {"v_error", row.v_error},
                    {"param_mismatches", row.param_mismatches}});
  }

  if (json_file) {
    const nlohmann::json doc = {{"benchmark", "optimizer"},
                                {"backend", k.name},
                                {"device", a->name()},
                                {"iters", o.iters},
                                {"warmup", kWarmup},
                                {"copy_bytes", kCopyBytes},
                                {"update_bytes_per_param", kUpdateBytesPerParam},
                                {"rule", "AdamW"},
                                {"param_dtype", "bf16"},
                                {"grad_dtype", "bf16"},
                                {"rows", rows}};
    json_file->write(doc.dump(2) + "\n");
    json_file->commit();
  }
  return all_pass ? 0 : 1;
}

}  // namespace shardswap
