// What `shardswap train`, `plan` and `eval` run: the model, apart from its data (RunData,
// tools/trainer/run_data.h). The training loop (tools/trainer/train.cpp) sees only this interface;
// the model says what its params are and how much working memory and work it takes, all from its
// config alone (a plan opens no file of data), and a rank's model trains on the batches the
// trainer draws for it.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "shardswap/allocator.h"
#include "shardswap/config_reader.h"
#include "shardswap/dtype.h"
#include "shardswap/engine.h"
#include "data/token_data.h"

namespace shardswap {

struct ValLogits {
  int sequences = 0, seq_len = 0, vocab = 0;
  std::vector<std::int32_t> inputs;  ///< sequences * seq_len
  std::vector<float> logits;         ///< sequences * seq_len * vocab
};

/// One rank's model with its working memory, made once per rank; it holds no data.
class RankModel {
 public:
  virtual ~RankModel() = default;
  /// Forward and backward of one micro-batch, adding `weight` times the gradient of its mean loss
  /// over its counted targets into the engine's slots (Engine::grad_slot / grad_ready). Returns
  /// that mean loss.
  virtual double train_micro(Engine& engine, TokenSequences batch, double weight) = 0;
  /// The mean loss of a validation batch over its counted targets.
  virtual double val_loss(const Engine& engine, TokenSequences batch) = 0;
  /// The inputs of a validation batch and every position's logits ([inputs, vocab]), for checks
  /// against another implementation. ConfigError for a model that has none.
  virtual ValLogits val_logits(const Engine& engine, TokenSequences batch) = 0;
  /// GPU time of the model's phases (`logging.timing` on a GPU): on, then after each step the
  /// seconds of each phase since the last take, named ("forward", "attention forward", ...).
  /// A model without phase timing returns none.
  virtual void time_phases(bool on) { (void)on; }
  virtual std::vector<std::pair<std::string, double>> take_phase_seconds() { return {}; }
};

/// The model's groups as layer switching (layer_switching) sees them, known from the config's
/// model keys alone: the config reader checks the schedule with them, for a plan too, which opens
/// no data.
struct SwitchingGroups {
  std::vector<std::string> all;  ///< every group, in declaration order (RunModel::groups())
  /// What LISA and BAdam switch when layer_switching.layers is absent: the body's layers.
  std::vector<std::string> layers;
  /// What LISA keeps active at every step when layer_switching.always_active is absent (BAdam
  /// keeps none).
  std::vector<std::string> lisa_always_active;
};

/// A run's model, described from its config alone when the config is read (read_run_model) and
/// shared read-only by every run and rank made from that config: what a plan asks (groups,
/// declarations, bytes, flops) costs no data and no Engine.
class RunModel {
 public:
  virtual ~RunModel() = default;
  /// The groups in declaration order ("embed", "layers.0", ..., "head").
  virtual std::vector<std::string> groups() const = 0;
  virtual SwitchingGroups switching_groups() const = 0;
  virtual std::int64_t param_count() const = 0;
  /// Token ids the model reads lie below it: the data checks every token against it.
  virtual int vocab_size() const = 0;
  /// The width DeepSpeed's "auto" reduce bucket is sized by (transformers' Trainer: its square).
  virtual std::int64_t hidden_size() const = 0;
  /// Every param in declaration order: what declare() adds, and what a plan is made of without
  /// an Engine (plan_memory).
  virtual std::vector<ParamDeclaration> declarations() const = 0;
  void declare(Engine& engine) const;
  /// The params the Hugging Face Trainer leaves out of weight decay by default: biases and the
  /// weights of norm layers (shardswap.weight_decay_on "weights" sets their decay to 0).
  virtual std::vector<std::string> no_decay_params() const = 0;
  /// The initial weights of one build (Engine::build's init): from scratch (a pure function of
  /// the seed) or read from the model's folder. Made per build, so that what it draws ahead
  /// lives no longer than the build; thread-safe.
  virtual WeightInit initial_values() const = 0;
  /// The files the model reads (its folder's config and weights): what a run's outputs must
  /// never replace.
  virtual std::vector<std::filesystem::path> input_files() const = 0;
  /// Exact bytes of Tag::activation a RankModel of a micro-batch of `micro` samples holds.
  virtual std::int64_t activation_bytes(int micro, DType dtype, DeviceKind device) const = 0;
  virtual std::unique_ptr<RankModel> make_rank_model(int micro, DType dtype,
                                                     MemorySpace& space) const = 0;
  /// ConfigError naming the key where the model's config asks for what a run on `device`
  /// cannot do (the decoder: a model.attention the backend or this build lacks), called before
  /// a run builds or writes anything; make_rank_model would refuse the same later.
  virtual void check_device(DeviceKind device) const { (void)device; }
  /// Layers that can run their forward again in backward instead of keeping their activations
  /// (model.recompute_layers' range; 0: the model cannot), and how many this one recomputes.
  virtual int recomputable_layers() const { return 0; }
  virtual int recompute_layers() const { return 0; }
  /// This model with `layers` of them recomputed (a device budget's choice): ConfigError outside
  /// [0, recomputable_layers()].
  virtual std::shared_ptr<const RunModel> with_recompute(int layers) const;
  /// The bytes a step over `micro` samples on `device` reads and writes again in backward that
  /// keeping them from forward would spare (the decoder's norm outputs, model.keep_norm_outputs:
  /// its weight gradients' inputs); 0 where the model cannot keep them there. Whether this one
  /// keeps them, and this model with them kept or not (a device budget's choice; ConfigError
  /// for `true` where nothing can be kept).
  virtual double kept_norms_saved_bytes(int micro, DeviceKind device) const {
    (void)micro;
    (void)device;
    return 0.0;
  }
  virtual bool keeps_norms() const { return false; }
  virtual std::shared_ptr<const RunModel> with_kept_norms(bool keep) const;
  /// Tokens whose loss one sample carries (the decoder: seq_len).
  virtual std::int64_t tokens_per_sample() const = 0;
  /// FLOPs of forward + backward over one micro-batch with every group active.
  virtual double micro_flops(int micro) const = 0;
  /// The GEMM (m, n, k) whose cuBLAS rate is the yardstick of the model's rate.
  virtual std::vector<int> reference_gemm(int micro) const = 0;
  /// "decoder llama 1234 params, ...": the start-up line's part, for a run on `device`.
  virtual std::string describe(DeviceKind device) const = 0;
  /// How the model attends within documents kept apart (data.documents) on `device` with
  /// micro-batches of `micro`: a start-up line's part; empty where there is nothing to say.
  virtual std::string documents_apart_attention(DeviceKind device, int micro) const {
    (void)device;
    (void)micro;
    return {};
  }
  /// "decoder": the plan's first line.
  virtual std::string type_name() const = 0;
  /// The model's fields of a checkpoint's `extra` with weights of `dtype`, beside the trainer's
  /// (step, updates, seed): the decoder's hf_config, the config.json `ckpt export --format hf`
  /// writes. ConfigError for a dtype or shape no such export can hold: the config reader asks
  /// once, so that a run is refused before it starts rather than at its first save.
  virtual nlohmann::json checkpoint_extra(DType dtype) const = 0;
};

/// model.type, checked: "decoder", the one there is, which may be left out; the keys of the
/// byte-level MLP LM that was removed are refused naming model.type. Read first, so that an old
/// config is told what it is before any other key is missing.
std::string read_model_type(ConfigReader& c);

/// The model of the config's model.type (read_model_type), its keys read and checked: the
/// decoder reads model.path (its folder opened and its tensors checked now, the weights read
/// only when a build asks) or the inline config.json fields (tools/model/decoder_config.h). `seq_len` is the data's (data.seq_len), `seed` the
/// run's. Throws ConfigError naming the key and the file.
std::shared_ptr<const RunModel> read_run_model(ConfigReader& c, int seq_len, std::uint64_t seed);

}  // namespace shardswap
