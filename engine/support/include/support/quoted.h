// A value as config errors show it: in double quotes, as in the JSON it came from, with quotes,
// backslashes and control bytes escaped. Our own and not fmt's "{:?}": fmt 9 refuses that
// specifier for some argument types at run time (a fuzzed config found it: "invalid type
// specifier" escaped as an fmt::format_error instead of the ConfigError being built). Not named
// "quoted": with a std::string argument, std::quoted would be found by ADL.
#pragma once

#include <cstdio>
#include <string>
#include <string_view>

namespace shardswap {

inline std::string quote_value(std::string_view value) {
  std::string out = "\"";
  for (const char c : value) {
    const auto byte = static_cast<unsigned char>(c);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\t') {
      out += "\\t";
    } else if (byte < 0x20 || byte == 0x7f) {
      char escaped[8];
      std::snprintf(escaped, sizeof escaped, "\\x%02x", byte);
      out += escaped;
    } else {
      out += c;
    }
  }
  out += '"';
  return out;
}

}  // namespace shardswap
