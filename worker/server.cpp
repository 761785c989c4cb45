#include "worker/server.h"

#include <systemd/sd-daemon.h>
#include <unistd.h>

#include <atomic>
#include <utility>  // before Asio: Boost 1.74's awaitable.hpp needs std::exchange

#include <boost/asio.hpp>
#include <deque>
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

struct ServerState {
  asio::io_context* io = nullptr;
  Engine& engine;
  nlohmann::json info;
  std::map<Connection*, std::weak_ptr<Connection>> live;
  bool stopping = false;
  control::Writer* record = nullptr;  // our control block record, if any
};

/// One client connection: reads a request line, streams events back.
class Connection : public std::enable_shared_from_this<Connection> {
 public:
  Connection(ServerState& st, local::socket sock) : st_(st), sock_(std::move(sock)) {}

  void start() {
    st_.live[this] = weak_from_this();
    do_read_request();
  }
  void cancel() {
    if (request_id_ > 0 && !done_) st_.engine.cancel(request_id_);
  }
  /// Queues a line for the client (I/O thread only).
  void send(std::string line, bool last) {
    out_.push_back(std::move(line));
    close_after_ = close_after_ || last;
    if (!writing_) do_write();
  }
  void on_engine_done() { done_ = true; }

  ~Connection() { st_.live.erase(this); }

 private:
  void do_read_request() {
    auto self = shared_from_this();
    asio::async_read_until(sock_, asio::dynamic_buffer(buf_, proto::kMaxLineBytes), '\n',
                           [this, self](boost::system::error_code ec, size_t n) { on_read_request(ec, n); });
  }

  void on_read_request(boost::system::error_code ec, size_t n) {
    if (ec == asio::error::not_found) return send(proto::error_line("request line too long"), true);
    if (ec) return;  // client went away before asking anything
    std::string line = buf_.substr(0, n);
    buf_.erase(0, n);
    proto::Request req;
    try {
      req = proto::parse_request(line);
    } catch (const Error& e) {
      if (st_.record) st_.record->count_error();
      return send(proto::error_line(e.what()), true);
    }
    if (req.op == proto::Request::Op::info) {
      nlohmann::json info = st_.info;
      const EngineStats s = st_.engine.stats();
      info["busy"] = s.busy;
      info["waiting"] = s.waiting;
      return send(info.dump() + "\n", true);
    }
    if (st_.stopping) return send(proto::error_line("worker is stopping"), true);
    start_generate(req.generate);
    do_watch();
  }

  void start_generate(const proto::GenerateRequest& g) {
    GenerateRequest r;
    r.prompt = g.prompt;
    r.generated = g.generated;
    r.max_tokens = g.max_tokens;
    r.sampling = {g.sampling.temperature, g.sampling.top_k, g.sampling.top_p, g.sampling.min_p, g.sampling.seed};
    r.n_probs = g.logprobs;
    r.ignore_eos = g.ignore_eos;
    request_id_ = st_.engine.submit(std::move(r), std::make_shared<Sink>(*st_.io, weak_from_this(), st_.record));
  }

  // Anything after the request, or EOF, while generating: EOF means cancel.
  void do_watch() {
    auto self = shared_from_this();
    sock_.async_read_some(asio::buffer(scratch_), [this, self](boost::system::error_code ec, size_t) {
      if (ec) {
        cancel();
        return;
      }
      do_watch();
    });
  }

  void do_write() {
    if (out_.empty()) {
      writing_ = false;
      if (close_after_) {
        boost::system::error_code ignored;
        sock_.shutdown(local::socket::shutdown_both, ignored);
        sock_.close(ignored);
      }
      return;
    }
    writing_ = true;
    while (out_.size() > 1) {  // everything queued goes out in one write
      out_[out_.size() - 2] += out_.back();
      out_.pop_back();
    }
    auto self = shared_from_this();
    asio::async_write(sock_, asio::buffer(out_.front()), [this, self](boost::system::error_code ec, size_t) {
      if (ec) {
        cancel();
        out_.clear();
        writing_ = false;
        return;
      }
      out_.pop_front();
      do_write();
    });
  }

  /// Receives engine callbacks on the engine thread and posts them to I/O.
  class Sink : public RequestSink {
   public:
    Sink(asio::io_context& io, std::weak_ptr<Connection> c, control::Writer* record)
        : io_(io), c_(std::move(c)), record_(record) {}
    void on_token(int64_t index, const Sampled& s) override {
      proto::TokenEvent e{index, s.token, s.logprob, {}};
      for (const auto& t : s.top) e.top.emplace_back(t.token, t.logprob);
      post(proto::token_line(e), false);
    }
    void on_done(Finish reason, const Timings& t, const std::string& error) override {
      if (record_) record_->count_request(uint64_t(t.prompt_n), uint64_t(t.predicted_n), reason == Finish::error);
      if (reason == Finish::error) return post(proto::error_line(error), true);
      post(proto::done_line(finish_name(reason),
                            {t.prompt_n, t.cache_n, t.predicted_n, t.prompt_ms, t.predicted_ms}),
           true);
    }

   private:
    // Lines wait in the outbox until the I/O thread takes them; one handler
    // is posted per burst, so a last token and the done line the engine
    // sends right after it leave in one write (one wake-up for the reader).
    struct Outbox {
      std::mutex mu;
      std::string lines;
      bool last = false;
      bool posted = false;
    };
    void post(std::string line, bool last) {
      bool first;
      {
        std::lock_guard lock(box_->mu);
        box_->lines += line;
        box_->last = box_->last || last;
        first = !box_->posted;
        box_->posted = true;
      }
      if (!first) return;
      asio::post(io_, [c = c_, box = box_] {
        std::string lines;
        bool last;
        {
          std::lock_guard lock(box->mu);
          lines.swap(box->lines);
          last = box->last;
          box->posted = false;
        }
        if (auto conn = c.lock()) {
          if (last) conn->on_engine_done();
          conn->send(std::move(lines), last);
        }
      });
    }
    asio::io_context& io_;
    std::weak_ptr<Connection> c_;
    std::shared_ptr<Outbox> box_ = std::make_shared<Outbox>();
    control::Writer* record_;
  };

  ServerState& st_;
  local::socket sock_;
  std::string buf_;
  char scratch_[256];
  std::deque<std::string> out_;
  bool writing_ = false;
  bool close_after_ = false;
  bool done_ = false;
  int64_t request_id_ = 0;
};

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
  ServerState st{nullptr, engine, {}, {}, false, record.get()};
  asio::io_context io;
  st.io = &io;
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
      if (auto c = w.lock()) c->cancel();
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
