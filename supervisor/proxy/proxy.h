#pragma once
/// The front proxy: OpenAI and Anthropic APIs on proxy.listen, a queue in
/// front of the workers, and resumption of every request whose worker dies.
/// The supervisor constructs it on its io_context with its WorkerRegistry:
///
///   proxy::Proxy proxy(io, config.proxy, proxy::ModelText::from_gguf(seg.metadata(), config.model.name), registry);
///   proxy.start();                  // binds; throws ds4::Error
///   ... SIGHUP: proxy.reload_keys(); reload: proxy.apply(new_config.proxy);
///   ... SIGTERM: proxy.stop(deadline, [&] { sd_notify(0, "STOPPING=1"); ... });
///
/// Every call on the io_context's thread, which runs the whole proxy, except
/// that requests with long bodies are parsed and tokenized on the proxy's
/// planner threads (core.h).

#include <utility>  // before Asio: Boost 1.74's awaitable.hpp needs std::exchange

#include <boost/asio.hpp>
#include <functional>
#include <memory>
#include <string>

#include "shared/config.h"
#include "shared/worker_registry.h"
#include "supervisor/proxy/conn_store.h"
#include "supervisor/proxy/model_text.h"

namespace ds4::proxy {

struct Core;

class Proxy : public sup::ProxyStatsSource {
 public:
  Proxy(boost::asio::io_context& io, const ProxyConfig& config, ModelText model, sup::WorkerRegistry& registry);
  ~Proxy() override;

  /// Loads the key file and listens. Throws ds4::Error when the address
  /// cannot be bound, the key file cannot be read, or the address is not
  /// loopback, there are no keys and limits.allow_insecure_bind is off.
  /// `inherited_fd` >= 0: a listening socket the service manager holds
  /// (socket activation) is used instead of binding proxy.listen; the proxy
  /// accepts on a duplicate and never closes the original.
  void start(int inherited_fd = -1);
  /// Keep up to `capacity` client connections, each with its journal, in
  /// systemd's fd store (session_journal.h), so that a supervisor killed
  /// mid-answer goes on with them when it restarts. 0 (the default): none.
  void keep_connections(size_t capacity);
  /// The connections a killed supervisor left in the fd store: each one's
  /// answer goes on from the client's next byte, or it is closed (journal:
  /// DS4_EVENT=connection_lost, with the reason). After start().
  void adopt_connections(std::vector<StoredConnection> conns);
  /// The bound address (port 0 in the config: the one the kernel chose).
  boost::asio::ip::tcp::endpoint endpoint() const;

  /// Rereads proxy.api_keys_file (SIGHUP). Throws ds4::Error naming the file;
  /// the keys loaded before stay in force then.
  void reload_keys();
  /// Applies the parts of a new config that change in place: queue, limits,
  /// key file (listen needs a restart of the proxy).
  void apply(const ProxyConfig& config);

  /// Graceful stop: no new connections or requests; work in flight finishes
  /// or, at `deadline`, is cut off; then every connection closes and `done` runs.
  void stop(Duration deadline, std::function<void()> done);

  sup::ProxyStats proxy_stats() const override;
  sup::ProxyActivity proxy_activity() const override;
  /// The /metrics text.
  std::string metrics_text() const;
  /// More Prometheus text for /metrics (the supervisor's headroom figures).
  void set_metrics_extra(std::function<std::string()> fn);
  /// The body of GET /status.json (the supervisor's status); without one
  /// it holds the workers and the queue only.
  void set_status_source(std::function<std::string()> fn);
  /// The workers are exec engines (workers.engine: exec): requests go to
  /// them as they came, also while none is registered (at the start, or
  /// after the supervisor's restart, when the connections it adopts are
  /// planned before any worker is back). Without it (ds4-proxy), a
  /// registered worker's HTTP port says so.
  void set_exec_engines(bool exec);

 private:
  void start_inherited(int fd);
  std::unique_ptr<Core> core_;
};

}  // namespace ds4::proxy
