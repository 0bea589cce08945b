// The durable writes of support/durable_file.h, over POSIX calls.
#include "support/durable_file.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "shardswap/error.h"

namespace shardswap {

namespace fs = std::filesystem;

std::string IoStatus::why() const {
  return std::strerror(error);
}

IoStatus write_all(int fd, const void* data, std::size_t bytes, std::size_t* written) noexcept {
  const auto* p = static_cast<const char*>(data);
  std::size_t done = 0;
  IoStatus status;
  while (done < bytes) {
    const ssize_t n = ::write(fd, p + done, bytes - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      status = {"write", n < 0 ? errno : EIO};
      break;
    }
    done += static_cast<std::size_t>(n);
  }
  if (written != nullptr) *written = done;
  return status;
}

IoStatus fsync_path(const fs::path& path, int open_flags) noexcept {
  const int fd = ::open(path.c_str(), open_flags | O_CLOEXEC);
  if (fd < 0) return {"open", errno};
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);  // read-only: nothing left for close to report
  return rc != 0 ? IoStatus{"fsync", err} : IoStatus{};
}

IoStatus fsync_directory_status(const fs::path& dir) noexcept {
  return fsync_path(dir, O_RDONLY | O_DIRECTORY);
}

void fsync_directory(const fs::path& dir) {
  if (const IoStatus status = fsync_directory_status(dir))
    throw Error(fmt::format("fsync of directory '{}': {}", dir.string(), status.why()));
}

fs::path parent_directory(const fs::path& path) {
  return path.has_parent_path() ? path.parent_path() : fs::path(".");
}

IoStatus rename_durably(const fs::path& from, const fs::path& to) noexcept {
  if (::rename(from.c_str(), to.c_str()) != 0) return {"rename", errno};
  return fsync_directory_status(parent_directory(to));
}

DurableFile::DurableFile(fs::path path) : path_(std::move(path)) {
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) fail("open", errno);
}

DurableFile::~DurableFile() {
  if (fd_ >= 0) ::close(fd_);
}

void DurableFile::write(const void* data, std::size_t bytes) {
  if (const IoStatus status = write_all(fd_, data, bytes)) fail(status.call, status.error);
}

void DurableFile::commit() {
  if (::fsync(fd_) != 0) fail("fsync", errno);
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) fail("close", errno);
}

void DurableFile::fail(const char* call, int error) const {
  throw Error(fmt::format("{} '{}': {}", call, path_.string(), std::strerror(error)));
}

}  // namespace shardswap
