#pragma once
/// ds4-supervisor: the daemon. It owns the config, the model segment, the
/// workers (through a UnitBackend and the WorkerManager) and the admin socket,
/// all on one boost::asio::io_context run by one thread.
///
/// Attaching the proxy (issue 4). The proxy is built between prepare() and
/// run(), on the same io_context, from what the Supervisor exposes:
///
///   ds4::sup::Supervisor sup({.config_path = path});
///   sup.prepare();                          // config, model segment, backend, admin socket
///   Proxy proxy(sup.io(), sup.config(), sup.registry(), sup.model());
///   sup.set_proxy_stats(&proxy);            // queue length in status, idle checks for drains
///   sup.on_reload([&](const Config& before, const Config& after, const ConfigChanges& c) {
///     proxy.apply(after, c); });            // after a valid reload was applied
///   sup.on_stop([&](Duration deadline, std::function<void()> done) {
///     proxy.stop(deadline, done); });       // SIGTERM: the requests in flight end first
///   return sup.run();                       // workers start; READY=1; until SIGTERM
///
/// The registry (WorkerRegistry) tells the proxy which workers are ready, on
/// which socket, and calls on_change() listeners on every state change; a
/// worker in state `draining` must get no new requests. set_ready_gate() lets
/// the proxy hold READY=1 back until its port is open.

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

#include "shared/config.h"
#include "shared/worker_registry.h"
#include "supervisor/asio.h"
#include "supervisor/model_setup.h"
#include "supervisor/paths.h"
#include "supervisor/resident_file.h"
#include "supervisor/status_history.h"
#include "supervisor/worker_capabilities.h"
#include "supervisor/worker_manager.h"

namespace ds4::sup {

class AdminServer;
class MemorySource;
class UnitBackend;
class WorkerHealth;
class HolderKeeper;
class MemfdSegments;
class SegmentServer;
class SegmentSweeper;
class WorkerManager;

struct SupervisorOptions {
  std::string config_path;
  /// Named on the command line: then it must exist. The default path may
  /// not (the embedded defaults run).
  bool config_given = false;
  /// Where ds4-worker and ds4-mkmodel are; empty = beside this executable.
  std::string bin_dir;
};

class Supervisor {
 public:
  explicit Supervisor(SupervisorOptions options);
  ~Supervisor();

  /// Loads and validates the config, loads the model segment (making a
  /// synthetic model if there is none; a memfd one that systemd's fd store
  /// gave back is reused), computes the ladder's memory plans, picks the
  /// worker backend and opens the admin and segment sockets. Throws ds4::Error.
  /// Call it before starting any thread: SIGTERM and SIGINT stay blocked from
  /// here until run() handles them; one during the model load stops it and
  /// removes what it wrote, with store::LoadCancelled (start_signals.h).
  void prepare();
  /// Starts (or adopts) the workers, tells systemd READY=1 once one serves,
  /// and runs until SIGTERM/SIGINT (SIGHUP reloads). Returns the exit status.
  int run();

  asio::io_context& io() { return io_; }
  WorkerRegistry& registry();
  const Config& config() const { return config_; }
  /// The listening socket systemd passed (ds4-supervisor.socket: socket
  /// activation), for the proxy; -1 without one. It outlives this process:
  /// connections that come while the supervisor restarts wait in its backlog.
  int inherited_listen_fd() const { return listen_fd_; }
  /// How many client connections the fd store has room for (0: no store,
  /// or its FileDescriptorStoreMax= could not be asked).
  size_t connection_slots() const { return connection_slots_; }
  /// The connections a killed run of ours left in the fd store (ds4-conn-N:
  /// descriptors), for the proxy to take back; once.
  std::map<std::string, std::vector<int>> take_stored_connections() { return std::move(stored_connections_); }
  const ModelInfo& model() const { return model_; }
  const std::string& segment_name() const { return model_.segment; }

  void set_proxy_stats(const ProxyStatsSource* stats);
  using ReloadFn = std::function<void(const Config& before, const Config& after, const ConfigChanges& changes)>;
  void on_reload(ReloadFn fn) { reload_listeners_.push_back(std::move(fn)); }
  /// SIGTERM or SIGINT: each listener is told to stop taking work and to
  /// finish what it has within `deadline` (restart.drain_deadline), and
  /// calls `done` then; the workers are stopped once every listener is done,
  /// or at once on a second signal.
  using StopFn = std::function<void(Duration deadline, std::function<void()> done)>;
  void on_stop(StopFn fn) { stop_listeners_.push_back(std::move(fn)); }
  /// READY=1 waits until `gate` returns true as well (checked on every worker change).
  void set_ready_gate(std::function<bool()> gate) { ready_gate_ = std::move(gate); }

  /// Re-reads the config file and applies it. Returns false (and logs why)
  /// when the file is invalid; the old config stays. A new model (model.path,
  /// or the file changed on disk) loads on a thread of its own while the old
  /// one keeps serving, and is applied once loaded (DS4_EVENT=reload_done, or
  /// reload_failed with the old model still served). A GPU weights holder
  /// that starts or takes the new model copies the weights first, without
  /// blocking either; the workers restart once it answers. Until a reload is
  /// applied, every other reload is refused.
  /// `error`: why, when refused; a note for the admin when applied with one.
  bool reload(std::string* error = nullptr);
  /// `ds4ctl status --json`, and GET /status.json for the page: the
  /// workers, headroom, queue, model and holder now, the requests in flight,
  /// the last day's decisions ("events") and the sampled figures of the last
  /// status.history ("history", samples_json()). Without `page`, only the
  /// state now (for /metrics).
  nlohmann::json status_json(bool page = true) const;
  /// One sample for the page's graphs (every status.sample_every from run()).
  void sample_status();
  /// One admin request (admin.h) → its answer.
  nlohmann::json handle_admin(const nlohmann::json& request);

 private:
  /// A new model, loaded off the io thread, and the manager settings for it.
  struct Loaded {
    ModelInfo model;
    ManagerSettings settings;
  };
  bool apply_reload(Config next, const ConfigChanges& ch, std::optional<Loaded> loaded, std::string* error);
  /// The end of a reload, once the holder (if any) has the weights: the workers follow.
  void finish_reload(const Config& before, ManagerSettings settings, bool restart_all, const ConfigChanges& ch,
                     bool model_changed);
  void start_backend();
  /// The GPU whose weights holder the config wants; none for CPU workers or host-mapped weights.
  std::optional<int> holder_device() const;
  /// Starts the holder the config wants, if any; with `settled`, without
  /// blocking (it runs once the holder answers or gave up), else waiting.
  void start_holder(std::function<void()> settled = nullptr);
  void maybe_ready();
  /// The first stop signal: the listeners drain, then stop_workers(). A
  /// second one: stop_workers() now.
  void shutdown(int signal);
  void stop_workers();
  void stop_segment_server();
  void wait_signals();
  void schedule_status_sample();

  SupervisorOptions opts_;
  asio::io_context io_{1};  // one thread runs it
  Config config_;
  ModelInfo model_;
  std::optional<WorkerCapabilities> worker_caps_;  // what ds4-worker said it runs; nullopt: it did not say
  std::string runtime_dir_;
  RuntimeDirLock runtime_lock_;  // one supervisor per runtime folder
  std::unique_ptr<MemorySource> memory_;
  std::unique_ptr<UnitBackend> backend_;
  std::unique_ptr<WorkerHealth> health_;  // the control block and socket probes
  std::unique_ptr<HolderKeeper> holder_;  // GPU weights holder (GPU workers only)
  int listen_fd_ = -1;                       // socket activation: systemd's listening socket
  size_t connection_slots_ = 0;
  std::map<std::string, std::vector<int>> stored_connections_;
  std::unique_ptr<MemfdSegments> memfds_;    // memfd segments kept (and in systemd's fd store)
  /// The segment socket runs on a thread of its own: it answers while io_'s
  /// thread waits (HolderKeeper::start() waits there for a holder that first
  /// asks this socket for the weights).
  asio::io_context segments_io_{1};
  std::unique_ptr<SegmentServer> segments_;  // hands them to workers and holders
  std::thread segments_thread_;
  std::unique_ptr<SegmentSweeper> sweeper_;  // maps model_.segment, removes old ones
  std::unique_ptr<ResidentFile> resident_;   // model.keep_resident: an exec engine's file kept in memory
  std::unique_ptr<asio::steady_timer> resident_timer_;
  bool resident_warned_ = false;
  void keep_resident_now();
  std::unique_ptr<WorkerManager> manager_;
  std::unique_ptr<AdminServer> admin_;
  std::unique_ptr<asio::signal_set> signals_;
  const ProxyStatsSource* stats_ = nullptr;
  // The status page's memory: DS4_EVENT entries (from the journal observer,
  // any thread) and the sampled figures.
  std::shared_ptr<EventRing> events_ = std::make_shared<EventRing>(2000);
  SampleRing samples_{720};
  ProxyActivity last_activity_;
  std::optional<std::chrono::steady_clock::time_point> last_sample_;
  std::unique_ptr<asio::steady_timer> status_timer_;
  std::vector<ReloadFn> reload_listeners_;
  std::vector<StopFn> stop_listeners_;
  std::function<bool()> ready_gate_;
  bool ready_sent_ = false;
  bool stopping_ = false;
  bool stopping_workers_ = false;
  int exit_status_ = 0;
  bool reloading_ = false;  // a reload's new model loads on loader_, or its holder copies the weights
  std::jthread loader_;   // last: stopped and joined before the rest goes
};

}  // namespace ds4::sup
