// Gradient compression (fp32 gradients, bf16/fp16 on the wire): exact against the float64
// reference, and never more than one bucket of extra peak memory.
#include "shardswap/backend.h"
#include "shardswap/error.h"
#include "tests/catch_compat.h"
#include "tests/support/compression_peak.h"
#include "tests/support/reference_check.h"

using namespace shardswap;
using test_support::Case;

TEST_CASE("fp32 gradients reduced uncompressed match the float64 reference") {
  for (int world : {1, 3, 4})
    for (int stage : {1, 2}) {
      Case c{world, stage, DType::bf16, OptimizerType::adamw};
      c.grad_dtype = DType::f32;
      test_support::check_against_reference(c, cpu_backend());
    }
}

TEST_CASE("compressed gradient communication matches the float64 reference of its rounding") {
  for (int world : {2, 3, 8})
    for (int stage : {1, 2})
      for (DType wire : {DType::bf16, DType::f16}) {
        Case c{world, stage, DType::bf16, OptimizerType::adam};
        c.grad_dtype = DType::f32;
        c.comm_dtype = wire;
        test_support::check_against_reference(c, cpu_backend());
      }
}

TEST_CASE("compression raises peak memory by at most one reduce bucket whatever the model size") {
  for (std::int64_t params : {std::int64_t{1} << 20, std::int64_t{10'000'000}})
    for (int stage : {1, 2}) {
      const auto p = test_support::compression_peaks(cpu_backend(), params, stage, DType::bf16, 2);
      CAPTURE(params, stage, p.off, p.on, p.bucket);
      REQUIRE(p.on - p.off <= p.bucket);
      REQUIRE(p.on > p.off);  // the one compressed buffer does exist
    }
}

TEST_CASE("compression to bf16 is refused for bf16 gradients, naming the keys") {
  EngineConfig cfg;
  cfg.comm_dtype = DType::f16;
  const auto msg = test::message_of<ConfigError>([&] { cfg.validate(""); });
  REQUIRE(test::contains(msg, "communication_data_type"));
  REQUIRE(test::contains(msg, "grad_accum_dtype"));
  const auto fields = test::message_of<ConfigError>([&] { cfg.validate(); });
  REQUIRE(test::contains(fields, "EngineConfig.comm_dtype"));
  REQUIRE(test::contains(fields, "EngineConfig.grad_dtype"));
}
