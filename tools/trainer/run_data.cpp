#include "trainer/run_data.h"

#include <fmt/format.h>

namespace shardswap {

RunData::RunData(const TokenDataSpec& spec, int global_batch, int micro)
    : train_(spec.train), tokens_(spec), global_batch_(global_batch), micro_(micro) {}

TokenSequences RunData::train_micro(std::int64_t step, int rank, int world, int micro_index) const {
  return tokens_.train_batch(step, global_batch_, rank, world, micro_index, micro_);
}

TokenSequences RunData::val_batch(int index) const {
  return tokens_.val_batch(index, micro_);
}

std::string RunData::describe() const {
  return fmt::format("data {} ({} sequences, {} tokens; {} validation sequences)", train_,
                     tokens_.train_samples(), tokens_.train_tokens(), tokens_.val_samples());
}

}  // namespace shardswap
