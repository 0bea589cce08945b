// The element work of in-process collectives (internal): what InProcessGroup runs on one
// backend's memory.
#pragma once

#include <cstddef>

#include "shardswap/allocator.h"
#include "shardswap/communicator.h"
#include "shardswap/dtype.h"

namespace shardswap {

/// The element work of in-process collectives on one backend's memory (host, or one GPU that all
/// ranks share). Every function completes before it returns.
struct CollectiveOps {
  const char* name;
  DeviceKind device;  ///< the memory it works on
  /// dst[i] = op over q = 0..nsrc-1 of src[q][i]: bit16 and fp32 accumulate in fp32, fp64 in fp64,
  /// in rank order, rounded once. dst may be one of the sources.
  void (*reduce)(DType dtype, const void* const* src, int nsrc, void* dst, std::size_t count,
                 ReduceOp op);
  void (*copy)(void* dst, const void* src, std::size_t bytes);
  /// Waits for the calling thread's queued work on the backend (its writes become readable).
  void (*sync)();
  /// Scratch memory for all_reduce; may be cached per thread.
  void* (*scratch)(std::size_t bytes);
};

const CollectiveOps& host_collective_ops();
/// Ranks as threads sharing the current CUDA device. Throws BackendUnavailable without CUDA.
const CollectiveOps& cuda_collective_ops();

}  // namespace shardswap
