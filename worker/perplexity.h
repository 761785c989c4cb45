#pragma once
/// `ds4-worker perplexity`: the perplexity of a text and, against log-probs
/// saved from a base model, the KL divergence and top-token agreement, the
/// figures llama.cpp's llama-perplexity reports, computed the same way so
/// that they compare (docs/engine.md, "Perplexity and KL divergence").
///
/// The text's tokens are cut into chunks of n_ctx; each chunk starts at
/// position 0 with BOS in its first place (when the vocabulary adds one) and
/// only its second half is scored: the logits at positions n_ctx/2 ..
/// n_ctx-2 against the tokens that follow them.

#include <cstdint>
#include <cstdio>
#include <functional>
#include <istream>
#include <ostream>
#include <span>
#include <string>
#include <vector>

namespace ds4 {

class Backend;

/// Positions of a chunk that are scored: n_ctx - 1 - n_ctx/2.
inline int64_t scored_per_chunk(int64_t n_ctx) { return n_ctx - 1 - n_ctx / 2; }

/// A mean and its standard error from sums of x and x^2 over n values
/// (err = sqrt((sum2/n - mean^2) / (n-1)); 0 when n < 2 or the variance is
/// not positive), as llama-perplexity computes it.
struct MeanError {
  double mean = 0;
  double error = 0;
};
MeanError mean_and_error(double sum, double sum2, uint64_t n);

/// The value at `fraction` (0..1) of ascending `sorted`, interpolated
/// linearly between neighbours (llama-perplexity's percentile); 0 when empty.
double percentile(std::span<const float> sorted, double fraction);
/// The middle value of ascending `sorted` (the mean of the two middle ones
/// for an even count); 0 when empty.
double median(std::span<const float> sorted);

/// A row's log-softmax, kept in n_vocab + kRowHeader uint16 (2 bytes a
/// token plus 12): three floats, the row's largest log-prob `top`, a
/// `step`, and the exact log-prob of the token that follows (so the base's
/// perplexity is exact), then for each token u = round((top - logprob) /
/// step). The range is the row's own, at most kLogProbRange nats below the
/// top (step = range / 65535, so a log-prob is kept to within step/2 <=
/// 1.9e-4 nats); tokens further below keep 65535 and count as probability 0
/// (exp(-24) = 4e-11 each, 6e-6 over a vocabulary of 150k). llama-perplexity
/// keeps the same 2 bytes a token over 16 nats; fp16 log-probs would be as
/// large but lose 5e-3 nats at -10. A row's KL divergence against its own
/// saved row is then of the order of step^2 / 24 (1e-9).
inline constexpr double kLogProbRange = 24.0;
inline constexpr int64_t kRowHeader = 6;
void encode_log_probs(std::span<const float> logits, int32_t next, uint16_t* out);
/// Decodes a row encode_log_probs() wrote into log-probs; tokens at the
/// floor decode to -infinity. Returns the next token's exact log-prob.
double decode_log_probs(const uint16_t* in, int64_t n_vocab, std::vector<double>& out);

/// The header of a --save-logits file (little-endian): the magic
/// "ds4logp\0", uint32 version (1), uint32 n_vocab, n_ctx, n_chunks, then
/// n_ctx * n_chunks int32 tokens (the text's, before a chunk's first is
/// replaced by BOS), then for each chunk and each scored position its row as
/// encode_log_probs() keeps it ((n_vocab + 6) * 2 bytes).
struct LogProbHeader {
  uint32_t n_vocab = 0;
  uint32_t n_ctx = 0;
  uint32_t n_chunks = 0;
  std::vector<int32_t> tokens;
};
inline constexpr uint32_t kLogProbVersion = 1;
void write_log_prob_header(std::ostream& out, const LogProbHeader& h);
/// Throws ds4::Error naming `what` (the file's name) when it is not such a
/// file or is cut short.
LogProbHeader read_log_prob_header(std::istream& in, const std::string& what);

/// KL divergence and perplexity sums over the scored positions.
struct KlStats {
  double sum_nll = 0, sum_nll2 = 0;            // the model's -log p(next)
  double sum_nll_base = 0, sum_nll_base2 = 0;  // the base's
  double sum_nll_nll_base = 0;
  double sum_kld = 0, sum_kld2 = 0;
  uint64_t same_top = 0;
  uint64_t count = 0;
  std::vector<float> kld;  // each position's KL divergence
};

/// Adds one position: the model's logits, the base's encoded row, the token
/// that follows. KL(base || model) is taken over the base's decoded row
/// renormalized (so that it is >= 0, and 0 for a row against itself up to
/// the encoding's rounding); the top tokens are the lowest ids of the
/// largest logit and of the largest base log-prob.
void add_kl_position(KlStats& s, std::span<const float> logits, const uint16_t* base, int32_t next);

/// -log softmax(logits)[token], in double.
double negative_log_prob(std::span<const float> logits, int32_t token);

/// The summary lines of --kl-divergence (llama-perplexity's "Perplexity
/// statistics" and "KL divergence statistics"), for a test to read.
std::string kl_summary(KlStats s);

struct PerplexityOptions {
  int64_t n_ctx = 512;
  int64_t n_chunks = -1;       // -1: every whole chunk of the text
  std::string save_logits;     // --save-logits FILE
  std::string kl_divergence;   // --kl-divergence FILE
  bool add_bos = true;         // the vocabulary adds BOS
  int32_t bos = 1;
  int64_t n_vocab = 0;
  int64_t max_batch = 512;     // the backend's shape.max_batch
  int64_t logit_rows = 2;      // the backend's logit rows a step (shape.slots + 1)
};

/// Runs the text's chunks through `backend` (reserved for context n_ctx and
/// one slot) and prints the running perplexity of each chunk and the final
/// estimate to `out`, as llama-perplexity does; with kl_divergence the
/// tokens come from that file when `tokens` is empty, else must equal its.
/// With `json`, the figures also as one JSON line there at the end ({n_ctx,
/// chunks, positions, ppl, ppl_error}; with kl_divergence also ppl_base,
/// ln_ppl_ratio, kld_mean, kld_error, kld_median, kld_p99, kld_p999,
/// kld_max, same_top and their errors). Returns the final perplexity.
double run_perplexity(Backend& backend, std::vector<int32_t> tokens, const PerplexityOptions& o, std::FILE* out,
                      std::FILE* json = nullptr);

}  // namespace ds4
