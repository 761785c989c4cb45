#pragma once
/// What the listener, the sessions and the Proxy share (internal).

#include <utility>  // before Asio: Boost 1.74's awaitable.hpp needs std::exchange

#include <boost/asio.hpp>
#include <functional>
#include <map>
#include <memory>
#include <random>

#include <boost/asio/thread_pool.hpp>

#include "shared/config.h"
#include "supervisor/proxy/api_keys.h"
#include "supervisor/proxy/metrics.h"
#include "supervisor/proxy/model_text.h"
#include "supervisor/proxy/response_store.h"
#include "supervisor/proxy/router.h"
#include "supervisor/proxy/scheduler.h"
#include "supervisor/proxy/conn_store.h"

namespace ds4::proxy {

class Session;

/// Refused requests' journal lines, at most kPerSecond a second; the ones
/// left out are counted and said with the next line written.
struct RefusalLog {
  static constexpr int kPerSecond = 5;
  std::chrono::steady_clock::time_point second{};
  int written = 0;
  int64_t left_out = 0;
  /// One line for a refused request (status >= 400): its status, endpoint and reason.
  void note(int status, std::string_view endpoint, std::string_view reason);
};

struct Core {
  Core(boost::asio::io_context& io, const ProxyConfig& cfg, ModelText m, sup::WorkerRegistry& reg);

  boost::asio::io_context& io;
  ProxyConfig cfg;
  ModelText model;
  sup::WorkerRegistry& registry;
  /// Replaced, never changed, at a reload: a request planned on the planner
  /// keeps the keys it started with.
  std::shared_ptr<const ApiKeys> keys;
  Scheduler scheduler;
  Metrics metrics;
  ResponseStore responses;  // previous_response_id's (proxy.responses_store)
  RefusalLog refusals;
  boost::asio::ip::tcp::acceptor acceptor;
  std::map<Session*, std::weak_ptr<Session>> sessions;
  ConnStore conn_store;  // connections kept across a supervisor restart (off: capacity 0)
  std::function<std::string()> metrics_extra;
  std::function<std::string()> status_source;  // /status.json; null: the router's short one
  /// Where the requests with long bodies are parsed and tokenized (route()),
  /// so that the io thread goes on with everyone else's answers meanwhile
  /// (a prompt of 100k tokens takes about 0.2 s).
  boost::asio::thread_pool planner{2};
  int64_t planning = 0;  // requests on the planner (a stop waits for them as for running jobs)
  std::mt19937_64 rng;
  uint64_t next_id = 1;
  bool stopping = false;
  bool exec_engines = false;  // Proxy::set_exec_engines
  /// Expires with the Core: sessions whose handlers outlive the proxy (an
  /// io_context destroyed later) must not touch it.
  std::shared_ptr<bool> alive = std::make_shared<bool>(true);

  RouteContext route_context();
  std::string metrics_text();
  std::string new_id(const char* prefix);
};

SchedulerOptions scheduler_options(const ProxyConfig& cfg);

/// Starts accepting connections on core.acceptor.
void accept_connections(Core& core);
/// Closes every connection (at the end of a stop).
void close_sessions(Core& core);

}  // namespace ds4::proxy
