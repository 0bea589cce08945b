#include "trainer/run_data.h"

#include <fmt/format.h>

#include <algorithm>

#include "shardswap/error.h"

namespace shardswap {

RunData::RunData(const TokenDataSpec& spec, int global_batch, int micro)
    : train_(spec.train), tokens_(spec), global_batch_(global_batch), micro_(micro) {}

TokenSequences RunData::train_micro(std::int64_t step, int rank, int world, int micro_index) const {
  return tokens_.train_batch(step, global_batch_, rank, world, micro_index, micro_);
}

TokenSequences RunData::val_batch(int index) const {
  if (index < 0 || index >= val_batches())
    throw Error(fmt::format("RunData::val_batch({}): the validation set holds {} batches of {}",
                            index, val_batches(), micro_));
  const std::int64_t first = std::int64_t{index} * micro_;
  return tokens_.val_sequences(
      first, static_cast<int>(std::min<std::int64_t>(micro_, tokens_.val_samples() - first)));
}

std::int64_t RunData::val_targets(int batches) const {
  const std::int64_t sequences = std::min<std::int64_t>(std::int64_t{batches} * micro_,
                                                        tokens_.val_samples());
  if (!tokens_.val_masked()) return sequences * tokens_.seq_len();
  std::int64_t counted = 0;
  for (int b = 0; b < batches; ++b) counted += val_batch(b).counted_targets();
  return counted;
}

std::string RunData::describe() const {
  return fmt::format("data {} ({} sequences, {} tokens; {} validation sequences; documents {})",
                     train_, tokens_.train_samples(), tokens_.train_tokens(),
                     tokens_.val_samples(), tokens_.documents_apart() ? "apart" : "packed");
}

}  // namespace shardswap
