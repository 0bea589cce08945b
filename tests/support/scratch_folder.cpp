#include "tests/support/scratch_folder.h"

#include <stdlib.h>

#include <system_error>

#include "tests/catch_compat.h"

namespace fs = std::filesystem;

namespace shardswap::test_support {

ScratchFolder::ScratchFolder(const std::string& prefix) {
  auto pattern = (fs::temp_directory_path() / (prefix + "-XXXXXX")).string();
  REQUIRE(mkdtemp(pattern.data()) != nullptr);
  path_ = pattern;
}

ScratchFolder::~ScratchFolder() {
  std::error_code ec;
  fs::remove_all(path_, ec);
}

std::vector<std::string> ScratchFolder::names() const {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(path_)) names.push_back(e.path().filename());
  return names;
}

}  // namespace shardswap::test_support
