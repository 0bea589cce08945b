// Linked when CUDA is off: the decoder's CUDA backend, failing with a clear error. (The layout
// and cuda_bytes are inline in decoder_cuda.h, so a build without CUDA can still plan for one.)
#include "shardswap/error.h"
#include "model/decoder_cuda.h"

namespace shardswap::lm::dec {

std::unique_ptr<Compute> make_cuda_compute(const DecoderShape&, int, int, DType, void*,
                                           std::size_t, int, Precision, Attention, int, bool) {
  throw BackendUnavailable("make_cuda_compute: ShardSwap was built without CUDA");
}

Attention cuda_attention(const DecoderShape&, Attention) {
  throw BackendUnavailable("cuda_attention: ShardSwap was built without CUDA");
}

std::string cuda_attention_name(const DecoderShape&, Attention) {
  throw BackendUnavailable("cuda_attention_name: ShardSwap was built without CUDA");
}

bool cuda_apart_through_cudnn(const DecoderShape&, int, int, Attention) {
  throw BackendUnavailable("cuda_apart_through_cudnn: ShardSwap was built without CUDA");
}

std::string cuda_apart_attention_name(const DecoderShape&, int, int, Attention) {
  throw BackendUnavailable("cuda_apart_attention_name: ShardSwap was built without CUDA");
}

}  // namespace shardswap::lm::dec
