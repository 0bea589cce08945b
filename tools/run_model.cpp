// The byte LM behind RunModel (the decoder's is tools/run_decoder.cpp), and the choice by
// model.type.
#include "tools/run_model.h"

#include <fmt/format.h>

#include "shardswap/error.h"
#include "tools/lm/byte_lm.h"
#include "tools/lm/text_data.h"
#include "tools/train.h"

namespace shardswap {

std::unique_ptr<RunModel> make_decoder_run(const TrainConfig& config);  // run_decoder.cpp

namespace {

class ByteLmRank final : public RankModel {
 public:
  ByteLmRank(std::unique_ptr<ByteLm> model, const ByteCorpus& corpus, int micro)
      : model_(std::move(model)), corpus_(corpus), micro_(micro) {}
  double train_micro(Engine& engine, std::int64_t step, int rank, int /*world*/,
                     int micro) override {
    // Drawn per rank: the byte LM's samples are independent positions of the file.
    return model_->train_step(engine, corpus_.train_batch(rank, step, micro, micro_));
  }
  double val_loss(const Engine& engine, int index) override {
    return model_->loss(engine, corpus_.val_batch(index, micro_));
  }
  ValLogits val_logits(const Engine&, int) override {
    throw ConfigError("eval --logits: the byte LM has no logits output; it is for model.type "
                      "\"decoder\"");
  }

 private:
  std::unique_ptr<ByteLm> model_;
  const ByteCorpus& corpus_;
  int micro_;
};

class ByteLmRun final : public RunModel {
 public:
  explicit ByteLmRun(const TrainConfig& c)
      : shape_(c.model), seed_(c.seed), corpus_(c.data_path, c.model.context, c.val_fraction, c.seed) {}
  std::vector<std::string> groups() const override { return byte_lm_groups(shape_); }
  std::int64_t param_count() const override { return byte_lm_param_count(shape_); }
  void declare(Engine& engine) const override { ByteLm::declare(shape_, engine); }
  void init(const ParamInfo& param, std::span<float> values) const override {
    ByteLm::init(shape_, param, values, seed_);
  }
  std::int64_t activation_bytes(int micro, DType dtype, DeviceKind device) const override {
    return ByteLm::activation_bytes(shape_, micro, dtype, device);
  }
  std::unique_ptr<RankModel> make_rank_model(int micro, DType dtype,
                                             MemorySpace& space) const override {
    return std::make_unique<ByteLmRank>(make_byte_lm(shape_, micro, dtype, space), corpus_,
                                        micro);
  }
  std::int64_t tokens_per_sample() const override { return 1; }
  double micro_flops(int micro) const override { return byte_lm_step_flops(shape_, micro); }
  std::vector<int> reference_gemm(int micro) const override {
    return {micro, shape_.hidden, shape_.width};
  }
  std::string describe() const override {
    return fmt::format("byte_lm {} params, context {}, width {}, hidden {}, depth {}",
                       param_count(), shape_.context, shape_.width, shape_.hidden, shape_.depth);
  }
  std::string describe_data() const override {
    return fmt::format("data {} ({} bytes train, {} validation)", corpus_.path(),
                       corpus_.train_size(), corpus_.val_size());
  }
  std::string type_name() const override { return "byte_lm"; }

 private:
  ByteLmShape shape_;
  std::uint64_t seed_;
  ByteCorpus corpus_;
};

}  // namespace

std::unique_ptr<RunModel> make_run_model(const TrainConfig& config) {
  if (config.model_type == ModelType::decoder) return make_decoder_run(config);
  return std::make_unique<ByteLmRun>(config);
}

}  // namespace shardswap
