#include "trainer/progress.h"

#include <fmt/format.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "shardswap/error.h"

namespace shardswap {

namespace {

constexpr std::string_view kClearToEnd = "\x1b[K";
constexpr int kBarWidth = 24;
constexpr int kMinBarWidth = 10;

double seconds_between(ProgressReporter::Clock::time_point a,
                       ProgressReporter::Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// 950 -> "950", 12345 -> "12.3k", 4.5e6 -> "4.50M": a rate readable at a glance.
std::string compact(double v) {
  if (!std::isfinite(v)) return fmt::format("{}", v);
  const double a = std::fabs(v);
  if (a >= 1e9) return fmt::format("{:.2f}G", v / 1e9);
  if (a >= 1e6) return fmt::format("{:.2f}M", v / 1e6);
  if (a >= 1e4) return fmt::format("{:.1f}k", v / 1e3);
  return fmt::format("{:.0f}", v);
}

// Checked before any member is built from the options.
const ProgressOptions& checked(const ProgressOptions& o) {
  if (o.total_steps < 1)
    throw ConfigError(
        fmt::format("ProgressReporter: total_steps = {} must be >= 1", o.total_steps));
  if (o.interval < 1)
    throw ConfigError(fmt::format("ProgressReporter: interval = {} must be >= 1", o.interval));
  if (!(o.smoothing > 0.0 && o.smoothing <= 1.0))
    throw ConfigError(
        fmt::format("ProgressReporter: smoothing = {} must lie in (0, 1]", o.smoothing));
  return o;
}

}  // namespace

std::string format_hms(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0.0) return "-:--:--";
  // llround is undefined past the int64 range; an ETA from an absurd step time must not reach it.
  if (seconds > 1e14) return ">1e14s";
  const auto total = static_cast<std::int64_t>(std::llround(seconds));
  return fmt::format("{}:{:02}:{:02}", total / 3600, total / 60 % 60, total % 60);
}

StepTimeAverage::StepTimeAverage(double weight) : weight_(weight) {
  if (!(weight > 0.0 && weight <= 1.0))
    throw ConfigError(fmt::format("StepTimeAverage: weight {} must lie in (0, 1]", weight));
}

void StepTimeAverage::add(double seconds, std::int64_t steps) {
  if (steps < 1 || !std::isfinite(seconds) || seconds < 0.0) return;  // nothing measurable
  const double per_step = seconds / static_cast<double>(steps);
  if (!known_) {
    average_ = per_step;
    known_ = true;
    return;
  }
  // `steps` updates with the same value collapse to one with weight 1 - (1 - w)^steps.
  const double keep = std::pow(1.0 - weight_, static_cast<double>(steps));
  average_ = per_step + (average_ - per_step) * keep;
}

double StepTimeAverage::eta(std::int64_t steps_left) const {
  if (!known_) return std::numeric_limits<double>::quiet_NaN();
  return average_ * static_cast<double>(std::max<std::int64_t>(steps_left, 0));
}

ProgressReporter::ProgressReporter(std::ostream& out, ProgressOptions options,
                                   Clock::time_point start)
    : out_(out), options_(checked(options)), start_(start), step_time_(options.smoothing) {}

ProgressReporter::~ProgressReporter() {
  try {
    if (bar_on_line_) out_ << '\n' << std::flush;
  } catch (...) {  // a destructor must not throw; the stream is the caller's to check
  }
}

std::string ProgressReporter::fields(const ProgressSample& s, Clock::time_point now) const {
  return fmt::format("step {}/{}  loss {:.6g}  {} {}  memory {:.2f} MiB  eta {}  elapsed {}",
                     s.step, options_.total_steps, s.loss, options_.throughput_unit,
                     compact(s.throughput), s.memory_bytes / 1048576.0,
                     format_hms(step_time_.eta(options_.total_steps - s.step)),
                     format_hms(seconds_between(start_, now)));
}

std::string ProgressReporter::bar_line(const ProgressSample& s, Clock::time_point now) {
  const double done =
      std::clamp(static_cast<double>(s.step) / static_cast<double>(options_.total_steps), 0.0, 1.0);
  // A line wider than the terminal wraps, and "\r" then returns only to its last row: every
  // redraw would leave a stale row behind. So on a known width the bar takes a fixed share and
  // parts are left out, least useful first, then the line is cut. A part left out stays out for
  // the run: a line whose fields come and go as the loss gains a digit is harder to read.
  const int limit = options_.columns > 0 ? options_.columns - 1 : 0;  // the last column may wrap
  const int width = limit > 0 ? std::clamp(limit / 4, kMinBarWidth, kBarWidth) : kBarWidth;
  const auto filled = static_cast<int>(std::floor(done * width));
  struct Part {
    std::string text;
    int keep;  // left out once hidden_ >= keep
    const char* gap = "  ";
  };
  const Part parts[] = {
      {fmt::format("{:3.0f}%", std::floor(done * 100.0)), 9, ""},  // 99.5% is not done
      {fmt::format("[{}{}]", std::string(filled, '#'), std::string(width - filled, '.')), 4, " "},
      {fmt::format("{}/{}", s.step, options_.total_steps), 8, " "},
      {fmt::format("loss {:.5g}", s.loss), 5},
      {fmt::format("{} {}", compact(s.throughput), options_.throughput_unit), 2},
      {fmt::format("{:.2f} MiB", s.memory_bytes / 1048576.0), 1},
      {fmt::format("eta {}", format_hms(step_time_.eta(options_.total_steps - s.step))), 6},
      {fmt::format("elapsed {}", format_hms(seconds_between(start_, now))), 3}};
  std::string line;
  for (;;) {
    line.clear();
    for (const auto& p : parts)
      if (p.keep > hidden_) line += (line.empty() ? "" : p.gap) + p.text;
    if (limit == 0 || static_cast<int>(line.size()) <= limit || hidden_ >= 7) break;
    ++hidden_;
  }
  if (limit > 0 && static_cast<int>(line.size()) > limit) line.resize(limit);
  return line;
}

void ProgressReporter::draw(Clock::time_point now) {
  if (options_.terminal) {
    drawn_ = bar_line(last_, now);
    out_ << '\r' << drawn_ << kClearToEnd;
    bar_on_line_ = true;
    last_draw_ = now;
  } else {
    out_ << fields(last_, now) << '\n';
  }
  out_.flush();
  last_shown_ = true;
}

void ProgressReporter::update(const ProgressSample& sample, Clock::time_point now) {
  if (have_last_ && sample.step > last_.step)
    step_time_.add(seconds_between(last_update_, now), sample.step - last_.step);
  last_ = sample;
  last_update_ = now;
  const bool first = !have_last_;
  have_last_ = true;
  last_shown_ = false;
  const bool last_step = sample.step >= options_.total_steps;
  const bool due =
      options_.terminal
          ? first || last_step || seconds_between(last_draw_, now) >= options_.min_redraw_seconds
          : last_step || sample.step % options_.interval == 0;
  if (due) draw(now);
}

void ProgressReporter::message(std::string_view text) {
  if (!text.empty() && text.back() == '\n') text.remove_suffix(1);
  if (bar_on_line_) {
    out_ << '\r' << kClearToEnd << text << '\n' << '\r' << drawn_ << kClearToEnd;
  } else {
    out_ << text << '\n';
  }
  out_.flush();
}

void ProgressReporter::finish(Clock::time_point now) {
  if (options_.terminal) {
    if (!have_last_ || (!bar_on_line_ && last_shown_)) return;
    draw(now);
    out_ << '\n' << std::flush;
    bar_on_line_ = false;
  } else if (have_last_ && !last_shown_) {
    draw(now);
  }
}

int terminal_columns(int fd) {
  winsize size{};
  if (!isatty(fd) || ioctl(fd, TIOCGWINSZ, &size) != 0) return 0;
  return size.ws_col;
}

}  // namespace shardswap
