#include "supervisor/proxy/worker_call.h"

#include <algorithm>

#include "shared/error.h"
#include "shared/request_trace.h"

namespace ds4::proxy {

namespace asio = boost::asio;
using local = asio::local::stream_protocol;

/// One connection to a worker process, carrying the calls to it by id. One
/// read is always pending while it is open. Lines go out at once when the
/// socket takes them; the rest waits, in order, for one write at a time.
class WorkerLink : public std::enable_shared_from_this<WorkerLink> {
 public:
  WorkerLink(asio::io_context& io, WorkerPool& pool, WorkerTarget target)
      : sock_(io), pool_(pool), pool_alive_(pool.alive_), target_(std::move(target)) {}

  void connect() {
    sock_.async_connect(local::endpoint(target_.socket_path), [self = shared_from_this()](const boost::system::error_code& ec) {
      if (!self->sock_.is_open()) return;  // closed meanwhile
      if (ec) return self->lost("cannot connect to " + self->target_.socket_path + ": " + ec.message());
      boost::system::error_code ignored;
      self->sock_.non_blocking(true, ignored);  // write() sends at once what the socket takes
      self->connected_ = true;
      self->read();
      if (!self->waiting_.empty()) self->drain();
    });
  }

  void start(const std::shared_ptr<WorkerCall>& call, const proto::GenerateRequest& g) {
    call->id_ = next_id_++;
    call->link_ = shared_from_this();
    calls_[call->id_] = call;
    write(proto::to_line(g, call->id_));
  }

  /// Forgets call `id` and has the worker stop it.
  void cancel(int64_t id) {
    if (!calls_.erase(id) || !sock_.is_open()) return;
    write(proto::cancel_line(id));
    if (retired_ && calls_.empty()) close();  // after the cancel has gone out
  }

  /// No new call comes: closes once the running ones end.
  void retire() {
    retired_ = true;
    if (calls_.empty()) close();
  }

  /// `now`: without waiting for the lines not sent yet (cancels) to go out.
  void close(bool now = false) {
    if (!now && (writing_ || !waiting_.empty())) {
      closing_ = true;
      return;
    }
    boost::system::error_code ignored;
    sock_.close(ignored);
  }

  const WorkerTarget& target() const { return target_; }

 private:
  void write(std::string line) {
    if (!connected_ || writing_ || !waiting_.empty()) {
      waiting_ += line;
      return;
    }
    boost::system::error_code ec;
    const size_t n = sock_.write_some(asio::buffer(line), ec);  // the socket usually takes it all
    if (!ec && n == line.size()) return;
    waiting_.assign(line, ec ? 0 : n);  // the rest, or an error, goes the asynchronous way
    drain();
  }

  void drain() {
    writing_ = true;
    sending_.swap(waiting_);
    waiting_.clear();
    asio::async_write(sock_, asio::buffer(sending_), [self = shared_from_this()](const boost::system::error_code& ec, size_t) {
      self->writing_ = false;
      self->sending_.clear();
      if (!self->sock_.is_open()) return;
      if (ec) return self->lost("cannot send to " + self->target_.socket_path + ": " + ec.message());
      if (!self->waiting_.empty()) return self->drain();
      if (self->closing_) self->close();
    });
  }

  void read() {
    sock_.async_read_some(asio::buffer(in_), [self = shared_from_this()](const boost::system::error_code& ec, size_t n) {
      self->on_read(ec, n);
    });
  }

  void on_read(const boost::system::error_code& ec, size_t n) {
    if (!sock_.is_open()) return;  // closed by the pool or its last call
    if (ec) return lost(ec == asio::error::eof ? "the worker closed the connection" : ec.message());
    auto self = shared_from_this();  // a handler may drop every other reference
    const int64_t read_at = trace::on() ? trace::now_ns() : 0;
    int32_t place = 0;
    buf_.append(in_, n);
    size_t from = 0;
    for (size_t nl; (nl = buf_.find('\n', from)) != std::string::npos; from = nl + 1) {
      proto::Event e;
      try {
        e = proto::parse_event(std::string_view(buf_).substr(from, nl - from));
      } catch (const Error& err) {
        return lost(err.what());
      }
      if (e.id == 0)  // the worker refused a line (it then closes), or broke the protocol
        return lost(e.kind == proto::Event::Kind::error ? "the worker refused a request: " + e.message
                                                        : "the worker sent an event without a request id");
      if (!read_at) {
        deliver(std::move(e));
      } else {
        const int64_t id = e.id;
        trace::mark(trace::Stage::proxy_line, id, read_at, place++);
        deliver(std::move(e));
        trace::mark(trace::Stage::proxy_handled, id);
      }
      if (!sock_.is_open()) return;
    }
    buf_.erase(0, from);
    if (buf_.size() > proto::kMaxLineBytes) return lost("the worker sent a line longer than " + std::to_string(proto::kMaxLineBytes) + " bytes");
    read();
  }

  // One event to its call; events of a cancelled call are dropped. After its
  // last event (done or error) the call is over.
  void deliver(proto::Event&& e) {
    auto it = calls_.find(e.id);
    if (it == calls_.end()) return;
    std::shared_ptr<WorkerCall> call = it->second.lock();
    if (!call) {
      calls_.erase(it);
      return;
    }
    call->answered_ = true;
    if (e.kind == proto::Event::Kind::done || e.kind == proto::Event::Kind::error) {
      calls_.erase(it);
      call->finished_ = true;
      call->link_.reset();
      if (retired_ && calls_.empty()) close();
    }
    call->h_.on_event(std::move(e));
  }

  // The connection failed: every call on it breaks.
  void lost(const std::string& why) {
    auto self = shared_from_this();
    if (!pool_alive_.expired()) pool_.forget(this);
    waiting_.clear();
    closing_ = false;
    writing_ = false;
    boost::system::error_code ignored;
    sock_.close(ignored);
    std::vector<std::weak_ptr<WorkerCall>> calls;
    for (auto& [id, c] : calls_) calls.push_back(c);
    calls_.clear();
    for (auto& c : calls)
      if (auto call = c.lock()) call->broken(why);
  }

  local::socket sock_;
  WorkerPool& pool_;
  std::weak_ptr<bool> pool_alive_;  // the pool outlives no connection it made
  WorkerTarget target_;
  std::map<int64_t, std::weak_ptr<WorkerCall>> calls_;  // running, by request id
  int64_t next_id_ = 1;
  bool connected_ = false;
  bool retired_ = false;
  bool closing_ = false;  // close once the lines waiting are out
  bool writing_ = false;  // an asynchronous write of sending_ runs
  std::string sending_;   // its bytes
  std::string waiting_;   // lines after them
  char in_[16384];
  std::string buf_;  // received, not yet delivered
};

// ---- WorkerCall ----

WorkerCall::~WorkerCall() { cancel(); }

void WorkerCall::cancel() {
  finished_ = true;
  if (link_) {
    auto link = std::move(link_);
    link->cancel(id_);
  }
}

void WorkerCall::broken(const std::string& why) {
  if (finished_) return;
  auto self = shared_from_this();
  const bool answered = answered_;
  finished_ = true;
  link_.reset();
  h_.on_broken(why, answered);
}

// ---- WorkerPool ----

WorkerPool::~WorkerPool() {
  for (auto& [id, l] : links_) l->close(true);
}

std::shared_ptr<WorkerCall> WorkerPool::call(const WorkerTarget& w, const proto::GenerateRequest& g, WorkerCall::Handler h) {
  std::shared_ptr<WorkerLink>& l = links_[w.id];
  if (l && l->target().generation != w.generation) {
    l->retire();
    l.reset();
  }
  if (!l) {
    l = std::make_shared<WorkerLink>(io_, *this, w);
    ++opened_;
    l->connect();
  }
  auto call = std::make_shared<WorkerCall>(std::move(h));
  l->start(call, g);
  return call;
}

void WorkerPool::retain(const std::vector<sup::WorkerInfo>& workers) {
  std::erase_if(links_, [&](const auto& kv) {
    const auto& l = kv.second;
    auto w = std::find_if(workers.begin(), workers.end(), [&](const sup::WorkerInfo& w) { return w.id == kv.first; });
    const bool keep = w != workers.end() && w->state == sup::WorkerState::ready && w->generation == l->target().generation;
    if (!keep) l->retire();
    return !keep;
  });
}

bool WorkerPool::connected(int worker) const { return links_.count(worker) > 0; }

void WorkerPool::forget(const WorkerLink* link) {
  auto it = links_.find(link->target().id);
  if (it != links_.end() && it->second.get() == link) links_.erase(it);
}

}  // namespace ds4::proxy
