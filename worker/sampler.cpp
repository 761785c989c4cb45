#include "worker/sampler.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "shared/error.h"

namespace ds4 {

namespace {

using Candidate = LogitCandidate;

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

// A row's passes go 16 floats at a time in GCC/Clang vector types (each lane
// a running max, best or sum; the lanes meet at the end), in an AVX-512,
// an AVX2 and a baseline version picked at load time. A 128K-token
// vocabulary's row took ~0.9 ms in one scalar pass of double exponentials:
// a step of 32 sampled slots on a GPU waited ~30 ms for its host.
typedef float F16 __attribute__((vector_size(64)));
typedef int32_t I16 __attribute__((vector_size(64)));
typedef double D8 __attribute__((vector_size(64)));
constexpr size_t kLanes = 16;

#define DS4_ROW_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))

// The helpers are macros: Clang refuses a 64-byte vector passed to or from a
// function outside an AVX-512 clone, even an inlined one.
#define DS4_SPLAT(x) (F16{} + (x))
// Lanes of `a` where `take` is set (all ones), else `b`'s.
#define DS4_BLEND(take, a, b) F16((I16(a) & (take)) | (I16(b) & ~(take)))
#define DS4_LOAD16(v, p) std::memcpy(&(v), (p), sizeof(v))

/// The largest logit, NaN skipped (-inf when there is none).
DS4_ROW_CLONES float row_max(std::span<const float> logits) {
  F16 lane = DS4_SPLAT(-std::numeric_limits<float>::infinity());
  const size_t n = logits.size(), whole = n - n % kLanes;
  for (size_t i = 0; i < whole; i += kLanes) {
    F16 x;
    DS4_LOAD16(x, &logits[i]);
    lane = DS4_BLEND(x > lane, x, lane);  // false for NaN
  }
  float max = -std::numeric_limits<float>::infinity();
  for (size_t j = 0; j < kLanes; ++j) max = lane[j] > max ? lane[j] : max;
  for (size_t i = whole; i < n; ++i) max = logits[i] > max ? logits[i] : max;
  return max;
}

/// sum(exp(logit - max)) in double, NaN skipped. Each term in float:
/// 2^((logit - max) log2 e) as 2^n times a degree-7 polynomial of the rest
/// (|rest| <= ln 2 / 2), relative error ~1e-7; anything below exp(-87) ~
/// 1e-38 (-inf too) counts that, which no sum of terms up to 1 tells from 0.
DS4_ROW_CLONES double sum_exp(std::span<const float> logits, float max) {
  D8 lo{}, hi{};
  const F16 m = DS4_SPLAT(max), low = DS4_SPLAT(-87.0f);
  const size_t n = logits.size(), whole = n - n % kLanes;
  for (size_t i = 0; i < whole; i += kLanes) {
    F16 x;
    DS4_LOAD16(x, &logits[i]);
    x = x - m;
    x = DS4_BLEND(x > low, x, low);  // NaN too
    const F16 t = x * 1.44269504088896341f;
    const I16 k = __builtin_convertvector(t - 0.5f, I16);  // toward zero: t's nearest integer (t <= 0)
    const F16 f = (t - __builtin_convertvector(k, F16)) * 0.69314718055994531f;
    F16 e = DS4_SPLAT(1.0f / 5040);
    e = e * f + 1.0f / 720;
    e = e * f + 1.0f / 120;
    e = e * f + 1.0f / 24;
    e = e * f + 1.0f / 6;
    e = e * f + 0.5f;
    e = e * f + 1.0f;
    e = e * f + 1.0f;
    e = e * F16((k + 127) << 23);
    lo += __builtin_convertvector(__builtin_shufflevector(e, e, 0, 1, 2, 3, 4, 5, 6, 7), D8);
    hi += __builtin_convertvector(__builtin_shufflevector(e, e, 8, 9, 10, 11, 12, 13, 14, 15), D8);
  }
  double sum = 0;
  for (size_t j = 0; j < 8; ++j) sum += lo[j] + hi[j];
  for (size_t i = whole; i < n; ++i)
    if (!std::isnan(logits[i])) sum += double(std::exp(logits[i] - max));
  return sum;
}

/// The greedy token: the largest logit, ties to the lowest id, NaN never
/// (the lowest id that is not NaN when nothing is above -inf).
DS4_ROW_CLONES int32_t best_token(std::span<const float> logits) {
  constexpr int32_t kNone = std::numeric_limits<int32_t>::max();
  F16 best = DS4_SPLAT(-std::numeric_limits<float>::infinity());
  I16 id = I16{} + kNone, at = I16{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const size_t n = logits.size(), whole = n - n % kLanes;
  for (size_t i = 0; i < whole; i += kLanes, at += int32_t(kLanes)) {
    F16 x;
    DS4_LOAD16(x, &logits[i]);
    const I16 take = x > best;  // strictly: a lane keeps the lowest id of a tie
    best = DS4_BLEND(take, x, best);
    id = (at & take) | (id & ~take);
  }
  Candidate out{-std::numeric_limits<float>::infinity(), kNone};
  for (size_t j = 0; j < kLanes; ++j)
    if (id[j] != kNone && better({best[j], id[j]}, out)) out = {best[j], id[j]};
  for (size_t i = whole; i < n; ++i)
    if (logits[i] > out.logit || (logits[i] == out.logit && int32_t(i) < out.id)) out = {logits[i], int32_t(i)};
  if (out.id != kNone) return out.id;
  for (size_t i = 0; i < n; ++i)  // nothing above -inf
    if (!std::isnan(logits[i])) return int32_t(i);
  return 0;
}

/// Into the heap of the k best so far (root: the worst of them), when better.
inline void offer(std::vector<Candidate>& heap, float x, size_t i) {
  if (!(x >= heap.front().logit)) return;  // NaN too
  const Candidate c{x, int32_t(i)};
  if (!better(c, heap.front())) return;
  std::pop_heap(heap.begin(), heap.end(), better);
  heap.back() = c;
  std::push_heap(heap.begin(), heap.end(), better);
}

/// offer() for logits[from, end): sixteen at a time against the heap's
/// worst, one by one only in the rare blocks that hold a better one.
DS4_ROW_CLONES void offer_row(std::span<const float> logits, size_t from, std::vector<Candidate>& heap) {
  const size_t n = logits.size();
  size_t i = from;
  for (; i + kLanes <= n; i += kLanes) {
    F16 x;
    DS4_LOAD16(x, &logits[i]);
    I16 hit = x >= DS4_SPLAT(heap.front().logit);
    hit |= __builtin_shufflevector(hit, hit, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    hit |= __builtin_shufflevector(hit, hit, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    hit |= __builtin_shufflevector(hit, hit, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    hit |= __builtin_shufflevector(hit, hit, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    if (hit[0] == 0) continue;  // most blocks
    for (size_t j = 0; j < kLanes; ++j) offer(heap, logits[i + j], i + j);
  }
  for (; i < n; ++i) offer(heap, logits[i], i);
}

/// The `k` best of `logits`, best first, in `out` (resized to k).
void select_best(std::span<const float> logits, size_t k, std::vector<Candidate>& out) {
  k = std::min(k, logits.size());
  out.clear();
  if (k == 0) return;
  out.reserve(k);
  if (k * 8 >= logits.size()) {  // many of them: select, then sort those
    out.resize(logits.size());
    for (size_t j = 0; j < logits.size(); ++j) out[j] = {clean(logits[j]), int32_t(j)};
    if (k < out.size()) std::nth_element(out.begin(), out.begin() + ptrdiff_t(k - 1), out.end(), better);
    out.resize(k);
    std::sort(out.begin(), out.end(), better);
    return;
  }
  for (size_t i = 0; i < k; ++i) out.push_back({clean(logits[i]), int32_t(i)});
  std::make_heap(out.begin(), out.end(), better);  // its root the worst of them
  offer_row(logits, k, out);
  std::sort_heap(out.begin(), out.end(), better);  // best first
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

/// top-p over every token of the row (top-k off), best first in `c`,
/// without sorting the row: min-p drops every token below the best's logit +
/// log(min_p) whatever top-p keeps, so only those above it are candidates;
/// and top-p's prefix is sought among the best 256, then 4 times as many,
/// ..., each prefix's probability taken against the whole row's sum.
/// `max` gets the row's best logit, `sum` sum_exp's (when top-p needed it).
void nucleus(std::span<const float> logits, const SamplingParams& p, std::vector<Candidate>& c, float& max,
             double& sum) {
  max = row_max(logits);
  size_t above = logits.size();
  if (p.min_p > 0.0f && std::isfinite(max)) {
    const double floor = double(max) + std::log(double(p.min_p));
    above = 0;
    for (float l : logits) above += double(l) >= floor ? 1 : 0;  // NaN: false
  }
  const bool top_p = p.top_p < 1.0f && std::isfinite(max);
  if (top_p) sum = sum_exp(logits, max);
  for (size_t k = top_p ? std::min<size_t>(256, above) : above;; k = std::min(k * 4, above)) {
    select_best(logits, k, c);
    if (!top_p) return;
    double cum = 0;
    for (size_t i = 0; i < c.size(); ++i) {
      cum += std::exp(double(c[i].logit) - max) / sum;
      if (cum >= p.top_p) {
        c.resize(i + 1);
        return;
      }
    }
    if (k == above) return;  // the prefix reaches past the min-p floor: min-p cuts it
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

void logit_adjustments(const SamplingParams& p, std::span<const int32_t> generated, int32_t n_vocab, int32_t row,
                       std::vector<LogitAdjust>& out, std::vector<int32_t>& scratch) {
  const size_t first = out.size();
  for (const auto& [token, bias] : p.logit_bias)
    if (token >= 0 && token < n_vocab) out.push_back({row, token, bias});
  std::stable_sort(out.begin() + ptrdiff_t(first), out.end(),
                   [](const LogitAdjust& a, const LogitAdjust& b) { return a.token < b.token; });
  size_t biases = first;  // merge a token named twice
  for (size_t i = first; i < out.size(); ++i) {
    if (biases > first && out[biases - 1].token == out[i].token) out[biases - 1].delta += out[i].delta;
    else out[biases++] = out[i];
  }
  out.resize(biases);
  if (p.frequency_penalty == 0 && p.presence_penalty == 0) return;
  scratch.clear();
  for (int32_t t : generated)
    if (t >= 0 && t < n_vocab) scratch.push_back(t);
  std::sort(scratch.begin(), scratch.end());
  size_t b = first;  // the biases, ascending: walked beside the generated tokens
  for (size_t i = 0; i < scratch.size();) {
    size_t j = i;
    while (j < scratch.size() && scratch[j] == scratch[i]) ++j;
    const int32_t token = scratch[i];
    const float penalty = float(j - i) * p.frequency_penalty + p.presence_penalty;
    while (b < biases && out[b].token < token) ++b;
    if (b < biases && out[b].token == token) out[b].delta -= penalty;
    else out.push_back({row, token, -penalty});
    i = j;
  }
  std::sort(out.begin() + ptrdiff_t(first), out.end(),
            [](const LogitAdjust& a, const LogitAdjust& b) { return a.token < b.token; });
}

std::span<const float> adjust_logits(std::span<const float> logits, const SamplingParams& p,
                                     std::span<const int32_t> generated, std::vector<float>& out,
                                     std::vector<int32_t>& scratch) {
  out.assign(logits.begin(), logits.end());
  thread_local std::vector<LogitAdjust> adds;
  adds.clear();
  logit_adjustments(p, generated, int32_t(std::min<size_t>(logits.size(), INT32_MAX)), 0, adds, scratch);
  for (const LogitAdjust& a : adds) out[size_t(a.token)] += a.delta;
  return out;
}

namespace {

/// Draws from `cand` (best first, top-k and top-p applied): min-p, then the
/// temperature's softmax and the uniform of output index `n`.
int32_t draw(std::vector<Candidate>& cand, const SamplingParams& p, uint64_t n, std::vector<float>& scratch) {
  keep_min_p(cand, p.min_p);
  softmax(cand, double(p.temperature), scratch);
  const double u = uniform(p.seed, n);
  double cum = 0;
  for (size_t i = 0; i < cand.size(); ++i) {
    cum += scratch[i];
    if (u < cum) return cand[i].id;
  }
  return cand.back().id;
}

}  // namespace

Sampled sample(std::span<const float> logits, const SamplingParams& p, uint64_t n, int n_top,
               std::vector<float>& scratch) {
  if (logits.empty()) throw Error("sample: no logits (empty vocabulary)");
  // Candidates live per thread so that repeated calls do not allocate.
  thread_local std::vector<Candidate> cand;

  Sampled out;
  float max = 0;     // the row's largest logit, NaN skipped
  double sum = -1;   // sum_exp(logits, max), once known
  if (p.temperature <= 0.0f) {
    out.token = best_token(logits);
    max = clean(logits[size_t(out.token)]);
  } else {
    // llama.cpp's default chain: top-k → top-p → min-p → temperature → draw.
    const size_t k = p.top_k > 0 ? std::min(size_t(p.top_k), logits.size()) : logits.size();
    if (k < logits.size()) {
      select_best(logits, k, cand);
      max = cand[0].logit;
      keep_top_p(cand, p.top_p, scratch);
    } else {
      nucleus(logits, p, cand, max, sum);  // top-k keeps every token: top-p over the whole row
    }
    out.token = draw(cand, p, n, scratch);
  }

  // log(sum(exp(logits))): -inf (or +inf) when the row has no finite best.
  const double lse = std::isinf(max) ? double(max) : max + std::log(sum >= 0 ? sum : sum_exp(logits, max));
  out.logprob = float(double(clean(logits[size_t(out.token)])) - lse);
  if (n_top > 0) {
    select_best(logits, size_t(n_top), cand);
    out.top.reserve(cand.size());
    for (const Candidate& c : cand) out.top.push_back({c.id, float(double(c.logit) - lse)});
  }
  return out;
}

bool samples_from_best(const SamplingParams& p, int n_top, size_t k, size_t n_vocab) {
  return p.temperature > 0.0f && p.top_k > 0 && size_t(p.top_k) <= k && size_t(p.top_k) < n_vocab &&
         size_t(std::max(n_top, 0)) <= k;
}

Sampled sample_best(std::span<const LogitCandidate> best, double lse, const SamplingParams& p, uint64_t n, int n_top,
                    std::vector<float>& scratch) {
  if (p.temperature <= 0.0f || p.top_k <= 0 || size_t(p.top_k) > best.size() || size_t(std::max(n_top, 0)) > best.size())
    throw Error("sample_best: " + std::to_string(best.size()) + " candidates cannot serve top_k " +
                std::to_string(p.top_k) + " with " + std::to_string(n_top) + " alternatives");
  thread_local std::vector<Candidate> cand;
  cand.assign(best.begin(), best.begin() + p.top_k);
  keep_top_p(cand, p.top_p, scratch);
  Sampled out;
  out.token = draw(cand, p, n, scratch);
  for (const LogitCandidate& c : best.first(size_t(p.top_k)))
    if (c.id == out.token) out.logprob = float(double(c.logit) - lse);
  for (const LogitCandidate& c : best.first(size_t(std::max(n_top, 0))))
    out.top.push_back({c.id, float(double(c.logit) - lse)});
  return out;
}

}  // namespace ds4
