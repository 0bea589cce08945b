// Documents apart through cuDNN's fused attention, which is given no document boundaries: the
// batch's documents (Batch::positions) are grouped by length class, and each class runs as a
// batch of its own, one document a sequence, padded with zero rows to the class's length. The
// causal mask keeps every real row from seeing the padding after it, so each document's rows
// are what attention over that document alone gives; the padded rows' outputs are dropped, and
// in backward their zero output gradients add nothing to dK and dV (dS = P (dO V^T - delta) is
// zero on a row whose dO and O are zero). CudaCompute gathers each call's rows into padded
// buffers, runs cuDNN on them and scatters the results back (tools/model/cuda/apart.cu). This
// file is the host's part: which documents go into which call. Plain C++17, no CUDA.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace shardswap::lm::dec {

/// The shortest padded length: cuDNN's kernels take queries in tiles of 64 or more, so a shorter
/// class would cost as much and add plans.
inline constexpr int kApartMinSeqLen = 64;

/// The padded length of a document of `length` tokens in a batch of rows `seq_len` long: the
/// smallest power of 2 >= length, kApartMinSeqLen at least and seq_len at most (a document
/// never crosses a row). Under 2x the document's length above kApartMinSeqLen tokens.
inline int apart_class(int length, int seq_len) {
  long long c = kApartMinSeqLen;
  while (c < length) c *= 2;
  return static_cast<int>(c < seq_len ? c : seq_len);
}

/// A document: `length` token rows of the batch from `start`.
struct ApartDocument {
  int start = 0, length = 0;
};

/// One cuDNN call: documents [first, first + count) of ApartCalls::documents, all of class
/// seq_len, as `sequences` padded sequences of seq_len rows (count rounded up to a power of 2,
/// so that a class needs few plans; the sequences past count are all padding).
struct ApartCall {
  int seq_len = 0, sequences = 0, first = 0, count = 0;
  long long tokens() const { return static_cast<long long>(sequences) * seq_len; }
};

struct ApartCalls {
  /// Every document of the batch, grouped by class (shortest class first) and in batch order
  /// within a class: the order CudaCompute uploads them in.
  std::vector<ApartDocument> documents;
  std::vector<ApartCall> calls;
  /// The padded rows of all calls together (the attention's work is in these).
  long long padded_tokens() const {
    long long t = 0;
    for (const ApartCall& c : calls) t += c.tokens();
    return t;
  }
};

/// ApartCalls::documents as the device takes them: (start, length) pairs, document after
/// document (CudaCompute uploads this; a call's table starts at pair `first`).
inline std::vector<int> apart_document_table(const ApartCalls& calls) {
  std::vector<int> out;
  out.reserve(2 * calls.documents.size());
  for (const ApartDocument& d : calls.documents) {
    out.push_back(d.start);
    out.push_back(d.length);
  }
  return out;
}

// What the gather and scatter kernels (tools/model/cuda/apart.cu) compute for each padded row,
// here so that the host's tests run the same arithmetic.
#if defined(__CUDACC__)
#define SHARDSWAP_APART_HD __host__ __device__
#else
#define SHARDSWAP_APART_HD
#endif

/// The batch row of a call's padded row r: position r % seq_len of the call's document
/// r / seq_len, from the call's table (`docs`: its (start, length) pairs, `count` documents);
/// -1 on the padding (past a document's length, or a sequence past count).
SHARDSWAP_APART_HD inline long long apart_batch_row(const int* docs, int count, int seq_len,
                                                    long long r) {
  const long long seq = r / seq_len, pos = r % seq_len;
  if (seq >= count || pos >= docs[2 * seq + 1]) return -1;
  return docs[2 * seq] + pos;
}

/// Where head h of a call's padded row r keeps its lse in cuDNN's [sequences, heads, seq_len].
SHARDSWAP_APART_HD inline long long apart_lse_index(int seq_len, int heads, long long r, int h) {
  return (r / seq_len * heads + h) * seq_len + r % seq_len;
}
#undef SHARDSWAP_APART_HD

/// The largest power of 2 <= x (x >= 1).
inline int apart_floor_pow2(long long x) {
  int p = 1;
  while (static_cast<long long>(p) * 2 <= x) p *= 2;
  return p;
}

/// The calls for a batch of `sequences` rows of `seq_len` tokens whose token t has document
/// position positions[t] (0 where a document starts; the row's first token is always at 0, and
/// a position is 0 or the one before plus 1: CudaCompute::check refuses others before this is
/// asked), each call of at most max_tokens padded rows. std::invalid_argument when max_tokens is
/// below the longest class (seq_len) or the positions break that rule: a caller's mistake.
inline ApartCalls plan_apart_calls(const int* positions, int sequences, int seq_len,
                                   long long max_tokens) {
  if (sequences < 1 || seq_len < 1 || positions == nullptr)
    throw std::invalid_argument("plan_apart_calls: an empty batch or null positions");
  if (max_tokens < apart_class(seq_len, seq_len))
    throw std::invalid_argument("plan_apart_calls: calls of " + std::to_string(max_tokens) +
                                " tokens cannot hold a row of " + std::to_string(seq_len));
  std::vector<ApartDocument> found;
  for (int r = 0; r < sequences; ++r) {
    const long long row = static_cast<long long>(r) * seq_len;
    for (int i = 0; i < seq_len; ++i) {
      const int p = positions[row + i];
      if (i == 0 ? p != 0 : p != 0 && p != positions[row + i - 1] + 1)
        throw std::invalid_argument("plan_apart_calls: position " + std::to_string(p) +
                                    " of token " + std::to_string(row + i) + " breaks the rule");
      if (p == 0)
        found.push_back({static_cast<int>(row + i), 1});
      else
        ++found.back().length;
    }
  }
  // Classes are kApartMinSeqLen * 2^c, then seq_len: bucket by class, shortest first.
  std::vector<int> classes;
  for (int c = apart_class(1, seq_len);; c = apart_class(c + 1, seq_len)) {
    classes.push_back(c);
    if (c == seq_len) break;
  }
  ApartCalls out;
  out.documents.reserve(found.size());
  for (const int c : classes) {
    const int first_of_class = static_cast<int>(out.documents.size());
    for (const ApartDocument& d : found)
      if (apart_class(d.length, seq_len) == c) out.documents.push_back(d);
    const int in_class = static_cast<int>(out.documents.size()) - first_of_class;
    const int most = apart_floor_pow2(max_tokens / c);  // sequences a call
    for (int done = 0; done < in_class;) {
      const int count = in_class - done < most ? in_class - done : most;
      int padded = 1;
      while (padded < count) padded *= 2;  // <= most: most is a power of 2 >= count
      out.calls.push_back({c, padded, first_of_class + done, count});
      done += count;
    }
  }
  return out;
}

}  // namespace shardswap::lm::dec
