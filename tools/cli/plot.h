// `shardswap plot METRICS --out FILE`: the loss and the memory by tag of a training run against
// the step, layer switches marked, drawn by gnuplot from a `shardswap train --metrics` file.
#pragma once

#include <cstdint>
#include <istream>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "shardswap/error.h"
#include "files/output_file.h"

namespace shardswap {

/// A program ShardSwap runs is not installed; the message names the package that provides it.
class ToolNotFound : public Error {
 public:
  using Error::Error;
};

/// One line of the memory panel.
struct MemorySeries {
  std::string name;         ///< a memory tag ("param16", ...) or "total"
  std::vector<double> mib;  ///< one per MetricsSeries::steps; NaN where the line lacks it
};

/// What `shardswap plot` draws, read from a metrics file.
struct MetricsSeries {
  std::vector<std::int64_t> steps;  ///< every line's step, in file order
  std::vector<double> loss;         ///< one per step; NaN where absent or null (non-finite)
  /// Evaluation steps only; step 0 is the validation loss before training (the first line's
  /// "initial_val_loss").
  std::vector<std::pair<std::int64_t, double>> val_loss;
  /// The tags that reach kMinTagShare of the largest total on some line (ShardSwap's tags in
  /// their order, then unknown numeric keys of memory_bytes as first seen), then "total" if
  /// present. "peak" is left out, and so are tags that would only draw a line on zero (comm's
  /// few bytes of scalars).
  std::vector<MemorySeries> memory;
  std::vector<std::int64_t> switch_steps;  ///< lines with a "switch" object
  std::vector<std::string> switch_in;      ///< per switch: the groups that came in, joined
  std::vector<std::int64_t> resume_steps;  ///< the steps of resume lines, in file order
  std::vector<std::string> warnings;       ///< what was skipped (a cut-off last line), per line
};

/// Reads JSON lines (one object per step; blank lines skipped). Only "step" is required; missing
/// optional keys and unknown keys are fine. A resume line ({"resumed": {"step": R, ...}}, written
/// by a resumed run) drops the lines before it with a step beyond R: the run went on from R, so
/// the series is one curve. A last line without a newline that is not valid JSON (a write cut
/// short by a kill) is skipped with a warning in `warnings`. Throws ConfigError naming `source`
/// and the line for any other line that is not a JSON object, lacks an integer "step", or has a
/// known key of the wrong type; and for a file with no step at all.
MetricsSeries read_metrics(std::istream& in, const std::string& source);
/// read_metrics of a file; ConfigError naming it if it cannot be read.
MetricsSeries read_metrics_file(const std::string& path);

/// A memory tag is drawn when it reaches this share of the largest total on some line.
inline constexpr double kMinTagShare = 1e-3;

enum class PlotFormat { png, svg };

/// From the extension of `out_path` (.png or .svg, any case); ConfigError naming --out otherwise.
PlotFormat plot_format(const std::string& out_path);

/// The gnuplot script for `series`. It reads ARG1 (the output file), ARG2 (the folder of the data
/// files write_plot_data wrote) and ARG3 (the title), so no path is ever quoted into it.
/// Both throw ConfigError for a series with no step, or with a loss or memory series whose
/// length is not the number of steps.
/// The loss axis is linear unless log_y (every loss value must then be > 0: ConfigError naming
/// --log-y otherwise).
std::string gnuplot_script(const MetricsSeries& series, PlotFormat format, bool log_y = false);
/// Writes the data files gnuplot_script reads into `folder`.
void write_plot_data(const MetricsSeries& series, const std::string& folder);

struct PlotOptions {
  std::string gnuplot = "gnuplot";  ///< the program, looked up on PATH
  std::string title;                ///< above both panels
  bool log_y = false;               ///< the loss on a log axis (--log-y)
  std::vector<InputFile> inputs;    ///< files the output must never replace (the metrics file)
};

/// Draws `series` into `out_path` (its format by extension), an OutputFile: checked first (absent
/// or a regular file, no checkpoint's, none of options.inputs), then gnuplot draws into its
/// temporary beside `out_path`, which is renamed over it only once gnuplot succeeded and the file
/// exists: nothing is ever half-written. The data and the script go to a temporary folder.
/// Throws ConfigError (bad or refused --out), ToolNotFound (no gnuplot) or Error (gnuplot failed;
/// its output is in the message).
void plot_metrics(const MetricsSeries& series, const std::string& out_path,
                  const PlotOptions& options = {});

/// shardswap plot METRICS --out FILE.png|FILE.svg
/// Returns 0; throws ConfigError for bad arguments or input.
int plot_command(const std::vector<std::string>& args, std::ostream& out);

}  // namespace shardswap
