// Files that survive a crash: every byte written (a write interrupted by a signal, or short, is
// continued), fsynced, closed with its errors checked, and put under its name by a rename whose
// directory is fsynced too. What each caller renames, fsyncs and removes, and in which order, stays
// with the caller: tools/checks/kill_campaign.py stops a save at each of those calls and checks what it
// leaves. The calls below either throw an Error naming the file, or, for callers whose messages
// have a wording of their own, return what failed (IoStatus) and throw nothing.
#pragma once

#include <cstddef>
#include <filesystem>
#include <string>

namespace shardswap {

/// A system call that failed: `call` ("open", "write", "fsync", "close", "rename") and its errno.
/// Converts to true on failure; the default (error 0) is success.
struct IoStatus {
  const char* call = nullptr;
  int error = 0;

  explicit operator bool() const { return error != 0; }
  /// strerror(error).
  std::string why() const;
};

/// Writes all of `bytes` to `fd`, going on after EINTR and after a short write. A write that
/// writes nothing fails with EIO. `*written` (when given) receives the bytes written, all of
/// them or those before the failure.
IoStatus write_all(int fd, const void* data, std::size_t bytes,
                   std::size_t* written = nullptr) noexcept;

/// Opens `path` (flags | O_CLOEXEC), fsyncs and closes it: makes durable what was written to
/// it through another descriptor, or, for a directory, the entries made, renamed or removed in it.
IoStatus fsync_path(const std::filesystem::path& path, int open_flags) noexcept;

/// fsync_path of a directory.
IoStatus fsync_directory_status(const std::filesystem::path& dir) noexcept;

/// The same, throwing Error "fsync of directory 'DIR': WHY".
void fsync_directory(const std::filesystem::path& dir);

/// The directory that holds `path`: its parent, "." when it has none.
std::filesystem::path parent_directory(const std::filesystem::path& path);

/// rename(2) of `from` to `to` (atomic within one file system: `to` is the old entry or the
/// new one, never neither), then fsync of the directory holding `to`, so that the new name
/// survives a crash. A failure with `call` "rename" left everything as it was; any other
/// ("open", "fsync" of the directory) came after the rename took place.
IoStatus rename_durably(const std::filesystem::path& from,
                        const std::filesystem::path& to) noexcept;

/// One file written whole and made durable: created (or truncated) by the constructor, written
/// fully, then fsynced and closed by commit(). Every failure throws Error "CALL 'PATH': WHY".
/// Destroyed uncommitted, it closes the file and leaves it as it is (the caller's temporary
/// folder or name is what makes it invisible until complete).
class DurableFile {
 public:
  explicit DurableFile(std::filesystem::path path);
  ~DurableFile();
  DurableFile(const DurableFile&) = delete;
  DurableFile& operator=(const DurableFile&) = delete;

  void write(const void* data, std::size_t bytes);
  /// fsync, then close: a close error (NFS reports a lost write there) fails the commit too.
  void commit();

  const std::filesystem::path& path() const { return path_; }

 private:
  [[noreturn]] void fail(const char* call, int error) const;

  std::filesystem::path path_;
  int fd_ = -1;
};

}  // namespace shardswap
