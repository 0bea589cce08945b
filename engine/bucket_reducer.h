// Stage 2 gradient reduction: gradients are written into one of two reduce buckets; a full bucket
// is reduced straight into the owning ranks' gradient partitions, so no rank ever holds a full
// gradient buffer.
//
// A bucket is a window [start, start + capacity) of one group's flat space: a param's slot sits
// at its own flat offset within the window, so a reduced bucket splits at shard boundaries into
// contiguous pieces, one reduce per owner (usually one or two). Windows follow the order the
// gradients come in (backward order is usually descending), but any order is correct: a param
// reduced twice simply accumulates.
//
// Overlap (zero_optimization.overlap_comm): a bucket's reduces are queued without making the
// caller's stream wait for them, so backward fills the other bucket meanwhile. What depends on a
// reduce -- accumulating its result into the owner's partition, and reusing its bucket or the comm
// buffer -- is deferred to settle(), which the next flush (before it touches either buffer) and
// finish() call. Without overlap every reduce is waited for as it is issued.
//
// Compression (fp32 gradients, bf16/fp16 communication): each piece is cast into one reused
// bucket-sized comm buffer, reduced there, and accumulated back into the fp32 partition. That
// buffer is the only extra memory, whatever the model size: the failure of a compressed copy
// kept per bucket (PyTorch DDP's fp16 hook: peak from 3G to 4G) cannot happen.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/gradient_reducer.h"

namespace shardswap {

class BucketReducer final : public GradientReducer {
 public:
  /// Allocates two buckets of `capacity` elements of `grad_dtype` (tag grad) and, when
  /// comm_dtype differs, one comm buffer of `capacity` elements of `comm_dtype` (tag comm).
  BucketReducer(Communicator& comm, MemorySpace& space, const DeviceOps& kernels,
                DType grad_dtype, DType comm_dtype, std::int64_t capacity, bool overlap);

  std::int64_t grad_numel(const Group& g) const override { return g.shard.numel(); }
  std::string grad_label(const Group& g) const override;
  void attach(Group&, const std::vector<Param>&) override {}
  void detach(Group&) override {}
  /// Reduces the open bucket first if the slot does not fit in its window.
  View slot(Group& g, std::size_t index, const Param& p) override;
  /// False if the param has no slot in the open bucket.
  bool mark_ready(std::size_t index) override;
  /// flush() and settle(), and forget the fill direction: the next backward starts afresh.
  /// Afterwards every reduced gradient is in its owner's partition.
  void finish() override {
    flush();
    settle();
    last_group_ = nullptr;
  }
  void reduce_for_step(std::vector<Group>&) override {}
  std::byte* partition(const Group& g) const override { return g.grad.as<std::byte>(); }
  void clear(std::vector<Group>& groups) override;
  std::string pending(const Group& g) const override;
  void forget_groups() override;

 private:
  /// Reduces the open bucket (if any) into the owners' partitions; its slots go stale. Throws
  /// Error naming the params whose slot was handed out but never marked ready.
  void flush();
  /// Forgets the open bucket without reducing it; its slots go stale. Buckets already reduced
  /// are settled into their partitions first.
  void discard();
  void open(Group& group, const LayoutEntry& entry);
  void close(const std::string& event);
  /// Waits (on the caller's stream) for the reduces issued by the last flush and accumulates
  /// their results into the owners' partitions.
  void settle();

  Communicator& comm_;
  const DeviceOps& kernels_;
  DType dtype_;       // of the gradients (buckets and partitions)
  DType comm_dtype_;  // on the wire
  std::int64_t capacity_;
  Buffer buckets_[2];
  Buffer compressed_;  // only when comm_dtype_ != dtype_
  int current_ = 0;
  Group* group_ = nullptr;             // group of the open bucket; null when none is open
  std::int64_t start_ = 0;             // window start (flat element)
  std::int64_t lo_ = 0, hi_ = 0;       // hull of the slots handed out
  const Group* last_group_ = nullptr;  // previous slot's group and offset: the fill direction
  std::int64_t last_offset_ = -1;
  struct Pending {
    std::size_t param;
    std::string name;
    bool ready;
  };
  std::vector<Pending> pending_;
  std::int64_t flushes_ = 0;
  bool overlap_;
  /// A reduced piece this rank owns, waiting for settle() to add it to the partition.
  struct Owed {
    std::byte* partition;
    const std::byte* reduced;  // in a bucket or the comm buffer
    std::size_t count;
  };
  std::vector<Owed> owed_;
  const Group* in_flight_ = nullptr;  // group of the reduces issued by the last flush, unsettled
};

}  // namespace shardswap
