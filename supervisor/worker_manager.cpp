#include "supervisor/worker_manager.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "shared/error.h"
#include "shared/log.h"

namespace ds4::sup {

void log_decision(const Decision& d) {
  std::vector<log::Field> f;
  const std::string worker = std::to_string(d.worker), from = std::to_string(d.context_from),
                    to = std::to_string(d.context_to),
                    experts_from = d.host_experts_from ? std::to_string(*d.host_experts_from) : "",
                    experts_to = d.host_experts_to ? std::to_string(*d.host_experts_to) : "";
  f.push_back({"DS4_EVENT", d.event});
  f.push_back({"DS4_WORKER", worker});
  f.push_back({"DS4_CONTEXT_FROM", from});
  f.push_back({"DS4_CONTEXT_TO", to});
  // log::Field views its value: the strings live until the line is written.
  if (d.host_experts_from) f.push_back({"DS4_HOST_EXPERTS_FROM", experts_from});
  if (d.host_experts_to) f.push_back({"DS4_HOST_EXPERTS_TO", experts_to});
  if (d.kv_cache_from) f.push_back({"DS4_KV_CACHE_FROM", *d.kv_cache_from});
  if (d.kv_cache_to) f.push_back({"DS4_KV_CACHE_TO", *d.kv_cache_to});
  f.push_back({"DS4_REASON", d.reason});
  for (const auto& [k, v] : d.figures) f.push_back({k, v});
  std::string msg = "worker " + worker + ": " + d.event;
  // An expert rung reads "32768/e4": context 32768, the experts of 4 layers
  // on the host; a KV rung "32768/q8_0".
  const std::string rung_from = from + (d.kv_cache_from ? "/" + *d.kv_cache_from : "") +
                                (d.host_experts_from ? "/e" + experts_from : ""),
                    rung_to = to + (d.kv_cache_to ? "/" + *d.kv_cache_to : "") +
                              (d.host_experts_to ? "/e" + experts_to : "");
  if (rung_from != rung_to) msg += " " + rung_from + " -> " + rung_to;
  else msg += " at " + rung_to;
  msg += ": " + d.reason;
  const bool bad = d.event == "oom" || d.event == "backoff" || d.event == "downgrade" || d.event == "hang";
  log::write(bad ? log::Level::warn : log::Level::info, msg, f);
}

WorkerManager::WorkerManager(asio::io_context& io, UnitBackend& backend, MemorySource& memory,
                             ManagerSettings settings)
    : io_(io), backend_(backend), memory_(memory), s_(std::move(settings)), sampler_(io), health_timer_(io) {
  backend_.set_callbacks({[this](int id, int pid) { on_ready(id, pid); },
                          [this](int id, ExitKind k, const std::string& m) { on_exit(id, k, m); }});
}

WorkerManager::Slot& WorkerManager::slot(int id) {
  auto it = slots_.find(id);
  if (it == slots_.end()) throw Error("no worker " + std::to_string(id) + " (there are " +
                                      std::to_string(slots_.size()) + ")");
  return it->second;
}

namespace {

/// A TCP port on 127.0.0.1 that nobody listens on now, for an exec engine.
/// Another process may take it before the engine binds it: the engine then
/// fails to start and the next start picks another one.
/// DS4_EXEC_PORTS=LO-HI (tests on a shared machine) takes one of that range,
/// in turn, else the kernel picks. A port whose last connections are in
/// TIME_WAIT (an engine that was killed) counts as free, as it is for an
/// engine that binds with SO_REUSEADDR (llama-server, vLLM, ds4-worker):
/// without that, a dozen kills in a minute used up a small range.
int bind_port(int want) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throw Error(std::string("cannot pick a port for the engine: socket: ") + std::strerror(errno));
  const int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(uint16_t(want));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  int port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0)
    port = ntohs(a.sin_port);
  ::close(fd);
  return port;
}

int free_tcp_port() {
  int lo = 0, hi = 0;
  if (const char* r = std::getenv("DS4_EXEC_PORTS"); r && std::sscanf(r, "%d-%d", &lo, &hi) == 2 && 0 < lo && lo <= hi &&
                                                       hi < 65536) {
    static int next = 0;
    for (int i = 0; i <= hi - lo; ++i) {
      const int p = lo + (next++ % (hi - lo + 1));
      if (bind_port(p) == p) return p;
    }
    throw Error("no free port for the engine in DS4_EXEC_PORTS=" + std::string(r));
  }
  const int port = bind_port(0);
  if (port == 0) throw Error("cannot pick a port for the engine on 127.0.0.1");
  return port;
}

}  // namespace

std::string WorkerManager::socket_path(int id) const {
  return s_.socket_dir + "/worker-" + std::to_string(id) + ".sock";
}

void WorkerManager::start() {
  last_ = memory_.read();
  std::map<int, AdoptedWorker> running;
  for (const auto& a : backend_.find_running(s_.segment)) running[a.id] = a;
  for (uint32_t i = 0; i < s_.count; ++i) {
    Slot& sl = slots_[int(i)];
    sl.policy = std::make_unique<WorkerPolicy>(int(i), s_.policy);
    sl.timer = std::make_unique<asio::steady_timer>(io_);
    auto it = running.find(int(i));
    if (it != running.end()) {
      sl.policy->adopt(now(), it->second.context, it->second.pid, it->second.host_experts, it->second.kv_cache);
      sl.pid = it->second.pid;
      sl.running = true;
      sl.generation = 1;
      sl.port = it->second.port;
      log::info("worker " + std::to_string(i) + ": adopted the running process " + std::to_string(sl.pid) +
                    " at context " + std::to_string(it->second.context),
                {{"DS4_WORKER", std::to_string(i)}, {"DS4_PID", std::to_string(sl.pid)}});
      continue;
    }
    start_worker(int(i));
  }
  notify();
  schedule_sample();
  schedule_health();
}

void WorkerManager::start_worker(int id) {
  // Room for this one: what others still starting will take is not free yet.
  // On a GPU: the free memory the workers running there report; before the
  // first one runs, what the weights holder sees (with the weights already
  // on the GPU); with neither, the policy starts at the largest rung.
  Readings r = memory_.read();
  add_gpu_figures(r);
  r.on_gpu = s_.gpu_workers;
  if (!r.on_gpu) {
    r.gpu_free.reset();
  } else if (!r.gpu_free && gpu_memory_) {
    if (const std::optional<GpuMemory> g = gpu_memory_()) {
      r.gpu_free = g->free;
      r.gpu_total = g->total;
    }
  }
  for (const auto& [oid, o] : slots_)
    if (oid != id && o.policy && o.policy->state() == WorkerState::starting) {
      const Bytes own = o.policy->current().own_bytes;
      Bytes& room = r.gpu_free ? *r.gpu_free : r.available;
      room = room > own ? room - own : 0;
    }
  apply(id, slot(id).policy->start(now(), r));
}

void WorkerManager::record(Slot& sl, const std::vector<Decision>& decisions) {
  for (const auto& d : decisions) {
    log_decision(d);
    ++sl.decisions[d.event];
    EventRecord e;
    e.time_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                    std::chrono::system_clock::now().time_since_epoch()).count();
    e.decision = d;
    events_.push_back(std::move(e));
    while (events_.size() > s_.events_kept) events_.pop_front();
  }
}

void WorkerManager::apply(int id, Step step) {
  Slot& sl = slot(id);
  record(sl, step.decisions);
  for (const auto& a : step.actions) {
    switch (a.kind) {
      case Action::Kind::start:
        launch(id, a.context, a.host_experts, a.kv_cache);
        break;
      case Action::Kind::stop:
        if (sl.running) backend_.stop(id);
        else {
          // Nothing to stop: report the exit ourselves.
          asio::post(io_, [this, id] { on_exit(id, ExitKind::clean, ""); });
        }
        break;
      case Action::Kind::kill:
        if (sl.running) backend_.kill(id);
        else asio::post(io_, [this, id] { on_exit(id, ExitKind::clean, ""); });
        break;
      case Action::Kind::drain:
        sl.drain_since = now();
        // Checked at once, then at every sample.
        asio::post(io_, [this, id] {
          Slot& s = slot(id);
          if (s.policy->state() == WorkerState::draining && s.drain_since && idle(id)) {
            s.drain_since.reset();
            apply(id, s.policy->on_drained(now()));
          }
        });
        break;
    }
  }
  arm_timer(id);
  notify();
}

void WorkerManager::launch(int id, uint32_t context, uint32_t host_experts, const std::string& kv_cache) {
  Slot& sl = slot(id);
  LaunchSpec spec;
  spec.memory_max = s_.memory_max;
  WorkerLaunch& l = spec.launch;  // segment_socket: the backend's
  l.id = id;
  l.segment = s_.segment;
  l.socket = socket_path(id);
  l.context = context;
  l.host_experts = host_experts;
  l.kv_cache = kv_cache;
  l.holder_experts = s_.holder_experts;
  l.slots = s_.slots;
  l.device = s_.device;
  l.gpu_weights = s_.gpu_weights;
  l.threads = s_.threads;
  l.prefill_chunk = s_.prefill_chunk;
  l.busy_poll_us = s_.busy_poll.count();
  l.control = s_.control;
  if (!s_.exec_command.empty()) {  // workers.engine: exec (worker/exec_engine.h)
    l.exec_command = s_.exec_command;
    l.model = s_.model_path;
    l.start_timeout_ms = exec_start_timeout_ms(s_.policy.start_timeout);
    try {
      l.port = sl.port = free_tcp_port();
    } catch (const Error& e) {
      // A start that failed, as if the engine had exited at once: the
      // policy restarts it, then backs off; the supervisor goes on.
      const std::string why = e.what();
      log::error("worker " + std::to_string(id) + ": " + why, {{"DS4_WORKER", std::to_string(id)}});
      sl.running = false;
      asio::post(io_, [this, id, why] { on_exit(id, ExitKind::crash, why); });
      return;
    }
  }
  sl.running = true;
  sl.pid = 0;
  sl.probing = false;
  sl.probe_failed_since.reset();
  ++sl.generation;
  backend_.start(spec);
}

void WorkerManager::arm_timer(int id) {
  Slot& sl = slot(id);
  sl.timer->cancel();
  auto when = sl.policy->next_wakeup();
  if (!when) return;
  sl.timer->expires_at(*when);
  sl.timer->async_wait([this, id](boost::system::error_code ec) {
    if (ec || stopping_) return;
    apply(id, slot(id).policy->on_timer(now()));
  });
}

void WorkerManager::on_ready(int id, int pid) {
  auto it = slots_.find(id);
  if (it == slots_.end()) return;
  Slot& sl = it->second;
  if (!sl.ready_since || sl.pid != pid) sl.ready_since = now();
  sl.pid = pid;
  sl.probe_failed_since.reset();
  std::string extra;
  if (sl.down_since) {
    sl.last_downtime_ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(now() - *sl.down_since).count();
    extra = ", " + std::to_string(sl.last_downtime_ms) + " ms after it went away";
    sl.down_since.reset();
  }
  const std::string msg = "worker " + std::to_string(id) + " ready (pid " + std::to_string(pid) + ", " +
                          sl.policy->current().text() + ")" + extra;
  if (extra.empty())
    log::info(msg, {{"DS4_WORKER", std::to_string(id)}, {"DS4_PID", std::to_string(pid)},
                    {"DS4_CONTEXT", std::to_string(sl.policy->context())}});
  else
    log::info(msg, {{"DS4_WORKER", std::to_string(id)}, {"DS4_PID", std::to_string(pid)},
                    {"DS4_CONTEXT", std::to_string(sl.policy->context())},
                    {"DS4_DOWNTIME_MS", std::to_string(sl.last_downtime_ms)}});
  apply(id, sl.policy->on_ready(now(), pid));
}

void WorkerManager::on_exit(int id, ExitKind kind, const std::string& message) {
  auto it = slots_.find(id);
  if (it == slots_.end()) return;
  Slot& sl = it->second;
  sl.running = false;
  sl.pid = 0;
  sl.drain_since.reset();
  sl.ready_since.reset();
  if (kind != ExitKind::clean) {
    if (!sl.down_since) sl.down_since = now();
  } else {
    sl.down_since = now();  // planned restarts are measured too
  }
  sl.last_exit = std::string(exit_kind_name(kind)) + (message.empty() ? "" : ": " + message);
  if (stopping_) {
    sl.policy->on_exit(now(), ExitKind::clean, message);  // expected: request_stop() came first
    notify();
    maybe_finish_stop();
    return;
  }
  apply(id, sl.policy->on_exit(now(), kind, message));
}

bool WorkerManager::idle(int id) const {
  if (!stats_) return true;
  const ProxyStats st = stats_->proxy_stats();
  auto it = st.in_flight_by_worker.find(id);
  return it == st.in_flight_by_worker.end() || it->second == 0;
}

void WorkerManager::schedule_sample() {
  sampler_.expires_after(s_.sample_every);
  sampler_.async_wait([this](boost::system::error_code ec) {
    if (ec || stopping_) return;
    sample();
    schedule_sample();
  });
}

void WorkerManager::schedule_health() {
  if (!health_) return;
  // Probes often enough that a healthy worker's answer is never near the
  // timeout; when detection is off, only the timer keeps going (a reload may
  // turn it on).
  const Duration every = s_.policy.hang_timeout.count() == 0
                             ? Duration(std::chrono::seconds(1))
                             : std::clamp<Duration>(s_.policy.hang_timeout / 5, std::chrono::milliseconds(50),
                                                    std::chrono::seconds(1));
  health_timer_.expires_after(every);
  health_timer_.async_wait([this](boost::system::error_code ec) {
    if (ec || stopping_) return;
    check_health();
    schedule_health();
  });
}

std::optional<control::Snapshot> WorkerManager::own_record(int id) const {
  if (!health_) return std::nullopt;
  auto it = slots_.find(id);
  if (it == slots_.end() || it->second.pid <= 0) return std::nullopt;
  auto rec = health_->record(id);
  if (!rec || rec->pid != it->second.pid) return std::nullopt;
  return rec;
}

void WorkerManager::check_health() {
  const Duration timeout = s_.policy.hang_timeout;
  if (!health_) return;
  const TimePoint t = now();
  for (auto& [id, sl] : slots_) {
    if (sl.policy->state() == WorkerState::starting) {  // judged by its start time alone (start_timeout)
      sl.probe_failed_since.reset();
      Step st = sl.policy->on_health(t, {});
      if (!st.actions.empty() || !st.decisions.empty()) apply(id, std::move(st));
      continue;
    }
    if (timeout.count() == 0 || sl.policy->state() != WorkerState::ready || sl.pid <= 0) {
      sl.probe_failed_since.reset();
      continue;
    }
    Health h;
    if (auto rec = own_record(id)) h.heartbeat_age = Duration(rec->heartbeat_age_ms(health_->now_ns()));
    // Only failed probes count (timed out after hang_timeout, refused): a
    // supervisor that was itself stalled does not take a late answer for none.
    if (sl.probe_failed_since) h.unanswered = std::chrono::duration_cast<Duration>(t - *sl.probe_failed_since);
    if (!sl.probing && s_.exec_command.empty()) {  // an exec engine has no token socket: its heartbeat only
      sl.probing = true;
      health_->probe(socket_path(id), timeout, [this, id, gen = sl.generation, started = t](bool answered) {
        auto it = slots_.find(id);
        if (it == slots_.end() || it->second.generation != gen) return;  // a process gone since
        Slot& s = it->second;
        s.probing = false;
        if (answered) s.probe_failed_since.reset();
        else if (!s.probe_failed_since) s.probe_failed_since = started;
      });
    }
    Step st = sl.policy->on_health(t, h);
    if (!st.actions.empty() || !st.decisions.empty()) apply(id, std::move(st));
  }
}

void WorkerManager::add_gpu_figures(Readings& r) const {
  r.gpu_free.reset();
  r.gpu_total.reset();
  for (const auto& [id, sl] : slots_) {
    auto rec = own_record(id);
    if (!rec || !rec->on_gpu()) continue;
    if (!r.gpu_free || rec->gpu_free < *r.gpu_free) {
      r.gpu_free = rec->gpu_free;
      r.gpu_total = rec->gpu_total;
    }
  }
}

Readings WorkerManager::readings_for(int id) const {
  Readings r = last_;
  r.gpu_free.reset();
  r.gpu_total.reset();
  if (auto rec = own_record(id); rec && rec->on_gpu()) {
    r.gpu_free = rec->gpu_free;
    r.gpu_total = rec->gpu_total;
  }
  return r;
}

Readings WorkerManager::last_readings() const {
  Readings r = last_;
  add_gpu_figures(r);
  return r;
}

void WorkerManager::sample() {
  last_ = memory_.read();
  add_gpu_figures(last_);
  const TimePoint t = now();
  for (auto& [id, sl] : slots_) {
    if (sl.policy->state() == WorkerState::draining && sl.drain_since) {
      if (idle(id) || t - *sl.drain_since >= s_.drain_deadline) {
        sl.drain_since.reset();
        apply(id, sl.policy->on_drained(t));
      }
      continue;
    }
    Step st = sl.policy->on_readings(t, readings_for(id), idle(id));
    const bool stepped_down = !st.decisions.empty() && st.decisions.front().event == "downgrade";
    apply(id, std::move(st));
    if (stepped_down) {
      // One worker at a time: the others count their low headroom anew.
      for (auto& [oid, o] : slots_)
        if (oid != id) o.policy->reset_headroom_timers(t);
    }
  }
}

void WorkerManager::drain(int id) { apply(id, slot(id).policy->request_drain(now())); }

void WorkerManager::restart(int id) { apply(id, slot(id).policy->request_restart(now())); }

void WorkerManager::set_context(int id, uint32_t context) {
  apply(id, slot(id).policy->request_context(now(), context));
}

void WorkerManager::stop(std::function<void()> done) {
  stopping_ = true;
  stopped_ = std::move(done);
  sampler_.cancel();
  health_timer_.cancel();
  for (auto& [id, sl] : slots_) {
    sl.timer->cancel();
    record(sl, sl.policy->request_stop(now()).decisions);
    if (sl.running) backend_.stop(id);
  }
  notify();  // draining now: the proxy sends them nothing more
  maybe_finish_stop();
}

void WorkerManager::maybe_finish_stop() {
  if (!stopping_ || !stopped_) return;
  for (const auto& [id, sl] : slots_)
    if (sl.running) return;
  auto done = std::move(stopped_);
  stopped_ = nullptr;
  notify();
  asio::post(io_, done);
}

void WorkerManager::reconfigure(ManagerSettings settings, bool restart_all) {
  const uint32_t old_count = s_.count;
  s_ = std::move(settings);
  for (auto& [id, sl] : slots_) {
    if (uint32_t(id) >= s_.count) continue;
    apply(id, sl.policy->reconfigure(now(), s_.policy));
    if (restart_all) apply(id, sl.policy->request_restart(now()));
  }
  // Fewer workers: drain and stop the extra ones, then forget them once stopped.
  for (auto& [id, sl] : slots_)
    if (uint32_t(id) >= s_.count)
      apply(id, sl.policy->request_drain(now(), "workers.count is now " + std::to_string(s_.count)));
  for (uint32_t i = old_count; i < s_.count; ++i) {
    if (slots_.count(int(i))) {
      apply(int(i), slots_[int(i)].policy->request_restart(now()));
      continue;
    }
    Slot& sl = slots_[int(i)];
    sl.policy = std::make_unique<WorkerPolicy>(int(i), s_.policy);
    sl.timer = std::make_unique<asio::steady_timer>(io_);
    start_worker(int(i));
  }
  notify();
}

std::vector<WorkerInfo> WorkerManager::workers() const {
  std::vector<WorkerInfo> out;
  for (const auto& [id, sl] : slots_) {
    WorkerInfo w;
    w.id = id;
    w.state = sl.policy->state();
    if (s_.exec_command.empty()) w.socket_path = socket_path(id);
    else w.http_port = sl.port;
    w.context = sl.policy->context();
    w.host_experts = sl.policy->host_experts();
    w.kv_cache = sl.policy->kv_cache();
    w.slots = s_.slots;
    w.pid = sl.pid;
    w.generation = sl.generation;
    w.restarts = sl.policy->restarts();
    w.oom_kills = sl.policy->oom_kills();
    w.decisions = sl.decisions;
    out.push_back(w);
  }
  return out;
}

nlohmann::json WorkerManager::status_json() const {
  nlohmann::json arr = nlohmann::json::array();
  const TimePoint t = now();
  for (const auto& [id, sl] : slots_) {
    const WorkerPolicy& p = *sl.policy;
    nlohmann::json w = {{"id", id},
                        {"unit", backend_.unit_name(id)},
                        {"state", state_name(p.state())},
                        {"pid", sl.pid},
                        {"context", p.context()},
                        {"host_experts", p.host_experts()},
                        {"kv_cache", p.kv_cache()},
                        {"slots", s_.slots},
                        {"restarts", p.restarts()},
                        {"oom_kills", p.oom_kills()},
                        {"generation", sl.generation},
                        {"degraded", p.degraded()},
                        {"failures", p.failures()},
                        {"last_error", p.last_error()},
                        {"last_exit", sl.last_exit},
                        {"engine", s_.exec_command.empty() ? "native" : "exec"},
                        {"socket", s_.exec_command.empty() ? socket_path(id) : ""},
                        {"rung", p.rung()},
                        {"memory_plan", p.current().own_bytes},
                        {"decisions", sl.decisions}};
    if (sl.last_downtime_ms >= 0) w["last_downtime_ms"] = sl.last_downtime_ms;
    // Since its current process said READY=1; null while it is not up.
    w["uptime_ms"] = sl.ready_since && sl.pid > 0
                         ? nlohmann::json(std::chrono::duration_cast<std::chrono::milliseconds>(t - *sl.ready_since).count())
                         : nlohmann::json(nullptr);
    if (!s_.exec_command.empty()) w["port"] = sl.port;
    // From the worker's own control block record: null when it keeps none.
    w["heartbeat_age_ms"] = nullptr;
    if (auto rec = own_record(id)) {
      w["heartbeat_age_ms"] = rec->heartbeat_age_ms(health_->now_ns());
      w["counters"] = {{"requests", rec->requests},
                       {"tokens_in", rec->tokens_in},
                       {"tokens_out", rec->tokens_out},
                       {"errors", rec->errors}};
      if (rec->on_gpu()) w["gpu"] = {{"free", rec->gpu_free}, {"total", rec->gpu_total}};
    }
    if (auto wake = p.next_wakeup(); wake && *wake > t)
      w["backoff_ms"] = std::chrono::duration_cast<std::chrono::milliseconds>(*wake - t).count();
    arr.push_back(std::move(w));
  }
  return arr;
}

nlohmann::json WorkerManager::ladder_json() const {
  nlohmann::json arr = nlohmann::json::array();
  for (const Rung& r : s_.policy.ladder)
    arr.push_back({{"context", r.context},
                   {"kv_cache", r.kv_cache},
                   {"host_experts", r.host_experts},
                   {"memory_plan", r.own_bytes}});
  return arr;
}

void WorkerManager::notify() {
  for (auto& fn : listeners_) fn();
}

}  // namespace ds4::sup
