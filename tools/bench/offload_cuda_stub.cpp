// bench offload's CUDA rows in a build without CUDA (offload_cuda.cpp has the real ones).
#include "bench/offload_rows.h"
#include "shardswap/error.h"

namespace shardswap {

void cuda_offload_rows(const OffloadData&, HostUpdater&, std::size_t, int,
                       const std::function<void(const OffloadRow&)>&) {
  throw BackendUnavailable("bench offload: --backend cuda: this build has no CUDA backend");
}

}  // namespace shardswap
