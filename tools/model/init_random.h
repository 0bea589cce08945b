// Deterministic initial values of the built-in models: FNV-1a of the param's name mixed with the
// seed drives an mt19937_64, and the mapping of its 64-bit outputs to uniform and normal values is
// ours (no std:: distributions, whose output the standard leaves to the library), so every
// platform and every rank draws the same values.
#pragma once

#include <cmath>
#include <cstdint>
#include <numbers>
#include <random>
#include <string_view>

#include "shardswap/checkpoint.h"  // fnv1a64

namespace shardswap::lm {

inline std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/// The generator of one param's values.
inline std::mt19937_64 param_rng(std::string_view name, std::uint64_t seed) {
  return std::mt19937_64(splitmix64(fnv1a64(name.data(), name.size()) ^ splitmix64(seed)));
}

/// [0, 1) with 53 random bits.
inline double uniform01(std::mt19937_64& rng) {
  return static_cast<double>(rng() >> 11) * 0x1.0p-53;
}

/// Box-Muller; 1 - u keeps the logarithm's argument in (0, 1].
inline double normal01(std::mt19937_64& rng) {
  const double u1 = 1.0 - uniform01(rng), u2 = uniform01(rng);
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
}

}  // namespace shardswap::lm
