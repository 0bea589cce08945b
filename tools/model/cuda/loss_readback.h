// The step's mean loss read back to the host as soon as the head has made it (train_step).
#pragma once

#include <cuda_runtime.h>

#include "support/cuda_check.h"

namespace shardswap::lm::dec {

// queue() copies a device double into pinned host memory on cudaStreamPerThread and marks the
// copy; wait() waits for that mark only. train_step queues the copy after the loss and before
// the backward, so its host returns while the GPU still runs the backward it queued, and the
// caller queues its next work (engine.step(), the next micro-batch) behind it without a gap.
// Made at the first queue(), on the device current then (the compute's own).
class LossReadback {
 public:
  LossReadback() = default;
  LossReadback(const LossReadback&) = delete;
  LossReadback& operator=(const LossReadback&) = delete;
  ~LossReadback() {
    if (done_ != nullptr) cudaEventDestroy(done_);
    if (host_ != nullptr) cudaFreeHost(host_);
  }
  void queue(const double* device) {
    if (host_ == nullptr) {
      SHARDSWAP_CUDA_CHECK(cudaMallocHost(&host_, sizeof(double)));
      SHARDSWAP_CUDA_CHECK(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));
    }
    SHARDSWAP_CUDA_CHECK(cudaMemcpyAsync(host_, device, sizeof(double), cudaMemcpyDeviceToHost,
                                         cudaStreamPerThread));
    SHARDSWAP_CUDA_CHECK(cudaEventRecord(done_, cudaStreamPerThread));
  }
  double wait() const {
    SHARDSWAP_CUDA_CHECK(cudaEventSynchronize(done_));
    return *host_;
  }

 private:
  double* host_ = nullptr;  // pinned: the copy is asynchronous
  cudaEvent_t done_ = nullptr;
};

}  // namespace shardswap::lm::dec
