// What a file's mode says it is, for messages that refuse anything but a regular file: config
// files, data files, checkpoint files and the targets commands write.
#pragma once

#include <sys/stat.h>

#include <string_view>

namespace shardswap {

inline std::string_view file_kind(mode_t mode) {
  if (S_ISREG(mode)) return "a regular file";
  if (S_ISLNK(mode)) return "a symbolic link";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "a file of an unknown kind";
}

}  // namespace shardswap
