// Group lifecycle: frozen <-> active, under drop / keep_host / keep_device, and switches of the
// active set. Each call is all-or-nothing: new buffers are made into locals and committed at the
// end; buffers are given back only after every check (Pins, pending gradients) has passed.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <set>

#include "engine/engine_impl.h"
#include "optimizer/master_split.h"
#include "support/quoted.h"

namespace shardswap {

DeactivatePolicy deactivate_policy_from_name(std::string_view name, std::string_view key) {
  if (name == "drop") return DeactivatePolicy::drop;
  if (name == "keep_host") return DeactivatePolicy::keep_host;
  if (name == "keep_device") return DeactivatePolicy::keep_device;
  throw ConfigError(fmt::format("{} = {}: expected drop, keep_host or keep_device", key, quote_value(name)));
}

const char* deactivate_policy_name(DeactivatePolicy policy) {
  switch (policy) {
    case DeactivatePolicy::drop:
      return "drop";
    case DeactivatePolicy::keep_host:
      return "keep_host";
    case DeactivatePolicy::keep_device:
      return "keep_device";
  }
  return "?";
}

Group& Engine::Impl::group_named(const std::string& group, const char* caller) {
  require_built(caller);
  for (auto& g : groups)
    if (g.name == group) return g;
  throw ConfigError(fmt::format("Engine::{}: no group named '{}'", caller, group));
}

void Engine::Impl::require_no_pending(const Group& g, const char* caller) const {
  const std::string what = reducer ? reducer->pending(g) : std::string();
  if (!what.empty())
    throw StateError(fmt::format(
        "Engine::{}: group '{}' has gradients pending ({}); call step() or zero_grad() first; "
        "nothing was changed",
        caller, g.name, what));
}

void Engine::Impl::require_none_pending(std::string_view who) const {
  std::string all;
  for (const auto& g : groups) {
    const std::string what = reducer ? reducer->pending(g) : std::string();
    if (!what.empty())
      all += fmt::format("{}group '{}' has gradients pending ({})", all.empty() ? "" : ", ",
                         g.name, what);
  }
  if (!all.empty())
    throw StateError(fmt::format(
        "{}: {}; call step() or zero_grad() first; nothing was changed", who, all));
}

std::string Engine::Impl::pins_on(const std::vector<const Buffer*>& buffers) {
  std::string held;
  for (const Buffer* b : buffers)
    if (b->valid())
      for (const auto& pin : b->pin_labels())
        held += fmt::format("{}'{}' on '{}'", held.empty() ? "" : ", ", pin, b->label());
  return held;
}

KeptState Engine::Impl::kept_on_host(MemorySpace& host, const Group& g,
                                     std::int64_t step) const {
  // Sized from the layout, not from live buffers: restore makes these for frozen groups too.
  const auto shard = static_cast<std::size_t>(g.shard.numel());
  const auto slots = static_cast<std::size_t>(config.optimizer.state_slots());
  KeptState k{DeactivatePolicy::keep_host, {}, {}, step};
  k.master =
      host.allocate(shard * config.optimizer.master_bytes(), Tag::master32, master_label(g, true));
  k.state = host.allocate(slots * shard * config.optimizer.state_bytes(), Tag::optim_state,
                          state_label(g, true));
  return k;
}

MemorySpace& Engine::Impl::host_space() {
  if (!host) host = std::make_unique<MemorySpace>(comm.rank(), host_allocator());
  return *host;
}

std::unique_ptr<Allocator> Engine::Impl::host_allocator() const {
  return config.pin_host_memory ? space.host_staging_allocator() : make_host_allocator();
}

MemorySpace* Engine::Impl::state_space(bool active, std::optional<DeactivatePolicy> kept) {
  if (!active && (!kept || *kept == DeactivatePolicy::drop)) return nullptr;
  if (state_on_host() || (!active && *kept == DeactivatePolicy::keep_host)) return &host_space();
  return &space;
}

const MemorySpace* Engine::Impl::state_space(const Group& g) const {
  if (!g.active && !g.kept) return nullptr;
  if (state_on_host() || (!g.active && g.kept->policy == DeactivatePolicy::keep_host))
    return host.get();
  return &space;
}

Buffer Engine::Impl::take_state(MemorySpace& where, std::size_t bytes, Tag tag,
                                std::string label) {
  if (&where == &space) return take(bytes, tag, std::move(label));
  return where.allocate(bytes, tag, std::move(label));
}

std::size_t Engine::Impl::give_up_state(Buffer& b, const std::string& event, ReleasePolicy pins) {
  if (state_on_host()) return b.release(event, pins);  // host blocks are not recycled
  return give_up(b, event, pins);
}

Buffer Engine::Impl::take_grad(const Group& g) {
  const auto bytes =
      static_cast<std::size_t>(reducer->grad_numel(g)) * dtype_size(config.grad_type());
  if (reducer->grads_on_host()) return host_space().allocate(bytes, Tag::grad, reducer->grad_label(g));
  return take(bytes, Tag::grad, reducer->grad_label(g));
}

void Engine::Impl::zero_grad_buffer(Buffer& grad) {
  if (!reducer->grads_on_host()) ops.fill_zero(grad.data(), grad.bytes());
}

std::size_t Engine::Impl::give_up_grad(Buffer& b, const std::string& event, ReleasePolicy pins) {
  if (reducer->grads_on_host()) return b.release(event, pins);  // host blocks are not recycled
  return give_up(b, event, pins);
}

std::string Engine::Impl::master_label(const Group& g, bool kept_on_host) const {
  return fmt::format("group {} master{}", g.name, kept_on_host ? " (kept on host)" : "");
}

std::string Engine::Impl::state_label(const Group& g, bool kept_on_host) const {
  if (kept_on_host) return fmt::format("group {} state (kept on host)", g.name);
  return fmt::format("group {} {} state", g.name, optimizer_type_name(config.optimizer.type));
}

Buffer Engine::Impl::take(std::size_t bytes, Tag tag, std::string label) {
  auto& pool = recycled;
  auto it = std::find_if(pool.begin(), pool.end(),
                         [&](const Buffer& b) { return b.bytes() == bytes && b.tag() == tag; });
  bytes_taken += static_cast<std::int64_t>(bytes);
  if (it == pool.end()) return space.allocate(bytes, tag, std::move(label));
  Buffer b = std::move(*it);
  pool.erase(it);
  b.relabel(std::move(label));
  return b;
}

std::size_t Engine::Impl::give_up(Buffer& b, const std::string& event, ReleasePolicy pins) {
  bytes_given_up += static_cast<std::int64_t>(b.bytes());
  if (recycling && b.pin_labels().empty()) {
    b.invalidate_views(event);  // its old owner's aliases die here, as on a release
    recycled.push_back(std::move(b));
    return 0;
  }
  return b.release(event, pins);
}

void Engine::Impl::register_weight_views(const Group& g, std::vector<Param>& ps, DType dtype) {
  const auto psize = dtype_size(dtype);
  for (auto i : g.params) {
    Param& p = ps[i];
    const auto& entry = g.layout.entry_of(p.index_in_group);
    p.weight = g.param16.view(static_cast<std::size_t>(entry.offset) * psize,
                              static_cast<std::size_t>(p.info.numel), dtype,
                              p.info.name + ": weight view");
  }
}

void Engine::Impl::weights_up(Group& g) {
  Buffer device = take(g.param16.bytes(), Tag::param16, fmt::format("group {} param16", g.name));
  space.upload(device.data(), g.param16.data(), g.param16.bytes());
  g.home = std::move(g.param16);  // its Views stay valid: nothing changed in it
  g.param16 = std::move(device);
}

std::size_t Engine::Impl::weights_down(Group& g, const std::string& event, ReleasePolicy pins) {
  space.download(g.home.data(), g.param16.data(), g.param16.bytes());
  const std::size_t held = give_up(g.param16, event, pins);
  g.param16 = std::move(g.home);
  return held;
}

void Engine::Impl::allocate_active_state(Group& g) {
  const DType dtype = config.dtype;
  const auto psize = dtype_size(dtype);
  const auto shard = static_cast<std::size_t>(g.shard.numel());
  Buffer grad = take_grad(g);
  zero_grad_buffer(grad);
  MemorySpace& where = *state_space(true, std::nullopt);
  // Kept state that lives where an active group's does (keep_device; anything kept with the
  // state on the host) is handed back: no copy, and nothing can fail past this point.
  const bool in_place = g.kept && state_space(false, g.kept->policy) == &where;
  Buffer master, state;
  std::int64_t step = 0;
  const auto slots = static_cast<std::size_t>(config.optimizer.state_slots());
  if (!in_place) {
    master = take_state(where, shard * config.optimizer.master_bytes(), Tag::master32,
                        master_label(g));
    state = take_state(where, slots * shard * config.optimizer.state_bytes(), Tag::optim_state,
                       state_label(g));
    if (g.kept) {  // keep_host with the state on the device: exact copies back
      space.upload(master.data(), g.kept->master.data(), master.bytes());
      space.upload(state.data(), g.kept->state.data(), state.bytes());
      step = g.kept->step;
    } else if (config.optimizer.master == MasterStorage::bf16_remainder) {
      // The master is the bf16 weight exactly: low halves of zero.
      const DeviceOps& at = &where == &space ? ops : cpu_device_ops();
      at.fill_zero(master.data(), master.bytes());
      at.fill_zero(state.data(), state.bytes());
    } else if (&where == &space) {
      ops.cast(master.data(), DType::f32, g.param16_at(g.shard.begin, psize), dtype, shard);
      ops.fill_zero(state.data(), state.bytes());
    } else {
      seed_master_on_host(g, master);
      cpu_device_ops().fill_zero(state.data(), state.bytes());
    }
  }
  // Commit.
  if (in_place) {
    master = std::move(g.kept->master);
    state = std::move(g.kept->state);
    master.relabel(master_label(g));
    state.relabel(state_label(g));
    step = g.kept->step;
  }
  g.kept.reset();  // keep_host copies go back to the host allocator here
  g.grad = std::move(grad);
  g.master = std::move(master);
  g.state = std::move(state);
  g.step = step;
  g.active = true;
  g.holds_grads = false;
  reducer->attach(g, params);
}

void Engine::activate(const std::string& group) {
  Group& g = impl_->group_named(group, "activate");
  impl_->settle_update();
  if (g.active)
    throw StateError(fmt::format("Engine::activate: group '{}' is already active", group));
  if (!impl_->weights_on_host()) {
    impl_->allocate_active_state(g);
    impl_->release_idle_host();
    return;
  }
  // Its weights come up from their home: the device copy is the one trained from here on.
  if (impl_->weight_windows->in_use(g))
    throw StateError(fmt::format(
        "Engine::activate: group '{}' has its weights fetched; release_weights first; nothing "
        "was changed",
        group));
  impl_->weights_up(g);
  try {
    impl_->allocate_active_state(g);
  } catch (...) {
    (void)impl_->give_up(g.param16, "activate failed", ReleasePolicy::allow_pinned);
    g.param16 = std::move(g.home);
    throw;
  }
  impl_->weight_windows->forget(g, fmt::format("activate({})", group));
  impl_->register_weight_views(g);
}

void Engine::Impl::release_idle_host() noexcept {
  // With the state or the weights there, it lives as the engine does.
  if (!host || state_on_host() || weights_on_host()) return;
  for (const auto& g : groups)
    if (g.kept && g.kept->policy == DeactivatePolicy::keep_host) return;
  // No live buffer is left in it. Blocks still held by Pins keep the allocator alive through
  // their storage until the Pins go.
  host.reset();
}

std::size_t Engine::deactivate(const std::string& group, DeactivatePolicy policy,
                               ReleasePolicy pins) {
  Group& g = impl_->group_named(group, "deactivate");
  impl_->settle_update();
  if (!g.active)
    throw StateError(fmt::format("Engine::deactivate: group '{}' is not active", group));
  impl_->require_no_pending(g, "deactivate");
  MemorySpace* const to = impl_->state_space(false, policy);
  // keep_device, and any kept state with the state on the host, stays where it is.
  const bool in_place = to == impl_->state_space(true, std::nullopt);
  // Check every Pin before changing anything.
  std::vector<const Buffer*> leaving{&g.grad};
  if (impl_->weights_on_host()) leaving.push_back(&g.param16);  // it goes to its home
  if (!in_place) {
    leaving.push_back(&g.master);
    leaving.push_back(&g.state);
  }
  if (pins == ReleasePolicy::fail_if_pinned) {
    const std::string held = Impl::pins_on(leaving);
    if (!held.empty())
      throw PinnedMemory(
          fmt::format("Engine::deactivate: group '{}' is held by Pins: {}; nothing "
                      "was changed",
                      group, held));
  }
  std::optional<KeptState> kept;
  if (to != nullptr && !in_place) {  // keep_host with the state on the device
    KeptState k = impl_->kept_on_host(*to, g, g.step);
    impl_->space.download(k.master.data(), g.master.data(), g.master.bytes());
    impl_->space.download(k.state.data(), g.state.data(), g.state.bytes());
    kept = std::move(k);
  }
  // Commit: nothing below can fail but the relabelling's string.
  const auto event = fmt::format("deactivate({}, {})", group, deactivate_policy_name(policy));
  std::size_t held = 0;
  impl_->reducer->detach(g);
  held += impl_->give_up_grad(g.grad, event, pins);
  if (in_place) {
    const bool on_host = to != &impl_->space;
    g.master.relabel(impl_->master_label(g, on_host));
    g.state.relabel(impl_->state_label(g, on_host));
    kept = KeptState{policy, std::move(g.master), std::move(g.state), g.step};
  } else {
    held += impl_->give_up_state(g.master, event, pins);
    held += impl_->give_up_state(g.state, event, pins);
  }
  if (impl_->weights_on_host()) {
    held += impl_->weights_down(g, event, pins);
    impl_->register_weight_views(g);
  }
  g.kept = std::move(kept);
  g.active = false;
  if (policy == DeactivatePolicy::drop) g.step = 0;
  return held;
}

SwitchReport Engine::set_active(const std::vector<std::string>& groups, DeactivatePolicy policy) {
  impl_->require_built("set_active");
  std::set<std::string> wanted;
  for (const auto& name : groups) {
    (void)impl_->group_named(name, "set_active");  // names are checked before anything changes
    wanted.insert(name);
  }
  for (const auto& g : impl_->groups)
    if (g.active && !wanted.count(g.name)) impl_->require_no_pending(g, "set_active");
  const auto started = std::chrono::steady_clock::now();
  SwitchReport report;
  impl_->bytes_given_up = impl_->bytes_taken = 0;
  impl_->recycling = true;
  std::string call;  // the lifecycle call in progress, for the error
  const auto cleanup = [&] {
    impl_->recycling = false;
    impl_->recycled.clear();  // released (Buffer destructor)
  };
  try {
    for (auto& g : impl_->groups)
      if (g.active && !wanted.count(g.name)) {
        call = fmt::format("deactivate('{}', {})", g.name, deactivate_policy_name(policy));
        deactivate(g.name, policy);
        report.deactivated.push_back(g.name);
      }
    for (auto& g : impl_->groups)
      if (!g.active && wanted.count(g.name)) {
        call = fmt::format("activate('{}')", g.name);
        activate(g.name);
        report.activated.push_back(g.name);
      }
  } catch (const Error& e) {
    cleanup();
    // The same error type, saying which call failed and what was done before it.
    const std::string what = fmt::format(
        "Engine::set_active: {} failed (deactivated so far: [{}], activated: [{}]): {}", call,
        fmt::join(report.deactivated, ", "), fmt::join(report.activated, ", "), e.what());
    if (dynamic_cast<const OutOfMemory*>(&e)) throw OutOfMemory(what);
    if (dynamic_cast<const PinnedMemory*>(&e)) throw PinnedMemory(what);
    if (dynamic_cast<const StateError*>(&e)) throw StateError(what);
    if (dynamic_cast<const ConfigError*>(&e)) throw ConfigError(what);
    if (dynamic_cast<const CommError*>(&e)) throw CommError(what);
    if (dynamic_cast<const DeviceError*>(&e)) throw DeviceError(what);
    throw;
  } catch (...) {
    cleanup();
    throw;
  }
  impl_->recycling = false;
  for (auto& b : impl_->recycled) b.release("set_active: not reused");
  impl_->recycled.clear();
  report.bytes_freed = impl_->bytes_given_up;
  report.bytes_allocated = impl_->bytes_taken;
  impl_->ops.synchronize();  // the time includes the device work the switch queued
  report.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  return report;
}

void Engine::reform(const std::vector<std::pair<std::string, std::string>>& moves) {
  impl_->require_built("reform");
  auto params = impl_->params;
  std::set<std::string> affected;
  std::vector<std::string> names = impl_->group_names;
  for (const auto& [param, group] : moves) {
    if (group.empty())
      throw ConfigError(fmt::format("Engine::reform: '{}' needs a group name", param));
    Param& p = impl_->param(param, "reform");
    Param& moved = params[static_cast<std::size_t>(&p - impl_->params.data())];
    affected.insert(moved.info.group);
    affected.insert(group);
    moved.info.group = group;
    if (std::find(names.begin(), names.end(), group) == names.end()) names.push_back(group);
  }
  for (const auto& g : impl_->groups)
    if (affected.count(g.name) && (g.active || g.kept))
      throw StateError(
          fmt::format("Engine::reform: group '{}' must be frozen with no kept state "
                      "(deactivate it with drop first)",
                      g.name));
  // Every group is rebuilt (and the reducer forgets them all): nothing may be pending anywhere.
  impl_->require_none_pending("Engine::reform");
  // The re-formed groups' weight buffers are released at the commit: a Pin on one must stop
  // the re-form now, before anything is allocated or rebound.
  std::vector<const Buffer*> replaced;
  for (const auto& g : impl_->groups)
    if (affected.count(g.name)) replaced.push_back(&g.param16);
  const std::string held = Impl::pins_on(replaced);
  if (!held.empty())
    throw PinnedMemory(
        fmt::format("Engine::reform: held by Pins: {}; nothing was changed", held));
  std::erase_if(names, [&](const std::string& n) {
    return std::none_of(params.begin(), params.end(),
                        [&](const Param& p) { return p.info.group == n; });
  });
  auto groups =
      plan_groups(impl_->config, names, params, impl_->weight_decay, impl_->comm.world_size(), impl_->comm.rank());
  const DType dtype = impl_->config.dtype;
  const auto psize = dtype_size(dtype);
  // Weights on the host: the changed groups are frozen, so their weights are homes, and a new
  // group must fit the windows build made.
  const bool homes = impl_->weights_on_host();
  if (homes) {
    const std::string in_use = impl_->weight_windows->in_use_names();
    if (!in_use.empty())
      throw StateError(fmt::format(
          "Engine::reform: weights of {} are fetched; release_weights first; nothing was changed",
          in_use));
    for (const auto& g : groups)
      if (affected.count(g.name) &&
          static_cast<std::size_t>(g.layout.total_numel()) * psize >
              impl_->weight_windows->bytes())
        throw ConfigError(fmt::format(
            "Engine::reform: group '{}' would hold {} bytes of weights, above the frozen weight "
            "windows' {} (the largest group at build()); nothing was changed",
            g.name, static_cast<std::size_t>(g.layout.total_numel()) * psize,
            impl_->weight_windows->bytes()));
  }
  MemorySpace& where = homes ? impl_->host_space() : impl_->space;
  const DeviceOps& at = homes ? cpu_device_ops() : impl_->ops;
  // New flat buffers for the changed groups, filled from the old ones in the same memory.
  for (auto& g : groups) {
    if (!affected.count(g.name)) continue;
    g.param16 = where.allocate(static_cast<std::size_t>(g.layout.total_numel()) * psize,
                               Tag::param16,
                               fmt::format("group {} param16{}", g.name, homes ? " (host)" : ""));
    at.fill_zero(g.param16.data(), g.param16.bytes());
    for (auto i : g.params) {
      const Param& old = impl_->params[i];
      const Group& from = impl_->groups[old.group];
      const auto& src = from.layout.entry_of(old.index_in_group);
      const auto& dst = g.layout.entry_of(params[i].index_in_group);
      at.copy(g.param16_at(dst.offset, psize), from.param16_at(src.offset, psize),
              static_cast<std::size_t>(old.info.numel) * psize);
    }
  }
  // Commit: unchanged groups keep their buffers, state and Views; nothing below can fail but
  // the Views' label allocations.
  if (homes) impl_->weight_windows->forget_all("groups re-formed");
  for (auto& g : groups) {
    if (affected.count(g.name)) {
      Impl::register_weight_views(g, params, dtype);
      continue;
    }
    for (auto& old : impl_->groups)
      if (old.name == g.name) {
        g.param16 = std::move(old.param16);
        g.home = std::move(old.home);
        g.grad = std::move(old.grad);
        g.master = std::move(old.master);
        g.state = std::move(old.state);
        g.step = old.step;
        g.active = old.active;
        g.holds_grads = false;  // nothing is pending (checked above)
        g.kept = std::move(old.kept);
      }
  }
  for (auto& old : impl_->groups)
    if (affected.count(old.name) && old.param16.valid())
      old.param16.release(fmt::format("re-form of group {}", old.name));
  impl_->reducer->forget_groups();  // it must not remember old Group addresses
  impl_->params = std::move(params);
  impl_->groups = std::move(groups);
  impl_->group_names = std::move(names);
  impl_->hash_declarations();  // params moved between groups: what step() compares changed
  for (std::size_t i = 0; i < impl_->params.size(); ++i)
    impl_->infos[i].group = impl_->params[i].info.group;
}

// ---- checkpoints ----

std::vector<float> Engine::Impl::master_values(const Group& g, const Buffer& master,
                                               std::int64_t at, std::int64_t count) const {
  const MemorySpace& from = *state_space(g);
  const auto n = static_cast<std::size_t>(count);
  std::vector<float> out(n);
  if (config.optimizer.master == MasterStorage::fp32) {
    from.download(out.data(), master.as<float>() + at, n * sizeof(float));
    return out;
  }
  std::vector<std::uint16_t> low(n), weight(n);
  from.download(low.data(), master.as<std::uint16_t>() + at, n * 2);
  weight_space(g).download(weight.data(), g.param16_at(g.shard.begin + at, 2), n * 2);
  for (std::size_t e = 0; e < n; ++e)
    out[e] = std::bit_cast<float>(detail::join_master(weight[e], low[e]));
  return out;
}

TrainingState Engine::training_state(bool with_weights) const {
  impl_->require_built("training_state");
  impl_->require_none_pending("Engine::training_state");
  TrainingState out;
  const auto slots = static_cast<std::size_t>(impl_->config.optimizer.state_slots());
  for (const auto& g : impl_->groups) {
    GroupTrainingState s;
    s.group = g.name;
    s.active = g.active;
    s.step = g.step;
    const Buffer* master = g.active ? &g.master : nullptr;
    const Buffer* state = g.active ? &g.state : nullptr;
    const MemorySpace* from = impl_->state_space(g);
    if (!g.active && g.kept) {
      s.kept = g.kept->policy;
      s.step = g.kept->step;
      master = &g.kept->master;
      state = &g.kept->state;
    }
    if (master != nullptr) {
      const auto shard = static_cast<std::size_t>(g.shard.numel());
      s.master = impl_->master_values(g, *master, 0, static_cast<std::int64_t>(shard));
      s.state.resize(slots * shard);
      const DType state_dtype = impl_->config.optimizer.state_dtype;
      if (!s.state.empty() && state_dtype == DType::f32) {
        from->download(s.state.data(), state->data(), s.state.size() * 4);
      } else if (!s.state.empty()) {  // widened to fp32 (exact)
        std::vector<std::byte> stored(state->bytes());
        from->download(stored.data(), state->data(), stored.size());
        cpu_device_ops().cast(s.state.data(), DType::f32, stored.data(), state_dtype,
                              s.state.size());
      }
    }
    out.groups.push_back(std::move(s));
  }
  out.scaler = impl_->scaler.state();
  out.lr = impl_->config.optimizer.lr;
  if (with_weights)
    for (const auto& p : impl_->params) {
      std::vector<std::byte> raw(p.weight.bytes());
      impl_->weight_space(impl_->groups[p.group]).download(raw.data(), p.weight.raw(), raw.size());
      out.weights.push_back(std::move(raw));
    }
  return out;
}

// Checks: nothing below them can meet bad input.
void Engine::Impl::check_restorable(const TrainingState& state, const char* fn) const {
  const auto slots = static_cast<std::size_t>(config.optimizer.state_slots());
  const auto psize = dtype_size(config.dtype);
  if (state.groups.size() != groups.size())
    throw ConfigError(fmt::format("{}: {} groups given, the engine has {}", fn,
                                  state.groups.size(), groups.size()));
  for (std::size_t i = 0; i < groups.size(); ++i) {
    const auto& s = state.groups[i];
    const Group& g = groups[i];
    if (s.group != g.name)
      throw ConfigError(fmt::format("{}: group {} is '{}' here, '{}' in the state", fn, i, g.name,
                                    s.group));
    if (s.active && s.kept)
      throw ConfigError(fmt::format("{}: group '{}' is both active and kept", fn, g.name));
    if (s.kept == DeactivatePolicy::drop)
      throw ConfigError(fmt::format("{}: group '{}' is kept under drop", fn, g.name));
    const bool holds = s.active || s.kept;
    const auto shard = static_cast<std::size_t>(g.shard.numel());
    if (s.master.size() != (holds ? shard : 0) || s.state.size() != (holds ? slots * shard : 0))
      throw ConfigError(fmt::format(
          "{}: group '{}': {} master and {} optimizer-state values given, this rank's shard "
          "needs {} and {}",
          fn, g.name, s.master.size(), s.state.size(), holds ? shard : 0,
          holds ? slots * shard : 0));
    if (s.step < 0 || (!holds && s.step != 0))
      throw ConfigError(fmt::format("{}: group '{}': step {} does not fit its state", fn, g.name,
                                    s.step));
  }
  if (state.weights.size() != params.size())
    throw ConfigError(fmt::format("{}: {} weight arrays given for {} params", fn,
                                  state.weights.size(), params.size()));
  for (std::size_t i = 0; i < params.size(); ++i)
    if (state.weights[i].size() != static_cast<std::size_t>(params[i].info.numel) * psize)
      throw ConfigError(fmt::format("{}: '{}': {} weight bytes given, {} needed", fn,
                                    params[i].info.name, state.weights[i].size(),
                                    params[i].info.numel * static_cast<std::int64_t>(psize)));
  if (!(state.lr >= 0.0) || !std::isfinite(state.lr))
    throw ConfigError(fmt::format("{}: learning rate {} must be finite and >= 0", fn, state.lr));
  LossScaler check = scaler;  // validates the scaler state without changing ours
  check.restore(state.scaler);
}

// Buffers: a group's master and state are reused when it has them now and needs them after in
// the same memory (active, or kept where they are), its gradients when it stays active;
// anything else is allocated here, into the plan, so that a failure changes nothing.
Engine::Impl::RestorePlan Engine::Impl::plan_restore(const TrainingState& state) {
  const auto slots = static_cast<std::size_t>(config.optimizer.state_slots());
  RestorePlan plan;
  plan.groups.resize(groups.size());
  MemorySpace* host_now = host.get();
  for (std::size_t i = 0; i < groups.size(); ++i) {
    const auto& s = state.groups[i];
    Group& g = groups[i];
    GroupRestore& p = plan.groups[i];
    const auto shard = static_cast<std::size_t>(g.shard.numel());
    const MemorySpace* now = state_space(g);
    const bool holds = s.active || s.kept;
    const bool wants_host =
        holds && (state_on_host() || (!s.active && s.kept == DeactivatePolicy::keep_host));
    if (wants_host && host_now == nullptr) {
      plan.new_host = std::make_unique<MemorySpace>(comm.rank(), host_allocator());
      host_now = plan.new_host.get();
    }
    p.to = !holds ? nullptr : wants_host ? host_now : &space;
    p.reuse_grad = g.active && s.active;
    p.reuse_state = p.to != nullptr && now == p.to;
    if (s.active && !p.reuse_grad)
      p.grad = take_grad(g);
    if (p.to != nullptr && !p.reuse_state) {
      const bool kept_on_host = !s.active && wants_host;
      p.master = take_state(*p.to, shard * config.optimizer.master_bytes(), Tag::master32,
                            master_label(g, kept_on_host));
      p.state = take_state(*p.to, slots * shard * config.optimizer.state_bytes(),
                           Tag::optim_state, state_label(g, kept_on_host));
    }
    if (p.to != nullptr && config.optimizer.master == MasterStorage::bf16_remainder) {
      p.master_low.resize(s.master.size());
      p.master_weight.resize(s.master.size());
      for (std::size_t e = 0; e < s.master.size(); ++e) {
        const detail::MasterHalves h =
            detail::split_master(std::bit_cast<std::uint32_t>(s.master[e]));
        p.master_low[e] = h.low;
        p.master_weight[e] = h.weight;
      }
    }
    if (p.to != nullptr && config.optimizer.state_dtype != DType::f32 && !s.state.empty()) {
      p.state_values.resize(s.state.size() * config.optimizer.state_bytes());
      cpu_device_ops().cast(p.state_values.data(), config.optimizer.state_dtype, s.state.data(),
                            DType::f32, s.state.size());
    }
    if (g.active && !p.reuse_grad) p.freed.push_back(&g.grad);
    if (now != nullptr && !p.reuse_state) {
      p.freed.push_back(g.active ? &g.master : &g.kept->master);
      p.freed.push_back(g.active ? &g.state : &g.kept->state);
    }
    if (weights_on_host() && s.active && !g.active) {  // up from its home
      p.param16 = take(g.param16.bytes(), Tag::param16, fmt::format("group {} param16", g.name));
      space.upload(p.param16.data(), g.param16.data(), g.param16.bytes());
    }
    if (weights_on_host() && !s.active && g.active) p.freed.push_back(&g.param16);  // to its home
  }
  return plan;
}

// Commit: copies into buffers that exist, and moves; nothing here meets bad input.
void Engine::Impl::commit_restore(const TrainingState& state, RestorePlan& plan) {
  if (plan.new_host) host = std::move(plan.new_host);
  const auto event = std::string("restore_training_state");
  for (std::size_t i = 0; i < groups.size(); ++i) {
    const auto& s = state.groups[i];
    Group& g = groups[i];
    GroupRestore& p = plan.groups[i];
    Buffer master, sstate, grad;
    if (p.reuse_state) {
      master = g.active ? std::move(g.master) : std::move(g.kept->master);
      sstate = g.active ? std::move(g.state) : std::move(g.kept->state);
      const bool kept_on_host = !s.active && p.to != &space;
      master.relabel(master_label(g, kept_on_host));
      sstate.relabel(state_label(g, kept_on_host));
    } else {
      master = std::move(p.master);
      sstate = std::move(p.state);
    }
    if (p.reuse_grad) grad = std::move(g.grad);
    else grad = std::move(p.grad);
    if (g.active) reducer->detach(g);
    if (weights_on_host() && s.active != g.active) {  // the weights change places
      if (s.active) {
        g.home = std::move(g.param16);
        g.param16 = std::move(p.param16);
      } else {
        (void)give_up(g.param16, event, ReleasePolicy::fail_if_pinned);  // checked above
        g.param16 = std::move(g.home);
      }
      register_weight_views(g);
    }
    // What is left in the group now is given back.
    if (g.grad.valid()) give_up_grad(g.grad, event, ReleasePolicy::fail_if_pinned);  // checked above
    for (Buffer* b : {&g.master, &g.state})
      if (b->valid()) give_up_state(*b, event, ReleasePolicy::fail_if_pinned);
    g.kept.reset();
    if (!p.master_low.empty())
      p.to->upload(master.data(), p.master_low.data(), p.master_low.size() * 2);
    else if (p.to != nullptr)
      p.to->upload(master.data(), s.master.data(), s.master.size() * 4);
    if (p.to != nullptr) {
      if (!p.state_values.empty())
        p.to->upload(sstate.data(), p.state_values.data(), p.state_values.size());
      else if (!s.state.empty())
        p.to->upload(sstate.data(), s.state.data(), s.state.size() * 4);
    }
    if (s.active) {
      zero_grad_buffer(grad);
      g.grad = std::move(grad);
      g.master = std::move(master);
      g.state = std::move(sstate);
    } else if (s.kept) {
      g.kept = KeptState{*s.kept, std::move(master), std::move(sstate), s.step};
    }
    g.active = s.active;
    g.step = s.step;  // a kept group keeps its count too, as deactivate leaves it
    if (g.active) reducer->attach(g, params);
  }
  for (std::size_t i = 0; i < params.size(); ++i)
    weight_space(groups[params[i].group])
        .upload(params[i].weight.raw(), state.weights[i].data(), state.weights[i].size());
  // A master kept as low halves is the bf16 weight's too: the shard's weights are the masters'
  // high halves (the same as the weights saved beside them unless saved under fp32 masters,
  // where a tie rounded to even differs), written after the weights.
  for (std::size_t i = 0; i < groups.size(); ++i)
    if (!plan.groups[i].master_weight.empty())
      weight_space(groups[i]).upload(groups[i].param16_at(groups[i].shard.begin, 2), plan.groups[i].master_weight.data(),
                   plan.groups[i].master_weight.size() * 2);
  scaler.restore(state.scaler);
  config.optimizer.lr = state.lr;
  release_idle_host();
}

void Engine::restore_training_state(const TrainingState& state) {
  impl_->require_built("restore_training_state");
  const char* const fn = "Engine::restore_training_state";
  impl_->require_none_pending("Engine::restore_training_state");
  impl_->check_restorable(state, fn);
  if (impl_->weights_on_host()) {
    const std::string in_use = impl_->weight_windows->in_use_names();
    if (!in_use.empty())
      throw StateError(fmt::format(
          "{}: weights of {} are fetched; release_weights first; nothing was changed", fn, in_use));
  }
  Impl::RestorePlan plan = impl_->plan_restore(state);
  std::vector<const Buffer*> freed;
  for (const auto& p : plan.groups) freed.insert(freed.end(), p.freed.begin(), p.freed.end());
  const std::string held = Impl::pins_on(freed);
  if (!held.empty())
    throw PinnedMemory(fmt::format("{}: held by Pins: {}; nothing was changed", fn, held));
  if (impl_->weights_on_host()) impl_->weight_windows->forget_all(fn);  // the homes change
  impl_->commit_restore(state, plan);
}

View Engine::master(const std::string& group) const {
  Group& g = impl_->group_named(group, "master");
  impl_->settle_update();
  if (impl_->config.optimizer.master == MasterStorage::bf16_remainder)
    throw StateError(fmt::format(
        "Engine::master: group '{}': the master is kept as the bf16 weights and their low 16 bits "
        "(shardswap.master_weights = bf16_remainder), not as fp32 values: read it with "
        "master_pieces()",
        group));
  if (!g.active)
    throw StateError(fmt::format("Engine::master: group '{}' is frozen: it has no master", group));
  return g.master.view(0, static_cast<std::size_t>(g.shard.numel()), DType::f32,
                       fmt::format("group {} master shard", group));
}

bool Engine::is_active(const std::string& group) const {
  return impl_->group_named(group, "is_active").active;
}

std::vector<std::string> Engine::active_groups() const {
  std::vector<std::string> out;
  for (const auto& g : impl_->groups)
    if (g.active) out.push_back(g.name);
  return out;
}

}  // namespace shardswap
