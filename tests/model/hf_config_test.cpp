// Hugging Face config.json to DecoderShape and back: configs modelled on real checkpoints
// (Qwen2.5-0.5B, Qwen3-0.6B, Llama-3.2-1B, Mistral-7B-v0.1) in both RoPE layouts, transformers' defaults,
// and every refusal naming its field.
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "shardswap/error.h"
#include "tests/catch_compat.h"
#include "tests/support/scratch_folder.h"
#include "model/hf_config.h"

using namespace shardswap;
using nlohmann::json;
using test::contains;
using test::message_of;

namespace {

const HfConfigSource kFile{"/models/x/config.json", {}};
const HfSeqLen kSeq{1024, "data.seq_len"};

// Qwen/Qwen2.5-0.5B's config.json (transformers 4 layout).
const json kQwen = json::parse(R"({
  "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
  "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
  "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 24,
  "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24,
  "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
  "sliding_window": 32768, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
  "transformers_version": "4.40.1", "use_cache": true, "use_sliding_window": false,
  "vocab_size": 151936})");

// Qwen/Qwen3-0.6B's config.json: head_dim 128 with hidden_size / num_attention_heads = 64.
const json kQwen3 = json::parse(R"({
  "architectures": ["Qwen3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
  "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
  "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
  "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
  "rms_norm_eps": 1e-06, "rope_scaling": null, "rope_theta": 1000000, "sliding_window": null,
  "tie_word_embeddings": true, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
  "use_cache": true, "use_sliding_window": false, "vocab_size": 151936})");

// meta-llama/Llama-3.2-1B's config.json: llama3 RoPE scaling in rope_scaling.
const json kLlama = json::parse(R"({
  "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu",
  "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
  "max_position_embeddings": 131072, "mlp_bias": false, "model_type": "llama",
  "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
  "pretraining_tp": 1, "rms_norm_eps": 1e-05,
  "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "rope_theta": 500000.0, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
  "transformers_version": "4.45.0.dev0", "use_cache": true, "vocab_size": 128256})");

// The same model as transformers 5 saves it: rope_parameters, dtype.
const json kLlama5 = json::parse(R"({
  "architectures": ["LlamaForCausalLM"], "attention_bias": false, "head_dim": 64,
  "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 8192,
  "max_position_embeddings": 131072, "mlp_bias": false, "model_type": "llama",
  "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
  "rms_norm_eps": 1e-05,
  "rope_parameters": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                      "original_max_position_embeddings": 8192, "rope_theta": 500000.0,
                      "rope_type": "llama3"},
  "tie_word_embeddings": true, "dtype": "bfloat16", "transformers_version": "5.0.0",
  "vocab_size": 128256})");

// mistralai/Mistral-7B-v0.1's config.json: a sliding window of 4096.
const json kMistral = json::parse(R"({
  "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
  "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
  "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mistral",
  "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
  "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096,
  "tie_word_embeddings": false, "torch_dtype": "bfloat16", "transformers_version": "4.34.0.dev0",
  "use_cache": true, "vocab_size": 32000})");

HfModelConfig parse(const json& j, HfSeqLen seq = kSeq) {
  return hf_config_from_json(j, kFile, seq);
}

json with(json j, const std::string& key, const json& value) {
  j[key] = value;
  return j;
}
json without(json j, const std::string& key) {
  j.erase(key);
  return j;
}

std::string refusal(const json& j, HfSeqLen seq = kSeq) {
  return message_of<ConfigError>([&] { parse(j, seq); });
}

bool same(const DecoderShape& a, const DecoderShape& b) {
  return a.family == b.family && a.vocab == b.vocab && a.hidden == b.hidden &&
         a.intermediate == b.intermediate && a.layers == b.layers && a.heads == b.heads &&
         a.kv_heads == b.kv_heads && a.head_dim == b.head_dim &&
         a.max_positions == b.max_positions && a.rms_eps == b.rms_eps &&
         a.rope_theta == b.rope_theta && a.rope_scaling == b.rope_scaling &&
         a.rope_factor == b.rope_factor && a.rope_low_freq_factor == b.rope_low_freq_factor &&
         a.rope_high_freq_factor == b.rope_high_freq_factor &&
         a.rope_original_max_positions == b.rope_original_max_positions &&
         a.qkv_bias == b.qkv_bias && a.qk_norm == b.qk_norm && a.tied == b.tied;
}

}  // namespace

TEST_CASE("Qwen2.5-0.5B's config.json gives its shape, q/k/v biases and a tied head", "[hf]") {
  const auto c = parse(kQwen, {32768, "data.seq_len"});
  const auto& s = c.shape;
  CHECK(s.family == DecoderFamily::qwen2);
  CHECK(s.vocab == 151936);
  CHECK(s.hidden == 896);
  CHECK(s.intermediate == 4864);
  CHECK(s.layers == 24);
  CHECK(s.heads == 14);
  CHECK(s.kv_heads == 2);
  CHECK(s.head_dim == 64);
  CHECK(s.max_positions == 32768);
  CHECK(s.rms_eps == 1e-6);
  CHECK(s.rope_theta == 1e6);
  CHECK(s.rope_scaling == RopeScaling::none);
  CHECK(s.qkv_bias);
  CHECK(s.tied);
  REQUIRE(c.dtype.has_value());
  CHECK(*c.dtype == DType::bf16);
}

TEST_CASE("Llama-3.2-1B's llama3 RoPE scaling reads the same from both layouts", "[hf]") {
  const auto v4 = parse(kLlama).shape;
  CHECK(v4.family == DecoderFamily::llama);
  CHECK(v4.head_dim == 64);
  CHECK(v4.kv_heads == 8);
  CHECK(v4.rms_eps == 1e-5);
  CHECK(v4.rope_theta == 500000.0);
  CHECK(v4.rope_scaling == RopeScaling::llama3);
  CHECK(v4.rope_factor == 32.0);
  CHECK(v4.rope_low_freq_factor == 1.0);
  CHECK(v4.rope_high_freq_factor == 4.0);
  CHECK(v4.rope_original_max_positions == 8192);
  CHECK(!v4.qkv_bias);
  CHECK(v4.tied);
  const auto v5 = parse(kLlama5);
  CHECK(same(v4, v5.shape));
  CHECK(*v5.dtype == DType::bf16);
  // The older "type" key of rope_scaling names the type too.
  json old = kLlama;
  old["rope_scaling"].erase("rope_type");
  old["rope_scaling"]["type"] = "llama3";
  CHECK(same(v4, parse(old).shape));
  // transformers 5: rope_scaling wins over rope_parameters; the theta inside the parameters
  // wins over the top-level one.
  json both = with(kLlama5, "rope_scaling", kLlama["rope_scaling"]);
  both["rope_parameters"] = {{"rope_type", "default"}};
  both["rope_theta"] = 500000.0;
  CHECK(same(v4, parse(both).shape));
  json inner = with(kLlama5, "rope_theta", 1.0);
  CHECK(parse(inner).shape.rope_theta == 500000.0);
}

TEST_CASE("Mistral-7B-v0.1 is refused only where its sliding window is in use", "[hf]") {
  const auto s = parse(kMistral, {4096, "data.seq_len"}).shape;
  CHECK(s.family == DecoderFamily::mistral);
  CHECK(s.kv_heads == 8);
  CHECK(s.head_dim == 128);
  CHECK(!s.qkv_bias);
  CHECK(!s.tied);
  const auto m = refusal(kMistral, {4097, "data.seq_len"});
  CHECK(contains(m, "/models/x/config.json 'sliding_window' = 4096: sliding-window attention"));
  CHECK(contains(m, "data.seq_len = 4097"));
  // null: no window (Mistral v0.2 and later); absent: transformers' default of 4096.
  CHECK(parse(with(kMistral, "sliding_window", nullptr), {32768, "data.seq_len"}).shape.layers ==
        32);
  CHECK(contains(refusal(without(kMistral, "sliding_window"), {5000, "data.seq_len"}),
                 "'sliding_window': absent, so transformers' default of 4096 applies: "
                 "sliding-window attention is not implemented"));
}

TEST_CASE("a qwen2 sliding window counts only when enabled on some layer and shorter than seq_len",
          "[hf]") {
  const HfSeqLen long_seq{8192, "data.seq_len"};
  json q = with(kQwen, "sliding_window", 4096);
  CHECK(parse(q, long_seq).shape.layers == 24);  // use_sliding_window false
  q["use_sliding_window"] = true;
  // max_window_layers 24 of 24 layers: every layer has full attention.
  CHECK(parse(q, long_seq).shape.layers == 24);
  q["max_window_layers"] = 20;
  CHECK(contains(refusal(q, long_seq), "'sliding_window' = 4096: sliding-window attention"));
  CHECK(parse(q, {4096, "data.seq_len"}).shape.layers == 24);  // the window covers the sequence
  // layer_types, as transformers 5 saves it, decides instead of max_window_layers.
  json types = json::array();
  for (int i = 0; i < 24; ++i) types.push_back("full_attention");
  q["layer_types"] = types;
  CHECK(parse(q, long_seq).shape.layers == 24);
  q["layer_types"][23] = "sliding_attention";
  CHECK(contains(refusal(q, long_seq), "'sliding_window' = 4096"));
  q["layer_types"][23] = "chunked_attention";
  CHECK(contains(refusal(q, long_seq), "'layer_types' = "));
}

TEST_CASE("transformers' defaults fill what config.json leaves out, null included", "[hf]") {
  json q = without(without(without(kQwen, "max_position_embeddings"), "rms_norm_eps"),
                   "tie_word_embeddings");
  q = without(without(q, "rope_theta"), "torch_dtype");
  q["num_attention_heads"] = 32;
  q["hidden_size"] = 2048;
  q = without(q, "num_key_value_heads");
  const auto c = parse(q);
  CHECK(c.shape.max_positions == 32768);
  CHECK(c.shape.rms_eps == 1e-6);
  CHECK(!c.shape.tied);
  CHECK(c.shape.rope_theta == 10000.0);
  CHECK(c.shape.kv_heads == 32);  // Qwen2Config's default, not num_attention_heads
  CHECK(c.shape.head_dim == 64);
  CHECK(!c.dtype.has_value());
  // null: num_attention_heads, as the configs' __post_init__ sets it.
  CHECK(parse(with(kMistral, "num_key_value_heads", nullptr), {16, "s"}).shape.kv_heads == 32);
  CHECK(parse(without(kMistral, "num_key_value_heads"), {16, "s"}).shape.kv_heads == 8);
  CHECK(parse(without(kLlama, "num_key_value_heads")).shape.kv_heads == 32);
  CHECK(parse(without(kLlama, "max_position_embeddings")).shape.max_positions == 2048);
  CHECK(parse(without(kMistral, "max_position_embeddings"), {16, "s"}).shape.max_positions ==
        131072);
  // An explicit head_dim other than hidden_size / num_attention_heads (Qwen2 reads it too).
  CHECK(parse(with(kQwen, "head_dim", 128)).shape.head_dim == 128);
}

TEST_CASE("each refused config.json field is named with its value and the file", "[hf]") {
  CHECK(refusal(with(kQwen, "model_type", "gpt2")) ==
        "/models/x/config.json 'model_type' = \"gpt2\": unsupported model type; supported: "
        "llama, qwen2, qwen3, mistral");
  CHECK(contains(refusal(without(kQwen, "model_type")), "'model_type': missing"));
  CHECK(contains(refusal(with(kQwen, "hidden_act", "gelu")), "'hidden_act' = \"gelu\""));
  CHECK(contains(refusal(without(kQwen, "hidden_size")), "'hidden_size': missing; required"));
  CHECK(contains(refusal(with(kQwen, "vocab_size", 0)), "'vocab_size' = 0: must be in [1,"));
  CHECK(contains(refusal(with(kQwen, "vocab_size", -3)), "'vocab_size' = -3"));
  CHECK(contains(refusal(with(kQwen, "vocab_size", 1.5)), "'vocab_size' = 1.5: not an integer"));
  CHECK(contains(refusal(with(kQwen, "intermediate_size", "4864")),
                 "'intermediate_size' = \"4864\": not an integer"));
  CHECK(contains(refusal(with(kQwen, "num_hidden_layers", 5000000000LL)), "'num_hidden_layers'"));
  CHECK(contains(refusal(with(kQwen, "num_key_value_heads", 3)),
                 "'num_key_value_heads' = 3: must divide num_attention_heads = 14"));
  CHECK(contains(refusal(with(kQwen, "head_dim", 63)), "'head_dim' = 63: must be even"));
  CHECK(contains(refusal(with(kQwen, "hidden_size", 900)),
                 "'num_attention_heads' = 14: does not divide hidden_size = 900"));
  CHECK(contains(refusal(with(kLlama, "hidden_size", 2050)), "'num_attention_heads' = 32"));
  CHECK(contains(refusal(with(kQwen, "rms_norm_eps", 0)), "'rms_norm_eps' = 0"));
  CHECK(contains(refusal(with(kQwen, "rope_theta", -1.0)), "'rope_theta' = -1.0"));
  CHECK(contains(refusal(with(kQwen, "tie_word_embeddings", 1)), "'tie_word_embeddings' = 1"));
  CHECK(contains(refusal(with(kLlama, "attention_bias", true)),
                 "'attention_bias' = true: biases on the attention projections"));
  CHECK(contains(refusal(with(kLlama, "mlp_bias", true)), "'mlp_bias' = true"));
  CHECK(contains(refusal(with(kQwen, "torch_dtype", "float64")), "'torch_dtype' = \"float64\""));
  CHECK(contains(refusal(kQwen, {40000, "data.seq_len"}),
                 "'max_position_embeddings' = 32768: below data.seq_len = 40000"));
  // RoPE.
  json r = kLlama;
  r["rope_scaling"]["rope_type"] = "yarn";
  CHECK(contains(refusal(r),
                 "'rope_scaling.rope_type' = \"yarn\": unsupported RoPE type; "
                 "supported: default, linear, llama3"));
  r = kLlama5;
  r["rope_parameters"]["rope_type"] = "dynamic";
  CHECK(contains(refusal(r), "'rope_parameters.rope_type' = \"dynamic\""));
  r = kLlama;
  r["rope_scaling"].erase("low_freq_factor");
  CHECK(contains(refusal(r), "'rope_scaling.low_freq_factor': missing"));
  r = kLlama;
  r["rope_scaling"]["high_freq_factor"] = 0.5;
  CHECK(contains(refusal(r), "'rope_scaling.high_freq_factor' = 0.5: must be above"));
  r = kLlama5;
  r["rope_parameters"]["rope_theta"] = "big";
  CHECK(contains(refusal(r), "'rope_parameters.rope_theta' = \"big\": not a number"));
  CHECK(contains(refusal(with(kLlama, "rope_scaling", 3)), "'rope_scaling' = 3: not an object"));
  CHECK(contains(refusal(with(kLlama, "partial_rotary_factor", 0.5)),
                 "'partial_rotary_factor' = 0.5"));
  r = kLlama5;
  r["rope_parameters"] = {{"full_attention", {{"rope_type", "default"}}}};
  CHECK(contains(refusal(r), "'rope_parameters.full_attention'"));
  r = kLlama;
  r["rope_scaling"] = {{"rope_type", "linear"}};
  CHECK(contains(refusal(r), "'rope_scaling.factor': missing"));
  r["rope_scaling"]["factor"] = 2.0;
  CHECK(parse(r).shape.rope_scaling == RopeScaling::linear);
  CHECK(parse(r).shape.rope_factor == 2.0);
}

TEST_CASE("the same fields inline in ShardSwap's config are named by their key", "[hf]") {
  const HfConfigSource inline_source{{}, "model."};
  json m = {{"model_type", "llama"},    {"vocab_size", 256},      {"hidden_size", 64},
            {"intermediate_size", 160}, {"num_hidden_layers", 2}, {"num_attention_heads", 4},
            {"num_key_value_heads", 2}, {"seq_len", 128},         {"path", nullptr}};
  const auto s = hf_config_from_json(m, inline_source, {128, "model.seq_len"}).shape;
  CHECK(s.vocab == 256);
  CHECK(s.head_dim == 16);
  CHECK(s.max_positions == 2048);
  m["model_type"] = "bert";
  CHECK(message_of<ConfigError>([&] {
          hf_config_from_json(m, inline_source, {128, "model.seq_len"});
        }) ==
        "model.model_type = \"bert\": unsupported model type; supported: llama, qwen2, "
        "qwen3, mistral");
  CHECK(message_of<ConfigError>([&] { hf_config_from_json(json::array(), inline_source, {}); }) ==
        "model: not a JSON object");
}

TEST_CASE("config.json written for a shape reads back as that shape", "[hf]") {
  for (const json* j : {&kQwen, &kQwen3, &kLlama, &kMistral}) {
    auto s = parse(*j, {16, "s"}).shape;
    for (const DType dtype : {DType::bf16, DType::f16, DType::f32}) {
      const json out = hf_config_to_json(s, dtype);
      const auto back = parse(out, {32768, "s"});
      CHECK(same(s, back.shape));
      CHECK(*back.dtype == dtype);
      CHECK(out.at("architectures").size() == 1);
      // Both RoPE layouts agree: rope_parameters alone reads the same.
      CHECK(same(s, parse(without(without(out, "rope_scaling"), "rope_theta"), {16, "s"}).shape));
      CHECK(same(s, parse(without(out, "rope_parameters"), {16, "s"}).shape));
    }
  }
  auto s = parse(kLlama).shape;
  const json out = hf_config_to_json(s, DType::bf16);
  CHECK(out.at("architectures")[0] == "LlamaForCausalLM");
  CHECK(out.at("rope_parameters").at("rope_type") == "llama3");
  CHECK(out.at("rope_parameters").at("rope_theta") == 500000.0);
  CHECK(out.at("rope_scaling").at("original_max_position_embeddings") == 8192);
  CHECK(out.at("torch_dtype") == "bfloat16");
  CHECK(out.at("dtype") == "bfloat16");
  s.qkv_bias = true;
  CHECK(contains(message_of<ConfigError>([&] { hf_config_to_json(s, DType::bf16); }),
                 "hf_config_to_json: q/k/v biases"));
  s.qkv_bias = false;
  CHECK(contains(message_of<ConfigError>([&] { hf_config_to_json(s, DType::f64); }),
                 "hf_config_to_json: dtype fp64"));
  auto q = parse(kQwen).shape;
  q.qkv_bias = false;
  CHECK(contains(message_of<ConfigError>([&] { hf_config_to_json(q, DType::bf16); }),
                 "a qwen2 always has q/k/v biases"));
  auto q3 = parse(kQwen3).shape;
  CHECK(hf_config_to_json(q3, DType::bf16).at("architectures")[0] == "Qwen3ForCausalLM");
  CHECK(hf_config_to_json(q3, DType::bf16).at("attention_bias") == false);
  q3.qk_norm = false;
  CHECK(contains(message_of<ConfigError>([&] { hf_config_to_json(q3, DType::bf16); }),
                 "a qwen3 always has q/k norms"));
  s.qk_norm = true;
  CHECK(contains(message_of<ConfigError>([&] { hf_config_to_json(s, DType::bf16); }),
                 "q/k norms exist only in qwen3"));
}

TEST_CASE("a Qwen3 config.json: q/k norms, no biases, head_dim apart from hidden / heads", "[hf]") {
  const DecoderShape s = parse(kQwen3).shape;
  CHECK(s.family == DecoderFamily::qwen3);
  CHECK(s.qk_norm);
  CHECK(!s.qkv_bias);
  CHECK(s.head_dim == 128);  // not 1024 / 16
  CHECK(s.q_width() == 2048);
  CHECK(s.kv_heads == 8);
  CHECK(s.max_positions == 40960);
  CHECK(s.rope_theta == 1e6);
  CHECK(s.tied);
  // Qwen3Config's own default head_dim is 128, whatever hidden / heads is.
  CHECK(parse(without(kQwen3, "head_dim")).shape.head_dim == 128);
  CHECK(parse(with(kQwen3, "hidden_size", 1000)).shape.head_dim == 128);
  // attention_bias puts a bias on o_proj too, which the decoder does not have.
  CHECK(contains(refusal(with(kQwen3, "attention_bias", true)),
                 "'attention_bias' = true: biases on the attention projections"));
  // Sliding windows as in Qwen2: in use only with use_sliding_window, from max_window_layers up.
  CHECK(contains(refusal(with(with(with(kQwen3, "use_sliding_window", true), "sliding_window", 512),
                              "max_window_layers", 4)),
                 "sliding-window attention is not implemented"));
  CHECK(parse(with(with(with(kQwen3, "use_sliding_window", true), "sliding_window", 512),
                   "max_window_layers", 28))
            .shape.qk_norm);
}

TEST_CASE("read_hf_config names the file that is missing, not JSON or refused", "[hf]") {
  const test_support::ScratchFolder folder("hf-config");
  const auto file = folder / "config.json";
  CHECK(message_of<ConfigError>([&] { read_hf_config(file, kSeq); }) ==
        file.string() + ": no such file");
  std::ofstream(file) << "{\"model_type\": ";
  CHECK(contains(message_of<ConfigError>([&] { read_hf_config(file, kSeq); }),
                 file.string() + ":1:16: not valid JSON: "));
  std::ofstream(file, std::ios::trunc) << "[1]";
  CHECK(message_of<ConfigError>([&] { read_hf_config(file, kSeq); }) ==
        file.string() + ": not a JSON object");
  std::ofstream(file, std::ios::trunc) << with(kQwen, "model_type", "gpt2").dump();
  CHECK(contains(message_of<ConfigError>([&] { read_hf_config(file, kSeq); }),
                 file.string() + " 'model_type' = \"gpt2\""));
  std::ofstream(file, std::ios::trunc) << kQwen.dump();
  CHECK(read_hf_config(file, kSeq).shape.hidden == 896);
  CHECK(contains(message_of<ConfigError>([&] { read_hf_config(folder.path(), kSeq); }),
                 "not a regular file (a directory)"));
}

TEST_CASE("a config.json larger than 16 MiB is refused from its size, before it is read", "[hf]") {
  // A 1 GiB one (sparse here) was read whole: 2.2 GB of memory, then parsed.
  const test_support::ScratchFolder folder("hf-config-size");
  const auto file = folder / "config.json";
  std::ofstream(file) << kQwen.dump();
  std::filesystem::resize_file(file, std::uintmax_t{1} << 30);
  CHECK(message_of<ConfigError>([&] { read_hf_config(file, kSeq); }) ==
        file.string() +
            ": larger than 16 MiB (16777216 bytes), the most a Hugging Face config.json may hold: "
            "it has 1073741824 bytes");
}

TEST_CASE(
    "a default that does not fit an absent field is refused naming the field, not with the "
    "JSON library's text",
    "[hf]") {
  // Mistral's default of 8 key/value heads with 4 attention heads: the refusal looked the absent
  // field up to show its value (found by tests/fuzz/hf_config_fuzz.cpp).
  const auto mistral = without(with(kMistral, "num_attention_heads", 4), "num_key_value_heads");
  const auto m = refusal(mistral);
  CAPTURE(m);
  CHECK(m ==
        "/models/x/config.json 'num_key_value_heads': not in the file, and its default for the "
        "model_type "
        "must divide num_attention_heads = 4");
}
