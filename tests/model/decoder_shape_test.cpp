// The decoder's shape limits (DecoderShapeLimits) and rules (validate_decoder_shape), the same
// for every reader and backend, and its param count without the param list.
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "shardswap/error.h"
#include "tests/catch_compat.h"
#include "model/decoder.h"
#include "model/decoder_cpu.h"
#include "model/decoder_cuda.h"
#include "model/hf_config.h"

using namespace shardswap;

namespace {

std::int64_t listed(const DecoderShape& s) {
  std::int64_t total = 0;
  for (const auto& p : decoder_params(s)) {
    std::int64_t n = 1;
    for (const auto x : p.shape) n *= x;
    total += n;
  }
  return total;
}

}  // namespace

TEST_CASE("decoder_param_count equals the elements of decoder_params for every kind of shape") {
  for (const bool bias : {false, true})
    for (const bool tied : {false, true})
      for (const int layers : {1, 3, 7}) {
        DecoderShape s;
        s.family = bias ? DecoderFamily::qwen2 : DecoderFamily::llama;
        s.qkv_bias = bias;
        s.tied = tied;
        s.layers = layers;
        s.vocab = 97;
        s.hidden = 40;
        s.intermediate = 72;
        s.heads = 6;
        s.kv_heads = 3;
        s.head_dim = 10;
        CAPTURE(bias, tied, layers);
        CHECK(decoder_param_count(s) == listed(s));
      }
}

TEST_CASE("validate_decoder_shape refuses a size above DecoderShapeLimits naming the field") {
  const auto refused = [](auto spoil) {
    DecoderShape s;
    spoil(s);
    return test::message_of<ConfigError>([&] { validate_decoder_shape(s); });
  };
  CHECK(refused([](DecoderShape& s) { s.layers = 1000000000; }) ==
        "validate_decoder_shape: DecoderShape.layers = 1000000000 is above 131072, the most "
        "DecoderShapeLimits allows");
  CHECK(test::contains(refused([](DecoderShape& s) { s.vocab = DecoderShapeLimits::vocab + 1; }),
                       "DecoderShape.vocab = 16777217 is above 16777216"));
  CHECK(test::contains(refused([](DecoderShape& s) {
                         s.heads = 4096;
                         s.kv_heads = 1;
                         s.head_dim = 512;
                       }),
                       "DecoderShape.heads = 4096 x head_dim = 512 is 2097152, above 1048576"));
  CHECK(test::contains(refused([](DecoderShape& s) {
                         s.layers = DecoderShapeLimits::layers;
                         s.hidden = DecoderShapeLimits::hidden;
                         s.intermediate = DecoderShapeLimits::intermediate;
                       }),
                       "above 281474976710656, the most DecoderShapeLimits allows"));
  // At the limits of each field alone, a shape is accepted (and its count made without the list).
  DecoderShape s;
  s.layers = DecoderShapeLimits::layers;
  CHECK_NOTHROW(validate_decoder_shape(s));
  CHECK(decoder_param_count(s) > 0);
}

// One list of shape rules (validate_decoder_shape) for the readers and both backends: they used
// to disagree (rope_theta above 1 in one, above 0 in another; the CUDA layout took 0 layers and
// any rms_eps; kv_heads named in some messages, heads in others).
TEST_CASE("every reader and backend applies the same shape rules, naming the field") {
  const auto refusals = [](const DecoderShape& s) {
    return std::vector<std::string>{
        test::message_of<ConfigError>([&] { validate_decoder_shape(s); }),
        test::message_of<ConfigError>([&] { lm::dec::cpu_bytes(s, 2, 8); }),
        test::message_of<ConfigError>([&] { lm::dec::cuda_bytes(s, 2, 8); }),
        test::message_of<ConfigError>([&] { hf_config_to_json(s, DType::bf16); })};
  };
  const auto check = [&](const DecoderShape& s, const std::string& what) {
    for (const std::string& m : refusals(s)) {
      CAPTURE(m);
      CHECK(test::contains(m, what));
    }
  };
  DecoderShape s;
  for (const double theta : {0.0, -1.0, std::numeric_limits<double>::infinity()}) {
    s.rope_theta = theta;
    check(s, "DecoderShape.rope_theta = ");
  }
  // transformers accepts any theta above 0: so do the readers and both backends now.
  s.rope_theta = 0.5;
  CHECK_NOTHROW(validate_decoder_shape(s));
  CHECK_NOTHROW(lm::dec::cpu_bytes(s, 2, 8));
  CHECK_NOTHROW(lm::dec::cuda_bytes(s, 2, 8));
  nlohmann::json inline_config = hf_config_to_json(s, DType::bf16);
  CHECK(hf_config_from_json(inline_config, HfConfigSource{{}, "model."}, {}).shape.rope_theta ==
        0.5);
  CHECK(decoder_param_count(s) > 0);
  s = DecoderShape{};
  s.kv_heads = 3;
  check(s, "DecoderShape.kv_heads = 3 must divide heads = 4");
  s = DecoderShape{};
  s.layers = 0;
  check(s, "DecoderShape.layers = 0 must be at least 1");
  s = DecoderShape{};
  s.rms_eps = 0.0;
  check(s, "DecoderShape.rms_eps = 0 must be positive");
  s = DecoderShape{};
  s.head_dim = 7;
  check(s, "DecoderShape.head_dim = 7 must be even");
  // Each names who refused.
  s = DecoderShape{};
  s.vocab = 0;
  const auto m = refusals(s);
  CHECK(m[0].rfind("validate_decoder_shape: DecoderShape.vocab = 0", 0) == 0);
  CHECK(m[1].rfind("cpu_bytes: DecoderShape.vocab = 0", 0) == 0);
  CHECK(m[2].rfind("decoder (cuda): DecoderShape.vocab = 0", 0) == 0);
  CHECK(m[3].rfind("hf_config_to_json: DecoderShape.vocab = 0", 0) == 0);
}

// model.bit16_residual: the CUDA layout sizes the residual stream (xs, ys), dz and dx for the
// weights' type and drops dx's rounded copy (d16), so the plan is the bytes the option takes;
// Decoder::activation_bytes, which the plan and the allocation both use, passes it on.
TEST_CASE("the CUDA layout holds the residual stream and its gradients in 2 bytes under "
          "model.bit16_residual") {
  const DecoderShape s;  // 4 layers, hidden 128
  const int sequences = 3, seq_len = 40;
  const std::size_t n = 120, d = 128, layers = 4;
  const auto rounded = [](std::size_t bytes) { return (bytes + 255) / 256 * 256; };
  for (const int recompute : {0, 4}) {
    CAPTURE(recompute);
    const std::size_t slots = lm::dec::cuda_kept_slots(s.layers, recompute);
    const lm::dec::CudaLayout wide =
        lm::dec::cuda_layout(s, sequences, seq_len, recompute, 0, false, false);
    const lm::dec::CudaLayout narrow =
        lm::dec::cuda_layout(s, sequences, seq_len, recompute, 0, false, true);
    for (const auto& [l, size] :
         {std::pair{wide, std::size_t{4}}, std::pair{narrow, std::size_t{2}}}) {
      CHECK(l.ys - l.xs == rounded((layers + 1) * n * d * size));
      CHECK(l.rstd_attn - l.ys == rounded(slots * n * d * size));
      CHECK(l.dz - l.dx == rounded(n * d * size));
      CHECK(l.d16 - l.dz == rounded(n * d * size));
    }
    CHECK(wide.dout - wide.d16 == rounded(n * d * 2));
    CHECK(narrow.dout == narrow.d16);  // dx is its own GEMM input
    const auto halved = [&](std::size_t elements) {
      return rounded(elements * 4) - rounded(elements * 2);
    };
    const std::size_t saved = halved((layers + 1) * n * d) + halved(slots * n * d) +
                              2 * halved(n * d) + rounded(n * d * 2);  // xs, ys, dx, dz; d16
    CHECK(wide.bytes - narrow.bytes == saved);
    CHECK(lm::dec::cuda_bytes(s, sequences, seq_len, recompute, 0, false, true) == narrow.bytes);
    DecoderOptions options;
    options.recompute_layers = recompute;
    options.precision.bit16_residual = true;
    CHECK(Decoder::activation_bytes(s, sequences, seq_len, DType::bf16, DeviceKind::cuda,
                                    options) == static_cast<std::int64_t>(narrow.bytes));
    options.precision.bit16_residual = false;
    CHECK(Decoder::activation_bytes(s, sequences, seq_len, DType::bf16, DeviceKind::cuda,
                                    options) == static_cast<std::int64_t>(wide.bytes));
  }
}
