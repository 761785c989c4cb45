#pragma once
/// A mixture of experts' routing, the same on every backend: from each
/// token's router scores to the rows each chosen expert computes. A backend
/// computes the scores (router . n), calls route_experts() on the host, and
/// runs the experts over the rows it returns (worker/forward.h's MoeSpec says
/// what is computed; the CPU backend is the reference).

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace ds4 {

/// Where the routes go: arrays the caller owns (the memory plan's).
struct ExpertRoutes {
  int32_t* pair = nullptr;      // T x K: the row of token t's k-th expert (k by weight, largest first)
  float* weight = nullptr;      // T x K: scratch (each token's chosen weights)
  int32_t* start = nullptr;     // E + 1: expert e's rows are [start[e], start[e + 1])
  int32_t* token_of = nullptr;  // T x K rows, grouped by expert, tokens in batch order within one
  float* weight_of = nullptr;   // T x K: each row's weight
  /// Words (4 bytes) the arrays take for T tokens: 4 x T x K + E + 1.
  static int64_t words(int64_t T, int64_t K, int64_t E) { return 4 * T * K + E + 1; }
  /// Words a batch's expert jobs take (three each: expert, first row, rows
  /// up to 8): at most one a part-filled group of each expert, one per 8 rows else.
  static int64_t job_words(int64_t T, int64_t K, int64_t E) { return 3 * ((T * K + 7) / 8 + E); }
  /// Carves the arrays from `words` (at least words(T, K, E) of them).
  static ExpertRoutes in(void* words, int64_t T, int64_t K, int64_t E) {
    ExpertRoutes r;
    r.pair = static_cast<int32_t*>(words);
    r.weight = reinterpret_cast<float*>(r.pair + T * K);
    r.start = reinterpret_cast<int32_t*>(r.weight + T * K);
    r.token_of = r.start + E + 1;
    r.weight_of = reinterpret_cast<float*>(r.token_of + T * K);
    return r;
  }
};

/// One token: p (E scores, ld apart from the next token's) becomes softmax(p)
/// in ggml's order (exp(s - max), the sum in double, times its inverse); the
/// K largest (ties to the lower id) go to chosen/weight, renormalised to
/// sum 1 (the sum kept >= 2^-14) when `norm`.
inline void route_token(float* p, int64_t E, int64_t K, bool norm, int32_t* chosen, float* weight) {
  const float mx = *std::max_element(p, p + E);
  double sum = 0;
  for (int64_t e = 0; e < E; ++e) sum += double(p[e] = std::exp(p[e] - mx));
  const float inv = float(1.0 / sum);
  for (int64_t e = 0; e < E; ++e) p[e] *= inv;
  for (int64_t k = 0; k < K; ++k) {
    int32_t best = -1;
    for (int32_t e = 0; e < int32_t(E); ++e) {
      if (std::find(chosen, chosen + k, e) != chosen + k) continue;
      if (best < 0 || p[e] > p[best]) best = e;
    }
    chosen[k] = best;
    weight[k] = p[best];
  }
  if (norm) {
    float s = 0;
    for (int64_t k = 0; k < K; ++k) s += weight[k];
    s = std::max(s, 6.103515625e-5f);
    for (int64_t k = 0; k < K; ++k) weight[k] /= s;
  }
}

/// After route_token() for every token (chosen in r.pair, weights in
/// r.weight): groups the T x K (token, weight) pairs by expert, and turns
/// r.pair into each token's rows.
inline void group_routes(const ExpertRoutes& r, int64_t T, int64_t K, int64_t E) {
  std::fill(r.start, r.start + E + 1, 0);
  for (int64_t i = 0; i < T * K; ++i) ++r.start[r.pair[i] + 1];
  for (int64_t e = 0; e < E; ++e) r.start[e + 1] += r.start[e];
  for (int64_t t = 0; t < T; ++t)  // start[e] is each expert's cursor, then its end
    for (int64_t k = 0; k < K; ++k) {
      const int32_t at = r.start[r.pair[t * K + k]]++;
      r.token_of[at] = int32_t(t);
      r.weight_of[at] = r.weight[t * K + k];
      r.pair[t * K + k] = at;
    }
  for (int64_t e = E; e > 0; --e) r.start[e] = r.start[e - 1];
  r.start[0] = 0;
}

}  // namespace ds4
