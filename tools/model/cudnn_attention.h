// The decoder's causal GQA attention through cuDNN's fused flash attention (cuDNN 9's C graph
// API, tools/model/cudnn_attention.cpp), forward with the row log-sum-exp and backward. A build
// without cuDNN links tools/model/cudnn_attention_stub.cpp instead (SHARDSWAP_CUDNN,
// tools/model/CMakeLists.txt): cudnn_attention_available() says which. C++17 and free of cuDNN's
// headers so that nvcc compiles the decoder that includes it.
#pragma once

#include <cstddef>
#include <memory>

#include "model/decoder_compute.h"

namespace shardswap::lm::dec {

/// Whether this build has attention through cuDNN: true in cudnn_attention.cpp, false in its
/// stub, whose CudnnAttention throws BackendUnavailable. A link-time choice, so every target of
/// one build plans the decoder's memory (cuda_layout) the same.
bool cudnn_attention_available();

/// The workspace handed to cuDNN for `tokens` tokens of `heads` query heads: a plan that asks
/// for more is refused (ConfigError) rather than given memory from outside. cuDNN 9.14 on an
/// H200 asked for tokens * heads * head_dim fp32 values plus 256 bytes (GQA; 256 bytes for
/// MHA) at every shape tried, up to 8 x 2048 tokens of 14 heads (56 MiB); 1 MiB more is slack.
inline std::size_t cudnn_attention_workspace_bytes(std::size_t tokens, int heads, int head_dim) {
  return tokens * static_cast<std::size_t>(heads) * static_cast<std::size_t>(head_dim) * 4 +
         (std::size_t{1} << 20);
}

/// One attention problem. Rows are tokens, token = sequence * seq_len + position, and head h's
/// vector starts at h * head_dim in its row; the *_ld are row lengths in elements. The plans
/// are built for (and cached by) every field.
struct AttentionShape {
  int sequences = 0, seq_len = 0, heads = 0, kv_heads = 0, head_dim = 0;
  DType dtype = DType::bf16;  // of q, k, v, o, dout, dq, dk, dv: bf16 or fp16
  long long q_ld = 0;         // q, o, dout (and dq): heads * head_dim or more
  long long kv_ld = 0;        // k, v
  long long grad_ld = 0;      // dq, dk, dv (backward only)
  /// Backward without atomics: dS K is written straight into dq (cuDNN keeps dP in its
  /// workspace, so the batch goes in calls of cudnn_attention_deterministic_sequences) instead
  /// of being summed over key tiles into the fp32 dq32 accumulator, whose order of additions
  /// varies from run to run. dq32 is then unused (may be null). The forward is the same.
  bool deterministic = false;
  bool operator==(const AttentionShape& o) const {
    return sequences == o.sequences && seq_len == o.seq_len && heads == o.heads &&
           kv_heads == o.kv_heads && head_dim == o.head_dim && dtype == o.dtype && q_ld == o.q_ld &&
           kv_ld == o.kv_ld && grad_ld == o.grad_ld && deterministic == o.deterministic;
  }
};

/// The deterministic backward's workspace for a call of `sequences` sequences: cuDNN keeps the
/// probabilities' gradient dP of every (sequence, head) there, 2 bytes a score of the 64-padded
/// seq_len x seq_len (as cudnn-frontend sizes it on Hopper), besides the workspace above.
inline std::size_t cudnn_attention_deterministic_workspace_bytes(int sequences, int seq_len,
                                                                 int heads, int head_dim) {
  const std::size_t padded = (static_cast<std::size_t>(seq_len) + 63) / 64 * 64;
  const std::size_t b = static_cast<std::size_t>(sequences);
  return b * static_cast<std::size_t>(heads) * padded * padded * 2 +
         cudnn_attention_workspace_bytes(b * static_cast<std::size_t>(seq_len), heads, head_dim);
}

/// How many sequences one deterministic backward call of shape s takes with `bytes` of
/// workspace: the most, up to s.sequences, whose workspace fits, keeping each call's lse and
/// delta 16-byte aligned (a call starts first * heads * seq_len floats in); 0 when even the
/// smallest call does not fit. CudnnAttention::backward splits the batch into such calls.
inline int cudnn_attention_deterministic_sequences(const AttentionShape& s, std::size_t bytes) {
  int unit = 1;
  while (static_cast<long long>(unit) * s.heads * s.seq_len % 4 != 0) ++unit;
  int best = 0;
  for (int c = 1; c <= s.sequences; ++c) {
    if (c % unit != 0 && c != s.sequences) continue;
    if (cudnn_attention_deterministic_workspace_bytes(c, s.seq_len, s.heads, s.head_dim) > bytes)
      break;
    best = c;
  }
  return best;
}

/// Forward operands (device pointers, 16-byte aligned). lse is fp32 [sequences, heads, seq_len]
/// packed: the natural log of each row's sum of exp(scaled scores).
struct AttentionForward {
  const void *q, *k, *v;
  void* o;  // rows of q_ld
  float* lse;
};

/// Backward operands. dq, dk, dv are written in the operands' type (rows of grad_ld; dk, dv
/// summed over each kv head's group), rounded from fp32 sums. dq32 is fp32 scratch of
/// sequences * heads * seq_len * head_dim values (cuDNN's dQ accumulator, zeroed here; its
/// layout is cuDNN's), delta fp32 scratch of sequences * heads * seq_len (rowsum(dout * o)).
struct AttentionBackward {
  const void *q, *k, *v, *o, *dout;
  const float* lse;
  void *dq, *dk, *dv;
  float* dq32;
  float* delta;
};

/// A cuDNN handle on cudaStreamPerThread of the current device and the plans it has built.
/// Not copyable. Everything is queued on cudaStreamPerThread; the host never waits.
class CudnnAttention {
 public:
  /// workspace: [workspace, workspace + bytes) of device memory, 16-byte aligned.
  CudnnAttention(void* workspace, std::size_t bytes);
  ~CudnnAttention();
  CudnnAttention(const CudnnAttention&) = delete;
  CudnnAttention& operator=(const CudnnAttention&) = delete;

  /// Builds (once per shape) the forward and backward plans; returns the larger workspace
  /// they need. Throws ConfigError naming the shape when cuDNN has no engine for it or wants
  /// more workspace than it was given; nothing is queued.
  std::size_t prepare(const AttentionShape& s);
  /// Queues the forward (prepare()s first). scale = 1 / sqrt(head_dim).
  void forward(const AttentionShape& s, const AttentionForward& io);
  /// Queues the backward (prepare()s first), from forward's lse.
  void backward(const AttentionShape& s, const AttentionBackward& io);

  /// cuDNN's version at run time (e.g. 91400 for 9.14.0).
  static long version();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace shardswap::lm::dec
