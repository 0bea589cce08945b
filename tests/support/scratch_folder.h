// A folder of a test's own under the system's temporary folder, removed with its contents when
// the test leaves its scope: also when a REQUIRE fails or the code under test throws, as both
// unwind the stack.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

namespace shardswap::test_support {

class ScratchFolder {
 public:
  /// Creates <temp>/<prefix>-XXXXXX, unique (mkdtemp): CTest runs test cases in parallel
  /// processes, and other checkouts may run the suite at the same time.
  explicit ScratchFolder(const std::string& prefix);
  /// Removes the folder and everything in it; never throws (errors are ignored).
  ~ScratchFolder();
  ScratchFolder(const ScratchFolder&) = delete;
  ScratchFolder& operator=(const ScratchFolder&) = delete;

  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }
  const std::filesystem::path& path() const { return path_; }
  /// The names of the entries in the folder itself, in directory order.
  std::vector<std::string> names() const;

 private:
  std::filesystem::path path_;
};

}  // namespace shardswap::test_support
