// Where does a cuBLAS handle's device memory go? (docs/memory.md, "Outside the plan".) The
// decoder hands every cuBLAS handle a workspace from its own block, yet the driver's free memory
// (cudaMemGetInfo) drops by more than the plan. This probe reads cudaMemGetInfo after each
// stage of the decoder's use of cuBLAS: context, cublasCreate, cublasSetStream, our workspace,
// the first bf16 GEMM, GEMMs of other shapes, a second handle, and the handles destroyed.
//   nvcc -std=c++17 -arch=sm_90 tools/probes/cublas_memory.cu -lcublas -o cublas_memory
//   ./cublas_memory            (then again under CUBLAS_WORKSPACE_CONFIG / CUDA_MODULE_LOADING)
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define CHECK(x)                                                                         \
  do {                                                                                   \
    if (auto e = (x); e != 0) {                                                          \
      std::fprintf(stderr, "%s:%d: %s failed (%d)\n", __FILE__, __LINE__, #x, int(e)); \
      std::exit(1);                                                                      \
    }                                                                                    \
  } while (0)

namespace {

long long free_bytes() {
  size_t free = 0, total = 0;
  CHECK(cudaMemGetInfo(&free, &total));
  return static_cast<long long>(free);
}

long long last = 0;
void stage(const char* what) {
  const long long now = free_bytes();
  std::printf("%-52s %12lld bytes (%8.2f MiB)\n", what, last - now, (last - now) / 1048576.0);
  last = now;
}

void* device(size_t bytes) {
  void* p = nullptr;
  CHECK(cudaMalloc(&p, bytes));
  CHECK(cudaMemset(p, 0, bytes));
  return p;
}

// C[m, n] = A[m, k] B[k, n] in cuBLAS's column-major terms, bf16 in, fp32 out and compute: the
// decoder's calls.
void gemm(cublasHandle_t h, int m, int n, int k, const void* a, const void* b, void* c) {
  const float one = 1.0f, zero = 0.0f;
  CHECK(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, &one, a, CUDA_R_16BF, m, b,
                     CUDA_R_16BF, k, &zero, c, CUDA_R_32F, m, CUBLAS_COMPUTE_32F,
                     CUBLAS_GEMM_DEFAULT));
  CHECK(cudaStreamSynchronize(cudaStreamPerThread));
}

}  // namespace

int main() {
  const char* ws = std::getenv("CUBLAS_WORKSPACE_CONFIG");
  const char* ml = std::getenv("CUDA_MODULE_LOADING");
  std::printf("CUBLAS_WORKSPACE_CONFIG=%s CUDA_MODULE_LOADING=%s\n", ws ? ws : "(unset)",
              ml ? ml : "(unset)");
  CHECK(cudaFree(nullptr));
  last = free_bytes();
  const size_t big = size_t{8192} * 8192;
  void* a = device(big * 2);
  void* b = device(big * 2);
  void* c = device(big * 4);
  const size_t ws_bytes = size_t{32} << 20;
  void* workspace = device(ws_bytes);
  stage("operands (3 x 8192^2) and our 32 MiB workspace");
  cublasHandle_t h1 = nullptr, h2 = nullptr;
  CHECK(cublasCreate(&h1));
  stage("cublasCreate");
  CHECK(cublasSetStream(h1, cudaStreamPerThread));
  stage("cublasSetStream(cudaStreamPerThread)");
  CHECK(cublasSetWorkspace(h1, workspace, ws_bytes));
  stage("cublasSetWorkspace(ours)");
  gemm(h1, 1024, 1024, 1024, a, b, c);
  stage("first GEMM 1024^3");
  gemm(h1, 4096, 8192, 896, a, b, c);
  gemm(h1, 896, 8192, 4864, a, b, c);
  gemm(h1, 8192, 8192, 8192, a, b, c);
  stage("GEMMs of three other shapes");
  CHECK(cublasCreate(&h2));
  CHECK(cublasSetStream(h2, cudaStreamPerThread));
  CHECK(cublasSetWorkspace(h2, workspace, ws_bytes));
  gemm(h2, 1024, 1024, 1024, a, b, c);
  stage("a second handle, same stream and workspace, a GEMM");
  CHECK(cublasDestroy(h2));
  stage("second handle destroyed");
  CHECK(cublasDestroy(h1));
  stage("first handle destroyed");
  CHECK(cudaFree(a));
  CHECK(cudaFree(b));
  CHECK(cudaFree(c));
  CHECK(cudaFree(workspace));
  stage("operands and workspace freed");
  return 0;
}
