// Element types of flat buffers. The host C++ types of bf16 and fp16 are internal
// (memory/host_types.h, Eigen's); public code reads and writes them as raw bytes or through
// the float conversions of the Engine (read_weight, add_grad) and of shardswap/elements.h.
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
/// Throws ConfigError "WHAT = \"NAME\": unknown dtype; ..." on anything else (`what`: a config
/// key or parameter).
DType dtype_from_name(std::string_view name, std::string_view what);

/// The DType of a host C++ type, for View::data<T>(): float and double here; bf16 and fp16
/// where their host types are declared. Any other type does not compile.
template <class T>
constexpr DType dtype_of() = delete;
template <>
constexpr DType dtype_of<float>() {
  return DType::f32;
}
template <>
constexpr DType dtype_of<double>() {
  return DType::f64;
}

}  // namespace shardswap
