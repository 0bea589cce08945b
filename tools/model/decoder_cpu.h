// The CPU backend of the decoder (tools/model/decoder_compute.h): fp32 Eigen on the host, one
// thread per call, all working memory carved from one block the caller allocates.
#pragma once

#include <cstddef>
#include <memory>

#include "model/decoder_compute.h"

namespace shardswap::lm::dec {

/// Exact bytes of the CPU backend's working memory for batches of up to max_sequences x
/// seq_len tokens (activations kept for backward, backward scratch, the fp32 upcast of one
/// group's weights, the chunked cross-entropy's logits rows: loss_rows of them, 0 for
/// kLossChunkRows, at most the batch's tokens). The lowest recompute_layers
/// layers keep only their input x_l from forward and run their forward again in backward,
/// sharing one layer's activations (0: none; at most layers); gradients and loss are the same
/// bits either way. Throws ConfigError naming the DecoderShape field or argument that no
/// backend can run.
std::size_t cpu_bytes(const DecoderShape& s, int max_sequences, int seq_len,
                      int recompute_layers = 0, int loss_rows = 0);

/// The backend on [memory, memory + cpu_bytes(...)) (host memory, 64-byte aligned; the block
/// must outlive the backend). Batches may have fewer sequences and a shorter seq_len than
/// configured. Throws ConfigError on a block that is too small or misaligned, or a precision
/// that is not fp32, bf16 or fp16. `precision`: fp32 everywhere (the default), or bf16 / fp16
/// logits (each rounded to it before the cross-entropy, as the CUDA backend's bit16 logits are:
/// model.bit16_logits), gradient at SwiGLU's output (rounded where the down projection's input
/// gradient is formed: model.bit16_swiglu_grad) and residual stream (the o and down projections'
/// products, the sums x + o Wo^T and y + act Wdown^T, each norm's output gradient and the
/// stream's gradient, each rounded after its fp32 product or sum: model.bit16_residual).
/// `loss_rows`: the cross-entropy's chunk (model.loss_chunk_rows), as cpu_bytes was given it.
std::unique_ptr<Compute> make_cpu_compute(const DecoderShape& s, int max_sequences, int seq_len,
                                          void* memory, std::size_t bytes,
                                          int recompute_layers = 0, Precision precision = {},
                                          int loss_rows = 0);

/// Rows of logits the cross-entropy holds at once ([rows, vocab] fp32) unless a run asks for
/// another count (model.loss_chunk_rows): bounds the logits memory for large vocabularies while
/// keeping the head's GEMMs large enough to be efficient.
inline constexpr int kLossChunkRows = 64;

}  // namespace shardswap::lm::dec
