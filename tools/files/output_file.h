// The files the commands write (ckpt export --out, plot --out, bench --json, train --metrics):
// the target is checked before any work starts, and a whole file is written beside it and renamed
// over it, so that what was there is replaced only by a complete file of ours, or not at all.
#pragma once

#include <filesystem>
#include <streambuf>
#include <string>
#include <string_view>
#include <vector>

namespace shardswap {

/// A file a command reads, which its output must never replace.
struct InputFile {
  std::string role;  ///< what it is to the user: "the config file", "the data file", ...
  std::filesystem::path path;
};

/// The entries of a checkpoint directory, as inputs named `role`.
std::vector<InputFile> checkpoint_inputs(const std::filesystem::path& dir,
                                         const std::string& role = "the checkpoint file");

/// Refuses `path` as the output of `flag` unless its folder exists and it is absent or a regular
/// file (lstat: a symbolic link, a device, a FIFO, a socket or a directory is refused), it is
/// not inside a checkpoint directory (a folder holding a ShardSwap metadata.json, or a
/// checkpoint's own file name under a step-N folder), and it is not the same file (device and
/// inode) as any of `inputs`. Throws ConfigError "FLAG 'PATH': WHAT; refusing to replace it".
void check_output_path(std::string_view flag, const std::filesystem::path& path,
                       const std::vector<InputFile>& inputs = {});

/// One whole output file. The constructor checks the target (check_output_path) and creates
/// nothing; the bytes go to a temporary beside it (same folder, so the rename is atomic; a
/// unique name, so two runs never share it), which commit() makes durable and renames over the
/// target. The temporary is removed on any failure and by the destructor unless committed.
class OutputFile {
 public:
  OutputFile(std::string flag, std::filesystem::path target, std::vector<InputFile> inputs = {});
  ~OutputFile();
  OutputFile(const OutputFile&) = delete;
  OutputFile& operator=(const OutputFile&) = delete;

  /// The temporary, created empty on first use: for a program that writes the file itself.
  const std::filesystem::path& temporary();
  /// Appends to the temporary with write(2) until every byte is written. Throws Error naming
  /// the target and the temporary.
  void write(const void* data, std::size_t bytes);
  void write(std::string_view text) { write(text.data(), text.size()); }
  /// fsyncs the temporary, checks the target again (it may have changed while the command
  /// worked), renames the temporary over it and fsyncs the folder. Throws ConfigError when the
  /// target is now refused, Error when a system call fails; the temporary is removed either way.
  void commit();

  const std::filesystem::path& target() const { return target_; }

 private:
  void remove_temporary() noexcept;

  std::string flag_;
  std::filesystem::path target_;
  std::vector<InputFile> inputs_;
  std::filesystem::path temporary_;
  int fd_ = -1;
  bool committed_ = false;
};

/// The buffer of the CLI's std::cout: line-buffered (a line is written as it ends, so that
/// `train > run.log` shows each as it comes), with write(2) to `fd`, keeping the first error.
/// stdio's buffer drops the errno of a failed write, and a result lost on a full disk or a
/// closed descriptor must end the command with exit 1 naming why, not 0 (docs/reliability.md).
class DescriptorOutput final : public std::streambuf {
 public:
  explicit DescriptorOutput(int fd);
  ~DescriptorOutput() override;
  DescriptorOutput(const DescriptorOutput&) = delete;
  DescriptorOutput& operator=(const DescriptorOutput&) = delete;

  /// Writes what is buffered; returns the errno of the first write that failed, 0 when every
  /// byte handed over so far was written.
  int finish();

 protected:
  int_type overflow(int_type c) override;
  std::streamsize xsputn(const char* s, std::streamsize n) override;
  int sync() override;

 private:
  bool write_buffered();

  int fd_;
  int error_ = 0;  ///< the first write's errno; once set, what follows is dropped
  char buffer_[4096];
};

}  // namespace shardswap
