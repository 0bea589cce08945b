// The byte LM on the CPU: the float64 reference checked by finite differences, the model's
// loss and every gradient against that reference through a real Engine (bf16 and fp16 weights,
// bit16 and fp32 gradient slots, 1 and 2 ranks, stage 1 and 2, frozen groups), its declaration,
// init and memory, its errors, and a short training run on real text.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <tuple>
#include <vector>

#include "shardswap/backend.h"
#include "shardswap/engine.h"
#include "shardswap/allocator.h"
#include "shardswap/error.h"
#include "tests/catch_compat.h"
#include "tests/support/byte_lm_reference.h"
#include "tools/lm/byte_lm.h"
#include "tools/lm/text_data.h"

using namespace shardswap;
using test_support::ByteLmCase;
using test_support::ByteLmCheck;
using test_support::ParamValues;

namespace {

// bf16 rounds a slot's gradient to 8 significant bits (relative 2^-9), fp16 to 11; with fp32
// slots only fp32 arithmetic remains. Any wrong formula gives errors of order 1.
double tolerance(const ByteLmCase& c) {
  const DType grad = c.grad_dtype.value_or(c.dtype);
  if (grad == DType::bf16) return 1e-2;
  if (grad == DType::f16) return 2e-3;
  return 1e-5;
}

void require_matches(const ByteLmCase& c) {
  CAPTURE(c.world_size, c.stage, dtype_name(c.dtype), dtype_name(c.grad_dtype.value_or(c.dtype)),
          c.active.size());
  const ByteLmCheck r = test_support::check_byte_lm(c, cpu_backend());
  CAPTURE(r.loss_error, r.worst_grad_error, r.worst_param);
  REQUIRE(r.steps_applied == c.world_size);
  REQUIRE(r.activation_bytes_match);
  REQUIRE(r.eval_loss_matches);
  REQUIRE(r.loss_error < 1e-5);
  REQUIRE(r.worst_grad_error < tolerance(c));
  REQUIRE(r.frozen_unchanged);
  REQUIRE(r.grad_errors.size() == test_support::byte_lm_reference_params(c.shape).size());
}

ParamValues perturbed(ParamValues w, const std::string& name, std::size_t i, double delta) {
  w.at(name)[i] += delta;
  return w;
}

}  // namespace

TEST_CASE("the float64 reference's gradients match central finite differences") {
  const ByteLmShape shape{3, 5, 7, 2};
  const ParamValues w = test_support::random_byte_lm_weights(shape, 5);
  const TokenBatch batch = test_support::random_token_batch(shape, 4, 6);
  const auto ref = test_support::byte_lm_reference_gradients(shape, w, batch);
  REQUIRE(ref.loss == Approx(test_support::byte_lm_reference_loss(shape, w, batch)).epsilon(1e-12));
  REQUIRE(ref.grads.size() == test_support::byte_lm_reference_params(shape).size());
  constexpr double h = 1e-5;
  for (const auto& [name, grad] : ref.grads) {
    CAPTURE(name);
    std::vector<double> numeric(grad.size());
    for (std::size_t i = 0; i < grad.size(); ++i) {
      if (name == "embed.weight" && grad[i] == 0.0) continue;  // rows no sample uses: exactly 0
      numeric[i] = (test_support::byte_lm_reference_loss(shape, perturbed(w, name, i, h), batch) -
                    test_support::byte_lm_reference_loss(shape, perturbed(w, name, i, -h), batch)) /
                   (2 * h);
    }
    const double err = test_support::normalized_error(grad, numeric);
    CAPTURE(err);
    REQUIRE(err < 1e-6);
    double norm = 0.0;
    for (double g : grad) norm += g * g;
    REQUIRE(norm > 0.0);  // every param really has a gradient here
  }
}

TEST_CASE("byte LM declares the params, shapes and groups of the reference") {
  const ByteLmShape shape{4, 24, 40, 3};
  InProcessGroup group(1);
  MemorySpace space(0, make_host_allocator());
  Engine engine(EngineConfig{}, group.rank(0), space);
  ByteLm::declare(shape, engine);
  const auto ref = test_support::byte_lm_reference_params(shape);
  REQUIRE(engine.params().size() == ref.size());
  std::int64_t total = 0;
  for (const auto& p : engine.params()) {
    CAPTURE(p.name);
    REQUIRE(ref.count(p.name) == 1);
    REQUIRE(p.shape == ref.at(p.name).shape);
    REQUIRE(p.group == ref.at(p.name).group);
    total += p.numel;
  }
  REQUIRE(byte_lm_param_count(shape) == total);
  REQUIRE(byte_lm_groups(shape) ==
          std::vector<std::string>{"embed", "layers.0", "layers.1", "layers.2", "head"});
  std::vector<std::string> declared = engine.groups();
  std::sort(declared.begin(), declared.end());
  auto expected = byte_lm_groups(shape);
  std::sort(expected.begin(), expected.end());
  REQUIRE(declared == expected);
  // fc1, fc2 (2 d h each) per layer and the head (2 d 256), times 3 for forward + backward.
  REQUIRE(byte_lm_step_flops(shape, 10) == 3.0 * 10 * (3 * 4.0 * 24 * 40 + 2.0 * 24 * 256));
}

TEST_CASE("byte LM init is a pure function of seed and name with the documented scales") {
  const ByteLmShape shape{8, 128, 512, 4};
  const auto values = [&](const std::string& name, std::vector<std::int64_t> dims,
                          std::uint64_t seed) {
    ParamInfo p{name, dims, 1, "g"};
    for (auto e : dims) p.numel *= e;
    std::vector<float> v(static_cast<std::size_t>(p.numel));
    ByteLm::init(shape, p, v, seed);
    return v;
  };
  const auto stats = [](const std::vector<float>& v) {
    double sum = 0, sq = 0, max = 0;
    for (float x : v) {
      sum += x;
      sq += double(x) * x;
      max = std::max(max, std::abs(double(x)));
    }
    const double mean = sum / v.size();
    return std::tuple{mean, std::sqrt(sq / v.size() - mean * mean), max};
  };
  const auto embed = values("embed.weight", {8 * 256, 128}, 7);
  REQUIRE(embed == values("embed.weight", {8 * 256, 128}, 7));
  REQUIRE(embed != values("embed.weight", {8 * 256, 128}, 8));
  const auto [em, es, emax] = stats(embed);
  REQUIRE(std::abs(em) < 1e-3);
  REQUIRE(es == Approx(0.02).epsilon(0.01));
  // The same seed gives different values to different names.
  REQUIRE(values("layers.0.fc1.weight", {512, 128}, 7) !=
          values("layers.1.fc1.weight", {512, 128}, 7));
  const auto [f1m, f1s, f1max] = stats(values("layers.0.fc1.weight", {512, 128}, 7));
  REQUIRE(f1max <= 1.0 / std::sqrt(128.0));
  REQUIRE(f1s == Approx(1.0 / std::sqrt(128.0) / std::sqrt(3.0)).epsilon(0.02));
  const double fc2_bound = 1.0 / std::sqrt(512.0) / std::sqrt(8.0);
  const auto [f2m, f2s, f2max] = stats(values("layers.3.fc2.weight", {128, 512}, 7));
  REQUIRE(f2max <= fc2_bound);
  REQUIRE(f2max > 0.99 * fc2_bound);
  const auto [hm, hs, hmax] = stats(values("head.weight", {256, 128}, 7));
  REQUIRE(hmax <= 1.0 / std::sqrt(128.0));
  REQUIRE(hmax > 0.99 / std::sqrt(128.0));
  for (const char* norm : {"layers.2.norm.weight", "final_norm.weight"})
    REQUIRE(values(norm, {128}, 7) == std::vector<float>(128, 1.0f));
  for (const char* bias :
       {"layers.2.norm.bias", "layers.0.fc1.bias", "layers.0.fc2.bias", "final_norm.bias"})
    REQUIRE(values(bias, {128}, 7) == std::vector<float>(128, 0.0f));
  // Pinned values: the mapping from (seed, name) to numbers must not change between platforms
  // or releases (a resumed run re-creates frozen state from them).
  REQUIRE(embed[0] == -0.02068488672f);
  REQUIRE(values("head.weight", {256, 128}, 1)[5] == 0.0396569185f);
  REQUIRE_THROWS_AS(values("layers.0.attn.weight", {4}, 1), ConfigError);
}

TEST_CASE("byte LM on the CPU matches the float64 reference: bf16 and fp16 weights, 1 rank") {
  for (const ByteLmCase& c : test_support::byte_lm_one_rank_dtype_cases()) require_matches(c);
}

TEST_CASE("byte LM on the CPU matches the float64 reference with 2 ranks, stage 1 and 2") {
  for (int stage : {1, 2})
    for (std::optional<DType> grad : {std::optional<DType>{}, std::optional<DType>{DType::f32}}) {
      ByteLmCase c;
      c.world_size = 2;
      c.stage = stage;
      c.grad_dtype = grad;
      require_matches(c);
    }
  ByteLmCase c;  // fp16 weights with a loss scale, two ranks
  c.world_size = 2;
  c.dtype = DType::f16;
  require_matches(c);
}

TEST_CASE("byte LM gives frozen groups no gradients and the active ones the reference's") {
  // Frozen below, between and above active groups; and the head alone.
  const std::vector<std::vector<std::string>> sets = {
      {"head", "layers.1"}, {"embed", "layers.1"}, {"layers.0"}, {"head"}, {"embed"}};
  for (const auto& active : sets)
    for (int stage : {1, 2}) {
      ByteLmCase c;
      c.shape.depth = 3;
      c.stage = stage;
      c.world_size = 2;
      c.grad_dtype = DType::f32;
      c.active = active;
      CAPTURE(active);
      const ByteLmCheck r = test_support::check_byte_lm(c, cpu_backend());
      CAPTURE(r.worst_grad_error, r.worst_param);
      REQUIRE(r.frozen_unchanged);
      REQUIRE(r.worst_grad_error < tolerance(c));
      REQUIRE(r.loss_error < 1e-5);
      REQUIRE(!r.grad_errors.empty());
      for (const auto& [name, err] : r.grad_errors) {
        const auto group = test_support::byte_lm_reference_params(c.shape).at(name).group;
        REQUIRE(std::find(active.begin(), active.end(), group) != active.end());
      }
    }
}

TEST_CASE("byte LM holds exactly activation_bytes of activation memory, and gives it back") {
  const ByteLmShape shape{8, 128, 512, 4};
  MemorySpace space(0, make_host_allocator());
  for (int max_batch : {1, 7, 256}) {
    CAPTURE(max_batch);
    auto model = make_byte_lm(shape, max_batch, DType::bf16, space);
    const auto planned = ByteLm::activation_bytes(shape, max_batch, DType::bf16, DeviceKind::host);
    REQUIRE(space.stats().tag(Tag::activation).requested.current == planned);
    REQUIRE(space.stats().tag(Tag::activation).buffers == 1);
    // At least the fp32 residual stream, norms, MLP activations and logits it must keep.
    const std::int64_t n = max_batch, d = 128, h = 512, L = 4;
    REQUIRE(planned >= 4 * n * ((L + 1) * d + L * (d + 2 * h) + d + 256));
    model.reset();
    REQUIRE(space.stats().tag(Tag::activation).requested.current == 0);
  }
  REQUIRE(ByteLm::activation_bytes(shape, 64, DType::bf16, DeviceKind::cuda) >
          ByteLm::activation_bytes(shape, 32, DType::bf16, DeviceKind::cuda));
}

TEST_CASE("byte LM rejects bad shapes, batches and weights of another dtype") {
  MemorySpace space(0, make_host_allocator());
  REQUIRE(test::contains(test::message_of<ConfigError>([&] {
                           make_byte_lm({8, 0, 512, 4}, 4, DType::bf16, space);
                         }),
                         "width"));
  REQUIRE(test::contains(
      test::message_of<ConfigError>([&] { make_byte_lm({}, 0, DType::bf16, space); }),
      "max_batch"));
  REQUIRE_THROWS_AS(make_byte_lm({}, 4, DType::f32, space), ConfigError);

  const ByteLmShape shape{2, 8, 16, 1};
  InProcessGroup group(1);
  EngineConfig cfg;
  cfg.dtype = DType::bf16;
  Engine engine(cfg, group.rank(0), space);
  ByteLm::declare(shape, engine);
  engine.build([&](const ParamInfo& p, std::span<float> v) { ByteLm::init(shape, p, v, 1); });
  auto model = make_byte_lm(shape, 4, DType::bf16, space);
  TokenBatch big = test_support::random_token_batch(shape, 5, 1);
  REQUIRE(test::contains(test::message_of<ConfigError>([&] { model->train_step(engine, big); }),
                         "max_batch"));
  TokenBatch torn = test_support::random_token_batch(shape, 3, 1);
  torn.context.pop_back();
  REQUIRE_THROWS_AS(model->loss(engine, torn), ConfigError);
  auto fp16_model = make_byte_lm(shape, 4, DType::f16, space);
  const TokenBatch ok = test_support::random_token_batch(shape, 3, 1);
  REQUIRE(test::contains(test::message_of<ConfigError>([&] { fp16_model->train_step(engine, ok); }),
                         "embed.weight"));
  REQUIRE(std::isfinite(model->train_step(engine, ok)));
  // Without a GPU (or without CUDA in the build) the cuBLAS rate is an error, never a number.
  REQUIRE_THROWS_AS(measure_cublas_gemm_tflops(64, 64, 64, DType::f32), ConfigError);
  if (cuda_device_count() == 0)
    REQUIRE_THROWS_AS(measure_cublas_gemm_tflops(64, 64, 64, DType::bf16), Error);
}

TEST_CASE(
    "byte LM trained a few hundred steps on the GPL brings validation loss well below ln 256") {
  const ByteLmShape shape{8, 64, 192, 2};
  const ByteCorpus corpus("/usr/share/common-licenses/GPL-3", shape.context);
  constexpr int kBatch = 64, kSteps = 300, kValBatches = 8;
  InProcessGroup group(1);
  MemorySpace space(0, make_host_allocator());
  EngineConfig cfg;
  cfg.dtype = DType::bf16;
  cfg.optimizer.type = OptimizerType::adamw;
  cfg.optimizer.lr = 3e-3;
  cfg.optimizer.weight_decay = 0.01;
  cfg.gradient_clipping = 1.0;
  cfg.reduce_bucket_bytes = std::size_t{1} << 20;  // a stage-2 bucket is zeroed whole when opened
  Engine engine(cfg, group.rank(0), space);
  ByteLm::declare(shape, engine);
  engine.build([&](const ParamInfo& p, std::span<float> v) { ByteLm::init(shape, p, v, 1); });
  auto model = make_byte_lm(shape, kBatch, cfg.dtype, space);
  const auto val_loss = [&] {
    double sum = 0.0;
    for (int i = 0; i < kValBatches; ++i) sum += model->loss(engine, corpus.val_batch(i, kBatch));
    return sum / kValBatches;
  };
  const double before = val_loss();
  const auto start = std::chrono::steady_clock::now();
  for (int step = 0; step < kSteps; ++step) {
    model->train_step(engine, corpus.train_batch(0, step, 0, kBatch));
    engine.step();
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double after = val_loss();
  std::printf("byte LM on GPL-3: validation loss %.3f -> %.3f after %d steps of %d (%.2f s)\n",
              before, after, kSteps, kBatch, seconds);
  REQUIRE(before == Approx(std::log(256.0)).epsilon(0.1));  // untrained: about uniform
  REQUIRE(after < 3.0);  // ln 256 = 5.55; byte unigram statistics of English alone give about 3
}
