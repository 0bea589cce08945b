// data[i] *= factor on a CUDA stream (for NCCL's avg, done as sum then scale: NCCL 2.28's ncclAvg
// left the last element of an odd-sized out-of-place reduce_scatter unwritten on one rank, seen on
// the H200 on 2026-11-29).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "shardswap/dtype.h"

namespace shardswap {

void scale_on_stream(void* data, std::size_t count, DType dtype, double factor,
                     cudaStream_t stream);

}  // namespace shardswap
