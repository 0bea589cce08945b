// The Engine: declarations -> groups with flat layouts -> buffers -> the ZeRO-1/2 step.
#include "engine/engine.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <unordered_map>

#include "engine/bucket_reducer.h"
#include "engine/engine_impl.h"
#include "engine/group.h"
#include "memory/error.h"
#include "optimizer/loss_scaler.h"

namespace shardswap {

std::int64_t MemoryPlan::total() const {
  std::int64_t sum = 0;
  for (auto b : bytes) sum += b;
  return sum;
}

namespace {

constexpr std::int64_t kScalarBytes = 8;  // one double

LossScaleConfig scaling_for(const EngineConfig& config) {
  if (config.dtype == DType::f16) return config.loss_scale;
  LossScaleConfig none;  // bf16 has fp32's range: no scaling, but Inf/NaN still skip the step
  none.dynamic = false;
  none.static_scale = 1.0;
  return none;
}

std::string shape_text(const std::vector<std::int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

}  // namespace

Engine::Engine(EngineConfig config, Communicator& comm, MemorySpace& space,
               const OptimizerKernels& kernels)
    : config_(std::move(config)), comm_(comm), space_(space), kernels_(kernels) {
  config_.validate();
  impl_ = std::make_unique<Impl>(scaling_for(config_));
}

Engine::~Engine() = default;

void Engine::add_param(std::string name, std::vector<std::int64_t> shape, std::string group) {
  if (impl_->built)
    throw ConfigError(fmt::format("Engine::add_param: '{}' declared after build()", name));
  if (name.empty()) throw ConfigError("Engine::add_param: a param needs a name");
  if (group.empty())
    throw ConfigError(fmt::format("Engine::add_param: '{}' needs a group name", name));
  if (impl_->by_name.count(name))
    throw ConfigError(fmt::format("Engine::add_param: duplicate param name '{}'", name));
  std::int64_t numel = 1;
  for (auto extent : shape) numel *= extent;
  bool positive = !shape.empty();
  for (auto extent : shape) positive = positive && extent > 0;
  if (!positive)
    throw ConfigError(fmt::format("Engine::add_param: '{}' has zero elements (shape {})", name,
                                  shape_text(shape)));
  auto& groups = impl_->group_names;
  if (std::find(groups.begin(), groups.end(), group) == groups.end()) groups.push_back(group);
  Param p;
  p.info = {std::move(name), std::move(shape), numel, std::move(group)};
  impl_->by_name.emplace(p.info.name, impl_->params.size());
  impl_->infos.push_back(p.info);
  impl_->params.push_back(std::move(p));
}

void Engine::set_group_weight_decay(const std::string& group, double weight_decay) {
  if (!(weight_decay >= 0.0) || !std::isfinite(weight_decay))
    throw ConfigError(
        fmt::format("Engine::set_group_weight_decay: group '{}': weight decay {} "
                    "must be finite and >= 0",
                    group, weight_decay));
  impl_->weight_decay[group] = weight_decay;
  for (auto& g : impl_->groups)
    if (g.name == group) g.weight_decay = weight_decay;
}

// Groups with their layouts and shards, no buffers yet.
std::vector<Group> plan_groups(const EngineConfig& config,
                                      const std::vector<std::string>& names,
                                      std::vector<Param>& params,
                                      const std::map<std::string, double>& weight_decay,
                                      int world_size, int rank) {
  std::vector<Group> groups;
  for (const auto& name : names) {
    Group g;
    g.name = name;
    auto wd = weight_decay.find(name);
    g.weight_decay = wd != weight_decay.end() ? wd->second : config.optimizer.weight_decay;
    std::vector<std::int64_t> numels;
    for (std::size_t i = 0; i < params.size(); ++i)
      if (params[i].info.group == name) {
        params[i].group = groups.size();
        params[i].index_in_group = g.params.size();
        g.params.push_back(i);
        numels.push_back(params[i].info.numel);
      }
    LayoutOptions options;
    options.element_bytes = dtype_size(config.dtype);
    options.alignment_bytes = config.alignment_bytes;
    options.world_size = world_size;
    options.order = config.order;
    g.layout = FlatLayout::build(numels, options);
    g.shard = Shard::of(g.layout, rank);
    groups.push_back(std::move(g));
  }
  return groups;
}

// Bucket capacity in elements: the configured bytes (of gradients), capped at the largest group's
// flat size (a bucket's window never leaves one group, so more would never be used: DeepSpeed's
// default of 5e8 elements would otherwise cost 2 GB for any model), grown (with a warning) to
// the largest param, and to at least one element per rank for the stage-1 compressed chunks.
static std::int64_t bucket_capacity(const EngineConfig& config, const std::vector<Group>& groups,
                                    const std::vector<Param>& params, int world_size, bool warn) {
  const auto gsize = static_cast<std::int64_t>(dtype_size(config.grad_type()));
  std::int64_t capacity = static_cast<std::int64_t>(config.reduce_bucket_bytes) / gsize;
  std::int64_t largest = 0, largest_group = 0;
  std::string largest_name;
  for (const auto& g : groups) largest_group = std::max(largest_group, g.layout.total_numel());
  if (largest_group > 0) capacity = std::min(capacity, largest_group);
  for (const auto& g : groups)
    for (auto i : g.params)
      if (params[i].info.numel > largest) {
        largest = params[i].info.numel;
        largest_name = params[i].info.name;
      }
  if (config.stage == 2 && largest > capacity) {
    if (warn)
      spdlog::warn("Engine: reduce bucket grown from {} to {} bytes to hold param '{}'",
                   capacity * gsize, largest * gsize, largest_name);
    capacity = largest;
  }
  return std::max<std::int64_t>(capacity, world_size);
}

MemoryPlan Engine::plan(const std::optional<std::vector<std::string>>& active_at_build) const {
  if (impl_->params.empty()) throw ConfigError("Engine::plan: no params declared");
  if (active_at_build && impl_->built)
    throw StateError("Engine::plan: an active set can only be assumed before build()");
  if (active_at_build)
    for (const auto& name : *active_at_build)
      if (std::find(impl_->group_names.begin(), impl_->group_names.end(), name) ==
          impl_->group_names.end())
        throw ConfigError(fmt::format("Engine::plan: no group named '{}'", name));
  auto params = impl_->params;
  const bool built = impl_->built;
  const auto planned = plan_groups(config_, impl_->group_names, params, impl_->weight_decay,
                                   comm_.world_size(), comm_.rank());
  const auto psize = static_cast<std::int64_t>(dtype_size(config_.dtype));
  const auto gsize = static_cast<std::int64_t>(dtype_size(config_.grad_type()));
  const auto slots = config_.optimizer.state_slots();
  MemoryPlan plan;
  auto add = [&](Tag t, std::int64_t bytes) { plan.bytes[static_cast<std::size_t>(t)] += bytes; };
  for (std::size_t i = 0; i < planned.size(); ++i) {
    const Group& g = planned[i];
    add(Tag::param16, g.layout.total_numel() * psize);
    // Before build() every group counts as active (build's default), unless told otherwise.
    const Group* now = built ? &impl_->groups[i] : nullptr;
    const bool active =
        now != nullptr ? now->active
                       : !active_at_build || std::find(active_at_build->begin(),
                                                       active_at_build->end(),
                                                       impl_->group_names[i]) !=
                                                 active_at_build->end();
    const bool kept_on_device =
        now != nullptr && now->kept && now->kept->policy == DeactivatePolicy::keep_device;
    if (active)
      add(Tag::grad, (config_.stage == 1 ? g.layout.total_numel() : g.shard.numel()) * gsize);
    if (active || kept_on_device) {
      add(Tag::master32, g.shard.numel() * 4);
      add(Tag::optim_state, g.shard.numel() * 4 * slots);
    }
  }
  // After build the buckets exist: their size stays what build chose, whatever reform does.
  const auto capacity = built ? impl_->capacity
                              : bucket_capacity(config_, planned, params, comm_.world_size(), false);
  if (config_.stage == 2) add(Tag::grad, 2 * capacity * gsize);
  add(Tag::comm, kScalarBytes);
  if (config_.compressed())
    add(Tag::comm, capacity * static_cast<std::int64_t>(dtype_size(config_.comm_type())));
  return plan;
}

void Engine::build(const WeightInit& init, const std::optional<std::vector<std::string>>& active) {
  if (impl_->built) throw Error("Engine::build: already built");
  if (impl_->params.empty()) throw ConfigError("Engine::build: no params declared");
  const auto& names = impl_->group_names;
  if (active)
    for (const auto& name : *active)
      if (std::find(names.begin(), names.end(), name) == names.end())
        throw ConfigError(fmt::format("Engine::build: active group '{}' is not declared", name));
  const int rank = comm_.rank();
  const DType dtype = config_.dtype, grad_dtype = config_.grad_type();
  const auto psize = dtype_size(dtype);
  // Everything is built into locals and moved in at the end: a failure frees it all.
  auto params = impl_->params;
  auto groups = plan_groups(config_, names, params, impl_->weight_decay, comm_.world_size(), rank);
  std::vector<float> values;
  std::vector<std::byte> staged;  // one param's bit16 values on the host, then uploaded
  for (auto& g : groups) {
    const auto total = static_cast<std::size_t>(g.layout.total_numel());
    g.param16 =
        space_.allocate(total * psize, Tag::param16, fmt::format("group {} param16", g.name));
    kernels_.fill_zero(g.param16.data(), g.param16.bytes());  // padding stays zero for good
    for (auto i : g.params) {
      Param& p = params[i];
      const auto& entry = g.layout.entry_of(p.index_in_group);
      values.assign(static_cast<std::size_t>(p.info.numel), 0.0f);
      init(p.info, values);
      staged.resize(values.size() * psize);
      cpu_kernels().cast(staged.data(), dtype, values.data(), DType::f32, values.size());
      space_.upload(g.param16_at(entry.offset, psize), staged.data(), staged.size());
      p.weight = g.param16.view(static_cast<std::size_t>(entry.offset) * psize,
                                static_cast<std::size_t>(p.info.numel), dtype,
                                p.info.name + ": weight view");
    }
    // Every rank must start from the same weights, whatever its init did.
    comm_.broadcast(g.param16.data(), total, dtype, 0);
  }
  const auto capacity = bucket_capacity(config_, groups, params, comm_.world_size(), rank == 0);
  std::unique_ptr<BucketReducer> reducer;
  if (config_.stage == 2)
    reducer = std::make_unique<BucketReducer>(comm_, space_, kernels_, grad_dtype,
                                              config_.comm_type(), capacity,
                                              config_.overlap_comm);
  Buffer compressed;
  if (config_.stage == 1 && config_.compressed())
    compressed = space_.allocate(
        static_cast<std::size_t>(capacity) * dtype_size(config_.comm_type()), Tag::comm,
        fmt::format("compressed chunk ({})", dtype_name(config_.comm_type())));
  Buffer scalars = space_.allocate(kScalarBytes, Tag::comm, "step scalars");
  // Active state last, through the same path as activate(); params must be in place for views.
  std::swap(impl_->params, params);
  try {
    for (auto& g : groups)
      if (!active || std::find(active->begin(), active->end(), g.name) != active->end())
        allocate_active_state(g);
  } catch (...) {
    std::swap(impl_->params, params);
    throw;
  }
  impl_->groups = std::move(groups);
  impl_->reducer = std::move(reducer);
  impl_->compressed = std::move(compressed);
  impl_->scalars = std::move(scalars);
  impl_->capacity = capacity;
  impl_->built = true;
}

View Engine::weight(const std::string& name) const {
  impl_->require_built("weight");
  return impl_->param(name, "weight").weight;
}

View Engine::grad_slot(const std::string& name) {
  impl_->require_built("grad_slot");
  Param& p = impl_->param(name, "grad_slot");
  if (!impl_->groups[p.group].active)
    throw StateError(
        fmt::format("Engine::grad_slot: '{}' belongs to frozen group '{}'", name, p.info.group));
  if (config_.stage == 1) {
    p.slot_out = true;
    p.ready = false;
    return p.full_grad;
  }
  Group& g = impl_->groups[p.group];
  const auto i = static_cast<std::size_t>(&p - impl_->params.data());
  return impl_->reducer->slot(g, i, name, g.layout.entry_of(p.index_in_group));
}

void Engine::grad_ready(const std::string& name) {
  impl_->require_built("grad_ready");
  Param& p = impl_->param(name, "grad_ready");
  const auto i = static_cast<std::size_t>(&p - impl_->params.data());
  const bool known = config_.stage == 1 ? p.slot_out : impl_->reducer->mark_ready(i);
  if (!known)
    throw Error(fmt::format("Engine::grad_ready: '{}' has no grad slot handed out", name));
  p.ready = true;
}

void Engine::finish_backward() {
  impl_->require_built("finish_backward");
  if (config_.stage == 2) {
    impl_->reducer->finish();
    return;
  }
  std::string missing;
  for (const auto& p : impl_->params)
    if (p.slot_out && !p.ready)
      missing += fmt::format("{}'{}'", missing.empty() ? "" : ", ", p.info.name);
  if (!missing.empty())
    throw Error(fmt::format("Engine: grad_slot was handed out but grad_ready never called for {}",
                            missing));
}

// Stage 1: reduce-scatters a group's full gradient buffer so this rank's shard holds the sum.
// Uncompressed, in place. Compressed, in chunks through the one comm buffer: the k-th slice of
// every rank's shard is cast to the wire type side by side, reduce-scattered there, and this
// rank's slice is cast back into its fp32 shard.
void Engine::reduce_scatter_grads(Group& g) {
  const DType grad_dtype = config_.grad_type(), wire = config_.comm_type();
  const auto gsize = dtype_size(grad_dtype), wsize = dtype_size(wire);
  const auto shard = static_cast<std::size_t>(g.shard.numel());
  const auto rank = static_cast<std::size_t>(comm_.rank());
  auto* grads = g.grad.as<std::byte>();
  if (!config_.compressed()) {
    comm_.reduce_scatter(grads, grads + rank * shard * gsize, shard, grad_dtype, ReduceOp::sum);
    return;
  }
  const auto ranks = static_cast<std::size_t>(comm_.world_size());
  const std::size_t slice = static_cast<std::size_t>(impl_->capacity) / ranks;
  auto* chunk = impl_->compressed.as<std::byte>();
  for (std::size_t k = 0; k < shard; k += slice) {
    const std::size_t n = std::min(slice, shard - k);
    for (std::size_t r = 0; r < ranks; ++r)
      kernels_.cast(chunk + r * n * wsize, wire, grads + (r * shard + k) * gsize, grad_dtype, n);
    comm_.reduce_scatter(chunk, chunk + rank * n * wsize, n, wire, ReduceOp::sum);
    kernels_.cast(grads + (rank * shard + k) * gsize, grad_dtype, chunk + rank * n * wsize, wire,
                  n);
  }
}

double Engine::sum_across_ranks(double value) {
  impl_->require_built("sum_across_ranks");
  void* scalar = impl_->scalars.data();
  space_.upload(scalar, &value, sizeof value);
  comm_.all_reduce(scalar, 1, DType::f64, ReduceOp::sum);
  space_.download(&value, scalar, sizeof value);
  // After a timed-out collective was aborted the download returns whatever the buffer held:
  // the communicator says so here, before the value steers a step.
  comm_.check();
  return value;
}

StepResult Engine::step() {
  impl_->require_built("step");
  finish_backward();
  const DType dtype = config_.dtype, grad_dtype = config_.grad_type();
  const auto psize = dtype_size(dtype), gsize = dtype_size(grad_dtype);
  auto& groups = impl_->groups;
  if (config_.stage == 1)
    for (auto& g : groups)
      if (g.active) reduce_scatter_grads(g);

  // Partitions now hold sums over ranks of loss-scaled micro-batch sums. One factor turns them
  // into the mean unscaled gradient; it is applied in registers, never to a stored copy.
  StepResult result;
  result.loss_scale = impl_->scaler.scale();
  const double unscale =
      1.0 / (result.loss_scale * comm_.world_size() * config_.gradient_accumulation_steps);
  double squares = 0.0;
  for (auto& g : groups)
    if (g.active)
      squares += kernels_.sum_squares(g.grad_partition(config_.stage, gsize), grad_dtype,
                                      static_cast<std::size_t>(g.shard.numel()), unscale);
  // One all-reduce gives both the norm and the overflow flag: Inf/NaN anywhere poisons the sum.
  squares = sum_across_ranks(squares);
  result.grad_norm = std::sqrt(squares);
  const bool overflow = !std::isfinite(squares);
  if (overflow && dtype == DType::bf16 && config_.nonfinite == NonFinitePolicy::error) {
    // Every rank saw the same all-reduced sum, so every rank throws here. The gradients are
    // dropped first so that a caller who catches it can go on with the next batch.
    std::int64_t done = 0;  // the optimizer step this would have been: after the furthest group
    for (const auto& g : groups)
      if (g.active) done = std::max(done, g.step);
    zero_grad();
    throw Error(fmt::format(
        "Engine::step: step {} (optimizer step of the active groups) has non-finite gradients "
        "(global norm {}) under bf16 with shardswap.nonfinite = error; the step was not "
        "applied, weights and optimizer state are unchanged, the gradients were dropped",
        done + 1, result.grad_norm));
  }
  result.applied = impl_->scaler.update(overflow);
  if (result.applied) {
    result.clip_coef = clip_coefficient(result.grad_norm, config_.gradient_clipping);
    StepArgs args;
    args.lr = config_.optimizer.lr;
    args.grad_scale = static_cast<float>(unscale * result.clip_coef);
    const auto slots = config_.optimizer.state_slots();
    for (auto& g : groups) {
      if (!g.active) continue;
      const auto shard = static_cast<std::size_t>(g.shard.numel());
      args.step = ++g.step;
      args.weight_decay = g.weight_decay;
      ShardTensors t;
      t.master = g.master.as<float>();
      t.state0 = slots >= 1 ? g.state.as<float>() : nullptr;
      t.state1 = slots >= 2 ? g.state.as<float>() + shard : nullptr;
      t.grad = g.grad_partition(config_.stage, gsize);
      t.param = g.param16_at(g.shard.begin, psize);
      t.dtype = dtype;
      t.grad_dtype = grad_dtype;
      t.count = shard;
      kernels_.update(config_.optimizer, args, t);
    }
    for (auto& g : groups) {
      if (!g.active) continue;
      const auto shard = static_cast<std::size_t>(g.shard.numel());
      comm_.all_gather(g.param16_at(g.shard.begin, psize), g.param16.data(), shard, dtype);
    }
  }
  zero_grad();
  return result;
}

void Engine::zero_grad() {
  impl_->require_built("zero_grad");
  if (impl_->reducer) impl_->reducer->discard();
  for (auto& g : impl_->groups)
    if (g.active) kernels_.fill_zero(g.grad.data(), g.grad.bytes());
  for (auto& p : impl_->params) p.slot_out = p.ready = false;
}

double Engine::loss_scale() const {
  return impl_->scaler.scale();
}

void Engine::set_lr(double lr) {
  if (!(lr >= 0.0) || !std::isfinite(lr))
    throw ConfigError(fmt::format("Engine::set_lr: learning rate {} must be finite and >= 0", lr));
  config_.optimizer.lr = lr;
}

const std::vector<ParamInfo>& Engine::params() const {
  return impl_->infos;
}

std::vector<std::string> Engine::groups() const {
  return impl_->group_names;
}

static const Group& find_group(const std::vector<Group>& groups, const std::string& name,
                               const char* caller) {
  for (const auto& g : groups)
    if (g.name == name) return g;
  throw ConfigError(fmt::format("Engine::{}: no built group named '{}'", caller, name));
}

std::int64_t Engine::group_step(const std::string& group) const {
  return find_group(impl_->groups, group, "group_step").step;
}

const FlatLayout& Engine::layout(const std::string& group) const {
  return find_group(impl_->groups, group, "layout").layout;
}

std::vector<MasterPiece> Engine::master_pieces(const std::string& name) const {
  impl_->require_built("master_pieces");
  const Param& p = impl_->param(name, "master_pieces");
  const Group& g = impl_->groups[p.group];
  std::vector<MasterPiece> pieces;
  if (!g.active) return pieces;  // a frozen group has no master
  const float* master = g.master.as<float>();
  for (const auto& f : g.shard.fragments)
    if (f.param == p.index_in_group) {
      MasterPiece piece{f.param_offset, std::vector<float>(static_cast<std::size_t>(f.count))};
      space_.download(piece.values.data(), master + f.shard_offset, f.count * sizeof(float));
      pieces.push_back(std::move(piece));
    }
  return pieces;
}

std::vector<float> Engine::read_weight(const std::string& name) const {
  const View w = weight(name);
  std::vector<std::byte> raw(w.bytes());
  space_.download(raw.data(), w.raw(), raw.size());
  std::vector<float> out(w.count());
  cpu_kernels().cast(out.data(), DType::f32, raw.data(), w.dtype(), out.size());
  return out;
}

}  // namespace shardswap
