#pragma once
/// Token sampling: greedy, temperature, top-k, top-p, min-p, applied in
/// llama.cpp's default order (top-k → top-p → min-p → temperature → draw).
/// Randomness is counter-based: the draw for the token at output index `n` of a
/// request depends only on (seed, n), so a request resumed on another worker
/// from its prompt plus already generated tokens continues identically.

#include <cstdint>
#include <span>
#include <vector>

namespace ds4 {

struct SamplingParams {
  float temperature = 0.8f;  // <= 0: greedy
  int32_t top_k = 40;        // <= 0: off
  float top_p = 0.95f;       // >= 1: off
  float min_p = 0.05f;       // <= 0: off
  uint64_t seed = 0;
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

/// Picks the token at output index `n` from `logits` (n_vocab floats).
/// Greedy ties go to the lowest token id. `scratch` avoids allocation per call.
Sampled sample(std::span<const float> logits, const SamplingParams& p, uint64_t n,
               int n_top, std::vector<float>& scratch);

}  // namespace ds4
