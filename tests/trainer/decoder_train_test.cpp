// The decoder as `shardswap train` runs it: from a Hugging Face folder (the transformers fixtures
// of tests/fixtures/decoder) through the engine's bit16 groups, LISA switching its layers from
// JSON, checkpoints exported back as a Hugging Face folder, and a resume at another world size
// continuing on the same tokens.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "shardswap/checkpoint.h"
#include "shardswap/error.h"
#include "tests/catch_compat.h"
#include "tests/support/scratch_folder.h"
#include "cli/ckpt.h"
#include "model/decoder.h"
#include "model/hf_checkpoint.h"
#include "model/safetensors.h"
#include "data/token_data.h"
#include "trainer/metrics_log.h"
#include "trainer/run_model.h"
#include "trainer/train.h"

using namespace shardswap;
using shardswap::test_support::ScratchFolder;
namespace fs = std::filesystem;

namespace {

const fs::path kFixtures = fs::path(SHARDSWAP_TEST_DIR) / "fixtures" / "decoder";

// Random token files of ids below `vocab`: a training and a validation set.
void write_tokens(const fs::path& path, int count, int vocab, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::uint32_t> ids(static_cast<std::size_t>(count));
  for (auto& id : ids) id = rng() % static_cast<std::uint32_t>(vocab);
  write_token_file(path.string(), ids, 1);
}

nlohmann::json decoder_run(const ScratchFolder& dir, const std::string& fixture) {
  write_tokens(dir / "train.bin", 6000, 96, 1);
  write_tokens(dir / "val.bin", 2000, 96, 2);
  nlohmann::json j = nlohmann::json::parse(R"({
    "world_size": 2, "steps": 8, "seed": 5, "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.003, "weight_decay": 0.01}},
    "bf16": {"enabled": true}, "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 5000},
    "model": {"type": "decoder"},
    "data": {"seq_len": 24},
    "logging": {"interval": 4, "eval_interval": 4, "eval_batches": 2}
  })");
  j["model"]["path"] = (kFixtures / fixture).string();
  j["data"]["train"] = (dir / "train.bin").string();
  j["data"]["val"] = (dir / "val.bin").string();
  return j;
}

TrainConfig load(const nlohmann::json& j) {
  ConfigReader reader(j, "test.json");
  return train_config_from_json(reader);
}

std::vector<nlohmann::json> run(const TrainConfig& config, std::string* log_text = nullptr) {
  std::ostringstream log, metrics;
  MetricsStream lines(metrics);
  train(config, TrainOutput{log, &lines});
  if (log_text) *log_text = log.str();
  std::vector<nlohmann::json> out;
  std::istringstream in(metrics.str());
  for (std::string line; std::getline(in, line);) {
    auto m = nlohmann::json::parse(line);
    if (m.contains("step")) out.push_back(m);
  }
  return out;
}

// Two runs that must take the same steps: per step the same active groups, loss, gradient norm
// and (where logged) validation loss, bit for bit.
void require_same_steps(const std::vector<nlohmann::json>& a,
                        const std::vector<nlohmann::json>& b) {
  REQUIRE(a.size() == b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    CAPTURE(i);
    REQUIRE(a[i].at("active_groups") == b[i].at("active_groups"));
    REQUIRE(a[i].at("loss").get<double>() == b[i].at("loss").get<double>());
    REQUIRE(a[i].at("grad_norm") == b[i].at("grad_norm"));
    REQUIRE(a[i].contains("val_loss") == b[i].contains("val_loss"));
    if (a[i].contains("val_loss"))
      REQUIRE(a[i].at("val_loss").get<double>() == b[i].at("val_loss").get<double>());
  }
}

int export_hf(const fs::path& checkpoint, const fs::path& folder) {
  std::ostringstream out;
  return ckpt_command({"export", checkpoint.string(), "--format", "hf", "--out", folder.string()},
                      out);
}

std::vector<std::byte> bytes_of(const SafetensorsTensor& t) {
  return {t.data, t.data + t.bytes};
}

}  // namespace

TEST_CASE("a decoder loaded from a Hugging Face folder gives transformers' logits through the "
          "engine",
          "[decoder]") {
  const ScratchFolder dir("decoder-logits");
  for (const char* fixture : {"llama3", "qwen2_tied"}) {
    INFO("fixture " << fixture);
    auto j = decoder_run(dir, fixture);
    j["world_size"] = 1;
    const TrainConfig config = load(j);
    const RunModel& model = *config.model;
    InProcessGroup group(1);
    MemorySpace space(0, make_host_allocator());
    Engine engine(config.engine, group.rank(0), space);
    model.declare(engine);
    engine.build(model.initial_values(), model.groups());
    const SafetensorsFile batch = SafetensorsFile::open(kFixtures / fixture / "batch.safetensors");
    const auto* inputs = batch.find("inputs");
    const auto* targets = batch.find("targets");
    const auto* logits = batch.find("logits");
    REQUIRE((inputs && targets && logits));
    DecoderBatch b;
    b.sequences = static_cast<int>(inputs->shape[0]);
    b.seq_len = static_cast<int>(inputs->shape[1]);
    b.inputs.resize(inputs->bytes / 4);
    b.targets.resize(targets->bytes / 4);
    std::memcpy(b.inputs.data(), inputs->data, inputs->bytes);
    std::memcpy(b.targets.data(), targets->data, targets->bytes);
    // The shape as the model room reads the folder itself, apart from the trainer's config.
    const DecoderShape shape = HfCheckpoint::open(kFixtures / fixture, {b.seq_len, "seq"}).shape();
    auto decoder = make_decoder(shape, b.sequences, b.seq_len, config.engine.dtype,
                                space);
    const std::vector<float> ours = decoder->logits(engine, b);
    std::vector<float> theirs(logits->bytes / 4);
    std::memcpy(theirs.data(), logits->data, logits->bytes);
    REQUIRE(ours.size() == theirs.size());
    double diff = 0.0, norm = 0.0;
    for (std::size_t i = 0; i < ours.size(); ++i) {
      diff += (ours[i] - theirs[i]) * static_cast<double>(ours[i] - theirs[i]);
      norm += theirs[i] * static_cast<double>(theirs[i]);
    }
    CHECK(std::sqrt(diff / norm) < 2e-5);  // the engine holds the checkpoint's bf16 exactly
  }
}

TEST_CASE("a LISA fine-tune of a Hugging Face folder exports as one: frozen layers bit for bit, "
          "trained ones changed, load -> export exact",
          "[decoder]") {
  const ScratchFolder dir("decoder-lisa");
  auto j = decoder_run(dir, "qwen2_untied");
  j["layer_switching"] = {{"type", "lisa"}, {"interval", 4}, {"gamma", 1}, {"seed", 3}};
  j["checkpoint"] = {{"dir", (dir / "ckpt").string()}, {"every", 8}};
  std::string log;
  const auto metrics = run(load(j), &log);
  CAPTURE(log);
  REQUIRE(metrics.size() == 8);
  // Layers are switched from the JSON alone: every layers.N sampled, embed and head always on.
  std::vector<std::string> ever;
  for (const auto& m : metrics)
    for (const auto& g : m.at("active_groups")) ever.push_back(g.get<std::string>());
  CHECK(std::count(ever.begin(), ever.end(), "embed") == 8);
  CHECK(std::count(ever.begin(), ever.end(), "head") == 8);
  const auto first_active = metrics.front().at("active_groups");
  const auto last_val = metrics.back().at("val_loss").get<double>();
  CHECK(std::isfinite(last_val));

  REQUIRE(export_hf(dir / "ckpt" / checkpoint_name(8), dir / "hf") == 0);
  const HfCheckpoint exported = HfCheckpoint::open(dir / "hf", {24, "seq_len"});
  const SafetensorsFile original =
      SafetensorsFile::open(kFixtures / "qwen2_untied" / "model.safetensors");
  int changed = 0, same = 0;
  for (const auto& p : decoder_params(exported.shape())) {
    INFO(p.name);
    const auto* before = original.find(p.name);
    REQUIRE(before != nullptr);
    const bool equal = bytes_of(*before) == bytes_of(exported.tensor(p.name));
    const bool trained = std::find(ever.begin(), ever.end(), p.group) != ever.end();
    if (!trained) CHECK(equal);  // a layer LISA never drew is the checkpoint's, bit for bit
    (equal ? same : changed) += 1;
  }
  CHECK(changed > 0);
  (void)first_active;
}

TEST_CASE("a decoder loaded and exported unchanged is the Hugging Face folder it came from, bit "
          "for bit",
          "[decoder]") {
  const ScratchFolder dir("decoder-roundtrip");
  for (const char* fixture : {"qwen2_tied", "llama3"}) {
    INFO("fixture " << fixture);
    auto j = decoder_run(dir, fixture);
    j["steps"] = 1;
    j["optimizer"]["params"]["lr"] = 0.0;  // a step that changes nothing
    j["optimizer"]["params"]["weight_decay"] = 0.0;
    const auto ck = dir / (std::string("ckpt-") + fixture);
    j["checkpoint"] = {{"dir", ck.string()}, {"every", 1}};
    run(load(j));
    const auto out = dir / (std::string("hf-") + fixture);
    REQUIRE(export_hf(ck / checkpoint_name(1), out) == 0);
    const SafetensorsFile original = SafetensorsFile::open(kFixtures / fixture / "model.safetensors");
    const HfCheckpoint exported = HfCheckpoint::open(out, {24, "seq_len"});
    for (const auto& p : decoder_params(exported.shape())) {
      INFO(p.name);
      const auto* before = original.find(p.name);
      REQUIRE(before != nullptr);
      CHECK(bytes_of(*before) == bytes_of(exported.tensor(p.name)));
    }
  }
}

TEST_CASE("an export carries the source folder's tokenizer, chat template, generation config and "
          "token ids",
          "[decoder]") {
  const ScratchFolder dir("decoder-hf-roundtrip");
  // A copy of the llama3 fixture (bos 1, eos 2, generation_config.json from transformers) with
  // tokenizer files beside it, their bytes random: an export must copy them unread.
  const fs::path model = dir / "model";
  fs::copy(kFixtures / "llama3", model);
  std::mt19937 rng(11);
  const auto random_text = [&](std::size_t n) {
    std::string s(n, ' ');
    for (auto& c : s) c = static_cast<char>('a' + rng() % 26);
    return s;
  };
  const std::map<std::string, std::string> tokenizer = {
      {"tokenizer.json", "{\"model\": \"" + random_text(5000) + "\"}"},
      {"tokenizer_config.json",
       "{\"chat_template\": \"{% for m in messages %}{{ m['content'] }}{% endfor %}\"}"},
      {"special_tokens_map.json", "{\"eos_token\": \"</s>\"}"}};
  for (const auto& [name, bytes] : tokenizer) std::ofstream(model / name) << bytes;
  auto j = decoder_run(dir, "llama3");
  j["model"]["path"] = model.string();
  j["steps"] = 2;
  j["checkpoint"] = {{"dir", (dir / "ckpt").string()}, {"every", 2}};
  run(load(j));
  const fs::path ck = dir / "ckpt" / checkpoint_name(2);
  REQUIRE(export_hf(ck, dir / "hf") == 0);
  for (const auto& [name, bytes] : tokenizer) {
    INFO(name);
    CHECK(read_whole_file(dir / "hf" / name) == bytes);
  }
  CHECK(read_whole_file(dir / "hf" / "generation_config.json") ==
        read_whole_file(model / "generation_config.json"));
  const auto source = nlohmann::json::parse(read_whole_file(model / "config.json"));
  const auto exported = nlohmann::json::parse(read_whole_file(dir / "hf" / "config.json"));
  for (const char* key : {"bos_token_id", "eos_token_id", "initializer_range"}) {
    INFO(key);
    REQUIRE(source.contains(key));
    CHECK(exported.at(key) == source.at(key));
  }
  CHECK(exported.at("hidden_size") == source.at("hidden_size"));

  // The source changed since the run: refused naming the file and the way out.
  std::ofstream(model / "tokenizer.json") << "{}";
  const std::string msg = test::message_of<ConfigError>([&] {
    std::ostringstream out;
    ckpt_command({"export", ck.string(), "--format", "hf", "--out", (dir / "hf2").string()}, out);
  });
  CHECK(test::contains(msg, (model / "tokenizer.json").string()));
  CHECK(test::contains(msg, "has changed since the run read it"));
  CHECK(test::contains(msg, "--tokenizer-from"));
  CHECK_FALSE(fs::exists(dir / "hf2"));
  // --tokenizer-from takes another folder's files as they are.
  std::ostringstream out;
  REQUIRE(ckpt_command({"export", ck.string(), "--format", "hf", "--out", (dir / "hf3").string(),
                        "--tokenizer-from", model.string()},
                       out) == 0);
  CHECK(read_whole_file(dir / "hf3" / "tokenizer.json") == "{}");
  CHECK(test::contains(out.str(), "beside them: tokenizer.json, tokenizer_config.json"));
  // A folder without generation_config.json: one is made from config.json's token ids.
  fs::create_directory(dir / "tok");
  std::ofstream(dir / "tok" / "tokenizer.json") << "{}";
  REQUIRE(ckpt_command({"export", ck.string(), "--format", "hf", "--out", (dir / "hf4").string(),
                        "--tokenizer-from", (dir / "tok").string()},
                       out) == 0);
  const auto generation =
      nlohmann::json::parse(read_whole_file(dir / "hf4" / "generation_config.json"));
  CHECK(generation.at("bos_token_id") == source.at("bos_token_id"));
  CHECK(generation.at("eos_token_id") == source.at("eos_token_id"));
  CHECK(generation.at("_from_model_config") == true);

  // From scratch there is no folder: no side files, and no token ids to write a generation
  // config from.
  auto scratch = j;
  scratch["model"] = {{"vocab_size", 96}, {"hidden_size", 32}, {"intermediate_size", 48},
                      {"num_hidden_layers", 2}, {"num_attention_heads", 4}};
  scratch["checkpoint"] = {{"dir", (dir / "ckpt-scratch").string()}, {"every", 2}};
  run(load(scratch));
  REQUIRE(export_hf(dir / "ckpt-scratch" / checkpoint_name(2), dir / "hf-scratch") == 0);
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir / "hf-scratch"))
    names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  CHECK(names == std::vector<std::string>{"config.json", "model.safetensors"});
}

TEST_CASE("biases and norm weights are not decayed unless shardswap.weight_decay_on is \"all\"",
          "[decoder]") {
  // One step from the same weights (so every gradient is the same), a large decoupled decay:
  // the two runs differ exactly in the params the Hugging Face Trainer leaves out of decay.
  const ScratchFolder dir("decoder-no-decay");
  std::map<std::string, HfCheckpoint> exported;
  for (const char* on : {"weights", "all"}) {
    auto j = decoder_run(dir, "qwen2_untied");  // q/k/v biases, norms
    j["steps"] = 1;
    j["optimizer"]["params"]["weight_decay"] = 5.0;
    j["shardswap"]["weight_decay_on"] = on;
    const fs::path ck = dir / (std::string("ckpt-") + on);
    j["checkpoint"] = {{"dir", ck.string()}, {"every", 1}};
    run(load(j));
    REQUIRE(export_hf(ck / checkpoint_name(1), dir / (std::string("hf-") + on)) == 0);
    exported.emplace(on, HfCheckpoint::open(dir / (std::string("hf-") + on), {24, "seq_len"}));
  }
  int excluded = 0;
  for (const auto& p : decoder_params(exported.at("all").shape())) {
    INFO(p.name);
    const bool kept = p.name.ends_with(".bias") || p.name.ends_with("norm.weight");
    const bool same = bytes_of(exported.at("weights").tensor(p.name)) ==
                      bytes_of(exported.at("all").tensor(p.name));
    CHECK(same == !kept);
    excluded += kept ? 1 : 0;
  }
  CHECK(excluded == 2 * 5 + 1);  // per layer: 2 norms and 3 biases; the final norm
  auto j = decoder_run(dir, "qwen2_untied");
  j["shardswap"]["weight_decay_on"] = "biases";
  CHECK(test::config_shaped(test::message_of<ConfigError>([&] { load(j); }), "test.json",
                            "shardswap.weight_decay_on"));
}

TEST_CASE("a decoder's BAdam section without layers walks every layer, with nothing always on",
          "[decoder]") {
  const ScratchFolder dir("decoder-badam");
  auto j = decoder_run(dir, "llama3");
  j["layer_switching"] = {{"type", "badam"}, {"interval", 2}, {"always_active", nlohmann::json::array()}};
  const auto metrics = run(load(j));
  REQUIRE(metrics.size() == 8);
  // Two blocks (layers.0, layers.1) of two steps each, in ascending order, then again.
  for (std::size_t i = 0; i < metrics.size(); ++i) {
    INFO("step " << i + 1);
    const auto want = nlohmann::json::array({"layers." + std::to_string((i / 2) % 2)});
    CHECK(metrics[i].at("active_groups") == want);
  }
}

TEST_CASE("a decoder run resumed at another world size continues on the same tokens", "[decoder]") {
  const ScratchFolder dir("decoder-resume");
  auto j = decoder_run(dir, "llama3");
  j["checkpoint"] = {{"dir", (dir / "ckpt").string()}, {"every", 4}, {"keep", 4}};
  const auto whole = run(load(j));  // world 2, steps 1..8, saved at 4 and 8
  REQUIRE(whole.size() == 8);
  for (const int world : {1, 4}) {
    INFO("resumed at world size " << world);
    auto r = j;
    r["world_size"] = world;
    r["train_micro_batch_size_per_gpu"] = 8 / world / 2;  // the same global batch of 8
    r["checkpoint"]["dir"] = (dir / ("ckpt-" + std::to_string(world))).string();
    r["checkpoint"]["every"] = 2;  // 6 and 8: the second resume below starts at 6
    r["checkpoint"]["load"] = (dir / "ckpt" / checkpoint_name(4)).string();
    const auto resumed = run(load(r));
    REQUIRE(resumed.size() == 4);
    for (std::size_t i = 0; i < 4; ++i) {
      const double a = resumed[i].at("loss").get<double>(), b = whole[4 + i].at("loss").get<double>();
      INFO("step " << resumed[i].at("step") << ": " << a << " vs " << b);
      CHECK(resumed[i].at("step") == whole[4 + i].at("step"));
      // The same sequences in every step: only the order of float sums differs.
      CHECK(std::abs(a - b) <= 1e-4 * std::abs(b));
    }
    // Resumed again at this world size from its own step 6: steps 7 and 8 bit for bit as the
    // run that went on from there.
    auto again = r;
    again["checkpoint"]["dir"] = (dir / ("again-" + std::to_string(world))).string();
    again["checkpoint"]["load"] =
        (dir / ("ckpt-" + std::to_string(world)) / checkpoint_name(6)).string();
    const auto continued = run(load(again));
    REQUIRE(continued.size() == 2);
    for (std::size_t i = 0; i < 2; ++i) {
      CHECK(continued[i].at("step") == resumed[2 + i].at("step"));
      CHECK(continued[i].at("loss") == resumed[2 + i].at("loss"));
      CHECK(continued[i].at("grad_norm") == resumed[2 + i].at("grad_norm"));
    }
  }
}

TEST_CASE("a decoder run takes the same steps at ZeRO stage 1 and 2 and at world sizes 1, 2 and 4",
          "[decoder]") {
  // What the byte LM's multi-rank tests checked of the engine, on the decoder: the gradients
  // reduced over ranks (all-reduce at stage 1, reduce-scatter at stage 2) are the global
  // batch's, whatever the split. A rank's gradient lost, counted twice or not averaged moves
  // the gradient norm far beyond the float sums' order.
  const ScratchFolder dir("decoder-stages");
  const auto j = decoder_run(dir, "llama3");
  const auto reference = run(load(j));  // world 2, stage 2
  REQUIRE(reference.size() == 8);
  for (const int world : {1, 2, 4})
    for (const int stage : {1, 2}) {
      if (world == 2 && stage == 2) continue;
      INFO("world size " << world << ", stage " << stage);
      auto r = j;
      r["world_size"] = world;
      r["train_micro_batch_size_per_gpu"] = 8 / world / 2;  // the same global batch of 8
      r["zero_optimization"]["stage"] = stage;
      const auto steps = run(load(r));
      REQUIRE(steps.size() == reference.size());
      for (std::size_t i = 0; i < steps.size(); ++i) {
        const double loss = steps[i].at("loss").get<double>();
        const double ref_loss = reference[i].at("loss").get<double>();
        const double norm = steps[i].at("grad_norm").get<double>();
        const double ref_norm = reference[i].at("grad_norm").get<double>();
        INFO("step " << i + 1 << ": loss " << loss << " vs " << ref_loss << ", grad_norm "
                     << norm << " vs " << ref_norm);
        // Step 1 starts from the same weights: only the order of float sums differs. Later
        // steps drift apart as bf16 weights round differently (measured: up to 4e-4).
        const double tol = i == 0 ? 1e-5 : 1e-3;
        CHECK(std::abs(loss - ref_loss) <= tol * std::abs(ref_loss));
        CHECK(std::abs(norm - ref_norm) <= 10 * tol * std::abs(ref_norm));
      }
    }
}

TEST_CASE("a LISA run with the frozen layers' weights on the host gives the losses of one with "
          "them on the device, on two ranks",
          "[decoder]") {
  const ScratchFolder dir("decoder-frozen-host");
  auto j = decoder_run(dir, "qwen2_untied");
  j["layer_switching"] = {{"type", "lisa"}, {"interval", 2}, {"gamma", 1}, {"seed", 4}};
  j["checkpoint"] = {{"dir", (dir / "ckpt").string()}, {"every", 4}};
  const auto device = run(load(j));
  j["shardswap"]["frozen_weight_placement"] = "host";
  j["checkpoint"]["dir"] = (dir / "ckpt-host").string();
  std::string log;
  const auto host = run(load(j), &log);
  CAPTURE(log);
  REQUIRE(device.size() == 8);
  require_same_steps(host, device);
  // Saved with the weights on the device at step 4, resumed with them on the host: steps 5-8
  // as the run that went on.
  j["checkpoint"]["dir"] = (dir / "ckpt-resumed").string();
  j["checkpoint"]["load"] = (dir / "ckpt" / checkpoint_name(4)).string();
  const auto resumed = run(load(j));
  REQUIRE(resumed.size() == 4);
  for (std::size_t i = 0; i < resumed.size(); ++i) {
    CAPTURE(i);
    REQUIRE(resumed[i].at("step") == device[4 + i].at("step"));
    REQUIRE(resumed[i].at("loss").get<double>() == device[4 + i].at("loss").get<double>());
    REQUIRE(resumed[i].at("grad_norm") == device[4 + i].at("grad_norm"));
  }
}

TEST_CASE("a BAdam run with every frozen group's weights on the host, the embedding and the head "
          "among them, gives the losses of one with them on the device, tied or not",
          "[decoder]") {
  for (const char* fixture : {"qwen2_untied", "qwen2_tied"}) {
    CAPTURE(fixture);
    const ScratchFolder dir(std::string("decoder-frozen-badam-") + fixture);
    auto j = decoder_run(dir, fixture);
    // One block at a time: the embedding, the layers and the head each frozen most steps.
    j["layer_switching"] = {
        {"type", "badam"}, {"interval", 2}, {"always_active", nlohmann::json::array()}};
    const auto device = run(load(j));
    j["shardswap"]["frozen_weight_placement"] = "host";
    std::string log;
    const auto host = run(load(j), &log);
    CAPTURE(log);
    REQUIRE(device.size() == 8);
    require_same_steps(host, device);
  }
}

TEST_CASE("a LISA run with the update overlapping the next forward takes the steps of one "
          "without, tied or not, on two ranks",
          "[decoder]") {
  for (const char* fixture : {"qwen2_untied", "qwen2_tied"}) {
    CAPTURE(fixture);
    const ScratchFolder dir(std::string("decoder-overlap-") + fixture);
    auto j = decoder_run(dir, fixture);
    j["layer_switching"] = {{"type", "lisa"}, {"interval", 2}, {"gamma", 1}, {"seed", 4}};
    const auto plain = run(load(j));
    j["shardswap"]["overlap_update"] = true;
    std::string log;
    const auto overlapped = run(load(j), &log);
    CAPTURE(log);
    REQUIRE(plain.size() == 8);
    require_same_steps(overlapped, plain);
  }
}

// A precision option trains close to the fp32 run, not to its bits (its first step's loss is
// the same when only the backward changes), and a non-boolean value is refused naming the key.
TEST_CASE("the precision options (model.bit16_logits, model.bit16_swiglu_grad, "
          "model.bit16_residual) train close to the fp32 run, not its bits, and a non-boolean "
          "value is refused naming the key",
          "[decoder]") {
  for (const char* option : {"bit16_logits", "bit16_swiglu_grad", "bit16_residual"}) {
    CAPTURE(option);
    const ScratchFolder dir(std::string("decoder-") + option);
    auto j = decoder_run(dir, "qwen2_untied");
    const auto fp32 = run(load(j));
    j["model"][option] = true;
    const auto bf16 = run(load(j));
    REQUIRE(fp32.size() == 8);
    REQUIRE(bf16.size() == fp32.size());
    bool differs = false;
    for (std::size_t i = 0; i < bf16.size(); ++i) {
      const double a = fp32[i].at("loss").get<double>(), b = bf16[i].at("loss").get<double>();
      CAPTURE(i, a, b);
      REQUIRE(std::abs(a - b) / a < 1e-2);
      differs = differs || a != b;
    }
    REQUIRE(differs);
    j["model"][option] = "yes";
    const std::string msg = test::message_of<ConfigError>([&] { (void)load(j); });
    REQUIRE(test::contains(msg, std::string("model.") + option));
  }
}

// model.attention picks among the CUDA backend's attentions: "auto" is the key left out, a value
// it does not know is refused when the config is read, and a cuDNN or own-kernel choice on a
// CPU run is refused before the first step, and by `shardswap plan`, naming the key, never run
// or planned as something else.
TEST_CASE(
    "model.attention: \"auto\" is the default, an unknown value and a CUDA choice on a CPU "
    "run or plan are refused naming the key",
    "[decoder]") {
  const ScratchFolder dir("decoder-attention");
  auto j = decoder_run(dir, "qwen2_untied");
  j["steps"] = 2;
  const auto plain = run(load(j));
  j["model"]["attention"] = "auto";
  require_same_steps(run(load(j)), plain);
  j["model"]["attention"] = "flash";
  std::string msg = test::message_of<ConfigError>([&] { (void)load(j); });
  CHECK(test::contains(msg, "model.attention = \"flash\""));
  CHECK(test::contains(msg, "\"cudnn-atomic\""));
  for (const char* cuda_only : {"cudnn", "cudnn-atomic", "own"}) {
    CAPTURE(cuda_only);
    j["model"]["attention"] = cuda_only;
    const TrainConfig config = load(j);  // a value the key knows
    msg = test::message_of<ConfigError>([&] { (void)run(config); });
    CHECK(test::contains(msg, std::string("model.attention = \"") + cuda_only + "\""));
    CHECK(test::contains(msg, "CPU backend"));
    std::ostringstream plan;
    msg = test::message_of<ConfigError>([&] { print_plan(config, plan); });
    CHECK(test::contains(msg, std::string("model.attention = \"") + cuda_only + "\""));
    CHECK(plan.str().empty());
  }
}

// model.keep_norm_outputs is the CUDA backend's (tests/gpu/decoder_gpu_test.cpp checks its bits
// and bytes): false is the key left out; true on a CPU run is refused before the first step and
// by the plan's bytes, naming the key; a value that is not a boolean when the config is read.
TEST_CASE("model.keep_norm_outputs: false is the default, true on a CPU run and a non-boolean "
          "are refused naming the key",
          "[decoder]") {
  const ScratchFolder dir("decoder-keep-norms");
  auto j = decoder_run(dir, "qwen2_untied");
  j["steps"] = 2;
  const auto plain = run(load(j));
  j["model"]["keep_norm_outputs"] = false;
  require_same_steps(run(load(j)), plain);
  j["model"]["keep_norm_outputs"] = true;
  const TrainConfig config = load(j);
  std::string msg = test::message_of<ConfigError>([&] { (void)run(config); });
  CHECK(test::contains(msg, "model.keep_norm_outputs = true"));
  CHECK(test::contains(msg, "CPU backend"));
  DecoderShape shape;  // a small Llama
  shape.family = DecoderFamily::llama;
  shape.vocab = 37;
  shape.hidden = 16;
  shape.intermediate = 24;
  shape.layers = 2;
  shape.heads = 4;
  shape.kv_heads = 2;
  shape.head_dim = 4;
  shape.max_positions = 32;
  DecoderOptions options;
  options.keep_norm_outputs = true;
  msg = test::message_of<ConfigError>([&] {
    (void)Decoder::activation_bytes(shape, 2, 8, DType::bf16, DeviceKind::host, options);
  });
  CHECK(test::contains(msg, "model.keep_norm_outputs"));
  j["model"]["keep_norm_outputs"] = "yes";
  msg = test::message_of<ConfigError>([&] { (void)load(j); });
  CHECK(test::contains(msg, "model.keep_norm_outputs"));
}

// model.loss_chunk_rows sizes the cross-entropy's block of logits: a run with chunks of 8 rows
// (6 a micro-batch of 2 x 24 tokens) trains as one with the backend's own (one chunk), up to the
// order in which the head's gradient is summed, and plans (and holds: the trainer checks plan
// = peak) fewer bytes; a value outside [1, 2^30] or not a number is refused naming the key.
TEST_CASE("model.loss_chunk_rows trains as the default and plans its own bytes, a bad value is "
          "refused naming the key",
          "[decoder]") {
  const ScratchFolder dir("decoder-loss-rows");
  auto j = decoder_run(dir, "qwen2_untied");
  const TrainConfig plain_config = load(j);
  const auto plain = run(plain_config);
  j["model"]["loss_chunk_rows"] = 8;
  const TrainConfig chunked_config = load(j);
  const auto chunked = run(chunked_config);
  REQUIRE(chunked.size() == plain.size());
  for (std::size_t i = 0; i < plain.size(); ++i) {
    const double a = plain[i].at("loss").get<double>(), b = chunked[i].at("loss").get<double>();
    CAPTURE(i, a, b);
    REQUIRE(std::abs(a - b) < 1e-5 * a);
  }
  const auto activation = [](const TrainConfig& c) {
    return c.model->activation_bytes(c.batches.micro_samples, c.engine.dtype, DeviceKind::host);
  };
  CHECK(activation(chunked_config) < activation(plain_config));
  for (const nlohmann::json& bad : {nlohmann::json(0), nlohmann::json(-3),
                                   nlohmann::json(std::int64_t{1} << 31), nlohmann::json("many")}) {
    CAPTURE(bad.dump());
    j["model"]["loss_chunk_rows"] = bad;
    CHECK(test::contains(test::message_of<ConfigError>([&] { (void)load(j); }),
                         "model.loss_chunk_rows"));
  }
}
