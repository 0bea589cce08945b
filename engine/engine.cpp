// The Engine: declarations -> groups with flat layouts -> buffers -> the ZeRO-1/2 step.
#include "shardswap/engine.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <string_view>
#include <unordered_map>
#include <unordered_set>

#include "engine/backend_ops.h"
#include "engine/engine_impl.h"
#include "engine/engine_internals.h"
#include "engine/group.h"
#include "engine/rank_agreement.h"
#include "shardswap/error.h"

namespace shardswap {

std::int64_t MemoryPlan::total() const {
  std::int64_t sum = 0;
  for (auto b : bytes) sum += b;
  return sum;
}

std::int64_t MemoryPlan::host_total() const {
  std::int64_t sum = 0;
  for (auto b : host) sum += b;
  return sum;
}

namespace {

// The step's scalars: the sum of squares, and the doubles RankAgreement exchanges.
constexpr std::int64_t kScalarBytes = RankAgreement::kScratchDoubles * sizeof(double);

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

const char* device_kind_name(DeviceKind kind) {
  return kind == DeviceKind::cuda ? "CUDA device memory" : "host memory";
}

// The backend, the memory space and the communicator must work on the same memory: the device
// operations are the backend's, and they run on the space's buffers and the collectives' data.
const Backend& checked_backend(const Backend& backend, const MemorySpace& space,
                               const Communicator& comm) {
  if (space.device() != backend.kind())
    throw ConfigError(fmt::format(
        "Engine: backend '{}' runs on {}, but its MemorySpace (rank {}) allocates {}; make the "
        "space with backend.make_allocator(rank)",
        backend.name(), device_kind_name(backend.kind()), space.rank(),
        device_kind_name(space.device())));
  if (comm.device() != backend.kind())
    throw ConfigError(fmt::format(
        "Engine: backend '{}' runs on {}, but its Communicator (rank {}) exchanges {}",
        backend.name(), device_kind_name(backend.kind()), comm.rank(),
        device_kind_name(comm.device())));
  return backend;
}

EngineConfig validated(EngineConfig config) {
  config.validate();
  return config;
}

}  // namespace

Engine::Impl::Impl(EngineConfig config_in, Communicator& comm_in, MemorySpace& space_in,
                   const Backend& backend_in)
    : config(validated(std::move(config_in))),
      comm(comm_in),
      space(space_in),
      backend(checked_backend(backend_in, space_in, comm_in)),
      ops(device_ops(backend)),
      scaler(scaling_for(config)) {}

Engine::Engine(EngineConfig config, Communicator& comm, MemorySpace& space,
               const Backend& backend)
    : impl_(std::make_unique<Impl>(std::move(config), comm, space, backend)) {}

Engine::~Engine() {
  // An update still running beside the caller's work must not outlive the buffers it writes.
  if (impl_->update_end != 0) {
    try {
      impl_->settle_update();
      impl_->ops.synchronize();
    } catch (const std::exception& e) {
      spdlog::warn("Engine::~Engine: waiting for the last update failed: {}", e.what());
    }
  }
}

namespace {

// Where add_param records the declarations: the Engine's Impl, or plan_memory's own lists (a plan
// without an Engine checks and orders them by the same code).
struct Declarations {
  std::vector<Param>& params;
  std::unordered_map<std::string, std::size_t>& by_name;
  std::vector<std::string>& group_names;  // in order of first declaration
  std::unordered_set<std::string>& declared_groups;

  void add(std::string name, std::vector<std::int64_t> shape, std::string group) {
    if (name.empty()) throw ConfigError("Engine::add_param: a param needs a name");
    if (group.empty())
      throw ConfigError(fmt::format("Engine::add_param: '{}' needs a group name", name));
    if (by_name.count(name))
      throw ConfigError(fmt::format("Engine::add_param: duplicate param name '{}'", name));
    bool positive = !shape.empty();
    for (auto extent : shape) positive = positive && extent > 0;
    if (!positive)
      throw ConfigError(fmt::format("Engine::add_param: '{}' has zero elements (shape {})", name,
                                    shape_text(shape)));
    // Checked as it is multiplied: {2^32, 2^32} would wrap to 0 elements, {INT64_MAX, 4} to -4.
    // The bound leaves room for the bytes of every kind of state an element has (bit16 weight
    // and gradient, fp32 master, two fp32 moments) in an int64.
    std::int64_t numel = 1;
    for (auto extent : shape)
      if (__builtin_mul_overflow(numel, extent, &numel) || numel > Engine::kMaxParamElements)
        throw ConfigError(fmt::format(
            "Engine::add_param: '{}' (shape {}) has more than {} elements, the most a param may "
            "have",
            name, shape_text(shape), Engine::kMaxParamElements));
    if (declared_groups.insert(group).second) group_names.push_back(group);
    Param p;
    p.info = {std::move(name), std::move(shape), numel, std::move(group)};
    by_name.emplace(p.info.name, params.size());
    params.push_back(std::move(p));
  }
};

}  // namespace

void Engine::add_param(std::string name, std::vector<std::int64_t> shape, std::string group) {
  if (impl_->built)
    throw ConfigError(fmt::format("Engine::add_param: '{}' declared after build()", name));
  Declarations{impl_->params, impl_->by_name, impl_->group_names, impl_->declared_groups}.add(
      std::move(name), std::move(shape), std::move(group));
  impl_->infos.push_back(impl_->params.back().info);
}

namespace {

// set_group_weight_decay's and set_param_weight_decay's one rule for the value.
void check_weight_decay(const char* call, const char* what, const std::string& name,
                        double weight_decay) {
  if (!(weight_decay >= 0.0) || !std::isfinite(weight_decay))
    throw ConfigError(fmt::format("Engine::{}: {} '{}': weight decay {} must be finite and >= 0",
                                  call, what, name, weight_decay));
}

}  // namespace

void Engine::set_group_weight_decay(const std::string& group, double weight_decay) {
  check_weight_decay("set_group_weight_decay", "group", group, weight_decay);
  impl_->weight_decay[group] = weight_decay;
  for (auto& g : impl_->groups)
    if (g.name == group) g.weight_decay = weight_decay;
}

void Engine::set_param_weight_decay(const std::string& param, double weight_decay) {
  check_weight_decay("set_param_weight_decay", "param", param, weight_decay);
  impl_->param(param, "set_param_weight_decay");  // refuses an unknown name
  impl_->param_weight_decay[param] = weight_decay;
}

namespace {

// A stretch of a group's shard whose elements share one weight decay.
struct DecaySpan {
  std::int64_t begin = 0;  // in the shard
  std::int64_t count = 0;
  double weight_decay = 0.0;
};

// The group's shard as stretches of equal weight decay: one span without per-param overrides;
// else a span per run of fragments, each reaching to the next fragment (the alignment padding
// between params, whose values stay zero, rides with the param before it).
std::vector<DecaySpan> decay_spans(const Group& g, const std::vector<Param>& params,
                                   const std::map<std::string, double>& overrides) {
  const std::int64_t n = g.shard.numel();
  if (overrides.empty() || g.shard.fragments.empty()) return {{0, n, g.weight_decay}};
  std::vector<DecaySpan> spans;
  for (std::size_t i = 0; i < g.shard.fragments.size(); ++i) {
    const Fragment& f = g.shard.fragments[i];
    const auto it = overrides.find(params[g.params[f.param]].info.name);
    const double wd = it != overrides.end() ? it->second : g.weight_decay;
    const std::int64_t begin = i == 0 ? 0 : f.shard_offset;
    if (!spans.empty() && spans.back().weight_decay == wd) continue;  // extends to the next
    if (!spans.empty()) spans.back().count = begin - spans.back().begin;
    spans.push_back({begin, 0, wd});
  }
  spans.back().count = n - spans.back().begin;
  return spans;
}

}  // namespace

// Groups with their layouts and shards, no buffers yet.
std::vector<Group> plan_groups(const EngineConfig& config,
                                      const std::vector<std::string>& names,
                                      std::vector<Param>& params,
                                      const std::map<std::string, double>& weight_decay,
                                      int world_size, int rank) {
  // Each param's group looked up once (a scan of all params per group was quadratic: 21 s to
  // plan 10,000 layers).
  std::unordered_map<std::string_view, std::size_t> index_of;
  for (std::size_t i = 0; i < names.size(); ++i) index_of.emplace(names[i], i);
  std::vector<std::vector<std::size_t>> members(names.size());
  for (std::size_t i = 0; i < params.size(); ++i) {
    const auto it = index_of.find(params[i].info.group);
    if (it == index_of.end())
      throw Error(fmt::format("Engine: param '{}' has undeclared group '{}'", params[i].info.name,
                              params[i].info.group));
    members[it->second].push_back(i);
  }
  std::vector<Group> groups;
  for (std::size_t k = 0; k < names.size(); ++k) {
    const auto& name = names[k];
    Group g;
    g.name = name;
    g.index = k;
    auto wd = weight_decay.find(name);
    g.weight_decay = wd != weight_decay.end() ? wd->second : config.optimizer.weight_decay;
    std::vector<std::int64_t> numels;
    for (const std::size_t i : members[k]) {
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
  // A bucket, or a window of gradients on the host, holds a whole param.
  const bool windows = config.gradient_placement == Placement::host;
  if ((windows || !accumulates_in_place(config, world_size)) && largest > capacity) {
    if (warn)
      spdlog::warn("Engine: {} grown from {} to {} bytes to hold param '{}'",
                   windows ? "gradient window" : "reduce bucket", capacity * gsize,
                   largest * gsize, largest_name);
    capacity = largest;
  }
  return std::max<std::int64_t>(capacity, world_size);
}

namespace {

// What a plan is made of: the declarations and, after build(), the groups' states and the bucket
// capacity build chose. Engine::plan gives its own; plan_memory, before any build, its lists.
struct PlanSource {
  const EngineConfig& config;
  const std::vector<Param>& params;
  const std::vector<std::string>& group_names;
  const std::unordered_set<std::string>& declared_groups;
  const std::map<std::string, double>& weight_decay;
  int world_size = 1;
  int rank = 0;
  const std::vector<Group>* built = nullptr;  // the built groups; null before build()
  std::int64_t capacity = 0;                  // build's bucket capacity, after build()
  std::int64_t chunk = 0;                     // build's offload chunk, after build()
  std::int64_t window_bytes = 0;              // build's frozen weight windows, after build()
};

// Bytes of each frozen weight window: the largest group's weights.
std::int64_t weight_window_bytes(const std::vector<Group>& groups, std::size_t psize) {
  std::int64_t most = 0;
  for (const auto& g : groups)
    most = std::max(most, g.layout.total_numel() * static_cast<std::int64_t>(psize));
  return most;
}

MemoryPlan plan_of(const PlanSource& in,
                   const std::optional<std::vector<std::string>>& active_at_build) {
  if (in.params.empty()) throw ConfigError("Engine::plan: no params declared");
  if (active_at_build && in.built)
    throw StateError("Engine::plan: an active set can only be assumed before build()");
  const std::unordered_set<std::string_view> assumed =
      active_at_build ? std::unordered_set<std::string_view>(active_at_build->begin(),
                                                             active_at_build->end())
                      : std::unordered_set<std::string_view>();
  if (active_at_build)
    for (const auto& name : *active_at_build)
      if (!in.declared_groups.count(name))
        throw ConfigError(fmt::format("Engine::plan: no group named '{}'", name));
  auto params = in.params;
  const auto planned =
      plan_groups(in.config, in.group_names, params, in.weight_decay, in.world_size, in.rank);
  const auto psize = static_cast<std::int64_t>(dtype_size(in.config.dtype));
  const auto gsize = static_cast<std::int64_t>(dtype_size(in.config.grad_type()));
  const auto slots = in.config.optimizer.state_slots();
  const auto state_bytes = static_cast<std::int64_t>(in.config.optimizer.state_bytes());
  const auto master_bytes = static_cast<std::int64_t>(in.config.optimizer.master_bytes());
  require_gradient_placement(in.config, in.world_size);
  const bool in_place = accumulates_in_place(in.config, in.world_size);
  const bool state_on_host = in.config.optimizer_placement == Placement::host;
  const bool grads_on_host = in.config.gradient_placement == Placement::host;
  MemoryPlan plan;
  auto add_to = [](std::array<std::int64_t, kTagCount>& where, Tag t, std::int64_t bytes) {
    where[static_cast<std::size_t>(t)] += bytes;
  };
  auto add = [&](Tag t, std::int64_t bytes) { add_to(plan.bytes, t, bytes); };
  auto add_host = [&](Tag t, std::int64_t bytes) { add_to(plan.host, t, bytes); };
  const bool weights_on_host = in.config.frozen_weight_placement == Placement::host;
  for (std::size_t i = 0; i < planned.size(); ++i) {
    const Group& g = planned[i];
    // Before build() every group counts as active (build's default), unless told otherwise.
    const Group* now = in.built ? &(*in.built)[i] : nullptr;
    const bool active =
        now != nullptr ? now->active : !active_at_build || assumed.count(in.group_names[i]);
    // Weights on the host: every group's home there, an active group's weights on the device too.
    if (weights_on_host) add_host(Tag::param16, g.layout.total_numel() * psize);
    if (!weights_on_host || active) add(Tag::param16, g.layout.total_numel() * psize);
    const bool kept = now != nullptr && now->kept;
    if (active)
      add_to(grads_on_host ? plan.host : plan.bytes, Tag::grad,
             (in_place ? g.layout.total_numel() : g.shard.numel()) * gsize);
    if (active || kept) {
      const bool on_host =
          state_on_host || (kept && now->kept->policy == DeactivatePolicy::keep_host);
      auto& where = on_host ? plan.host : plan.bytes;
      add_to(where, Tag::master32, g.shard.numel() * master_bytes);
      add_to(where, Tag::optim_state, g.shard.numel() * state_bytes * slots);
    }
  }
  if (state_on_host) {  // the update's two slots on the device, or two staging buffers
    const std::int64_t chunk = in.built ? in.chunk : offload_chunk(in.config, planned);
    if (grads_on_host) add(Tag::grad, 2 * chunk * gsize);  // the gradients' slots
    if (in.config.offload_update == OffloadUpdate::streamed) {
      add(Tag::master32, 2 * chunk * master_bytes);
      add(Tag::optim_state, 2 * chunk * state_bytes * slots);
    } else {
      if (!grads_on_host) add_host(Tag::grad, chunk * gsize);  // else read where they are
      add_host(Tag::param16, chunk * psize);
    }
  }
  // After build the buckets exist: their size stays what build chose, whatever reform does.
  const auto capacity =
      in.built ? in.capacity : bucket_capacity(in.config, planned, params, in.world_size, false);
  if (!in_place || grads_on_host) add(Tag::grad, 2 * capacity * gsize);  // buckets or windows
  if (weights_on_host)  // two windows of frozen weights
    add(Tag::param16, 2 * (in.built ? in.window_bytes : weight_window_bytes(planned, psize)));
  add(Tag::comm, kScalarBytes);
  if (in.config.compressed())
    add(Tag::comm, capacity * static_cast<std::int64_t>(dtype_size(in.config.comm_type())));
  return plan;
}

}  // namespace

MemoryPlan Engine::plan(const std::optional<std::vector<std::string>>& active_at_build) const {
  return plan_of({.config = impl_->config,
                  .params = impl_->params,
                  .group_names = impl_->group_names,
                  .declared_groups = impl_->declared_groups,
                  .weight_decay = impl_->weight_decay,
                  .world_size = impl_->comm.world_size(),
                  .rank = impl_->comm.rank(),
                  .built = impl_->built ? &impl_->groups : nullptr,
                  .capacity = impl_->capacity,
                  .chunk = impl_->chunk,
                  .window_bytes = impl_->weight_windows
                                      ? static_cast<std::int64_t>(impl_->weight_windows->bytes())
                                      : 0},
                 active_at_build);
}

MemoryPlan plan_memory(const EngineConfig& config, int world_size, int rank,
                       const std::vector<ParamDeclaration>& params,
                       const std::optional<std::vector<std::string>>& active_at_build) {
  if (world_size < 1 || rank < 0 || rank >= world_size)
    throw ConfigError(
        fmt::format("plan_memory: rank {} of world size {}: needs world size >= 1 "
                    "and 0 <= rank < world size",
                    rank, world_size));
  const EngineConfig checked = validated(config);  // as the Engine's constructor checks it
  std::vector<Param> declared;
  std::unordered_map<std::string, std::size_t> by_name;
  std::vector<std::string> group_names;
  std::unordered_set<std::string> declared_groups;
  Declarations into{declared, by_name, group_names, declared_groups};
  for (const auto& p : params) into.add(p.name, p.shape, p.group);
  const std::map<std::string, double> no_weight_decay;  // changes no byte
  return plan_of({.config = checked,
                  .params = declared,
                  .group_names = group_names,
                  .declared_groups = declared_groups,
                  .weight_decay = no_weight_decay,
                  .world_size = world_size,
                  .rank = rank},
                 active_at_build);
}

void Engine::build(const WeightInit& init, const std::optional<std::vector<std::string>>& active) {
  if (impl_->built) throw StateError("Engine::build: already built");
  if (impl_->params.empty()) throw ConfigError("Engine::build: no params declared");
  const auto& names = impl_->group_names;
  const std::unordered_set<std::string_view> wanted =
      active ? std::unordered_set<std::string_view>(active->begin(), active->end())
             : std::unordered_set<std::string_view>();
  if (active)
    for (const auto& name : *active)
      if (!impl_->declared_groups.count(name))
        throw ConfigError(fmt::format("Engine::build: active group '{}' is not declared", name));
  const int rank = impl_->comm.rank();
  const DType dtype = impl_->config.dtype;
  const auto psize = dtype_size(dtype);
  // Everything is built into locals and moved in at the end: a failure frees it all. The
  // scalars come first: the ranks compare their declarations through them before anything else
  // is allocated or exchanged.
  Buffer scalars = impl_->space.allocate(kScalarBytes, Tag::comm, "step scalars");
  impl_->require_same_declarations(scalars.data(), "build", "nothing stays allocated");
  auto params = impl_->params;
  auto groups = plan_groups(impl_->config, names, params, impl_->weight_decay, impl_->comm.world_size(), rank);
  std::vector<float> values;
  std::vector<std::byte> staged;  // one param's bit16 values on the host, then uploaded
  // Weights on the host: every group's home there, and the windows that bring frozen ones in.
  const bool homes = impl_->weights_on_host();
  std::unique_ptr<WeightWindows> windows;
  if (homes)
    windows = std::make_unique<WeightWindows>(
        impl_->space, impl_->ops,
        static_cast<std::size_t>(weight_window_bytes(groups, psize)));
  for (auto& g : groups) {
    const auto total = static_cast<std::size_t>(g.layout.total_numel());
    MemorySpace& where = homes ? impl_->host_space() : impl_->space;
    const DeviceOps& at = homes ? cpu_device_ops() : impl_->ops;
    g.param16 = where.allocate(total * psize, Tag::param16,
                               fmt::format("group {} param16{}", g.name, homes ? " (host)" : ""));
    at.fill_zero(g.param16.data(), g.param16.bytes());  // padding stays zero for good
    for (auto i : g.params) {
      Param& p = params[i];
      const auto& entry = g.layout.entry_of(p.index_in_group);
      values.assign(static_cast<std::size_t>(p.info.numel), 0.0f);
      init(p.info, values);
      staged.resize(values.size() * psize);
      cpu_device_ops().cast(staged.data(), dtype, values.data(), DType::f32, values.size());
      where.upload(g.param16_at(entry.offset, psize), staged.data(), staged.size());
    }
    // Every rank must start from the same weights, whatever its init did: a home goes through
    // a window, the collectives' memory.
    if (!homes) {
      impl_->comm.broadcast(g.param16.data(), total, dtype, 0);
    } else if (impl_->comm.world_size() > 1) {
      const Buffer& window = windows->scratch();
      impl_->space.upload(window.data(), g.param16.data(), g.param16.bytes());
      impl_->comm.broadcast(window.data(), total, dtype, 0);
      impl_->space.download(g.param16.data(), window.data(), g.param16.bytes());
    }
  }
  const auto capacity = bucket_capacity(impl_->config, groups, params, impl_->comm.world_size(), rank == 0);
  // The gradient path's buffers (stage 2 buckets, the compressed chunk).
  auto reducer = make_gradient_reducer(impl_->config, impl_->comm, impl_->space, impl_->ops,
                                       capacity, params.size());
  // Active state last, through the same path as activate(); params and the reducer must be in
  // place for the gradient slots.
  std::swap(impl_->params, params);
  std::swap(impl_->reducer, reducer);
  try {
    if (impl_->state_on_host()) impl_->allocate_staging(groups);
    for (auto& g : groups) {
      if (!active || wanted.count(g.name)) {
        if (homes) impl_->weights_up(g);
        impl_->allocate_active_state(g);
      }
      impl_->register_weight_views(g);
    }
  } catch (...) {
    std::swap(impl_->params, params);
    std::swap(impl_->reducer, reducer);
    impl_->slot_master = Buffer();
    impl_->slot_state = Buffer();
    impl_->slot_grad = Buffer();
    impl_->staging_grad = Buffer();
    impl_->staging_param = Buffer();
    impl_->updater.reset();
    impl_->host.reset();
    throw;
  }
  impl_->groups = std::move(groups);
  impl_->weight_windows = std::move(windows);
  impl_->scalars = std::move(scalars);
  impl_->capacity = capacity;
  impl_->built = true;
  impl_->hash_declarations();
}

View Engine::weight(const std::string& name) const {
  impl_->require_built_only("weight");
  const Param& p = impl_->param(name, "weight");
  const Group& g = impl_->groups[p.group];
  impl_->await_update(g);
  if (!impl_->weights_on_host() || g.active) return p.weight;
  const Buffer* window = impl_->weight_windows->window_of(g);
  if (window == nullptr)
    throw StateError(fmt::format(
        "Engine::weight: '{}': group '{}' is frozen and its weights are on the host "
        "(frozen_weight_placement = host); fetch_weights('{}') brings them to the device",
        name, g.name, g.name));
  const auto psize = dtype_size(impl_->config.dtype);
  return window->view(static_cast<std::size_t>(g.layout.entry_of(p.index_in_group).offset) * psize,
                      static_cast<std::size_t>(p.info.numel), impl_->config.dtype,
                      p.info.name + ": weight view (window)");
}

void Engine::fetch_weights(const std::string& group) const {
  impl_->require_built_only("fetch_weights");
  const Group& g = impl_->group_named(group, "fetch_weights");
  impl_->await_update(g);
  if (!impl_->weights_on_host() || g.active) return;  // on the device already
  impl_->weight_windows->fetch(g, impl_->groups);
}

void Engine::release_weights(const std::string& group) const {
  impl_->require_built_only("release_weights");
  const Group& g = impl_->group_named(group, "release_weights");
  if (!impl_->weights_on_host() || g.active) return;
  impl_->weight_windows->release(g);
}

// ---- what every rank must hold alike (RankAgreement) ----

std::vector<std::uint64_t> Engine::Impl::declaration_entries() const {
  std::vector<std::uint64_t> out;
  out.reserve(params.size() + 1);
  out.push_back(fnv1a_words(
      kFnvOffset,
      {config.stage, static_cast<std::int64_t>(config.dtype),
       static_cast<std::int64_t>(config.grad_type()), static_cast<std::int64_t>(config.comm_type()),
       static_cast<std::int64_t>(config.alignment_bytes),
       static_cast<std::int64_t>(config.reduce_bucket_bytes),
       static_cast<std::int64_t>(config.order)}));
  for (const Param& p : params) {
    const ParamInfo& info = p.info;
    std::uint64_t h = fnv1a64(info.name.data(), info.name.size());
    h = fnv1a_words(h, {static_cast<std::int64_t>(info.name.size()),
                        static_cast<std::int64_t>(info.shape.size())});
    for (const auto extent : info.shape) h = fnv1a_words(h, {extent});
    h = fnv1a64(info.group.data(), info.group.size(), h);
    out.push_back(fnv1a_words(h, {static_cast<std::int64_t>(info.group.size())}));
  }
  return out;
}

std::string Engine::Impl::describe_declaration(std::size_t i) const {
  if (i == 0)
    return fmt::format(
        "EngineConfig{{stage {}, {} params, {} gradients, {} on the wire, alignment {} bytes, "
        "buckets of {} bytes, {} order}}",
        config.stage, dtype_name(config.dtype), dtype_name(config.grad_type()),
        dtype_name(config.comm_type()), config.alignment_bytes, config.reduce_bucket_bytes,
        config.order == LayoutOrder::declaration ? "declaration" : "round-robin");
  if (i > params.size()) return fmt::format("no param (it declared {})", params.size());
  const ParamInfo& info = params[i - 1].info;
  return fmt::format("param '{}' {} in group '{}'", info.name, shape_text(info.shape),
                     info.group);
}

std::string Engine::Impl::describe_hand_over(std::size_t i) const {
  const auto& log = reducer->hand_overs();
  if (i >= log.size())
    return fmt::format("nothing (it issued {} reduction{})", log.size(), log.size() == 1 ? "" : "s");
  const HandOver& h = log[i];
  const Group& g = groups[h.group];
  std::vector<std::string> names;
  for (const auto p : g.params) {
    const LayoutEntry& e = g.layout.entry_of(params[p].index_in_group);
    if (e.offset < h.end && e.offset + e.numel > h.begin) names.push_back(params[p].info.name);
  }
  std::string shown;
  for (std::size_t k = 0; k < names.size() && k < 3; ++k)
    shown += fmt::format("{}'{}'", k == 0 ? "" : ", ", names[k]);
  if (names.size() > 3) shown += fmt::format(" and {} more", names.size() - 3);
  return fmt::format("group '{}' elements [{}, {}) ({})", g.name, h.begin, h.end, shown);
}

void Engine::Impl::begin_side_update() {
  settle_update();  // one update beside the caller's work at a time
  update_marks.assign(groups.size(), 0);
  ops.begin_side();
}

void Engine::Impl::end_side_update() {
  try {
    update_end = ops.mark_side();
  } catch (...) {
    ops.end_side();
    throw;
  }
  ops.end_side();
}

void Engine::Impl::await_update(const Group& g) const {
  const auto i = static_cast<std::size_t>(&g - groups.data());
  if (i >= update_marks.size() || update_marks[i] == 0) return;
  ops.await_side(update_marks[i]);
  update_marks[i] = 0;  // awaited once is enough: the stream keeps the order
}

void Engine::Impl::settle_update() const {
  if (update_end == 0) return;
  ops.await_side(update_end);
  update_end = 0;
  update_marks.clear();
}

void Engine::Impl::hash_declarations() {
  declarations_hash = kFnvOffset;
  for (const auto e : declaration_entries())
    declarations_hash = fnv1a64(&e, sizeof e, declarations_hash);
}

void Engine::Impl::require_same_declarations(void* scratch, const char* caller,
                                             const char* outcome) {
  if (comm.world_size() == 1) return;
  RankAgreement agreement(comm, space, scratch);
  const auto entries = declaration_entries();
  const auto d = agreement.first_difference(
      entries, [&](std::size_t i) { return describe_declaration(i); });
  if (!d) return;
  throw CommError(fmt::format(
      "Engine::{}: the ranks declared different params: declaration {} is {} on rank 0 but {} on "
      "rank {}; every rank must make the same add_param calls in the same order with the same "
      "EngineConfig; {}",
      caller, d->index, d->at_rank0, d->at_rank, d->rank, outcome));
}

void Engine::Impl::require_same_hand_overs() {
  if (comm.world_size() == 1) return;
  // One all-reduce a step: the declarations (a re-form may have differed) and the reductions.
  std::vector<std::uint64_t> issued;
  issued.reserve(reducer->hand_overs().size());
  for (const HandOver& h : reducer->hand_overs()) {
    // By the group's name, not its index: ranks that re-formed alike in another order number
    // the same groups differently.
    const std::string& name = groups[h.group].name;
    issued.push_back(fnv1a_words(fnv1a64(name.data(), name.size()),
                                 {static_cast<std::int64_t>(name.size()), h.begin, h.end}));
  }
  std::uint64_t reduced = kFnvOffset;
  for (const auto e : issued) reduced = fnv1a64(&e, sizeof e, reduced);
  reduced = fnv1a_words(reduced, {static_cast<std::int64_t>(issued.size())});
  RankAgreement agreement(comm, space, scalars.data());
  const std::uint64_t both[2] = {declarations_hash, reduced};
  const auto same = agreement.same_everywhere(both);
  if (same[0] && same[1]) return;
  // Every rank saw the same verdict: all of them drop the gradients and throw.
  constexpr const char* kOutcome = "the step was not applied, the gradients were dropped";
  if (!same[0]) {
    reducer->clear(groups);
    require_same_declarations(scalars.data(), "step", kOutcome);
  }
  const auto d = agreement.first_difference(
      issued, [&](std::size_t i) { return describe_hand_over(i); });
  reducer->clear(groups);
  if (!d)  // the whole hashes differed, so some entry does: not reached
    throw CommError(fmt::format("Engine::step: the ranks disagree; {}", kOutcome));
  throw CommError(fmt::format(
      "Engine::step: the ranks handed gradients over differently, which would add one param's "
      "gradient to another's: reduction {} since the last step is of {} on rank 0 but of {} on "
      "rank {}; every rank must hand over the same params in the same order; {}",
      d->index + 1, d->at_rank0, d->at_rank, d->rank, kOutcome));
}

View Engine::Impl::grad_slot(const std::string& name, const char* caller) {
  require_built(caller);
  Param& p = param(name, caller);
  Group& g = groups[p.group];
  if (!g.active)
    throw StateError(fmt::format("Engine::{}: '{}' belongs to frozen group '{}'", caller, name,
                                 p.info.group));
  return reducer->slot(g, index_of(p), p);
}

View Engine::grad_slot(const std::string& name) {
  return impl_->grad_slot(name, "grad_slot");
}

void Engine::grad_ready(const std::string& name) {
  impl_->require_built("grad_ready");
  Param& p = impl_->param(name, "grad_ready");
  if (!impl_->reducer->mark_ready(impl_->index_of(p)))
    throw StateError(fmt::format("Engine::grad_ready: '{}' has no grad slot handed out", name));
}

void Engine::add_grad(const std::string& name, std::span<const float> grad) {
  impl_->require_built("add_grad");
  const Param& p = impl_->param(name, "add_grad");
  if (grad.size() != static_cast<std::size_t>(p.info.numel))
    throw ConfigError(fmt::format("Engine::add_grad: '{}' has {} elements, {} values given", name,
                                  p.info.numel, grad.size()));
  const View slot = impl_->grad_slot(name, "add_grad");
  if (impl_->space.device() == DeviceKind::host) {
    impl_->ops.accumulate(slot.raw(), slot.dtype(), grad.data(), DType::f32, grad.size());
  } else {
    // Host values reach the device through a bounded staging buffer, a chunk at a time.
    constexpr std::size_t kChunk = std::size_t{1} << 18;  // floats: 1 MiB
    const std::size_t chunk = std::min(kChunk, grad.size());
    Buffer staging = impl_->space.allocate(chunk * sizeof(float), Tag::other,
                                           fmt::format("add_grad staging ({})", name));
    auto* dst = static_cast<std::byte*>(slot.raw());
    const auto esize = dtype_size(slot.dtype());
    for (std::size_t at = 0; at < grad.size(); at += chunk) {
      const std::size_t n = std::min(chunk, grad.size() - at);
      impl_->space.upload(staging.data(), grad.data() + at, n * sizeof(float));
      impl_->ops.accumulate(dst + at * esize, slot.dtype(), staging.data(), DType::f32, n);
    }
    impl_->ops.synchronize();  // the staging buffer is released below
  }
  grad_ready(name);
}

void Engine::add_grad(const std::string& name, const void* grad, DType dtype, std::size_t count) {
  impl_->require_built("add_grad");
  const Param& p = impl_->param(name, "add_grad");
  if (count != static_cast<std::size_t>(p.info.numel))
    throw ConfigError(fmt::format("Engine::add_grad: '{}' has {} elements, {} values given", name,
                                  p.info.numel, count));
  if (dtype == DType::f64)
    throw ConfigError(fmt::format(
        "Engine::add_grad: '{}': fp64 gradients are not accepted (f32, bf16 or fp16)", name));
  if (grad == nullptr)
    throw ConfigError(fmt::format("Engine::add_grad: '{}': null gradient pointer", name));
  const View slot = impl_->grad_slot(name, "add_grad");
  impl_->ops.accumulate(slot.raw(), slot.dtype(), grad, dtype, count);
  grad_ready(name);
}

void Engine::finish_backward() {
  impl_->require_built("finish_backward");
  impl_->reducer->finish();
}

double Engine::sum_across_ranks(double value) {
  // Only the scalars buffer, which no update touches: a trainer's loss reduced right after
  // step() must not make its next forward wait for the whole update (overlap_update). With
  // ranks, the communicator's stream runs this after the update's all-gathers anyway.
  impl_->require_built_only("sum_across_ranks");
  // One rank: the sum is the value, and the host must not wait for the GPU to say so (a trainer
  // reducing its loss after step() would idle the GPU while it makes its next batch).
  if (impl_->comm.world_size() == 1) return value;
  void* scalar = impl_->scalars.data();
  impl_->space.upload(scalar, &value, sizeof value);
  impl_->comm.all_reduce(scalar, 1, DType::f64, ReduceOp::sum);
  impl_->space.download(&value, scalar, sizeof value);
  // After a timed-out collective was aborted the download returns whatever the buffer held:
  // the communicator says so here, before the value steers a step.
  impl_->comm.check();
  return value;
}

void Engine::Impl::update_group(Group& g, StepArgs args) {
  const DType dtype = config.dtype, grad_dtype = config.grad_type();
  const auto psize = dtype_size(dtype), gsize = dtype_size(grad_dtype);
  const auto slots = config.optimizer.state_slots();
  const std::size_t state_bytes = config.optimizer.state_bytes();
  for (const DecaySpan& span : decay_spans(g, params, param_weight_decay)) {
    const auto at = static_cast<std::size_t>(span.begin);
    args.weight_decay = span.weight_decay;
    if (state_on_host()) {
      update_on_host(g, args, span.begin, span.count);
      continue;
    }
    ShardTensors t;
    set_master(t, config.optimizer, g.master, at);
    t.state0 = g.state_at(0, slots, at, state_bytes);
    t.state1 = g.state_at(1, slots, at, state_bytes);
    t.grad = reducer->partition(g) + at * gsize;
    t.param = g.param16_at(g.shard.begin + span.begin, psize);
    t.dtype = dtype;
    t.grad_dtype = grad_dtype;
    t.count = static_cast<std::size_t>(span.count);
    t.state_dtype = config.optimizer.state_dtype;
    ops.update(config.optimizer, args, t);
  }
}

StepResult Engine::step() {
  impl_->require_built("step");
  finish_backward();
  const DType dtype = impl_->config.dtype;
  const auto psize = dtype_size(dtype);
  auto& groups = impl_->groups;
  impl_->reducer->reduce_for_step(groups);
  impl_->require_same_hand_overs();

  // Partitions now hold sums over ranks of loss-scaled micro-batch sums. One factor turns them
  // into the mean unscaled gradient; it is applied in registers, never to a stored copy.
  StepResult result;
  result.loss_scale = impl_->scaler.scale();
  const double unscale =
      1.0 / (result.loss_scale * impl_->comm.world_size() * impl_->config.gradient_accumulation_steps);
  double squares = impl_->gradient_squares(unscale);
  // One all-reduce gives both the norm and the overflow flag: Inf/NaN anywhere poisons the sum.
  squares = sum_across_ranks(squares);
  result.grad_norm = std::sqrt(squares);
  const bool overflow = !std::isfinite(squares);
  if (overflow && dtype == DType::bf16 && impl_->config.nonfinite == NonFinitePolicy::error) {
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
  // Every rank's updated shard to every rank: the group's full bit16 weights.
  const auto gather = [&](Group& g) {
    const auto shard = static_cast<std::size_t>(g.shard.numel());
    impl_->comm.all_gather(g.param16_at(g.shard.begin, psize), g.param16.data(), shard, dtype);
  };
  if (result.applied) {
    result.clip_coef = clip_coefficient(result.grad_norm, impl_->config.gradient_clipping);
    StepArgs args;
    args.lr = impl_->config.optimizer.lr;
    args.grad_scale = static_cast<float>(unscale * result.clip_coef);
    impl_->streaming.clear();  // nothing left from a step that failed part-way
    // With overlap_update, each group's update and all-gather go on the side stream and are
    // marked there, so the next forward waits for the groups it reads only (group order is the
    // forward's: the embedding first).
    const bool beside = impl_->config.overlap_update;
    if (beside) impl_->begin_side_update();
    try {
      for (auto& g : groups) {
        if (!g.active) continue;
        args.step = ++g.step;
        impl_->update_group(g, args);
        if (beside) {
          gather(g);
          impl_->update_marks[static_cast<std::size_t>(&g - groups.data())] =
              impl_->ops.mark_side();
        }
      }
      if (!beside) {
        impl_->flush_host_updates();
        for (auto& g : groups)
          if (g.active) gather(g);
      }
    } catch (...) {
      if (beside) impl_->end_side_update();
      throw;
    }
    if (beside) {
      impl_->reducer->clear(groups);  // on the side stream too: the update reads the gradients
      impl_->end_side_update();
      return result;
    }
  }
  zero_grad();
  return result;
}

void Engine::zero_grad() {
  impl_->require_built("zero_grad");
  impl_->reducer->clear(impl_->groups);
}

double Engine::loss_scale() const {
  return impl_->scaler.scale();
}

void Engine::set_lr(double lr) {
  if (!(lr >= 0.0) || !std::isfinite(lr))
    throw ConfigError(fmt::format("Engine::set_lr: learning rate {} must be finite and >= 0", lr));
  impl_->config.optimizer.lr = lr;
}

double Engine::lr() const {
  return impl_->config.optimizer.lr;
}

const EngineConfig& Engine::config() const {
  return impl_->config;
}

const Backend& Engine::backend() const {
  return impl_->backend;
}

MemorySpace& Engine::memory() const {
  return impl_->space;
}

MemoryStats Engine::memory_stats() const {
  return impl_->space.stats();
}

MemoryStats Engine::host_memory_stats() const {
  if (!impl_->host) {
    MemoryStats none;
    none.rank = impl_->comm.rank();
    return none;
  }
  return impl_->host->stats();
}

void Engine::reset_host_peaks() {
  if (impl_->host) impl_->host->reset_peaks();
}

std::string Engine::memory_report() const {
  std::string text = impl_->space.report_text();
  if (impl_->host) text += impl_->host->report_text();
  return text;
}

int Engine::rank() const {
  return impl_->comm.rank();
}

int Engine::world_size() const {
  return impl_->comm.world_size();
}

const std::vector<ParamInfo>& Engine::params() const {
  return impl_->infos;
}

std::vector<std::string> Engine::groups() const {
  return impl_->group_names;
}

std::int64_t Engine::group_step(const std::string& group) const {
  return impl_->group_named(group, "group_step").step;
}

const FlatLayout& EngineInternals::layout(const Engine& engine, const std::string& group) {
  return engine.impl_->group_named(group, "layout").layout;
}

void EngineInternals::require_none_pending(const Engine& engine, std::string_view who) {
  engine.impl_->require_none_pending(who);
}

std::vector<MasterPiece> Engine::master_pieces(const std::string& name) const {
  impl_->require_built("master_pieces");
  const Param& p = impl_->param(name, "master_pieces");
  const Group& g = impl_->groups[p.group];
  std::vector<MasterPiece> pieces;
  if (!g.active) return pieces;  // a frozen group has no master
  for (const auto& f : g.shard.fragments)
    if (f.param == p.index_in_group)
      pieces.push_back(MasterPiece{f.param_offset,
                                   impl_->master_values(g, g.master, f.shard_offset, f.count)});
  return pieces;
}

std::vector<float> Engine::read_weight(const std::string& name) const {
  impl_->require_built("read_weight");
  const Param& p = impl_->param(name, "read_weight");
  const View& w = p.weight;  // where the weights are kept: the device, or a home on the host
  std::vector<std::byte> raw(w.bytes());
  impl_->weight_space(impl_->groups[p.group]).download(raw.data(), w.raw(), raw.size());
  std::vector<float> out(w.count());
  cpu_device_ops().cast(out.data(), DType::f32, raw.data(), w.dtype(), out.size());
  return out;
}

}  // namespace shardswap
