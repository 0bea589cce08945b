// The decoder behind RunModel: its config as the model reads it (tools/model/decoder_config.h) and
// its weights, from scratch or from a Hugging Face folder. The data is the trainer's (RunData).
#include <fmt/format.h>

#include <filesystem>
#include <memory>
#include <mutex>
#include <thread>

#include "model/decoder.h"
#include "model/decoder_config.h"
#include "model/decoder_cuda.h"
#include "model/hf_config.h"
#include "model/init_ahead.h"
#include "trainer/run_model.h"

namespace shardswap {

namespace {

const char* family_name(DecoderFamily f) {
  switch (f) {
    case DecoderFamily::llama:
      return "llama";
    case DecoderFamily::qwen2:
      return "qwen2";
    case DecoderFamily::qwen3:
      return "qwen3";
    case DecoderFamily::mistral:
      return "mistral";
  }
  return "?";
}

DecoderBatch to_batch(TokenSequences s) {
  return {s.sequences, s.seq_len, std::move(s.inputs), std::move(s.targets),
          std::move(s.positions)};
}

class DecoderRank final : public RankModel {
 public:
  DecoderRank(std::unique_ptr<Decoder> model, int vocab)
      : model_(std::move(model)), vocab_(vocab) {}
  double train_micro(Engine& engine, TokenSequences batch, double weight) override {
    return model_->train_step(engine, to_batch(std::move(batch)), weight);
  }
  double val_loss(const Engine& engine, TokenSequences batch) override {
    return model_->loss(engine, to_batch(std::move(batch)));
  }
  void time_phases(bool on) override { model_->time_phases(on); }
  std::vector<std::pair<std::string, double>> take_phase_seconds() override {
    const lm::dec::PhaseTimes t = model_->take_phase_times();
    if (t.steps == 0) return {};
    return {{"forward", t.forward / 1e3},
            {"forward MLP", t.forward_mlp / 1e3},
            {"attention forward", t.attention_forward / 1e3},
            {"head and loss", t.head / 1e3},
            {"backward MLP", t.backward_mlp / 1e3},
            {"backward", t.backward / 1e3},
            {"attention backward", t.attention_backward / 1e3}};
  }
  ValLogits val_logits(const Engine& engine, TokenSequences batch) override {
    DecoderBatch b = to_batch(std::move(batch));
    ValLogits out{b.sequences, b.seq_len, vocab_, b.inputs, model_->logits(engine, b)};
    return out;
  }

 private:
  std::unique_ptr<Decoder> model_;
  int vocab_;
};

class DecoderRun final : public RunModel {
 public:
  DecoderRun(DecoderConfig config, std::uint64_t seed) : config_(std::move(config)), seed_(seed) {}
  std::vector<std::string> groups() const override { return decoder_groups(config_.shape); }
  SwitchingGroups switching_groups() const override {
    // LISA and BAdam switch the decoder's "layers.N" groups; LISA keeps the embedding and the
    // head always active (the LISA paper's choice).
    SwitchingGroups g{.all = groups(), .layers = {}, .lisa_always_active = {"embed", "head"}};
    for (const auto& name : g.all)
      if (name.starts_with("layers.")) g.layers.push_back(name);
    return g;
  }
  std::int64_t param_count() const override { return decoder_param_count(config_.shape); }
  int vocab_size() const override { return config_.shape.vocab; }
  std::int64_t hidden_size() const override { return config_.shape.hidden; }
  std::vector<ParamDeclaration> declarations() const override {
    std::vector<ParamDeclaration> out;
    for (auto& p : decoder_params(config_.shape))
      out.push_back({std::move(p.name), std::move(p.shape), std::move(p.group)});
    return out;
  }
  std::vector<std::string> no_decay_params() const override {
    // transformers' Trainer (get_decay_parameter_names): the params of its norm layers and
    // every param named like a bias.
    std::vector<std::string> out;
    for (const auto& p : decoder_params(config_.shape))
      if (p.name.ends_with(".bias") || p.name.ends_with("norm.weight")) out.push_back(p.name);
    return out;
  }
  WeightInit initial_values() const override {
    if (config_.weights)
      return [weights = config_.weights](const ParamInfo& param, std::span<float> values) {
        weights->copy(param.name, DType::f32, std::as_writable_bytes(values));
      };
    // Drawn ahead on every core, made at the first value asked for: a build whose rank draws
    // none never makes its index of every param (as large as the engine's declarations).
    struct Drawn {
      std::once_flag made;
      std::unique_ptr<InitAhead> ahead;
    };
    return [drawn = std::make_shared<Drawn>(), shape = config_.shape, seed = seed_](
               const ParamInfo& param, std::span<float> values) {
      std::call_once(drawn->made, [&] {
        drawn->ahead = std::make_unique<InitAhead>(
            shape, seed, static_cast<int>(std::thread::hardware_concurrency()));
      });
      drawn->ahead->fill(param, values);
    };
  }
  std::vector<std::filesystem::path> input_files() const override { return config_.input_files(); }
  std::int64_t activation_bytes(int micro, DType dtype, DeviceKind device) const override {
    return Decoder::activation_bytes(config_.shape, micro, config_.seq_len, dtype, device,
                                     config_.options);
  }
  std::unique_ptr<RankModel> make_rank_model(int micro, DType dtype,
                                             MemorySpace& space) const override {
    return std::make_unique<DecoderRank>(
        make_decoder(config_.shape, micro, config_.seq_len, dtype, space, config_.options),
        config_.shape.vocab);
  }
  void check_device(DeviceKind device) const override {
    check_decoder_options(config_.shape, config_.options, device);
  }
  int recomputable_layers() const override { return config_.shape.layers; }
  int recompute_layers() const override { return config_.options.recompute_layers; }
  std::shared_ptr<const RunModel> with_recompute(int layers) const override {
    if (layers < 0 || layers > config_.shape.layers)
      throw ConfigError(fmt::format("model.recompute_layers = {}: must lie in [0, {}] (layers)",
                                    layers, config_.shape.layers));
    DecoderConfig config = config_;
    config.options.recompute_layers = layers;
    return std::make_shared<const DecoderRun>(std::move(config), seed_);
  }
  double kept_norms_saved_bytes(int micro, DeviceKind device) const override {
    if (device != DeviceKind::cuda) return 0.0;  // the CPU backend cannot keep them
    // Each layer's two norms run again in backward: fp32 rows read, rows of the weights'
    // dtype written (2 bytes: the CUDA backend's weights are bf16 or fp16).
    const double rows = static_cast<double>(micro) * config_.seq_len;
    return 2.0 * config_.shape.layers * rows * config_.shape.hidden * (4.0 + 2.0);
  }
  bool keeps_norms() const override { return config_.options.keep_norm_outputs; }
  std::shared_ptr<const RunModel> with_kept_norms(bool keep) const override {
    DecoderConfig config = config_;
    config.options.keep_norm_outputs = keep;
    return std::make_shared<const DecoderRun>(std::move(config), seed_);
  }
  std::int64_t tokens_per_sample() const override { return config_.seq_len; }
  double micro_flops(int micro) const override {
    return decoder_step_flops(config_.shape, std::int64_t{micro} * config_.seq_len,
                              config_.seq_len);
  }
  std::vector<int> reference_gemm(int micro) const override {
    return {micro * config_.seq_len, config_.shape.intermediate, config_.shape.hidden};
  }
  std::string describe(DeviceKind device) const override {
    const auto& s = config_.shape;
    return fmt::format(
        "decoder {} params ({}), {} layers, hidden {}, intermediate {}, heads {} / kv {} x {}, "
        "vocab {}{}, seq_len {}, {}{}",
        param_count(), family_name(s.family), s.layers, s.hidden, s.intermediate, s.heads,
        s.kv_heads, s.head_dim, s.vocab, s.tied ? " (tied head)" : "", config_.seq_len,
        config_.path.empty() ? "from scratch" : "from " + config_.path,
        // Which attention a GPU run has is said, never left to guess (docs/models.md).
        device == DeviceKind::cuda
            ? ", attention: " + lm::dec::cuda_attention_name(s, config_.options.attention)
            : "");
  }
  std::string documents_apart_attention(DeviceKind device, int micro) const override {
    if (device != DeviceKind::cuda) return {};
    return lm::dec::cuda_apart_attention_name(config_.shape, micro, config_.seq_len,
                                              config_.options.attention);
  }
  std::string type_name() const override { return "decoder"; }
  nlohmann::json checkpoint_extra(DType dtype) const override {
    return config_.checkpoint_extra(dtype);
  }

 private:
  DecoderConfig config_;
  std::uint64_t seed_;
};

}  // namespace

std::shared_ptr<const RunModel> read_decoder_run(ConfigReader& c, int seq_len,
                                                 std::uint64_t seed) {
  return std::make_shared<const DecoderRun>(decoder_config_from_json(c, seq_len), seed);
}

}  // namespace shardswap
