// What `shardswap bench offload` (bench_offload.cpp) shares with its CUDA rows (offload_cuda.cpp,
// or offload_cuda_stub.cpp in a build without CUDA): the update every row runs, its inputs and
// their one-step result, the timing and the row.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "optimizer/optimizer.h"

namespace shardswap {

class HostUpdater;

/// Bytes one AdamW update moves per param: master, m, v read and written (fp32), the bf16
/// gradient read and the bf16 param written: 4 * 3 + 4 * 3 + 2 + 2.
constexpr std::size_t kUpdateBytesPerParam = 28;
constexpr int kWarmup = 2;

/// The update of every row: AdamW at step 10 (m and v far from their start), bf16 gradient and
/// param, fp32 master, m and v.
OptimizerConfig offload_config();
StepArgs offload_args();

/// Every tensor of every row starts as one period of kPeriod random elements repeated (element i
/// holds period[i % kPeriod]), so one cpu_device_ops().update of one period gives the expected
/// bits of every element after one step. bf16 values are kept as their bits.
struct OffloadData {
  static constexpr std::size_t kPeriod = std::size_t{1} << 20;
  std::vector<float> master, m, v;
  std::vector<std::uint16_t> grad;
  /// After one update of the period from the values above (param: the bf16 master).
  std::vector<float> next_master, next_m, next_v;
  std::vector<std::uint16_t> next_param;
};
OffloadData make_offload_data();

/// Writes elements [begin, end) of dst, each `elem` bytes: element i is period[i % kPeriod].
void fill_periodic(void* dst, const void* period, std::size_t elem, std::size_t begin,
                   std::size_t end);
/// True when the n elements at `got` are `period` repeated, bit for bit.
bool equals_periodic(const void* got, const void* period, std::size_t elem, std::size_t n);

/// The median of `iters` calls of f after kWarmup untimed ones, in seconds. f returns when its
/// work is done (a device's included).
double median_seconds(int iters, const std::function<void()>& f);

/// One line of the table. A rate is shown where its count is set.
struct OffloadRow {
  explicit OffloadRow(std::string row_name, unsigned cpu_threads = 0)
      : name(std::move(row_name)), threads(cpu_threads) {}

  std::string name;
  unsigned threads = 0;    ///< CPU threads (0: not a CPU row)
  double seconds = 0;      ///< the median time of one call
  std::size_t params = 0;  ///< params updated per call (0: not an update)
  double bytes = 0;        ///< bytes counted for GB/s (0: none)
  std::optional<double> ratio;
  std::optional<bool> ok;  ///< the row's check, where it has one
};

/// The rows of --backend cuda on the current device over n params (bench_offload.h), each given
/// to `emit` as soon as it is measured: pinned H2D, D2H and both at once; the on-device update;
/// state in pinned host memory updated the "host" and the "streamed" way (ratio: params/s over
/// the on-device update's). Each update row's `ok`: one step from OffloadData's values gives
/// next_* at every element. Throws BackendUnavailable in a build without CUDA.
void cuda_offload_rows(const OffloadData& data, HostUpdater& updater, std::size_t n, int iters,
                       const std::function<void(const OffloadRow&)>& emit);

}  // namespace shardswap
