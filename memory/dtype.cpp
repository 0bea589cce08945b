#include "shardswap/dtype.h"
#include "support/quoted.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>

#include "shardswap/error.h"

namespace shardswap {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32:
      return "fp32";
    case DType::f64:
      return "fp64";
    case DType::bf16:
      return "bf16";
    case DType::f16:
      return "fp16";
  }
  return "?";
}

DType dtype_from_name(std::string_view name, std::string_view what) {
  std::string lower(name);
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (lower == "fp32" || lower == "float32" || lower == "float") return DType::f32;
  if (lower == "fp64" || lower == "float64" || lower == "double") return DType::f64;
  if (lower == "bf16" || lower == "bfloat16") return DType::bf16;
  if (lower == "fp16" || lower == "float16" || lower == "half") return DType::f16;
  throw ConfigError(
      fmt::format("{} = {}: unknown dtype; expected fp32, fp64, bf16 or fp16", what, quote_value(name)));
}

}  // namespace shardswap
