// Linked when CUDA is off: measure_cublas_gemm_tflops fails with a clear error.
#include "shardswap/error.h"
#include "model/cublas_rate.h"

namespace shardswap {

double measure_cublas_gemm_tflops(int, int, int, DType) {
  throw BackendUnavailable("measure_cublas_gemm_tflops: ShardSwap was built without CUDA");
}

}  // namespace shardswap
