// Checkpoints: each rank saves its pieces of every param's fp32 master and optimizer state (per
// param, so any world size can load them), rank 0 the bit16 weights and one metadata file; a
// checkpoint directory is complete or absent, and every file is checked before anything changes.
// The format is described in docs/checkpoints.md.
#pragma once

#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "shardswap/engine.h"

namespace shardswap {

/// A file being written into a checkpoint. Implementations throw Error naming the file.
class CheckpointFile {
 public:
  virtual ~CheckpointFile() = default;
  virtual void write(const void* data, std::size_t bytes) = 0;
  /// Makes the bytes durable (fsync) and closes the file.
  virtual void commit() = 0;
};

/// Opens a new file for writing (truncating it). Tests inject one that fails like a full disk.
using OpenCheckpointFile =
    std::function<std::unique_ptr<CheckpointFile>(const std::filesystem::path& path)>;

/// The POSIX file: write(2) until done, fsync(2) and close(2) on commit.
std::unique_ptr<CheckpointFile> open_checkpoint_file(const std::filesystem::path& path);

/// FNV-1a, 64 bits, continued from `hash` (start from kFnvOffset).
inline constexpr std::uint64_t kFnvOffset = 0xcbf29ce484222325ull;
std::uint64_t fnv1a64(const void* data, std::size_t bytes, std::uint64_t hash = kFnvOffset);

/// 32 lowercase hex digits of 128 random bits (std::random_device): a save id, or a run id.
std::string new_random_id();

/// The checkpoint a run resumed from: part of the lineage every checkpoint of the run records.
struct CheckpointParent {
  std::string run_id;     ///< the run that wrote it
  std::int64_t step = 0;  ///< the step it was saved at
};

struct SaveOptions {
  /// The trainer's own state (its step, data position, ...): stored as given, returned by
  /// load_checkpoint. Must be a JSON object, nested at most 1022 levels as stored (a string that
  /// is not UTF-8 is stored one level deeper): save_checkpoint refuses a deeper one, which a
  /// load would refuse. Strings need not be UTF-8 (see docs/checkpoints.md).
  nlohmann::json extra = nlohmann::json::object();
  /// The run's config, for the record (inspect shows it; load does not read it).
  nlohmann::json config = nlohmann::json::object();
  OpenCheckpointFile open = open_checkpoint_file;
  /// The run writing this save (new_random_id(), made once per process run). A `dir` holding a
  /// checkpoint of another run (or anything that is not a checkpoint of this run) is never
  /// replaced: the save goes to `dir`-<first 8 digits of run_id> instead. Empty: the caller
  /// owns its directory names, and `dir` is replaced whatever it holds.
  std::string run_id;
  /// What this run resumed from; none for a run that started fresh.
  std::optional<CheckpointParent> parent;
};

/// Collective: every rank calls it with the same `dir` and options, between steps. Writes the
/// engine's state into `dir`.tmp-save, fsyncs every file and the directory, then renames it to
/// `dir` (an older `dir` of the same run is replaced only once the new one is complete; leftovers
/// of an interrupted save of `dir` are recovered first, as recover_checkpoints does). Every file
/// carries a new random save id; the metadata records it, each file's size and checksum, the
/// lineage and a save sequence number (1 + the highest under `dir`'s parent). On any failure
/// every rank throws, the temporary directory is removed and an existing checkpoint is left as
/// it was; the error names the file. Returns the directory written (see SaveOptions::run_id).
std::filesystem::path save_checkpoint(Engine& engine, const std::filesystem::path& dir,
                                      const SaveOptions& options = {});

struct LoadedCheckpoint {
  nlohmann::json extra;  ///< SaveOptions::extra of the save, its strings' bytes as given
  int world_size = 0;    ///< of the save
  std::string save_id;   ///< of the save
  std::string run_id;    ///< SaveOptions::run_id of the save ("" if none was given)
  std::int64_t save_sequence = 0;
};

/// Collective: every rank calls it with the same `dir`, on a built Engine with the same
/// declarations (names, shapes, groups), bit16 type and optimizer type as the saved one; the
/// world size, ZeRO stage and alignment may differ (each rank reassembles its shard from the
/// per-param pieces). Every check (metadata, declarations, files present and regular, sizes,
/// checksums, every file of this save, pieces covering every param) runs before the engine is
/// touched; on failure it throws ConfigError naming the file and the engine is unchanged.
LoadedCheckpoint load_checkpoint(Engine& engine, const std::filesystem::path& dir);

// ---- reading without an Engine (export, inspect) ----

/// The verified metadata (checksum, format version, save id, lineage and every field a reader
/// uses checked for presence and type; `extra` an object) of the checkpoint in `dir`, its
/// `config` and `extra` as stored (see encode_byte_strings); ConfigError naming the file (and
/// the field, or the line, column and key path) when `dir` is not a checkpoint, the file is
/// corrupt, or its JSON nests deeper than 1024 levels (which save_checkpoint never writes).
/// Nothing in it is nested deeper, so walking it recursively is safe.
nlohmann::json read_checkpoint_metadata(const std::filesystem::path& dir);

/// One param's values as a checkpoint holds them.
struct CheckpointTensor {
  std::string name;
  std::vector<std::int64_t> shape;
  DType dtype = DType::bf16;
  std::vector<std::byte> data;  ///< little-endian, dtype_size(dtype) bytes per element
};

/// Every param, in declaration order: the bit16 weights, or with `master` the fp32 masters
/// reassembled from every rank's pieces (a group without fp32 state, i.e. frozen under drop,
/// gives its bit16 weights widened to fp32: what activation would seed its master with). Every
/// file is verified first.
std::vector<CheckpointTensor> read_checkpoint_tensors(const std::filesystem::path& dir,
                                                      bool master);

// ---- a directory of checkpoints (config section `checkpoint`) ----

/// "step-00000100": the name of the checkpoint of `step` under a checkpoint root. A save whose
/// name is taken by another run's checkpoint is named "step-00000100-1a2b3c4d" (the first 8 hex
/// digits of its run id); both forms are checkpoint names.
std::string checkpoint_name(std::int64_t step);

/// A complete checkpoint under a root: its name is a checkpoint name, its metadata verifies, and
/// every file the metadata lists is a regular file of the recorded size (checksums are checked
/// by load and inspect, not here).
struct CheckpointEntry {
  std::filesystem::path path;
  std::int64_t step = 0;           ///< from its name
  std::string run_id;              ///< of the run that wrote it ("" if none was given)
  std::int64_t save_sequence = 0;  ///< higher: written later
};

struct CheckpointScan {
  std::vector<CheckpointEntry> complete;  ///< in the order they were written (save sequence)
  std::vector<std::string> skipped;       ///< "PATH: why", for each checkpoint name not complete
};
CheckpointScan scan_checkpoints(const std::filesystem::path& root);

/// The complete checkpoints under `root`, oldest step first (ties: in save order).
std::vector<std::filesystem::path> list_checkpoints(const std::filesystem::path& root);

/// The most recently written complete checkpoint under `root` (highest save sequence), if any.
std::optional<CheckpointEntry> latest_checkpoint(const std::filesystem::path& root);

/// Completes or rolls back what an interrupted save or prune left under `root`: for each
/// checkpoint name with a `.tmp-save` or `.old-save` beside it, every copy is verified in full;
/// a complete `.tmp-save` whose checkpoint is absent (or incomplete) becomes it, else a complete
/// `.old-save` goes back; every other leftover is removed, as are `.prune` leftovers. Cheap when
/// nothing is left over (one directory listing). Returns one line per action, naming the paths.
/// Not a collective: call it on one process, before choosing a checkpoint to load.
std::vector<std::string> recover_checkpoints(const std::filesystem::path& root);

/// Deletes all but the newest `keep` (by save sequence) complete checkpoints that `run_id`
/// wrote under `root`; a checkpoint another run wrote is never deleted. Each doomed checkpoint
/// is first renamed out of the checkpoint names (NAME.prune, the root fsynced), so that an
/// interruption cannot leave anything that lists as complete; `.prune` leftovers are removed.
/// Recovers leftovers of interrupted saves first (recover_checkpoints). Not a collective: call
/// it on one rank, after save_checkpoint returned.
void prune_checkpoints(const std::filesystem::path& root, int keep, const std::string& run_id);

// ---- strings that are not UTF-8, in JSON ----

/// JSON text must be UTF-8, a C++ string (a Linux path) need not be: every string that is not
/// valid UTF-8 becomes {"bytes_hex": "<its bytes in hex>"}, every object with such a key (or
/// one that would read as an encoded value) {"object_entries": [[key, value], ...]}, so that
/// decode_byte_strings(encode_byte_strings(j)) == j for every j. Used for the metadata's
/// `config` and `extra`.
nlohmann::json encode_byte_strings(const nlohmann::json& j);
nlohmann::json decode_byte_strings(const nlohmann::json& j);

}  // namespace shardswap
