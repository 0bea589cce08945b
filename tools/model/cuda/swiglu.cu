// SwiGLU, act = silu(gate) * up, and its gradient (tools/model/cuda/kernels.h). fp32 arithmetic on
// the weights' type; act and the gradients are rounded to it.
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "model/cuda/common.cuh"
#include "model/cuda/kernels.h"

namespace shardswap::lm::dec {
namespace {

// SwiGLU's elements go 8 at a time (16-byte loads of T: scalar 2-byte loads left these kernels
// at a third of the memory bandwidth, 0.35 ms a call at 8 x 2048 x 4864 on an H200); the
// launcher (with_pack) checks that every pointer is 16-byte aligned and the row length and
// stride multiples of 8, else they go one at a time. (Pack and FloatPack:
// common.cuh.)

__device__ __forceinline__ float silu(float g) {
  return g / (1.0f + expf(-g));
}

// gate and up are rows of `width` elements, ld apart (side by side in one [n, 2 I] block, as one
// GEMM writes them); act and dact are dense [n, width]. Pack i's element offset in gate and up.
template <int N>
__device__ __forceinline__ long long strided(long long i, int width, long long ld) {
  const long long per_row = width / N;
  return (i / per_row) * ld + (i % per_row) * N;
}

// act = silu(gate) * up in T, N elements a thread.
template <class T, int N>
__global__ void swiglu_forward(const T* __restrict__ gate, const T* __restrict__ up,
                               long long packs, int width, long long ld, T* __restrict__ act) {
  GRID_STRIDE(i, packs) {
    const long long at = strided<N>(i, width, ld);
    const Pack<T, N> g = *reinterpret_cast<const Pack<T, N>*>(gate + at);
    const Pack<T, N> u = *reinterpret_cast<const Pack<T, N>*>(up + at);
    Pack<T, N> a;
#pragma unroll
    for (int e = 0; e < N; ++e) a.v[e] = from_float<T>(silu(to_float(g.v[e])) * to_float(u.v[e]));
    reinterpret_cast<Pack<T, N>*>(act)[i] = a;
  }
}

// Given dact (D: fp32, or T with model.bit16_swiglu_grad): gate and up are replaced by their
// gradients (T; they are not needed after), and, when act is not null, act = silu(gate) * up is
// recomputed for the down projection's weight gradient in the same pass (backward does not keep
// act from forward).
template <class T, class D, int N>
__global__ void swiglu_backward(const D* __restrict__ dact, T* __restrict__ gate,
                                T* __restrict__ up, T* __restrict__ act, long long packs,
                                int width, long long ld) {
  GRID_STRIDE(i, packs) {
    const long long at = strided<N>(i, width, ld);
    const FloatPack<N> da = load_floats<N>(dact + i * N);  // common.cuh
    Pack<T, N> g = *reinterpret_cast<const Pack<T, N>*>(gate + at);
    Pack<T, N> u = *reinterpret_cast<const Pack<T, N>*>(up + at);
    Pack<T, N> a;
#pragma unroll
    for (int e = 0; e < N; ++e) {
      const float gv = to_float(g.v[e]), uv = to_float(u.v[e]);
      const float sig = 1.0f / (1.0f + expf(-gv));
      a.v[e] = from_float<T>(gv * sig * uv);
      g.v[e] = from_float<T>(da.v[e] * uv * sig * (1.0f + gv * (1.0f - sig)));
      u.v[e] = from_float<T>(da.v[e] * gv * sig);
    }
    *reinterpret_cast<Pack<T, N>*>(gate + at) = g;
    *reinterpret_cast<Pack<T, N>*>(up + at) = u;
    if (act != nullptr) reinterpret_cast<Pack<T, N>*>(act)[i] = a;
  }
}

// Calls f(std::integral_constant<int, N>) with N = 8, SwiGLU's elements a thread, where every
// pointer is 16-byte aligned and width and ld multiples of 8 (any intermediate_size that is a
// multiple of 8: all Llama, Qwen2 and Mistral sizes), else N = 1.
template <class F>
void with_pack(int width, long long ld, std::initializer_list<const void*> ptrs, F&& f) {
  bool eight = width % 8 == 0 && ld % 8 == 0;
  for (const void* p : ptrs) eight = eight && reinterpret_cast<std::uintptr_t>(p) % 16 == 0;
  if (eight)
    f(std::integral_constant<int, 8>{});
  else
    f(std::integral_constant<int, 1>{});
  check_launch();
}

}  // namespace

template <class T>
void launch_swiglu_forward(const T* gate, const T* up, int rows, int width, long long ld,
                           T* act) {
  const long long count = static_cast<long long>(rows) * width;
  with_pack(width, ld, {gate, up, act}, [&](auto pack) {
    constexpr int N = decltype(pack)::value;
    swiglu_forward<T, N><<<blocks_for(count / N), 256, 0, cudaStreamPerThread>>>(
        gate, up, count / N, width, ld, act);
  });
}

template <class T, class D>
void launch_swiglu_backward(const D* dact, T* gate, T* up, T* act, int rows, int width,
                            long long ld) {
  const long long count = static_cast<long long>(rows) * width;
  with_pack(width, ld, {dact, gate, up, act}, [&](auto pack) {
    constexpr int N = decltype(pack)::value;
    swiglu_backward<T, D, N><<<blocks_for(count / N), 256, 0, cudaStreamPerThread>>>(
        dact, gate, up, act, count / N, width, ld);
  });
}

template void launch_swiglu_forward(const __nv_bfloat16*, const __nv_bfloat16*, int, int,
                                    long long, __nv_bfloat16*);
template void launch_swiglu_forward(const __half*, const __half*, int, int, long long, __half*);
template void launch_swiglu_backward(const float*, __nv_bfloat16*, __nv_bfloat16*,
                                     __nv_bfloat16*, int, int, long long);
template void launch_swiglu_backward(const __nv_bfloat16*, __nv_bfloat16*, __nv_bfloat16*,
                                     __nv_bfloat16*, int, int, long long);
template void launch_swiglu_backward(const float*, __half*, __half*, __half*, int, int,
                                     long long);
template void launch_swiglu_backward(const __half*, __half*, __half*, __half*, int, int,
                                     long long);

}  // namespace shardswap::lm::dec
