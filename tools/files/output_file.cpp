#include "files/output_file.h"
#include "support/durable_file.h"
#include "support/file_kind.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <random>

#include "shardswap/error.h"

namespace shardswap {

namespace fs = std::filesystem;

namespace {

// What a checkpoint's metadata.json starts with (docs/checkpoints.md): how a folder is known to be
// a checkpoint even when the metadata itself is corrupt.
constexpr std::string_view kCheckpointMetadataStart = R"({"format":"shardswap-checkpoint")";

bool is_checkpoint_metadata(const fs::path& file) {
  // Non-blocking and not following a link: a FIFO or a link named metadata.json is no metadata,
  // and looking must never hang.
  const int fd = ::open(file.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return false;
  struct stat st {};
  std::string head(kCheckpointMetadataStart.size(), '\0');
  ssize_t got = -1;
  if (::fstat(fd, &st) == 0 && S_ISREG(st.st_mode)) got = ::read(fd, head.data(), head.size());
  ::close(fd);
  return got == static_cast<ssize_t>(head.size()) && head == kCheckpointMetadataStart;
}

bool is_checkpoint_file_name(const std::string& name) {
  return name == "metadata.json" || name == "weights.bin" ||
         (name.starts_with("rank-") && name.ends_with(".bin"));
}

bool is_step_folder_name(const std::string& name) {
  return name.size() > 5 && name.starts_with("step-") && name[5] >= '0' && name[5] <= '9';
}

[[noreturn]] void refuse(std::string_view flag, const fs::path& path, const std::string& what) {
  throw ConfigError(fmt::format("{} '{}': {}; refusing to replace it", flag, path.string(), what));
}

}  // namespace

std::vector<InputFile> checkpoint_inputs(const fs::path& dir, const std::string& role) {
  std::vector<InputFile> inputs;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) inputs.push_back({role, entry.path()});
  return inputs;
}

void check_output_path(std::string_view flag, const fs::path& path,
                       const std::vector<InputFile>& inputs) {
  if (path.empty()) throw ConfigError(fmt::format("{}: an empty path", flag));
  const fs::path folder = path.has_parent_path() ? path.parent_path() : fs::path(".");
  struct stat st {};
  if (::stat(folder.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
    throw ConfigError(fmt::format("{} '{}': the folder '{}' does not exist", flag, path.string(),
                                  folder.string()));
  if (::access(folder.c_str(), W_OK | X_OK) != 0)
    throw ConfigError(fmt::format("{} '{}': cannot write into the folder '{}': {}", flag,
                                  path.string(), folder.string(), std::strerror(errno)));

  const bool exists = ::lstat(path.c_str(), &st) == 0;
  if (!exists && errno != ENOENT)
    throw ConfigError(fmt::format("{} '{}': {}", flag, path.string(), std::strerror(errno)));
  if (exists && !S_ISREG(st.st_mode)) refuse(flag, path, std::string(file_kind(st.st_mode)));

  const std::string name = path.filename().string();
  fs::path absolute_folder = fs::absolute(folder).lexically_normal();
  if (absolute_folder.filename().empty()) absolute_folder = absolute_folder.parent_path();
  const std::string folder_name = absolute_folder.filename().string();
  if (is_checkpoint_metadata(folder / "metadata.json") ||
      (is_step_folder_name(folder_name) && is_checkpoint_file_name(name)))
    refuse(flag, path, fmt::format("inside the checkpoint directory '{}'", folder.string()));

  if (!exists) return;
  for (const auto& input : inputs) {
    struct stat in {};
    if (::stat(input.path.c_str(), &in) == 0 && in.st_dev == st.st_dev && in.st_ino == st.st_ino)
      refuse(flag, path, fmt::format("the same file as {} '{}'", input.role, input.path.string()));
  }
}

OutputFile::OutputFile(std::string flag, fs::path target, std::vector<InputFile> inputs)
    : flag_(std::move(flag)), target_(std::move(target)), inputs_(std::move(inputs)) {
  check_output_path(flag_, target_, inputs_);
}

OutputFile::~OutputFile() {
  if (!committed_) remove_temporary();
}

void OutputFile::remove_temporary() noexcept {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  if (!temporary_.empty()) ::unlink(temporary_.c_str());
  temporary_.clear();
}

const fs::path& OutputFile::temporary() {
  if (fd_ >= 0) return temporary_;
  std::random_device random;
  const fs::path folder = target_.has_parent_path() ? target_.parent_path() : fs::path(".");
  for (int attempt = 0; attempt < 16; ++attempt) {
    // O_EXCL: a name another run holds is never shared; the mode is 0666 less the umask, as
    // for any file the user creates.
    fs::path candidate =
        folder / fmt::format("{}.tmp-{:08x}", target_.filename().string(), random());
    const int fd =
        ::open(candidate.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
    if (fd >= 0) {
      fd_ = fd;
      temporary_ = std::move(candidate);
      return temporary_;
    }
    if (errno != EEXIST)
      throw Error(fmt::format("{} '{}': cannot create a temporary '{}': {}", flag_,
                              target_.string(), candidate.string(), std::strerror(errno)));
  }
  throw Error(fmt::format("{} '{}': no free temporary name beside it", flag_, target_.string()));
}

void OutputFile::write(const void* data, std::size_t bytes) {
  temporary();
  if (const IoStatus status = write_all(fd_, data, bytes)) {
    const auto message = fmt::format("{} '{}': cannot write the temporary '{}': {}", flag_,
                                     target_.string(), temporary_.string(), status.why());
    remove_temporary();
    throw Error(message);
  }
}

void OutputFile::commit() {
  temporary();  // nothing written: the output is an empty file
  const auto fail = [&](const char* call, int err) {
    const auto message = fmt::format("{} '{}': {} of '{}': {}", flag_, target_.string(), call,
                                     temporary_.string(), std::strerror(err));
    remove_temporary();
    throw Error(message);
  };
  // Through a new descriptor: a program given temporary() may have written it on its own.
  ::close(fd_);
  fd_ = -1;
  if (const IoStatus status = fsync_path(temporary_, O_RDONLY | O_NOFOLLOW))
    fail(status.call, status.error);
  try {
    check_output_path(flag_, target_, inputs_);
  } catch (...) {
    remove_temporary();
    throw;
  }
  const IoStatus status = rename_durably(temporary_, target_);
  if (status && std::string_view(status.call) == "rename") fail("rename", status.error);
  committed_ = true;
  if (status)
    throw Error(fmt::format("{} '{}': fsync of the folder '{}': {}", flag_, target_.string(),
                            parent_directory(target_).string(), status.why()));
}

DescriptorOutput::DescriptorOutput(int fd) : fd_(fd) {
  setp(buffer_, buffer_ + sizeof buffer_);
}

DescriptorOutput::~DescriptorOutput() {
  write_buffered();
}

bool DescriptorOutput::write_buffered() {
  const char* data = pbase();
  std::size_t left = static_cast<std::size_t>(pptr() - pbase());
  setp(buffer_, buffer_ + sizeof buffer_);
  while (left > 0 && error_ == 0) {
    const ssize_t wrote = ::write(fd_, data, left);
    if (wrote < 0 && errno == EINTR) continue;
    if (wrote <= 0) {
      error_ = wrote < 0 ? errno : EIO;
      break;
    }
    data += wrote;
    left -= static_cast<std::size_t>(wrote);
  }
  return error_ == 0;
}

DescriptorOutput::int_type DescriptorOutput::overflow(int_type c) {
  if (traits_type::eq_int_type(c, traits_type::eof()))
    return write_buffered() ? traits_type::not_eof(c) : traits_type::eof();
  if (pptr() == epptr() && !write_buffered()) return traits_type::eof();
  *pptr() = traits_type::to_char_type(c);
  pbump(1);
  if (traits_type::to_char_type(c) == '\n' && !write_buffered()) return traits_type::eof();
  return error_ == 0 ? c : traits_type::eof();
}

std::streamsize DescriptorOutput::xsputn(const char* s, std::streamsize n) {
  if (error_ != 0) return 0;
  const auto size = static_cast<std::size_t>(n);
  for (std::size_t done = 0; done < size;) {
    if (pptr() == epptr() && !write_buffered()) return 0;
    const std::size_t piece = std::min(size - done, static_cast<std::size_t>(epptr() - pptr()));
    std::memcpy(pptr(), s + done, piece);
    pbump(static_cast<int>(piece));
    done += piece;
  }
  if (std::memchr(s, '\n', size) != nullptr && !write_buffered()) return 0;
  return n;
}

int DescriptorOutput::sync() {
  return write_buffered() ? 0 : -1;
}

int DescriptorOutput::finish() {
  write_buffered();
  return error_;
}

}  // namespace shardswap
