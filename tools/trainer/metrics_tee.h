// One MetricsLog that hands every call to several: the trainer writes its per-step lines once,
// and they reach both the --metrics file and the tensorboard event files (tools/trainer/tensorboard.h).
#pragma once

#include <algorithm>
#include <optional>
#include <vector>

#include "trainer/metrics_log.h"

namespace shardswap {

class MetricsTee final : public MetricsLog {
 public:
  /// Null entries are left out. The logs are called in this order: one that throws (a failed
  /// write under --metrics-errors=fail) stops the call before the logs after it.
  explicit MetricsTee(std::vector<MetricsLog*> logs) : logs_(std::move(logs)) {
    logs_.erase(std::remove(logs_.begin(), logs_.end(), nullptr), logs_.end());
  }
  bool empty() const { return logs_.empty(); }

  void begin(const std::optional<ResumePoint>& resumed) override {
    for (auto* log : logs_) log->begin(resumed);
  }
  void write(std::int64_t step, const nlohmann::json& line) override {
    for (auto* log : logs_) log->write(step, line);
  }

 private:
  std::vector<MetricsLog*> logs_;
};

}  // namespace shardswap
