// Entry point of the GPU suite. Without a CUDA device each test exits 77, which CTest reports as
// skipped, after printing why; listing the tests (CTest discovery) always works.
#define CATCH_CONFIG_RUNNER
#include <cuda_runtime.h>

#include <cstdio>
#include <string>

#include "engine/comm/nccl.h"
#include "memory/allocator.h"
#include "tests/catch_compat.h"

int main(int argc, char* argv[]) {
  bool listing = false;
  for (int i = 1; i < argc; ++i) listing = listing || std::string(argv[i]).rfind("--list", 0) == 0;
  if (!listing && shardswap::cuda_device_count() == 0) {
    std::printf("SKIPPED: no CUDA device is visible on this machine\n");
    return 77;
  }
  if (!listing) {
    // Create the context and load NCCL's device code first: that memory stays until the process
    // ends and is not the tests' to give back.
    cudaFree(nullptr);
    auto comms = shardswap::make_nccl_communicators({0});
    comms.at(0)->barrier();
  }
  return Catch::Session().run(argc, argv);
}
