#include "model/init_ahead.h"

#include <algorithm>

#include "shardswap/error.h"

namespace shardswap {

InitAhead::InitAhead(const DecoderShape& shape, std::uint64_t seed, int threads)
    : shape_(shape), seed_(seed), threads_(static_cast<std::size_t>(std::max(threads, 1))) {
  for (const DecoderParam& p : decoder_params(shape)) {
    std::int64_t numel = 1;
    for (const auto x : p.shape) numel *= x;
    index_.emplace(p.name, order_.size());
    order_.push_back(ParamInfo{p.name, p.shape, numel, p.group});
  }
}

InitAhead::~InitAhead() {
  for (auto& [index, values] : in_flight_) values.wait();
}

std::vector<float> InitAhead::draw(std::size_t index) const {
  const ParamInfo& p = order_[index];
  std::vector<float> values(static_cast<std::size_t>(p.numel));
  Decoder::init(shape_, p, values, seed_);
  return values;
}

void InitAhead::launch_ahead() {
  while (in_flight_.size() < threads_ && next_ < order_.size()) {
    const std::size_t i = next_++;
    in_flight_.emplace(i, std::async(std::launch::async, [this, i] { return draw(i); }));
  }
}

void InitAhead::fill(const ParamInfo& param, std::span<float> values) {
  std::future<std::vector<float>> drawn;
  {
    std::lock_guard lock(mutex_);
    const auto found = index_.find(param.name);
    if (found == index_.end()) {  // Decoder::init names what is wrong
      Decoder::init(shape_, param, values, seed_);
      return;
    }
    const std::size_t index = found->second;
    const auto numel = static_cast<std::size_t>(order_[index].numel);
    if (values.size() != numel)
      throw ConfigError("InitAhead: '" + param.name + "' has " + std::to_string(values.size()) +
                        " values, the decoder's shape " + std::to_string(numel));
    if (const auto f = in_flight_.find(index); f != in_flight_.end()) {
      drawn = std::move(f->second);
      in_flight_.erase(f);
    } else if (index >= next_) {
      next_ = index + 1;  // drawn below, on this thread; the ones after it ahead
    }
    launch_ahead();
  }
  if (!drawn.valid()) {  // not drawn ahead: straight into values
    Decoder::init(shape_, param, values, seed_);
    return;
  }
  const std::vector<float> v = drawn.get();
  std::copy(v.begin(), v.end(), values.begin());
}

}  // namespace shardswap
