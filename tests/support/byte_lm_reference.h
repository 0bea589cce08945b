// The byte LM in float64 with plain loops, written apart from tools/lm (sample by sample, no
// matrices, no shared helpers), and a check of a ByteLm backend through a real Engine against
// it. Shared by the CPU and GPU suites.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "shardswap/backend.h"
#include "tools/lm/byte_lm.h"

namespace shardswap::test_support {

/// Param values by name, row-major [out, in] as the model declares them.
using ParamValues = std::map<std::string, std::vector<double>>;

/// Each param's shape and group as the reference understands the model.
struct RefParam {
  std::vector<std::int64_t> shape;
  std::string group;
};
std::map<std::string, RefParam> byte_lm_reference_params(const ByteLmShape& shape);

/// Mean cross-entropy of the batch.
double byte_lm_reference_loss(const ByteLmShape& shape, const ParamValues& w,
                              const TokenBatch& batch);

struct RefGradients {
  double loss = 0.0;
  ParamValues grads;  ///< d(mean loss) / d(param), every param
};
RefGradients byte_lm_reference_gradients(const ByteLmShape& shape, const ParamValues& w,
                                         const TokenBatch& batch);

/// ||a - b|| / ||b|| (||a - b|| when b is zero).
double normalized_error(const std::vector<double>& a, const std::vector<double>& b);

/// Random weights (not the init: norms around 1, biases non-zero, matrices a little larger than
/// the init's scale) from `seed`, and random bytes.
ParamValues random_byte_lm_weights(const ByteLmShape& shape, std::uint64_t seed);
TokenBatch random_token_batch(const ByteLmShape& shape, int size, std::uint64_t seed);

struct ByteLmCase {
  ByteLmShape shape{3, 16, 24, 2};
  int world_size = 1;
  int stage = 2;
  DType dtype = DType::bf16;
  std::optional<DType> grad_dtype = {};  ///< fp32: gradients kept in fp32 slots
  /// The groups active at build (and trained); empty: all.
  std::vector<std::string> active = {};
  int batch = 12;      ///< samples per rank
  int max_batch = 16;  ///< the model's
};

/// One rank, every stage (1, 2), weight type (bf16, fp16) and gradient slot (the weights' type,
/// fp32): the dtype matrix both suites check; the rest as ByteLmCase has it.
std::vector<ByteLmCase> byte_lm_one_rank_dtype_cases();

/// What a check found (for the caller's REQUIREs and for reporting).
struct ByteLmCheck {
  double loss_error = 0.0;        ///< max over ranks of |loss - reference| / reference
  double worst_grad_error = 0.0;  ///< max over trained params of the normalized gradient error
  std::string worst_param;
  std::map<std::string, double> grad_errors;  ///< per trained param
  bool frozen_unchanged = true;               ///< frozen groups' weights identical after step
  bool eval_loss_matches = true;              ///< loss() == train_step's loss, bitwise
  bool activation_bytes_match = true;         ///< the space's activation bytes == planned
  int steps_applied = 0;
};

/// Builds a real Engine per rank on `backend` (world_size in-process ranks; SGD, lr 1000, no
/// momentum or decay, no clipping; fp16 with a static loss scale of 1024), fills it with
/// random_byte_lm_weights, runs one train_step per rank on its own random batch and one step,
/// and recovers each trained param's mean gradient from its fp32 master: (before - after) / lr.
/// Compares it with the float64 reference averaged over the ranks' batches. The caller
/// REQUIREs on the result (rank threads must not use Catch2's macros).
ByteLmCheck check_byte_lm(const ByteLmCase& c, const Backend& backend);

}  // namespace shardswap::test_support
