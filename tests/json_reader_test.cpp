// The one bounded JSON reader (shardswap/json_reader.h) on its own: what it refuses and how its
// messages name the place. The readers built on it (configs, checkpoint metadata, safetensors
// headers, Hugging Face files, metrics lines) have their own tests.
#include <sys/stat.h>

#include <fstream>
#include <string>

#include <fmt/format.h>

#include "shardswap/config_reader.h"
#include "shardswap/error.h"
#include "shardswap/json_reader.h"
#include "tests/catch_compat.h"
#include "tests/support/scratch_folder.h"

using namespace shardswap;
using Kind = JsonError::Kind;
using test_support::ScratchFolder;

namespace {

// The JsonError `text` is refused with.
JsonError refusal(std::string_view text, const JsonLimits& limits = {}) {
  try {
    (void)parse_json(text, "t.json", limits);
  } catch (const JsonError& e) {
    return e;
  }
  FAIL("parse_json accepted " << text.substr(0, 80));
  throw std::logic_error("unreachable");
}

}  // namespace

TEST_CASE("text after a NUL byte is refused at the NUL, not ignored", "[json]") {
  // The parser takes a NUL for the end of its input: {"a": 1} would be all that was read.
  const std::string text = std::string("{\"a\": 1}\n") + '\0' + "{\"b\": 2}";
  const auto e = refusal(text);
  CHECK(e.kind() == Kind::syntax);
  CHECK(std::string(e.what()) == "t.json:2:1: not valid JSON: a NUL byte (JSON text holds none)");
  CHECK(refusal(std::string("{\"a\": \"x") + '\0' + "y\"}").column() == 9);
}

TEST_CASE("a number beyond double's range is refused naming its line, column and key path",
          "[json]") {
  const auto e = refusal("{\"optimizer\": {\"params\":\n  {\"lr\": 1e999}}}");
  CHECK(e.kind() == Kind::number_range);
  CHECK(std::string(e.what()) ==
        "t.json:2:10: optimizer.params.lr: the number 1e999 is beyond the range of a double "
        "(about 1.8e308)");
  CHECK(refusal("[1, 2, -1e400]").located() ==
        "1:8: [2]: the number -1e400 is beyond the range of a double (about 1.8e308)");
}

TEST_CASE("each limit is the reader's own: depth and size refused naming the limit", "[json]") {
  const JsonLimits limits{3, 100, "a test file"};
  CHECK_NOTHROW(parse_json("[[[1]]]", "t.json", limits));
  const auto deep = refusal("{\"a\": [[[1]]]}", limits);
  CHECK(deep.kind() == Kind::too_deep);
  CHECK(std::string(deep.what()) ==
        "t.json:1:9: a[0][0]: nested deeper than 3 levels of objects "
        "and lists, the most a test file may have");
  const JsonLimits short_lists{3, 100, "a test file", 2};
  CHECK_NOTHROW(parse_json("[1, [2, 3]]", "t.json", short_lists));
  CHECK(std::string(refusal(" [1, 2, 3]", short_lists).what()) ==
        "t.json:1:2: a list of more than 2 elements, the most a test file may have");
  const auto long_list = refusal(R"({"a": [1, [1, 2, 3]]})", short_lists);
  CHECK(long_list.kind() == Kind::too_long);
  CHECK(long_list.located() ==
        "1:11: a[1]: a list of more than 2 elements, the most a test file "
        "may have");
  const auto large = refusal("[" + std::string(99, ' ') + "]", limits);
  CHECK(large.kind() == Kind::too_large);
  CHECK(std::string(large.what()) ==
        "t.json: 101 bytes of JSON, more than the 100 bytes it may have");
}

TEST_CASE("a key repeated at any depth is refused naming its key path", "[json]") {
  const auto e = refusal(R"({"a": [{"x": 1}, {"x": 1, "y": 2, "x": 3}]})");
  CHECK(e.kind() == Kind::repeated_key);
  CHECK(std::string(e.what()) == "t.json:1:35: a[1].x: the key 'x' appears twice in a[1]");
}

TEST_CASE("a file is read only if it is a regular file within its limit, to its end", "[json]") {
  const ScratchFolder folder("json-reader");
  const auto path = folder / "f.json";
  std::ofstream(path) << "{\"a\": [1, 2, 3]}";
  CHECK(read_json_file(path, {}, "test file") == nlohmann::json{{"a", {1, 2, 3}}});
  // One byte over the limit: refused from its size, before it is read.
  const auto over = test::message_of<JsonError>([&] { read_json_text(path, 15, "test file"); });
  CHECK(over == path.string() +
                    ": larger than 15 bytes (15 bytes), the most a test file may hold: it has 16 "
                    "bytes");
  const auto fifo = (folder / "fifo.json").string();
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  CHECK(test::message_of<JsonError>([&] { read_json_text(fifo, 100, "test file"); }) ==
        fifo + ": not a regular file (a FIFO): a test file must be one");
  CHECK(test::message_of<JsonError>([&] { read_json_text(folder / "none", 100, "test file"); }) ==
        (folder / "none").string() + ": cannot open the test file: No such file or directory");
  // A file with a NUL inside is read whole and refused where the NUL is.
  std::ofstream(path, std::ios::binary | std::ios::trunc)
      << std::string("{}\n\n  ", 7) << '\0' << "{}";
  CHECK(test::message_of<JsonError>([&] { read_json_file(path, {}, "test file"); }) ==
        path.string() + ":3:3: not valid JSON: a NUL byte (JSON text holds none)");
}

TEST_CASE("a value built in memory is measured without recursion, however deep", "[json]") {
  nlohmann::json root = nlohmann::json::array();
  nlohmann::json* node = &root;
  for (int level = 2; level <= 200'000; ++level)
    node = &(node->emplace_back(nlohmann::json::array()));
  const auto steps = json_deeper_than(root, 4);
  REQUIRE(steps.has_value());
  CHECK(json_path_text(*steps) == "[0][0][0][0]");
  CHECK(!json_deeper_than(root, 200'000).has_value());
  CHECK(json_deeper_than(root, 199'999).has_value());
}

TEST_CASE("a --set number beyond double's range is refused naming the key, without library text",
          "[json][config]") {
  ConfigReader reader(nlohmann::json{{"optimizer", {{"params", {{"lr", 0.1}}}}}}, "r.json");
  const auto m = test::message_of<ConfigError>([&] { reader.set("optimizer.params.lr=1e999"); });
  CHECK(m ==
        "--set 'optimizer.params.lr=1e999': optimizer.params.lr: the number 1e999 is beyond the "
        "range of a double (about 1.8e308)");
  CHECK(reader.json()["optimizer"]["params"]["lr"] == 0.1);
}
