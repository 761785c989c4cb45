#include "worker/server.h"

#include <sys/socket.h>
#include <sys/syscall.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <functional>
#include <optional>
#include <utility>  // before Asio: Boost 1.74's awaitable.hpp needs std::exchange

#include <boost/asio.hpp>
#include <map>

#include "shared/busy_poll.h"
#include "shared/control_block.h"
#include "shared/error.h"
#include "shared/log.h"
#include "shared/protocol.h"
#include "shared/request_trace.h"
#include "worker/engine.h"
#include "worker/room_check.h"

namespace ds4 {
namespace {

namespace asio = boost::asio;
using local = asio::local::stream_protocol;

class Connection;

struct ServerState {
  Engine& engine;
  nlohmann::json info;
  std::map<Connection*, std::weak_ptr<Connection>> live;
  bool stopping = false;
  control::Writer* record = nullptr;  // our control block record, if any
  std::vector<std::weak_ptr<Connection>> touched;  // connections with lines in the step that ends
};

/// A request's events, as lines of its connection's step (Connection::add):
/// they leave at the step's end with the connection's other lines.
class Sink : public RequestSink, public std::enable_shared_from_this<Sink> {
 public:
  Sink(ServerState& st, std::weak_ptr<Connection> c, int64_t id) : st_(st), c_(std::move(c)), id_(id) {}
  void on_token(int64_t index, const Sampled& s) override {
    proto::TokenEvent e{index, s.token, s.logprob, {}};
    for (const auto& t : s.top) e.top.emplace_back(t.token, t.logprob);
    add(proto::token_line(e, id_), false);
  }
  void on_done(Finish reason, const Timings& t, const std::string& error) override {
    if (st_.record) st_.record->count_request(uint64_t(t.prompt_n), uint64_t(t.predicted_n), reason == Finish::error);
    add(reason == Finish::error ? proto::error_line(error, id_)
                                : proto::done_line(finish_name(reason),
                                                   {t.prompt_n, t.cache_n, t.predicted_n, t.prompt_ms, t.predicted_ms}, id_),
        true);
  }

  int64_t id() const { return id_; }
  int64_t engine_id = 0;  // the engine's id of the request

 private:
  void add(const std::string& line, bool last);  // to the connection, if it is still there

  ServerState& st_;
  std::weak_ptr<Connection> c_;
  const int64_t id_;  // the client's id, 0 = none
};

/// One client connection. A generate request with an id shares it with
/// others: the next line is taken at once. One without id has it alone: the
/// next line is taken when it ends. A step's lines of all the connection's
/// requests leave together at the step's end, in one write; what the socket
/// does not take waits, in order, until it has room. EOF (or an error)
/// cancels what runs; a line that cannot be parsed is answered with an error
/// and the connection closes.
class Connection : public std::enable_shared_from_this<Connection> {
 public:
  Connection(ServerState& st, local::socket sock) : st_(st), sock_(std::move(sock)) {}

  void start() {
    st_.live[this] = weak_from_this();
    do_read();
  }
  /// The worker stops: running requests are cancelled and the connection
  /// closes after their answers; an idle one closes now.
  void stop() { send({}, true); }

  /// A line of this step; `ended`: the last of that request.
  void add(std::string_view line, std::shared_ptr<Sink> ended) {
    step_ += line;
    if (ended) step_ends_.push_back(std::move(ended));
    if (!touched_) {
      touched_ = true;
      st_.touched.push_back(weak_from_this());
    }
  }
  /// The step ended: its lines go out, the requests that ended are done.
  void end_step() {
    touched_ = false;
    const int64_t ended = trace::on() ? trace::now_ns() : 0;
    send(step_, false);
    step_.clear();
    if (step_ends_.empty()) return;
    if (ended)
      for (const auto& s : step_ends_) trace::mark(trace::Stage::worker_step_end, s->id(), ended, int32_t(step_ends_.size()));
    for (const auto& s : step_ends_) {
      if (s == serial_) serial_.reset();
      else if (auto it = tagged_.find(s->id()); it != tagged_.end() && it->second == s) tagged_.erase(it);
    }
    step_ends_.clear();
    maybe_close();
    serve();  // lines that waited for a request without id
  }

  ~Connection() {
    close();
    st_.live.erase(this);
  }

 private:
  // One read is always pending until EOF: it brings the next requests, and
  // EOF cancels what runs.
  void do_read() {
    auto self = shared_from_this();
    sock_.async_read_some(asio::buffer(in_), [this, self](boost::system::error_code ec, size_t n) {
      if (ec) {
        peer_gone_ = true;
        return cancel_all();
      }
      if (!close_after_) buf_.append(in_, n);  // closing: what follows is not answered
      serve();
      if (!peer_gone_ && sock_.is_open()) do_read();
    });
  }

  // Handles the complete lines received, up to one that must wait for a
  // request without id to end.
  void serve() {
    while (!close_after_ && !peer_gone_) {
      const size_t nl = buf_.find('\n');
      if (nl == std::string::npos) {
        if (buf_.size() > proto::kMaxLineBytes && !serial_) return send(proto::error_line("request line too long"), true);
        return;
      }
      if (serial_) return;  // taken up when it ends
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
        case proto::Request::Op::cancel:  // one that ended already is not there: nothing happens
          if (auto it = tagged_.find(req.id); it != tagged_.end()) st_.engine.cancel(it->second->engine_id);
          break;
        case proto::Request::Op::generate:
          if (st_.stopping) return send(proto::error_line("worker is stopping", req.id), true);
          if (req.id && tagged_.count(req.id))
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
    r.sampling = {g.sampling.temperature, g.sampling.top_k,
                  g.sampling.top_p,       g.sampling.min_p,
                  g.sampling.seed,        g.sampling.frequency_penalty,
                  g.sampling.presence_penalty, std::move(g.sampling.logit_bias)};
    r.n_probs = g.logprobs;
    r.ignore_eos = g.ignore_eos;
    r.grammar = std::move(g.grammar);
    for (proto::GrammarTrigger& t : g.grammar_triggers) r.grammar_triggers.push_back({std::move(t.text), t.at_start});
    trace::mark(trace::Stage::worker_read, id);
    auto sink = std::make_shared<Sink>(st_, weak_from_this(), id);
    sink->engine_id = st_.engine.submit(std::move(r), sink);
    if (id) tagged_[id] = std::move(sink);
    else serial_ = std::move(sink);
  }

  void cancel_all() {
    if (serial_) st_.engine.cancel(serial_->engine_id);
    for (auto& [id, s] : tagged_) st_.engine.cancel(s->engine_id);
  }

  /// Sends bytes, at once as far as the socket takes them; `close_after`:
  /// the connection closes, and what runs on it is cancelled.
  void send(std::string_view bytes, bool close_after) {
    if (open_ && !bytes.empty()) {
      if (pending_.empty()) bytes.remove_prefix(send_some(bytes));
      if (!bytes.empty() && !broken_) {
        pending_ += bytes;
        if (!flushing_) flush();
      }
    }
    if (close_after && !close_after_) {
      close_after_ = true;
      cancel_all();
    }
    maybe_close();
  }
  // Sends what waits when the socket has room.
  void flush() {
    flushing_ = true;
    sock_.async_wait(local::socket::wait_write, [self = shared_from_this()](boost::system::error_code ec) {
      self->flushing_ = false;
      if (ec || !self->open_) return self->close();
      self->pending_.erase(0, self->send_some(self->pending_));
      if (!self->pending_.empty() && !self->broken_) return self->flush();
      self->pending_.clear();
      self->maybe_close();
    });
  }
  size_t send_some(std::string_view bytes) {
    size_t done = 0;
    while (done < bytes.size()) {
      const ssize_t n = ::send(sock_.native_handle(), bytes.data() + done, bytes.size() - done, MSG_DONTWAIT | MSG_NOSIGNAL);
      if (n > 0) done += size_t(n);
      else if (n < 0 && errno == EINTR) continue;
      else {
        broken_ = !(n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK));  // the reader sees the connection end
        break;
      }
    }
    return done;
  }

  // Closes once asked to, with no request running and nothing left to send.
  void maybe_close() {
    if (close_after_ && !serial_ && tagged_.empty() && (pending_.empty() || broken_)) close();
  }
  void close() {
    if (!open_) return;
    open_ = false;
    pending_.clear();
    boost::system::error_code ignored;
    sock_.shutdown(local::socket::shutdown_both, ignored);
    sock_.close(ignored);
  }

  ServerState& st_;
  local::socket sock_;
  bool open_ = true;
  char in_[16384];
  std::string buf_;      // received, not yet handled
  std::string pending_;  // to send, when the socket has room
  bool flushing_ = false;
  bool broken_ = false;  // a send failed: nothing more goes out
  bool close_after_ = false;
  bool peer_gone_ = false;
  std::shared_ptr<Sink> serial_;                     // the request without id that runs, if any
  std::map<int64_t, std::shared_ptr<Sink>> tagged_;  // running requests with ids, by id
  std::string step_;                                 // this step's lines
  std::vector<std::shared_ptr<Sink>> step_ends_;     // requests whose last lines are among them
  bool touched_ = false;                             // listed in ServerState::touched
};

void Sink::add(const std::string& line, bool last) {
  if (auto c = c_.lock()) c->add(line, last ? shared_from_this() : nullptr);
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
  trace::open(("worker-" + std::to_string(opts.id) + "-" + std::to_string(getpid())).c_str());
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
             {"DS4_SLOTS", std::to_string(opts.shape.slots)}, {"DS4_KV_CACHE", kv_type_name(opts.shape.kv)}});

  Engine engine(backend, hp, lm.tokenizer.eos(), opts.shape);
  engine.set_token_table(TokenTable::from_model(lm.segment.metadata(), lm.tokenizer));
  // The state outlives the io_context: handlers it still holds when it is
  // destroyed release their connections, which unregister from the state.
  ServerState st{engine, {}, {}, false, record.get(), {}};
  asio::io_context io(1);
  engine.on_step_end([&st] {
    std::vector<std::weak_ptr<Connection>> touched;
    touched.swap(st.touched);
    for (auto& w : touched)
      if (auto c = w.lock()) c->end_step();
  });
  st.info = {{"ev", "info"},
             {"id", opts.id},
             {"pid", int64_t(getpid())},
             {"model", hp.name},
             {"segment", lm.segment.name()},
             {"n_vocab", hp.n_vocab},
             {"ctx", opts.shape.ctx},
             {"slots", opts.shape.slots},
             {"kv_cache", kv_type_name(opts.shape.kv)},
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

  asio::signal_set signals(io, SIGTERM, SIGINT);
  asio::steady_timer grace(io);
  std::function<void(const std::string&)> stop = [&](const std::string& why) {
    if (st.stopping) return;
    sd_notify(0, "STOPPING=1");
    if (record) record->set_state(control::RecordState::stopping);
    log::info("stopping " + why, {{"DS4_WORKER", std::to_string(opts.id)}});
    st.stopping = true;
    boost::system::error_code ignored;
    acc.close(ignored);
    for (auto& [p, w] : st.live)
      if (auto c = w.lock()) c->stop();
    // Let the cancellations reach their clients, then stop.
    grace.expires_after(std::chrono::milliseconds(200));
    grace.async_wait([&](boost::system::error_code) { io.stop(); });
  };
  signals.async_wait([&](boost::system::error_code ec, int sig) {
    if (!ec) stop("on signal " + std::to_string(sig));
  });
  // A process-backend worker under the supervisor's keeper outlives the
  // supervisor (the next one adopts it) and ends with the keeper.
  std::optional<asio::posix::stream_descriptor> keeper;
  if (const int k = opts.dies_with; k > 0) {
    const std::string gone = "as the supervisor's keeper (pid " + std::to_string(k) + ") is gone";
    const int fd = int(::syscall(SYS_pidfd_open, k, 0));
    if (fd < 0) throw Error("the supervisor's keeper (pid " + std::to_string(k) + ") is gone");
    keeper.emplace(io, fd);
    keeper->async_wait(asio::posix::stream_descriptor::wait_read, [&stop, gone](boost::system::error_code ec) {
      if (!ec) stop(gone);
    });
  }

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
  // One thread: the engine steps while it has work, and between steps the
  // io_context runs what is ready (request lines, cancels, closed
  // connections, writes that waited for room); idle, it waits there. No
  // thread hands a request or an answer to another. The heartbeat comes from
  // this loop, so a stuck step stops it (and the socket's answers); the
  // device figures are refreshed about once a second.
  // While a step computes (between layers, or while the GPU runs it), the
  // requests that arrive are read and queued: their timings start when they
  // reach the worker, not when the step in progress ends, and a GPU worker
  // parses the next step's requests while the GPU computes this one.
  // Idle, it first polls for opts.busy_poll (workers.busy_poll): the next
  // request of a client that got its answer comes within tens of
  // microseconds, and is then read without a sleeping thread's wake-up.
  backend.set_during_step([&io] {
    for (int i = 0; i < 64 && io.poll_one(); ++i) {
    }
  });
  try {
    auto device_read = std::chrono::steady_clock::now();
    while (!io.stopped()) {
      if (!engine.step() && !poll_busily(io, opts.busy_poll)) io.run_one_for(std::chrono::milliseconds(50));
      // What is ready, up to a bound: a client that never stops sending
      // cannot hold the engine back.
      for (int i = 0; i < 256 && io.poll_one(); ++i) {
      }
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
    ::unlink(opts.socket_path.c_str());
    throw;
  }
  ::unlink(opts.socket_path.c_str());
}

}  // namespace ds4
