// perplexity: the --save-logits file's round trip, the log-prob encoding's
// precision, and the statistics (mean and error, median, percentiles, KL
// divergence, same top) on hand-made inputs.
#include <doctest/doctest.h>

#include <cmath>
#include <random>
#include <sstream>
#include <vector>

#include "shared/error.h"
#include "worker/perplexity.h"

using namespace ds4;

namespace {

std::vector<float> random_logits(size_t n, uint32_t seed, float scale = 4.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

double exact_kl(const std::vector<float>& p_logits, const std::vector<float>& q_logits) {
  auto lse = [](const std::vector<float>& l) {
    double m = l[0], s = 0;
    for (float x : l) m = std::max(m, double(x));
    for (float x : l) s += std::exp(x - m);
    return m + std::log(s);
  };
  const double lp = lse(p_logits), lq = lse(q_logits);
  double kl = 0;
  for (size_t i = 0; i < p_logits.size(); ++i) {
    const double a = p_logits[i] - lp, b = q_logits[i] - lq;
    kl += std::exp(a) * (a - b);
  }
  return kl;
}

}  // namespace

TEST_CASE("perplexity: mean and error as llama-perplexity computes them") {
  // Values 1, 2, 3, 4: mean 2.5, population variance 1.25, error sqrt(1.25/3).
  const MeanError m = mean_and_error(10, 30, 4);
  CHECK(m.mean == doctest::Approx(2.5));
  CHECK(m.error == doctest::Approx(std::sqrt(1.25 / 3)));
  CHECK(mean_and_error(5, 25, 1).error == 0);  // one value: no error
  CHECK(mean_and_error(0, 0, 0).mean == 0);
  CHECK(mean_and_error(6, 12, 3).error == 0);  // all equal: variance 0
}

TEST_CASE("perplexity: median and percentiles interpolate linearly") {
  const std::vector<float> odd = {1, 2, 3, 4, 5};
  const std::vector<float> even = {1, 2, 3, 10};
  CHECK(median(odd) == 3);
  CHECK(median(even) == 2.5);
  CHECK(median(std::vector<float>{}) == 0);
  CHECK(percentile(odd, 0) == 1);
  CHECK(percentile(odd, 1) == 5);
  CHECK(percentile(odd, 0.5) == 3);
  CHECK(percentile(odd, 0.99) == doctest::Approx(4.96));  // 0.99 * 4 = 3.96: 4 + 0.96 * (5 - 4)
  CHECK(percentile(even, 0.999) == doctest::Approx(3 + 0.997 * 7));
}

TEST_CASE("perplexity: a row's log-probs are kept to within 1.9e-4 nats, the range cut at 24") {
  const std::vector<float> logits = random_logits(1000, 3, 8.0f);
  std::vector<uint16_t> row(logits.size() + kRowHeader);
  encode_log_probs(logits, 17, row.data());
  std::vector<double> lp;
  const double next = decode_log_probs(row.data(), int64_t(logits.size()), lp);
  double m = logits[0], s = 0;
  for (float x : logits) m = std::max(m, double(x));
  for (float x : logits) s += std::exp(x - m);
  const double lse = m + std::log(s);
  int cut = 0;
  for (size_t i = 0; i < logits.size(); ++i) {
    const double want = logits[i] - lse;
    if (want - (m - lse) <= -kLogProbRange) {
      CHECK(std::isinf(lp[i]));
      ++cut;
    } else {
      CHECK(std::fabs(lp[i] - want) < 1.9e-4);
    }
  }
  CHECK(cut > 0);  // scale 8 over 1000 tokens spans more than 24 nats
  CHECK(next == doctest::Approx(logits[17] - lse).epsilon(1e-6));
  // A narrow row keeps its whole range, its lowest too.
  const std::vector<float> narrow = {0.0f, 1.0f, 2.0f};
  std::vector<uint16_t> r3(3 + kRowHeader);
  encode_log_probs(narrow, 0, r3.data());
  decode_log_probs(r3.data(), 3, lp);
  CHECK(std::isfinite(lp[0]));
  CHECK(lp[0] == doctest::Approx(-2 - std::log(1 + std::exp(-1.0) + std::exp(-2.0))).epsilon(1e-6));
}

TEST_CASE("perplexity: the log-prob file's header round trip and its errors") {
  LogProbHeader h;
  h.n_vocab = 512;
  h.n_ctx = 4;
  h.n_chunks = 2;
  h.tokens = {1, 5, 6, 7, 8, 9, 10, 11};
  std::stringstream ss;
  write_log_prob_header(ss, h);
  CHECK(ss.str().size() == 8 + 4 * 4 + 8 * 4);
  const LogProbHeader back = read_log_prob_header(ss, "f");
  CHECK(back.n_vocab == 512);
  CHECK(back.n_ctx == 4);
  CHECK(back.n_chunks == 2);
  CHECK(back.tokens == h.tokens);

  std::stringstream bad("not a log-prob file at all");
  CHECK_THROWS_WITH_AS(read_log_prob_header(bad, "x.bin"), doctest::Contains("not a file of log-probs"), Error);
  std::string cut;
  {
    std::stringstream s2;
    write_log_prob_header(s2, h);
    cut = s2.str().substr(0, 30);
  }
  std::stringstream short_in(cut);
  CHECK_THROWS_WITH_AS(read_log_prob_header(short_in, "x.bin"), doctest::Contains("cut short"), Error);
}

TEST_CASE("perplexity: KL divergence of a row against itself is 0, against another its exact value") {
  const std::vector<float> p = random_logits(300, 11, 2.0f);
  const std::vector<float> q = random_logits(300, 12, 2.0f);
  std::vector<uint16_t> base(p.size() + kRowHeader);
  encode_log_probs(p, 7, base.data());
  KlStats s;
  add_kl_position(s, p, base.data(), 7);
  CHECK(s.count == 1);
  CHECK(std::fabs(s.kld[0]) < 1e-8);
  CHECK(s.same_top == 1);
  CHECK(s.sum_nll == doctest::Approx(negative_log_prob(p, 7)).epsilon(1e-9));
  CHECK(s.sum_nll_base == doctest::Approx(s.sum_nll).epsilon(1e-6));
  add_kl_position(s, q, base.data(), 7);
  CHECK(s.count == 2);
  CHECK(s.kld[1] == doctest::Approx(exact_kl(p, q)).epsilon(1e-3));
  CHECK(s.kld[1] > 0.1);
  // Same top: the argmax of p and q differ for these seeds unless they happen to agree.
  const auto argmax = [](const std::vector<float>& v) { return std::max_element(v.begin(), v.end()) - v.begin(); };
  CHECK(s.same_top == 1 + (argmax(p) == argmax(q)));
  const std::string sum = kl_summary(s);
  CHECK(sum.find("Mean    KLD:") != std::string::npos);
  CHECK(sum.find("Same top p:") != std::string::npos);
  CHECK(sum.find("Mean PPL(Q)/PPL(base)") != std::string::npos);
}

TEST_CASE("perplexity: negative log-prob of a uniform row is log(n)") {
  const std::vector<float> flat(64, 3.0f);
  CHECK(negative_log_prob(flat, 5) == doctest::Approx(std::log(64.0)));
  std::vector<uint16_t> row(64 + kRowHeader);
  encode_log_probs(flat, 0, row.data());
  std::vector<double> lp;
  decode_log_probs(row.data(), 64, lp);
  for (double x : lp) CHECK(x == doctest::Approx(-std::log(64.0)).epsilon(1e-6));
}
