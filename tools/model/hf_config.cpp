#include "model/hf_config.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>

#include <cerrno>
#include <climits>
#include <cmath>
#include <cstring>
#include <tuple>

#include "support/file_kind.h"
#include "support/quoted.h"
#include "shardswap/error.h"
#include "model/decoder.h"
#include "shardswap/json_reader.h"

namespace shardswap {

namespace fs = std::filesystem;
using nlohmann::json;

std::string HfConfigSource::field(std::string_view key) const {
  if (!file.empty()) return fmt::format("{} '{}'", file.string(), key);
  return fmt::format("{}{}", prefix, key);
}

namespace {

// transformers' defaults where config.json leaves a field out (LlamaConfig, Qwen2Config,
// Qwen3Config, MistralConfig of transformers 5).
struct FamilyDefaults {
  std::string_view model_type;
  DecoderFamily family;
  int max_positions;
  std::optional<int> kv_heads;  ///< empty: num_attention_heads
  std::optional<int> head_dim;  ///< empty: hidden_size / num_attention_heads
};
constexpr FamilyDefaults kFamilies[] = {
    {"llama", DecoderFamily::llama, 2048, std::nullopt, std::nullopt},
    {"qwen2", DecoderFamily::qwen2, 32768, 32, std::nullopt},
    {"qwen3", DecoderFamily::qwen3, 32768, 32, 128},
    {"mistral", DecoderFamily::mistral, 4096 * 32, 8, std::nullopt},
};
constexpr std::string_view kSupportedTypes = "supported: llama, qwen2, qwen3, mistral";
constexpr double kDefaultTheta = 10000.0;
// The largest config.json read: real ones are a few KiB (a classifier's label names make some
// larger), so this only bounds the memory a hostile one takes.
constexpr std::size_t kMaxHfConfigBytes = std::size_t{16} << 20;
constexpr double kDefaultRmsEps = 1e-6;
constexpr int kMistralSlidingWindow = 4096;
constexpr int kQwen2SlidingWindow = 4096;
constexpr int kQwen2MaxWindowLayers = 28;

std::string value_text(const json& v) {
  return v.is_string() ? quote_value(v.get<std::string>()) : v.dump();
}

// Reads the fields of one JSON object, naming them through `source` under `path` (the object's
// own key path: "" for the top, "rope_scaling." for a nested one).
class Fields {
 public:
  Fields(const json& object, const HfConfigSource& source, std::string path = "")
      : object_(object), source_(source), path_(std::move(path)) {}

  std::string name(std::string_view key) const {
    return source_.field(fmt::format("{}{}", path_, key));
  }
  [[noreturn]] void refuse(std::string_view key, std::string_view why) const {
    // An absent field refused is its default that does not fit (a Mistral's 8 key/value heads
    // with 4 attention heads; found by tests/fuzz/hf_config_fuzz.cpp).
    const auto it = object_.find(key);
    if (it == object_.end())
      throw ConfigError(fmt::format("{}: not in the file, and its default for the model_type {}",
                                    name(key), why));
    throw ConfigError(fmt::format("{} = {}: {}", name(key), value_text(*it), why));
  }
  [[noreturn]] void refuse_missing(std::string_view key, std::string_view why) const {
    throw ConfigError(fmt::format("{}: missing; {}", name(key), why));
  }
  // null counts as absent, as transformers reads it (a default applies).
  bool present(std::string_view key) const { return object_.contains(key); }
  bool has(std::string_view key) const {
    const auto it = object_.find(key);
    return it != object_.end() && !it->is_null();
  }
  const json& at(std::string_view key) const { return object_.at(key); }

  int integer(std::string_view key, std::optional<int> fallback, int min) const {
    if (!has(key)) {
      if (!fallback) refuse_missing(key, "required");
      return *fallback;
    }
    const json& v = at(key);
    if (!v.is_number_integer()) refuse(key, "not an integer");
    const bool above =
        v.is_number_unsigned() ? v.get<std::uint64_t>() > INT_MAX : v.get<std::int64_t>() > INT_MAX;
    if (above || v.get<std::int64_t>() < min)
      refuse(key, fmt::format("must be in [{}, {}]", min, INT_MAX));
    return v.get<int>();
  }
  double positive(std::string_view key, std::optional<double> fallback) const {
    if (!has(key)) {
      if (!fallback) refuse_missing(key, "required");
      return *fallback;
    }
    const json& v = at(key);
    if (!v.is_number()) refuse(key, "not a number");
    const double x = v.get<double>();
    if (!(std::isfinite(x) && x > 0.0)) refuse(key, "must be a finite number above 0");
    return x;
  }
  bool boolean(std::string_view key, bool fallback) const {
    if (!has(key)) return fallback;
    if (!at(key).is_boolean()) refuse(key, "not true or false");
    return at(key).get<bool>();
  }
  std::optional<std::string> string(std::string_view key) const {
    if (!has(key)) return std::nullopt;
    if (!at(key).is_string()) refuse(key, "not a string");
    return at(key).get<std::string>();
  }

 private:
  const json& object_;
  const HfConfigSource& source_;
  std::string path_;
};

void read_rope(const Fields& top, const json& config, const HfConfigSource& source,
               DecoderShape& s) {
  // transformers 5 takes a legacy rope_scaling over rope_parameters, and a rope_theta inside the
  // parameters over the top-level one (PreTrainedConfig.convert_rope_params_to_dict).
  std::string key;
  if (top.has("rope_scaling"))
    key = "rope_scaling";
  else if (top.has("rope_parameters"))
    key = "rope_parameters";
  static const json kEmpty = json::object();
  if (!key.empty() && !config.at(key).is_object()) top.refuse(key, "not an object");
  const json& params = key.empty() ? kEmpty : config.at(key);
  const Fields rope(params, source, key.empty() ? "" : key + ".");
  for (const char* layer_type : {"full_attention", "sliding_attention"})
    if (params.contains(layer_type))
      rope.refuse(layer_type, "RoPE parameters per layer type are not supported");

  const char* type_key = rope.has("rope_type") ? "rope_type" : "type";
  const std::string type = rope.string(type_key).value_or("default");
  s.rope_theta = rope.has("rope_theta") ? rope.positive("rope_theta", std::nullopt)
                                        : top.positive("rope_theta", kDefaultTheta);
  for (const Fields* f : {&rope, &top})
    if (f->has("partial_rotary_factor") && !(f->at("partial_rotary_factor").is_number() &&
                                             f->at("partial_rotary_factor").get<double>() == 1.0))
      f->refuse("partial_rotary_factor", "RoPE on part of a head is not implemented (only 1.0)");

  if (type == "default") {
    s.rope_scaling = RopeScaling::none;
  } else if (type == "linear") {
    s.rope_scaling = RopeScaling::linear;
    s.rope_factor = rope.positive("factor", std::nullopt);
  } else if (type == "llama3") {
    s.rope_scaling = RopeScaling::llama3;
    s.rope_factor = rope.positive("factor", std::nullopt);
    s.rope_low_freq_factor = rope.positive("low_freq_factor", std::nullopt);
    s.rope_high_freq_factor = rope.positive("high_freq_factor", std::nullopt);
    s.rope_original_max_positions =
        rope.integer("original_max_position_embeddings", std::nullopt, 1);
    if (!(s.rope_high_freq_factor > s.rope_low_freq_factor))
      rope.refuse("high_freq_factor",
                  fmt::format("must be above low_freq_factor = {}", s.rope_low_freq_factor));
  } else {
    rope.refuse(type_key, "unsupported RoPE type; supported: default, linear, llama3");
  }
}

// Whether sliding-window attention changes anything at `seq_len`: a position attends to the
// `window` positions ending at itself, so a window of at least seq_len is full attention.
bool window_in_use(int window, const HfSeqLen& seq_len) {
  return seq_len.value > 0 && window < seq_len.value;
}

// The window of a field that may be absent (transformers' default `absent`), null (none) or an
// integer.
std::optional<int> window_of(const Fields& f, std::string_view key, int absent) {
  if (!f.present(key)) return absent;
  if (f.at(key).is_null()) return std::nullopt;
  return f.integer(key, std::nullopt, 1);
}

void check_sliding_window(const Fields& f, const DecoderShape& s, int layers,
                          const HfSeqLen& seq_len) {
  const auto refuse = [&](int window) {
    const auto why = fmt::format(
        "sliding-window attention is not implemented, and a window of "
        "{} would be in use at {} = {}",
        window, seq_len.key, seq_len.value);
    if (f.present("sliding_window")) f.refuse("sliding_window", why);
    throw ConfigError(fmt::format("{}: absent, so transformers' default of {} applies: {}",
                                  f.name("sliding_window"), window, why));
  };
  if (s.family == DecoderFamily::mistral) {
    const auto window = window_of(f, "sliding_window", kMistralSlidingWindow);
    if (window && window_in_use(*window, seq_len)) refuse(*window);
    return;
  }
  // Llama has no sliding window
  if (s.family != DecoderFamily::qwen2 && s.family != DecoderFamily::qwen3) return;
  // Qwen2Config and Qwen3Config: the window applies only with use_sliding_window, to the layers
  // layer_types
  // marks "sliding_attention" (by default those from max_window_layers up).
  if (!f.boolean("use_sliding_window", false)) return;
  const auto window = window_of(f, "sliding_window", kQwen2SlidingWindow);
  if (!window) return;
  bool some_layer = false;
  if (f.has("layer_types")) {
    const json& types = f.at("layer_types");
    if (!types.is_array() || types.size() != static_cast<std::size_t>(layers))
      f.refuse("layer_types", fmt::format("not a list of num_hidden_layers = {} names", layers));
    for (const auto& t : types) {
      if (t != "full_attention" && t != "sliding_attention")
        f.refuse("layer_types",
                 fmt::format("{}: supported: full_attention, sliding_attention", value_text(t)));
      some_layer = some_layer || t == "sliding_attention";
    }
  } else {
    some_layer = f.integer("max_window_layers", kQwen2MaxWindowLayers, 0) < layers;
  }
  if (some_layer && window_in_use(*window, seq_len)) refuse(*window);
}

const FamilyDefaults& family_of(const Fields& f) {
  const auto type = f.string("model_type");
  if (!type) f.refuse_missing("model_type", kSupportedTypes);
  for (const auto& d : kFamilies)
    if (d.model_type == *type) return d;
  f.refuse("model_type", fmt::format("unsupported model type; {}", kSupportedTypes));
}

std::optional<DType> dtype_field(const Fields& f) {
  for (const char* key : {"dtype", "torch_dtype"}) {
    const auto name = f.string(key);
    if (!name) continue;
    if (*name == "bfloat16") return DType::bf16;
    if (*name == "float16") return DType::f16;
    if (*name == "float32") return DType::f32;
    f.refuse(key, "unsupported dtype; supported: bfloat16, float16, float32");
  }
  return std::nullopt;
}

const char* torch_dtype_name(DType t) {
  switch (t) {
    case DType::bf16:
      return "bfloat16";
    case DType::f16:
      return "float16";
    case DType::f32:
      return "float32";
    case DType::f64:
      break;
  }
  throw ConfigError(
      fmt::format("hf_config_to_json: dtype {}: a Hugging Face checkpoint holds "
                  "bf16, fp16 or fp32 weights",
                  dtype_name(t)));
}

// What messages about the whole of a config name: the file, or the prefix of the inline keys.
std::string where(const HfConfigSource& source) {
  std::string name = source.file.empty() ? source.prefix : source.file.string();
  if (name.ends_with('.')) name.pop_back();
  return name;
}

// The sizes against DecoderShapeLimits, naming the key, before anything is made from them (a
// param list of num_hidden_layers = 1000000000 would take gigabytes before any other check).
void check_limits(const Fields& f, const DecoderShape& s) {
  using Limits = DecoderShapeLimits;
  const auto above = [](std::int64_t most) {
    return fmt::format("above {}, the most ShardSwap accepts", most);
  };
  const std::tuple<const char*, int, int> sizes[] = {
      {"vocab_size", s.vocab, Limits::vocab},
      {"hidden_size", s.hidden, Limits::hidden},
      {"intermediate_size", s.intermediate, Limits::intermediate},
      {"num_hidden_layers", s.layers, Limits::layers},
      {"num_attention_heads", s.heads, Limits::heads}};
  for (const auto& [key, value, most] : sizes)
    if (value > most) f.refuse(key, above(most));
  if (s.head_dim > Limits::head_dim) {
    if (f.has("head_dim")) f.refuse("head_dim", above(Limits::head_dim));
    f.refuse("num_attention_heads",
             fmt::format("gives head_dim = hidden_size / num_attention_heads = {}: {}", s.head_dim,
                         above(Limits::head_dim)));
  }
  // Without a head_dim the width is hidden_size, within its limit.
  if (s.q_width() > Limits::q_width)
    f.refuse("head_dim", fmt::format("num_attention_heads x head_dim = {} x {} = {}: {}", s.heads,
                                     s.head_dim, s.q_width(), above(Limits::q_width)));
  DecoderShape counted = s;
  counted.qkv_bias = s.family == DecoderFamily::qwen2;
  counted.qk_norm = s.family == DecoderFamily::qwen3;
  counted.tied = f.boolean("tie_word_embeddings", false);
  if (const auto params = decoder_param_count_unchecked(counted); params > Limits::params)
    throw ConfigError(
        fmt::format("{} = {} (hidden_size = {}, intermediate_size = {}, vocab_size = {}): {} "
                    "params, {}",
                    f.name("num_hidden_layers"), s.layers, s.hidden, s.intermediate, s.vocab,
                    params, above(Limits::params)));
}

}  // namespace

HfModelConfig hf_config_from_json(const json& config, const HfConfigSource& source,
                                  const HfSeqLen& seq_len) {
  if (!config.is_object()) throw ConfigError(fmt::format("{}: not a JSON object", where(source)));
  const Fields f(config, source);
  const FamilyDefaults& family = family_of(f);
  HfModelConfig out;
  DecoderShape& s = out.shape;
  s.family = family.family;
  if (const auto act = f.string("hidden_act"); act && *act != "silu")
    f.refuse("hidden_act", "unsupported activation; the MLP is SwiGLU: only \"silu\"");
  s.vocab = f.integer("vocab_size", std::nullopt, 1);
  s.hidden = f.integer("hidden_size", std::nullopt, 1);
  s.intermediate = f.integer("intermediate_size", std::nullopt, 1);
  s.layers = f.integer("num_hidden_layers", std::nullopt, 1);
  s.heads = f.integer("num_attention_heads", std::nullopt, 1);
  s.kv_heads =
      f.integer("num_key_value_heads",
                f.present("num_key_value_heads") ? s.heads : family.kv_heads.value_or(s.heads), 1);
  if (s.heads % s.kv_heads != 0)
    f.refuse("num_key_value_heads", fmt::format("must divide num_attention_heads = {}", s.heads));
  // LlamaConfig refuses a hidden size that is no multiple of the heads even with a head_dim;
  // Qwen3Config's head_dim has a default of its own (128).
  const bool head_dim_given = f.has("head_dim") || family.head_dim.has_value();
  if ((!head_dim_given || s.family == DecoderFamily::llama) && s.hidden % s.heads != 0)
    f.refuse("num_attention_heads", fmt::format("does not divide hidden_size = {}", s.hidden));
  s.head_dim = f.integer("head_dim", family.head_dim.value_or(s.hidden / s.heads), 1);
  if (s.head_dim % 2 != 0) {
    if (f.has("head_dim")) f.refuse("head_dim", "must be even (RoPE rotates pairs)");
    throw ConfigError(fmt::format(
        "{} = {} / {} = {} = {}: the head size must be even (RoPE "
        "rotates pairs)",
        f.name("hidden_size"), s.hidden, f.name("num_attention_heads"), s.heads, s.head_dim));
  }
  check_limits(f, s);
  s.max_positions = f.integer("max_position_embeddings", family.max_positions, 1);
  s.rms_eps = f.positive("rms_norm_eps", kDefaultRmsEps);
  s.tied = f.boolean("tie_word_embeddings", false);
  read_rope(f, config, source, s);

  switch (s.family) {
    case DecoderFamily::qwen2:
      s.qkv_bias = true;  // Qwen2Attention always builds q/k/v with a bias and o without
      break;
    case DecoderFamily::qwen3:
      // Qwen3Attention: q_norm and k_norm always; attention_bias puts biases on all four
      // projections, o_proj's included.
      if (f.boolean("attention_bias", false))
        f.refuse("attention_bias",
                 "biases on the attention projections (o_proj's included) are "
                 "not implemented");
      s.qkv_bias = false;
      s.qk_norm = true;
      break;
    case DecoderFamily::llama:
      if (f.boolean("attention_bias", false))
        f.refuse("attention_bias",
                 "biases on the attention projections (o_proj's included) are "
                 "not implemented");
      if (f.boolean("mlp_bias", false))
        f.refuse("mlp_bias", "biases on the MLP projections are not implemented");
      s.qkv_bias = false;
      break;
    case DecoderFamily::mistral:
      s.qkv_bias = false;  // MistralAttention has no biases
      break;
  }
  check_sliding_window(f, s, s.layers, seq_len);
  if (seq_len.value > s.max_positions)
    f.refuse("max_position_embeddings", fmt::format("below {} = {}", seq_len.key, seq_len.value));
  // The decoder's own rules, which the checks above apply key by key to name the key: whatever
  // they let through, the decoder would refuse later, so it is refused here, naming the file.
  validate_decoder_shape(s, where(source));
  out.dtype = dtype_field(f);
  return out;
}

HfModelConfig read_hf_config(const fs::path& file, const HfSeqLen& seq_len) {
  const auto refuse = [&](std::string_view why) {
    return ConfigError(fmt::format("{}: {}", file.string(), why));
  };
  struct stat st {};
  if (::stat(file.c_str(), &st) != 0)
    throw refuse(errno == ENOENT ? std::string("no such file")
                                 : fmt::format("cannot be read: {}", std::strerror(errno)));
  if (!S_ISREG(st.st_mode))
    throw refuse(fmt::format("not a regular file ({})", file_kind(st.st_mode)));
  // Read whole (to its size: a NUL byte is refused, not taken for the end) through the bounded
  // reader: at most kMaxHfConfigBytes, nested at most 64 deep (a real one is 3 deep).
  const json config = read_json_file(file, JsonLimits{64, kMaxHfConfigBytes, "a config.json"},
                                     "Hugging Face config.json");
  if (!config.is_object()) throw refuse("not a JSON object");
  HfModelConfig read = hf_config_from_json(config, HfConfigSource{file, {}}, seq_len);
  read.fields = config;
  return read;
}

json hf_config_to_json(const DecoderShape& s, DType dtype) {
  const auto refuse = [](std::string_view why) {
    return ConfigError(fmt::format("hf_config_to_json: {}", why));
  };
  const char* torch_dtype = torch_dtype_name(dtype);
  validate_decoder_shape(s, "hf_config_to_json");
  if (s.family == DecoderFamily::llama && s.hidden % s.heads != 0)
    throw refuse(
        fmt::format("a llama of hidden size {} and {} heads: transformers refuses a "
                    "hidden size that is no multiple of the heads",
                    s.hidden, s.heads));
  if (s.qkv_bias != (s.family == DecoderFamily::qwen2))
    throw refuse(s.qkv_bias ? "q/k/v biases without o_proj's exist only in qwen2"
                            : "a qwen2 always has q/k/v biases");
  if (s.qk_norm != (s.family == DecoderFamily::qwen3))
    throw refuse(s.qk_norm ? "q/k norms exist only in qwen3" : "a qwen3 always has q/k norms");
  const char* model_type = "mistral";
  const char* architecture = "MistralForCausalLM";
  switch (s.family) {
    case DecoderFamily::llama:
      model_type = "llama", architecture = "LlamaForCausalLM";
      break;
    case DecoderFamily::qwen2:
      model_type = "qwen2", architecture = "Qwen2ForCausalLM";
      break;
    case DecoderFamily::qwen3:
      model_type = "qwen3", architecture = "Qwen3ForCausalLM";
      break;
    case DecoderFamily::mistral:
      break;
  }
  json rope = {{"rope_type", "default"}};
  if (s.rope_scaling == RopeScaling::linear) {
    rope = {{"rope_type", "linear"}, {"factor", s.rope_factor}};
  } else if (s.rope_scaling == RopeScaling::llama3) {
    rope = {{"rope_type", "llama3"},
            {"factor", s.rope_factor},
            {"low_freq_factor", s.rope_low_freq_factor},
            {"high_freq_factor", s.rope_high_freq_factor},
            {"original_max_position_embeddings", s.rope_original_max_positions}};
  }
  json parameters = rope;
  parameters["rope_theta"] = s.rope_theta;
  json c = {{"architectures", {architecture}},
            {"model_type", model_type},
            {"vocab_size", s.vocab},
            {"hidden_size", s.hidden},
            {"intermediate_size", s.intermediate},
            {"num_hidden_layers", s.layers},
            {"num_attention_heads", s.heads},
            {"num_key_value_heads", s.kv_heads},
            {"head_dim", s.head_dim},
            {"hidden_act", "silu"},
            {"max_position_embeddings", s.max_positions},
            {"rms_norm_eps", s.rms_eps},
            {"tie_word_embeddings", s.tied},
            {"rope_theta", s.rope_theta},
            {"rope_scaling", s.rope_scaling == RopeScaling::none ? json(nullptr) : rope},
            {"rope_parameters", parameters},
            {"dtype", torch_dtype},
            {"torch_dtype", torch_dtype}};
  switch (s.family) {
    case DecoderFamily::llama:
      c["attention_bias"] = false;
      c["mlp_bias"] = false;
      break;
    case DecoderFamily::qwen3:
      c["attention_bias"] = false;
      [[fallthrough]];
    case DecoderFamily::qwen2:
      c["use_sliding_window"] = false;
      c["sliding_window"] = nullptr;
      c["max_window_layers"] = s.layers;
      break;
    case DecoderFamily::mistral:
      c["sliding_window"] = nullptr;
      break;
  }
  return c;
}

}  // namespace shardswap
