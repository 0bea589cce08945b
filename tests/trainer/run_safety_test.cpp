// What keeps a run's checkpoints its own and its errors honest: the lock on checkpoint.dir (a
// second trainer is refused, in one process or two), the directory probed before the first
// step, the failing rank's own error surfacing rather than another rank's "other rank failed",
// and a stop signal finishing the step, saving it and resuming bit for bit.
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <sstream>
#include <streambuf>
#include <string>
#include <thread>
#include <vector>

#include "engine/comm/collective_ops.h"
#include "shardswap/checkpoint.h"
#include "shardswap/checkpoint_dir.h"
#include "shardswap/communicator.h"
#include "shardswap/config_reader.h"
#include "shardswap/engine.h"
#include "shardswap/error.h"
#include "tests/catch_compat.h"
#include "tests/support/scratch_folder.h"
#include "tests/support/small_models.h"
#include "trainer/metrics_log.h"
#include "trainer/train.h"

using namespace shardswap;
using test::contains;
using test_support::ScratchFolder;
namespace fs = std::filesystem;

namespace {

// The trainer writes metrics lines through a MetricsLog; these tests read them from a stream.
// Each adapter lives to the end of the test binary, outliving every train() given it.
MetricsStream* metrics_of(std::ostream& out) {
  static std::mutex mutex;
  static std::deque<std::unique_ptr<MetricsStream>> all;
  std::lock_guard lock(mutex);
  all.push_back(std::make_unique<MetricsStream>(out));
  return all.back().get();
}

std::mt19937_64& rng() {
  static std::mt19937_64 r(std::random_device{}());
  return r;
}

std::string random_bytes(std::size_t n) {
  std::string s(n, '\0');
  for (auto& c : s) c = static_cast<char>(rng()() & 0xff);
  return s;
}

void write_file(const fs::path& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

std::string host_name() {
  char name[256] = {};
  gethostname(name, sizeof name - 1);
  return name;
}

// A small run of the decoder on bytes: two ranks, ZeRO-2 bf16, a few milliseconds a step; seeded
// at random (the comparisons are between runs of one seed).
nlohmann::json small_run(std::int64_t steps) {
  auto j = nlohmann::json::parse(R"({
    "world_size": 2, "train_micro_batch_size_per_gpu": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
    "bf16": {"enabled": true}, "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 3000},
    "model": {"type": "decoder", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
              "max_position_embeddings": 64, "tie_word_embeddings": true},
    "data": {"tokenizer": "bytes", "train": "/usr/share/common-licenses/GPL-3", "seq_len": 16},
    "logging": {"interval": 5, "eval_interval": 1000, "eval_batches": 2}
  })");
  j["steps"] = steps;
  j["seed"] = rng()() % 100000;
  return j;
}

TrainConfig load(const nlohmann::json& j) {
  ConfigReader reader(j, "test.json");
  return train_config_from_json(reader);
}

/// An output stream that calls `on_line(n)` after its n-th line (n from 1) is complete: what a
/// test uses to act at a chosen step of a run, from inside the run (rank 0 writes the metrics
/// line of a step after every rank has finished it).
class LineHook : public std::streambuf {
 public:
  explicit LineHook(std::function<void(int)> on_line) : on_line_(std::move(on_line)) {}
  const std::string& text() const { return text_; }

 protected:
  int overflow(int c) override {
    if (c == traits_type::eof()) return traits_type::not_eof(c);
    text_ += static_cast<char>(c);
    if (c == '\n') on_line_(++lines_);
    return c;
  }

 private:
  std::function<void(int)> on_line_;
  std::string text_;
  int lines_ = 0;
};

std::vector<nlohmann::json> metrics_lines(const std::string& text) {
  std::vector<nlohmann::json> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    auto m = nlohmann::json::parse(line);
    if (m.contains("resumed")) continue;  // where a resumed run says it resumed: not a step
    m.erase("tokens_per_s");  // timings: not part of what two runs must agree on
    m.erase("step_seconds");
    out.push_back(std::move(m));
  }
  return out;
}

// Host collectives whose element work throws on the thread that set fail_own_work.
thread_local bool fail_own_work = false;
const CollectiveOps& faulty_ops() {
  static const CollectiveOps ops{
      "faulty host",
      DeviceKind::host,
      [](DType d, const void* const* src, int n, void* dst, std::size_t count, ReduceOp op) {
        if (fail_own_work) throw DeviceError("injected reduce failure on this rank");
        host_collective_ops().reduce(d, src, n, dst, count, op);
      },
      host_collective_ops().copy,
      [] {},
      host_collective_ops().scratch};
  return ops;
}

/// Rethrows after a pause: a failing rank slower to unwind than the others, so that a "keep
/// whatever comes first" policy would keep another rank's error.
template <class F>
void fail_slowly(F&& f) {
  try {
    f();
  } catch (...) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    throw;
  }
}

}  // namespace

// ---- finding: two trainers on one checkpoint.dir ----

TEST_CASE(
    "a second lock on a checkpoint directory is refused naming the holder, in one process "
    "too") {
  const ScratchFolder folder("shardswap-lock");
  const fs::path dir = folder / "ckpts";  // absent: the lock makes it
  std::optional<CheckpointDirLock> first(std::in_place, dir);
  REQUIRE(fs::is_directory(dir));
  const CheckpointDirHolder recorded = read_checkpoint_dir_holder(dir);
  CHECK(recorded.pid == static_cast<long>(getpid()));
  CHECK(recorded.host == host_name());
  CHECK(recorded.since.size() == 20);  // 2026-12-01T13:04:50Z

  std::string message;
  CheckpointDirHolder holder;
  try {
    CheckpointDirLock second(dir);
  } catch (const CheckpointDirBusy& e) {
    message = e.what();
    holder = e.holder();
  }
  INFO(message);
  CHECK(contains(message, "'" + dir.string() + "'"));
  CHECK(contains(message, fmt::format("pid {}", getpid())));
  CHECK(contains(message, "host " + host_name()));
  CHECK(holder.pid == static_cast<long>(getpid()));

  // Moved, the lock is still held; released, the directory is free again and the record gone.
  CheckpointDirLock moved = std::move(*first);
  first.reset();
  CHECK_THROWS_AS(CheckpointDirLock(dir), CheckpointDirBusy);
  { CheckpointDirLock gone = std::move(moved); }
  CHECK(read_checkpoint_dir_holder(dir).pid == 0);
  CheckpointDirLock again(dir);
  CHECK(read_checkpoint_dir_holder(dir).pid == static_cast<long>(getpid()));
}

TEST_CASE(
    "a lock file that is a symlink or a directory is refused naming it, the target "
    "untouched") {
  const ScratchFolder folder("shardswap-lock-link");
  const fs::path dir = folder / "ckpts";
  fs::create_directory(dir);
  const fs::path target = folder / "precious";
  const std::string bytes = random_bytes(512);
  write_file(target, bytes);
  const fs::path lock_file = dir / CheckpointDirLock::kFileName;
  fs::create_symlink(target, lock_file);
  const auto message = test::message_of<Error>([&] { CheckpointDirLock lock(dir); });
  CHECK(contains(message, lock_file.string()));
  CHECK(read_file(target) == bytes);
  CHECK(fs::is_symlink(lock_file));

  fs::remove(lock_file);
  fs::create_directory(lock_file);
  CHECK(
      contains(test::message_of<Error>([&] { CheckpointDirLock lock(dir); }), lock_file.string()));
}

TEST_CASE(
    "a second trainer on a checkpoint.dir in use is refused before it builds, and the first "
    "finishes") {
  const ScratchFolder folder("shardswap-two-trainers");
  const fs::path dir = folder / "ckpts";
  auto first = small_run(12);
  first["checkpoint"] = {{"dir", dir.string()}, {"every", 4}, {"keep", 5}};
  auto second = small_run(4);
  second["world_size"] = 1;
  second["checkpoint"] = {{"dir", dir.string()}, {"every", 2}};

  // The second trainer starts from inside the first's run, after its third step.
  std::string refused;
  std::ostringstream second_log, second_metrics;
  LineHook hook([&](int line) {
    if (line != 3) return;
    try {
      train(load(second), TrainOutput{second_log, metrics_of(second_metrics)});
    } catch (const CheckpointDirBusy& e) {
      refused = e.what();
    }
  });
  std::ostream metrics(&hook);
  std::ostringstream log;
  const TrainSummary summary = train(load(first), TrainOutput{log, metrics_of(metrics)});
  INFO(refused);
  CHECK(contains(refused, "'" + dir.string() + "'"));
  CHECK(contains(refused, fmt::format("pid {}", getpid())));
  CHECK(contains(refused, "host " + host_name()));
  CHECK(second_metrics.str().empty());  // not one step
  CHECK(second_log.str().empty());      // not even built
  CHECK(summary.steps == 12);
  std::vector<std::string> names;
  for (const auto& p : list_checkpoints(dir)) {
    names.push_back(p.filename().string());
    read_checkpoint_tensors(p, true);  // every checksum verified
  }
  CHECK(names ==
        std::vector<std::string>{checkpoint_name(4), checkpoint_name(8), checkpoint_name(12)});
  // Released at the end of the run: the next trainer may take the directory.
  CheckpointDirLock next(dir);
}

// ---- finding: save errors late and hiding their cause ----

TEST_CASE(
    "a checkpoint.dir under a regular file is refused before the first step, naming it, at "
    "world sizes 1 and 2") {
  for (int world : {1, 2}) {
    const ScratchFolder folder("shardswap-probe-file");
    const fs::path file = folder / "a-file";
    const std::string bytes = random_bytes(100);
    write_file(file, bytes);
    const fs::path dir = file / "ckpts";
    auto j = small_run(6);
    j["world_size"] = world;
    j["checkpoint"] = {{"dir", dir.string()}, {"every", 2}};
    std::ostringstream log, metrics;
    const auto message = test::message_of<ConfigError>([&] {
      train(load(j), TrainOutput{log, metrics_of(metrics)});
    });
    INFO("world size " << world << ": " << message);
    CHECK(contains(message, "checkpoint.dir"));
    CHECK(contains(message, "'" + dir.string() + "'"));
    CHECK(contains(message, "Not a directory"));
    CHECK(metrics.str().empty());  // before any step
    CHECK(read_file(file) == bytes);
  }
}

TEST_CASE(
    "a directory that does not take files is refused by the probe, naming it and the "
    "reason, leaving nothing") {
  const ScratchFolder folder("shardswap-probe");
  const fs::path dir = folder / "ckpts";
  fs::create_directory(dir);
  // A read-only file system refuses the open; a failing disk, the fsync after the write.
  const OpenCheckpointFile read_only = [](const fs::path& p) -> std::unique_ptr<CheckpointFile> {
    throw Error(fmt::format("open '{}': Read-only file system", p.string()));
  };
  struct BadDisk : CheckpointFile {
    std::unique_ptr<CheckpointFile> real;
    void write(const void* d, std::size_t n) override { real->write(d, n); }
    void commit() override { throw Error("fsync: Input/output error"); }
  };
  const OpenCheckpointFile bad_disk = [](const fs::path& p) -> std::unique_ptr<CheckpointFile> {
    auto f = std::make_unique<BadDisk>();
    f->real = open_checkpoint_file(p);
    return f;
  };
  for (const auto& [open, reason] :
       {std::pair{read_only, "Read-only file system"}, std::pair{bad_disk, "Input/output error"}}) {
    const auto message = test::message_of<ConfigError>([&] { probe_checkpoint_dir(dir, open); });
    INFO(message);
    CHECK(contains(message, "'" + dir.string() + "'"));
    CHECK(contains(message, reason));
    CHECK(fs::is_empty(dir));
  }
  // A path that is not UTF-8 is a path like any other.
  const fs::path latin1 = folder / "ck_\xe9" / "deeper";
  probe_checkpoint_dir(latin1);
  CHECK(fs::is_directory(latin1));
  CHECK(fs::is_empty(latin1));
  CheckpointDirLock lock(latin1);
  CHECK(contains(test::message_of<CheckpointDirBusy>([&] { CheckpointDirLock again(latin1); }),
                 latin1.string()));
}

TEST_CASE("a save failing on one rank surfaces that rank's own error, not another rank's") {
  for (int world : {2, 3}) {
    const ScratchFolder folder("shardswap-rank-error");
    const fs::path dir = folder / checkpoint_name(3);
    const std::string failing = fmt::format("rank-{:05}-of-{:05}.bin", world - 1, world);
    const std::uint64_t seed = rng()();
    const auto message = test::message_of<Error>([&] {
      run_ranks(world, [&](int rank, Communicator& comm) {
        MemorySpace space(rank, make_host_allocator());
        Engine e(test_support::small_lisa_config(2), comm, space);
        test_support::declare_small_lisa_model(e);
        e.build([&](const ParamInfo& p, std::span<float> v) {
          std::mt19937_64 values(seed ^ std::hash<std::string>{}(p.name));  // same on every rank
          for (auto& x : v) x = static_cast<float>(values() % 1000) / 1000.0f;
        });
        SaveOptions options;
        options.open = [&](const fs::path& p) {
          if (p.filename() == failing)
            throw Error(fmt::format("open '{}': Read-only file system (simulated)", p.string()));
          return open_checkpoint_file(p);
        };
        if (rank == world - 1)
          fail_slowly([&] { save_checkpoint(e, dir, options); });
        else
          save_checkpoint(e, dir, options);
      });
    });
    INFO("world size " << world << ": " << message);
    CHECK(contains(message, failing));
    CHECK(contains(message, "Read-only file system"));
    CHECK(!contains(message, "other rank(s) failed"));
    CHECK(fs::is_empty(folder.path()));  // nothing published, nothing left
  }
}

TEST_CASE(
    "a rank failing inside a collective surfaces its own error, not the aborted "
    "collective's") {
  const std::uint64_t seed = rng()();
  const auto message = test::message_of<DeviceError>([&] {
    run_ranks(
        3,
        [&](int rank, Communicator& comm) {
          std::mt19937_64 values(seed + static_cast<std::uint64_t>(rank));
          std::vector<float> data(24);
          for (auto& x : data) x = static_cast<float>(values() % 100);
          fail_own_work = rank == 1;
          const auto reduce = [&] {
            comm.all_reduce(data.data(), data.size(), DType::f32, ReduceOp::sum);
          };
          if (rank == 1)
            fail_slowly(reduce);
          else
            reduce();
        },
        faulty_ops(), std::chrono::milliseconds{0});
  });
  CHECK(contains(message, "injected reduce failure"));
}

// ---- finding: signals ----

TEST_CASE(
    "a stop signal before step k stops the run after step k with a checkpoint there, and "
    "the resume equals the straight run bit for bit") {
  const ScratchFolder folder("shardswap-stop");
  const std::int64_t steps = 12;
  const int k = 3 + static_cast<int>(rng()() % 7);  // 3..9: between saves and on them alike
  INFO("stop after step " << k);
  auto j = small_run(steps);
  j["checkpoint"] = {{"dir", (folder / "straight").string()}, {"every", 5}, {"keep", 10}};
  std::ostringstream straight_log, straight_metrics;
  train(load(j), TrainOutput{straight_log, metrics_of(straight_metrics)});

  const fs::path dir = folder / "stopped";
  j["checkpoint"]["dir"] = dir.string();
  std::atomic<int> stop{0};
  LineHook hook([&](int line) {
    if (line == k - 1) stop = SIGTERM;  // after step k - 1 is complete: the next one finishes
  });
  std::ostream metrics(&hook);
  std::ostringstream log;
  TrainOutput out{log, metrics_of(metrics)};
  out.stop_signal = &stop;
  const TrainSummary stopped = train(load(j), out);
  INFO(log.str());
  CHECK(stopped.stopped_by == SIGTERM);
  CHECK(stopped.steps == k);
  CHECK(metrics_lines(hook.text()).size() == static_cast<std::size_t>(k));
  CHECK(contains(log.str(), fmt::format("SIGTERM")));
  CHECK(contains(log.str(), fmt::format("after step {}", k)));
  const fs::path saved = dir / checkpoint_name(k);
  CHECK(stopped.stop_checkpoint == saved.string());
  CHECK(contains(log.str(), saved.string()));
  REQUIRE(!list_checkpoints(dir).empty());
  CHECK(list_checkpoints(dir).back() == saved);

  j["checkpoint"]["load"] = "latest";
  std::ostringstream resumed_log, resumed_metrics;
  const TrainSummary resumed =
      train(load(j), TrainOutput{resumed_log, metrics_of(resumed_metrics)});
  CHECK(resumed.stopped_by == 0);
  CHECK(contains(resumed_log.str(), "resumed from " + saved.string()));
  const auto all = metrics_lines(straight_metrics.str());
  const auto after = metrics_lines(resumed_metrics.str());
  REQUIRE(after.size() == static_cast<std::size_t>(steps - k));
  for (std::size_t i = 0; i < after.size(); ++i) {
    INFO("step " << after[i]["step"]);
    CHECK(after[i].dump() == all[static_cast<std::size_t>(k) + i].dump());
  }
  // Every save has its own id, so the files differ in that; the values they hold may not.
  for (const bool master : {false, true}) {
    const auto want = read_checkpoint_tensors(folder / "straight" / checkpoint_name(steps), master);
    const auto got = read_checkpoint_tensors(dir / checkpoint_name(steps), master);
    REQUIRE(got.size() == want.size());
    for (std::size_t i = 0; i < got.size(); ++i) {
      INFO(got[i].name << (master ? " (master)" : " (bit16)"));
      CHECK(got[i].data == want[i].data);
    }
  }
}

TEST_CASE("a stop signal without checkpoint.dir stops after the step and says nothing was saved") {
  for (int signal : {SIGINT, SIGHUP}) {
    auto j = small_run(10);
    j["world_size"] = 3;
    std::atomic<int> stop{signal};  // already there at the start: the first step finishes
    std::ostringstream log, metrics;
    TrainOutput out{log, metrics_of(metrics)};
    out.stop_signal = &stop;
    const TrainSummary summary = train(load(j), out);
    INFO(log.str());
    CHECK(summary.stopped_by == signal);
    CHECK(summary.steps == 1);
    CHECK(summary.stop_checkpoint.empty());
    CHECK(metrics_lines(metrics.str()).size() == 1);
    CHECK(contains(log.str(), signal == SIGINT ? "SIGINT" : "SIGHUP"));
    CHECK(contains(log.str(), "no checkpoint"));
  }
}
