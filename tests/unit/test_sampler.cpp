// Sampler: greedy and its ties, the truncation chain, the counter-based
// randomness (a draw depends only on seed and output index), the shape of the
// distribution, and log-probs against a hand computation.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "shared/error.h"
#include "worker/sampler.h"

using namespace ds4;

namespace {

SamplingParams plain(float temperature, uint64_t seed = 1) {
  SamplingParams p;
  p.temperature = temperature;
  p.top_k = 0;
  p.top_p = 1.0f;
  p.min_p = 0.0f;
  p.seed = seed;
  return p;
}

std::vector<float> random_logits(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  std::vector<float> v(n);
  for (float& x : v) x = nd(rng);
  return v;
}

int32_t draw(const std::vector<float>& logits, const SamplingParams& p, uint64_t n) {
  std::vector<float> scratch;
  return sample(logits, p, n, 0, scratch).token;
}

}  // namespace

TEST_CASE("sampler: greedy takes the largest logit, ties to the lowest id") {
  std::vector<float> scratch;
  const SamplingParams g = plain(0.0f);
  CHECK(sample(std::vector<float>{0.1f, 2.0f, -1.0f}, g, 0, 0, scratch).token == 1);
  CHECK(sample(std::vector<float>{1.0f, 3.0f, 3.0f, 2.0f}, g, 0, 0, scratch).token == 1);
  CHECK(sample(std::vector<float>{5.0f, 5.0f}, g, 7, 0, scratch).token == 0);
  SamplingParams neg = g;
  neg.temperature = -1.0f;
  CHECK(sample(std::vector<float>{0.0f, 0.0f, 9.0f}, neg, 3, 0, scratch).token == 2);
  // A NaN never wins.
  const float nan = std::numeric_limits<float>::quiet_NaN();
  CHECK(sample(std::vector<float>{nan, 1.0f, nan}, g, 0, 0, scratch).token == 1);
}

TEST_CASE("sampler: the same seed and index give the same token") {
  const std::vector<float> logits = random_logits(1000, 1);
  SamplingParams p;  // defaults: temperature 0.8, top-k 40, top-p 0.95, min-p 0.05
  p.seed = 1234;
  std::vector<int32_t> first, again;
  for (uint64_t n = 0; n < 200; ++n) first.push_back(draw(logits, p, n));
  // In reverse order: a draw does not depend on the calls before it.
  for (uint64_t n = 200; n-- > 0;) again.insert(again.begin(), draw(logits, p, n));
  CHECK(first == again);

  p.seed = 1235;
  std::vector<int32_t> other;
  for (uint64_t n = 0; n < 200; ++n) other.push_back(draw(logits, p, n));
  CHECK(first != other);
}

TEST_CASE("sampler: truncations that leave one token equal greedy") {
  for (uint32_t s = 0; s < 20; ++s) {
    const std::vector<float> logits = random_logits(4096, s);
    const int32_t greedy = draw(logits, plain(0.0f), 0);
    for (uint64_t n = 0; n < 10; ++n) {
      SamplingParams k1 = plain(1.5f, s);
      k1.top_k = 1;
      CHECK(draw(logits, k1, n) == greedy);
      SamplingParams p0 = plain(1.5f, s);
      p0.top_p = 1e-6f;
      CHECK(draw(logits, p0, n) == greedy);
      SamplingParams m1 = plain(1.5f, s);
      m1.min_p = 1.0f;
      CHECK(draw(logits, m1, n) == greedy);
    }
  }
}

TEST_CASE("sampler: two equal logits are both drawn") {
  const std::vector<float> logits = {-10.0f, 2.0f, 2.0f, -10.0f};
  int counts[4] = {};
  for (uint64_t n = 0; n < 2000; ++n) ++counts[draw(logits, plain(1.0f, 99), n)];
  CHECK(counts[1] > 900);
  CHECK(counts[2] > 900);
  CHECK(counts[0] + counts[3] < 10);  // each has probability ~3e-6
}

TEST_CASE("sampler: frequencies follow the softmax, temperature sharpens") {
  const std::vector<float> logits = {std::log(0.5f), std::log(0.3f), std::log(0.2f)};
  const int draws = 20000;
  int counts[3] = {};
  for (uint64_t n = 0; n < uint64_t(draws); ++n) ++counts[draw(logits, plain(1.0f, 7), n)];
  CHECK(counts[0] / double(draws) == doctest::Approx(0.5).epsilon(0.05));
  CHECK(counts[1] / double(draws) == doctest::Approx(0.3).epsilon(0.05));
  CHECK(counts[2] / double(draws) == doctest::Approx(0.2).epsilon(0.07));

  // Temperature 0.5 squares the probabilities: 25 : 9 : 4.
  int cold[3] = {};
  for (uint64_t n = 0; n < uint64_t(draws); ++n) ++cold[draw(logits, plain(0.5f, 7), n)];
  CHECK(cold[0] / double(draws) == doctest::Approx(25.0 / 38).epsilon(0.05));
  CHECK(cold[2] / double(draws) == doctest::Approx(4.0 / 38).epsilon(0.1));
}

TEST_CASE("sampler: top-k, top-p and min-p cut where they should") {
  // Probabilities 0.4, 0.3, 0.2, 0.1.
  const std::vector<float> logits = {std::log(0.4f), std::log(0.3f), std::log(0.2f),
                                     std::log(0.1f)};
  auto seen = [&](const SamplingParams& p) {
    std::vector<bool> s(logits.size());
    for (uint64_t n = 0; n < 3000; ++n) s[size_t(draw(logits, p, n))] = true;
    return s;
  };
  SamplingParams k2 = plain(1.0f);
  k2.top_k = 2;
  CHECK(seen(k2) == std::vector<bool>{true, true, false, false});
  SamplingParams p65 = plain(1.0f);
  p65.top_p = 0.65f;  // 0.4 + 0.3 reaches it
  CHECK(seen(p65) == std::vector<bool>{true, true, false, false});
  SamplingParams p75 = plain(1.0f);
  p75.top_p = 0.75f;
  CHECK(seen(p75) == std::vector<bool>{true, true, true, false});
  SamplingParams m = plain(1.0f);
  m.min_p = 0.45f;  // keeps p >= 0.18
  CHECK(seen(m) == std::vector<bool>{true, true, true, false});
  SamplingParams all = plain(1.0f);
  CHECK(seen(all) == std::vector<bool>{true, true, true, true});
}

TEST_CASE("sampler: log-probs are the log-softmax of the raw logits") {
  const std::vector<float> logits = {1.0f, 2.0f, 3.0f};
  // log(e^1 + e^2 + e^3) = 3.40760596
  const double lse = 3.4076059644443806;
  std::vector<float> scratch;
  const Sampled g = sample(logits, plain(0.0f), 0, 2, scratch);
  CHECK(g.token == 2);
  CHECK(g.logprob == doctest::Approx(3.0 - lse).epsilon(1e-6));
  REQUIRE(g.top.size() == 2);
  CHECK(g.top[0].token == 2);
  CHECK(g.top[0].logprob == doctest::Approx(3.0 - lse).epsilon(1e-6));
  CHECK(g.top[1].token == 1);
  CHECK(g.top[1].logprob == doctest::Approx(2.0 - lse).epsilon(1e-6));

  // Temperature and truncation change the draw, not the reported log-probs.
  SamplingParams hot = plain(2.0f, 5);
  hot.top_k = 2;
  for (uint64_t n = 0; n < 50; ++n) {
    const Sampled s = sample(logits, hot, n, 5, scratch);
    CHECK(s.token != 0);
    CHECK(s.logprob == doctest::Approx(logits[size_t(s.token)] - lse).epsilon(1e-6));
    REQUIRE(s.top.size() == 3);  // n_top beyond the vocabulary: all of it
    CHECK(s.top[2].token == 0);
    CHECK(s.top[2].logprob == doctest::Approx(1.0 - lse).epsilon(1e-6));
  }

  // Large logits do not overflow.
  const Sampled big = sample(std::vector<float>{1000.0f, 1000.0f}, plain(0.0f), 0, 1, scratch);
  CHECK(big.logprob == doctest::Approx(-std::log(2.0)).epsilon(1e-6));
}

TEST_CASE("sampler: logit_bias and OpenAI's penalties adjust a copy of the logits") {
  const std::vector<float> logits = {1.0f, 2.0f, 3.0f, 0.5f};
  SamplingParams p = plain(0);
  std::vector<float> out;
  std::vector<int32_t> counts;
  const std::vector<int32_t> generated = {2, 2, 2, 1, 3};
  // No adjustment asked: the same logits.
  CHECK_FALSE(p.adjusts());
  auto a = adjust_logits(logits, p, generated, out, counts);
  CHECK(std::vector<float>(a.begin(), a.end()) == logits);
  p.frequency_penalty = 0.5f;
  p.presence_penalty = 0.25f;
  p.logit_bias = {{0, 10.0f}, {3, -1.0f}};
  CHECK(p.adjusts());
  a = adjust_logits(logits, p, generated, out, counts);
  // token 0: +10 (never generated); 1: once (-0.5 - 0.25); 2: three times (-1.5 - 0.25); 3: -1, once (-0.75).
  CHECK(a[0] == doctest::Approx(11.0f));
  CHECK(a[1] == doctest::Approx(1.25f));
  CHECK(a[2] == doctest::Approx(1.25f));
  CHECK(a[3] == doctest::Approx(-1.25f));
  CHECK(logits[2] == 3.0f);  // the backend's row is left alone
  CHECK(draw(std::vector<float>(a.begin(), a.end()), p, 0) == 0);  // the bias decides greedy
  // The prompt does not count: an answer with no tokens yet gets the biases alone.
  a = adjust_logits(logits, p, {}, out, counts);
  CHECK(a[2] == 3.0f);
  // Negative penalties favour repeats; ids outside the vocabulary are ignored.
  p.frequency_penalty = -2.0f;
  p.presence_penalty = 0;
  p.logit_bias = {{99, 5.0f}};
  a = adjust_logits(logits, p, std::vector<int32_t>{3, 3, 77}, out, counts);
  CHECK(a[3] == doctest::Approx(4.5f));
  CHECK(a.size() == 4);
}

TEST_CASE("sampler: logit_adjustments lists one sum a token, ascending, for the backend to add") {
  SamplingParams p = plain(0);
  std::vector<LogitAdjust> out{{9, 1, 1.0f}};  // appended after what is there
  std::vector<int32_t> scratch;
  p.logit_bias = {{7, 1.0f}, {2, -3.0f}, {7, 0.5f}, {-1, 4.0f}, {50, 4.0f}};
  p.frequency_penalty = 0.5f;
  p.presence_penalty = 0.25f;
  logit_adjustments(p, std::vector<int32_t>{5, 7, 5, 5, 60}, 10, 3, out, scratch);
  // 2: its bias; 5: generated 3 times (-1.5 - 0.25); 7: 1.5 of bias, once generated (-0.75);
  // the ids outside [0, 10) are dropped.
  REQUIRE(out.size() == 4);
  CHECK(out[0].row == 9);
  const std::vector<std::pair<int32_t, float>> want{{2, -3.0f}, {5, -1.75f}, {7, 0.75f}};
  for (size_t i = 0; i < want.size(); ++i) {
    CAPTURE(i);
    CHECK(out[i + 1].row == 3);
    CHECK(out[i + 1].token == want[i].first);
    CHECK(out[i + 1].delta == doctest::Approx(want[i].second));
  }
  // Nothing asked: nothing listed.
  out.clear();
  logit_adjustments(plain(0), std::vector<int32_t>{1, 2}, 10, 0, out, scratch);
  CHECK(out.empty());
}

TEST_CASE("sampler: no logits is an error") {
  std::vector<float> scratch;
  CHECK_THROWS_AS(sample(std::vector<float>{}, plain(1.0f), 0, 0, scratch), Error);
}

namespace {

// The truncation chain written plainly over a whole sorted row, for the
// vocabulary-sized case below: what sample() must pick.
int32_t reference_draw(const std::vector<float>& logits, const SamplingParams& p, uint64_t n) {
  std::vector<std::pair<float, int32_t>> c;
  for (size_t i = 0; i < logits.size(); ++i)
    c.push_back({std::isnan(logits[i]) ? -std::numeric_limits<float>::infinity() : logits[i], int32_t(i)});
  std::sort(c.begin(), c.end(), [](auto& a, auto& b) { return a.first > b.first || (a.first == b.first && a.second < b.second); });
  if (p.top_k > 0) c.resize(std::min(c.size(), size_t(p.top_k)));
  if (p.top_p < 1.0f) {
    double sum = 0, cum = 0;
    for (auto& x : c) sum += std::exp(double(x.first) - c[0].first);
    for (size_t i = 0; i < c.size(); ++i) {
      cum += std::exp(double(c[i].first) - c[0].first) / sum;
      if (cum >= p.top_p) {
        c.resize(i + 1);
        break;
      }
    }
  }
  if (p.min_p > 0.0f) {
    size_t keep = 1;
    while (keep < c.size() && double(c[keep].first) >= double(c[0].first) + std::log(double(p.min_p))) ++keep;
    c.resize(keep);
  }
  // The draw itself: sample() over the survivors alone (its own softmax and uniform).
  std::vector<float> cut(logits.size(), -std::numeric_limits<float>::infinity());
  SamplingParams only = p;
  only.top_k = int32_t(c.size());
  only.top_p = 1.0f;
  only.min_p = 0.0f;
  for (auto& x : c) cut[size_t(x.second)] = x.first;
  std::vector<float> scratch;
  return sample(cut, only, n, 0, scratch).token;
}

}  // namespace

TEST_CASE("sampler: a vocabulary-sized row gives the tokens and log-probs of a plain computation") {
  // 128256 tokens (Llama 3's; not a multiple of the 16 lanes), with NaN, -inf
  // and ties between lanes and in the tail.
  for (uint32_t seed : {1u, 2u, 3u}) {
    CAPTURE(seed);
    std::vector<float> row = random_logits(128256, seed);
    const float nan = std::numeric_limits<float>::quiet_NaN();
    for (size_t i = 5; i < row.size(); i += 997) row[i] = nan;
    for (size_t i = 11; i < row.size(); i += 1009) row[i] = -std::numeric_limits<float>::infinity();
    const size_t top = size_t(std::max_element(row.begin(), row.end(), [](float a, float b) {
                                return std::isnan(b) ? false : std::isnan(a) || a < b;
                              }) - row.begin());
    std::vector<float> scratch;
    const SamplingParams g = plain(0.0f);
    Sampled s = sample(row, g, 0, 3, scratch);
    CHECK(s.token == int32_t(top));
    double max = -INFINITY, sum = 0;
    for (float x : row)
      if (!std::isnan(x)) max = std::max(max, double(x));
    for (float x : row)
      if (!std::isnan(x)) sum += std::exp(double(x) - max);
    const double lse = max + std::log(sum);
    CHECK(s.logprob == doctest::Approx(double(row[top]) - lse).epsilon(1e-6));
    REQUIRE(s.top.size() == 3);
    CHECK(s.top[0].token == int32_t(top));
    // A tie with the best, in an earlier lane, then in the tail: the lowest id wins.
    std::vector<float> tie = row;
    tie[top - 7] = row[top];
    CHECK(sample(tie, g, 0, 0, scratch).token == int32_t(top - 7));
    tie = row;
    tie.back() = tie[tie.size() - 2] = row[top] + 1.0f;
    CHECK(sample(tie, g, 0, 0, scratch).token == int32_t(row.size() - 2));

    SamplingParams nucleus = plain(0.8f, seed);
    nucleus.top_p = 0.9f;
    nucleus.min_p = 0.05f;
    SamplingParams wide = plain(1.0f, seed);
    wide.top_p = 0.5f;  // no min-p: top-p alone, past the first 256 tokens of these flat rows
    SamplingParams minp = plain(1.2f, seed);
    minp.min_p = 0.1f;
    SamplingParams defaults;
    defaults.seed = seed;
    for (const SamplingParams& p : {nucleus, wide, minp, defaults})
      for (uint64_t n = 0; n < 40; ++n) {
        CAPTURE(n);
        CHECK(sample(row, p, n, 0, scratch).token == reference_draw(row, p, n));
      }
  }
  // A row of NaN and -inf: greedy takes the first that is not NaN.
  std::vector<float> none(40, std::numeric_limits<float>::quiet_NaN());
  none[33] = -std::numeric_limits<float>::infinity();
  std::vector<float> scratch;
  CHECK(sample(none, plain(0.0f), 0, 0, scratch).token == 33);
}

namespace {

/// A row's best `k` as the backends rank them (higher logit, then lower id;
/// NaN as -inf), and its log-sum-exp in double: the reference for
/// sample_best() and the CUDA backend's best_logits().
std::pair<std::vector<LogitCandidate>, double> reference_best(const std::vector<float>& row, size_t k) {
  std::vector<LogitCandidate> c;
  for (size_t i = 0; i < row.size(); ++i)
    c.push_back({std::isnan(row[i]) ? -std::numeric_limits<float>::infinity() : row[i], int32_t(i)});
  std::stable_sort(c.begin(), c.end(), [](const LogitCandidate& a, const LogitCandidate& b) { return a.logit > b.logit; });
  c.resize(std::min(k, c.size()));
  const double max = c[0].logit;
  double sum = 0;
  for (float x : row)
    if (!std::isnan(x)) sum += std::exp(double(x) - max);
  return {c, std::isinf(max) ? max : max + std::log(sum)};
}

/// Rows with ties (some at ±0), NaN and -inf among their best.
std::vector<std::vector<float>> awkward_rows(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> g(0.0f, 3.0f);
  std::vector<std::vector<float>> rows;
  for (int r = 0; r < 4; ++r) {
    std::vector<float> row(n);
    for (float& x : row) x = r == 3 ? -std::fabs(g(rng)) : g(rng);
    if (r == 3)  // the best at zero, of either sign
      for (size_t i = 0; i < n; i += 7) row[i] = (i / 7) % 2 ? -0.0f : 0.0f;
    const size_t best = size_t(std::max_element(row.begin(), row.end()) - row.begin());
    for (size_t i = 0; i < 20; ++i) row[(best + 97 * (i + 1)) % n] = row[best] - float(i % 4);  // ties near the top
    row[(best + 5) % n] = std::numeric_limits<float>::quiet_NaN();
    row[(best + 6) % n] = -std::numeric_limits<float>::infinity();
    rows.push_back(row);
  }
  return rows;
}

}  // namespace

TEST_CASE("sampler: sample_best from a row's best 64 logits and its log-sum-exp is sample() of the row") {
  std::vector<float> scratch;
  int compared = 0;
  for (const auto& row : awkward_rows(5000, 3)) {
    const auto [best, lse] = reference_best(row, 64);
    for (float temp : {0.3f, 0.8f, 1.5f})
      for (int top_k : {1, 7, 40, 64})
        for (float top_p : {0.9f, 1.0f})
          for (float min_p : {0.0f, 0.05f})
            for (uint64_t seed : {1u, 2u, 3u}) {
              SamplingParams p = plain(temp, seed);
              p.top_k = top_k;
              p.top_p = top_p;
              p.min_p = min_p;
              const int n_top = int(seed % 3) * 2;
              REQUIRE(samples_from_best(p, n_top, best.size(), row.size()));
              const Sampled want = sample(row, p, seed * 7, n_top, scratch);
              const Sampled got = sample_best(best, lse, p, seed * 7, n_top, scratch);
              CAPTURE(temp);
              CAPTURE(top_k);
              CHECK(got.token == want.token);
              CHECK(got.logprob == doctest::Approx(want.logprob).epsilon(1e-5));
              REQUIRE(got.top.size() == want.top.size());
              for (size_t i = 0; i < got.top.size(); ++i) {
                CHECK(got.top[i].token == want.top[i].token);
                CHECK(got.top[i].logprob == doctest::Approx(want.top[i].logprob).epsilon(1e-5));
              }
              ++compared;
            }
  }
  CHECK(compared == 4 * 3 * 4 * 2 * 2 * 3);
  // What the best 64 cannot serve: greedy, top-k off or above 64, more alternatives.
  SamplingParams p = plain(0.8f);
  CHECK_FALSE(samples_from_best(plain(0), 0, 64, 5000));
  p.top_k = 0;
  CHECK_FALSE(samples_from_best(p, 0, 64, 5000));
  p.top_k = 65;
  CHECK_FALSE(samples_from_best(p, 0, 64, 5000));
  p.top_k = 40;
  CHECK_FALSE(samples_from_best(p, 65, 64, 5000));
  CHECK_FALSE(samples_from_best(p, 0, 64, 40));  // top-k keeps the whole row: sample() takes top-p over all of it
  CHECK_THROWS_AS(sample_best(std::vector<LogitCandidate>(10, {1.0f, 0}), 0.0, p, 0, 0, scratch), Error);
}
