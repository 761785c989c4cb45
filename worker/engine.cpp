#include "worker/engine.h"

#include <algorithm>
#include <cmath>

#include "shared/error.h"

namespace ds4 {

using Clock = std::chrono::steady_clock;

static double ms_since(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}

const char* finish_name(Finish f) {
  switch (f) {
    case Finish::stop: return "stop";
    case Finish::length: return "length";
    case Finish::context: return "context";
    case Finish::cancelled: return "cancelled";
    case Finish::error: return "error";
  }
  return "error";
}

struct Engine::Active {
  int64_t id = 0;
  GenerateRequest req;
  std::shared_ptr<RequestSink> sink;
  std::vector<int32_t> seq;  // prompt + generated
  int64_t n_past = 0;        // tokens of seq already in the slot's KV
  int slot = -1;
  bool done = false;
  Timings timings;
  Clock::time_point t_start, t_first;
  int64_t prefilled = 0;
  bool sampled_once = false;
  std::unique_ptr<GrammarSampler> grammar;  // when the request has one
};

Engine::Engine(Backend& backend, const HParams& hp, int32_t eos, EngineShape shape)
    : backend_(backend), hp_(hp), eos_(eos), shape_(shape), slots_(size_t(shape.slots)) {}

std::string Engine::validate(const GenerateRequest& r) const {
  if (r.prompt.empty()) return "the prompt has no tokens";
  const int64_t total = int64_t(r.prompt.size() + r.generated.size());
  if (total >= shape_.ctx)
    return "the prompt has " + std::to_string(total) + " tokens but the context is " +
           std::to_string(shape_.ctx) + " tokens per slot";
  for (const auto* v : {&r.prompt, &r.generated})
    for (int32_t t : *v)
      if (t < 0 || t >= hp_.n_vocab)
        return "token " + std::to_string(t) + " is out of range [0, " + std::to_string(hp_.n_vocab) + ")";
  if (r.max_tokens < 0) return "max_tokens must not be negative";
  if (r.n_probs < 0 || r.n_probs > 20) return "logprobs must be between 0 and 20";
  for (const auto& [t, bias] : r.sampling.logit_bias)
    if (t < 0 || t >= hp_.n_vocab)
      return "logit_bias: token " + std::to_string(t) + " is out of range [0, " + std::to_string(hp_.n_vocab) + ")";
  return "";
}

int64_t Engine::submit(GenerateRequest req, std::shared_ptr<RequestSink> sink) {
  auto a = std::make_shared<Active>();
  a->req = std::move(req);
  a->sink = std::move(sink);
  a->t_start = Clock::now();
  int64_t id;
  std::lock_guard lock(mu_);
  id = a->id = next_id_++;
  inbox_.push_back(std::move(a));
  return id;
}

void Engine::cancel(int64_t id) {
  std::lock_guard lock(mu_);
  cancels_.push_back(id);
}

EngineStats Engine::stats() const {
  std::lock_guard lock(mu_);
  EngineStats s;
  s.slots = shape_.slots;
  s.ctx = shape_.ctx;
  s.waiting = int64_t(inbox_.size());
  for (const Slot& sl : slots_) s.busy += sl.req != nullptr;
  return s;
}

void Engine::finish(Active& a, Finish reason, const std::string& error) {
  if (a.done) return;
  a.done = true;
  if (a.sampled_once) a.timings.predicted_ms = ms_since(a.t_first);
  a.sink->on_done(reason, a.timings, error);
  if (a.slot >= 0) slots_[size_t(a.slot)].req.reset();
}

// Takes waiting requests into free slots, longest cached prefix first.
void Engine::admit() {
  std::vector<std::shared_ptr<Active>> incoming;
  std::vector<int64_t> cancels;
  {
    std::lock_guard lock(mu_);
    cancels.swap(cancels_);
    for (int64_t id : cancels) {
      auto it = std::find_if(inbox_.begin(), inbox_.end(), [&](auto& a) { return a->id == id; });
      if (it != inbox_.end()) {
        incoming.push_back(*it);
        (*it)->done = true;  // finished below, outside the lock
        inbox_.erase(it);
      }
    }
    const int64_t free = std::count_if(slots_.begin(), slots_.end(), [](const Slot& s) { return !s.req; });
    for (int64_t i = 0; i < free && !inbox_.empty(); ++i) {
      incoming.push_back(inbox_.front());
      inbox_.pop_front();
    }
  }
  for (int64_t id : cancels)
    for (Slot& s : slots_)
      if (s.req && s.req->id == id) finish(*s.req, Finish::cancelled);
  for (auto& a : incoming) {
    if (a->done) {  // cancelled while waiting
      a->done = false;
      finish(*a, Finish::cancelled);
      continue;
    }
    if (std::string err = validate(a->req); !err.empty()) {
      finish(*a, Finish::error, err);
      continue;
    }
    if (!a->req.grammar.empty() && !start_grammar(*a)) continue;
    a->seq = a->req.prompt;
    a->seq.insert(a->seq.end(), a->req.generated.begin(), a->req.generated.end());
    if (int64_t(a->req.generated.size()) >= a->req.max_tokens) {
      finish(*a, Finish::length);
      continue;
    }
    // The free slot whose cache this request continues (it keeps at least
    // half of what the slot holds: an agent's next turn, a retry), the
    // longest match first; when none does, the least recently used free
    // slot, so that a new conversation evicts the oldest prefix rather than
    // one that a few shared tokens (BOS, a system prompt) made look closest.
    int best = -1, lru = -1;
    size_t best_len = 0;
    std::vector<size_t> match(slots_.size(), 0);
    for (size_t i = 0; i < slots_.size(); ++i) {
      if (slots_[i].req) continue;
      const auto& c = slots_[i].cache;
      const size_t n = std::min(c.size(), a->seq.size());
      size_t l = 0;
      while (l < n && c[l] == a->seq[l]) ++l;
      match[i] = l;
      if (lru < 0 || slots_[i].used < slots_[size_t(lru)].used) lru = int(i);
      if (2 * l < c.size()) continue;  // would throw away most of this slot's cache
      if (best < 0 || l > best_len || (l == best_len && slots_[i].used < slots_[size_t(best)].used))
        best = int(i), best_len = l;
    }
    if (best < 0) best = lru, best_len = match[size_t(lru)];
    Slot& s = slots_[size_t(best)];
    s.used = ++use_clock_;
    a->slot = best;
    // Keep at least the last token to evaluate: its logits give the next token.
    a->n_past = int64_t(std::min(best_len, a->seq.size() - 1));
    s.cache.resize(size_t(a->n_past));
    a->timings.cache_n = a->n_past;
    s.req = a;
  }
}

void Engine::end_step() {
  if (step_end_) step_end_();
}

bool Engine::step() {
  admit();
  std::vector<BatchToken> batch;
  std::vector<Active*> sampled;  // per logit row
  // Generating slots first: one token each.
  for (Slot& s : slots_) {
    if (!s.req) continue;
    Active& a = *s.req;
    if (int64_t(a.seq.size()) - a.n_past != 1) continue;
    batch.push_back({a.seq.back(), int32_t(a.slot), int32_t(a.n_past), int32_t(sampled.size())});
    sampled.push_back(&a);
  }
  // Then prompt chunks with what is left of the batch.
  for (Slot& s : slots_) {
    if (!s.req) continue;
    Active& a = *s.req;
    const int64_t left = int64_t(a.seq.size()) - a.n_past;
    if (left <= 1) continue;  // generating: queued above
    const int64_t room = shape_.max_batch - int64_t(batch.size());
    if (room <= 0) break;
    const int64_t n = std::min(left, room);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t pos = a.n_past + i;
      const bool last = pos == int64_t(a.seq.size()) - 1;
      batch.push_back({a.seq[size_t(pos)], int32_t(a.slot), int32_t(pos), last ? int32_t(sampled.size()) : -1});
      if (last) sampled.push_back(&a);
    }
  }
  if (batch.empty()) {
    end_step();
    return false;
  }

  // Each request's logit_bias and penalties go to the backend, which adds
  // them where the logits are (a GPU then picks a biased greedy token there).
  adjust_.clear();
  for (size_t row = 0; row < sampled.size(); ++row) {
    const Active& a = *sampled[row];
    if (a.req.sampling.adjusts())
      logit_adjustments(a.req.sampling, std::span<const int32_t>(a.seq).subspan(a.req.prompt.size()),
                        int32_t(hp_.n_vocab), int32_t(row), adjust_, adjust_scratch_);
  }
  backend_.forward(batch, adjust_);

  // Advance every slot by the tokens it had in the batch.
  for (const BatchToken& b : batch) {
    Slot& s = slots_[size_t(b.slot)];
    s.cache.push_back(b.token);
    s.req->n_past = b.pos + 1;
    if (!s.req->sampled_once) s.req->timings.prompt_n++;
  }
  // The rows sampled from their whole logits (temperatures, alternatives)
  // come to the host together and are drawn in parallel.
  std::vector<int32_t> host_rows;
  for (size_t row = 0; row < sampled.size(); ++row)
    if (draws_on_host(*sampled[row], int32_t(row))) host_rows.push_back(int32_t(row));
  host_draws(sampled, host_rows);
  for (size_t row = 0; row < sampled.size(); ++row) {
    Active& a = *sampled[row];
    const int64_t index = int64_t(a.seq.size() - a.req.prompt.size());
    Sampled out;
    if (!draw_errors_[row].empty()) {
      finish(a, Finish::error, draw_errors_[row]);
      continue;
    }
    try {
      out = std::binary_search(host_rows.begin(), host_rows.end(), int32_t(row)) ? std::move(drawn_[row])
                                                                                  : sample_row(a, int32_t(row), index);
    } catch (const Error& e) {  // a grammar limit passed
      finish(a, Finish::error, e.what());
      continue;
    }
    if (a.done) continue;
    if (!a.sampled_once) {
      a.sampled_once = true;
      a.t_first = Clock::now();
      a.timings.prompt_ms = std::chrono::duration<double, std::milli>(a.t_first - a.t_start).count();
    }
    if (a.grammar) {
      if (tokens_->eog(out.token)) {  // allowed only where the grammar can end
        finish(a, Finish::stop);
        continue;
      }
      if (!a.grammar->accept(out.token)) {  // the mask allowed it: cannot happen
        finish(a, Finish::error, "grammar: token " + std::to_string(out.token) + " was drawn but does not fit");
        continue;
      }
    } else if (out.token == eos_ && !a.req.ignore_eos) {
      finish(a, Finish::stop);
      continue;
    }
    a.seq.push_back(out.token);
    a.timings.predicted_n++;
    a.sink->on_token(index, out);
    if (a.grammar && a.grammar->must_end()) finish(a, Finish::stop);  // nothing more can follow
    else if (index + 1 >= a.req.max_tokens) finish(a, Finish::length);
    else if (int64_t(a.seq.size()) > shape_.ctx) finish(a, Finish::context);  // next position would be ctx
  }
  end_step();
  return true;
}

// Parses the request's grammar and replays its generated tokens through it.
// False when the request finished here (an error, or an answer complete).
bool Engine::start_grammar(Active& a) {
  if (!tokens_) {
    finish(a, Finish::error, "grammar: this engine has no token table (constrained decoding is off)");
    return false;
  }
  try {
    a.grammar = std::make_unique<GrammarSampler>(grammar::Grammar::parse(a.req.grammar), tokens_, !a.req.ignore_eos,
                                                 a.req.grammar_triggers);
    for (size_t i = 0; i < a.req.generated.size(); ++i) {
      const int32_t t = a.req.generated[i];
      if (t >= tokens_->size() || tokens_->eog(t) || !a.grammar->accept(t)) {
        finish(a, Finish::error, "grammar: generated token " + std::to_string(i) + " (id " + std::to_string(t) +
                                     ") does not fit the grammar");
        return false;
      }
    }
  } catch (const Error& e) {
    finish(a, Finish::error, e.what());
    return false;
  }
  if (!a.req.generated.empty() && a.grammar->must_end()) {  // the undisturbed answer ended there
    finish(a, Finish::stop);
    return false;
  }
  return true;
}

bool Engine::draws_on_host(const Active& a, int32_t row) const {
  if (a.grammar) return false;
  return a.req.sampling.temperature > 0.0f || a.req.n_probs > 0 || !backend_.greedy(row);
}

void Engine::host_draws(std::span<Active* const> sampled, std::span<const int32_t> rows) {
  drawn_.resize(sampled.size());
  draw_errors_.assign(sampled.size(), std::string());
  // A sampled request with top-k draws from the row's best logits where the
  // backend keeps them; the others need their whole rows on the host.
  std::vector<int32_t> whole;
  for (int32_t row : rows) {
    const Active& a = *sampled[size_t(row)];
    const std::optional<RowBest> best = backend_.best_logits(row);
    if (!best || !samples_from_best(a.req.sampling, a.req.n_probs, best->best.size(), size_t(hp_.n_vocab))) {
      whole.push_back(row);
      continue;
    }
    try {
      drawn_[size_t(row)] = sample_best(best->best, best->lse, a.req.sampling,
                                        uint64_t(a.seq.size() - a.req.prompt.size()), a.req.n_probs, sample_scratch_);
    } catch (const std::exception& e) {
      draw_errors_[size_t(row)] = e.what();
    }
  }
  if (whole.empty()) return;
  backend_.fetch_logits(whole);
  backend_.host_parallel(int(whole.size()), [&](int i) {
    const int32_t row = whole[size_t(i)];
    const Active& a = *sampled[size_t(row)];
    thread_local std::vector<float> scratch;
    try {
      drawn_[size_t(row)] = sample(backend_.logits(row), a.req.sampling,
                                   uint64_t(a.seq.size() - a.req.prompt.size()), a.req.n_probs, scratch);
    } catch (const std::exception& e) {
      draw_errors_[size_t(row)] = e.what();
    }
  });
}

// The next token of `a` from logit row `row` (its logit_bias and penalties
// already added by the backend).
Sampled Engine::sample_row(Active& a, int32_t row, int64_t index) {
  const SamplingParams& sp = a.req.sampling;
  // Greedy without alternatives is picked where the logits are (a GPU
  // backend then sends back one token instead of the whole row); a grammar
  // needs the row on the host for its mask.
  if (!a.grammar && sp.temperature <= 0.0f && a.req.n_probs == 0) {
    if (std::optional<TokenLogprob> picked = backend_.greedy(row)) {
      Sampled out;
      out.token = picked->token;
      out.logprob = picked->logprob;
      return out;
    }
  }
  // With a grammar, the token drawn without it is kept when the grammar takes
  // it (llama.cpp does the same): greedy, that is the masked draw's token;
  // sampled, a refused draw is redrawn from the masked row with its own
  // randomness, which gives each allowed token its masked probability. The
  // mask, the costly part, is then needed only at refusals. Alternatives
  // (logprobs) come from the masked row.
  const bool try_first = a.grammar && a.req.n_probs == 0;
  bool tried = false;  // the drawn token was refused already
  if (try_first && sp.temperature <= 0.0f)
    if (std::optional<TokenLogprob> picked = backend_.greedy(row)) {
      if (a.grammar->fits(picked->token)) {
        Sampled out;
        out.token = picked->token;
        out.logprob = picked->logprob;
        return out;
      }
      tried = true;
    }
  std::span<const float> logits = backend_.logits(row);
  if (!a.grammar) return sample(logits, sp, uint64_t(index), a.req.n_probs, sample_scratch_);
  if (try_first && !tried) {
    Sampled out = sample(logits, sp, uint64_t(index), 0, sample_scratch_);
    if (a.grammar->fits(out.token)) return out;
  }
  masked_.assign(logits.begin(), logits.end());
  if (a.grammar->mask(masked_) == 0) {
    finish(a, Finish::error, "grammar: no token of the vocabulary can continue the answer");
    return {};
  }
  SamplingParams redraw = sp;
  if (try_first) redraw.seed ^= 0x9e3779b97f4a7c15ull;  // independent of the refused draw
  Sampled out = sample(masked_, redraw, uint64_t(index), a.req.n_probs, sample_scratch_);
  std::erase_if(out.top, [](const TokenLogprob& t) { return std::isinf(t.logprob); });  // masked alternatives
  return out;
}

void Engine::run_until_idle() {
  while (step()) {
  }
}

}  // namespace ds4
