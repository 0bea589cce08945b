// The sharded engine on the CPU against the float64 reference of tests/support: world sizes 1,
// 2, 3, 4, 8; stages 1 and 2; bf16 and fp16; Adam, AdamW and SGD.
#include "shardswap/backend.h"
#include "tests/catch_compat.h"
#include "tests/support/reference_check.h"

using namespace shardswap;
using test_support::check_against_reference;

namespace {

void check_all(OptimizerType optimizer) {
  for (int world : {1, 2, 3, 4, 8})
    for (int stage : {1, 2})
      for (DType dtype : {DType::bf16, DType::f16})
        check_against_reference({world, stage, dtype, optimizer}, cpu_backend());
}

}  // namespace

TEST_CASE("sharded Adam matches the float64 reference for every world size, stage and dtype") {
  check_all(OptimizerType::adam);
}

TEST_CASE("sharded AdamW matches the float64 reference for every world size, stage and dtype") {
  check_all(OptimizerType::adamw);
}

TEST_CASE("sharded SGD matches the float64 reference for every world size, stage and dtype") {
  check_all(OptimizerType::sgd);
}

TEST_CASE("round-robin layout order gives the same result as declaration order") {
  for (int stage : {1, 2})
    check_against_reference({3, stage, DType::bf16, OptimizerType::adamw, LayoutOrder::round_robin},
                            cpu_backend());
}
