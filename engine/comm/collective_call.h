// One rank's call of a collective as the backends that check that every rank called the same
// compare and name it (internal): the in-process rendezvous and the MPI communicator's opening
// exchange.
#pragma once

#include <fmt/format.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "shardswap/communicator.h"
#include "shardswap/dtype.h"

namespace shardswap {

// int64: the MPI communicator sends it as one of the call's words.
enum class CollectiveKind : std::int64_t {
  all_reduce,
  reduce_scatter,
  reduce,
  all_gather,
  broadcast,
  barrier
};

inline const char* collective_name(CollectiveKind k) {
  switch (k) {
    case CollectiveKind::all_reduce:
      return "all_reduce";
    case CollectiveKind::reduce_scatter:
      return "reduce_scatter";
    case CollectiveKind::reduce:
      return "reduce";
    case CollectiveKind::all_gather:
      return "all_gather";
    case CollectiveKind::broadcast:
      return "broadcast";
    case CollectiveKind::barrier:
      return "barrier";
  }
  return "?";
}

/// What must agree across ranks.
struct CollectiveCall {
  CollectiveKind kind = CollectiveKind::barrier;
  std::size_t count = 0;  // the count argument as the caller passed it
  DType dtype = DType::f32;
  ReduceOp op = ReduceOp::sum;  // left at sum where the collective has no op, so calls compare
  int root = 0;                 // left at 0 where the collective has no root

  bool has_op() const {
    return kind == CollectiveKind::all_reduce || kind == CollectiveKind::reduce_scatter ||
           kind == CollectiveKind::reduce;
  }
  bool has_root() const {
    return kind == CollectiveKind::reduce || kind == CollectiveKind::broadcast;
  }
  bool same_as(const CollectiveCall& o) const {
    return kind == o.kind && count == o.count && dtype == o.dtype && op == o.op && root == o.root;
  }
  /// "all_reduce(count=8, bf16, sum)", "broadcast(count=4, f32, root=1)", "barrier()".
  std::string describe() const {
    if (kind == CollectiveKind::barrier) return "barrier()";
    std::string s = fmt::format("{}(count={}, {}", collective_name(kind), count, dtype_name(dtype));
    if (has_op()) s += fmt::format(", {}", reduce_op_name(op));
    if (has_root()) s += fmt::format(", root={}", root);
    return s + ")";
  }
};

}  // namespace shardswap
