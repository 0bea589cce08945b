// InitAhead (tools/model/init_ahead.h): the decoder's random initial values drawn ahead on threads
// are Decoder::init's, in whatever order and from however many threads they are asked for.
#include <algorithm>
#include <string>
#include <thread>
#include <vector>

#include "shardswap/error.h"
#include "tests/catch_compat.h"
#include "model/decoder.h"
#include "model/init_ahead.h"

using namespace shardswap;

namespace {

DecoderShape shape() {
  DecoderShape s;
  s.family = DecoderFamily::qwen2;
  s.qkv_bias = true;
  s.vocab = 300;
  s.hidden = 48;
  s.intermediate = 80;
  s.layers = 3;
  s.heads = 4;
  s.kv_heads = 2;
  s.head_dim = 12;
  return s;
}

std::vector<ParamInfo> infos(const DecoderShape& s) {
  std::vector<ParamInfo> out;
  for (const DecoderParam& p : decoder_params(s)) {
    std::int64_t numel = 1;
    for (const auto x : p.shape) numel *= x;
    out.push_back({p.name, p.shape, numel, p.group});
  }
  return out;
}

std::vector<float> direct(const DecoderShape& s, const ParamInfo& p, std::uint64_t seed) {
  std::vector<float> v(static_cast<std::size_t>(p.numel));
  Decoder::init(s, p, v, seed);
  return v;
}

}  // namespace

TEST_CASE("InitAhead gives Decoder::init's values in declaration order, any order, any threads",
          "[decoder]") {
  const DecoderShape s = shape();
  const auto params = infos(s);
  REQUIRE(params.size() > 10);
  const std::uint64_t seed = 7;
  for (const int threads : {1, 3, 64}) {
    CAPTURE(threads);
    SECTION("declaration order, " + std::to_string(threads) + " threads") {
      InitAhead ahead(s, seed, threads);
      for (const ParamInfo& p : params) {
        std::vector<float> got(static_cast<std::size_t>(p.numel), -1.0f);
        ahead.fill(p, got);
        CAPTURE(p.name);
        REQUIRE(got == direct(s, p, seed));
      }
    }
    SECTION("reversed, then each param a second time, " + std::to_string(threads) + " threads") {
      InitAhead ahead(s, seed, threads);
      auto order = params;
      std::reverse(order.begin(), order.end());
      order.insert(order.end(), params.begin(), params.end());
      for (const ParamInfo& p : order) {
        std::vector<float> got(static_cast<std::size_t>(p.numel), -1.0f);
        ahead.fill(p, got);
        CAPTURE(p.name);
        REQUIRE(got == direct(s, p, seed));
      }
    }
  }
  SECTION("four threads asking for every param at once") {
    InitAhead ahead(s, seed, 4);
    std::vector<std::vector<std::vector<float>>> got(4);
    std::vector<std::thread> callers;
    for (int t = 0; t < 4; ++t)
      callers.emplace_back([&, t] {
        for (const ParamInfo& p : params) {
          got[t].emplace_back(static_cast<std::size_t>(p.numel));
          ahead.fill(p, got[t].back());
        }
      });
    for (auto& c : callers) c.join();
    for (int t = 0; t < 4; ++t)
      for (std::size_t i = 0; i < params.size(); ++i) {
        CAPTURE(t, params[i].name);
        REQUIRE(got[t][i] == direct(s, params[i], seed));
      }
  }
}

TEST_CASE("InitAhead refuses a name or size that is not the decoder's, naming it", "[decoder]") {
  const DecoderShape s = shape();
  InitAhead ahead(s, 1, 2);
  std::vector<float> v(10);
  ParamInfo bogus{"model.layers.0.mlp.nonsense", {10}, 10, "layers.0"};
  const std::string unknown = test::message_of<ConfigError>([&] { ahead.fill(bogus, v); });
  CAPTURE(unknown);
  REQUIRE(test::contains(unknown, "model.layers.0.mlp.nonsense"));
  const ParamInfo wrong = infos(s).front();  // the embedding, 300 x 48 values, not 10
  const std::string size = test::message_of<ConfigError>([&] { ahead.fill(wrong, v); });
  CAPTURE(size);
  REQUIRE(test::contains(size, wrong.name));
}
