// The files the commands write: a target is refused unless it is absent or a regular file of
// nobody's (no link, device, FIFO, directory, checkpoint file or input of the command), and a
// whole file lands beside it and is renamed over it, or nothing changes.
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "shardswap/error.h"
#include "tests/catch_compat.h"
#include "tests/support/file_size_limit.h"
#include "tests/support/scratch_folder.h"
#include "files/output_file.h"

using namespace shardswap;
using test_support::FileSizeLimit;
using test_support::ScratchFolder;
namespace fs = std::filesystem;

namespace {

const std::string kPrefix = "shardswap-output-file-test";

std::string random_bytes(std::mt19937_64& rng, std::size_t n) {
  std::string s(n, '\0');
  for (auto& c : s) c = static_cast<char>(rng());
  return s;
}

void write_file(const fs::path& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary);
  f << text;
}

std::string read_file(const fs::path& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

std::string refusal(const fs::path& target, const std::vector<InputFile>& inputs = {}) {
  return test::message_of<ConfigError>([&] { OutputFile("--out", target, inputs); });
}

}  // namespace

TEST_CASE("an output file replaces a regular file whole and leaves no temporary beside it") {
  ScratchFolder dir(kPrefix);
  std::mt19937_64 rng(21);
  write_file(dir / "model.safetensors", random_bytes(rng, 5000));
  const std::string text = random_bytes(rng, 300000);
  {
    OutputFile out("--out", dir / "model.safetensors");
    for (std::size_t at = 0; at < text.size();) {  // in pieces of random sizes
      const auto n = std::min<std::size_t>(text.size() - at, rng() % 70000 + 1);
      out.write(text.data() + at, n);
      at += n;
    }
    REQUIRE(dir.names().size() == 2);  // the old file and the temporary beside it
    out.commit();
  }
  REQUIRE(read_file(dir / "model.safetensors") == text);
  REQUIRE(dir.names() == std::vector<std::string>{"model.safetensors"});
}

TEST_CASE("a link, a device, a FIFO or a directory as the output is refused and left alone") {
  ScratchFolder dir(kPrefix);
  write_file(dir / "victim", "the link's target");
  fs::create_symlink(dir / "victim", dir / "link");
  fs::create_symlink("/dev/null", dir / "null-link");
  REQUIRE(::mkfifo((dir / "fifo").c_str(), 0644) == 0);
  fs::create_directory(dir / "folder");
  const auto expect = [&](const fs::path& path, const std::string& what) {
    const auto message = refusal(path);
    CAPTURE(message);
    REQUIRE(message == fmt::format("--out '{}': {}; refusing to replace it", path.string(), what));
  };
  expect(dir / "link", "a symbolic link");
  expect(dir / "null-link", "a symbolic link");
  expect(dir / "fifo", "a FIFO");
  expect(dir / "folder", "a directory");
  expect("/dev/null", "a character device");  // only looked at: nothing is ever opened
  REQUIRE(fs::is_symlink(dir / "link"));
  REQUIRE(fs::is_symlink(dir / "null-link"));
  REQUIRE(fs::is_fifo(dir / "fifo"));
  REQUIRE(fs::is_directory(dir / "folder"));
  REQUIRE(read_file(dir / "victim") == "the link's target");
  REQUIRE(dir.names().size() == 5);  // no temporary
}

TEST_CASE("an output inside a checkpoint directory is refused") {
  ScratchFolder dir(kPrefix);
  const auto ck = dir / "step-00000010";
  fs::create_directory(ck);
  write_file(ck / "metadata.json", R"({"format":"shardswap-checkpoint","fnv1a64":"0"})");
  for (const char* name : {"weights.bin", "rank-00000-of-00002.bin", "metadata.json", "new.bin"})
    REQUIRE(test::contains(refusal(ck / name),
                           fmt::format("inside the checkpoint directory '{}'", ck.string())));
  // A checkpoint's own file names under a step folder, even before its metadata is written.
  const auto partial = dir / "step-00000020.tmp-save";
  fs::create_directory(partial);
  REQUIRE(test::contains(refusal(partial / "weights.bin"), "inside the checkpoint directory"));
  REQUIRE(test::contains(refusal(partial / "rank-00001-of-00002.bin"), "inside the checkpoint"));
  // Another program's metadata.json makes no checkpoint; other names under a step folder are fine.
  const auto other = dir / "exports";
  fs::create_directory(other);
  write_file(other / "metadata.json", R"({"format":"something else"})");
  OutputFile("--out", other / "weights.bin");
  OutputFile("--out", partial / "notes.txt");
}

TEST_CASE("an output that is the same file as an input is refused, through a hard link too") {
  ScratchFolder dir(kPrefix);
  std::mt19937_64 rng(5);
  const std::string config = random_bytes(rng, 777);
  write_file(dir / "run.json", config);
  fs::create_hard_link(dir / "run.json", dir / "other-name.json");
  const std::vector<InputFile> inputs = {{"the data file", dir / "absent.txt"},
                                         {"the config file", dir / "run.json"}};
  for (const char* name : {"run.json", "other-name.json"}) {
    const auto message = refusal(dir / name, inputs);
    CAPTURE(message);
    REQUIRE(test::contains(message, fmt::format("the same file as the config file '{}'",
                                                (dir / "run.json").string())));
  }
  REQUIRE(read_file(dir / "run.json") == config);
  OutputFile("--out", dir / "copy.json", inputs);  // a different file is fine
}

TEST_CASE("an output in a folder that does not exist is refused naming the folder") {
  ScratchFolder dir(kPrefix);
  REQUIRE(refusal(dir / "no/such/out.json") ==
          fmt::format("--out '{}': the folder '{}' does not exist",
                      (dir / "no/such/out.json").string(), (dir / "no/such").string()));
  REQUIRE(test::contains(test::message_of<ConfigError>([] { OutputFile("--json", ""); }),
                         "--json: an empty path"));
}

TEST_CASE("a write that fails removes the temporary and leaves the target as it was") {
  ScratchFolder dir(kPrefix);
  std::mt19937_64 rng(9);
  const std::string old = random_bytes(rng, 100);
  write_file(dir / "out.bin", old);
  OutputFile out("--out", dir / "out.bin");
  std::string message;
  {
    const FileSizeLimit limit(64 * 1024);
    const std::string text = random_bytes(rng, 200 * 1024);
    message = test::message_of<Error>([&] { out.write(text.data(), text.size()); });
  }
  CAPTURE(message);
  REQUIRE(test::contains(message, fmt::format("--out '{}'", (dir / "out.bin").string())));
  REQUIRE(test::contains(message, "File too large"));
  REQUIRE(read_file(dir / "out.bin") == old);
  REQUIRE(dir.names() == std::vector<std::string>{"out.bin"});
}

TEST_CASE("a target that became a symbolic link while the command worked is refused at commit") {
  ScratchFolder dir(kPrefix);
  write_file(dir / "victim", "left alone");
  OutputFile out("--out", dir / "out.json");
  out.write("{\"rows\": []}\n");
  fs::create_symlink(dir / "victim", dir / "out.json");
  REQUIRE(test::contains(test::message_of<ConfigError>([&] { out.commit(); }),
                         "a symbolic link; refusing to replace it"));
  REQUIRE(fs::is_symlink(dir / "out.json"));
  REQUIRE(read_file(dir / "victim") == "left alone");
  REQUIRE(dir.names().size() == 2);  // the link and its target: the temporary is gone
}

TEST_CASE("an output given up before its commit leaves nothing behind") {
  ScratchFolder dir(kPrefix);
  {
    OutputFile out("--out", dir / "plot.svg");
    const auto tmp = out.temporary();
    REQUIRE(tmp.parent_path() == dir.path());  // beside the target: the rename stays atomic
    REQUIRE(fs::exists(tmp));
  }
  REQUIRE(dir.names().empty());
}
