// The one reader of JSON that comes from outside the process: configs, checkpoint metadata and
// file headers, Hugging Face config.json and index files, safetensors headers, metrics lines and
// --set values. Bounded in size (each caller gives its limit), in depth (a container that would
// open one level too deep is refused before anything deeper is built, so nothing that walks the
// result recursively, nlohmann's dump() and copy included, can overflow the stack) and linear in
// time; a key repeated in an object is refused (which of two values counts would otherwise be the
// parser's choice). Its errors are ConfigError naming the source, the line and column and the key
// path, never the JSON library's own exception text.
#pragma once

#include <nlohmann/json.hpp>

#include <cstddef>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "shardswap/error.h"

namespace shardswap {

/// One step of a key path: an object's key, or a list's index.
struct JsonPathStep {
  std::string key;
  std::size_t index = 0;
  bool is_index = false;
};

/// A key path as messages show it ("optimizer.params.lr", "schedule[2].step"), short however deep
/// or long its keys: the first six and the last three steps, each key at most 32 bytes.
std::string json_path_text(const std::vector<JsonPathStep>& steps);

/// What a reader accepts; each caller sets its own.
struct JsonLimits {
  /// The deepest nesting of objects and lists; the top-level container is level 1.
  std::size_t max_depth = 256;
  /// The largest text parsed, in bytes.
  std::size_t max_bytes = std::size_t{16} << 20;
  /// What the text is, in the messages about limits: "..., the most HOLDER may have".
  std::string_view holder = "a JSON text";
  /// The most elements one list may hold (a list is refused when one more would be added,
  /// before it is built further): for formats whose lists are short by nature.
  std::size_t max_list_items = static_cast<std::size_t>(-1);
};

/// JSON text refused: not JSON, a number beyond double's range, nested too deep, a list too long,
/// a repeated key, larger than the limit, or a file that cannot be read. what() is the whole
/// message: "SOURCE:LINE:COLUMN: KEY.PATH: REASON", without the parts that are unknown.
class JsonError : public ConfigError {
 public:
  enum class Kind { syntax, number_range, too_deep, too_long, repeated_key, too_large, unreadable };
  JsonError(Kind kind, std::string source, std::size_t line, std::size_t column,
            std::vector<JsonPathStep> path, std::string reason);

  Kind kind() const { return kind_; }
  const std::string& source() const { return source_; }
  /// Where in the text, counting from 1; 0 when unknown.
  std::size_t line() const { return line_; }
  std::size_t column() const { return column_; }
  /// The key path of the value at fault (for a repeated key, that key's); empty when unknown.
  const std::vector<JsonPathStep>& path() const { return path_; }
  /// What is wrong, without source, position or key path.
  const std::string& reason() const { return reason_; }
  /// The message without its source: "LINE:COLUMN: KEY.PATH: REASON".
  std::string located() const;

 private:
  Kind kind_;
  std::string source_;
  std::size_t line_, column_;
  std::vector<JsonPathStep> path_;
  std::string reason_;
};

/// Parses `text` in time linear in its size; `source` names it in messages. Throws JsonError if
/// the text is longer than limits.max_bytes, is not JSON (a NUL byte included: JSON text holds
/// none, and the parser would otherwise stop at it and ignore the rest), holds a number beyond
/// double's range, nests deeper than limits.max_depth (refused at the bracket that would open the
/// level, before anything deeper is built), has a list longer than limits.max_list_items or
/// repeats a key in an object.
nlohmann::json parse_json(std::string_view text, const std::string& source,
                          const JsonLimits& limits = {});

/// The whole of `file`, read only if it is a regular file (a symbolic link to one is fine) of at
/// most `max_bytes`, to its end. A FIFO or device is refused from stat() before it is opened
/// (opening some devices acts, and a FIFO's open blocks until a writer comes); no read goes past
/// the limit even if the file grows meanwhile. `noun` names the file in messages ("config file":
/// "FILE: cannot open the config file: ...", "FILE: not a regular file (a FIFO): a config file
/// must be one", "FILE: larger than 16 MiB (...), the most a config file may hold"). Throws
/// JsonError (kind unreadable or too_large).
std::string read_json_text(const std::filesystem::path& file, std::size_t max_bytes,
                           std::string_view noun);

/// read_json_text(file, limits.max_bytes, noun) parsed as parse_json does, naming the file.
nlohmann::json read_json_file(const std::filesystem::path& file, const JsonLimits& limits,
                              std::string_view noun);

/// The key path (its first `max_depth` steps) to the first container of `root` that lies deeper
/// than `max_depth` levels (the root's own is level 1), or nothing. Iterative: `root` may be
/// nested arbitrarily deep, as a value built in memory may be.
std::optional<std::vector<JsonPathStep>> json_deeper_than(const nlohmann::json& root,
                                                          std::size_t max_depth);

}  // namespace shardswap
