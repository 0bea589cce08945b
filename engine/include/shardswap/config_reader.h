// Reads a JSON config by key path ("optimizer.params.lr", "layer_switching.schedule[2].step"), with
// typed errors that name the key and the file in one shape, "FILE: KEY = VALUE: what is wrong"
// (or "FILE: KEY: what is wrong" where no value is shown), so that every config mistake reads
// alike whichever part of ShardSwap finds it; remembers which keys were read so unknown ones can
// be reported, and collects the warnings of reading ("auto" values, accepted-but-ignored settings)
// in one list for the caller to print.
#pragma once

#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <exception>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

namespace shardswap {

class ConfigReader {
 public:
  /// The deepest nesting of objects and lists a config may have; the top-level object is level 1.
  static constexpr std::size_t kMaxDepth = 256;
  /// The largest config file read, in bytes (16 MiB).
  static constexpr std::size_t kMaxFileBytes = std::size_t{16} << 20;

  /// `source` names where the JSON came from (a file path) in error messages. Throws ConfigError
  /// naming `source` if `root` is not an object or nests deeper than kMaxDepth: nothing a reader
  /// holds is deeper, so walking it never recurses further.
  ConfigReader(nlohmann::json root, std::string source);
  /// Parses a file through read_json_text (shardswap/json_reader.h). Throws ConfigError naming
  /// the file if it is not a regular file (a FIFO or device is refused without being opened, so
  /// nothing blocks), is larger than kMaxFileBytes (nothing past the limit is read) or cannot be
  /// read; and as from_text does.
  static ConfigReader from_file(const std::string& path);
  /// Parses `text` with parse_json (shardswap/json_reader.h), in time linear in its size;
  /// `source` names it in messages. Throws ConfigError (a JsonError) naming the source, line and
  /// column if it is not JSON (a NUL byte included); the source, line, column and key path
  /// (shortened) if it nests deeper than kMaxDepth, refused before anything deeper is built; and
  /// the key path if an object repeats a key (DeepSpeed refuses those too).
  static ConfigReader from_text(std::string_view text, std::string source);

  bool has(std::string_view path) const;
  /// True if the key holds the string "auto", the placeholder of Hugging Face's DeepSpeed configs.
  bool is_auto(std::string_view path) const;
  /// Throws ConfigError naming the key if it is present and not a JSON object (a section).
  void expect_object(std::string_view path) const;
  /// Says what "auto" at `path` stands for: `value`, the one a Hugging Face Trainer run fills in
  /// there. A getter that finds "auto" at `path` then reads `value` (checked as a value written in
  /// the file is) and records one warning "SOURCE: PATH = "auto": ShardSwap uses VALUE WHY", so
  /// the warning names the value the run gets; `why` says where it comes from. Registering a path
  /// that does not hold "auto" changes nothing.
  void resolve_auto(std::string path, nlohmann::json value, std::string why);
  /// Each getter returns `fallback` when the key is absent and throws ConfigError naming the key
  /// and the source when it is present with the wrong type. A key holding "auto" gives the value
  /// resolve_auto gave it or, where none was given, `fallback` (ShardSwap's default for it); either
  /// way it records one warning naming the key and the value used.
  double number(std::string_view path, double fallback);
  /// Accepts integral numbers written as floats (5e8), as DeepSpeed configs do.
  std::int64_t integer(std::string_view path, std::int64_t fallback);
  bool boolean(std::string_view path, bool fallback);
  std::string string(std::string_view path, const std::string& fallback);
  std::vector<double> numbers(std::string_view path, const std::vector<double>& fallback);
  std::vector<std::string> strings(std::string_view path, const std::vector<std::string>& fallback);
  /// Number of elements of the list at `path` (0 when absent); throws ConfigError naming the key
  /// if it is not a list. Elements are read with indexed paths: "path[i]", "path[i].key".
  /// A list of objects is not marked read here: its elements' keys are, by the getters that read
  /// them, so a misspelt key inside an element is still reported by unread_keys().
  std::size_t array_size(std::string_view path);

  /// Sets a value from a "key.path=value" override (value parsed as JSON, else as a string).
  /// Missing objects on the path are created; an index ("schedule[1].step=5") must name an
  /// existing list element. The path's keys and indices and the value's own nesting together
  /// stay within kMaxDepth (ConfigError naming the key path otherwise), as in a file; a key
  /// repeated inside the value is refused too. A refused override changes nothing.
  void set(std::string_view assignment);
  /// The overrides set() applied, as given ("key.path=value"), in order.
  const std::vector<std::string>& overrides() const { return overrides_; }
  /// Counts the key (and everything under it) as read without reading it: for a caller that has
  /// dealt with it otherwise, e.g. recorded a warning that it is ignored.
  void mark_read(std::string_view path) { read_.emplace(path); }
  /// Leaf keys present in the JSON that no getter has read, in path order. A list is one leaf,
  /// unless it holds objects: then each element's keys are leaves ("schedule[0].step").
  std::vector<std::string> unread_keys() const;
  /// A key that was read (present or not) under the same parent as `path` and is spelt within two
  /// edits of it: the likely intended key of a misspelt one. Empty if none.
  std::optional<std::string> closest_read_key(std::string_view path) const;
  const std::string& source() const { return source_; }
  /// The value at `path` as JSON text (strings in double quotes), as messages show it; nothing if
  /// the key is absent.
  std::optional<std::string> written(std::string_view path) const;
  /// The whole config as read (with the --set overrides applied).
  const nlohmann::json& json() const { return root_; }
  /// Throws ConfigError "SOURCE: PATH: WHY": for a key whose value is not shown (missing, or a
  /// whole section).
  [[noreturn]] void fail(std::string_view path, std::string_view why) const;
  /// Throws ConfigError "SOURCE: PATH = VALUE: WHY". `value` is shown as given: callers write
  /// strings as JSON does ("lisa", in double quotes), so the message shows what the file holds.
  [[noreturn]] void fail(std::string_view path, std::string_view value, std::string_view why) const;
  /// fail(path, VALUE, why) with the value at `path` as written in the JSON.
  [[noreturn]] void fail_value(std::string_view path, std::string_view why) const;
  /// Rethrows `e`, whose message a validator below the reader wrote as "KEY = VALUE: what" (it
  /// knows the key, not the file), as "SOURCE: KEY = VALUE: what"; a message that already starts
  /// with the source is rethrown unchanged.
  [[noreturn]] void rethrow_naming_file(const std::exception& e) const;
  /// Records the warning "SOURCE: PATH: WHY". One warning per key: a second one for the same path
  /// is dropped, so a caller may record a more specific warning before a getter's.
  void warn(std::string_view path, std::string_view why);
  /// Records the warning "SOURCE: PATH = VALUE: WHY" (one per key, as above).
  void warn(std::string_view path, std::string_view value, std::string_view why);
  /// "SOURCE: " + `message`: the prefix of every message about this config.
  std::string naming_file(std::string_view message) const;
  /// The warnings recorded so far, in the order they were recorded.
  const std::vector<std::string>& warnings() const { return warnings_; }

 private:
  const nlohmann::json* find(std::string_view path) const;
  /// What a getter reads at `path`, which it marks read: the value in the JSON; for "auto", the
  /// value resolve_auto gave it, or nullptr (the getter's fallback, shown in the warning as
  /// `fallback`); nullptr when absent.
  const nlohmann::json* value_read(std::string_view path, const std::string& fallback);
  struct ResolvedAuto {
    nlohmann::json value;
    std::string why;
  };
  nlohmann::json root_;
  std::string source_;
  std::set<std::string, std::less<>> read_;
  std::set<std::string, std::less<>> warned_;
  std::vector<std::string> warnings_;
  std::map<std::string, ResolvedAuto, std::less<>> resolved_autos_;
  std::vector<std::string> overrides_;
};

}  // namespace shardswap
