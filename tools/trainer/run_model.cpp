// The choice of the model behind RunModel: the decoder (tools/trainer/run_decoder.cpp), the one
// built-in model family.
#include "trainer/run_model.h"

#include <fmt/format.h>

#include <utility>

#include "shardswap/error.h"
#include "support/quoted.h"

namespace shardswap {

// run_decoder.cpp
std::shared_ptr<const RunModel> read_decoder_run(ConfigReader& c, int seq_len, std::uint64_t seed);

void RunModel::declare(Engine& engine) const {
  for (auto& p : declarations())
    engine.add_param(std::move(p.name), std::move(p.shape), std::move(p.group));
}

std::shared_ptr<const RunModel> RunModel::with_recompute(int layers) const {
  if (layers != 0)
    throw ConfigError(fmt::format("model.recompute_layers = {}: the {} model recomputes no layer",
                                  layers, type_name()));
  return nullptr;  // unreachable for a model that keeps the default: asked only for layers > 0
}

std::shared_ptr<const RunModel> RunModel::with_kept_norms(bool keep) const {
  if (keep)
    throw ConfigError(fmt::format(
        "model.keep_norm_outputs = true: the {} model keeps no norm outputs", type_name()));
  return nullptr;  // unreachable for a model that keeps the default: asked only to keep them
}

std::string read_model_type(ConfigReader& c) {
  // One built-in model family: model.type may be left out. The byte-level MLP LM it once chose
  // between was removed; its configs are refused rather than read as a decoder's with the
  // LM's keys ignored.
  const auto type = c.string("model.type", "decoder");
  if (type == "byte_lm")
    c.fail("model.type", "\"byte_lm\"",
           "the byte-level MLP LM was removed: use model.type \"decoder\" with data.tokenizer "
           "\"bytes\" (configs/quickstart.json)");
  if (type != "decoder")
    c.fail("model.type", quote_value(type), "expected \"decoder\" (Llama / Qwen2 / Mistral)");
  for (const char* key :
       {"model.context", "model.width", "model.hidden", "model.depth", "data.path"})
    if (c.has(key))
      c.fail("model.type", fmt::format("{} is a key of the byte-level MLP LM, which was removed: "
                                       "use the decoder's (docs/config.md) with data.tokenizer "
                                       "\"bytes\" (configs/quickstart.json)",
                                       key));
  return type;
}

std::shared_ptr<const RunModel> read_run_model(ConfigReader& c, int seq_len, std::uint64_t seed) {
  read_model_type(c);  // the decoder, the one there is
  return read_decoder_run(c, seq_len, seed);
}

}  // namespace shardswap
