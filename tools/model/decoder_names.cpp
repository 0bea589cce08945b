// The decoder's param names: Hugging Face's, which the engine uses too (one table for the
// engine-facing model, both backends' messages and the checkpoint readers).
#include <fmt/format.h>

#include "model/decoder_compute.h"

namespace shardswap::lm::dec {

std::string param_name(ParamId id) {
  const auto layer = [&](const char* what) {
    return fmt::format("model.layers.{}.{}", id.layer, what);
  };
  switch (id.kind) {
    case ParamKind::embed:
      return "model.embed_tokens.weight";
    case ParamKind::attn_norm:
      return layer("input_layernorm.weight");
    case ParamKind::q:
      return layer("self_attn.q_proj.weight");
    case ParamKind::q_bias:
      return layer("self_attn.q_proj.bias");
    case ParamKind::q_norm:
      return layer("self_attn.q_norm.weight");
    case ParamKind::k:
      return layer("self_attn.k_proj.weight");
    case ParamKind::k_bias:
      return layer("self_attn.k_proj.bias");
    case ParamKind::k_norm:
      return layer("self_attn.k_norm.weight");
    case ParamKind::v:
      return layer("self_attn.v_proj.weight");
    case ParamKind::v_bias:
      return layer("self_attn.v_proj.bias");
    case ParamKind::o:
      return layer("self_attn.o_proj.weight");
    case ParamKind::mlp_norm:
      return layer("post_attention_layernorm.weight");
    case ParamKind::gate:
      return layer("mlp.gate_proj.weight");
    case ParamKind::up:
      return layer("mlp.up_proj.weight");
    case ParamKind::down:
      return layer("mlp.down_proj.weight");
    case ParamKind::final_norm:
      return "model.norm.weight";
    case ParamKind::head:
      return "lm_head.weight";
  }
  return {};
}

}  // namespace shardswap::lm::dec
