// Element types of flat buffers. (Their host C++ types are in memory/host_types.h, kept apart so
// CUDA sources can use DType without Eigen.)
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace shardswap {

enum class DType { f32, f64, bf16, f16 };

constexpr std::size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32:
      return 4;
    case DType::f64:
      return 8;
    case DType::bf16:
      return 2;
    case DType::f16:
      return 2;
  }
  return 0;
}

constexpr bool is_bit16(DType t) {
  return t == DType::bf16 || t == DType::f16;
}

const char* dtype_name(DType t);

/// Parses "fp32"/"float32", "fp64", "bf16"/"bfloat16", "fp16"/"float16"/"half".
/// Throws ConfigError naming `what` (a config key or parameter) on anything else.
DType dtype_from_name(std::string_view name, std::string_view what);

}  // namespace shardswap
