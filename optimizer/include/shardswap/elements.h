// Element conversions on host memory, for code that holds bit16 data as raw bytes (the host C++
// types of bf16 and fp16 are not part of the API): a model that upcasts its weights, or adds an
// fp32 gradient into the slot the engine hands it. The arithmetic is the CPU backend's own, so
// the bits are those the engine's CPU kernels give (round to nearest even, through fp32).
#pragma once

#include <cstddef>

#include "shardswap/dtype.h"

namespace shardswap {

/// dst[i] = to(src[i]) for i < count: fp32, bf16 or fp16 each way, through fp32 (exact from
/// bf16 and fp16, so rounded once); the same type copies the bits. ConfigError naming the
/// argument for fp64 or a null pointer with count > 0; nothing is written then.
void convert_elements(void* dst, DType to, const void* src, DType from, std::size_t count);

/// dst[i] = dst_type(float(dst[i]) + float(src[i])) for i < count: adds a gradient into a slot of
/// any of fp32, bf16, fp16 from any of them. Errors as convert_elements.
void accumulate_elements(void* dst, DType dst_type, const void* src, DType src_type,
                         std::size_t count);

}  // namespace shardswap
