// Entry point of the GPU suite. Without a CUDA device each test exits 77, which CTest reports as
// skipped, after printing why; listing the tests (CTest discovery) always works.
// A listener checks after every test case that the device's free memory (cudaMemGetInfo) is back
// within 2 MiB of where it was when the test case started (device_memory_check.h); the run fails
// otherwise.
#define CATCH_CONFIG_RUNNER
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "shardswap/nccl.h"
#include "shardswap/allocator.h"
#include "tests/catch_compat.h"
#include "tests/gpu/device_memory_check.h"

namespace {

using test::ListenerBase;

bool memory_lost = false;
std::int64_t worst_loss = 0;
std::int64_t allowed = 0;  // the running test case's allow_retained_device_memory
int cases_checked = 0;

struct DeviceMemoryListener : ListenerBase {
  using ListenerBase::ListenerBase;
  std::int64_t before = 0;
  std::string name;
  void testCaseStarting(Catch::TestCaseInfo const& info) override {
    ListenerBase::testCaseStarting(info);
    name = std::string(info.name);
    allowed = 0;
    before = test::device_free_bytes();
  }
  void testCaseEnded(Catch::TestCaseStats const& stats) override {
    const std::int64_t lost = before - test::device_free_bytes() - allowed;
    worst_loss = std::max(worst_loss, lost);
    ++cases_checked;
    if (lost > test::kDeviceMemorySlack) {
      memory_lost = true;
      std::printf("DEVICE MEMORY NOT RETURNED: '%s' left %lld bytes fewer free\n", name.c_str(),
                  static_cast<long long>(lost));
    }
    ListenerBase::testCaseEnded(stats);
  }
};

}  // namespace

std::int64_t test::device_free_bytes() {
  return static_cast<std::int64_t>(shardswap::cuda_device_memory(0).free);
}

void test::allow_retained_device_memory(std::int64_t bytes, const char* what) {
  allowed += bytes;
  std::printf("device memory kept for the process by %s: %lld bytes (allowed)\n", what,
              static_cast<long long>(bytes));
}

CATCH_REGISTER_LISTENER(DeviceMemoryListener)

int main(int argc, char* argv[]) {
  // As the CLI does (tools/cli/main.cpp): cuBLAS keeps no workspace pool of its own per handle,
  // the handles use the workspace they are given.
  setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0", /*overwrite=*/0);
  bool listing = false;
  for (int i = 1; i < argc; ++i) listing = listing || std::string(argv[i]).rfind("--list", 0) == 0;
  if (!listing && shardswap::cuda_device_count() == 0) {
    std::printf("SKIPPED: no CUDA device is visible on this machine\n");
    return 77;
  }
  if (!listing) {
    // Create the context and load NCCL's device code first: that memory stays until the process
    // ends and is not the tests' to give back.
    // With several GPUs, NCCL's first communicator across them also sets up peer access, which
    // holds device memory for the rest of the process (190 MiB on GPU 0 of two H200s, b701400).
    cudaFree(nullptr);
    std::vector<int> devices;
    for (int d = 0; d < std::min(shardswap::cuda_device_count(), 8); ++d) devices.push_back(d);
    auto comms = shardswap::make_nccl_communicators(devices);
    std::vector<std::thread> ranks;  // a barrier over several GPUs needs a thread per rank
    for (auto& comm : comms) ranks.emplace_back([&comm] { comm->barrier(); });
    for (auto& t : ranks) t.join();
  }
  const int status = Catch::Session().run(argc, argv);
  if (listing) return status;
  std::printf(
      "device memory: checked after %d test cases; largest shortfall %lld bytes (limit %lld)\n",
      cases_checked, static_cast<long long>(worst_loss),
      static_cast<long long>(test::kDeviceMemorySlack));
  return status != 0 ? status : (memory_lost ? 1 : 0);
}
