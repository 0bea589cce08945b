// Argument checks every backend's kernels make before touching memory (one place, so the
// backends refuse exactly the same calls with the same messages). Internal to optimizer/.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>

#include "optimizer/optimizer.h"

namespace shardswap::detail {

/// ConfigError "<fn>: <name> is null for <count> <unit>" when p is null (count > 0 assumed).
void require_data(const void* p, const char* fn, const char* name, std::size_t count,
                  const char* unit = "elements");

/// Checks sum_squares' arguments: spans and sums present when n > 0, and every span's data
/// present when it has elements ("<fn>: spans[i].data is null for <count> elements").
void check_squares(const char* fn, const ConstSpan* spans, std::size_t n, const double* sums);

/// Checks an update's arguments: bit16 params, gradients of the param type or fp32, step >= 1
/// and every tensor the rule reads present. `fn` names the caller ("cpu_device_ops().update").
/// Returns false when there is nothing to do (count 0).
bool check_update(const char* fn, const OptimizerConfig& config, const StepArgs& args,
                  const ShardTensors& t);

/// check_update of every piece, and every slot the rule uses present with a chunk >= 1. Returns
/// false when no piece has an element.
bool check_streamed(const char* fn, const OptimizerConfig& config, const StreamedTensors& s);

/// The update of elements [at, at + n) of piece `p`, with master and state in `slot`.
inline ShardTensors slot_tensors(const StreamedTensors& s, const ShardTensors& p, int slot,
                                 std::size_t at, std::size_t n) {
  ShardTensors c = p;
  if (p.master_low != nullptr)
    c.master_low = static_cast<std::uint16_t*>(s.slot_master[slot]);
  else
    c.master = static_cast<float*>(s.slot_master[slot]);
  c.state0 = p.state0 != nullptr ? s.slot_state0[slot] : nullptr;
  c.state1 = p.state1 != nullptr ? s.slot_state1[slot] : nullptr;
  c.grad = s.slot_grad[slot] != nullptr
               ? s.slot_grad[slot]
               : static_cast<const std::byte*>(p.grad) + at * dtype_size(p.grad_dtype);
  c.param = static_cast<std::byte*>(p.param) + at * dtype_size(p.dtype);
  c.count = n;
  return c;
}

/// One copy between a chunk's slot and its place in the piece's host memory.
struct ChunkCopy {
  void* slot = nullptr;  ///< null: the rule has no such tensor
  void* host = nullptr;
  std::size_t bytes = 0;
  bool up_only = false;  ///< read by the update, not written: it does not come back down
};

/// The copies of elements [at, at + n) of piece `p` (host memory) and its slot tensors `c`: the
/// master (fp32, or its low halves), each state slot in the piece's state dtype, and the gradient
/// when it is on the host too (s.slot_grad set), up only.
inline std::array<ChunkCopy, 4> chunk_copies(const StreamedTensors& s, const ShardTensors& p,
                                             const ShardTensors& c, std::size_t at,
                                             std::size_t n) {
  const std::size_t state = dtype_size(p.state_dtype);
  const auto host_state = [&](void* h) {
    return h == nullptr ? nullptr : static_cast<void*>(static_cast<std::byte*>(h) + at * state);
  };
  const ChunkCopy master =
      p.master_low != nullptr
          ? ChunkCopy{c.master_low, p.master_low + at, n * sizeof(std::uint16_t)}
          : ChunkCopy{c.master, p.master + at, n * sizeof(float)};
  const std::size_t grad = dtype_size(p.grad_dtype);
  const ChunkCopy gradient =
      s.slot_grad[0] == nullptr
          ? ChunkCopy{}
          : ChunkCopy{const_cast<void*>(c.grad),
                      const_cast<std::byte*>(static_cast<const std::byte*>(p.grad)) + at * grad,
                      n * grad, true};
  return {master, ChunkCopy{c.state0, host_state(p.state0), n * state},
          ChunkCopy{c.state1, host_state(p.state1), n * state}, gradient};
}

/// Calls f(piece, chunk index k, at, n) for chunk after chunk of every piece, k counting on
/// across pieces: the walk both backends make.
template <class F>
void for_each_streamed_chunk(const StreamedTensors& s, F&& f) {
  std::size_t k = 0;
  for (const StreamedPiece& piece : s.pieces)
    for (std::size_t at = 0; at < piece.t.count; at += s.chunk, ++k)
      f(piece, k, at, std::min(s.chunk, piece.t.count - at));
}

}  // namespace shardswap::detail
