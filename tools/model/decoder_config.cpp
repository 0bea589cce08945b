#include "model/decoder_config.h"

#include <fmt/format.h>

#include "shardswap/error.h"
#include "model/hf_config.h"

namespace shardswap {

namespace {

// The config.json fields that may be given inline under model.* for a model from scratch.
const std::vector<std::string> kInlineFields = {
    "model_type",          "vocab_size",          "hidden_size",
    "intermediate_size",   "num_hidden_layers",   "num_attention_heads",
    "num_key_value_heads", "head_dim",            "max_position_embeddings",
    "rms_norm_eps",        "rope_theta",          "rope_scaling",
    "rope_parameters",     "tie_word_embeddings", "hidden_act",
    "attention_bias",      "mlp_bias",            "sliding_window",
    "use_sliding_window",  "max_window_layers",   "layer_types"};

// model.path wins over the inline fields: a config written for one model (configs/qwen2.5-*.json)
// then trains any folder given on the command line. A field that restates the folder's value is
// silent; one that differs is a warning naming both (an error under --strict), never applied.
void warn_replaced_fields(ConfigReader& c, const nlohmann::json& folder) {
  for (const auto& field : kInlineFields) {
    const std::string key = "model." + field;
    if (!c.has(key)) continue;
    const nlohmann::json& mine = c.json().at("model").at(field);
    c.mark_read(key);
    const auto theirs = folder.find(field);
    if (theirs != folder.end() && *theirs == mine) continue;
    c.warn(key, mine.dump(),
           theirs == folder.end()
               ? "model.path's config.json does not set it (transformers' default applies): "
                 "model.path wins, this value is not used"
               : fmt::format("model.path's config.json says {}: model.path wins, this value is "
                             "not used",
                             theirs->dump()));
  }
}

}  // namespace

std::vector<std::filesystem::path> DecoderConfig::input_files() const {
  std::vector<std::filesystem::path> files;
  if (!weights) return files;
  files.push_back(weights->folder() / "config.json");
  for (const auto& f : weights->files()) files.push_back(f);
  for (const auto& f : side_files) files.push_back(weights->folder() / f.name);
  return files;
}

nlohmann::json DecoderConfig::checkpoint_extra(DType dtype) const {
  nlohmann::json config = weights ? weights->config().fields : nlohmann::json::object();
  config.update(hf_config_to_json(shape, dtype));
  nlohmann::json extra = {{"hf_config", std::move(config)}};
  if (weights) {
    nlohmann::json files = nlohmann::json::array();
    for (const auto& f : side_files)
      files.push_back({{"name", f.name},
                       {"bytes", f.bytes},
                       {"fnv1a64", fmt::format("{:016x}", f.fnv1a64)}});
    extra["hf_source"] = {{"path", std::filesystem::absolute(weights->folder()).string()},
                          {"files", std::move(files)}};
  }
  return extra;
}

DecoderConfig decoder_config_from_json(ConfigReader& c, int seq_len) {
  DecoderConfig d;
  d.seq_len = seq_len;
  const HfSeqLen checked_at{seq_len, "data.seq_len"};
  d.path = c.string("model.path", "");
  try {
    if (!d.path.empty()) {
      // config.json and every tensor checked now, before anything is built.
      d.weights = std::make_shared<const HfCheckpoint>(HfCheckpoint::open(d.path, checked_at));
      d.shape = d.weights->shape();
      d.side_files = hf_side_files(d.path);
      warn_replaced_fields(c, d.weights->config().fields);
    } else {
      nlohmann::json fields = nlohmann::json::object();
      for (const auto& field : kInlineFields)
        if (c.has("model." + field)) {
          fields[field] = c.json().at("model").at(field);
          c.mark_read("model." + field);
        }
      if (!fields.contains("model_type")) fields["model_type"] = "llama";
      d.shape = hf_config_from_json(fields, HfConfigSource{{}, "model."}, checked_at).shape;
    }
  } catch (const ConfigError& e) {
    c.rethrow_naming_file(e);
  }
  const auto recompute = c.integer("model.recompute_layers", 0);
  if (recompute < 0 || recompute > d.shape.layers)
    c.fail("model.recompute_layers", fmt::format("{}", recompute),
           fmt::format("must lie in [0, num_hidden_layers = {}]", d.shape.layers));
  d.options.recompute_layers = static_cast<int>(recompute);
  if (c.has("model.loss_chunk_rows")) {
    // A chunk above the batch's tokens is the batch (min(rows, tokens) is what is allocated).
    constexpr std::int64_t kMaxRows = std::int64_t{1} << 30;
    const auto rows = c.integer("model.loss_chunk_rows", 0);
    if (rows < 1 || rows > kMaxRows)
      c.fail("model.loss_chunk_rows", fmt::format("{}", rows),
             fmt::format("must lie in [1, {}]", kMaxRows));
    d.options.loss_chunk_rows = static_cast<int>(rows);
  }
  d.options.keep_norm_outputs = c.boolean("model.keep_norm_outputs", false);
  d.options.precision.bit16_logits = c.boolean("model.bit16_logits", false);
  d.options.precision.bit16_swiglu_grad = c.boolean("model.bit16_swiglu_grad", false);
  d.options.precision.bit16_residual = c.boolean("model.bit16_residual", false);
  const std::string attention = c.string("model.attention", "auto");
  using lm::dec::Attention;
  bool known = false;
  for (const Attention a :
       {Attention::automatic, Attention::cudnn, Attention::cudnn_atomic, Attention::own})
    if (attention == lm::dec::attention_key_value(a)) {
      d.options.attention = a;
      known = true;
    }
  if (!known)
    c.fail_value("model.attention", "must be \"auto\", \"cudnn\", \"cudnn-atomic\" or \"own\"");
  return d;
}

}  // namespace shardswap
