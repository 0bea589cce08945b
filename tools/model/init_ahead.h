// The decoder's random initial values (Decoder::init) drawn ahead of the engine's requests, on
// several threads: one core draws a value in 20-60 ns, minutes for a 7B model's 7.6B values. Each
// param keeps its own generator, so the values are Decoder::init's whatever the thread count.
#pragma once

#include <cstdint>
#include <future>
#include <map>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "shardswap/engine.h"
#include "model/decoder.h"

namespace shardswap {

class InitAhead {
 public:
  /// Up to `threads` params drawn at once (their fp32 values held until asked for).
  InitAhead(const DecoderShape& shape, std::uint64_t seed, int threads);
  InitAhead(const InitAhead&) = delete;
  InitAhead& operator=(const InitAhead&) = delete;
  ~InitAhead();  // waits for the draws in flight

  /// Decoder::init's values of `param` into `values`. Thread-safe; the params after it in
  /// declaration order (the engine's build order) start drawing meanwhile. Throws as
  /// Decoder::init (ConfigError for a name that is not a param of the decoder).
  void fill(const ParamInfo& param, std::span<float> values);

 private:
  std::vector<float> draw(std::size_t index) const;
  void launch_ahead();  // with mutex_ held

  DecoderShape shape_;
  std::uint64_t seed_;
  std::size_t threads_;
  std::vector<ParamInfo> order_;                // declaration order
  std::map<std::string, std::size_t> index_;    // name -> place in order_
  std::mutex mutex_;
  std::size_t next_ = 0;                        // the next param to start drawing
  std::map<std::size_t, std::future<std::vector<float>>> in_flight_;
};

}  // namespace shardswap
