// The yardstick of a run's GEMM rate (logging.timing on cuda): what cuBLAS itself reaches on one
// GEMM of the model's reference shape (RunModel::reference_gemm), measured in the same process.
#pragma once

#include "shardswap/dtype.h"

namespace shardswap {

/// The rate of a bit16 GEMM (m x k times k x n, fp32 accumulation) through cuBLAS on the
/// current device, in TFLOP/s: a few warm-up calls, then the mean of several timed ones on
/// random data. Its buffers are cudaMalloc'ed for the call and freed (outside any MemorySpace).
/// Throws ConfigError for a non-positive size or a dtype that is not bit16; BackendUnavailable
/// in a build without CUDA.
double measure_cublas_gemm_tflops(int m, int n, int k, DType dtype);

}  // namespace shardswap
