// Loading a checkpoint (format in docs/checkpoints.md): every rank reads and verifies every file
// (so every rank fails the same way on bad input), keeps the pieces that fall in its own shard at
// the current world size, and only then hands the engine one TrainingState to restore. Also the
// tensors of a checkpoint as saved (read_checkpoint_tensors: inspect, export).
#include "engine/checkpoint_format.h"
#include "engine/checkpoint_steps.h"
#include "engine/engine_internals.h"
#include "optimizer/optimizer.h"

#include <fmt/ranges.h>

#include <map>

#include "partition/flat_layout.h"

namespace shardswap {

using namespace checkpoint_detail;

namespace {

// Reads and verifies every rank file of the checkpoint, calling `piece` for each piece with its
// param, first element, count and values ((1 + slots) x count floats: master, then each slot),
// and checks that the pieces of every param whose group holds state cover it exactly once.
void read_pieces(const fs::path& dir, const json& meta, const std::vector<SavedParam>& params,
                 const std::function<void(std::size_t param, std::int64_t begin,
                                          std::int64_t count, const float* values)>& piece) {
  const fs::path meta_file = dir / kMetadataName;
  const int world = field<int>(meta, "world_size", meta_file);
  const int slots = field<int>(meta, "state_slots", meta_file);
  if (world < 1 || slots < 0 || slots > 2)
    throw ConfigError(fmt::format("'{}': world_size {} or state_slots {} out of range",
                                  meta_file.string(), world, slots));
  std::map<std::string, std::size_t> index;
  for (std::size_t i = 0; i < params.size(); ++i) index[params[i].name] = i;
  std::vector<std::vector<std::pair<std::int64_t, std::int64_t>>> covered(params.size());
  for (int r = 0; r < world; ++r) {
    const auto name = rank_file_name(r, world);
    const BinaryFile f = read_binary(dir, name, meta);
    try {
      if (f.header.at("kind") != "rank" || f.header.at("rank") != r ||
          f.header.at("world_size") != world || f.header.at("state_slots") != slots)
        throw ConfigError("its header does not match its name and the metadata");
      for (const auto& p : f.header.at("pieces")) {
        const auto pname = p.at("param").get<std::string>();
        const auto begin = p.at("begin").get<std::int64_t>();
        const auto count = p.at("count").get<std::int64_t>();
        const auto offset = p.at("offset").get<std::int64_t>();
        auto it = index.find(pname);
        if (it == index.end())
          throw ConfigError(fmt::format("a piece of '{}', which the metadata does not declare",
                                        pname));
        const SavedParam& sp = params[it->second];
        if (!sp.holds_state)
          throw ConfigError(fmt::format("a piece of '{}', whose group '{}' holds no state", pname,
                                        sp.group));
        if (begin < 0 || count < 1 || begin + count > sp.numel)
          throw ConfigError(fmt::format("piece [{}, {}) of '{}' lies outside its {} elements",
                                        begin, begin + count, pname, sp.numel));
        const auto* values = f.at(offset, (1 + slots) * count * 4,
                                  fmt::format("piece [{}, {}) of '{}'", begin, begin + count,
                                              pname));
        covered[it->second].emplace_back(begin, begin + count);
        // The header's length is arbitrary, so the values need not be aligned for floats.
        std::vector<float> aligned(static_cast<std::size_t>((1 + slots) * count));
        std::memcpy(aligned.data(), values, aligned.size() * 4);
        piece(it->second, begin, count, aligned.data());
      }
    } catch (const json::exception& e) {
      throw ConfigError(fmt::format("'{}': bad header: {}", f.path.string(), e.what()));
    } catch (const ConfigError& e) {
      if (std::string_view(e.what()).find(f.path.string()) != std::string_view::npos) throw;
      throw ConfigError(fmt::format("'{}': {}", f.path.string(), e.what()));
    }
  }
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (!params[i].holds_state) continue;
    auto& ranges = covered[i];
    std::sort(ranges.begin(), ranges.end());
    std::int64_t next = 0;
    for (const auto& [b, e] : ranges) {
      if (b != next) break;
      next = e;
    }
    if (next != params[i].numel || ranges.empty() || ranges.back().second != params[i].numel)
      throw ConfigError(fmt::format(
          "checkpoint '{}': the rank files' pieces of '{}' do not cover its {} elements exactly "
          "once",
          dir.string(), params[i].name, params[i].numel));
  }
}

struct Weights {
  DType dtype = DType::bf16;
  std::vector<std::vector<std::byte>> raw;  // per saved param
};

Weights read_weights(const fs::path& dir, const json& meta, const std::vector<SavedParam>& params) {
  const fs::path meta_file = dir / kMetadataName;
  Weights w;
  w.dtype = dtype_from_name(field<std::string>(meta, "dtype", meta_file),
                            (meta_file.string() + " dtype"));
  const BinaryFile f = read_binary(dir, kWeightsName, meta);
  try {
    if (f.header.at("kind") != "weights" || f.header.at("dtype") != dtype_name(w.dtype))
      throw ConfigError("its header does not match the metadata");
    const auto& entries = f.header.at("params");
    if (entries.size() != params.size())
      throw ConfigError(fmt::format("{} params, the metadata declares {}", entries.size(),
                                    params.size()));
    for (std::size_t i = 0; i < params.size(); ++i) {
      const auto& e = entries[i];
      const auto bytes = params[i].numel * static_cast<std::int64_t>(dtype_size(w.dtype));
      if (e.at("name") != params[i].name || e.at("bytes") != bytes)
        throw ConfigError(fmt::format("entry {} is not '{}' of {} bytes", i, params[i].name, bytes));
      const auto* p = f.at(e.at("offset").get<std::int64_t>(), bytes, params[i].name);
      w.raw.emplace_back(p, p + bytes);
    }
  } catch (const json::exception& e) {
    throw ConfigError(fmt::format("'{}': bad header: {}", f.path.string(), e.what()));
  } catch (const ConfigError& e) {
    if (std::string_view(e.what()).find(f.path.string()) != std::string_view::npos) throw;
    throw ConfigError(fmt::format("'{}': {}", f.path.string(), e.what()));
  }
  return w;
}

[[noreturn]] void different_model(const fs::path& meta_file, const char* what,
                                  const std::string& saved, const std::string& here) {
  throw ConfigError(fmt::format("load_checkpoint: '{}' is a checkpoint of a different model: "
                                "{} '{}' saved, '{}' here",
                                meta_file.string(), what, saved, here));
}

// Throws unless what the checkpoint saved is what this engine has here.
void require_same(const fs::path& meta_file, const char* what, const std::string& saved,
                  const std::string& here) {
  if (saved != here) different_model(meta_file, what, saved, here);
}

// The checkpoint's params, checked to be this engine's model: bit16 type, optimizer, params (name,
// shape, group, in order) and optimizer state slots.
std::vector<SavedParam> same_model_params(const Engine& engine, const json& meta,
                                          const fs::path& meta_file) {
  const auto& config = engine.config();
  const auto differs = [&](const char* what, const std::string& saved, const std::string& here) {
    require_same(meta_file, what, saved, here);
  };
  differs("bit16 type", field<std::string>(meta, "dtype", meta_file), dtype_name(config.dtype));
  differs("optimizer", field<std::string>(meta, "optimizer", meta_file),
          optimizer_type_name(config.optimizer.type));
  auto params = saved_params(meta, meta_file);
  const auto& mine = engine.params();
  differs("param count", std::to_string(params.size()), std::to_string(mine.size()));
  for (std::size_t i = 0; i < params.size(); ++i) {
    const auto label = fmt::format("param {}", i);
    differs(label.c_str(),
            fmt::format("{} {} in {}", params[i].name, fmt::join(params[i].shape, "x"),
                        params[i].group),
            fmt::format("{} {} in {}", mine[i].name, fmt::join(mine[i].shape, "x"), mine[i].group));
  }
  differs("optimizer state slots", std::to_string(field<int>(meta, "state_slots", meta_file)),
          std::to_string(config.optimizer.state_slots()));
  return params;
}

// Everything this rank's engine needs from the checkpoint, verified against its declarations.
TrainingState read_state_for(const Engine& engine, const fs::path& dir, LoadedCheckpoint& out) {
  const json meta = read_checkpoint_metadata(dir);
  const fs::path meta_file = dir / kMetadataName;
  const auto params = same_model_params(engine, meta, meta_file);
  const auto& mine = engine.params();
  const int slots = engine.config().optimizer.state_slots();

  // This rank's shard of each group at the current world size, and where each of its params'
  // fragments lands.
  const int rank = engine.rank();
  TrainingState state;
  struct Target {
    std::size_t group;
    std::int64_t param_offset, shard_offset, count;
  };
  std::vector<std::vector<Target>> targets(mine.size());
  std::map<std::string, std::size_t> param_index;
  for (std::size_t i = 0; i < mine.size(); ++i) param_index[mine[i].name] = i;
  std::map<std::string, json> saved_groups;
  for (const auto& g : field<json>(meta, "groups", meta_file))
    saved_groups[field<std::string>(g, "name", meta_file)] = g;
  std::vector<std::int64_t> shard_numel;
  for (const auto& name : engine.groups()) {
    auto it = saved_groups.find(name);
    // (Not require_same: a group may be named "(none)".)
    if (it == saved_groups.end()) different_model(meta_file, "group", "(none)", name);
    GroupTrainingState s;
    s.group = name;
    const auto holding = field<std::string>(it->second, "state", meta_file);
    s.step = field<std::int64_t>(it->second, "step", meta_file);
    if (holding == "active") {
      s.active = true;
    } else if (holding == "keep_host" || holding == "keep_device") {
      s.kept = deactivate_policy_from_name(holding, meta_file.string() + " groups.state");
    } else if (holding != "none") {
      throw ConfigError(fmt::format("'{}': group '{}' has state '{}'", meta_file.string(), name,
                                    holding));
    }
    const Shard shard = Shard::of(EngineInternals::layout(engine, name), rank);
    if (s.active || s.kept) {
      s.master.assign(static_cast<std::size_t>(shard.numel()), 0.0f);
      s.state.assign(static_cast<std::size_t>(slots * shard.numel()), 0.0f);
      const auto members = params_of(engine, name);
      for (const auto& f : shard.fragments)
        targets[param_index.at(members[f.param]->name)].push_back(
            {state.groups.size(), f.param_offset, f.shard_offset, f.count});
    }
    shard_numel.push_back(shard.numel());
    state.groups.push_back(std::move(s));
  }
  if (saved_groups.size() != state.groups.size())
    require_same(meta_file, "group count", std::to_string(saved_groups.size()),
                 std::to_string(state.groups.size()));

  read_pieces(dir, meta, params, [&](std::size_t param, std::int64_t begin, std::int64_t count,
                                     const float* values) {
    for (const auto& t : targets[param]) {
      const std::int64_t lo = std::max(begin, t.param_offset);
      const std::int64_t hi = std::min(begin + count, t.param_offset + t.count);
      if (lo >= hi) continue;
      auto& g = state.groups[t.group];
      const std::int64_t shard = shard_numel[t.group];
      const std::int64_t to = t.shard_offset + (lo - t.param_offset);
      std::memcpy(g.master.data() + to, values + (lo - begin), (hi - lo) * 4);
      for (int k = 0; k < slots; ++k)
        std::memcpy(g.state.data() + k * shard + to, values + (1 + k) * count + (lo - begin),
                    (hi - lo) * 4);
    }
  });
  state.weights = read_weights(dir, meta, params).raw;
  const json& scaler = field<json>(meta, "loss_scaler", meta_file);
  state.scaler.scale = field<double>(scaler, "scale", meta_file);
  state.scaler.clean_steps = field<std::int64_t>(scaler, "clean_steps", meta_file);
  state.scaler.hysteresis_left = field<int>(scaler, "hysteresis_left", meta_file);
  state.lr = field<double>(meta, "lr", meta_file);
  try {
    out.extra = decode_byte_strings(field<json>(meta, "extra", meta_file));
  } catch (const ConfigError& e) {
    throw ConfigError(fmt::format("'{}': extra: {}", meta_file.string(), e.what()));
  }
  out.world_size = field<int>(meta, "world_size", meta_file);
  out.save_id = field<std::string>(meta, "save_id", meta_file);
  out.run_id = field<std::string>(meta, "run_id", meta_file);
  out.save_sequence = field<std::int64_t>(meta, "save_sequence", meta_file);
  return state;
}

}  // namespace

LoadedCheckpoint load_checkpoint(Engine& engine, const fs::path& dir_in) {
  LoadedCheckpoint out;
  TrainingState state;
  std::exception_ptr error;
  attempt(error, [&] {
    EngineInternals::require_none_pending(engine, "load_checkpoint");
    const fs::path dir = normalized(dir_in, "load_checkpoint");
    try {
      state = read_state_for(engine, dir, out);
    } catch (const ConfigError& e) {
      if (std::string_view(e.what()).starts_with("load_checkpoint")) throw;
      throw ConfigError(fmt::format("load_checkpoint: {}", e.what()));
    }
  });
  agree(engine, error, "load_checkpoint");
  engine.restore_training_state(state);
  return out;
}

std::vector<CheckpointTensor> read_checkpoint_tensors(const fs::path& dir, bool master) {
  const json meta = read_checkpoint_metadata(dir);
  const auto params = saved_params(meta, dir / kMetadataName);
  const Weights weights = read_weights(dir, meta, params);
  std::vector<CheckpointTensor> out;
  for (std::size_t i = 0; i < params.size(); ++i) {
    CheckpointTensor t{params[i].name, params[i].shape, weights.dtype, weights.raw[i]};
    if (master) {
      // Widened bit16 weights, overwritten below by the saved masters where a group has them.
      t.dtype = DType::f32;
      t.data.resize(static_cast<std::size_t>(params[i].numel) * 4);
      cpu_device_ops().cast(t.data.data(), DType::f32, weights.raw[i].data(), weights.dtype,
                         static_cast<std::size_t>(params[i].numel));
    }
    out.push_back(std::move(t));
  }
  if (master)
    read_pieces(dir, meta, params,
                [&](std::size_t param, std::int64_t begin, std::int64_t count,
                    const float* values) {
                  std::memcpy(out[param].data.data() + begin * 4, values, count * 4);
                });
  else
    read_pieces(dir, meta, params, [](std::size_t, std::int64_t, std::int64_t, const float*) {});
  return out;
}

}  // namespace shardswap
