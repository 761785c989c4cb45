// Forwarding to exec engines (workers.engine: exec) through the Scheduler,
// against a scripted HTTP server on a real loopback socket: answers pass
// through, a request whose engine fails before the first byte is replayed on
// another worker, one cut after its first byte ends in an error.
#include <utility>  // before Asio: Boost 1.74's awaitable.hpp needs std::exchange

#include <doctest/doctest.h>

#include <boost/asio.hpp>

#include "supervisor/proxy/api_response.h"
#include "supervisor/proxy/router.h"
#include "supervisor/proxy/scheduler.h"
#include "tests/unit/fake_registry.h"

using namespace ds4::proxy;
using ds4::sup::WorkerState;
using ds4::test::FakeRegistry;
namespace asio = boost::asio;
using tcp = asio::ip::tcp;

namespace {

/// Reads one request per connection, records it, writes `reply`, closes.
struct ScriptedEngine {
  ScriptedEngine(asio::io_context& io, std::string reply) : acceptor(io, {asio::ip::address_v4::loopback(), 0}), reply(std::move(reply)) {
    accept();
  }
  int port() const { return acceptor.local_endpoint().port(); }
  void accept() {
    acceptor.async_accept([this](boost::system::error_code ec, tcp::socket s) {
      if (ec) return;
      auto sock = std::make_shared<tcp::socket>(std::move(s));
      auto buf = std::make_shared<std::string>();
      asio::async_read_until(*sock, asio::dynamic_buffer(*buf), "\r\n\r\n", [this, sock, buf](boost::system::error_code ec, size_t n) {
        if (ec) return;
        const size_t cl = buf->find("Content-Length: ");
        const size_t len = cl == std::string::npos ? 0 : std::stoul(buf->substr(cl + 16));
        const size_t want = n + len;
        asio::async_read(*sock, asio::dynamic_buffer(*buf), asio::transfer_exactly(want > buf->size() ? want - buf->size() : 0),
                         [this, sock, buf](boost::system::error_code, size_t) {
                           requests.push_back(*buf);
                           asio::async_write(*sock, asio::buffer(reply), [sock](boost::system::error_code, size_t) {
                             boost::system::error_code ignored;
                             sock->shutdown(tcp::socket::shutdown_both, ignored);
                             sock->close(ignored);
                           });
                         });
      });
      accept();
    });
  }
  tcp::acceptor acceptor;
  std::string reply;
  std::vector<std::string> requests;
};

struct ForwardSink : JobSink {
  int status = 0;
  bool streaming = false;
  std::string bytes;
  std::optional<JobResult> done;
  void on_waiting(int64_t) override {}
  bool on_token(const ds4::proto::TokenEvent&) override { return true; }
  void on_done(const JobResult& r) override { done = r; }
  void on_engine_head(int s, const std::string&, bool st) override { status = s, streaming = st; }
  void on_engine_data(std::string_view b) override { bytes.append(b); }
};

std::shared_ptr<Job> forward_job(ForwardSink& sink, bool stream, std::string body = R"({"model":"m","messages":[]})") {
  auto j = std::make_shared<Job>();
  EngineRequest r;
  r.target = "/v1/chat/completions?x=1";
  r.body = std::move(body);
  r.stream = stream;
  j->forward = std::make_shared<const EngineRequest>(r);
  j->sink = &sink;
  return j;
}

void run_until(asio::io_context& io, const std::function<bool()>& done) {
  for (int i = 0; i < 200 && !done(); ++i) io.run_for(std::chrono::milliseconds(10));
}

ds4::sup::WorkerInfo engine_worker(int id, int port) {
  ds4::sup::WorkerInfo w;
  w.id = id;
  w.state = WorkerState::ready;
  w.http_port = port;
  w.context = 512;
  w.slots = 1;
  w.generation = 1;
  return w;
}

const std::string kSseHead = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n";

std::string chunk(const std::string& s) {
  char n[16];
  std::snprintf(n, sizeof n, "%zx\r\n", s.size());
  return n + s + "\r\n";
}

}  // namespace

TEST_CASE("exec engine: a whole answer comes back as the engine sent it; the request goes as it came") {
  asio::io_context io;
  ScriptedEngine engine(io, "HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{\"e\":\"bad\"}");
  FakeRegistry reg;
  reg.list = {engine_worker(0, engine.port())};
  Scheduler s(io, reg, {});
  ForwardSink sink;
  auto j = forward_job(sink, false);
  REQUIRE(s.submit(j));
  run_until(io, [&] { return sink.done.has_value(); });
  REQUIRE(sink.done);
  CHECK(sink.done->ok);
  CHECK(sink.status == 400);
  CHECK_FALSE(sink.streaming);
  CHECK(sink.bytes == "{\"e\":\"bad\"}");
  REQUIRE(engine.requests.size() == 1);
  CHECK(engine.requests[0].starts_with("POST /v1/chat/completions?x=1 HTTP/1.1\r\n"));
  CHECK(engine.requests[0].ends_with("\r\n\r\n{\"model\":\"m\",\"messages\":[]}"));
  CHECK(s.running() == 0);
}

TEST_CASE("exec engine: a stream passes through, de-chunked, as it comes") {
  asio::io_context io;
  ScriptedEngine engine(io, kSseHead + chunk("data: {\"a\":1}\n\n") + chunk("data: [DONE]\n\n") + "0\r\n\r\n");
  FakeRegistry reg;
  reg.list = {engine_worker(0, engine.port())};
  Scheduler s(io, reg, {});
  ForwardSink sink;
  REQUIRE(s.submit(forward_job(sink, true)));
  run_until(io, [&] { return sink.done.has_value(); });
  REQUIRE(sink.done);
  CHECK(sink.done->ok);
  CHECK(sink.streaming);
  CHECK(sink.bytes == "data: {\"a\":1}\n\ndata: [DONE]\n\n");
}

TEST_CASE("exec engine: refused or closed before the first byte, the request is replayed on the next worker") {
  asio::io_context io;
  ScriptedEngine closes(io, "");  // reads the request, closes without a word
  ScriptedEngine busy(io, "HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n");
  ScriptedEngine good(io, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}");
  FakeRegistry reg;
  reg.list = {engine_worker(0, closes.port()), engine_worker(1, busy.port()), engine_worker(2, good.port())};
  Scheduler s(io, reg, {});
  ForwardSink sink;
  REQUIRE(s.submit(forward_job(sink, false)));
  run_until(io, [&] { return sink.done.has_value(); });
  REQUIRE(sink.done);
  CHECK(sink.done->ok);
  CHECK(sink.status == 200);
  CHECK(sink.bytes == "{}");
  CHECK(closes.requests.size() >= 1);
  CHECK(busy.requests.size() >= 1);
  CHECK(good.requests.size() == 1);
  CHECK(s.counters().broken_calls >= 2);
}

TEST_CASE("exec engine: a stream cut after its first byte ends in an error, not replayed") {
  asio::io_context io;
  ScriptedEngine cut(io, kSseHead + chunk("data: {\"a\":1}\n\n"));  // then closes mid-stream
  ScriptedEngine good(io, kSseHead + chunk("data: [DONE]\n\n") + "0\r\n\r\n");
  FakeRegistry reg;
  reg.list = {engine_worker(0, cut.port()), engine_worker(1, good.port())};
  Scheduler s(io, reg, {});
  ForwardSink sink;
  REQUIRE(s.submit(forward_job(sink, true)));
  run_until(io, [&] { return sink.done.has_value(); });
  REQUIRE(sink.done);
  CHECK_FALSE(sink.done->ok);
  CHECK(sink.done->error.message.find("mid-answer") != std::string::npos);
  CHECK(sink.bytes == "data: {\"a\":1}\n\n");
  CHECK(good.requests.empty());
}

TEST_CASE("exec engine: an answer over the limit is an error, not replayed forever") {
  asio::io_context io;
  ScriptedEngine big(io, "HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + std::string(100, 'x'));
  FakeRegistry reg;
  reg.list = {engine_worker(0, big.port())};
  SchedulerOptions o;
  o.engine.max_body_bytes = 50;
  Scheduler s(io, reg, o);
  ForwardSink sink;
  REQUIRE(s.submit(forward_job(sink, false)));
  run_until(io, [&] { return sink.done.has_value(); });
  REQUIRE(sink.done);
  CHECK_FALSE(sink.done->ok);
  CHECK(sink.done->error.message.find("larger than 50 bytes") != std::string::npos);
  CHECK(big.requests.size() == 1);
}

TEST_CASE("forward_request: the body must be a JSON object; stream a boolean") {
  HttpRequest req{boost::beast::http::verb::post, "/v1/messages", 11};
  req.set(boost::beast::http::field::content_type, "application/json");
  req.body() = R"({"stream":true,"model":"x"})";
  auto f = forward_request(req);
  REQUIRE(std::holds_alternative<EngineRequest>(f));
  CHECK(std::get<EngineRequest>(f).stream);
  CHECK(std::get<EngineRequest>(f).target == "/v1/messages");
  req.body() = R"({"stream":"yes"})";
  CHECK(std::holds_alternative<ApiError>(forward_request(req)));
  req.body() = "[1]";
  CHECK(std::holds_alternative<ApiError>(forward_request(req)));
  req.body() = "{";
  CHECK(std::holds_alternative<ApiError>(forward_request(req)));
  req.body() = std::string(100, '[') + std::string(100, ']');
  CHECK(std::get<ApiError>(forward_request(req)).message.find("nests deeper") != std::string::npos);
}

TEST_CASE("forward_request: every API's reasoning controls reach an engine as chat_template_kwargs.enable_thinking") {
  HttpRequest req{boost::beast::http::verb::post, "/v1/messages", 11};
  auto body_of = [&](const std::string& target, const std::string& body) {
    req.target(target);
    req.body() = body;
    auto f = forward_request(req);
    REQUIRE(std::holds_alternative<EngineRequest>(f));
    return nlohmann::json::parse(std::get<EngineRequest>(f).body);
  };
  auto think = [&](const std::string& target, const std::string& body) {
    return body_of(target, body)["chat_template_kwargs"]["enable_thinking"];
  };
  CHECK(think("/v1/messages", R"({"model":"m","thinking":{"type":"disabled"},"max_tokens":4})") == false);
  CHECK(think("/v1/messages", R"({"thinking":{"type":"enabled","budget_tokens":1024}})") == true);
  CHECK(think("/v1/chat/completions", R"({"reasoning_effort":"minimal"})") == false);
  CHECK(think("/v1/chat/completions?x=1", R"({"reasoning_effort":"high"})") == true);
  CHECK(think("/v1/responses", R"({"reasoning":{"effort":"none"}})") == false);
  // The client's own switch wins; its other kwargs stay; nothing asked, nothing added.
  const auto own = body_of("/v1/chat/completions", R"({"reasoning_effort":"low","chat_template_kwargs":{"enable_thinking":false,"x":1}})");
  CHECK(own["chat_template_kwargs"] == nlohmann::json{{"enable_thinking", false}, {"x", 1}});
  CHECK(body_of("/v1/chat/completions", R"({"messages":[]})").dump() == R"({"messages":[]})");
  CHECK(body_of("/v1/completions", R"({"reasoning_effort":"none"})").dump() == R"({"reasoning_effort":"none"})");
  req.target("/v1/chat/completions");
  req.body() = R"({"reasoning_effort":"very"})";
  CHECK(std::get<ApiError>(forward_request(req)).message.find("reasoning_effort") != std::string::npos);
  req.body() = R"({"reasoning_effort":"none","chat_template_kwargs":7})";
  CHECK(std::holds_alternative<ApiError>(forward_request(req)));
}

TEST_CASE("sse_error_event: each API's error event, one line of data") {
  CHECK(sse_error_event(Api::openai, "{\"error\":\n{}}") == "data: {\"error\": {}}\n\n");
  CHECK(sse_error_event(Api::anthropic, "{\"type\":\"error\"}") == "event: error\ndata: {\"type\":\"error\"}\n\n");
}

TEST_CASE("exec engine: a client that goes away closes the engine's connection (it stops generating)") {
  asio::io_context io;
  tcp::acceptor acceptor(io, {asio::ip::address_v4::loopback(), 0});
  tcp::socket server(io);
  bool connected = false, closed = false;
  char buf[4096];
  std::function<void()> read_on = [&] {
    server.async_read_some(asio::buffer(buf), [&](boost::system::error_code ec, size_t) {
      if (ec) closed = true;
      else read_on();
    });
  };
  acceptor.async_accept(server, [&](boost::system::error_code ec) {
    connected = !ec;
    if (connected) read_on();  // reads the request, never answers
  });
  FakeRegistry reg;
  reg.list = {engine_worker(0, acceptor.local_endpoint().port())};
  Scheduler s(io, reg, {});
  ForwardSink sink;
  auto j = forward_job(sink, true);
  REQUIRE(s.submit(j));
  run_until(io, [&] { return connected; });
  REQUIRE(connected);
  CHECK(s.running() == 1);
  s.cancel(j);
  run_until(io, [&] { return closed; });
  CHECK(closed);
  CHECK(s.running() == 0);
  CHECK_FALSE(sink.done);  // the sink hears nothing after a cancel
}
