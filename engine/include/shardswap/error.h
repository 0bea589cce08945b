// The one base of every ShardSwap error, and the typed errors shared by all modules.
// Header-only so that every module, partition/ (pure arithmetic) among them, can throw them
// without linking anything.
#pragma once

#include <exception>
#include <stdexcept>
#include <string>
#include <vector>

namespace shardswap {

/// Base of every error ShardSwap throws. Messages start with the function they come from and
/// name the config key, parameter, group, buffer or file involved; a mistake in a config value
/// instead reads "KEY = VALUE: what is wrong" (readers of a file add "FILE: " in front), the one
/// shape CLI users see for every config mistake.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Bad input: a config value, a declaration or an argument that can never work.
class ConfigError : public Error {
 public:
  using Error::Error;
};

/// A lifecycle call that does not fit the group's state (activating an active group,
/// deactivating a frozen one, gradients for a frozen param). Nothing was changed.
class StateError : public Error {
 public:
  using Error::Error;
};

/// A View was used after its buffer was freed or re-formed.
class StaleView : public Error {
 public:
  using Error::Error;
};

/// A buffer could not be released because Pins still hold it.
class PinnedMemory : public Error {
 public:
  using Error::Error;
};

/// An allocator could not satisfy a request.
class OutOfMemory : public Error {
 public:
  using Error::Error;
};

/// A collective failed, mismatched across ranks, or was aborted because another rank failed.
class CommError : public Error {
 public:
  using Error::Error;
};

/// This rank failed only because another one did: a collective aborted by a failing rank, or a
/// phase the ranks agreed had failed elsewhere ("N other rank(s) failed"). Never the root cause:
/// whoever collects the ranks' errors shows the failing rank's own error before this one.
class PeerFailure : public CommError {
 public:
  using CommError::CommError;
};

/// Of the errors of a group's ranks (in the order they arrived, empty entries skipped), the one a
/// user should see: the first that is not a PeerFailure, else the first. Empty if none failed.
inline std::exception_ptr root_cause(const std::vector<std::exception_ptr>& errors) {
  std::exception_ptr first;
  for (const auto& e : errors) {
    if (!e) continue;
    if (!first) first = e;
    try {
      std::rethrow_exception(e);
    } catch (const PeerFailure&) {
      continue;
    } catch (...) {
      return e;
    }
  }
  return first;
}

/// A CUDA, cuBLAS or NCCL call failed (the message names the statement, file, line and device).
class DeviceError : public Error {
 public:
  using Error::Error;
};

/// The requested backend (e.g. CUDA) is not part of this build.
class BackendUnavailable : public Error {
 public:
  using Error::Error;
};

}  // namespace shardswap
