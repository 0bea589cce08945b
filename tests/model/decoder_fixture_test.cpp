// The decoder against transformers itself: tests/fixtures/decoder holds tiny random Llama (llama3
// RoPE scaling), Qwen2 (q/k/v biases, tied and untied), Qwen3 (q/k norms, head_dim apart from
// hidden / heads) and Mistral models saved by transformers
// 5.17 with, for one batch, the logits, loss and every parameter's gradient it computed in float32
// (tools/fixtures/make_decoder_fixtures.py). They are read here through ShardSwap's own readers
// (config.json, safetensors), run through the CPU backend on the stored bf16 weights, and
// compared by normalized error ||ours - theirs|| / ||theirs||.
#include "tests/catch_compat.h"
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "model/decoder.h"
#include "model/decoder_cpu.h"
#include "model/hf_config.h"
#include "model/safetensors.h"

namespace shardswap {
namespace {

namespace fs = std::filesystem;

const fs::path kFixtures = fs::path(SHARDSWAP_TEST_DIR) / "fixtures" / "decoder";
const char* const kModels[] = {"llama3", "mistral", "qwen2_tied", "qwen2_untied", "qwen3"};

// Float32 arithmetic in another order than PyTorch's: ~1e-6 observed; the bound leaves room
// for the longer sums of the gradients.
constexpr double kTolerance = 2e-5;

double normalized_error(const std::vector<float>& ours, const std::vector<float>& theirs) {
  REQUIRE(ours.size() == theirs.size());
  double diff = 0.0, norm = 0.0;
  for (std::size_t i = 0; i < ours.size(); ++i) {
    const double d = static_cast<double>(ours[i]) - static_cast<double>(theirs[i]);
    diff += d * d;
    norm += static_cast<double>(theirs[i]) * static_cast<double>(theirs[i]);
  }
  REQUIRE(norm > 0.0);  // a fixture of zeros would prove nothing
  return std::sqrt(diff / norm);
}

template <class T>
std::vector<T> tensor_values(const SafetensorsFile& file, const std::string& name,
                             const char* dtype) {
  const SafetensorsTensor* t = file.find(name);
  INFO(file.path().string() << ": " << name);
  REQUIRE(t != nullptr);
  REQUIRE(t->dtype == dtype);
  std::vector<T> out(t->bytes / sizeof(T));
  REQUIRE(out.size() * sizeof(T) == t->bytes);
  std::memcpy(out.data(), t->data, t->bytes);
  return out;
}

// Collects fp32 gradients by name, recording the order of opens and closes.
class CollectingSink final : public lm::dec::GradSink {
 public:
  explicit CollectingSink(const DecoderShape& shape) {
    for (const auto& p : decoder_params(shape)) {
      std::int64_t n = 1;
      for (const auto x : p.shape) n *= x;
      grads[p.name].assign(static_cast<std::size_t>(n), 0.0f);
    }
  }
  bool active(int) const override { return true; }
  lm::dec::GradSlot open(lm::dec::ParamId id) override {
    const auto name = decoder_param_name(id);
    auto it = grads.find(name);
    REQUIRE(it != grads.end());
    opened.push_back(name);
    return {it->second.data(), DType::f32};
  }
  void close(lm::dec::ParamId id) override { closed.push_back(decoder_param_name(id)); }

  std::map<std::string, std::vector<float>> grads;
  std::vector<std::string> opened, closed;
};

struct Fixture {
  DecoderShape shape;
  SafetensorsFile model, batch;
  std::vector<std::int32_t> inputs, targets;
  int sequences = 0, seq_len = 0;
};

Fixture load_fixture(const std::string& name, const char* batch_file = "batch.safetensors") {
  const fs::path folder = kFixtures / name;
  SafetensorsFile batch = SafetensorsFile::open(folder / batch_file);
  const SafetensorsTensor* inputs = batch.find("inputs");
  REQUIRE(inputs != nullptr);
  REQUIRE(inputs->shape.size() == 2);
  const int sequences = static_cast<int>(inputs->shape[0]);
  const int seq_len = static_cast<int>(inputs->shape[1]);
  Fixture f{read_hf_config(folder / "config.json", {seq_len, "seq_len"}).shape,
            SafetensorsFile::open(folder / "model.safetensors"), batch, {}, {}, sequences,
            seq_len};
  f.inputs = tensor_values<std::int32_t>(batch, "inputs", "I32");
  f.targets = tensor_values<std::int32_t>(batch, "targets", "I32");
  return f;
}

// The fixture's stored bf16 weights, copied out of the mapping (its data need not be aligned),
// and the decoder's view of them.
struct FixtureWeights {
  std::map<std::string, std::vector<std::uint16_t>> values;
  lm::dec::Weights w;
};
void load_weights(const Fixture& f, FixtureWeights& out) {
  auto& values = out.values;
  auto& w = out.w;
  for (const auto& p : decoder_params(f.shape))
    values[p.name] = tensor_values<std::uint16_t>(f.model, p.name, "BF16");
  const auto at = [&](lm::dec::ParamId id) -> const void* {
    return values.at(decoder_param_name(id)).data();
  };
  using K = lm::dec::ParamKind;
  w.dtype = DType::bf16;
  w.embed = at({K::embed});
  for (int l = 0; l < f.shape.layers; ++l) {
    lm::dec::LayerWeights lw;
    lw.attn_norm = at({K::attn_norm, l});
    lw.q = at({K::q, l});
    lw.k = at({K::k, l});
    lw.v = at({K::v, l});
    if (f.shape.qkv_bias) {
      lw.q_bias = at({K::q_bias, l});
      lw.k_bias = at({K::k_bias, l});
      lw.v_bias = at({K::v_bias, l});
    }
    if (f.shape.qk_norm) {
      lw.q_norm = at({K::q_norm, l});
      lw.k_norm = at({K::k_norm, l});
    }
    lw.o = at({K::o, l});
    lw.mlp_norm = at({K::mlp_norm, l});
    lw.gate = at({K::gate, l});
    lw.up = at({K::up, l});
    lw.down = at({K::down, l});
    w.layers.push_back(lw);
  }
  w.final_norm = at({K::final_norm});
  w.head = f.shape.tied ? w.embed : at({K::head});
}

// The CPU compute of the fixture's shape and batch size, in a block of its own.
struct FixtureCompute {
  struct alignas(64) Line {
    std::byte bytes[64];
  };
  std::vector<Line> memory;
  std::unique_ptr<lm::dec::Compute> compute;
  explicit FixtureCompute(const Fixture& f) {
    const std::size_t bytes = lm::dec::cpu_bytes(f.shape, f.sequences, f.seq_len);
    memory.resize(bytes / sizeof(Line) + 1);
    compute = lm::dec::make_cpu_compute(f.shape, f.sequences, f.seq_len, memory.data(), bytes);
  }
};

// Each gradient the sink collected against the fixture's "grad." + name, checked within
// kTolerance; returns the worst normalized error and its param's name.
std::pair<double, std::string> check_gradients(const CollectingSink& sink, const Fixture& f) {
  std::pair<double, std::string> worst{0.0, ""};
  for (const auto& [name, grad] : sink.grads) {
    INFO("gradient of " << name);
    const double e = normalized_error(grad, tensor_values<float>(f.batch, "grad." + name, "F32"));
    if (e > worst.first) worst = {e, name};
    CHECK(e < kTolerance);
  }
  return worst;
}

TEST_CASE("the CPU decoder gives transformers' logits, loss and every gradient on its fixtures",
          "[decoder][fixture]") {
  for (const char* model : kModels) {
    INFO("fixture " << model);
    Fixture f = load_fixture(model);
    FixtureWeights fw;
    load_weights(f, fw);
    const lm::dec::Weights& w = fw.w;

    FixtureCompute fc(f);
    lm::dec::Compute* const compute = fc.compute.get();
    const lm::dec::Batch batch{f.sequences, f.seq_len, f.inputs.data(), f.targets.data(), nullptr};

    std::vector<float> logits(f.inputs.size() * static_cast<std::size_t>(f.shape.vocab));
    compute->logits(w, batch, logits.data());
    const double logits_error =
        normalized_error(logits, tensor_values<float>(f.batch, "logits", "F32"));
    const float their_loss = tensor_values<float>(f.batch, "loss", "F32").at(0);

    CollectingSink sink(f.shape);
    const double loss = compute->train_step(w, batch, 1.0, sink);
    const auto [worst, worst_name] = check_gradients(sink, f);
    fmt::print("{}: logits error {:.2e}, loss {:.7f} vs transformers' {:.7f}, worst gradient "
               "error {:.2e} ({})\n",
               model, logits_error, loss, their_loss, worst, worst_name);
    CHECK(logits_error < kTolerance);
    CHECK(std::abs(loss - their_loss) <= kTolerance * std::abs(their_loss));
    // Every param's slot was opened and closed exactly once.
    CHECK(sink.opened.size() == sink.grads.size());
    CHECK(sink.closed.size() == sink.grads.size());
  }
}

TEST_CASE("the CPU decoder's masked loss and gradients are transformers' with labels of -100",
          "[decoder][fixture]") {
  // masked_batch.safetensors: the fixture's tokens with about a third of the targets ignored (-1
  // here, -100 in transformers' labels), and transformers' loss and gradients from those labels.
  for (const char* model : kModels) {
    INFO("fixture " << model);
    Fixture f = load_fixture(model, "masked_batch.safetensors");
    FixtureWeights fw;
    load_weights(f, fw);
    const std::size_t counted = static_cast<std::size_t>(
        std::count_if(f.targets.begin(), f.targets.end(), [](std::int32_t t) { return t >= 0; }));
    REQUIRE(counted > 0);
    REQUIRE(counted < f.targets.size());
    FixtureCompute fc(f);
    lm::dec::Compute* const compute = fc.compute.get();
    const lm::dec::Batch batch{f.sequences, f.seq_len, f.inputs.data(), f.targets.data(), nullptr};
    CollectingSink sink(f.shape);
    const double loss = compute->train_step(fw.w, batch, 1.0, sink);
    const float their_loss = tensor_values<float>(f.batch, "loss", "F32").at(0);
    const double worst = check_gradients(sink, f).first;
    fmt::print("{} masked ({} of {} targets): loss {:.7f} vs transformers' {:.7f}, worst gradient "
               "error {:.2e}\n",
               model, counted, f.targets.size(), loss, their_loss, worst);
    CHECK(std::abs(loss - their_loss) <= kTolerance * std::abs(their_loss));
  }
}

TEST_CASE("the CPU decoder keeps packed documents apart as transformers does with restarting "
          "position_ids",
          "[decoder][fixture]") {
  // packed_batch.safetensors: the fixture's tokens cut into documents by position_ids that
  // restart (no attention mask: transformers then keeps the documents apart), the targets that
  // start a document ignored, and transformers' logits, loss and gradients.
  for (const char* model : kModels) {
    INFO("fixture " << model);
    Fixture f = load_fixture(model, "packed_batch.safetensors");
    FixtureWeights fw;
    load_weights(f, fw);
    const std::vector<std::int32_t> positions =
        tensor_values<std::int32_t>(f.batch, "positions", "I32");
    REQUIRE(std::count(positions.begin(), positions.end(), 0) > f.sequences);  // several a row
    FixtureCompute fc(f);
    lm::dec::Compute* const compute = fc.compute.get();
    const lm::dec::Batch batch{f.sequences, f.seq_len, f.inputs.data(), f.targets.data(),
                               positions.data()};
    std::vector<float> logits(f.inputs.size() * static_cast<std::size_t>(f.shape.vocab));
    compute->logits(fw.w, batch, logits.data());
    const double logits_error =
        normalized_error(logits, tensor_values<float>(f.batch, "logits", "F32"));
    CollectingSink sink(f.shape);
    const double loss = compute->train_step(fw.w, batch, 1.0, sink);
    const float their_loss = tensor_values<float>(f.batch, "loss", "F32").at(0);
    const double worst = check_gradients(sink, f).first;
    fmt::print("{} packed apart: logits error {:.2e}, loss {:.7f} vs transformers' {:.7f}, worst "
               "gradient error {:.2e}\n",
               model, logits_error, loss, their_loss, worst);
    CHECK(logits_error < kTolerance);
    CHECK(std::abs(loss - their_loss) <= kTolerance * std::abs(their_loss));
  }
}

}  // namespace
}  // namespace shardswap
