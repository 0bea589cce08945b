// The Engine's private state, shared by engine.cpp (declarations, build, step) and
// lifecycle.cpp (activate, deactivate, switches). Not part of the public API.
#pragma once

#include <fmt/format.h>

#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "engine/bucket_reducer.h"
#include "engine/engine.h"
#include "engine/group.h"
#include "memory/error.h"
#include "optimizer/loss_scaler.h"

namespace shardswap {

struct Engine::Impl {
  explicit Impl(const LossScaleConfig& scaling) : scaler(scaling) {}

  std::vector<Param> params;
  std::vector<ParamInfo> infos;  // the declarations, as params() returns them
  std::unordered_map<std::string, std::size_t> by_name;
  std::vector<std::string> group_names;  // in order of first declaration
  std::map<std::string, double> weight_decay;
  std::vector<Group> groups;  // after build
  std::unique_ptr<BucketReducer> reducer;
  Buffer compressed;          // stage 1 with compression: one reused chunk buffer
  Buffer scalars;             // the step's global scalars, in backend memory for the collectives
  std::int64_t capacity = 0;  // bucket (and compressed chunk) capacity in elements
  LossScaler scaler;
  std::unique_ptr<MemorySpace> host;  // keep_host states; made on first use
  // During set_active only: blocks given up by outgoing groups, handed to incoming groups of
  // the same size and tag instead of a cudaFree + cudaMalloc pair; the rest is released when
  // set_active returns, so nothing is cached between calls.
  std::vector<Buffer> recycled;
  bool recycling = false;
  std::int64_t bytes_given_up = 0;  // by the current set_active
  std::int64_t bytes_taken = 0;
  bool built = false;

  Param& param(const std::string& name, const char* caller) {
    auto it = by_name.find(name);
    if (it == by_name.end())
      throw ConfigError(fmt::format("Engine::{}: no param named '{}'", caller, name));
    return params[it->second];
  }
  void require_built(const char* caller) const {
    if (!built) throw Error(fmt::format("Engine::{}: call build() first", caller));
  }
};

/// Groups with their layouts and shards (no buffers) for `names`, each holding the params whose
/// info.group is its name; sets each param's group and index_in_group.
std::vector<Group> plan_groups(const EngineConfig& config, const std::vector<std::string>& names,
                               std::vector<Param>& params,
                               const std::map<std::string, double>& weight_decay, int world_size,
                               int rank);

}  // namespace shardswap
