#include "supervisor/proxy/static_registry.h"

#include "shared/protocol.h"

namespace ds4::proxy {

namespace asio = boost::asio;
using local = asio::local::stream_protocol;

/// One info exchange, bounded by a timer.
struct StaticRegistry::Probe : std::enable_shared_from_this<StaticRegistry::Probe> {
  Probe(asio::io_context& io, std::function<void(bool, nlohmann::json)> done) : sock(io), timer(io), done(std::move(done)) {}
  local::socket sock;
  asio::steady_timer timer;
  std::string buf;
  std::function<void(bool, nlohmann::json)> done;
  void finish(bool ok, nlohmann::json info = {}) {
    if (!done) return;
    auto d = std::move(done);
    done = nullptr;
    timer.cancel();
    boost::system::error_code ignored;
    sock.close(ignored);
    d(ok, std::move(info));
  }
  void run(const std::string& path, Duration timeout) {
    auto self = shared_from_this();
    timer.expires_after(timeout);
    timer.async_wait([self](const boost::system::error_code& ec) {
      if (!ec) self->finish(false);
    });
    sock.async_connect(local::endpoint(path), [self](const boost::system::error_code& ec) {
      if (ec) return self->finish(false);
      static const std::string kInfo = "{\"op\":\"info\"}\n";
      asio::async_write(self->sock, asio::buffer(kInfo), [self](const boost::system::error_code& ec, size_t) {
        if (ec) self->finish(false);
      });
      asio::async_read_until(self->sock, asio::dynamic_buffer(self->buf, 1 << 20), '\n',
                             [self](const boost::system::error_code& ec, size_t n) {
                               if (ec) return self->finish(false);
                               auto j = nlohmann::json::parse(self->buf.substr(0, n), nullptr, false);
                               self->finish(j.is_object() && j.value("ev", "") == "info", j);
                             });
    });
  }
};

StaticRegistry::StaticRegistry(asio::io_context& io, std::vector<std::string> sockets, Duration interval)
    : io_(io), interval_(interval), alive_(std::make_shared<bool>(true)) {
  for (size_t i = 0; i < sockets.size(); ++i) {
    sup::WorkerInfo w;
    w.id = int(i);
    w.state = sup::WorkerState::starting;
    w.socket_path = sockets[i];
    workers_.push_back(w);
  }
  forced_.resize(sockets.size());
  probed_state_.resize(sockets.size(), sup::WorkerState::starting);
}

StaticRegistry::~StaticRegistry() { alive_.reset(); }

void StaticRegistry::start() {
  for (size_t i = 0; i < workers_.size(); ++i) probe(i);
}

void StaticRegistry::probe(size_t i) {
  std::weak_ptr<bool> alive = alive_;
  auto p = std::make_shared<Probe>(io_, [this, i, alive](bool ok, nlohmann::json info) {
    if (alive.expired()) return;
    int64_t ctx = 0, slots = 0;
    int pid = 0;
    if (ok) {
      ctx = info.value("ctx", int64_t(0));
      slots = info.value("slots", int64_t(0));
      pid = info.value("pid", 0);
    }
    probed(i, ok, ctx, slots, pid);
    auto t = std::make_shared<asio::steady_timer>(io_, interval_);
    t->async_wait([this, i, alive, t](const boost::system::error_code& ec) {
      if (!ec && !alive.expired()) probe(i);
    });
  });
  p->run(workers_[i].socket_path, std::chrono::seconds(2));
}

void StaticRegistry::probed(size_t i, bool ok, int64_t ctx, int64_t slots, int pid) {
  sup::WorkerInfo& w = workers_[i];
  const sup::WorkerInfo was = w;
  if (ok) {
    if (probed_state_[i] != sup::WorkerState::ready || pid != w.pid) ++w.generation;
    probed_state_[i] = sup::WorkerState::ready;
    w.context = ctx;
    w.slots = slots;
    w.pid = pid;
  } else if (probed_state_[i] == sup::WorkerState::ready) {
    probed_state_[i] = sup::WorkerState::restarting;
    ++w.restarts;
  }
  w.state = forced_[i].value_or(probed_state_[i]);
  if (w.state != was.state || w.generation != was.generation || w.context != was.context || w.slots != was.slots) changed();
}

void StaticRegistry::force_state(int id, std::optional<sup::WorkerState> state) {
  forced_.at(size_t(id)) = state;
  workers_[size_t(id)].state = state.value_or(probed_state_[size_t(id)]);
  changed();
}

void StaticRegistry::changed() {
  auto ls = listeners_;
  for (auto& fn : ls) fn();
}

}  // namespace ds4::proxy
