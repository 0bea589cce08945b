// Lets the suite build against Catch2 v2 (Debian 12) and v3 (Ubuntu 24.04).
#pragma once

#if __has_include(<catch2/catch_all.hpp>)
#include <catch2/catch_all.hpp>
using Catch::Approx;  // Catch2 v2 has it in the global namespace
#else
#include <catch2/catch.hpp>
#endif

#include <stdexcept>
#include <string>

namespace test {

/// Runs f, which must throw E; returns the message so a test can check what it names.
template <class E, class F>
std::string message_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  FAIL("expected an exception, none was thrown");
  return {};
}

/// True if `text` contains `part`.
inline bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

/// True if `message` has the shape of every config mistake, "FILE: KEY = VALUE: what" or (for a
/// key whose value is not shown) "FILE: KEY: what", and names no C++ function ("::",
/// "_from_name"): what a CLI user reads must be about the file, not the code.
inline bool config_shaped(const std::string& message, const std::string& file,
                          const std::string& key) {
  const std::string head = file + ": " + key;
  if (message.rfind(head, 0) != 0) return false;
  const std::string rest = message.substr(head.size());
  const bool valued = rest.rfind(" = ", 0) == 0 && rest.find(": ", 3) != std::string::npos;
  const bool bare = rest.rfind(": ", 0) == 0 && rest.size() > 2;
  return (valued || bare) && !contains(message, "::") && !contains(message, "_from_name");
}

/// The base of an event listener (CATCH_REGISTER_LISTENER). Catch2 v2 declares it only where
/// CATCH_CONFIG_EXTERNAL_INTERFACES (or CATCH_CONFIG_RUNNER) is defined before this include.
#if __has_include(<catch2/catch_all.hpp>)
using ListenerBase = Catch::EventListenerBase;  // Catch2 v3
#elif defined(CATCH_CONFIG_EXTERNAL_INTERFACES)
using ListenerBase = Catch::TestEventListenerBase;  // Catch2 v2
#endif

}  // namespace test

// Catch2's assertion macros are not thread-safe: inside rank threads (run_ranks with more than
// one rank) use these, which throw; run_ranks rethrows the first failure on the test's thread.
#define RANK_REQUIRE(cond)                                                              \
  do {                                                                                  \
    if (!(cond))                                                                        \
      throw std::runtime_error(std::string(__FILE__) + ":" + std::to_string(__LINE__) + \
                               ": RANK_REQUIRE(" #cond ") failed");                     \
  } while (0)

namespace test {

/// message_of for rank threads: throws instead of failing through Catch2.
template <class E, class F>
std::string rank_message_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  throw std::runtime_error("rank_message_of: expected an exception, none was thrown");
}

}  // namespace test
