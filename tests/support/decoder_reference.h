// The decoder (tools/model/decoder_compute.h) in float64 with plain loops, written apart from its
// backends (sequence by sequence, token by token, no matrices, no chunking, no shared helpers),
// and its gradient by central finite differences. What a backend is checked against.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "model/decoder_compute.h"

namespace shardswap::test_support {

/// Param values by Hugging Face name, row-major [out, in] as transformers stores them.
using DecoderValues = std::map<std::string, std::vector<double>>;

struct DecoderRefParam {
  std::string name;
  std::vector<std::int64_t> shape;
  int group = 0;  ///< 0 embed, 1 + l layers.l, layers + 1 the final norm and an untied head
  std::int64_t numel() const;
};
/// Every param of the shape, in declaration order (embedding first, lm_head last).
std::vector<DecoderRefParam> decoder_reference_params(const DecoderShape& s);

/// Token ids: `sequences` rows of `seq_len` inputs, each followed by its target; positions
/// (empty: 0 .. seq_len - 1 in each row) keep documents apart: each token's place in its
/// document, which starts where a position is 0 (lm::dec::Batch::positions).
struct DecoderTokens {
  int sequences = 0;
  int seq_len = 0;
  std::vector<std::int32_t> inputs, targets;
  std::vector<std::int32_t> positions;
};

struct DecoderRefOutput {
  std::vector<double> logits;  ///< [sequences * seq_len, vocab]
  double loss = 0.0;  ///< mean cross-entropy over every position whose target is not ignored (< 0)
};
DecoderRefOutput decoder_reference_forward(const DecoderShape& s, const DecoderValues& w,
                                           const DecoderTokens& tokens);

/// d(mean loss) / d(w[name][index]) by central differences of step h; w[name][index] is
/// perturbed and put back.
double decoder_reference_gradient(const DecoderShape& s, DecoderValues& w,
                                  const DecoderTokens& tokens, const std::string& name,
                                  std::size_t index, double h = 1e-5);

/// RoPE's inverse frequencies, computed here in float64 from the config fields (transformers'
/// default and llama3 rules), then rounded to float32 as transformers keeps them.
std::vector<float> decoder_reference_inv_freq(const DecoderShape& s);

/// Random weights from `seed` (not an init: norms around 1, biases non-zero, matrices of scale
/// 1 / sqrt(fan-in), so that activations and logits are O(1) and nothing saturates).
DecoderValues random_decoder_weights(const DecoderShape& s, std::uint64_t seed);
DecoderTokens random_decoder_tokens(const DecoderShape& s, int sequences, int seq_len,
                                    std::uint64_t seed);

/// The mean over `rows` rows of `vocab` logits of logsumexp(z_r) - z_r[targets[r]], in float64;
/// rows whose target is negative (ignored) count neither in the sum nor in the mean. What a
/// backend's loss must be for the logits it hands out.
double decoder_mean_cross_entropy(const float* logits, std::size_t rows, std::size_t vocab,
                                  const std::int32_t* targets);

/// ||a - b|| / ||b|| (||a - b|| when b is zero).
double decoder_normalized_error(const std::vector<double>& a, const std::vector<double>& b);

}  // namespace shardswap::test_support
