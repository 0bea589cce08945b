// Host element values of every type the collectives carry (double, float, bf16_t, f16_t) as
// float64, for comparing against float64 references. Shared by the CPU and GPU suites.
#pragma once

#include <type_traits>

#include "memory/host_types.h"

namespace shardswap::test_support {

/// x as float64, exactly: every fp32, bf16 and fp16 value is one.
template <class T>
double to_double(T x) {
  if constexpr (std::is_same_v<T, double>) {
    return x;
  } else {
    return static_cast<double>(static_cast<float>(x));
  }
}

}  // namespace shardswap::test_support
