#include "supervisor/proxy/proxy.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "shared/error.h"
#include "shared/log.h"
#include "shared/request_trace.h"
#include "supervisor/proxy/core.h"
#include "supervisor/proxy/session.h"
#include "supervisor/proxy/tcp_bytes.h"

namespace ds4::proxy {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;

SchedulerOptions scheduler_options(const ProxyConfig& cfg) {
  SchedulerOptions o;
  o.max_waiting = cfg.queue.max_waiting;
  o.max_wait = cfg.queue.max_wait;
  o.engine.max_header_bytes = uint32_t(std::min<Bytes>(cfg.limits.max_header_bytes, UINT32_MAX));
  o.engine.max_body_bytes = cfg.limits.max_body_bytes;
  o.resume_engines = true;
  return o;
}

Core::Core(asio::io_context& io_, const ProxyConfig& c, ModelText m, sup::WorkerRegistry& reg)
    : io(io_), cfg(c), model(std::move(m)), registry(reg), keys(std::make_shared<const ApiKeys>(c.api_keys_file)),
      scheduler(io_, reg, scheduler_options(c)), responses(c.responses_store), acceptor(io_), rng(std::random_device{}()) {}

RouteContext Core::route_context() {
  PlanLimits limits;
  limits.max_tokens_per_request = cfg.limits.max_tokens_per_request;
  limits.context = scheduler.max_context();
  limits.random_seed = rng();
  limits.responses = &responses;
  RouteContext ctx{model, *keys, limits, [this] { return registry.workers(); }, [this] { return metrics_text(); },
                   stopping};
  ctx.status = status_source;
  ctx.forward = exec_engines;
  for (const auto& w : scheduler.workers())
    if (w.http_port > 0) ctx.forward = true;
  return ctx;
}

std::string Core::metrics_text() {
  std::string text = metrics.render(registry.workers(), scheduler);
  if (metrics_extra) text += metrics_extra();
  return text;
}

std::string Core::new_id(const char* prefix) {
  // prefix, 16 random hex digits, 4 of a counter (snprintf's formatting cost
  // 2% of a request's time).
  static constexpr char kHex[] = "0123456789abcdef";
  std::string id(prefix);
  const size_t at = id.size();
  id.resize(at + 20);
  const uint64_t random = rng(), count = next_id++;
  for (int i = 0; i < 16; ++i) id[at + size_t(i)] = kHex[(random >> (60 - 4 * i)) & 15];
  for (int i = 0; i < 4; ++i) id[at + 16 + size_t(i)] = kHex[(count >> (12 - 4 * i)) & 15];
  return id;
}

void accept_connections(Core& core) {
  core.acceptor.async_accept([&core](const boost::system::error_code& ec, tcp::socket sock) {
    if (ec == asio::error::operation_aborted || !core.acceptor.is_open()) return;
    if (!ec) {
      const bool reject = core.sessions.size() >= core.cfg.limits.max_connections;
      std::unique_ptr<ConnJournal> journal;
      std::string name;
      if (!reject && core.conn_store.size() < core.conn_store.capacity()) {
        // The connection and its journal go to systemd's fd store: a
        // supervisor killed mid-answer gets both back when it restarts.
        journal = ConnJournal::create("ds4-conn");
        if (journal) journal->base(0, 0, {});
        if (journal && journal->ok()) name = core.conn_store.add(sock.native_handle(), journal->fd());
        if (name.empty()) journal.reset();
      }
      std::make_shared<Session>(core, std::move(sock))->start(reject, std::move(journal), std::move(name));
    }
    accept_connections(core);
  });
}

void close_sessions(Core& core) {
  std::vector<std::shared_ptr<Session>> live;
  for (auto& [p, w] : core.sessions)
    if (auto s = w.lock()) live.push_back(std::move(s));
  for (auto& s : live) s->close();
}

Proxy::Proxy(asio::io_context& io, const ProxyConfig& config, ModelText model, sup::WorkerRegistry& registry)
    : core_(std::make_unique<Core>(io, config, std::move(model), registry)) {
  trace::open("proxy");
}

Proxy::~Proxy() {
  core_->planner.stop();  // what is planned there comes back to a proxy that is gone: dropped
  core_->planner.join();
  boost::system::error_code ignored;
  core_->acceptor.close(ignored);
  close_sessions(*core_);
}

void Proxy::start(int inherited_fd) {
  Core& c = *core_;
  reload_keys();
  if (inherited_fd >= 0) return start_inherited(inherited_fd);
  if (!c.cfg.listen.is_loopback() && !c.keys->enabled() && !c.cfg.limits.allow_insecure_bind)
    throw Error("proxy.listen " + c.cfg.listen.str() +
                " is not a loopback address and proxy.api_keys_file is empty: set api keys, or "
                "proxy.limits.allow_insecure_bind: true to serve without them");
  try {
    const tcp::endpoint ep(asio::ip::make_address(c.cfg.listen.host), c.cfg.listen.port);
    c.acceptor.open(ep.protocol());
    c.acceptor.set_option(asio::socket_base::reuse_address(true));
    c.acceptor.bind(ep);
    c.acceptor.listen(asio::socket_base::max_listen_connections);
  } catch (const boost::system::system_error& e) {
    boost::system::error_code ignored;
    c.acceptor.close(ignored);
    throw Error("proxy.listen " + c.cfg.listen.str() + ": cannot listen: " + e.code().message());
  }
  accept_connections(c);
}

void Proxy::start_inherited(int fd) {
  Core& c = *core_;
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0 || (ss.ss_family != AF_INET && ss.ss_family != AF_INET6))
    throw Error("the listening socket systemd passed (descriptor " + std::to_string(fd) +
                ") is not a TCP socket: ListenStream= of ds4-supervisor.socket must be an address and port");
  const int own = ::fcntl(fd, F_DUPFD_CLOEXEC, 3);
  if (own < 0) throw Error(std::string("cannot duplicate the listening socket systemd passed: ") + std::strerror(errno));
  // The service manager (or the keeper) holds its own copy: ours closes with
  // the acceptor, so a stop closes the port here.
  ::close(fd);
  boost::system::error_code ec;
  c.acceptor.assign(ss.ss_family == AF_INET ? tcp::v4() : tcp::v6(), own, ec);
  if (ec) {
    ::close(own);
    throw Error("cannot listen on the socket systemd passed: " + ec.message());
  }
  const tcp::endpoint ep = c.acceptor.local_endpoint(ec);
  if (!ep.address().is_loopback() && !c.keys->enabled() && !c.cfg.limits.allow_insecure_bind) {
    c.acceptor.close(ec);
    throw Error("the socket unit listens on " + ep.address().to_string() + ":" + std::to_string(ep.port()) +
                ", not a loopback address, and proxy.api_keys_file is empty: set api keys, or "
                "proxy.limits.allow_insecure_bind: true to serve without them");
  }
  const bool same = (c.cfg.listen.port == 0 || c.cfg.listen.port == ep.port()) &&
                    (asio::ip::make_address(c.cfg.listen.host, ec) == ep.address() || ec);
  if (!same)
    log::warn("proxy.listen " + c.cfg.listen.str() + " differs from the socket systemd holds (" +
                  ep.address().to_string() + ":" + std::to_string(ep.port()) +
                  "): serving on the socket's address (ListenStream= of ds4-supervisor.socket; where ds4-socket-generator "
                  "is installed, `systemctl --user daemon-reload`, `systemctl --user stop ds4-supervisor.socket` and "
                  "`systemctl --user restart ds4-supervisor` move it to proxy.listen)",
              {{"DS4_LISTEN", c.cfg.listen.str()}});
  log::info("listening on the socket systemd (socket activation) or the keeper holds: connections made while the "
            "supervisor restarts wait for it in the kernel's backlog",
            {{"DS4_EVENT", "socket_inherited"}});
  accept_connections(c);
}

void Proxy::keep_connections(size_t capacity) { core_->conn_store = ConnStore(capacity); }

void Proxy::adopt_connections(std::vector<StoredConnection> conns) {
  Core& c = *core_;
  size_t continued = 0, closed = 0, answers = 0;
  for (StoredConnection& sc : conns) {
    if (auto n = stored_connection_number(sc.name)) c.conn_store.skip_past(*n);
    c.conn_store.adopt();
    std::string why;
    const std::optional<TcpBytes> bytes = sc.socket >= 0 ? tcp_bytes(sc.socket) : std::nullopt;
    std::optional<JournalState> st = sc.journal >= 0 ? ConnJournal::read(sc.journal, &why) : std::nullopt;
    if (sc.socket < 0 || sc.journal < 0) why = "the store gave back no socket or no journal";
    else if (!bytes) why = "the descriptor is not a connected TCP socket";
    std::shared_ptr<Session> s;
    if (bytes && st) {
      boost::system::error_code ec;
      tcp::socket sock(c.io);
      sockaddr_storage ss{};
      socklen_t len = sizeof ss;
      ::getsockname(sc.socket, reinterpret_cast<sockaddr*>(&ss), &len);
      sock.assign(ss.ss_family == AF_INET6 ? tcp::v6() : tcp::v4(), sc.socket, ec);
      if (!ec) {
        sc.socket = -1;  // the session's now
        s = std::make_shared<Session>(c, std::move(sock));
        auto journal = std::make_unique<ConnJournal>(sc.journal, *st);
        sc.journal = -1;
        bool mid_answer = false;
        if (s->recover(std::move(journal), sc.name, *st, bytes->read, bytes->written, &why, &mid_answer)) {
          ++continued;
          answers += mid_answer ? 1 : 0;
          continue;
        }
      } else {
        why = "cannot take the socket: " + ec.message();
      }
    }
    log::warn("connection " + sc.name + " from before the restart is closed: " + why,
              {{"DS4_EVENT", "connection_lost"}, {"DS4_CONNECTION", sc.name}, {"DS4_REASON", why}});
    ++closed;
    if (s) {
      s->close();  // also takes it out of the store
    } else {
      if (sc.socket >= 0) ::shutdown(sc.socket, SHUT_RDWR);
      c.conn_store.remove(sc.name);
    }
    if (sc.socket >= 0) ::close(sc.socket);
    if (sc.journal >= 0) ::close(sc.journal);
  }
  if (!conns.empty())
    log::info("took back " + std::to_string(conns.size()) + " client connections from before the restart: " +
                  std::to_string(continued) + " go on (" + std::to_string(answers) + " of them mid-answer), " +
                  std::to_string(closed) + " closed",
              {{"DS4_EVENT", "connections_adopted"},
               {"DS4_CONNECTIONS", std::to_string(conns.size())},
               {"DS4_CONTINUED", std::to_string(continued)},
               {"DS4_MID_ANSWER", std::to_string(answers)}});
}

tcp::endpoint Proxy::endpoint() const {
  boost::system::error_code ec;
  return core_->acceptor.local_endpoint(ec);
}

void Proxy::reload_keys() {
  auto keys = std::make_shared<ApiKeys>(core_->cfg.api_keys_file);
  keys->reload();  // throws: the keys before stay
  if (keys->enabled() && keys->size() == 0)
    log::warn("proxy.api_keys_file " + core_->cfg.api_keys_file.string() +
              " holds no key: every request is refused (401) until one is added (then SIGHUP)");
  core_->keys = std::move(keys);
}

void Proxy::apply(const ProxyConfig& config) {
  Core& c = *core_;
  const bool keys_changed = config.api_keys_file != c.cfg.api_keys_file;
  const ListenAddress listen = c.cfg.listen;
  c.cfg = config;
  c.cfg.listen = listen;  // rebinding is the caller's (a new Proxy)
  c.scheduler.set_options(scheduler_options(config));
  c.responses.set_capacity(config.responses_store);
  if (keys_changed) reload_keys();
}

void Proxy::stop(Duration deadline, std::function<void()> done) {
  Core& c = *core_;
  c.stopping = true;
  boost::system::error_code ignored;
  c.acceptor.close(ignored);
  auto until = std::chrono::steady_clock::now() + deadline;
  auto timer = std::make_shared<asio::steady_timer>(c.io);
  auto poll = std::make_shared<std::function<void()>>();
  *poll = [this, until, timer, poll, done = std::move(done)]() mutable {
    Core& c = *core_;
    if ((c.scheduler.waiting() == 0 && c.scheduler.running() == 0 && c.planning == 0) ||
        std::chrono::steady_clock::now() >= until) {
      close_sessions(c);
      auto d = std::move(done);
      *poll = nullptr;  // breaks the cycle
      if (d) d();
      return;
    }
    timer->expires_after(std::chrono::milliseconds(20));
    timer->async_wait([poll](const boost::system::error_code&) {
      if (*poll) (*poll)();
    });
  };
  (*poll)();
}

sup::ProxyStats Proxy::proxy_stats() const { return core_->scheduler.stats(); }

sup::ProxyActivity Proxy::proxy_activity() const {
  sup::ProxyActivity a;
  core_->metrics.fill(a);
  a.requests = core_->scheduler.requests(sup::ProxyActivity::kListedRequests);
  return a;
}

void Proxy::set_status_source(std::function<std::string()> fn) { core_->status_source = std::move(fn); }

void Proxy::set_exec_engines(bool exec) { core_->exec_engines = exec; }

std::string Proxy::metrics_text() const { return core_->metrics_text(); }

void Proxy::set_metrics_extra(std::function<std::string()> fn) { core_->metrics_extra = std::move(fn); }

}  // namespace ds4::proxy
