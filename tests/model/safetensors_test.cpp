// safetensors files and Hugging Face model folders: round trips of random tensors, the byte
// layout checked by a reader written here, every malformed file refused naming the file and the
// tensor, dtype conversion against a float64 reference of round-to-nearest-even, and model
// folders (one file or sharded) in and out, bit-exact.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "shardswap/error.h"
#include "tests/catch_compat.h"
#include "tests/support/scratch_folder.h"
#include "model/hf_checkpoint.h"
#include "model/safetensors.h"

using namespace shardswap;
using nlohmann::json;
using test::contains;
using test::message_of;
using test_support::ScratchFolder;
namespace fs = std::filesystem;

namespace {

// ---- a writer and a reader of the raw layout, independent of the code under test ----

struct Raw {
  std::string name, dtype;
  std::vector<std::int64_t> shape;
  std::vector<std::byte> data;
};

std::vector<std::byte> read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<char> c((std::istreambuf_iterator<char>(in)), {});
  std::vector<std::byte> out(c.size());
  if (!c.empty()) std::memcpy(out.data(), c.data(), c.size());
  return out;
}

void write_bytes(const fs::path& path, const std::vector<std::byte>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
  REQUIRE(out.good());
}

// An 8-byte little-endian size, `header` as given, then `data`.
std::vector<std::byte> raw_file(const std::string& header, const std::vector<std::byte>& data,
                                std::uint64_t declared) {
  std::vector<std::byte> out;
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<std::byte>((declared >> (8 * i)) & 0xff));
  for (const char c : header) out.push_back(static_cast<std::byte>(c));
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

// A well-formed file of `tensors`, their data in the given order, the header's entries sorted
// by name (the order of entries is free) and not padded (the data need not be aligned).
std::vector<std::byte> raw_file(const std::vector<Raw>& tensors, const json& metadata = nullptr) {
  json header = json::object();
  if (!metadata.is_null()) header["__metadata__"] = metadata;
  std::vector<std::byte> data;
  for (const auto& t : tensors) {
    header[t.name] = {{"dtype", t.dtype},
                      {"shape", t.shape},
                      {"data_offsets", {data.size(), data.size() + t.data.size()}}};
    data.insert(data.end(), t.data.begin(), t.data.end());
  }
  const std::string text = header.dump();
  return raw_file(text, data, text.size());
}

std::size_t width_of(const std::string& dtype) {
  if (dtype == "F64" || dtype == "I64") return 8;
  if (dtype == "F32" || dtype == "I32") return 4;
  if (dtype == "BF16" || dtype == "F16" || dtype == "I16") return 2;
  return 1;
}

std::int64_t numel(const std::vector<std::int64_t>& shape) {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

// Random finite values of `dtype`, as bytes: fp32 from a normal distribution; bf16 its top
// half; fp16 from random sign, exponent (normal range) and mantissa; other dtypes random bytes.
std::vector<std::byte> stored_values(std::mt19937_64& rng, const std::string& dtype,
                                     std::int64_t count) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<std::byte> out(static_cast<std::size_t>(count) * width_of(dtype));
  for (std::int64_t i = 0; i < count; ++i) {
    std::byte* p = out.data() + static_cast<std::size_t>(i) * width_of(dtype);
    if (dtype == "F32" || dtype == "BF16") {
      const float f = normal(rng) * 3.0f;
      std::uint32_t bits;
      std::memcpy(&bits, &f, 4);
      if (dtype == "F32") {
        std::memcpy(p, &bits, 4);
      } else {
        const std::uint16_t h = static_cast<std::uint16_t>(bits >> 16);
        std::memcpy(p, &h, 2);
      }
    } else if (dtype == "F16") {
      const auto r = rng();
      const std::uint16_t h = static_cast<std::uint16_t>(
          ((r & 1) << 15) | ((1 + (r >> 1) % 30) << 10) | ((r >> 8) & 1023));
      std::memcpy(p, &h, 2);
    } else {
      for (std::size_t b = 0; b < width_of(dtype); ++b) p[b] = static_cast<std::byte>(rng());
    }
  }
  return out;
}

double bf16_value(std::uint16_t h) {
  const std::uint32_t bits = std::uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

double f16_value(std::uint16_t h) {
  const int sign = h >> 15, exp = (h >> 10) & 31, frac = h & 1023;
  if (exp == 31) return frac ? NAN : (sign ? -INFINITY : INFINITY);
  const double v = exp == 0 ? std::ldexp(frac, -24) : std::ldexp(1024 + frac, exp - 25);
  return sign ? -v : v;
}

// x rounded to the nearest number of `precision` significant bits (nearest even on a tie),
// with subnormal spacing below 2^min_exponent: bf16 is (8, -126), fp16 (11, -14).
double round_to(double x, int precision, int min_exponent) {
  if (x == 0.0) return x;
  int e = 0;
  std::frexp(x, &e);  // x = m 2^e, 0.5 <= |m| < 1
  const int spacing = std::max(e - precision, min_exponent - precision + 1);
  return std::nearbyint(std::ldexp(x, -spacing)) * std::ldexp(1.0, spacing);
}

std::uint16_t u16(const std::byte* p) {
  std::uint16_t h;
  std::memcpy(&h, p, 2);
  return h;
}
float f32(const std::byte* p) {
  float f;
  std::memcpy(&f, p, 4);
  return f;
}

SafetensorsFile write_and_open(const fs::path& path, const std::vector<Raw>& tensors,
                               const std::map<std::string, std::string>& metadata = {}) {
  {
    OutputFile out("--out", path);
    std::vector<SafetensorsData> data;
    for (const auto& t : tensors) data.push_back({{t.name, t.dtype, t.shape}, t.data});
    write_safetensors(out, data, metadata);
  }
  return SafetensorsFile::open(path);
}

// The tensors of a file as its raw bytes say, checked the way the format's reference
// implementation checks them: the header size, a JSON object, each entry's size, and data
// covering the rest of the file without gap or overlap.
std::map<std::string, Raw> raw_read(const fs::path& path) {
  const auto bytes = read_bytes(path);
  REQUIRE(bytes.size() >= 8);
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | std::to_integer<std::uint64_t>(bytes[i]);
  REQUIRE(8 + n <= bytes.size());
  const json header = json::parse(reinterpret_cast<const char*>(bytes.data()) + 8,
                                  reinterpret_cast<const char*>(bytes.data()) + 8 + n);
  REQUIRE(header.is_object());
  std::map<std::string, Raw> out;
  std::vector<std::pair<std::uint64_t, std::uint64_t>> ranges;
  for (const auto& [name, e] : header.items()) {
    if (name == "__metadata__") continue;
    Raw t{name, e.at("dtype"), e.at("shape").get<std::vector<std::int64_t>>(), {}};
    const std::uint64_t begin = e.at("data_offsets")[0], end = e.at("data_offsets")[1];
    REQUIRE(end - begin == static_cast<std::uint64_t>(numel(t.shape)) * width_of(t.dtype));
    REQUIRE(8 + n + end <= bytes.size());
    t.data.assign(bytes.begin() + static_cast<std::ptrdiff_t>(8 + n + begin),
                  bytes.begin() + static_cast<std::ptrdiff_t>(8 + n + end));
    ranges.emplace_back(begin, end);
    out[name] = std::move(t);
  }
  std::sort(ranges.begin(), ranges.end());
  std::uint64_t at = 0;
  for (const auto& [b, e] : ranges) {
    REQUIRE(b == at);
    at = e;
  }
  REQUIRE(8 + n + at == bytes.size());
  return out;
}

std::string refusal_of(const fs::path& path) {
  return message_of<ConfigError>([&] { SafetensorsFile::open(path); });
}

}  // namespace

TEST_CASE("random tensors of every dtype round-trip through the writer and the reader", "[hf]") {
  std::mt19937_64 rng(7);
  const ScratchFolder folder("safetensors");
  std::vector<Raw> tensors;
  for (const std::string dtype : {"F32", "BF16", "F16", "I64", "U8", "F64", "I32"})
    for (const std::vector<std::int64_t>& shape :
         std::vector<std::vector<std::int64_t>>{{3, 5}, {7}, {2, 3, 2}}) {
      tensors.push_back({fmt::format("t.{}.{}", dtype, tensors.size()), dtype, shape, {}});
      tensors.back().data = stored_values(rng, dtype, numel(shape));
    }
  tensors.push_back({"scalar", "F32", {}, stored_values(rng, "F32", 1)});
  tensors.push_back({"empty", "BF16", {4, 0}, {}});
  const auto file =
      write_and_open(folder / "a.safetensors", tensors, {{"format", "pt"}, {"note", "x y"}});
  REQUIRE(file.tensors().size() == tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const auto& got = file.tensors()[i];  // in the order of the data: the order written
    const auto& want = tensors[i];
    CHECK(got.name == want.name);
    CHECK(got.dtype == want.dtype);
    CHECK(got.shape == want.shape);
    REQUIRE(got.bytes == want.data.size());
    // (An empty tensor has no bytes to compare: memcmp must not see an empty vector's null data.)
    if (got.bytes > 0) CHECK(std::memcmp(got.data, want.data.data(), got.bytes) == 0);
    CHECK(file.find(want.name) == &got);
  }
  CHECK(file.find("absent") == nullptr);
  CHECK(file.metadata() == std::map<std::string, std::string>{{"format", "pt"}, {"note", "x y"}});
}

TEST_CASE("the written file has the documented byte layout, checked byte by byte", "[hf]") {
  std::mt19937_64 rng(8);
  const ScratchFolder folder("safetensors");
  const std::vector<Raw> tensors = {{"b.weight", "BF16", {3, 2}, stored_values(rng, "BF16", 6)},
                                    {"a.weight", "F32", {5}, stored_values(rng, "F32", 5)}};
  write_and_open(folder / "x.safetensors", tensors, {{"format", "pt"}});
  const auto bytes = read_bytes(folder / "x.safetensors");
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | std::to_integer<std::uint64_t>(bytes[i]);
  REQUIRE(8 + n <= bytes.size());
  CHECK((8 + n) % 8 == 0);  // the data starts 8-byte aligned
  const std::string header(reinterpret_cast<const char*>(bytes.data()) + 8, n);
  const std::string expected_json =
      R"({"__metadata__":{"format":"pt"},"b.weight":{"dtype":"BF16","shape":[3,2],)"
      R"("data_offsets":[0,12]},"a.weight":{"dtype":"F32","shape":[5],"data_offsets":[12,32]}})";
  CHECK(header.substr(0, expected_json.size()) == expected_json);
  CHECK(header.find_first_not_of(' ', expected_json.size()) == std::string::npos);
  CHECK(bytes.size() == 8 + n + 32);
  CHECK(std::memcmp(bytes.data() + 8 + n, tensors[0].data.data(), 12) == 0);
  CHECK(std::memcmp(bytes.data() + 8 + n + 12, tensors[1].data.data(), 20) == 0);
}

TEST_CASE("a file written elsewhere, entries out of order and data unaligned, reads right",
          "[hf]") {
  std::mt19937_64 rng(9);
  const ScratchFolder folder("safetensors");
  const std::vector<Raw> tensors = {{"z", "F16", {3}, stored_values(rng, "F16", 3)},
                                    {"a", "F32", {2, 2}, stored_values(rng, "F32", 4)}};
  write_bytes(folder / "w.safetensors", raw_file(tensors, {{"k", "v"}}));
  const auto file = SafetensorsFile::open(folder / "w.safetensors");
  REQUIRE(file.tensors().size() == 2);
  CHECK(file.tensors()[0].name == "z");
  CHECK(std::memcmp(file.find("a")->data, tensors[1].data.data(), 16) == 0);
  CHECK(file.metadata().at("k") == "v");
}

TEST_CASE("every malformed safetensors file is refused naming the file and the tensor", "[hf]") {
  std::mt19937_64 rng(10);
  const ScratchFolder folder("safetensors");
  const auto path = folder / "bad.safetensors";
  const std::string where = "safetensors file '" + path.string() + "': ";
  const auto refused = [&](const std::vector<std::byte>& bytes) {
    write_bytes(path, bytes);
    return refusal_of(path);
  };
  const std::vector<Raw> good = {{"w", "F32", {2, 3}, stored_values(rng, "F32", 6)},
                                 {"b", "BF16", {3}, stored_values(rng, "BF16", 3)}};
  const auto whole = raw_file(good);
  const auto data = std::vector<std::byte>(good[0].data.begin(), good[0].data.end());
  const auto header = [](const std::string& h, std::vector<std::byte> d) {
    return raw_file(h, d, h.size());
  };
  const std::vector<std::byte> d30(30, std::byte{1});

  CHECK(refusal_of(folder / "none.safetensors") ==
        "safetensors file '" + (folder / "none.safetensors").string() + "': no such file");
  CHECK(contains(refusal_of(folder.path()), "not a regular file (a directory)"));
  CHECK(refused({std::byte{1}, std::byte{0}}) ==
        where + "2 bytes: too short for the 8-byte header size");
  // Truncated: the last tensor's data runs past the end.
  auto truncated = whole;
  truncated.pop_back();
  CHECK(refused(truncated) ==
        where + "tensor \"b\": data_offsets [24, 30]: beyond the 29 bytes of data in the file");
  // Trailing bytes nobody owns.
  auto longer = whole;
  longer.push_back(std::byte{0});
  CHECK(contains(refused(longer), "the tensors' data ends at byte 30 of the 31 bytes"));
  CHECK(contains(refused(raw_file("{}", {}, 1000)), where + "header size 1000 is beyond the file"));
  CHECK(contains(refused(raw_file("{}", {}, 200ull << 20)), "is above the limit of 104857600"));
  CHECK(contains(refused(header("{\"w\": [", {})), where + "the header, at 1:8: not valid JSON: "));
  CHECK(contains(refused(header("", {})), where + "the header, at 1:1: not valid JSON: "));
  CHECK(refused(header("[1, 2]", {})) == where + "the header is not a JSON object");
  CHECK(refused(header(R"({"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},)"
                       R"("b":{"dtype":"F32","shape":[2],"data_offsets":[20,28]}})",
                       d30)) ==
        where + "tensor \"b\": data_offsets [20, 28] overlap those of \"w\" (ending at 24)");
  CHECK(
      contains(refused(header(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                              std::vector<std::byte>(8))),
               where + "tensor \"w\": data_offsets [4, 8] leave bytes [0, 4) of the data unused"));
  CHECK(refused(header(R"({"w":{"dtype":"Q7","shape":[1],"data_offsets":[0,1]}})",
                       std::vector<std::byte>(1))) ==
        where + "tensor \"w\": dtype \"Q7\" is not one this reader knows");
  CHECK(contains(refused(header(R"({"w":{"dtype":"F4","shape":[2],"data_offsets":[0,1]}})",
                                std::vector<std::byte>(1))),
                 "tensor \"w\": dtype \"F4\" is not one"));
  CHECK(refused(header(R"({"w":{"dtype":"F32","shape":[2,4],"data_offsets":[0,30]}})", d30)) ==
        where +
            "tensor \"w\": shape [2, 4] of F32 (4 bytes an element) does not fill "
            "data_offsets [0, 30] (30 bytes)");
  CHECK(contains(refused(header(R"({"w":{"dtype":"U8","shape":[4611686018427387904,8],)"
                                R"("data_offsets":[0,30]}})",
                                d30)),
                 "tensor \"w\": shape [4611686018427387904, 8] of U8"));
  CHECK(
      contains(refused(header(R"({"w":{"dtype":"U8","shape":[-30],"data_offsets":[0,30]}})", d30)),
               "tensor \"w\": shape [-30]: not all integers >= 0"));
  CHECK(contains(refused(header(R"({"w":{"dtype":"U8","shape":[30],"data_offsets":[30,0]}})", d30)),
                 "tensor \"w\": data_offsets [30, 0]: end before begin"));
  CHECK(contains(refused(header(R"({"w":{"dtype":"U8","shape":[30],"data_offsets":[0]}})", d30)),
                 "tensor \"w\": data_offsets [0]: not [begin, end]"));
  CHECK(contains(refused(header(R"({"w":{"shape":[30],"data_offsets":[0,30]}})", d30)),
                 "tensor \"w\": dtype missing"));
  CHECK(contains(
      refused(header(R"({"w":{"dtype":"U8","shape":[30],"data_offsets":[0,30],"x":1}})", d30)),
      "tensor \"w\": unknown field \"x\""));
  CHECK(contains(refused(header(R"({"w":{"dtype":"U8","shape":[15],"data_offsets":[0,15]},)"
                                R"("w":{"dtype":"U8","shape":[15],"data_offsets":[15,30]}})",
                                d30)),
                 "tensor \"w\": named twice in the header"));
  CHECK(contains(refused(header(R"({"__metadata__":{"a":1}})", {})),
                 where + "__metadata__ \"a\" is not a string"));
  CHECK(contains(refused(header(R"({"w":7})", {})), "tensor \"w\": its entry is not an object"));
  // A refused file leaves nothing mapped behind the caller's back; the good file still opens.
  write_bytes(path, whole);
  CHECK(SafetensorsFile::open(path).tensors().size() == 2);
}

TEST_CASE("a header holding a list of a million empty objects is refused in under a second",
          "[hf]") {
  // Valid JSON, 3 MB: the callback parser the reader used took minutes (quadratic in the list).
  const ScratchFolder folder("safetensors");
  const auto path = folder / "list.safetensors";
  std::string list = "[";
  for (int i = 0; i < 1'000'000; ++i) list += i == 0 ? "{}" : ",{}";
  list += "]";
  // Its lists are short by nature (a shape, data_offsets): one is refused once it grows past
  // 1024 elements, before the rest is built.
  for (const auto& [header, why] :
       {std::pair<std::string, std::string>{
            list,
            "the header, at 1:1: a list of more than 1024 elements, the most a safetensors "
            "header may have"},
        {R"({"w": )" + list + "}",
         "the header, at 1:7: w: a list of more than 1024 elements, the most a safetensors header "
         "may have"}}) {
    write_bytes(path, raw_file(header, {}, header.size()));
    const auto start = std::chrono::steady_clock::now();
    const auto m = refusal_of(path);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    CAPTURE(m, seconds);
    CHECK(m == "safetensors file '" + path.string() + "': " + why);
    CHECK(seconds < 1.0);
  }
}

TEST_CASE(
    "a header nested too deep, repeating a key inside an entry or holding a NUL is refused "
    "naming where",
    "[hf]") {
  const ScratchFolder folder("safetensors");
  const auto path = folder / "h.safetensors";
  const std::string where = "safetensors file '" + path.string() + "': ";
  const auto refused = [&](const std::string& header) {
    write_bytes(path, raw_file(header, {}, header.size()));
    return refusal_of(path);
  };
  const std::string deep =
      R"({"w": )" + std::string(100'000, '[') + std::string(100'000, ']') + "}";
  // A list of 1024 objects is within the limit of list lengths: read, then refused as no entry.
  std::string list = R"({"w": [{})";
  for (int i = 1; i < 1024; ++i) list += ",{}";
  CHECK(refused(list + "]}") == where + "tensor \"w\": its entry is not an object");
  CHECK(refused(deep) == where +
                             "the header, at 1:14: w[0][0][0][0][0][0][0]: nested "
                             "deeper than 8 levels of objects and lists, the most a "
                             "safetensors header may have");
  // A name repeated at the top level names the tensor; inside an entry, the field.
  CHECK(refused(R"({"w": {}, "w": {}})") == where + "tensor \"w\": named twice in the header");
  CHECK(refused(R"({"w": {"dtype": "F32", "dtype": "F16"}})") ==
        where + "the header, at 1:24: w.dtype: the key 'dtype' appears twice in w");
  // JSON holds no NUL: the text after one is not ignored (the parser took it for the end).
  std::string nul = R"({"__metadata__": {}})";
  nul += std::string(1, '\0') + "garbage";
  CHECK(refused(nul) == where +
                            "the header, at 1:21: not valid JSON: a NUL byte (JSON text holds "
                            "none)");
}

TEST_CASE("the safetensors writer refuses bad entries and short data, leaving no file", "[hf]") {
  const ScratchFolder folder("safetensors");
  const auto target = folder / "out.safetensors";
  std::vector<std::byte> four(4);
  const auto attempt = [&](std::vector<SafetensorsData> tensors) {
    OutputFile out("--out", target);
    write_safetensors(out, tensors, {});
  };
  CHECK(contains(message_of<ConfigError>([&] {
                   attempt({{{"a", "F32", {1}}, four}, {{"a", "F32", {1}}, four}});
                 }),
                 "write_safetensors '" + target.string() + "': tensor \"a\": named twice"));
  CHECK(contains(message_of<ConfigError>([&] {
                   attempt({{{"a", "F5", {1}}, four}});
                 }),
                 "tensor \"a\": unknown dtype \"F5\""));
  CHECK(contains(message_of<ConfigError>([&] {
                   attempt({{{"a", "F32", {-1}}, four}});
                 }),
                 "tensor \"a\": shape [-1] has a negative size"));
  CHECK(contains(message_of<ConfigError>([&] {
                   attempt({{{"__metadata__", "F32", {1}}, four}});
                 }),
                 "not a name a tensor can have"));
  CHECK(contains(message_of<ConfigError>([&] {
                   attempt({{{"\xff", "F32", {1}}, four}});
                 }),
                 "not UTF-8"));
  CHECK(contains(message_of<Error>([&] {
                   attempt({{{"a", "F32", {2}}, four}});
                 }),
                 "tensor \"a\": 4 bytes given, its header says 8"));
  CHECK(folder.names().empty());  // neither the target nor a temporary
}

TEST_CASE("conversion is bit-exact between equal dtypes and rounds to nearest even when narrowing",
          "[hf]") {
  std::mt19937_64 rng(11);
  const fs::path file = "/x/model.safetensors";
  const int n = 4000;
  // fp32 values: random, plus exact ties of bf16 and of fp16 and values near fp16's limits.
  std::vector<std::byte> f32_data = stored_values(rng, "F32", n);
  for (int i = 0; i < 200; ++i) {
    // Within fp16's range, as the same values are narrowed to fp16 too.
    std::uint32_t bits = (static_cast<std::uint32_t>(rng() % 0x1700) + 0x3000) << 16 | 0x8000;
    std::memcpy(f32_data.data() + 4 * i, &bits, 4);  // halfway between two bf16 values
    const auto h = static_cast<std::uint16_t>(((rng() % 29) + 1) << 10 | (rng() & 1023));
    const float tie = static_cast<float>((f16_value(h) + f16_value(h + 1)) / 2);
    std::memcpy(f32_data.data() + 4 * (200 + i), &tie, 4);
    const float tiny = static_cast<float>(std::ldexp(static_cast<double>(rng() % 5000), -30));
    std::memcpy(f32_data.data() + 4 * (400 + i), &tiny, 4);  // fp16 subnormals
  }
  const float big = 65519.0f;  // rounds down to 65504, fp16's largest
  std::memcpy(f32_data.data() + 4 * 600, &big, 4);
  const SafetensorsTensor f32_src{"w", "F32", {n}, f32_data.data(), f32_data.size()};

  std::vector<std::byte> to_bf16(2 * n), to_f16(2 * n), to_f32(4 * n);
  convert_tensor(f32_src, file, DType::bf16, to_bf16);
  convert_tensor(f32_src, file, DType::f16, to_f16);
  convert_tensor(f32_src, file, DType::f32, to_f32);
  CHECK(to_f32 == f32_data);
  int mismatches = 0;
  for (int i = 0; i < n; ++i) {
    const double x = f32(f32_data.data() + 4 * i);
    mismatches += bf16_value(u16(to_bf16.data() + 2 * i)) != round_to(x, 8, -126);
    mismatches += f16_value(u16(to_f16.data() + 2 * i)) != round_to(x, 11, -14);
  }
  CHECK(mismatches == 0);
  CHECK(f16_value(u16(to_f16.data() + 2 * 600)) == 65504.0);

  // Widening is exact; bit16 to the other bit16 is one rounding of the exact value.
  for (const std::string dtype : {"BF16", "F16"}) {
    const auto data = stored_values(rng, dtype, n);
    const SafetensorsTensor src{"h", dtype, {n / 2, 2}, data.data(), data.size()};
    std::vector<std::byte> wide(4 * n), same(2 * n), other(2 * n);
    convert_tensor(src, file, DType::f32, wide);
    convert_tensor(src, file, dtype == "BF16" ? DType::bf16 : DType::f16, same);
    convert_tensor(src, file, dtype == "BF16" ? DType::f16 : DType::bf16, other);
    CHECK(same == data);
    mismatches = 0;
    for (int i = 0; i < n; ++i) {
      const double x = dtype == "BF16" ? bf16_value(u16(data.data() + 2 * i))
                                       : f16_value(u16(data.data() + 2 * i));
      mismatches += f32(wide.data() + 4 * i) != x;
      const double y = dtype == "BF16" ? f16_value(u16(other.data() + 2 * i))
                                       : bf16_value(u16(other.data() + 2 * i));
      const double want = dtype == "BF16" ? round_to(x, 11, -14) : round_to(x, 8, -126);
      // bf16 values beyond fp16's range are refused as a whole; none at scale 3.
      mismatches += y != want;
    }
    CHECK(mismatches == 0);
  }
}

TEST_CASE("a conversion that cannot be done is refused, naming the tensor, writing nothing",
          "[hf]") {
  const fs::path file = "/x/model-00001-of-00002.safetensors";
  std::vector<float> values = {1.0f, -2.5f, 70000.0f, 3.0f};
  std::vector<std::byte> data(16);
  std::memcpy(data.data(), values.data(), 16);
  const SafetensorsTensor src{"model.norm.weight", "F32", {4}, data.data(), 16};
  std::vector<std::byte> out(8, std::byte{0x5a});
  const auto before = out;
  CHECK(message_of<ConfigError>([&] { convert_tensor(src, file, DType::f16, out); }) ==
        "convert_tensor: tensor \"model.norm.weight\" in '" + file.string() +
            "': element 2 = 70000 is beyond fp16's range");
  CHECK(out == before);
  std::vector<std::byte> small(6);
  CHECK(contains(message_of<ConfigError>([&] { convert_tensor(src, file, DType::bf16, small); }),
                 "4 elements of bf16 are 8 bytes, the destination holds 6"));
  const SafetensorsTensor ints{"ids", "I8", {4}, data.data(), 4};
  CHECK(contains(
      message_of<ConfigError>([&] { convert_tensor(ints, file, DType::bf16, out); }),
      "tensor \"ids\" in '" + file.string() + "': stored as I8; supported: BF16, F16, F32"));
}

// ---- model folders ----

namespace {

json tiny_config(const std::string& model_type, bool tied) {
  return {{"architectures", {"X"}},
          {"model_type", model_type},
          {"vocab_size", 11},
          {"hidden_size", 8},
          {"intermediate_size", 12},
          {"num_hidden_layers", 2},
          {"num_attention_heads", 2},
          {"num_key_value_heads", 1},
          {"max_position_embeddings", 64},
          {"rope_theta", 10000.0},
          {"tie_word_embeddings", tied},
          {"torch_dtype", "bfloat16"},
          {"bos_token_id", 1},
          {"transformers_version", "4.45.0"}};
}

// The params of tiny_config, written out by hand from the Hugging Face modules (independent of
// decoder_params): hidden 8, 2 heads of 4 (q 8 wide), 1 kv head (4 wide), intermediate 12.
std::vector<std::pair<std::string, std::vector<std::int64_t>>> tiny_params(bool bias, bool tied) {
  std::vector<std::pair<std::string, std::vector<std::int64_t>>> p = {
      {"model.embed_tokens.weight", {11, 8}}};
  for (int l = 0; l < 2; ++l) {
    const std::string a = "model.layers." + std::to_string(l) + ".";
    p.push_back({a + "input_layernorm.weight", {8}});
    p.push_back({a + "self_attn.q_proj.weight", {8, 8}});
    if (bias) p.push_back({a + "self_attn.q_proj.bias", {8}});
    p.push_back({a + "self_attn.k_proj.weight", {4, 8}});
    if (bias) p.push_back({a + "self_attn.k_proj.bias", {4}});
    p.push_back({a + "self_attn.v_proj.weight", {4, 8}});
    if (bias) p.push_back({a + "self_attn.v_proj.bias", {4}});
    p.push_back({a + "self_attn.o_proj.weight", {8, 8}});
    p.push_back({a + "post_attention_layernorm.weight", {8}});
    p.push_back({a + "mlp.gate_proj.weight", {12, 8}});
    p.push_back({a + "mlp.up_proj.weight", {12, 8}});
    p.push_back({a + "mlp.down_proj.weight", {8, 12}});
  }
  p.push_back({"model.norm.weight", {8}});
  if (!tied) p.push_back({"lm_head.weight", {11, 8}});
  return p;
}

std::vector<Raw> random_params(std::mt19937_64& rng, bool bias, bool tied,
                               const std::string& dtype = "BF16") {
  std::vector<Raw> out;
  for (const auto& [name, shape] : tiny_params(bias, tied))
    out.push_back({name, dtype, shape, stored_values(rng, dtype, numel(shape))});
  return out;
}

void write_config(const fs::path& folder, const json& config) {
  std::ofstream(folder / "config.json") << config.dump(2);
}

// A folder with config.json and `tensors` split over files by `shard_of` (one file,
// model.safetensors, when it is empty), and the index listing them.
void write_folder(const fs::path& folder, const json& config, const std::vector<Raw>& tensors,
                  const std::function<int(std::size_t)>& shard_of = {}) {
  fs::create_directories(folder);
  write_config(folder, config);
  if (!shard_of) {
    write_bytes(folder / "model.safetensors", raw_file(tensors));
    return;
  }
  std::map<int, std::vector<Raw>> shards;
  json map = json::object();
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    shards[shard_of(i)].push_back(tensors[i]);
    map[tensors[i].name] = fmt::format("part-{}.safetensors", shard_of(i));
  }
  for (const auto& [k, ts] : shards)
    write_bytes(folder / fmt::format("part-{}.safetensors", k), raw_file(ts));
  std::ofstream(folder / "model.safetensors.index.json")
      << json{{"metadata", {{"total_size", 1}}}, {"weight_map", map}}.dump();
}

void check_holds(const HfCheckpoint& ck, const std::vector<Raw>& tensors) {
  for (const auto& t : tensors) {
    const auto& got = ck.tensor(t.name);
    CHECK(got.dtype == t.dtype);
    CHECK(got.shape == t.shape);
    REQUIRE(got.bytes == t.data.size());
    CHECK(std::memcmp(got.data, t.data.data(), got.bytes) == 0);
  }
}

const HfSeqLen kSeq{32, "data.seq_len"};

std::string open_refusal(const fs::path& folder) {
  return message_of<ConfigError>([&] { HfCheckpoint::open(folder, kSeq); });
}

}  // namespace

TEST_CASE("the expected tensors are the Hugging Face params in declaration order", "[hf]") {
  for (const bool bias : {false, true})
    for (const bool tied : {false, true}) {
      const auto s =
          hf_config_from_json(tiny_config(bias ? "qwen2" : "llama", tied), {{}, "model."}, kSeq)
              .shape;
      const auto specs = decoder_params(s);
      const auto want = tiny_params(bias, tied);
      REQUIRE(specs.size() == want.size());
      for (std::size_t i = 0; i < specs.size(); ++i) {
        CHECK(specs[i].name == want[i].first);
        CHECK(specs[i].shape == want[i].second);
        CHECK(decoder_param_name(specs[i].id) == specs[i].name);
      }
    }
}

TEST_CASE("a model folder in one file opens with every param in place", "[hf]") {
  std::mt19937_64 rng(12);
  const ScratchFolder root("hf-folder");
  for (const bool tied : {false, true}) {
    const auto folder = root / (tied ? "tied" : "untied");
    auto tensors = random_params(rng, true, tied);
    std::shuffle(tensors.begin(), tensors.end(), rng);  // file order is free
    auto stored = tensors;
    // A buffer older transformers saved is ignored.
    stored.push_back(
        {"model.layers.0.self_attn.rotary_emb.inv_freq", "F32", {2}, stored_values(rng, "F32", 2)});
    write_folder(folder, tiny_config("qwen2", tied), stored);
    const auto ck = HfCheckpoint::open(folder, kSeq);
    CHECK(ck.shape().qkv_bias);
    CHECK(ck.shape().tied == tied);
    CHECK(ck.files() == std::vector<fs::path>{folder / "model.safetensors"});
    check_holds(ck, tensors);
    CHECK(ck.file_of("model.norm.weight") == folder / "model.safetensors");
    CHECK(contains(
        message_of<ConfigError>([&] { ck.tensor("model.layers.0.self_attn.rotary_emb.inv_freq"); }),
        "is not a param of the model"));
  }
}

TEST_CASE("a sharded folder opens when its index and the files' headers agree", "[hf]") {
  std::mt19937_64 rng(13);
  const ScratchFolder root("hf-folder");
  const auto tensors = random_params(rng, false, false, "F16");
  const auto folder = root / "sharded";
  write_folder(folder, tiny_config("llama", false), tensors, [](std::size_t i) { return i % 3; });
  const auto ck = HfCheckpoint::open(folder, kSeq);
  CHECK(ck.files().size() == 3);
  check_holds(ck, tensors);
  CHECK(ck.file_of(tensors[4].name) == folder / "part-1.safetensors");

  const auto index = folder / "model.safetensors.index.json";
  const json good = json::parse(std::ifstream(index));
  const auto with_index = [&](const json& j) {
    std::ofstream(index, std::ios::trunc) << j.dump();
    return open_refusal(folder);
  };
  json j = good;
  j["weight_map"][tensors[4].name] = "part-2.safetensors";
  CHECK(with_index(j) == index.string() + ": tensor \"" + tensors[4].name +
                             "\" is mapped to 'part-2.safetensors', whose header does not hold it");
  j = good;
  j["weight_map"].erase(tensors[4].name);
  CHECK(with_index(j) == index.string() + ": 'part-1.safetensors' holds tensor \"" +
                             tensors[4].name + "\", which the weight_map does not list");
  j = good;
  j["weight_map"][tensors[4].name] = "part-9.safetensors";
  CHECK(contains(with_index(j), (folder / "part-9.safetensors").string() + "': no such file"));
  j["weight_map"][tensors[4].name] = "../part-1.safetensors";
  CHECK(contains(with_index(j), "not a file name in the folder"));
  CHECK(contains(with_index(json::array()), "not an object with a \"weight_map\" object"));
  std::ofstream(index, std::ios::trunc) << "{";
  CHECK(contains(open_refusal(folder), index.string() + ":1:2: not valid JSON: "));
  // Refused from its size, before it is read (it was read whole, however large).
  std::filesystem::resize_file(index, (std::uintmax_t{64} << 20) + 1);
  CHECK(contains(open_refusal(folder), index.string() +
                                           ": larger than 64 MiB (67108864 bytes), the "
                                           "most a safetensors index may hold"));
  std::ofstream(index, std::ios::trunc) << good.dump();
  write_bytes(folder / "model.safetensors", raw_file({}));
  CHECK(contains(open_refusal(folder),
                 "holds both model.safetensors and "
                 "model.safetensors.index.json"));
  fs::remove(folder / "model.safetensors");
  fs::remove(index);
  CHECK(contains(open_refusal(folder), "holds neither model.safetensors nor"));
  CHECK(contains(open_refusal(root / "absent"),
                 "'" + (root / "absent").string() + "': no such folder"));
}

TEST_CASE("a missing, extra, mis-shaped or wrongly typed tensor is refused naming it", "[hf]") {
  std::mt19937_64 rng(14);
  const ScratchFolder root("hf-folder");
  const auto folder = root / "m";
  const auto config = tiny_config("llama", false);
  const auto tensors = random_params(rng, false, false);
  const auto file = (folder / "model.safetensors").string();
  const auto refused = [&](std::vector<Raw> ts) {
    fs::remove_all(folder);
    write_folder(folder, config, ts);
    return open_refusal(folder);
  };
  auto ts = tensors;
  ts.erase(ts.begin() + 5);
  CHECK(refused(ts) == "Hugging Face model folder '" + folder.string() +
                           "': 1 tensor of the model missing: \"" + tensors[5].name + "\"");
  ts = tensors;
  ts.pop_back();
  ts.erase(ts.begin());
  CHECK(contains(refused(ts),
                 "2 tensors of the model missing: \"model.embed_tokens.weight\", "
                 "\"lm_head.weight\""));
  ts = tensors;
  ts.push_back(
      {"model.layers.0.self_attn.q_proj.bias", "BF16", {8}, stored_values(rng, "BF16", 8)});
  CHECK(contains(refused(ts), "tensor \"model.layers.0.self_attn.q_proj.bias\" in '" + file +
                                  "' is no param of the model config.json describes"));
  ts = tensors;
  ts.push_back(
      {"model.layers.2.input_layernorm.weight", "BF16", {8}, stored_values(rng, "BF16", 8)});
  CHECK(contains(refused(ts), "tensor \"model.layers.2.input_layernorm.weight\""));
  ts = tensors;
  ts[3].shape = {4, 4, 2};
  CHECK(contains(refused(ts), "tensor \"" + tensors[3].name + "\" in '" + file +
                                  "': shape [4, 4, 2], config.json makes it [4, 8]"));
  ts = tensors;
  ts[2] = {ts[2].name, "I16", ts[2].shape, ts[2].data};
  CHECK(contains(refused(ts), "tensor \"" + tensors[2].name + "\" in '" + file +
                                  "': stored as I16; supported: BF16, F16, F32"));
  // config.json refusals come first, naming the file.
  fs::remove_all(folder);
  json gpt2 = config;
  gpt2["model_type"] = "gpt2";
  write_folder(folder, gpt2, tensors);
  CHECK(contains(open_refusal(folder),
                 (folder / "config.json").string() + " 'model_type' = \"gpt2\""));
  fs::remove(folder / "config.json");
  CHECK(contains(open_refusal(folder), (folder / "config.json").string() + ": no such file"));
}

TEST_CASE("a tied model's stored lm_head is accepted only as an exact copy of the embedding",
          "[hf]") {
  std::mt19937_64 rng(15);
  const ScratchFolder root("hf-folder");
  auto ts = random_params(rng, true, true);
  ts.push_back({"lm_head.weight", "BF16", {11, 8}, ts[0].data});
  write_folder(root / "copy", tiny_config("qwen2", true), ts);
  // Accepted, and not a param: the embedding is the head.
  const auto ck = HfCheckpoint::open(root / "copy", kSeq);
  check_holds(ck, std::vector<Raw>(ts.begin(), ts.end() - 1));
  CHECK_THROWS_AS(ck.tensor("lm_head.weight"), ConfigError);
  ts.back().data[5] ^= std::byte{1};
  write_folder(root / "other", tiny_config("qwen2", true), ts);
  CHECK(contains(open_refusal(root / "other"),
                 "tensor \"lm_head.weight\" in '" +
                     (root / "other" / "model.safetensors").string() +
                     "': config.json ties the head to the embedding, but this head is not a "
                     "copy of it"));
}

TEST_CASE("load then export is bit-exact, in one file and sharded above the limit", "[hf]") {
  std::mt19937_64 rng(16);
  const ScratchFolder root("hf-folder");
  for (const std::string dtype : {"BF16", "F16", "F32"}) {
    const auto tensors = random_params(rng, true, false, dtype);
    const auto in = root / ("in-" + dtype);
    write_folder(in, tiny_config("qwen2", false), tensors, [](std::size_t i) { return i / 10; });
    const auto ck = HfCheckpoint::open(in, kSeq);
    const DType t = *dtype_of_safetensors(dtype);
    const auto fill = [&](const HfTensorSpec& spec, std::span<std::byte> out) {
      ck.copy(spec.name, t, out);
    };
    std::uint64_t total = 0;
    for (const auto& x : tensors) total += x.data.size();
    for (const std::uint64_t limit : {total, total / 3, std::uint64_t{1}}) {
      const auto out = root / fmt::format("out-{}-{}", dtype, limit);
      write_hf_folder(out, ck.shape(), t, fill, limit);
      const auto back = HfCheckpoint::open(out, kSeq);
      check_holds(back, tensors);
      // And as the raw bytes of the files say, read without the code under test.
      std::map<std::string, Raw> raw;
      for (const auto& f : back.files()) raw.merge(raw_read(f));
      REQUIRE(raw.size() == tensors.size());
      for (const auto& x : tensors) {
        CHECK(raw.at(x.name).dtype == x.dtype);
        CHECK(raw.at(x.name).shape == x.shape);
        CHECK(raw.at(x.name).data == x.data);
      }
      // The folder holds exactly its files, nothing temporary beside it.
      std::set<std::string> names;
      for (const auto& e : fs::directory_iterator(out)) names.insert(e.path().filename());
      std::set<std::string> beside;
      for (const auto& e : fs::directory_iterator(root.path())) beside.insert(e.path().filename());
      CHECK(std::none_of(beside.begin(), beside.end(),
                         [](const std::string& n) { return contains(n, ".tmp-export"); }));
      const json config = json::parse(std::ifstream(out / "config.json"));
      CHECK(config == hf_config_to_json(ck.shape(), t));
      if (limit == total) {
        CHECK(names == std::set<std::string>{"config.json", "model.safetensors"});
        continue;
      }
      CHECK(names.contains("model.safetensors.index.json"));
      const json index = json::parse(std::ifstream(out / "model.safetensors.index.json"));
      CHECK(index.at("metadata").at("total_size") == total);
      const std::size_t files = names.size() - 2;
      if (limit == 1) CHECK(files == tensors.size());  // each param alone
      std::map<std::string, std::uint64_t> shard_bytes;
      for (const auto& x : tensors) {
        const std::string f = index.at("weight_map").at(x.name);
        CHECK(names.contains(f));
        CHECK(back.file_of(x.name) == out / f);
        shard_bytes[f] += x.data.size();
      }
      CHECK(shard_bytes.size() == files);
      for (std::size_t k = 1; k <= files; ++k) {
        const auto f = fmt::format("model-{:05d}-of-{:05d}.safetensors", k, files);
        CHECK(shard_bytes.contains(f));
        if (limit > 1) CHECK(shard_bytes[f] <= limit);
        CHECK(SafetensorsFile::open(out / f).metadata().at("format") == "pt");
      }
    }
  }
}

TEST_CASE("an export of another dtype converts each param, and a mixed-dtype folder loads", "[hf]") {
  std::mt19937_64 rng(17);
  const ScratchFolder root("hf-folder");
  auto tensors = random_params(rng, false, true, "F32");
  for (std::size_t i = 0; i < tensors.size(); i += 2)
    tensors[i] = {tensors[i].name, "BF16", tensors[i].shape,
                  stored_values(rng, "BF16", numel(tensors[i].shape))};
  write_folder(root / "in", tiny_config("mistral", true), tensors);
  const auto ck = HfCheckpoint::open(root / "in", kSeq);
  write_hf_folder(
      root / "out", ck.shape(), DType::bf16,
      [&](const HfTensorSpec& spec, std::span<std::byte> out) {
        ck.copy(spec.name, DType::bf16, out);
      },
      1 << 20);
  const auto back = HfCheckpoint::open(root / "out", kSeq);
  for (const auto& t : tensors) {
    const auto& got = back.tensor(t.name);
    REQUIRE(got.dtype == "BF16");
    for (std::int64_t i = 0; i < numel(t.shape); ++i) {
      const double x =
          t.dtype == "BF16" ? bf16_value(u16(t.data.data() + 2 * i)) : f32(t.data.data() + 4 * i);
      if (bf16_value(u16(got.data + 2 * i)) != round_to(x, 8, -126))
        FAIL(fmt::format("{}[{}]: {} stored as {}", t.name, i, x,
                         bf16_value(u16(got.data + 2 * i))));
    }
  }
}

TEST_CASE("a NaN or Inf stored in a weight is refused when read, naming tensor, file and element",
          "[hf]") {
  std::mt19937_64 rng(19);
  const ScratchFolder root("hf-folder");
  struct Case {
    const char* dtype;
    std::vector<std::byte> bits;  // one element's stored bytes, little-endian
    const char* what;
  };
  const std::vector<Case> cases = {
      {"BF16", {std::byte{0xC0}, std::byte{0x7F}}, "NaN"},
      {"BF16", {std::byte{0x80}, std::byte{0xFF}}, "Inf"},  // -Inf
      {"F16", {std::byte{0x01}, std::byte{0x7C}}, "NaN"},
      {"F16", {std::byte{0x00}, std::byte{0x7C}}, "Inf"},
      {"F32", {std::byte{0x00}, std::byte{0x00}, std::byte{0x80}, std::byte{0x7F}}, "Inf"},
      {"F32", {std::byte{0x01}, std::byte{0x00}, std::byte{0xC0}, std::byte{0xFF}}, "NaN"}};
  int k = 0;
  for (const auto& c : cases) {
    INFO(c.dtype << " " << c.what);
    auto tensors = random_params(rng, false, true, c.dtype);
    auto& poisoned = tensors[3];
    const std::size_t element = static_cast<std::size_t>(numel(poisoned.shape)) / 2 + 1;
    std::memcpy(poisoned.data.data() + element * c.bits.size(), c.bits.data(), c.bits.size());
    const fs::path folder = root / fmt::format("in{}", k++);
    write_folder(folder, tiny_config("mistral", true), tensors);
    const auto ck = HfCheckpoint::open(folder, kSeq);  // opening maps; reading finds it
    std::vector<float> out(static_cast<std::size_t>(numel(poisoned.shape)), 7.0f);
    const std::string msg = message_of<ConfigError>(
        [&] { ck.copy(poisoned.name, DType::f32, std::as_writable_bytes(std::span(out))); });
    CHECK(contains(msg, '"' + poisoned.name + '"'));
    CHECK(contains(msg, (folder / "model.safetensors").string()));
    CHECK(contains(msg, fmt::format("element {} is {}", element, c.what)));
    CHECK(std::all_of(out.begin(), out.end(), [](float v) { return v == 7.0f; }));  // untouched
    // Every other tensor reads.
    const auto& fine = tensors[2];
    std::vector<float> ok(static_cast<std::size_t>(numel(fine.shape)));
    ck.copy(fine.name, DType::f32, std::as_writable_bytes(std::span(ok)));
  }
}

TEST_CASE("write_hf_folder refuses a used folder and leaves nothing after a failure", "[hf]") {
  std::mt19937_64 rng(18);
  const ScratchFolder root("hf-folder");
  const auto shape = hf_config_from_json(tiny_config("llama", false), {{}, "model."}, kSeq).shape;
  const auto zeros = [](const HfTensorSpec&, std::span<std::byte> out) {
    std::fill(out.begin(), out.end(), std::byte{0x3f});
  };
  fs::create_directories(root / "used");
  std::ofstream(root / "used" / "keep.txt") << "mine";
  CHECK(message_of<ConfigError>(
            [&] { write_hf_folder(root / "used", shape, DType::bf16, zeros, 1000); }) ==
        "write_hf_folder '" + (root / "used").string() + "': not empty; refusing to write into it");
  std::ofstream(root / "file") << "x";
  CHECK(contains(message_of<ConfigError>(
                     [&] { write_hf_folder(root / "file", shape, DType::bf16, zeros, 1000); }),
                 "a regular file; refusing to replace it"));
  CHECK(contains(message_of<ConfigError>(
                     [&] { write_hf_folder(root / "no" / "x", shape, DType::bf16, zeros, 1000); }),
                 "does not exist"));
  CHECK(contains(
      message_of<ConfigError>([&] { write_hf_folder(root / "x", shape, DType::f64, zeros, 1000); }),
      "hf_config_to_json: dtype fp64"));
  // A provider failing half-way: no folder, no temporary.
  int calls = 0;
  const auto failing = [&](const HfTensorSpec& spec, std::span<std::byte> out) {
    if (++calls == 9) throw ConfigError("no weights for " + spec.name);
    zeros(spec, out);
  };
  CHECK(message_of<ConfigError>([&] {
          write_hf_folder(root / "x", shape, DType::bf16, failing, 300);
        }) == "no weights for " + decoder_params(shape)[8].name);
  // An empty folder is taken (and replaced whole, at the end).
  fs::create_directories(root / "empty");
  write_hf_folder(root / "empty", shape, DType::bf16, zeros, 1000);
  CHECK(HfCheckpoint::open(root / "empty", kSeq).shape().layers == 2);
  std::set<std::string> names;
  for (const auto& e : fs::directory_iterator(root.path())) names.insert(e.path().filename());
  CHECK(names == std::set<std::string>{"used", "file", "empty"});
  CHECK(read_bytes(root / "used" / "keep.txt").size() == 4);
}
