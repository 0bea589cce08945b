// The training progress reporter: plain lines for logs, one redrawn line on a terminal, messages
// above the bar, and an ETA from a smoothed step time.
#include <chrono>
#include <cmath>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "shardswap/error.h"
#include "tests/catch_compat.h"
#include "trainer/progress.h"

using namespace shardswap;
using Clock = ProgressReporter::Clock;
using std::chrono::milliseconds;

namespace {

// Loss, rate and memory of step `step` in these tests: all differ from step to step.
ProgressSample sample(std::int64_t step) {
  return {step, 2.0 / static_cast<double>(step), 1000.0 * static_cast<double>(step) + 345.0,
          step * 1048576 + 524288};
}

std::size_t count(const std::string& text, const std::string& part) {
  std::size_t n = 0;
  for (auto at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) ++n;
  return n;
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

}  // namespace

TEST_CASE("plain mode prints exactly one line per interval and at the last step") {
  std::ostringstream out;
  const auto t0 = Clock::time_point{};
  ProgressReporter progress(out, {.total_steps = 25, .terminal = false, .interval = 10}, t0);
  for (int step = 1; step <= 25; ++step)
    progress.update(sample(step), t0 + milliseconds(500 * step));
  progress.finish(t0 + milliseconds(12600));
  // 0.5 s a step, timed from step 1: ETA after step 10 = 15 x 0.5 = 7.5 s, rounded to 8.
  REQUIRE(
      out.str() ==
      "step 10/25  loss 0.2  tokens/s 10.3k  memory 10.50 MiB  eta 0:00:08  elapsed 0:00:05\n"
      "step 20/25  loss 0.1  tokens/s 20.3k  memory 20.50 MiB  eta 0:00:03  elapsed 0:00:10\n"
      "step 25/25  loss 0.08  tokens/s 25.3k  memory 25.50 MiB  eta 0:00:00  elapsed 0:00:13\n");
}

TEST_CASE("plain mode holds no control characters, messages included") {
  std::ostringstream out;
  const auto t0 = Clock::time_point{};
  ProgressReporter progress(out, {.total_steps = 30, .terminal = false, .interval = 7}, t0);
  for (int step = 1; step <= 30; ++step) {
    progress.update(sample(step), t0 + milliseconds(40 * step));
    if (step == 12) progress.message("switch at step 12: in [layers.3] out [layers.1]");
  }
  progress.finish(t0 + milliseconds(1300));
  const auto lines = lines_of(out.str());
  REQUIRE(lines.size() == 6);  // steps 7, 14, 21, 28, 30 and the message
  REQUIRE(lines[1] == "switch at step 12: in [layers.3] out [layers.1]");
  for (char c : out.str()) REQUIRE((c == '\n' || (c >= 0x20 && c < 0x7f)));
}

TEST_CASE("plain mode's finish prints the last step of a run that stopped early") {
  std::ostringstream out;
  const auto t0 = Clock::time_point{};
  ProgressReporter progress(out, {.total_steps = 100, .terminal = false, .interval = 10}, t0);
  for (int step = 1; step <= 13; ++step)
    progress.update(sample(step), t0 + milliseconds(1000 * step));
  progress.finish(t0 + milliseconds(13000));
  progress.finish(t0 + milliseconds(14000));  // a second finish adds nothing
  const auto lines = lines_of(out.str());
  REQUIRE(lines.size() == 2);
  REQUIRE(lines[1] ==
          "step 13/100  loss 0.153846  tokens/s 13.3k  memory 13.50 MiB  eta 0:01:27  "
          "elapsed 0:00:13");
}

TEST_CASE("terminal mode redraws one line in place with a bar and the ETA") {
  std::ostringstream out;
  const auto t0 = Clock::time_point{};
  ProgressReporter progress(out, {.total_steps = 10, .terminal = true}, t0);
  for (int step = 1; step <= 5; ++step)
    progress.update(sample(step), t0 + milliseconds(2000 * step));
  const std::string drawn = out.str();
  REQUIRE(drawn.find('\n') == std::string::npos);
  REQUIRE(count(drawn, "\r") == 5);  // 2 s apart: every update is drawn
  REQUIRE(count(drawn, "\x1b[K") == 5);
  // The last draw: half done, 2 s a step, 5 steps left.
  const std::string last = drawn.substr(drawn.rfind('\r'));
  REQUIRE(last ==
          "\r 50% [############............] 5/10  loss 0.4  5345 tokens/s  5.50 MiB  eta 0:00:10  "
          "elapsed 0:00:10\x1b[K");

  progress.update(sample(10), t0 + milliseconds(20000));
  progress.finish(t0 + milliseconds(20500));
  const std::string all = out.str();
  REQUIRE(all.back() == '\n');
  REQUIRE(count(all, "\n") == 1);
  REQUIRE(test::contains(all.substr(all.rfind('\r')), "100% [########################] 10/10"));
  REQUIRE(test::contains(all.substr(all.rfind('\r')), "eta 0:00:00  elapsed 0:00:21"));
}

TEST_CASE("terminal mode redraws at most every min_redraw_seconds, and always the last step") {
  std::ostringstream out;
  const auto t0 = Clock::time_point{};
  ProgressReporter progress(out, {.total_steps = 400, .terminal = true, .min_redraw_seconds = 0.1},
                            t0);
  // 30 ms a step: drawn at step 1, then 120 ms later (steps 5, 9, ..., 397), then step 400.
  for (int step = 1; step <= 400; ++step)
    progress.update(sample(step), t0 + milliseconds(30 * step));
  REQUIRE(count(out.str(), "\r") == 1 + 99 + 1);
  REQUIRE(test::contains(out.str().substr(out.str().rfind('\r')), " 400/400 "));
}

TEST_CASE("terminal mode prints a message on its own line and redraws the bar below it") {
  std::ostringstream out;
  const auto t0 = Clock::time_point{};
  ProgressReporter progress(out, {.total_steps = 8, .terminal = true}, t0);
  progress.update(sample(1), t0 + milliseconds(1000));
  progress.update(sample(2), t0 + milliseconds(2000));
  const std::string bar = out.str().substr(out.str().rfind('\r'));
  progress.message("eval at step 2: val_loss 0.731\n");
  progress.update(sample(3), t0 + milliseconds(3000));
  progress.finish(t0 + milliseconds(3000));

  const auto lines = lines_of(out.str());
  REQUIRE(lines.size() == 2);
  // The bar is cleared before the message, so what the terminal shows on that row is the message.
  REQUIRE(test::contains(lines[0], "\r\x1b[Keval at step 2: val_loss 0.731"));
  REQUIRE(lines[0].substr(lines[0].rfind('\r')) == "\r\x1b[Keval at step 2: val_loss 0.731");
  // Below it the bar is back, then the next update redraws it.
  REQUIRE(lines[1].starts_with(bar + "\r 37% ["));  // 3/8 = 37.5%, rounded down
  REQUIRE(test::contains(lines[1], " 3/8 "));
}

TEST_CASE("a message before any bar is a plain line") {
  std::ostringstream out;
  ProgressReporter progress(out, {.total_steps = 8, .terminal = true});
  progress.message("layer switching: lisa every 20 steps");
  REQUIRE(out.str() == "layer switching: lisa every 20 steps\n");
}

TEST_CASE("a bar left on its line is ended when the reporter goes away") {
  std::ostringstream out;
  {
    const auto t0 = Clock::time_point{};
    ProgressReporter progress(out, {.total_steps = 8, .terminal = true}, t0);
    progress.update(sample(3), t0 + milliseconds(10));
  }  // e.g. an exception unwinds the training loop: the error must start on a new line
  REQUIRE(out.str().back() == '\n');
  REQUIRE(count(out.str(), "\n") == 1);
}

TEST_CASE("a narrow terminal loses the least useful parts first, and the line never wraps") {
  for (int columns : {200, 120, 100, 80, 60, 30}) {
    std::ostringstream out;
    const auto t0 = Clock::time_point{};
    ProgressReporter progress(out, {.total_steps = 12345, .terminal = true, .columns = columns},
                              t0);
    progress.update(sample(1234), t0 + milliseconds(1000));
    progress.update(sample(1235), t0 + milliseconds(2000));
    const std::string last = out.str().substr(out.str().rfind('\r') + 1);
    const std::string visible = last.substr(0, last.size() - 3);  // without "\x1b[K"
    CAPTURE(columns, visible);
    REQUIRE(static_cast<int>(visible.size()) <= columns - 1);
    REQUIRE(visible.starts_with(" 10% "));
    REQUIRE(test::contains(visible, "1235/12345"));
    REQUIRE(test::contains(visible, "eta 3:05:10"));  // 1 s a step, 11110 steps left
    if (columns >= 120) {
      REQUIRE(test::contains(visible, "["));
      REQUIRE(test::contains(visible, "1235.50 MiB"));
      REQUIRE(test::contains(visible, "elapsed 0:00:02"));
    }
    if (columns <= 80) REQUIRE_FALSE(test::contains(visible, "MiB"));  // memory goes first
  }
}

TEST_CASE("a part left out to fit the terminal stays out, so the line does not flicker") {
  std::ostringstream out;
  const auto t0 = Clock::time_point{};
  ProgressReporter progress(out, {.total_steps = 10, .terminal = true, .columns = 100}, t0);
  // 113 columns with every part: the memory is left out.
  progress.update({1, 1.2345678e-05, 1.5e6, std::int64_t{81234} * 1048576}, t0 + milliseconds(500));
  REQUIRE_FALSE(test::contains(out.str(), "MiB"));
  REQUIRE(test::contains(out.str(), "1.50M tokens/s"));
  // Every part would fit now (96 columns); the memory still stays out.
  progress.update({2, 2.0, 5.0, 0}, t0 + milliseconds(1000));
  const std::string last = out.str().substr(out.str().rfind('\r'));
  REQUIRE(test::contains(last, "loss 2  5 tokens/s  eta"));
  REQUIRE_FALSE(test::contains(last, "MiB"));
}

TEST_CASE("format_hms writes h:mm:ss rounded to the second, and a placeholder when unknown") {
  REQUIRE(format_hms(0.0) == "0:00:00");
  REQUIRE(format_hms(59.4) == "0:00:59");
  REQUIRE(format_hms(59.5) == "0:01:00");
  REQUIRE(format_hms(3599.6) == "1:00:00");
  REQUIRE(format_hms(25 * 3600 + 61) == "25:01:01");
  REQUIRE(format_hms(-1.0) == "-:--:--");
  REQUIRE(format_hms(std::nan("")) == "-:--:--");
  REQUIRE(format_hms(HUGE_VAL) == "-:--:--");
  REQUIRE(format_hms(1e300) == ">1e14s");  // no int64 overflow
}

TEST_CASE("the step time average matches a step-by-step float64 moving average on random data") {
  std::mt19937_64 rng(11);
  std::uniform_real_distribution<double> seconds(0.01, 3.0);
  std::uniform_int_distribution<int> steps(1, 9);
  const double w = 0.07;
  StepTimeAverage average(w);
  REQUIRE_FALSE(average.known());
  REQUIRE(std::isnan(average.eta(10)));
  double reference = 0.0;
  bool first = true;
  for (int i = 0; i < 200; ++i) {
    const int n = steps(rng);
    const double total = seconds(rng) * n;
    average.add(total, n);
    // The reference feeds the n steps one at a time, each taking total / n.
    for (int k = 0; k < n; ++k) {
      reference = first ? total / n : w * (total / n) + (1.0 - w) * reference;
      first = false;
    }
    REQUIRE(average.seconds_per_step() == Approx(reference).epsilon(1e-12));
  }
  REQUIRE(average.eta(1234) == Approx(1234 * reference).epsilon(1e-12));
  REQUIRE(average.eta(-5) == 0.0);
}

TEST_CASE("the ETA follows a change of pace within a few dozen steps") {
  std::ostringstream out;
  const auto t0 = Clock::time_point{};
  ProgressReporter progress(out, {.total_steps = 1000, .terminal = false, .interval = 100}, t0);
  auto now = t0;
  for (int step = 1; step <= 100; ++step) progress.update(sample(step), now += milliseconds(100));
  // 0.1 s a step, 900 steps left.
  REQUIRE(test::contains(out.str(), "eta 0:01:30"));
  for (int step = 101; step <= 200; ++step)
    progress.update(sample(step), now += milliseconds(1000));
  // Now 1 s a step: after 100 steps at weight 0.05 the average is 1 - 0.9 x 0.95^100 = 0.99467 s;
  // x 800 steps left = 795.7 s = 0:13:16.
  REQUIRE(test::contains(lines_of(out.str()).back(), "eta 0:13:16"));
}

TEST_CASE("the reporter refuses options that cannot work, naming them") {
  std::ostringstream out;
  REQUIRE(test::contains(
      test::message_of<ConfigError>([&] { ProgressReporter p(out, {.total_steps = 0}); }),
      "total_steps"));
  REQUIRE(test::contains(test::message_of<ConfigError>(
                             [&] { ProgressReporter p(out, {.total_steps = 5, .interval = 0}); }),
                         "interval"));
  REQUIRE(test::contains(test::message_of<ConfigError>([&] {
                           ProgressReporter p(out, {.total_steps = 5, .smoothing = 1.5});
                         }),
                         "smoothing"));
}

TEST_CASE("the throughput is shown in the unit the caller names") {
  std::ostringstream plain, terminal;
  const auto t0 = Clock::time_point{};
  ProgressReporter a(plain, {.total_steps = 2, .terminal = false, .throughput_unit = "samples/s"},
                     t0);
  ProgressReporter b(terminal, {.total_steps = 2, .terminal = true, .throughput_unit = "samples/s"},
                     t0);
  for (auto* p : {&a, &b}) p->update({2, 0.5, 2345.0, 1048576}, t0 + milliseconds(100));
  REQUIRE(test::contains(plain.str(), "  samples/s 2345  "));
  REQUIRE(test::contains(terminal.str(), "  2345 samples/s  "));
  REQUIRE_FALSE(test::contains(plain.str() + terminal.str(), "tokens"));
}
