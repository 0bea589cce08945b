#include "files/mapped_file.h"

#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <unistd.h>

#include "shardswap/error.h"
#include "support/file_kind.h"

namespace shardswap {

namespace {

[[noreturn]] void refuse(const std::string& where, const std::string& why) {
  throw ConfigError(fmt::format("{}: {}", where, why));
}

void require_regular(const std::string& where, const struct stat& st) {
  if (!S_ISREG(st.st_mode))
    refuse(where, fmt::format("not a regular file ({})", file_kind(st.st_mode)));
}

}  // namespace

std::shared_ptr<const MappedFile> MappedFile::open(const std::filesystem::path& path,
                                                   const std::string& where) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0)
    refuse(where, errno == ENOENT ? std::string("no such file")
                                  : fmt::format("cannot be opened: {}", std::strerror(errno)));
  require_regular(where, st);
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) refuse(where, fmt::format("cannot be opened: {}", std::strerror(errno)));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }  // the mapping outlives the descriptor
  } closer{fd};
  if (::fstat(fd, &st) != 0)
    refuse(where, fmt::format("cannot be opened: {}", std::strerror(errno)));
  require_regular(where, st);
  std::shared_ptr<MappedFile> file(new MappedFile);
  const auto size = static_cast<std::size_t>(st.st_size);
  if (size > 0) {  // mmap refuses a length of 0
    void* p = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED)
      refuse(where, fmt::format("cannot be mapped ({} bytes): {}", size, std::strerror(errno)));
    file->data_ = static_cast<std::byte*>(p);
    file->size_ = size;
  }
  return file;
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) ::munmap(data_, size_);
}

void MappedFile::advise(int advice) const {
  if (data_ != nullptr) ::madvise(data_, size_, advice);
}

}  // namespace shardswap
