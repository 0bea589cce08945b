// Documents apart through cuDNN: a call's rows gathered from the batch into padded buffers, and
// the results scattered back (tools/model/cuda/kernels.h; the calls: tools/model/apart_calls.h).
// Pure copies: the values cuDNN sees and gives are the batch's own, bit for bit.
#include <cstdint>
#include <string>

#include "model/apart_calls.h"
#include "model/cuda/common.cuh"
#include "model/cuda/kernels.h"

namespace shardswap::lm::dec {
namespace {

// 8 elements (16 bytes) a load or store.
constexpr int kApartPack = 8;
constexpr int kApartThreads = 128;

// A block a padded row (grid: sequences * seq_len). Gather writes every padded row, zeros where
// no document's row is (the buffers live in scratch that held other values); scatter writes
// only the documents' rows.
template <class T, bool kGather>
__global__ void __launch_bounds__(kApartThreads)
    apart_rows(const int* __restrict__ docs, int count, int seq_len, ApartTensors<T> ts,
               const float* __restrict__ lse_from, float* __restrict__ lse_to, int heads) {
  using P = Pack<T, kApartPack>;
  const long long r = blockIdx.x;
  const long long batch_row = apart_batch_row(docs, count, seq_len, r);
  const bool real = batch_row >= 0;
  if (!kGather && !real) return;
  const long long row = real ? batch_row : 0;
  for (int i = 0; i < ts.count; ++i) {
    const ApartTensor<T> t = ts.t[i];
    const int packs = t.width / kApartPack;
    const long long batch_at = row * t.ld, padded_at = r * t.width;
    for (int e = threadIdx.x; e < packs; e += blockDim.x) {
      if constexpr (kGather) {
        P v;
        if (real) {
          v = reinterpret_cast<const P*>(t.from + batch_at)[e];
        } else {
#pragma unroll
          for (int j = 0; j < kApartPack; ++j) v.v[j] = from_float<T>(0.0f);
        }
        reinterpret_cast<P*>(t.to + padded_at)[e] = v;
      } else {
        reinterpret_cast<P*>(t.to + batch_at)[e] =
            reinterpret_cast<const P*>(t.from + padded_at)[e];
      }
    }
  }
  if (lse_to == nullptr) return;
  for (int h = threadIdx.x; h < heads; h += blockDim.x) {
    const long long padded = apart_lse_index(seq_len, heads, r, h);
    if constexpr (kGather)
      lse_to[padded] = real ? lse_from[row * heads + h] : 0.0f;
    else
      lse_to[row * heads + h] = lse_from[padded];
  }
}

template <class T>
void check_tensors(const ApartTensors<T>& ts, const char* call) {
  const auto aligned = [](const void* p) {
    return p != nullptr && reinterpret_cast<std::uintptr_t>(p) % 16 == 0;
  };
  if (ts.count < 0 || ts.count > kApartMaxTensors)
    throw ConfigError(std::string(call) + ": " + std::to_string(ts.count) + " tensors");
  for (int i = 0; i < ts.count; ++i) {
    const ApartTensor<T>& t = ts.t[i];
    if (!aligned(t.from) || !aligned(t.to) || t.width < 1 || t.width % kApartPack != 0 ||
        t.ld < t.width || t.ld % kApartPack != 0)
      throw ConfigError(std::string(call) + ": tensor " + std::to_string(i) +
                        " is null, not 16-byte aligned, or its width " + std::to_string(t.width) +
                        " / row length " + std::to_string(t.ld) + " is not a multiple of 8");
  }
}

template <class T, bool kGather>
void launch_apart(const int* docs, int count, int sequences, int seq_len,
                  const ApartTensors<T>& tensors, const float* lse_from, float* lse_to, int heads,
                  const char* call) {
  check_tensors(tensors, call);
  if (docs == nullptr || count < 0 || count > sequences || seq_len < 1 ||
      static_cast<long long>(sequences) * seq_len > (1LL << 31) - 1)
    throw ConfigError(std::string(call) + ": " + std::to_string(count) + " documents in " +
                      std::to_string(sequences) + " x " + std::to_string(seq_len) + " padded rows");
  const unsigned rows = static_cast<unsigned>(static_cast<long long>(sequences) * seq_len);
  apart_rows<T, kGather><<<rows, kApartThreads, 0, cudaStreamPerThread>>>(
      docs, count, seq_len, tensors, lse_from, lse_to, heads);
  check_launch();
}

}  // namespace

template <class T>
void launch_apart_gather(const int* docs, int count, int sequences, int seq_len,
                         const ApartTensors<T>& tensors, const float* lse_from, float* lse_to,
                         int heads) {
  launch_apart<T, true>(docs, count, sequences, seq_len, tensors, lse_from, lse_to, heads,
                        "launch_apart_gather");
}

template <class T>
void launch_apart_scatter(const int* docs, int count, int sequences, int seq_len,
                          const ApartTensors<T>& tensors, const float* lse_from, float* lse_to,
                          int heads) {
  launch_apart<T, false>(docs, count, sequences, seq_len, tensors, lse_from, lse_to, heads,
                         "launch_apart_scatter");
}

#define SHARDSWAP_APART(T)                                                                 \
  template void launch_apart_gather<T>(const int*, int, int, int, const ApartTensors<T>&,  \
                                       const float*, float*, int);                         \
  template void launch_apart_scatter<T>(const int*, int, int, int, const ApartTensors<T>&, \
                                        const float*, float*, int);
SHARDSWAP_APART(__nv_bfloat16)
SHARDSWAP_APART(__half)
#undef SHARDSWAP_APART

}  // namespace shardswap::lm::dec
