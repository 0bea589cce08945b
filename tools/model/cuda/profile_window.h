// A profiler's capture window over the CUDA decoder's train_step calls
// (SHARDSWAP_CUDA_PROFILE_STEPS).
#pragma once

#include <cuda_profiler_api.h>

#include <cstdlib>
#include <string>

#include "support/cuda_check.h"
#include "shardswap/error.h"

namespace shardswap::lm::dec {

// A profiler's capture window over train_step calls, from SHARDSWAP_CUDA_PROFILE_STEPS=FIRST or
// FIRST,COUNT (1-based; COUNT 1 by default): cudaProfilerStart before step FIRST, cudaProfilerStop
// before step FIRST + COUNT, so that the window holds whole steps with what the caller queues
// between them (engine.step()'s gradient norm and update) and nothing of the set-up, for a
// profiler started with capture off (Nsight Compute's --profile-from-start off, Nsight Systems'
// --capture-range=cudaProfilerApi; tools/bench/profile_step.sh). A run that ends at step FIRST +
// COUNT - 1 captures to its exit. Unset: nothing.
class ProfileWindow {
 public:
  ProfileWindow() {
    const char* v = std::getenv("SHARDSWAP_CUDA_PROFILE_STEPS");
    if (v == nullptr || *v == '\0') return;
    char* end = nullptr;
    const long first = std::strtol(v, &end, 10);
    long count = 1;
    if (end != v && *end == ',') {
      const char* c = end + 1;
      count = std::strtol(c, &end, 10);
      if (end == c) count = 0;
    }
    if (end == v || *end != '\0' || first < 1 || count < 1)
      throw ConfigError(std::string("SHARDSWAP_CUDA_PROFILE_STEPS=") + v +
                        ": not FIRST or FIRST,COUNT with FIRST, COUNT >= 1");
    first_ = first;
    last_ = first + count - 1;
  }
  void before_step() {
    ++step_;
    if (first_ > 0 && step_ == last_ + 1) {
      // What the last step queued (its backward, engine.step()'s work) ends inside the window,
      // for a profiler that records kernels as they run rather than at their launch.
      SHARDSWAP_CUDA_CHECK(cudaDeviceSynchronize());
      SHARDSWAP_CUDA_CHECK(cudaProfilerStop());
    }
    if (step_ == first_) SHARDSWAP_CUDA_CHECK(cudaProfilerStart());
  }

 private:
  long first_ = 0, last_ = 0, step_ = 0;
};

}  // namespace shardswap::lm::dec
