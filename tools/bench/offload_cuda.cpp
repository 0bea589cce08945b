// bench offload's CUDA rows (offload_rows.h): the host link's bandwidth from page-locked memory,
// and two ways to update master, m and v that live in pinned host memory, against the CUDA kernel
// on state in device memory. Times are read on the host around the work and its synchronization,
// as bench optimizer does. The kernel table queues on cudaStreamPerThread; the copies run on two
// streams of their own (one per direction, so both directions of the link work at once), ordered
// against the kernels by events.
#include <cuda_runtime.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "bench/offload_rows.h"
#include "optimizer/host_updater.h"
#include "support/cuda_check.h"

namespace shardswap {

namespace {

// Elements per piece of a pipelined step: 32 MiB of bf16, 64 MiB of each fp32 tensor, long
// enough for a copy to run at the link's speed, and 16 pieces in 256M params for the overlap.
constexpr std::size_t kPiece = std::size_t{16} << 20;

// Page-locked host memory (cudaMallocHost) or device memory (cudaMalloc), freed when it goes.
class CudaBuffer {
 public:
  enum Kind { pinned, device };
  CudaBuffer(Kind kind, std::size_t bytes) : kind_(kind) {
    SHARDSWAP_CUDA_CHECK(kind == pinned ? cudaMallocHost(&p_, bytes) : cudaMalloc(&p_, bytes));
  }
  ~CudaBuffer() { SHARDSWAP_CUDA_WARN(kind_ == pinned ? cudaFreeHost(p_) : cudaFree(p_)); }
  CudaBuffer(const CudaBuffer&) = delete;
  CudaBuffer& operator=(const CudaBuffer&) = delete;
  unsigned char* get() const { return static_cast<unsigned char*>(p_); }
  float* f32() const { return static_cast<float*>(p_); }

 private:
  Kind kind_;
  void* p_ = nullptr;
};

class Stream {
 public:
  Stream() { SHARDSWAP_CUDA_CHECK(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking)); }
  ~Stream() { SHARDSWAP_CUDA_WARN(cudaStreamDestroy(s_)); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  operator cudaStream_t() const { return s_; }
  void synchronize() const { SHARDSWAP_CUDA_CHECK(cudaStreamSynchronize(s_)); }

 private:
  cudaStream_t s_ = nullptr;
};

// An event that only orders work (no timing). Move-only, so that a vector of them can grow.
class Event {
 public:
  Event() { SHARDSWAP_CUDA_CHECK(cudaEventCreateWithFlags(&e_, cudaEventDisableTiming)); }
  ~Event() {
    if (e_ != nullptr) SHARDSWAP_CUDA_WARN(cudaEventDestroy(e_));
  }
  Event(Event&& o) noexcept : e_(std::exchange(o.e_, nullptr)) {}
  Event& operator=(Event&&) = delete;
  operator cudaEvent_t() const { return e_; }

 private:
  cudaEvent_t e_ = nullptr;
};

std::vector<Event> events(std::size_t n) {
  std::vector<Event> e;
  e.reserve(n);
  for (std::size_t i = 0; i < n; ++i) e.emplace_back();
  return e;
}

// Piece p of a step over n params: its first element and length.
struct Piece {
  std::size_t at, len;
};
std::size_t piece_count(std::size_t n) {
  return (n + kPiece - 1) / kPiece;
}
Piece piece(std::size_t n, std::size_t p) {
  return {p * kPiece, std::min(kPiece, n - p * kPiece)};
}

// A synchronous copy on the calling thread's stream, the one the kernels run on.
void copy_now(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind) {
  SHARDSWAP_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, kind, cudaStreamPerThread));
  SHARDSWAP_CUDA_CHECK(cudaStreamSynchronize(cudaStreamPerThread));
}

// What the rows use over n params. Pinned: master, m and v (the offloaded state) and the bf16
// staging of gradients and params. Device: master, m, v and param of the on-device update, the
// gradient every row reads, the params the offload ways write, and for the streamed way two slots
// of a piece of master, m and v.
struct Buffers {
  Buffers(std::size_t params, const OffloadData& d)
      : n(params),
        master(CudaBuffer::pinned, 4 * n),
        m(CudaBuffer::pinned, 4 * n),
        v(CudaBuffer::pinned, 4 * n),
        grad_stage(CudaBuffer::pinned, 2 * n),
        param_stage(CudaBuffer::pinned, 2 * n),
        d_master(CudaBuffer::device, 4 * n),
        d_m(CudaBuffer::device, 4 * n),
        d_v(CudaBuffer::device, 4 * n),
        d_grad(CudaBuffer::device, 2 * n),
        d_param(CudaBuffer::device, 2 * n),
        d_param_out(CudaBuffer::device, 2 * n),
        slot_stride((std::min(kPiece, n) + 63) / 64 * 64),
        d_slots(CudaBuffer::device, 2 * 3 * 4 * slot_stride) {
    fill_periodic(grad_stage.get(), d.grad.data(), 2, 0, n);
    copy_now(d_grad.get(), grad_stage.get(), 2 * n, cudaMemcpyHostToDevice);
  }
  // Tensor k (master, m, v) of slot s.
  float* slot(std::size_t s, int k) const {
    return d_slots.f32() + (s * 3 + static_cast<std::size_t>(k)) * slot_stride;
  }

  std::size_t n;
  CudaBuffer master, m, v, grad_stage, param_stage;
  CudaBuffer d_master, d_m, d_v, d_grad, d_param, d_param_out;
  // Elements of one tensor of a slot: a piece, rounded up so that every tensor is 256-byte aligned.
  std::size_t slot_stride;
  CudaBuffer d_slots;
};

// The pinned state as OffloadData's start.
void reset_host(const Buffers& b, const OffloadData& d) {
  fill_periodic(b.master.get(), d.master.data(), 4, 0, b.n);
  fill_periodic(b.m.get(), d.m.data(), 4, 0, b.n);
  fill_periodic(b.v.get(), d.v.data(), 4, 0, b.n);
}

// True when the pinned state holds its values after one step, and so do the n bf16 params at
// `d_param` (downloaded through the gradient staging, which every host step refills).
bool stepped_once(const Buffers& b, const void* d_param, const OffloadData& d) {
  copy_now(b.grad_stage.get(), d_param, 2 * b.n, cudaMemcpyDeviceToHost);
  return equals_periodic(b.master.get(), d.next_master.data(), 4, b.n) &&
         equals_periodic(b.m.get(), d.next_m.data(), 4, b.n) &&
         equals_periodic(b.v.get(), d.next_v.data(), 4, b.n) &&
         equals_periodic(b.grad_stage.get(), d.next_param.data(), 2, b.n);
}

OffloadRow link_row(std::string name, int iters, std::size_t bytes,
                    const std::function<void()>& f) {
  OffloadRow row{std::move(name)};
  row.seconds = median_seconds(iters, f);
  row.bytes = static_cast<double>(bytes);
  return row;
}

// One fp32 tensor (4 B/param) between pinned and device memory: up, down, and both at once.
void link_rows(const Buffers& b, const Stream& up, const Stream& down, int iters,
               const std::function<void(const OffloadRow&)>& emit) {
  const std::size_t bytes = 4 * b.n;
  const auto h2d = [&] {
    SHARDSWAP_CUDA_CHECK(
        cudaMemcpyAsync(b.d_master.get(), b.master.get(), bytes, cudaMemcpyHostToDevice, up));
  };
  const auto d2h = [&] {
    SHARDSWAP_CUDA_CHECK(
        cudaMemcpyAsync(b.m.get(), b.d_m.get(), bytes, cudaMemcpyDeviceToHost, down));
  };
  emit(link_row("pinned H2D", iters, bytes, [&] {
    h2d();
    up.synchronize();
  }));
  emit(link_row("pinned D2H", iters, bytes, [&] {
    d2h();
    down.synchronize();
  }));
  emit(link_row("pinned H2D + D2H (two streams)", iters, 2 * bytes, [&] {
    h2d();
    d2h();
    up.synchronize();
    down.synchronize();
  }));
}

// The CUDA kernel alone, on state in device memory.
OffloadRow device_row(const Buffers& b, const OffloadData& d, int iters) {
  reset_host(b, d);
  copy_now(b.d_master.get(), b.master.get(), 4 * b.n, cudaMemcpyHostToDevice);
  copy_now(b.d_m.get(), b.m.get(), 4 * b.n, cudaMemcpyHostToDevice);
  copy_now(b.d_v.get(), b.v.get(), 4 * b.n, cudaMemcpyHostToDevice);
  SHARDSWAP_CUDA_CHECK(cudaMemsetAsync(b.d_param.get(), 0, 2 * b.n, cudaStreamPerThread));
  const DeviceOps& k = cuda_device_ops();
  const ShardTensors t{b.d_master.f32(), b.d_m.f32(), b.d_v.f32(), b.d_grad.get(),
                       b.d_param.get(),  DType::bf16, DType::bf16, b.n};
  k.update(offload_config(), offload_args(), t);
  copy_now(b.master.get(), b.d_master.get(), 4 * b.n, cudaMemcpyDeviceToHost);
  copy_now(b.m.get(), b.d_m.get(), 4 * b.n, cudaMemcpyDeviceToHost);
  copy_now(b.v.get(), b.d_v.get(), 4 * b.n, cudaMemcpyDeviceToHost);
  OffloadRow row{"on-device update (kernel alone)"};
  row.ok = stepped_once(b, b.d_param.get(), d);
  row.seconds = median_seconds(iters, [&] {
    k.update(offload_config(), offload_args(), t);
    k.synchronize();
  });
  row.params = b.n;
  row.bytes = static_cast<double>(kUpdateBytesPerParam * b.n);
  return row;
}

// One step of the "host" way. The gradient comes down piece by piece on `down`, an event after
// each; the CPU updates a piece once it is down and sends its params up on `up`. So the CPU works
// on piece p while later pieces come down and earlier params go up.
void host_step(const Buffers& b, HostUpdater& updater, const Stream& up, const Stream& down,
               const std::vector<Event>& grad_down) {
  for (std::size_t p = 0; p < piece_count(b.n); ++p) {
    const Piece s = piece(b.n, p);
    SHARDSWAP_CUDA_CHECK(cudaMemcpyAsync(b.grad_stage.get() + 2 * s.at, b.d_grad.get() + 2 * s.at,
                                         2 * s.len, cudaMemcpyDeviceToHost, down));
    SHARDSWAP_CUDA_CHECK(cudaEventRecord(grad_down[p], down));
  }
  for (std::size_t p = 0; p < piece_count(b.n); ++p) {
    const Piece s = piece(b.n, p);
    SHARDSWAP_CUDA_CHECK(cudaEventSynchronize(grad_down[p]));
    updater.update(offload_config(), offload_args(),
                   ShardTensors{b.master.f32() + s.at, b.m.f32() + s.at, b.v.f32() + s.at,
                                b.grad_stage.get() + 2 * s.at, b.param_stage.get() + 2 * s.at,
                                DType::bf16, DType::bf16, s.len});
    SHARDSWAP_CUDA_CHECK(cudaMemcpyAsync(b.d_param_out.get() + 2 * s.at,
                                         b.param_stage.get() + 2 * s.at, 2 * s.len,
                                         cudaMemcpyHostToDevice, up));
  }
  up.synchronize();
}

// One step of the "streamed" way. Master, m and v go up piece by piece into one of two device
// slots, the kernel updates a piece once it is up, and the piece comes down once updated; a slot
// is refilled once its previous piece is down. So piece p + 1 goes up while p is updated and
// p - 1 comes down.
void streamed_step(const Buffers& b, const Stream& up, const Stream& down,
                   const std::vector<Event>& uploaded, const std::vector<Event>& updated,
                   const std::vector<Event>& downloaded) {
  for (std::size_t p = 0; p < piece_count(b.n); ++p) {
    const Piece s = piece(b.n, p);
    float* const host[3] = {b.master.f32() + s.at, b.m.f32() + s.at, b.v.f32() + s.at};
    float* const slot[3] = {b.slot(p % 2, 0), b.slot(p % 2, 1), b.slot(p % 2, 2)};
    if (p >= 2) SHARDSWAP_CUDA_CHECK(cudaStreamWaitEvent(up, downloaded[p - 2], 0));
    for (int k = 0; k < 3; ++k)
      SHARDSWAP_CUDA_CHECK(
          cudaMemcpyAsync(slot[k], host[k], 4 * s.len, cudaMemcpyHostToDevice, up));
    SHARDSWAP_CUDA_CHECK(cudaEventRecord(uploaded[p], up));
    SHARDSWAP_CUDA_CHECK(cudaStreamWaitEvent(cudaStreamPerThread, uploaded[p], 0));
    cuda_device_ops().update(
        offload_config(), offload_args(),
        ShardTensors{slot[0], slot[1], slot[2], b.d_grad.get() + 2 * s.at,
                     b.d_param_out.get() + 2 * s.at, DType::bf16, DType::bf16, s.len});
    SHARDSWAP_CUDA_CHECK(cudaEventRecord(updated[p], cudaStreamPerThread));
    SHARDSWAP_CUDA_CHECK(cudaStreamWaitEvent(down, updated[p], 0));
    for (int k = 0; k < 3; ++k)
      SHARDSWAP_CUDA_CHECK(
          cudaMemcpyAsync(host[k], slot[k], 4 * s.len, cudaMemcpyDeviceToHost, down));
    SHARDSWAP_CUDA_CHECK(cudaEventRecord(downloaded[p], down));
  }
  down.synchronize();
}

// An offload way's row: one step from the start, checked, then timed (the state goes on
// stepping). `link_bytes`: what it moves over the link per param.
OffloadRow offload_row(std::string name, const Buffers& b, const OffloadData& d, int iters,
                       std::size_t link_bytes, double on_device_seconds,
                       const std::function<void()>& step) {
  reset_host(b, d);
  SHARDSWAP_CUDA_CHECK(cudaMemsetAsync(b.d_param_out.get(), 0, 2 * b.n, cudaStreamPerThread));
  SHARDSWAP_CUDA_CHECK(cudaStreamSynchronize(cudaStreamPerThread));
  step();
  OffloadRow row{std::move(name)};
  row.ok = stepped_once(b, b.d_param_out.get(), d);
  row.seconds = median_seconds(iters, step);
  row.params = b.n;
  row.bytes = static_cast<double>(link_bytes * b.n);
  row.ratio = on_device_seconds / row.seconds;
  return row;
}

}  // namespace

void cuda_offload_rows(const OffloadData& data, HostUpdater& updater, std::size_t n, int iters,
                       const std::function<void(const OffloadRow&)>& emit) {
  const Buffers b(n, data);
  const Stream up, down;
  link_rows(b, up, down, iters, emit);
  const OffloadRow on_device = device_row(b, data, iters);
  emit(on_device);

  const std::vector<Event> grad_down = events(piece_count(n));
  OffloadRow host =
      offload_row("offload host (grad down, CPU, param up)", b, data, iters, 4, on_device.seconds,
                  [&] { host_step(b, updater, up, down, grad_down); });
  host.threads = updater.threads();
  emit(host);

  const std::vector<Event> uploaded = events(piece_count(n)), updated = events(piece_count(n)),
                           downloaded = events(piece_count(n));
  emit(offload_row("offload streamed (state up, kernel, down)", b, data, iters, 24,
                   on_device.seconds,
                   [&] { streamed_step(b, up, down, uploaded, updated, downloaded); }));
}

}  // namespace shardswap
