// `train --metrics`: one JSON line per step, each written whole with one write(2) and checked, so
// that a killed run loses no line it finished and a full disk is never silent; a resumed run
// appends to the file after a line saying where it resumed.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <ostream>
#include <string>
#include <string_view>
#include <vector>

#include "files/output_file.h"

namespace shardswap {

/// Where a run resumed: the step its checkpoint was saved at, and the checkpoint.
struct ResumePoint {
  std::int64_t step = 0;
  std::filesystem::path checkpoint;
};

/// One metrics line: compact JSON and '\n'. Bytes that are not UTF-8 in a string (a path) become
/// U+FFFD instead of making the dump throw.
std::string metrics_line(const nlohmann::json& line);
/// The first line of a resumed run: {"resumed": {"step": N, "checkpoint": "PATH"}}. It has no
/// "step" key: readers tell it from a step's line by its "resumed" key.
nlohmann::json resume_marker(const ResumePoint& point);

/// Where the trainer's metrics go. The trainer calls begin() once, before the first step line,
/// then write() once per step.
class MetricsLog {
 public:
  virtual ~MetricsLog() = default;
  /// nullopt: a fresh run; the log starts empty. A resume point: the log keeps what it holds
  /// and gets resume_marker(point).
  virtual void begin(const std::optional<ResumePoint>& resumed) = 0;
  /// The line of `step` (its "step" key).
  virtual void write(std::int64_t step, const nlohmann::json& line) = 0;
};

/// Lines into a stream (in memory: tests, programs that keep the metrics themselves). A stream
/// holds nothing from before, so begin() only writes the marker of a resume.
class MetricsStream final : public MetricsLog {
 public:
  explicit MetricsStream(std::ostream& out) : out_(out) {}
  void begin(const std::optional<ResumePoint>& resumed) override;
  void write(std::int64_t step, const nlohmann::json& line) override;

 private:
  std::ostream& out_;
};

/// What a failed write of a metrics line does (--metrics-errors).
enum class MetricsErrors {
  fail,  ///< throws Error naming the file and the step: the run stops (exit 1)
  warn,  ///< a warning at the first failure, the run goes on; finish() says how many were lost
};

/// A file written by appending whole records (the metrics file's lines, TensorBoard's event
/// records). Each record is one write(2) on a descriptor opened O_APPEND, so it is in the kernel
/// (and survives a kill of the process) as soon as write() returns; a failed or short write is
/// cut back off, so the file only ever holds whole records, and is then what `errors` says.
class RecordAppender {
 public:
  /// `records` names what is written in messages ("lines", "records").
  RecordAppender(MetricsErrors errors, std::ostream& warnings, const char* records)
      : errors_(errors), warnings_(warnings), records_(records) {}
  /// The file to append to: its descriptor (the caller's, who closes it), its name as messages
  /// begin ("--metrics 'm.jsonl'") and the bytes of whole records it holds.
  void attach(int fd, std::string name, std::uint64_t size);
  /// After the caller cut the file to `size` bytes of whole records.
  void set_size(std::uint64_t size) { size_ = size; }
  /// Appends `bytes` whole and returns true; on failure cuts the file back and, under fail,
  /// throws Error "NAME: cannot write WHAT: why", under warn warns at the first failure,
  /// counts it and returns false.
  bool append(std::string_view bytes, const std::string& what);
  /// At the end of the run: fsyncs the file (if one was attached); under warn prints how many
  /// records were lost, if any. Returns that count.
  std::int64_t finish();
  std::int64_t written() const { return written_; }
  std::int64_t lost() const { return lost_; }

 private:
  MetricsErrors errors_;
  std::ostream& warnings_;
  const char* records_;
  int fd_ = -1;
  std::string name_;
  std::uint64_t size_ = 0;  // bytes of whole records in the file
  std::int64_t written_ = 0, lost_ = 0;
  std::string first_failure_;
};

/// The --metrics file: one line a record of a RecordAppender.
class MetricsFile final : public MetricsLog {
 public:
  /// Checks `path` (check_output_path with `inputs`: absent or a regular file, no checkpoint's,
  /// no input of the run) and opens it, creating it, without changing what it holds: a run that
  /// fails before begin() leaves an existing file as it was. ConfigError when refused.
  /// Warnings go to `warnings`.
  MetricsFile(std::filesystem::path path, const std::vector<InputFile>& inputs,
              MetricsErrors errors, std::ostream& warnings);
  ~MetricsFile() override;
  MetricsFile(const MetricsFile&) = delete;
  MetricsFile& operator=(const MetricsFile&) = delete;

  /// Fresh: truncates the file. Resumed: cuts a partial last line (no '\n': a write cut by a
  /// kill) back to the last complete line, then writes the marker.
  void begin(const std::optional<ResumePoint>& resumed) override;
  void write(std::int64_t step, const nlohmann::json& line) override;
  /// At the end of the run: fsyncs the file; under MetricsErrors::warn prints how many lines
  /// were lost, if any. Returns that count.
  std::int64_t finish();

  std::int64_t lines_written() const { return lines_.written(); }
  std::int64_t lines_lost() const { return lines_.lost(); }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
  std::ostream& warnings_;
  int fd_ = -1;
  RecordAppender lines_;
};

}  // namespace shardswap
