// `shardswap ckpt export|inspect`: a checkpoint's weights as a safetensors file, and a summary of
// what a checkpoint holds.
#pragma once

#include <filesystem>
#include <map>
#include <ostream>
#include <string>
#include <vector>

#include "shardswap/checkpoint.h"
#include "files/output_file.h"

namespace shardswap {

/// A summary of the checkpoint in `dir` after verifying every file: world size, step, model,
/// groups with their state and step count, the active set, loss scaler, files and bytes.
std::string describe_checkpoint(const std::filesystem::path& dir);

/// `ckpt export DIR --out FILE [--master]` (bit16 weights, or the fp32 masters) and
/// `ckpt inspect DIR`. Returns the exit status; throws ConfigError for bad arguments or a bad
/// checkpoint (the CLI exits 2).
int ckpt_command(const std::vector<std::string>& args, std::ostream& out);

}  // namespace shardswap
