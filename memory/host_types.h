// Host C++ types of the element types: Eigen's bfloat16 and half (round to nearest even).
#pragma once

#include <Eigen/Core>

#include "shardswap/dtype.h"

namespace shardswap {

using bf16_t = Eigen::bfloat16;
using f16_t = Eigen::half;

template <>
constexpr DType dtype_of<bf16_t>() {
  return DType::bf16;
}
template <>
constexpr DType dtype_of<f16_t>() {
  return DType::f16;
}

}  // namespace shardswap
