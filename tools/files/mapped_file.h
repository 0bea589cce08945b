// A regular file mapped read-only, the one way the decoder's readers (token files, safetensors)
// open what they read: a FIFO or a device is refused from stat() before it is opened (opening a
// FIFO blocks until a writer comes, opening some devices acts), and checked again once open, in
// case the path was replaced in between. The mapping outlives its descriptor; readers share it
// (shared_ptr) with the views they hand out.
#pragma once

#include <cstddef>
#include <filesystem>
#include <memory>
#include <string>

namespace shardswap {

class MappedFile {
 public:
  /// Maps `path`. ConfigError "WHERE: why" (no such file, not a regular file (a FIFO, ...),
  /// cannot be opened, cannot be mapped), with `where` naming the file as the caller's messages
  /// do. An empty file maps to data() == nullptr, size() == 0.
  static std::shared_ptr<const MappedFile> open(const std::filesystem::path& path,
                                                const std::string& where);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const std::byte* data() const { return data_; }
  std::size_t size() const { return size_; }
  /// madvise over the whole mapping (MADV_SEQUENTIAL, MADV_RANDOM): a hint, errors ignored.
  void advise(int advice) const;

 private:
  MappedFile() = default;
  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace shardswap
