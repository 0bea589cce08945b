// Stage 1: every active group keeps its full bit16 (or fp32) gradient buffer; grad slots are
// Views of it, accumulated into until the step, when each group's buffer is reduce-scattered so
// this rank's shard holds the sum. With compression, in chunks through one reused comm buffer.
#pragma once

#include "engine/gradient_reducer.h"

namespace shardswap {

class FullGradientReducer final : public GradientReducer {
 public:
  FullGradientReducer(const EngineConfig& config, Communicator& comm, MemorySpace& space,
                      const DeviceOps& ops, std::int64_t capacity, std::size_t param_count);

  std::int64_t grad_numel(const Group& g) const override { return g.layout.total_numel(); }
  std::string grad_label(const Group& g) const override;
  void attach(Group& g, const std::vector<Param>& params) override;
  void detach(Group& g) override;
  View slot(Group& g, std::size_t index, const Param& p) override;
  bool mark_ready(std::size_t index) override;
  void finish() override;
  void reduce_for_step(std::vector<Group>& groups) override;
  std::byte* partition(const Group& g) const override;
  void clear(std::vector<Group>& groups) override;
  std::string pending(const Group& g) const override;
  void forget_groups() override {}

 private:
  void reduce_scatter(Group& g);
  struct Slot {
    View view;           // "<name>: grad slot", while the group is active
    std::string name;
    bool out = false;    // handed out since the last clear
    bool ready = false;  // grad_ready since it was last handed out
  };
  Communicator& comm_;
  const DeviceOps& ops_;
  DType dtype_, wire_;
  std::int64_t capacity_;
  Buffer compressed_;  // only when the wire type differs: one reused chunk
  std::vector<Slot> slots_;
};

}  // namespace shardswap
