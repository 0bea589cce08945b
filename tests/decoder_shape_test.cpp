// The decoder's shape limits (DecoderShapeLimits) and its param count without the param list.
#include <cstdint>
#include <string>

#include "shardswap/error.h"
#include "tests/catch_compat.h"
#include "model/decoder.h"

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
