#include "supervisor/proxy/proxy.h"

#include "shared/error.h"
#include "shared/log.h"
#include "supervisor/asio.h"
#include "supervisor/proxy/core.h"
#include "supervisor/proxy/session.h"

namespace ds4::proxy {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;

SchedulerOptions scheduler_options(const ProxyConfig& cfg) {
  SchedulerOptions o;
  o.max_waiting = cfg.queue.max_waiting;
  o.max_wait = cfg.queue.max_wait;
  o.engine.max_header_bytes = uint32_t(std::min<Bytes>(cfg.limits.max_header_bytes, UINT32_MAX));
  o.engine.max_body_bytes = cfg.limits.max_body_bytes;
  return o;
}

Core::Core(asio::io_context& io_, const ProxyConfig& c, ModelText m, sup::WorkerRegistry& reg)
    : io(io_), cfg(c), model(std::move(m)), registry(reg), scheduler(io_, reg, scheduler_options(c)), acceptor(io_),
      shared_cfg_(std::make_shared<const ProxyConfig>(c)), keys_(std::make_shared<const ApiKeys>(c.api_keys_file)),
      rng_(std::random_device{}()) {
  busy_poll_us = busy_poll_for(c).count();
  publish_workers();
  // After the scheduler's own listener: it has read the new list by then.
  registry.on_change([this, alive = std::weak_ptr<bool>(alive)] {
    if (!alive.expired()) publish_workers();
  });
}

void Core::publish_workers() {
  context = scheduler.max_context();
  bool http = false;
  for (const auto& w : scheduler.workers()) http = http || w.http_port > 0;
  forward = http;
}

std::shared_ptr<const ProxyConfig> Core::config() const {
  std::lock_guard lock(m_);
  return shared_cfg_;
}

std::shared_ptr<const ApiKeys> Core::keys() const {
  std::lock_guard lock(m_);
  return keys_;
}

void Core::set_config(const ProxyConfig& c) {
  cfg = c;
  busy_poll_us = busy_poll_for(c).count();
  auto shared = std::make_shared<const ProxyConfig>(c);
  std::lock_guard lock(m_);
  shared_cfg_ = std::move(shared);
}

void Core::set_keys(std::shared_ptr<const ApiKeys> k) {
  std::lock_guard lock(m_);
  keys_ = std::move(k);
}

void Core::add_session(const std::shared_ptr<Session>& s) {
  std::lock_guard lock(m_);
  sessions_[s.get()] = s;
}

void Core::remove_session(Session* s) {
  std::lock_guard lock(m_);
  sessions_.erase(s);
}

size_t Core::session_count() const {
  std::lock_guard lock(m_);
  return sessions_.size();
}

std::vector<std::shared_ptr<Session>> Core::live_sessions() const {
  std::vector<std::shared_ptr<Session>> live;
  std::lock_guard lock(m_);
  for (auto& [p, w] : sessions_)
    if (auto s = w.lock()) live.push_back(std::move(s));
  return live;
}

RouteContext Core::route_context(const ProxyConfig& c, const ApiKeys& k, bool on_core) {
  PlanLimits limits;
  limits.max_tokens_per_request = c.limits.max_tokens_per_request;
  limits.context = context;
  {
    std::lock_guard lock(m_);
    limits.random_seed = rng_();
  }
  RouteContext ctx{model, k, limits, nullptr, nullptr, stopping, forward};
  if (on_core) {
    ctx.workers = [this] { return registry.workers(); };
    ctx.metrics = [this] { return metrics_text(); };
  }
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
  uint64_t random = 0, count = 0;
  {
    std::lock_guard lock(m_);
    random = rng_();
    count = next_id_++;
  }
  for (int i = 0; i < 16; ++i) id[at + size_t(i)] = kHex[(random >> (60 - 4 * i)) & 15];
  for (int i = 0; i < 4; ++i) id[at + 16 + size_t(i)] = kHex[(count >> (12 - 4 * i)) & 15];
  return id;
}

void start_fronts(Core& core) {
  auto first = std::make_unique<Front>();
  first->io = &core.io;
  core.fronts.push_back(std::move(first));
  const uint32_t n = threads_for(core.cfg);
  for (uint32_t i = 1; i < n; ++i) {
    auto f = std::make_unique<Front>();
    f->own = std::make_unique<asio::io_context>(1);
    f->io = f->own.get();
    f->work.emplace(f->own->get_executor());
    f->thread = std::thread([&core, io = f->io, i] {
      const std::string name = "ds4-proxy-" + std::to_string(i);
      pthread_setname_np(pthread_self(), name.c_str());
      sup::run_busy_polling(*io, [&core] { return std::chrono::microseconds(core.busy_poll_us.load()); });
    });
    core.fronts.push_back(std::move(f));
  }
}

void join_fronts(Core& core) {
  for (auto& f : core.fronts) {
    if (f->core()) continue;
    f->work.reset();
    f->io->stop();
    if (f->thread.joinable()) f->thread.join();
  }
}

// Each connection goes to the connection thread with the fewest, in turn
// among equals.
void accept_connections(Core& core) {
  const size_t n = core.fronts.size();
  Front* front = nullptr;
  for (size_t k = 1; k <= n; ++k) {
    Front* f = core.fronts[(core.last_front + k) % n].get();
    if (!front || f->connections.load() < front->connections.load()) front = f;
  }
  for (size_t i = 0; i < n; ++i)
    if (core.fronts[i].get() == front) core.last_front = i;
  core.acceptor.async_accept(*front->io, [&core, front](const boost::system::error_code& ec, tcp::socket sock) {
    if (ec == asio::error::operation_aborted || !core.acceptor.is_open()) return;
    if (!ec) {
      const bool reject = core.session_count() >= core.cfg.limits.max_connections;
      auto s = std::make_shared<Session>(core, *front, std::move(sock));
      core.add_session(s);
      asio::dispatch(*front->io, [s, reject] { s->start(reject); });
    }
    accept_connections(core);
  });
}

void close_sessions(Core& core) {
  for (auto& s : core.live_sessions()) s->close_on_its_thread();
}

Proxy::Proxy(asio::io_context& io, const ProxyConfig& config, ModelText model, sup::WorkerRegistry& registry)
    : core_(std::make_unique<Core>(io, config, std::move(model), registry)) {}

Proxy::~Proxy() {
  boost::system::error_code ignored;
  core_->acceptor.close(ignored);
  join_fronts(*core_);
  // No other thread runs now: every session closes here.
  for (auto& s : core_->live_sessions()) s->close();
}

void Proxy::start() {
  Core& c = *core_;
  reload_keys();
  if (!c.cfg.listen.is_loopback() && !c.keys()->enabled() && !c.cfg.limits.allow_insecure_bind)
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
  if (c.fronts.empty()) start_fronts(c);
  accept_connections(c);
}

tcp::endpoint Proxy::endpoint() const {
  boost::system::error_code ec;
  return core_->acceptor.local_endpoint(ec);
}

void Proxy::reload_keys() {
  auto keys = std::make_shared<ApiKeys>(core_->cfg.api_keys_file);
  keys->reload();  // throws: the keys before stay
  core_->set_keys(std::move(keys));
}

void Proxy::apply(const ProxyConfig& config) {
  Core& c = *core_;
  const bool keys_changed = config.api_keys_file != c.cfg.api_keys_file;
  ProxyConfig next = config;
  next.listen = c.cfg.listen;    // rebinding is the caller's (a new Proxy)
  next.threads = c.cfg.threads;  // so is another number of threads
  c.set_config(next);
  c.scheduler.set_options(scheduler_options(config));
  if (keys_changed) reload_keys();  // throws: the keys before stay
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
    if ((c.scheduler.waiting() == 0 && c.scheduler.running() == 0) || std::chrono::steady_clock::now() >= until) {
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

std::string Proxy::metrics_text() const { return core_->metrics_text(); }

void Proxy::set_metrics_extra(std::function<std::string()> fn) { core_->metrics_extra = std::move(fn); }

}  // namespace ds4::proxy
