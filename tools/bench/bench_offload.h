// `shardswap bench offload`: what updating optimizer state that lives in host memory costs (issue
// 31): the multi-threaded host update against the host's copy bandwidth, and with CUDA, the two
// ways to update state kept in pinned memory against the update of state on the device. Every
// update row is checked bit for bit in the same run.
#pragma once

#include <ostream>
#include <string>
#include <vector>

namespace shardswap {

/// Runs the benchmark with the arguments after "bench offload":
///   [--backend cpu|cuda] [--params 256M] [--threads N] [--iters 10] [--json FILE]
/// Rows, all over the same N params of AdamW (fp32 master, m, v; bf16 gradient and param):
///   host copy        memcpy on --threads threads of a buffer of 14 B/param, so that read +
///                    written bytes equal the update's 28 B/param
///   host update      HostUpdater on --threads threads, and on 1; GB/s at 28 B/param and its
///                    ratio to the host copy's
/// and with --backend cuda (cudaMallocHost memory):
///   pinned H2D, D2H, H2D + D2H at once (two streams): 4 B/param each way
///   offload host     state in pinned memory: the bf16 gradient down (2 B/param), HostUpdater,
///                    the bf16 params up (2 B/param), in pieces so that copies overlap the CPU
///   offload streamed state in pinned memory: master, m and v up (12 B/param), the CUDA kernel,
///                    and down (12 B/param), double-buffered pieces
///   on-device        the CUDA kernel alone on state in device memory
/// Prints a fixed-width table to `out` (and the rows as JSON to FILE). Returns 0 when every
/// check passed, 1 otherwise (a failed check voids its row). Throws ConfigError on a bad
/// argument, BackendUnavailable for cuda in a build without CUDA.
int bench_offload(const std::vector<std::string>& args, std::ostream& out);

}  // namespace shardswap
