// `shardswap bench switch`: the cost of a layer switch against the bytes it must touch.
#pragma once

#include <ostream>
#include <string>
#include <vector>

namespace shardswap {

/// shardswap bench switch [--backend cpu|cuda] [--layers 32] [--dim 4096] [--switches 20]
///                        [--json FILE]
/// Returns 0, or 1 if a row's check failed (stats not equal to the plan after the switches).
int bench_switch(const std::vector<std::string>& args, std::ostream& out);

}  // namespace shardswap
