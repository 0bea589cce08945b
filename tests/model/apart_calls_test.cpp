// Documents apart through cuDNN (tools/model/apart_calls.h): the calls plan_apart_calls makes of
// a batch's documents, the padded rows cuda_apart_call_tokens lets one call take, and, in
// float64, that attention over the padded calls (causal, told nothing of the documents, with the
// padding's rows zero and its lse 0 in backward, as tools/model/cuda/apart.cu gathers them) is
// attention over each document alone, forward and backward. The GPU suite checks the kernels and
// cuDNN themselves (tests/gpu/decoder_gpu_test.cpp, "documents apart").
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "shardswap/error.h"
#include "tests/catch_compat.h"
#include "model/apart_calls.h"
#include "model/decoder_cuda.h"

using namespace shardswap;
using namespace shardswap::lm::dec;

namespace {

// Positions of `sequences` rows of seq_len tokens cut into documents of 1 to `longest` tokens.
std::vector<int> random_positions(int sequences, int seq_len, int longest, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<int> out;
  for (int r = 0; r < sequences; ++r) {
    int left = 0;  // tokens left in the current document
    for (int i = 0, pos = 0; i < seq_len; ++i, ++pos, --left) {
      if (i == 0 || left == 0) {
        pos = 0;
        left = 1 + static_cast<int>(rng() % static_cast<unsigned>(longest));
      }
      out.push_back(pos);
    }
  }
  return out;
}

// The documents of positions as (start, length), in batch order.
std::vector<ApartDocument> documents_of(const std::vector<int>& positions) {
  std::vector<ApartDocument> out;
  for (std::size_t t = 0; t < positions.size(); ++t)
    if (positions[t] == 0)
      out.push_back({static_cast<int>(t), 1});
    else
      ++out.back().length;
  return out;
}

// Causal GQA attention in float64 over row ranges (start, length) of packed rows: q [rows, H hd],
// k and v [rows, K hd]. Forward writes o and lse [rows, H] of each range's rows; backward adds
// each range's dq, dk, dv from dout, o and the given lse, as a flash backward does (P from lse,
// delta = rowsum(dout o), dS = P (dP - delta)).
struct Heads {
  int h, k, d;
};
using Vec = std::vector<double>;

double dot(const double* x, const double* y, int d) {
  double s = 0;
  for (int e = 0; e < d; ++e) s += x[e] * y[e];
  return s;
}

// Where row t's head h keeps its lse: [rows, heads] (the batch's), or cuDNN's layout.
using LseAt = std::function<long long(long long, int)>;

void causal_forward(const Heads& a, const Vec& q, const Vec& k, const Vec& v,
                    const std::vector<ApartDocument>& ranges, Vec& o, Vec& lse,
                    const LseAt& lse_at) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(a.d));
  const int qw = a.h * a.d, kw = a.k * a.d;
  for (const ApartDocument& r : ranges)
    for (int i = 0; i < r.length; ++i)
      for (int h = 0; h < a.h; ++h) {
        const int g = h / (a.h / a.k);
        const long long qi = static_cast<long long>(r.start + i);
        Vec s(static_cast<std::size_t>(i + 1));
        double m = -INFINITY;
        for (int j = 0; j <= i; ++j) {
          s[j] = scale * dot(&q[qi * qw + h * a.d], &k[(r.start + j) * kw + g * a.d], a.d);
          m = std::max(m, s[j]);
        }
        double sum = 0;
        for (const double x : s) sum += std::exp(x - m);
        const double l = m + std::log(sum);
        lse[static_cast<std::size_t>(lse_at(qi, h))] = l;
        for (int e = 0; e < a.d; ++e) {
          double acc = 0;
          for (int j = 0; j <= i; ++j)
            acc += std::exp(s[j] - l) * v[(r.start + j) * kw + g * a.d + e];
          o[qi * qw + h * a.d + e] = acc;
        }
      }
}

void causal_backward(const Heads& a, const Vec& q, const Vec& k, const Vec& v, const Vec& o,
                     const Vec& dout, const Vec& lse, const LseAt& lse_at,
                     const std::vector<ApartDocument>& ranges, Vec& dq, Vec& dk, Vec& dv) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(a.d));
  const int qw = a.h * a.d, kw = a.k * a.d;
  for (const ApartDocument& r : ranges)
    for (int i = 0; i < r.length; ++i)
      for (int h = 0; h < a.h; ++h) {
        const int g = h / (a.h / a.k);
        const long long qi = static_cast<long long>(r.start + i);
        const double* qrow = &q[qi * qw + h * a.d];
        const double* drow = &dout[qi * qw + h * a.d];
        const double delta = dot(drow, &o[qi * qw + h * a.d], a.d);
        for (int j = 0; j <= i; ++j) {
          const long long kj = (r.start + j) * static_cast<long long>(kw) + g * a.d;
          const double p = std::exp(scale * dot(qrow, &k[kj], a.d) -
                                    lse[static_cast<std::size_t>(lse_at(qi, h))]);
          const double ds = p * (dot(drow, &v[kj], a.d) - delta);
          for (int e = 0; e < a.d; ++e) {
            dq[qi * qw + h * a.d + e] += scale * ds * k[kj + e];
            dk[kj + e] += scale * ds * qrow[e];
            dv[kj + e] += p * drow[e];
          }
        }
      }
}

// apart.cu's gather of one tensor (rows of `width`) for a call, by the kernels' own arithmetic
// (apart_batch_row on the uploaded table): the documents' rows, `pad` past them (the kernel
// writes zeros); and its scatter of the documents' rows back.
Vec gather(const Vec& batch, int width, const std::vector<int>& table, const ApartCall& call,
           double pad) {
  const int* docs = table.data() + 2 * call.first;
  Vec out(static_cast<std::size_t>(call.tokens()) * width, pad);
  for (long long r = 0; r < call.tokens(); ++r)
    if (const long long row = apart_batch_row(docs, call.count, call.seq_len, r); row >= 0)
      std::copy_n(&batch[static_cast<std::size_t>(row) * width], width,
                  &out[static_cast<std::size_t>(r) * width]);
  return out;
}
void scatter(const Vec& padded, int width, const std::vector<int>& table, const ApartCall& call,
             Vec& batch) {
  const int* docs = table.data() + 2 * call.first;
  for (long long r = 0; r < call.tokens(); ++r)
    if (const long long row = apart_batch_row(docs, call.count, call.seq_len, r); row >= 0)
      std::copy_n(&padded[static_cast<std::size_t>(r) * width], width,
                  &batch[static_cast<std::size_t>(row) * width]);
}
// The lse: cuDNN's [sequences, heads, seq_len] to the batch's [rows, heads] and back (0 on the
// padding).
void scatter_lse(const Vec& padded, int heads, const std::vector<int>& table, const ApartCall& call,
                 Vec& batch) {
  const int* docs = table.data() + 2 * call.first;
  for (long long r = 0; r < call.tokens(); ++r)
    if (const long long row = apart_batch_row(docs, call.count, call.seq_len, r); row >= 0)
      for (int h = 0; h < heads; ++h)
        batch[static_cast<std::size_t>(row * heads + h)] =
            padded[static_cast<std::size_t>(apart_lse_index(call.seq_len, heads, r, h))];
}
Vec gather_lse(const Vec& batch, int heads, const std::vector<int>& table, const ApartCall& call) {
  const int* docs = table.data() + 2 * call.first;
  Vec out(static_cast<std::size_t>(call.tokens()) * heads, NAN);
  for (long long r = 0; r < call.tokens(); ++r) {
    const long long row = apart_batch_row(docs, call.count, call.seq_len, r);
    for (int h = 0; h < heads; ++h)
      out[static_cast<std::size_t>(apart_lse_index(call.seq_len, heads, r, h))] =
          row >= 0 ? batch[static_cast<std::size_t>(row * heads + h)] : 0.0;
  }
  return out;
}

bool is_pow2(long long x) {
  return x >= 1 && (x & (x - 1)) == 0;
}

// Every rule of the calls for one batch.
void check_calls(const std::vector<int>& positions, int sequences, int seq_len,
                 long long max_tokens) {
  CAPTURE(sequences, seq_len, max_tokens);
  const ApartCalls c = plan_apart_calls(positions.data(), sequences, seq_len, max_tokens);
  const std::vector<ApartDocument> want = documents_of(positions);
  // The same documents, each once, grouped by class, shortest first, batch order within one.
  REQUIRE(c.documents.size() == want.size());
  std::vector<ApartDocument> sorted = want;
  std::stable_sort(sorted.begin(), sorted.end(),
                   [&](const ApartDocument& a, const ApartDocument& b) {
                     return apart_class(a.length, seq_len) < apart_class(b.length, seq_len);
                   });
  for (std::size_t i = 0; i < sorted.size(); ++i) {
    REQUIRE(c.documents[i].start == sorted[i].start);
    REQUIRE(c.documents[i].length == sorted[i].length);
  }
  // The calls take the documents in order, each within its class and the call's bound.
  int next = 0;
  for (const ApartCall& call : c.calls) {
    CAPTURE(call.seq_len, call.sequences, call.first, call.count);
    REQUIRE(call.first == next);
    REQUIRE(call.count >= 1);
    REQUIRE(is_pow2(call.sequences));
    REQUIRE(call.count <= call.sequences);
    REQUIRE(call.sequences < 2 * call.count);  // the power of 2 at or above count
    REQUIRE(call.tokens() <= max_tokens);
    for (int d = call.first; d < call.first + call.count; ++d)
      REQUIRE(apart_class(c.documents[static_cast<std::size_t>(d)].length, seq_len) ==
              call.seq_len);
    next += call.count;
  }
  REQUIRE(next == static_cast<int>(want.size()));
}

}  // namespace

TEST_CASE("apart_class: the power of 2 at or above the length, 64 at least, the row at most") {
  CHECK(apart_class(1, 2048) == 64);
  CHECK(apart_class(64, 2048) == 64);
  CHECK(apart_class(65, 2048) == 128);
  CHECK(apart_class(1000, 2048) == 1024);
  CHECK(apart_class(1025, 2048) == 2048);
  CHECK(apart_class(2048, 2048) == 2048);
  CHECK(apart_class(1, 40) == 40);  // rows shorter than 64: one class
  CHECK(apart_class(600, 1000) == 1000);
  CHECK(apart_class(300, 1000) == 512);
}

TEST_CASE(
    "plan_apart_calls: every document once, by class, in calls of powers of 2 within the bound") {
  struct Case {
    int sequences, seq_len, longest;
    long long max_tokens;
  };
  unsigned seed = 1;
  for (const Case& k : {Case{8, 2048, 900, 8 * 2048}, Case{8, 2048, 30, 8 * 2048},
                        Case{3, 70, 40, 210}, Case{3, 70, 70, 70}, Case{4, 1000, 1000, 1500},
                        Case{2, 40, 5, 80}, Case{1, 2048, 2048, 2048}, Case{5, 300, 1, 1500}})
    for (int repeat = 0; repeat < 5; ++repeat) {
      const std::vector<int> positions =
          random_positions(k.sequences, k.seq_len, k.longest, seed++);
      check_calls(positions, k.sequences, k.seq_len, k.max_tokens);
    }
  // One document a row: one class of the row's length.
  std::vector<int> whole;
  for (int t = 0; t < 4 * 512; ++t) whole.push_back(t % 512);
  REQUIRE(documents_of(whole).size() == 4);
  const ApartCalls c = plan_apart_calls(whole.data(), 4, 512, 4 * 512);
  REQUIRE(c.calls.size() == 1);
  CHECK(c.calls[0].seq_len == 512);
  CHECK(c.calls[0].sequences == 4);
  CHECK(c.padded_tokens() == 4 * 512);
}

TEST_CASE(
    "plan_apart_calls: a bound below one row, or positions that break the rule, are refused") {
  const std::vector<int> positions = random_positions(2, 128, 50, 5);
  CHECK_THROWS_AS(plan_apart_calls(positions.data(), 2, 128, 127), std::invalid_argument);
  CHECK_NOTHROW(plan_apart_calls(positions.data(), 2, 128, 128));
  std::vector<int> bad = positions;
  bad[128] = 1;  // a row starts at 0
  CHECK_THROWS_AS(plan_apart_calls(bad.data(), 2, 128, 256), std::invalid_argument);
  bad = positions;
  bad[5] = bad[4] + 2;  // 0 or the one before plus 1
  CHECK_THROWS_AS(plan_apart_calls(bad.data(), 2, 128, 256), std::invalid_argument);
  CHECK_THROWS_AS(plan_apart_calls(nullptr, 2, 128, 256), std::invalid_argument);
}

TEST_CASE(
    "cuda_apart_call_tokens: a whole batch for Qwen2.5 and Llama shapes, 0 where a row does not "
    "fit") {
  const auto shape = [](int layers, int hidden, int inter, int heads, int kv, int vocab) {
    DecoderShape s;
    s.family = DecoderFamily::qwen2;
    s.qkv_bias = true;
    s.layers = layers;
    s.hidden = hidden;
    s.intermediate = inter;
    s.heads = heads;
    s.kv_heads = kv;
    s.head_dim = hidden / heads;
    s.vocab = vocab;
    s.max_positions = 32768;
    return s;
  };
  // Qwen2.5-0.5B at 8 x 2048, 1.5B at 4 x 2048, 7B at 3 x 2048: the whole batch in one call's
  // bound (act and dact hold 6 I bytes a token; a padded row takes 8 (H + K) hd + 4 H).
  CHECK(cuda_apart_call_tokens(shape(24, 896, 4864, 14, 2, 151936), 8, 2048) == 8 * 2048);
  CHECK(cuda_apart_call_tokens(shape(28, 1536, 8960, 12, 2, 151936), 4, 2048) == 4 * 2048);
  CHECK(cuda_apart_call_tokens(shape(28, 3584, 18944, 28, 4, 152064), 3, 2048) == 3 * 2048);
  DecoderShape llama = shape(32, 4096, 14336, 32, 8, 128256);
  llama.family = DecoderFamily::llama;
  llama.qkv_bias = false;
  CHECK(cuda_apart_call_tokens(llama, 1, 4096) == 4096);
  // A tiny MLP beside wide attention: the scratch holds less than a row.
  const DecoderShape narrow = shape(2, 512, 64, 8, 8, 1000);
  CHECK(cuda_apart_call_tokens(narrow, 4, 256) == 0);
  // The bound is what fits: its buffers within act and dact, one row more would not.
  const DecoderShape mid = shape(2, 256, 512, 4, 2, 1000);
  const long long t = cuda_apart_call_tokens(mid, 16, 128);
  const CudaLayout l = cuda_layout(mid, 16, 128, 0);
  REQUIRE(t >= 128);
  if (t < 16 * 128) {
    CHECK(static_cast<std::size_t>(t + 1) * cuda_apart_row_bytes(mid) + 7 * 256 > l.dx - l.act);
  }
  CHECK(static_cast<std::size_t>(t) * cuda_apart_row_bytes(mid) + 7 * 256 <= l.dx - l.act);
  // The documents' table: a (start, length) pair for as many documents as tokens.
  CHECK(l.xs - l.documents >= 2 * 16 * 128 * sizeof(int));
}

TEST_CASE("attention over padded calls is each document's alone, forward and backward (float64)") {
  const Heads a{4, 2, 8};
  const int sequences = 3, seq_len = 70, qw = a.h * a.d, kw = a.k * a.d;
  const std::size_t n = static_cast<std::size_t>(sequences) * seq_len;
  std::mt19937 rng(7);
  std::normal_distribution<double> normal;
  const auto random = [&](std::size_t count) {
    Vec x(count);
    for (double& e : x) e = normal(rng);
    return x;
  };
  const Vec q = random(n * qw), k = random(n * kw), v = random(n * kw), dout = random(n * qw);
  // Documents of 1 to 40 tokens and a whole row: both classes (64 and the row's 70), several
  // calls of the first.
  std::vector<int> positions = random_positions(sequences, seq_len, 40, 11);
  for (int i = 0; i < seq_len; ++i) positions[2 * seq_len + i] = i;  // the last row one document
  const ApartCalls c = plan_apart_calls(positions.data(), sequences, seq_len, 140);
  REQUIRE(c.calls.size() >= 3);
  std::set<int> classes;
  for (const ApartCall& call : c.calls) classes.insert(call.seq_len);
  REQUIRE(classes.size() == 2);

  // Each document alone.
  const LseAt batch_lse = [&](long long t, int h) { return t * a.h + h; };
  Vec o(n * qw), lse(n * a.h), dq(n * qw), dk(n * kw), dv(n * kw);
  causal_forward(a, q, k, v, documents_of(positions), o, lse, batch_lse);
  causal_backward(a, q, k, v, o, dout, lse, batch_lse, documents_of(positions), dq, dk, dv);

  // Through the calls: padded sequences, causal and nothing more, lse in cuDNN's layout; the
  // rows moved by the kernels' arithmetic on the table CudaCompute uploads.
  const std::vector<int> table = apart_document_table(c);
  REQUIRE(table.size() == 2 * c.documents.size());
  const auto through_calls = [&](double dout_pad, Vec& go, Vec& glse, Vec& gdq, Vec& gdk,
                                 Vec& gdv) {
    go.assign(n * qw, NAN);
    glse.assign(n * a.h, NAN);
    gdq.assign(n * qw, NAN);
    gdk.assign(n * kw, NAN);
    gdv.assign(n * kw, NAN);
    for (const bool backward : {false, true})
      for (const ApartCall& call : c.calls) {
        std::vector<ApartDocument> sequences_of_call;
        for (int s = 0; s < call.sequences; ++s)
          sequences_of_call.push_back({s * call.seq_len, call.seq_len});
        const LseAt cudnn_lse = [&](long long r, int h) {
          return apart_lse_index(call.seq_len, a.h, r, h);
        };
        const auto t = static_cast<std::size_t>(call.tokens());
        const Vec pq = gather(q, qw, table, call, 0), pk = gather(k, kw, table, call, 0),
                  pv = gather(v, kw, table, call, 0);
        if (!backward) {
          Vec po(t * qw), plse(t * a.h, NAN);
          causal_forward(a, pq, pk, pv, sequences_of_call, po, plse, cudnn_lse);
          scatter(po, qw, table, call, go);
          scatter_lse(plse, a.h, table, call, glse);
          continue;
        }
        // Backward from what forward scattered.
        const Vec po = gather(go, qw, table, call, 0), pd = gather(dout, qw, table, call, dout_pad),
                  plse = gather_lse(glse, a.h, table, call);
        Vec pdq(t * qw), pdk(t * kw), pdv(t * kw);
        causal_backward(a, pq, pk, pv, po, pd, plse, cudnn_lse, sequences_of_call, pdq, pdk, pdv);
        scatter(pdq, qw, table, call, gdq);
        scatter(pdk, kw, table, call, gdk);
        scatter(pdv, kw, table, call, gdv);
      }
  };
  const auto worst = [](const Vec& x, const Vec& y) {
    double w = 0;
    for (std::size_t i = 0; i < x.size(); ++i) w = std::max(w, std::fabs(x[i] - y[i]));
    return std::isnan(w) ? INFINITY : w;  // a row never written stays NaN
  };
  Vec go, glse, gdq, gdk, gdv;
  through_calls(0.0, go, glse, gdq, gdk, gdv);
  CHECK(worst(go, o) < 1e-12);
  CHECK(worst(glse, lse) < 1e-12);
  CHECK(worst(gdq, dq) < 1e-12);
  CHECK(worst(gdk, dk) < 1e-12);
  CHECK(worst(gdv, dv) < 1e-12);
  // The zero output gradient on the padding is what keeps it out of dK and dV: with ones there
  // instead, the documents' key gradients change (their queries' do not).
  through_calls(1.0, go, glse, gdq, gdk, gdv);
  CHECK(worst(gdq, dq) < 1e-12);
  CHECK(worst(gdv, dv) > 1e-3);
}

TEST_CASE("cuda_apart_attention_name: cuDNN's padded calls wherever the run has cuDNN") {
  DecoderShape s;
  s.family = DecoderFamily::qwen2;
  s.qkv_bias = true;
  s.layers = 2;
  s.hidden = 896;
  s.intermediate = 4864;
  s.heads = 14;
  s.kv_heads = 2;
  s.head_dim = 64;
  s.vocab = 1000;
  s.max_positions = 4096;
  std::string automatic;
  try {
    automatic = cuda_apart_attention_name(s, 8, 2048);
  } catch (const BackendUnavailable&) {  // a build without CUDA says so for every form
    CHECK_THROWS_AS(cuda_apart_attention_name(s, 8, 2048, Attention::own), BackendUnavailable);
    CHECK_THROWS_AS(cuda_apart_through_cudnn(s, 8, 2048, Attention::cudnn), BackendUnavailable);
    return;
  }
  const auto own = [](const std::string& name) {
    return name.find("own attention kernels") != std::string::npos;
  };
  CHECK(own(cuda_apart_attention_name(s, 8, 2048, Attention::own)));
  CHECK_FALSE(cuda_apart_through_cudnn(s, 8, 2048, Attention::own));
  if (!cudnn_attention_available()) {  // "auto" is the own kernels for every batch then
    CHECK(own(automatic));
    CHECK_FALSE(cuda_apart_through_cudnn(s, 8, 2048, Attention::automatic));
    CHECK_THROWS_AS(cuda_apart_through_cudnn(s, 8, 2048, Attention::cudnn), ConfigError);
    return;
  }
  for (const Attention a : {Attention::automatic, Attention::cudnn, Attention::cudnn_atomic}) {
    CHECK(cuda_apart_through_cudnn(s, 8, 2048, a));
    CHECK(cuda_apart_attention_name(s, 8, 2048, a).rfind("cuDNN", 0) == 0);
  }
  DecoderShape narrow = s;  // an MLP too narrow to hold a padded row: the own kernels, and why
  narrow.intermediate = 64;
  CHECK_FALSE(cuda_apart_through_cudnn(narrow, 4, 256, Attention::cudnn));
  CHECK(cuda_apart_attention_name(narrow, 4, 256, Attention::cudnn).find("does not fit") !=
        std::string::npos);
}
