#include "engine/bucket_reducer.h"

#include <fmt/format.h>

#include <algorithm>

#include "shardswap/error.h"

namespace shardswap {

BucketReducer::BucketReducer(Communicator& comm, MemorySpace& space,
                             const DeviceOps& kernels, DType grad_dtype, DType comm_dtype,
                             std::int64_t capacity, bool overlap)
    : comm_(comm),
      kernels_(kernels),
      dtype_(grad_dtype),
      comm_dtype_(comm_dtype),
      capacity_(capacity),
      overlap_(overlap) {
  const auto n = static_cast<std::size_t>(capacity);
  for (int i = 0; i < 2; ++i)
    buckets_[i] =
        space.allocate(n * dtype_size(grad_dtype), Tag::grad, fmt::format("grad bucket {}", i));
  if (comm_dtype != grad_dtype)
    compressed_ = space.allocate(n * dtype_size(comm_dtype), Tag::comm,
                                 fmt::format("compressed bucket ({})", dtype_name(comm_dtype)));
}

std::string BucketReducer::grad_label(const Group& g) const {
  return fmt::format("group {} grad partition", g.name);
}

View BucketReducer::slot(Group& group, std::size_t param, const Param& p) {
  const LayoutEntry& entry = group.layout.entry_of(p.index_in_group);
  const std::string& name = p.info.name;
  const bool fits = group_ == &group && entry.offset >= start_ &&
                    entry.offset + entry.numel <= start_ + capacity_;
  const bool fresh = !fits;
  if (fresh) {
    flush();
    open(group, entry);
  }
  // Slots are accumulated into, and the alignment gaps between them are reduced with them: what
  // the hull gains is zeroed now (only that: zeroing the whole capacity at every window cost a
  // 64 MiB fill per window on the CPU). A slot inside the hull already holds zeros or gradient.
  const auto esize = dtype_size(dtype_);
  auto* bucket = buckets_[current_].as<std::byte>();
  const auto zero = [&](std::int64_t from, std::int64_t to) {
    if (to > from)
      kernels_.fill_zero(bucket + static_cast<std::size_t>(from - start_) * esize,
                         static_cast<std::size_t>(to - from) * esize);
  };
  if (fresh) {
    zero(entry.offset, entry.offset + entry.numel);
    lo_ = entry.offset;
    hi_ = entry.offset + entry.numel;
  } else {
    zero(entry.offset, lo_);
    zero(hi_, entry.offset + entry.numel);
    lo_ = std::min(lo_, entry.offset);
    hi_ = std::max(hi_, entry.offset + entry.numel);
  }
  last_group_ = &group;
  last_offset_ = entry.offset;
  group.holds_grads = true;
  auto it = std::find_if(pending_.begin(), pending_.end(),
                         [&](const Pending& p) { return p.param == param; });
  if (it == pending_.end())
    pending_.push_back({param, name, false});
  else
    it->ready = false;  // handed out again: more gradient is coming
  return buckets_[current_].view(static_cast<std::size_t>(entry.offset - start_) * esize,
                                 static_cast<std::size_t>(entry.numel), dtype_,
                                 fmt::format("{}: grad slot in bucket {}", name, current_));
}

bool BucketReducer::mark_ready(std::size_t param) {
  for (auto& p : pending_)
    if (p.param == param) {
      p.ready = true;
      return true;
    }
  return false;
}

void BucketReducer::open(Group& group, const LayoutEntry& entry) {
  // Gradients usually arrive in descending flat order (backward): place the window so it ends at
  // this param. Ascending arrival (the previous slot of this group lay below): start at it.
  const bool ascending = last_group_ == &group && last_offset_ < entry.offset;
  const std::int64_t align = group.layout.alignment_elements();
  if (ascending) {
    start_ = entry.offset;
  } else {  // the lowest aligned start whose window still holds the whole param
    const std::int64_t slack = (capacity_ - entry.numel) / align * align;
    start_ = std::max<std::int64_t>(0, entry.offset - slack);
  }
  group_ = &group;
  lo_ = hi_ = entry.offset;  // empty; slot() zeroes what the hull gains
}

void BucketReducer::flush() {
  if (group_ == nullptr) return;
  std::string missing;
  for (const auto& p : pending_)
    if (!p.ready) missing += fmt::format("{}'{}'", missing.empty() ? "" : ", ", p.name);
  if (!missing.empty())
    throw Error(fmt::format("Engine: grad_slot was handed out but grad_ready never called for {}",
                            missing));
  // The previous flush's results leave the comm buffer (reused below) and the bucket we are
  // about to flip to.
  settle();
  const auto esize = static_cast<std::int64_t>(dtype_size(dtype_));
  const auto wire_size = static_cast<std::int64_t>(dtype_size(comm_dtype_));
  auto* bucket = buckets_[current_].as<std::byte>();
  // One reduce per owner's piece, issued as one group so that they share the links the way a
  // reduce-scatter does (one after another, each would carry its whole piece over every link).
  struct Piece {
    std::byte* data;  // in the bucket, or in the comm buffer when compressed
    std::size_t count;
    int root;
    std::int64_t begin;
  };
  std::vector<Piece> pieces;
  for (const OwnedRange& piece : owners_of(group_->layout, lo_, hi_)) {
    const std::int64_t at = piece.begin - start_;
    std::byte* data = bucket + at * esize;
    const auto count = static_cast<std::size_t>(piece.end - piece.begin);
    if (compressed_.valid()) {
      std::byte* wire = compressed_.as<std::byte>() + at * wire_size;
      kernels_.cast(wire, comm_dtype_, data, dtype_, count);
      data = wire;
    }
    pieces.push_back({data, count, piece.rank, piece.begin});
  }
  hand_overs_.push_back({group_->index, lo_, hi_});
  comm_.set_deferred(overlap_);
  comm_.group_start();
  try {
    for (const Piece& p : pieces) comm_.reduce(p.data, p.count, comm_dtype_, ReduceOp::sum, p.root);
    comm_.group_end();
  } catch (...) {
    try {
      comm_.group_end();
    } catch (...) {  // the first error is the one to report
    }
    comm_.set_deferred(false);
    throw;
  }
  for (const Piece& p : pieces)
    if (p.root == comm_.rank())
      owed_.push_back(
          {group_->grad.as<std::byte>() + (p.begin - group_->shard.begin) * esize, p.data, p.count});
  comm_.set_deferred(false);
  in_flight_ = group_;  // even with nothing owed here: the bucket is read until the reduces end
  if (!overlap_) settle();
  ++flushes_;
  close(fmt::format("reduce of grad bucket {} (flush {})", current_, flushes_));
  current_ = 1 - current_;  // the next window fills the other bucket
}

void BucketReducer::settle() {
  if (in_flight_ == nullptr) return;
  comm_.join();
  in_flight_ = nullptr;
  for (const Owed& o : owed_)
    kernels_.accumulate(o.partition, dtype_, o.reduced, comm_dtype_, o.count);
  owed_.clear();
}

void BucketReducer::discard() {
  settle();
  hand_overs_.clear();
  if (group_ != nullptr) close("zero_grad discarded the pending bucket");
  last_group_ = nullptr;
}

void BucketReducer::clear(std::vector<Group>& groups) {
  discard();
  for (auto& g : groups) {
    if (g.active) kernels_.fill_zero(g.grad.data(), g.grad.bytes());
    g.holds_grads = false;
  }
}

std::string BucketReducer::pending(const Group& g) const {
  if (group_ == &g) {
    std::string params;
    for (const auto& p : pending_)
      params += fmt::format("{}'{}'", params.empty() ? "" : ", ", p.name);
    return fmt::format("in the open reduce bucket: {}", params);
  }
  if (in_flight_ == &g) return "in a reduce issued and not yet settled";
  if (g.holds_grads) return "reduced, not yet applied by step()";
  return "";
}

void BucketReducer::forget_groups() {
  discard();
  last_group_ = nullptr;
  last_offset_ = -1;
}

void BucketReducer::close(const std::string& event) {
  buckets_[current_].invalidate_views(event);
  group_ = nullptr;
  pending_.clear();
}

}  // namespace shardswap
