// The decoder's CUDA backend against transformers itself: the fixtures of tests/fixtures/decoder
// (tiny random Llama with llama3 RoPE scaling, Qwen2 tied and untied, Mistral, Qwen3 where its
// folder exists; logits, loss and every gradient transformers computed in float32 for one batch)
// run on the stored bf16 weights with bf16 GEMM inputs and fp32 accumulation, compared by
// normalized error. The CPU backend's float32 run of the same fixtures
// (tests/model/decoder_fixture_test.cpp) agrees to ~1e-6; here the bound is bf16's (activations
// rounded to 8 bits of mantissa before every GEMM).
#include <cuda_runtime.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "shardswap/error.h"
#include "tests/catch_compat.h"
#include "model/decoder.h"
#include "model/decoder_cuda.h"
#include "model/hf_config.h"
#include "model/safetensors.h"

using namespace shardswap;

namespace {

namespace fs = std::filesystem;
using lm::dec::ParamId;
using lm::dec::ParamKind;

const fs::path kFixtures = fs::path(SHARDSWAP_TEST_DIR) / "fixtures" / "decoder";
// Measured on an NVIDIA H200: logits 7.6e-3 to 1.08e-2, gradients at most 3.4e-2 (k's bias:
// softmax ignores a shift shared by a row of scores, so its gradient is a small remainder after
// cancellation); the float32 CPU run of the same fixtures is at 1e-6, so this is bf16's rounding
// of every GEMM input (8 bits of mantissa), several times a layer.
constexpr double kLogitsTolerance = 2e-2;
constexpr double kGradTolerance = 5e-2;

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) FAIL(what << ": " << cudaGetErrorString(e));
}

struct DeviceBuffer {
  void* p = nullptr;
  explicit DeviceBuffer(std::size_t bytes) { check(cudaMalloc(&p, bytes ? bytes : 1), "cudaMalloc"); }
  ~DeviceBuffer() { cudaFree(p); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

double normalized_error(const std::vector<float>& ours, const std::vector<float>& theirs) {
  REQUIRE(ours.size() == theirs.size());
  double diff = 0.0, norm = 0.0;
  for (std::size_t i = 0; i < ours.size(); ++i) {
    const double d = static_cast<double>(ours[i]) - theirs[i];
    diff += d * d;
    norm += static_cast<double>(theirs[i]) * theirs[i];
  }
  REQUIRE(norm > 0.0);
  return std::sqrt(diff / norm);
}

std::vector<float> floats(const SafetensorsFile& f, const std::string& name) {
  const auto* t = f.find(name);
  INFO(name);
  REQUIRE(t != nullptr);
  REQUIRE(t->dtype == "F32");
  std::vector<float> out(t->bytes / 4);
  std::memcpy(out.data(), t->data, t->bytes);
  return out;
}

// fp32 device slots by name, one open at a time.
class DeviceSink final : public lm::dec::GradSink {
 public:
  explicit DeviceSink(const DecoderShape& s) {
    for (const auto& p : decoder_params(s)) {
      std::int64_t n = 1;
      for (const auto x : p.shape) n *= x;
      auto& slot = slots_[p.name];
      slot = std::make_unique<DeviceBuffer>(static_cast<std::size_t>(n) * 4);
      sizes_[p.name] = static_cast<std::size_t>(n);
      check(cudaMemset(slot->p, 0, static_cast<std::size_t>(n) * 4), "cudaMemset");
    }
  }
  bool active(int) const override { return true; }
  lm::dec::GradSlot open(ParamId id) override {
    return {slots_.at(decoder_param_name(id))->p, DType::f32};
  }
  void close(ParamId) override {}
  std::vector<float> read(const std::string& name) const {
    std::vector<float> out(sizes_.at(name));
    check(cudaMemcpy(out.data(), slots_.at(name)->p, out.size() * 4, cudaMemcpyDeviceToHost),
          "cudaMemcpy");
    return out;
  }

 private:
  std::map<std::string, std::unique_ptr<DeviceBuffer>> slots_;
  std::map<std::string, std::size_t> sizes_;
};

}  // namespace

TEST_CASE("cuda decoder gives transformers' logits, loss and gradients on its fixtures (bf16)",
          "[decoder][gpu][fixture]") {
  // batch.safetensors: one stream a row; packed_batch.safetensors: the same tokens cut into
  // documents by restarting position_ids, which transformers keeps apart.
  const std::vector<std::string> models{"llama3", "mistral", "qwen2_tied", "qwen2_untied",
                                        "qwen3"};
  for (const std::string& model : models)
  for (const std::string file : {"batch.safetensors", "packed_batch.safetensors"}) {
    INFO("fixture " << model << ", " << file);
    const fs::path folder = kFixtures / model;
    const SafetensorsFile batch = SafetensorsFile::open(folder / file);
    const SafetensorsFile weights = SafetensorsFile::open(folder / "model.safetensors");
    const auto* inputs = batch.find("inputs");
    REQUIRE(inputs != nullptr);
    const int sequences = static_cast<int>(inputs->shape[0]), seq_len = static_cast<int>(inputs->shape[1]);
    const DecoderShape shape = read_hf_config(folder / "config.json", {seq_len, "seq_len"}).shape;
    std::vector<std::int32_t> in(inputs->bytes / 4), targets(in.size());
    std::memcpy(in.data(), inputs->data, inputs->bytes);
    std::memcpy(targets.data(), batch.find("targets")->data, in.size() * 4);
    std::vector<std::int32_t> positions;
    if (const auto* p = batch.find("positions"); p != nullptr) {
      positions.resize(in.size());
      REQUIRE(p->bytes == in.size() * 4);
      std::memcpy(positions.data(), p->data, p->bytes);
    }

    // The bf16 weights on the device, by name.
    std::map<std::string, std::unique_ptr<DeviceBuffer>> device;
    for (const auto& p : decoder_params(shape)) {
      const auto* t = weights.find(p.name);
      INFO(p.name);
      REQUIRE((t != nullptr && t->dtype == "BF16"));
      auto& b = device[p.name];
      b = std::make_unique<DeviceBuffer>(t->bytes);
      check(cudaMemcpy(b->p, t->data, t->bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
    }
    const auto at = [&](ParamId id) -> const void* { return device.at(decoder_param_name(id))->p; };
    lm::dec::Weights w;
    w.dtype = DType::bf16;
    w.embed = at({ParamKind::embed});
    for (int l = 0; l < shape.layers; ++l) {
      lm::dec::LayerWeights lw;
      lw.attn_norm = at({ParamKind::attn_norm, l});
      lw.q = at({ParamKind::q, l});
      lw.k = at({ParamKind::k, l});
      lw.v = at({ParamKind::v, l});
      if (shape.qkv_bias) {
        lw.q_bias = at({ParamKind::q_bias, l});
        lw.k_bias = at({ParamKind::k_bias, l});
        lw.v_bias = at({ParamKind::v_bias, l});
      }
      if (shape.qk_norm) {
        lw.q_norm = at({ParamKind::q_norm, l});
        lw.k_norm = at({ParamKind::k_norm, l});
      }
      lw.o = at({ParamKind::o, l});
      lw.mlp_norm = at({ParamKind::mlp_norm, l});
      lw.gate = at({ParamKind::gate, l});
      lw.up = at({ParamKind::up, l});
      lw.down = at({ParamKind::down, l});
      w.layers.push_back(lw);
    }
    w.final_norm = at({ParamKind::final_norm});
    w.head = shape.tied ? w.embed : at({ParamKind::head});

    // The packed documents also through cuDNN's padded calls, where the config names cuDNN
    // (model.attention "cudnn"; "auto" keeps them on the own kernels: docs/data.md).
    std::vector<lm::dec::Attention> attentions{lm::dec::Attention::automatic};
    if (!positions.empty() && lm::dec::cuda_attention(shape) == lm::dec::Attention::cudnn)
      attentions.push_back(lm::dec::Attention::cudnn);
    for (const lm::dec::Attention attention : attentions) {
      INFO("model.attention = " << lm::dec::attention_key_value(attention));
      const std::size_t bytes = lm::dec::cuda_bytes(shape, sequences, seq_len);
      DeviceBuffer block(bytes);
      auto compute = lm::dec::make_cuda_compute(shape, sequences, seq_len, DType::bf16, block.p,
                                                bytes, 0, {}, attention);
      const lm::dec::Batch b{sequences, seq_len, in.data(), targets.data(),
                             positions.empty() ? nullptr : positions.data()};
      std::vector<float> logits(in.size() * static_cast<std::size_t>(shape.vocab));
      compute->logits(w, b, logits.data());
      const double logits_error = normalized_error(logits, floats(batch, "logits"));
      DeviceSink sink(shape);
      const double loss = compute->train_step(w, b, 1.0, sink);
      check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
      const double their_loss = floats(batch, "loss").at(0);
      double worst = 0.0;
      std::string worst_name;
      for (const auto& p : decoder_params(shape)) {
        INFO("gradient of " << p.name);
        const double e = normalized_error(sink.read(p.name), floats(batch, "grad." + p.name));
        if (e > worst) worst = e, worst_name = p.name;
        CHECK(e < kGradTolerance);
      }
      std::printf("%s %s (cuda, bf16, model.attention %s): logits error %.2e, loss %.6f vs "
                  "transformers' %.6f, worst gradient error %.2e (%s)\n",
                  model.c_str(), positions.empty() ? "" : "packed apart",
                  lm::dec::attention_key_value(attention), logits_error, loss, their_loss, worst,
                  worst_name.c_str());
      CHECK(logits_error < kLogitsTolerance);
      CHECK(std::abs(loss - their_loss) < 1e-2 * std::abs(their_loss));
    }
  }
}
