// Durable files (support/durable_file.h): every byte written or the failure said with the file's
// name, and renames that say whether they took place.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "shardswap/error.h"
#include "support/durable_file.h"
#include "tests/catch_compat.h"
#include "tests/support/file_size_limit.h"
#include "tests/support/scratch_folder.h"

using namespace shardswap;
using test_support::FileSizeLimit;
using test_support::ScratchFolder;
namespace fs = std::filesystem;

namespace {

const std::string kPrefix = "shardswap-durable-file-test";

std::string read_file(const fs::path& path) {
  std::ifstream f(path, std::ios::binary);
  std::ostringstream text;
  text << f.rdbuf();
  return text.str();
}

std::string error_of(const auto& call) {
  try {
    call();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("a durable file holds every byte written once committed") {
  const ScratchFolder folder(kPrefix);
  const std::string text(1 << 20, 'x');
  DurableFile file(folder / "f");
  file.write(text.data(), text.size());
  file.write("end", 3);
  file.commit();
  REQUIRE(read_file(folder / "f") == text + "end");
}

TEST_CASE("a durable file that cannot be created or written says which call failed on which file") {
  const ScratchFolder folder(kPrefix);
  const fs::path missing = folder / "no-such-folder" / "f";
  REQUIRE(error_of([&] { DurableFile file(missing); }) ==
          "open '" + missing.string() + "': No such file or directory");
  const FileSizeLimit limit(4096);
  DurableFile file(folder / "big");
  const std::string text(8192, 'x');
  REQUIRE(error_of([&] { file.write(text.data(), text.size()); }) ==
          "write '" + (folder / "big").string() + "': File too large");
}

TEST_CASE("write_all stops at the first failing write and counts what went out before it") {
  const ScratchFolder folder(kPrefix);
  const FileSizeLimit limit(4096);
  const int fd = ::open((folder / "f").c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
  REQUIRE(fd >= 0);
  const std::string text(8192, 'x');
  std::size_t written = 0;
  const IoStatus status = write_all(fd, text.data(), text.size(), &written);
  ::close(fd);
  REQUIRE(status);
  REQUIRE(std::string(status.call) == "write");
  REQUIRE(status.error == EFBIG);
  REQUIRE(written == 4096);
}

TEST_CASE("fsync of a directory that is not there throws naming the directory") {
  const ScratchFolder folder(kPrefix);
  const fs::path missing = folder / "gone";
  REQUIRE(error_of([&] { fsync_directory(missing); }) ==
          "fsync of directory '" + missing.string() + "': No such file or directory");
  REQUIRE_FALSE(fsync_directory_status(folder.path()));
}

TEST_CASE("a durable rename replaces the target, and a failed one says the rename failed") {
  const ScratchFolder folder(kPrefix);
  std::ofstream(folder / "new") << "new";
  std::ofstream(folder / "target") << "old";
  REQUIRE_FALSE(rename_durably(folder / "new", folder / "target"));
  REQUIRE(read_file(folder / "target") == "new");
  REQUIRE_FALSE(fs::exists(folder / "new"));
  const IoStatus status = rename_durably(folder / "new", folder / "target");
  REQUIRE(status);
  REQUIRE(std::string(status.call) == "rename");
  REQUIRE(read_file(folder / "target") == "new");
}

TEST_CASE("a path's directory is its parent, or the current one for a bare name") {
  REQUIRE(parent_directory("a/b") == fs::path("a"));
  REQUIRE(parent_directory("b") == fs::path("."));
}
