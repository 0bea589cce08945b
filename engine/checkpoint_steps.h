// What saving, loading and the directory scan of checkpoints share besides the files: ranks that
// fail together, the checkpoint directory's name, a name's leftovers recovered (internal).
#pragma once

#include <fmt/format.h>

#include <exception>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "shardswap/engine.h"
#include "shardswap/error.h"

namespace shardswap::checkpoint_detail {

namespace fs = std::filesystem;

// Every rank learns whether any rank failed the phase; a failed rank rethrows its own error, the
// others say that another rank failed (every rank must leave the collective sequence together),
// as a PeerFailure: whoever collects the ranks' errors (run_ranks) shows the failing rank's.
inline void agree(Engine& engine, const std::exception_ptr& error, const char* what,
                  const std::function<void()>& on_failure = {}) {
  const double failed = engine.sum_across_ranks(error ? 1.0 : 0.0);
  if (failed == 0.0) return;
  if (on_failure) on_failure();
  if (error) std::rethrow_exception(error);
  throw PeerFailure(fmt::format("{}: {} other rank(s) failed (their error names the file)", what,
                                static_cast<int>(failed)));
}

template <class F>
void attempt(std::exception_ptr& error, F&& f) {
  if (error) return;
  try {
    f();
  } catch (...) {
    error = std::current_exception();
  }
}

// The params of `group` in the order its flat layout numbers them (declaration order).
inline std::vector<const ParamInfo*> params_of(const Engine& engine, const std::string& group) {
  std::vector<const ParamInfo*> out;
  for (const auto& p : engine.params())
    if (p.group == group) out.push_back(&p);
  return out;
}

inline fs::path normalized(const fs::path& dir, const char* fn) {
  fs::path d = dir.lexically_normal();
  if (!d.has_filename()) d = d.parent_path();
  if (d.empty() || d.filename() == "." || d.filename() == "..")
    throw ConfigError(fmt::format("{}: '{}' cannot be a checkpoint directory", fn, dir.string()));
  return d;
}

// What a kill during a save of `dir` can leave, made whole again (see recover_checkpoints).
void recover_name(const fs::path& dir, std::vector<std::string>& actions);

}  // namespace shardswap::checkpoint_detail
