#include "shardswap/batch_sizes.h"

#include <fmt/format.h>

#include <optional>
#include <string_view>

#include "shardswap/error.h"

namespace shardswap {

namespace {

constexpr std::string_view kMicro = "train_micro_batch_size_per_gpu";
constexpr std::string_view kAccumulation = "gradient_accumulation_steps";
constexpr std::string_view kTrain = "train_batch_size";
// Bounds keep micro x accumulation x world (each below 2^20, 2^20 and 2^21) inside int64.
constexpr std::int64_t kMaxMicro = std::int64_t{1} << 20;
constexpr std::int64_t kMaxAccumulation = std::int64_t{1} << 20;
constexpr std::int64_t kMaxWorld = std::int64_t{1} << 21;
constexpr std::int64_t kMaxTrain = kMaxMicro * kMaxAccumulation * kMaxWorld;
// What Hugging Face's Trainer fills in for "auto": TrainingArguments' defaults.
constexpr std::int64_t kHfMicro = 8;         // per_device_train_batch_size
constexpr std::int64_t kHfAccumulation = 1;  // gradient_accumulation_steps

// The key's value, or nothing when it is absent or "auto" (left for the caller to warn about once
// the value it resolves to is known).
std::optional<std::int64_t> given(ConfigReader& c, std::string_view key, std::int64_t max) {
  if (!c.has(key) || c.is_auto(key)) return std::nullopt;
  const auto v = c.integer(key, 0);
  if (v < 1) c.fail(key, fmt::format("{}", v), "must be >= 1");
  if (v > max) c.fail(key, fmt::format("{}", v), fmt::format("must be <= {}", max));
  return v;
}

}  // namespace

BatchSizes resolve_batch_sizes(ConfigReader& c, int world_size) {
  if (world_size < 1 || world_size > kMaxWorld)
    c.fail("world_size", fmt::format("{}", world_size),
           fmt::format("must lie in [1, {}]", kMaxWorld));
  const std::int64_t world = world_size;
  const auto micro = given(c, kMicro, kMaxMicro);
  const auto accumulation = given(c, kAccumulation, kMaxAccumulation);
  const auto train = given(c, kTrain, kMaxTrain);

  // "auto" is what Hugging Face's Trainer fills in: its defaults, except where a given
  // train_batch_size determines the value (DeepSpeed's arithmetic below): a Trainer run of the
  // file had that value, or the Trainer would have refused the file for the mismatch.
  std::int64_t m = micro.value_or(c.is_auto(kMicro) ? kHfMicro : 32);
  std::int64_t a = accumulation.value_or(kHfAccumulation), t = 0;
  if (train && micro && accumulation) {
    t = *train;
    if (t != m * a * world)
      c.fail(kTrain, fmt::format("{}", t),
             fmt::format("but {} x {} x world size = {} x {} x {} = {}", kMicro, kAccumulation, m,
                         a, world, m * a * world));
  } else if (train && micro) {
    t = *train;
    if (t % (m * world) != 0)
      c.fail(kTrain, fmt::format("{}", t),
             fmt::format("not a multiple of {} x world size = {} x {} = {}, so {} "
                         "= {} / {} is not a whole number",
                         kMicro, m, world, m * world, kAccumulation, t, m * world));
    a = t / (m * world);
    if (a > kMaxAccumulation)
      c.fail(kTrain, fmt::format("{}", t),
             fmt::format("gives {} = {} / {} = {}, more than {}", kAccumulation, t, m * world, a,
                         kMaxAccumulation));
  } else if (train) {
    // With or without the accumulation (then 1), the micro batch is what is left per rank.
    t = *train;
    if (t % (a * world) != 0) {
      if (accumulation)
        c.fail(kTrain, fmt::format("{}", t),
               fmt::format("not a multiple of {} x world size = {} x {} = {}, so "
                           "{} = {} / {} is not a whole number",
                           kAccumulation, a, world, a * world, kMicro, t, a * world));
      c.fail(kTrain, fmt::format("{}", t),
             fmt::format("not a multiple of the world size {}, so {} = {} / {} is "
                         "not a whole number",
                         world, kMicro, t, world));
    }
    m = t / (a * world);
    if (m > kMaxMicro)
      c.fail(
          kTrain, fmt::format("{}", t),
          fmt::format("gives {} = {} / {} = {}, more than {}", kMicro, t, a * world, m, kMaxMicro));
  } else {
    t = m * a * world;
  }

  // "auto" keys count as read and get one warning each, now that their values are known.
  const auto resolved = [&](std::string_view key, std::int64_t value, std::string why) {
    if (!c.is_auto(key)) return;
    c.resolve_auto(std::string(key), value, std::move(why));
    c.integer(key, value);  // marks it read and records the warning
  };
  const bool derived_accumulation = train && micro && !accumulation;
  const bool derived_micro = train && !micro;
  const auto trainer_default = [](std::string_view argument) {
    return fmt::format("(Hugging Face's Trainer default: TrainingArguments.{})", argument);
  };
  resolved(kMicro, m,
           derived_micro ? fmt::format("= {} / ({} x world size {})", t, a, world)
                         : trainer_default("per_device_train_batch_size"));
  resolved(kAccumulation, a,
           derived_accumulation ? fmt::format("= {} / ({} x world size {})", t, m, world)
                                : trainer_default("gradient_accumulation_steps"));
  resolved(
      kTrain, t,
      fmt::format("= {} x {} x world size {}, as Hugging Face's Trainer computes it", m, a, world));
  return BatchSizes{static_cast<int>(m), static_cast<int>(a), t};
}

}  // namespace shardswap
