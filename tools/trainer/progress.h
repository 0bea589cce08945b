// Training progress for `shardswap train`: on a terminal one line redrawn in place, elsewhere
// (pipe, file, CI) plain lines every `interval` steps, so logs hold no control characters.
#pragma once

#include <chrono>
#include <cstdint>
#include <ostream>
#include <string>
#include <string_view>

namespace shardswap {

/// "h:mm:ss", hours unbounded, rounded to the nearest second; "-:--:--" for a negative or
/// non-finite time (an ETA not known yet).
std::string format_hms(double seconds);

/// An exponential moving average of the time per step: the ETA follows a change of pace (a layer
/// switch, a slower phase) within a few dozen steps but does not jump on one slow step.
class StepTimeAverage {
 public:
  /// `weight`: the share of one new step in the average, in (0, 1].
  explicit StepTimeAverage(double weight = 0.05);

  /// `steps` (>= 1) steps took `seconds` in all: counted as `steps` steps of seconds/steps each,
  /// so the average does not depend on how often it is fed. The first call sets the average.
  void add(double seconds, std::int64_t steps);

  bool known() const { return known_; }
  double seconds_per_step() const { return average_; }
  /// Seconds left for `steps_left` steps; NaN while nothing is known.
  double eta(std::int64_t steps_left) const;

 private:
  double weight_;
  double average_ = 0.0;
  bool known_ = false;
};

/// What the caller knows after a step.
struct ProgressSample {
  std::int64_t step = 0;  ///< steps completed, 1..total
  double loss = 0.0;
  double throughput = 0.0;        ///< per second, in ProgressOptions::throughput_unit
  std::int64_t memory_bytes = 0;  ///< shown in MiB
};

struct ProgressOptions {
  std::int64_t total_steps = 0;
  /// true: redraw one line in place (the caller decides, e.g. isatty(fileno(stdout)));
  /// false: plain lines.
  bool terminal = false;
  std::int64_t interval = 10;       ///< plain lines: every `interval` steps and at the last
  double min_redraw_seconds = 0.1;  ///< terminal: at most 10 redraws a second
  int columns = 0;                  ///< terminal width (terminal_columns()); 0: not shortened
  double smoothing = 0.05;          ///< StepTimeAverage weight of the ETA
  /// What `throughput` counts: "tokens/s" for a language model, "samples/s" for the built-in
  /// regression model, which has no tokens.
  std::string throughput_unit = "tokens/s";
};

/// Reports progress to one stream. Not thread-safe: one thread (rank 0) calls it.
///
/// Terminal mode writes "\r", the line, then "\x1b[K" (clear to the end of the line) and never a
/// newline until finish(); message() clears the bar, prints the message on its own line and
/// redraws the bar below it. Plain mode writes one line per `interval` steps, no control
/// characters. The ETA is measured from the first update on, because the first step usually
/// carries one-off work (allocation, warm-up) that says nothing of the steps to come.
class ProgressReporter {
 public:
  using Clock = std::chrono::steady_clock;

  /// `start` is when the run started (elapsed counts from it). Throws ConfigError naming the
  /// option if total_steps < 1, interval < 1 or smoothing is not in (0, 1].
  ProgressReporter(std::ostream& out, ProgressOptions options,
                   Clock::time_point start = Clock::now());
  /// Ends a bar left on its line, so that an error printed next starts on a line of its own.
  ~ProgressReporter();
  ProgressReporter(const ProgressReporter&) = delete;
  ProgressReporter& operator=(const ProgressReporter&) = delete;

  /// After each step. Draws or prints only when due (see the class comment); costs a few
  /// arithmetic operations otherwise.
  void update(const ProgressSample& sample, Clock::time_point now = Clock::now());
  /// Eval results, layer switches, warnings: printed above the bar without garbling it.
  void message(std::string_view text);
  /// Draws the last sample's final line (terminal: then a newline; plain: only if that step's
  /// line was not printed yet). Calling it again does nothing until the next update.
  void finish(Clock::time_point now = Clock::now());

  /// The fields of one line, without bar: "step 20/100  loss ...  elapsed 0:00:03".
  std::string fields(const ProgressSample& sample, Clock::time_point now) const;

 private:
  void draw(Clock::time_point now);
  std::string bar_line(const ProgressSample& sample, Clock::time_point now);

  std::ostream& out_;
  ProgressOptions options_;
  Clock::time_point start_;
  StepTimeAverage step_time_;
  ProgressSample last_;
  bool have_last_ = false;
  bool last_shown_ = false;        // the last sample's line is on screen / in the log
  bool bar_on_line_ = false;       // terminal: a bar without newline is the current line
  std::string drawn_;              // terminal: that bar, to redraw after a message
  int hidden_ = 0;                 // terminal: parts left out to fit the width (see bar_line)
  Clock::time_point last_update_;  // of the previous update, for the step time
  Clock::time_point last_draw_;
};

/// Columns of the terminal behind file descriptor `fd`; 0 if it is not a terminal.
int terminal_columns(int fd);

}  // namespace shardswap
