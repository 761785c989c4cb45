#include "supervisor/proxy/scheduler.h"

#include <algorithm>

#include "shared/log.h"
#include "shared/request_trace.h"
#include "supervisor/proxy/engine_probe.h"

namespace ds4::proxy {

namespace {

// An engine call's callback of a job: `fn(job, args...)`, run only while the
// scheduler (`alive`) and the job live and the job still runs.
template <class F>
auto while_running(std::weak_ptr<Job> wj, std::weak_ptr<bool> alive, F fn) {
  return [wj, alive, fn](auto&&... a) {
    if (alive.expired()) return;
    auto j = wj.lock();
    if (j && j->state == Job::State::running) fn(j, a...);
  };
}

}  // namespace

namespace asio = boost::asio;
using Clock = std::chrono::steady_clock;

size_t common_prefix(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  const size_t n = std::min(a.size(), b.size());
  size_t i = 0;
  while (i < n && a[i] == b[i]) ++i;
  return i;
}

std::optional<int> pick_worker(const std::vector<Candidate>& cands, const std::vector<int32_t>& tokens, int64_t needed) {
  std::optional<int> best;
  size_t best_prefix = 0;
  int64_t best_free = 0;
  for (const Candidate& c : cands) {
    if (c.free_slots <= 0 || c.context <= needed || c.http) continue;
    size_t prefix = 0;
    if (c.history)
      for (const auto& seq : *c.history) prefix = std::max(prefix, common_prefix(tokens, seq));
    const bool better = !best || prefix > best_prefix ||
                        (prefix == best_prefix && (c.free_slots > best_free || (c.free_slots == best_free && c.id < *best)));
    if (better) {
      best = c.id;
      best_prefix = prefix;
      best_free = c.free_slots;
    }
  }
  return best;
}

Scheduler::Scheduler(asio::io_context& io, sup::WorkerRegistry& registry, SchedulerOptions options)
    : io_(io), registry_(registry), opt_(options), notice_timer_(io), retry_timer_(io), pool_(io),
      alive_(std::make_shared<bool>(true)), workers_(registry.workers()) {
  registry_.on_change([this, alive = std::weak_ptr<bool>(alive_)] {
    if (alive.expired()) return;
    workers_ = registry_.workers();
    pool_.retain(workers_);
    for (const sup::WorkerInfo& w : workers_)  // an exec engine that just started: asked what it resumes at once
      if (w.state == sup::WorkerState::ready && w.socket_path.empty() && w.http_port > 0) engine_probed(w);
    pump();
  });
}

Scheduler::~Scheduler() {
  alive_.reset();
  for (auto& [p, job] : running_) {
    if (job->call) job->call->cancel();
    if (job->engine_call) job->engine_call->cancel();
  }
}

bool Scheduler::submit(std::shared_ptr<Job> job) {
  if (queue_.size() >= opt_.max_waiting) {
    ++counters_.rejected_full;
    return false;
  }
  job->seq = next_seq_++;
  job->state = Job::State::queued;
  job->queued_at = Clock::now();
  if (job->submitted == Clock::time_point{}) job->submitted = job->queued_at;
  queue_.push_back(job);
  pump();
  if (job->state == Job::State::queued) {  // no worker took it at once
    enqueue_timer(job);
    arm_notices();
  }
  return true;
}

void Scheduler::cancel(const std::shared_ptr<Job>& job) {
  job->sink = nullptr;
  if (job->state == Job::State::queued) {
    queue_.erase(std::remove(queue_.begin(), queue_.end(), job), queue_.end());
    if (job->wait_timer) job->wait_timer->cancel();
  } else if (job->state == Job::State::running) {
    leave_worker(job);
  }
  job->state = Job::State::done;
  pump();
}

sup::ProxyStats Scheduler::stats() const {
  sup::ProxyStats s;
  s.waiting = int64_t(queue_.size());
  s.in_flight = int64_t(running_.size());
  for (auto& [id, n] : in_flight_)
    if (n > 0) s.in_flight_by_worker[id] = n;
  return s;
}

std::vector<sup::RequestView> Scheduler::requests(size_t limit) const {
  std::vector<const Job*> jobs;
  for (const auto& j : queue_) jobs.push_back(j.get());
  for (const auto& [p, j] : running_) jobs.push_back(p);
  std::sort(jobs.begin(), jobs.end(), [](const Job* a, const Job* b) { return a->submitted < b->submitted; });
  if (jobs.size() > limit) jobs.resize(limit);
  const auto now = Clock::now();
  std::vector<sup::RequestView> out;
  out.reserve(jobs.size());
  for (const Job* j : jobs) {
    sup::RequestView v;
    v.endpoint = j->endpoint;
    v.running = j->state == Job::State::running;
    v.worker = v.running ? j->worker : -1;
    v.age_ms = std::chrono::duration_cast<std::chrono::milliseconds>(now - j->submitted).count();
    v.prompt_tokens = int64_t(j->gen.prompt.size());
    v.generated = int64_t(j->gen.generated.size());
    v.resumes = j->resumes;
    out.push_back(std::move(v));
  }
  return out;
}

int64_t Scheduler::max_context() const {
  int64_t ctx = 0;
  for (const auto& w : workers_) ctx = std::max(ctx, w.context);
  return ctx;
}

void Scheduler::enqueue_timer(const std::shared_ptr<Job>& job) {
  if (!job->wait_timer) job->wait_timer = std::make_unique<asio::steady_timer>(io_);
  const auto left = std::chrono::duration_cast<Clock::duration>(opt_.max_wait) - job->waited;
  job->wait_timer->expires_after(std::max(left, Clock::duration::zero()));
  job->wait_timer->async_wait([this, w = std::weak_ptr<Job>(job), alive = std::weak_ptr<bool>(alive_)](const boost::system::error_code& ec) {
    auto job = w.lock();
    if (ec || alive.expired() || !job || job->state != Job::State::queued) return;
    queue_.erase(std::remove(queue_.begin(), queue_.end(), job), queue_.end());
    ++counters_.timeouts;
    finish(job, {false, "", job->timings,
                 {ErrorKind::timeout, "the request waited " + format_duration(opt_.max_wait) +
                                          " for a worker (queue.max_wait); try again later", 5}});
    notify_positions(false);
  });
}

void Scheduler::pump() {
  if (pumping_ || queue_.empty()) return;
  pumping_ = true;
  const std::vector<sup::WorkerInfo>& workers = workers_;  // a registry change never comes from inside pump
  const auto now = Clock::now();
  std::vector<Candidate>& cands = candidates_;
  cands.clear();
  for (const sup::WorkerInfo& w : workers) {
    if (w.state != sup::WorkerState::ready || w.slots <= 0 || (w.socket_path.empty() && w.http_port <= 0)) continue;
    if (auto b = blocked_.find(w.id); b != blocked_.end()) {
      if (b->second.generation != w.generation) blocked_.erase(b);  // a new process: try it at once
      else if (now < b->second.until) continue;
    }
    if (w.socket_path.empty() && !engine_probed(w)) continue;  // asked what it can resume first
    cands.push_back({w.id, w.context, w.slots - in_flight_[w.id], &history_[w.id], w.socket_path.empty()});
  }
  // The job at queue position i leaves the queue and starts on worker `id`.
  const auto dispatch = [&](size_t i, const std::shared_ptr<Job>& job, int id) {
    queue_.erase(queue_.begin() + std::ptrdiff_t(i));
    for (Candidate& c : cands)
      if (c.id == id) --c.free_slots;
    for (const sup::WorkerInfo& w : workers)
      if (w.id == id) start(job, w);
  };
  for (size_t i = 0; i < queue_.size();) {
    if (std::none_of(cands.begin(), cands.end(), [](const Candidate& c) { return c.free_slots > 0; })) break;
    std::shared_ptr<Job> job = queue_[i];
    if (job->forward) {  // an exec engine's job: no tokens, no context to check (the engine does)
      std::optional<int> pick;
      int64_t best_free = 0;
      for (const Candidate& c : cands)
        if (c.http && c.free_slots > best_free) pick = c.id, best_free = c.free_slots;
      if (!pick) {
        ++i;
        continue;
      }
      dispatch(i, job, *pick);
      continue;
    }
    const int64_t needed = int64_t(job->gen.prompt.size() + job->gen.generated.size());
    if (int64_t(job->gen.generated.size()) >= job->gen.max_tokens) {
      queue_.erase(queue_.begin() + std::ptrdiff_t(i));
      finish(job, {true, "length", job->timings, {}});
      continue;
    }
    const std::optional<int> pick = pick_worker(cands, job->gen.prompt, needed);
    if (!pick) {
      // A free worker exists but its context is too small: wait for a bigger
      // one if any could come, otherwise end here.
      const bool could = std::any_of(workers.begin(), workers.end(), [&](const sup::WorkerInfo& w) {
        return w.state != sup::WorkerState::stopped && (w.context == 0 || w.context > needed);
      });
      if (could) {
        ++i;
        continue;
      }
      queue_.erase(queue_.begin() + std::ptrdiff_t(i));
      if (job->gen.generated.empty())
        finish(job, {false, "", job->timings,
                     bad_request("the prompt has " + std::to_string(needed) + " tokens but the context is " +
                                 std::to_string(max_context()) + " tokens: shorten the prompt")});
      else
        finish(job, {true, "length", job->timings, {}});
      continue;
    }
    dispatch(i, job, *pick);
  }
  pumping_ = false;
  notify_positions(false);
}

void Scheduler::start(const std::shared_ptr<Job>& job, const sup::WorkerInfo& w) {
  const auto now = Clock::now();
  if (job->wait_timer) job->wait_timer->cancel();
  job->waited += now - job->queued_at;
  if (job->worker < 0) {
    const double s = std::chrono::duration<double>(job->waited).count();
    ++counters_.dispatched;
    counters_.wait_seconds_sum += s;
    counters_.wait_seconds_max = std::max(counters_.wait_seconds_max, s);
  }
  job->state = Job::State::running;
  job->worker = w.id;
  job->worker_generation = w.generation;
  job->call_started = now;
  job->call_tokens = 0;
  job->last_position = 0;
  ++in_flight_[w.id];
  running_[job.get()] = job;
  if (job->forward) return start_forward(job, w);
  remember(w.id, *job);

  std::weak_ptr<Job> wj = job;
  std::weak_ptr<bool> alive = alive_;
  WorkerCall::Handler h{
      [this, wj, alive](proto::Event&& e) {
        if (alive.expired()) return;
        if (auto j = wj.lock()) on_event(j, std::move(e));
      },
      [this, wj, alive](const std::string& why, bool answered) {
        if (alive.expired()) return;
        if (auto j = wj.lock()) on_broken(j, why, answered);
      }};
  const int64_t dispatch = trace::on() ? trace::now_ns() : 0;
  job->call = pool_.call({w.id, w.generation, w.socket_path}, job->gen, std::move(h));
  if (dispatch) {
    trace::mark(trace::Stage::proxy_received, job->call->id(), job->trace_received, job->trace_port);
    trace::mark(trace::Stage::proxy_dispatch, job->call->id(), dispatch, w.id);
  }
}

EngineCaps Scheduler::engine_caps(int worker) const {
  auto it = engines_.find(worker);
  return it == engines_.end() ? EngineCaps{} : it->second.caps;
}

bool Scheduler::engine_probed(const sup::WorkerInfo& w) {
  if (!opt_.resume_engines) return true;
  EngineState& e = engines_[w.id];
  if (e.generation != w.generation) e = {w.generation, {}, false};
  if (e.caps.probed) return true;
  if (e.probing) return false;
  e.probing = true;
  const int id = w.id;
  const uint64_t gen = w.generation;
  probe_engine(io_, w.http_port, opt_.engine, opt_.probe_timeout,
               [this, id, gen, alive = std::weak_ptr<bool>(alive_)](EngineCaps caps) {
                 if (alive.expired()) return;
                 EngineState& e = engines_[id];
                 if (e.generation != gen) return;
                 e.caps = caps;
                 e.probing = false;
                 log::info("worker " + std::to_string(id) + ": the exec engine resumes answers cut mid-stream: " +
                               caps.describe(),
                           {{"DS4_WORKER", std::to_string(id)}});
                 pump();
               });
  return false;
}

void Scheduler::start_forward(const std::shared_ptr<Job>& job, const sup::WorkerInfo& w) {
  if (job->forwarded && job->resumable) return start_resume(job, w);
  auto with = [wj = std::weak_ptr<Job>(job), alive = std::weak_ptr<bool>(alive_)](auto fn) {
    return while_running(wj, alive, fn);
  };
  // Nothing went out yet: the request as this engine can resume it.
  job->resumable.reset();
  const EngineCaps caps = engine_caps(w.id);
  bool as_chat = false;
  if (job->anthropic) {
    as_chat = true;  // converted at an earlier dispatch
  } else if (caps.resumes_chat()) {
    if (std::optional<EngineRequest> chat = anthropic_as_chat(*job->forward)) {
      as_chat = true;
      job->forward = std::make_shared<const EngineRequest>(std::move(*chat));
    }
  }
  const EngineRequest req = resumable_request(*job, resume_kind(*job->forward, caps), as_chat);
  EngineCall::Handler h;
  h.head = with([this](const std::shared_ptr<Job>& j, int status, const std::string& ct, bool streaming) {
    blocked_.erase(j->worker);  // it answers: no backoff
    if (j->sink) j->sink->on_engine_head(status, ct, streaming);
  });
  h.data = with([](const std::shared_ptr<Job>& j, std::string_view bytes) {
    EngineOp op;
    op.bytes = bytes;
    engine_op(*j, std::move(op));
  });
  h.done = with([this](const std::shared_ptr<Job>& j) {
    j->engine_call.reset();
    leave_worker(j);
    finish(j, {true, "stop", j->timings, {}});
    pump();
  });
  h.broken = with([this](const std::shared_ptr<Job>& j, const std::string& why, bool replay) {
    on_engine_broken(j, why, replay);
  });
  job->engine_call = EngineCall::start(io_, w.http_port, req, opt_.engine, std::move(h));
}

EngineRequest Scheduler::resumable_request(Job& job, ResumeKind kind, bool as_chat) {
  if (as_chat && !job.anthropic) {
    std::string model;  // the name the client asked for, for message_start
    auto b = parse_body(job.forward->body);
    if (const json* body = std::get_if<json>(&b); body && body->is_object())
      if (auto m = body->find("model"); m != body->end() && m->is_string()) model = m->get<std::string>();
    job.anthropic = std::make_unique<AnthropicFromChat>(std::move(model));
  }
  job.resume_kind = kind;
  job.resumable.reset();
  if (kind == ResumeKind::none) return *job.forward;
  Added added;
  EngineRequest req = with_token_ids(*job.forward, kind, added);
  job.resumable = std::make_unique<ResumableStream>(kind, added, wants_usage_chunk(*job.forward));
  return req;
}

void Scheduler::engine_op(Job& job, EngineOp op) {
  op.resume = job.resumable ? job.resume_kind : ResumeKind::none;
  op.as_chat = job.anthropic != nullptr;
  if (!job.sink) return apply_op(job, op, false);
  job.sink->on_engine_op(op, [&job, &op] { apply_op(job, op, true); });
}

void Scheduler::apply_op(Job& job, const EngineOp& op, bool deliver) {
  auto out = [&job, deliver](std::string_view bytes) {
    if (bytes.empty()) return;
    if (deliver) to_client(job, bytes);
    else if (job.anthropic) job.anthropic->feed(bytes);  // its state, as if sent
  };
  if (!job.resumable) {  // a stream no engine can resume: it went out as it came
    job.forwarded = true;
    return out(op.bytes);
  }
  ResumableStream& s = *job.resumable;
  switch (op.kind) {
    case EngineOp::Kind::feed: {
      const std::string bytes = s.feed(op.bytes);
      if (!bytes.empty()) job.forwarded = true;
      return out(bytes);
    }
    case EngineOp::Kind::continuation:
      return s.begin_continuation();
    case EngineOp::Kind::hole:
      if (op.at >= 0 && size_t(op.at) < s.generated().size()) s.fill_hole(size_t(op.at), op.id);
      return;
    case EngineOp::Kind::end:
      return out(s.end_length(op.at));
    case EngineOp::Kind::close:
      if (!s.ended()) out(s.close());
      return;
  }
}

std::string Scheduler::restore(Job& job, const std::vector<EngineOp>& ops) {
  if (ops.empty()) return "";  // none of the engine's answer went out
  const EngineOp& first = ops.front();
  if (first.resume == ResumeKind::none)
    return "an exec engine's answer under way that no engine can continue (a request with tools, a grammar, "
           "response_format or n > 1, or an engine that resumes none)";
  if (first.as_chat) {
    std::optional<EngineRequest> chat = anthropic_as_chat(*job.forward);
    if (!chat) return "its Anthropic stream, sent to the engine as chat, no longer converts";
    job.forward = std::make_shared<const EngineRequest>(std::move(*chat));
  }
  resumable_request(job, first.resume, first.as_chat);
  for (const EngineOp& op : ops) apply_op(job, op, false);
  if (job.forwarded && !whole(job) && !job.resumable->resumable())
    return "its answer went out with a part that no continuation goes on from (a tool call, a thought, an error event)";
  return "";  // not forwarded: none of the answer went out, it starts again
}

bool Scheduler::whole(const Job& job) {
  return job.resumable && (job.resumable->ended() || job.resumable->finished());
}

void Scheduler::end_restored(Job& job) {
  EngineOp op;
  op.kind = EngineOp::Kind::close;
  engine_op(job, std::move(op));
  if (job.sink) job.sink->on_done({true, "stop", job.timings, {}});
}

// The answer went out in part and the engine that gave it is gone: the
// prompt's ids (the engine's own tokenisation, once), then the continuation.
void Scheduler::start_resume(const std::shared_ptr<Job>& job, const sup::WorkerInfo& w) {
  const EngineCaps caps = engine_caps(w.id);
  const bool chat = job->resume_kind == ResumeKind::chat;
  if (chat ? !caps.resumes_chat() : !caps.resumes_completions())
    return fail_forward(job, "worker " + std::to_string(w.id) + " (exec engine) cannot continue the answer cut mid-stream: it resumes " +
                                 caps.describe() + "; send the request again");
  const int port = w.http_port;
  if (job->prompt_ids) return fill_holes(job, port);
  std::weak_ptr<Job> wj = job;
  std::weak_ptr<bool> alive = alive_;
  const uint64_t gen = w.generation;
  // Each step's answer: on to `next`, or the job back to the queue / ended.
  auto step = [this, wj, alive, gen](std::function<void(const std::shared_ptr<Job>&, std::string)> next) {
    return [this, wj, alive, gen, next](EngineReply r) {
      if (alive.expired()) return;
      auto j = wj.lock();
      if (!j || j->state != Job::State::running || j->worker_generation != gen) return;
      j->engine_call.reset();
      if (r.status == 0) return on_engine_broken(j, r.why, r.replay);
      if (r.status != 200)
        return fail_forward(j, "worker " + std::to_string(j->worker) + " (exec engine) refused a step of the resume: HTTP " +
                                   std::to_string(r.status) + ": " + r.body.substr(0, 300));
      next(j, std::move(r.body));
    };
  };
  auto tokenize = [this, port, step](const std::shared_ptr<Job>& j, const std::string& text) {
    EngineRequest t;
    t.target = "/tokenize";
    t.body = tokenize_body(text);
    j->engine_call = fetch_whole(io_, port, t, opt_.engine, step([this, port](const std::shared_ptr<Job>& j, std::string body) {
      j->prompt_ids = read_tokens(body);
      if (!j->prompt_ids) return fail_forward(j, "the exec engine's /tokenize answer has no tokens: " + body.substr(0, 300));
      fill_holes(j, port);
    }));
  };
  if (!chat) {
    std::string text;
    job->prompt_ids = prompt_ids(*job->forward, text);
    if (job->prompt_ids) return fill_holes(job, port);
    return tokenize(job, text);
  }
  job->engine_call = fetch_whole(io_, port, apply_template_request(*job->forward), opt_.engine,
                                 step([this, tokenize](const std::shared_ptr<Job>& j, std::string body) {
                                   std::optional<std::string> prompt = read_prompt(body);
                                   if (!prompt)
                                     return fail_forward(j, "the exec engine's /apply-template answer has no prompt: " +
                                                                body.substr(0, 300));
                                   tokenize(j, *prompt);
                                 }));
}

// The ids the first answer's stream left out, one greedy token each, before
// the continuation goes on from them.
void Scheduler::fill_holes(const std::shared_ptr<Job>& job, int port) {
  ResumableStream& s = *job->resumable;
  const std::optional<size_t> hole = s.first_hole();
  if (!hole) return send_continuation(job, port);
  std::weak_ptr<Job> wj = job;
  std::weak_ptr<bool> alive = alive_;
  const uint64_t gen = job->worker_generation;
  const size_t at = *hole;
  job->engine_call = fetch_whole(
      io_, port, hole_request(*job->forward, job->resume_kind, *job->prompt_ids, s.generated(), at), opt_.engine,
      [this, wj, alive, gen, port, at](EngineReply r) {
        if (alive.expired()) return;
        auto j = wj.lock();
        if (!j || j->state != Job::State::running || j->worker_generation != gen) return;
        j->engine_call.reset();
        if (r.status == 0) return on_engine_broken(j, r.why, r.replay);
        const std::optional<int32_t> id = r.status == 200 ? first_token_id(r.body) : std::nullopt;
        if (!id)
          return fail_forward(j, "worker " + std::to_string(j->worker) +
                                     " (exec engine) gave no id for a token its stream left out: HTTP " +
                                     std::to_string(r.status) + ": " + r.body.substr(0, 300));
        EngineOp op;
        op.kind = EngineOp::Kind::hole;
        op.at = int64_t(at);
        op.id = *id;
        engine_op(*j, std::move(op));
        fill_holes(j, port);
      });
}

void Scheduler::send_continuation(const std::shared_ptr<Job>& job, int port) {
  ResumableStream& s = *job->resumable;
  std::optional<EngineRequest> req =
      continuation_request(*job->forward, job->resume_kind, *job->prompt_ids, s.generated(), s.top_logprobs());
  if (!req) {  // every token the client asked for is out: only the end was missing
    EngineOp op;
    op.kind = EngineOp::Kind::end;
    op.at = int64_t(job->prompt_ids->size());
    engine_op(*job, std::move(op));
    leave_worker(job);
    finish(job, {true, "length", job->timings, {}});
    return pump();
  }
  EngineOp begin;
  begin.kind = EngineOp::Kind::continuation;
  engine_op(*job, std::move(begin));
  job->continuation_status = 0;
  auto with = [wj = std::weak_ptr<Job>(job), alive = std::weak_ptr<bool>(alive_)](auto fn) {
    return while_running(wj, alive, fn);
  };
  EngineCall::Handler h;
  h.head = with([this](const std::shared_ptr<Job>& j, int status, const std::string&, bool) {
    blocked_.erase(j->worker);
    j->continuation_status = status;
  });
  h.data = with([](const std::shared_ptr<Job>& j, std::string_view bytes) {
    if (j->continuation_status != 200) return;
    EngineOp op;
    op.bytes = bytes;
    engine_op(*j, std::move(op));
  });
  h.done = with([this](const std::shared_ptr<Job>& j) {
    j->engine_call.reset();
    if (j->continuation_status != 200)
      return fail_forward(j, "worker " + std::to_string(j->worker) + " (exec engine) refused the continuation: HTTP " +
                                 std::to_string(j->continuation_status));
    leave_worker(j);
    finish(j, {true, "stop", j->timings, {}});
    pump();
  });
  h.broken = with([this](const std::shared_ptr<Job>& j, const std::string& why, bool replay) {
    on_engine_broken(j, why, replay);
  });
  log::debug("worker " + std::to_string(job->worker) + ": continuing an answer after " +
                 std::to_string(s.generated().size()) + " tokens",
             {{"DS4_WORKER", std::to_string(job->worker)}});
  job->engine_call = EngineCall::start(io_, port, *req, opt_.engine, std::move(h));
}

void Scheduler::to_client(Job& job, std::string_view bytes) {
  if (!job.sink) return;
  if (!job.anthropic) return job.sink->on_engine_data(bytes);
  const std::string out = job.anthropic->feed(bytes);
  if (!out.empty()) job.sink->on_engine_data(out);
}

void Scheduler::fail_forward(const std::shared_ptr<Job>& job, const std::string& message) {
  ++counters_.broken_calls;
  log::info("an exec engine's answer failed: " + message, {{"DS4_WORKER", std::to_string(job->worker)}});
  leave_worker(job);
  finish(job, {false, "", job->timings, {ErrorKind::internal, message}});
  pump();
}

void Scheduler::on_engine_broken(const std::shared_ptr<Job>& job, const std::string& why, bool replay) {
  if (!job->forwarded && replay) return on_broken(job, why, false);  // nothing reached the client: replay it
  if (job->forwarded && job->resumable) {
    ResumableStream& s = *job->resumable;
    if (s.ended() || s.finished()) {  // the answer was whole: only the connection's end was missing
      EngineOp op;
      op.kind = EngineOp::Kind::close;
      engine_op(*job, std::move(op));
      leave_worker(job);
      finish(job, {true, "stop", job->timings, {}});
      return pump();
    }
    if (replay && s.resumable()) return on_broken(job, why, true);  // continues on the next ready engine
  }
  // Part of the answer is out and this engine cannot resume it, or the
  // engine's answer is one no retry would mend.
  ++counters_.broken_calls;
  const int w = job->worker;
  log::info("an exec engine's answer failed" + std::string(job->forwarded ? " after its first byte" : "") +
                ": worker " + std::to_string(w) + ": " + why,
            {{"DS4_WORKER", std::to_string(w)}});
  leave_worker(job);
  const std::string what = job->forwarded ? " (exec engine) failed mid-answer: " : " (exec engine): ";
  finish(job, {false, "", job->timings,
               {ErrorKind::internal, "worker " + std::to_string(w) + what + why +
                                         (job->forwarded ? "; this engine's answer cannot be resumed, send the request again"
                                                         : "")}});
  pump();
}

void Scheduler::on_event(const std::shared_ptr<Job>& job, proto::Event&& e) {
  if (job->state != Job::State::running) return;
  using K = proto::Event::Kind;
  if (e.kind == K::token) {
    const int64_t expected = int64_t(job->gen.generated.size());
    if (e.token.index < expected) return;  // already have it
    if (e.token.index > expected) {
      job->call->cancel();
      return on_broken(job, "the worker skipped token " + std::to_string(expected), true);
    }
    blocked_.erase(job->worker);  // it answers: no backoff
    const auto now = Clock::now();
    if (job->call_tokens++ == 0) job->first_token = now;
    job->last_token = now;
    job->gen.generated.push_back(e.token.token);
    ++counters_.tokens_out;
    const bool more = job->sink && job->sink->on_token(e.token);
    if (more || job->state != Job::State::running) return;
    // The answer is complete before the worker knows: stop it, estimate its timings.
    auto ms = [](Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); };
    job->timings.prompt_n += int64_t(job->gen.prompt.size() + job->gen.generated.size()) - job->call_tokens;
    job->timings.prompt_ms += ms(job->first_token - job->call_started);
    job->timings.predicted_n += job->call_tokens;
    job->timings.predicted_ms += ms(job->last_token - job->first_token);
    leave_worker(job);
    finish(job, {true, "stop", job->timings, {}});
    pump();
    return;
  }
  if (e.kind == K::done) {
    job->timings.prompt_n += e.timings.prompt_n;
    job->timings.cache_n += e.timings.cache_n;
    job->timings.predicted_n += e.timings.predicted_n;
    job->timings.prompt_ms += e.timings.prompt_ms;
    job->timings.predicted_ms += e.timings.predicted_ms;
    if (e.reason == "cancelled") return on_broken(job, "the worker cancelled the request (stopping)", true);
    leave_worker(job);
    finish(job, {true, e.reason == "stop" ? "stop" : "length", job->timings, {}});
    pump();
    return;
  }
  // An error from the worker.
  if (e.message.find("stopping") != std::string::npos) return on_broken(job, e.message, true);
  leave_worker(job);
  if (e.message.find("context") != std::string::npos && !job->gen.generated.empty())
    finish(job, {true, "length", job->timings, {}});
  else
    finish(job, {false, "", job->timings, {ErrorKind::internal, "worker " + std::to_string(job->worker) + ": " + e.message}});
  pump();
}

void Scheduler::on_broken(const std::shared_ptr<Job>& job, const std::string& why, bool answered) {
  if (job->state != Job::State::running) return;
  ++counters_.broken_calls;
  const int w = job->worker;
  Block& b = blocked_[w];
  if (b.generation != job->worker_generation) b = {job->worker_generation, {}, {}};
  b.delay = b.delay.count() == 0 ? opt_.retry_min : std::min(b.delay * 2, opt_.retry_max);
  b.until = Clock::now() + b.delay;
  leave_worker(job);
  if (answered || !job->gen.generated.empty()) {
    ++job->resumes;
    ++counters_.resumes;
  }
  if (answered)  // a refused connect is routine while a worker restarts: not worth an entry each time
    log::debug("request moves back to the queue: worker " + std::to_string(w) + ": " + why,
               {{"DS4_WORKER", std::to_string(w)}, {"DS4_TOKENS_DONE", std::to_string(job->gen.generated.size())}});
  requeue_front(job);
  arm_retry();
  pump();
}

void Scheduler::requeue_front(const std::shared_ptr<Job>& job) {
  job->state = Job::State::queued;
  job->queued_at = Clock::now();
  // Ahead of every fresh job; among jobs moved back, in submission order.
  size_t p = 0;
  while (p < queue_.size() && queue_[p]->worker >= 0 && queue_[p]->seq < job->seq) ++p;
  queue_.insert(queue_.begin() + std::ptrdiff_t(p), job);
  enqueue_timer(job);
  arm_notices();
}

void Scheduler::leave_worker(const std::shared_ptr<Job>& job) {
  if (job->call) {
    job->call->cancel();
    job->call.reset();
  }
  if (job->engine_call) {
    job->engine_call->cancel();
    job->engine_call.reset();
  }
  if (running_.erase(job.get())) {
    --in_flight_[job->worker];
    if (!job->forward) remember(job->worker, *job);
  }
}

void Scheduler::finish(const std::shared_ptr<Job>& job, JobResult r) {
  job->state = Job::State::done;
  if (job->wait_timer) job->wait_timer->cancel();
  JobSink* sink = job->sink;
  job->sink = nullptr;
  if (sink) sink->on_done(r);
}

void Scheduler::remember(int worker, const Job& job) {
  auto& h = history_[worker];
  const size_t n_prompt = job.gen.prompt.size();
  // The same request seen again (it ends on this worker after it started
  // there): its entry grows by the tokens generated meanwhile.
  if (!h.empty() && h.back().size() >= n_prompt && h.back().size() <= n_prompt + job.gen.generated.size() &&
      std::equal(job.gen.prompt.begin(), job.gen.prompt.end(), h.back().begin()) &&
      std::equal(h.back().begin() + std::ptrdiff_t(n_prompt), h.back().end(), job.gen.generated.begin())) {
    h.back().insert(h.back().end(), job.gen.generated.begin() + std::ptrdiff_t(h.back().size() - n_prompt),
                    job.gen.generated.end());
    return;
  }
  std::vector<int32_t> seq = job.gen.prompt;
  seq.insert(seq.end(), job.gen.generated.begin(), job.gen.generated.end());
  h.push_back(std::move(seq));
  while (h.size() > opt_.prefix_history) h.pop_front();
}

void Scheduler::notify_positions(bool force) {
  for (size_t i = 0; i < queue_.size(); ++i) {
    Job& j = *queue_[i];
    const int64_t pos = int64_t(i) + 1;
    if (!force && j.last_position == pos) continue;
    j.last_position = pos;
    if (j.sink) j.sink->on_waiting(pos);
  }
}

void Scheduler::arm_notices() {
  if (notices_armed_ || queue_.empty()) return;
  notices_armed_ = true;
  notice_timer_.expires_after(opt_.notice_interval);
  notice_timer_.async_wait([this, alive = std::weak_ptr<bool>(alive_)](const boost::system::error_code& ec) {
    if (ec || alive.expired()) return;
    notices_armed_ = false;
    notify_positions(true);
    arm_notices();
  });
}

void Scheduler::arm_retry() {
  // The earliest block still in force; pump lets a worker in again after it.
  const auto now = Clock::now();
  Clock::time_point first = Clock::time_point::max();
  for (auto& [id, b] : blocked_)
    if (b.until > now) first = std::min(first, b.until);
  if (first == Clock::time_point::max()) return;
  retry_timer_.expires_at(first);
  retry_timer_.async_wait([this, alive = std::weak_ptr<bool>(alive_)](const boost::system::error_code& ec) {
    if (ec || alive.expired()) return;
    pump();
    if (!queue_.empty()) arm_retry();
  });
}

}  // namespace ds4::proxy
