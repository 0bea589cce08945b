// Causal GQA attention as two cuDNN backend operation graphs, the pattern cuDNN's runtime-fusion
// engines recognize as flash attention (the one cuDNN's own frontend expresses):
//   forward:  S = Q K^T scale; causal mask (GEN_INDEX rows, cols, CMP_GE, BINARY_SELECT -inf);
//             M = max S, Z = sum exp(S - M), lse = M + log Z, O = (exp(S - M) / Z) V
//   backward: delta = rowsum(dO * O); P = exp(mask(Q K^T scale - lse));
//             dV = P^T dO, dS = P (dO V^T - delta) scale, dK = dS^T Q, dQ = dS K
// with GQA as a broadcast of K and V over each group and dK, dV summed over it. S and P are never
// stored: only the inputs, outputs, lse, delta and the fp32 dQ accumulator are real tensors.
// Plans are built once per shape; the workspace is the caller's.
#include "model/cudnn_attention.h"

#include <cuda_runtime.h>
#include <cudnn.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <deque>
#include <initializer_list>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "shardswap/error.h"
#include "support/cuda_check.h"

namespace shardswap::lm::dec {
namespace {

std::string status_text(cudnnStatus_t status) {
  std::string text = cudnnGetErrorString(status);
  char last[512] = {};
  cudnnGetLastErrorString(last, sizeof(last));
  if (last[0] != '\0') text += std::string(": ") + last;
  return text;
}

void check(cudnnStatus_t status, const char* what) {
  if (status != CUDNN_STATUS_SUCCESS)
    throw DeviceError(std::string("CudnnAttention: ") + what + " failed: " + status_text(status));
}

// An owned backend descriptor (not copyable); the destructor never throws.
class Desc {
 public:
  explicit Desc(cudnnBackendDescriptorType_t type) {
    check(cudnnBackendCreateDescriptor(type, &d_), "cudnnBackendCreateDescriptor");
  }
  ~Desc() {
    if (d_ != nullptr) cudnnBackendDestroyDescriptor(d_);
  }
  Desc(Desc&& o) noexcept : d_(std::exchange(o.d_, nullptr)) {}
  Desc& operator=(Desc&& o) noexcept {
    std::swap(d_, o.d_);
    return *this;
  }
  Desc(const Desc&) = delete;
  Desc& operator=(const Desc&) = delete;

  template <class T>
  Desc& set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, const T* values,
            std::int64_t count) {
    check(cudnnBackendSetAttribute(d_, name, type, count, values), "cudnnBackendSetAttribute");
    return *this;
  }
  template <class T>
  Desc& set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, const T& value) {
    return set(name, type, &value, 1);
  }
  Desc& desc(cudnnBackendAttributeName_t name, cudnnBackendDescriptor_t value) {
    return set(name, CUDNN_TYPE_BACKEND_DESCRIPTOR, value);
  }
  void finalize(const char* what) { check(cudnnBackendFinalize(d_), what); }
  cudnnBackendDescriptor_t get() const { return d_; }

 private:
  cudnnBackendDescriptor_t d_ = nullptr;
};

using Dims = std::array<std::int64_t, 4>;
constexpr cudnnDataType_t f32 = CUDNN_DATA_FLOAT;

// An operation graph under construction: it owns every descriptor its operations refer to.
class GraphBuilder {
 public:
  // A real tensor (uid < kFirstVirtual, a variant pack entry) or a virtual one (the next uid).
  cudnnBackendDescriptor_t tensor(std::int64_t uid, cudnnDataType_t type, Dims dims, Dims strides,
                                  bool by_value = false) {
    return make(uid, type, dims, strides, false, by_value);
  }
  cudnnBackendDescriptor_t virt(cudnnDataType_t type, Dims dims, Dims strides) {
    return make(next_virtual_++, type, dims, strides, true, false);
  }

  void pointwise(cudnnPointwiseMode_t mode, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t b,
                 cudnnBackendDescriptor_t y, cudnnBackendDescriptor_t t = nullptr,
                 cudnnDataType_t math = f32, std::int64_t axis = -1) {
    Desc pw(CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
    pw.set(CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, mode);
    pw.set(CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, math);
    if (axis >= 0) pw.set(CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, axis);
    pw.finalize("pointwise descriptor");
    Desc op(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
    op.desc(CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, pw.get());
    op.desc(CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x);
    if (b != nullptr) op.desc(CUDNN_ATTR_OPERATION_POINTWISE_BDESC, b);
    if (t != nullptr) op.desc(CUDNN_ATTR_OPERATION_POINTWISE_TDESC, t);
    op.desc(CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y);
    op.finalize("pointwise operation");
    keep_.push_back(std::move(pw));
    ops_.push_back(std::move(op));
  }
  void matmul(cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t c) {
    Desc mm(CUDNN_BACKEND_MATMUL_DESCRIPTOR);
    mm.set(CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, f32);
    mm.finalize("matmul descriptor");
    Desc op(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR);
    op.desc(CUDNN_ATTR_OPERATION_MATMUL_ADESC, a);
    op.desc(CUDNN_ATTR_OPERATION_MATMUL_BDESC, b);
    op.desc(CUDNN_ATTR_OPERATION_MATMUL_CDESC, c);
    op.desc(CUDNN_ATTR_OPERATION_MATMUL_DESC, mm.get());
    op.finalize("matmul operation");
    keep_.push_back(std::move(mm));
    ops_.push_back(std::move(op));
  }
  void reduction(cudnnReduceTensorOp_t mode, cudnnBackendDescriptor_t x,
                 cudnnBackendDescriptor_t y) {
    Desc red(CUDNN_BACKEND_REDUCTION_DESCRIPTOR);
    red.set(CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, mode);
    red.set(CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, f32);
    red.finalize("reduction descriptor");
    Desc op(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR);
    op.desc(CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x);
    op.desc(CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y);
    op.desc(CUDNN_ATTR_OPERATION_REDUCTION_DESC, red.get());
    op.finalize("reduction operation");
    keep_.push_back(std::move(red));
    ops_.push_back(std::move(op));
  }
  void reshape(cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
    Desc op(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR);
    op.desc(CUDNN_ATTR_OPERATION_RESHAPE_XDESC, x);
    op.desc(CUDNN_ATTR_OPERATION_RESHAPE_YDESC, y);
    op.finalize("reshape operation");
    ops_.push_back(std::move(op));
  }
  // The causal mask of scores x [B, H, Tq, Tk]: x where row >= col, else -inf (uid neg_inf).
  cudnnBackendDescriptor_t causal(cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t neg_inf,
                                  Dims dims, Dims strides) {
    auto row = virt(CUDNN_DATA_INT32, dims, strides), col = virt(CUDNN_DATA_INT32, dims, strides);
    pointwise(CUDNN_POINTWISE_GEN_INDEX, x, nullptr, row, nullptr, f32, 2);
    pointwise(CUDNN_POINTWISE_GEN_INDEX, x, nullptr, col, nullptr, f32, 3);
    auto keep = virt(CUDNN_DATA_BOOLEAN, dims, strides);
    pointwise(CUDNN_POINTWISE_CMP_GE, row, col, keep, nullptr, CUDNN_DATA_BOOLEAN);
    auto y = virt(f32, dims, strides);
    pointwise(CUDNN_POINTWISE_BINARY_SELECT, x, neg_inf, y, keep);
    return y;
  }

  // The finalized operation graph on `handle`.
  Desc finish(cudnnHandle_t handle) {
    std::vector<cudnnBackendDescriptor_t> ops;
    for (const Desc& op : ops_) ops.push_back(op.get());
    Desc graph(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
    graph.set(CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, handle);
    graph.set(CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, ops.data(),
              static_cast<std::int64_t>(ops.size()));
    graph.finalize("operation graph");
    return graph;
  }

 private:
  static constexpr std::int64_t kFirstVirtual = 100;
  cudnnBackendDescriptor_t make(std::int64_t uid, cudnnDataType_t type, Dims dims, Dims strides,
                                bool is_virtual, bool by_value) {
    const std::int64_t alignment = 16;
    Desc t(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
    t.set(CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, type);
    t.set(CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, dims.data(), 4);
    t.set(CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, strides.data(), 4);
    t.set(CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, uid);
    t.set(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, alignment);
    t.set(CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, is_virtual);
    if (by_value) t.set(CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, true);
    t.finalize("tensor descriptor");
    const cudnnBackendDescriptor_t raw = t.get();
    keep_.push_back(std::move(t));
    return raw;
  }

  std::int64_t next_virtual_ = kFirstVirtual;
  std::vector<Desc> keep_, ops_;
};

// uids of the real tensors (variant pack entries).
enum Uid : std::int64_t {
  kQ = 1,
  kK,
  kV,
  kO,
  kLse,
  kScale,
  kNegInf,
  kDout,
  kDq,
  kDk,
  kDv,
  kDelta,
  kDq32,
  kOne
};

cudnnDataType_t cudnn_type(DType t) {
  return t == DType::bf16 ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_HALF;
}

std::string describe(const AttentionShape& s) {
  return std::to_string(s.sequences) + " x " + std::to_string(s.seq_len) + " tokens, " +
         std::to_string(s.heads) + " heads, " + std::to_string(s.kv_heads) +
         " kv heads, head_dim " + std::to_string(s.head_dim) + ", " + dtype_name(s.dtype) +
         (s.deterministic ? ", deterministic" : "");
}

// The common tensors: q [B, H, T, d] (rows q_ld apart), k^T and v as [B, K, d, T] / [B, K, T, d].
struct Sizes {
  std::int64_t b, h, hk, t, d, q_ld, kv_ld, g_ld;
  explicit Sizes(const AttentionShape& s)
      : b(s.sequences),
        h(s.heads),
        hk(s.kv_heads),
        t(s.seq_len),
        d(s.head_dim),
        q_ld(s.q_ld),
        kv_ld(s.kv_ld),
        g_ld(s.grad_ld) {}
  Dims q_dims() const { return {b, h, t, d}; }
  Dims q_strides(std::int64_t ld) const { return {t * ld, d, ld, 1}; }
  Dims kv_dims() const { return {b, hk, t, d}; }
  Dims kv_strides(std::int64_t ld) const { return {t * ld, d, ld, 1}; }
  Dims kv_t_dims() const { return {b, hk, d, t}; }
  Dims kv_t_strides() const { return {t * kv_ld, d, 1, kv_ld}; }
  Dims scores() const { return {b, h, t, t}; }
  Dims scores_strides() const { return {h * t * t, t * t, t, 1}; }
  Dims scores_t_strides() const { return {h * t * t, t * t, 1, t}; }  // P^T over the same memory
  Dims rows() const { return {b, h, t, 1}; }
  Dims rows_strides() const { return {h * t, t, 1, 1}; }
};

constexpr Dims kScalar{1, 1, 1, 1};

Desc forward_graph(cudnnHandle_t handle, const AttentionShape& s) {
  const Sizes z(s);
  const cudnnDataType_t io = cudnn_type(s.dtype);
  GraphBuilder g;
  auto q = g.tensor(kQ, io, z.q_dims(), z.q_strides(z.q_ld));
  auto kt = g.tensor(kK, io, z.kv_t_dims(), z.kv_t_strides());
  auto v = g.tensor(kV, io, z.kv_dims(), z.kv_strides(z.kv_ld));
  auto o = g.tensor(kO, io, z.q_dims(), z.q_strides(z.q_ld));
  auto lse = g.tensor(kLse, f32, z.rows(), z.rows_strides());
  auto scale = g.tensor(kScale, f32, kScalar, kScalar, true);
  auto neg_inf = g.tensor(kNegInf, f32, kScalar, kScalar, true);
  const Dims sd = z.scores(), ss = z.scores_strides();
  auto s0 = g.virt(f32, sd, ss);
  g.matmul(q, kt, s0);
  auto s1 = g.virt(f32, sd, ss);
  g.pointwise(CUDNN_POINTWISE_MUL, s0, scale, s1);
  auto s2 = g.causal(s1, neg_inf, sd, ss);
  auto m = g.virt(f32, z.rows(), z.rows_strides());
  g.reduction(CUDNN_REDUCE_TENSOR_MAX, s2, m);
  auto s3 = g.virt(f32, sd, ss);
  g.pointwise(CUDNN_POINTWISE_SUB, s2, m, s3);
  auto e = g.virt(f32, sd, ss);
  g.pointwise(CUDNN_POINTWISE_EXP, s3, nullptr, e);
  auto sum = g.virt(f32, z.rows(), z.rows_strides());
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, e, sum);
  auto log_sum = g.virt(f32, z.rows(), z.rows_strides());
  g.pointwise(CUDNN_POINTWISE_LOG, sum, nullptr, log_sum);
  g.pointwise(CUDNN_POINTWISE_ADD, m, log_sum, lse);
  // Both operands of a fused matmul have one type: the probabilities are rounded to q's.
  auto p = g.virt(io, sd, ss);
  g.pointwise(CUDNN_POINTWISE_DIV, e, sum, p);
  g.matmul(p, v, o);
  return g.finish(handle);
}

Desc backward_graph(cudnnHandle_t handle, const AttentionShape& s) {
  const Sizes z(s);
  const cudnnDataType_t io = cudnn_type(s.dtype);
  GraphBuilder g;
  auto q = g.tensor(kQ, io, z.q_dims(), z.q_strides(z.q_ld));
  auto kt = g.tensor(kK, io, z.kv_t_dims(), z.kv_t_strides());
  auto vt = g.tensor(kV, io, z.kv_t_dims(), z.kv_t_strides());
  auto o = g.tensor(kO, io, z.q_dims(), z.q_strides(z.q_ld));
  auto dout = g.tensor(kDout, io, z.q_dims(), z.q_strides(z.q_ld));
  auto lse = g.tensor(kLse, f32, z.rows(), z.rows_strides());
  auto scale = g.tensor(kScale, f32, kScalar, kScalar, true);
  auto neg_inf = g.tensor(kNegInf, f32, kScalar, kScalar, true);
  auto one = g.tensor(kOne, f32, kScalar, kScalar, true);
  auto dq = g.tensor(kDq, io, z.q_dims(), z.q_strides(z.g_ld));
  auto dk = g.tensor(kDk, io, z.kv_dims(), z.kv_strides(z.g_ld));
  auto dv = g.tensor(kDv, io, z.kv_dims(), z.kv_strides(z.g_ld));
  auto delta = g.tensor(kDelta, f32, z.rows(), z.rows_strides());
  const Dims sd = z.scores(), ss = z.scores_strides(), st = z.scores_t_strides();
  // delta = rowsum(dout * o)
  auto dout_o = g.virt(f32, z.q_dims(), {z.h * z.t * z.d, z.t * z.d, z.h * z.d, 1});
  g.pointwise(CUDNN_POINTWISE_MUL, dout, o, dout_o);
  auto row_sum = g.virt(f32, z.rows(), z.rows_strides());
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, dout_o, row_sum);
  g.pointwise(CUDNN_POINTWISE_MUL, row_sum, one, delta);
  // P = exp(mask(q k^T scale - lse))
  auto s0 = g.virt(f32, sd, ss);
  g.matmul(q, kt, s0);
  auto s1 = g.virt(f32, sd, ss);
  g.pointwise(CUDNN_POINTWISE_MUL, s0, scale, s1);
  auto s2 = g.virt(f32, sd, ss);
  g.pointwise(CUDNN_POINTWISE_SUB, s1, lse, s2);
  auto s3 = g.causal(s2, neg_inf, sd, ss);
  auto p = g.virt(f32, sd, ss);
  g.pointwise(CUDNN_POINTWISE_EXP, s3, nullptr, p);
  // dV = P^T dout, summed over the group when kv heads are shared.
  const bool grouped = z.h != z.hk;
  const Dims full_dims{z.b, z.h, z.t, z.d}, full_strides{z.h * z.t * z.d, z.t * z.d, z.d, 1};
  auto pt = g.virt(io, sd, st);
  g.reshape(p, pt);
  if (grouped) {
    auto dv_full = g.virt(io, full_dims, full_strides);
    g.matmul(pt, dout, dv_full);
    g.reduction(CUDNN_REDUCE_TENSOR_ADD, dv_full, dv);
  } else {
    g.matmul(pt, dout, dv);
  }
  // dS = P (dout v^T - delta) scale
  auto dp = g.virt(f32, sd, ss);
  g.matmul(dout, vt, dp);
  auto dp1 = g.virt(f32, sd, ss);
  g.pointwise(CUDNN_POINTWISE_SUB, dp, delta, dp1);
  auto ds0 = g.virt(f32, sd, ss);
  g.pointwise(CUDNN_POINTWISE_MUL, dp1, p, ds0);
  auto ds = g.virt(io, sd, ss);  // an operand of dS k below: q's type
  g.pointwise(CUDNN_POINTWISE_MUL, ds0, scale, ds);
  // dK = dS^T q
  auto dst = g.virt(io, sd, st);
  g.reshape(ds, dst);
  if (grouped) {
    auto dk_full = g.virt(io, full_dims, full_strides);
    g.matmul(dst, q, dk_full);
    g.reduction(CUDNN_REDUCE_TENSOR_ADD, dk_full, dk);
  } else {
    g.matmul(dst, q, dk);
  }
  auto k = g.virt(io, z.kv_dims(), z.kv_strides(z.kv_ld));
  g.reshape(kt, k);
  if (s.deterministic) {
    // dQ = dS k straight into dq: cuDNN's form without atomics (dP in its workspace).
    g.matmul(ds, k, dq);
  } else {
    // dQ = dS k, accumulated in fp32 over key tiles (dq32, cuDNN's scratch), then rounded.
    auto dq32 = g.tensor(kDq32, f32, z.q_dims(), {z.h * z.t * z.d, z.t * z.d, z.d, 1});
    g.matmul(ds, k, dq32);
    g.pointwise(CUDNN_POINTWISE_IDENTITY, dq32, nullptr, dq);
  }
  return g.finish(handle);
}

struct Plan {
  Desc plan;
  std::size_t workspace = 0;
};

// A plan from an engine configuration, or the reason cuDNN refused it (appended to `why`).
bool try_config(cudnnHandle_t handle, cudnnBackendDescriptor_t config, const std::string& name,
                Plan& out, std::string& why) {
  Desc plan(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
  plan.set(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, handle);
  plan.desc(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, config);
  const cudnnStatus_t status = cudnnBackendFinalize(plan.get());
  if (status != CUDNN_STATUS_SUCCESS) {
    why += "; " + name + ": " + status_text(status);
    return false;
  }
  std::int64_t bytes = 0, n = 0;
  check(cudnnBackendGetAttribute(plan.get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                                 CUDNN_TYPE_INT64, 1, &n, &bytes),
        "execution plan: workspace size");
  out = Plan{std::move(plan), static_cast<std::size_t>(bytes)};
  return true;
}

// The engine configurations a heuristic mode offers, best first.
std::vector<Desc> heuristic_configs(const Desc& graph, cudnnBackendHeurMode_t mode,
                                    std::string& why) {
  std::vector<Desc> configs;
  Desc heur(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
  heur.desc(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, graph.get());
  heur.set(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, mode);
  const cudnnStatus_t status = cudnnBackendFinalize(heur.get());
  if (status != CUDNN_STATUS_SUCCESS) {
    why += "; heuristics: " + status_text(status);
    return configs;
  }
  std::int64_t count = 0;
  check(cudnnBackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                 CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, nullptr),
        "engine heuristics: result count");
  std::vector<cudnnBackendDescriptor_t> raw;
  for (std::int64_t i = 0; i < count; ++i) {
    configs.emplace_back(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR);
    raw.push_back(configs.back().get());
  }
  std::int64_t got = 0;
  if (count > 0)
    check(cudnnBackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                   CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &got, raw.data()),
          "engine heuristics: results");
  configs.erase(configs.begin() + got, configs.end());
  why += "; heuristics offered " + std::to_string(got);
  return configs;
}

// The first configuration of heuristic mode A that finalizes; failing that, every engine cuDNN
// has for the graph, by index, in its default configuration. Throws ConfigError with what each
// answered when none does.
Plan build_plan(cudnnHandle_t handle, const Desc& graph, const std::string& what) {
  std::string why;
  Plan plan{Desc(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR), 0};
  std::vector<Desc> configs = heuristic_configs(graph, CUDNN_HEUR_MODE_A, why);
  for (std::size_t i = 0; i < configs.size(); ++i)
    if (try_config(handle, configs[i].get(), "config " + std::to_string(i), plan, why)) return plan;
  std::int64_t engines = 0, n = 0;
  check(cudnnBackendGetAttribute(graph.get(), CUDNN_ATTR_OPERATIONGRAPH_ENGINE_GLOBAL_COUNT,
                                 CUDNN_TYPE_INT64, 1, &n, &engines),
        "operation graph: engine count");
  for (std::int64_t i = 0; i < engines; ++i) {
    Desc engine(CUDNN_BACKEND_ENGINE_DESCRIPTOR);
    engine.desc(CUDNN_ATTR_ENGINE_OPERATION_GRAPH, graph.get());
    engine.set(CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, i);
    const cudnnStatus_t status = cudnnBackendFinalize(engine.get());
    const std::string name = "engine " + std::to_string(i);
    if (status != CUDNN_STATUS_SUCCESS) {
      why += "; " + name + ": " + status_text(status);
      continue;
    }
    Desc config(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR);
    config.desc(CUDNN_ATTR_ENGINECFG_ENGINE, engine.get());
    const cudnnStatus_t config_status = cudnnBackendFinalize(config.get());
    if (config_status != CUDNN_STATUS_SUCCESS) {
      why += "; " + name + " configuration: " + status_text(config_status);
      continue;
    }
    if (try_config(handle, config.get(), name, plan, why)) return plan;
  }
  throw ConfigError("CudnnAttention: cuDNN " + std::to_string(cudnnGetVersion()) +
                    " has no engine for the " + what + " (" + why.substr(2) + ")");
}

}  // namespace

bool cudnn_attention_available() {
  return true;
}

struct CudnnAttention::Impl {
  cudnnHandle_t handle = nullptr;
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
  struct Entry {
    AttentionShape shape;
    bool backward;
    Plan plan;
  };
  std::deque<Entry> plans;  // tens of shapes at most (documents apart: one a call shape):
                            // a linear search is enough; stable references

  const Plan& plan_for(AttentionShape s, bool backward) {
    if (!backward) s.deterministic = false;  // one forward graph for both backwards
    for (const Entry& e : plans)
      if (e.backward == backward && e.shape == s) return e.plan;
    check_shape(s);
    const std::string what =
        std::string(backward ? "backward" : "forward") + " attention of " + describe(s);
    Desc graph = backward ? backward_graph(handle, s) : forward_graph(handle, s);
    Plan p = build_plan(handle, graph, what);
    if (p.workspace > workspace_bytes)
      throw ConfigError("CudnnAttention: cuDNN wants " + std::to_string(p.workspace) +
                        " bytes of workspace for the " + what + ", above the " +
                        std::to_string(workspace_bytes) + " it was given");
    plans.push_back(Entry{s, backward, std::move(p)});
    return plans.back().plan;
  }

  // Sequences per call of the deterministic backward (the whole batch for the other form).
  int backward_sequences(const AttentionShape& s) const {
    if (!s.deterministic) return s.sequences;
    const int c = cudnn_attention_deterministic_sequences(s, workspace_bytes);
    if (c == 0)
      throw ConfigError("CudnnAttention: the deterministic backward attention of " +
                        describe(s) + " needs " +
                        std::to_string(cudnn_attention_deterministic_workspace_bytes(
                            1, s.seq_len, s.heads, s.head_dim)) +
                        " bytes of workspace for one sequence, above the " +
                        std::to_string(workspace_bytes) + " it was given");
    return c;
  }

  static void check_shape(const AttentionShape& s) {
    const auto fail = [&](const std::string& why) {
      throw ConfigError("CudnnAttention: " + describe(s) + ": " + why);
    };
    if (s.sequences < 1 || s.seq_len < 1 || s.heads < 1 || s.kv_heads < 1 || s.head_dim < 1)
      fail("sizes must be >= 1");
    if (s.heads % s.kv_heads != 0) fail("kv_heads does not divide heads");
    if (s.head_dim % 8 != 0 || s.head_dim > 128)
      fail("head_dim is not a multiple of 8 in [8, 128]");
    if (s.dtype != DType::bf16 && s.dtype != DType::f16) fail("dtype is not bf16 or fp16");
    if (s.q_ld < std::int64_t{s.heads} * s.head_dim ||
        s.kv_ld < std::int64_t{s.kv_heads} * s.head_dim)
      fail("q_ld or kv_ld is shorter than a row");
    if (s.q_ld % 8 != 0 || s.kv_ld % 8 != 0 || s.grad_ld % 8 != 0)
      fail("q_ld, kv_ld and grad_ld must be multiples of 8 elements (16-byte rows)");
  }

  void execute(const Plan& p, const std::vector<std::int64_t>& uids, std::vector<void*> ptrs) {
    Desc pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
    pack.set(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, uids.data(),
             static_cast<std::int64_t>(uids.size()));
    pack.set(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, ptrs.data(),
             static_cast<std::int64_t>(ptrs.size()));
    pack.set(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, workspace);
    pack.finalize("variant pack");
    check(cudnnBackendExecute(handle, p.plan.get(), pack.get()), "cudnnBackendExecute");
  }
};

namespace {
void check_pointers(std::initializer_list<const void*> ptrs, const char* call) {
  for (const void* p : ptrs)
    if (p == nullptr || reinterpret_cast<std::uintptr_t>(p) % 16 != 0)
      throw ConfigError(std::string("CudnnAttention::") + call +
                        ": an operand is null or not 16-byte aligned");
}
}  // namespace

CudnnAttention::CudnnAttention(void* workspace, std::size_t bytes) : impl_(new Impl) {
  if (bytes > 0 && (workspace == nullptr || reinterpret_cast<std::uintptr_t>(workspace) % 16 != 0))
    throw ConfigError("CudnnAttention: the workspace is null or not 16-byte aligned");
  impl_->workspace = workspace;
  impl_->workspace_bytes = bytes;
  check(cudnnCreate(&impl_->handle), "cudnnCreate");
  const cudnnStatus_t status = cudnnSetStream(impl_->handle, cudaStreamPerThread);
  if (status != CUDNN_STATUS_SUCCESS) {
    cudnnDestroy(impl_->handle);
    check(status, "cudnnSetStream");
  }
}

CudnnAttention::~CudnnAttention() {
  if (impl_ == nullptr) return;
  impl_->plans.clear();  // the plans before the handle they were built on
  if (impl_->handle != nullptr) cudnnDestroy(impl_->handle);
}

std::size_t CudnnAttention::prepare(const AttentionShape& s) {
  std::size_t bytes = impl_->plan_for(s, false).workspace;
  const int per_call = impl_->backward_sequences(s);
  for (const int c : {per_call, s.sequences % per_call}) {
    if (c == 0) continue;
    AttentionShape t = s;
    t.sequences = c;
    bytes = std::max(bytes, impl_->plan_for(t, true).workspace);
  }
  return bytes;
}

void CudnnAttention::forward(const AttentionShape& s, const AttentionForward& io) {
  check_pointers({io.q, io.k, io.v, io.o, io.lse}, "forward");
  const Plan& p = impl_->plan_for(s, false);
  float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(s.head_dim)));
  float neg_inf = -std::numeric_limits<float>::infinity();
  impl_->execute(p, {kQ, kK, kV, kO, kLse, kScale, kNegInf},
                 {const_cast<void*>(io.q), const_cast<void*>(io.k), const_cast<void*>(io.v), io.o,
                  io.lse, &scale, &neg_inf});
}

void CudnnAttention::backward(const AttentionShape& s, const AttentionBackward& io) {
  check_pointers({io.q, io.k, io.v, io.o, io.dout, io.lse, io.dq, io.dk, io.dv, io.delta},
                 "backward");
  if (!s.deterministic) check_pointers({io.dq32}, "backward");
  float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(s.head_dim)));
  float neg_inf = -std::numeric_limits<float>::infinity(), one = 1.0f;
  if (!s.deterministic) {
    const Plan& p = impl_->plan_for(s, true);
    const std::size_t dq32_bytes = sizeof(float) * static_cast<std::size_t>(s.sequences) *
                                   static_cast<std::size_t>(s.seq_len) *
                                   static_cast<std::size_t>(s.heads) *
                                   static_cast<std::size_t>(s.head_dim);
    // cuDNN accumulates dQ into dq32 over key tiles: it starts from zero.
    SHARDSWAP_CUDA_CHECK(cudaMemsetAsync(io.dq32, 0, dq32_bytes, cudaStreamPerThread));
    impl_->execute(p, {kQ, kK, kV, kO, kDout, kLse, kScale, kNegInf, kOne, kDq, kDk, kDv, kDelta,
                       kDq32},
                   {const_cast<void*>(io.q), const_cast<void*>(io.k), const_cast<void*>(io.v),
                    const_cast<void*>(io.o), const_cast<void*>(io.dout),
                    const_cast<float*>(io.lse), &scale, &neg_inf, &one, io.dq, io.dk, io.dv,
                    io.delta, io.dq32});
    return;
  }
  // Deterministic: calls of per_call sequences, each on its rows of every operand (2-byte
  // elements; lse and delta [sequences, heads, seq_len]).
  const int per_call = impl_->backward_sequences(s);
  for (int first = 0; first < s.sequences; first += per_call) {
    AttentionShape t = s;
    t.sequences = std::min(per_call, s.sequences - first);
    const Plan& p = impl_->plan_for(t, true);
    const long long row = static_cast<long long>(first) * s.seq_len;
    const long long stat = row * s.heads;
    const auto at = [row](const void* base, long long ld) {
      return static_cast<void*>(const_cast<char*>(static_cast<const char*>(base)) +
                                row * ld * 2);
    };
    impl_->execute(p, {kQ, kK, kV, kO, kDout, kLse, kScale, kNegInf, kOne, kDq, kDk, kDv, kDelta},
                   {at(io.q, s.q_ld), at(io.k, s.kv_ld), at(io.v, s.kv_ld), at(io.o, s.q_ld),
                    at(io.dout, s.q_ld), const_cast<float*>(io.lse) + stat, &scale, &neg_inf,
                    &one, at(io.dq, s.grad_ld), at(io.dk, s.grad_ld), at(io.dv, s.grad_ld),
                    io.delta + stat});
  }
}

long CudnnAttention::version() {
  return static_cast<long>(cudnnGetVersion());
}

}  // namespace shardswap::lm::dec
