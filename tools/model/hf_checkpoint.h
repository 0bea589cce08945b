// Hugging Face model folders of the decoder (tools/model/decoder_compute.h), in and out: config.json
// and the weights as model.safetensors, or sharded with model.safetensors.index.json. The
// engine's param names are the Hugging Face tensor names.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "model/decoder.h"
#include "model/hf_config.h"
#include "model/safetensors.h"
#include "shardswap/error.h"

namespace shardswap {

/// A param of the decoder: its Hugging Face name, shape and group (decoder_params(shape) lists
/// them in declaration order).
using HfTensorSpec = DecoderParam;

/// Copies `src` into `out` as `dtype` (bf16, fp16 or fp32; `out` holds exactly numel elements),
/// element by element: bit-exact when the dtypes agree, exact when widening, round to nearest
/// even when narrowing. Throws ConfigError naming `src`'s tensor and `file` (and writes nothing)
/// for a stored dtype other than BF16, F16, F32, a wrong `out` size, or a finite value that
/// fp16 cannot hold.
void convert_tensor(const SafetensorsTensor& src, const std::filesystem::path& file, DType dtype,
                    std::span<std::byte> out);

/// Where a stored tensor first holds a value that is not finite.
struct NonFinite {
  std::int64_t index = 0;  ///< the element, in storage order
  const char* what = "";   ///< "NaN" or "Inf"
};
/// The first NaN or Inf of a BF16, F16 or F32 tensor, read from its stored bits (none for
/// another dtype).
std::optional<NonFinite> first_nonfinite(const SafetensorsTensor& t);

/// A Hugging Face model folder, opened and checked as a whole before any weight is read: meant
/// to come before the engine allocates anything.
class HfCheckpoint {
 public:
  /// Reads FOLDER/config.json (read_hf_config, checked at `seq_len`) and maps the weights:
  /// model.safetensors, or model.safetensors.index.json {"weight_map": {name: file}} and the
  /// files it names (plain names in the folder), each file's header agreeing with the index.
  /// Checks that every tensor of decoder_params is there with its shape and a stored dtype
  /// of BF16, F16 or F32, and that nothing else is (rotary_emb.inv_freq buffers aside; a tied
  /// model's lm_head.weight only as an exact copy of the embedding). Throws ConfigError naming
  /// the folder, the file and the tensor.
  static HfCheckpoint open(const std::filesystem::path& folder, const HfSeqLen& seq_len);

  const std::filesystem::path& folder() const { return folder_; }
  const HfModelConfig& config() const { return config_; }
  const DecoderShape& shape() const { return config_.shape; }
  /// The files the weights were read from, in the order opened.
  std::vector<std::filesystem::path> files() const;
  /// The stored tensor of param `name`; ConfigError for a name that is not a param.
  const SafetensorsTensor& tensor(std::string_view name) const;
  /// The file holding param `name`.
  const std::filesystem::path& file_of(std::string_view name) const;
  /// convert_tensor of param `name`; ConfigError naming the tensor, its file and the element for
  /// a stored NaN or Inf (nothing is written).
  void copy(std::string_view name, DType dtype, std::span<std::byte> out) const;

 private:
  struct Place {
    std::size_t file;    // in files_
    std::size_t tensor;  // in files_[file].tensors()
  };
  using Places = std::map<std::string, Place, std::less<>>;
  const Place& place(std::string_view name) const;
  // open()'s steps: map the weights' files (one, or those an index names) and find every stored
  // tensor; take the params of the model among them; refuse whatever is left over.
  Places map_weights();
  Places map_index(const std::filesystem::path& index_path);
  void take_params(const Places& stored);
  void refuse_leftovers(const Places& stored) const;
  ConfigError refusal(std::string_view why) const;

  std::filesystem::path folder_;
  HfModelConfig config_;
  std::vector<SafetensorsFile> files_;
  Places params_;
};

/// Fills `out` (numel * dtype size bytes) with the values of param `spec`, in the dtype given
/// to write_hf_folder.
using HfTensorFill = std::function<void(const HfTensorSpec& spec, std::span<std::byte> out)>;

/// What an export keeps of the model it came from, beside the weights.
struct HfFolderExtras {
  /// config.json's other fields (bos_token_id, eos_token_id, pad_token_id, ...): written with
  /// the shape's fields (hf_config_to_json's), which win where both name a field.
  nlohmann::json config_fields = nlohmann::json::object();
  /// Files written beside (name in the folder, bytes): the tokenizer, generation_config.json.
  std::vector<std::pair<std::string, std::string>> files;
};

/// Writes `shape`'s model as a Hugging Face folder: config.json (hf_config_to_json over
/// extras.config_fields), extras.files, the
/// params of decoder_params in `dtype` (bf16, fp16 or fp32), asked of `fill` one at a
/// time, as model.safetensors when their bytes are at most `max_shard_bytes`, else as
/// model-0000i-of-0000n.safetensors (params in order, a new file where the next would pass the
/// limit; a larger param alone) with model.safetensors.index.json. `folder` must be absent or
/// an empty directory in an existing one. Everything is written into a new
/// FOLDER.tmp-export-HOST-PID-* (mode 0777 less the umask, as mkdir makes one) beside it and
/// renamed to FOLDER at the end, so that a folder of that name is complete or absent: a failure
/// removes the temporary folder, and the temporaries of FOLDER's exports whose process died on
/// this host (killed, crashed) are removed first. Throws ConfigError for a refused folder,
/// shape or dtype (nothing written), Error for a failing write.
void write_hf_folder(const std::filesystem::path& folder, const DecoderShape& shape, DType dtype,
                     const HfTensorFill& fill, std::uint64_t max_shard_bytes,
                     const HfFolderExtras& extras = {});

/// The files of a model folder, beside config.json and the weights, that a round trip keeps so
/// that transformers' AutoTokenizer, chat templates and generate() work on an export: the
/// tokenizer's (tokenizer.json, tokenizer_config.json with its chat_template, ...), a separate
/// chat template, and generation_config.json.
inline constexpr const char* kHfSideFiles[] = {
    "tokenizer.json",    "tokenizer_config.json", "special_tokens_map.json",
    "tokenizer.model",   "vocab.json",            "merges.txt",
    "added_tokens.json", "chat_template.jinja",   "chat_template.json",
    "generation_config.json"};
/// A side file as a run records it: its name in the folder, size and FNV-1a 64 of its bytes.
struct HfSideFile {
  std::string name;
  std::uint64_t bytes = 0;
  std::uint64_t fnv1a64 = 0;
};
/// The side files `folder` holds (regular files of kHfSideFiles' names), read once to record
/// them. Error naming the file for one that cannot be read.
std::vector<HfSideFile> hf_side_files(const std::filesystem::path& folder);
/// A file's bytes, whole; Error naming it for one that cannot be read or is not a regular file.
std::string read_whole_file(const std::filesystem::path& file);
/// write_hf_folder's check of `folder` alone, for a command to run before any work: throws
/// ConfigError "LABEL 'FOLDER': what is wrong" (its parent missing; a file, link or other
/// non-directory; a directory that is not empty). Returns the folder without a trailing '/'.
std::filesystem::path check_hf_folder(const std::filesystem::path& folder, std::string_view label);

}  // namespace shardswap
