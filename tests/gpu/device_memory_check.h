// The GPU suite's check that every test case gives its device memory back (tests/gpu/main.cpp):
// the end of a test case must find the device's free memory within kDeviceMemorySlack of where
// it was at its start.
#pragma once

#include <cstdint>

namespace test {

inline constexpr std::int64_t kDeviceMemorySlack = 2 * 1024 * 1024;

/// The device's free bytes now (cudaMemGetInfo on device 0).
std::int64_t device_free_bytes();

/// Lets the running test case end with `bytes` fewer free than it began with, for memory a
/// library keeps for the rest of the process (`what`), and prints it. Only for memory the test
/// has shown is kept once: the same work again on new handles took no more.
void allow_retained_device_memory(std::int64_t bytes, const char* what);

}  // namespace test
