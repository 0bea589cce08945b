// Saving a checkpoint (format in docs/checkpoints.md): every rank writes its file into a
// temporary directory, the ranks agree that all succeeded, rank 0 writes the metadata and renames
// the directory into place. The policy on the directory it keeps: engine/checkpoint_scan.cpp.
#include "engine/checkpoint_format.h"
#include "engine/checkpoint_steps.h"
#include "engine/engine_internals.h"
#include "optimizer/optimizer.h"
#include "support/durable_file.h"

#include <random>

#include "partition/flat_layout.h"

#ifndef SHARDSWAP_VERSION
#define SHARDSWAP_VERSION "unknown"
#endif

namespace shardswap {

using namespace checkpoint_detail;

namespace {

// Runs `body` writing `path`; any failure becomes an Error naming the file.
template <class F>
void writing(const fs::path& path, F&& body) {
  try {
    body();
  } catch (const std::exception& e) {
    throw Error(fmt::format("save_checkpoint: writing '{}': {}", path.string(), e.what()));
  }
}

const char* holding_name(const GroupTrainingState& s) {
  if (s.active) return "active";
  if (s.kept) return deactivate_policy_name(*s.kept);
  return "none";
}

// A value only rank 0 knows, given to every rank (exactly: below 2^53, and the others add 0).
std::uint64_t from_rank0(Engine& engine, std::uint64_t value) {
  return static_cast<std::uint64_t>(
      engine.sum_across_ranks(engine.rank() == 0 ? static_cast<double>(value) : 0.0));
}

bool written_by(const fs::path& dir, const std::string& run_id) {
  try {
    return read_checkpoint_metadata(dir).at("run_id") == run_id;
  } catch (const ConfigError&) {
    return false;
  }
}

// Where a save asked for `asked` goes: `asked`, unless a run id is given and `asked` holds
// anything but a checkpoint of that run; then `asked`-<the run id's first 8 digits>, which must be
// free or the run's own. Leftovers of interrupted saves of a name are recovered before it is
// judged, so that the complete copy decides (and is never deleted).
fs::path save_target(const fs::path& asked, const std::string& run_id) {
  std::vector<std::string> actions;
  recover_name(asked, actions);
  const auto free_or_own = [&](const fs::path& dir) {
    return !fs::exists(fs::symlink_status(dir)) || run_id.empty() || written_by(dir, run_id);
  };
  if (free_or_own(asked)) return asked;
  const fs::path own = sibling(asked, "-" + run_id.substr(0, 8));
  recover_name(own, actions);
  if (free_or_own(own)) return own;
  throw Error(
      fmt::format("'{}' and '{}' both hold something other than a checkpoint of run {}: "
                  "refusing to replace either",
                  asked.string(), own.string(), run_id));
}

std::int64_t next_save_sequence(const fs::path& root) {
  std::int64_t highest = 0;
  for (const auto& c : scan_checkpoints(root).complete)
    highest = std::max(highest, c.save_sequence);
  return highest + 1;
}

// What load would refuse is refused before anything is written.
void check_save_options(const SaveOptions& options) {
  if (!options.extra.is_object())
    throw ConfigError("save_checkpoint: SaveOptions::extra must be a JSON object");
  // The values are checked before encode_byte_strings walks them (recursively) and again as they
  // would be stored.
  for (const auto& [name, value] : {std::pair<const char*, const json*>{"extra", &options.extra},
                                    {"config", &options.config}}) {
    constexpr std::size_t kStoredDepth = kMaxMetadataDepth - 2;  // below the outer and metadata
    auto deep = json_deeper_than(*value, kStoredDepth);
    if (!deep) deep = json_deeper_than(encode_byte_strings(*value), kStoredDepth);
    if (deep)
      throw ConfigError(fmt::format(
          "save_checkpoint: SaveOptions::{}: {}: nested deeper than {} levels of objects and "
          "lists (as stored), the most a checkpoint's metadata holds there",
          name, json_path_text(*deep), kStoredDepth));
  }
  if (!options.run_id.empty() && (options.run_id.size() < 8 || !is_lower_hex(options.run_id)))
    throw ConfigError(
        fmt::format("save_checkpoint: SaveOptions::run_id '{}' must be empty or at "
                    "least 8 lowercase hex digits (new_random_id())",
                    options.run_id));
}

// Where a save writes, the same on every rank: rank 0's choice.
struct SaveTarget {
  fs::path dir;               // the checkpoint's name: the one asked, or the run's suffixed one
  std::string save_id;        // rank 0's, given to every rank
  std::int64_t sequence = 0;  // known to rank 0 only: it alone writes the metadata
};

// Rank 0 recovers what an interrupted save of the name left, chooses the directory (the name
// asked, or the run's suffixed one) and makes the temporary one. A failure here removes
// nothing: a leftover it did not get to may be the only complete copy.
SaveTarget prepare_save(Engine& engine, const fs::path& asked, const std::string& run_id) {
  SaveTarget target;
  target.dir = asked;
  std::exception_ptr error;
  attempt(error, [&] {
    if (engine.rank() != 0) return;
    writing(asked, [&] {
      if (!asked.parent_path().empty()) fs::create_directories(asked.parent_path());
      target.dir = save_target(asked, run_id);
      target.sequence = next_save_sequence(parent_directory(target.dir));
      target.save_id = new_random_id();
      if (!fs::create_directory(sibling(target.dir, ".tmp-save")))
        throw Error(fmt::format("'{}' appeared during the save: refusing to write into it",
                                sibling(target.dir, ".tmp-save").string()));
    });
  });
  agree(engine, error, "save_checkpoint");
  // Every rank writes into rank 0's directory, with rank 0's save id.
  if (from_rank0(engine, target.dir != asked ? 1 : 0) != 0)
    target.dir = sibling(asked, "-" + run_id.substr(0, 8));
  std::uint64_t id_parts[3] = {};
  for (int i = 0; i < 3; ++i)
    id_parts[i] = from_rank0(
        engine, engine.rank() == 0 ? std::stoull(target.save_id.substr(i * 11, 11), nullptr, 16)
                                   : 0);
  target.save_id = fmt::format("{:011x}{:011x}{:010x}", id_parts[0], id_parts[1], id_parts[2]);
  return target;
}

// This rank's pieces: per param, the element range it holds, master then each slot.
void write_rank_file(const Engine& engine, const TrainingState& state, const fs::path& path,
                     const std::string& save_id, const OpenCheckpointFile& open) {
  const int rank = engine.rank(), world = engine.world_size();
  const int slots = engine.config().optimizer.state_slots();
  const auto groups = engine.groups();
  writing(path, [&] {
    json pieces = json::array();
    std::int64_t offset = 0;
    struct Source {
      const GroupTrainingState* s;
      std::int64_t shard_offset, count, shard;
    };
    std::vector<Source> sources;
    for (std::size_t gi = 0; gi < groups.size(); ++gi) {
      const auto& s = state.groups[gi];
      if (!s.active && !s.kept) continue;
      const Shard shard = Shard::of(EngineInternals::layout(engine, groups[gi]), rank);
      const auto members = params_of(engine, groups[gi]);
      for (const auto& f : shard.fragments) {
        pieces.push_back({{"param", members[f.param]->name},
                          {"begin", f.param_offset},
                          {"count", f.count},
                          {"offset", offset}});
        offset += (1 + slots) * f.count * 4;
        sources.push_back({&s, f.shard_offset, f.count, shard.numel()});
      }
    }
    const json header = {{"kind", "rank"},      {"save_id", save_id},   {"rank", rank},
                         {"world_size", world}, {"state_slots", slots}, {"pieces", pieces}};
    BinaryWriter out(open, path, header);
    for (const auto& src : sources) {
      out.write(src.s->master.data() + src.shard_offset, src.count * 4);
      for (int k = 0; k < slots; ++k)
        out.write(src.s->state.data() + k * src.shard + src.shard_offset, src.count * 4);
    }
    out.finish();
  });
}

// The bit16 weights, the same on every rank: saved once, by rank 0.
void write_weights_file(const Engine& engine, const TrainingState& state, const fs::path& path,
                        const std::string& save_id, const OpenCheckpointFile& open) {
  writing(path, [&] {
    json entries = json::array();
    std::int64_t offset = 0;
    for (std::size_t i = 0; i < engine.params().size(); ++i) {
      const auto bytes = static_cast<std::int64_t>(state.weights[i].size());
      entries.push_back({{"name", engine.params()[i].name}, {"offset", offset}, {"bytes", bytes}});
      offset += bytes;
    }
    BinaryWriter out(open, path,
                     {{"kind", "weights"},
                      {"save_id", save_id},
                      {"dtype", dtype_name(engine.config().dtype)},
                      {"params", entries}});
    for (const auto& w : state.weights) out.write(w.data(), w.size());
    out.finish();
  });
}

// The metadata (docs/checkpoints.md) but its list of files and the caller's config and extra.
json metadata_of(const Engine& engine, const TrainingState& state, const SaveOptions& options,
                 const SaveTarget& target) {
  const auto& config = engine.config();
  json meta;
  meta["format_version"] = kFormatVersion;
  meta["shardswap_version"] = SHARDSWAP_VERSION;
  meta["save_id"] = target.save_id;
  meta["save_sequence"] = target.sequence;
  meta["run_id"] = options.run_id;
  meta["parent"] = options.parent
                       ? json{{"run_id", options.parent->run_id}, {"step", options.parent->step}}
                       : json(nullptr);
  meta["world_size"] = engine.world_size();
  meta["dtype"] = dtype_name(config.dtype);
  meta["stage"] = config.stage;
  meta["alignment_bytes"] = config.alignment_bytes;
  meta["optimizer"] = optimizer_type_name(config.optimizer.type);
  meta["state_slots"] = config.optimizer.state_slots();
  meta["lr"] = state.lr;
  meta["loss_scaler"] = {{"scale", state.scaler.scale},
                         {"clean_steps", state.scaler.clean_steps},
                         {"hysteresis_left", state.scaler.hysteresis_left}};
  json params = json::array();
  for (const auto& p : engine.params())
    params.push_back({{"name", p.name}, {"shape", p.shape}, {"group", p.group}});
  meta["params"] = params;
  json gs = json::array();
  for (const auto& s : state.groups)
    gs.push_back({{"name", s.group}, {"state", holding_name(s)}, {"step", s.step}});
  meta["groups"] = gs;
  meta["active"] = engine.active_groups();
  return meta;
}

// Each binary file of the save in `tmp` as it lies on disk: its size, and its trailer (the
// checksum of the rest).
json file_records(const fs::path& tmp, int world) {
  json files = json::array();
  const auto add_file = [&](const std::string& name) {
    writing(tmp / name, [&] {
      const InputFile in(tmp / name);
      std::uint64_t trailer = 0;
      if (in.size() < kTrailBytes) throw Error("shorter than its trailer");
      in.read(&trailer, sizeof trailer, in.size() - kTrailBytes);
      files.push_back({{"name", name}, {"bytes", in.size()}, {"fnv1a64", hex64(trailer)}});
    });
  };
  add_file(kWeightsName);
  for (int r = 0; r < world; ++r) add_file(rank_file_name(r, world));
  return files;
}

void write_metadata_file(json meta, const SaveOptions& options, const fs::path& path) {
  writing(path, [&] {
    // Strings that are not UTF-8 (a path may hold any bytes) cannot be JSON text as they are.
    meta["config"] = encode_byte_strings(options.config);
    meta["extra"] = encode_byte_strings(options.extra);
    const std::string text = meta.dump(1);
    const std::string whole = fmt::format(
        "{}{}{}{}}}\n", kPrefix, hex64(fnv1a64(text.data(), text.size())), kMiddle, text);
    auto file = options.open(path);
    file->write(whole.data(), whole.size());
    file->commit();
  });
}

// The complete copy in `tmp` becomes `dir`, replacing the one there.
void move_into_place(const fs::path& tmp, const fs::path& dir) {
  const fs::path old = sibling(dir, ".old-save");
  writing(dir, [&] {
    fsync_directory(tmp);
    // Renames only, until the new copy is in place: at every instant one complete copy lies
    // under a name recover_checkpoints() knows (DIR, then DIR.old-save or DIR.tmp-save).
    // save_target() recovered every leftover of the name, so an .old-save here is not ours.
    if (fs::exists(fs::symlink_status(old)))
      throw Error(fmt::format("'{}' appeared during the save: refusing to touch it", old.string()));
    const bool replacing = fs::exists(fs::symlink_status(dir));
    if (replacing) fs::rename(dir, old);
    try {
      fs::rename(tmp, dir);
    } catch (...) {
      std::error_code ec;
      if (replacing) fs::rename(old, dir, ec);
      throw;
    }
    fsync_directory(parent_directory(dir));
    if (replacing) fs::remove_all(old);
  });
}

}  // namespace

fs::path save_checkpoint(Engine& engine, const fs::path& dir_in, const SaveOptions& options) {
  const fs::path asked = normalized(dir_in, "save_checkpoint");
  check_save_options(options);
  const int rank = engine.rank(), world = engine.world_size();
  // Refused in the save's own name, on every rank alike: a rank with gradients pending must
  // not leave the others in the save's collectives.
  TrainingState state;
  std::exception_ptr error;
  attempt(error, [&] {
    EngineInternals::require_none_pending(engine, "save_checkpoint");
    state = engine.training_state(rank == 0);
  });
  agree(engine, error, "save_checkpoint");

  const SaveTarget target = prepare_save(engine, asked, options.run_id);
  const fs::path tmp = sibling(target.dir, ".tmp-save");
  const auto remove_tmp = [&] {
    std::error_code ec;
    if (rank == 0) fs::remove_all(tmp, ec);
  };
  attempt(error, [&] {
    write_rank_file(engine, state, tmp / rank_file_name(rank, world), target.save_id,
                    options.open);
    if (rank == 0)
      write_weights_file(engine, state, tmp / kWeightsName, target.save_id, options.open);
  });
  agree(engine, error, "save_checkpoint", remove_tmp);

  // Rank 0: the metadata, then the directory into place.
  attempt(error, [&] {
    if (rank != 0) return;
    json meta = metadata_of(engine, state, options, target);
    meta["files"] = file_records(tmp, world);
    write_metadata_file(std::move(meta), options, tmp / kMetadataName);
    move_into_place(tmp, target.dir);
  });
  agree(engine, error, "save_checkpoint", remove_tmp);
  return target.dir;
}

std::string new_random_id() {
  try {
    std::random_device device;
    std::string id;
    for (int i = 0; i < 4; ++i) id += fmt::format("{:08x}", static_cast<std::uint32_t>(device()));
    return id;
  } catch (const std::exception& e) {
    throw Error(fmt::format("new_random_id: no random device: {}", e.what()));
  }
}

}  // namespace shardswap
