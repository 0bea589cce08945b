// The thread's work stream and its side stream (support/work_stream.h).
#include "support/work_stream.h"

#include <fmt/format.h>

#include <map>
#include <vector>

#include "shardswap/error.h"
#include "support/cuda_check.h"

namespace shardswap::detail {

namespace {

// One thread's side stream on one device, and the events its marks were recorded on (made as the
// marks need them, up to kSideMarks).
struct Side {
  cudaStream_t stream = nullptr;
  cudaEvent_t joined = nullptr;  // recorded on the thread's stream at begin_side_work
  std::vector<cudaEvent_t> marks;
  Side() = default;
  Side(const Side&) = delete;
  Side& operator=(const Side&) = delete;
  // At the thread's end, which for the main thread may come after the CUDA runtime has shut down:
  // errors are ignored and cleared.
  ~Side() {
    if (stream != nullptr) (void)cudaStreamSynchronize(stream);
    for (auto e : marks) (void)cudaEventDestroy(e);
    if (joined != nullptr) (void)cudaEventDestroy(joined);
    if (stream != nullptr) (void)cudaStreamDestroy(stream);
    (void)cudaGetLastError();
  }
};

struct ThreadSides {
  std::map<int, Side> by_device;
  Side* current = nullptr;  // between begin_side_work and end_side_work
  std::uint64_t marked = 0;
};

ThreadSides& sides() {
  thread_local ThreadSides s;
  return s;
}

Side& side_of_current_device() {
  int device = 0;
  SHARDSWAP_CUDA_CHECK(cudaGetDevice(&device));
  Side& side = sides().by_device[device];
  if (side.stream == nullptr) {
    SHARDSWAP_CUDA_CHECK(cudaStreamCreateWithFlags(&side.stream, cudaStreamNonBlocking));
    SHARDSWAP_CUDA_CHECK(cudaEventCreateWithFlags(&side.joined, cudaEventDisableTiming));
  }
  return side;
}

}  // namespace

cudaStream_t work_stream() {
  const Side* side = sides().current;
  return side != nullptr ? side->stream : cudaStreamPerThread;
}

void begin_side_work() {
  if (sides().current != nullptr)
    throw StateError("begin_side_work: this thread's side work has begun already");
  Side& side = side_of_current_device();
  SHARDSWAP_CUDA_CHECK(cudaEventRecord(side.joined, cudaStreamPerThread));
  SHARDSWAP_CUDA_CHECK(cudaStreamWaitEvent(side.stream, side.joined, 0));
  sides().current = &side;
}

void end_side_work() {
  sides().current = nullptr;
}

std::uint64_t mark_side_work() {
  ThreadSides& s = sides();
  if (s.current == nullptr) throw StateError("mark_side_work: no side work has begun");
  Side& side = *s.current;
  const std::uint64_t mark = ++s.marked;
  const auto slot = static_cast<std::size_t>(mark % kSideMarks);
  while (side.marks.size() <= slot && side.marks.size() < kSideMarks) {
    cudaEvent_t e = nullptr;
    SHARDSWAP_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    side.marks.push_back(e);
  }
  SHARDSWAP_CUDA_CHECK(cudaEventRecord(side.marks[slot], side.stream));
  return mark;
}

void await_side_work(std::uint64_t mark) {
  if (mark == 0) return;
  Side& side = side_of_current_device();
  const auto slot = static_cast<std::size_t>(mark % kSideMarks);
  if (slot >= side.marks.size())
    throw StateError(fmt::format("await_side_work: mark {} was not made on this device", mark));
  SHARDSWAP_CUDA_CHECK(cudaStreamWaitEvent(cudaStreamPerThread, side.marks[slot], 0));
}

}  // namespace shardswap::detail
