#include "shardswap/config_reader.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>

#include "shardswap/error.h"

namespace shardswap {

namespace {

// One step of a key path: an object key followed by zero or more list indices ("schedule[2]").
struct PathStep {
  std::string key;
  std::vector<std::size_t> indices;
};

std::vector<PathStep> parse_path(std::string_view path) {
  const auto malformed = [&](std::string_view why) -> ConfigError {
    return ConfigError(fmt::format("{}: malformed key path: {}", path, why));
  };
  std::vector<PathStep> steps;
  std::size_t start = 0;
  while (true) {
    const auto dot = path.find('.', start);
    const std::string_view part = path.substr(start, dot - start);
    const auto bracket = part.find('[');
    PathStep step{std::string(part.substr(0, bracket)), {}};
    if (step.key.empty()) throw malformed("a key is empty");
    for (auto pos = bracket; pos != std::string_view::npos;) {
      const auto close = part.find(']', pos);
      if (close == std::string_view::npos || close == pos + 1) throw malformed("expected [index]");
      std::size_t index = 0;
      for (const char ch : part.substr(pos + 1, close - pos - 1)) {
        if (ch < '0' || ch > '9') throw malformed("an index must be a non-negative integer");
        if (index > 100'000'000) throw malformed("an index is too large");
        index = index * 10 + static_cast<std::size_t>(ch - '0');
      }
      step.indices.push_back(index);
      pos = close + 1;
      if (pos == part.size()) break;
      if (part[pos] != '[') throw malformed("expected '.' or '[' after ']'");
    }
    steps.push_back(std::move(step));
    if (dot == std::string_view::npos) break;
    start = dot + 1;
  }
  return steps;
}

// Edit distance counting a swap of neighbours as one edit (optimal string alignment), for
// suggesting the key a misspelt one was meant to be: "widht" is one edit from "width".
std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::vector<std::size_t>> d(a.size() + 1, std::vector<std::size_t>(b.size() + 1));
  for (std::size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (std::size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i)
    for (std::size_t j = 1; j <= b.size(); ++j) {
      d[i][j] = std::min(
          {d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1])
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  return d[a.size()][b.size()];
}

// "a.b[0].c" -> {"a.b[0]", "c"}; "a" -> {"", "a"}.
std::pair<std::string_view, std::string_view> split_parent(std::string_view path) {
  const auto dot = path.rfind('.');
  if (dot == std::string_view::npos) return {{}, path};
  return {path.substr(0, dot), path.substr(dot + 1)};
}

bool holds_objects(const nlohmann::json& j) {
  return j.is_array() &&
         std::any_of(j.begin(), j.end(), [](const nlohmann::json& x) { return x.is_object(); });
}

void collect_leaves(const nlohmann::json& j, const std::string& prefix,
                    std::vector<std::string>& out) {
  if (j.is_object() && !j.empty()) {
    for (const auto& [key, value] : j.items())
      collect_leaves(value, prefix.empty() ? key : prefix + "." + key, out);
  } else if (holds_objects(j)) {
    // Keys inside a list of objects can be misspelt like any other: report them one by one.
    for (std::size_t i = 0; i < j.size(); ++i)
      collect_leaves(j[i], fmt::format("{}[{}]", prefix, i), out);
  } else {
    out.push_back(prefix);
  }
}

}  // namespace

ConfigReader::ConfigReader(nlohmann::json root, std::string source)
    : root_(std::move(root)), source_(std::move(source)) {
  if (!root_.is_object())
    throw ConfigError(fmt::format("{}: the top level must be a JSON object {{...}}", source_));
}

ConfigReader ConfigReader::from_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw ConfigError(fmt::format("{}: cannot open the config file", path));
  std::stringstream text;
  text << in.rdbuf();
  return from_text(text.str(), path);
}

ConfigReader ConfigReader::from_text(std::string_view text, std::string source) {
  // nlohmann keeps the last of repeated keys without a word; DeepSpeed refuses them, and so do we:
  // a repeated key usually means one of the two values is not the one the author meant.
  struct Frame {
    std::string path;
    bool object;
    std::set<std::string, std::less<>> keys;
    std::string key;  // the last key seen in this object
  };
  std::vector<Frame> frames;
  const auto child_path = [&]() -> std::string {
    if (frames.empty()) return "";
    const Frame& f = frames.back();
    if (!f.object) return f.path + "[]";
    return f.path.empty() ? f.key : f.path + "." + f.key;
  };
  const nlohmann::json::parser_callback_t check = [&](int, nlohmann::json::parse_event_t event,
                                                      nlohmann::json& parsed) {
    using E = nlohmann::json::parse_event_t;
    if (event == E::object_start || event == E::array_start) {
      frames.push_back(Frame{child_path(), event == E::object_start, {}, {}});
    } else if (event == E::object_end || event == E::array_end) {
      frames.pop_back();
    } else if (event == E::key) {
      Frame& f = frames.back();
      f.key = parsed.get<std::string>();
      if (!f.keys.insert(f.key).second)
        throw ConfigError(fmt::format("{}: {}: the key '{}' appears twice in {}", source,
                                      f.path.empty() ? f.key : f.path + "." + f.key, f.key,
                                      f.path.empty() ? "the top-level object" : f.path));
    }
    return true;
  };
  try {
    // `source` is copied, not moved: `check` may still need it while the argument is parsed.
    auto root = nlohmann::json::parse(text.begin(), text.end(), check);
    return ConfigReader(std::move(root), source);
  } catch (const nlohmann::json::parse_error& e) {
    // e.byte counts from 1 and points at the last character read: the one that broke the parse
    // (one past the end when the text ended early).
    const std::size_t end = std::min<std::size_t>(e.byte == 0 ? 0 : e.byte - 1, text.size());
    const auto before = text.substr(0, end);
    const std::size_t line =
        1 + static_cast<std::size_t>(std::count(before.begin(), before.end(), '\n'));
    const auto newline = before.rfind('\n');
    const std::size_t column = end - (newline == std::string_view::npos ? 0 : newline + 1) + 1;
    // Keep nlohmann's reason, without its own prefix ("[json.exception...] parse error at ...: ").
    std::string reason = e.what();
    if (const auto colon = reason.find(": "); colon != std::string::npos)
      reason = reason.substr(colon + 2);
    throw ConfigError(fmt::format("{}:{}:{}: not valid JSON: {}", source, line, column, reason));
  } catch (const nlohmann::json::out_of_range& e) {
    // A number beyond double's range (1e309): nlohmann reports it as out_of_range, with no
    // position (found by tests/fuzz, corpus file crash-number-overflow.json).
    std::string reason = e.what();
    if (const auto bracket = reason.find("] "); bracket != std::string::npos)
      reason = reason.substr(bracket + 2);
    throw ConfigError(fmt::format("{}: not valid JSON: {}", source, reason));
  }
}

std::string ConfigReader::naming_file(std::string_view message) const {
  return fmt::format("{}: {}", source_, message);
}

void ConfigReader::fail(std::string_view path, std::string_view why) const {
  throw ConfigError(naming_file(fmt::format("{}: {}", path, why)));
}

void ConfigReader::fail(std::string_view path, std::string_view value, std::string_view why) const {
  throw ConfigError(naming_file(fmt::format("{} = {}: {}", path, value, why)));
}

std::optional<std::string> ConfigReader::written(std::string_view path) const {
  const auto* node = find(path);
  if (node == nullptr) return std::nullopt;
  return node->dump();
}

void ConfigReader::fail_value(std::string_view path, std::string_view why) const {
  const auto value = written(path);
  if (!value) fail(path, why);
  fail(path, *value, why);
}

void ConfigReader::rethrow_naming_file(const std::exception& e) const {
  const std::string_view what = e.what();
  // Already named: "SOURCE: ..." or, for a JSON syntax error, "SOURCE:LINE:COLUMN: ...".
  if (what.substr(0, source_.size() + 1) == source_ + ":") throw ConfigError(std::string(what));
  throw ConfigError(naming_file(what));
}

const nlohmann::json* ConfigReader::find(std::string_view path) const {
  const nlohmann::json* node = &root_;
  for (const auto& step : parse_path(path)) {
    if (!node->is_object()) return nullptr;
    auto it = node->find(step.key);
    if (it == node->end()) return nullptr;
    node = &*it;
    for (const auto index : step.indices) {
      if (!node->is_array() || index >= node->size()) return nullptr;
      node = &(*node)[index];
    }
  }
  return node;
}

bool ConfigReader::has(std::string_view path) const {
  return find(path) != nullptr;
}

bool ConfigReader::is_auto(std::string_view path) const {
  const auto* node = find(path);
  return node != nullptr && node->is_string() && node->get_ref<const std::string&>() == "auto";
}

void ConfigReader::expect_object(std::string_view path) const {
  const auto* node = find(path);
  if (node != nullptr && !node->is_object()) fail(path, node->dump(), "must be an object {...}");
}

bool ConfigReader::read_auto(std::string_view path, const nlohmann::json* node,
                             const std::string& fallback) {
  read_.emplace(path);
  if (node == nullptr || !node->is_string() || node->get_ref<const std::string&>() != "auto")
    return false;
  warn(path, "\"auto\"",
       fmt::format("a value Hugging Face's trainer fills in; ShardSwap uses its default, {}",
                   fallback));
  return true;
}

void ConfigReader::warn(std::string_view path, std::string_view why) {
  if (!warned_.emplace(path).second) return;
  warnings_.push_back(naming_file(fmt::format("{}: {}", path, why)));
}

void ConfigReader::warn(std::string_view path, std::string_view value, std::string_view why) {
  if (!warned_.emplace(path).second) return;
  warnings_.push_back(naming_file(fmt::format("{} = {}: {}", path, value, why)));
}

double ConfigReader::number(std::string_view path, double fallback) {
  const auto* node = find(path);
  if (read_auto(path, node, fmt::format("{}", fallback))) return fallback;
  if (node == nullptr) return fallback;
  if (!node->is_number()) fail(path, node->dump(), "must be a number");
  return node->get<double>();
}

std::int64_t ConfigReader::integer(std::string_view path, std::int64_t fallback) {
  const auto* node = find(path);
  if (read_auto(path, node, fmt::format("{}", fallback))) return fallback;
  if (node == nullptr) return fallback;
  if (node->is_number_integer()) return node->get<std::int64_t>();
  if (node->is_number_float()) {
    const double v = node->get<double>();
    if (std::isfinite(v) && v == std::floor(v) && std::fabs(v) < 9.2e18)
      return static_cast<std::int64_t>(v);
  }
  fail(path, node->dump(), "must be an integer");
}

bool ConfigReader::boolean(std::string_view path, bool fallback) {
  const auto* node = find(path);
  if (read_auto(path, node, fmt::format("{}", fallback))) return fallback;
  if (node == nullptr) return fallback;
  if (!node->is_boolean()) fail(path, node->dump(), "must be true or false");
  return node->get<bool>();
}

std::string ConfigReader::string(std::string_view path, const std::string& fallback) {
  const auto* node = find(path);
  if (read_auto(path, node, fmt::format("'{}'", fallback))) return fallback;
  if (node == nullptr) return fallback;
  if (!node->is_string()) fail(path, node->dump(), "must be a string");
  return node->get<std::string>();
}

std::vector<double> ConfigReader::numbers(std::string_view path,
                                          const std::vector<double>& fallback) {
  const auto* node = find(path);
  if (read_auto(path, node, fmt::format("[{}]", fmt::join(fallback, ", ")))) return fallback;
  if (node == nullptr) return fallback;
  std::vector<double> out;
  if (node->is_array())
    for (const auto& x : *node) {
      if (!x.is_number()) fail(path, node->dump(), "must be a list of numbers");
      out.push_back(x.get<double>());
    }
  else
    fail(path, node->dump(), "must be a list of numbers");
  return out;
}

std::vector<std::string> ConfigReader::strings(std::string_view path,
                                               const std::vector<std::string>& fallback) {
  const auto* node = find(path);
  if (read_auto(path, node, fmt::format("[{}]", fmt::join(fallback, ", ")))) return fallback;
  if (node == nullptr) return fallback;
  const auto refuse = [&] { fail(path, node->dump(), "must be a list of strings"); };
  if (!node->is_array()) refuse();
  std::vector<std::string> out;
  for (const auto& x : *node) {
    if (!x.is_string()) refuse();
    out.push_back(x.get<std::string>());
  }
  return out;
}

std::size_t ConfigReader::array_size(std::string_view path) {
  const auto* node = find(path);
  if (node == nullptr) {
    read_.emplace(path);
    return 0;
  }
  if (!node->is_array()) fail(path, node->dump(), "must be a list");
  // A list without objects is one leaf (see unread_keys): this read covers it.
  if (!holds_objects(*node)) read_.emplace(path);
  return node->size();
}

void ConfigReader::set(std::string_view assignment) {
  const auto eq = assignment.find('=');
  if (eq == std::string_view::npos || eq == 0)
    throw ConfigError(fmt::format("--set '{}': expected key.path=value", assignment));
  const std::string path(assignment.substr(0, eq));
  const std::string text(assignment.substr(eq + 1));
  nlohmann::json value;
  try {
    value = nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error&) {
    value = text;  // a bare word: a string
  } catch (const nlohmann::json::out_of_range& e) {
    // A number beyond double's range: refused, not kept as the string "1e309".
    throw ConfigError(fmt::format("--set '{}': {}", assignment, e.what()));
  }
  // Edit a copy, so a refused override leaves the config as it was. A missing key is created.
  nlohmann::json updated = root_;
  nlohmann::json* node = &updated;
  for (const auto& step : parse_path(path)) {
    if (!node->is_object() && !node->is_null())
      throw ConfigError(fmt::format("--set '{}': '{}' lies under a value that is not an object",
                                    assignment, step.key));
    node = &(*node)[step.key];
    for (const auto index : step.indices) {
      if (!node->is_array() || index >= node->size())
        throw ConfigError(
            fmt::format("--set '{}': {}[{}] is not an element of a list in the "
                        "config",
                        assignment, step.key, index));
      node = &(*node)[index];
    }
  }
  *node = std::move(value);
  root_ = std::move(updated);
}

std::vector<std::string> ConfigReader::unread_keys() const {
  std::vector<std::string> leaves;
  collect_leaves(root_, "", leaves);
  std::vector<std::string> unread;
  for (const auto& leaf : leaves) {
    // A leaf counts as read if it or anything above it was read: "a.b[0].c", "a.b[0]", "a.b", "a".
    bool read = false;
    for (std::string p = leaf; !p.empty() && !read;) {
      read = read_.count(p) > 0;
      const auto cut = p.find_last_of(".[");
      p = cut == std::string::npos ? std::string() : p.substr(0, cut);
    }
    if (!read) unread.push_back(leaf);
  }
  return unread;
}

std::optional<std::string> ConfigReader::closest_read_key(std::string_view path) const {
  const auto [parent, name] = split_parent(path);
  std::optional<std::string> best;
  // One edit for short names, two for long ones: beyond that a guess misleads more than it helps.
  std::size_t best_distance = name.size() >= 8 ? 3 : 2;
  for (const auto& key : read_) {
    const auto [key_parent, key_name] = split_parent(key);
    if (key_parent != parent || key == path) continue;
    const auto d = edit_distance(name, key_name);
    if (d < best_distance) {
      best_distance = d;
      best = key;
    }
  }
  return best;
}

}  // namespace shardswap
