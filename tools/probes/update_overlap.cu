// How much of the optimizer's update can hide under the next step's forward? (issue 32: the
// engine's update, 28 bytes a param, is memory-bound; the forward is GEMM-bound.) This probe runs
// a decoder-shaped forward's GEMMs (L layers of q|k|v, o, gate|up, down over n tokens) and an
// AdamW-shaped update of the same params (fp32 master, m, v and gradient in, bf16 weight out),
// split in L groups: alone, one after the other on one stream, and overlapped (the update on a
// second stream, layer l's GEMMs waiting only for group l's update). It prints each time and what
// the overlap saved against the serial order.
//   nvcc -std=c++17 -O2 -arch=sm_90 tools/probes/update_overlap.cu -lcublas -o update_overlap
//   ./update_overlap [hidden intermediate layers tokens vocab kv_width]   (default: Qwen2.5-1.5B,
//   4 x 2048; Qwen2.5-0.5B at 8 x 2048: 896 4864 24 16384 151936 128)
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(x)                                                                         \
  do {                                                                                   \
    if (auto e = (x); e != 0) {                                                          \
      std::fprintf(stderr, "%s:%d: %s failed (%d)\n", __FILE__, __LINE__, #x, int(e)); \
      std::exit(1);                                                                      \
    }                                                                                    \
  } while (0)

namespace {

__global__ void adamw(float* master, float* m, float* v, const float* grad, __nv_bfloat16* w,
                      size_t n) {
  const float lr = 1e-4f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f, wd = 0.1f;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    const float g = grad[i];
    const float mi = b1 * m[i] + (1 - b1) * g;
    const float vi = b2 * v[i] + (1 - b2) * g * g;
    float p = master[i];
    p -= lr * (mi / (sqrtf(vi) + eps) + wd * p);
    m[i] = mi;
    v[i] = vi;
    master[i] = p;
    w[i] = __float2bfloat16(p);
  }
}

// The same update, four elements a thread per load, on `gridDim.x` blocks of 1024 threads: one
// block an SM, so a small grid leaves the other SMs to the GEMMs beside it.
__global__ void __launch_bounds__(1024) adamw4(float4* master, float4* m, float4* v,
                                               const float4* grad, __nv_bfloat162* w, size_t n4) {
  const float lr = 1e-4f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f, wd = 0.1f;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n4;
       i += size_t{gridDim.x} * blockDim.x) {
    const float4 g = grad[i];
    float4 mi = m[i], vi = v[i], p = master[i];
    const auto one = [&](float& mm, float& vv, float& pp, float gg) {
      mm = b1 * mm + (1 - b1) * gg;
      vv = b2 * vv + (1 - b2) * gg * gg;
      pp -= lr * (mm / (sqrtf(vv) + eps) + wd * pp);
    };
    one(mi.x, vi.x, p.x, g.x);
    one(mi.y, vi.y, p.y, g.y);
    one(mi.z, vi.z, p.z, g.z);
    one(mi.w, vi.w, p.w, g.w);
    m[i] = mi;
    v[i] = vi;
    master[i] = p;
    w[2 * i] = __floats2bfloat162_rn(p.x, p.y);
    w[2 * i + 1] = __floats2bfloat162_rn(p.z, p.w);
  }
}

void* device(size_t bytes) {
  void* p = nullptr;
  CHECK(cudaMalloc(&p, bytes));
  CHECK(cudaMemset(p, 0, bytes));
  return p;
}

struct Shape {
  long d = 1536, i = 8960, layers = 28, n = 8192, vocab = 151936;
  long q = 1536, kv = 256;
  long layer_params() const { return d * (q + 2 * kv) + q * d + 3 * i * d + 2 * d; }
};

}  // namespace

int main(int argc, char** argv) {
  Shape s;
  if (argc >= 7) {
    s.d = std::atol(argv[1]);
    s.i = std::atol(argv[2]);
    s.layers = std::atol(argv[3]);
    s.n = std::atol(argv[4]);
    s.vocab = std::atol(argv[5]);
    s.q = s.d;
    s.kv = std::atol(argv[6]);
  }
  const size_t group = s.layer_params();
  const size_t total = group * s.layers;
  std::printf("d %ld, i %ld, %ld layers, %ld tokens: %.3f Gparams updated in %ld groups\n", s.d,
              s.i, s.layers, s.n, total / 1e9, s.layers);

  auto* master = static_cast<float*>(device(total * 4));
  auto* m = static_cast<float*>(device(total * 4));
  auto* v = static_cast<float*>(device(total * 4));
  auto* grad = static_cast<float*>(device(total * 4));
  auto* w16 = static_cast<__nv_bfloat16*>(device(total * 2));
  const long widest = std::max({s.q + 2 * s.kv, 2 * s.i, s.d});
  auto* x = static_cast<__nv_bfloat16*>(device(size_t(s.n) * std::max(s.i, s.d) * 2));
  auto* y = static_cast<__nv_bfloat16*>(device(size_t(s.n) * widest * 2));

  cublasHandle_t h;
  CHECK(cublasCreate(&h));
  cudaStream_t main_stream, side;
  CHECK(cudaStreamCreateWithFlags(&main_stream, cudaStreamNonBlocking));
  CHECK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
  std::vector<cudaEvent_t> updated(s.layers);
  for (auto& ev : updated) CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  cudaEvent_t t0, t1, side_done;
  CHECK(cudaEventCreate(&t0));
  CHECK(cudaEventCreate(&t1));
  CHECK(cudaEventCreateWithFlags(&side_done, cudaEventDisableTiming));
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));

  const auto gemm = [&](cudaStream_t st, long out, long in, const __nv_bfloat16* wt) {
    CHECK(cublasSetStream(h, st));
    const float one = 1.0f, zero = 0.0f;
    // y[n, out] = x[n, in] W[out, in]^T, column-major as cuBLAS sees it.
    CHECK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, int(out), int(s.n), int(in), &one, wt,
                       CUDA_R_16BF, int(in), x, CUDA_R_16BF, int(in), &zero, y, CUDA_R_16BF,
                       int(out), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  };
  const auto layer_forward = [&](cudaStream_t st, long l) {
    const __nv_bfloat16* wl = w16 + l * group;
    gemm(st, s.q + 2 * s.kv, s.d, wl);
    gemm(st, s.d, s.q, wl);
    gemm(st, 2 * s.i, s.d, wl);
    gemm(st, s.d, s.i, wl);
  };
  const auto update = [&](cudaStream_t st, long l) {
    const size_t at = l * group;
    adamw<<<sms * 8, 256, 0, st>>>(master + at, m + at, v + at, grad + at, w16 + at, group);
    CHECK(cudaGetLastError());
  };

  const auto timed = [&](const char* what, auto&& body) {
    std::vector<float> ms;
    for (int r = 0; r < 7; ++r) {
      CHECK(cudaEventRecord(t0, main_stream));
      body();
      CHECK(cudaEventRecord(t1, main_stream));
      CHECK(cudaEventSynchronize(t1));
      float t = 0;
      CHECK(cudaEventElapsedTime(&t, t0, t1));
      if (r > 1) ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    const float median = ms[ms.size() / 2];
    std::printf("%-46s %8.2f ms\n", what, median);
    return median;
  };

  const float update_alone = timed("update alone (one stream)", [&] {
    for (long l = 0; l < s.layers; ++l) update(main_stream, l);
  });
  const float forward_alone = timed("forward GEMMs alone", [&] {
    for (long l = 0; l < s.layers; ++l) layer_forward(main_stream, l);
  });
  const float serial = timed("update, then forward (one stream)", [&] {
    for (long l = 0; l < s.layers; ++l) update(main_stream, l);
    for (long l = 0; l < s.layers; ++l) layer_forward(main_stream, l);
  });
  // The update on the side stream, group by group, and the forward on the main one, layer l
  // waiting for group l's update only.
  const auto overlapped_with = [&](auto&& update_on) {
    CHECK(cudaEventRecord(side_done, main_stream));
    CHECK(cudaStreamWaitEvent(side, side_done, 0));
    for (long l = 0; l < s.layers; ++l) {
      update_on(side, l);
      CHECK(cudaEventRecord(updated[l], side));
    }
    for (long l = 0; l < s.layers; ++l) {
      CHECK(cudaStreamWaitEvent(main_stream, updated[l], 0));
      layer_forward(main_stream, l);
    }
  };
  const float overlapped =
      timed("overlapped (layer l waits for group l)", [&] { overlapped_with(update); });
  // The update on a few SMs (blocks of 1024 threads, one an SM): alone and beside the forward.
  for (int blocks : {16, 33, 66, sms}) {
    const auto capped = [&](cudaStream_t st, long l) {
      const size_t at = l * group;  // group is a multiple of 4 at these shapes
      adamw4<<<blocks, 1024, 0, st>>>(reinterpret_cast<float4*>(master + at),
                                      reinterpret_cast<float4*>(m + at),
                                      reinterpret_cast<float4*>(v + at),
                                      reinterpret_cast<const float4*>(grad + at),
                                      reinterpret_cast<__nv_bfloat162*>(w16 + at), group / 4);
      CHECK(cudaGetLastError());
    };
    char label[96];
    std::snprintf(label, sizeof label, "update on %d blocks of 1024, alone", blocks);
    timed(label, [&] {
      for (long l = 0; l < s.layers; ++l) capped(main_stream, l);
    });
    std::snprintf(label, sizeof label, "update on %d blocks of 1024, overlapped", blocks);
    const float beside = timed(label, [&] { overlapped_with(capped); });
    std::printf("  %d blocks: saved %.2f ms against the full-grid serial order\n", blocks,
                serial - beside);
  }
  const double bytes = double(total) * 30;
  std::printf("update: %.2f TB/s at 30 bytes a param; forward %.1f TFLOP/s\n",
              bytes / (update_alone * 1e-3) / 1e12,
              2.0 * s.n * (group - 2 * s.d) * s.layers / (forward_alone * 1e-3) / 1e12);
  std::printf("overlap saved %.2f ms of %.2f (%.0f%% of the update)\n", serial - overlapped, serial,
              100.0 * (serial - overlapped) / update_alone);
  return 0;
}
