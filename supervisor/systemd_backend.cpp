#include "supervisor/systemd_backend.h"

#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <systemd/sd-bus.h>
#include <time.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "shared/error.h"
#include "shared/files.h"
#include "shared/log.h"
#include "shared/worker_launch.h"
#include "supervisor/journal_watch.h"
#include "supervisor/process_backend.h"  // read_vmstat_oom_kills
#include "supervisor/worker_unit_text.h"

namespace ds4::sup {

namespace {

namespace fs = std::filesystem;

constexpr const char* kDest = "org.freedesktop.systemd1";
constexpr const char* kManagerPath = "/org/freedesktop/systemd1";
constexpr const char* kManagerIface = "org.freedesktop.systemd1.Manager";
constexpr const char* kUnitIface = "org.freedesktop.systemd1.Unit";
constexpr const char* kServiceIface = "org.freedesktop.systemd1.Service";
/// How long a SIGKILLed worker waits for the kernel's oom-kill line to reach
/// the journal when the kernel's counter says one is on its way.
constexpr auto kOomEvidenceWait = std::chrono::milliseconds(1000);

std::string unit_of(int id) { return "ds4-worker@" + std::to_string(id) + ".service"; }

/// Writes `text` to `path` unless it holds that already; true when it changed.
bool write_if_changed(const std::string& path, const std::string& text) {
  if (read_whole_file(path) == text) return false;
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp);
    f << text;
    if (!f) throw Error("cannot write " + tmp);
  }
  fs::rename(tmp, path);
  return true;
}

/// RAII for sd_bus_error / sd_bus_message.
struct BusError {
  sd_bus_error e = SD_BUS_ERROR_NULL;
  ~BusError() { sd_bus_error_free(&e); }
  std::string what(int r) const { return e.message ? e.message : std::strerror(-r); }
};
struct Msg {
  sd_bus_message* m = nullptr;
  ~Msg() { sd_bus_message_unref(m); }
};

class SystemdBackend : public UnitBackend {
 public:
  SystemdBackend(asio::io_context& io, SystemdBackendOptions o, sd_bus* bus)
      : io_(io), opts_(std::move(o)), bus_(bus), bus_fd_(io), bus_timer_(io) {}

  ~SystemdBackend() override {
    for (auto& [id, u] : units_)
      if (u.evidence_timer) u.evidence_timer->cancel();
    bus_fd_.release();  // sd_bus owns it
    sd_bus_slot_unref(props_slot_);
    sd_bus_slot_unref(jobs_slot_);
    sd_bus_flush_close_unref(bus_);
  }

  /// Subscribes to unit signals, makes sure the template exists, starts the
  /// journal watcher. Throws ds4::Error.
  void init() {
    BusError err;
    int r = sd_bus_match_signal(bus_, &props_slot_, kDest, nullptr, "org.freedesktop.DBus.Properties",
                                "PropertiesChanged", &SystemdBackend::on_props_thunk, this);
    if (r < 0) throw Error(std::string("cannot watch unit properties: ") + std::strerror(-r));
    r = sd_bus_match_signal(bus_, &jobs_slot_, kDest, kManagerPath, kManagerIface, "JobRemoved",
                            &SystemdBackend::on_job_thunk, this);
    if (r < 0) throw Error(std::string("cannot watch jobs: ") + std::strerror(-r));
    r = sd_bus_call_method(bus_, kDest, kManagerPath, kManagerIface, "Subscribe", &err.e, nullptr, "");
    if (r < 0) throw Error("cannot subscribe to the user manager: " + err.what(r));
    ensure_template();
    {
      // The manager's own cgroup, to tell its units' OOM kills from others'.
      BusError e2;
      char* cg = nullptr;
      if (sd_bus_get_property_string(bus_, kDest, kManagerPath, kManagerIface, "ControlGroup", &e2.e, &cg) >= 0 && cg) {
        manager_cgroup_ = cg;
        free(cg);
      }
    }
    vmstat_base_ = read_vmstat_oom_kills();
    journal_ = std::make_unique<JournalWatcher>(io_, [this](const JournalFinding& f) { on_journal(f); });
    kick();
  }

  std::string name() const override { return "systemd"; }
  void set_callbacks(BackendCallbacks cb) override { cb_ = std::move(cb); }
  std::string unit_name(int id) const override { return unit_of(id); }

  void start(const LaunchSpec& spec) override {
    const int id = int(spec.launch.id);
    Unit& u = unit(id);
    try {
      write_env(spec.launch);
      if (write_memory_dropin(id, spec.memory_max)) reload_manager();
    } catch (const std::exception& e) {
      return fail_later(id, e.what());
    }
    const std::string name = unit_of(id);
    {
      // A failed unit must be reset before it is started again, or systemd
      // counts the starts towards start-limit-hit.
      BusError err;
      sd_bus_call_method(bus_, kDest, kManagerPath, kManagerIface, "ResetFailedUnit", &err.e, nullptr, "s",
                         name.c_str());
    }
    u.running = true;
    u.seen_start = false;
    u.ready = false;
    u.stop_requested = false;
    u.killed_by_us = false;
    u.main_pid = 0;
    u.status_text.clear();
    u.journal_error.clear();
    u.oom_seen = false;
    u.start_job.clear();
    BusError err;
    Msg reply;
    int r = sd_bus_call_method(bus_, kDest, kManagerPath, kManagerIface, "StartUnit", &err.e, &reply.m, "ss",
                               name.c_str(), "replace");
    if (r < 0) {
      u.running = false;
      kick();
      return fail_later(id, "cannot start " + name + ": " + err.what(r));
    }
    const char* job = nullptr;
    if (sd_bus_message_read(reply.m, "o", &job) >= 0 && job) u.start_job = job;
    const WorkerLaunch& l = spec.launch;
    log::info("starting " + name + " (context " + std::to_string(l.context) + " x " + std::to_string(l.slots) +
                  " slots" + (l.kv_cache != "f16" ? ", a " + l.kv_cache + " KV cache" : "") +
                  (l.host_experts ? ", the experts of " + std::to_string(l.host_experts) + " layers on the host" : "") +
                  (spec.memory_max ? ", MemoryMax=" + std::to_string(spec.memory_max) : "") + ")",
              {{"DS4_WORKER", std::to_string(id)}, {"DS4_UNIT", name}});
    kick();
  }

  void stop(int id) override {
    Unit& u = unit(id);
    u.stop_requested = true;
    BusError err;
    const std::string name = unit_of(id);
    int r = sd_bus_call_method(bus_, kDest, kManagerPath, kManagerIface, "StopUnit", &err.e, nullptr, "ss",
                               name.c_str(), "replace");
    if (r < 0) log::warn("cannot stop " + name + ": " + err.what(r) + ", ignoring");
    kick();
  }

  void kill(int id) override {
    Unit& u = unit(id);
    u.stop_requested = true;
    u.killed_by_us = true;
    BusError err;
    const std::string name = unit_of(id);
    int r = sd_bus_call_method(bus_, kDest, kManagerPath, kManagerIface, "KillUnit", &err.e, nullptr, "ssi",
                               name.c_str(), "all", int32_t(SIGKILL));
    if (r < 0) {
      // The unit may have ended meanwhile; its end is reported either way.
      log::warn("cannot kill " + name + ": " + err.what(r) + ", ignoring");
    }
    kick();
  }

  std::vector<AdoptedWorker> find_running(const std::string& segment) override {
    std::vector<AdoptedWorker> out;
    BusError err;
    Msg reply;
    int r = sd_bus_call_method(bus_, kDest, kManagerPath, kManagerIface, "ListUnitsByPatterns", &err.e, &reply.m,
                               "asas", 1, "active", 1, "ds4-worker@*.service");
    if (r < 0) {
      log::warn("cannot list running workers: " + err.what(r) + ", ignoring");
      return out;
    }
    sd_bus_message_enter_container(reply.m, 'a', "(ssssssouso)");
    const char *name, *desc, *load, *active, *sub, *follow, *path, *jtype, *jpath;
    uint32_t jid;
    while (sd_bus_message_read(reply.m, "(ssssssouso)", &name, &desc, &load, &active, &sub, &follow, &path, &jid,
                               &jtype, &jpath) > 0) {
      int id = -1;
      if (std::sscanf(name, "ds4-worker@%d.service", &id) != 1 || id < 0) continue;
      WorkerLaunch launch;
      try {
        launch = parse_worker_launch({}, decode_env_file(read_whole_file(opts_.runtime_dir + "/worker-" +
                                                                         std::to_string(id) + ".env").value_or("")));
      } catch (const Error& e) {
        log::warn(std::string(name) + ": its environment file does not read (" + e.what() + ")");
        launch.segment.clear();  // stopped below
      }
      if (launch.segment != segment) {
        log::info(std::string(name) + " runs another model segment (" + launch.segment + "); stopping it");
        BusError e2;
        sd_bus_call_method(bus_, kDest, kManagerPath, kManagerIface, "StopUnit", &e2.e, nullptr, "ss", name,
                           "replace");
        continue;
      }
      AdoptedWorker a;
      a.id = id;
      a.pid = int(main_pid(id));
      a.context = uint32_t(launch.context);
      a.host_experts = uint32_t(launch.host_experts);
      a.kv_cache = launch.kv_cache;
      a.socket_path = launch.socket;
      a.port = int(launch.port);
      Unit& u = unit(id);
      u.running = u.seen_start = u.ready = true;
      u.main_pid = uint32_t(a.pid);
      out.push_back(a);
    }
    kick();
    return out;
  }

 private:
  struct Unit {
    int id = 0;
    std::string path;  // D-Bus object path
    bool running = false;     // we started it and have not reported its end
    bool seen_start = false;  // saw activating/active for this run
    bool ready = false;
    bool stop_requested = false;
    bool killed_by_us = false;  // kill(): our SIGKILL, not the OOM killer's
    uint32_t main_pid = 0;
    std::string active_state;
    std::string status_text;
    std::string journal_error;
    std::string start_job;
    bool oom_seen = false;    // the journal named this unit in an OOM kill
    std::unique_ptr<asio::steady_timer> evidence_timer;
  };

  Unit& unit(int id) {
    auto it = units_.find(id);
    if (it != units_.end()) return it->second;
    Unit& u = units_[id];
    u.id = id;
    char* p = nullptr;
    if (sd_bus_path_encode("/org/freedesktop/systemd1/unit", unit_of(id).c_str(), &p) >= 0) {
      u.path = p;
      free(p);
    }
    by_path_[u.path] = id;
    return u;
  }

  void fail_later(int id, std::string msg) {
    asio::post(io_, [this, id, msg] { if (cb_.exited) cb_.exited(id, ExitKind::crash, msg); });
  }

  // --- files -----------------------------------------------------------

  std::string user_unit_dir() const {
    const char* x = std::getenv("XDG_RUNTIME_DIR");
    return std::string(x ? x : "") + "/systemd/user";
  }

  void write_env(WorkerLaunch launch) {
    // ds4-worker@.service reads it (EnvironmentFile=), and its ExecStart=
    // names a few of the variables; the worker reads the rest from its
    // environment (shared/worker_launch.h).
    launch.segment_socket = opts_.runtime_dir + "/segments.sock";
    write_if_changed(opts_.runtime_dir + "/worker-" + std::to_string(launch.id) + ".env",
                     "# Written by ds4-supervisor for ds4-worker@" + std::to_string(launch.id) +
                         ".service; rewritten at every start.\n" + launch.to_env_file());
  }

  /// The MemoryMax= drop-in; true when it changed (the manager must reload).
  bool write_memory_dropin(int id, Bytes memory_max) {
    const std::string dir = user_unit_dir() + "/" + unit_of(id) + ".d";
    const std::string file = dir + "/50-ds4-memory.conf";
    if (memory_max == 0) {
      std::error_code ec;
      return fs::remove(file, ec);
    }
    fs::create_directories(dir);
    return write_if_changed(file, "# Written by ds4-supervisor (workers.memory_max).\n[Service]\nMemoryMax=" +
                                      std::to_string(memory_max) + "\n");
  }

  void reload_manager() {
    BusError err;
    int r = sd_bus_call_method(bus_, kDest, kManagerPath, kManagerIface, "Reload", &err.e, nullptr, "");
    if (r < 0) throw Error("cannot reload the user manager: " + err.what(r));
  }

  /// Writes a ds4-worker@.service that runs our own ds4-worker when the user
  /// manager has none (not installed).
  void ensure_template() {
    BusError err;
    Msg reply;
    std::string load_state;
    int r = sd_bus_call_method(bus_, kDest, kManagerPath, kManagerIface, "LoadUnit", &err.e, &reply.m, "s",
                               "ds4-worker@0.service");
    if (r >= 0) {
      const char* path = nullptr;
      sd_bus_message_read(reply.m, "o", &path);
      char* state = nullptr;
      BusError e2;
      if (path && sd_bus_get_property_string(bus_, kDest, path, kUnitIface, "LoadState", &e2.e, &state) >= 0) {
        load_state = state;
        free(state);
      }
    }
    const std::string ours = user_unit_dir() + "/ds4-worker@.service";
    if (load_state == "loaded" && !fs::exists(ours)) return;  // installed
    std::string text = kWorkerUnitText;
    const std::string from = "%h/.local/bin/ds4-worker";
    for (size_t p = text.find(from); p != std::string::npos; p = text.find(from, p + 1))
      text.replace(p, from.size(), opts_.worker_binary);
    text = "# Written by ds4-supervisor: no ds4-worker@.service was installed.\n" + text;
    fs::create_directories(user_unit_dir());
    if (write_if_changed(ours, text)) {
      log::info("wrote " + ours + " (running " + opts_.worker_binary + ")");
      reload_manager();
    }
  }

  uint32_t main_pid(int id) {
    uint32_t pid = 0;
    BusError err;
    Msg reply;
    if (sd_bus_get_property(bus_, kDest, unit(id).path.c_str(), kServiceIface, "MainPID", &err.e, &reply.m, "u") >= 0)
      sd_bus_message_read(reply.m, "u", &pid);
    return pid;
  }

  // --- the bus on asio -------------------------------------------------

  /// Processes what is queued and waits for more.
  void kick() {
    asio::post(io_, [this] { process(); });
  }

  void process() {
    for (int i = 0; i < 1000; ++i) {
      const int r = sd_bus_process(bus_, nullptr);
      if (r < 0) {
        log::error(std::string("lost the user manager's bus: ") + std::strerror(-r));
        return;
      }
      if (r == 0) break;
    }
    arm();
  }

  void arm() {
    if (!fd_open_) {
      bus_fd_.assign(sd_bus_get_fd(bus_));
      fd_open_ = true;
    }
    const int ev = sd_bus_get_events(bus_);
    if (!waiting_) {
      waiting_ = true;
      bus_fd_.async_wait(ev & POLLOUT ? asio::posix::stream_descriptor::wait_write
                                      : asio::posix::stream_descriptor::wait_read,
                         [this](boost::system::error_code ec) {
                           waiting_ = false;
                           if (ec) return;
                           process();
                         });
    }
    uint64_t usec = 0;
    if (sd_bus_get_timeout(bus_, &usec) >= 0 && usec != UINT64_MAX) {
      timespec ts;
      clock_gettime(CLOCK_MONOTONIC, &ts);
      const uint64_t now = uint64_t(ts.tv_sec) * 1000000 + uint64_t(ts.tv_nsec) / 1000;
      bus_timer_.expires_after(std::chrono::microseconds(usec > now ? usec - now : 0));
      bus_timer_.async_wait([this](boost::system::error_code ec) {
        if (!ec) process();
      });
    }
  }

  // --- signals ---------------------------------------------------------

  static int on_props_thunk(sd_bus_message* m, void* self, sd_bus_error*) {
    static_cast<SystemdBackend*>(self)->on_props(m);
    return 0;
  }
  static int on_job_thunk(sd_bus_message* m, void* self, sd_bus_error*) {
    static_cast<SystemdBackend*>(self)->on_job(m);
    return 0;
  }

  void on_props(sd_bus_message* m) {
    auto it = by_path_.find(sd_bus_message_get_path(m) ? sd_bus_message_get_path(m) : "");
    if (it == by_path_.end()) return;
    Unit& u = units_[it->second];
    const char* iface = nullptr;
    if (sd_bus_message_read(m, "s", &iface) < 0) return;
    if (sd_bus_message_enter_container(m, 'a', "{sv}") < 0) return;
    std::string active;
    while (sd_bus_message_enter_container(m, 'e', "sv") > 0) {
      const char* key = nullptr;
      sd_bus_message_read(m, "s", &key);
      const std::string k = key ? key : "";
      if (k == "ActiveState" || k == "StatusText") {
        const char* v = nullptr;
        if (sd_bus_message_read(m, "v", "s", &v) >= 0 && v) (k == "ActiveState" ? active : u.status_text) = v;
      } else if (k == "MainPID") {
        uint32_t pid = 0;
        if (sd_bus_message_read(m, "v", "u", &pid) >= 0 && pid) u.main_pid = pid;
      } else {
        sd_bus_message_skip(m, "v");
      }
      sd_bus_message_exit_container(m);
    }
    sd_bus_message_exit_container(m);
    if (active.empty()) return;
    u.active_state = active;
    if (!u.running) return;
    if (active == "activating" || active == "active" || active == "deactivating") u.seen_start = true;
    if (active == "active" && !u.ready) report_ready(u);
    else if ((active == "failed" || active == "inactive") && u.seen_start) finish(u);
  }

  void on_job(sd_bus_message* m) {
    uint32_t id = 0;
    const char *job = nullptr, *unit_name = nullptr, *result = nullptr;
    if (sd_bus_message_read(m, "uoss", &id, &job, &unit_name, &result) < 0) return;
    int wid = -1;
    if (std::sscanf(unit_name, "ds4-worker@%d.service", &wid) != 1) return;
    auto it = units_.find(wid);
    if (it == units_.end()) return;
    Unit& u = it->second;
    if (!u.running || u.start_job != job) return;
    u.start_job.clear();
    if (std::string(result) == "done") {
      if (!u.ready) report_ready(u);
    } else {
      u.seen_start = true;
      finish(u);
    }
  }

  void report_ready(Unit& u) {
    u.ready = true;
    u.seen_start = true;
    if (!u.main_pid) u.main_pid = main_pid(u.id);
    if (cb_.ready) cb_.ready(u.id, int(u.main_pid));
  }

  void on_journal(const JournalFinding& f) {
    int id = -1;
    // Another user manager (another user, a test) may run a ds4-worker@N of
    // its own: a kernel line counts only when its cgroup is under ours.
    const bool in_our_tree = f.cgroup.empty() || manager_cgroup_.empty() ||
                             f.cgroup.rfind(manager_cgroup_ + "/", 0) == 0;
    const bool ours = in_our_tree && std::sscanf(f.unit.c_str(), "ds4-worker@%d.service", &id) == 1;
    auto it = ours ? units_.find(id) : units_.end();
    if (f.kind == JournalFinding::Kind::oom_kill) {
      ++oom_lines_seen_;
      if (it != units_.end()) {
        it->second.oom_seen = true;
        log::info("journal: the kernel OOM-killed " + f.unit, {{"DS4_WORKER", std::to_string(id)}});
      }
      // Exits waiting for evidence decide now.
      for (auto& [uid, u] : units_)
        if (u.evidence_timer) u.evidence_timer->cancel();
    } else if (it != units_.end()) {
      it->second.journal_error = f.text;
    }
  }

  // --- why it ended ----------------------------------------------------

  struct ExitFacts {
    std::string result;
    int32_t code = 0;    // CLD_EXITED 1, CLD_KILLED 2, CLD_DUMPED 3
    int32_t status = 0;
  };

  ExitFacts facts(const Unit& u) {
    ExitFacts f;
    BusError e1, e2, e3;
    char* result = nullptr;
    if (sd_bus_get_property_string(bus_, kDest, u.path.c_str(), kServiceIface, "Result", &e1.e, &result) >= 0) {
      f.result = result;
      free(result);
    }
    Msg a, b;
    if (sd_bus_get_property(bus_, kDest, u.path.c_str(), kServiceIface, "ExecMainCode", &e2.e, &a.m, "i") >= 0)
      sd_bus_message_read(a.m, "i", &f.code);
    if (sd_bus_get_property(bus_, kDest, u.path.c_str(), kServiceIface, "ExecMainStatus", &e3.e, &b.m, "i") >= 0)
      sd_bus_message_read(b.m, "i", &f.status);
    return f;
  }

  /// The worker's unit ended: decide why, waiting (bounded) for the kernel's
  /// OOM line when the kernel's counter says one has not reached us yet.
  void finish(Unit& u) {
    if (u.evidence_timer) return;  // already deciding
    const ExitFacts f = facts(u);
    const bool sigkill = (f.code == 2 || f.code == 3) && f.status == SIGKILL;
    const uint64_t kernel_kills = read_vmstat_oom_kills() - vmstat_base_;
    if (sigkill && !u.killed_by_us && f.result != "oom-kill" && !u.oom_seen && kernel_kills > oom_lines_seen_) {
      u.evidence_timer = std::make_unique<asio::steady_timer>(io_, kOomEvidenceWait);
      const int id = u.id;
      // Cancelled early by any oom-kill line the journal brings (on_journal).
      u.evidence_timer->async_wait([this, id, f](boost::system::error_code) {
        Unit& x = units_[id];
        x.evidence_timer.reset();
        if (x.oom_seen) return conclude(x, f, true, "");
        // Still a kill the journal has not attributed: the counter is the evidence.
        const bool unclaimed = read_vmstat_oom_kills() - vmstat_base_ > oom_lines_seen_;
        conclude(x, f, unclaimed, unclaimed ? " (kernel oom_kill counter; no journal line within 1 s)" : "");
        kick();
      });
      kick();
      return;
    }
    conclude(u, f, u.oom_seen, "");
    kick();
  }

  void conclude(Unit& u, const ExitFacts& f, bool oom_evidence, const std::string& note) {
    if (!u.running) return;
    u.running = false;
    u.ready = false;
    ExitKind kind;
    std::string msg;
    const bool signalled = f.code == 2 || f.code == 3;
    if (u.killed_by_us && signalled && f.status == SIGKILL) {
      kind = ExitKind::clean;
      msg = "killed by the supervisor (SIGKILL)";
    } else if (f.result == "oom-kill" || (signalled && f.status == SIGKILL && oom_evidence)) {
      kind = ExitKind::oom;
      msg = "OOM-killed (" + (f.result == "oom-kill" ? std::string("Result=oom-kill") : "kernel oom-kill line") + ")" + note;
    } else if (signalled) {
      const int sig = f.status;
      msg = std::string("killed by signal ") + (sigabbrev_np(sig) ? sigabbrev_np(sig) : std::to_string(sig).c_str());
      if (sig == SIGKILL || sig == SIGTERM || sig == SIGINT || sig == SIGHUP)
        kind = u.stop_requested ? ExitKind::clean : ExitKind::killed;
      else
        kind = ExitKind::crash;
    } else if (f.code == 1) {
      kind = f.status == 0 || u.stop_requested ? ExitKind::clean
             : f.status == kExitDoesNotFit     ? ExitKind::no_fit
                                               : ExitKind::crash;
      if (f.status != 0) msg = "exited with status " + std::to_string(f.status);
    } else {
      // Never ran (no env file, bad ExecStart, ...).
      kind = u.stop_requested ? ExitKind::clean : ExitKind::crash;
      msg = "unit failed with result '" + f.result + "'";
    }
    if (kind == ExitKind::crash || kind == ExitKind::no_fit) {
      std::string why = u.status_text.rfind("error: ", 0) == 0 ? u.status_text.substr(7) : u.journal_error;
      if (!why.empty()) msg = why + " (" + msg + ")";
    }
    log::info(unit_of(u.id) + " ended: " + exit_kind_name(kind) + (msg.empty() ? "" : ", " + msg) +
                  " (Result=" + f.result + ")",
              {{"DS4_WORKER", std::to_string(u.id)}, {"DS4_EXIT", exit_kind_name(kind)}, {"DS4_UNIT_RESULT", f.result}});
    u.main_pid = 0;
    if (cb_.exited) cb_.exited(u.id, kind, msg);
  }

  asio::io_context& io_;
  SystemdBackendOptions opts_;
  sd_bus* bus_;
  asio::posix::stream_descriptor bus_fd_;
  asio::steady_timer bus_timer_;
  bool fd_open_ = false;
  bool waiting_ = false;
  sd_bus_slot* props_slot_ = nullptr;
  sd_bus_slot* jobs_slot_ = nullptr;
  BackendCallbacks cb_;
  std::map<int, Unit> units_;
  std::map<std::string, int> by_path_;
  std::unique_ptr<JournalWatcher> journal_;
  uint64_t vmstat_base_ = 0;
  uint64_t oom_lines_seen_ = 0;
  std::string manager_cgroup_;
};

}  // namespace

std::unique_ptr<UnitBackend> make_systemd_backend(asio::io_context& io, const SystemdBackendOptions& options,
                                                  std::string* why_not) {
  auto say = [&](std::string s) {
    if (why_not) *why_not = std::move(s);
    return nullptr;
  };
  if (!std::getenv("XDG_RUNTIME_DIR")) return say("XDG_RUNTIME_DIR is not set");
  sd_bus* bus = nullptr;
  int r = sd_bus_open_user(&bus);
  if (r < 0) return say(std::string("no user bus: ") + std::strerror(-r));
  // Someone must own the manager's name (an activatable name does not count).
  BusError err;
  char* version = nullptr;
  r = sd_bus_get_property_string(bus, kDest, kManagerPath, kManagerIface, "Version", &err.e, &version);
  if (r < 0) {
    sd_bus_flush_close_unref(bus);
    return say("the user manager does not answer on the user bus: " + err.what(r));
  }
  free(version);
  auto b = std::make_unique<SystemdBackend>(io, options, bus);
  try {
    b->init();
  } catch (const Error& e) {
    return say(e.what());
  }
  return b;
}

}  // namespace ds4::sup
