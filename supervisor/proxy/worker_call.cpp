#include "supervisor/proxy/worker_call.h"

#include <algorithm>

#include "shared/error.h"

namespace ds4::proxy {

namespace asio = boost::asio;
using local = asio::local::stream_protocol;

/// One open connection to a worker: busy with one call, or idle in its pool.
/// One read is always pending while it is open; it brings the call's events,
/// or, while idle, tells that the worker closed the connection (or broke the
/// protocol), and the connection is dropped.
class WorkerLink : public std::enable_shared_from_this<WorkerLink> {
 public:
  WorkerLink(asio::io_context& io, WorkerPool& pool, WorkerTarget target)
      : sock_(io), pool_(pool), target_(std::move(target)) {}

  void connect() {
    sock_.async_connect(local::endpoint(target_.socket_path), [self = shared_from_this()](const boost::system::error_code& ec) {
      if (!self->sock_.is_open()) return;  // its call was cancelled meanwhile
      if (ec) return self->lost("cannot connect to " + self->target_.socket_path + ": " + ec.message());
      boost::system::error_code ignored;
      self->sock_.non_blocking(true, ignored);  // send() sends at once what the socket takes
      self->read();
      if (self->call_) self->call_->send();
    });
  }

  void close() {
    call_ = nullptr;
    boost::system::error_code ignored;
    sock_.close(ignored);
  }

  local::socket sock_;
  WorkerPool& pool_;
  WorkerTarget target_;
  WorkerCall* call_ = nullptr;  // null while idle

 private:
  void read() {
    sock_.async_read_some(asio::buffer(in_), [self = shared_from_this()](const boost::system::error_code& ec, size_t n) {
      self->on_read(ec, n);
    });
  }

  void on_read(const boost::system::error_code& ec, size_t n) {
    if (!sock_.is_open()) return;  // closed by its call or its pool
    if (ec) return lost(ec == asio::error::eof ? "the worker closed the connection" : ec.message());
    if (!call_) return lost("the worker sent something unasked");
    buf_.append(in_, n);
    size_t from = 0;
    for (size_t nl; call_ && (nl = buf_.find('\n', from)) != std::string::npos; from = nl + 1) {
      proto::Event e;
      try {
        e = proto::parse_event(std::string_view(buf_).substr(from, nl - from));
      } catch (const Error& err) {
        return lost(err.what());
      }
      deliver(std::move(e), nl + 1 == buf_.size());
    }
    if (!sock_.is_open()) return;
    buf_.erase(0, from);
    if (buf_.size() > proto::kMaxLineBytes) return lost("the worker sent a line longer than " + std::to_string(proto::kMaxLineBytes) + " bytes");
    read();
  }

  // One event to the call. After its last event (done or error) the call is
  // over: the connection goes back to the pool when nothing else came with it
  // and the worker finished the work, else it closes.
  void deliver(proto::Event&& e, bool nothing_after) {
    std::shared_ptr<WorkerCall> call = call_->shared_from_this();  // the handler may drop every other reference
    call->answered_ = true;
    if (e.kind == proto::Event::Kind::done || e.kind == proto::Event::Kind::error) {
      auto self = shared_from_this();
      call->finished_ = true;
      call->link_.reset();
      call_ = nullptr;
      if (e.kind == proto::Event::Kind::done && e.reason != "cancelled" && nothing_after) pool_.put(self);
      else close();
    }
    call->h_.on_event(std::move(e));
  }

  // The connection failed: its call breaks, or an idle one is forgotten.
  void lost(const std::string& why) {
    auto self = shared_from_this();
    WorkerCall* call = call_;
    if (!call) pool_.forget(this);
    close();
    if (call) call->broken(why);
  }

  char in_[16384];
  std::string buf_;  // received, not yet delivered
};

// ---- WorkerCall ----

WorkerCall::~WorkerCall() { cancel(); }

void WorkerCall::cancel() {
  finished_ = true;
  if (link_) {
    link_->close();
    link_.reset();
  }
}

void WorkerCall::send() {
  boost::system::error_code ec;  // the socket usually takes the line at once: no completion to wait for
  const size_t n = link_->sock_.write_some(asio::buffer(request_), ec);
  if (!ec && n == request_.size()) return;
  request_.erase(0, n);  // the rest, or an error, goes the asynchronous way
  asio::async_write(link_->sock_, asio::buffer(request_), [self = shared_from_this()](const boost::system::error_code& ec, size_t) {
    if (ec && !self->finished_) self->broken("cannot send to " + self->link_->target_.socket_path + ": " + ec.message());
  });
}

void WorkerCall::broken(const std::string& why) {
  if (finished_) return;
  auto self = shared_from_this();
  const bool answered = answered_;
  cancel();
  h_.on_broken(why, answered);
}

// ---- WorkerPool ----

WorkerPool::~WorkerPool() {
  for (auto& [id, links] : idle_)
    for (auto& l : links) l->close();
}

std::shared_ptr<WorkerCall> WorkerPool::call(const WorkerTarget& w, std::string request_line, WorkerCall::Handler h) {
  auto call = std::make_shared<WorkerCall>(std::move(request_line), std::move(h));
  if (auto it = idle_.find(w.id); it != idle_.end()) {
    auto& links = it->second;
    while (!links.empty()) {
      std::shared_ptr<WorkerLink> l = std::move(links.back());
      links.pop_back();
      if (l->target_.generation != w.generation) {
        l->close();
        continue;
      }
      l->target_.max_idle = w.max_idle;
      l->call_ = call.get();
      call->link_ = std::move(l);
      call->send();
      return call;
    }
  }
  auto l = std::make_shared<WorkerLink>(io_, *this, w);
  ++opened_;
  l->call_ = call.get();
  call->link_ = l;
  l->connect();
  return call;
}

void WorkerPool::retain(const std::vector<sup::WorkerInfo>& workers) {
  for (auto& [id, links] : idle_) {
    auto w = std::find_if(workers.begin(), workers.end(), [id = id](const sup::WorkerInfo& w) { return w.id == id; });
    std::erase_if(links, [&](const std::shared_ptr<WorkerLink>& l) {
      const bool keep = w != workers.end() && w->state == sup::WorkerState::ready && w->generation == l->target_.generation;
      if (!keep) l->close();
      return !keep;
    });
  }
}

size_t WorkerPool::idle(int worker) const {
  auto it = idle_.find(worker);
  return it == idle_.end() ? 0 : it->second.size();
}

void WorkerPool::put(const std::shared_ptr<WorkerLink>& link) {
  auto& links = idle_[link->target_.id];
  if (links.size() >= link->target_.max_idle) return link->close();
  links.push_back(link);
}

void WorkerPool::forget(const WorkerLink* link) {
  auto it = idle_.find(link->target_.id);
  if (it == idle_.end()) return;
  std::erase_if(it->second, [&](const std::shared_ptr<WorkerLink>& l) { return l.get() == link; });
}

}  // namespace ds4::proxy
