// The decoder's keys of a ShardSwap config (docs/config.md's `model` section): a Hugging Face
// folder (model.path) or the config.json fields inline under model.*, and the layers recomputed
// in backward. The model reads them itself; the trainer hands it the sequence length, a key of
// the data (data.seq_len) that the model's position checks need too.
#pragma once

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "shardswap/config_reader.h"
#include "model/decoder.h"
#include "model/decoder_compute.h"
#include "model/hf_checkpoint.h"

namespace shardswap {

struct DecoderConfig {
  DecoderShape shape;  ///< from model.path's config.json, or the model.* fields
  std::string path;    ///< model.path: a Hugging Face model folder to start from ("": scratch)
  /// model.path's folder, opened once when the config is read: config.json and every tensor
  /// checked, the weights mapped (read when init asks for them). Null from scratch.
  std::shared_ptr<const HfCheckpoint> weights;
  /// model.path's tokenizer files, chat template and generation_config.json (hf_side_files),
  /// recorded when the config is read: a checkpoint names them so that an export can copy them.
  std::vector<HfSideFile> side_files;
  int seq_len = 0;  ///< data.seq_len, as the trainer read it
  /// model.recompute_layers, model.loss_chunk_rows, model.keep_norm_outputs, the precision
  /// options (model.bit16_logits, model.bit16_swiglu_grad, model.bit16_residual:
  /// docs/models.md) and model.attention ("auto", "cudnn", "cudnn-atomic" or "own"), as
  /// make_decoder takes them.
  DecoderOptions options;
  /// model.path's config.json, weight files and side files: what a run's outputs must never
  /// replace (empty from scratch).
  std::vector<std::filesystem::path> input_files() const;
  /// What a checkpoint records for a Hugging Face export with weights of `dtype`: "hf_config",
  /// the config.json (model.path's fields, its token ids among them, under the shape's), and
  /// from a folder "hf_source": {"path", "files": [{"name", "bytes", "fnv1a64"}]}, the side
  /// files `ckpt export --format hf` copies. ConfigError for a dtype or shape no export holds.
  nlohmann::json checkpoint_extra(DType dtype) const;
};

/// Reads model.path or the inline config.json fields (model.model_type, model.hidden_size, ...;
/// model_type defaults to "llama") and the DecoderOptions keys, checked at `seq_len`
/// (data.seq_len); opens model.path's folder and checks
/// its tensors now. Throws ConfigError naming the key and the file (the config's, or the
/// folder's config.json or weights).
DecoderConfig decoder_config_from_json(ConfigReader& c, int seq_len);

}  // namespace shardswap
