#include "worker/perplexity.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>

#include <nlohmann/json.hpp>

#include "shared/error.h"
#include "worker/backend.h"

namespace ds4 {
namespace {

constexpr char kMagic[8] = {'d', 's', '4', 'l', 'o', 'g', 'p', '\0'};
constexpr uint16_t kFloor = 65535;

void put_u32(std::ostream& out, uint32_t v) { out.write(reinterpret_cast<const char*>(&v), sizeof v); }

uint32_t get_u32(std::istream& in, const std::string& what) {
  uint32_t v = 0;
  if (!in.read(reinterpret_cast<char*>(&v), sizeof v)) throw Error(what + ": cut short in its header");
  return v;
}

/// The largest logit (its lowest id) and the row's log-sum-exp, in double.
struct RowMax {
  int64_t arg = 0;
  double max = 0;
  double lse = 0;
};

RowMax row_max(std::span<const float> logits) {
  RowMax r;
  r.max = logits[0];
  for (size_t i = 1; i < logits.size(); ++i)
    if (logits[i] > r.max) {
      r.max = logits[i];
      r.arg = int64_t(i);
    }
  double sum = 0;
  for (const float l : logits) sum += std::exp(double(l) - r.max);
  r.lse = r.max + std::log(sum);
  return r;
}

}  // namespace

MeanError mean_and_error(double sum, double sum2, uint64_t n) {
  MeanError r;
  if (n == 0) return r;
  r.mean = sum / double(n);
  const double var = sum2 / double(n) - r.mean * r.mean;
  r.error = var > 0 && n > 1 ? std::sqrt(var / double(n - 1)) : 0;
  return r;
}

double percentile(std::span<const float> sorted, double fraction) {
  if (sorted.empty()) return 0;
  if (fraction <= 0) return sorted.front();
  if (fraction >= 1) return sorted.back();
  const double p = fraction * double(sorted.size() - 1);
  const size_t i = size_t(p);
  const double f = p - double(i);
  return (1 - f) * sorted[i] + f * sorted[std::min(i + 1, sorted.size() - 1)];
}

double median(std::span<const float> sorted) {
  const size_t n = sorted.size();
  if (n == 0) return 0;
  return n % 2 ? sorted[n / 2] : 0.5 * (double(sorted[n / 2 - 1]) + sorted[n / 2]);
}

void encode_log_probs(std::span<const float> logits, int32_t next, uint16_t* out) {
  const RowMax r = row_max(logits);
  const float mn = *std::min_element(logits.begin(), logits.end());
  const double range = std::min(r.max - double(mn), kLogProbRange);
  const float top = float(r.max - r.lse);
  const float step = float(range / 65535.0);
  const float next_lp = float(double(logits[size_t(next)]) - r.lse);
  std::memcpy(out, &top, sizeof top);
  std::memcpy(out + 2, &step, sizeof step);
  std::memcpy(out + 4, &next_lp, sizeof next_lp);
  uint16_t* u = out + kRowHeader;
  for (size_t i = 0; i < logits.size(); ++i) {
    const double below = r.max - double(logits[i]);
    if (step == 0) u[i] = 0;
    else if (below >= range) u[i] = kFloor;
    else u[i] = uint16_t(std::min(65535.0, std::nearbyint(below / step)));
  }
}

double decode_log_probs(const uint16_t* in, int64_t n_vocab, std::vector<double>& out) {
  float top = 0, step = 0, next_lp = 0;
  std::memcpy(&top, in, sizeof top);
  std::memcpy(&step, in + 2, sizeof step);
  std::memcpy(&next_lp, in + 4, sizeof next_lp);
  // A row whose range was cut at kLogProbRange: its floor means "further below".
  const bool cut = double(step) * 65535.0 >= kLogProbRange * (1 - 1e-6);
  out.resize(size_t(n_vocab));
  for (int64_t i = 0; i < n_vocab; ++i) {
    const uint16_t u = in[kRowHeader + i];
    out[size_t(i)] = cut && u == kFloor ? -std::numeric_limits<double>::infinity() : double(top) - double(step) * u;
  }
  return next_lp;
}

void write_log_prob_header(std::ostream& out, const LogProbHeader& h) {
  out.write(kMagic, sizeof kMagic);
  put_u32(out, kLogProbVersion);
  put_u32(out, h.n_vocab);
  put_u32(out, h.n_ctx);
  put_u32(out, h.n_chunks);
  out.write(reinterpret_cast<const char*>(h.tokens.data()), std::streamsize(h.tokens.size() * sizeof(int32_t)));
}

LogProbHeader read_log_prob_header(std::istream& in, const std::string& what) {
  char magic[sizeof kMagic] = {};
  if (!in.read(magic, sizeof magic) || std::memcmp(magic, kMagic, sizeof magic) != 0)
    throw Error(what + ": not a file of log-probs that --save-logits wrote");
  if (const uint32_t v = get_u32(in, what); v != kLogProbVersion)
    throw Error(what + ": version " + std::to_string(v) + " (this ds4-worker reads version " +
                std::to_string(kLogProbVersion) + ")");
  LogProbHeader h;
  h.n_vocab = get_u32(in, what);
  h.n_ctx = get_u32(in, what);
  h.n_chunks = get_u32(in, what);
  if (h.n_vocab == 0 || h.n_ctx < 2 || h.n_chunks == 0 || uint64_t(h.n_ctx) * h.n_chunks > (1ull << 31))
    throw Error(what + ": a header of " + std::to_string(h.n_vocab) + " tokens of vocabulary, context " +
                std::to_string(h.n_ctx) + ", " + std::to_string(h.n_chunks) + " chunks is not one --save-logits writes");
  h.tokens.resize(size_t(h.n_ctx) * h.n_chunks);
  if (!in.read(reinterpret_cast<char*>(h.tokens.data()), std::streamsize(h.tokens.size() * sizeof(int32_t))))
    throw Error(what + ": cut short in its tokens");
  return h;
}

double negative_log_prob(std::span<const float> logits, int32_t token) {
  const RowMax r = row_max(logits);
  return r.lse - double(logits[size_t(token)]);
}

void add_kl_position(KlStats& s, std::span<const float> logits, const uint16_t* base, int32_t next) {
  const RowMax q = row_max(logits);
  const int64_t n = int64_t(logits.size());
  std::vector<double> lp;
  const double next_base = decode_log_probs(base, n, lp);
  int64_t base_top = 0;
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (lp[size_t(i)] > lp[size_t(base_top)]) base_top = i;
    sum += std::exp(lp[size_t(i)]);
  }
  // The decoded row sums to 1 only up to its rounding: renormalized, the
  // divergence is >= 0 and of second order in that rounding.
  const double base_lse = std::log(sum);
  double kld = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double b = lp[size_t(i)] - base_lse;
    if (std::isinf(b)) continue;
    kld += std::exp(b) * (b - (double(logits[size_t(i)]) - q.lse));
  }
  const double nll = q.lse - double(logits[size_t(next)]);
  const double nll_base = -next_base;
  s.sum_nll += nll;
  s.sum_nll2 += nll * nll;
  s.sum_nll_base += nll_base;
  s.sum_nll_base2 += nll_base * nll_base;
  s.sum_nll_nll_base += nll * nll_base;
  s.sum_kld += kld;
  s.sum_kld2 += kld * kld;
  s.same_top += q.arg == base_top;
  ++s.count;
  s.kld.push_back(float(kld));
}

namespace {

struct PplFigures {
  MeanError ln_ppl, ln_base;
  double cov = 0;
};

PplFigures ppl_figures(const KlStats& s) {
  PplFigures f;
  f.ln_ppl = mean_and_error(s.sum_nll, s.sum_nll2, s.count);
  f.ln_base = mean_and_error(s.sum_nll_base, s.sum_nll_base2, s.count);
  if (s.count > 1) {
    const double n = double(s.count);
    f.cov = (s.sum_nll_nll_base / n - (s.sum_nll / n) * (s.sum_nll_base / n)) / (n - 1);
  }
  return f;
}

std::string format(const char* fmt, auto... args) {
  char buf[256];
  std::snprintf(buf, sizeof buf, fmt, args...);
  return buf;
}

struct KlFigures {
  double ppl, ppl_err, base, base_err, cor, ln_ratio, ln_ratio_err, diff_err;
  MeanError kld;
  double top, top_err;
};

KlFigures kl_figures(const KlStats& s) {
  const PplFigures f = ppl_figures(s);
  const double ppl = std::exp(f.ln_ppl.mean), ppl_err = ppl * f.ln_ppl.error;
  const double base = std::exp(f.ln_base.mean), base_err = base * f.ln_base.error;
  const double ln_ratio = f.ln_ppl.mean - f.ln_base.mean;
  const double ln_ratio_err = std::sqrt(std::max(
      0.0, f.ln_ppl.error * f.ln_ppl.error + f.ln_base.error * f.ln_base.error - 2 * f.cov));
  const double cor = f.ln_ppl.error > 0 && f.ln_base.error > 0 ? f.cov / (f.ln_ppl.error * f.ln_base.error) : 0;
  const double diff_err =
      std::sqrt(std::max(0.0, ppl_err * ppl_err + base_err * base_err - 2 * ppl * base * f.cov));
  const MeanError kld = mean_and_error(s.sum_kld, s.sum_kld2, s.count);
  const double top = s.count ? double(s.same_top) / double(s.count) : 0;
  const double top_err = s.count > 1 ? std::sqrt(top * (1 - top) / double(s.count - 1)) : 0;
  return {ppl, ppl_err, base, base_err, cor, ln_ratio, ln_ratio_err, diff_err, kld, top, top_err};
}

}  // namespace

std::string kl_summary(KlStats s) {
  std::sort(s.kld.begin(), s.kld.end());
  const auto [ppl, ppl_err, base, base_err, cor, ln_ratio, ln_ratio_err, diff_err, kld, top, top_err] = kl_figures(s);
  std::string o = "====== Perplexity statistics ======\n";
  o += format("Mean PPL(Q)                   : %10.6f ± %10.6f\n", ppl, ppl_err);
  o += format("Mean PPL(base)                : %10.6f ± %10.6f\n", base, base_err);
  o += format("Cor(ln(PPL(Q)), ln(PPL(base))): %6.2f%%\n", 100 * cor);
  o += format("Mean ln(PPL(Q)/PPL(base))     : %10.6f ± %10.6f\n", ln_ratio, ln_ratio_err);
  o += format("Mean PPL(Q)/PPL(base)         : %10.6f ± %10.6f\n", std::exp(ln_ratio), std::exp(ln_ratio) * ln_ratio_err);
  o += format("Mean PPL(Q)-PPL(base)         : %10.6f ± %10.6f\n", ppl - base, diff_err);
  o += "\n====== KL divergence statistics ======\n";
  o += format("Mean    KLD: %10.6f ± %10.6f\n", kld.mean, kld.error);
  o += format("Maximum KLD: %10.6f\n", s.kld.empty() ? 0.0 : double(s.kld.back()));
  o += format("99.9%%   KLD: %10.6f\n", percentile(s.kld, 0.999));
  o += format("99.0%%   KLD: %10.6f\n", percentile(s.kld, 0.990));
  o += format("Median  KLD: %10.6f\n", median(s.kld));
  o += format("Minimum KLD: %10.6f\n", s.kld.empty() ? 0.0 : double(s.kld.front()));
  o += format("Same top p: %6.3f ± %6.3f %%\n", 100 * top, 100 * top_err);
  return o;
}

namespace {

nlohmann::json kl_json(KlStats s) {
  std::sort(s.kld.begin(), s.kld.end());
  const KlFigures f = kl_figures(s);
  return {{"positions", s.count},
          {"ppl", f.ppl},
          {"ppl_error", f.ppl_err},
          {"ppl_base", f.base},
          {"ppl_base_error", f.base_err},
          {"ln_ppl_ratio", f.ln_ratio},
          {"ln_ppl_ratio_error", f.ln_ratio_err},
          {"kld_mean", f.kld.mean},
          {"kld_error", f.kld.error},
          {"kld_median", median(s.kld)},
          {"kld_p99", percentile(s.kld, 0.99)},
          {"kld_p999", percentile(s.kld, 0.999)},
          {"kld_max", s.kld.empty() ? 0.0 : double(s.kld.back())},
          {"same_top", f.top},
          {"same_top_error", f.top_err}};
}

}  // namespace

double run_perplexity(Backend& backend, std::vector<int32_t> tokens, const PerplexityOptions& o, std::FILE* out,
                      std::FILE* json) {
  const int64_t n_ctx = o.n_ctx, n_vocab = o.n_vocab, first = n_ctx / 2;
  if (!o.save_logits.empty() && !o.kl_divergence.empty())
    throw Error("give one of --save-logits and --kl-divergence (the base's log-probs are saved from one run, "
                "compared in another)");
  std::ifstream base_in;
  int64_t n_chunks = 0;
  if (!o.kl_divergence.empty()) {
    base_in.open(o.kl_divergence, std::ios::binary);
    if (!base_in) throw Error("--kl-divergence: cannot read '" + o.kl_divergence + "'");
    LogProbHeader h = read_log_prob_header(base_in, o.kl_divergence);
    if (int64_t(h.n_vocab) != n_vocab)
      throw Error(o.kl_divergence + ": its vocabulary has " + std::to_string(h.n_vocab) + " tokens, the model's " +
                  std::to_string(n_vocab) + " (the base must be the same model family)");
    if (int64_t(h.n_ctx) != n_ctx)
      throw Error(o.kl_divergence + ": saved with a context of " + std::to_string(h.n_ctx) + ", this run's is " +
                  std::to_string(n_ctx) + " (--context)");
    if (!tokens.empty()) {
      if (tokens.size() < h.tokens.size())
        throw Error(o.kl_divergence + ": saved from " + std::to_string(h.tokens.size()) + " tokens of text, and the text "
                    "given has " + std::to_string(tokens.size()) + " (a different text or tokenizer)");
      const auto diff = std::mismatch(h.tokens.begin(), h.tokens.end(), tokens.begin());
      if (diff.first != h.tokens.end())
        throw Error(o.kl_divergence + ": saved from another text or tokenizer: token " +
                    std::to_string(diff.first - h.tokens.begin()) + " is " + std::to_string(*diff.first) +
                    " there and " + std::to_string(*diff.second) + " here");
    }
    if (o.n_chunks > int64_t(h.n_chunks))
      throw Error("--chunks " + std::to_string(o.n_chunks) + ": " + o.kl_divergence + " holds " +
                  std::to_string(h.n_chunks) + " chunks");
    n_chunks = o.n_chunks > 0 ? o.n_chunks : int64_t(h.n_chunks);
    tokens = std::move(h.tokens);
  } else {
    if (int64_t(tokens.size()) < 2 * n_ctx)
      throw Error("the text has " + std::to_string(tokens.size()) + " tokens; a context of " + std::to_string(n_ctx) +
                  " needs at least " + std::to_string(2 * n_ctx) + " (as llama-perplexity)");
    n_chunks = int64_t(tokens.size()) / n_ctx;
    if (o.n_chunks > 0) n_chunks = std::min(n_chunks, o.n_chunks);
  }
  for (const int32_t t : tokens)
    if (t < 0 || t >= n_vocab) throw Error("token " + std::to_string(t) + " is outside the vocabulary");

  std::ofstream save;
  if (!o.save_logits.empty()) {
    save.open(o.save_logits, std::ios::binary | std::ios::trunc);
    if (!save) throw Error("--save-logits: cannot write '" + o.save_logits + "'");
    LogProbHeader h{uint32_t(n_vocab), uint32_t(n_ctx), uint32_t(n_chunks),
                    std::vector<int32_t>(tokens.begin(), tokens.begin() + n_chunks * n_ctx)};
    write_log_prob_header(save, h);
  }

  const size_t row_words = size_t(n_vocab + kRowHeader);
  std::vector<uint16_t> row(row_words);
  KlStats kl;
  double nll = 0, nll2 = 0;
  uint64_t count = 0;
  std::vector<BatchToken> batch;
  const bool kld_mode = base_in.is_open();
  if (kld_mode)
    std::fprintf(out, "chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence            Same top p\n");
  for (int64_t c = 0; c < n_chunks; ++c) {
    const int32_t* chunk = tokens.data() + c * n_ctx;
    auto token_at = [&](int64_t j) { return j == 0 && o.add_bos ? o.bos : chunk[j]; };
    // The unscored first half in batches, without logits.
    for (int64_t j = 0; j < first; j += o.max_batch) {
      batch.clear();
      for (int64_t k = j; k < std::min(first, j + o.max_batch); ++k) batch.push_back({token_at(k), 0, int32_t(k), -1});
      backend.forward(batch);
    }
    // The scored half, as many positions a step as the backend gives logit rows.
    for (int64_t j = first; j < n_ctx - 1; j += o.logit_rows) {
      batch.clear();
      std::vector<int32_t> rows;
      for (int64_t k = j; k < std::min(n_ctx - 1, j + o.logit_rows); ++k) {
        batch.push_back({token_at(k), 0, int32_t(k), int32_t(k - j)});
        rows.push_back(int32_t(k - j));
      }
      backend.forward(batch);
      backend.fetch_logits(rows);
      for (const int32_t r : rows) {
        const std::span<const float> logits = backend.logits(r);
        const int32_t next = chunk[j + r + 1];
        if (kld_mode) {
          if (!base_in.read(reinterpret_cast<char*>(row.data()), std::streamsize(row_words * sizeof(uint16_t))))
            throw Error(o.kl_divergence + ": cut short in chunk " + std::to_string(c + 1));
          add_kl_position(kl, logits, row.data(), next);
          continue;
        }
        const double v = negative_log_prob(logits, next);
        nll += v;
        nll2 += v * v;
        ++count;
        if (save.is_open()) {
          encode_log_probs(logits, next, row.data());
          save.write(reinterpret_cast<const char*>(row.data()), std::streamsize(row_words * sizeof(uint16_t)));
        }
      }
    }
    if (kld_mode) {
      const PplFigures f = ppl_figures(kl);
      const MeanError k = mean_and_error(kl.sum_kld, kl.sum_kld2, kl.count);
      const double ppl = std::exp(f.ln_ppl.mean);
      const double ratio_err =
          std::sqrt(std::max(0.0, f.ln_ppl.error * f.ln_ppl.error + f.ln_base.error * f.ln_base.error - 2 * f.cov));
      const double top = double(kl.same_top) / double(kl.count);
      const double top_err = kl.count > 1 ? std::sqrt(top * (1 - top) / double(kl.count - 1)) : 0;
      std::fprintf(out, "%4lld    %9.4f ± %9.4f    %10.5f ± %10.5f    %10.5f ± %10.5f    %6.3f ± %6.3f %%\n",
                   (long long)(c + 1), ppl, ppl * f.ln_ppl.error, f.ln_ppl.mean - f.ln_base.mean, ratio_err, k.mean,
                   k.error, 100 * top, 100 * top_err);
    } else {
      std::fprintf(out, "[%lld]%.4f,", (long long)(c + 1), std::exp(nll / double(count)));
    }
    std::fflush(out);
  }
  if (save.is_open() && !save.flush()) throw Error("--save-logits: writing '" + o.save_logits + "' failed");
  if (kld_mode) {
    std::fprintf(out, "\n%s", kl_summary(kl).c_str());
    if (json) {
      nlohmann::json j = kl_json(kl);
      j["n_ctx"] = n_ctx;
      j["chunks"] = n_chunks;
      std::fprintf(json, "%s\n", j.dump().c_str());
    }
    return std::exp(kl.sum_nll / double(kl.count));
  }
  const double mean = nll / double(count);
  const double ppl = std::exp(mean);
  const double var = nll2 / double(count) - mean * mean;
  const double err = var > 0 && count > 1 ? ppl * std::sqrt(var / double(count - 1)) : 0.0;
  std::fprintf(out, "\nFinal estimate: PPL = %.4f +/- %.5f\n", ppl, err);
  if (json)
    std::fprintf(json, "%s\n",
                 nlohmann::json{{"n_ctx", n_ctx}, {"chunks", n_chunks}, {"positions", count}, {"ppl", ppl},
                                {"ppl_error", err}}.dump().c_str());
  return ppl;
}

}  // namespace ds4
