// Element counts as the benchmarks read and print them: 64M, 256M, 1G (K, M, G are powers of 1024).
#pragma once

#include <cstddef>
#include <string>

namespace shardswap {

/// A count >= 1 written as digits with an optional K, M or G. Throws ConfigError
/// "<what>: '<text>' is not a count like 64M, 256M or 1G (...)", `what` naming the command and
/// option ("bench optimizer: --sizes").
std::size_t parse_count(const std::string& text, const std::string& what);
/// The count with the largest of G, M, K that divides it ("256M"), else its digits.
std::string count_label(std::size_t n);

}  // namespace shardswap
