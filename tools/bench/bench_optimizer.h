// `shardswap bench optimizer`: the fused AdamW shard update against the copy bandwidth of the same
// backend and run, each row checked for correctness in that run.
#pragma once

#include <ostream>
#include <string>
#include <vector>

namespace shardswap {

/// Runs the benchmark with the arguments after "bench optimizer":
///   [--backend cpu|cuda] [--sizes 64M,256M,1G] [--iters N] [--json FILE]
/// Prints a fixed-width table to `out` (and the rows as JSON to FILE). Returns 0 when every row's
/// check passed, 1 otherwise (a failed check voids that row's numbers). Throws ConfigError on a
/// bad argument, BackendUnavailable for cuda in a build without CUDA.
int bench_optimizer(const std::vector<std::string>& args, std::ostream& out);

}  // namespace shardswap
