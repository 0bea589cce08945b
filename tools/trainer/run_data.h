// The training data of a run, apart from its model: opened and checked once per run, when the
// config is read for train or eval (`plan` opens none), then shared read-only by every rank of
// the process, each drawing its own micro-batches from it. The model owns no data: the trainer
// hands each RankModel the batch it trains on.
#pragma once

#include <cstdint>
#include <string>

#include "data/token_data.h"

namespace shardswap {

class RunData {
 public:
  /// Opens and checks every file of `spec` (TokenDataset's ConfigErrors); `global_batch` and
  /// `micro` are the run's batch sizes in sequences.
  RunData(const TokenDataSpec& spec, int global_batch, int micro);

  /// Micro-batch `micro_index` of `rank` of `world` at `step`: a pure function of its arguments,
  /// so any number of threads may draw at once.
  TokenSequences train_micro(std::int64_t step, int rank, int world, int micro_index) const;
  /// The targets the loss is on in step `step`'s global batch, over every rank: the same on
  /// every rank, with no communication.
  std::int64_t step_targets(std::int64_t step) const {
    return tokens_.counted_targets(step, global_batch_);
  }
  /// Validation batch `index`: the validation samples [index * micro, (index + 1) * micro), the
  /// last batch holding what is left (fewer sequences). Error for an index at or past
  /// val_batches(): no batch wraps around the set.
  TokenSequences val_batch(int index) const;
  /// The targets the loss is on in validation batches [0, batches).
  std::int64_t val_targets(int batches) const;
  /// The batches of micro-batch size that cover the validation set, the last one maybe partial.
  std::int64_t val_batches() const { return (tokens_.val_samples() + micro_ - 1) / micro_; }
  bool has_val() const { return tokens_.has_val(); }
  /// Documents kept apart (data.documents): the batches carry positions.
  bool documents_apart() const { return tokens_.documents_apart(); }
  int micro() const { return micro_; }
  int seq_len() const { return tokens_.seq_len(); }
  std::int64_t val_samples() const { return tokens_.val_samples(); }
  /// "data FILES (...)": the start-up line's part.
  std::string describe() const;

 private:
  std::string train_;  // data.train as the config gives it
  TokenDataset tokens_;
  int global_batch_;
  int micro_;
};

}  // namespace shardswap
