// The decoder's CPU backend against the float64 reference (tests/support/decoder_reference.h):
// logits and loss over the architecture's variants, every param's gradient against finite
// differences, frozen groups, bf16 weights and slots, determinism, and its memory block.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "optimizer/optimizer.h"
#include "shardswap/elements.h"
#include "shardswap/error.h"
#include "tests/catch_compat.h"
#include "tests/support/decoder_reference.h"
#include "model/decoder_cpu.h"

using namespace shardswap;
using lm::dec::ParamId;
using lm::dec::ParamKind;
using test_support::DecoderTokens;
using test_support::DecoderValues;

namespace {

// ---- shapes ----

DecoderShape tiny_llama() {  // GQA (K < H), no bias, untied
  DecoderShape s;
  s.family = DecoderFamily::llama;
  s.vocab = 37;
  s.hidden = 16;
  s.intermediate = 24;
  s.layers = 2;
  s.heads = 4;
  s.kv_heads = 2;
  s.head_dim = 4;
  s.max_positions = 32;
  s.rms_eps = 1e-5;
  return s;
}

DecoderShape tiny_qwen2(bool tied) {  // K == H, q/k/v biases
  DecoderShape s = tiny_llama();
  s.family = DecoderFamily::qwen2;
  s.heads = 2;
  s.kv_heads = 2;
  s.head_dim = 8;
  s.qkv_bias = true;
  s.tied = tied;
  s.rope_theta = 1e6;
  s.rms_eps = 1e-6;
  return s;
}

// head_dim 6 with theta 10^4: inv_freq 1, 0.046, 0.0022 (wavelengths 6.3, 135, 2900); with an
// original context of 256 the first is kept, the second blended and the third divided.
DecoderShape tiny_llama3() {
  DecoderShape s = tiny_llama();
  s.heads = 3;
  s.kv_heads = 1;
  s.head_dim = 6;  // q width 18 != hidden 16
  s.rope_scaling = RopeScaling::llama3;
  s.rope_factor = 8.0;
  s.rope_low_freq_factor = 1.0;
  s.rope_high_freq_factor = 4.0;
  s.rope_original_max_positions = 256;
  s.rope_theta = 10000.0;
  return s;
}

// Qwen3: per-head q/k norms, no biases, head_dim 6 apart from hidden / heads = 4; GQA.
DecoderShape tiny_qwen3(bool tied) {
  DecoderShape s = tiny_llama();
  s.family = DecoderFamily::qwen3;
  s.heads = 4;
  s.kv_heads = 2;
  s.head_dim = 6;
  s.qk_norm = true;
  s.tied = tied;
  s.rope_theta = 1e6;
  s.rms_eps = 1e-6;
  return s;
}

DecoderShape tiny_mistral() {  // GQA, three layers, tied
  DecoderShape s = tiny_llama();
  s.family = DecoderFamily::mistral;
  s.layers = 3;
  s.tied = true;
  return s;
}

// ---- params by name, as the reference names them ----

std::string name_of(ParamId p) {
  const auto layer = [&](const char* what) {
    return fmt::format("model.layers.{}.{}", p.layer, what);
  };
  switch (p.kind) {
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
  return "?";
}

int group_of(const DecoderShape& s, const std::string& name) {
  for (const auto& p : test_support::decoder_reference_params(s))
    if (p.name == name) return p.group;
  return -1;
}

// ---- weights of a dtype, and the exact values they hold ----

struct Model {
  DecoderShape shape;
  DecoderValues values;  // what the stored weights are, exactly
  std::map<std::string, std::vector<std::byte>> storage;
  lm::dec::Weights weights;
};

Model make_model(const DecoderShape& s, const DecoderValues& values, DType dtype) {
  Model m{s, {}, {}, {}};
  for (const auto& [name, v] : values) {
    std::vector<float> f(v.begin(), v.end());
    auto& bytes = m.storage[name];
    bytes.resize(f.size() * dtype_size(dtype));
    cpu_device_ops().cast(bytes.data(), dtype, f.data(), DType::f32, f.size());
    cpu_device_ops().cast(f.data(), DType::f32, bytes.data(), dtype, f.size());
    m.values[name] = std::vector<double>(f.begin(), f.end());
  }
  const auto ptr = [&](const std::string& name) -> const void* {
    const auto it = m.storage.find(name);
    return it == m.storage.end() ? nullptr : it->second.data();
  };
  auto& w = m.weights;
  w.dtype = dtype;
  w.embed = ptr("model.embed_tokens.weight");
  for (int l = 0; l < s.layers; ++l) {
    const auto n = [&](ParamKind k) { return ptr(name_of({k, l})); };
    lm::dec::LayerWeights lw;
    for (const ParamKind kind : lm::dec::kLayerKinds) lm::dec::layer_weight(lw, kind) = n(kind);
    w.layers.push_back(lw);
  }
  w.final_norm = ptr("model.norm.weight");
  w.head = s.tied ? w.embed : ptr("lm_head.weight");
  return m;
}

Model random_model(const DecoderShape& s, std::uint64_t seed, DType dtype = DType::f32) {
  return make_model(s, test_support::random_decoder_weights(s, seed), dtype);
}

// ---- the backend's block, between guard bytes ----

constexpr std::size_t kGuard = 4096;
constexpr unsigned char kPattern = 0xA5;

struct Block {
  std::vector<unsigned char> raw;
  std::size_t offset = 0, bytes = 0;
  explicit Block(std::size_t n) : raw(n + 2 * kGuard + 64, kPattern), bytes(n) {
    const auto base = reinterpret_cast<std::uintptr_t>(raw.data()) + kGuard;
    offset = kGuard + (64 - base % 64) % 64;
  }
  void* data() { return raw.data() + offset; }
  bool guards_intact() const {
    for (std::size_t i = 0; i < raw.size(); ++i)
      if ((i < offset || i >= offset + bytes) && raw[i] != kPattern) return false;
    return true;
  }
};

struct Backend {
  Block block;
  std::unique_ptr<lm::dec::Compute> compute;
  Backend(const DecoderShape& s, int max_sequences, int seq_len,
          lm::dec::Precision precision = {}, int loss_rows = 0)
      : block(lm::dec::cpu_bytes(s, max_sequences, seq_len, 0, loss_rows)),
        compute(lm::dec::make_cpu_compute(s, max_sequences, seq_len, block.data(), block.bytes,
                                          0, precision, loss_rows)) {}
};

lm::dec::Batch batch_of(const DecoderTokens& t) {
  return {t.sequences, t.seq_len, t.inputs.data(), t.targets.data(),
          t.positions.empty() ? nullptr : t.positions.data()};
}

// Positions that cut each row into documents at random places (a row's first always starts
// one), and the (row, first column, length) of each document.
struct Documents {
  std::vector<std::int32_t> positions;
  std::vector<std::array<int, 3>> spans;
};
Documents random_documents(int sequences, int seq_len, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  Documents d;
  for (int r = 0; r < sequences; ++r) {
    int start = 0;
    for (int c = 0; c < seq_len; ++c) {
      if (c > 0 && rng() % 4 == 0) {
        d.spans.push_back({r, start, c - start});
        start = c;
      }
      d.positions.push_back(c - start);
    }
    d.spans.push_back({r, start, seq_len - start});
  }
  return d;
}

// ---- a grad sink that records what backward does ----

class RecordingSink final : public lm::dec::GradSink {
 public:
  /// Slots of `dtype` for every param, zero or `initial` (rounded to the dtype).
  RecordingSink(const DecoderShape& s, std::set<int> active, DType dtype = DType::f32,
                const DecoderValues* initial = nullptr)
      : s_(s), active_(std::move(active)), dtype_(dtype) {
    for (const auto& p : test_support::decoder_reference_params(s)) {
      std::vector<float> f(static_cast<std::size_t>(p.numel()), 0.0f);
      if (initial != nullptr)
        std::copy(initial->at(p.name).begin(), initial->at(p.name).end(), f.begin());
      auto& bytes = slots_[p.name];
      bytes.resize(f.size() * dtype_size(dtype));
      cpu_device_ops().cast(bytes.data(), dtype, f.data(), DType::f32, f.size());
    }
  }
  static std::set<int> all(const DecoderShape& s) {
    std::set<int> g;
    for (int i = 0; i <= s.layers + 1; ++i) g.insert(i);
    return g;
  }

  bool active(int group) const override { return active_.count(group) != 0; }
  lm::dec::GradSlot open(ParamId param) override {
    const std::string name = name_of(param);
    events.push_back("open " + name);
    if (!open_.insert(name).second) problems.push_back(name + " opened twice at once");
    if (closed_.count(name) != 0) problems.push_back(name + " opened again after its close");
    if (!active(group_of(s_, name))) problems.push_back(name + " of a frozen group opened");
    return {slots_.at(name).data(), dtype_};
  }
  void close(ParamId param) override {
    const std::string name = name_of(param);
    events.push_back("close " + name);
    if (open_.erase(name) == 0) problems.push_back(name + " closed without being open");
    closed_.insert(name);
  }

  std::vector<double> grad(const std::string& name) const {
    const auto& bytes = slots_.at(name);
    std::vector<float> f(bytes.size() / dtype_size(dtype_));
    cpu_device_ops().cast(f.data(), DType::f32, bytes.data(), dtype_, f.size());
    return {f.begin(), f.end()};
  }
  const std::vector<std::byte>& raw(const std::string& name) const { return slots_.at(name); }
  bool all_closed() const { return open_.empty(); }
  const std::set<std::string>& closed() const { return closed_; }

  std::vector<std::string> events;
  std::vector<std::string> problems;

 private:
  DecoderShape s_;
  std::set<int> active_;
  DType dtype_;
  std::map<std::string, std::vector<std::byte>> slots_;
  std::set<std::string> open_, closed_;
};

// Coordinates at which a param's gradient is compared with finite differences: all of a small
// param, else 12 at random; for the embedding, rows of tokens the batch uses (the others have
// no gradient) and, tied, a few of the head's own.
std::vector<std::size_t> sample_of(const DecoderShape& s, const test_support::DecoderRefParam& p,
                                   const DecoderTokens& t, std::mt19937_64& rng) {
  const auto numel = static_cast<std::size_t>(p.numel());
  std::vector<std::size_t> out;
  if (numel <= 24) {
    for (std::size_t i = 0; i < numel; ++i) out.push_back(i);
    return out;
  }
  const auto d = static_cast<std::size_t>(s.hidden);
  for (int k = 0; k < 12; ++k) {
    std::size_t i = rng() % numel;
    if (p.name == "model.embed_tokens.weight" && k % 2 == 0)
      i = static_cast<std::size_t>(t.inputs[rng() % t.inputs.size()]) * d + rng() % d;
    out.push_back(i);
  }
  return out;
}

}  // namespace

TEST_CASE(
    "decoder reference: its RoPE frequencies are the seam's rope_inv_freq, llama3 rules included",
    "[decoder]") {
  for (const DecoderShape& s : {tiny_llama(), tiny_qwen2(false), tiny_llama3()}) {
    const auto ours = rope_inv_freq(s), ref = test_support::decoder_reference_inv_freq(s);
    REQUIRE(ours.size() == ref.size());
    for (std::size_t i = 0; i < ours.size(); ++i) REQUIRE(ours[i] == Approx(ref[i]).epsilon(1e-6));
  }
  // The llama3 shape meets all three regimes: kept, blended, divided by the factor.
  const auto plain = rope_inv_freq(tiny_llama3());
  DecoderShape unscaled = tiny_llama3();
  unscaled.rope_scaling = RopeScaling::none;
  const auto base = rope_inv_freq(unscaled);
  REQUIRE(plain[0] == base[0]);
  REQUIRE(plain[1] < base[1]);
  REQUIRE(plain[1] > base[1] / 8.0f * 1.01f);
  REQUIRE(plain[2] == Approx(base[2] / 8.0f).epsilon(1e-6));
}

TEST_CASE(
    "decoder CPU forward: logits and loss match the float64 reference (normalized error < 1e-5)",
    "[decoder]") {
  struct Case {
    const char* what;
    DecoderShape shape;
    int max_sequences, seq_len, sequences, batch_len;
  };
  const Case cases[] = {
      {"llama GQA", tiny_llama(), 3, 8, 3, 8},
      {"llama GQA, one sequence", tiny_llama(), 3, 8, 1, 8},
      {"qwen2 bias untied", tiny_qwen2(false), 3, 8, 3, 8},
      {"qwen2 bias tied", tiny_qwen2(true), 3, 8, 1, 8},
      {"llama3 rope scaling", tiny_llama3(), 2, 12, 2, 12},
      {"mistral tied, shorter batch", tiny_mistral(), 4, 10, 3, 6},
      {"llama GQA, two loss chunks", tiny_llama(), 3, 32, 3, 30},
      {"qwen3 q/k norms untied", tiny_qwen3(false), 3, 8, 3, 8},
      {"qwen3 q/k norms tied, shorter batch", tiny_qwen3(true), 2, 10, 2, 7},
  };
  std::uint64_t seed = 1;
  for (const Case& c : cases) {
    CAPTURE(c.what);
    const Model m = random_model(c.shape, seed++);
    const DecoderTokens t =
        test_support::random_decoder_tokens(c.shape, c.sequences, c.batch_len, seed++);
    Backend be(c.shape, c.max_sequences, c.seq_len);
    const auto ref = test_support::decoder_reference_forward(c.shape, m.values, t);
    std::vector<float> logits(ref.logits.size());
    be.compute->logits(m.weights, batch_of(t), logits.data());
    const double logits_error = test_support::decoder_normalized_error(
        std::vector<double>(logits.begin(), logits.end()), ref.logits);
    const double loss = be.compute->loss(m.weights, batch_of(t));
    CAPTURE(logits_error, loss, ref.loss);
    REQUIRE(logits_error < 1e-5);
    REQUIRE(std::abs(loss - ref.loss) / ref.loss < 1e-5);
    REQUIRE(be.block.guards_intact());
  }
}

TEST_CASE(
    "decoder CPU backward: every param's gradient matches finite differences of the float64 "
    "reference",
    "[decoder]") {
  struct Case {
    const char* what;
    DecoderShape shape;
    int sequences, seq_len;
  };
  const Case cases[] = {
      {"llama GQA", tiny_llama(), 3, 6},
      {"qwen2 bias tied", tiny_qwen2(true), 2, 5},
      {"llama3 rope scaling, K = 1", tiny_llama3(), 1, 9},
      {"qwen2 bias untied, two loss chunks", tiny_qwen2(false), 3, 30},
      {"qwen3 q/k norms, GQA", tiny_qwen3(false), 2, 6},
      {"qwen3 q/k norms tied", tiny_qwen3(true), 1, 7},
  };
  static_assert(3 * 30 > lm::dec::kLossChunkRows && 3 * 30 < 2 * lm::dec::kLossChunkRows,
                "the last case's 90 tokens take a full chunk of rows and a partial one");
  std::uint64_t seed = 100;
  for (const Case& c : cases) {
    CAPTURE(c.what);
    Model m = random_model(c.shape, seed++);
    const DecoderTokens t =
        test_support::random_decoder_tokens(c.shape, c.sequences, c.seq_len, seed++);
    Backend be(c.shape, c.sequences, c.seq_len + 2);
    RecordingSink sink(c.shape, RecordingSink::all(c.shape));
    const double loss = be.compute->train_step(m.weights, batch_of(t), 1.0, sink);
    REQUIRE(sink.problems.empty());
    REQUIRE(sink.all_closed());
    const auto params = test_support::decoder_reference_params(c.shape);
    REQUIRE(sink.closed().size() == params.size());
    REQUIRE(std::abs(loss - test_support::decoder_reference_forward(c.shape, m.values, t).loss) <
            1e-5 * loss);
    std::mt19937_64 rng(seed++);
    double worst = 0.0;
    for (const auto& p : params) {
      CAPTURE(p.name);
      const auto got = sink.grad(p.name);
      std::vector<double> ours, numeric;
      for (std::size_t i : sample_of(c.shape, p, t, rng)) {
        ours.push_back(got[i]);
        numeric.push_back(
            test_support::decoder_reference_gradient(c.shape, m.values, t, p.name, i));
      }
      const double err = test_support::decoder_normalized_error(ours, numeric);
      double norm = 0.0;
      for (double g : numeric) norm += g * g;
      CAPTURE(err, norm);
      REQUIRE(norm > 0.0);  // the sample really has a gradient
      REQUIRE(err < 1e-5);
      worst = std::max(worst, err);
    }
    UNSCOPED_INFO(c.what << ": worst normalized gradient error " << worst);
    REQUIRE(be.block.guards_intact());
  }
}

// model.loss_chunk_rows: the cross-entropy's rows a chunk size its logits block and how often
// the head's gradient is added to; the loss is the same and the gradients the same up to the
// order of those additions. A chunk above the batch's tokens is the batch; a negative one is
// refused, naming it.
TEST_CASE("decoder CPU: the loss's chunk of rows changes the block's bytes, not the loss or the "
          "gradients",
          "[decoder]") {
  const DecoderShape s = tiny_qwen2(false);
  const int sequences = 3, seq_len = 30;  // 90 tokens
  const auto bytes = [&](int rows) { return lm::dec::cpu_bytes(s, sequences, seq_len, 0, rows); };
  CHECK(bytes(7) < bytes(0));  // 0: kLossChunkRows (64)
  CHECK(bytes(0) == bytes(lm::dec::kLossChunkRows));
  CHECK(bytes(0) < bytes(90));
  CHECK(bytes(90) == bytes(100000));
  CHECK(test::contains(test::message_of<ConfigError>([&] { (void)bytes(-1); }),
                       "loss_chunk_rows = -1"));
  Model m = random_model(s, 51);
  const DecoderTokens t = test_support::random_decoder_tokens(s, sequences, seq_len, 52);
  const auto run = [&](int rows) {
    Backend be(s, sequences, seq_len, {}, rows);
    RecordingSink sink(s, RecordingSink::all(s));
    const double loss = be.compute->train_step(m.weights, batch_of(t), 1.0, sink);
    REQUIRE(sink.problems.empty());
    REQUIRE(be.block.guards_intact());
    std::map<std::string, std::vector<double>> grads;
    for (const auto& p : test_support::decoder_reference_params(s)) grads[p.name] = sink.grad(p.name);
    return std::pair{loss, grads};
  };
  const auto [loss, grads] = run(0);
  for (const int rows : {7, 90, 100000}) {
    CAPTURE(rows);
    const auto [other_loss, other_grads] = run(rows);
    REQUIRE(std::abs(other_loss - loss) < 1e-6 * loss);
    for (const auto& [name, g] : grads) {
      CAPTURE(name);
      REQUIRE(test_support::decoder_normalized_error(other_grads.at(name), g) < 1e-6);
    }
  }
}

TEST_CASE("decoder CPU: ignored targets add nothing, loss and gradients are those of the mean "
          "over the others, against the float64 reference",
          "[decoder]") {
  const DecoderShape shape = tiny_qwen2(false);
  std::uint64_t seed = 300;
  // Masks of every kind: about half ignored (two loss chunks), a single target, none at all.
  for (const int keep_every : {2, 90, 0}) {
    CAPTURE(keep_every);
    Model m = random_model(shape, seed++);
    DecoderTokens t = test_support::random_decoder_tokens(shape, 3, 30, seed++);
    std::size_t kept = 0;
    for (std::size_t i = 0; i < t.targets.size(); ++i) {
      const bool keep = keep_every != 0 && (i * 7 + 3) % static_cast<std::size_t>(keep_every) == 0;
      if (!keep) t.targets[i] = lm::dec::kIgnoredTarget;
      kept += keep ? 1 : 0;
    }
    REQUIRE(lm::dec::counted_targets(batch_of(t)) == kept);
    Backend be(shape, 3, 32);
    RecordingSink sink(shape, RecordingSink::all(shape));
    const double loss = be.compute->train_step(m.weights, batch_of(t), 1.0, sink);
    REQUIRE(sink.problems.empty());
    const double reference = test_support::decoder_reference_forward(shape, m.values, t).loss;
    CHECK(std::abs(loss - reference) <= 1e-5 * std::abs(reference));
    CHECK(be.compute->loss(m.weights, batch_of(t)) == loss);
    std::mt19937_64 rng(seed++);
    for (const auto& p : test_support::decoder_reference_params(shape)) {
      CAPTURE(p.name);
      const auto got = sink.grad(p.name);
      if (kept == 0) {  // nothing counted: no gradient anywhere
        CHECK(std::all_of(got.begin(), got.end(), [](double g) { return g == 0.0; }));
        continue;
      }
      std::vector<double> ours, numeric;
      for (std::size_t i : sample_of(shape, p, t, rng)) {
        ours.push_back(got[i]);
        numeric.push_back(test_support::decoder_reference_gradient(shape, m.values, t, p.name, i));
      }
      CHECK(test_support::decoder_normalized_error(ours, numeric) < 1e-5);
    }
  }
}

TEST_CASE(
    "decoder CPU documents apart: each document's logits are those of it alone, loss and every "
    "gradient match the float64 reference",
    "[decoder]") {
  std::uint64_t seed = 300;
  for (const DecoderShape& s : {tiny_llama(), tiny_qwen2(true), tiny_qwen3(false)}) {
    CAPTURE(s.qkv_bias, s.qk_norm);
    Model m = random_model(s, seed++);
    DecoderTokens t = test_support::random_decoder_tokens(s, 3, 12, seed++);
    const Documents docs = random_documents(3, 12, seed++);
    t.positions = docs.positions;
    REQUIRE(docs.spans.size() > 3);  // some row holds several documents
    Backend be(s, 3, 12);
    std::vector<float> logits(t.inputs.size() * static_cast<std::size_t>(s.vocab));
    be.compute->logits(m.weights, batch_of(t), logits.data());
    // Independent of the reference: a document run alone, as a sequence of its own from
    // position 0, gives the same logits (to float32 rounding of other sums).
    for (const auto& [row, first, length] : docs.spans) {
      CAPTURE(row, first, length);
      DecoderTokens alone{1, length, {}, {}, {}};
      for (int c = first; c < first + length; ++c) {
        alone.inputs.push_back(t.inputs[static_cast<std::size_t>(row * 12 + c)]);
        alone.targets.push_back(t.targets[static_cast<std::size_t>(row * 12 + c)]);
      }
      std::vector<float> want(static_cast<std::size_t>(length * s.vocab));
      be.compute->logits(m.weights, batch_of(alone), want.data());
      const auto offset = static_cast<std::size_t>((row * 12 + first) * s.vocab);
      const auto from = logits.begin() + static_cast<std::ptrdiff_t>(offset);
      const std::vector<double> got(from, from + static_cast<std::ptrdiff_t>(want.size()));
      REQUIRE(test_support::decoder_normalized_error(got, {want.begin(), want.end()}) < 1e-6);
    }
    const auto ref = test_support::decoder_reference_forward(s, m.values, t);
    REQUIRE(test_support::decoder_normalized_error({logits.begin(), logits.end()}, ref.logits) <
            1e-5);
    // Without the positions the same tokens give other logits: the documents did see each other.
    DecoderTokens joined = t;
    joined.positions.clear();
    REQUIRE(test_support::decoder_normalized_error(
                test_support::decoder_reference_forward(s, m.values, joined).logits, ref.logits) >
            1e-2);
    RecordingSink sink(s, RecordingSink::all(s));
    const double loss = be.compute->train_step(m.weights, batch_of(t), 1.0, sink);
    REQUIRE(std::abs(loss - ref.loss) <= 1e-5 * ref.loss);
    std::mt19937_64 rng(seed++);
    for (const auto& p : test_support::decoder_reference_params(s)) {
      CAPTURE(p.name);
      const auto got = sink.grad(p.name);
      std::vector<double> ours, numeric;
      for (std::size_t i : sample_of(s, p, t, rng)) {
        ours.push_back(got[i]);
        numeric.push_back(test_support::decoder_reference_gradient(s, m.values, t, p.name, i));
      }
      REQUIRE(test_support::decoder_normalized_error(ours, numeric) < 1e-5);
    }
    REQUIRE(be.block.guards_intact());
  }
}

// model.bit16_logits: the logits rounded to bf16 before the cross-entropy. Checked from the
// outside: the logits it hands out are the fp32 run's rounded (the same GEMM), its loss is the
// float64 cross-entropy of those logits, and its gradients stay within a bf16 rounding of the
// fp32 run's (not equal: the option changes the bits).
TEST_CASE("decoder CPU with bit16 logits: the cross-entropy of the fp32 logits rounded to bf16",
          "[decoder]") {
  for (const DecoderShape& shape : {tiny_qwen2(true), tiny_llama()}) {
    CAPTURE(shape.family == DecoderFamily::qwen2);
    const Model m = random_model(shape, 41);
    const DecoderTokens t = test_support::random_decoder_tokens(shape, 3, 30, 42);  // two chunks
    Backend fp32(shape, 3, 30), bf16(shape, 3, 30, {.logits = DType::bf16});
    const auto rows = static_cast<std::size_t>(3 * 30), v = static_cast<std::size_t>(shape.vocab);
    std::vector<float> z32(rows * v), z16(rows * v);
    fp32.compute->logits(m.weights, batch_of(t), z32.data());
    bf16.compute->logits(m.weights, batch_of(t), z16.data());
    std::size_t changed = 0;
    for (std::size_t i = 0; i < z32.size(); ++i) {
      std::uint16_t bits = 0;
      convert_elements(&bits, DType::bf16, &z32[i], DType::f32, 1);
      float rounded = 0.0f;
      convert_elements(&rounded, DType::f32, &bits, DType::bf16, 1);
      REQUIRE(z16[i] == rounded);
      changed += z16[i] != z32[i] ? 1 : 0;
    }
    REQUIRE(changed > z32.size() / 2);
    const double want =  // the mean cross-entropy of the rounded logits, in float64
        test_support::decoder_mean_cross_entropy(z16.data(), rows, v, t.targets.data());
    const double loss16 = bf16.compute->loss(m.weights, batch_of(t));
    const double loss32 = fp32.compute->loss(m.weights, batch_of(t));
    CAPTURE(loss16, loss32, want);
    REQUIRE(std::abs(loss16 - want) / want < 1e-6);
    REQUIRE(loss16 != loss32);
    RecordingSink g32(shape, RecordingSink::all(shape)), g16(shape, RecordingSink::all(shape));
    REQUIRE(fp32.compute->train_step(m.weights, batch_of(t), 1.0, g32) == loss32);
    REQUIRE(bf16.compute->train_step(m.weights, batch_of(t), 1.0, g16) == loss16);
    for (const auto& p : test_support::decoder_reference_params(shape)) {
      const double err = test_support::decoder_normalized_error(g16.grad(p.name), g32.grad(p.name));
      CAPTURE(p.name, err);
      REQUIRE(err < 1e-2);
    }
    const std::string head = test_support::decoder_reference_params(shape).back().name;
    REQUIRE(g16.grad(head) != g32.grad(head));
  }
}

TEST_CASE("decoder CPU refuses a logits, SwiGLU-gradient or residual-stream dtype that is not "
          "fp32, bf16 or fp16",
          "[decoder]") {
  const DecoderShape shape = tiny_llama();
  Block block(lm::dec::cpu_bytes(shape, 1, 4));
  const std::string logits = test::message_of<ConfigError>([&] {
    (void)lm::dec::make_cpu_compute(shape, 1, 4, block.data(), block.bytes, 0,
                                    {.logits = DType::f64});
  });
  REQUIRE(test::contains(logits, "logits of dtype fp64"));
  const std::string swiglu = test::message_of<ConfigError>([&] {
    (void)lm::dec::make_cpu_compute(shape, 1, 4, block.data(), block.bytes, 0,
                                    {.swiglu_grad = DType::f64});
  });
  REQUIRE(test::contains(swiglu, "SwiGLU's gradient of dtype fp64"));
  const std::string residual = test::message_of<ConfigError>([&] {
    (void)lm::dec::make_cpu_compute(shape, 1, 4, block.data(), block.bytes, 0,
                                    {.residual = DType::f64});
  });
  REQUIRE(test::contains(residual, "the residual stream of dtype fp64"));
}

// model.bit16_swiglu_grad: the gradient at SwiGLU's output rounded to bf16 before SwiGLU's
// backward. The forward is untouched (the same loss and logits to the bit); the gradients of
// everything below the first MLP's output move by about a bf16 rounding and no more, and the
// head's, above every MLP, not at all.
TEST_CASE("decoder CPU with a bit16 SwiGLU gradient: the same loss, gradients within a bf16 "
          "rounding of the fp32 run's",
          "[decoder]") {
  for (const DecoderShape& shape : {tiny_qwen2(true), tiny_llama()}) {
    CAPTURE(shape.family == DecoderFamily::qwen2);
    const Model m = random_model(shape, 45);
    const DecoderTokens t = test_support::random_decoder_tokens(shape, 3, 30, 46);
    Backend fp32(shape, 3, 30), bf16(shape, 3, 30, {.swiglu_grad = DType::bf16});
    RecordingSink g32(shape, RecordingSink::all(shape)), g16(shape, RecordingSink::all(shape));
    const double loss32 = fp32.compute->train_step(m.weights, batch_of(t), 1.0, g32);
    REQUIRE(bf16.compute->train_step(m.weights, batch_of(t), 1.0, g16) == loss32);
    std::size_t moved = 0;
    for (const auto& p : test_support::decoder_reference_params(shape)) {
      const double err = test_support::decoder_normalized_error(g16.grad(p.name), g32.grad(p.name));
      CAPTURE(p.name, err);
      REQUIRE(err < 1e-2);
      moved += g16.grad(p.name) != g32.grad(p.name) ? 1 : 0;
    }
    REQUIRE(moved > 0);
    // The final norm and an untied head sit above every MLP: their gradients keep every bit.
    REQUIRE(g16.grad("model.norm.weight") == g32.grad("model.norm.weight"));
    if (!shape.tied) REQUIRE(g16.grad("lm_head.weight") == g32.grad("lm_head.weight"));
  }
}

// model.bit16_residual: the residual stream (each layer's input and post-attention sum, and the
// o and down projections' products added into them) and the gradients along it (at each norm's
// output, and the stream's own) rounded to bf16. The forward moves: the logits and the loss
// differ from the fp32 run's, by little; every gradient stays within a few bf16 roundings of
// the fp32 run's. Weights in bf16, as a run with the option has them (x_0, an embedding row, is
// then already a bf16 value). The bounds are about twice the worst measured: logits 0.0045,
// gradients 0.027 (the first layer's k bias, a small gradient whose terms nearly cancel, about
// an eighth of the q bias's in size; every other one 0.015 or less).
TEST_CASE("decoder CPU with a bit16 residual stream: logits, loss and gradients close to the "
          "fp32 run's, not its bits",
          "[decoder]") {
  for (const DecoderShape& shape : {tiny_qwen2(true), tiny_llama()}) {
    CAPTURE(shape.family == DecoderFamily::qwen2);
    const Model m = random_model(shape, 47, DType::bf16);
    const DecoderTokens t = test_support::random_decoder_tokens(shape, 3, 30, 48);
    Backend fp32(shape, 3, 30), bf16(shape, 3, 30, {.residual = DType::bf16});
    const auto rows = static_cast<std::size_t>(3 * 30), v = static_cast<std::size_t>(shape.vocab);
    std::vector<float> z32(rows * v), z16(rows * v);
    fp32.compute->logits(m.weights, batch_of(t), z32.data());
    bf16.compute->logits(m.weights, batch_of(t), z16.data());
    const double logits_err = test_support::decoder_normalized_error(
        {z16.begin(), z16.end()}, {z32.begin(), z32.end()});
    CAPTURE(logits_err);
    REQUIRE(z16 != z32);
    REQUIRE(logits_err < 1e-2);
    RecordingSink g32(shape, RecordingSink::all(shape)), g16(shape, RecordingSink::all(shape));
    const double loss32 = fp32.compute->train_step(m.weights, batch_of(t), 1.0, g32);
    const double loss16 = bf16.compute->train_step(m.weights, batch_of(t), 1.0, g16);
    CAPTURE(loss32, loss16);
    REQUIRE(loss16 != loss32);
    REQUIRE(std::abs(loss16 - loss32) / loss32 < 1e-2);
    REQUIRE(bf16.compute->loss(m.weights, batch_of(t)) == loss16);
    std::size_t moved = 0;
    for (const auto& p : test_support::decoder_reference_params(shape)) {
      const double err = test_support::decoder_normalized_error(g16.grad(p.name), g32.grad(p.name));
      CAPTURE(p.name, err);
      REQUIRE(err < 5e-2);
      moved += g16.grad(p.name) != g32.grad(p.name) ? 1 : 0;
    }
    REQUIRE(moved > 0);
  }
}

TEST_CASE("decoder CPU refuses positions that do not cut rows into documents, naming the token",
          "[decoder]") {
  const DecoderShape s = tiny_llama();
  const Model m = random_model(s, 5);
  Backend be(s, 2, 6);
  DecoderTokens t = test_support::random_decoder_tokens(s, 2, 6, 6);
  const std::vector<std::vector<std::int32_t>> bad = {
      {1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 5},   // a row starting past 0
      {0, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 6},   // the second row too (token 6)
      {0, 1, 3, 4, 5, 6, 0, 1, 2, 3, 4, 5},   // a jump (token 2)
      {0, 1, 2, 0, 0, 7, 0, 1, 2, 3, 4, 5},   // token 5
      {0, 1, 2, -1, 0, 1, 0, 1, 2, 3, 4, 5}}; // negative (token 3)
  const std::int64_t tokens[] = {0, 6, 2, 5, 3};
  for (std::size_t k = 0; k < bad.size(); ++k) {
    t.positions = bad[k];
    CAPTURE(k);
    RecordingSink sink(s, RecordingSink::all(s));
    const auto msg = test::message_of<ConfigError>(
        [&] { be.compute->train_step(m.weights, batch_of(t), 1.0, sink); });
    CAPTURE(msg);
    REQUIRE(test::contains(msg, fmt::format("of token {}:", tokens[k])));
    REQUIRE(sink.events.empty());
  }
  t.positions = {0, 1, 0, 0, 1, 2, 0, 0, 0, 1, 2, 3};  // documents of 1 token are fine
  RecordingSink sink(s, RecordingSink::all(s));
  REQUIRE(std::isfinite(be.compute->train_step(m.weights, batch_of(t), 1.0, sink)));
}

TEST_CASE("decoder CPU backward opens each slot once, just before writing it, in backward order",
          "[decoder]") {
  for (const auto& [shape, tied] : {std::pair{tiny_qwen2(false), false},
                                    std::pair{tiny_qwen2(true), true},
                                    std::pair{tiny_qwen3(false), false}}) {
    CAPTURE(tied, shape.qk_norm);
    const DecoderShape& s = shape;
    const Model m = random_model(s, 7);
    const DecoderTokens t = test_support::random_decoder_tokens(s, 2, 5, 8);
    Backend be(s, 2, 5);
    RecordingSink sink(s, RecordingSink::all(s));
    be.compute->train_step(m.weights, batch_of(t), 1.0, sink);
    // The head group, then the layers from the top, each in reverse declaration order, then
    // the embedding; one slot open at a time, so a tied embedding's (its head and lookup
    // gradients summed) comes last, like an untied one's.
    std::vector<std::string> expected;
    const auto both = [&](const std::string& name) {
      expected.push_back("open " + name);
      expected.push_back("close " + name);
    };
    if (!tied) both("lm_head.weight");
    both("model.norm.weight");
    for (int l = s.layers - 1; l >= 0; --l)
      for (const ParamKind k :
           {ParamKind::down, ParamKind::up, ParamKind::gate, ParamKind::mlp_norm, ParamKind::o,
            ParamKind::v_bias, ParamKind::v, ParamKind::k_norm, ParamKind::k_bias, ParamKind::k,
            ParamKind::q_norm, ParamKind::q_bias, ParamKind::q, ParamKind::attn_norm}) {
        const bool bias =
            k == ParamKind::v_bias || k == ParamKind::k_bias || k == ParamKind::q_bias;
        const bool head_norm = k == ParamKind::k_norm || k == ParamKind::q_norm;
        if ((!bias || s.qkv_bias) && (!head_norm || s.qk_norm)) both(name_of({k, l}));
      }
    both("model.embed_tokens.weight");
    REQUIRE(sink.events == expected);
    REQUIRE(sink.problems.empty());
  }
}

TEST_CASE(
    "decoder CPU frozen groups: only active slots are opened, with the all-active run's gradients",
    "[decoder]") {
  DecoderShape qwen3 = tiny_qwen3(false);
  qwen3.layers = 3;
  for (const auto& [shape, tied] :
       {std::pair{tiny_mistral(), false}, std::pair{tiny_mistral(), true}, std::pair{qwen3, false},
        std::pair{qwen3, true}}) {
    CAPTURE(tied, shape.qk_norm);
    DecoderShape s = shape;  // 3 layers: groups 0 embed, 1..3 layers, 4 head
    s.tied = tied;
    const Model m = random_model(s, 11);
    const DecoderTokens t = test_support::random_decoder_tokens(s, 2, 7, 12);
    Backend be(s, 2, 7);
    RecordingSink all(s, RecordingSink::all(s));
    const double loss = be.compute->train_step(m.weights, batch_of(t), 1.0, all);
    const std::set<int> subsets[] = {{2, 4}, {1}, {0}, {4}, {3}, {0, 4}, {}};
    for (const std::set<int>& active : subsets) {
      const std::vector<int> groups(active.begin(), active.end());
      CAPTURE(groups);
      RecordingSink sink(s, active);
      REQUIRE(be.compute->train_step(m.weights, batch_of(t), 1.0, sink) == loss);
      REQUIRE(sink.problems.empty());
      REQUIRE(sink.all_closed());
      std::set<std::string> expected;
      for (const auto& p : test_support::decoder_reference_params(s)) {
        // A tied head's matrix is the embedding: its gradient comes with group 0.
        if (active.count(p.group) == 0) continue;
        expected.insert(p.name);
        CAPTURE(p.name);
        REQUIRE((sink.raw(p.name) == all.raw(p.name)));  // bit for bit
      }
      REQUIRE(sink.closed() == expected);
      // Nothing below the lowest active group is reached: the events name no param below it.
      const int lowest = active.empty() ? s.layers + 2 : *active.begin();
      for (const auto& e : sink.events) {
        CAPTURE(e);
        REQUIRE(group_of(s, e.substr(e.find(' ') + 1)) >= lowest);
      }
    }
  }
}

TEST_CASE(
    "decoder CPU with only the head active stops at the head: no layer's backward scratch is "
    "written",
    "[decoder]") {
  const DecoderShape s = tiny_llama();
  const Model m = random_model(s, 21);
  const DecoderTokens t = test_support::random_decoder_tokens(s, 2, 8, 22);
  // Bytes of a fresh block (filled with the guard pattern) that a train_step changed.
  const auto touched = [&](std::set<int> active) {
    Backend be(s, 2, 8);
    RecordingSink sink(s, std::move(active));
    be.compute->train_step(m.weights, batch_of(t), 1.0, sink);
    std::size_t n = 0;
    for (std::size_t i = 0; i < be.block.bytes; ++i)
      n += be.block.raw[be.block.offset + i] != kPattern;
    return n;
  };
  const std::size_t none = touched({}), head = touched({s.layers + 1}), top = touched({s.layers}),
                    all = touched(RecordingSink::all(s));
  CAPTURE(none, head, top, all);
  REQUIRE(none < head);  // the head's own gradient work
  REQUIRE(head < top);   // a layer's backward scratch
  REQUIRE(top <= all);
}

TEST_CASE(
    "decoder CPU on bf16 and fp16 weights equals the float64 reference on the same values "
    "upcast",
    "[decoder]") {
  for (const DType dtype : {DType::bf16, DType::f16}) {
    CAPTURE(dtype_name(dtype));
    const DecoderShape s = tiny_qwen2(dtype == DType::f16);
    const DecoderValues exact = test_support::random_decoder_weights(s, 31);
    const Model m = make_model(s, exact, dtype);
    REQUIRE(m.values.at("model.layers.0.self_attn.q_proj.weight") !=
            exact.at("model.layers.0.self_attn.q_proj.weight"));  // really rounded
    const DecoderTokens t = test_support::random_decoder_tokens(s, 3, 6, 32);
    Backend be(s, 3, 6);
    const auto ref = test_support::decoder_reference_forward(s, m.values, t);
    std::vector<float> logits(ref.logits.size());
    be.compute->logits(m.weights, batch_of(t), logits.data());
    REQUIRE(test_support::decoder_normalized_error(
                std::vector<double>(logits.begin(), logits.end()), ref.logits) < 1e-5);
    RecordingSink sink(s, RecordingSink::all(s));
    const double loss = be.compute->train_step(m.weights, batch_of(t), 1.0, sink);
    REQUIRE(std::abs(loss - ref.loss) < 1e-5 * ref.loss);
    std::mt19937_64 rng(33);
    DecoderValues values = m.values;
    for (const auto& p : test_support::decoder_reference_params(s)) {
      CAPTURE(p.name);
      const auto got = sink.grad(p.name);
      std::vector<double> ours, numeric;
      for (std::size_t i : sample_of(s, p, t, rng)) {
        ours.push_back(got[i]);
        numeric.push_back(test_support::decoder_reference_gradient(s, values, t, p.name, i));
      }
      REQUIRE(test_support::decoder_normalized_error(ours, numeric) < 1e-5);
    }
  }
}

TEST_CASE("decoder CPU adds into bf16 slots in fp32 and rounds once, the tied embedding included",
          "[decoder]") {
  for (const bool tied : {false, true}) {
    CAPTURE(tied);
    const DecoderShape s = tiny_qwen2(tied);
    const Model m = random_model(s, 41, DType::bf16);
    const DecoderTokens t = test_support::random_decoder_tokens(s, 2, 6, 42);
    Backend be(s, 2, 6);
    // Slots that already hold a gradient (bf16 values), once as fp32 and once as bf16.
    const Model initial = random_model(s, 43, DType::bf16);
    RecordingSink f32(s, RecordingSink::all(s), DType::f32, &initial.values);
    RecordingSink b16(s, RecordingSink::all(s), DType::bf16, &initial.values);
    be.compute->train_step(m.weights, batch_of(t), 1.0, f32);
    be.compute->train_step(m.weights, batch_of(t), 1.0, b16);
    for (const auto& p : test_support::decoder_reference_params(s)) {
      CAPTURE(p.name);
      // bf16(float(initial) + fp32 gradient): the fp32 slot's sum, rounded once.
      const std::vector<double> fp32_sum = f32.grad(p.name);
      std::vector<float> sum(fp32_sum.begin(), fp32_sum.end());
      std::vector<std::byte> rounded(sum.size() * 2);
      cpu_device_ops().cast(rounded.data(), DType::bf16, sum.data(), DType::f32, sum.size());
      REQUIRE((b16.raw(p.name) == rounded));
      REQUIRE(f32.grad(p.name) != initial.values.at(p.name));
    }
  }
}

TEST_CASE("decoder CPU is deterministic and grad_scale scales the gradient", "[decoder]") {
  const DecoderShape s = tiny_llama3();
  const Model m = random_model(s, 51, DType::bf16);
  const DecoderTokens t = test_support::random_decoder_tokens(s, 2, 9, 52);
  Backend one(s, 2, 12), other(s, 3, 9);
  RecordingSink a(s, RecordingSink::all(s)), b(s, RecordingSink::all(s)),
      c(s, RecordingSink::all(s)), eight(s, RecordingSink::all(s)), third(s, RecordingSink::all(s));
  const double la = one.compute->train_step(m.weights, batch_of(t), 1.0, a);
  const double lb = one.compute->train_step(m.weights, batch_of(t), 1.0, b);
  const double lc = other.compute->train_step(m.weights, batch_of(t), 1.0, c);
  REQUIRE(la == lb);
  REQUIRE(la == lc);
  REQUIRE(one.compute->loss(m.weights, batch_of(t)) == la);
  one.compute->train_step(m.weights, batch_of(t), 8.0, eight);
  one.compute->train_step(m.weights, batch_of(t), 1.0 / 3.0, third);
  for (const auto& p : test_support::decoder_reference_params(s)) {
    CAPTURE(p.name);
    REQUIRE((a.raw(p.name) == b.raw(p.name)));
    REQUIRE((a.raw(p.name) == c.raw(p.name)));
    const auto g = a.grad(p.name), g8 = eight.grad(p.name), g3 = third.grad(p.name);
    std::vector<double> times8(g.size()), over3(g.size());
    for (std::size_t i = 0; i < g.size(); ++i) {
      times8[i] = 8.0 * g[i];
      over3[i] = g[i] / 3.0;
    }
    REQUIRE(g8 == times8);  // a power of two scales exactly
    REQUIRE(test_support::decoder_normalized_error(g3, over3) < 1e-6);
  }
}

TEST_CASE("decoder CPU works inside its cpu_bytes block and refuses a smaller or misaligned one",
          "[decoder]") {
  const DecoderShape s = tiny_qwen2(true);
  const Model m = random_model(s, 61);
  const DecoderTokens t = test_support::random_decoder_tokens(s, 3, 8, 62);  // the largest batch
  Backend be(s, 3, 8);
  RecordingSink sink(s, RecordingSink::all(s));
  be.compute->train_step(m.weights, batch_of(t), 1.0, sink);
  std::vector<float> logits(static_cast<std::size_t>(3 * 8 * s.vocab));
  be.compute->logits(m.weights, batch_of(t), logits.data());
  be.compute->loss(m.weights, batch_of(t));
  REQUIRE(be.block.guards_intact());

  const std::size_t bytes = lm::dec::cpu_bytes(s, 3, 8);
  REQUIRE(bytes % 64 == 0);
  REQUIRE(lm::dec::cpu_bytes(s, 4, 8) > bytes);
  REQUIRE(lm::dec::cpu_bytes(s, 3, 9) > bytes);
  Block block(bytes + 64);
  const auto small = test::message_of<ConfigError>(
      [&] { lm::dec::make_cpu_compute(s, 3, 8, block.data(), bytes - 64); });
  CAPTURE(small);
  REQUIRE(test::contains(small, "make_cpu_compute"));
  REQUIRE(test::contains(small, "cpu_bytes"));
  const auto misaligned = test::message_of<ConfigError>([&] {
    lm::dec::make_cpu_compute(s, 3, 8, static_cast<unsigned char*>(block.data()) + 4, bytes);
  });
  REQUIRE(test::contains(misaligned, "aligned"));
  REQUIRE(block.guards_intact());
}

TEST_CASE("decoder CPU refuses shapes and batches it cannot run, naming the field, writing nothing",
          "[decoder]") {
  const auto refused = [](DecoderShape s, const char* field, int seq_len = 8) {
    CAPTURE(field);
    const auto msg = test::message_of<ConfigError>([&] { lm::dec::cpu_bytes(s, 2, seq_len); });
    CAPTURE(msg);
    REQUIRE(test::contains(msg, "cpu_bytes"));
    REQUIRE(test::contains(msg, field));
  };
  DecoderShape s = tiny_llama();
  s.kv_heads = 3;
  refused(s, "kv_heads");
  s = tiny_llama();
  s.head_dim = 5;
  refused(s, "head_dim");
  s = tiny_llama();
  s.vocab = 0;
  refused(s, "vocab");
  refused(tiny_llama(), "max_positions", 33);

  s = tiny_llama();
  const Model m = random_model(s, 71);
  Backend be(s, 2, 8);
  RecordingSink sink(s, RecordingSink::all(s));
  const auto step = [&](const DecoderTokens& t) {
    return test::message_of<ConfigError>(
        [&] { be.compute->train_step(m.weights, batch_of(t), 1.0, sink); });
  };
  REQUIRE(test::contains(step(test_support::random_decoder_tokens(s, 3, 8, 1)), "max_sequences"));
  REQUIRE(test::contains(step(test_support::random_decoder_tokens(s, 2, 9, 1)), "seq_len"));
  DecoderTokens bad = test_support::random_decoder_tokens(s, 2, 8, 1);
  bad.targets[5] = s.vocab;
  REQUIRE(test::contains(step(bad), "vocab"));
  lm::dec::Weights no_layer = m.weights;
  no_layer.layers[1].gate = nullptr;
  const DecoderTokens good = test_support::random_decoder_tokens(s, 2, 8, 1);
  REQUIRE(test::contains(test::message_of<ConfigError>(
                             [&] { be.compute->train_step(no_layer, batch_of(good), 1.0, sink); }),
                         "model.layers.1.mlp.gate_proj.weight"));
  REQUIRE(sink.events.empty());
  REQUIRE(be.block.guards_intact());
}

TEST_CASE("decoder CPU recomputing layers in backward gives the same bits in fewer bytes",
          "[decoder]") {
  // A tied Mistral-like shape of 3 layers (the lookup's and the head's gradient summed), a
  // Qwen2 shape with biases and a Qwen3 one with q/k norms; every group active, and LISA-like
  // sets (embedding and head with one layer, a frozen layer below an active one); the residual
  // stream in fp32, and in bf16 (model.bit16_residual: its sums are formed again in backward).
  const lm::dec::Precision precisions[] = {{}, {.residual = DType::bf16}};
  for (const DecoderShape& s : {tiny_mistral(), tiny_qwen2(false), tiny_qwen3(true)}) {
    CAPTURE(s.layers, s.qkv_bias, s.qk_norm, s.tied);
    const Model m = random_model(s, 71, DType::bf16);
    const DecoderTokens t = test_support::random_decoder_tokens(s, 2, 9, 72);
    std::vector<std::set<int>> actives = {RecordingSink::all(s), {0, s.layers + 1, 1}, {2}};
    for (const lm::dec::Precision& precision : precisions) {
      for (const auto& active : actives) {
        Backend kept(s, 2, 9, precision);
        RecordingSink want(s, active);
        const double loss = kept.compute->train_step(m.weights, batch_of(t), 1.0, want);
        for (int recompute = 1; recompute <= s.layers; ++recompute) {
          CAPTURE(precision.residual == DType::bf16, recompute, active.size());
          Block block(lm::dec::cpu_bytes(s, 2, 9, recompute));
          const auto compute = lm::dec::make_cpu_compute(s, 2, 9, block.data(), block.bytes,
                                                         recompute, precision);
          RecordingSink got(s, active);
          REQUIRE(compute->train_step(m.weights, batch_of(t), 1.0, got) == loss);
          REQUIRE(got.problems.empty());
          REQUIRE(got.events == want.events);  // the same slots, in the same order
          for (const auto& p : test_support::decoder_reference_params(s)) {
            CAPTURE(p.name);
            REQUIRE((got.raw(p.name) == want.raw(p.name)));
          }
          REQUIRE(compute->loss(m.weights, batch_of(t)) == loss);
          REQUIRE(block.guards_intact());
        }
      }
    }
    // Recomputed layers share one layer's activations: each one past the first saves a layer's
    // (up to the 64-byte rounding of the 11 per-layer regions, 15 with q/k norms).
    const std::size_t regions = s.qk_norm ? 15 : 11;
    const std::size_t none = lm::dec::cpu_bytes(s, 2, 9);
    REQUIRE(lm::dec::cpu_bytes(s, 2, 9, 1) == none);
    const std::size_t per_layer = none - lm::dec::cpu_bytes(s, 2, 9, 2);
    REQUIRE(per_layer > regions * 64);
    for (int r = 2; r <= s.layers; ++r) {
      const std::size_t saved = none - lm::dec::cpu_bytes(s, 2, 9, r);
      CAPTURE(r, saved, per_layer);
      const std::size_t want = static_cast<std::size_t>(r - 1) * per_layer;
      REQUIRE(saved + regions * 64 >= want);
      REQUIRE(saved <= want + regions * 64);
    }
  }
}

TEST_CASE("decoder CPU refuses recompute_layers outside [0, layers], naming it", "[decoder]") {
  const DecoderShape s = tiny_llama();
  for (const int bad : {-1, s.layers + 1}) {
    CAPTURE(bad);
    const auto msg = test::message_of<ConfigError>([&] { lm::dec::cpu_bytes(s, 2, 8, bad); });
    CAPTURE(msg);
    REQUIRE(test::contains(msg, "recompute_layers"));
  }
}

namespace {

// Hands each layer's weights out through one "window": copied in at acquire, overwritten with
// NaN at release, so a read of a layer outside its acquire/release gives NaN, not the bits.
class WindowSource final : public lm::dec::WeightSource {
 public:
  WindowSource(const Model& m) : m_(m) {}
  lm::dec::LayerWeights acquire(int l) override {
    calls.push_back("acquire " + std::to_string(l));
    if (held_ >= 0) problems.push_back("layer " + std::to_string(l) + " acquired while " +
                                       std::to_string(held_) + " is held");
    held_ = l;
    const lm::dec::LayerWeights& from = m_.weights.layers[static_cast<std::size_t>(l)];
    lm::dec::LayerWeights to;
    window_.clear();
    window_.reserve(16);
    const auto copy = [&](const void* p, ParamKind kind) -> const void* {
      if (p == nullptr) return nullptr;
      const auto& bytes = m_.storage.at(name_of({kind, l}));
      window_.push_back(bytes);
      return window_.back().data();
    };
    lm::dec::LayerWeights source = from;
    for (const ParamKind kind : lm::dec::kLayerKinds)
      lm::dec::layer_weight(to, kind) = copy(lm::dec::layer_weight(source, kind), kind);
    return to;
  }
  void release(int l) override {
    calls.push_back("release " + std::to_string(l));
    if (held_ != l) problems.push_back("layer " + std::to_string(l) + " released, not held");
    held_ = -1;
    poison();
  }
  const void* acquire_embed() override {
    take(kEmbed, "embed");
    return copy_of("model.embed_tokens.weight");
  }
  void release_embed() override { give(kEmbed, "embed"); }
  lm::dec::HeadWeights acquire_head() override {
    take(kHead, "head");
    const void* norm = copy_of("model.norm.weight");
    return {norm, copy_of(m_.shape.tied ? "model.embed_tokens.weight" : "lm_head.weight")};
  }
  void release_head() override { give(kHead, "head"); }
  std::vector<std::string> calls, problems;

 private:
  static constexpr int kEmbed = -2, kHead = -3;
  void take(int part, const std::string& name) {
    calls.push_back("acquire " + name);
    if (held_ != -1) problems.push_back(name + " acquired while another part is held");
    held_ = part;
    window_.clear();
  }
  void give(int part, const std::string& name) {
    calls.push_back("release " + name);
    if (held_ != part) problems.push_back(name + " released, not held");
    held_ = -1;
    poison();
  }
  const void* copy_of(const std::string& name) {
    window_.push_back(m_.storage.at(name));
    return window_.back().data();
  }
  void poison() {
    for (auto& bytes : window_)  // 0xFF bytes: NaN in bf16 and fp32 alike
      std::fill(bytes.begin(), bytes.end(), std::byte{0xFF});
  }
  const Model& m_;
  int held_ = -1;
  std::vector<std::vector<std::byte>> window_;  // reserved: its pointers stay put
};

}  // namespace

TEST_CASE("decoder CPU with its weights handed out a part at a time by a weight source gives the "
          "same bits, reading each only between acquire and release",
          "[decoder]") {
  for (const DecoderShape& s : {tiny_mistral(), tiny_qwen2(false), tiny_qwen3(true)}) {
    CAPTURE(s.layers, s.qkv_bias, s.qk_norm, s.tied);
    const Model m = random_model(s, 81, DType::bf16);
    const DecoderTokens t = test_support::random_decoder_tokens(s, 2, 9, 82);
    // Every group, LISA-like sets, and a layer alone above frozen ones.
    std::vector<std::set<int>> actives = {RecordingSink::all(s), {0, s.layers + 1, 2}, {3}};
    for (int recompute : {0, 2}) {
      for (const auto& active : actives) {
        CAPTURE(recompute, active.size());
        Block block(lm::dec::cpu_bytes(s, 2, 9, recompute));
        const auto compute =
            lm::dec::make_cpu_compute(s, 2, 9, block.data(), block.bytes, recompute);
        RecordingSink want(s, active);
        const double loss = compute->train_step(m.weights, batch_of(t), 1.0, want);
        WindowSource source(m);
        lm::dec::Weights w = m.weights;
        w.layers.clear();
        w.embed = w.final_norm = w.head = nullptr;
        w.source = &source;
        RecordingSink got(s, active);
        REQUIRE(compute->train_step(w, batch_of(t), 1.0, got) == loss);
        REQUIRE(source.problems.empty());
        REQUIRE(got.events == want.events);
        for (const auto& p : test_support::decoder_reference_params(s)) {
          CAPTURE(p.name);
          REQUIRE((got.raw(p.name) == want.raw(p.name)));
        }
        // The embedding first; forward ascending over every layer, then backward descending to
        // the lowest active group's layer (every layer when the embedding is active), each
        // acquired once a pass; the head between them (the CPU backend casts it twice: for the
        // loss, and again for backward).
        std::vector<std::string> calls = {"acquire embed", "release embed"};
        for (int l = 0; l < s.layers; ++l)
          calls.insert(calls.end(), {"acquire " + std::to_string(l), "release " + std::to_string(l)});
        for (int pass = 0; pass < 2; ++pass)
          calls.insert(calls.end(), {"acquire head", "release head"});
        const int lowest = *active.begin();
        for (int l = s.layers - 1; l >= 0 && l + 1 >= lowest; --l)
          calls.insert(calls.end(), {"acquire " + std::to_string(l), "release " + std::to_string(l)});
        REQUIRE(source.calls == calls);
        source.calls.clear();
        REQUIRE(compute->loss(w, batch_of(t)) == compute->loss(m.weights, batch_of(t)));
        REQUIRE(source.calls.size() == 2 * static_cast<std::size_t>(s.layers) + 4);
        REQUIRE(source.problems.empty());
      }
    }
    // A source beside a full list of layers is refused, naming it.
    Backend b(s, 2, 9);
    WindowSource source(m);
    lm::dec::Weights both = m.weights;
    both.source = &source;
    RecordingSink sink(s, RecordingSink::all(s));
    REQUIRE(test::contains(
        test::message_of<ConfigError>([&] { b.compute->train_step(both, batch_of(t), 1.0, sink); }),
        "beside a weight source"));
  }
}

TEST_CASE("layer_weight gives each layer kind its own field and refuses the others", "[decoder]") {
  lm::dec::LayerWeights lw;
  std::set<const void* const*> fields;
  for (const ParamKind kind : lm::dec::kLayerKinds) fields.insert(&lm::dec::layer_weight(lw, kind));
  REQUIRE(fields.size() == 14);
  REQUIRE(sizeof(lm::dec::LayerWeights) == 14 * sizeof(void*));  // no field left out
  for (const ParamKind kind : {ParamKind::embed, ParamKind::final_norm, ParamKind::head})
    REQUIRE_THROWS_AS(lm::dec::layer_weight(lw, kind), std::invalid_argument);
}
