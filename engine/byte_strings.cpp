// Strings that are not UTF-8 in a checkpoint's metadata (encode_byte_strings,
// decode_byte_strings; shardswap/checkpoint.h): a path may hold any bytes, JSON text may not.
#include <fmt/format.h>

#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "engine/checkpoint_format.h"
#include "shardswap/checkpoint.h"
#include "shardswap/error.h"

namespace shardswap {

using checkpoint_detail::is_lower_hex;
using nlohmann::json;

namespace {

// RFC 3629: no overlong forms, no surrogates, nothing above U+10FFFF (what JSON text allows).
bool valid_utf8(std::string_view s) {
  for (std::size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) {
      ++i;
      continue;
    }
    std::size_t len = 0;
    std::uint32_t cp = 0;
    if ((c & 0xe0) == 0xc0) {
      len = 2, cp = c & 0x1f;
    } else if ((c & 0xf0) == 0xe0) {
      len = 3, cp = c & 0x0f;
    } else if ((c & 0xf8) == 0xf0) {
      len = 4, cp = c & 0x07;
    } else {
      return false;
    }
    if (i + len > s.size()) return false;
    for (std::size_t k = 1; k < len; ++k) {
      const auto b = static_cast<unsigned char>(s[i + k]);
      if ((b & 0xc0) != 0x80) return false;
      cp = (cp << 6) | (b & 0x3f);
    }
    if ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) ||
        cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))
      return false;
    i += len;
  }
  return true;
}

constexpr const char* kBytesHex = "bytes_hex";
constexpr const char* kObjectEntries = "object_entries";

bool looks_encoded(const json& j) {
  return j.is_object() && j.size() == 1 && (j.contains(kBytesHex) || j.contains(kObjectEntries));
}

std::string to_hex(std::string_view s) {
  std::string out;
  out.reserve(2 * s.size());
  for (unsigned char c : s) out += fmt::format("{:02x}", c);
  return out;
}

std::string from_hex(const std::string& hex) {
  if (hex.size() % 2 != 0 || !is_lower_hex(hex))
    throw ConfigError(
        fmt::format("{} '{}' is not an even number of lowercase hex digits", kBytesHex, hex));
  std::string out(hex.size() / 2, '\0');
  for (std::size_t i = 0; i < out.size(); ++i)
    out[i] = static_cast<char>(std::stoi(hex.substr(2 * i, 2), nullptr, 16));
  return out;
}

}  // namespace

json encode_byte_strings(const json& j) {
  if (j.is_string()) {
    const auto& s = j.get_ref<const std::string&>();
    if (valid_utf8(s)) return j;
    json out = json::object();
    out[kBytesHex] = to_hex(s);
    return out;
  }
  if (j.is_array()) {
    json out = json::array();
    for (const auto& e : j) out.push_back(encode_byte_strings(e));
    return out;
  }
  if (!j.is_object()) return j;
  bool plain = !looks_encoded(j);
  for (const auto& [key, value] : j.items()) plain = plain && valid_utf8(key);
  json out = json::object();
  if (plain) {
    for (const auto& [key, value] : j.items()) out[key] = encode_byte_strings(value);
    return out;
  }
  json entries = json::array();
  for (const auto& [key, value] : j.items())
    entries.push_back(json::array({encode_byte_strings(json(key)), encode_byte_strings(value)}));
  out[kObjectEntries] = std::move(entries);
  return out;
}

// Recursive, and bounded: metadata is read at most kMaxMetadataDepth deep (read_checkpoint_metadata
// refuses deeper), and save_checkpoint refuses to store anything deeper.
json decode_byte_strings(const json& j) {
  if (j.is_array()) {
    json out = json::array();
    for (const auto& e : j) out.push_back(decode_byte_strings(e));
    return out;
  }
  if (!j.is_object()) return j;
  if (looks_encoded(j) && j.contains(kBytesHex)) {
    if (!j[kBytesHex].is_string())
      throw ConfigError(fmt::format("{} holds {}, not a string", kBytesHex, j[kBytesHex].dump()));
    return from_hex(j[kBytesHex].get<std::string>());
  }
  json out = json::object();
  if (looks_encoded(j)) {
    if (!j[kObjectEntries].is_array())
      throw ConfigError(fmt::format("{} is not an array", kObjectEntries));
    for (const auto& e : j[kObjectEntries]) {
      const json key = e.is_array() && e.size() == 2 ? decode_byte_strings(e[0]) : json();
      if (!key.is_string())
        throw ConfigError(
            fmt::format("{} holds {}, not a [key, value] pair", kObjectEntries, e.dump()));
      out[key.get<std::string>()] = decode_byte_strings(e[1]);
    }
    return out;
  }
  for (const auto& [key, value] : j.items()) out[key] = decode_byte_strings(value);
  return out;
}

}  // namespace shardswap
