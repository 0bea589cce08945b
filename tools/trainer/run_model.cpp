// The choice of the model behind RunModel: the decoder (tools/trainer/run_decoder.cpp), the one built-in
// model family.
#include "trainer/run_model.h"

#include <utility>

#include "trainer/train.h"

namespace shardswap {

// run_decoder.cpp
std::unique_ptr<RunModel> make_decoder_run(const TrainConfig& config);
SwitchingGroups decoder_switching_groups(const TrainConfig& config);

void RunModel::declare(Engine& engine) const {
  for (auto& p : declarations())
    engine.add_param(std::move(p.name), std::move(p.shape), std::move(p.group));
}

std::unique_ptr<RunModel> make_run_model(const TrainConfig& config) {
  return make_decoder_run(config);
}

SwitchingGroups switching_groups(const TrainConfig& config) {
  return decoder_switching_groups(config);
}

}  // namespace shardswap
