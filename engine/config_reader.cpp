#include "engine/config_reader.h"

#include <fmt/format.h>

#include <cmath>
#include <fstream>
#include <sstream>

#include "memory/error.h"

namespace shardswap {

namespace {

std::vector<std::string> split(std::string_view path) {
  std::vector<std::string> parts;
  std::size_t start = 0;
  while (true) {
    const auto dot = path.find('.', start);
    parts.emplace_back(path.substr(start, dot - start));
    if (dot == std::string_view::npos) break;
    start = dot + 1;
  }
  return parts;
}

void collect_leaves(const nlohmann::json& j, const std::string& prefix,
                    std::vector<std::string>& out) {
  if (j.is_object() && !j.empty()) {
    for (const auto& [key, value] : j.items())
      collect_leaves(value, prefix.empty() ? key : prefix + "." + key, out);
  } else {
    out.push_back(prefix);
  }
}

}  // namespace

ConfigReader::ConfigReader(nlohmann::json root, std::string source)
    : root_(std::move(root)), source_(std::move(source)) {
  if (!root_.is_object())
    throw ConfigError(
        fmt::format("ConfigReader: {}: the top level must be a JSON object", source_));
}

ConfigReader ConfigReader::from_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw ConfigError(fmt::format("ConfigReader: cannot open config file '{}'", path));
  std::stringstream text;
  text << in.rdbuf();
  try {
    return ConfigReader(nlohmann::json::parse(text.str()), path);
  } catch (const nlohmann::json::parse_error& e) {
    throw ConfigError(fmt::format("ConfigReader: '{}' is not valid JSON: {}", path, e.what()));
  }
}

void ConfigReader::fail(std::string_view path, const std::string& why) const {
  throw ConfigError(fmt::format("config {}: {} {}", source_, path, why));
}

const nlohmann::json* ConfigReader::find(std::string_view path) const {
  const nlohmann::json* node = &root_;
  for (const auto& part : split(path)) {
    if (!node->is_object()) return nullptr;
    auto it = node->find(part);
    if (it == node->end()) return nullptr;
    node = &*it;
  }
  return node;
}

bool ConfigReader::has(std::string_view path) const {
  return find(path) != nullptr;
}

double ConfigReader::number(std::string_view path, double fallback) {
  const auto* node = find(path);
  read_.emplace(path);
  if (node == nullptr) return fallback;
  if (!node->is_number()) fail(path, fmt::format("must be a number, not {}", node->dump()));
  return node->get<double>();
}

std::int64_t ConfigReader::integer(std::string_view path, std::int64_t fallback) {
  const auto* node = find(path);
  read_.emplace(path);
  if (node == nullptr) return fallback;
  if (node->is_number_integer()) return node->get<std::int64_t>();
  if (node->is_number_float()) {
    const double v = node->get<double>();
    if (std::isfinite(v) && v == std::floor(v) && std::fabs(v) < 9.2e18)
      return static_cast<std::int64_t>(v);
  }
  fail(path, fmt::format("must be an integer, not {}", node->dump()));
}

bool ConfigReader::boolean(std::string_view path, bool fallback) {
  const auto* node = find(path);
  read_.emplace(path);
  if (node == nullptr) return fallback;
  if (!node->is_boolean()) fail(path, fmt::format("must be true or false, not {}", node->dump()));
  return node->get<bool>();
}

std::string ConfigReader::string(std::string_view path, const std::string& fallback) {
  const auto* node = find(path);
  read_.emplace(path);
  if (node == nullptr) return fallback;
  if (!node->is_string()) fail(path, fmt::format("must be a string, not {}", node->dump()));
  return node->get<std::string>();
}

std::vector<double> ConfigReader::numbers(std::string_view path,
                                          const std::vector<double>& fallback) {
  const auto* node = find(path);
  read_.emplace(path);
  if (node == nullptr) return fallback;
  std::vector<double> out;
  if (node->is_array())
    for (const auto& x : *node) {
      if (!x.is_number())
        fail(path, fmt::format("must be a list of numbers, not {}", node->dump()));
      out.push_back(x.get<double>());
    }
  else
    fail(path, fmt::format("must be a list of numbers, not {}", node->dump()));
  return out;
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
  }
  nlohmann::json* node = &root_;
  for (const auto& part : split(path)) {
    if (!node->is_object())
      throw ConfigError(fmt::format("--set '{}': '{}' lies under a value that is not an object",
                                    assignment, part));
    node = &(*node)[part];
  }
  *node = std::move(value);
}

std::vector<std::string> ConfigReader::unread_keys() const {
  std::vector<std::string> leaves;
  collect_leaves(root_, "", leaves);
  std::vector<std::string> unread;
  for (const auto& leaf : leaves) {
    // A leaf counts as read if it or any object above it was read (e.g. a list of betas).
    bool read = false;
    for (std::string p = leaf; !p.empty() && !read;) {
      read = read_.count(p) > 0;
      const auto dot = p.rfind('.');
      p = dot == std::string::npos ? std::string() : p.substr(0, dot);
    }
    if (!read) unread.push_back(leaf);
  }
  return unread;
}

}  // namespace shardswap
