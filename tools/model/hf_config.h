// The decoder's shape from a Hugging Face config.json (LlamaConfig, Qwen2Config, Qwen3Config,
// MistralConfig as transformers reads them, its defaults included) or from the same fields inline
// in ShardSwap's JSON config, and back to a config.json that transformers' from_pretrained loads.
// What the decoder does not implement is refused naming the field, never approximated.
#pragma once

#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>

#include "shardswap/dtype.h"
#include "model/decoder_compute.h"

namespace shardswap {

/// Where the fields come from, for messages: a config.json file ("PATH 'field'") or a section of
/// ShardSwap's config ("model.field" for the prefix "model.").
struct HfConfigSource {
  std::filesystem::path file;  ///< set for a config.json
  std::string prefix;          ///< used when `file` is empty
  /// The name of a field (`key` may be nested: "rope_scaling.factor") as messages show it.
  std::string field(std::string_view key) const;
};

/// The sequence length the model will be run at, for the checks that depend on it
/// (max_position_embeddings, sliding windows). value 0: none to check (a tool that only reads
/// or writes weights).
struct HfSeqLen {
  int value = 0;
  std::string key;  ///< the config key it comes from, e.g. "data.seq_len"
};

struct HfModelConfig {
  DecoderShape shape;
  std::optional<DType> dtype;  ///< [dtype] or [torch_dtype]: bfloat16, float16, float32
  /// The config.json as read (read_hf_config; empty from hf_config_from_json): its other
  /// fields, such as the token ids, for whoever passes them on.
  nlohmann::json fields;
};

/// The shape from `config`: model_type llama, qwen2, qwen3 or mistral; hidden_act "silu";
/// vocab_size, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads required;
/// num_key_value_heads (default num_attention_heads), head_dim (default hidden_size /
/// num_attention_heads; 128 for qwen3, as Qwen3Config), max_position_embeddings, rms_norm_eps and
/// tie_word_embeddings with transformers' defaults for the model_type; RoPE in either layout:
/// transformers 4's rope_theta + rope_scaling {rope_type | type, factor, low_freq_factor,
/// high_freq_factor, original_max_position_embeddings} or transformers 5's rope_parameters
/// {rope_type, rope_theta, ...}, rope_type default, linear or llama3 (rope_scaling wins over
/// rope_parameters, and a rope_theta inside the parameters over the top-level one, as in
/// transformers 5). Biases: qwen2 always q/k/v (never o, as transformers builds it); qwen3 q_norm
/// and k_norm always, attention_bias true refused (o_proj's bias); llama attention_bias or mlp_bias
/// true is refused (o_proj / MLP biases are not implemented); mistral none. Refused: sliding-window
/// attention in use at seq_len (mistral sliding_window < seq_len; qwen2 and qwen3
/// use_sliding_window with sliding_window < seq_len on some layer), seq_len above
/// max_position_embeddings. Other fields are ignored. Throws ConfigError "FIELD = VALUE: what is
/// wrong" (FIELD as `source` names it).
HfModelConfig hf_config_from_json(const nlohmann::json& config, const HfConfigSource& source,
                                  const HfSeqLen& seq_len);

/// Reads and parses `file` (a config.json); ConfigError naming the file when it is missing, not
/// a regular file, not JSON, not an object, or refused by hf_config_from_json.
HfModelConfig read_hf_config(const std::filesystem::path& file, const HfSeqLen& seq_len);

/// A config.json for `shape` with weights of `dtype` (bf16, fp16 or fp32): architectures,
/// model_type and every field above, the RoPE in both layouts (rope_parameters for
/// transformers 5, rope_theta + rope_scaling for 4; they agree), dtype and torch_dtype. Throws
/// ConfigError for a shape no config.json can describe (a qwen2 without q/k/v biases, a llama
/// or mistral with them, q/k norms outside qwen3, an invalid size) or another dtype.
nlohmann::json hf_config_to_json(const DecoderShape& shape, DType dtype);

}  // namespace shardswap
