// The directory of checkpoints: scanned, listed, recovered and pruned (shardswap/checkpoint.h).
//
// Policy on the directory of checkpoints: a complete copy of every checkpoint exists at every
// instant of a save or a prune (so a kill anywhere loses at most the save in progress), a name
// that could list as complete only ever appears by a rename of a complete, fsynced directory, and
// nothing deletes a checkpoint that another run wrote. recover_checkpoints() turns what a kill
// left into that state again.
#include "engine/checkpoint_format.h"
#include "engine/checkpoint_steps.h"
#include "support/durable_file.h"

#include <optional>
#include <set>
#include <system_error>
#include <tuple>

namespace shardswap {

using namespace checkpoint_detail;

namespace {

// A name under a checkpoint root: "step-" digits, optionally "-" and 8 hex digits of a run id.
std::optional<std::int64_t> checkpoint_step(std::string_view name) {
  if (!name.starts_with("step-")) return std::nullopt;
  name.remove_prefix(5);
  const std::size_t digits = name.find_first_not_of("0123456789");
  const std::string_view number = name.substr(0, digits);
  if (number.empty() || number.size() > 18) return std::nullopt;
  const std::string_view rest = digits == std::string_view::npos ? "" : name.substr(digits);
  if (!rest.empty() && !(rest.size() == 9 && rest[0] == '-' && is_lower_hex(rest.substr(1))))
    return std::nullopt;
  return std::stoll(std::string(number));
}

// "" when `dir` is a complete checkpoint (every file verified), else why not.
std::string incomplete_because(const fs::path& dir) {
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(dir, ec))) return "absent";
  try {
    (void)read_checkpoint_tensors(dir, false);
    return "";
  } catch (const ConfigError& e) {
    return e.what();
  }
}

}  // namespace

void checkpoint_detail::recover_name(const fs::path& dir, std::vector<std::string>& actions) {
  const fs::path tmp = sibling(dir, ".tmp-save"), old = sibling(dir, ".old-save");
  std::error_code ec;
  const bool has_tmp = fs::exists(fs::symlink_status(tmp, ec));
  const bool has_old = fs::exists(fs::symlink_status(old, ec));
  if (!has_tmp && !has_old) return;
  const std::string dir_why = incomplete_because(dir);
  const std::string tmp_why = has_tmp ? incomplete_because(tmp) : "absent";
  const std::string old_why = has_old ? incomplete_because(old) : "absent";
  const auto remove = [&](const fs::path& p, const std::string& why) {
    fs::remove_all(p);
    actions.push_back(fmt::format("removed '{}' ({})", p.string(), why));
  };
  const auto promote = [&](const fs::path& from, const char* what) {
    if (dir_why != "absent") remove(dir, "incomplete: " + dir_why);
    fs::rename(from, dir);
    fsync_directory(parent_directory(dir));
    actions.push_back(fmt::format("{}: '{}' -> '{}'", what, from.string(), dir.string()));
  };
  bool tmp_left = has_tmp, old_left = has_old;
  if (!dir_why.empty()) {
    if (has_tmp && tmp_why.empty()) {
      promote(tmp, "completed an interrupted save");
      tmp_left = false;
    } else if (has_old && old_why.empty()) {
      promote(old, "rolled back an interrupted save");
      old_left = false;
    }
  }
  const auto leftover_why = [&](const std::string& why) {
    return why.empty()
               ? fmt::format("a copy left by an interrupted save; '{}' is complete", dir.string())
               : "incomplete: " + why;
  };
  if (tmp_left) remove(tmp, leftover_why(tmp_why));
  if (old_left) remove(old, leftover_why(old_why));
  fsync_directory(parent_directory(dir));
}

std::string checkpoint_name(std::int64_t step) { return fmt::format("step-{:08}", step); }

namespace {

// Throws ConfigError unless every file `meta` lists is in `dir`, regular, of the recorded size.
void require_files_present(const fs::path& dir, const json& meta) {
  const fs::path meta_file = dir / kMetadataName;
  for (const auto& f : field<json>(meta, "files", meta_file)) {
    const auto name = field<std::string>(f, "name", meta_file);
    const auto bytes = field<std::uint64_t>(f, "bytes", meta_file);
    if (name.empty() || name.find('/') != std::string::npos || name == "..")
      throw ConfigError(
          fmt::format("'{}': file name '{}' is not a name", meta_file.string(), name));
    std::error_code ec;
    const auto st = fs::status(dir / name, ec);
    if (!fs::exists(st)) throw ConfigError(fmt::format("'{}' is missing", (dir / name).string()));
    if (!fs::is_regular_file(st))
      throw ConfigError(fmt::format("'{}' is not a regular file", (dir / name).string()));
    const auto size = fs::file_size(dir / name, ec);
    if (ec || size != bytes)
      throw ConfigError(fmt::format("'{}' holds {} bytes, the metadata says {}",
                                    (dir / name).string(), size, bytes));
  }
}

template <class F>
auto in_root(const char* fn, const fs::path& root, F&& body) {
  try {
    return body();
  } catch (const fs::filesystem_error& e) {
    throw Error(fmt::format("{}: under '{}': {}", fn, root.string(), e.what()));
  }
}

}  // namespace

CheckpointScan scan_checkpoints(const fs::path& root) {
  CheckpointScan out;
  std::error_code ec;
  if (!fs::exists(root, ec)) return out;
  fs::directory_iterator it(root, ec);
  if (ec)
    throw ConfigError(
        fmt::format("cannot list checkpoint directory '{}': {}", root.string(), ec.message()));
  for (const auto& entry : it) {
    const auto step = checkpoint_step(entry.path().filename().string());
    if (!step) continue;
    try {
      const json meta = read_checkpoint_metadata(entry.path());
      require_files_present(entry.path(), meta);
      out.complete.push_back({entry.path(), *step, meta.at("run_id").get<std::string>(),
                              meta.at("save_sequence").get<std::int64_t>()});
    } catch (const ConfigError& e) {
      out.skipped.push_back(e.what());
    }
  }
  std::sort(out.complete.begin(), out.complete.end(), [](const auto& a, const auto& b) {
    return std::tie(a.save_sequence, a.step, a.path) < std::tie(b.save_sequence, b.step, b.path);
  });
  std::sort(out.skipped.begin(), out.skipped.end());
  return out;
}

std::vector<fs::path> list_checkpoints(const fs::path& root) {
  auto complete = scan_checkpoints(root).complete;
  std::stable_sort(complete.begin(), complete.end(),
                   [](const auto& a, const auto& b) { return a.step < b.step; });
  std::vector<fs::path> out;
  for (auto& c : complete) out.push_back(std::move(c.path));
  return out;
}

std::optional<CheckpointEntry> latest_checkpoint(const fs::path& root) {
  auto complete = scan_checkpoints(root).complete;
  if (complete.empty()) return std::nullopt;
  return complete.back();
}

std::vector<std::string> recover_checkpoints(const fs::path& root) {
  return in_root("recover_checkpoints", root, [&] {
    std::vector<std::string> actions;
    std::error_code ec;
    if (!fs::is_directory(root, ec)) return actions;
    std::set<std::string> saves;
    std::vector<fs::path> prunes;
    for (const auto& entry : fs::directory_iterator(root)) {
      const std::string name = entry.path().filename().string();
      const auto base = [&](std::string_view suffix) {
        return name.ends_with(suffix) &&
               checkpoint_step(std::string_view(name).substr(0, name.size() - suffix.size()));
      };
      if (base(".tmp-save") || base(".old-save")) saves.insert(name.substr(0, name.size() - 9));
      if (base(".prune")) prunes.push_back(entry.path());
    }
    for (const auto& p : prunes) {
      fs::remove_all(p);
      actions.push_back(fmt::format("removed '{}' (left by an interrupted prune)", p.string()));
    }
    for (const auto& name : saves) recover_name(root / name, actions);
    if (!actions.empty()) fsync_directory(root);
    return actions;
  });
}

void prune_checkpoints(const fs::path& root, int keep, const std::string& run_id) {
  if (keep < 1)
    throw ConfigError(fmt::format("prune_checkpoints: keep = {} must be >= 1", keep));
  in_root("prune_checkpoints", root, [&] {
    recover_checkpoints(root);
    std::vector<fs::path> own;  // oldest first
    for (const auto& c : scan_checkpoints(root).complete)
      if (c.run_id == run_id) own.push_back(c.path);
    for (std::size_t i = 0; i + static_cast<std::size_t>(keep) < own.size(); ++i) {
      // Out of the checkpoint names first: a kill during the removal leaves a .prune leftover,
      // never a partial checkpoint under a name that lists.
      const fs::path doomed = sibling(own[i], ".prune");
      fs::rename(own[i], doomed);
      fsync_directory(root);
      fs::remove_all(doomed);
    }
  });
}

}  // namespace shardswap
