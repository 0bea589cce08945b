// DeepSpeed's tensorboard section (tools/trainer/tensorboard.h): CRC-32C against the standard check
// values, the protobuf and TFRecord bytes against ones worked out by hand (and equal to what
// TensorBoard's own protobuf classes serialize), the metrics line's mapping to tags, and the
// event file as the trainer writes it: whole records, on disk per step, a resume in a new file,
// write errors under --metrics-errors' two policies.
#include <fmt/format.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "shardswap/config_json.h"
#include "shardswap/config_reader.h"
#include "shardswap/error.h"
#include "tests/catch_compat.h"
#include "tests/support/file_size_limit.h"
#include "tests/support/scratch_folder.h"
#include "trainer/crc32c.h"
#include "trainer/tensorboard.h"

using namespace shardswap;
using nlohmann::json;
using test_support::FileSizeLimit;
using test_support::ScratchFolder;
namespace fs = std::filesystem;

namespace {

const std::string kPrefix = "shardswap-tensorboard-test";

// Bytes from space-separated hex: "0a 04".
std::string bytes(const std::string& hex) {
  std::string out;
  std::istringstream in(hex);
  for (std::string byte; in >> byte;)
    out.push_back(static_cast<char>(std::stoul(byte, nullptr, 16)));
  return out;
}

std::string varint(std::uint64_t v) {
  std::string out;
  tfevents::put_varint(out, v);
  return out;
}

std::string read_file(const fs::path& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

std::uint64_t little_endian(const std::string& s, std::size_t at, std::size_t n) {
  std::uint64_t v = 0;
  for (std::size_t i = 0; i < n; ++i)
    v |= static_cast<std::uint64_t>(static_cast<unsigned char>(s[at + i])) << (8 * i);
  return v;
}

// The events of a file, each record's CRCs checked; the whole file must be whole records.
std::vector<std::string> read_records(const fs::path& path) {
  const std::string file = read_file(path);
  std::vector<std::string> events;
  std::size_t at = 0;
  while (at < file.size()) {
    REQUIRE(file.size() - at >= 12);
    const std::uint64_t n = little_endian(file, at, 8);
    REQUIRE(little_endian(file, at + 8, 4) == masked_crc32c(file.substr(at, 8)));
    REQUIRE(file.size() - at >= 16 + n);
    const std::string data = file.substr(at + 12, n);
    REQUIRE(little_endian(file, at + 12 + n, 4) == masked_crc32c(data));
    events.push_back(data);
    at += 16 + n;
  }
  return events;
}

// An event without its wall time (field 1, a double: its first 9 bytes), which the writer takes
// from the clock.
std::string without_time(const std::string& event) {
  REQUIRE(event.size() >= 9);
  REQUIRE(event[0] == '\x09');
  return event.substr(9);
}

fs::path only_event_file(const fs::path& dir) {
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir)) files.push_back(e.path());
  REQUIRE(files.size() == 1);
  return files[0];
}

json line_of(std::int64_t step) {
  return {{"step", step},
          {"loss", 5.0 - 0.25 * static_cast<double>(step)},
          {"lr", 1e-3},
          {"skipped", false},
          {"memory_bytes", {{"grad", 1024 * step}}},
          {"active_groups", {"embed", "layers.0"}}};
}

}  // namespace

TEST_CASE("crc32c gives the standard check values", "[tensorboard]") {
  REQUIRE(crc32c("123456789") == 0xE3069283u);
  REQUIRE(crc32c("") == 0u);
  // RFC 3720, B.4: 32 bytes of zeros, of ones, ascending, descending.
  std::string ascending, descending;
  for (int i = 0; i < 32; ++i) {
    ascending.push_back(static_cast<char>(i));
    descending.push_back(static_cast<char>(31 - i));
  }
  REQUIRE(crc32c(std::string(32, '\0')) == 0x8A9136AAu);
  REQUIRE(crc32c(std::string(32, '\xff')) == 0x62A8AB43u);
  REQUIRE(crc32c(ascending) == 0x46DD794Eu);
  REQUIRE(crc32c(descending) == 0x113FDB5Cu);
}

TEST_CASE("the masked crc32c is the crc rotated right by 15 bits plus 0xa282ead8",
          "[tensorboard]") {
  REQUIRE(masked_crc32c("") == 0xa282ead8u);  // crc 0
  // 0xE3069283 rotated right by 15: 0x25078C0D; plus 0xa282ead8: 0xC78AB0E5 (mod 2^32).
  REQUIRE(masked_crc32c("123456789") == 0xC78AB0E5u);
}

TEST_CASE("a varint is seven bits a byte, least significant first, the high bit saying more",
          "[tensorboard]") {
  REQUIRE(varint(0) == bytes("00"));
  REQUIRE(varint(1) == bytes("01"));
  REQUIRE(varint(127) == bytes("7f"));
  REQUIRE(varint(128) == bytes("80 01"));
  REQUIRE(varint(300) == bytes("ac 02"));
  REQUIRE(varint(std::uint64_t{1} << 32) == bytes("80 80 80 80 10"));
  REQUIRE(varint(std::numeric_limits<std::uint64_t>::max()) ==
          bytes("ff ff ff ff ff ff ff ff ff 01"));
}

TEST_CASE("a record is the length, its masked crc, the data and the data's masked crc",
          "[tensorboard]") {
  // Empty: eight zero bytes of length, masked crc32c of them, no data, masked crc32c of "".
  REQUIRE(tfevents::record("") == bytes("00 00 00 00 00 00 00 00 29 03 98 07 d8 ea 82 a2"));
  REQUIRE(tfevents::record("abc") ==
          bytes("03 00 00 00 00 00 00 00 b0 99 49 0e 61 62 63 6e 57 f1 21"));
}

TEST_CASE("the first event of a file holds the wall time and the file version brain.Event:2",
          "[tensorboard]") {
  // field 1 (double, wire type 1): 09, 1.5 little-endian; field 3 (string): 1a, 13 bytes.
  REQUIRE(tfevents::file_version_event(1.5) ==
          bytes("09 00 00 00 00 00 00 f8 3f 1a 0d") + "brain.Event:2");
}

TEST_CASE("a scalar is a Summary.Value of the tag and a float simple_value in field 5",
          "[tensorboard]") {
  // wall_time 1.5; step (field 2, varint) 7; summary (field 5): 13 bytes holding one value
  // (field 1): 11 bytes, the tag (field 1) "loss" and simple_value (field 2, fixed32) 2.5f.
  REQUIRE(tfevents::summary_event(1.5, 7, {{"loss", 2.5f}}, {}) ==
          bytes("09 00 00 00 00 00 00 f8 3f 10 07 2a 0d 0a 0b 0a 04") + "loss" +
              bytes("15 00 00 20 40"));
}

TEST_CASE("a text is a DT_STRING scalar tensor whose metadata names the text plugin",
          "[tensorboard]") {
  // Value: tag "g"; tensor (field 8): dtype (1) DT_STRING = 7, an empty tensor_shape (2),
  // string_val (8) "`a`"; metadata (field 9): plugin_data (1) with plugin_name (1) "text".
  REQUIRE(tfevents::summary_event(2.0, 300, {}, {{"g", "`a`"}}) ==
          bytes("09 00 00 00 00 00 00 00 40 10 ac 02 2a 1a 0a 18 0a 01 67 42 09 08 07 12 00 42 03 "
                "60 61 60 4a 08 0a 06 0a 04 74 65 78 74"));
}

TEST_CASE("a resume is a SessionLog START at its step naming the checkpoint", "[tensorboard]") {
  // session_log (field 7): status (1) START = 1, checkpoint_path (2) "ck".
  REQUIRE(tfevents::session_start_event(2.0, 10, "ck") ==
          bytes("09 00 00 00 00 00 00 00 40 10 0a 3a 06 08 01 12 02 63 6b"));
}

TEST_CASE("a metrics line's numbers become scalars tagged by key path, true and false 1 and 0",
          "[tensorboard]") {
  const json line = {{"step", 4},
                     {"loss", 2.75},
                     {"grad_norm", nullptr},  // a non-finite norm: nothing to show
                     {"skipped", true},
                     {"memory_bytes", {{"grad", 4096}, {"total", 8192}}},
                     {"switch", {{"in", {"layers.1"}}, {"out", json::array()}, {"seconds", 0.5}}},
                     {"active_groups", {"embed", "lm_head"}}};
  const auto without = tensorboard_values(line, false);
  std::vector<std::pair<std::string, float>> scalars;
  for (const auto& s : without.scalars) scalars.emplace_back(s.tag, s.value);
  REQUIRE(scalars == std::vector<std::pair<std::string, float>>{{"loss", 2.75f},
                                                                {"memory_bytes/grad", 4096.0f},
                                                                {"memory_bytes/total", 8192.0f},
                                                                {"skipped", 1.0f},
                                                                {"switch/seconds", 0.5f}});
  std::vector<std::pair<std::string, std::string>> texts;
  for (const auto& t : without.texts) texts.emplace_back(t.tag, t.text);
  REQUIRE(texts == std::vector<std::pair<std::string, std::string>>{{"switch/in", "`layers.1`"},
                                                                    {"switch/out", "(none)"}});
  const auto with = tensorboard_values(line, true);
  REQUIRE(with.scalars.size() == without.scalars.size());
  REQUIRE(with.texts.size() == 3);
  REQUIRE(with.texts[0].tag == "active_groups");
  REQUIRE(with.texts[0].text == "`embed`, `lm_head`");  // code spans: no Markdown emphasis
}

TEST_CASE("the event file is made at begin, and each step's record is on disk when write returns",
          "[tensorboard]") {
  ScratchFolder dir(kPrefix);
  std::ostringstream warnings;
  const fs::path log_dir = dir / "runs" / "job";
  TensorBoardLog log(log_dir, MetricsErrors::fail, warnings);
  REQUIRE(!fs::exists(dir / "runs"));  // nothing before the run begins
  log.begin(std::nullopt);
  const fs::path file = only_event_file(log_dir);
  REQUIRE(file == log.file());
  REQUIRE(file.filename().string().rfind("events.out.tfevents.", 0) == 0);
  REQUIRE(file.filename().string().ends_with(fmt::format(".{}", ::getpid())));
  for (std::int64_t step = 1; step <= 5; ++step) {
    log.write(step, line_of(step));
    const auto events = read_records(file);
    REQUIRE(events.size() == static_cast<std::size_t>(step) + 1);
    // The groups come with the first step only (no switch in these lines).
    const auto values = tensorboard_values(line_of(step), step == 1);
    REQUIRE(without_time(events.back()) ==
            without_time(tfevents::summary_event(0.0, step, values.scalars, values.texts)));
  }
  REQUIRE(without_time(read_records(file).front()) ==
          without_time(tfevents::file_version_event(0.0)));
  REQUIRE(log.finish() == 0);
  REQUIRE(log.records_written() == 6);
  REQUIRE(warnings.str().empty());
}

TEST_CASE("a resumed run writes a new event file with a SessionLog START after its checkpoint",
          "[tensorboard]") {
  ScratchFolder dir(kPrefix);
  std::ostringstream warnings;
  fs::create_directories(dir / "job");
  std::ofstream(dir / "job" / "events.out.tfevents.1.earlier") << "a stopped run's";
  TensorBoardLog log(dir / "job", MetricsErrors::fail, warnings);
  const ResumePoint at{10, dir / "ck" / "step-00000010"};
  log.begin(at);
  log.write(11, line_of(11));
  REQUIRE(read_file(dir / "job" / "events.out.tfevents.1.earlier") == "a stopped run's");
  const auto events = read_records(log.file());
  REQUIRE(events.size() == 3);
  REQUIRE(without_time(events[1]) ==
          without_time(tfevents::session_start_event(0.0, 11, at.checkpoint.string())));
}

TEST_CASE("an event that cannot be written stops the run, naming the file and the step",
          "[tensorboard]") {
  ScratchFolder dir(kPrefix);
  std::ostringstream warnings;
  TensorBoardLog log(dir / "job", MetricsErrors::fail, warnings);
  log.begin(std::nullopt);
  std::string message;
  std::int64_t step = 1;
  {
    const FileSizeLimit limit(4096);
    message = test::message_of<Error>([&] {
      for (;; ++step) log.write(step, line_of(step));
    });
  }
  CAPTURE(message);
  REQUIRE(message ==
          fmt::format("tensorboard event file '{}': cannot write the events of step {}: File too "
                      "large",
                      log.file().string(), step));
  // Whole records only: the one cut short by the limit is gone.
  REQUIRE(read_records(log.file()).size() == static_cast<std::size_t>(step));
}

TEST_CASE("under warn, events that cannot be written are counted and the run goes on",
          "[tensorboard]") {
  ScratchFolder dir(kPrefix);
  std::ostringstream warnings;
  TensorBoardLog log(dir / "job", MetricsErrors::warn, warnings);
  log.begin(std::nullopt);
  const std::int64_t steps = 100;
  {
    const FileSizeLimit limit(4096);
    for (std::int64_t step = 1; step <= steps; ++step) log.write(step, line_of(step));
  }
  const auto lost = log.finish();
  const auto kept = read_records(log.file()).size();
  REQUIRE(lost > 0);
  REQUIRE(static_cast<std::int64_t>(kept) == steps + 1 - lost);
  REQUIRE(log.records_lost() == lost);
  const auto text = warnings.str();
  CAPTURE(text);
  REQUIRE(test::contains(text, fmt::format("cannot write the events of step {}", kept)));
  REQUIRE(test::contains(text, fmt::format("{} of {} records lost", lost, steps + 1)));
}

TEST_CASE("an event directory that a file stands in the way of is refused naming the keys",
          "[tensorboard]") {
  ScratchFolder dir(kPrefix);
  std::ofstream(dir / "runs") << "not a directory";
  std::ostringstream warnings;
  const auto m = test::message_of<ConfigError>(
      [&] { TensorBoardLog(dir / "runs" / "job", MetricsErrors::fail, warnings); });
  CAPTURE(m);
  REQUIRE(test::contains(m, "tensorboard.output_path / tensorboard.job_name"));
  REQUIRE(test::contains(m, fmt::format("'{}' is not a directory", (dir / "runs").string())));
}

TEST_CASE("the tensorboard section reads DeepSpeed's keys and defaults and warns of others",
          "[tensorboard]") {
  auto none = ConfigReader::from_text("{}", "a.json");
  const auto off = tensorboard_config_from_json(none);
  REQUIRE(!off.enabled);
  REQUIRE(off.log_dir() == fs::path("DeepSpeedJobName"));  // DeepSpeed's: output_path "" + job

  auto reader = ConfigReader::from_text(
      R"({"tensorboard": {"enabled": true, "output_path": "out/logs/", "job_name": "run1",
          "enable": false}})",
      "b.json");
  const auto t = tensorboard_config_from_json(reader);
  REQUIRE(t.enabled);
  REQUIRE(t.log_dir() == fs::path("out/logs/run1"));
  // The misspelt key is the one warning: the section itself is not reported as not implemented.
  const auto warnings = config_warnings(reader);
  CAPTURE(warnings);
  REQUIRE(warnings.size() == 1);
  REQUIRE(test::contains(warnings[0],
                         "b.json: tensorboard.enable: not a key of the tensorboard "
                         "section (enabled, output_path, job_name); ignored"));
}

TEST_CASE("a tensorboard section that is not an object, or holds a wrong type, is refused",
          "[tensorboard]") {
  auto list = ConfigReader::from_text(R"({"tensorboard": [true]})", "c.json");
  REQUIRE(test::contains(test::message_of<ConfigError>([&] { tensorboard_config_from_json(list); }),
                         "tensorboard"));
  auto typed = ConfigReader::from_text(R"({"tensorboard": {"enabled": "yes"}})", "d.json");
  REQUIRE(
      test::contains(test::message_of<ConfigError>([&] { tensorboard_config_from_json(typed); }),
                     "tensorboard.enabled"));
}
