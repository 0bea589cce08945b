// The lock on a checkpoint directory and the probe for writing (shardswap/checkpoint_dir.h).
// The lock is flock(2), not fcntl(2): fcntl locks belong to the process (a second lock of the
// same process succeeds, and closing any descriptor of the file drops them), flock locks to the
// open file, so two trainers in one process exclude each other too. Paths are bytes throughout:
// a name that is not UTF-8 is never decoded, quoted as JSON or re-encoded.
#include "shardswap/checkpoint_dir.h"
#include "support/durable_file.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <sstream>
#include <system_error>
#include <thread>

namespace shardswap {

namespace fs = std::filesystem;

namespace {

std::string errno_text(int err) {
  return std::strerror(err);
}

std::string host_name() {
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) != 0) return "unknown";
  return name;
}

std::string utc_now() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  ::gmtime_r(&now, &tm);
  char text[32];
  std::strftime(text, sizeof text, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return text;
}

// "pid P\nhost H\nsince T\n": plain text, so that `cat` tells a person who holds the directory.
std::string holder_record() {
  return fmt::format("pid {}\nhost {}\nsince {}\n", ::getpid(), host_name(), utc_now());
}

CheckpointDirHolder parse_holder(const std::string& text) {
  CheckpointDirHolder h;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    const auto space = line.find(' ');
    if (space == std::string::npos) continue;
    const std::string key = line.substr(0, space), value = line.substr(space + 1);
    if (key == "pid") {
      try {
        h.pid = std::stol(value);
      } catch (const std::exception&) {
        h.pid = 0;  // not a record of ours: said as unknown
      }
    } else if (key == "host") {
      h.host = value;
    } else if (key == "since") {
      h.since = value;
    }
  }
  return h;
}

std::string read_fd(int fd) {
  std::string text;
  char buffer[512];
  for (off_t at = 0; text.size() < 4096;) {
    const ssize_t n = ::pread(fd, buffer, sizeof buffer, at);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    text.append(buffer, static_cast<std::size_t>(n));
    at += n;
  }
  return text;
}

// Opens DIR/.shardswap.lock for reading and writing, creating it. O_NOFOLLOW: a symlink planted
// there must not make us write (or truncate) the file it points to; O_NONBLOCK: a FIFO must not
// hang the open. Anything but a regular file is refused.
int open_lock_file(const fs::path& file) {
  int fd;
  do {
    fd = ::open(file.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0644);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) {
    const int err = errno;
    throw Error(fmt::format("CheckpointDirLock: cannot open the lock file '{}': {}{}",
                            file.string(), errno_text(err),
                            err == ELOOP ? " (it is a symbolic link)" : ""));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw Error(
        fmt::format("CheckpointDirLock: the lock file '{}' is not a regular file", file.string()));
  }
  return fd;
}

}  // namespace

void probe_checkpoint_dir(const fs::path& dir, const OpenCheckpointFile& open) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec)
    throw ConfigError(fmt::format("probe_checkpoint_dir: cannot create the directory '{}': {}",
                                  dir.string(), ec.message()));
  if (!fs::is_directory(dir, ec))
    throw ConfigError(fmt::format("probe_checkpoint_dir: '{}' is not a directory", dir.string()));
  // A name of its own per call: two probes (or a crashed one's leftover) never collide.
  static std::atomic<unsigned> calls{0};
  const fs::path probe = dir / fmt::format(".shardswap-probe-{}-{}", ::getpid(), calls++);
  try {
    auto file = open(probe);
    const std::string text = "shardswap probe: a file can be written and made durable here\n";
    file->write(text.data(), text.size());
    file->commit();
  } catch (const std::exception& e) {
    fs::remove(probe, ec);
    throw ConfigError(
        fmt::format("probe_checkpoint_dir: '{}' does not take files: {}", dir.string(), e.what()));
  }
  if (!fs::remove(probe, ec) || ec)
    throw ConfigError(fmt::format("probe_checkpoint_dir: '{}': cannot remove the probe '{}': {}",
                                  dir.string(), probe.string(),
                                  ec ? ec.message() : std::string("it vanished")));
  if (const IoStatus status = fsync_directory_status(dir))
    throw ConfigError(fmt::format("probe_checkpoint_dir: '{}': fsync of the directory: {}",
                                  dir.string(), status.why()));
}

CheckpointDirHolder read_checkpoint_dir_holder(const fs::path& dir) {
  const fs::path file = dir / CheckpointDirLock::kFileName;
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (fd < 0) return {};
  const std::string text = read_fd(fd);
  ::close(fd);
  return parse_holder(text);
}

CheckpointDirLock::CheckpointDirLock(const fs::path& dir) : dir_(dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec)
    throw ConfigError(fmt::format("CheckpointDirLock: cannot create the directory '{}': {}",
                                  dir.string(), ec.message()));
  const fs::path file = dir / kFileName;
  const int fd = open_lock_file(file);
  int rc;
  do {
    rc = ::flock(fd, LOCK_EX | LOCK_NB);
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) {
    const int err = errno;
    if (err != EWOULDBLOCK) {
      ::close(fd);
      throw Error(
          fmt::format("CheckpointDirLock: cannot lock '{}': {}", file.string(), errno_text(err)));
    }
    // The holder writes its record just after taking the lock: give it a moment to appear.
    std::string record = read_fd(fd);
    for (int i = 0; i < 20 && record.empty(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      record = read_fd(fd);
    }
    ::close(fd);
    CheckpointDirHolder holder = parse_holder(record);
    const std::string who = holder.pid > 0
                                ? fmt::format("pid {} on host {}{}", holder.pid,
                                              holder.host.empty() ? "(unknown)" : holder.host,
                                              holder.since.empty() ? "" : ", since " + holder.since)
                                : std::string("a holder that has not recorded itself");
    throw CheckpointDirBusy(
        fmt::format("CheckpointDirLock: the checkpoint directory '{}' is in use by another "
                    "trainer: {} (lock file '{}'); two runs on one directory would overwrite "
                    "each other's checkpoints",
                    dir.string(), who, file.string()),
        std::move(holder));
  }
  // Ours: replace whatever an earlier holder left with our record.
  const std::string record = holder_record();
  if (::ftruncate(fd, 0) != 0 ||
      ::pwrite(fd, record.data(), record.size(), 0) != static_cast<ssize_t>(record.size())) {
    const int err = errno;
    ::close(fd);  // releases the lock
    throw Error(fmt::format("CheckpointDirLock: cannot write the lock file '{}': {}", file.string(),
                            errno_text(err)));
  }
  fd_ = fd;
}

void CheckpointDirLock::release() noexcept {
  if (fd_ < 0) return;
  // Emptied while still held: after the unlock, the file may already be the next holder's.
  (void)::ftruncate(fd_, 0);
  ::close(fd_);
  fd_ = -1;
}

CheckpointDirLock::~CheckpointDirLock() {
  release();
}

CheckpointDirLock::CheckpointDirLock(CheckpointDirLock&& other) noexcept
    : dir_(std::move(other.dir_)), fd_(other.fd_) {
  other.fd_ = -1;
}

CheckpointDirLock& CheckpointDirLock::operator=(CheckpointDirLock&& other) noexcept {
  if (this != &other) {
    release();
    dir_ = std::move(other.dir_);
    fd_ = other.fd_;
    other.fd_ = -1;
  }
  return *this;
}

}  // namespace shardswap
