// `shardswap ckpt`: safetensors export and inspection of checkpoints (engine/checkpoint.h).
#include "cli/ckpt.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <sstream>

#include "shardswap/checkpoint.h"
#include "shardswap/error.h"
#include "model/hf_checkpoint.h"
#include "model/hf_config.h"
#include "model/safetensors.h"

namespace shardswap {

namespace fs = std::filesystem;
using nlohmann::json;

// 5 GB a shard: save_pretrained's default max_shard_size in transformers 4.
constexpr std::uint64_t kHfShardBytes = 5'000'000'000;

std::string describe_checkpoint(const fs::path& dir) {
  const json meta = read_checkpoint_metadata(dir);
  const auto tensors = read_checkpoint_tensors(dir, false);  // verifies every file
  std::map<std::string, std::pair<int, std::int64_t>> per_group;  // params, elements
  std::int64_t elements = 0;
  for (const auto& p : meta.at("params")) {
    std::int64_t n = 1;
    for (auto e : p.at("shape")) n *= e.get<std::int64_t>();
    auto& g = per_group[p.at("group").get<std::string>()];
    ++g.first;
    g.second += n;
    elements += n;
  }
  std::ostringstream s;
  const json& extra = meta.at("extra");
  s << fmt::format("checkpoint {}: format {}, written by shardswap {}, world size {}\n",
                   dir.string(), meta.at("format_version").get<int>(),
                   meta.at("shardswap_version").get<std::string>(),
                   meta.at("world_size").get<int>());
  const json& parent = meta.at("parent");
  const std::string run = meta.at("run_id").get<std::string>();
  s << fmt::format(
      "save {} (save sequence {}), run {}, {}\n", meta.at("save_id").get<std::string>(),
      meta.at("save_sequence").get<std::int64_t>(), run.empty() ? "(none)" : run,
      parent.is_null()
          ? std::string("started fresh")
          : fmt::format("resumed from run {} at step {}", parent.at("run_id").get<std::string>(),
                        parent.at("step").get<std::int64_t>()));
  // Strings that are not UTF-8 show as {"bytes_hex": ...}, as the metadata stores them.
  if (extra.contains("step")) s << fmt::format("step {}\n", extra.at("step").dump());
  if (!extra.empty()) s << fmt::format("trainer state: {}\n", extra.dump());
  s << fmt::format("model: {} params, {} elements, {}; optimizer {} ({} state slots); saved at "
                   "ZeRO stage {}\n",
                   meta.at("params").size(), elements, meta.at("dtype").get<std::string>(),
                   meta.at("optimizer").get<std::string>(), meta.at("state_slots").get<int>(),
                   meta.at("stage").get<int>());
  s << fmt::format("{:<24}{:>13}{:>8}{:>8}{:>12}\n", "group", "state", "step", "params",
                   "elements");
  for (const auto& g : meta.at("groups")) {
    const auto name = g.at("name").get<std::string>();
    s << fmt::format("{:<24}{:>13}{:>8}{:>8}{:>12}\n", name, g.at("state").get<std::string>(),
                     g.at("step").get<std::int64_t>(), per_group[name].first,
                     per_group[name].second);
  }
  s << fmt::format("active: {}\n", fmt::join(meta.at("active").get<std::vector<std::string>>(),
                                             ", "));
  const json& scaler = meta.at("loss_scaler");
  s << fmt::format("loss scale {} (clean steps {}, hysteresis left {}); lr {}\n",
                   scaler.at("scale").get<double>(), scaler.at("clean_steps").get<std::int64_t>(),
                   scaler.at("hysteresis_left").get<int>(), meta.at("lr").get<double>());
  std::uint64_t total = 0;
  for (const auto& f : meta.at("files")) {
    s << fmt::format("  {:<32}{:>14} bytes\n", f.at("name").get<std::string>(),
                     f.at("bytes").get<std::uint64_t>());
    total += f.at("bytes").get<std::uint64_t>();
  }
  s << fmt::format("{} files, {} bytes, every checksum verified ({} params' weights read)\n",
                   meta.at("files").size(), total, tensors.size());
  return s.str();
}

namespace {

// The side files of an export (tokenizer, chat template, generation_config.json): those of
// --tokenizer-from DIR when given, else those the run recorded of its model.path
// (extra.hf_source), read from that folder and checked against the record, so that an export
// never pairs the weights with another tokenizer unasked. Without generation_config.json, one
// is written from config.json's token ids, as transformers derives it from a model's config.
std::vector<std::pair<std::string, std::string>> export_side_files(
    const fs::path& dir, const json& extra, const std::string& tokenizer_from) {
  std::vector<std::pair<std::string, std::string>> files;
  if (!tokenizer_from.empty()) {
    if (!fs::is_directory(tokenizer_from))
      throw ConfigError(fmt::format("--tokenizer-from '{}': not a directory", tokenizer_from));
    for (const auto& f : hf_side_files(tokenizer_from))
      files.emplace_back(f.name, read_whole_file(fs::path(tokenizer_from) / f.name));
  } else if (extra.contains("hf_source")) {
    const json& source = extra.at("hf_source");
    const fs::path from = source.at("path").get<std::string>();
    for (const auto& f : source.at("files")) {
      const std::string name = f.at("name").get<std::string>();
      const fs::path path = from / name;
      const auto refuse = [&](const std::string& why) {
        return ConfigError(fmt::format(
            "ckpt export --format hf: '{}', a file of the model folder the run of '{}' started "
            "from, {}: give --tokenizer-from DIR to take the tokenizer files from another folder",
            path.string(), dir.string(), why));
      };
      std::string bytes;
      try {
        bytes = read_whole_file(path);
      } catch (const Error& e) {
        throw refuse(fmt::format("cannot be read ({})", e.what()));
      }
      if (bytes.size() != f.at("bytes").get<std::uint64_t>() ||
          fmt::format("{:016x}", fnv1a64(bytes.data(), bytes.size())) !=
              f.at("fnv1a64").get<std::string>())
        throw refuse("has changed since the run read it");
      files.emplace_back(name, std::move(bytes));
    }
  }
  const bool has_generation = std::any_of(files.begin(), files.end(), [](const auto& f) {
    return f.first == "generation_config.json";
  });
  const json& config = extra.at("hf_config");
  if (!has_generation && (config.contains("bos_token_id") || config.contains("eos_token_id"))) {
    json generation = {{"_from_model_config", true}};
    for (const char* key : {"bos_token_id", "eos_token_id", "pad_token_id"})
      if (config.contains(key) && !config.at(key).is_null()) generation[key] = config.at(key);
    files.emplace_back("generation_config.json", generation.dump(2) + "\n");
  }
  return files;
}

// `ckpt export DIR --format hf --out FOLDER`: the weights under their Hugging Face names with
// the config.json the trainer recorded in the checkpoint (extra.hf_config) and the side files
// of the model it started from (export_side_files).
int export_hf_folder(const fs::path& dir, const fs::path& folder, bool master,
                     std::uint64_t max_shard_bytes, const std::string& tokenizer_from,
                     std::ostream& out) {
  check_hf_folder(folder, "--out");  // before any work, named as the user gave it
  const json meta = read_checkpoint_metadata(dir);
  const json& extra = meta.at("extra");
  if (!extra.contains("hf_config"))
    throw ConfigError(fmt::format(
        "ckpt export --format hf: checkpoint '{}' has no Hugging Face config (it was not saved "
        "by a decoder run); export it as safetensors",
        dir.string()));
  const DecoderShape shape =
      hf_config_from_json(extra.at("hf_config"),
                          HfConfigSource{{}, fmt::format("{}: extra.hf_config.", dir.string())},
                          HfSeqLen{})
          .shape;
  HfFolderExtras extras{extra.at("hf_config"), export_side_files(dir, extra, tokenizer_from)};
  const auto tensors = read_checkpoint_tensors(dir, master);
  std::map<std::string, const CheckpointTensor*> by_name;
  for (const auto& t : tensors) by_name[t.name] = &t;
  const DType dtype = master ? DType::f32 : tensors.front().dtype;
  std::uint64_t bytes = 0;
  write_hf_folder(
      folder, shape, dtype,
      [&](const HfTensorSpec& spec, std::span<std::byte> dst) {
        const auto it = by_name.find(spec.name);
        if (it == by_name.end() || it->second->shape != spec.shape ||
            it->second->data.size() != dst.size())
          throw ConfigError(fmt::format(
              "ckpt export --format hf: checkpoint '{}' has no param '{}' of the shape its "
              "config.json gives",
              dir.string(), spec.name));
        std::memcpy(dst.data(), it->second->data.data(), dst.size());
        bytes += dst.size();
      },
      max_shard_bytes, extras);
  out << fmt::format("wrote {}: config.json and {} tensors, {} bytes of {} data\n",
                     folder.string(), tensors.size(), bytes, safetensors_dtype_name(dtype));
  if (!extras.files.empty()) {
    std::vector<std::string> names;
    for (const auto& f : extras.files) names.push_back(f.first);
    out << fmt::format("  beside them: {}\n", fmt::join(names, ", "));
  }
  return 0;
}

}  // namespace

int ckpt_command(const std::vector<std::string>& args, std::ostream& out) {
  const auto usage = [](const std::string& why) {
    return ConfigError(fmt::format(
        "ckpt: {}; usage: shardswap ckpt export DIR --out FILE.safetensors [--master] | "
        "shardswap ckpt export DIR --format hf --out FOLDER [--master] [--max-shard-bytes N] "
        "[--tokenizer-from DIR] | "
        "shardswap ckpt inspect DIR",
        why));
  };
  if (args.empty()) throw usage("needs export or inspect");
  if (args[0] == "inspect") {
    if (args.size() != 2) throw usage("inspect takes one checkpoint directory");
    out << describe_checkpoint(args[1]);
    return 0;
  }
  if (args[0] != "export") throw usage(fmt::format("unknown subcommand '{}'", args[0]));
  std::string dir, file, format = "safetensors", tokenizer_from;
  bool master = false;
  std::uint64_t max_shard_bytes = kHfShardBytes;
  for (std::size_t i = 1; i < args.size(); ++i) {
    const auto value = [&](const char* flag) -> const std::string& {
      if (i + 1 >= args.size()) throw usage(fmt::format("{} needs a value", flag));
      return args[++i];
    };
    if (args[i] == "--out") {
      file = value("--out");
    } else if (args[i] == "--tokenizer-from") {
      tokenizer_from = value("--tokenizer-from");
    } else if (args[i] == "--master") {
      master = true;
    } else if (args[i] == "--format") {
      format = value("--format");
      if (format != "safetensors" && format != "hf")
        throw usage(fmt::format("--format '{}': expected safetensors or hf", format));
    } else if (args[i] == "--max-shard-bytes") {
      const std::string& v = value("--max-shard-bytes");
      std::size_t used = 0;
      unsigned long long n = 0;
      try {
        n = std::stoull(v, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (used != v.size() || n == 0 || v.front() == '-')
        throw usage(fmt::format("--max-shard-bytes '{}': expected a positive number of bytes", v));
      max_shard_bytes = n;
    } else if (dir.empty() && !args[i].starts_with("--")) {
      dir = args[i];
    } else {
      throw usage(fmt::format("unknown argument '{}'", args[i]));
    }
  }
  if (dir.empty()) throw usage("export needs a checkpoint directory");
  if (file.empty()) throw usage("export needs --out FILE");
  if (!tokenizer_from.empty() && format != "hf")
    throw usage("--tokenizer-from needs --format hf");
  if (format == "hf")
    return export_hf_folder(dir, file, master, max_shard_bytes, tokenizer_from, out);
  // Checked before the checkpoint is read: a refused --out costs nothing and changes nothing.
  OutputFile target("--out", file, checkpoint_inputs(dir));
  const json meta = read_checkpoint_metadata(dir);
  const auto tensors = read_checkpoint_tensors(dir, master);
  std::map<std::string, std::string> metadata = {
      {"format", "pt"},
      {"source", "shardswap checkpoint"},
      {"weights", master ? "fp32 master" : "bit16"},
      {"shardswap_version", meta.at("shardswap_version").get<std::string>()}};
  if (meta.at("extra").contains("step")) metadata["step"] = meta.at("extra").at("step").dump();
  std::vector<SafetensorsData> data;
  data.reserve(tensors.size());
  for (const auto& t : tensors)
    data.push_back({{t.name, safetensors_dtype_name(t.dtype), t.shape}, t.data});
  write_safetensors(target, data, metadata);
  std::uint64_t bytes = 0;
  for (const auto& t : tensors) bytes += t.data.size();
  out << fmt::format("wrote {}: {} tensors, {} bytes of {} data\n", file, tensors.size(), bytes,
                     master ? "F32" : safetensors_dtype_name(tensors.front().dtype));
  return 0;
}

}  // namespace shardswap
