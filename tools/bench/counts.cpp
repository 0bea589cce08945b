#include "bench/counts.h"

#include <fmt/format.h>

#include <algorithm>

#include "shardswap/error.h"

namespace shardswap {

std::size_t parse_count(const std::string& text, const std::string& what) {
  const auto bad = [&] {
    return ConfigError(fmt::format(
        "{}: '{}' is not a count like 64M, 256M or 1G (K, M, G are powers of 1024)", what, text));
  };
  if (text.empty()) throw bad();
  std::size_t unit = 1;
  std::string digits = text;
  switch (text.back()) {
    case 'K':
    case 'k':
      unit = std::size_t{1} << 10;
      break;
    case 'M':
    case 'm':
      unit = std::size_t{1} << 20;
      break;
    case 'G':
    case 'g':
      unit = std::size_t{1} << 30;
      break;
    default:
      break;
  }
  if (unit != 1) digits.pop_back();
  if (digits.empty() || digits.size() > 12 ||
      !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; }))
    throw bad();
  const std::size_t count = std::stoull(digits) * unit;
  if (count == 0) throw bad();
  return count;
}

std::string count_label(std::size_t n) {
  if (n % (std::size_t{1} << 30) == 0) return fmt::format("{}G", n >> 30);
  if (n % (std::size_t{1} << 20) == 0) return fmt::format("{}M", n >> 20);
  if (n % (std::size_t{1} << 10) == 0) return fmt::format("{}K", n >> 10);
  return std::to_string(n);
}

}  // namespace shardswap
