// Token files and the decoder's dataset: llm.c's format read and written, every malformed file
// refused naming the key and the file, packing against a plain reimplementation, the shuffle a
// bijection per epoch, and the global batch of a step the same at every world size and
// micro-batch split (docs/data.md).
#include <sys/stat.h>

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "shardswap/error.h"
#include "tests/catch_compat.h"
#include "tests/support/scratch_folder.h"
#include "data/token_data.h"

using namespace shardswap;
using shardswap::test_support::ScratchFolder;

namespace {

using Tokens = std::vector<std::uint32_t>;
using Window = std::vector<std::int32_t>;  // seq_len + 1 tokens: the inputs, then the last target

// `n` ids below `vocab` from a fixed-seed engine (mt19937_64's output is fixed by the standard).
Tokens random_tokens(std::size_t n, std::uint32_t vocab, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  Tokens t(n);
  for (auto& x : t) x = static_cast<std::uint32_t>(rng() % vocab);
  return t;
}

// An llm.c file written here, byte by byte, independently of write_token_file; the header fields
// and the bytes after the tokens are the caller's, so malformed files are easy to make.
void write_raw(const std::filesystem::path& path, std::int32_t magic, std::int32_t version,
               std::int32_t count, const Tokens& tokens, int width, std::size_t extra_bytes = 0) {
  std::vector<unsigned char> bytes(1024, 0);
  const auto put = [&](std::size_t at, std::uint32_t v, int w) {
    for (int b = 0; b < w; ++b) bytes[at + b] = static_cast<unsigned char>(v >> (8 * b));
  };
  put(0, static_cast<std::uint32_t>(magic), 4);
  put(4, static_cast<std::uint32_t>(version), 4);
  put(8, static_cast<std::uint32_t>(count), 4);
  for (const auto id : tokens) {
    bytes.resize(bytes.size() + width);
    put(bytes.size() - width, id, width);
  }
  bytes.resize(bytes.size() + extra_bytes, 0x5a);
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(bytes.data()),
             static_cast<std::streamsize>(bytes.size()));
}

void write_good(const std::filesystem::path& path, const Tokens& tokens, int version) {
  write_raw(path, 20240520, version, static_cast<std::int32_t>(tokens.size()), tokens,
            version == 1 ? 2 : 4);
}

std::vector<unsigned char> file_bytes(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// Packing as docs/data.md states it, written plainly: every window of seq_len + 1 tokens starting
// at a multiple of seq_len inside one file, files in order.
std::vector<Window> reference_windows(const std::vector<Tokens>& files, int seq_len) {
  std::vector<Window> windows;
  for (const auto& f : files)
    for (std::size_t at = 0; at + seq_len + 1 <= f.size(); at += seq_len)
      windows.emplace_back(f.begin() + at, f.begin() + at + seq_len + 1);
  return windows;
}

// The windows of a batch, row by row.
std::vector<Window> windows_of(const TokenSequences& b) {
  std::vector<Window> out;
  for (int i = 0; i < b.sequences; ++i) {
    const auto row = static_cast<std::size_t>(i) * b.seq_len;
    Window w(b.inputs.begin() + row, b.inputs.begin() + row + b.seq_len);
    w.push_back(b.targets[row + b.seq_len - 1]);
    // The targets are the inputs shifted by one: check it for every position, not only the last.
    for (int t = 0; t + 1 < b.seq_len; ++t) REQUIRE(b.targets[row + t] == b.inputs[row + t + 1]);
    out.push_back(std::move(w));
  }
  return out;
}

// Three token files of odd lengths (one too short to hold a window) and a validation file.
struct Corpus {
  static constexpr int kSeqLen = 7;
  static constexpr std::uint32_t kVocab = 1000;
  ScratchFolder dir{"shardswap-token-data"};
  std::vector<Tokens> train = {random_tokens(7 * 5 + 4, kVocab, 1),   // 5 windows, 3 left over
                               random_tokens(5, kVocab, 2),           // no window
                               random_tokens(7 * 9 + 1, kVocab, 3),   // exactly 9
                               random_tokens(7 * 3 + 6, kVocab, 4)};  // 3, 5 left over
  Tokens val = random_tokens(7 * 4 + 2, kVocab, 5);
  Corpus() {
    for (std::size_t i = 0; i < train.size(); ++i)
      write_good(dir / ("train-" + std::to_string(i) + ".bin"), train[i], i % 2 == 0 ? 1 : 2);
    write_good(dir / "val.bin", val, 2);
  }
  TokenDataSpec spec(std::uint64_t seed = 7) const {
    TokenDataSpec s;
    s.train = (dir / "train-*.bin").string();
    s.val = (dir / "val.bin").string();
    s.seq_len = kSeqLen;
    s.vocab = static_cast<int>(kVocab);
    s.seed = seed;
    return s;
  }
};

// What TokenDataset refuses, as the message it gives.
std::string refusal(const TokenDataSpec& spec) {
  return test::message_of<ConfigError>([&] { TokenDataset d(spec); });
}

TokenDataSpec spec_of(const std::filesystem::path& train, int vocab = 1000, int seq_len = 4) {
  TokenDataSpec s;
  s.train = train.string();
  s.seq_len = seq_len;
  s.vocab = vocab;
  return s;
}

// The global batch of `step`: every rank's micro-batches in order, at this world and micro size.
std::vector<Window> global_batch(const TokenDataset& d, std::int64_t step, int g, int world,
                                 int micro) {
  std::vector<Window> out;
  for (int rank = 0; rank < world; ++rank)
    for (int m = 0; m < g / world / micro; ++m)
      for (auto& w : windows_of(d.train_batch(step, g, rank, world, m, micro)))
        out.push_back(std::move(w));
  return out;
}

}  // namespace

TEST_CASE("write_token_file lays out llm.c's header and little-endian tokens", "[data]") {
  ScratchFolder dir("shardswap-token-data");
  const Tokens t = {0, 1, 0xfffe, 258, 70000 % 65536};
  write_token_file((dir / "v1.bin").string(), t, 1);
  const Tokens wide = {0, 0x12345678, 65536, 7};
  write_token_file((dir / "v2.bin").string(), wide, 2);
  const auto le = [](const std::vector<unsigned char>& b, std::size_t at, int w) {
    std::uint32_t v = 0;
    for (int i = 0; i < w; ++i) v |= std::uint32_t{b[at + i]} << (8 * i);
    return v;
  };
  const auto v1 = file_bytes(dir / "v1.bin");
  REQUIRE(v1.size() == 1024 + 2 * t.size());
  REQUIRE(le(v1, 0, 4) == 20240520);
  REQUIRE(le(v1, 4, 4) == 1);
  REQUIRE(le(v1, 8, 4) == t.size());
  for (std::size_t i = 12; i < 1024; ++i) REQUIRE(v1[i] == 0);
  for (std::size_t i = 0; i < t.size(); ++i) REQUIRE(le(v1, 1024 + 2 * i, 2) == t[i]);
  const auto v2 = file_bytes(dir / "v2.bin");
  REQUIRE(v2.size() == 1024 + 4 * wide.size());
  REQUIRE(le(v2, 4, 4) == 2);
  REQUIRE(le(v2, 8, 4) == wide.size());
  for (std::size_t i = 0; i < wide.size(); ++i) REQUIRE(le(v2, 1024 + 4 * i, 4) == wide[i]);
}

TEST_CASE("write_token_file refuses an id too wide for uint16 and writes nothing", "[data]") {
  ScratchFolder dir("shardswap-token-data");
  const Tokens t = {1, 2, 65536};
  const auto msg =
      test::message_of<ConfigError>([&] { write_token_file((dir / "x.bin").string(), t, 1); });
  CHECK(test::contains(msg, "x.bin"));
  CHECK(test::contains(msg, "65536"));
  CHECK(test::contains(msg, "index 2"));
  const auto bad_version =
      test::message_of<ConfigError>([&] { write_token_file((dir / "y.bin").string(), t, 3); });
  CHECK(test::contains(bad_version, "version 3"));
  REQUIRE(dir.names().empty());
}

TEST_CASE("a token file reads back every uint16 and uint32 id written independently", "[data]") {
  ScratchFolder dir("shardswap-token-data");
  for (const int version : {1, 2}) {
    const std::uint32_t vocab = version == 1 ? 65536 : 151936;  // the whole uint16 range; Qwen2's
    for (const std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{999}}) {
      const Tokens t = random_tokens(n, vocab, 100 + n + version);
      const auto path = dir / ("f" + std::to_string(version) + "-" + std::to_string(n) + ".bin");
      write_good(path, t, version);
      const TokenFile f = TokenFile::open_llmc(path.string(), static_cast<int>(vocab));
      REQUIRE(f.size() == static_cast<std::int64_t>(n));
      REQUIRE(f.width() == (version == 1 ? 2 : 4));
      std::vector<std::int32_t> all(n);
      f.copy(0, static_cast<std::int64_t>(n), all.data());
      for (std::size_t i = 0; i < n; ++i) {
        REQUIRE(f[static_cast<std::int64_t>(i)] == static_cast<std::int32_t>(t[i]));
        REQUIRE(all[i] == static_cast<std::int32_t>(t[i]));
      }
    }
  }
  // And a file of our writer reads back through the same path.
  const Tokens t = random_tokens(333, 50000, 9);
  write_token_file((dir / "ours.bin").string(), t, 1);
  const TokenFile f = TokenFile::open_llmc((dir / "ours.bin").string(), 50000);
  REQUIRE(f.size() == 333);
  for (std::size_t i = 0; i < t.size(); ++i)
    REQUIRE(f[static_cast<std::int64_t>(i)] == static_cast<std::int32_t>(t[i]));
}

TEST_CASE("a token file with a wrong magic is refused naming the key, the pattern and the file",
          "[data]") {
  ScratchFolder dir("shardswap-token-data");
  write_good(dir / "a.bin", random_tokens(100, 1000, 1), 1);
  write_raw(dir / "b.bin", 1234, 1, 10, random_tokens(10, 1000, 2), 2);
  const auto pattern = (dir / "*.bin").string();
  const auto msg = refusal(spec_of(dir / "*.bin"));
  CHECK(msg == "data.train = \"" + pattern + "\": \"" + (dir / "b.bin").string() +
                   "\": not a token file (magic 1234, expected 20240520)");
}

TEST_CASE("a token file of another version is refused naming the file and the version", "[data]") {
  ScratchFolder dir("shardswap-token-data");
  write_raw(dir / "v3.bin", 20240520, 3, 10, random_tokens(10, 1000, 2), 4);
  const auto msg = refusal(spec_of(dir / "v3.bin"));
  CHECK(msg.rfind("data.train = \"" + (dir / "v3.bin").string() + "\": token file version 3", 0) ==
        0);
}

TEST_CASE("a truncated token file is refused naming the file and its sizes", "[data]") {
  ScratchFolder dir("shardswap-token-data");
  write_raw(dir / "short.bin", 20240520, 2, 100, random_tokens(99, 1000, 2), 4);
  const auto msg = refusal(spec_of(dir / "short.bin"));
  CHECK(test::contains(msg, "data.train = \"" + (dir / "short.bin").string() + "\": truncated"));
  CHECK(test::contains(msg, std::to_string(1024 + 99 * 4) + " bytes"));
  CHECK(test::contains(msg, std::to_string(1024 + 100 * 4)));
  // Shorter than the header itself.
  std::ofstream(dir / "tiny.bin") << "tiny";
  CHECK(test::contains(refusal(spec_of(dir / "tiny.bin")), "shorter than the 1024-byte header"));
}

TEST_CASE("a token file with bytes after its tokens is refused naming the file", "[data]") {
  ScratchFolder dir("shardswap-token-data");
  write_raw(dir / "long.bin", 20240520, 1, 50, random_tokens(50, 1000, 2), 2, 1);
  const auto msg = refusal(spec_of(dir / "long.bin"));
  CHECK(test::contains(
      msg, "data.train = \"" + (dir / "long.bin").string() + "\": trailing bytes: 1125 bytes"));
}

TEST_CASE("a token id not below the vocab is refused naming the file, index, id and vocab",
          "[data]") {
  ScratchFolder dir("shardswap-token-data");
  Tokens t = random_tokens(500, 1000, 3);
  t[321] = 1000;
  write_good(dir / "big.bin", t, 1);
  const auto msg = refusal(spec_of(dir / "big.bin"));
  CHECK(msg == "data.train = \"" + (dir / "big.bin").string() +
                   "\": token 1000 (at index 321) is not below the vocab size 1000");
  // Far into a uint32 file (past the first block of the scan), and an id beyond int32's range.
  Tokens wide = random_tokens(200000, 151936, 4);
  wide[150001] = 0xfffffff0u;
  write_good(dir / "wide.bin", wide, 2);
  CHECK(test::contains(refusal(spec_of(dir / "wide.bin", 151936)),
                       "token 4294967280 (at index 150001) is not below the vocab size 151936"));
  // The same file is fine for a larger vocab, and in data.val the key is data.val.
  write_good(dir / "ok.bin", random_tokens(500, 1000, 4), 2);
  auto spec = spec_of(dir / "ok.bin");
  spec.val = (dir / "big.bin").string();
  CHECK(test::contains(refusal(spec),
                       "data.val = \"" + (dir / "big.bin").string() + "\": token 1000"));
  spec.vocab = 1001;
  REQUIRE(TokenDataset(spec).has_val());
}

TEST_CASE("a glob that matches nothing is refused naming the pattern", "[data]") {
  ScratchFolder dir("shardswap-token-data");
  write_good(dir / "a.bin", random_tokens(100, 1000, 1), 1);
  const auto pattern = (dir / "*.tok").string();
  CHECK(refusal(spec_of(dir / "*.tok")) == "data.train = \"" + pattern + "\": no file matches");
  auto spec = spec_of(dir / "a.bin");
  spec.val = (dir / "val-*.bin").string();
  CHECK(refusal(spec) == "data.val = \"" + spec.val + "\": no file matches");
  CHECK(refusal(spec_of("")) == "data.train: is empty");
  // A plain path that does not exist says so.
  CHECK(refusal(spec_of(dir / "gone.bin")) ==
        "data.train = \"" + (dir / "gone.bin").string() + "\": no such file");
}

TEST_CASE("a directory or FIFO among the data files is refused as not a regular file", "[data]") {
  ScratchFolder dir("shardswap-token-data");
  write_good(dir / "a.bin", random_tokens(100, 1000, 1), 1);
  std::filesystem::create_directory(dir / "b.bin");
  auto msg = refusal(spec_of(dir / "*.bin"));
  CHECK(test::contains(msg,
                       "\"" + (dir / "b.bin").string() + "\": not a regular file (a directory)"));
  std::filesystem::remove(dir / "b.bin");
  REQUIRE(::mkfifo((dir / "c.bin").c_str(), 0600) == 0);
  msg = refusal(spec_of(dir / "*.bin"));  // must not block opening the FIFO
  CHECK(test::contains(msg, "\"" + (dir / "c.bin").string() + "\": not a regular file (a FIFO)"));
  auto bytes = spec_of(dir / "c.bin");
  bytes.bytes = true;
  bytes.vocab = 256;
  CHECK(test::contains(refusal(bytes), "not a regular file (a FIFO)"));
}

TEST_CASE("a training set too short for one window is refused naming data.train", "[data]") {
  ScratchFolder dir("shardswap-token-data");
  write_good(dir / "a.bin", random_tokens(4, 1000, 1), 1);  // seq_len 4 needs 5 tokens
  write_good(dir / "b.bin", random_tokens(0, 1000, 1), 2);
  const auto msg = refusal(spec_of(dir / "*.bin"));
  CHECK(test::contains(msg, "data.train = \"" + (dir / "*.bin").string() + "\": 4 tokens in 2"));
  CHECK(test::contains(msg, "seq_len + 1 = 5"));
}

TEST_CASE("glob matches are taken in bytewise name order", "[data]") {
  ScratchFolder dir("shardswap-token-data");
  for (const char* name : {"c10.bin", "B.bin", "c2.bin", "a.bin", "_x.bin"})
    write_good(dir / name, random_tokens(30, 1000, 1), 1);
  const TokenDataset d(spec_of(dir / "*.bin"));
  std::vector<std::string> want;
  for (const char* name : {"B.bin", "_x.bin", "a.bin", "c10.bin", "c2.bin"})
    want.push_back((dir / name).string());
  REQUIRE(d.train_files() == want);
}

TEST_CASE("packing cuts each file into seq_len + 1 windows at multiples of seq_len, in file order",
          "[data]") {
  const Corpus c;
  const TokenDataset d(c.spec());
  const auto want = reference_windows(c.train, Corpus::kSeqLen);
  REQUIRE(want.size() == 5 + 9 + 3);
  REQUIRE(d.train_samples() == static_cast<std::int64_t>(want.size()));
  REQUIRE(d.train_tokens() == d.train_samples() * Corpus::kSeqLen);
  for (std::size_t i = 0; i < want.size(); ++i) {
    const auto got = windows_of(d.train_sample(static_cast<std::int64_t>(i)));
    REQUIRE(got.size() == 1);
    REQUIRE(got[0] == want[i]);
  }
  CHECK_THROWS_AS(d.train_sample(d.train_samples()), ConfigError);
}

TEST_CASE("validation sequences are the validation windows in order and never wrap", "[data]") {
  const Corpus c;
  const TokenDataset d(c.spec());
  const auto want = reference_windows({c.val}, Corpus::kSeqLen);
  REQUIRE(d.val_samples() == 4);
  for (int first = 0; first < 4; ++first)
    for (int count = 1; first + count <= 4; ++count) {
      const auto got = windows_of(d.val_sequences(first, count));
      REQUIRE(got.size() == static_cast<std::size_t>(count));
      for (int i = 0; i < count; ++i) REQUIRE(got[i] == want[first + i]);
    }
  // Past the set, before it, or empty: refused, naming the set's size.
  for (const auto& [first, count] : {std::pair{3, 2}, {4, 1}, {-1, 1}, {0, 0}, {0, 5}})
    CHECK(test::contains(
        test::message_of<ConfigError>([&, f = first, n = count] { d.val_sequences(f, n); }),
        "validation set's 4 samples"));
  auto spec = c.spec();
  spec.val.clear();
  const TokenDataset no_val(spec);
  REQUIRE_FALSE(no_val.has_val());
  CHECK(test::contains(test::message_of<ConfigError>([&] { no_val.val_sequences(0, 1); }), "data.val"));
}

TEST_CASE("the shuffle is a bijection of 0 .. n-1 for every n tried", "[data]") {
  for (const std::int64_t n : {1, 2, 3, 4, 5, 7, 16, 17, 1000, 4096, 4097, 65537}) {
    for (const std::uint64_t seed : {0ull, 1ull, 0xdeadbeefull}) {
      for (const std::uint64_t epoch : {0ull, 1ull, 12345ull}) {
        std::vector<char> seen(static_cast<std::size_t>(n), 0);
        for (std::int64_t p = 0; p < n; ++p) {
          const auto q = shuffled_index(seed, epoch, p, n);
          REQUIRE(q >= 0);
          REQUIRE(q < n);
          REQUIRE(seen[static_cast<std::size_t>(q)] == 0);
          seen[static_cast<std::size_t>(q)] = 1;
        }
      }
    }
  }
  // Far beyond what a table could hold: still a value in range, the same on every call.
  const std::int64_t huge = (std::int64_t{1} << 62) + 12345;
  const auto q = shuffled_index(3, 4, huge - 1, huge);
  REQUIRE(q >= 0);
  REQUIRE(q < huge);
  REQUIRE(shuffled_index(3, 4, huge - 1, huge) == q);
  CHECK_THROWS_AS(shuffled_index(1, 0, 5, 5), ConfigError);
  CHECK_THROWS_AS(shuffled_index(1, 0, 0, 0), ConfigError);
}

TEST_CASE("the shuffle differs across epochs and seeds and is not the identity", "[data]") {
  constexpr std::int64_t n = 1000;
  const auto perm = [](std::uint64_t seed, std::uint64_t epoch) {
    std::vector<std::int64_t> p(n);
    for (std::int64_t i = 0; i < n; ++i) p[i] = shuffled_index(seed, epoch, i, n);
    return p;
  };
  const auto base = perm(1, 0);
  std::vector<std::int64_t> identity(n);
  for (std::int64_t i = 0; i < n; ++i) identity[i] = i;
  for (const auto& other : {perm(1, 1), perm(1, 2), perm(2, 0), identity}) {
    int same = 0;
    for (std::int64_t i = 0; i < n; ++i) same += base[i] == other[i];
    CHECK(same < 20);  // two independent permutations agree in about one place
  }
  REQUIRE(perm(1, 0) == base);  // a pure function of its arguments
}

TEST_CASE("every epoch draws each training sample exactly once", "[data]") {
  const Corpus c;
  const TokenDataset d(c.spec());
  const std::int64_t n = d.train_samples();
  for (std::int64_t e = 0; e < 3; ++e) {
    std::set<std::int64_t> seen;
    for (std::int64_t g = e * n; g < (e + 1) * n; ++g) seen.insert(d.sample_of_draw(g));
    REQUIRE(static_cast<std::int64_t>(seen.size()) == n);
    REQUIRE(*seen.rbegin() == n - 1);
  }
  std::vector<std::int64_t> e0, e1;
  for (std::int64_t g = 0; g < n; ++g) {
    e0.push_back(d.sample_of_draw(g));
    e1.push_back(d.sample_of_draw(n + g));
  }
  REQUIRE(e0 != e1);
  REQUIRE(d.epoch_of(0, 12) == 0);
  REQUIRE(d.epoch_of(1, 12) == 12 / n);
  REQUIRE(d.epoch_of(10, 12) == 120 / n);
}

TEST_CASE("the global batch of every step is the same at world sizes 1 to 4 and any micro split",
          "[data]") {
  const Corpus c;
  constexpr int g = 12;
  constexpr std::int64_t steps = 6;  // 72 draws over 17 samples: past four epoch boundaries
  // The expected batch, built from the plain packing and the draw rule of docs/data.md.
  const auto windows = reference_windows(c.train, Corpus::kSeqLen);
  const auto n = static_cast<std::int64_t>(windows.size());
  const auto expected = [&](std::int64_t step) {
    std::vector<Window> out;
    for (std::int64_t k = step * g; k < (step + 1) * g; ++k)
      out.push_back(windows[static_cast<std::size_t>(shuffled_index(7, k / n, k % n, n))]);
    return out;
  };
  // (world, micro-batch size): accumulation = g / world / micro.
  const std::vector<std::pair<int, int>> splits = {{1, 12}, {1, 6}, {1, 4}, {1, 1}, {2, 6}, {2, 3},
                                                   {2, 1},  {3, 4}, {3, 2}, {4, 3}, {4, 1}};
  for (std::int64_t step = 0; step < steps; ++step) {
    const auto want = expected(step);
    for (const auto& [world, micro] : splits) {
      const TokenDataset d(c.spec());  // each run opens its own, like a process would
      INFO("step " << step << ", world " << world << ", micro " << micro);
      const auto got = global_batch(d, step, g, world, micro);
      REQUIRE(got == want);  // order, and so the multiset too
    }
  }
  // The seed matters: another seed gives other batches.
  const TokenDataset other(c.spec(8));
  REQUIRE(global_batch(other, 0, g, 1, 12) != expected(0));
}

TEST_CASE("a run resumed at another world size continues on the same tokens", "[data]") {
  const Corpus c;
  constexpr int g = 12;
  constexpr std::int64_t k = 3, end = 8;  // saved after step 2; the epoch (17) ends mid-step 1
  const auto n = TokenDataset(c.spec()).train_samples();
  // The run at world 2 (micro 3, accumulation 2) up to step k - 1, then resumed at world 4
  // (micro 3) from a fresh dataset, as a new process would.
  std::vector<Window> resumed;
  {
    const TokenDataset d(c.spec());
    for (std::int64_t s = 0; s < k; ++s)
      for (auto& w : global_batch(d, s, g, 2, 3)) resumed.push_back(std::move(w));
  }
  {
    const TokenDataset d(c.spec());
    for (std::int64_t s = k; s < end; ++s)
      for (auto& w : global_batch(d, s, g, 4, 3)) resumed.push_back(std::move(w));
  }
  // The uninterrupted runs at world 4 and at world 2.
  std::vector<Window> straight4, straight2;
  const TokenDataset d(c.spec());
  for (std::int64_t s = 0; s < end; ++s) {
    for (auto& w : global_batch(d, s, g, 4, 3)) straight4.push_back(std::move(w));
    for (auto& w : global_batch(d, s, g, 2, 6)) straight2.push_back(std::move(w));
  }
  REQUIRE(resumed == straight4);
  // Against world 2's own continuation, step by step as sets of sequences (what reaches the
  // optimizer), although each rank holds other sequences at world 4 than at world 2.
  for (std::int64_t s = k; s < end; ++s) {
    const auto at = static_cast<std::ptrdiff_t>(s * g);
    std::multiset<Window> four(resumed.begin() + at, resumed.begin() + at + g);
    std::multiset<Window> two(straight2.begin() + at, straight2.begin() + at + g);
    REQUIRE(four == two);
    REQUIRE(windows_of(d.train_batch(s, g, 1, 4, 0, 3)) !=
            windows_of(d.train_batch(s, g, 1, 2, 0, 3)));
  }
  // Every epoch, the one across the save point (draws 34 to 50, saved at 36) included, holds
  // every window exactly once: nothing skipped, nothing repeated.
  const auto all = reference_windows(c.train, Corpus::kSeqLen);
  const std::multiset<Window> each(all.begin(), all.end());
  for (std::int64_t e = 0; (e + 1) * n <= end * g; ++e) {
    INFO("epoch " << e);
    REQUIRE(std::multiset<Window>(resumed.begin() + e * n, resumed.begin() + (e + 1) * n) == each);
  }
}

TEST_CASE("train_batch refuses a split that does not tile the global batch", "[data]") {
  const Corpus c;
  const TokenDataset d(c.spec());
  CHECK_THROWS_AS(d.train_batch(0, 12, 0, 5, 0, 1), ConfigError);  // 5 does not divide 12
  CHECK_THROWS_AS(d.train_batch(0, 12, 4, 4, 0, 3), ConfigError);  // rank beyond the world
  CHECK_THROWS_AS(d.train_batch(0, 12, 0, 4, 1, 3), ConfigError);  // past the rank's share
  CHECK_THROWS_AS(d.train_batch(-1, 12, 0, 1, 0, 1), ConfigError);
  CHECK_THROWS_AS(d.train_batch(0, 12, 0, 1, 0, 0), ConfigError);
  CHECK_THROWS_AS(d.train_batch(0, 12, 0, 1, 2147483647, 1), ConfigError);
  const auto msg = test::message_of<ConfigError>([&] { d.train_batch(0, 12, 0, 5, 0, 1); });
  CHECK(
      test::contains(msg, "TokenDataset::train_batch: step 0, global batch 12, rank 0 of world 5"));
  CHECK_THROWS_AS(d.train_batch(std::int64_t{1} << 61, 12, 0, 1, 0, 1), ConfigError);
}

TEST_CASE("the byte tokenizer packs a file's bytes and keeps a val_fraction tail", "[data]") {
  ScratchFolder dir("shardswap-token-data");
  const Tokens bytes = random_tokens(1003, 256, 11);
  {
    std::ofstream out(dir / "text.txt", std::ios::binary);
    for (const auto b : bytes) out.put(static_cast<char>(b));
  }
  TokenDataSpec spec = spec_of(dir / "text.txt", 300, 8);
  spec.bytes = true;
  spec.val_fraction = 0.25;
  const TokenDataset d(spec);
  const std::size_t val = 250;  // floor(1003 * 0.25)
  const Tokens train_part(bytes.begin(), bytes.end() - val),
      val_part(bytes.end() - val, bytes.end());
  const auto want_train = reference_windows({train_part}, 8);
  const auto want_val = reference_windows({val_part}, 8);
  REQUIRE(d.train_samples() == static_cast<std::int64_t>(want_train.size()));
  REQUIRE(d.val_samples() == static_cast<std::int64_t>(want_val.size()));
  for (std::size_t i = 0; i < want_train.size(); ++i)
    REQUIRE(windows_of(d.train_sample(static_cast<std::int64_t>(i)))[0] == want_train[i]);
  const auto v = windows_of(d.val_sequences(0, static_cast<int>(want_val.size())));
  REQUIRE(v == want_val);
  // Refusals: a vocab below 256, a val_fraction outside (0, 1), several files without data.val.
  spec.vocab = 255;
  CHECK(test::contains(refusal(spec), "data.tokenizer = \"bytes\""));
  spec.vocab = 256;
  spec.val_fraction = 1.0;
  CHECK(test::contains(refusal(spec), "data.val_fraction = 1"));
  spec.val_fraction = 0.1;
  std::filesystem::copy_file(dir / "text.txt", dir / "text2.txt");
  spec.train = (dir / "*.txt").string();
  CHECK(test::contains(refusal(spec), "2 files match"));
  // With data.val (not one of the training files), every training file is used whole.
  std::filesystem::copy_file(dir / "text.txt", dir / "held-out.dat");
  spec.val = (dir / "held-out.dat").string();
  const TokenDataset two(spec);
  REQUIRE(two.train_samples() == 2 * ((1003 - 1) / 8));
  REQUIRE(two.val_samples() == (1003 - 1) / 8);
  // Too small to split.
  spec = spec_of(dir / "text.txt", 256, 200);
  spec.bytes = true;
  CHECK(test::contains(refusal(spec), "too small"));
}

TEST_CASE("a validation file that data.train also matches is refused, under any spelling",
          "[data]") {
  const Corpus c;
  auto spec = c.spec();
  spec.val = (c.dir / "train-2.bin").string();
  std::string msg = refusal(spec);
  CHECK(test::contains(msg, "data.val = "));
  CHECK(test::contains(msg, "is also a training file"));
  CHECK(test::contains(msg, "train-2.bin"));
  // Another spelling of the path, and a hard link: the same file.
  spec.val = (c.dir / "." / "train-0.bin").string();
  CHECK(test::contains(refusal(spec), "is also a training file"));
  std::filesystem::create_hard_link(c.dir / "train-3.bin", c.dir / "held-out.bin");
  spec.val = (c.dir / "held-out.bin").string();
  msg = refusal(spec);
  CHECK(test::contains(msg, "held-out.bin"));
  CHECK(test::contains(msg, "train-3.bin"));
  // A copy is another file: accepted (its content is the user's business).
  std::filesystem::copy_file(c.dir / "train-3.bin", c.dir / "copy.bin");
  spec.val = (c.dir / "copy.bin").string();
  CHECK(TokenDataset(spec).val_samples() == 3);
}

TEST_CASE("an llm.c token file read with the byte tokenizer is refused, naming the tokenizer",
          "[data]") {
  const Corpus c;
  for (const char* name : {"train-0.bin", "train-1.bin"}) {  // versions 1 and 2
    INFO(name);
    TokenDataSpec spec;
    spec.train = (c.dir / name).string();
    spec.bytes = true;
    spec.seq_len = 4;
    spec.vocab = 256;
    const std::string msg = refusal(spec);
    CHECK(test::contains(msg, name));
    CHECK(test::contains(msg, "an llm.c token file"));
    CHECK(test::contains(msg, "data.tokenizer \"llmc\""));
  }
  // A file that starts with the magic but whose header does not explain its size is bytes.
  const auto path = c.dir / "looks-like.bin";
  {
    std::ofstream out(path, std::ios::binary);
    const std::int32_t header[3] = {kTokenFileMagic, 1, 1000};
    out.write(reinterpret_cast<const char*>(header), sizeof header);
    out << std::string(3000, 'x');
  }
  TokenDataSpec spec;
  spec.train = path.string();
  spec.bytes = true;
  spec.seq_len = 4;
  spec.vocab = 256;
  CHECK(TokenDataset(spec).train_samples() > 0);
}

TEST_CASE("data.documents: read from the config, apart refused for files that mark no documents",
          "[data]") {
  const ScratchFolder dir("shardswap-token-documents");
  std::vector<std::uint32_t> tokens(400, 7);
  write_token_file((dir / "plain.bin").string(), tokens, 1);
  write_token_file((dir / "marked.bin").string(), tokens, 1,
                   std::vector<std::uint8_t>(tokens.size(), kMaskTarget | kMaskDocumentStart));
  TokenDataSpec spec;
  spec.seq_len = 8;
  spec.vocab = 16;
  spec.train = (dir / "marked.bin").string();
  spec.val = (dir / "plain.bin").string();
  CHECK(!TokenDataset(spec).documents_apart());  // not every file marks its documents
  spec.documents_apart = true;
  CHECK(test::contains(refusal(spec), "data.documents = \"apart\": \"" +
                                          (dir / "plain.bin").string() + "\" marks no document"));
  spec.val.clear();
  CHECK(TokenDataset(spec).documents_apart());
  spec.documents_apart = false;
  CHECK(!TokenDataset(spec).documents_apart());
  spec.documents_apart = true;
  spec.bytes = true;
  spec.vocab = 256;
  std::ofstream(dir / "text.txt") << std::string(300, 'a');
  spec.train = (dir / "text.txt").string();
  CHECK(test::contains(refusal(spec), "data.documents = \"apart\": data.tokenizer = \"bytes\""));
  const auto read = [](const char* json) {
    ConfigReader c(nlohmann::json::parse(json), "config");
    return token_data_spec_from_json(c);
  };
  CHECK(!read(R"({"data": {"train": "x"}})").documents_apart.has_value());
  CHECK(*read(R"({"data": {"train": "x", "documents": "apart"}})").documents_apart);
  CHECK(!*read(R"({"data": {"train": "x", "documents": "packed"}})").documents_apart);
  CHECK(test::contains(test::message_of<ConfigError>(
                           [&] { read(R"({"data": {"train": "x", "documents": "split"}})"); }),
                       "data.documents"));
}

TEST_CASE("a token file with a loss mask: ignored targets where the mask says so, counted alike "
          "at every world size and split",
          "[data]") {
  const ScratchFolder dir("shardswap-token-mask");
  std::mt19937 rng(21);
  std::vector<std::uint32_t> tokens(2000);
  std::vector<std::uint8_t> mask(tokens.size());
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    tokens[i] = rng() % 500;
    // Runs of trained and untrained tokens, as a chat's answers and prompts make them.
    mask[i] = ((i / 37) % 3 == 0 ? 0 : kMaskTarget) | (i % 200 == 0 ? kMaskDocumentStart : 0);
  }
  for (const int version : {1, 2})
  for (const bool apart : {false, true}) {
    INFO("version " << version << (apart ? ", documents apart" : ", packed"));
    const auto path = dir / fmt::format("masked-{}.bin", version);
    write_token_file(path.string(), tokens, version, mask);
    TokenDataSpec spec;
    spec.train = path.string();
    spec.seq_len = 16;
    spec.vocab = 500;
    spec.seed = 3;
    // Apart is what a file that marks its documents gets when data.documents is not set.
    if (!apart) spec.documents_apart = false;
    const TokenDataset d(spec);
    REQUIRE(d.documents_apart() == apart);
    // Every sample's targets: the file's next tokens, ignored where the mask bit is clear and,
    // documents apart, where the next token starts a document; positions restart there.
    std::int64_t all = 0;
    for (std::int64_t s = 0; s < d.train_samples(); ++s) {
      const TokenSequences seq = d.train_sample(s);
      REQUIRE(seq.positions.size() == (apart ? std::size_t{16} : 0));
      for (int k = 0; k < spec.seq_len; ++k) {
        const std::size_t at = static_cast<std::size_t>(s * spec.seq_len + k + 1);
        const bool counted =
            (mask[at] & kMaskTarget) != 0 && !(apart && (mask[at] & kMaskDocumentStart) != 0);
        const std::int32_t want =
            counted ? static_cast<std::int32_t>(tokens[at]) : lm::dec::kIgnoredTarget;
        REQUIRE(seq.targets[static_cast<std::size_t>(k)] == want);
        REQUIRE(seq.inputs[static_cast<std::size_t>(k)] ==
                static_cast<std::int32_t>(tokens[at - 1]));
        if (!apart) continue;
        const bool starts = k == 0 || (mask[at - 1] & kMaskDocumentStart) != 0;
        REQUIRE(seq.positions[static_cast<std::size_t>(k)] ==
                (starts ? 0 : seq.positions[static_cast<std::size_t>(k - 1)] + 1));
      }
      all += seq.counted_targets();
    }
    REQUIRE(all > 0);
    REQUIRE(all < d.train_samples() * spec.seq_len);
    // The global batch's count is the sum of every rank's micro-batches, whatever the split.
    for (std::int64_t step = 0; step < 5; ++step) {
      const std::int64_t counted = d.counted_targets(step, 8);
      for (const int world : {1, 2, 4})
        for (const int micro : {1, 2}) {
          if (8 / world % micro != 0) continue;
          std::int64_t sum = 0;
          for (int rank = 0; rank < world; ++rank)
            for (int m = 0; m < 8 / world / micro; ++m)
              sum += d.train_batch(step, 8, rank, world, m, micro).counted_targets();
          REQUIRE(sum == counted);
        }
    }
  }
  // Without a mask every target counts.
  write_token_file((dir / "plain.bin").string(), tokens, 1);
  TokenDataSpec plain;
  plain.train = (dir / "plain.bin").string();
  plain.seq_len = 16;
  plain.vocab = 500;
  CHECK(TokenDataset(plain).counted_targets(0, 8) == 8 * 16);
  // A mask of another length is refused by the writer; flags the reader does not know, by it.
  CHECK(test::contains(test::message_of<ConfigError>([&] {
                         write_token_file((dir / "x.bin").string(), tokens, 1,
                                          std::span(mask).first(10));
                       }),
                       "10 mask bytes for 2000 tokens"));
  {
    std::fstream f(dir / "masked-1.bin", std::ios::in | std::ios::out | std::ios::binary);
    const std::int32_t flags = 3;
    f.seekp(12);
    f.write(reinterpret_cast<const char*>(&flags), 4);
  }
  plain.train = (dir / "masked-1.bin").string();
  CHECK(test::contains(refusal(plain), "header[3] = 3"));
  // Read as bytes, a masked token file is refused too.
  plain.train = (dir / "masked-2.bin").string();
  plain.bytes = true;
  plain.vocab = 256;
  CHECK(test::contains(refusal(plain), "an llm.c token file"));
}
