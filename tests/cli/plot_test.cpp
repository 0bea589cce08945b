// `shardswap plot`: the series read from a metrics file, the errors that name the file and the
// line, and the drawing (through gnuplot) that never leaves a half-written file behind.
#include <fmt/format.h>
#include <stdlib.h>
#include <unistd.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "shardswap/error.h"
#include "tests/catch_compat.h"
#include "tests/support/scratch_folder.h"
#include "cli/plot.h"

using namespace shardswap;
using test_support::ScratchFolder;
namespace fs = std::filesystem;

namespace {

constexpr double kMiB = 1048576.0;
const std::string kScratchPrefix = "shardswap-plot-test";

void write_file(const fs::path& path, const std::string& text) {
  std::ofstream f(path);
  f << text;
  REQUIRE(f.good());
}

std::string read_file(const fs::path& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// What the generator put into the file, kept apart from the JSON it wrote.
struct Expected {
  std::vector<std::int64_t> steps;
  std::vector<double> loss;  // NaN: written as null or left out
  std::vector<std::pair<std::int64_t, double>> val_loss;
  std::vector<std::string> memory_names;
  std::vector<std::vector<double>> memory_mib;  // per name, per line
  std::vector<std::int64_t> switch_steps;
};

// A metrics file as `shardswap train --metrics` writes it, random values, with the cases the
// reader must get right: the validation loss before training on the first line, null grad_norm
// and loss, switch events, val_loss on some steps, a tag always zero (activation, and 'other'
// which is missing at first), one always below kMinTagShare of the total (comm's few bytes), an
// unknown tag appearing midway, a line without memory_bytes, unknown keys, a blank line.
std::pair<std::string, Expected> random_metrics(std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  const auto uniform = [&](double lo, double hi) {
    return std::uniform_real_distribution<double>(lo, hi)(rng);
  };
  const auto bytes = [&](std::int64_t lo, std::int64_t hi) {
    return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng);
  };
  const int lines = 73;
  const std::int64_t first_step = 101;
  const std::int64_t param16 = bytes(1 << 20, 1 << 24);
  Expected e;
  e.memory_names = {"param16", "grad", "master32", "optim_state", "kv_cache", "total"};
  e.memory_mib.assign(e.memory_names.size(), {});
  std::string text;
  for (int i = 0; i < lines; ++i) {
    const std::int64_t step = first_step + i;
    const bool overflow = uniform(0, 1) < 0.1;
    const double loss = uniform(0.01, 5.0);
    nlohmann::json line = {
        {"step", step},
        {"grad_norm", overflow ? nlohmann::json() : nlohmann::json(uniform(0.1, 9.0))},
        {"skipped", overflow},
        {"lr", uniform(1e-5, 1e-2)},
        {"loss_scale", 65536.0},
        {"tokens_per_s", uniform(1e3, 1e6)},
        {"active_groups", {"input", "head"}},
        {"unknown_key", {{"a", {1, 2}}}}};
    if (i == 0) {
      const double v = uniform(0.01, 5.0);
      line["initial_val_loss"] = v;
      e.val_loss.emplace_back(0, v);
    }
    if (i % 17 == 5)
      line["loss"] = nullptr;
    else if (i % 23 != 7)
      line["loss"] = loss;
    e.steps.push_back(step);
    e.loss.push_back(i % 17 == 5 || i % 23 == 7 ? std::nan("") : loss);
    if (uniform(0, 1) < 0.15) {
      const double v = uniform(0.01, 5.0);
      line["val_loss"] = v;
      e.val_loss.emplace_back(step, v);
    }
    if (i > 0 && uniform(0, 1) < 0.08) {
      line["switch"] = {{"in", {"layers.3"}},
                        {"out", {"layers.1"}},
                        {"bytes_freed", bytes(1, 1 << 20)},
                        {"bytes_allocated", bytes(1, 1 << 20)},
                        {"seconds", uniform(1e-4, 1e-2)}};
      e.switch_steps.push_back(step);
    }
    if (i == 40) {  // no memory_bytes at all: a gap in every memory line
      for (auto& column : e.memory_mib) column.push_back(std::nan(""));
    } else {
      const std::int64_t kv = i >= 30 ? bytes(1, 1 << 22) : 0;
      const std::vector<std::int64_t> v = {param16, bytes(1, 1 << 22), bytes(1, 1 << 22),
                                           bytes(1, 1 << 23), bytes(0, 64)};
      nlohmann::json memory = {{"param16", v[0]},
                               {"grad", v[1]},
                               {"master32", v[2]},
                               {"optim_state", v[3]},
                               {"comm", v[4]},
                               {"activation", 0},
                               {"note", "not a number: tolerated, not drawn"}};
      if (i >= 10) memory["other"] = 0;
      if (i >= 30) memory["kv_cache"] = kv;
      const std::int64_t total = v[0] + v[1] + v[2] + v[3] + v[4] + kv;
      memory["total"] = total;
      memory["peak"] = total + bytes(0, 1000);
      line["memory_bytes"] = memory;
      for (int k = 0; k < 4; ++k) e.memory_mib[k].push_back(v[k] / kMiB);  // not comm's
      e.memory_mib[4].push_back(i >= 30 ? kv / kMiB : std::nan(""));
      e.memory_mib[5].push_back(total / kMiB);
    }
    text += line.dump() + "\n";
    if (i == 20) text += "\n";
  }
  return {text, e};
}

// Equal, NaN matching NaN.
bool same(double a, double b) {
  return (std::isnan(a) && std::isnan(b)) || a == b;
}

std::string config_error(const std::string& text) {
  std::istringstream in(text);
  return test::message_of<ConfigError>([&] { read_metrics(in, "bad.jsonl"); });
}

MetricsSeries sample_series() {
  return read_metrics_file(SHARDSWAP_TEST_DIR "/fixtures/metrics/metrics-sample.jsonl");
}

// Sets TMPDIR for the scope: plot_metrics' temporary folder is then easy to find, or to miss.
class TmpdirOverride {
 public:
  explicit TmpdirOverride(const fs::path& dir) {
    if (const char* old = getenv("TMPDIR")) old_ = old;
    setenv("TMPDIR", dir.c_str(), 1);
  }
  ~TmpdirOverride() {
    if (old_)
      setenv("TMPDIR", old_->c_str(), 1);
    else
      unsetenv("TMPDIR");
  }

 private:
  std::optional<std::string> old_;
};

}  // namespace

TEST_CASE("plot reads steps, loss, val_loss, memory by tag and switches from a metrics file") {
  for (std::uint64_t seed : {1, 2, 3}) {
    const auto [text, e] = random_metrics(seed);
    std::istringstream in(text);
    const MetricsSeries s = read_metrics(in, "random.jsonl");
    CAPTURE(seed);
    REQUIRE(s.steps == e.steps);
    REQUIRE(s.loss.size() == e.loss.size());
    for (std::size_t i = 0; i < e.loss.size(); ++i) REQUIRE(same(s.loss[i], e.loss[i]));
    REQUIRE(s.val_loss == e.val_loss);
    REQUIRE(s.switch_steps == e.switch_steps);
    REQUIRE(s.switch_in == std::vector<std::string>(e.switch_steps.size(), "layers.3"));
    REQUIRE_FALSE(e.switch_steps.empty());  // the seeds were picked to hold switches
    REQUIRE(s.memory.size() == e.memory_names.size());
    for (std::size_t k = 0; k < e.memory_names.size(); ++k) {
      CAPTURE(e.memory_names[k]);
      REQUIRE(s.memory[k].name == e.memory_names[k]);
      REQUIRE(s.memory[k].mib.size() == e.steps.size());
      for (std::size_t i = 0; i < e.steps.size(); ++i)
        REQUIRE(same(s.memory[k].mib[i], e.memory_mib[k][i]));
    }
  }
}

TEST_CASE("plot reads the committed sample, its null grad_norm and switches included") {
  const auto s = sample_series();
  REQUIRE(s.steps.size() == 40);
  REQUIRE(s.switch_steps == std::vector<std::int64_t>{11, 21, 31});
  REQUIRE(s.val_loss.size() == 4);
  REQUIRE(s.memory.back().name == "total");
  REQUIRE(s.memory.back().mib[0] == 838296 / kMiB);  // step 1's total, from the file
}

TEST_CASE("a line with only a step is read with gaps, not refused") {
  std::istringstream in(R"({"step": 5}
{"step": 6, "loss": 0.5, "memory_bytes": {"grad": 2097152, "total": 3145728}})");
  const auto s = read_metrics(in, "sparse.jsonl");
  REQUIRE(s.steps == std::vector<std::int64_t>{5, 6});
  REQUIRE(std::isnan(s.loss[0]));
  REQUIRE(s.loss[1] == 0.5);
  REQUIRE(s.memory.size() == 2);
  REQUIRE(s.memory[0].name == "grad");
  REQUIRE(std::isnan(s.memory[0].mib[0]));
  REQUIRE(s.memory[0].mib[1] == 2.0);
  REQUIRE(s.memory[1].mib[1] == 3.0);
}

TEST_CASE("a malformed metrics line is refused naming the file and the line") {
  const std::string good = R"({"step": 1, "loss": 0.5})";
  REQUIRE(
      test::contains(config_error(good + "\n" + good + "\n{\"step\": 3,\n"), "bad.jsonl line 3"));
  REQUIRE(test::contains(config_error(good + "\n[1, 2]\n"),
                         "bad.jsonl line 2: expected a JSON object"));
  const auto no_step = config_error(R"({"loss": 1.0})");
  REQUIRE(test::contains(no_step, "bad.jsonl line 1"));
  REQUIRE(test::contains(no_step, "'step'"));
  REQUIRE(test::contains(config_error(R"({"step": 1.5})"), "'step' must be an integer"));
  REQUIRE(test::contains(config_error(R"({"step": 1, "loss": "low"})"), "'loss'"));
  REQUIRE(test::contains(config_error(R"({"step": 1, "val_loss": [1]})"), "'val_loss'"));
  REQUIRE(test::contains(config_error(R"({"step": 1, "memory_bytes": 5})"), "'memory_bytes'"));
  REQUIRE(test::contains(config_error(R"({"step": 1, "memory_bytes": {"grad": "x"}})"),
                         "'memory_bytes.grad'"));
  REQUIRE(test::contains(config_error(R"({"step": 1, "switch": true})"), "'switch'"));
}

TEST_CASE(
    "a metrics line that is not JSON, too deep or repeating a key is refused naming its "
    "line, column and key, without the JSON library's text") {
  const std::string good = R"({"step": 1, "loss": 0.5})";
  const auto cases = {
      std::pair<std::string, std::string>{R"({"step": 2, "loss": oops})",
                                          "plot: bad.jsonl line 2, column 21: not valid JSON: "},
      {R"({"step": 2, "loss": 1e999})",
       "plot: bad.jsonl line 2, column 21: loss: the number 1e999 is beyond the range of a double"},
      {R"({"step": 2, "step": 3})",
       "plot: bad.jsonl line 2, column 13: step: the key 'step' appears twice"},
      {R"({"step": 2, "x": )" + std::string(100'000, '[') + std::string(100'000, ']') + "}",
       "plot: bad.jsonl line 2, column 81: x[0][0][0][0][0] ... [0][0][0]: nested deeper than 64 "
       "levels"},
      {R"({"step": 2})" + std::string(1, '\0') + R"({"step": 3})",
       "plot: bad.jsonl line 2, column 12: not valid JSON: a NUL byte"},
  };
  for (const auto& [line, expected] : cases) {
    const auto m = config_error(good + "\n" + line + "\n");
    CAPTURE(m.substr(0, 300));
    REQUIRE(test::contains(m, expected));
    REQUIRE(!test::contains(m, "json.exception"));
  }
}

TEST_CASE("a cut-off last line is skipped with a warning naming the file") {
  for (std::uint64_t seed : {4, 5, 6}) {
    const auto [text, e] = random_metrics(seed);
    // The last line as a kill leaves it: cut anywhere before its end, no newline.
    const auto last = text.rfind('\n', text.size() - 2) + 1;
    std::mt19937_64 rng(seed);
    const auto cut = last + std::uniform_int_distribution<std::size_t>(
                                1, text.size() - last - 3)(rng);  // always invalid JSON
    CAPTURE(seed, text.substr(last, cut - last));
    std::istringstream in(text.substr(0, cut));
    const auto s = read_metrics(in, "cut.jsonl");
    REQUIRE(s.steps == std::vector<std::int64_t>(e.steps.begin(), e.steps.end() - 1));
    REQUIRE(s.warnings.size() == 1);
    REQUIRE(test::contains(s.warnings[0], "cut.jsonl line"));
    REQUIRE(test::contains(s.warnings[0], "cut-off last line"));
  }
}

TEST_CASE("a malformed line is still refused when it ends in a newline or is not the last") {
  const std::string good = R"({"step": 1, "loss": 0.5})";
  REQUIRE(test::contains(config_error(good + "\n{\"step\": 2, \"lo\n"), "bad.jsonl line 2"));
  REQUIRE(test::contains(config_error(good + "\n{\"step\": 2, \"lo\n" + good),
                         "bad.jsonl line 2"));
  // A complete last line of the wrong shape is no cut-off write: refused too.
  REQUIRE(test::contains(config_error(good + "\n{\"loss\": 1}"), "bad.jsonl line 2"));
}

TEST_CASE("a resume line drops the earlier lines beyond its step, leaving one curve") {
  std::mt19937_64 rng(11);
  std::uniform_real_distribution<double> loss(0.1, 5.0);
  const std::int64_t resumed = 40, first_end = 57, last = 90;
  std::string text;
  std::vector<double> expected;
  for (std::int64_t step = 1; step <= first_end; ++step) {  // a run that stopped at first_end
    const double v = loss(rng);
    text += nlohmann::json{{"step", step}, {"loss", v}}.dump() + "\n";
    if (step <= resumed) expected.push_back(v);
  }
  text += R"({"resumed": {"step": 40, "checkpoint": "ck/step-00000040"}})" "\n";
  for (std::int64_t step = resumed + 1; step <= last; ++step) {  // the same steps, redone
    const double v = loss(rng);
    text += nlohmann::json{{"step", step}, {"loss", v}, {"val_loss", v}}.dump() + "\n";
    expected.push_back(v);
  }
  std::istringstream in(text);
  const auto s = read_metrics(in, "resumed.jsonl");
  std::vector<std::int64_t> steps(last);
  for (std::int64_t i = 0; i < last; ++i) steps[static_cast<std::size_t>(i)] = i + 1;
  REQUIRE(s.steps == steps);
  REQUIRE(s.loss == expected);
  REQUIRE(s.val_loss.size() == static_cast<std::size_t>(last - resumed));
  REQUIRE(s.resume_steps == std::vector<std::int64_t>{resumed});
  REQUIRE(s.warnings.empty());
}

TEST_CASE("a resume line without an integer step is refused naming the line") {
  REQUIRE(test::contains(config_error("{\"step\": 1}\n{\"resumed\": {\"step\": \"x\"}}\n"),
                         "bad.jsonl line 2: 'resumed'"));
  REQUIRE(test::contains(config_error("{\"resumed\": 3}\n"), "bad.jsonl line 1: 'resumed'"));
}

TEST_CASE("a missing, unreadable or empty metrics file is refused naming it") {
  ScratchFolder dir(kScratchPrefix);
  const auto missing = (dir / "missing.jsonl").string();
  REQUIRE(
      test::contains(test::message_of<ConfigError>([&] { read_metrics_file(missing); }), missing));
  REQUIRE(
      test::contains(test::message_of<ConfigError>([&] { read_metrics_file(dir.path().string()); }),
                     "is a directory"));
  write_file(dir / "empty.jsonl", "\n\n");
  REQUIRE(test::contains(
      test::message_of<ConfigError>([&] { read_metrics_file((dir / "empty.jsonl").string()); }),
      "empty.jsonl' holds no step"));
}

TEST_CASE("plot: --out must end in .png or .svg") {
  REQUIRE(plot_format("run/loss.png") == PlotFormat::png);
  REQUIRE(plot_format("LOSS.SVG") == PlotFormat::svg);
  for (const char* bad : {"loss.pdf", "loss", "png", "loss.png.txt"})
    REQUIRE(test::contains(test::message_of<ConfigError>([&] { plot_format(bad); }), "--out"));
}

TEST_CASE("the script marks every switch in both panels and draws each non-zero tag") {
  const auto [text, e] = random_metrics(4);
  std::istringstream in(text);
  const auto s = read_metrics(in, "random.jsonl");
  const std::string script = gnuplot_script(s, PlotFormat::svg);
  for (std::int64_t step : e.switch_steps)
    REQUIRE(test::contains(script,
                           fmt::format("set arrow from first {0}, graph 0 to first {0}", step)));
  // Set before the first panel and never unset: both panels show them.
  REQUIRE_FALSE(test::contains(script, "unset arrow"));
  for (const auto& name : e.memory_names)
    REQUIRE(test::contains(script, fmt::format("title '{}'", name)));
  for (const char* absent :
       {"title 'activation'", "title 'other'", "title 'peak'", "title 'comm'", "note"})
    REQUIRE_FALSE(test::contains(script, absent));
  REQUIRE(test::contains(script, "title 'val_loss'"));
  // Each switch labelled with what came in; the labels unset before the memory panel.
  for (std::size_t i = 0; i < e.switch_steps.size(); ++i)
    REQUIRE(test::contains(script, fmt::format("set label {} 'in: layers.3' at first {}, graph",
                                               100 + i, e.switch_steps[i])));
  REQUIRE(script.find("unset label\n") > script.rfind("set label 1"));
  REQUIRE(script.find("unset label\n") < script.find("memory (MiB)"));
  // The x axis starts at step 0, where the validation loss before training is.
  REQUIRE(test::contains(script, "set xrange [0:"));
}

TEST_CASE("the loss axis is linear unless --log-y, which needs every loss above zero") {
  const auto [text, e] = random_metrics(5);
  std::istringstream in(text);
  auto s = read_metrics(in, "random.jsonl");
  // ("\nset": the script always says "unset logscale y" before the memory panel.)
  REQUIRE_FALSE(test::contains(gnuplot_script(s, PlotFormat::svg), "\nset logscale y"));
  const std::string log = gnuplot_script(s, PlotFormat::svg, true);
  REQUIRE(test::contains(log, "set logscale y\nset ylabel 'loss (log scale)'"));
  s.loss[3] = 0.0;
  REQUIRE(test::contains(
      test::message_of<ConfigError>([&] { gnuplot_script(s, PlotFormat::svg, true); }),
      "--log-y"));
  REQUIRE(test::contains(gnuplot_script(s, PlotFormat::svg), "set ylabel 'loss'\n"));
}

TEST_CASE("a tag is drawn from kMinTagShare of the largest total up") {
  // total 1 MiB: a tag of 1048.576 bytes is exactly the share, one byte less is below it.
  std::istringstream in(
      R"({"step": 1, "loss": 1, "memory_bytes": {"grad": 1049, "comm": 1048, "total": 1048576}})");
  const auto s = read_metrics(in, "share.jsonl");
  REQUIRE(s.memory.size() == 2);
  REQUIRE(s.memory[0].name == "grad");
  REQUIRE(s.memory[1].name == "total");
}

TEST_CASE("a tag name cannot break out of the script's quotes") {
  std::istringstream in(R"({"step": 1, "loss": 1, "memory_bytes": {"it's\n": 1048576}})");
  const auto script = gnuplot_script(read_metrics(in, "odd.jsonl"), PlotFormat::png);
  REQUIRE(test::contains(script, "title 'it''s '\n"));
}

TEST_CASE("a missing gnuplot is reported naming the package to install, and nothing is written") {
  ScratchFolder dir(kScratchPrefix);
  const auto out = dir / "loss.svg";
  PlotOptions options;
  options.gnuplot = "shardswap-test-no-such-gnuplot";
  const auto message =
      test::message_of<ToolNotFound>([&] { plot_metrics(sample_series(), out, options); });
  REQUIRE(test::contains(message, "gnuplot-nox"));
  REQUIRE(dir.names().empty());
}

TEST_CASE("a failing gnuplot leaves an existing output as it was") {
  ScratchFolder dir(kScratchPrefix);
  const auto out = dir / "loss.png";
  write_file(out, "the previous plot");
  PlotOptions options;
  options.gnuplot = "false";  // exits 1
  bool config_error = false;
  try {
    plot_metrics(sample_series(), out, options);
    FAIL("plot_metrics did not throw");
  } catch (const ConfigError&) {
    config_error = true;
  } catch (const Error& e) {
    REQUIRE(test::contains(e.what(), "exited with status 1"));
  }
  REQUIRE_FALSE(config_error);  // not bad input: the CLI exits 1
  REQUIRE(read_file(out) == "the previous plot");
  REQUIRE(dir.names() == std::vector<std::string>{"loss.png"});
}

TEST_CASE("a gnuplot that exits 0 without drawing is an error") {
  ScratchFolder dir(kScratchPrefix);
  PlotOptions options;
  options.gnuplot = "true";
  REQUIRE(test::contains(
      test::message_of<Error>([&] { plot_metrics(sample_series(), dir / "x.svg", options); }),
      "wrote nothing"));
  REQUIRE(dir.names().empty());
}

TEST_CASE("plot: --out in a folder that does not exist is bad input naming --out") {
  ScratchFolder dir(kScratchPrefix);
  const auto out = (dir / "no/such/folder/loss.svg").string();
  REQUIRE(test::contains(test::message_of<ConfigError>([&] { plot_metrics(sample_series(), out); }),
                         "--out"));
}

// Runs the installed gnuplot (tools/install-deps.sh installs it).
TEST_CASE("plot draws an SVG with every series and removes its temporary files") {
  ScratchFolder dir(kScratchPrefix), tmp(kScratchPrefix);
  const TmpdirOverride temp_here(tmp.path());
  const auto out = dir / "run.svg";
  const auto s = sample_series();
  plot_metrics(s, out.string());
  const std::string svg = read_file(out);
  REQUIRE(svg.starts_with("<?xml"));
  REQUIRE(test::contains(svg, "</svg>"));
  for (const char* name : {">loss<", ">val_loss<", ">layer switch<", ">param16<", ">grad<",
                           ">master32<", ">optim_state<", ">activation<", ">total<"})
    REQUIRE(test::contains(svg, name));
  REQUIRE_FALSE(test::contains(svg, ">other<"));  // zero throughout
  REQUIRE(dir.names() == std::vector<std::string>{"run.svg"});
  REQUIRE(tmp.names().empty());
}

TEST_CASE("a series with no step, or with a series of the wrong length, is refused") {
  MetricsSeries s;
  REQUIRE(test::contains(test::message_of<ConfigError>([&] { gnuplot_script(s, PlotFormat::svg); }),
                         "no step"));
  s.steps = {1, 2, 3};
  s.loss = {0.5, 0.4, 0.3};
  s.memory = {{"grad", {1.0, 2.0}}};
  REQUIRE(test::contains(test::message_of<ConfigError>([&] { gnuplot_script(s, PlotFormat::svg); }),
                         "3 steps"));
  s.memory[0].mib.push_back(3.0);
  REQUIRE(test::contains(gnuplot_script(s, PlotFormat::svg), "title 'grad'"));
}
