// Reads a JSON config by key path ("optimizer.params.lr", "layer_switching.schedule[2].step"), with
// typed errors that name the key and the file, and remembers which keys were read so unknown ones
// can be reported.
#pragma once

#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <set>
#include <string>
#include <string_view>
#include <vector>

namespace shardswap {

class ConfigReader {
 public:
  /// `source` names where the JSON came from (a file path) in error messages.
  ConfigReader(nlohmann::json root, std::string source);
  /// Parses a file. Throws ConfigError naming the file if it cannot be read or parsed.
  static ConfigReader from_file(const std::string& path);

  bool has(std::string_view path) const;
  /// Each getter returns `fallback` when the key is absent and throws ConfigError naming the key
  /// and the source when it is present with the wrong type.
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
  /// existing list element. A refused override changes nothing.
  void set(std::string_view assignment);
  /// Leaf keys present in the JSON that no getter has read, in path order. A list is one leaf,
  /// unless it holds objects: then each element's keys are leaves ("schedule[0].step").
  std::vector<std::string> unread_keys() const;
  const std::string& source() const { return source_; }
  [[noreturn]] void fail(std::string_view path, const std::string& why) const;

 private:
  const nlohmann::json* find(std::string_view path) const;
  nlohmann::json root_;
  std::string source_;
  std::set<std::string, std::less<>> read_;
};

}  // namespace shardswap
