// Peak memory with gradient compression on and off, read from the allocator's stats: the check
// that the failure of ../shared/seeds/000 (a compressed copy kept per bucket) cannot happen here.
#pragma once

#include <cstdint>

#include "shardswap/dtype.h"
#include "shardswap/backend.h"

namespace shardswap::test_support {

struct PeakPair {
  std::int64_t off = 0;     ///< peak allocated bytes, fp32 gradients on the wire
  std::int64_t on = 0;      ///< peak allocated bytes, `wire` gradients on the wire
  std::int64_t bucket = 0;  ///< one reduce bucket, bytes
};

/// Builds a stack of square-ish linear layers of about `params` elements in total, fp32
/// gradients, and runs two steps with communication in fp32 and then in `wire`.
PeakPair compression_peaks(const Backend& backend, std::int64_t params, int stage, DType wire,
                           int world_size);

}  // namespace shardswap::test_support
