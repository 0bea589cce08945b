// Causal GQA attention through cuDNN (tools/model/cudnn_attention.h) against the decoder's own
// attention kernels and a float64 host reference, on random bf16 / fp16 operands: forward O and
// lse, backward dQ, dK, dV, over MHA and GQA, head_dim 64 and 128 and sequence lengths that are
// not multiples of a tile. cuDNN runs on the decoder's layouts (q, k, v in their own regions,
// the gradients in one row of width (H + 2K) hd). Errors are normalized: the largest absolute
// difference over the largest absolute reference value of the tensor.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "shardswap/error.h"
#include "tests/catch_compat.h"
#include "tests/gpu/device_memory_check.h"
#include "model/cudnn_attention.h"
#include "model/decoder_cuda.h"

using namespace shardswap;
using namespace shardswap::lm::dec;

namespace {

// Whether the build has cuDNN is a link-time choice (cudnn_attention_available): without it the
// cuDNN checks have nothing to run, and say so.
bool skipped_without_cudnn() {
  if (cudnn_attention_available()) return false;
  WARN("this build has no cuDNN (SHARDSWAP_CUDNN): the cuDNN attention checks did not run");
  return true;
}

using Vec = std::vector<double>;

void cuda_ok(cudaError_t status, const char* what) {
  if (status != cudaSuccess)
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
}

struct DeviceBuffer {
  void* p = nullptr;
  explicit DeviceBuffer(std::size_t bytes) {
    cuda_ok(cudaMalloc(&p, std::max<std::size_t>(bytes, 1)), "cudaMalloc");
    cuda_ok(cudaMemset(p, 0, bytes), "cudaMemset");
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { cudaFree(p); }
  template <class U = void>
  U* as() const {
    return static_cast<U*>(p);
  }
};

std::uint16_t to_bits(DType t, float x) {
  std::uint16_t bits = 0;
  if (t == DType::bf16) {
    const __nv_bfloat16 h = __float2bfloat16_rn(x);
    std::memcpy(&bits, &h, 2);
  } else {
    const __half h = __float2half_rn(x);
    std::memcpy(&bits, &h, 2);
  }
  return bits;
}
double from_bits(DType t, std::uint16_t bits) {
  // From raw bits: the types' own constructors (no memcpy into their protected member).
  if (t == DType::bf16) {
    __nv_bfloat16_raw raw;
    raw.x = bits;
    return static_cast<double>(__bfloat162float(__nv_bfloat16(raw)));
  }
  __half_raw raw;
  raw.x = bits;
  return static_cast<double>(__half2float(__half(raw)));
}

// Random values of the type: the host reference computes from exactly what the device holds.
std::vector<std::uint16_t> random_bits(DType t, std::size_t count, double spread,
                                       std::mt19937& rng) {
  std::normal_distribution<float> u(0.0f, static_cast<float>(spread));
  std::vector<std::uint16_t> bits(count);
  for (auto& b : bits) b = to_bits(t, u(rng));
  return bits;
}
Vec values(DType t, const std::vector<std::uint16_t>& bits) {
  Vec v(bits.size());
  for (std::size_t i = 0; i < bits.size(); ++i) v[i] = from_bits(t, bits[i]);
  return v;
}

struct Case {
  const char* name;
  int sequences, seq_len, heads, kv_heads, head_dim;
  DType dtype;
};

// The float64 reference on packed rows: q, o, dout [n, H d], k, v [n, K d]; lse [b, h, t].
struct Reference {
  Vec o, lse, dq, dk, dv;
};
Reference reference(const Case& c, const Vec& q, const Vec& k, const Vec& v, const Vec& dout) {
  const int B = c.sequences, T = c.seq_len, H = c.heads, K = c.kv_heads, d = c.head_dim;
  const int group = H / K;
  const std::size_t qw = static_cast<std::size_t>(H) * d, kw = static_cast<std::size_t>(K) * d;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const std::size_t n = static_cast<std::size_t>(B) * T;
  Reference r{Vec(n * qw), Vec(n * H), Vec(n * qw), Vec(n * kw), Vec(n * kw)};
  Vec p(T), dp(T);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h) {
      const int g = h / group;
      for (int i = 0; i < T; ++i) {
        const std::size_t qi = (static_cast<std::size_t>(b) * T + i) * qw + h * d;
        double m = -INFINITY;
        for (int j = 0; j <= i; ++j) {
          const std::size_t kj = (static_cast<std::size_t>(b) * T + j) * kw + g * d;
          double s = 0;
          for (int e = 0; e < d; ++e) s += q[qi + e] * k[kj + e];
          p[j] = s * scale;
          m = std::max(m, p[j]);
        }
        double z = 0;
        for (int j = 0; j <= i; ++j) z += std::exp(p[j] - m);
        r.lse[(static_cast<std::size_t>(b) * H + h) * T + i] = m + std::log(z);
        for (int j = 0; j <= i; ++j) p[j] = std::exp(p[j] - m) / z;
        double delta = 0;
        for (int e = 0; e < d; ++e) {
          double o = 0;
          for (int j = 0; j <= i; ++j)
            o += p[j] * v[(static_cast<std::size_t>(b) * T + j) * kw + g * d + e];
          r.o[qi + e] = o;
          delta += o * dout[qi + e];
        }
        for (int j = 0; j <= i; ++j) {
          const std::size_t kj = (static_cast<std::size_t>(b) * T + j) * kw + g * d;
          double s = 0;
          for (int e = 0; e < d; ++e) s += dout[qi + e] * v[kj + e];
          const double ds = p[j] * (s - delta) * scale;
          for (int e = 0; e < d; ++e) {
            r.dq[qi + e] += ds * k[kj + e];
            r.dk[kj + e] += ds * q[qi + e];
            r.dv[kj + e] += p[j] * dout[qi + e];
          }
        }
      }
    }
  return r;
}

double normalized_error(const Vec& got, const Vec& want) {
  double diff = 0, scale = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    diff = std::max(diff, std::abs(got[i] - want[i]));
    scale = std::max(scale, std::abs(want[i]));
  }
  return scale > 0 ? diff / scale : diff;
}

template <class U>
std::vector<U> download(const void* p, std::size_t count) {
  std::vector<U> host(count);
  cuda_ok(cudaMemcpy(host.data(), p, count * sizeof(U), cudaMemcpyDeviceToHost), "download");
  return host;
}
void upload(void* p, const std::vector<std::uint16_t>& host) {
  cuda_ok(cudaMemcpy(p, host.data(), host.size() * 2, cudaMemcpyHostToDevice), "upload");
}

// Columns [from, from + width) of rows `ld` long, as a packed matrix.
template <class U, class F>
Vec columns(const std::vector<U>& rows, std::size_t n, std::size_t ld, std::size_t from,
            std::size_t width, F&& value) {
  Vec out(n * width);
  for (std::size_t t = 0; t < n; ++t)
    for (std::size_t c = 0; c < width; ++c) out[t * width + c] = value(rows[t * ld + from + c]);
  return out;
}

// lse of the own kernels is [token, head]; the reference's (and cuDNN's) [sequence, head, pos].
Vec lse_by_head(const std::vector<float>& token_major, const Case& c) {
  Vec out(token_major.size());
  for (int b = 0; b < c.sequences; ++b)
    for (int t = 0; t < c.seq_len; ++t)
      for (int h = 0; h < c.heads; ++h)
        out[(static_cast<std::size_t>(b) * c.heads + h) * c.seq_len + t] =
            token_major[(static_cast<std::size_t>(b) * c.seq_len + t) * c.heads + h];
  return out;
}

struct Errors {
  double o, lse, dq, dk, dv;
};

struct Run {
  Errors cudnn, own, between;
  std::size_t workspace;
};

Run run_case(const Case& c) {
  std::mt19937 rng(1234u + static_cast<unsigned>(c.seq_len * 7 + c.head_dim + c.heads));
  const std::size_t n = static_cast<std::size_t>(c.sequences) * c.seq_len;
  const std::size_t qw = static_cast<std::size_t>(c.heads) * c.head_dim,
                    kw = static_cast<std::size_t>(c.kv_heads) * c.head_dim, width = qw + 2 * kw;
  // Scores of O(1) (q.k ~ spread^2 * d * scale): softmaxes neither flat nor one-hot.
  const double spread = std::pow(static_cast<double>(c.head_dim), -0.25) * 1.5;
  const auto q = random_bits(c.dtype, n * qw, spread, rng);
  const auto k = random_bits(c.dtype, n * kw, spread, rng);
  const auto v = random_bits(c.dtype, n * kw, 1.0, rng);
  const auto dout = random_bits(c.dtype, n * qw, 1.0, rng);
  const Reference ref = reference(c, values(c.dtype, q), values(c.dtype, k), values(c.dtype, v),
                                  values(c.dtype, dout));
  const auto b16 = [&](std::uint16_t bits) { return from_bits(c.dtype, bits); };
  const auto f32 = [](float x) { return static_cast<double>(x); };

  DeviceBuffer dq_(n * qw * 2), dk_(n * kw * 2), dv_(n * kw * 2), ddout(n * qw * 2);
  upload(dq_.p, q);
  upload(dk_.p, k);
  upload(dv_.p, v);
  upload(ddout.p, dout);
  Run run{};

  {  // cuDNN on the decoder's layouts
    DeviceBuffer o(n * qw * 2), lse(n * c.heads * 4), g16(n * width * 2), dq32(n * qw * 4),
        delta(n * c.heads * 4), workspace(cudnn_attention_workspace_bytes(n, c.heads, c.head_dim));
    CudnnAttention attn(workspace.p, cudnn_attention_workspace_bytes(n, c.heads, c.head_dim));
    AttentionShape s;
    s.sequences = c.sequences;
    s.seq_len = c.seq_len;
    s.heads = c.heads;
    s.kv_heads = c.kv_heads;
    s.head_dim = c.head_dim;
    s.dtype = c.dtype;
    s.q_ld = static_cast<long long>(qw);
    s.kv_ld = static_cast<long long>(kw);
    s.grad_ld = static_cast<long long>(width);
    run.workspace = attn.prepare(s);
    attn.forward(s, {dq_.p, dk_.p, dv_.p, o.p, lse.as<float>()});
    auto* g = g16.as<std::uint16_t>();
    attn.backward(s, {dq_.p, dk_.p, dv_.p, o.p, ddout.p, lse.as<float>(), g, g + qw, g + qw + kw,
                      dq32.as<float>(), delta.as<float>()});
    cuda_ok(cudaStreamSynchronize(cudaStreamPerThread), "cuDNN attention");
    const auto o_h = download<std::uint16_t>(o.p, n * qw);
    const auto lse_h = download<float>(lse.p, n * c.heads);
    const auto g_h = download<std::uint16_t>(g16.p, n * width);
    const Vec cdq = columns(g_h, n, width, 0, qw, b16);
    run.cudnn = {normalized_error(values(c.dtype, o_h), ref.o),
                 normalized_error(Vec(lse_h.begin(), lse_h.end()), ref.lse),
                 normalized_error(cdq, ref.dq),
                 normalized_error(columns(g_h, n, width, qw, kw, b16), ref.dk),
                 normalized_error(columns(g_h, n, width, qw + kw, kw, b16), ref.dv)};

    {  // the own kernels on packed rows
      DeviceBuffer oo(n * qw * 2), olse(n * c.heads * 4), grads(n * width * 4),
          odelta(n * c.heads * 4);
      own_attention_forward(c.dtype, c.sequences, c.seq_len, c.heads, c.kv_heads, c.head_dim, dq_.p,
                            dk_.p, dv_.p, oo.p, olse.as<float>());
      own_attention_backward(c.dtype, c.sequences, c.seq_len, c.heads, c.kv_heads, c.head_dim,
                             dq_.p, dk_.p, dv_.p, oo.p, ddout.p, olse.as<float>(),
                             odelta.as<float>(), grads.as<float>(), static_cast<long long>(width));
      cuda_ok(cudaStreamSynchronize(cudaStreamPerThread), "own attention");
      const Vec oo_h = values(c.dtype, download<std::uint16_t>(oo.p, n * qw));
      const Vec olse_h = lse_by_head(download<float>(olse.p, n * c.heads), c);
      const auto grads_h = download<float>(grads.p, n * width);
      const Vec odq = columns(grads_h, n, width, 0, qw, f32),
                odk = columns(grads_h, n, width, qw, kw, f32),
                odv = columns(grads_h, n, width, qw + kw, kw, f32);
      run.own = {normalized_error(oo_h, ref.o), normalized_error(olse_h, ref.lse),
                 normalized_error(odq, ref.dq), normalized_error(odk, ref.dk),
                 normalized_error(odv, ref.dv)};
      run.between = {normalized_error(values(c.dtype, o_h), oo_h),
                     normalized_error(Vec(lse_h.begin(), lse_h.end()), olse_h),
                     normalized_error(cdq, odq),
                     normalized_error(columns(g_h, n, width, qw, kw, b16), odk),
                     normalized_error(columns(g_h, n, width, qw + kw, kw, b16), odv)};
    }
  }
  return run;
}

const Case kCases[] = {
    {"GQA 4/2, hd 64, bf16, 2 x 77", 2, 77, 4, 2, 64, DType::bf16},
    {"MHA 4/4, hd 128, fp16, 1 x 50", 1, 50, 4, 4, 128, DType::f16},
    {"GQA 6/1, hd 128, bf16, 2 x 33", 2, 33, 6, 1, 128, DType::bf16},
    {"MHA 2/2, hd 64, fp16, 3 x 130", 3, 130, 2, 2, 64, DType::f16},
    {"GQA 14/2, hd 64, bf16, 1 x 200", 1, 200, 14, 2, 64, DType::bf16},
};

void print(const char* who, const Errors& e) {
  std::printf("  %-14s O %.2e  lse %.2e  dQ %.2e  dK %.2e  dV %.2e\n", who, e.o, e.lse, e.dq, e.dk,
              e.dv);
}

}  // namespace

TEST_CASE(
    "cuDNN attention and the own kernels both match the float64 reference, forward and "
    "backward",
    "[cudnn][gpu]") {
  if (skipped_without_cudnn()) return;
  std::printf("cuDNN %ld: attention, errors normalized by the reference's largest value\n",
              CudnnAttention::version());
  for (const Case& c : kCases) {
    INFO(c.name);
    const Run r = run_case(c);
    std::printf("%s (cuDNN workspace %zu bytes)\n", c.name, r.workspace);
    print("cuDNN:", r.cudnn);
    print("own:", r.own);
    print("cuDNN vs own:", r.between);
    // O, and cuDNN's dQ, dK, dV, are rounded to the type (2^-9 bf16, 2^-12 fp16 relative) from
    // fp32 sums, and the probabilities cuDNN multiplies V (and dS K) by are rounded too; the own
    // kernels keep P and their gradients in fp32. lse is fp32 in both.
    const bool bf16 = c.dtype == DType::bf16;
    const double rounded = bf16 ? 1e-2 : 2e-3, f32_sums = bf16 ? 5e-3 : 1e-3;
    CHECK(r.cudnn.o < rounded);
    CHECK(r.cudnn.lse < 1e-5);
    CHECK(r.cudnn.dq < rounded);
    CHECK(r.cudnn.dk < rounded);
    CHECK(r.cudnn.dv < rounded);
    CHECK(r.own.o < rounded);
    CHECK(r.own.lse < 1e-5);
    CHECK(r.own.dq < f32_sums);
    CHECK(r.own.dk < f32_sums);
    CHECK(r.own.dv < f32_sums);
  }
}

TEST_CASE("cuDNN attention refuses a shape it cannot run, naming it, before queueing anything",
          "[cudnn][gpu]") {
  if (skipped_without_cudnn()) return;
  DeviceBuffer workspace(1 << 20);
  CudnnAttention attn(workspace.p, 1 << 20);
  AttentionShape s;
  s.sequences = 1;
  s.seq_len = 16;
  s.heads = 6;
  s.kv_heads = 4;  // does not divide heads
  s.head_dim = 64;
  s.q_ld = 6 * 64;
  s.kv_ld = 4 * 64;
  s.grad_ld = 14 * 64;
  REQUIRE(test::contains(test::message_of<ConfigError>([&] { attn.prepare(s); }),
                         "kv_heads does not divide"));
  s.kv_heads = 2;
  s.kv_ld = 2 * 64;
  s.head_dim = 160;
  REQUIRE_THROWS_AS(attn.prepare(s), ConfigError);
  CHECK_THROWS_AS(CudnnAttention(nullptr, 16), ConfigError);
}

TEST_CASE("model.attention picks the attention and refuses a cuDNN one the build or shape rules "
          "out",
          "[cudnn][gpu]") {
  DecoderShape s;
  s.head_dim = 64;
  DecoderShape odd = s;
  odd.head_dim = 12;
  CHECK(cuda_attention(s, Attention::own) == Attention::own);
  CHECK(test::contains(cuda_attention_name(s, Attention::own), "model.attention = \"own\""));
  CHECK(cuda_attention(odd) == Attention::own);  // the own kernels, as documented
  if (!cudnn_attention_available()) {  // the own kernels, and a cuDNN value refused
    CHECK(cuda_attention(s) == Attention::own);
    CHECK(test::contains(cuda_attention_name(s), "this build has no cuDNN"));
    CHECK(test::contains(
        test::message_of<ConfigError>([&] { cuda_attention(s, Attention::cudnn); }),
        "model.attention = \"cudnn\": this build has no cuDNN"));
    return;
  }
  CHECK(cuda_attention(s) == Attention::cudnn);  // deterministic by default
  CHECK(test::contains(cuda_attention_name(s), "deterministic backward"));
  CHECK(test::contains(cuda_attention_name(odd), "head_dim is not a multiple of 8"));
  CHECK(cuda_attention(s, Attention::cudnn) == Attention::cudnn);
  CHECK(test::contains(
      test::message_of<ConfigError>([&] { cuda_attention(odd, Attention::cudnn); }),
      "model.attention = \"cudnn\": head_dim = 12"));
  CHECK(cuda_attention(s, Attention::cudnn_atomic) == Attention::cudnn_atomic);
  CHECK(test::contains(cuda_attention_name(s, Attention::cudnn_atomic), "atomics"));
  CHECK(test::contains(
      test::message_of<ConfigError>([&] { cuda_attention(odd, Attention::cudnn_atomic); }),
      "model.attention = \"cudnn-atomic\": head_dim = 12"));
}

namespace {
// Random bf16 operands of a causal GQA attention, packed rows, and the gradient rows' scratch.
struct AttentionOperands {
  AttentionShape s;
  std::size_t n, qw, kw, width;
  DeviceBuffer q, k, v, dout, o, lse, g16, dq32, delta;
  AttentionOperands(int B, int T, int H, int K, int d, unsigned seed)
      : n(static_cast<std::size_t>(B) * T),
        qw(std::size_t{static_cast<std::size_t>(H)} * d),
        kw(std::size_t{static_cast<std::size_t>(K)} * d),
        width(qw + 2 * kw),
        q(n * qw * 2),
        k(n * kw * 2),
        v(n * kw * 2),
        dout(n * qw * 2),
        o(n * qw * 2),
        lse(n * H * 4),
        g16(n * width * 2),
        dq32(n * qw * 4),
        delta(n * H * 4) {
    std::mt19937 rng(seed);
    const double spread = std::pow(static_cast<double>(d), -0.25) * 1.5;
    upload(q.p, random_bits(DType::bf16, n * qw, spread, rng));
    upload(k.p, random_bits(DType::bf16, n * kw, spread, rng));
    upload(v.p, random_bits(DType::bf16, n * kw, 1.0, rng));
    upload(dout.p, random_bits(DType::bf16, n * qw, 1.0, rng));
    s.sequences = B;
    s.seq_len = T;
    s.heads = H;
    s.kv_heads = K;
    s.head_dim = d;
    s.q_ld = static_cast<long long>(qw);
    s.kv_ld = static_cast<long long>(kw);
    s.grad_ld = static_cast<long long>(width);
  }
  // Forward and backward through attn; the backward deterministic or not.
  void step(CudnnAttention& attn, bool deterministic) {
    AttentionShape t = s;
    t.deterministic = deterministic;
    auto* g = g16.as<std::uint16_t>();
    attn.forward(t, {q.p, k.p, v.p, o.p, lse.as<float>()});
    attn.backward(t, {q.p, k.p, v.p, o.p, dout.p, lse.as<float>(), g, g + qw, g + qw + kw,
                      deterministic ? nullptr : dq32.as<float>(), delta.as<float>()});
  }
  std::vector<std::uint16_t> grads() const { return download<std::uint16_t>(g16.p, n * width); }
  Vec grad_values() const {
    const auto h = grads();
    Vec out(h.size());
    for (std::size_t i = 0; i < h.size(); ++i) out[i] = from_bits(DType::bf16, h[i]);
    return out;
  }
};

template <class Step>
float time_ms(Step&& step) {
  step();  // warm (plans built)
  cudaEvent_t start, stop;
  cuda_ok(cudaEventCreate(&start), "cudaEventCreate");
  cuda_ok(cudaEventCreate(&stop), "cudaEventCreate");
  const int reps = 5;
  cuda_ok(cudaEventRecord(start, cudaStreamPerThread), "cudaEventRecord");
  for (int i = 0; i < reps; ++i) step();
  cuda_ok(cudaEventRecord(stop, cudaStreamPerThread), "cudaEventRecord");
  cuda_ok(cudaEventSynchronize(stop), "cudaEventSynchronize");
  float ms = 0;
  cuda_ok(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return ms / reps;
}
}  // namespace

// Attention forward + backward at Qwen2.5 0.5B / 1.5B / 7B layer shapes, seq 2048: cuDNN's
// atomic backward, its deterministic one as the decoder runs it (calls of up to
// kCudaDeterministicDpBytes of dP) and in one call, and (at the first shape) the own kernels,
// after checks that they agree. Hidden: run it by its tag.
TEST_CASE("cuDNN attention, atomic and deterministic backward and the own kernels: time",
          "[.][cudnn-bench]") {
  if (skipped_without_cudnn()) return;
  struct Case {
    const char* name;
    int B, H, K, d;
    bool own;
  };
  const int T = 2048;
  for (const Case c : {Case{"Qwen2.5-0.5B", 8, 14, 2, 64, true},
                       Case{"Qwen2.5-1.5B", 4, 12, 2, 128, false},
                       Case{"Qwen2.5-7B", 1, 28, 4, 128, false}}) {
    AttentionOperands x(c.B, T, c.H, c.K, c.d, 7);
    DecoderShape ds;
    ds.hidden = c.H * c.d;
    ds.heads = c.H;
    ds.kv_heads = c.K;
    ds.head_dim = c.d;
    const std::size_t decoder_bytes = cuda_cudnn_scratch_bytes(ds, c.B, T);
    const std::size_t atomic_bytes = cudnn_attention_workspace_bytes(x.n, c.H, c.d);
    DeviceBuffer w_atomic(atomic_bytes), w_decoder(decoder_bytes);
    CudnnAttention atomic(w_atomic.p, atomic_bytes), decoder(w_decoder.p, decoder_bytes);
    AttentionShape det = x.s;
    det.deterministic = true;
    const std::size_t asked_atomic = atomic.prepare(x.s);
    const float atomic_ms = time_ms([&] { x.step(atomic, false); });
    const Vec atomic_g = x.grad_values();
    const float decoder_ms = time_ms([&] { x.step(decoder, true); });
    const Vec decoder_g = x.grad_values();
    const double flops = 7.0 * c.B * c.H * double(T) * T * c.d;  // 7 causal matmuls
    std::printf("%s attention fwd+bwd, %d x %d tokens, %d / %d heads, head_dim %d, bf16:\n"
                "  atomic backward                %7.3f ms (%3.0f TFLOP/s), workspace asked %zu of "
                "%zu\n"
                "  deterministic, as the decoder  %7.3f ms (%3.0f TFLOP/s), %d sequences a call, "
                "scratch %zu; grads vs atomic %.2e\n",
                c.name, c.B, T, c.H, c.K, c.d, atomic_ms, flops / atomic_ms / 1e9, asked_atomic,
                atomic_bytes, decoder_ms, flops / decoder_ms / 1e9,
                cudnn_attention_deterministic_sequences(det, decoder_bytes), decoder_bytes,
                normalized_error(decoder_g, atomic_g));
    CHECK(normalized_error(decoder_g, atomic_g) < 1e-2);
    for (int per_call = 1; per_call <= c.B; per_call *= 2) {  // the trade: dP bytes for speed
      const std::size_t bytes = cudnn_attention_deterministic_workspace_bytes(per_call, T, c.H, c.d);
      DeviceBuffer w(bytes);
      CudnnAttention calls(w.p, bytes);
      const std::size_t asked = calls.prepare(det);
      const float ms = time_ms([&] { x.step(calls, true); });
      const double diff = normalized_error(x.grad_values(), decoder_g);
      std::printf("  deterministic, %d a call       %7.3f ms (%3.0f TFLOP/s), workspace asked %zu "
                  "of %zu; grads vs the decoder's %.2e\n",
                  per_call, ms, flops / ms / 1e9, asked, bytes, diff);
      CHECK(diff < 1e-2);
    }
    if (!c.own) continue;
    DeviceBuffer oo(x.n * x.qw * 2), olse(x.n * c.H * 4), grads(x.n * x.width * 4),
        odelta(x.n * c.H * 4);
    const float own_ms = time_ms([&] {
      own_attention_forward(DType::bf16, c.B, T, c.H, c.K, c.d, x.q.p, x.k.p, x.v.p, oo.p,
                            olse.as<float>());
      own_attention_backward(DType::bf16, c.B, T, c.H, c.K, c.d, x.q.p, x.k.p, x.v.p, oo.p,
                             x.dout.p, olse.as<float>(), odelta.as<float>(), grads.as<float>(),
                             static_cast<long long>(x.width));
    });
    x.step(decoder, true);
    const Vec co = values(DType::bf16, download<std::uint16_t>(x.o.p, x.n * x.qw));
    const Vec ow = values(DType::bf16, download<std::uint16_t>(oo.p, x.n * x.qw));
    const auto oh = download<float>(grads.p, x.n * x.width);
    const double o_diff = normalized_error(co, ow),
                 g_diff = normalized_error(x.grad_values(), Vec(oh.begin(), oh.end()));
    std::printf("  own kernels %.3f ms (%.0f TFLOP/s), %.1fx the deterministic cuDNN; O differs "
                "by %.2e, dq|dk|dv by %.2e\n",
                own_ms, flops / own_ms / 1e9, own_ms / decoder_ms, o_diff, g_diff);
    CHECK(o_diff < 1e-2);
    CHECK(g_diff < 2e-2);
  }
}

// The deterministic backward (dS K straight into dQ) gives the same bits run after run, in one
// call and in calls of one sequence, at a shape where the atomic form's key tiles are many
// (2 x 1024 positions, 14 heads / 2 kv heads), and agrees with the atomic form to bf16's
// rounding; cuDNN's asked workspace is within the bound that sizes it. Twice, on new handles:
// the second round must give the same bits and leave no device memory behind (the first may
// leave what cuDNN keeps for the process, the kernels it loaded).
TEST_CASE("cuDNN's deterministic backward gives identical bits run to run", "[cudnn]") {
  if (skipped_without_cudnn()) return;
  const int B = 2, T = 1024, H = 14, K = 2, d = 64;
  AttentionOperands x(B, T, H, K, d, 11);
  AttentionShape det = x.s;
  det.deterministic = true;
  const std::size_t whole_bytes = cudnn_attention_deterministic_workspace_bytes(B, T, H, d),
                    one_bytes = cudnn_attention_deterministic_workspace_bytes(1, T, H, d),
                    atomic_bytes = cudnn_attention_workspace_bytes(x.n, H, d);
  REQUIRE(cudnn_attention_deterministic_sequences(det, whole_bytes) == B);
  REQUIRE(cudnn_attention_deterministic_sequences(det, one_bytes) == 1);
  CHECK(cudnn_attention_deterministic_sequences(det, one_bytes - 1) == 0);
  struct Round {
    std::vector<std::uint16_t> whole, one, atomic, atomic_again;
  };
  const auto round = [&] {
    DeviceBuffer w_whole(whole_bytes), w_one(one_bytes), w_atomic(atomic_bytes);
    CudnnAttention whole(w_whole.p, whole_bytes), one(w_one.p, one_bytes),
        atomic(w_atomic.p, atomic_bytes);
    CHECK(whole.prepare(det) <= whole_bytes);
    CHECK(one.prepare(det) <= one_bytes);
    // A workspace short of one sequence is refused, naming the bytes.
    DeviceBuffer w_short(one_bytes / 2);
    CudnnAttention short_of_one(w_short.p, one_bytes / 2);
    CHECK(test::contains(test::message_of<ConfigError>([&] { short_of_one.prepare(det); }),
                         "for one sequence"));
    const auto grads_of = [&](CudnnAttention& attn, bool deterministic) {
      x.step(attn, deterministic);
      return x.grads();
    };
    Round r;
    r.whole = grads_of(whole, true);
    CHECK(grads_of(whole, true) == r.whole);
    r.one = grads_of(one, true);
    CHECK(grads_of(one, true) == r.one);
    r.atomic = grads_of(atomic, false);
    r.atomic_again = grads_of(atomic, false);
    cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    return r;
  };
  const std::int64_t start = test::device_free_bytes();
  const Round first = round();
  const std::int64_t after_first = test::device_free_bytes();
  const Round second = round();
  const std::int64_t after_second = test::device_free_bytes();
  CHECK(second.whole == first.whole);
  CHECK(second.one == first.one);
  CHECK(after_first - after_second <= test::kDeviceMemorySlack);
  test::allow_retained_device_memory(start - after_first, "cuDNN's loaded attention kernels");
  const auto as_values = [](const std::vector<std::uint16_t>& bits) {
    Vec out(bits.size());
    for (std::size_t i = 0; i < bits.size(); ++i) out[i] = from_bits(DType::bf16, bits[i]);
    return out;
  };
  const double vs_atomic = normalized_error(as_values(first.whole), as_values(first.atomic));
  std::printf("cuDNN backward, %d x %d tokens, %d / %d heads: deterministic identical twice and "
              "on new handles (one call and calls of one sequence: %s); against the atomic form "
              "%.2e; the atomic form's two runs %s; device memory kept after the first round "
              "%lld bytes, after the second %lld more\n",
              B, T, H, K, first.whole == first.one ? "identical" : "differ", vs_atomic,
              first.atomic == first.atomic_again ? "identical" : "differ",
              static_cast<long long>(start - after_first),
              static_cast<long long>(after_first - after_second));
  CHECK(vs_atomic < 1e-2);
  CHECK(normalized_error(as_values(first.whole), as_values(first.one)) < 1e-2);
}
