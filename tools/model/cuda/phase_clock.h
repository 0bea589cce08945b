// The GPU time of the CUDA decoder's train_step phases (Compute::time_phases), from CUDA events.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <utility>
#include <vector>

#include "support/cuda_check.h"
#include "model/decoder_compute.h"

namespace shardswap::lm::dec {

// The GPU time of train_step's phases (PhaseTimes) from CUDA events on cudaStreamPerThread: a
// mark records an event as the next phase's work is queued; the time between two marks is the
// earlier mark's phase. Reading waits for the step's last mark (train_step returns once the
// loss is read, with the backward still running); off, a mark does nothing and nothing waits.
class PhaseClock {
 public:
  enum Phase {
    forward,      // embedding, norms, q/k/v/o projections, RoPE
    forward_mlp,  // the MLP's norm, gate/up/down GEMMs, SwiGLU
    attention_forward,
    head,
    backward_mlp,
    backward,  // the rest of backward: norms, q/k/v/o, RoPE, embedding
    attention_backward,
    done
  };
  PhaseClock() = default;
  PhaseClock(const PhaseClock&) = delete;
  PhaseClock& operator=(const PhaseClock&) = delete;
  ~PhaseClock() {
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
  }
  void enable(bool on) { on_ = on; }
  // A step's first mark; what a step that threw left behind is dropped.
  void begin() {
    marks_.clear();
    mark(forward);
  }
  void mark(Phase p) {
    if (!on_) return;
    if (marks_.size() == events_.size()) {
      cudaEvent_t e;
      SHARDSWAP_CUDA_CHECK(cudaEventCreate(&e));
      events_.push_back(e);
    }
    SHARDSWAP_CUDA_CHECK(cudaEventRecord(events_[marks_.size()], cudaStreamPerThread));
    marks_.push_back(p);
  }
  // After the step's last mark (done): waits for it, then adds the step's phases to the sums.
  void add_step() {
    if (!on_ || marks_.empty()) return;
    SHARDSWAP_CUDA_CHECK(cudaEventSynchronize(events_[marks_.size() - 1]));
    double* sums[] = {&times_.forward,      &times_.forward_mlp, &times_.attention_forward,
                      &times_.head,         &times_.backward_mlp, &times_.backward,
                      &times_.attention_backward};
    for (std::size_t i = 0; i + 1 < marks_.size(); ++i) {
      float ms = 0;
      SHARDSWAP_CUDA_CHECK(cudaEventElapsedTime(&ms, events_[i], events_[i + 1]));
      if (marks_[i] != done) *sums[marks_[i]] += ms;
    }
    ++times_.steps;
    marks_.clear();
  }
  PhaseTimes take() { return std::exchange(times_, PhaseTimes{}); }

 private:
  bool on_ = false;
  std::vector<cudaEvent_t> events_;  // reused step after step
  std::vector<Phase> marks_;
  PhaseTimes times_;
};

}  // namespace shardswap::lm::dec
