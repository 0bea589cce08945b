#include "trainer/tensorboard.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <system_error>

#include "shardswap/config_reader.h"
#include "shardswap/error.h"
#include "trainer/crc32c.h"

namespace shardswap {

namespace fs = std::filesystem;
using nlohmann::json;

fs::path TensorBoardConfig::log_dir() const {
  return fs::path(output_path) / job_name;
}

TensorBoardConfig tensorboard_config_from_json(ConfigReader& c) {
  TensorBoardConfig t;
  if (!c.has("tensorboard")) return t;
  c.expect_object("tensorboard");
  t.enabled = c.boolean("tensorboard.enabled", t.enabled);
  t.output_path = c.string("tensorboard.output_path", t.output_path);
  t.job_name = c.string("tensorboard.job_name", t.job_name);
  // DeepSpeed's section has these three keys only. Another is most likely a misspelt one: say
  // so here, by name, rather than leave it to the list of DeepSpeed settings not implemented.
  for (const auto& [key, value] : c.json().at("tensorboard").items()) {
    if (key == "enabled" || key == "output_path" || key == "job_name") continue;
    const std::string path = "tensorboard." + key;
    c.warn(path, "not a key of the tensorboard section (enabled, output_path, job_name); ignored");
    c.mark_read(path);
  }
  return t;
}

namespace tfevents {

namespace {

// Protobuf wire types.
constexpr std::uint32_t kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5;

void put_key(std::string& out, std::uint32_t field, std::uint32_t wire_type) {
  put_varint(out, (field << 3) | wire_type);
}

template <class Unsigned>
void put_little_endian(std::string& out, Unsigned value) {
  for (std::size_t i = 0; i < sizeof value; ++i)
    out.push_back(static_cast<char>((value >> (8 * i)) & 0xFFu));
}

void put_varint_field(std::string& out, std::uint32_t field, std::uint64_t value) {
  put_key(out, field, kVarint);
  put_varint(out, value);
}

void put_double_field(std::string& out, std::uint32_t field, double value) {
  put_key(out, field, kFixed64);
  put_little_endian(out, std::bit_cast<std::uint64_t>(value));
}

void put_float_field(std::string& out, std::uint32_t field, float value) {
  put_key(out, field, kFixed32);
  put_little_endian(out, std::bit_cast<std::uint32_t>(value));
}

// Strings, bytes and embedded messages alike.
void put_bytes_field(std::string& out, std::uint32_t field, std::string_view bytes) {
  put_key(out, field, kLengthDelimited);
  put_varint(out, bytes.size());
  out.append(bytes);
}

// Field numbers (event.proto, summary.proto, tensor.proto, tensor_shape.proto).
namespace event {
constexpr std::uint32_t wall_time = 1, step = 2, file_version = 3, summary = 5, session_log = 7;
}
namespace session_log {
constexpr std::uint32_t status = 1, checkpoint_path = 2;
constexpr std::uint64_t start = 1;  // SessionLog.SessionStatus.START
}  // namespace session_log
namespace summary {
constexpr std::uint32_t value = 1;
}
namespace value {
constexpr std::uint32_t tag = 1, simple_value = 2, tensor = 8, metadata = 9;
}
namespace metadata {
constexpr std::uint32_t plugin_data = 1;
}
namespace plugin_data {
constexpr std::uint32_t plugin_name = 1;
}
namespace tensor {
constexpr std::uint32_t dtype = 1, tensor_shape = 2, string_val = 8;
constexpr std::uint64_t dt_string = 7;  // types.proto DataType.DT_STRING
}  // namespace tensor

std::string event_head(double wall_time, std::int64_t step) {
  std::string e;
  put_double_field(e, event::wall_time, wall_time);
  put_varint_field(e, event::step, static_cast<std::uint64_t>(step));  // int64: two's complement
  return e;
}

std::string text_value(const Text& text) {
  std::string tensor;
  put_varint_field(tensor, tensor::dtype, tensor::dt_string);
  put_bytes_field(tensor, tensor::tensor_shape, "");  // no dimensions: a scalar
  put_bytes_field(tensor, tensor::string_val, text.text);
  std::string plugin;
  put_bytes_field(plugin, plugin_data::plugin_name, "text");  // content: TextPluginData v0, empty
  std::string meta;
  put_bytes_field(meta, metadata::plugin_data, plugin);
  std::string v;
  put_bytes_field(v, value::tag, text.tag);
  put_bytes_field(v, value::tensor, tensor);
  put_bytes_field(v, value::metadata, meta);
  return v;
}

}  // namespace

void put_varint(std::string& out, std::uint64_t value) {
  while (value >= 0x80) {
    out.push_back(static_cast<char>((value & 0x7F) | 0x80));
    value >>= 7;
  }
  out.push_back(static_cast<char>(value));
}

std::string record(std::string_view data) {
  std::string length;
  put_little_endian(length, static_cast<std::uint64_t>(data.size()));
  std::string out = length;
  put_little_endian(out, masked_crc32c(length));
  out.append(data);
  put_little_endian(out, masked_crc32c(data));
  return out;
}

std::string file_version_event(double wall_time) {
  std::string e;
  put_double_field(e, event::wall_time, wall_time);
  put_bytes_field(e, event::file_version, "brain.Event:2");
  return e;
}

std::string summary_event(double wall_time, std::int64_t step, const std::vector<Scalar>& scalars,
                          const std::vector<Text>& texts) {
  std::string s;
  for (const auto& scalar : scalars) {
    std::string v;
    put_bytes_field(v, value::tag, scalar.tag);
    put_float_field(v, value::simple_value, scalar.value);
    put_bytes_field(s, summary::value, v);
  }
  for (const auto& text : texts) put_bytes_field(s, summary::value, text_value(text));
  std::string e = event_head(wall_time, step);
  put_bytes_field(e, event::summary, s);
  return e;
}

std::string session_start_event(double wall_time, std::int64_t step, std::string_view checkpoint) {
  std::string log;
  put_varint_field(log, session_log::status, session_log::start);
  put_bytes_field(log, session_log::checkpoint_path, checkpoint);
  std::string e = event_head(wall_time, step);
  put_bytes_field(e, event::session_log, log);
  return e;
}

}  // namespace tfevents

namespace {

bool is_string_list(const json& node) {
  if (!node.is_array()) return false;
  for (const auto& item : node)
    if (!item.is_string()) return false;
  return true;
}

// Group names such as lm_head would turn into emphasis in the text plugin's Markdown: each item
// is a code span.
std::string code_spans(const json& items) {
  if (items.empty()) return "(none)";
  std::string out;
  for (const auto& item : items) {
    if (!out.empty()) out += ", ";
    out += "`" + item.get<std::string>() + "`";
  }
  return out;
}

void collect(const json& node, const std::string& tag, TensorBoardValues& out) {
  if (node.is_object()) {
    for (const auto& [key, child] : node.items())
      collect(child, tag.empty() ? key : tag + "/" + key, out);
  } else if (node.is_boolean()) {
    out.scalars.push_back({tag, node.get<bool>() ? 1.0f : 0.0f});
  } else if (node.is_number()) {
    out.scalars.push_back({tag, static_cast<float>(node.get<double>())});
  } else if (node.is_string()) {
    out.texts.push_back({tag, node.get<std::string>()});
  } else if (is_string_list(node)) {
    out.texts.push_back({tag, code_spans(node)});
  }
  // null (a number JSON cannot hold) and lists of anything else: nothing to show.
}

double unix_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string host_name() {
  std::array<char, 256> name{};
  if (::gethostname(name.data(), name.size() - 1) != 0 || name[0] == '\0') return "localhost";
  return name.data();
}

// The nearest of `dir` and its parents that exists; empty if none does (a relative path whose
// first component is missing: the current directory takes it).
fs::path nearest_existing(const fs::path& dir) {
  std::error_code ec;
  for (fs::path p = dir; !p.empty(); p = p.parent_path()) {
    if (fs::exists(fs::symlink_status(p, ec))) return p;
    if (p == p.parent_path()) break;
  }
  return {};
}

}  // namespace

TensorBoardValues tensorboard_values(const json& line, bool with_active_groups) {
  TensorBoardValues out;
  for (const auto& [key, node] : line.items()) {
    if (key == "step") continue;  // the event's step
    if (key == "active_groups" && !with_active_groups) continue;
    collect(node, key, out);
  }
  return out;
}

TensorBoardLog::TensorBoardLog(fs::path log_dir, MetricsErrors errors, std::ostream& warnings)
    : log_dir_(std::move(log_dir)), records_(errors, warnings, "records") {
  const fs::path existing = nearest_existing(log_dir_);
  std::error_code ec;
  if (!existing.empty() && !fs::is_directory(fs::status(existing, ec)))
    throw ConfigError(fmt::format(
        "tensorboard.output_path / tensorboard.job_name: the event files go in '{}', but '{}' "
        "is not a directory",
        log_dir_.string(), existing.string()));
}

TensorBoardLog::~TensorBoardLog() {
  if (fd_ >= 0) ::close(fd_);
}

void TensorBoardLog::begin(const std::optional<ResumePoint>& resumed) {
  std::error_code ec;
  fs::create_directories(log_dir_, ec);
  if (ec)
    throw Error(fmt::format("tensorboard: cannot create the directory '{}' for the event files: {}",
                            log_dir_.string(), ec.message()));
  // TensorBoard reads a directory's event files in name order, which the time keeps; the pid
  // tells apart two runs started in the same second, a counter whatever else clashes.
  const std::string base =
      fmt::format("events.out.tfevents.{}.{}.{}", static_cast<std::int64_t>(std::time(nullptr)),
                  host_name(), ::getpid());
  for (int n = 0; fd_ < 0; ++n) {
    file_ = log_dir_ / (n == 0 ? base : fmt::format("{}.{}", base, n));
    fd_ = ::open(file_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_APPEND | O_NOFOLLOW | O_CLOEXEC,
                 0666);
    if (fd_ < 0 && (errno != EEXIST || n == 99))
      throw Error(fmt::format("tensorboard: cannot create the event file '{}': {}", file_.string(),
                              std::strerror(errno)));
  }
  records_.attach(fd_, fmt::format("tensorboard event file '{}'", file_.string()), 0);
  records_.append(tfevents::record(tfevents::file_version_event(unix_seconds())),
                  "the file's version event");
  if (resumed) {
    // TensorBoard keeps what it holds before a START's step and drops the rest: the START goes
    // at the first step this run writes, after the checkpoint's.
    const auto start = tfevents::session_start_event(unix_seconds(), resumed->step + 1,
                                                     resumed->checkpoint.string());
    records_.append(tfevents::record(start),
                    fmt::format("the event saying the run resumed at step {}", resumed->step));
  }
}

void TensorBoardLog::write(std::int64_t step, const json& line) {
  if (fd_ < 0) throw Error("TensorBoardLog::write: begin() was not called");
  // The groups in training: at this process's first step and wherever a switch changed them.
  const bool with_groups = !groups_written_ || line.contains("switch");
  const TensorBoardValues values = tensorboard_values(line, with_groups);
  const auto event = tfevents::summary_event(unix_seconds(), step, values.scalars, values.texts);
  if (records_.append(tfevents::record(event), fmt::format("the events of step {}", step)) &&
      line.contains("active_groups"))
    groups_written_ = true;
}

std::int64_t TensorBoardLog::finish() {
  return records_.finish();  // begin() never came: nothing attached, nothing written
}

}  // namespace shardswap
