#pragma once
/// What the listener, the sessions and the Proxy share (internal).
///
/// Threads: the core thread (the io_context the Proxy was given) runs the
/// scheduler, the workers' connections and the listener. Client connections
/// are spread over proxy.threads connection threads, the core thread the
/// first of them (Front 0), each with an io_context of its own. A session on
/// another thread reaches the scheduler by posting to the core thread, and
/// hears its job's events by posts back (session.cpp). What every thread
/// reads is here, each part saying how it is guarded.

#include <utility>  // before Asio: Boost 1.74's awaitable.hpp needs std::exchange

#include <boost/asio.hpp>
#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <thread>
#include <vector>

#include "shared/config.h"
#include "supervisor/proxy/api_keys.h"
#include "supervisor/proxy/metrics.h"
#include "supervisor/proxy/model_text.h"
#include "supervisor/proxy/router.h"
#include "supervisor/proxy/scheduler.h"

namespace ds4::proxy {

class Session;

/// A thread that serves client connections.
struct Front {
  boost::asio::io_context* io = nullptr;       // the core's for front 0, else `own`
  std::unique_ptr<boost::asio::io_context> own;
  std::optional<boost::asio::executor_work_guard<boost::asio::io_context::executor_type>> work;
  std::thread thread;                          // none for front 0
  std::atomic<int> connections{0};             // its open sessions (the listener picks the least busy)
  bool core() const { return !own; }
};

struct Core {
  Core(boost::asio::io_context& io, const ProxyConfig& cfg, ModelText m, sup::WorkerRegistry& reg);

  // Declared first, destroyed last: their io_contexts destroy the sessions
  // they hold, which by then find `alive` expired and touch nothing.
  std::vector<std::unique_ptr<Front>> fronts;
  size_t last_front = 0;  // the listener's last pick

  boost::asio::io_context& io;
  ProxyConfig cfg;  // the core thread's; the connection threads read shared_cfg
  const ModelText model;  // immutable: every thread reads it
  sup::WorkerRegistry& registry;
  Scheduler scheduler;
  Metrics metrics;  // guards itself
  boost::asio::ip::tcp::acceptor acceptor;
  std::function<std::string()> metrics_extra;

  // For every thread.
  std::atomic<bool> stopping{false};
  std::atomic<int64_t> context{0};   // the largest worker context (scheduler.max_context())
  std::atomic<bool> forward{false};  // the workers are exec engines
  std::atomic<int64_t> busy_poll_us{0};

  /// Expires with the Core: sessions whose handlers outlive the proxy (an
  /// io_context destroyed later) must not touch it.
  std::shared_ptr<bool> alive = std::make_shared<bool>(true);

  std::shared_ptr<const ProxyConfig> config() const;
  std::shared_ptr<const ApiKeys> keys() const;
  void set_config(const ProxyConfig& c);
  void set_keys(std::shared_ptr<const ApiKeys> k);

  void add_session(const std::shared_ptr<Session>& s);
  void remove_session(Session* s);
  size_t session_count() const;
  std::vector<std::shared_ptr<Session>> live_sessions() const;

  /// For a request routed on the calling thread: its limits and keys from
  /// the snapshots given, the workers' state from the atomics above. Its
  /// workers() and metrics() are the live ones on the core thread only.
  RouteContext route_context(const ProxyConfig& c, const ApiKeys& k, bool on_core);
  std::string metrics_text();
  std::string new_id(const char* prefix);
  /// Reads the registry's workers into the atomics (core thread).
  void publish_workers();

 private:
  mutable std::mutex m_;  // guards what follows
  std::shared_ptr<const ProxyConfig> shared_cfg_;
  std::shared_ptr<const ApiKeys> keys_;
  std::map<Session*, std::weak_ptr<Session>> sessions_;
  std::mt19937_64 rng_;
  uint64_t next_id_ = 1;
};

SchedulerOptions scheduler_options(const ProxyConfig& cfg);

/// Starts the connection threads beyond the first (threads_for(cfg)).
void start_fronts(Core& core);
/// Stops them and waits for them (the Proxy's end).
void join_fronts(Core& core);
/// Starts accepting connections on core.acceptor.
void accept_connections(Core& core);
/// Closes every connection (at the end of a stop), each on its own thread.
void close_sessions(Core& core);

}  // namespace ds4::proxy
