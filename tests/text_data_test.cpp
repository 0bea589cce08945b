// ByteCorpus: the split, batches as pure functions of their arguments, and errors that name
// data.path and the file.
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "shardswap/error.h"
#include "tests/catch_compat.h"
#include "tests/support/scratch_folder.h"
#include "tools/lm/text_data.h"

using namespace shardswap;

namespace {

// A temporary file of `n` pseudo-random bytes (a fixed LCG: the same on every platform), removed
// when the object goes.
struct TempFile {
  std::string path;
  std::vector<std::uint8_t> bytes;
  explicit TempFile(std::size_t n, const std::string& tag = "corpus") {
    path = (std::filesystem::temp_directory_path() /
            ("shardswap_text_data_" + tag + "_" + std::to_string(::getpid())))
               .string();
    std::uint32_t x = 12345;
    for (std::size_t i = 0; i < n; ++i) {
      x = x * 1664525u + 1013904223u;
      bytes.push_back(static_cast<std::uint8_t>(x >> 24));
    }
    std::ofstream(path, std::ios::binary)
        .write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(n));
  }
  ~TempFile() { std::filesystem::remove(path); }
};

// Where sample i's context + target occurs in the file (-1 if nowhere).
std::int64_t position_of(const TempFile& f, const TokenBatch& b, int i, int context) {
  std::vector<std::uint8_t> sample(b.context.begin() + i * context,
                                   b.context.begin() + (i + 1) * context);
  sample.push_back(b.target[static_cast<std::size_t>(i)]);
  const auto it = std::search(f.bytes.begin(), f.bytes.end(), sample.begin(), sample.end());
  return it == f.bytes.end() ? -1 : it - f.bytes.begin();
}

}  // namespace

TEST_CASE("byte corpus keeps the last val_fraction of the bytes for validation") {
  const TempFile f(1000);
  const ByteCorpus tenth(f.path, 8);
  REQUIRE(tenth.size() == 1000);
  REQUIRE(tenth.train_size() == 900);
  REQUIRE(tenth.val_size() == 100);
  REQUIRE(tenth.val_windows() == 100 / 9);
  const ByteCorpus quarter(f.path, 4, 0.25);
  REQUIRE(quarter.train_size() == 750);
  REQUIRE(quarter.val_size() == 250);
  const ByteCorpus odd(f.path, 4, 0.333);  // floor(333.0)
  REQUIRE(odd.val_size() == 333);
}

TEST_CASE("byte corpus draws training samples from the training split alone, reproducibly") {
  const TempFile f(5000);
  constexpr int c = 8;
  const ByteCorpus corpus(f.path, c, 0.2, 42);
  const TokenBatch b = corpus.train_batch(1, 17, 2, 64);
  REQUIRE(b.size == 64);
  REQUIRE(b.context.size() == 64u * c);
  REQUIRE(b.target.size() == 64u);
  std::set<std::int64_t> positions;
  for (int i = 0; i < b.size; ++i) {
    const auto p = position_of(f, b, i, c);
    REQUIRE(p >= 0);
    REQUIRE(p + c < corpus.train_size());  // the target byte too lies in the training split
    positions.insert(p);
  }
  REQUIRE(positions.size() > 55);  // spread over the split, not one place repeated
  // A pure function of (seed, rank, step, micro): again, and from another instance.
  const TokenBatch again = ByteCorpus(f.path, c, 0.2, 42).train_batch(1, 17, 2, 64);
  REQUIRE(again.context == b.context);
  REQUIRE(again.target == b.target);
  // Each argument changes the draw.
  for (const TokenBatch& other :
       {corpus.train_batch(0, 17, 2, 64), corpus.train_batch(1, 18, 2, 64),
        corpus.train_batch(1, 17, 3, 64), ByteCorpus(f.path, c, 0.2, 43).train_batch(1, 17, 2, 64)})
    REQUIRE(other.context != b.context);
  // A smaller batch is the same draw's prefix.
  const TokenBatch prefix = corpus.train_batch(1, 17, 2, 5);
  REQUIRE(std::equal(prefix.context.begin(), prefix.context.end(), b.context.begin()));
  // Pinned: the sampler must give the same positions on every platform and release (resumed
  // runs depend on it).
  std::vector<std::int64_t> first;
  for (int i = 0; i < 4; ++i) first.push_back(position_of(f, b, i, c));
  REQUIRE(first == std::vector<std::int64_t>{497, 3812, 1775, 527});
}

TEST_CASE("byte corpus validation batches walk the validation split in windows, wrapping") {
  const TempFile f(1000);
  constexpr int c = 4;
  const ByteCorpus corpus(f.path, c, 0.1);  // 100 bytes: 20 windows of 5
  REQUIRE(corpus.val_windows() == 20);
  const auto window = [&](std::int64_t k, const TokenBatch& b, int i) {
    const auto at = static_cast<std::size_t>(corpus.train_size() + k * (c + 1));
    for (int j = 0; j < c; ++j)
      if (b.context[static_cast<std::size_t>(i * c + j)] !=
          f.bytes[at + static_cast<std::size_t>(j)])
        return false;
    return b.target[static_cast<std::size_t>(i)] == f.bytes[at + c];
  };
  const TokenBatch b0 = corpus.val_batch(0, 8), b2 = corpus.val_batch(2, 8);
  for (int i = 0; i < 8; ++i) {
    REQUIRE(window(i, b0, i));
    REQUIRE(window((16 + i) % 20, b2, i));  // samples 16..23: windows 16..19, then 0..3
  }
  const TokenBatch again = corpus.val_batch(2, 8);
  REQUIRE(again.context == b2.context);
}

TEST_CASE("byte corpus errors name data.path and the file, or the bad argument") {
  using test::contains;
  using test::message_of;
  const std::string missing = "/nonexistent/shardswap-corpus.txt";
  auto m = message_of<ConfigError>([&] { ByteCorpus c(missing, 8); });
  REQUIRE(contains(m, "data.path"));
  REQUIRE(contains(m, missing));
  const auto dir = std::filesystem::temp_directory_path().string();
  m = message_of<ConfigError>([&] { ByteCorpus c(dir, 8); });
  REQUIRE(contains(m, "data.path"));
  REQUIRE(contains(m, dir));
  // 90 bytes: 81 for training, 9 for validation: enough for context 8, too few for context 9.
  const TempFile small(90, "small");
  REQUIRE_NOTHROW(ByteCorpus(small.path, 8));
  m = message_of<ConfigError>([&] { ByteCorpus c(small.path, 9); });
  REQUIRE(contains(m, "data.path"));
  REQUIRE(contains(m, small.path));
  REQUIRE(contains(m, "too small"));
  const TempFile empty(0, "empty");
  REQUIRE(contains(message_of<ConfigError>([&] { ByteCorpus c(empty.path, 1); }), empty.path));
  for (double bad : {0.0, 1.0, -0.1, 1.5})
    REQUIRE(contains(message_of<ConfigError>([&] { ByteCorpus c(small.path, 2, bad); }),
                     "data.val_fraction"));
  REQUIRE_THROWS_AS(ByteCorpus(small.path, 0), ConfigError);
  const ByteCorpus ok(small.path, 4);
  REQUIRE_THROWS_AS(ok.train_batch(0, 0, 0, 0), ConfigError);
  REQUIRE_THROWS_AS(ok.train_batch(-1, 0, 0, 4), ConfigError);
  REQUIRE_THROWS_AS(ok.val_batch(-1, 4), ConfigError);
}

namespace {

// The bytes of data the process holds now (heap and private writable mappings: what
// RLIMIT_DATA limits), from /proc/self/status.
std::uint64_t data_bytes() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);)
    if (line.rfind("VmData:", 0) == 0) return std::stoull(line.substr(7)) * 1024;
  FAIL("no VmData in /proc/self/status");
  return 0;
}

// Lets the process allocate at most `more` bytes beyond what it holds, until the object goes.
struct DataLimit {
  rlimit old{};
  explicit DataLimit(std::uint64_t more) {
    REQUIRE(::getrlimit(RLIMIT_DATA, &old) == 0);
    const rlimit limited{data_bytes() + more, old.rlim_max};
    REQUIRE(::setrlimit(RLIMIT_DATA, &limited) == 0);
  }
  ~DataLimit() { ::setrlimit(RLIMIT_DATA, &old); }
};

}  // namespace

TEST_CASE("byte corpus maps a data file larger than the memory it may allocate") {
  const test_support::ScratchFolder dir("shardswap-corpus-huge");
  const auto path = (dir / "huge.bin").string();
  // 1 GiB, mostly holes (no disk), with random bytes where the validation split starts.
  constexpr std::int64_t kSize = std::int64_t{1} << 30;
  const std::int64_t train = kSize - static_cast<std::int64_t>(std::floor(kSize * 0.1));
  std::vector<std::uint8_t> tail(64);
  std::uint32_t x = 99;
  for (auto& b : tail) b = static_cast<std::uint8_t>((x = x * 1664525u + 1013904223u) >> 24);
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT, 0600);
  REQUIRE(fd >= 0);
  REQUIRE(::ftruncate(fd, kSize) == 0);
  REQUIRE(::pwrite(fd, tail.data(), tail.size(), train) == static_cast<ssize_t>(tail.size()));
  ::close(fd);
  std::optional<ByteCorpus> corpus;
  {
    const DataLimit limit(std::uint64_t{256} << 20);  // a quarter of the file
    corpus.emplace(path, 7);
    ByteCorpus again(path, 7);  // the trainer checks the file, then opens it again
    REQUIRE(again.size() == kSize);
  }
  REQUIRE(corpus->size() == kSize);
  REQUIRE(corpus->train_size() == train);
  // Validation window 0 is the first 8 bytes of the split: the bytes written there.
  const auto b = corpus->val_batch(0, 2);
  REQUIRE(std::equal(b.context.begin(), b.context.begin() + 7, tail.begin()));
  REQUIRE(b.target[0] == tail[7]);
  REQUIRE(std::equal(b.context.begin() + 7, b.context.end(), tail.begin() + 8));
  REQUIRE(b.target[1] == tail[15]);
}

TEST_CASE("byte corpus refuses a data file that is not a regular file, naming it and its kind") {
  const test_support::ScratchFolder dir("shardswap-corpus-kinds");
  const auto fifo = (dir / "fifo").string();
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  const std::pair<std::string, std::string> cases[] = {
      {fifo, "a FIFO"}, {dir.path().string(), "a directory"}, {"/dev/zero", "a character device"}};
  for (const auto& [path, kind] : cases) {
    const auto m = test::message_of<ConfigError>([&] { ByteCorpus c(path, 8); });
    CAPTURE(m);
    REQUIRE(m == "data.path = \"" + path + "\": not a regular file (" + kind + ")");
  }
}

TEST_CASE("byte corpus batches are the same from every corpus of one file") {
  const TempFile f(5000, "twice");
  const ByteCorpus a(f.path, 16), b(f.path, 16);
  const ByteCorpus copy = a;
  std::mt19937 rng(3);
  for (int i = 0; i < 20; ++i) {
    const int rank = static_cast<int>(rng() % 4), step = static_cast<int>(rng() % 1000);
    const auto x = a.train_batch(rank, step, 0, 8);
    REQUIRE(x.context == b.train_batch(rank, step, 0, 8).context);
    REQUIRE(x.target == copy.train_batch(rank, step, 0, 8).target);
    for (int s = 0; s < 8; ++s) REQUIRE(position_of(f, x, s, 16) >= 0);
  }
}
