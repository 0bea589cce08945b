// The order in which a group's params are packed into its flat buffer (the public part of
// partition/: the layout arithmetic itself is internal).
#pragma once

namespace shardswap {

enum class LayoutOrder {
  declaration,  ///< params in the order they were declared
  round_robin,  ///< param i goes to rank bucket i % world_size; buckets concatenated in rank
                ///< order, each in declaration order (spreads consecutive grads over owners)
};

}  // namespace shardswap
