// `shardswap ckpt export|inspect`: a checkpoint's weights as a safetensors file, and a summary of
// what a checkpoint holds.
#pragma once

#include <filesystem>
#include <map>
#include <ostream>
#include <string>
#include <vector>

#include "shardswap/checkpoint.h"
#include "tools/output_file.h"

namespace shardswap {

/// Writes `tensors` in the safetensors format: an 8-byte little-endian header length, a JSON
/// header {name: {dtype: BF16|F16|F32, shape, data_offsets: [begin, end]}, "__metadata__":
/// `metadata`} padded with spaces so the data starts 8-byte aligned, then the raw little-endian
/// data in the order given. Written through `out` (its temporary, fsynced, renamed over the
/// target). Throws Error naming the file, or ConfigError if the target was replaced by something
/// it must not overwrite meanwhile.
void write_safetensors(const std::vector<CheckpointTensor>& tensors, OutputFile& out,
                       const std::map<std::string, std::string>& metadata);

/// A summary of the checkpoint in `dir` after verifying every file: world size, step, model,
/// groups with their state and step count, the active set, loss scaler, files and bytes.
std::string describe_checkpoint(const std::filesystem::path& dir);

/// `ckpt export DIR --out FILE [--master]` (bit16 weights, or the fp32 masters) and
/// `ckpt inspect DIR`. Returns the exit status; throws ConfigError for bad arguments or a bad
/// checkpoint (the CLI exits 2).
int ckpt_command(const std::vector<std::string>& args, std::ostream& out);

}  // namespace shardswap
