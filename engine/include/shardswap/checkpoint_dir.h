// A checkpoint directory held by one run: an advisory lock so that two trainers never write into
// the same directory, and a check, before any work, that the directory takes durable files.
#pragma once

#include <filesystem>
#include <string>

#include "shardswap/checkpoint.h"
#include "shardswap/error.h"

namespace shardswap {

/// Creates `dir` (and its parents) if needed and checks that files can be made durable there:
/// creates, writes, fsyncs and removes a probe file (`open` makes it: tests inject failures),
/// then fsyncs the directory. Throws ConfigError naming `dir` and the system's reason (a parent
/// that is a regular file, a read-only file system, a full disk, ...); nothing is left behind
/// but the directories it created.
void probe_checkpoint_dir(const std::filesystem::path& dir,
                          const OpenCheckpointFile& open = open_checkpoint_file);

/// Who holds a checkpoint directory, as its lock file records it (empty fields: not recorded).
struct CheckpointDirHolder {
  long pid = 0;
  std::string host;
  std::string since;  ///< when it took the lock, UTC, ISO 8601
};

/// The lock is held by someone else: another process, or another CheckpointDirLock of this one.
class CheckpointDirBusy : public Error {
 public:
  CheckpointDirBusy(const std::string& what, CheckpointDirHolder holder)
      : Error(what), holder_(std::move(holder)) {}
  const CheckpointDirHolder& holder() const { return holder_; }

 private:
  CheckpointDirHolder holder_;
};

/// Exclusive hold of a checkpoint directory for as long as the object lives (a whole training
/// run): flock(2) LOCK_EX | LOCK_NB on DIR/.shardswap.lock, which records the holder's pid, host
/// name and start time. Advisory: it keeps out whoever takes the same lock (every `shardswap
/// train`), not other writers. The lock belongs to the open file, so two locks of one process
/// exclude each other as two processes do. It ends when the object is destroyed, or when the
/// process dies however it dies: a crashed run never leaves a stale lock. The lock file itself
/// stays (removing it would let a waiting opener lock a file nobody else can see).
class CheckpointDirLock {
 public:
  static constexpr const char* kFileName = ".shardswap.lock";

  /// Creates `dir` if needed and takes its lock. Throws CheckpointDirBusy naming the directory
  /// and the holder's pid and host when it is held; Error naming the lock file when that cannot
  /// be opened as a regular file of its own (a symlink, a FIFO, a directory, ...).
  explicit CheckpointDirLock(const std::filesystem::path& dir);
  /// Empties the lock file (its record is no longer true), then closes it: the lock is released.
  ~CheckpointDirLock();
  CheckpointDirLock(CheckpointDirLock&& other) noexcept;
  CheckpointDirLock& operator=(CheckpointDirLock&& other) noexcept;
  CheckpointDirLock(const CheckpointDirLock&) = delete;
  CheckpointDirLock& operator=(const CheckpointDirLock&) = delete;

  const std::filesystem::path& dir() const { return dir_; }

 private:
  void release() noexcept;
  std::filesystem::path dir_;
  int fd_ = -1;
};

/// The holder recorded in DIR's lock file, as far as it can be read (for messages and tools);
/// an empty record where there is none.
CheckpointDirHolder read_checkpoint_dir_holder(const std::filesystem::path& dir);

}  // namespace shardswap
