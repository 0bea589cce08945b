// The decoder reads its own keys (tools/model/decoder_config.h), with no trainer around it: the
// inline config.json fields, a Hugging Face folder opened once, and the refusals naming the key.
#include <fmt/format.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "shardswap/config_reader.h"
#include "shardswap/error.h"
#include "tests/catch_compat.h"
#include "model/decoder_config.h"
#include "model/hf_checkpoint.h"

using namespace shardswap;
using test::contains;
using test::message_of;
namespace fs = std::filesystem;

namespace {

const fs::path kFixtures = fs::path(SHARDSWAP_TEST_DIR) / "fixtures" / "decoder";

DecoderConfig read(const nlohmann::json& model, int seq_len = 24) {
  ConfigReader reader(nlohmann::json{{"model", model}}, "run.json");
  return decoder_config_from_json(reader, seq_len);
}

}  // namespace

TEST_CASE("the decoder reads its inline config.json fields, llama by default", "[decoder]") {
  const DecoderConfig d = read({{"vocab_size", 96}, {"hidden_size", 32}, {"intermediate_size", 48},
                                {"num_hidden_layers", 3}, {"num_attention_heads", 4},
                                {"num_key_value_heads", 2}, {"recompute_layers", 2}});
  CHECK(d.shape.family == DecoderFamily::llama);
  CHECK(d.shape.vocab == 96);
  CHECK(d.shape.layers == 3);
  CHECK(d.shape.kv_heads == 2);
  CHECK(d.shape.head_dim == 8);
  CHECK(d.options.recompute_layers == 2);
  CHECK(d.options.loss_chunk_rows == 0);  // the backend's own
  CHECK(d.seq_len == 24);
  CHECK(d.path.empty());
  CHECK(d.weights == nullptr);
  CHECK(d.input_files().empty());
}

TEST_CASE("the decoder opens model.path once and lists the files a run must not replace",
          "[decoder]") {
  const fs::path folder = kFixtures / "qwen2_tied";
  const DecoderConfig d = read({{"path", folder.string()}});
  REQUIRE(d.weights != nullptr);
  const HfCheckpoint alone = HfCheckpoint::open(folder, {24, "data.seq_len"});
  CHECK(d.shape.family == DecoderFamily::qwen2);
  CHECK(d.shape.vocab == alone.shape().vocab);
  CHECK(d.shape.layers == alone.shape().layers);
  CHECK(d.shape.tied);
  const auto files = d.input_files();
  // The fixture's side file: generation_config.json (transformers wrote it).
  REQUIRE(d.side_files.size() == 1);
  CHECK(d.side_files[0].name == "generation_config.json");
  CHECK(d.side_files[0].bytes == fs::file_size(folder / "generation_config.json"));
  REQUIRE(files.size() == 1 + alone.files().size() + 1);
  CHECK(files.front() == folder / "config.json");
  CHECK(files[alone.files().size()] == alone.files().back());
  CHECK(files.back() == folder / "generation_config.json");
}

TEST_CASE("the decoder's keys are refused naming the key and the config file", "[decoder]") {
  const nlohmann::json tiny = {{"vocab_size", 96}, {"hidden_size", 32},
                               {"intermediate_size", 48}, {"num_hidden_layers", 3},
                               {"num_attention_heads", 4}};
  auto too_many = tiny;
  too_many["recompute_layers"] = 4;
  std::string msg = message_of<ConfigError>([&] { read(too_many); });
  CHECK(test::config_shaped(msg, "run.json", "model.recompute_layers"));
  CHECK(contains(msg, "num_hidden_layers = 3"));


  // The sequence length is checked against the model: past max_position_embeddings.
  auto short_positions = tiny;
  short_positions["max_position_embeddings"] = 16;
  msg = message_of<ConfigError>([&] { read(short_positions, 24); });
  CHECK(contains(msg, "data.seq_len"));
  CHECK(contains(msg, "run.json"));

  msg = message_of<ConfigError>([&] { read({{"path", "/nonexistent/model"}}); });
  CHECK(contains(msg, "/nonexistent/model"));
}

TEST_CASE("model.path wins over inline fields: the same value is silent, another one a warning",
          "[decoder]") {
  const fs::path folder = kFixtures / "llama3";
  const HfCheckpoint alone = HfCheckpoint::open(folder, {24, "data.seq_len"});
  const nlohmann::json& theirs = alone.config().fields;
  ConfigReader reader(
      nlohmann::json{{"model",
                      {{"path", folder.string()},
                       {"model_type", "llama"},                                    // the same
                       {"hidden_size", theirs.at("hidden_size").get<double>()},  // 1.0 * same
                       {"num_hidden_layers", theirs.at("num_hidden_layers").get<int>() + 1},
                       {"sliding_window", 16}}}},  // not in a llama's config.json
      "run.json");
  const DecoderConfig d = decoder_config_from_json(reader, 24);
  CHECK(d.shape.layers == alone.shape().layers);  // the folder's
  const auto& warnings = reader.warnings();
  REQUIRE(warnings.size() == 2);
  CHECK(test::config_shaped(warnings[0], "run.json", "model.num_hidden_layers"));
  CHECK(contains(warnings[0], fmt::format("config.json says {}", alone.shape().layers)));
  CHECK(contains(warnings[0], "model.path wins"));
  CHECK(test::config_shaped(warnings[1], "run.json", "model.sliding_window"));
  CHECK(contains(warnings[1], "does not set it"));
  CHECK(reader.unread_keys().empty());
}
