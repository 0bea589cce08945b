// An fp32 master value kept as the bf16 weight plus its low 16 bits (MasterStorage::
// bf16_remainder): the two halves and back, the same on the host and in CUDA kernels (every
// backend must split alike for offloaded and on-device runs to agree).
//
// A bijection between fp32 bit patterns and (weight, low) pairs needs each bf16 weight to stand
// for exactly 65,536 fp32 values; rounding ties to even gives even weights 65,537 and odd ones
// 65,535, so the weight here rounds ties away from zero: weight = high half + (low >= 0x8000), and
// the master is ((weight - (low >> 15)) << 16) | low. NaN masters are stored as the canonical
// quiet NaN (0x7FC00000): a NaN's high half can be 0x7FFF or 0xFFFF, which the carry would wrap.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define SHARDSWAP_HOST_DEVICE __host__ __device__
#else
#define SHARDSWAP_HOST_DEVICE
#endif

namespace shardswap::detail {

struct MasterHalves {
  std::uint16_t weight;  ///< bf16 bits
  std::uint16_t low;
};

/// The halves of an fp32 master's bits.
SHARDSWAP_HOST_DEVICE inline MasterHalves split_master(std::uint32_t bits) {
  if ((bits & 0x7F800000u) == 0x7F800000u && (bits & 0x007FFFFFu) != 0) bits = 0x7FC00000u;
  const auto low = static_cast<std::uint16_t>(bits & 0xFFFFu);
  return {static_cast<std::uint16_t>((bits >> 16) + (low >> 15)), low};
}

/// The fp32 master's bits from its halves (split_master's inverse on every non-NaN value).
SHARDSWAP_HOST_DEVICE inline std::uint32_t join_master(std::uint16_t weight, std::uint16_t low) {
  return ((static_cast<std::uint32_t>(weight) - (low >> 15)) << 16) | low;
}

}  // namespace shardswap::detail
