// DeepSpeed's `tensorboard` config section: the records of `train --metrics` (same values, same
// step numbers) also as TensorBoard event files under output_path/job_name, encoded here by hand
// (TFRecord framing around hand-written Event protobufs), so no TensorFlow or protobuf library is
// needed. docs/config.md lists the tags.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <ostream>
#include <string>
#include <string_view>
#include <vector>

#include "trainer/metrics_log.h"

namespace shardswap {

class ConfigReader;

/// Config section `tensorboard`, with DeepSpeed's keys and defaults.
struct TensorBoardConfig {
  bool enabled = false;     ///< tensorboard.enabled
  std::string output_path;  ///< tensorboard.output_path ("": the current directory)
  std::string job_name = "DeepSpeedJobName";  ///< tensorboard.job_name
  /// Where the event files go: output_path/job_name, as DeepSpeed joins them (an absolute
  /// job_name stands alone).
  std::filesystem::path log_dir() const;
};

/// Reads tensorboard.{enabled, output_path, job_name}. Any other key of the section is recorded
/// as a warning in the reader, naming the three, and counts as read. ConfigError naming the key
/// when the section is not an object or a value has the wrong type.
TensorBoardConfig tensorboard_config_from_json(ConfigReader& config);

/// The file format, one function per message, exposed for tests. Field numbers are those of
/// TensorFlow's event.proto, summary.proto and tensor.proto.
namespace tfevents {

/// Appends `value` as a protobuf base-128 varint (least significant 7 bits first).
void put_varint(std::string& out, std::uint64_t value);
/// One TFRecord: the length as uint64 little-endian, its masked CRC-32C, `data`, the data's
/// masked CRC-32C (tools/trainer/crc32c.h).
std::string record(std::string_view data);

struct Scalar {
  std::string tag;
  float value;  ///< Summary.Value.simple_value is a float: TensorBoard keeps float32
};
/// A string for TensorBoard's text plugin (rendered as Markdown).
struct Text {
  std::string tag;
  std::string text;
};

/// Event{wall_time, file_version = "brain.Event:2"}: the first event of every file.
std::string file_version_event(double wall_time);
/// Event{wall_time, step, summary} with one Summary.Value per scalar (simple_value) and per text
/// (a DT_STRING scalar tensor whose metadata names the plugin "text").
std::string summary_event(double wall_time, std::int64_t step, const std::vector<Scalar>& scalars,
                          const std::vector<Text>& texts);
/// Event{wall_time, step, session_log{START, checkpoint_path}}: on reading it TensorBoard drops
/// the events it holds at `step` or later (those a stopped run wrote past its resume point).
std::string session_start_event(double wall_time, std::int64_t step, std::string_view checkpoint);

}  // namespace tfevents

/// What TensorBoard is given of one metrics line. Every number of the line (except "step") is a
/// scalar tagged by its key path joined with '/' ("loss", "memory_bytes/grad",
/// "switch/bytes_freed"); true and false are 1 and 0; null (a non-finite grad_norm) is left out.
/// A list of strings is a text, its items as code spans joined by ", " ("switch/in"); the line's
/// "active_groups" is left out unless `with_active_groups` (the trainer's writer gives it on its
/// first step and at each switch, not on every step).
struct TensorBoardValues {
  std::vector<tfevents::Scalar> scalars;
  std::vector<tfevents::Text> texts;
};
TensorBoardValues tensorboard_values(const nlohmann::json& line, bool with_active_groups);

/// The event file of a run: one Event record per metrics line, each one write(2) on a file
/// opened O_APPEND, so a step's events are in the kernel (and survive a kill) as soon as write()
/// returns; a failed or short write is cut back off, so the file holds whole records only. A
/// failed write does what --metrics-errors says, as for the metrics file.
class TensorBoardLog final : public MetricsLog {
 public:
  /// Checks that `log_dir` is a directory or can be made one (what stands in the way is not a
  /// directory: ConfigError naming the tensorboard keys) and creates nothing: ranks other than
  /// 0, which never call begin(), and a run that fails before its first step write nothing.
  TensorBoardLog(std::filesystem::path log_dir, MetricsErrors errors, std::ostream& warnings);
  ~TensorBoardLog() override;
  TensorBoardLog(const TensorBoardLog&) = delete;
  TensorBoardLog& operator=(const TensorBoardLog&) = delete;

  /// Makes log_dir and a new file events.out.tfevents.<unix time>.<host>.<pid> in it (never one
  /// that exists: a resumed run adds a file beside the earlier ones, which TensorBoard reads in
  /// name order), and writes the file_version event; a resume then writes a SessionLog START at
  /// the step after the checkpoint's, so that TensorBoard shows the earlier run's events up to
  /// the checkpoint and this run's after it. Error naming the directory or file when they cannot
  /// be made.
  void begin(const std::optional<ResumePoint>& resumed) override;
  void write(std::int64_t step, const nlohmann::json& line) override;
  /// At the end of the run: fsyncs the file; under MetricsErrors::warn prints how many records
  /// (one per step, and the file's first one or two) were lost, if any. Returns that count.
  std::int64_t finish();

  const std::filesystem::path& log_dir() const { return log_dir_; }
  /// The event file ("" before begin()).
  const std::filesystem::path& file() const { return file_; }
  std::int64_t records_written() const { return records_.written(); }
  std::int64_t records_lost() const { return records_.lost(); }

 private:
  std::filesystem::path log_dir_, file_;
  int fd_ = -1;
  RecordAppender records_;
  bool groups_written_ = false;  // active_groups has been given once
};

}  // namespace shardswap
