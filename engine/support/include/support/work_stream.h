// The stream each thread's engine work goes on (CUDA builds only).
//
// The engine queues its kernels, copies and collectives on the calling thread's
// cudaStreamPerThread, in call order, so that a trainer's own work on that stream is ordered with
// them for free. One exception: with EngineConfig::overlap_update, step() queues the update on
// the thread's side stream instead, so that the next forward on the thread's stream runs beside
// it and waits only for the groups it reads (Engine::fetch_weights). So every launch and copy of
// the engine names work_stream(), never cudaStreamPerThread itself.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace shardswap::detail {

/// This thread's side stream while begin_side_work() is in effect, else cudaStreamPerThread.
cudaStream_t work_stream();

/// Until end_side_work(), work_stream() is this thread's side stream on the current device (one
/// per thread and device, made on first use), which first waits for everything queued on the
/// thread's stream so far. Not nested: StateError if already begun.
void begin_side_work();
/// work_stream() is cudaStreamPerThread again. The side stream's work goes on.
void end_side_work();
/// Marks the work queued so far on the side stream (between begin and end only); returns the
/// mark, counting up from 1 per thread.
std::uint64_t mark_side_work();
/// Makes the thread's stream wait until side mark `mark` is done; 0 waits for nothing. A mark
/// whose event was recorded again since (more than kSideMarks marks later) is waited for through
/// the later record: a longer wait, never a shorter one.
void await_side_work(std::uint64_t mark);

inline constexpr std::uint64_t kSideMarks = 1024;

}  // namespace shardswap::detail
