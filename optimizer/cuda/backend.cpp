// The CUDA backend's kernel table: the CPU backend's argument checks and messages, the per-call
// scalars of update_scalars.h, and the launches of kernels.cu. All work is queued on the calling
// thread's work stream (support/work_stream.h: cudaStreamPerThread, or its side stream while the
// engine queues an update beside the next forward) of the current device; only sum_squares,
// has_inf_or_nan and synchronize wait, and only for that stream.
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <utility>

#include "shardswap/error.h"
#include "optimizer/cuda/kernels.h"
#include "optimizer/kernel_checks.h"
#include "optimizer/optimizer.h"
#include "optimizer/update_scalars.h"
#include "support/cuda_check.h"
#include "support/work_stream.h"

namespace shardswap {

namespace {

using detail::Elem;

Elem elem_of(DType dtype, const char* fn) {
  switch (dtype) {
    case DType::f32:
      return Elem::f32;
    case DType::bf16:
      return Elem::bf16;
    case DType::f16:
      return Elem::f16;
    default:
      break;
  }
  throw ConfigError(
      fmt::format("cuda_device_ops().{}: dtype {} is not fp32, bf16 or fp16", fn, dtype_name(dtype)));
}

Elem bit16_elem_of(DType dtype, const char* fn) {
  if (!is_bit16(dtype)) {
    throw ConfigError(fmt::format("cuda_device_ops().{}: dtype {} is not a bit16 type (bf16 or fp16)",
                                  fn, dtype_name(dtype)));
  }
  return elem_of(dtype, fn);
}

// A null pointer would fault on the device and poison the context: detail::require_data and
// detail::check_update refuse it here.

// The reductions leave one partial result per block in pinned host memory, which kernels write
// directly (unified addressing): no device memory outside the allocators' accounts, no second
// pass, and the host adds the partials in block order, so a result is reproducible on a given
// GPU model. One buffer per thread serves every device, since each call waits for its kernels
// before it returns; it holds the partials of kSpansPerWait reductions, made by one launch and
// waited for once (a wait drains the GPU, and so does the tail of each small launch: the
// engine's gradient norm makes one reduction a 16M-element piece of every group, about 100 a
// step at 1.5B params).
constexpr int kMaxBlocks = 4096;
constexpr std::size_t kSpansPerWait = detail::kMaxSquaresSpans;  // one launch a wait

class HostScratch {
 public:
  HostScratch() = default;
  HostScratch(const HostScratch&) = delete;
  HostScratch& operator=(const HostScratch&) = delete;
  ~HostScratch() {
    if (data_ != nullptr) SHARDSWAP_CUDA_WARN(cudaFreeHost(data_));
  }

  // kMaxBlocks partials for each of `spans` reductions (at most kSpansPerWait).
  double* doubles(std::size_t spans = 1) {
    return static_cast<double*>(get(spans * kMaxBlocks * sizeof(double)));
  }
  int* ints() { return static_cast<int*>(get(kMaxBlocks * sizeof(int))); }

 private:
  // Grows only (to the largest batch asked for), so a thread's buffer settles at its first step.
  void* get(std::size_t bytes) {
    if (bytes > bytes_) {
      if (data_ != nullptr) SHARDSWAP_CUDA_CHECK(cudaFreeHost(data_));
      data_ = nullptr;
      bytes_ = 0;
      SHARDSWAP_CUDA_CHECK(
          cudaHostAlloc(&data_, bytes, cudaHostAllocPortable | cudaHostAllocMapped));
      bytes_ = bytes;
    }
    return data_;
  }
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

HostScratch& scratch() {
  thread_local HostScratch s;
  return s;
}

void update(const OptimizerConfig& config, const StepArgs& args, const ShardTensors& t) {
  if (!detail::check_update("cuda_device_ops().update", config, args, t)) return;
  const bool low = config.master == MasterStorage::bf16_remainder;
  const detail::UpdateLaunch launch{low ? static_cast<void*>(t.master_low) : t.master,
                                    t.state0,
                                    t.state1,
                                    t.grad,
                                    t.param,
                                    bit16_elem_of(t.dtype, "update"),
                                    elem_of(t.grad_dtype, "update"),
                                    t.count,
                                    elem_of(t.state_dtype, "update"),
                                    low};
  if (config.type == OptimizerType::sgd) {
    detail::launch_sgd(sgd_scalars(config, args), launch);
  } else {
    detail::launch_adam(adam_scalars(config, args), launch);
  }
}

void sum_squares(const ConstSpan* spans, std::size_t n, DType dtype, double scale,
                 double* sums) {
  const Elem e = elem_of(dtype, "sum_squares");
  detail::check_squares("cuda_device_ops().sum_squares", spans, n, sums);
  for (std::size_t first = 0; first < n; first += kSpansPerWait) {
    const std::size_t batch = std::min(kSpansPerWait, n - first);
    double* partials = scratch().doubles(batch);
    const void* data[kSpansPerWait] = {};
    std::size_t counts[kSpansPerWait] = {};
    for (std::size_t i = 0; i < batch; ++i) {
      data[i] = spans[first + i].data;
      counts[i] = spans[first + i].count;
    }
    int blocks[kSpansPerWait] = {};
    detail::launch_sum_squares(data, counts, static_cast<int>(batch), e, scale, partials,
                               kMaxBlocks, blocks);
    SHARDSWAP_CUDA_CHECK(cudaStreamSynchronize(detail::work_stream()));
    for (std::size_t i = 0; i < batch; ++i) {
      double sum = 0.0;
      for (int b = 0; b < blocks[i]; ++b) sum += partials[i * kMaxBlocks + b];
      sums[first + i] = sum;
    }
  }
}

bool has_inf_or_nan(const void* data, DType dtype, std::size_t count) {
  const Elem e = elem_of(dtype, "has_inf_or_nan");
  if (count == 0) return false;
  detail::require_data(data, "cuda_device_ops().has_inf_or_nan", "data", count);
  int* flags = scratch().ints();
  const int blocks = detail::launch_find_inf_or_nan(data, e, count, flags, kMaxBlocks);
  SHARDSWAP_CUDA_CHECK(cudaStreamSynchronize(detail::work_stream()));
  bool found = false;
  for (int b = 0; b < blocks; ++b) found |= flags[b] != 0;
  return found;
}

// Within one type the bits are copied unchanged, as on the CPU.
void cast(void* dst, DType dst_dtype, const void* src, DType src_dtype, std::size_t count) {
  const Elem d = elem_of(dst_dtype, "cast");
  const Elem s = elem_of(src_dtype, "cast");
  if (count == 0) return;
  detail::require_data(dst, "cuda_device_ops().cast", "dst", count);
  detail::require_data(src, "cuda_device_ops().cast", "src", count);
  if (d == s) {
    if (dst != src) {
      SHARDSWAP_CUDA_CHECK(cudaMemcpyAsync(dst, src, count * dtype_size(dst_dtype),
                                           cudaMemcpyDeviceToDevice, detail::work_stream()));
    }
    return;
  }
  detail::launch_cast(dst, d, src, s, count);
}

void accumulate(void* dst, DType dst_dtype, const void* src, DType src_dtype, std::size_t count) {
  const Elem d = elem_of(dst_dtype, "accumulate");
  const Elem s = elem_of(src_dtype, "accumulate");
  if (count == 0) return;
  detail::require_data(dst, "cuda_device_ops().accumulate", "dst", count);
  detail::require_data(src, "cuda_device_ops().accumulate", "src", count);
  detail::launch_accumulate(dst, d, src, s, count);
}

void fill_zero(void* dst, std::size_t bytes) {
  if (bytes == 0) return;
  detail::require_data(dst, "cuda_device_ops().fill_zero", "dst", bytes, "bytes");
  SHARDSWAP_CUDA_CHECK(cudaMemsetAsync(dst, 0, bytes, detail::work_stream()));
}

void copy(void* dst, const void* src, std::size_t bytes) {
  if (bytes == 0) return;
  detail::require_data(dst, "cuda_device_ops().copy", "dst", bytes, "bytes");
  detail::require_data(src, "cuda_device_ops().copy", "src", bytes, "bytes");
  SHARDSWAP_CUDA_CHECK(
      cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, detail::work_stream()));
}

void synchronize() {
  SHARDSWAP_CUDA_CHECK(cudaStreamSynchronize(detail::work_stream()));
}

// A thread's copy queue: a stream of its own, and an event recorded after each copy in a ring (a
// mark whose event was recorded again since is waited for through the later copy's, which it
// precedes: a longer wait, never a shorter one).
struct CopyQueue {
  static constexpr std::size_t kEvents = 64;
  cudaStream_t stream = nullptr;
  cudaEvent_t before = nullptr;  // the thread's stream at each copy
  cudaEvent_t after[kEvents] = {};
  std::uint64_t queued = 0;
  CopyQueue() {
    SHARDSWAP_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    SHARDSWAP_CUDA_CHECK(cudaEventCreateWithFlags(&before, cudaEventDisableTiming));
    for (auto& e : after) SHARDSWAP_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  }
  // At the thread's end, which for the main thread may come after the CUDA runtime has shut
  // down: errors are ignored and cleared.
  ~CopyQueue() {
    (void)cudaStreamSynchronize(stream);
    for (auto& e : after) (void)cudaEventDestroy(e);
    (void)cudaEventDestroy(before);
    (void)cudaStreamDestroy(stream);
    (void)cudaGetLastError();
  }
  CopyQueue(const CopyQueue&) = delete;
  CopyQueue& operator=(const CopyQueue&) = delete;
};

CopyQueue& copy_queue() {
  thread_local CopyQueue q;
  return q;
}

std::uint64_t queue_copy(void* dst, const void* src, std::size_t bytes) {
  CopyQueue& q = copy_queue();
  if (bytes > 0) {
    detail::require_data(dst, "cuda_device_ops().queue_copy", "dst", bytes, "bytes");
    detail::require_data(src, "cuda_device_ops().queue_copy", "src", bytes, "bytes");
    SHARDSWAP_CUDA_CHECK(cudaEventRecord(q.before, detail::work_stream()));
    SHARDSWAP_CUDA_CHECK(cudaStreamWaitEvent(q.stream, q.before, 0));
    SHARDSWAP_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, q.stream));
  }
  const std::uint64_t mark = ++q.queued;
  SHARDSWAP_CUDA_CHECK(cudaEventRecord(q.after[mark % CopyQueue::kEvents], q.stream));
  return mark;
}

void await_copy(std::uint64_t mark) {
  if (mark == 0) return;
  CopyQueue& q = copy_queue();
  SHARDSWAP_CUDA_CHECK(
      cudaStreamWaitEvent(detail::work_stream(), q.after[mark % CopyQueue::kEvents], 0));
}

void finish_copies() {
  SHARDSWAP_CUDA_CHECK(cudaStreamSynchronize(copy_queue().stream));
}

// A stream or event of one update_streamed call, destroyed when the call ends (also by an
// exception: the call synchronizes first).
struct CopyStream {
  cudaStream_t s = nullptr;
  CopyStream() { SHARDSWAP_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); }
  ~CopyStream() { SHARDSWAP_CUDA_WARN(cudaStreamDestroy(s)); }
  CopyStream(const CopyStream&) = delete;
  CopyStream& operator=(const CopyStream&) = delete;
};
struct Event {
  cudaEvent_t e = nullptr;
  Event() { SHARDSWAP_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming)); }
  ~Event() { SHARDSWAP_CUDA_WARN(cudaEventDestroy(e)); }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
};

// Chunk k (counted over every piece) goes up on `up` into slot k % 2 once the chunk before it in
// that slot has come down; the update runs on the calling thread's stream once it is up, and it
// comes down on `down` once updated. So chunk k + 1 travels up while chunk k is updated and chunk
// k - 1 comes down, across the pieces' boundaries.
void update_streamed(const OptimizerConfig& config, const StreamedTensors& s) {
  if (!detail::check_streamed("cuda_device_ops().update_streamed", config, s)) return;
  CopyStream up, down;
  Event uploaded[2], updated[2], downloaded[2];
  const auto copies = [&](const ShardTensors& host, const ShardTensors& c, std::size_t at,
                          std::size_t n, bool to_slot, cudaStream_t stream) {
    for (const auto& x : detail::chunk_copies(s, host, c, at, n))
      if (x.slot != nullptr && (to_slot || !x.up_only))
        SHARDSWAP_CUDA_CHECK(cudaMemcpyAsync(to_slot ? x.slot : x.host, to_slot ? x.host : x.slot,
                                             x.bytes, cudaMemcpyDefault, stream));
  };
  try {
    detail::for_each_streamed_chunk(
        s, [&](const StreamedPiece& p, std::size_t k, std::size_t at, std::size_t n) {
          const int slot = static_cast<int>(k % 2);
          const ShardTensors c = detail::slot_tensors(s, p.t, slot, at, n);
          if (k >= 2) SHARDSWAP_CUDA_CHECK(cudaStreamWaitEvent(up.s, downloaded[slot].e, 0));
          copies(p.t, c, at, n, true, up.s);
          SHARDSWAP_CUDA_CHECK(cudaEventRecord(uploaded[slot].e, up.s));
          SHARDSWAP_CUDA_CHECK(cudaStreamWaitEvent(detail::work_stream(), uploaded[slot].e, 0));
          update(config, p.args, c);
          SHARDSWAP_CUDA_CHECK(cudaEventRecord(updated[slot].e, detail::work_stream()));
          SHARDSWAP_CUDA_CHECK(cudaStreamWaitEvent(down.s, updated[slot].e, 0));
          copies(p.t, c, at, n, false, down.s);
          SHARDSWAP_CUDA_CHECK(cudaEventRecord(downloaded[slot].e, down.s));
        });
    SHARDSWAP_CUDA_CHECK(cudaStreamSynchronize(down.s));  // the host holds the result
  } catch (...) {
    // Nothing queued may outlive the streams and events it names.
    SHARDSWAP_CUDA_WARN(cudaStreamSynchronize(up.s));
    SHARDSWAP_CUDA_WARN(cudaStreamSynchronize(detail::work_stream()));
    SHARDSWAP_CUDA_WARN(cudaStreamSynchronize(down.s));
    throw;
  }
}

}  // namespace

const DeviceOps& cuda_device_ops() {
  static const DeviceOps table{.name = "cuda",
                                      .update = update,
                                      .update_streamed = update_streamed,
                                      .sum_squares = sum_squares,
                                      .has_inf_or_nan = has_inf_or_nan,
                                      .cast = cast,
                                      .accumulate = accumulate,
                                      .fill_zero = fill_zero,
                                      .copy = copy,
                                      .synchronize = synchronize,
                                      .queue_copy = queue_copy,
                                      .await_copy = await_copy,
                                      .finish_copies = finish_copies,
                                      .begin_side = detail::begin_side_work,
                                      .end_side = detail::end_side_work,
                                      .mark_side = detail::mark_side_work,
                                      .await_side = detail::await_side_work};
  return table;
}

}  // namespace shardswap
