// Linked when the build has no cuDNN (SHARDSWAP_CUDNN off or cuDNN 9 not found, or no CUDA):
// the decoder runs its own attention kernels and plans no cuDNN regions; CudnnAttention fails
// with a clear error.
#include <string>

#include "shardswap/error.h"
#include "model/cudnn_attention.h"

namespace shardswap::lm::dec {

namespace {
[[noreturn]] void unavailable(const char* call) {
  throw BackendUnavailable(std::string("CudnnAttention::") + call +
                           ": ShardSwap was built without cuDNN (SHARDSWAP_CUDNN)");
}
}  // namespace

bool cudnn_attention_available() {
  return false;
}

struct CudnnAttention::Impl {};

CudnnAttention::CudnnAttention(void*, std::size_t) {
  unavailable("CudnnAttention");
}
CudnnAttention::~CudnnAttention() = default;
std::size_t CudnnAttention::prepare(const AttentionShape&) {
  unavailable("prepare");
}
void CudnnAttention::forward(const AttentionShape&, const AttentionForward&) {
  unavailable("forward");
}
void CudnnAttention::backward(const AttentionShape&, const AttentionBackward&) {
  unavailable("backward");
}
long CudnnAttention::version() {
  unavailable("version");
}

}  // namespace shardswap::lm::dec
