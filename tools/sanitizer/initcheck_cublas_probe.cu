// Does compute-sanitizer's initcheck see what a cuBLAS GEMM writes? (docs/reliability.md:
// initcheck reported the reads of GEMM outputs by the byte LM, the model of that time, as
// uninitialized, while the results equaled the float64 reference.) C = A x B with beta = 0
// through cublasGemmEx (bf16 in, fp32 out, as that model called it), then a kernel reads every element of C, and the host checks C
// against a float64 product. Run under initcheck: reports here, with a correct C, mean the
// tool does not see the GEMM's stores.
//   nvcc -std=c++17 -arch=sm_90 tools/sanitizer/initcheck_cublas_probe.cu -lcublas -o probe
//   compute-sanitizer --tool initcheck ./probe [M N K]
// PROBE_MEMSET=1 clears C before the GEMM: the control (no report expected).
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#define CHECK(x)                                                                   \
  do {                                                                             \
    const auto s_ = (x);                                                           \
    if (s_ != 0) {                                                                 \
      std::fprintf(stderr, "%s failed (%d) at line %d\n", #x, int(s_), __LINE__); \
      std::exit(1);                                                                \
    }                                                                              \
  } while (0)

__global__ void sum_all(const float* c, long long n, float* out) {
  float acc = 0.0f;
  for (long long i = blockIdx.x * 1LL * blockDim.x + threadIdx.x; i < n;
       i += 1LL * gridDim.x * blockDim.x)
    acc += c[i];
  atomicAdd(out, acc);  // the order does not matter here: only the reads are under test
}

int main(int argc, char** argv) {
  const int m = argc > 3 ? std::atoi(argv[1]) : 256;
  const int n = argc > 3 ? std::atoi(argv[2]) : 512;
  const int k = argc > 3 ? std::atoi(argv[3]) : 128;
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<__nv_bfloat16> a(static_cast<size_t>(m) * k), b(static_cast<size_t>(k) * n);
  for (auto& x : a) x = __float2bfloat16(u(rng));
  for (auto& x : b) x = __float2bfloat16(u(rng));
  __nv_bfloat16 *da, *db;
  float *dc, *dsum;
  CHECK(cudaMalloc(&da, a.size() * sizeof a[0]));
  CHECK(cudaMalloc(&db, b.size() * sizeof b[0]));
  CHECK(cudaMalloc(&dc, static_cast<size_t>(m) * n * sizeof(float)));  // never initialized
  CHECK(cudaMalloc(&dsum, sizeof(float)));
  CHECK(cudaMemset(dsum, 0, sizeof(float)));
  const char* clear = std::getenv("PROBE_MEMSET");
  if (clear != nullptr && clear[0] == '1')
    CHECK(cudaMemset(dc, 0, static_cast<size_t>(m) * n * sizeof(float)));
  CHECK(cudaMemcpy(da, a.data(), a.size() * sizeof a[0], cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(db, b.data(), b.size() * sizeof b[0], cudaMemcpyHostToDevice));
  cublasHandle_t h;
  CHECK(cublasCreate(&h));
  const float one = 1.0f, zero = 0.0f;
  // Column-major: C (m x n) = A (m x k) x B (k x n).
  CHECK(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, &one, da, CUDA_R_16BF, m, db,
                     CUDA_R_16BF, k, &zero, dc, CUDA_R_32F, m, CUBLAS_COMPUTE_32F,
                     CUBLAS_GEMM_DEFAULT));
  sum_all<<<64, 256>>>(dc, static_cast<long long>(m) * n, dsum);
  CHECK(cudaGetLastError());
  std::vector<float> c(static_cast<size_t>(m) * n);
  CHECK(cudaMemcpy(c.data(), dc, c.size() * sizeof(float), cudaMemcpyDeviceToHost));
  double worst = 0.0;
  for (int j = 0; j < n; ++j)
    for (int i = 0; i < m; ++i) {
      double ref = 0.0;
      for (int p = 0; p < k; ++p)
        ref += double(__bfloat162float(a[static_cast<size_t>(p) * m + i])) *
               double(__bfloat162float(b[static_cast<size_t>(j) * k + p]));
      worst = std::fmax(worst, std::fabs(ref - c[static_cast<size_t>(j) * m + i]));
    }
  std::printf("probe: C = A x B, %d x %d x %d, bf16 -> fp32, largest |C - float64| = %.3g (%s)\n",
              m, n, k, worst, worst < 1e-3 ? "correct" : "WRONG");
  cublasDestroy(h);
  return worst < 1e-3 ? 0 : 1;
}
