#include "shardswap/json_reader.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <type_traits>

#include "support/file_kind.h"

namespace shardswap {

namespace {

using json = nlohmann::json;

// The first `max` bytes of `text`, not cutting a UTF-8 sequence, with "..." if anything was cut.
std::string clipped(std::string_view text, std::size_t max) {
  if (text.size() <= max) return std::string(text);
  while (max > 0 && (static_cast<unsigned char>(text[max]) & 0xC0) == 0x80) --max;
  return std::string(text.substr(0, max)) + "...";
}

std::string joined(const std::vector<JsonPathStep>& steps, std::size_t from, std::size_t to) {
  std::string out;
  for (std::size_t i = from; i < to; ++i) {
    if (steps[i].is_index)
      out += fmt::format("[{}]", steps[i].index);
    else
      out += (i == 0 ? "" : ".") + clipped(steps[i].key, 32);
  }
  return out;
}

// "LINE:COLUMN" of byte `offset` (both counting from 1).
std::pair<std::size_t, std::size_t> line_column(std::string_view text, std::size_t offset) {
  const auto before = text.substr(0, std::min(offset, text.size()));
  const std::size_t line =
      1 + static_cast<std::size_t>(std::count(before.begin(), before.end(), '\n'));
  const auto newline = before.rfind('\n');
  return {line, before.size() - (newline == std::string_view::npos ? 0 : newline + 1) + 1};
}

// The byte offset of the bracket that opens nesting level `level` (the top-level value's opens
// level 1), in text that the parser read as JSON up to there; npos if none. The builder knows the
// key path, not the position: this finds it, only for the error.
std::size_t offset_of_level(std::string_view text, std::size_t level) {
  std::size_t depth = 0;
  bool in_string = false;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\')
        ++i;
      else if (c == '"')
        in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      if (++depth == level) return i;
    } else if ((c == '}' || c == ']') && depth > 0) {
      --depth;
    }
  }
  return std::string_view::npos;
}

// In text that the parser read as JSON up to there: with `container`, the byte offset of the
// bracket of the container at key path `steps`; else of the second occurrence of the key `steps`
// ends with, in the object at the path before it. npos if not found (a key written with escapes
// is not matched). The builder knows the key path, not the position: this finds it, only for the
// error, in one pass.
std::size_t offset_of_path(std::string_view text, const std::vector<JsonPathStep>& steps,
                           bool container) {
  if (!container && (steps.empty() || steps.back().is_index)) return std::string_view::npos;
  if (container && steps.empty()) return text.find_first_not_of(" \t\r\n");  // the root
  struct Frame {
    bool object;
    bool on_path;  // the container `steps` passes through (or, at depth n, holds the key)
    bool expect_key;
    std::size_t index;  // lists: the element being read
    std::string key;    // objects: the key of the member being read
    int seen;           // the target object: how often its key was read
  };
  // The object holding the repeated key is on level n; the container sought, on level n + 1.
  const std::size_t n = steps.size();
  std::vector<Frame> open;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (c == '"') {
      const std::size_t start = i;
      std::string s;
      bool escaped = false;
      for (++i; i < text.size() && text[i] != '"'; ++i) {
        if (text[i] == '\\') {
          escaped = true;
          ++i;
        } else {
          s += text[i];
        }
      }
      if (open.empty() || !open.back().object || !open.back().expect_key) continue;
      Frame& f = open.back();
      f.key = std::move(s);
      f.expect_key = false;
      if (!container && f.on_path && open.size() == n && !escaped && f.key == steps.back().key &&
          ++f.seen == 2)
        return start;
    } else if (c == '{' || c == '[') {
      bool on_path = open.empty();
      if (!open.empty() && open.back().on_path && open.size() <= n) {
        const Frame& parent = open.back();
        const JsonPathStep& step = steps[open.size() - 1];
        on_path = parent.object ? !step.is_index && parent.key == step.key
                                : step.is_index && parent.index == step.index;
      }
      if (container && on_path && open.size() == n) return i;
      open.push_back(Frame{c == '{', on_path, c == '{', 0, {}, 0});
    } else if ((c == '}' || c == ']') && !open.empty()) {
      open.pop_back();
    } else if (c == ',' && !open.empty()) {
      Frame& f = open.back();
      if (f.object)
        f.expect_key = true;
      else
        ++f.index;
    }
  }
  return std::string_view::npos;
}

// What a SAX parse refuses beyond JSON's own rules, with the key path where it happened; the
// message is worded by parse_json, which knows the text.
struct TooLong {
  std::vector<JsonPathStep> steps;  // the key path of the list that would grow too long
};
struct TooDeep {
  std::vector<JsonPathStep> steps;  // the key path of the container that would open too deep
};
struct RepeatedKey {
  std::vector<JsonPathStep> steps;  // the key path of the repeated key
};
struct OutOfRange {
  std::vector<JsonPathStep> steps;  // the key path of the number
  std::size_t position;             // the byte just past it
  std::string token;
};

// Builds the tree from nlohmann's SAX events, refusing a repeated key and nesting deeper than
// `max_depth` before anything deeper is built. nlohmann's callback parser (json::parse with a
// callback) is quadratic in a list of many objects (each object's end scans its parent for
// discarded elements), and keeping a key path per level is quadratic in depth: here each event
// costs O(1) (a key lookup O(log n)), and a key path is made only for an error.
class TreeBuilder {
 public:
  TreeBuilder(std::size_t max_depth, std::size_t max_list_items)
      : max_depth_(max_depth), max_list_items_(max_list_items) {}

  bool null() { return put(nullptr); }
  bool boolean(bool v) { return put(v); }
  bool number_integer(json::number_integer_t v) { return put(v); }
  bool number_unsigned(json::number_unsigned_t v) { return put(v); }
  bool number_float(json::number_float_t v, const json::string_t&) { return put(v); }
  bool string(json::string_t& v) { return put(std::move(v)); }
  bool binary(json::binary_t& v) { return put(json::binary(std::move(v))); }
  bool start_object(std::size_t) { return open(json::object()); }
  bool start_array(std::size_t) { return open(json::array()); }
  bool key(json::string_t& k) {
    Level& top = open_.back();
    top.key = std::move(k);
    if (top.node->contains(top.key)) throw RepeatedKey{steps_to_pending()};
    return true;
  }
  bool end_object() { return close(); }
  bool end_array() { return close(); }
  template <class Exception>
  bool parse_error(std::size_t position, const std::string& token, const Exception& e) {
    // A number beyond double's range is the one error nlohmann reports as out_of_range, with no
    // position in it: the key path and position are known here.
    if constexpr (std::is_same_v<Exception, json::out_of_range>)
      throw OutOfRange{steps_to_pending(), position, token};
    throw e;
  }

  json take() { return std::move(root_); }

 private:
  struct Level {
    json* node;
    std::string key;  // objects: the key of the member being read
  };

  // Places `v` where the parse is (the root, the end of a list, the pending key of an object);
  // returns where it lies. Pointers into an open container stay valid: only the innermost open
  // container grows.
  json* place(json&& v) {
    if (open_.empty()) {
      root_ = std::move(v);
      return &root_;
    }
    Level& top = open_.back();
    if (top.node->is_array()) {
      if (top.node->size() >= max_list_items_) {
        auto steps = steps_to_pending();
        steps.pop_back();  // the list's own path, not its next element's
        throw TooLong{std::move(steps)};
      }
      top.node->push_back(std::move(v));
      return &top.node->back();
    }
    return &top.node->get_ref<json::object_t&>().emplace(top.key, std::move(v)).first->second;
  }
  bool put(json&& v) {
    place(std::move(v));
    return true;
  }
  bool open(json&& v) {
    if (open_.size() >= max_depth_) throw TooDeep{steps_to_pending()};
    open_.push_back(Level{place(std::move(v)), {}});
    return true;
  }
  bool close() {
    open_.pop_back();
    return true;
  }
  // The key path of the value being read now (the member's key, or the next list index).
  std::vector<JsonPathStep> steps_to_pending() const {
    std::vector<JsonPathStep> steps;
    for (std::size_t i = 0; i < open_.size(); ++i) {
      const Level& l = open_[i];
      if (l.node->is_object())
        steps.push_back(JsonPathStep{l.key});
      else  // the open list's element being read: the last one below the top, the next at it
        steps.push_back(JsonPathStep{{}, l.node->size() - (i + 1 < open_.size() ? 1 : 0), true});
    }
    return steps;
  }

  std::size_t max_depth_;
  std::size_t max_list_items_;
  json root_;
  std::vector<Level> open_;
};

std::string mib(std::size_t bytes) {
  return bytes % (std::size_t{1} << 20) == 0 ? fmt::format("{} MiB", bytes >> 20)
                                             : fmt::format("{} bytes", bytes);
}

}  // namespace

std::string json_path_text(const std::vector<JsonPathStep>& steps) {
  const auto n = steps.size();
  if (n <= 10) return joined(steps, 0, n);
  return joined(steps, 0, 6) + " ... " + joined(steps, n - 3, n);
}

namespace {

// "LINE:COLUMN: KEY.PATH: REASON", without the parts that are unknown.
std::string located_text(std::size_t line, std::size_t column,
                         const std::vector<JsonPathStep>& path, std::string_view reason) {
  std::string out;
  if (line != 0) out += fmt::format("{}:{}: ", line, column);
  if (!path.empty()) out += json_path_text(path) + ": ";
  return out + std::string(reason);
}

std::string error_text(const std::string& source, std::size_t line, std::size_t column,
                       const std::vector<JsonPathStep>& path, std::string_view reason) {
  const auto rest = located_text(line, column, path, reason);
  if (source.empty()) return rest;
  return fmt::format("{}{}{}", source, line == 0 ? ": " : ":", rest);
}

}  // namespace

JsonError::JsonError(Kind kind, std::string source, std::size_t line, std::size_t column,
                     std::vector<JsonPathStep> path, std::string reason)
    : ConfigError(error_text(source, line, column, path, reason)),
      kind_(kind),
      source_(std::move(source)),
      line_(line),
      column_(column),
      path_(std::move(path)),
      reason_(std::move(reason)) {}

std::string JsonError::located() const {
  return located_text(line_, column_, path_, reason_);
}

nlohmann::json parse_json(std::string_view text, const std::string& source,
                          const JsonLimits& limits) {
  using Kind = JsonError::Kind;
  const auto at = [&](std::size_t offset) { return line_column(text, offset); };
  if (text.size() > limits.max_bytes)
    throw JsonError(Kind::too_large, source, 0, 0, {},
                    fmt::format("{} bytes of JSON, more than the {} it may have", text.size(),
                                mib(limits.max_bytes)));
  // nlohmann's lexer takes a NUL byte for the end of the input: "{}\0anything" would parse as
  // {} and the rest be ignored. JSON text holds no raw NUL, so one is an error where it is.
  if (const auto nul = text.find('\0'); nul != std::string_view::npos) {
    const auto [line, column] = at(nul);
    throw JsonError(Kind::syntax, source, line, column, {},
                    "not valid JSON: a NUL byte (JSON text holds none)");
  }
  TreeBuilder builder(limits.max_depth, limits.max_list_items);
  try {
    json::sax_parse(text.begin(), text.end(), &builder);
    return builder.take();
  } catch (const RepeatedKey& e) {
    const std::vector<JsonPathStep> parent(e.steps.begin(), e.steps.end() - 1);
    const auto offset = offset_of_path(text, e.steps, false);
    const auto [line, column] =
        offset == std::string_view::npos ? std::pair<std::size_t, std::size_t>{0, 0} : at(offset);
    throw JsonError(Kind::repeated_key, source, line, column, e.steps,
                    fmt::format("the key '{}' appears twice in {}", clipped(e.steps.back().key, 32),
                                parent.empty() ? "the top-level object" : json_path_text(parent)));
  } catch (const TooLong& e) {
    const auto offset = offset_of_path(text, e.steps, true);
    const auto [line, column] =
        offset == std::string_view::npos ? std::pair<std::size_t, std::size_t>{0, 0} : at(offset);
    throw JsonError(Kind::too_long, source, line, column, e.steps,
                    fmt::format("a list of more than {} elements, the most {} may have",
                                limits.max_list_items, limits.holder));
  } catch (const TooDeep& e) {
    const auto offset = offset_of_level(text, limits.max_depth + 1);
    const auto [line, column] =
        offset == std::string_view::npos ? std::pair<std::size_t, std::size_t>{0, 0} : at(offset);
    throw JsonError(Kind::too_deep, source, line, column, e.steps,
                    fmt::format("nested deeper than {} levels of objects and lists, the most {} "
                                "may have",
                                limits.max_depth, limits.holder));
  } catch (const OutOfRange& e) {
    // The position is one past the number's end; show where the number starts.
    const auto start = e.position >= e.token.size() ? e.position - e.token.size() : 0;
    const auto [line, column] = at(start);
    throw JsonError(Kind::number_range, source, line, column, e.steps,
                    fmt::format("the number {} is beyond the range of a double (about 1.8e308)",
                                clipped(e.token, 40)));
  } catch (const json::parse_error& e) {
    // e.byte counts from 1 and points at the last character read: the one that broke the parse
    // (one past the end when the text ended early).
    const std::size_t end = std::min<std::size_t>(e.byte == 0 ? 0 : e.byte - 1, text.size());
    // Keep nlohmann's reason, without its own prefix ("[json.exception...] parse error at ...: ").
    std::string reason = e.what();
    if (const auto colon = reason.find(": "); colon != std::string::npos)
      reason = reason.substr(colon + 2);
    const auto [line, column] = at(end);
    throw JsonError(Kind::syntax, source, line, column, {}, "not valid JSON: " + reason);
  }
}

std::string read_json_text(const std::filesystem::path& file, std::size_t max_bytes,
                           std::string_view noun) {
  using Kind = JsonError::Kind;
  const std::string path = file.string();
  const auto refuse = [&](Kind kind, std::string why) {
    return JsonError(kind, path, 0, 0, {}, std::move(why));
  };
  const auto too_large = [&](std::string_view size) {
    return refuse(Kind::too_large,
                  fmt::format("larger than {} ({} bytes), the most a {} may hold{}", mib(max_bytes),
                              max_bytes, noun, size));
  };
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0)
    throw refuse(Kind::unreadable,
                 fmt::format("cannot open the {}: {}", noun, std::strerror(errno)));
  const auto check = [&] {
    if (!S_ISREG(st.st_mode))
      throw refuse(Kind::unreadable, fmt::format("not a regular file ({}): a {} must be one",
                                                 file_kind(st.st_mode), noun));
    if (static_cast<std::uint64_t>(st.st_size) > max_bytes)
      throw too_large(fmt::format(": it has {} bytes", st.st_size));
  };
  check();
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0)
    throw refuse(Kind::unreadable,
                 fmt::format("cannot open the {}: {}", noun, std::strerror(errno)));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  if (::fstat(fd, &st) != 0)
    throw refuse(Kind::unreadable,
                 fmt::format("cannot read the {}: {}", noun, std::strerror(errno)));
  check();
  // Read to the end, one byte past the limit at most: a file may grow while it is read (and
  // /proc files report size 0). The buffer grows with what is read, not with the limit.
  std::string text;
  std::size_t got = 0;
  while (got <= max_bytes) {
    if (text.size() == got)
      text.resize(std::min(
          max_bytes + 1,
          std::max<std::size_t>({got * 2, 4096, static_cast<std::size_t>(st.st_size) + 1})));
    const auto n = ::read(fd, text.data() + got, text.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0)
      throw refuse(Kind::unreadable,
                   fmt::format("cannot read the {}: {}", noun, std::strerror(errno)));
    if (n == 0) break;
    got += static_cast<std::size_t>(n);
  }
  if (got > max_bytes) throw too_large("");
  text.resize(got);
  return text;
}

nlohmann::json read_json_file(const std::filesystem::path& file, const JsonLimits& limits,
                              std::string_view noun) {
  return parse_json(read_json_text(file, limits.max_bytes, noun), file.string(), limits);
}

std::optional<std::vector<JsonPathStep>> json_deeper_than(const nlohmann::json& root,
                                                          std::size_t max_depth) {
  struct Frame {
    const json* node;
    json::const_iterator child;
    std::size_t index;
  };
  if (!root.is_structured()) return std::nullopt;
  if (max_depth == 0) return std::vector<JsonPathStep>{};
  std::vector<Frame> chain{{&root, root.begin(), 0}};
  while (!chain.empty()) {
    Frame& f = chain.back();
    if (f.child == f.node->end()) {
      chain.pop_back();
      if (!chain.empty()) {
        ++chain.back().child;
        ++chain.back().index;
      }
      continue;
    }
    if (!f.child->is_structured()) {
      ++f.child;
      ++f.index;
      continue;
    }
    if (chain.size() >= max_depth) {
      std::vector<JsonPathStep> steps;
      for (const auto& g : chain)
        steps.push_back(g.node->is_object() ? JsonPathStep{g.child.key()}
                                            : JsonPathStep{{}, g.index, true});
      return steps;
    }
    const json* child = &*f.child;
    chain.push_back(Frame{child, child->begin(), 0});
  }
  return std::nullopt;
}

}  // namespace shardswap
