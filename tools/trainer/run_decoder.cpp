// The decoder behind RunModel: its config (model.* and data.* keys), its weights (from scratch or
// a Hugging Face folder); and the run's data it reads (token files or bytes, the global batch of
// a step drawn the same at any world size), opened apart from the model (RunData).
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <thread>

#include "shardswap/error.h"
#include "support/quoted.h"
#include "model/decoder.h"
#include "model/decoder_cuda.h"
#include "model/hf_checkpoint.h"
#include "model/hf_config.h"
#include "model/init_ahead.h"
#include "data/token_data.h"
#include "trainer/run_model.h"
#include "trainer/train.h"

namespace shardswap {

namespace {

const char* family_name(DecoderFamily f) {
  switch (f) {
    case DecoderFamily::llama:
      return "llama";
    case DecoderFamily::qwen2:
      return "qwen2";
    case DecoderFamily::mistral:
      return "mistral";
  }
  return "?";
}

// The config.json fields that may be given inline under model.* for a model from scratch.
const std::vector<std::string> kInlineFields = {
    "model_type",          "vocab_size",          "hidden_size",
    "intermediate_size",   "num_hidden_layers",   "num_attention_heads",
    "num_key_value_heads", "head_dim",            "max_position_embeddings",
    "rms_norm_eps",        "rope_theta",          "rope_scaling",
    "rope_parameters",     "tie_word_embeddings", "hidden_act",
    "attention_bias",      "mlp_bias",            "sliding_window",
    "use_sliding_window",  "max_window_layers",   "layer_types"};

TokenDataSpec token_spec(const TrainConfig& c) {
  TokenDataSpec spec;
  spec.train = c.decoder.data_train;
  spec.val = c.decoder.data_val;
  spec.bytes = c.decoder.bytes;
  spec.val_fraction = c.val_fraction;
  spec.seq_len = c.decoder.seq_len;
  spec.vocab = c.decoder.shape.vocab;
  spec.seed = c.seed;
  return spec;
}

DecoderBatch to_batch(TokenSequences s) {
  return {s.sequences, s.seq_len, std::move(s.inputs), std::move(s.targets)};
}

class DecoderRank final : public RankModel {
 public:
  DecoderRank(std::unique_ptr<Decoder> model, int vocab)
      : model_(std::move(model)), vocab_(vocab) {}
  double train_micro(Engine& engine, TokenSequences batch) override {
    return model_->train_step(engine, to_batch(std::move(batch)));
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
  explicit DecoderRun(const TrainConfig& c)
      : config_(c.decoder), seed_(c.seed), on_cuda_(c.backend.kind == DeviceKind::cuda) {
    if (!config_.path.empty())
      checkpoint_.emplace(HfCheckpoint::open(config_.path, {config_.seq_len, "data.seq_len"}));
  }
  std::vector<std::string> groups() const override { return decoder_groups(config_.shape); }
  std::int64_t param_count() const override { return decoder_param_count(config_.shape); }
  std::vector<ParamDeclaration> declarations() const override {
    std::vector<ParamDeclaration> out;
    for (auto& p : decoder_params(config_.shape))
      out.push_back({std::move(p.name), std::move(p.shape), std::move(p.group)});
    return out;
  }
  void init(const ParamInfo& param, std::span<float> values) const override {
    if (checkpoint_) {
      checkpoint_->copy(param.name, DType::f32, std::as_writable_bytes(values));
      return;
    }
    // Made at the first value asked for: `plan` draws none, and its index of every param (as
    // large as the engine's declarations) is not made for it.
    std::call_once(init_ahead_made_, [&] {
      init_ahead_ = std::make_unique<InitAhead>(
          config_.shape, seed_, static_cast<int>(std::thread::hardware_concurrency()));
    });
    init_ahead_->fill(param, values);
  }
  std::int64_t activation_bytes(int micro, DType dtype, DeviceKind device) const override {
    return Decoder::activation_bytes(config_.shape, micro, config_.seq_len, dtype, device,
                                     config_.recompute_layers);
  }
  std::unique_ptr<RankModel> make_rank_model(int micro, DType dtype,
                                             MemorySpace& space) const override {
    return std::make_unique<DecoderRank>(
        make_decoder(config_.shape, micro, config_.seq_len, dtype, space, config_.recompute_layers),
        config_.shape.vocab);
  }
  std::int64_t tokens_per_sample() const override { return config_.seq_len; }
  double micro_flops(int micro) const override {
    return decoder_step_flops(config_.shape, std::int64_t{micro} * config_.seq_len,
                              config_.seq_len);
  }
  std::vector<int> reference_gemm(int micro) const override {
    return {micro * config_.seq_len, config_.shape.intermediate, config_.shape.hidden};
  }
  std::string describe() const override {
    const auto& s = config_.shape;
    return fmt::format(
        "decoder {} params ({}), {} layers, hidden {}, intermediate {}, heads {} / kv {} x {}, "
        "vocab {}{}, seq_len {}, {}{}",
        param_count(), family_name(s.family), s.layers, s.hidden, s.intermediate, s.heads,
        s.kv_heads, s.head_dim, s.vocab, s.tied ? " (tied head)" : "", config_.seq_len,
        config_.path.empty() ? "from scratch" : "from " + config_.path,
        // Which attention a GPU run has is said, never left to guess (docs/models.md).
        on_cuda_ ? ", attention: " + lm::dec::cuda_attention_name(s) : "");
  }
  std::string type_name() const override { return "decoder"; }
  nlohmann::json checkpoint_extra() const override { return {{"hf_config", config_.hf_config}}; }

 private:
  DecoderRunConfig config_;
  std::uint64_t seed_;
  // From scratch: Decoder::init's values, drawn ahead (init is const: made on first use).
  mutable std::once_flag init_ahead_made_;
  mutable std::unique_ptr<InitAhead> init_ahead_;
  bool on_cuda_;
  std::optional<HfCheckpoint> checkpoint_;
};

}  // namespace

void decoder_config_from_json(ConfigReader& c, TrainConfig& t) {
  DecoderRunConfig& d = t.decoder;
  d.seq_len = static_cast<int>(c.integer("data.seq_len", d.seq_len));
  if (d.seq_len < 1 || d.seq_len > (1 << 20))
    c.fail("data.seq_len", fmt::format("{}", d.seq_len), "must lie in [1, 1048576]");
  const HfSeqLen seq_len{d.seq_len, "data.seq_len"};
  d.path = c.string("model.path", "");
  try {
    if (!d.path.empty()) {
      for (const auto& field : kInlineFields)
        if (c.has("model." + field))
          c.fail("model." + field,
                 "comes from model.path's config.json; set either model.path or the fields");
      // config.json and every tensor checked now, before anything is built.
      d.shape = HfCheckpoint::open(d.path, seq_len).shape();
    } else {
      nlohmann::json fields = nlohmann::json::object();
      for (const auto& field : kInlineFields)
        if (c.has("model." + field)) {
          fields[field] = c.json().at("model").at(field);
          c.mark_read("model." + field);
        }
      if (!fields.contains("model_type")) fields["model_type"] = "llama";
      d.shape = hf_config_from_json(fields, HfConfigSource{{}, "model."}, seq_len).shape;
    }
  } catch (const ConfigError& e) {
    c.rethrow_naming_file(e);
  }
  const auto recompute = c.integer("model.recompute_layers", 0);
  if (recompute < 0 || recompute > d.shape.layers)
    c.fail("model.recompute_layers", fmt::format("{}", recompute),
           fmt::format("must lie in [0, num_hidden_layers = {}]", d.shape.layers));
  d.recompute_layers = static_cast<int>(recompute);
  const auto tokenizer = c.string("data.tokenizer", "llmc");
  if (tokenizer != "llmc" && tokenizer != "bytes")
    c.fail("data.tokenizer", quote_value(tokenizer),
           "expected \"llmc\" (token files in llm.c's format) or \"bytes\"");
  d.bytes = tokenizer == "bytes";
  d.data_train = c.string("data.train", "");
  if (d.data_train.empty()) c.fail("data.train", "is required for model.type \"decoder\"");
  d.data_val = c.string("data.val", "");
  t.val_fraction = c.number("data.val_fraction", t.val_fraction);
}

std::shared_ptr<const RunData> open_run_data(ConfigReader& c, const TrainConfig& t) {
  try {
    auto data = std::make_shared<const RunData>(token_spec(t), t.batches.train_samples,
                                                t.batches.micro_samples);
    if (!data->has_val())
      c.fail("data.val", "no validation set: give data.val (or data.tokenizer \"bytes\")");
    return data;
  } catch (const ConfigError& e) {
    c.rethrow_naming_file(e);
  }
}

std::vector<std::filesystem::path> decoder_input_files(const TrainConfig& t) {
  // The token files by name alone: the run's data (open_run_data) has opened and scanned them.
  std::vector<std::filesystem::path> files;
  for (const auto& f : token_data_files(token_spec(t))) files.emplace_back(f);
  if (!t.decoder.path.empty()) {
    const HfCheckpoint model = HfCheckpoint::open(t.decoder.path, {t.decoder.seq_len, "data.seq_len"});
    files.push_back(std::filesystem::path(t.decoder.path) / "config.json");
    for (const auto& f : model.files()) files.push_back(f);
  }
  return files;
}

std::unique_ptr<RunModel> make_decoder_run(const TrainConfig& config) {
  return std::make_unique<DecoderRun>(config);
}

SwitchingGroups decoder_switching_groups(const TrainConfig& config) {
  // LISA and BAdam switch the decoder's "layers.N" groups; LISA keeps the embedding and the
  // head always active (the LISA paper's choice).
  SwitchingGroups g{.all = decoder_groups(config.decoder.shape),
                    .layers = {},
                    .lisa_always_active = {"embed", "head"}};
  for (const auto& name : g.all)
    if (name.starts_with("layers.")) g.layers.push_back(name);
  return g;
}

}  // namespace shardswap
