// Linked when CUDA is off: the CUDA backend's symbols, failing with a clear error.
#include "shardswap/error.h"
#include "tools/lm/byte_lm_compute.h"

namespace shardswap {

namespace lm {

std::unique_ptr<Compute> make_cuda_compute(const Dims&, int, DType, void*, std::size_t) {
  throw BackendUnavailable("make_byte_lm: ShardSwap was built without CUDA");
}

double cublas_gemm_tflops(int, int, int, DType) {
  throw BackendUnavailable("measure_cublas_gemm_tflops: ShardSwap was built without CUDA");
}

}  // namespace lm

}  // namespace shardswap
