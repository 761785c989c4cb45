#include "supervisor/policy.h"

#include <algorithm>
#include <cstdio>

#include "shared/bytes.h"
#include "shared/error.h"

namespace ds4::sup {

PolicyConfig PolicyConfig::from(const Config& c) {
  PolicyConfig p;
  p.ladder = ladder_rungs(c.workers.ladder);
  p.reserve = c.workers.reserve;
  p.min_available = c.headroom.min_available;
  p.low_for = c.headroom.for_;
  p.step_up_after = c.headroom.step_up_after;
  p.psi = c.headroom.psi;
  p.backoff_initial = c.restart.backoff_initial;
  p.backoff_max = c.restart.backoff_max;
  p.healthy_after = c.restart.healthy_after;
  p.hang_timeout = c.restart.hang_timeout;
  p.start_timeout = c.restart.start_timeout;
  return p;
}

const char* exit_kind_name(ExitKind k) {
  switch (k) {
    case ExitKind::clean: return "clean";
    case ExitKind::oom: return "oom";
    case ExitKind::crash: return "crash";
    case ExitKind::no_fit: return "does_not_fit";
    case ExitKind::killed: return "killed";
  }
  return "?";
}

WorkerPolicy::WorkerPolicy(int id, PolicyConfig config) : id_(id), config_(std::move(config)) {
  if (config_.ladder.empty()) throw Error("policy: the ladder is empty");
}

Decision WorkerPolicy::decision(const std::string& event, size_t from, size_t to, std::string reason) const {
  Decision d;
  d.event = event;
  d.worker = id_;
  const Rung &a = config_.ladder[from], &b = config_.ladder[to];
  d.context_from = a.context;
  d.context_to = b.context;
  if (has_expert_rungs(config_.ladder)) {
    d.host_experts_from = a.host_experts;
    d.host_experts_to = b.host_experts;
  }
  if (has_kv_rungs(config_.ladder)) {
    d.kv_cache_from = a.kv_cache;
    d.kv_cache_to = b.kv_cache;
  }
  d.reason = std::move(reason);
  return d;
}

namespace {

// The memory a worker's plan (KV cache, scratch) lives in: host memory, or,
// for a worker on a GPU, that device's free memory. A GPU worker's plan takes
// next to nothing of host memory, so a smaller one would free none there:
// host readings (MemAvailable, PSI) do not move it, and the GPU's do.
// On a GPU whose free memory is not known yet (no worker reported it, and no
// weights holder said), there is nothing to go by: not low, not ample, and a
// start takes the largest rung.
bool on_gpu(const Readings& r) { return r.on_gpu || r.gpu_free; }
bool room_known(const Readings& r) { return !on_gpu(r) || r.gpu_free; }
Bytes room(const Readings& r) { return r.gpu_free ? *r.gpu_free : r.available; }

std::string room_text(const Readings& r) {
  return r.gpu_free ? format_bytes(*r.gpu_free) + " free on the GPU" : format_bytes(r.available) + " available";
}

std::vector<std::pair<std::string, std::string>> room_figures(const Readings& r) {
  std::vector<std::pair<std::string, std::string>> f = {{"DS4_AVAILABLE", std::to_string(r.available)}};
  if (r.gpu_free) f.emplace_back("DS4_GPU_FREE", std::to_string(*r.gpu_free));
  return f;
}

}  // namespace

bool WorkerPolicy::low(const Readings& r) const {
  if (!room_known(r)) return false;
  if (room(r) < config_.min_available) return true;
  return !on_gpu(r) && config_.psi > 0 && r.psi_some_avg10 > config_.psi;
}

bool WorkerPolicy::ample(const Readings& r) const {
  if (rung_ == 0 || !room_known(r) || low(r)) return false;
  // The step up adds the difference of the two plans; what is left must
  // still be above both thresholds.
  const Bytes up = config_.ladder[rung_ - 1].own_bytes, here = config_.ladder[rung_].own_bytes;
  const Bytes extra = up > here ? up - here : 0;
  const Bytes keep = std::max(config_.min_available, config_.reserve);
  return room(r) >= extra && room(r) - extra >= keep;
}

Duration WorkerPolicy::backoff_delay() const {
  return std::min(config_.backoff_max,
                  config_.backoff_initial * (int64_t(1) << std::min<int64_t>(std::max<int64_t>(failures_ - 2, 0), 30)));
}

Step WorkerPolicy::start(TimePoint now, const Readings& r) {
  if (!room_known(r)) {
    Step s = start_at(0, "start",
                      "on a GPU whose free memory is not known yet: the largest rung (the worker checks its plan "
                      "against the GPU and, when it does not fit, exits 75 and restarts one rung lower at once)",
                      now);
    s.decisions.back().context_from = s.decisions.back().context_to;
    s.decisions.back().figures = room_figures(r);
    return s;
  }
  const Bytes free = room(r) > config_.reserve ? room(r) - config_.reserve : 0;
  size_t rung = config_.ladder.size() - 1;
  bool fits = false;
  for (size_t i = 0; i < config_.ladder.size(); ++i) {
    if (config_.ladder[i].own_bytes <= free) {
      rung = i;
      fits = true;
      break;
    }
  }
  const Bytes needs = config_.ladder[rung].own_bytes;
  std::string reason = fits ? "largest rung that fits: needs " + format_bytes(needs) + ", " + room_text(r) +
                                  " − " + format_bytes(config_.reserve) + " reserve"
                            : "no rung fits (smallest needs " + format_bytes(needs) + ", " + room_text(r) +
                                  " − " + format_bytes(config_.reserve) + " reserve); trying the smallest";
  Step s = start_at(rung, "start", reason, now);
  s.decisions.back().context_from = s.decisions.back().context_to;
  s.decisions.back().figures = room_figures(r);
  s.decisions.back().figures.insert(s.decisions.back().figures.end(),
                                    {{"DS4_RESERVE", std::to_string(config_.reserve)},
                                     {"DS4_NEEDS", std::to_string(needs)}});
  return s;
}

Step WorkerPolicy::start_at(size_t rung, const std::string& event, const std::string& reason, TimePoint now) {
  Step s;
  const size_t from = rung_;
  rung_ = rung;
  state_ = WorkerState::starting;
  started_at_ = now;
  stopping_ = false;
  hung_ = false;
  after_ = After::nothing;
  backoff_until_.reset();
  ready_since_.reset();
  low_since_.reset();
  ample_since_.reset();
  if (!event.empty()) s.decisions.push_back(decision(event, from, rung, reason));
  const Rung& to = config_.ladder[rung];
  s.actions.push_back({Action::Kind::start, to.context, to.host_experts, to.kv_cache});
  return s;
}

Step WorkerPolicy::on_ready(TimePoint now, int pid) {
  state_ = WorkerState::ready;
  pid_ = pid;
  ready_since_ = now;
  low_since_.reset();
  ample_since_.reset();
  return {};
}

Step WorkerPolicy::on_exit(TimePoint now, ExitKind kind, const std::string& message) {
  if (!message.empty()) last_error_ = message;
  pid_ = 0;
  const bool was_ready = state_ == WorkerState::ready || state_ == WorkerState::draining;
  // A worker that served a while and then died is a fault, not a crash loop:
  // it is restarted at once (it used to need backoff_max of readiness, so a
  // second kill within a minute paused every client for backoff_initial).
  if (ready_since_ && now - *ready_since_ >= config_.healthy_after) failures_ = 0;
  ready_since_.reset();

  // Out of memory, told by the kernel (OOM kill) or by the worker itself (its
  // plan did not fit, host or GPU): one rung lower, at once.
  if (kind == ExitKind::oom || kind == ExitKind::no_fit) {
    const bool oom = kind == ExitKind::oom;
    if (oom) ++oom_kills_;
    ++restarts_;
    const size_t to = std::min(rung_ + 1, config_.ladder.size() - 1);
    if (to == rung_) {
      // Already at the bottom: this is a failure like a crash.
      ++failures_;
    } else {
      failures_ = 0;
    }
    const std::string what = oom ? std::string("OOM-killed") : "memory plan did not fit";
    if (failures_ >= 2) {
      Step s;
      stopping_ = false;
      after_ = After::nothing;
      const Duration d = std::min(config_.backoff_max, config_.backoff_initial * (int64_t(1) << std::min<int64_t>(failures_ - 2, 30)));
      state_ = WorkerState::backoff;
      backoff_until_ = now + d;
      target_ = to;
      s.decisions.push_back(decision("backoff", rung_, to,
                                     what + " at the smallest " + config_.ladder[rung_].text() + " (" +
                                         std::to_string(failures_) + " failures in a row); retrying in " +
                                         format_duration(d)));
      s.decisions.back().figures = {{"DS4_BACKOFF_MS", std::to_string(d.count())},
                                    {"DS4_FAILURES", std::to_string(failures_)},
                                    {"DS4_EXIT", exit_kind_name(kind)}};
      return s;
    }
    const std::string where = " at " + config_.ladder[rung_].text() +
                              (to == rung_ ? "; already the smallest rung, restarting at it"
                                           : "; restarting one rung lower at once, at " + config_.ladder[to].text());
    if (oom) {
      Step s = start_at(to, "oom", "OOM-killed by the kernel" + where, now);
      s.decisions.back().figures = {{"DS4_OOM_KILLS", std::to_string(oom_kills_)}};
      return s;
    }
    Step s = start_at(to, "downgrade",
                      "the worker's memory plan did not fit" + where + (message.empty() ? "" : " (" + message + ")"),
                      now);
    s.decisions.back().figures = {{"DS4_EXIT", exit_kind_name(kind)}};
    return s;
  }

  if (stopping_) {
    stopping_ = false;
    if (after_ == After::start_target) {
      ++restarts_;
      if (hung_) {
        hung_ = false;
        ++failures_;
        if (failures_ >= 2) {
          const Duration d = backoff_delay();
          Step s;
          state_ = WorkerState::backoff;
          backoff_until_ = now + d;
          after_ = After::nothing;
          s.decisions.push_back(decision("backoff", rung_, target_,
                                         "worker hung and was killed, " + std::to_string(failures_) +
                                             " failures in a row; retrying in " + format_duration(d)));
          s.decisions.back().figures = {{"DS4_BACKOFF_MS", std::to_string(d.count())},
                                        {"DS4_FAILURES", std::to_string(failures_)}};
          return s;
        }
      }
      // Carries out a decision already logged (downgrade, upgrade, restart, hang).
      return start_at(target_, "", "", now);
    }
    state_ = WorkerState::stopped;
    after_ = After::nothing;
    return {};
  }

  // Unexpected: a crash, a person's kill, or a clean exit nobody asked for.
  ++failures_;
  ++restarts_;
  std::string what = std::string(exit_kind_name(kind)) + (was_ready ? "" : " before it was ready");
  if (!message.empty()) what += ": " + message;
  if (failures_ == 1) {
    Step s = start_at(rung_, "restart", "worker exited (" + what + "); restarting at once", now);
    s.decisions.back().figures = {{"DS4_EXIT", exit_kind_name(kind)}};
    return s;
  }
  Step s;
  const Duration d =
      std::min(config_.backoff_max, config_.backoff_initial * (int64_t(1) << std::min<int64_t>(failures_ - 2, 30)));
  state_ = WorkerState::backoff;
  backoff_until_ = now + d;
  target_ = rung_;
  s.decisions.push_back(decision("backoff", rung_, rung_,
                                 "worker exited (" + what + "), " + std::to_string(failures_) +
                                     " failures in a row; retrying in " + format_duration(d)));
  s.decisions.back().figures = {{"DS4_BACKOFF_MS", std::to_string(d.count())},
                                {"DS4_FAILURES", std::to_string(failures_)},
                                {"DS4_EXIT", exit_kind_name(kind)}};
  return s;
}

Step WorkerPolicy::on_health(TimePoint now, const Health& h) {
  std::string why;
  if (state_ == WorkerState::starting && config_.start_timeout.count() != 0 && now - started_at_ > config_.start_timeout) {
    why = "not ready " + format_duration(config_.start_timeout) +
          " after its start (restart.start_timeout): hung at start; killing it, then starting it again at " +
          config_.ladder[rung_].text();
  } else {
    if (state_ != WorkerState::ready || config_.hang_timeout.count() == 0) return {};
    const bool stale = h.heartbeat_age && *h.heartbeat_age > config_.hang_timeout;
    const bool mute = h.unanswered > config_.hang_timeout;
    if (!stale && !mute) return {};
    if (stale) why = "no heartbeat for " + format_duration(*h.heartbeat_age);
    if (mute) why += std::string(why.empty() ? "" : ", ") + "socket unanswered for " + format_duration(h.unanswered);
    why += " (hang_timeout " + format_duration(config_.hang_timeout) + "): hung; killing pid " + std::to_string(pid_) +
           ", then restarting at " + config_.ladder[rung_].text();
  }
  Step s;
  s.decisions.push_back(decision("hang", rung_, rung_, why));
  if (state_ == WorkerState::starting)
    s.decisions.back().figures = {{"DS4_START_TIMEOUT_MS", std::to_string(config_.start_timeout.count())}};
  else
    s.decisions.back().figures = {
        {"DS4_HEARTBEAT_AGE_MS", h.heartbeat_age ? std::to_string(h.heartbeat_age->count()) : std::string("none")},
        {"DS4_UNANSWERED_MS", std::to_string(h.unanswered.count())},
        {"DS4_HANG_TIMEOUT_MS", std::to_string(config_.hang_timeout.count())},
        {"DS4_PID", std::to_string(pid_)}};
  state_ = WorkerState::restarting;
  stopping_ = true;
  hung_ = true;
  after_ = After::start_target;
  target_ = rung_;
  low_since_.reset();
  ample_since_.reset();
  s.actions.push_back({Action::Kind::kill, 0});
  return s;
}

Step WorkerPolicy::on_timer(TimePoint now) {
  if (state_ != WorkerState::backoff || !backoff_until_ || now < *backoff_until_) return {};
  return start_at(target_, "restart",
                  "backoff over after " + std::to_string(failures_) + " failures; starting again", now);
}

std::optional<TimePoint> WorkerPolicy::next_wakeup() const {
  if (state_ == WorkerState::backoff) return backoff_until_;
  return std::nullopt;
}

Step WorkerPolicy::drain_then(size_t target, TimePoint now) {
  Step s;
  target_ = target;
  after_ = After::start_target;
  if (state_ == WorkerState::ready || state_ == WorkerState::starting) {
    state_ = WorkerState::draining;
    s.actions.push_back({Action::Kind::drain, 0});
  } else if (state_ == WorkerState::backoff || state_ == WorkerState::stopped) {
    // Nothing runs: start at the target right away.
    return start_at(target, "", "", now);
  }
  return s;
}

Step WorkerPolicy::on_drained(TimePoint now) {
  if (state_ != WorkerState::draining) return {};
  state_ = WorkerState::restarting;
  if (after_ == After::stay_stopped) state_ = WorkerState::draining;
  stopping_ = true;
  Step s;
  s.actions.push_back({Action::Kind::stop, 0});
  return s;
}

Step WorkerPolicy::on_readings(TimePoint now, const Readings& r, bool idle) {
  if (state_ != WorkerState::ready) {
    low_since_.reset();
    ample_since_.reset();
    return {};
  }
  Step s;
  if (low(r)) {
    ample_since_.reset();
    if (!low_since_) low_since_ = now;
    if (now - *low_since_ < config_.low_for) return s;
    const size_t to = rung_ + 1;
    if (to >= config_.ladder.size()) return s;  // nothing lower to go to: the kernel decides
    const std::string why = "headroom low for " + format_duration(std::chrono::duration_cast<Duration>(now - *low_since_)) +
                            ": " + room_text(r) + (room(r) < config_.min_available ? " < " : ", ") +
                            "min_available " + format_bytes(config_.min_available) +
                            (config_.psi > 0 && !on_gpu(r) ? ", PSI some avg10 " + std::to_string(r.psi_some_avg10) + "%"
                                                            : "") +
                            "; draining, then one rung lower";
    s.decisions.push_back(decision("downgrade", rung_, to, why));
    s.decisions.back().figures = room_figures(r);
    s.decisions.back().figures.insert(s.decisions.back().figures.end(),
                                      {{"DS4_MIN_AVAILABLE", std::to_string(config_.min_available)},
                                       {"DS4_PSI_SOME_AVG10", std::to_string(r.psi_some_avg10)}});
    Step d = drain_then(to, now);
    s.actions = d.actions;
    low_since_.reset();
    return s;
  }
  low_since_.reset();
  if (config_.step_up_after.count() == 0 || !ample(r)) {
    ample_since_.reset();
    return s;
  }
  if (!ample_since_) ample_since_ = now;
  if (now - *ample_since_ < config_.step_up_after || !idle) return s;
  const size_t to = rung_ - 1;
  const Bytes up = config_.ladder[to].own_bytes, here = config_.ladder[rung_].own_bytes;
  s.decisions.push_back(decision(
      "upgrade", rung_, to,
      "headroom ample for " + format_duration(std::chrono::duration_cast<Duration>(now - *ample_since_)) + ": " +
          room_text(r) + ", " + config_.ladder[to].text() + " needs " + format_bytes(up - std::min(up, here)) +
          " more; worker idle, one rung up"));
  s.decisions.back().figures = room_figures(r);
  s.decisions.back().figures.emplace_back("DS4_NEEDS", std::to_string(up));
  Step d = drain_then(to, now);
  s.actions = d.actions;
  ample_since_.reset();
  return s;
}

void WorkerPolicy::reset_headroom_timers(TimePoint now) {
  if (low_since_) low_since_ = now;
}

Step WorkerPolicy::request_drain(TimePoint now, const std::string& why) {
  Step s;
  if (state_ == WorkerState::backoff) {
    state_ = WorkerState::stopped;
    backoff_until_.reset();
    s.decisions.push_back(decision("stop", rung_, rung_, why + ": it stays stopped (it was waiting to start again)"));
    return s;
  }
  if (state_ != WorkerState::ready && state_ != WorkerState::starting) return s;
  after_ = After::stay_stopped;
  state_ = WorkerState::draining;
  s.decisions.push_back(decision("stop", rung_, rung_, why + ": draining, then it stays stopped"));
  s.actions.push_back({Action::Kind::drain, 0});
  return s;
}

Step WorkerPolicy::request_restart(TimePoint now) {
  failures_ = 0;
  if (state_ == WorkerState::draining || state_ == WorkerState::restarting) {
    target_ = rung_;
    after_ = After::start_target;
    return {};
  }
  Step s;
  s.decisions.push_back(decision("restart", rung_, rung_, "restart requested by an administrator"));
  Step d = drain_then(rung_, now);
  s.actions = d.actions;
  for (auto& x : d.decisions) s.decisions.push_back(x);
  return s;
}

Step WorkerPolicy::request_context(TimePoint now, uint32_t context) {
  const std::vector<Rung>& ladder = config_.ladder;
  auto it = std::find_if(ladder.begin(), ladder.end(), [&](const Rung& r) { return r.context == context; });
  if (it == ladder.end()) {
    std::string l;
    for (size_t i = 0; i < ladder.size(); ++i)
      if (i == 0 || ladder[i].context != ladder[i - 1].context)
        l += (l.empty() ? "" : ", ") + std::to_string(ladder[i].context);
    throw Error("context " + std::to_string(context) + " is not on the ladder [" + l + "]");
  }
  // Of a context's rungs (the largest has one per KV and expert rung), the
  // first: the most precise cache, the fewest experts on the host.
  const size_t to = size_t(it - ladder.begin());
  failures_ = 0;
  Step s;
  s.decisions.push_back(decision(to < rung_ ? "upgrade" : to > rung_ ? "downgrade" : "restart", rung_, to,
                                 "context set to " + std::to_string(context) + " by an administrator"));
  if (state_ == WorkerState::draining || state_ == WorkerState::restarting) {
    target_ = to;
    after_ = After::start_target;
    return s;
  }
  Step d = drain_then(to, now);
  s.actions = d.actions;
  for (auto& x : d.decisions) s.decisions.push_back(x);
  return s;
}

Step WorkerPolicy::request_stop(TimePoint now) {
  Step s;
  backoff_until_.reset();
  after_ = After::stay_stopped;
  if (state_ == WorkerState::stopped || state_ == WorkerState::backoff) {
    state_ = WorkerState::stopped;
    return s;
  }
  stopping_ = true;
  state_ = WorkerState::draining;
  s.decisions.push_back(decision("stop", rung_, rung_, "the supervisor is stopping"));
  s.actions.push_back({Action::Kind::stop, 0});
  return s;
}

Step WorkerPolicy::reconfigure(TimePoint now, PolicyConfig config) {
  if (config.ladder.empty()) throw Error("policy: the ladder is empty");
  const Rung was = current();
  config_ = std::move(config);
  const std::vector<Rung>& ladder = config_.ladder;
  if (const auto same = find_rung(ladder, was.context, was.host_experts, was.kv_cache)) {
    rung_ = *same;
    return {};
  }
  // The running context is no longer on the ladder: the largest rung not above it.
  size_t to = ladder.size() - 1;
  for (size_t i = 0; i < ladder.size(); ++i)
    if (ladder[i].context <= was.context) { to = i; break; }
  rung_ = std::min(rung_, ladder.size() - 1);
  Step s;
  Decision d;
  d.event = ladder[to].context < was.context ? "downgrade" : ladder[to].context > was.context ? "upgrade" : "restart";
  d.worker = id_;
  d.context_from = was.context;
  d.context_to = ladder[to].context;
  if (has_expert_rungs(ladder)) {
    d.host_experts_from = was.host_experts;
    d.host_experts_to = ladder[to].host_experts;
  }
  if (has_kv_rungs(ladder)) {
    d.kv_cache_from = was.kv_cache;
    d.kv_cache_to = ladder[to].kv_cache;
  }
  d.reason = "reload: " + was.text() + " is no longer on the ladder";
  s.decisions.push_back(d);
  Step x = drain_then(to, now);
  s.actions = x.actions;
  return s;
}

void WorkerPolicy::adopt(TimePoint now, uint32_t context, int pid, uint32_t host_experts, const std::string& kv_cache) {
  const std::vector<Rung>& ladder = config_.ladder;
  if (const auto r = find_rung(ladder, context, host_experts, kv_cache)) {
    rung_ = *r;
  } else {
    auto it = std::find_if(ladder.begin(), ladder.end(), [&](const Rung& x) { return x.context == context; });
    rung_ = it == ladder.end() ? ladder.size() - 1 : size_t(it - ladder.begin());
  }
  state_ = WorkerState::ready;
  pid_ = pid;
  ready_since_ = now;
}

}  // namespace ds4::sup
