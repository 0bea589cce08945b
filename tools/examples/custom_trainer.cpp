// A user's own trainer on the ShardSwap C++ API (docs/api.md walks through it): a two-layer MLP
// softmax classifier written with plain loops, data made up in the program, trained by 2 ranks as
// threads with ZeRO-2, bf16 weights, AdamW and 2 micro-batches per step. Part-way it deactivates
// the hidden layer's group under `drop` and later activates it again.
//
// It checks what a user relies on and says so through its exit code: the loss falls by a clear
// margin, the memory stats equal Engine::plan() after build, after every lifecycle call and
// after every step, and a run resumed from its checkpoint repeats the same bits. Exit 0: every
// check passed; 1: a check or the run failed; 2: bad input.
#include <fmt/format.h>

#include <stdlib.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "shardswap/backend.h"
#include "shardswap/checkpoint.h"
#include "shardswap/engine.h"
#include "shardswap/error.h"

using namespace shardswap;

namespace {

// The model: logits = W2 tanh(W1 x + b1) + b2, softmax cross-entropy. Two groups, one per layer.
constexpr int kInputs = 16, kHidden = 32, kClasses = 4;

// The run.
constexpr int kRanks = 2;
constexpr int kMicroBatches = 2;  // gradient accumulation steps
constexpr int kBatch = 32;        // samples per rank and micro-batch
constexpr int kEvalSamples = 512;
constexpr int kSteps = 80;
constexpr int kFreezeAt = 30;           // "hidden" is deactivated (drop) before this step ...
constexpr int kThawAt = 50;             // ... and activated again before this one
constexpr int kSaveAt = 60;             // a checkpoint before this step; the end resumes from it
constexpr double kRequiredRatio = 0.5;  // the last evaluation loss must be below half the first

/// A failed check of this program (as opposed to an error of the engine).
struct CheckFailed : std::runtime_error {
  using std::runtime_error::runtime_error;
};

void require(bool ok, const std::string& what) {
  if (!ok) throw CheckFailed(what);
}

// The engine's central promise: after build and after every lifecycle call, each tag holds
// exactly what plan() says (requested bytes). Nothing is cached, nothing is left behind.
void require_stats_equal_plan(const Engine& engine, const std::string& after) {
  const MemoryStats stats = engine.memory_stats();
  const MemoryPlan plan = engine.plan();
  for (Tag t : kAllTags)
    require(stats.tag(t).requested.current == plan.of(t),
            fmt::format("rank {}: after {}: tag {} holds {} bytes, plan() says {}", engine.rank(),
                        after, tag_name(t), stats.tag(t).requested.current, plan.of(t)));
}

struct Batch {
  int size = 0;
  std::vector<double> x;  // size x kInputs, row-major
  std::vector<int> label;
};

// Labels are the argmax of a fixed random linear teacher, which a small MLP can learn.
class Task {
 public:
  explicit Task(std::uint64_t seed) : teacher_(kClasses * kInputs) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<double> normal;
    for (auto& w : teacher_) w = normal(rng);
  }

  /// The batch of one data stream; streams are disjoint, so ranks and micro-batches see
  /// different samples.
  Batch sample(std::uint64_t stream, int size) const {
    std::mt19937_64 rng(0x5eed0000 + stream);
    std::normal_distribution<double> normal;
    Batch b;
    b.size = size;
    b.x.resize(static_cast<std::size_t>(size) * kInputs);
    for (auto& v : b.x) v = normal(rng);
    for (int s = 0; s < size; ++s) {
      int best = 0;
      double best_logit = -INFINITY;
      for (int c = 0; c < kClasses; ++c) {
        double logit = 0.0;
        for (int i = 0; i < kInputs; ++i) logit += teacher_[c * kInputs + i] * b.x[s * kInputs + i];
        if (logit > best_logit) best_logit = logit, best = c;
      }
      b.label.push_back(best);
    }
    return b;
  }

 private:
  std::vector<double> teacher_;  // kClasses x kInputs
};

// Declares the params. Every rank makes the same declarations in the same order.
// doc-snippet: declare
void declare(Engine& engine) {
  engine.add_param("fc1.weight", {kHidden, kInputs}, "hidden");
  engine.add_param("fc1.bias", {kHidden}, "hidden");
  engine.add_param("fc2.weight", {kClasses, kHidden}, "output");
  engine.add_param("fc2.bias", {kClasses}, "output");
}
// doc-snippet-end

// Initial weights, uniform in +-1/sqrt(fan_in), biases zero. Seeded by the param's name alone, so
// every rank computes the same values (build() broadcasts rank 0's anyway).
void init(const ParamInfo& param, std::span<float> values) {
  if (param.shape.size() == 1) {
    std::fill(values.begin(), values.end(), 0.0f);
    return;
  }
  std::uint64_t seed = 1469598103934665603ull;  // FNV-1a hash of the name
  for (unsigned char c : param.name) seed = (seed ^ c) * 1099511628211ull;
  std::mt19937_64 rng(seed);
  const double bound = 1.0 / std::sqrt(static_cast<double>(param.shape[1]));
  std::uniform_real_distribution<double> uniform(-bound, bound);
  for (auto& v : values) v = static_cast<float>(uniform(rng));
}

// The weights as the engine holds them (bf16), widened to double for the loops below.
// Engine::read_weight copies a param's weights to the host as floats, on any backend.
struct Weights {
  std::vector<double> w1, b1, w2, b2;
};

std::vector<double> widen(const Engine& engine, const std::string& name) {
  const std::vector<float> values = engine.read_weight(name);
  return {values.begin(), values.end()};
}

Weights read_weights(const Engine& engine) {
  return {widen(engine, "fc1.weight"), widen(engine, "fc1.bias"), widen(engine, "fc2.weight"),
          widen(engine, "fc2.bias")};
}

// Forward pass of one batch into `hidden` (size x kHidden) and `prob` (size x kClasses); returns
// the mean cross-entropy.
double forward(const Weights& w, const Batch& b, float* hidden, float* prob) {
  double loss = 0.0;
  for (int s = 0; s < b.size; ++s) {
    float* h = hidden + s * kHidden;
    for (int j = 0; j < kHidden; ++j) {
      double u = w.b1[j];
      for (int i = 0; i < kInputs; ++i) u += w.w1[j * kInputs + i] * b.x[s * kInputs + i];
      h[j] = static_cast<float>(std::tanh(u));
    }
    double logits[kClasses], top = -INFINITY;
    for (int c = 0; c < kClasses; ++c) {
      logits[c] = w.b2[c];
      for (int j = 0; j < kHidden; ++j) logits[c] += w.w2[c * kHidden + j] * h[j];
      top = std::max(top, logits[c]);
    }
    double sum = 0.0;
    for (int c = 0; c < kClasses; ++c) sum += std::exp(logits[c] - top);
    for (int c = 0; c < kClasses; ++c)
      prob[s * kClasses + c] = static_cast<float>(std::exp(logits[c] - top) / sum);
    loss -= logits[b.label[s]] - top - std::log(sum);
  }
  return loss / b.size;
}

// Hands this micro-batch's gradient of one param to the engine, times loss_scale() (1 with
// bf16; the fp16 dynamic scale otherwise). add_grad adds it into the param's gradient, converting
// to the gradient type, and marks it ready: with gradient accumulation the gradients of the
// micro-batches add up.
// doc-snippet: add_grad
void add_grad(Engine& engine, const std::string& name, const std::vector<double>& grad) {
  const double scale = engine.loss_scale();
  std::vector<float> scaled(grad.size());
  for (std::size_t i = 0; i < grad.size(); ++i) scaled[i] = static_cast<float>(scale * grad[i]);
  engine.add_grad(name, scaled);
}
// doc-snippet-end

// One micro-batch: forward, then backward into the grad slots of the active groups, output layer
// first as backward produces it. Gradients are of this micro-batch's mean loss; the engine
// averages over ranks and micro-batches. Returns the loss.
double train_micro_batch(Engine& engine, const Batch& b) {
  const Weights w = read_weights(engine);
  // The model's working memory comes from the rank's MemorySpace under Tag::activation, so the
  // stats (and their peak) count it. It is freed when `work` goes out of scope.
  Buffer work = engine.memory().allocate(sizeof(float) * b.size * (kHidden + kClasses),
                                         Tag::activation, "custom_trainer activations");
  float* hidden = work.as<float>();  // host memory: this model runs on the cpu backend
  float* prob = hidden + b.size * kHidden;
  const double loss = forward(w, b, hidden, prob);

  std::vector<double> dw2(kClasses * kHidden, 0.0), db2(kClasses, 0.0);
  std::vector<double> dw1(kHidden * kInputs, 0.0), db1(kHidden, 0.0);
  for (int s = 0; s < b.size; ++s) {
    const float* h = hidden + s * kHidden;
    double dlogit[kClasses];
    for (int c = 0; c < kClasses; ++c)
      dlogit[c] = (prob[s * kClasses + c] - (c == b.label[s] ? 1.0 : 0.0)) / b.size;
    for (int c = 0; c < kClasses; ++c) {
      db2[c] += dlogit[c];
      for (int j = 0; j < kHidden; ++j) dw2[c * kHidden + j] += dlogit[c] * h[j];
    }
    for (int j = 0; j < kHidden; ++j) {
      double dh = 0.0;
      for (int c = 0; c < kClasses; ++c) dh += w.w2[c * kHidden + j] * dlogit[c];
      const double du = dh * (1.0 - static_cast<double>(h[j]) * h[j]);
      db1[j] += du;
      for (int i = 0; i < kInputs; ++i) dw1[j * kInputs + i] += du * b.x[s * kInputs + i];
    }
  }
  if (engine.is_active("output")) {
    add_grad(engine, "fc2.bias", db2);
    add_grad(engine, "fc2.weight", dw2);
  }
  if (engine.is_active("hidden")) {  // a frozen group takes no gradients (grad_slot would throw)
    add_grad(engine, "fc1.bias", db1);
    add_grad(engine, "fc1.weight", dw1);
  }
  return loss;
}

double evaluate(const Engine& engine, const Batch& b) {
  std::vector<float> hidden(static_cast<std::size_t>(b.size) * kHidden);
  std::vector<float> prob(static_cast<std::size_t>(b.size) * kClasses);
  return forward(read_weights(engine), b, hidden.data(), prob.data());
}

// doc-snippet: config
EngineConfig make_config() {
  EngineConfig config;
  config.stage = 2;
  config.dtype = DType::bf16;
  config.gradient_accumulation_steps = kMicroBatches;
  // Two stage-2 buckets of this many bytes each. The default (64 MiB) would dwarf this model;
  // it must hold the largest param (fc1.weight: 512 bf16 = 1 KiB) or it is grown to it.
  config.reduce_bucket_bytes = 2048;
  config.gradient_clipping = 1.0;
  config.optimizer.type = OptimizerType::adamw;
  config.optimizer.lr = 0.02;
  config.optimizer.weight_decay = 0.01;
  return config;
}
// doc-snippet-end

void print_plan(const MemoryPlan& plan, const MemoryStats& stats) {
  std::string line;
  for (Tag t : kAllTags)
    if (plan.of(t) != 0) line += fmt::format(" {} {}", tag_name(t), plan.of(t));
  fmt::print("  plan():{}; total {} B\n", line, plan.total());
  fmt::print("  stats: requested {} B, allocated {} B, reserved {} B\n", stats.requested.current,
             stats.allocated.current, stats.reserved.current);
}

// A folder of the run's own for its checkpoint, removed when the run ends.
struct TemporaryFolder {
  std::filesystem::path path;
  TemporaryFolder() {
    std::string name = (std::filesystem::temp_directory_path() / "custom-trainer-XXXXXX").string();
    if (::mkdtemp(name.data()) == nullptr) throw std::runtime_error("mkdtemp failed for " + name);
    path = name;
  }
  ~TemporaryFolder() {
    std::error_code ignored;
    std::filesystem::remove_all(path, ignored);
  }
};

// One rank's run after build(): the training loop with its switches and its save, then the
// checks at the end and the resume from the checkpoint.
struct RankRun {
  RankRun(Engine& engine, const EngineConfig& config, const Task& task, const Batch& eval,
          int rank, const std::filesystem::path& checkpoint_dir)
      : engine(engine), config(config), task(task), eval(eval), rank(rank),
        checkpoint_dir(checkpoint_dir) {}

  Engine& engine;
  const EngineConfig& config;
  const Task& task;
  const Batch& eval;
  const int rank;
  const std::filesystem::path& checkpoint_dir;
  const bool log = rank == 0;
  double first_eval = 0.0;
  std::vector<float> frozen_w1;

  // One step: its micro-batches (a pure function of the step and rank), then step().
  std::pair<double, StepResult> train_step(int step) {
    // doc-snippet: step
    double loss = 0.0;
    for (int micro = 0; micro < kMicroBatches; ++micro) {
      const auto stream =
          1 + (static_cast<std::uint64_t>(step) * kMicroBatches + micro) * kRanks +
          static_cast<std::uint64_t>(rank);
      loss += train_micro_batch(engine, task.sample(stream, kBatch));
    }
    const StepResult result = engine.step();
    require(result.applied, fmt::format("step {} was applied (no Inf/NaN)", step));
    require_stats_equal_plan(engine, fmt::format("step {}", step));
    // A collective: every rank calls it.
    loss = engine.sum_across_ranks(loss / kMicroBatches) / kRanks;
    // doc-snippet-end
    return std::pair{loss, result};
  }

  // Before step kFreezeAt the hidden group is frozen (drop), before kThawAt active again.
  void switch_groups(int step) {
    // doc-snippet: deactivate
    if (step == kFreezeAt) {
      // Keep a View of the fp32 master to show what happens to aliases of freed memory.
      const View master = engine.master("hidden");
      const std::int64_t before = engine.memory_stats().requested.current;
      frozen_w1 = engine.read_weight("fc1.weight");
      const std::size_t pinned = engine.deactivate("hidden", DeactivatePolicy::drop);
      require_stats_equal_plan(engine, "deactivate(hidden, drop)");
      require(pinned == 0, "no Pin holds the hidden group's memory");
      require(master.stale(), "a View of a freed buffer is stale, not dangling");
      require(!engine.is_active("hidden") && engine.group_step("hidden") == 0,
              "drop leaves the group frozen with its step count reset");
      if (log) {
        fmt::print("before step {}: deactivate(hidden, drop) freed {} B\n", step,
                   before - engine.memory_stats().requested.current);
        print_plan(engine.plan(), engine.memory_stats());
      }
      try {
        (void)master.data<float>();
        require(false, "reading through a stale View throws StaleView");
      } catch (const StaleView& e) {
        if (log) fmt::print("  reading the old master View: {}\n", e.what());
      }
    }
    // doc-snippet-end
    if (step == kThawAt) {
      require(engine.read_weight("fc1.weight") == frozen_w1,
              "a frozen group's weights do not change");
      const std::int64_t before = engine.memory_stats().requested.current;
      engine.activate("hidden");
      require_stats_equal_plan(engine, "activate(hidden)");
      require(engine.group_step("hidden") == 0, "after drop a group restarts at step 0");
      if (log) {
        fmt::print("before step {}: activate(hidden) took {} B\n", step,
                   engine.memory_stats().requested.current - before);
        print_plan(engine.plan(), engine.memory_stats());
      }
    }
  }

  void train() {
    if (log) {
      fmt::print("custom_trainer: {} ranks, ZeRO-{}, {}, {}, {} micro-batches of {}\n", kRanks,
                 config.stage, dtype_name(config.dtype),
                 optimizer_type_name(config.optimizer.type), kMicroBatches, kBatch);
      fmt::print("after build (rank 0):\n");
      print_plan(engine.plan(), engine.memory_stats());
    }
    first_eval = evaluate(engine, eval);
    if (log) fmt::print("before step 0: eval loss {:.4f}\n", first_eval);
    for (int step = 0; step < kSteps; ++step) {
      switch_groups(step);
      // doc-snippet: checkpoint
      if (step == kSaveAt) {
        // Collective: every rank writes its shard of the fp32 state; `extra` holds the
        // trainer's own state (here, where to go on from), given back by load_checkpoint.
        SaveOptions options;
        options.extra = {{"next_step", step}};
        save_checkpoint(engine, checkpoint_dir, options);
      }
      // doc-snippet-end
      const auto [loss, result] = train_step(step);
      if (log && (step % 10 == 0 || step == kFreezeAt - 1 || step == kThawAt - 1 ||
                  step == kSteps - 1))
        fmt::print("after step {:>2}: train loss {:.4f}  eval loss {:.4f}  grad norm {:.4f}  {}\n",
                   step, loss, evaluate(engine, eval), result.grad_norm,
                   engine.is_active("hidden") ? "both groups" : "hidden frozen");
    }
  }

  void resume_and_check() {
    const double last_eval = evaluate(engine, eval);  // the same weights on every rank
    require(engine.group_step("output") == kSteps, "the output group stepped every step");
    require(engine.group_step("hidden") == kSteps - kThawAt,
            "the hidden group counts its steps since reactivation");
    require(last_eval < kRequiredRatio * first_eval,
            fmt::format("the eval loss fell from {:.4f} to {:.4f}, not below {} of it", first_eval,
                        last_eval, kRequiredRatio));
    const MemoryStats stats = engine.memory_stats();
    // doc-snippet: resume
    // Back to the checkpoint and on to the end again: the same bits as the first time.
    const std::vector<float> w1 = engine.read_weight("fc1.weight");
    const LoadedCheckpoint loaded = load_checkpoint(engine, checkpoint_dir);
    require_stats_equal_plan(engine, "load_checkpoint");
    for (int step = loaded.extra.at("next_step").get<int>(); step < kSteps; ++step)
      train_step(step);
    require(engine.read_weight("fc1.weight") == w1, "a resumed run repeats the same bits");
    // doc-snippet-end
    if (log) {
      fmt::print("resumed from {} (saved at step {} by {} ranks): the same weights at step {}\n",
                 checkpoint_dir.filename().string(), kSaveAt, loaded.world_size, kSteps);
      fmt::print("peak requested {} B (activation peak {} B); {} Views, {} Pins live\n",
                 stats.requested.peak, stats.tag(Tag::activation).requested.peak, stats.views,
                 stats.pins);
      fmt::print("custom_trainer: PASS: eval loss {:.4f} -> {:.4f}\n", first_eval, last_eval);
    }
  }
};

void run() {
  const TemporaryFolder scratch;
  const std::filesystem::path checkpoint_dir = scratch.path / "step-60";
  // doc-snippet: ranks
  const Backend backend = cpu_backend();
  const EngineConfig config = make_config();
  const Task task(7);
  const Batch eval = task.sample(0, kEvalSamples);

  run_ranks(
      kRanks,
      [&](int rank, Communicator& comm) {
        MemorySpace space(rank, backend.make_allocator(rank));
        Engine engine(config, comm, space, backend);
        declare(engine);
        const MemoryPlan planned = engine.plan();  // what build() will allocate
        engine.build(init);
        require_stats_equal_plan(engine, "build()");
        // doc-snippet-end
        require(engine.memory_stats().requested.current == planned.total(),
                "build() allocates what plan() said before it");
        RankRun run(engine, config, task, eval, rank, checkpoint_dir);
        run.train();
        run.resume_and_check();
      },
      backend);
}

}  // namespace

int main() {
  // doc-snippet: errors
  try {
    run();
    return 0;
  } catch (const CheckFailed& e) {
    std::fprintf(stderr, "custom_trainer: CHECK FAILED: %s\n", e.what());
  } catch (const PeerFailure& e) {
    // run_ranks rethrows a rank's own error first; this only when every failing rank failed
    // because of another one, e.g. a rank that returned while the others were in a collective.
    std::fprintf(stderr, "custom_trainer: a rank stopped the others: %s\n", e.what());
  } catch (const CommError& e) {
    // The ranks disagreed (declarations, the order gradients were handed over) or a collective
    // failed: the message names both ranks' sides. End the run.
    std::fprintf(stderr, "custom_trainer: ranks out of step: %s\n", e.what());
  } catch (const ConfigError& e) {
    std::fprintf(stderr, "custom_trainer: bad input: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "custom_trainer: error: %s\n", e.what());
  }
  return 1;
  // doc-snippet-end
}
