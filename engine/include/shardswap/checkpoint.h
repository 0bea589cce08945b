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

struct SaveOptions {
  /// The trainer's own state (its step, data position, ...): stored as given, returned by
  /// load_checkpoint. Must be a JSON object.
  nlohmann::json extra = nlohmann::json::object();
  /// The run's config, for the record (inspect shows it; load does not read it).
  nlohmann::json config = nlohmann::json::object();
  OpenCheckpointFile open = open_checkpoint_file;
};

/// Collective: every rank calls it with the same `dir`, between steps. Writes the engine's state
/// into `dir`.tmp-save, fsyncs every file and the directory, then renames it to `dir` (an older
/// `dir` is replaced only once the new one is complete). On any failure every rank throws, the
/// temporary directory is removed and an existing checkpoint is left as it was; the error
/// names the file.
void save_checkpoint(Engine& engine, const std::filesystem::path& dir,
                     const SaveOptions& options = {});

struct LoadedCheckpoint {
  nlohmann::json extra;  ///< SaveOptions::extra of the save
  int world_size = 0;    ///< of the save
};

/// Collective: every rank calls it with the same `dir`, on a built Engine with the same
/// declarations (names, shapes, groups), bit16 type and optimizer type as the saved one; the
/// world size, ZeRO stage and alignment may differ (each rank reassembles its shard from the
/// per-param pieces). Every check (metadata, declarations, files present, sizes, checksums,
/// pieces covering every param) runs before the engine is touched; on failure it throws
/// ConfigError naming the file and the engine is unchanged.
LoadedCheckpoint load_checkpoint(Engine& engine, const std::filesystem::path& dir);

// ---- reading without an Engine (export, inspect) ----

/// The verified metadata (checksum checked) of the checkpoint in `dir`; ConfigError naming the
/// file when `dir` is not a checkpoint or the file is corrupt.
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

/// "step-00000100": the name of the checkpoint of `step` under a checkpoint root.
std::string checkpoint_name(std::int64_t step);
/// The complete checkpoints (a metadata file present) under `root`, oldest step first.
std::vector<std::filesystem::path> list_checkpoints(const std::filesystem::path& root);
/// Deletes all but the newest `keep` complete checkpoints under `root`, and leftovers of
/// interrupted saves. Not a collective: call it on one rank, after save_checkpoint returned.
void prune_checkpoints(const std::filesystem::path& root, int keep);

}  // namespace shardswap
