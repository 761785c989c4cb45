#include "supervisor/supervisor.h"

#include <unistd.h>

#include <signal.h>
#include <systemd/sd-daemon.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "shared/bytes.h"
#include "shared/busy_poll.h"
#include "shared/error.h"
#include "shared/log.h"
#include "shared/model_store.h"
#include "supervisor/admin.h"
#include "supervisor/headroom.h"
#include "supervisor/keeper.h"
#include "supervisor/memfd_segments.h"
#include "supervisor/holder_keeper.h"
#include "supervisor/paths.h"
#include "supervisor/process_backend.h"
#include "supervisor/segment_server.h"
#include "supervisor/segment_sweeper.h"
#include "supervisor/start_signals.h"
#include "supervisor/systemd_backend.h"
#include "supervisor/worker_health.h"
#include "supervisor/worker_manager.h"

namespace ds4::sup {

namespace {

/// The binary and arguments process `pid` really runs (/proc, not config).
nlohmann::json proc_command(int pid) {
  if (pid <= 0) return nullptr;
  std::ifstream f("/proc/" + std::to_string(pid) + "/cmdline", std::ios::binary);
  std::string all((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (all.empty()) return nullptr;
  std::vector<std::string> argv;
  std::string cur;
  for (char c : all) {
    if (c == '\0') {
      argv.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  if (!cur.empty()) argv.push_back(cur);
  std::error_code ec;
  const auto exe = std::filesystem::read_symlink("/proc/" + std::to_string(pid) + "/exe", ec);
  nlohmann::json j;
  j["binary"] = ec ? (argv.empty() ? "" : argv[0]) : exe.string();
  j["args"] = argv.size() > 1 ? std::vector<std::string>(argv.begin() + 1, argv.end()) : std::vector<std::string>{};
  return j;
}

// What the proxy meets only once the model is loaded, found before it is: a
// port another process listens on, a device this build cannot use (a large
// model's load takes minutes to end in these errors otherwise). The config's
// own checks (load_config) cover the files it names.
void check_before_load(const Config& c, bool socket_inherited, const std::optional<WorkerCapabilities>& caps) {
  // A cuda device where ds4-worker has no CUDA backend: its workers and holder would crash-loop.
  if (const std::string why = device_refusal(c.workers.device, caps); !why.empty()) throw Error(why);
  const ListenAddress& l = c.proxy.listen;
  if (l.port != 0 && !socket_inherited) {  // an inherited socket is the proxy's already
    try {
      asio::io_context io;
      asio::ip::tcp::acceptor probe(io);
      const asio::ip::tcp::endpoint ep(asio::ip::make_address(l.host), l.port);
      probe.open(ep.protocol());
      probe.set_option(asio::socket_base::reuse_address(true));  // as the proxy binds it
      probe.bind(ep);
    } catch (const boost::system::system_error& e) {
      throw Error("proxy.listen " + l.str() + ": cannot listen: " + e.code().message());
    }
  }
}

ManagerSettings manager_settings(const Config& c, const ModelInfo& m, const std::string& runtime_dir,
                                 const std::string& control, const std::optional<WorkerCapabilities>& caps) {
  // Workers run on a GPU: cuda:N, or auto on a machine with an NVIDIA driver
  // (and workers that can use it: else auto workers run on the CPU).
  auto workers_on_gpu = [&](const Device& d) { return sup::workers_on_gpu(d, caps, nvidia_driver_present()); };
  ManagerSettings s;
  s.policy = PolicyConfig::from(c);
  if (c.workers.engine == WorkerEngine::exec) {
    // The engine's plan from the file's hyper-parameters, so that its first
    // start takes the largest rung that fits. A file without them: the
    // largest rung, and only an OOM kill, a failed start or low headroom
    // steps it down.
    try {
      std::string detail;
      s.policy.ladder = plan_exec_ladder(m.path, c.workers, keep_resident(c), &detail);
      log::info("exec engine plan: " + detail.substr(0, detail.size() - 2), {{"DS4_EVENT", "exec_plan"}});
    } catch (const Error& e) {  // the ladder's plans stay 0
      log::warn(std::string(e.what()) + "; the exec engine starts at the largest rung, ignoring");
    }
    s.exec_command = c.workers.exec_command;
    s.model_path = m.path;
    std::string kv_note;
    kv_rungs(m, c.workers, &kv_note);  // says that workers.kv_cache is the command line's here
    if (!kv_note.empty()) log::info(kv_note, {{"DS4_KV_CACHE", "f16"}});
  } else {
    // A mixture of experts on a GPU: the expert rungs come before the
    // smaller contexts; each rung's plan counts the experts the worker
    // copies itself (those its holder lacks: not with host-mapped weights).
    std::string note;
    const std::vector<uint32_t> rungs = expert_rungs(m, c.workers, workers_on_gpu(c.workers.device), &note);
    if (!note.empty()) log::info(note, {{"DS4_MOE_OFFLOAD", std::to_string(rungs.back())}});
    // The KV cache rungs come first at the largest context (workers.kv_cache).
    std::string kv_note;
    const std::vector<std::string> kv = kv_rungs(m, c.workers, &kv_note);
    if (!kv_note.empty()) log::info(kv_note, {{"DS4_KV_CACHE", kv.back()}});
    s.holder_experts = rungs.back();
    s.policy.ladder = plan_ladder(m, ladder_rungs(c.workers.ladder, kv, rungs), c.workers.slots, c.workers.threads,
                                  c.workers.prefill_chunk, c.gpu.weights == GpuWeights::device ? s.holder_experts : 0);
  }
  s.count = c.workers.count;
  s.slots = c.workers.slots;
  s.device = c.workers.device.str();
  s.gpu_workers = workers_on_gpu(c.workers.device);
  s.gpu_weights = c.gpu.weights == GpuWeights::host_mapped ? "host-mapped" : "auto";
  s.threads = c.workers.threads;
  s.prefill_chunk = c.workers.prefill_chunk;
  s.busy_poll = busy_poll_for(c.workers.busy_poll);
  s.memory_max = c.workers.memory_max;
  s.segment = m.segment;
  s.control = control;
  s.socket_dir = runtime_dir;
  s.drain_deadline = c.restart.drain_deadline;
  // Sample often enough to notice low headroom well within `for`.
  s.sample_every = std::clamp<Duration>(c.headroom.for_ / 4, std::chrono::milliseconds(100), std::chrono::seconds(1));
  return s;
}

// How the model is held, for status and the journal.
std::string backing_text(const ModelInfo& m, const MemfdSegments& memfds) {
  if (m.file_only) return "none (the exec engine loads the file)";
  if (m.backing == store::Backing::shm) return "shared memory";
  if (!memfds.fd_store()) return "memfd (in the supervisor)";
  return under_keeper() ? "memfd (in the supervisor, its keeper's fd store)" : "memfd (in the supervisor, fd store)";
}

}  // namespace

Supervisor::Supervisor(SupervisorOptions options) : opts_(std::move(options)) {
  if (opts_.bin_dir.empty()) opts_.bin_dir = self_dir();
}

Supervisor::~Supervisor() {
  log::set_observer(nullptr);
  stop_segment_server();
}

namespace {
int64_t wall_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}
size_t samples_kept(const StatusConfig& s) { return size_t(std::max<int64_t>(1, s.history / s.sample_every)); }
}  // namespace

void Supervisor::stop_segment_server() {
  segments_io_.stop();
  if (segments_thread_.joinable()) segments_thread_.join();
  if (segments_) segments_->close();
}

WorkerRegistry& Supervisor::registry() {
  if (!manager_) throw Error("Supervisor::registry() before prepare()");
  return *manager_;
}

void Supervisor::set_proxy_stats(const ProxyStatsSource* stats) {
  stats_ = stats;
  if (manager_) manager_->set_proxy_stats(stats);
}

void Supervisor::prepare() {
  // Until run() handles them, SIGTERM and SIGINT stop the model load instead
  // of ending the process in the middle of it (start_signals.h).
  StartSignals signals;
  // Every DS4_EVENT entry from here on is kept for the status page too.
  log::set_observer([ring = events_](log::Level level, std::string_view message, std::span<const log::Field> fields) {
    if (auto e = status_event(level, message, fields, wall_ms())) ring->add(std::move(*e));
  });
  config_ = load_config(opts_.config_path, {.model_file_must_exist = true});
  events_->set_capacity(config_.status.events_kept);
  samples_.set_capacity(samples_kept(config_.status));
  if (!config_.file_found && opts_.config_given)  // a typo must not run a random-weights model
    throw Error(opts_.config_path + ": no such config file (copy config/ds4.yaml there and set model.path, or "
                                    "leave --config out to run on the defaults)");
  if (!config_.file_found)
    log::warn("config file " + opts_.config_path + " not found; running on the defaults");
  runtime_dir_ = runtime_dir();
  ensure_private_dir(runtime_dir_);
  if (!under_keeper()) runtime_lock_ = RuntimeDirLock(runtime_dir_);  // else the keeper holds it for us
  // Memfd segments a previous run of ours left in systemd's fd store, and
  // the socket unit's listening socket.
  std::optional<uint32_t> store_max;
  memfds_ = std::make_unique<MemfdSegments>(MemfdSegments::systemd_fd_store_available(&store_max));
  if (memfds_->fd_store())  // two descriptors a connection, after the segments' slots
    connection_slots_ = store_max ? (*store_max > kMemfdStoreSlots ? (*store_max - kMemfdStoreSlots) / 2 : 0) : 0;
  PassedFds passed = memfds_->recover();
  stored_connections_ = std::move(passed.connections);
  const std::vector<int>& sockets = passed.listeners;
  if (!sockets.empty()) listen_fd_ = sockets.front();
  for (size_t i = 1; i < sockets.size(); ++i) {
    log::warn("systemd passed " + std::to_string(sockets.size()) + " listening sockets; the proxy listens on the first, " +
              "closing descriptor " + std::to_string(sockets[i]));
    ::close(sockets[i]);
  }
  // What the workers can run, from ds4-worker itself (asked once).
  std::string caps_why;
  worker_caps_ = ask_worker_capabilities(opts_.bin_dir + "/ds4-worker", &caps_why);
  if (!worker_caps_)
    log::warn("cannot ask ds4-worker what it runs (" + caps_why + "); assuming it may have a CUDA backend, ignoring");
  check_before_load(config_, listen_fd_ >= 0, worker_caps_);
  try {
    model_ = prepare_model(config_, runtime_dir_, opts_.bin_dir, *memfds_, signals.token());
  } catch (const store::LoadCancelled&) {
    sd_notify(0, "STOPPING=1\nSTATUS=stopped during the model load");
    throw;
  }
  if (!model_.file_only)
    log::info("model " + model_.name + " in segment " + model_.segment + " (" + format_bytes(model_.bytes) + ", " +
                  backing_text(model_, *memfds_) + (model_.reused ? ", reused" : ", loaded") + ")",
              {{"DS4_SEGMENT", model_.segment},
               {"DS4_MODEL", model_.path},
               {"DS4_BACKING", store::backing_name(model_.backing)},
               {"DS4_REUSED", model_.reused ? "1" : "0"}});
  if (model_.file_only && keep_resident(config_)) {
    resident_ = std::make_unique<ResidentFile>(model_.path);
    log::info("model.keep_resident: " + model_.path + " (" + format_bytes(resident_->bytes()) +
                  ") mapped by the supervisor; reading and locking its pages",
              {{"DS4_EVENT", "keep_resident"}, {"DS4_MODEL", model_.path}});
    resident_timer_ = std::make_unique<asio::steady_timer>(io_);
    keep_resident_now();
  }
    // Workers and the holder get a memfd segment's descriptor here, from before
  // either starts (start_holder() waits for the holder on this thread).
  segments_ = std::make_unique<SegmentServer>(segments_io_, runtime_dir_ + "/segments.sock", *memfds_);
  segments_thread_ = std::thread([this] { segments_io_.run(); });
  SweeperSettings sweep;
  sweep.memfds = memfds_.get();
  sweep.ledger_path = runtime_dir_ + "/segments.list";
  sweeper_ = std::make_unique<SegmentSweeper>(io_, std::move(sweep));
  sweeper_->set_current(model_.segment, model_.fd.get());  // sweeps once run() starts
  memory_ = std::make_unique<ProcMemorySource>();
  start_backend();
  start_holder();
  // The workers' records: kept when a restarted supervisor finds its own.
  health_ = std::make_unique<WorkerHealth>(io_, control::Block::create_or_open(control::segment_name_for(runtime_dir_)));
  manager_ = std::make_unique<WorkerManager>(io_, *backend_, *memory_,
                                             manager_settings(config_, model_, runtime_dir_, health_->name(), worker_caps_));
  manager_->set_proxy_stats(stats_);
  manager_->set_health_source(health_.get());
  // A GPU worker's first start goes by the free memory the holder sees.
  manager_->set_gpu_memory_source([this]() -> std::optional<GpuMemory> {
    return holder_ ? holder_->device_memory() : std::nullopt;
  });
  manager_->on_change([this] { maybe_ready(); });
  sweeper_->watch(*manager_);  // an old model's segment goes once its last worker has
  admin_ = std::make_unique<AdminServer>(io_, runtime_dir_ + "/admin.sock",
                                         [this](const nlohmann::json& r) { return handle_admin(r); });
}

// Every 10 s: where the lock was refused, what the kernel evicted comes back.
void Supervisor::keep_resident_now() {
  if (!resident_) return;
  const ResidentFile::Mode m = resident_->mode();
  if (m == ResidentFile::Mode::touched) {
    if (!resident_warned_) {
      resident_warned_ = true;
      log::warn("model.keep_resident: cannot lock " + model_.path + " in memory: " + resident_->lock_error() +
                "; re-touching its pages every 10s instead (raise LimitMEMLOCK= to lock them)");
    }
    if (const uint64_t back = resident_->touch(); back > 0)
      log::info("model.keep_resident: " + format_bytes(back) + " of " + model_.path + " had been evicted; read back");
  } else if (m == ResidentFile::Mode::locked && !resident_warned_) {
    resident_warned_ = true;
    log::info("model.keep_resident: " + model_.path + " locked in memory (" + format_bytes(resident_->resident_bytes()) +
                  " resident)",
              {{"DS4_EVENT", "keep_resident"}, {"DS4_MODEL", model_.path}});
  }
  resident_timer_->expires_after(m == ResidentFile::Mode::loading ? std::chrono::milliseconds(200) : std::chrono::seconds(10));
  resident_timer_->async_wait([this](const boost::system::error_code& ec) {
    if (!ec) keep_resident_now();
  });
}

void Supervisor::start_backend() {
  const std::string worker = opts_.bin_dir + "/ds4-worker";
  const WorkerBackend want = config_.workers.backend;
  if (want != WorkerBackend::process) {
    std::string why;
    SystemdBackendOptions so;
    so.worker_binary = worker;
    so.runtime_dir = runtime_dir_;
    backend_ = make_systemd_backend(io_, so, &why);
    if (backend_) return;
    if (want == WorkerBackend::systemd)
      throw Error("workers.backend is systemd, but " + why);
    log::info("no systemd user manager (" + why + "): running workers as child processes");
  }
  ProcessBackendOptions po;
  po.worker_binary = worker;
  po.runtime_dir = runtime_dir_;
  if (const char* cg = std::getenv("DS4_WORKER_CGROUP_PARENT")) po.cgroup_parent = cg;
  if (under_keeper()) po.keeper_pid = int(::getppid());  // workers outlive us; the next run adopts them
  auto pb = std::make_unique<ProcessBackend>(io_, po);
  if (config_.workers.memory_max > 0 && !pb->cgroup_note().empty())
    log::warn("workers.memory_max is not enforced for child processes: " + pb->cgroup_note());
  backend_ = std::move(pb);
}

std::optional<int> Supervisor::holder_device() const {
  // GPU workers map the weights a holder keeps on the device, so a restarted
  // worker does not copy them again. Not for host-mapped weights (they stay in
  // the shared pages) nor for CPU workers.
  const Device& d = config_.workers.device;
  if (config_.gpu.weights != GpuWeights::device || !workers_on_gpu(d, worker_caps_, nvidia_driver_present()))
    return std::nullopt;
  if (config_.workers.engine == WorkerEngine::exec) return std::nullopt;  // an external engine loads its own
  return d.kind == Device::Kind::cuda ? d.index : 0;
}

void Supervisor::start_holder(std::function<void()> settled) {
  const std::optional<int> device = holder_device();
  if (!device) {
    if (settled) settled();
    return;
  }
  HolderSettings hs;
  hs.worker_binary = opts_.bin_dir + "/ds4-worker";
  hs.segment = model_.segment;
  hs.device = *device;
  hs.socket = runtime_dir_ + "/holder-cuda" + std::to_string(hs.device) + ".sock";
  hs.segment_socket = segments_->path();
  hs.host_experts = expert_rungs(model_, config_.workers, true).back();  // the last expert rung's
  sd_notify(0, ("STATUS=copying the weights to cuda:" + std::to_string(hs.device)).c_str());
  holder_ = std::make_unique<HolderKeeper>(io_, hs);
  if (settled) holder_->start_async(std::move(settled));
  else holder_->start();
}

void Supervisor::maybe_ready() {
  if (ready_sent_ || stopping_) return;
  bool any = false;
  for (const auto& w : manager_->workers())
    if (w.state == WorkerState::ready || w.state == WorkerState::backoff) any = true;
  if (!any || (ready_gate_ && !ready_gate_())) return;
  ready_sent_ = true;
  sd_notify(0, ("READY=1\nSTATUS=serving " + model_.name + " with " + std::to_string(config_.workers.count) +
                " worker(s), " + backend_->name() + " backend")
                   .c_str());
  log::info("ready: admin socket " + runtime_dir_ + "/admin.sock, workers via " + backend_->name());
}

int Supervisor::run() {
  if (!manager_) prepare();
  wait_signals();
  StartSignals::unblock();  // one that came after the model load reaches shutdown() now
  manager_->start();
  status_timer_ = std::make_unique<asio::steady_timer>(io_);
  sample_status();
  schedule_status_sample();
  run_busy_polling(io_, [this] { return busy_poll_for(config_.proxy.busy_poll); });
  return exit_status_;
}

void Supervisor::schedule_status_sample() {
  status_timer_->expires_after(config_.status.sample_every);
  status_timer_->async_wait([this](boost::system::error_code ec) {
    if (ec || stopping_workers_) return;
    sample_status();
    schedule_status_sample();
  });
}

void Supervisor::sample_status() {
  const auto now = std::chrono::steady_clock::now();
  const ProxyActivity activity = stats_ ? stats_->proxy_activity() : ProxyActivity{};
  const ProxyStats ps = stats_ ? stats_->proxy_stats() : ProxyStats{};
  const Readings r = manager_->last_readings();
  StatusSample s;
  s.time_ms = wall_ms();
  s.host_available = int64_t(r.available);
  if (r.gpu_free) s.gpu_free = int64_t(*r.gpu_free);
  s.min_available = int64_t(config_.headroom.min_available);
  s.waiting = ps.waiting;
  s.in_flight = ps.in_flight;
  if (last_sample_) {  // the first sample has no interval to measure rates over
    const ActivityDelta d =
        activity_delta(last_activity_, activity, std::chrono::duration<double>(now - *last_sample_).count());
    s.tokens_per_s = d.tokens_per_s;
    s.answered = d.answered;
    s.latency_p50_s = d.latency_p50_s;
    s.latency_max_s = d.latency_max_s;
  }
  samples_.push(s);
  last_activity_ = activity;
  last_activity_.requests.clear();
  last_sample_ = now;
}

void Supervisor::wait_signals() {
  signals_ = std::make_unique<asio::signal_set>(io_, SIGTERM, SIGINT, SIGHUP);
  signals_->async_wait([this](boost::system::error_code ec, int sig) {
    if (ec) return;
    if (sig == SIGHUP) {
      if (!stopping_) reload();
      wait_signals();
      return;
    }
    shutdown(sig);
    if (!stopping_workers_) wait_signals();  // a second signal cuts the drain short
  });
}

void Supervisor::shutdown(int sig) {
  if (stopping_) {
    log::info("stopping on signal " + std::to_string(sig) + " again: not waiting for the requests in flight");
    return stop_workers();
  }
  stopping_ = true;
  loader_.request_stop();  // a reload's model load in progress ends now, not when it is done
  const Duration deadline = config_.restart.drain_deadline;
  sd_notify(0, "STOPPING=1\nSTATUS=stopping: finishing the requests in flight");
  log::info("stopping on signal " + std::to_string(sig) + ": finishing the requests in flight (at most " +
            format_duration(deadline) + ", restart.drain_deadline), then stopping the workers");
  // The workers keep serving (and are restarted if they fail) until every
  // listener has finished what it had.
  auto left = std::make_shared<size_t>(stop_listeners_.size());
  if (*left == 0) return stop_workers();
  for (auto& fn : stop_listeners_)
    fn(deadline, [this, left] {
      if (--*left == 0) stop_workers();
    });
}

void Supervisor::stop_workers() {
  if (stopping_workers_) return;
  stopping_workers_ = true;
  sd_notify(0, "STATUS=stopping the workers");
  log::info("stopping the workers");
  sweeper_->stop();
  manager_->stop([this] {
    log::info("all workers stopped");
    if (health_) control::Block::remove(health_->name());
    if (holder_) holder_->stop();
    if (admin_) admin_->close();
    stop_segment_server();
    if (signals_) signals_->cancel();
    io_.stop();
  });
}

bool Supervisor::reload(std::string* error) {
  if (reloading_) {
    // Applied now, a change would be undone when the reload in progress
    // applies the config it was read with.
    const std::string why = "a reload is still in progress (a new model loading, or its weights going to the GPU); "
                            "reload again once it is served";
    log::warn("reload refused: " + why);
    if (error) *error = why;
    return false;
  }
  Config next;
  try {
    next = load_config(opts_.config_path, {.model_file_must_exist = true});
    // Defaults stand in for a missing file, and a synthetic model with random
    // weights for a missing model.path: right for a first start, never in
    // place of a served model.
    if (!next.file_found && config_.file_found)
      throw Error(opts_.config_path + ": no such file (moved or deleted?); nothing to reload");
    if (next.model.path.empty() && !model_.synthetic)
      throw Error(opts_.config_path + ": no model.path: the served model " + model_.name +
                  " would give way to one with random weights; set model.path");
  } catch (const Error& e) {
    log::error(std::string("reload refused, keeping the running config: ") + e.what(),
               {{"DS4_EVENT", "reload_failed"}});
    if (error) *error = e.what();
    return false;
  }
  sd_notify(0, "RELOADING=1");
  ConfigChanges ch = diff(config_, next);
  if (!ch.model && !model_.synthetic) {
    // The same model.path, but the file may have been replaced (a new
    // version of the model): its identity names another segment then.
    try {
      if (store::segment_name(store::identify(model_.path)) != model_.file_key) {
        ch.model = true;
        ch.keys.push_back("the model file " + model_.path + " (changed on disk)");
      }
    } catch (const Error& e) {
      log::warn(std::string("reload: cannot read the model file, keeping the loaded model: ") + e.what());
      if (error) *error = std::string("cannot read the model file, so the loaded model stays: ") + e.what();
    }
  }
  if (!ch.any()) {
    log::info("reload: nothing changed");
    sd_notify(0, "READY=1");
    return true;
  }
  std::string keys;
  for (const auto& k : ch.keys) keys += (keys.empty() ? "" : ", ") + k;
  if (ch.changed("workers.backend"))
    log::warn("reload: workers.backend takes effect at the next supervisor start, ignoring");
  next.workers.backend = config_.workers.backend;
  if (!ch.model) {
    log::info("reload: changed " + keys, {{"DS4_EVENT", "reload"}});
    return apply_reload(std::move(next), ch, std::nullopt, error);
  }
  // A new model: loading it takes minutes for a large one, so it loads on a
  // thread of its own while the workers keep serving the old one and the
  // proxy keeps answering; the change is applied once it is in memory.
  log::info("reload: changed " + keys + "; loading the new model while the old one serves",
            {{"DS4_EVENT", "reload"}});
  reloading_ = true;
  if (loader_.joinable()) loader_.join();
  loader_ = std::jthread([this, next = std::move(next), ch, control = health_->name()](std::stop_token stop) mutable {
    std::optional<Loaded> loaded;
    std::string failed;
    Loaded l;
    try {
      l.model = prepare_model(next, runtime_dir_, opts_.bin_dir, *memfds_, stop);
      l.settings = manager_settings(next, l.model, runtime_dir_, control, worker_caps_);
      loaded = std::move(l);
    } catch (const store::LoadCancelled& e) {
      log::info(std::string("reload: the new model's load stopped, nothing of it kept: ") + e.what(),
                {{"DS4_EVENT", "reload_failed"}});
      return;  // the supervisor is stopping
    } catch (const Error& e) {
      failed = e.what();
      // A memfd made by this load would never be served (nor swept): let it go.
      if (l.model.fd && !l.model.reused) memfds_->release(l.model.segment);
    }
    asio::post(io_, [this, next = std::move(next), ch, loaded = std::move(loaded), failed]() mutable {
      if (stopping_) return;
      if (!loaded) {
        reloading_ = false;
        log::error("reload failed while loading the new model, the old one keeps serving: " + failed,
                   {{"DS4_EVENT", "reload_failed"}});
        sd_notify(0, "READY=1");
        return;
      }
      apply_reload(std::move(next), ch, std::move(loaded), nullptr);
    });
  });
  return true;
}

bool Supervisor::apply_reload(Config next, const ConfigChanges& ch, std::optional<Loaded> loaded, std::string* error) {
  const bool model_changed = loaded.has_value();
  try {
    if (loaded) {
      model_ = std::move(loaded->model);
      sweeper_->set_current(model_.segment, model_.fd.get());
    }
    ManagerSettings s = loaded ? std::move(loaded->settings) : manager_settings(next, model_, runtime_dir_, health_->name(), worker_caps_);
    const bool restart_all = ch.model || ch.changed("workers.slots") || ch.changed("workers.device") ||
                             ch.changed("workers.threads") || ch.changed("workers.busy_poll") ||
                             ch.changed("workers.prefill_chunk") ||
                             ch.changed("workers.memory_max") ||
                             ch.changed("workers.engine") || ch.changed("gpu.weights") ||
                             ch.changed("workers.moe_offload");
    const Config before = config_;
    config_ = next;
    events_->set_capacity(config_.status.events_kept);
    samples_.set_capacity(samples_kept(config_.status));
    // The holder follows workers.device, gpu.weights and the model: stopped
    // when no longer wanted or on another GPU, given the new model when it
    // stays, started when wanted and not running. Each copy of the weights is
    // made once, before the workers restart (so that they map it), and off
    // the io thread: the old workers and the proxy serve meanwhile.
    const std::optional<int> want = holder_device();
    if (holder_ && (!want || holder_->device() != *want)) {
      holder_->stop();
      holder_.reset();
      log::info("reload: the GPU weights holder is stopped" +
                std::string(want ? ", one for cuda:" + std::to_string(*want) + " replaces it" : ": not needed now"));
    }
    const uint32_t holder_experts = s.holder_experts;
    auto then = [this, before, s = std::move(s), restart_all, ch, model_changed]() mutable {
      finish_reload(before, std::move(s), restart_all, ch, model_changed);
    };
    if (holder_ && (model_changed || holder_experts != holder_->host_experts())) {
      reloading_ = true;
      holder_->change_image(model_.segment, holder_experts, std::move(then));
    } else if (want && !holder_) {
      reloading_ = true;
      start_holder(std::move(then));
    } else {
      then();
    }
  } catch (const Error& e) {
    reloading_ = false;
    log::error(std::string("reload failed while applying it: ") + e.what());
    if (error) *error = e.what();
    sd_notify(0, "READY=1");
    return false;
  }
  return true;
}

void Supervisor::finish_reload(const Config& before, ManagerSettings settings, bool restart_all,
                               const ConfigChanges& ch, bool model_changed) {
  reloading_ = false;
  if (stopping_) return;
  try {
    manager_->reconfigure(std::move(settings), restart_all);
    for (auto& fn : reload_listeners_) fn(before, config_, ch);
  } catch (const Error& e) {
    log::error(std::string("reload failed while applying it: ") + e.what());
    sd_notify(0, "READY=1");
    return;
  }
  if (model_changed)
    log::info("reload: the new model " + model_.name + " is served from " + model_.segment,
              {{"DS4_EVENT", "reload_done"}, {"DS4_SEGMENT", model_.segment}});
  sd_notify(0, "READY=1");
}

nlohmann::json Supervisor::status_json(bool page) const {
  nlohmann::json workers = manager_->status_json();
  for (auto& w : workers) {
    const int pid = w["pid"].get<int>();
    auto cmd = proc_command(pid);
    if (!cmd.is_null()) {
      w["binary"] = cmd["binary"];
      w["args"] = cmd["args"];
    }
  }
  const Readings r = manager_->last_readings();
  nlohmann::json out;
  out["workers"] = workers;
  out["headroom"] = {{"host_available", r.available},
                     {"gpu_free", r.gpu_free ? nlohmann::json(*r.gpu_free) : nlohmann::json(nullptr)},
                     {"gpu_total", r.gpu_total ? nlohmann::json(*r.gpu_total) : nlohmann::json(nullptr)},
                     {"psi_some_avg10", r.psi_some_avg10},
                     {"min_available", config_.headroom.min_available},
                     {"reserve", config_.workers.reserve}};
  // The proxy's view: requests waiting for a worker, and running on each one.
  const ProxyStats ps = stats_ ? stats_->proxy_stats() : ProxyStats{};
  for (auto& w : out["workers"]) {
    const auto it = ps.in_flight_by_worker.find(w.value("id", -1));
    w["in_flight"] = it == ps.in_flight_by_worker.end() ? int64_t(0) : it->second;
  }
  out["queue"] = {{"waiting", ps.waiting}, {"in_flight", ps.in_flight}};
  out["model"] = {{"name", model_.name},     {"path", model_.path},       {"segment", model_.segment},
                  {"bytes", model_.bytes},   {"weights", model_.weight_bytes}, {"synthetic", model_.synthetic},
                  {"reused", model_.reused},  {"backing", backing_text(model_, *memfds_)},
                  {"huge_page_bytes", model_.huge_page_bytes}};
  if (resident_) {
    const uint64_t held = resident_->resident_bytes();
    out["model"]["resident"] = {{"bytes", resident_->bytes()}, {"resident", held},
                                {"mode", ResidentFile::mode_name(resident_->mode())}};
    out["headroom"]["resident_model"] = held;  // outside host_available once locked
  }
  out["backend"] = backend_->name();
  out["ladder"] = config_.workers.ladder;  // the configured contexts
  out["rungs"] = manager_->ladder_json();   // every rung, each worker's "rung" an index into it
  out["config"] = opts_.config_path;
  out["control_block"] = health_->name();
  out["hang_timeout_ms"] = config_.restart.hang_timeout.count();
  out["holder"] = holder_ ? holder_->status() : nlohmann::json(nullptr);
  if (!page) return out;
  // For the page: what is happening, what happened today, the last hour.
  const int64_t now_ms = wall_ms();
  out["time_ms"] = now_ms;
  out["requests"] = requests_json(stats_ ? stats_->proxy_activity().requests : std::vector<RequestView>{});
  out["events"] = events_json(events_->since(now_ms - 24 * 3600 * 1000));
  out["history"] = samples_json(samples_.samples());
  out["sample_every_ms"] = std::chrono::duration_cast<std::chrono::milliseconds>(config_.status.sample_every).count();
  return out;
}

nlohmann::json Supervisor::handle_admin(const nlohmann::json& req) {
  const std::string cmd = req.value("cmd", "");
  auto worker_id = [&] {
    if (!req.contains("worker") || !req["worker"].is_number_integer())
      throw Error("'" + cmd + "' needs \"worker\": a worker id");
    const int64_t id = req["worker"].get<int64_t>();  // as int, 2^32 + 1 was worker 1
    if (id < 0 || id > INT32_MAX) throw Error("no worker " + req["worker"].dump());
    return int(id);
  };
  if (cmd == "status") {
    nlohmann::json s = status_json();
    s["ok"] = true;
    return s;
  }
  if (cmd == "events") {
    nlohmann::json ev = nlohmann::json::array();
    for (const auto& e : manager_->events()) {
      nlohmann::json j = {{"time_ms", e.time_ms},
                          {"event", e.decision.event},
                          {"worker", e.decision.worker},
                          {"context_from", e.decision.context_from},
                          {"context_to", e.decision.context_to},
                          {"reason", e.decision.reason}};
      if (e.decision.host_experts_from) j["host_experts_from"] = *e.decision.host_experts_from;
      if (e.decision.host_experts_to) j["host_experts_to"] = *e.decision.host_experts_to;
      if (e.decision.kv_cache_from) j["kv_cache_from"] = *e.decision.kv_cache_from;
      if (e.decision.kv_cache_to) j["kv_cache_to"] = *e.decision.kv_cache_to;
      ev.push_back(std::move(j));
    }
    return {{"ok", true}, {"events", ev}};
  }
  if (cmd == "drain") {
    manager_->drain(worker_id());
    return {{"ok", true}};
  }
  if (cmd == "restart") {
    manager_->restart(worker_id());
    return {{"ok", true}};
  }
  if (cmd == "context") {
    const int id = worker_id();
    if (!req.contains("size") || !req["size"].is_number_unsigned())
      throw Error("'context' needs \"size\": a context size on the ladder");
    const uint64_t size = req["size"].get<uint64_t>();
    if (size > UINT32_MAX) throw Error("context " + std::to_string(size) + " is not on the ladder");
    manager_->set_context(id, uint32_t(size));
    return {{"ok", true}};
  }
  if (cmd == "reload") {
    std::string err;
    if (!reload(&err)) return {{"ok", false}, {"error", "reload refused, the old config stays:\n" + err}};
    nlohmann::json a = {{"ok", true}};
    if (reloading_) a["loading"] = true;  // the new model loads on its own thread: its end is not known yet
    if (!err.empty()) a["note"] = err;
    return a;
  }
  throw Error("unknown command '" + cmd + "' (expected status, events, drain, restart, context or reload)");
}

}  // namespace ds4::sup
