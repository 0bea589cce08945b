// The public element conversions (shardswap/elements.h) over the CPU backend's kernels. The
// arguments are checked here so that an error names these functions and their parameters, not
// the kernel table behind them.
#include "shardswap/elements.h"

#include <fmt/format.h>

#include "optimizer/optimizer.h"
#include "shardswap/error.h"

namespace shardswap {
namespace {

void require(const char* fn, const char* what, DType type, const void* data, std::size_t count) {
  if (type == DType::f64)
    throw ConfigError(fmt::format("{}: {} is fp64; supported: fp32, bf16, fp16", fn, what));
  if (count > 0 && data == nullptr)
    throw ConfigError(fmt::format("{}: {} is null for {} elements", fn, what, count));
}

}  // namespace

void convert_elements(void* dst, DType to, const void* src, DType from, std::size_t count) {
  require("convert_elements", "dst", to, dst, count);
  require("convert_elements", "src", from, src, count);
  cpu_device_ops().cast(dst, to, src, from, count);
}

void accumulate_elements(void* dst, DType dst_type, const void* src, DType src_type,
                         std::size_t count) {
  require("accumulate_elements", "dst", dst_type, dst, count);
  require("accumulate_elements", "src", src_type, src, count);
  cpu_device_ops().accumulate(dst, dst_type, src, src_type, count);
}

}  // namespace shardswap
