// `shardswap ckpt`: safetensors export and inspection of checkpoints (engine/checkpoint.h).
#include "tools/ckpt.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <sstream>

#include "shardswap/error.h"
#include "tools/lm/safetensors.h"

namespace shardswap {

namespace fs = std::filesystem;
using nlohmann::json;

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

int ckpt_command(const std::vector<std::string>& args, std::ostream& out) {
  const auto usage = [](const std::string& why) {
    return ConfigError(fmt::format(
        "ckpt: {}; usage: shardswap ckpt export DIR --out FILE.safetensors [--master] | "
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
  std::string dir, file;
  bool master = false;
  for (std::size_t i = 1; i < args.size(); ++i) {
    if (args[i] == "--out") {
      if (i + 1 >= args.size()) throw usage("--out needs a value");
      file = args[++i];
    } else if (args[i] == "--master") {
      master = true;
    } else if (dir.empty() && !args[i].starts_with("--")) {
      dir = args[i];
    } else {
      throw usage(fmt::format("unknown argument '{}'", args[i]));
    }
  }
  if (dir.empty()) throw usage("export needs a checkpoint directory");
  if (file.empty()) throw usage("export needs --out FILE");
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
