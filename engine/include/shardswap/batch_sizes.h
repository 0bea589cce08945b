// The three batch-size keys of a DeepSpeed config, resolved against the world size the way
// DeepSpeed resolves them: any two give the third, all three must agree, one alone is completed.
#pragma once

#include <cstdint>

#include "shardswap/config_reader.h"

namespace shardswap {

/// Batch sizes count samples, and the names say so (the JSON keys are DeepSpeed's).
struct BatchSizes {
  int micro_samples = 32;  ///< train_micro_batch_size_per_gpu: samples per rank per micro-batch
  int gradient_accumulation_steps = 1;  ///< micro-batches per optimizer step
  /// train_batch_size: samples per step, micro_samples x accumulation x ranks.
  std::int64_t train_samples = 32;
};

/// Reads train_micro_batch_size_per_gpu, gradient_accumulation_steps and train_batch_size:
/// - all three: they must satisfy train_batch = micro x accumulation x world_size;
/// - two: the third is derived, and the division must be exact;
/// - train_batch_size alone: accumulation 1, micro = train_batch / world_size (exact);
/// - otherwise the micro batch defaults to 32 (DeepSpeed requires one of micro and train batch)
///   and the accumulation to 1.
/// A key holding "auto" takes what Hugging Face's Trainer fills in from its defaults (micro
/// batch 8, accumulation 1, train batch = their product x world size), or the value a given
/// train_batch_size determines, with one warning naming it and the value it got.
/// Throws ConfigError naming the key (and the file) for a value that is not an integer, zero or
/// negative, too large, or for sizes that do not multiply out, showing the arithmetic.
BatchSizes resolve_batch_sizes(ConfigReader& config, int world_size);

}  // namespace shardswap
