#pragma once
/// Token sampling: greedy, temperature, top-k, top-p, min-p, applied in
/// llama.cpp's default order (top-k → top-p → min-p → temperature → draw),
/// after OpenAI's logit adjustments (logit_bias, frequency and presence
/// penalties), which adjust_logits applies to a copy of the logits.
/// Randomness is counter-based: the draw for the token at output index `n` of a
/// request depends only on (seed, n), so a request resumed on another worker
/// from its prompt plus already generated tokens continues identically.

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

namespace ds4 {

struct SamplingParams {
  float temperature = 0.8f;  // <= 0: greedy
  int32_t top_k = 40;        // <= 0: off
  float top_p = 0.95f;       // >= 1: off
  float min_p = 0.05f;       // <= 0: off
  uint64_t seed = 0;
  float frequency_penalty = 0;  // subtracted from a token's logit once per time it was generated
  float presence_penalty = 0;   // subtracted once from the logit of every token generated before
  std::vector<std::pair<int32_t, float>> logit_bias;  // (token, added to its logit)
  /// Whether the logits need adjust_logits before sampling.
  bool adjusts() const { return frequency_penalty != 0 || presence_penalty != 0 || !logit_bias.empty(); }
};

struct TokenLogprob {
  int32_t token = 0;
  float logprob = 0;  // log-softmax of the raw logits (temperature 1), as OpenAI reports
};

struct Sampled {
  int32_t token = 0;
  float logprob = 0;
  std::vector<TokenLogprob> top;  // the `n_top` most likely, best first
};

/// `delta` added to the logit of `token` in logit row `row` of a step.
struct LogitAdjust {
  int32_t row = 0;
  int32_t token = 0;
  float delta = 0;
};

/// What `p` adds to a row's logits, one entry a token (ascending ids),
/// appended to `out` for logit row `row`: each bias (summed when a token is
/// named twice), and for a token generated c > 0 times so far (`generated`:
/// the answer's tokens, not the prompt's) c × frequency_penalty +
/// presence_penalty subtracted, as OpenAI defines them. Token ids outside
/// [0, n_vocab) are ignored (the engine refuses them first). A backend adds
/// these where its logits are (Backend::forward), so that a biased row need
/// not travel; `scratch` avoids allocation per call.
void logit_adjustments(const SamplingParams& p, std::span<const int32_t> generated, int32_t n_vocab, int32_t row,
                       std::vector<LogitAdjust>& out, std::vector<int32_t>& scratch);

/// `logits` with logit_adjustments() added, written to `out` (a reference for
/// the backends; `scratch` as there).
std::span<const float> adjust_logits(std::span<const float> logits, const SamplingParams& p,
                                     std::span<const int32_t> generated, std::vector<float>& out,
                                     std::vector<int32_t>& scratch);

/// Picks the token at output index `n` from `logits` (n_vocab floats).
/// Greedy ties go to the lowest token id. `scratch` avoids allocation per call.
Sampled sample(std::span<const float> logits, const SamplingParams& p, uint64_t n,
               int n_top, std::vector<float>& scratch);

/// A logit and its token. Rows are ranked best first: the higher logit,
/// then the lower id; NaN counts as -inf.
struct LogitCandidate {
  float logit;
  int32_t id;
};

/// Whether sample_best() can draw for `p` and `n_top` alternatives from the
/// best `k` logits of a row of `n_vocab`: sampled (temperature > 0), top-k on,
/// at most k and below n_vocab, and at most k alternatives.
bool samples_from_best(const SamplingParams& p, int n_top, size_t k, size_t n_vocab);

/// sample() from a row's best logits (`best`, ranked, at least top_k and
/// n_top of them) and log(sum(exp(logits))) of the whole row (`lse`): the
/// same token, log-probability and alternatives, without the row. A device
/// backend keeps these where the logits are (Backend::best_logits).
Sampled sample_best(std::span<const LogitCandidate> best, double lse, const SamplingParams& p, uint64_t n, int n_top,
                    std::vector<float>& scratch);

}  // namespace ds4
