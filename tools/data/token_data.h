// Training data of the decoder: token files in llm.c's format (or the bytes of a plain file),
// packed into sequences and shuffled so that the global batch of a step is a pure function of
// (seed, step, global batch size): the same at any world size and any micro-batch split, so a run
// resumed at another world size continues on the same tokens. Format and rules: docs/data.md.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "shardswap/config_reader.h"
#include "model/decoder_compute.h"
#include "files/mapped_file.h"

namespace shardswap {

/// llm.c's token file: 256 little-endian int32 (magic, version, token count, then zeros), then
/// the tokens, little-endian uint16 (version 1) or uint32 (version 2). ShardSwap's loss mask:
/// header[3] = kTokenFileMaskFlag and a byte per token after the tokens (kMaskTarget: the loss
/// is on that token, as the target of the one before; kMaskDocumentStart: a document's first
/// token). llm.c leaves header[3] zero and reads the tokens of such a file as its own.
inline constexpr std::int32_t kTokenFileMagic = 20240520;
inline constexpr std::int64_t kTokenFileHeaderBytes = 256 * 4;
inline constexpr std::int32_t kTokenFileMaskFlag = 1;
inline constexpr std::uint8_t kMaskTarget = 1;
inline constexpr std::uint8_t kMaskDocumentStart = 2;


/// One file's tokens, read-only and mapped: nothing is copied, copies share the mapping. The file
/// must not shrink while it is open (a mapped page past its end reads as SIGBUS).
class TokenFile {
 public:
  /// Opens an llm.c token file and checks it whole: the magic, the version (1 or 2), that the
  /// size is exactly the header plus count * width bytes, and that every token is below `vocab`
  /// (one scan). Every error is a ConfigError that starts with `where` (e.g. `data.train =
  /// "x/*.bin": "x/a.bin"`; empty: the quoted path) and names the file; a path that is not a
  /// regular file (a directory, FIFO or device) is refused from stat() without being opened.
  static TokenFile open_llmc(const std::string& path, int vocab, const std::string& where = {});
  /// The bytes of any regular file as tokens (vocab 256); same refusals of what is not a file.
  static TokenFile open_bytes(const std::string& path, const std::string& where = {});

  const std::string& path() const { return path_; }
  std::int64_t size() const { return count_; }  ///< tokens
  int width() const { return width_; }          ///< bytes per token: 1 (bytes), 2 or 4
  /// The file holds a loss mask (header[3] = kTokenFileMaskFlag).
  bool has_mask() const { return mask_ != nullptr; }
  std::int32_t operator[](std::int64_t i) const;
  /// Tokens [begin, begin + count) as int32 into `out`; the range must lie in the file.
  void copy(std::int64_t begin, std::int64_t count, std::int32_t* out) const;
  /// Of tokens [begin, begin + count), those the loss is on (all of them without a mask); with
  /// `apart`, not a document's first token either (it does not follow the token before it).
  std::int64_t counted_targets(std::int64_t begin, std::int64_t count, bool apart = false) const;
  /// The same as targets: a token left out of the loss is lm::dec::kIgnoredTarget.
  void copy_targets(std::int64_t begin, std::int64_t count, std::int32_t* out,
                    bool apart = false) const;
  /// Each token's place in its document (lm::dec::Batch::positions), for tokens [begin, begin +
  /// count): 0 at `begin` (what came before is not seen) and at each kMaskDocumentStart, else
  /// one more than the token before. The file must have a mask.
  void copy_positions(std::int64_t begin, std::int64_t count, std::int32_t* out) const;

 private:
  std::string path_;
  std::shared_ptr<const MappedFile> file_;
  const std::uint8_t* tokens_ = nullptr;  // past the header
  const std::uint8_t* mask_ = nullptr;    // past the tokens, with kTokenFileMaskFlag
  std::int64_t count_ = 0;
  int width_ = 1;
};

/// Writes `tokens` as an llm.c token file of `version` (1: uint16, 2: uint32) through an
/// OutputFile (check_output_path's refusals; a complete file replaces the target, or nothing
/// does). Throws ConfigError, writing nothing, for another version, a token that does not fit
/// version 1's uint16, or more than 2^31 - 1 tokens (the header's int32 count). A non-empty
/// `mask` (a byte per token: kMaskTarget, kMaskDocumentStart) is written after the tokens with
/// header[3] = kTokenFileMaskFlag; another size is refused.
void write_token_file(const std::string& path, std::span<const std::uint32_t> tokens, int version,
                      std::span<const std::uint8_t> mask = {});

/// Where the tokens come from: the data.* keys of the config.
struct TokenDataSpec {
  std::string train;  ///< data.train: a path or glob of token files (sorted by name)
  std::string val;    ///< data.val: the same for validation; empty: none (bytes: the tail)
  /// data.tokenizer = "bytes": the files' bytes are the tokens (vocab 256). Without data.val,
  /// data.train must be one file, whose last floor(size * val_fraction) bytes are validation.
  bool bytes = false;
  double val_fraction = 0.1;  ///< data.val_fraction: bytes without data.val only
  /// data.documents: "apart" (true), "packed" (false), or absent (empty: apart when every file
  /// marks its documents' starts, as tokenize_data.py --chat writes them; else packed).
  std::optional<bool> documents_apart;
  int seq_len = 0;            ///< tokens per sequence (inputs; each sample reads seq_len + 1)
  int vocab = 0;              ///< the model's vocabulary size: every token must be below it
  std::uint64_t seed = 1;     ///< the shuffle's seed
};

/// Reads data.seq_len, data.tokenizer ("llmc" or "bytes"), data.train (required), data.val,
/// data.val_fraction and data.documents; vocab and seed are the model's and the run's, left for
/// the caller to set.
/// Throws ConfigError naming the key. Opens nothing: the files are checked when a TokenDataset
/// opens them.
TokenDataSpec token_data_spec_from_json(ConfigReader& c);

/// The files data.train and data.val name, globs expanded (sorted by name), without opening them:
/// what a run reads, for the CLI's check that no output of the run is one of its inputs.
/// ConfigError, naming the key, for a pattern that matches nothing.
std::vector<std::string> token_data_files(const TokenDataSpec& spec);

/// Sequences of token ids in the layout of lm::dec::Batch: `sequences` rows of `seq_len`,
/// row-major; targets are the inputs shifted by one token.
struct TokenSequences {
  int sequences = 0;
  int seq_len = 0;
  std::vector<std::int32_t> inputs;
  std::vector<std::int32_t> targets;  ///< lm::dec::kIgnoredTarget where the loss is not on it
  /// Documents apart: each token's place in its document (lm::dec::Batch::positions); empty:
  /// packed, one stream per row.
  std::vector<std::int32_t> positions;
  /// The targets the loss is on.
  std::int64_t counted_targets() const {
    return static_cast<std::int64_t>(lm::dec::counted_targets(view()));
  }
  lm::dec::Batch view() const {
    return {sequences, seq_len, inputs.data(), targets.data(),
            positions.empty() ? nullptr : positions.data()};
  }
};

/// The position of draw p of an epoch: a bijection of [0, n) that is a pure function of
/// (seed, epoch, p), computed in O(1) memory (a Feistel network over the next even power of
/// two, keyed by splitmix64 of seed and epoch, walked until it lands below n). Throws
/// ConfigError for n < 1 or p outside [0, n).
std::int64_t shuffled_index(std::uint64_t seed, std::uint64_t epoch, std::int64_t p,
                            std::int64_t n);

/// The packed, shuffled training set and the sequential validation set.
///
/// Packing: every file is its own stream; sample j of a file holds its tokens [j * seq_len,
/// j * seq_len + seq_len + 1), so windows never cross files and the last tokens of a file that
/// do not fill a window are not used. Samples are numbered globally in file order.
///
/// Draws: the global draw g is sample shuffled_index(seed, g / N, g % N, N) of the N training
/// samples, so each epoch is one permutation of all of them. The batch of step s is the draws
/// [s * G, (s + 1) * G), G the global batch in sequences (micro * accumulation * world); rank r
/// holds draws s * G + r * (G / world) + [0, G / world), cut into micro-batches in order. The SET
/// of sequences of a step, and their order in the global batch (ranks in order, each rank's
/// micro-batches in order), therefore depend on neither the world size nor the micro split.
class TokenDataset {
 public:
  /// Opens every file and checks it (TokenFile). ConfigErrors name the key and the file: a glob
  /// that matches nothing (naming the pattern), a file refused by TokenFile, a training set (or
  /// a validation set) too short for one sample of seq_len + 1 tokens; data.val_fraction
  /// outside (0, 1) for bytes; data.tokenizer "bytes" with a vocab below 256, or with several
  /// training files and no data.val; seq_len < 1 or vocab < 1.
  explicit TokenDataset(const TokenDataSpec& spec);

  /// A rank's micro-batch of step `step`: the sequences of draws step * G + rank * (G / world) +
  /// micro_index * micro_size + [0, micro_size). Throws ConfigError, naming the arguments, unless
  /// step >= 0, G >= 1, 1 <= world divides G, 0 <= rank < world, micro_size >= 1, micro_index
  /// >= 0 and (micro_index + 1) * micro_size <= G / world.
  TokenSequences train_batch(std::int64_t step, int global_batch, int rank, int world,
                             int micro_index, int micro_size) const;
  /// Validation samples [first, first + count) in order, as `count` sequences. Never wraps:
  /// throws ConfigError for count < 1, first < 0, a range past val_samples(), or a dataset
  /// without validation.
  TokenSequences val_sequences(std::int64_t first, int count) const;

  /// The targets the loss is on in step `step`'s global batch of `global_batch` sequences (all
  /// ranks, all micro-batches): what the loss of the step is the mean over. Every target without
  /// a loss mask.
  std::int64_t counted_targets(std::int64_t step, int global_batch) const;

  /// The training sample of global draw g (>= 0): the shuffle.
  std::int64_t sample_of_draw(std::int64_t g) const;
  /// Training sample `index` (in [0, train_samples())), unshuffled, as one sequence.
  TokenSequences train_sample(std::int64_t index) const;
  /// The epoch of step `step`'s first draw, for logging.
  std::int64_t epoch_of(std::int64_t step, int global_batch) const;

  std::int64_t train_samples() const { return train_.samples; }
  std::int64_t val_samples() const { return val_.samples; }
  /// Some validation file holds a loss mask.
  bool val_masked() const;
  /// Documents are kept apart (data.documents): batches carry positions.
  bool documents_apart() const { return apart_; }
  bool has_val() const { return val_.samples > 0; }
  /// Tokens the training samples read as inputs (train_samples() * seq_len).
  std::int64_t train_tokens() const { return train_.samples * seq_len_; }
  int seq_len() const { return seq_len_; }
  int vocab() const { return vocab_; }  ///< the model's (spec.vocab)
  /// The training files in order (paths), for logging.
  std::vector<std::string> train_files() const;

 private:
  // A file's tokens [begin, begin + length) as one stream of samples.
  struct Stream {
    TokenFile file;
    std::int64_t begin = 0;
    std::int64_t length = 0;
  };
  struct Split {
    std::vector<Stream> streams;
    std::vector<std::int64_t> first;  // global index of each stream's first sample
    std::int64_t samples = 0;
  };
  void add(Split& split, TokenFile file, std::int64_t begin, std::int64_t length) const;
  // Where a sample starts: its stream and the offset of its first token there.
  struct Place {
    const Stream* stream;
    std::int64_t at;
  };
  Place place_of(const Split& split, std::int64_t sample) const;
  void append(const Split& split, std::int64_t sample, TokenSequences& out) const;

  int seq_len_;
  int vocab_;
  std::uint64_t seed_;
  bool apart_ = false;
  Split train_;
  Split val_;
};

}  // namespace shardswap
