#include "worker/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "shared/error.h"

namespace ds4 {

namespace {

struct Candidate {
  float logit;
  int32_t id;
};

// Better first: higher logit, then lower id, so that every ordering is total
// and greedy ties go to the lowest id.
bool better(const Candidate& a, const Candidate& b) {
  return a.logit > b.logit || (a.logit == b.logit && a.id < b.id);
}

// A NaN logit never wins and never breaks the ordering.
float clean(float x) { return std::isnan(x) ? -std::numeric_limits<float>::infinity() : x; }

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/// The uniform in [0, 1) for output index `n` of a request seeded with `seed`.
double uniform(uint64_t seed, uint64_t n) {
  const uint64_t bits = splitmix64(splitmix64(seed) ^ n);
  return double(bits >> 11) * 0x1.0p-53;
}

/// log(sum(exp(logits))), skipping NaN.
double log_sum_exp(std::span<const float> logits) {
  float max = -std::numeric_limits<float>::infinity();
  for (float l : logits) max = std::max(max, clean(l));
  if (std::isinf(max)) return max;  // all -inf (or +inf): nothing sensible to normalise
  double sum = 0;
  for (float l : logits) sum += std::exp(double(clean(l)) - max);
  return max + std::log(sum);
}

/// The `k` best of `logits`, best first, in `out` (resized to k).
void select_best(std::span<const float> logits, size_t k, std::vector<Candidate>& out) {
  out.resize(logits.size());
  for (size_t i = 0; i < logits.size(); ++i) out[i] = {clean(logits[i]), int32_t(i)};
  k = std::min(k, out.size());
  std::partial_sort(out.begin(), out.begin() + ptrdiff_t(k), out.end(), better);
  out.resize(k);
}

/// Softmax of the (sorted) candidates' logits divided by `temp`, into `probs`.
void softmax(const std::vector<Candidate>& c, double temp, std::vector<float>& probs) {
  probs.resize(c.size());
  double sum = 0;
  for (size_t i = 0; i < c.size(); ++i) {
    // Equal to the best counts 1 even when the best is infinite.
    const double p =
        c[i].logit == c[0].logit ? 1.0 : std::exp((double(c[i].logit) - c[0].logit) / temp);
    probs[i] = float(p);
    sum += p;
  }
  for (float& p : probs) p = float(p / sum);
}

/// top-p: the shortest prefix whose probability reaches p (at least one token).
void keep_top_p(std::vector<Candidate>& c, float top_p, std::vector<float>& probs) {
  if (top_p >= 1.0f || c.size() <= 1) return;
  softmax(c, 1.0, probs);
  double cum = 0;
  for (size_t i = 0; i < c.size(); ++i) {
    cum += probs[i];
    if (cum >= top_p) {
      c.resize(i + 1);
      return;
    }
  }
}

/// min-p: drop tokens whose probability is below min_p times the best one's.
void keep_min_p(std::vector<Candidate>& c, float min_p) {
  if (min_p <= 0.0f || c.size() <= 1) return;
  const double floor = double(c[0].logit) + std::log(double(min_p));
  size_t keep = 1;
  while (keep < c.size() && double(c[keep].logit) >= floor) ++keep;
  c.resize(keep);
}

}  // namespace

std::span<const float> adjust_logits(std::span<const float> logits, const SamplingParams& p,
                                     std::span<const int32_t> generated, std::vector<float>& out,
                                     std::vector<int32_t>& counts) {
  const size_t n_vocab = logits.size();
  out.assign(logits.begin(), logits.end());
  for (const auto& [token, bias] : p.logit_bias)
    if (token >= 0 && size_t(token) < n_vocab) out[size_t(token)] += bias;
  if (p.frequency_penalty != 0 || p.presence_penalty != 0) {
    counts.assign(n_vocab, 0);
    for (int32_t t : generated)
      if (t >= 0 && size_t(t) < n_vocab) ++counts[size_t(t)];
    for (int32_t t : generated) {
      if (t < 0 || size_t(t) >= n_vocab || counts[size_t(t)] == 0) continue;
      out[size_t(t)] -= float(counts[size_t(t)]) * p.frequency_penalty + p.presence_penalty;
      counts[size_t(t)] = 0;  // once per distinct token
    }
  }
  return out;
}

Sampled sample(std::span<const float> logits, const SamplingParams& p, uint64_t n, int n_top,
               std::vector<float>& scratch) {
  if (logits.empty()) throw Error("sample: no logits (empty vocabulary)");
  // Candidates live per thread so that repeated calls do not allocate.
  thread_local std::vector<Candidate> cand;

  Sampled out;
  if (p.temperature <= 0.0f) {
    Candidate best{clean(logits[0]), 0};
    for (size_t i = 1; i < logits.size(); ++i) {
      const Candidate c{clean(logits[i]), int32_t(i)};
      if (better(c, best)) best = c;
    }
    out.token = best.id;
  } else {
    // llama.cpp's default chain: top-k → top-p → min-p → temperature → draw.
    const size_t k = p.top_k > 0 ? size_t(p.top_k) : logits.size();
    select_best(logits, k, cand);
    keep_top_p(cand, p.top_p, scratch);
    keep_min_p(cand, p.min_p);
    softmax(cand, double(p.temperature), scratch);
    const double u = uniform(p.seed, n);
    double cum = 0;
    out.token = cand.back().id;
    for (size_t i = 0; i < cand.size(); ++i) {
      cum += scratch[i];
      if (u < cum) {
        out.token = cand[i].id;
        break;
      }
    }
  }

  const double lse = log_sum_exp(logits);
  out.logprob = float(double(clean(logits[size_t(out.token)])) - lse);
  if (n_top > 0) {
    select_best(logits, size_t(n_top), cand);
    out.top.reserve(cand.size());
    for (const Candidate& c : cand) out.top.push_back({c.id, float(double(c.logit) - lse)});
  }
  return out;
}

}  // namespace ds4
