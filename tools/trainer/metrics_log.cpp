#include "trainer/metrics_log.h"
#include "support/durable_file.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "shardswap/error.h"

namespace shardswap {

namespace fs = std::filesystem;
using nlohmann::json;

std::string metrics_line(const json& line) {
  return line.dump(-1, ' ', false, json::error_handler_t::replace) + '\n';
}

json resume_marker(const ResumePoint& point) {
  return {{"resumed", {{"step", point.step}, {"checkpoint", point.checkpoint.string()}}}};
}

void MetricsStream::begin(const std::optional<ResumePoint>& resumed) {
  if (resumed) out_ << metrics_line(resume_marker(*resumed));
}

void MetricsStream::write(std::int64_t, const json& line) {
  out_ << metrics_line(line);
}

MetricsFile::MetricsFile(fs::path path, const std::vector<InputFile>& inputs, MetricsErrors errors,
                         std::ostream& warnings)
    : path_(std::move(path)), warnings_(warnings), lines_(errors, warnings, "lines") {
  check_output_path("--metrics", path_, inputs);
  // O_NONBLOCK: should a FIFO take the file's place since the check, opening it must not hang.
  fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_APPEND | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC,
               0666);
  if (fd_ < 0)
    throw ConfigError(
        fmt::format("--metrics '{}': cannot open it: {}", path_.string(), std::strerror(errno)));
  struct stat st {};
  if (::fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd_);
    fd_ = -1;
    throw ConfigError(
        fmt::format("--metrics '{}': not a regular file; refusing to write it", path_.string()));
  }
  ::fcntl(fd_, F_SETFL, O_APPEND);  // blocking writes from here on
  lines_.attach(fd_, fmt::format("--metrics '{}'", path_.string()),
                static_cast<std::uint64_t>(st.st_size));
}

MetricsFile::~MetricsFile() {
  if (fd_ >= 0) ::close(fd_);
}

void MetricsFile::begin(const std::optional<ResumePoint>& resumed) {
  const auto cut_to = [&](std::uint64_t size) {
    if (::ftruncate(fd_, static_cast<off_t>(size)) != 0)
      throw Error(fmt::format("--metrics '{}': cannot truncate it to {} bytes: {}", path_.string(),
                              size, std::strerror(errno)));
    lines_.set_size(size);
  };
  if (!resumed) {
    cut_to(0);
    return;
  }
  struct stat st {};
  if (::fstat(fd_, &st) != 0)
    throw Error(fmt::format("--metrics '{}': {}", path_.string(), std::strerror(errno)));
  // The last complete line ends at the last '\n'; what follows it is a line a kill cut short.
  std::uint64_t end = static_cast<std::uint64_t>(st.st_size);
  const std::uint64_t size = end;
  char chunk[4096];
  bool found = end == 0;
  while (!found && end > 0) {
    const std::uint64_t n = std::min<std::uint64_t>(end, sizeof chunk);
    const ssize_t got = ::pread(fd_, chunk, n, static_cast<off_t>(end - n));
    if (got != static_cast<ssize_t>(n))
      throw Error(fmt::format("--metrics '{}': cannot read it back: {}", path_.string(),
                              got < 0 ? std::strerror(errno) : "short read"));
    for (std::uint64_t i = n; i > 0 && !found; --i) {
      if (chunk[i - 1] == '\n')
        found = true;
      else
        --end;
    }
  }
  if (end < size) {
    cut_to(end);
    warnings_ << fmt::format(
        "shardswap: --metrics '{}': removed a cut-off last line ({} bytes) left by the run that "
        "stopped\n",
        path_.string(), size - end);
  } else {
    lines_.set_size(size);
  }
  lines_.append(metrics_line(resume_marker(*resumed)),
                fmt::format("the line saying the run resumed at step {}", resumed->step));
}

void MetricsFile::write(std::int64_t step, const json& line) {
  lines_.append(metrics_line(line), fmt::format("the line of step {}", step));
}

std::int64_t MetricsFile::finish() {
  return lines_.finish();
}

void RecordAppender::attach(int fd, std::string name, std::uint64_t size) {
  fd_ = fd;
  name_ = std::move(name);
  size_ = size;
}

bool RecordAppender::append(std::string_view bytes, const std::string& what) {
  std::size_t done = 0;
  const IoStatus status = write_all(fd_, bytes.data(), bytes.size(), &done);
  // A short write left part of a record: cut it off (shrinking needs no space), so that a
  // record written later, once there is room again, starts whole. Best effort: the error
  // reported is the write's.
  if (status && done > 0) {
    const int ignored = ::ftruncate(fd_, static_cast<off_t>(size_));
    (void)ignored;
  }
  if (!status) {
    size_ += bytes.size();
    ++written_;
    return true;
  }
  const std::string message =
      fmt::format("{}: cannot write {}: {}", name_, what, status.why());
  if (errors_ == MetricsErrors::fail) throw Error(message);
  if (lost_++ == 0) {
    first_failure_ = message;
    warnings_ << fmt::format(
        "shardswap: warning: {}; the run goes on (--metrics-errors=warn), {} that cannot be "
        "written are counted\n",
        message, records_);
  }
  return false;
}

std::int64_t RecordAppender::finish() {
  if (fd_ < 0) return lost_;  // nothing was attached: nothing written
  if (::fsync(fd_) != 0) {
    const std::string message = fmt::format("{}: fsync: {}", name_, std::strerror(errno));
    if (errors_ == MetricsErrors::fail) throw Error(message);
    warnings_ << fmt::format("shardswap: warning: {}\n", message);
  }
  if (lost_ > 0)
    warnings_ << fmt::format("shardswap: warning: {}: {} of {} {} lost (the first: {})\n", name_,
                             lost_, lost_ + written_, records_, first_failure_);
  return lost_;
}

}  // namespace shardswap
