#include "worker/server.h"

#include <sys/socket.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <utility>  // before Asio: Boost 1.74's awaitable.hpp needs std::exchange

#include <boost/asio.hpp>
#include <map>
#include <mutex>
#include <thread>

#include "shared/control_block.h"
#include "shared/error.h"
#include "shared/log.h"
#include "shared/protocol.h"
#include "worker/engine.h"
#include "worker/memory_plan.h"

namespace ds4 {
namespace {

namespace asio = boost::asio;
using local = asio::local::stream_protocol;

class Connection;
struct Outbox;

struct ServerState {
  asio::io_context* io = nullptr;
  Engine& engine;
  nlohmann::json info;
  std::map<Connection*, std::weak_ptr<Connection>> live;
  bool stopping = false;
  control::Writer* record = nullptr;  // our control block record, if any
  std::vector<std::shared_ptr<Outbox>> touched;  // engine thread: connections with lines in this step
};

/// The write side of a connection, shared by its I/O thread and the engine
/// thread. Bytes go out at once when the socket takes them, so a request's
/// answer leaves from the engine thread without waiting for the I/O thread
/// to wake; what the socket does not take waits, in order, and the I/O
/// thread sends it when the socket has room (flush). Closing happens under
/// the lock: no thread ever writes to a descriptor that another connection
/// got since.
class Wire {
 public:
  explicit Wire(local::socket sock) : sock_(std::move(sock)), fd_(sock_.native_handle()) {}

  local::socket& socket() { return sock_; }  // I/O thread only
  /// Sends or queues `bytes`. True when bytes wait and the caller must have
  /// the I/O thread flush().
  bool write(std::string_view bytes) {
    std::lock_guard lock(mu_);
    if (!open_) return false;
    if (pending_.empty()) {
      bytes.remove_prefix(send_some(bytes));
      if (bytes.empty() || broken_) return false;
    }
    pending_ += bytes;
    if (flushing_) return false;
    flushing_ = true;
    return true;
  }
  /// Sends what waits; true when it is all gone (or cannot go: the reader
  /// sees the connection end).
  bool send_pending() {
    std::lock_guard lock(mu_);
    pending_.erase(0, send_some(pending_));
    if (pending_.empty() || broken_ || !open_) {
      pending_.clear();
      flushing_ = false;
      return true;
    }
    return false;
  }
  bool idle() {
    std::lock_guard lock(mu_);
    return !flushing_;
  }
  void close() {
    std::lock_guard lock(mu_);
    open_ = false;
    boost::system::error_code ignored;
    sock_.shutdown(local::socket::shutdown_both, ignored);
    sock_.close(ignored);
    pending_.clear();
  }

 private:
  size_t send_some(std::string_view bytes) {
    size_t done = 0;
    while (done < bytes.size()) {
      const ssize_t n = ::send(fd_, bytes.data() + done, bytes.size() - done, MSG_DONTWAIT | MSG_NOSIGNAL);
      if (n > 0) done += size_t(n);
      else if (n < 0 && errno == EINTR) continue;
      else {
        broken_ = !(n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK));
        break;
      }
    }
    return done;
  }

  std::mutex mu_;
  local::socket sock_;
  const int fd_;  // the engine thread writes to it, under mu_, while open_
  bool open_ = true;
  std::string pending_;
  bool flushing_ = false;
  bool broken_ = false;
};

/// A request's events, gathered on the engine thread.
class Sink : public RequestSink, public std::enable_shared_from_this<Sink> {
 public:
  Sink(ServerState& st, std::shared_ptr<Outbox> out, int64_t id) : st_(st), out_(std::move(out)), id_(id) {}
  void on_token(int64_t index, const Sampled& s) override {
    proto::TokenEvent e{index, s.token, s.logprob, {}};
    for (const auto& t : s.top) e.top.emplace_back(t.token, t.logprob);
    step_ += proto::token_line(e, id_);
  }
  void on_done(Finish reason, const Timings& t, const std::string& error) override {
    if (st_.record) st_.record->count_request(uint64_t(t.prompt_n), uint64_t(t.predicted_n), reason == Finish::error);
    step_ += reason == Finish::error ? proto::error_line(error, id_)
                                     : proto::done_line(finish_name(reason),
                                                        {t.prompt_n, t.cache_n, t.predicted_n, t.prompt_ms, t.predicted_ms}, id_);
    ended_ = true;
  }
  void on_step_end() override;

  int64_t engine_id = 0;  // the engine's id of the request (I/O thread)
  bool out = false;       // its last line is out (guarded by the Outbox's mutex)

 private:
  ServerState& st_;
  std::shared_ptr<Outbox> out_;
  const int64_t id_;   // the client's id, 0 = none
  std::string step_;   // this step's lines
  bool ended_ = false;
};

/// What leaves a connection, from the engine thread: a step's lines of all
/// the connection's requests go out together at the step's end (flush),
/// written by the engine thread itself when the step answered this connection
/// alone (no wait for the I/O thread to wake), else handed to the I/O thread
/// in one post, so that a busy engine spends no time in system calls. Either
/// way they leave in order, and a request counts as ended (Sink::out) only
/// once its last line is out.
struct Outbox : std::enable_shared_from_this<Outbox> {
  Outbox(std::weak_ptr<Connection> c, std::shared_ptr<Wire> w) : conn(std::move(c)), wire(std::move(w)) {}

  // Engine thread: called for every connection this step answered.
  void flush(bool alone, asio::io_context& io);
  // I/O thread: writes the lines handed over (c: null once the connection is gone).
  void deliver(Connection* c);

  const std::weak_ptr<Connection> conn;
  const std::shared_ptr<Wire> wire;
  // Engine thread only:
  std::string step;                             // this step's lines
  std::vector<std::shared_ptr<Sink>> step_ends;  // requests whose last line is among them
  bool touched = false;                         // listed in ServerState::touched
  // Under mu:
  std::mutex mu;
  std::string posted;                           // handed to the I/O thread, not written yet
  std::vector<std::shared_ptr<Sink>> posted_ends;
  bool posting = false;
  bool wanted = false;  // the I/O thread waits to hear of an end (a line behind a request, a close)
};

void Sink::on_step_end() {
  out_->step += step_;
  step_.clear();
  if (ended_) out_->step_ends.push_back(shared_from_this());
  if (!out_->touched) {
    out_->touched = true;
    st_.touched.push_back(out_);
  }
}

/// One client connection. A generate request with an id shares it with
/// others: the next line is taken at once. One without id has it alone: the
/// next line is taken when it ends. EOF (or an error) cancels what runs; a
/// line that cannot be parsed is answered with an error and the connection
/// closes.
class Connection : public std::enable_shared_from_this<Connection> {
 public:
  Connection(ServerState& st, local::socket sock) : st_(st), wire_(std::make_shared<Wire>(std::move(sock))) {}

  void start() {
    out_ = std::make_shared<Outbox>(weak_from_this(), wire_);
    st_.live[this] = weak_from_this();
    do_read();
  }
  /// The worker stops: running requests are cancelled and the connection
  /// closes after their answers; an idle one closes now.
  void stop() { send({}, true); }
  /// Sends bytes to the client (I/O thread); `close_after`: the connection
  /// closes, and what runs on it is cancelled.
  void send(std::string_view bytes, bool close_after) {
    if (wire_->write(bytes)) flush();
    if (close_after && !close_after_) {
      close_after_ = true;
      cancel_all();
    }
    maybe_close();
  }
  /// Sends what the socket did not take yet, when it has room (I/O thread).
  void flush() {
    wire_->socket().async_wait(local::socket::wait_write, [self = shared_from_this()](boost::system::error_code ec) {
      if (ec) return self->wire_->close();
      if (!self->wire_->send_pending()) return self->flush();
      self->maybe_close();
    });
  }
  /// A request's last line went out while something waited for it.
  void on_end() {
    maybe_close();
    serve();
  }

  ~Connection() {
    wire_->close();  // a sink still running writes nothing more
    st_.live.erase(this);
  }

 private:
  // One read is always pending until EOF: it brings the next requests, and
  // EOF cancels what runs.
  void do_read() {
    auto self = shared_from_this();
    wire_->socket().async_read_some(asio::buffer(in_), [this, self](boost::system::error_code ec, size_t n) {
      if (ec) {
        peer_gone_ = true;
        return cancel_all();
      }
      if (!close_after_) buf_.append(in_, n);  // closing: what follows is not answered
      serve();
      if (!peer_gone_ && wire_->socket().is_open()) do_read();
    });
  }

  // Handles the complete lines received, up to one that must wait for a
  // request without id to end.
  void serve() {
    while (!close_after_ && !peer_gone_) {
      const size_t nl = buf_.find('\n');
      if (nl == std::string::npos) {
        if (buf_.size() > proto::kMaxLineBytes && !serial_running(false))
          return send(proto::error_line("request line too long"), true);
        return;
      }
      if (serial_ && serial_running(true)) return;  // taken up when it ends
      if (nl > proto::kMaxLineBytes) return send(proto::error_line("request line too long"), true);
      proto::Request req;
      try {
        req = proto::parse_request(std::string_view(buf_).substr(0, nl));
      } catch (const Error& e) {
        if (st_.record) st_.record->count_error();
        return send(proto::error_line(e.what()), true);
      }
      buf_.erase(0, nl + 1);
      switch (req.op) {
        case proto::Request::Op::info: {
          nlohmann::json info = st_.info;
          const EngineStats s = st_.engine.stats();
          info["busy"] = s.busy;
          info["waiting"] = s.waiting;
          send(info.dump() + "\n", false);
          break;
        }
        case proto::Request::Op::cancel:
          // One that ended already is not found by the engine: nothing happens.
          if (auto it = tagged_.find(req.id); it != tagged_.end()) st_.engine.cancel(it->second->engine_id);
          break;
        case proto::Request::Op::generate:
          if (st_.stopping) return send(proto::error_line("worker is stopping", req.id), true);
          if (req.id && tagged_running(req.id))
            return send(proto::error_line("request id " + std::to_string(req.id) + " is already running on this connection"), true);
          start_generate(std::move(req.generate), req.id);
          break;
      }
    }
  }

  void start_generate(proto::GenerateRequest&& g, int64_t id) {
    GenerateRequest r;
    r.prompt = std::move(g.prompt);
    r.generated = std::move(g.generated);
    r.max_tokens = g.max_tokens;
    r.sampling = {g.sampling.temperature, g.sampling.top_k, g.sampling.top_p, g.sampling.min_p, g.sampling.seed};
    r.n_probs = g.logprobs;
    r.ignore_eos = g.ignore_eos;
    auto sink = std::make_shared<Sink>(st_, out_, id);
    sink->engine_id = st_.engine.submit(std::move(r), sink);
    if (!id) {
      serial_ = std::move(sink);
      return;
    }
    if (tagged_.size() >= forget_at_) forget_ended();
    tagged_[id] = std::move(sink);
  }

  void cancel_all() {
    if (serial_) st_.engine.cancel(serial_->engine_id);
    for (auto& [id, s] : tagged_) st_.engine.cancel(s->engine_id);
  }

  // Closes once asked to, with no request running and nothing left to send.
  void maybe_close() {
    if (close_after_ && !running(true) && wire_->idle()) wire_->close();
  }

  // Whether requests run, forgetting those whose last line is out. These
  // take the lock the engine thread holds while it writes: the usual paths
  // (a request with an id starts, a cancel) do without. `notify`: something
  // waits for an end, so the engine thread posts on_end() when one comes.
  bool serial_running(bool notify) {
    std::lock_guard lock(out_->mu);
    if (serial_ && serial_->out) serial_.reset();
    out_->wanted = out_->wanted || (notify && serial_);
    return serial_ != nullptr;
  }
  bool tagged_running(int64_t id) {
    auto it = tagged_.find(id);
    if (it == tagged_.end()) return false;
    std::lock_guard lock(out_->mu);
    if (!it->second->out) return true;
    tagged_.erase(it);
    return false;
  }
  bool running(bool notify) {
    std::lock_guard lock(out_->mu);
    if (serial_ && serial_->out) serial_.reset();
    std::erase_if(tagged_, [](const auto& kv) { return kv.second->out; });
    const bool any = serial_ || !tagged_.empty();
    out_->wanted = out_->wanted || (notify && any);
    return any;
  }
  void forget_ended() {
    {
      std::lock_guard lock(out_->mu);
      std::erase_if(tagged_, [](const auto& kv) { return kv.second->out; });
    }
    forget_at_ = std::max<size_t>(64, 2 * tagged_.size());
  }

  ServerState& st_;
  std::shared_ptr<Wire> wire_;
  std::shared_ptr<Outbox> out_;
  char in_[16384];
  std::string buf_;  // received, not yet handled
  bool close_after_ = false;
  bool peer_gone_ = false;
  std::shared_ptr<Sink> serial_;                     // the request without id that runs, if any
  std::map<int64_t, std::shared_ptr<Sink>> tagged_;  // requests with ids, by id, until seen ended
  size_t forget_at_ = 64;                            // tagged_ size at which ended ones are dropped
};

void Outbox::flush(bool alone, asio::io_context& io) {
  touched = false;
  std::lock_guard lock(mu);
  if (alone && !posting) {
    if (wire->write(step)) {
      asio::post(io, [c = conn] {
        if (auto p = c.lock()) p->flush();
      });
    }
    step.clear();
    for (auto& s : step_ends) s->out = true;
    const bool tell = !step_ends.empty() && wanted;
    step_ends.clear();
    if (tell) {
      wanted = false;
      asio::post(io, [c = conn] {
        if (auto p = c.lock()) p->on_end();
      });
    }
    return;
  }
  posted += step;
  step.clear();
  posted_ends.insert(posted_ends.end(), std::make_move_iterator(step_ends.begin()), std::make_move_iterator(step_ends.end()));
  step_ends.clear();
  if (posting) return;
  posting = true;
  asio::post(io, [self = shared_from_this()] {
    auto c = self->conn.lock();
    self->deliver(c.get());
  });
}

void Outbox::deliver(Connection* c) {
  bool ended;
  {
    std::lock_guard lock(mu);  // held while writing: a direct write cannot overtake these lines
    if (c && wire->write(posted)) c->flush();
    posted.clear();
    ended = !posted_ends.empty();
    for (auto& s : posted_ends) s->out = true;
    posted_ends.clear();
    posting = false;
    if (ended) wanted = false;  // told below, on this thread
  }
  if (c && ended) c->on_end();
}

void do_accept(ServerState& st, local::acceptor& acc) {
  acc.async_accept([&st, &acc](boost::system::error_code ec, local::socket sock) {
    if (ec == asio::error::operation_aborted) return;
    if (!ec) std::make_shared<Connection>(st, std::move(sock))->start();
    do_accept(st, acc);
  });
}

}  // namespace

namespace {

/// Attaches the supervisor's control block; a worker without one still serves.
std::unique_ptr<control::Writer> open_control(const ServeOptions& opts) {
  if (opts.control.empty()) return nullptr;
  try {
    return std::make_unique<control::Writer>(control::Block::attach(opts.control), opts.id, int(getpid()));
  } catch (const Error& e) {
    log::warn(std::string(e.what()) + "; no heartbeat for the supervisor, ignoring",
              {{"DS4_WORKER", std::to_string(opts.id)}});
    return nullptr;
  }
}

void report_device_memory(const Backend& backend, control::Writer* record) {
  if (!record) return;
  try {
    if (auto room = backend.device_room()) record->set_device_memory(room->free, room->total);
  } catch (const std::exception&) {
    // Only a figure for the supervisor: a device that cannot say fails the
    // next step anyway, with the error that matters.
  }
}

}  // namespace

void serve(const LoadedModel& lm, Backend& backend, const ServeOptions& opts) {
  const HParams& hp = lm.model.hp();
  const std::unique_ptr<control::Writer> record = open_control(opts);
  const MemoryPlan plan = backend.plan(opts.shape);
  if (record) record->set_plan(opts.shape.ctx, opts.shape.slots, plan.weights, plan.kv, plan.scratch);
  check_backend_plan_fits(backend, plan, opts.shape);
  sd_notify(0, "STATUS=reserving memory");
  backend.reserve(opts.shape);
  log::info("memory reserved: " + describe_plan(plan, opts.shape),
            {{"DS4_WORKER", std::to_string(opts.id)}, {"DS4_KV_BYTES", std::to_string(plan.kv)},
             {"DS4_SCRATCH_BYTES", std::to_string(plan.scratch)}, {"DS4_CONTEXT", std::to_string(opts.shape.ctx)},
             {"DS4_SLOTS", std::to_string(opts.shape.slots)}});

  Engine engine(backend, hp, lm.tokenizer.eos(), opts.shape);
  // The state outlives the io_context: handlers it still holds when it is
  // destroyed release their connections, which unregister from the state.
  ServerState st{nullptr, engine, {}, {}, false, record.get(), {}};
  asio::io_context io;
  st.io = &io;
  // Each connection's lines of a step leave together; written by the engine
  // thread when only one connection has any (see Outbox).
  engine.on_step_end([&st] {
    const bool alone = st.touched.size() == 1;
    for (auto& o : st.touched) o->flush(alone, *st.io);
    st.touched.clear();
  });
  st.info = {{"ev", "info"},
             {"id", opts.id},
             {"pid", int64_t(getpid())},
             {"model", hp.name},
             {"segment", lm.segment.name()},
             {"n_vocab", hp.n_vocab},
             {"ctx", opts.shape.ctx},
             {"slots", opts.shape.slots},
             {"backend", backend.name()},
             {"plan", {{"weights", plan.weights}, {"kv", plan.kv}, {"scratch", plan.scratch}}}};

  ::unlink(opts.socket_path.c_str());
  local::acceptor acc(io);
  try {
    acc.open();
    acc.bind(local::endpoint(opts.socket_path));
    acc.listen();
  } catch (const boost::system::system_error& e) {
    throw Error("cannot listen on " + opts.socket_path + ": " + e.code().message());
  }
  do_accept(st, acc);

  std::atomic<bool> stop_engine{false};
  std::exception_ptr engine_error;
  std::thread engine_thread([&] {
    try {
      // The heartbeat comes from this loop: a stuck step stops it. The device
      // figures are refreshed about once a second.
      auto device_read = std::chrono::steady_clock::now();
      while (!stop_engine.load()) {
        if (!engine.step()) engine.wait_for_work(std::chrono::milliseconds(50));
        if (record) {
          record->beat();
          const auto now = std::chrono::steady_clock::now();
          if (now - device_read >= std::chrono::seconds(1)) {
            report_device_memory(backend, record.get());
            device_read = now;
          }
        }
      }
    } catch (...) {
      engine_error = std::current_exception();
      asio::post(io, [&io] { io.stop(); });
    }
  });

  asio::signal_set signals(io, SIGTERM, SIGINT);
  asio::steady_timer grace(io);
  signals.async_wait([&](boost::system::error_code ec, int sig) {
    if (ec) return;
    sd_notify(0, "STOPPING=1");
    if (record) record->set_state(control::RecordState::stopping);
    log::info("stopping on signal " + std::to_string(sig), {{"DS4_WORKER", std::to_string(opts.id)}});
    st.stopping = true;
    boost::system::error_code ignored;
    acc.close(ignored);
    for (auto& [p, w] : st.live)
      if (auto c = w.lock()) c->stop();
    // Let the cancellations reach their clients, then stop.
    grace.expires_after(std::chrono::milliseconds(200));
    grace.async_wait([&](boost::system::error_code) { io.stop(); });
  });

  const std::string status = "serving " + (hp.name.empty() ? lm.segment.name() : hp.name) + ": context " +
                             std::to_string(opts.shape.ctx) + " x " + std::to_string(opts.shape.slots) +
                             " slots on " + backend.name();
  if (record) {
    report_device_memory(backend, record.get());
    record->beat();
    record->set_state(control::RecordState::ready);
  }
  sd_notify(0, ("READY=1\nSTATUS=" + status).c_str());
  log::info(status + ", socket " + opts.socket_path, {{"DS4_WORKER", std::to_string(opts.id)}});
  io.run();

  stop_engine.store(true);
  engine.cancel(0);  // wakes the engine thread
  engine_thread.join();
  ::unlink(opts.socket_path.c_str());
  if (engine_error) std::rethrow_exception(engine_error);
}

}  // namespace ds4
