#include "supervisor/proxy/session.h"

#include <malloc.h>
#include <sys/socket.h>

#include <ctime>

#include <boost/beast/http/read.hpp>

#include "shared/log.h"
#include "shared/request_trace.h"

namespace ds4::proxy {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;

Session::Session(Core& core, tcp::socket sock)
    : core_(core), core_alive_(core.alive), sock_(std::move(sock)), timer_(core.io) {}

Session::~Session() {
  if (core_alive_.expired()) return;
  if (job_) core_.scheduler.cancel(job_);  // nothing may call back into a dead session
  forget_store();
  core_.sessions.erase(this);
}

// ---- the journal (conn_journal.h) ----

template <class Buffers, class Handler>
void Session::Reader::async_read_some(const Buffers& buffers, Handler&& handler) {
  if (!s.journal_ || !s.journal_->ok()) {
    s.sock_.async_read_some(buffers, [&s = s, h = std::decay_t<Handler>(std::forward<Handler>(handler))](
                                         const boost::system::error_code& ec, size_t n) mutable {
      s.read_total_ += n;
      h(ec, n);
    });
    return;
  }
  // Readable first; the bytes are peeked, journaled, then taken from the
  // socket. A kill between the record and the take leaves them in both: the
  // restarted supervisor drops them from the socket (Session::recover), so
  // no kill loses a byte.
  s.sock_.async_wait(tcp::socket::wait_read, [&s = s, buffers, h = std::decay_t<Handler>(std::forward<Handler>(handler))](
                                                 boost::system::error_code ec) mutable {
    size_t n = 0;
    if (!ec) {
      n = s.sock_.receive(buffers, tcp::socket::message_peek, ec);
      if (ec == asio::error::would_block || ec == asio::error::try_again) return s.reader_.async_read_some(buffers, std::move(h));
      if (!ec && n == 0) ec = asio::error::eof;
      if (n > 0) {
        std::string bytes(n, '\0');
        asio::buffer_copy(asio::buffer(bytes), buffers, n);
        s.journal_->input(bytes);
        // The peeked bytes stay queued for this one reader: this takes them all.
        const ssize_t took = ::recv(s.sock_.native_handle(), bytes.data(), n, MSG_DONTWAIT);
        if (took != ssize_t(n)) ec = asio::error::connection_aborted;
        s.read_total_ += n;
      }
    }
    h(ec, n);
  });
}

Session::Step::Step(Session& s, JournalStep::Kind kind, std::string event) : s_(s) {
  if (!s.journal_ || s.replaying_ || s.step_depth_++ > 0) return;
  outer_ = true;
  s.step_ = JournalStep{};
  s.step_.kind = kind;
  s.step_.event = std::move(event);
}

Session::Step::~Step() {
  if (!outer_) return;
  Session& s = s_;
  s.step_depth_ = 0;
  s.step_.exchange_done = s.exchange_done_;
  s.step_.keep_alive = s.keep_alive_;
  if (s.journal_) s.journal_->step(s.step_);
  std::string bytes = std::move(s.step_.output);
  s.step_.output.clear();
  if (!bytes.empty()) s.send(std::move(bytes));
  if (s.exchange_done_ && !s.output_pending()) s.after_exchange();
}

bool Session::submit(const std::shared_ptr<Job>& job) {
  if (replaying_) return true;  // recover() submits the last job once the steps are replayed
  return core_.scheduler.submit(job);
}

void Session::forget_store() {
  if (store_name_.empty()) return;
  core_.conn_store.remove(store_name_);
  store_name_.clear();
  journal_.reset();
}

void Session::start(bool reject, std::unique_ptr<ConnJournal> journal, std::string store_name) {
  journal_ = std::move(journal);
  store_name_ = std::move(store_name);
  core_.sessions[this] = weak_from_this();
  boost::system::error_code ignored;
  sock_.non_blocking(true, ignored);  // write() sends at once what the socket takes
  if (reject) {
    keep_alive_ = false;
    exchange_done_ = false;
    phase_ = Phase::busy;
    respond_error({ErrorKind::unavailable, "too many connections (proxy.limits.max_connections)", 1});
    return;
  }
  sock_.set_option(tcp::no_delay(true), ignored);
  if (trace::on()) trace_port_ = sock_.remote_endpoint(ignored).port();
  do_read_header();
}

void Session::close() {
  if (phase_ == Phase::closed) return;
  phase_ = Phase::closed;
  if (job_ && !core_alive_.expired()) core_.scheduler.cancel(job_);
  job_.reset();
  if (!core_alive_.expired()) forget_store();
  timer_.cancel();
  boost::system::error_code ignored;
  sock_.shutdown(tcp::socket::shutdown_both, ignored);
  sock_.close(ignored);
}

// ---- after a supervisor restart ----

bool Session::recover(std::unique_ptr<ConnJournal> journal, std::string store_name, const JournalState& st,
                      uint64_t read, uint64_t written, std::string* why, bool* mid_answer) {
  auto fail = [why](std::string w) {
    *why = std::move(w);
    return false;
  };
  journal_ = std::move(journal);
  store_name_ = std::move(store_name);
  core_.sessions[this] = weak_from_this();
  boost::system::error_code ignored;
  sock_.non_blocking(true, ignored);
  sock_.set_option(tcp::no_delay(true), ignored);
  if (read < st.read_total() && st.read_total() - read <= st.input.size() && st.read_total() - read <= (1u << 20)) {
    // Killed between a read's record and its take: the journal's last bytes
    // are still in the socket. They are taken now (the journal has them).
    const size_t extra = size_t(st.read_total() - read);
    std::string queued(extra, '\0');
    const ssize_t took = ::recv(sock_.native_handle(), queued.data(), extra, MSG_DONTWAIT);
    if (took == ssize_t(extra) && st.input.compare(st.input.size() - extra, extra, queued) == 0) read += extra;
  }
  if (read != st.read_total())
    return fail("the socket gave " + std::to_string(read) + " bytes, the journal holds " +
                std::to_string(st.read_total()) + " (a read the kill cut before its record)");
  const std::string out = st.output();
  if (written < st.written_at_base || written - st.written_at_base > out.size())
    return fail("the socket took " + std::to_string(written) + " bytes, the journal's exchange began at " +
                std::to_string(st.written_at_base) + " and wrote " + std::to_string(out.size()));
  const size_t delivered = size_t(written - st.written_at_base);
  read_total_ = read;
  written_total_ = written;
  buf_.commit(asio::buffer_copy(buf_.prepare(st.input.size()), asio::buffer(st.input)));
  phase_ = Phase::busy;
  exchange_done_ = false;
  std::string rest = out.substr(delivered);  // journaled already: sent as it is

  const JournalStep* request = nullptr;
  for (const JournalStep& s : st.steps)
    if (s.kind == JournalStep::Kind::request) request = &s;
  if (!st.steps.empty() && st.steps.back().exchange_done) {  // answered; some bytes may still be due
    keep_alive_ = st.steps.back().keep_alive;
    // What follows the request in the buffer is the next one's.
    if (keep_alive_ && !parse_buffered_request()) return fail("its answered request does not parse again");
    exchange_done_ = true;
    *mid_answer = !rest.empty();
    send(std::move(rest));
    if (!output_pending()) after_exchange();
    return true;
  }
  if (!request) {  // the request was being read or planned: read or plan it again
    continue_sent_ = !out.empty();
    send(std::move(rest));
    do_read_header();
    return true;
  }

  // Planned, answer under way: plan it again with the choices the journal
  // kept, replay its tokens with nothing sent, then send what the client has
  // not had and let the job go on from its last token.
  const std::optional<JournalRequest> jr = decode_request(request->event);
  if (!jr) return fail("its request step does not decode");
  if (jr->forward) {
    bool answered = false;  // the head, a waiting notice or the engine's stream went out
    for (const JournalStep& s : st.steps)
      if (&s >= request && !s.output.empty()) answered = true;
    if (answered) {
      *mid_answer = true;
      return recover_forward(st, request, std::move(rest), why);
    }
    // Nothing of it went out: it is read and forwarded again (as an exec
    // engine's, Proxy::set_exec_engines, though no engine is back yet).
    continue_sent_ = !out.empty();
    send(std::move(rest));
    do_read_header();
    return true;
  }
  *mid_answer = true;
  std::optional<Route> again = route_again(jr->seed);
  if (!again) return fail("its request does not parse again");
  Route& r = *again;
  if (!r.plan) return fail("its request no longer plans to an answer");
  api_ = r.api;
  r.plan->gen.max_tokens = jr->max_tokens;
  r.plan->gen.sampling.seed = jr->seed;
  replayed_ = jr;
  replaying_ = true;
  start_job(std::move(*r.plan));
  replayed_.reset();
  bool more = true;
  for (const JournalStep& s : st.steps) {
    if (&s <= request) continue;
    if (s.kind == JournalStep::Kind::token) {
      const std::optional<proto::TokenEvent> e = decode_token(s.event);
      if (!e || !job_) {
        replaying_ = false;
        return fail("a token step does not decode or follows the end");
      }
      job_->gen.generated.push_back(e->token);
      more = on_token(*e);
    } else if (s.kind == JournalStep::Kind::done) {
      const std::optional<JobResult> res = decode_result(s.event);
      if (!res) {
        replaying_ = false;
        return fail("a done step does not decode");
      }
      on_done(*res);
      more = job_ != nullptr;
    }
  }
  replaying_ = false;
  send(std::move(rest));
  arm(core_.cfg.limits.request_timeout);
  if (exchange_done_) {  // a thought closed with no room left: the answer ended in the replay
    if (!output_pending()) after_exchange();
    return true;
  }
  if (!more) {  // the last token ended the answer; its end was not journaled
    JobResult end;
    end.reason = "stop";
    on_done(end);
    return true;
  }
  resubmit();
  return true;
}

void Session::resubmit() {
  if (!core_.scheduler.submit(job_)) {
    job_.reset();
    return respond_error({ErrorKind::unavailable, "the queue is full (proxy.queue.max_waiting); retry later", 2});
  }
  watch();
}

bool Session::recover_forward(const JournalState& st, const JournalStep* request, std::string rest, std::string* why) {
  auto fail = [this, why](std::string w) {
    *why = std::move(w);
    job_.reset();
    return false;
  };
  std::optional<Route> again = route_again(0);
  if (!again) return fail("its request does not parse again");
  Route& r = *again;
  if (!r.forward) return fail("its request no longer goes to an exec engine");
  if (!r.forward->stream) return fail("its answer is not a stream, yet bytes of it went out");
  api_ = r.api;
  std::vector<EngineOp> ops;
  for (const JournalStep& s : st.steps) {
    if (&s <= request || s.kind != JournalStep::Kind::engine) continue;
    std::optional<EngineOp> op = decode_engine_op(s.event);
    if (!op) return fail("an engine step does not decode");
    ops.push_back(std::move(*op));
  }
  forwarding_ = true;
  stream_ = true;
  head_sent_ = true;  // a forwarded stream's first output is its head
  engine_status_ = 0;
  engine_type_.clear();
  engine_body_.clear();
  job_ = std::make_shared<Job>();
  job_->forward = std::make_shared<const EngineRequest>(std::move(*r.forward));
  job_->sink = this;
  job_->endpoint = target_;
  if (std::string err = Scheduler::restore(*job_, ops); !err.empty()) return fail(std::move(err));
  send(std::move(rest));
  arm(core_.cfg.limits.request_timeout);
  if (Scheduler::whole(*job_)) {  // only the stream's end was missing
    Scheduler::end_restored(*job_);
    return true;
  }
  log::info("an exec engine's answer cut by the supervisor's restart goes on from the journaled stream (" +
                std::to_string(job_->resumable ? job_->resumable->generated().size() : 0) + " tokens out)",
            {{"DS4_EVENT", "answer_restored"}, {"DS4_CONNECTION", store_name_}});
  resubmit();
  return true;
}

void Session::on_engine_op(const EngineOp& op, const std::function<void()>& apply) {
  Step step(*this, JournalStep::Kind::engine, journal_ ? encode_engine_op(op) : std::string());
  apply();
}

std::optional<Route> Session::route_again(uint64_t seed) {
  if (!parse_buffered_request()) return std::nullopt;
  const HttpRequest& req = parser_->get();
  target_ = std::string(req.method_string()) + " " + std::string(req.target().substr(0, 200));
  keep_alive_ = req.keep_alive();
  received_ = std::chrono::steady_clock::now();
  RouteContext ctx = core_.route_context();
  ctx.limits.context = 0;  // the workers may not be back yet; the journal has the room it left
  ctx.limits.random_seed = seed;
  return route(req, ctx);
}

bool Session::parse_buffered_request() {
  parser_.emplace();
  parser_->header_limit(uint32_t(std::min<Bytes>(core_.cfg.limits.max_header_bytes, UINT32_MAX)));
  parser_->body_limit(core_.cfg.limits.max_body_bytes);
  parser_->eager(true);
  boost::system::error_code ec;
  while (!ec && !parser_->is_done() && buf_.size() > 0) buf_.consume(parser_->put(buf_.data(), ec));
  return !ec && parser_->is_done();
}

// ---- reading a request ----

void Session::do_read_header() {
  phase_ = Phase::header;
  const LimitsConfig& lim = core_.cfg.limits;
  parser_.emplace();
  parser_->header_limit(uint32_t(std::min<Bytes>(lim.max_header_bytes, UINT32_MAX)));
  parser_->body_limit(lim.max_body_bytes);
  arm(lim.header_timeout);
  if (buf_.size() > 0) {  // the watch read it already: parse it here, with no round through the io_context
    boost::system::error_code ec;
    parser_->eager(false);  // the header alone, as async_read_header
    buf_.consume(parser_->put(buf_.data(), ec));
    if (ec != http::error::need_more && (ec || parser_->is_header_done())) return on_header(ec);
  }
  http::async_read_header(reader_, buf_, *parser_, [self = shared_from_this()](const boost::system::error_code& ec, size_t) {
    self->on_header(ec);
  });
}

void Session::on_header(const boost::system::error_code& ec) {
  if (phase_ == Phase::closed) return;
  exchange_done_ = false;
  phase_ = Phase::busy;
  keep_alive_ = false;  // until the request says otherwise
  if (ec == http::error::end_of_stream || ec == asio::error::eof || ec == asio::error::operation_aborted ||
      ec == asio::error::connection_reset)
    return close();
  // The path decides the error shape; a header too large or malformed has none.
  const auto target = parser_->get().target();
  api_ = !ec || ec == http::error::body_limit ? api_of(std::string_view(target.data(), target.size())) : Api::openai;
  if (ec == http::error::header_limit)  // a long URL too: the request line is in the limit
    return respond_error({ErrorKind::headers_too_large, "the request line and headers are larger than " +
                                                    format_size(core_.cfg.limits.max_header_bytes) +
                                                    " (proxy.limits.max_header_bytes)"});
  if (ec == http::error::body_limit)  // Content-Length over the limit, seen with the headers
    return respond_error({ErrorKind::too_large, "the request body is larger than " +
                                                    format_size(core_.cfg.limits.max_body_bytes) +
                                                    " (proxy.limits.max_body_bytes)"});
  if (ec) return respond_error(bad_request("malformed HTTP request: " + ec.message()));
  auto& req = parser_->get();
  if (auto len = parser_->content_length(); len && *len > core_.cfg.limits.max_body_bytes)
    return respond_error({ErrorKind::too_large, "the request body has " + std::to_string(*len) +
                                                    " bytes, more than " + format_size(core_.cfg.limits.max_body_bytes) +
                                                    " (proxy.limits.max_body_bytes)"});
  auto expect = req.find(http::field::expect);
  if (expect != req.end() && beast::iequals(expect->value(), "100-continue") && !continue_sent_)
    write("HTTP/1.1 100 Continue\r\n\r\n");
  continue_sent_ = false;
  phase_ = Phase::body;
  arm(core_.cfg.limits.body_timeout);
  if (!parser_->is_done() && buf_.size() > 0) {  // the body came with the header
    boost::system::error_code ec;
    parser_->eager(true);
    buf_.consume(parser_->put(buf_.data(), ec));
    if (ec && ec != http::error::need_more) return on_body(ec);
  }
  if (parser_->is_done()) return on_body({});
  http::async_read(reader_, buf_, *parser_, [self = shared_from_this()](const boost::system::error_code& ec, size_t) {
    self->on_body(ec);
  });
}

void Session::on_body(const boost::system::error_code& ec) {
  if (phase_ != Phase::body) return;  // closed, or the body's time ran out (on_deadline answered)
  phase_ = Phase::busy;
  if (ec == http::error::body_limit)
    return respond_error({ErrorKind::too_large, "the request body is larger than " +
                                                    format_size(core_.cfg.limits.max_body_bytes) +
                                                    " (proxy.limits.max_body_bytes)"});
  if (ec == http::error::partial_message || ec == asio::error::eof || ec == asio::error::connection_reset ||
      ec == asio::error::operation_aborted)
    return close();  // the client went away mid-body: nobody to answer
  if (ec) return respond_error(bad_request("malformed HTTP request body: " + ec.message()));
  arm(core_.cfg.limits.request_timeout);
  handle();
}

// A body this long is parsed and tokenized on the planner's threads.
constexpr size_t kPlanAsideBytes = 16 * 1024;
// After planning a body this long, freed heap goes back to the system.
constexpr size_t kTrimAfterBytes = 1024 * 1024;

void Session::handle() {
  if (trace::on()) trace_received_ = trace::now_ns();
  received_ = std::chrono::steady_clock::now();
  const HttpRequest& req = parser_->get();
  target_ = std::string(req.method_string()) + " " + std::string(req.target().substr(0, 200));
  keep_alive_ = req.keep_alive() && !core_.stopping;
  const RouteContext ctx = core_.route_context();
  // Only generation requests (POST) are worth it; the reads (health,
  // metrics, status) need the io thread's registry and come without a body.
  if (req.body().size() >= kPlanAsideBytes && req.method() == http::verb::post) return plan_aside(ctx);
  routed(route(req, ctx), req.method() == http::verb::head);
}

// route() on the planner: the request and the keys go along (the session may
// end meanwhile, the keys be reloaded); what comes back is dropped when the
// session or the proxy is gone by then.
void Session::plan_aside(const RouteContext& ctx) {
  auto req = std::make_shared<HttpRequest>(std::move(parser_->get()));
  const bool head = req->method() == http::verb::head;
  RouteContext aside = ctx;
  aside.workers = nullptr;  // read only for /health and /metrics, which come with no body
  aside.metrics = nullptr;
  aside.status = nullptr;
  ++core_.planning;
  asio::post(core_.planner, [req, aside, keys = core_.keys, core = &core_, w = weak_from_this(), alive = core_alive_,
                             head]() mutable {
    auto r = std::make_shared<Route>(route(*req, aside));
    // glibc keeps what a large body and its JSON tree freed: the supervisor's
    // RSS stayed ~150 MB up after a few 15 MB requests, memory the workers'
    // headroom is measured against. Hand it back.
    const bool large = req->body().size() >= kTrimAfterBytes;
    req.reset();
    if (large) ::malloc_trim(0);
    asio::post(core->io, [core, w, alive, r, head] {
      if (alive.expired()) return;
      --core->planning;
      auto s = w.lock();
      if (s && s->phase_ != Phase::closed) s->routed(std::move(*r), head);
    });
  });
  watch();  // meanwhile: the read that notices a client gone, and holds the session
}

void Session::routed(Route r, bool head) {
  api_ = r.api;
  if (r.response) {
    r.response->head_only = head;
    return respond(*r.response);
  }
  if (r.forward) return start_forward(std::move(*r.forward));
  start_job(std::move(*r.plan));
}

// ---- running a job ----

void Session::start_job(Plan plan) {
  JournalRequest jr;
  if (replayed_) {
    jr = *replayed_;
  } else {
    const Endpoint ep = plan.endpoint;
    const char* prefix = ep == Endpoint::messages    ? "msg_"
                         : ep == Endpoint::chat      ? "chatcmpl-"
                         : ep == Endpoint::responses ? "resp_"
                                                     : "cmpl-";
    jr.id = core_.new_id(prefix);
    jr.created = int64_t(std::time(nullptr));
    jr.seed = plan.gen.sampling.seed;
    jr.max_tokens = plan.gen.max_tokens;
  }
  Step step(*this, JournalStep::Kind::request, encode_request(jr));
  plan_ = std::move(plan);
  stream_ = plan_->stream;
  head_sent_ = false;
  text_.emplace(plan_->stop);
  answer_.emplace(*plan_);
  answer_text_.clear();
  answer_calls_ = json::array();
  thought_tokens_ = earlier_tokens_ = 0;
  closing_thought_ = false;
  pending_tokens_.clear();
  response_id_ = jr.id;
  responder_ = make_responder(*plan_, core_.model.tokenizer(), response_id_, jr.created);
  job_ = std::make_shared<Job>();
  job_->gen = plan_->gen;
  job_->sink = this;
  job_->trace_received = trace_received_;
  job_->trace_port = trace_port_;
  job_->endpoint = target_;
  if (!replaying_) core_.metrics.add_tokens_in(int64_t(plan_->gen.prompt.size()));
  if (!submit(job_)) {
    job_.reset();
    return respond_error({ErrorKind::unavailable,
                          "the queue is full (" + std::to_string(core_.cfg.queue.max_waiting) +
                              " requests waiting, proxy.queue.max_waiting); retry later", 2});
  }
  if (exchange_done_) return;  // finished already (nothing could ever serve it)
  if (stream_) send_head();
  watch();
}

// ---- forwarding to an exec engine ----

void Session::start_forward(EngineRequest f) {
  JournalRequest jr;
  jr.forward = true;
  Step step(*this, JournalStep::Kind::request, encode_request(jr));
  forwarding_ = true;
  stream_ = f.stream;
  head_sent_ = false;
  engine_status_ = 0;
  engine_type_.clear();
  engine_body_.clear();
  job_ = std::make_shared<Job>();
  job_->forward = std::make_shared<const EngineRequest>(std::move(f));
  job_->sink = this;
  job_->endpoint = target_;
  if (!submit(job_)) {
    job_.reset();
    return respond_error({ErrorKind::unavailable,
                          "the queue is full (" + std::to_string(core_.cfg.queue.max_waiting) +
                              " requests waiting, proxy.queue.max_waiting); retry later", 2});
  }
  if (exchange_done_) return;
  watch();
}

void Session::on_engine_head(int status, const std::string& content_type, bool streaming) {
  if (streaming) return send_head(content_type.empty() ? "text/event-stream" : content_type);  // its events follow as they are
  engine_status_ = status;
  engine_type_ = content_type.empty() ? "application/json" : content_type;
}

void Session::on_engine_data(std::string_view bytes) {
  if (engine_status_ == 0) chunk(std::string(bytes));
  else engine_body_.append(bytes);
}

void Session::end_forward(const JobResult& r) {
  job_.reset();
  if (!r.ok) {
    if (!head_sent_) return respond_error(r.error);
    core_.metrics.count(status_of(r.error.kind));
    chunk(sse_error_event(api_, error_body(api_, r.error)));
    keep_alive_ = false;
    return end_exchange();
  }
  if (!engine_status_ || engine_status_ == 200)
    core_.metrics.observe_answer(std::chrono::duration<double>(std::chrono::steady_clock::now() - received_).count());
  if (!head_sent_) {
    Response resp;
    resp.status = engine_status_ ? engine_status_ : 200;
    resp.content_type = engine_type_;
    resp.body = std::move(engine_body_);
    return respond(resp);
  }
  // A stream: the engine's events went through; or our head went out while
  // the request waited and the engine answered something else than a stream
  // (an error): that comes as the stream's error event.
  if (engine_status_ != 0 && engine_status_ != 200) chunk(sse_error_event(api_, engine_body_));
  else if (engine_status_ == 200) chunk(std::move(engine_body_));
  core_.metrics.count(engine_status_ && engine_status_ != 200 ? engine_status_ : 200);
  end_exchange();
}

void Session::on_waiting(int64_t position) {
  if (!stream_ || exchange_done_) return;
  send_head();
  chunk(waiting_comment(position));
}

bool Session::on_token(const proto::TokenEvent& e) {
  Step step(*this, JournalStep::Kind::token, journal_ ? encode_token(e) : std::string());
  const Tokenizer& tok = core_.model.tokenizer();
  if (tok.is_eog(e.token)) return false;
  if (!replaying_) core_.metrics.add_tokens_out(1);
  if (plan_->logprobs) pending_tokens_.push_back({e.token, e.logprob, e.top});
  std::string piece = tok.piece(e.token);
  if (piece.empty() && plan_->read_answer) piece = core_.model.marker_text(e.token);  // a call marker, <think>
  const bool thinking = answer_->in_thought();
  TextStream::Out out = text_->push(piece);
  if (!out.text.empty() || out.stopped) {
    if (!plan_->read_answer) {  // completions: the text as it comes, with its tokens
      std::string bytes = responder_->text(out.text, std::move(pending_tokens_));
      pending_tokens_.clear();
      if (stream_) chunk(bytes);
    } else {
      emit(answer_->push(out.text));
    }
  }
  if (thinking && plan_->thinking_budget > 0 && ++thought_tokens_ >= plan_->thinking_budget && answer_->in_thought() &&
      !out.stopped) {
    closing_thought_ = true;
    return false;
  }
  return !out.stopped;
}

void Session::emit(std::vector<AnswerEvent> events) {
  std::string bytes;
  for (AnswerEvent& ev : events) {
    switch (ev.kind) {
      case AnswerEvent::Kind::content:
        bytes += responder_->text(ev.text, std::move(pending_tokens_));
        pending_tokens_.clear();
        answer_text_ += ev.text;
        break;
      case AnswerEvent::Kind::reasoning:
        bytes += responder_->reasoning(ev.text);
        break;
      case AnswerEvent::Kind::call: {
        const std::string id = core_.new_id(plan_->endpoint == Endpoint::messages ? "toolu_" : "call_");
        bytes += responder_->tool_call(id, ev.call);
        json args = json::parse(ev.call.arguments, nullptr, false);
        answer_calls_.push_back({{"id", id},
                                 {"type", "function"},
                                 {"function", {{"name", ev.call.name}, {"arguments", args.is_object() ? args : json::object()}}}});
        break;
      }
    }
  }
  if (stream_) chunk(bytes);
}

bool Session::close_thought(const Job& done) {
  const std::string close = "</think>\n\n";
  emit(answer_->push(text_->flush()));
  emit(answer_->push(close));
  earlier_tokens_ += int64_t(done.gen.generated.size());
  const int32_t left = done.gen.max_tokens - int32_t(done.gen.generated.size());
  std::vector<int32_t> tail = core_.model.encode(close, false);
  if (left <= int32_t(tail.size())) return false;
  job_ = std::make_shared<Job>();
  job_->gen = done.gen;
  job_->gen.prompt.insert(job_->gen.prompt.end(), done.gen.generated.begin(), done.gen.generated.end());
  job_->gen.prompt.insert(job_->gen.prompt.end(), tail.begin(), tail.end());
  job_->gen.generated.clear();
  job_->gen.max_tokens = left - int32_t(tail.size());
  job_->sink = this;
  job_->endpoint = target_;
  if (!submit(job_)) {
    job_.reset();
    return false;
  }
  return true;
}

void Session::on_done(const JobResult& r) {
  Step step(*this, JournalStep::Kind::done, journal_ ? encode_result(r) : std::string());
  if (forwarding_) return end_forward(r);
  std::shared_ptr<Job> job = std::move(job_);
  if (!r.ok) {
    if (head_sent_) {
      core_.metrics.count(status_of(r.error.kind));
      chunk(responder_->stream_error(r.error));
      keep_alive_ = false;
      return end_exchange();
    }
    return respond_error(r.error);
  }
  if (closing_thought_) {  // the thinking budget is spent: on after </think>
    closing_thought_ = false;
    if (close_thought(*job)) return;
    earlier_tokens_ -= int64_t(job->gen.generated.size());  // no room left: the answer ends here
  }
  std::string rest = text_->flush();
  if (plan_->read_answer) {
    std::vector<AnswerEvent> events = answer_->push(rest);
    for (AnswerEvent& e : answer_->finish()) events.push_back(std::move(e));
    emit(std::move(events));
    rest.clear();
  }
  if (!rest.empty() || !pending_tokens_.empty()) {
    std::string bytes = responder_->text(rest, std::move(pending_tokens_));
    pending_tokens_.clear();
    if (stream_) chunk(bytes);
  }
  Finish f;
  f.reason = !text_->matched().empty() ? FinishReason::stop_sequence
             : r.reason == "length"    ? FinishReason::length
             : answer_->calls() > 0    ? FinishReason::tool_calls
                                       : FinishReason::stop;
  f.stop_sequence = text_->matched();
  f.prompt_tokens = int64_t(plan_->gen.prompt.size());
  f.completion_tokens = earlier_tokens_ + int64_t(job->gen.generated.size());
  f.timings = r.timings;
  core_.metrics.add_tokens_cached(r.timings.cache_n);
  core_.metrics.observe_answer(std::chrono::duration<double>(std::chrono::steady_clock::now() - received_).count());
  if (plan_->endpoint == Endpoint::responses && plan_->store) {  // for a later previous_response_id
    json conversation = plan_->conversation;
    json said = {{"role", "assistant"}, {"content", answer_text_}};
    if (!answer_calls_.empty()) said["tool_calls"] = answer_calls_;
    conversation.push_back(std::move(said));
    core_.responses.put(response_id_, std::move(conversation));
  }
  if (!stream_) {
    Response resp;
    resp.body = responder_->finish(f);
    return respond(resp);
  }
  send_head();
  chunk(responder_->finish(f));
  core_.metrics.count(200);
  end_exchange();
}

// ---- writing ----

void RefusalLog::note(int status, std::string_view endpoint, std::string_view reason) {
  const auto now = std::chrono::steady_clock::now();
  if (now - second >= std::chrono::seconds(1)) {
    second = now;
    written = 0;
  }
  if (written >= kPerSecond) {
    ++left_out;
    return;
  }
  ++written;
  const std::string status_s = std::to_string(status);
  std::string message = "refused " + std::string(endpoint) + ": " + status_s + " " + std::string(reason);
  if (left_out > 0) message += " (" + std::to_string(left_out) + " more refused before, not logged)";
  left_out = 0;
  log::warn(message, {{"DS4_EVENT", "refused"}, {"DS4_STATUS", status_s}, {"DS4_ENDPOINT", endpoint}, {"DS4_REASON", reason}});
}

namespace {

// The message of an error body in either protocol's shape.
std::string error_message(const std::string& body) {
  json j = json::parse(body, nullptr, false);
  if (j.is_object() && j.contains("error") && j["error"].is_object() && j["error"].contains("message") &&
      j["error"]["message"].is_string())
    return j["error"]["message"].get<std::string>().substr(0, 500);
  return {};
}

}  // namespace

void Session::respond(const Response& r) {
  Step step(*this, JournalStep::Kind::output);
  core_.metrics.count(r.status);
  if (r.status >= 400)
    core_.refusals.note(r.status, target_.empty() ? "(before the request line was read)" : target_, error_message(r.body));
  // A body not read (413) leaves the stream unusable.
  if (r.status == 413 || (parser_ && !parser_->is_done())) keep_alive_ = false;
  write(serialize(r, keep_alive_));
  exchange_done_ = true;
  if (!output_pending()) after_exchange();
}

void Session::send_head(std::string_view content_type) {
  if (head_sent_) return;
  head_sent_ = true;
  write("HTTP/1.1 200 OK\r\nContent-Type: " + std::string(content_type) + "\r\nCache-Control: no-cache\r\n" +
        (keep_alive_ ? "Connection: keep-alive\r\n" : "Connection: close\r\n") +
        "X-Accel-Buffering: no\r\nTransfer-Encoding: chunked\r\n\r\n");
  if (responder_) chunk(responder_->open());
}

void Session::chunk(const std::string& bytes) {
  if (bytes.empty()) return;
  char size[24];
  std::snprintf(size, sizeof size, "%zx\r\n", bytes.size());
  write(size + bytes + "\r\n");
}

void Session::end_exchange() {
  Step step(*this, JournalStep::Kind::output);
  write("0\r\n\r\n");
  exchange_done_ = true;
  if (!output_pending()) after_exchange();
}

void Session::write(std::string bytes) {
  if (phase_ == Phase::closed || replaying_) return;
  if (step_depth_ > 0) {
    step_.output += bytes;
    return;
  }
  if (journal_ && journal_->ok()) {
    Step step(*this, JournalStep::Kind::output);  // journaled alone, then sent
    step_.output += bytes;
    return;
  }
  send(std::move(bytes));
}

void Session::send(std::string bytes) {
  if (phase_ == Phase::closed || bytes.empty()) return;
  written_total_ += bytes.size();
  if (!writing_ && out_.empty()) {  // the socket usually takes it all at once: no completion to wait for
    boost::system::error_code ec;
    const size_t n = sock_.write_some(asio::buffer(bytes), ec);
    if (!ec && n == bytes.size()) return;
    bytes.erase(0, n);  // the rest, or an error, goes the asynchronous way
  }
  out_.push_back(std::move(bytes));
  if (!writing_) do_write();
}

void Session::do_write() {
  if (out_.empty()) {
    writing_ = false;
    if (exchange_done_) after_exchange();
    return;
  }
  writing_ = true;
  asio::async_write(sock_, asio::buffer(out_.front()), [self = shared_from_this()](const boost::system::error_code& ec, size_t) {
    if (self->phase_ == Phase::closed) return;
    if (ec) return self->close();
    self->out_.pop_front();
    self->do_write();
  });
}

void Session::after_exchange() {
  if (replaying_ || phase_ == Phase::closed || phase_ == Phase::idle || phase_ == Phase::header) return;
  // The answer is all written: the journal starts the next exchange with
  // what was read ahead of it.
  if (journal_ && keep_alive_) journal_->base(read_total_, written_total_, {static_cast<const char*>(buf_.data().data()), buf_.size()});
  plan_.reset();
  forwarding_ = false;
  engine_body_.clear();
  responder_.reset();
  text_.reset();
  job_.reset();
  if (!keep_alive_) return linger_close();
  if (watching_) {  // the pending read delivers the next request
    phase_ = Phase::idle;
    arm(core_.cfg.limits.header_timeout);
    // A request pipelined behind this one is in the buffer already: end the
    // read (it owns the buffer's free space), its handler parses the request.
    if (buf_.size() > 0) {
      boost::system::error_code ignored;
      sock_.cancel(ignored);
    }
    return;
  }
  if (buf_.size() > 0) {  // a pipelined request: parsed on a fresh stack, so that a long pipeline never nests
    phase_ = Phase::idle;
    asio::post(sock_.get_executor(), [self = shared_from_this()] {
      if (self->phase_ == Phase::idle) self->do_read_header();
    });
    return;
  }
  do_read_header();
}

// Closing with unread input makes the kernel send RST, which can destroy the
// answer before the client reads it: send FIN, drain for a moment, then close.
void Session::linger_close() {
  phase_ = Phase::closed;
  forget_store();
  if (job_) {
    core_.scheduler.cancel(job_);
    job_.reset();
  }
  boost::system::error_code ignored;
  sock_.shutdown(tcp::socket::shutdown_send, ignored);
  timer_.expires_after(std::chrono::seconds(2));
  timer_.async_wait([self = shared_from_this()](const boost::system::error_code&) {
    boost::system::error_code ignored;
    self->sock_.close(ignored);
  });
  drain();
}

void Session::drain() {
  if (watching_) return;  // the pending read goes on draining below
  watching_ = true;
  buf_.clear();
  sock_.async_read_some(buf_.prepare(65536), [self = shared_from_this()](const boost::system::error_code& ec, size_t) {
    self->watching_ = false;
    if (ec) {
      self->timer_.cancel();
      boost::system::error_code ignored;
      self->sock_.close(ignored);
      return;
    }
    self->drain();
  });
}

// While a job runs (and after, until the next request), read whatever comes:
// an error or EOF means the client went away.
void Session::watch() {
  if (watching_ || phase_ == Phase::closed) return;
  if (buf_.size() >= core_.cfg.limits.max_header_bytes) return;  // pipelined too far ahead: stop reading
  watching_ = true;
  reader_.async_read_some(buf_.prepare(4096), [self = shared_from_this()](const boost::system::error_code& ec, size_t n) {
    self->watching_ = false;
    if (self->phase_ == Phase::closed) {
      if (!ec) self->drain();  // lingering: keep discarding
      return;
    }
    if (ec == asio::error::operation_aborted && self->phase_ == Phase::idle) return self->do_read_header();
    if (ec) return self->close();  // cancels the job
    self->buf_.commit(n);
    if (self->phase_ == Phase::idle) return self->do_read_header();
    self->watch();
  });
}

// ---- time limits ----

// One timer for the session's successive limits: a later deadline leaves
// the pending wait alone (it wakes at its time and waits on), only an
// earlier one re-arms it.
void Session::arm(Duration d) {
  deadline_ = std::chrono::steady_clock::now() + d;
  if (!timer_waiting_ || timer_.expiry() > deadline_) wait_deadline();
}

void Session::wait_deadline() {
  timer_waiting_ = true;
  timer_.expires_at(deadline_);  // a wait pending before ends with operation_aborted
  timer_.async_wait([w = weak_from_this()](const boost::system::error_code& ec) {
    auto self = w.lock();
    if (ec || !self || self->phase_ == Phase::closed) return;
    self->timer_waiting_ = false;
    if (std::chrono::steady_clock::now() < self->deadline_) return self->wait_deadline();
    self->on_deadline();
  });
}

void Session::on_deadline() {
  if (phase_ == Phase::closed) return;
  if (phase_ == Phase::body) {  // headers in, body late: answer 408 and stop reading it
    boost::system::error_code ignored;
    sock_.cancel(ignored);  // the body's read ends (on_body ignores it) before drain() reads again
    phase_ = Phase::busy;
    return respond_error({ErrorKind::request_timeout, "the request body did not arrive within " +
                                                          format_duration(core_.cfg.limits.body_timeout) +
                                                          " (proxy.limits.body_timeout)"});
  }
  if (phase_ == Phase::busy && !exchange_done_ && !head_sent_ && job_) {
    core_.scheduler.cancel(job_);
    job_.reset();
    keep_alive_ = false;
    return respond_error({ErrorKind::timeout, "the request took longer than " +
                                                  format_duration(core_.cfg.limits.request_timeout) +
                                                  " (proxy.limits.request_timeout)"});
  }
  close();  // slow headers or body, an idle keep-alive connection, or a stream past its time
}

}  // namespace ds4::proxy
