// `train --metrics`: whole lines written at once and checked, a fresh run starting the file
// empty, a resumed run appending after a line that says where it resumed, and a failed write that
// stops the run naming the file and the step, or (warn) is counted.
#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "shardswap/error.h"
#include "tests/catch_compat.h"
#include "tests/support/file_size_limit.h"
#include "tests/support/scratch_folder.h"
#include "trainer/metrics_log.h"

using namespace shardswap;
using nlohmann::json;
using test_support::FileSizeLimit;
using test_support::ScratchFolder;
namespace fs = std::filesystem;

namespace {

const std::string kPrefix = "shardswap-metrics-log-test";

void write_file(const fs::path& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary);
  f << text;
}

std::string read_file(const fs::path& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

json random_line(std::mt19937_64& rng, std::int64_t step) {
  std::uniform_real_distribution<double> u(0.0, 10.0);
  return {{"step", step},
          {"loss", u(rng)},
          {"lr", u(rng) * 1e-3},
          {"memory_bytes", {{"grad", static_cast<std::int64_t>(rng() % 100000)}}}};
}

}  // namespace

TEST_CASE("a fresh metrics file starts empty and holds one whole line per step") {
  ScratchFolder dir(kPrefix);
  std::mt19937_64 rng(1);
  write_file(dir / "m.jsonl", "{\"step\": 1, \"loss\": 9}\n{\"step\": 2, \"lo");  // an old run's
  std::ostringstream warnings;
  MetricsFile log(dir / "m.jsonl", {}, MetricsErrors::fail, warnings);
  REQUIRE(read_file(dir / "m.jsonl").size() > 0);  // opening changes nothing yet
  log.begin(std::nullopt);
  std::string expected;
  for (std::int64_t step = 1; step <= 37; ++step) {
    const json line = random_line(rng, step);
    log.write(step, line);
    expected += metrics_line(line);
    REQUIRE(read_file(dir / "m.jsonl") == expected);  // in the file as soon as write returns
  }
  REQUIRE(log.finish() == 0);
  REQUIRE(warnings.str().empty());
  REQUIRE(log.lines_written() == 37);
}

TEST_CASE(
    "a resumed metrics file keeps its lines, cuts a partial last one, says where it resumed") {
  ScratchFolder dir(kPrefix);
  std::mt19937_64 rng(2);
  std::string before;
  for (std::int64_t step = 1; step <= 14; ++step) before += metrics_line(random_line(rng, step));
  const std::string partial = metrics_line(random_line(rng, 15)).substr(0, 23);
  write_file(dir / "m.jsonl", before + partial);
  std::ostringstream warnings;
  MetricsFile log(dir / "m.jsonl", {}, MetricsErrors::fail, warnings);
  const ResumePoint at{10, dir / "ck" / "step-00000010"};
  log.begin(at);
  const json next = random_line(rng, 11);
  log.write(11, next);
  REQUIRE(read_file(dir / "m.jsonl") ==
          before + metrics_line(resume_marker(at)) + metrics_line(next));
  REQUIRE(json::parse(metrics_line(resume_marker(at))) ==
          json{{"resumed", {{"step", 10}, {"checkpoint", at.checkpoint.string()}}}});
  REQUIRE(test::contains(warnings.str(), fmt::format("{} bytes", partial.size())));
}

TEST_CASE("a resume point whose path is not UTF-8 is written with replacement characters") {
  ScratchFolder dir(kPrefix);
  std::ostringstream warnings, stream;
  const ResumePoint at{4, std::string("/tmp/ck_\xe9/step-00000004")};
  MetricsFile log(dir / "m.jsonl", {}, MetricsErrors::fail, warnings);
  log.begin(at);
  MetricsStream(stream).begin(at);
  const auto text = read_file(dir / "m.jsonl");
  REQUIRE(text == stream.str());
  REQUIRE(json::parse(text).at("resumed").at("checkpoint") == "/tmp/ck_\xef\xbf\xbd/step-00000004");
}

TEST_CASE("a metrics line that cannot be written stops the run, naming the file and the step") {
  ScratchFolder dir(kPrefix);
  std::mt19937_64 rng(3);
  std::ostringstream warnings;
  MetricsFile log(dir / "m.jsonl", {}, MetricsErrors::fail, warnings);
  log.begin(std::nullopt);
  std::string message;
  std::int64_t step = 1;
  {
    const FileSizeLimit limit(4096);
    message = test::message_of<Error>([&] {
      for (;; ++step) log.write(step, random_line(rng, step));
    });
  }
  CAPTURE(message);
  REQUIRE(message == fmt::format("--metrics '{}': cannot write the line of step {}: File too large",
                                 (dir / "m.jsonl").string(), step));
  // Only whole lines: the one cut short by the limit is gone.
  const auto text = read_file(dir / "m.jsonl");
  REQUIRE(text.back() == '\n');
  std::istringstream lines(text);
  std::int64_t n = 0;
  for (std::string line; std::getline(lines, line);) REQUIRE(json::parse(line).at("step") == ++n);
  REQUIRE(n == step - 1);
}

TEST_CASE("under warn, metrics lines that cannot be written are counted and the run goes on") {
  ScratchFolder dir(kPrefix);
  std::mt19937_64 rng(4);
  std::ostringstream warnings;
  MetricsFile log(dir / "m.jsonl", {}, MetricsErrors::warn, warnings);
  log.begin(std::nullopt);
  const std::int64_t steps = 200;  // about 20 KB of lines against the limit of 8 KiB
  {
    const FileSizeLimit limit(8192);
    for (std::int64_t step = 1; step <= steps; ++step) log.write(step, random_line(rng, step));
  }
  const auto lost = log.finish();
  // Whole lines only, in order; a shorter line may still fit after a longer one did not.
  std::istringstream lines(read_file(dir / "m.jsonl"));
  std::vector<std::int64_t> kept;
  for (std::string line; std::getline(lines, line);)
    kept.push_back(json::parse(line).at("step").get<std::int64_t>());
  REQUIRE(std::is_sorted(kept.begin(), kept.end()));
  REQUIRE(kept.size() > 1);
  REQUIRE(lost == steps - static_cast<std::int64_t>(kept.size()));
  REQUIRE(lost > 0);
  REQUIRE(log.lines_lost() == lost);
  std::int64_t first_lost = 1;
  while (first_lost <= static_cast<std::int64_t>(kept.size()) &&
         kept[static_cast<std::size_t>(first_lost - 1)] == first_lost)
    ++first_lost;
  const auto text = warnings.str();
  CAPTURE(text);
  REQUIRE(test::contains(text, fmt::format("cannot write the line of step {}", first_lost)));
  REQUIRE(test::contains(text, fmt::format("{} of {} lines lost", lost, steps)));
}

TEST_CASE("a metrics path that is a link or an input of the run is refused and left alone") {
  ScratchFolder dir(kPrefix);
  write_file(dir / "run.json", "{\"steps\": 3}");
  fs::create_symlink(dir / "run.json", dir / "link.jsonl");
  std::ostringstream warnings;
  const std::vector<InputFile> inputs = {{"the config file", dir / "run.json"}};
  REQUIRE(test::contains(test::message_of<ConfigError>([&] {
                           MetricsFile(dir / "link.jsonl", inputs, MetricsErrors::fail, warnings);
                         }),
                         "a symbolic link; refusing to replace it"));
  REQUIRE(test::contains(test::message_of<ConfigError>([&] {
                           MetricsFile(dir / "run.json", inputs, MetricsErrors::fail, warnings);
                         }),
                         "the same file as the config file"));
  REQUIRE(read_file(dir / "run.json") == "{\"steps\": 3}");
  REQUIRE(fs::is_symlink(dir / "link.jsonl"));
}
