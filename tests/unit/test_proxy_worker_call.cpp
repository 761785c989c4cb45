// The proxy's connections to workers: one per worker, shared by every call
// to it, each call's events told apart by request id; a cancel goes to the
// worker as a line, nothing stale ever reaches a call, a broken connection
// breaks every call on it, and a restarted worker loses no token. The worker
// is a fake on a real Unix socket, on the test's io_context; the scheduler
// drives the calls.
#include <doctest/doctest.h>
#include <stdlib.h>
#include <unistd.h>

#include <filesystem>

#include "supervisor/proxy/scheduler.h"
#include "tests/unit/fake_registry.h"

using namespace ds4::proxy;
using ds4::sup::WorkerInfo;
using ds4::test::FakeRegistry;
using ds4::sup::WorkerState;
namespace asio = boost::asio;
using local = asio::local::stream_protocol;

namespace {

/// A worker speaking the token protocol on `path`: every request gets the
/// lines `answer` makes of it and its id (by default tokens 100 + i up to
/// max_tokens, then done); cancels are recorded.
class FakeWorker {
 public:
  struct Conn {
    explicit Conn(asio::io_context& io) : sock(io) {}
    local::socket sock;
    std::string buf;
    char in[4096];
    int requests = 0;
    std::vector<int64_t> ids;      // of the requests, in order
    std::vector<int64_t> cancels;  // ids cancelled
    bool closed_by_peer = false;
  };

  FakeWorker(asio::io_context& io, std::string path) : io_(io), path_(std::move(path)), acc_(io) { listen(); }

  static std::string complete(const ds4::proto::GenerateRequest& g, int64_t id) {
    std::string out;
    for (int64_t i = int64_t(g.generated.size()); i < g.max_tokens; ++i)
      out += ds4::proto::token_line({i, int32_t(100 + i), -0.5f, {}}, id);
    return out + ds4::proto::done_line("length", {}, id);
  }
  std::function<std::string(const ds4::proto::GenerateRequest&, int64_t id)> answer = complete;

  void listen() {
    ::unlink(path_.c_str());
    acc_.open();
    acc_.bind(local::endpoint(path_));
    acc_.listen();
    accept();
  }
  /// The process dies: the socket stops listening and every connection closes.
  void die() {
    boost::system::error_code ignored;
    acc_.close(ignored);
    for (auto& c : conns) c->sock.close(ignored);
  }
  void send_to_all(const std::string& bytes) {
    for (auto& c : conns)
      if (c->sock.is_open()) asio::write(c->sock, asio::buffer(bytes));
  }
  int requests() const {
    int n = 0;
    for (auto& c : conns) n += c->requests;
    return n;
  }

  std::vector<std::shared_ptr<Conn>> conns;

 private:
  void accept() {
    acc_.async_accept([this](const boost::system::error_code& ec, local::socket s) {
      if (ec) return;
      auto c = std::make_shared<Conn>(io_);
      c->sock = std::move(s);
      conns.push_back(c);
      read(c);
      accept();
    });
  }
  void read(const std::shared_ptr<Conn>& c) {
    c->sock.async_read_some(asio::buffer(c->in), [this, c](const boost::system::error_code& ec, size_t n) {
      if (ec) {
        c->closed_by_peer = ec != asio::error::operation_aborted;
        return;
      }
      c->buf.append(c->in, n);
      for (size_t nl; (nl = c->buf.find('\n')) != std::string::npos;) {
        const auto req = ds4::proto::parse_request(c->buf.substr(0, nl));
        c->buf.erase(0, nl + 1);
        if (req.op == ds4::proto::Request::Op::cancel) {
          c->cancels.push_back(req.id);
          continue;
        }
        ++c->requests;
        c->ids.push_back(req.id);
        const std::string out = answer(req.generate, req.id);
        if (!out.empty()) asio::write(c->sock, asio::buffer(out));
      }
      read(c);
    });
  }

  asio::io_context& io_;
  std::string path_;
  local::acceptor acc_;
};

struct TokenSink : JobSink {
  std::vector<int32_t> tokens;
  std::optional<JobResult> done;
  void on_waiting(int64_t) override {}
  bool on_token(const ds4::proto::TokenEvent& e) override {
    tokens.push_back(e.token);
    return true;
  }
  void on_done(const JobResult& r) override { done = r; }
};

struct Fixture {
  Fixture() {
    char tmpl[] = "/tmp/ds4-pool-test-XXXXXX";
    dir = ::mkdtemp(tmpl);
    worker = std::make_unique<FakeWorker>(io, dir + "/w.sock");
    reg.list.push_back({.id = 0, .state = WorkerState::ready, .socket_path = dir + "/w.sock", .context = 512, .slots = 2, .generation = 1});
    SchedulerOptions o;
    o.retry_min = std::chrono::milliseconds(1);
    sched = std::make_unique<Scheduler>(io, reg, o);
  }
  ~Fixture() {
    sched.reset();
    worker.reset();
    dead.clear();
    std::filesystem::remove_all(dir);
  }
  /// The worker process is replaced: the old one dies (kept for its pending
  /// handlers), a new one listens on the same path.
  void restart_worker() {
    worker->die();
    dead.push_back(std::move(worker));
    worker = std::make_unique<FakeWorker>(io, dir + "/w.sock");
  }
  /// Submits a job for `max_tokens` tokens and runs until it is done.
  std::shared_ptr<Job> run(TokenSink& sink, int32_t max_tokens = 2) {
    auto j = submit(sink, max_tokens);
    io.restart();
    for (int i = 0; i < 2000 && !sink.done; ++i) io.run_one_for(std::chrono::milliseconds(5));
    return j;
  }
  std::shared_ptr<Job> submit(TokenSink& sink, int32_t max_tokens) {
    auto j = std::make_shared<Job>();
    j->gen.prompt = {1, 2, 3};
    j->gen.max_tokens = max_tokens;
    j->sink = &sink;
    REQUIRE(sched->submit(j));
    return j;
  }
  void settle() {
    io.restart();
    io.run_for(std::chrono::milliseconds(30));
  }

  asio::io_context io;
  std::string dir;
  std::unique_ptr<FakeWorker> worker;
  std::vector<std::unique_ptr<FakeWorker>> dead;
  FakeRegistry reg;
  std::unique_ptr<Scheduler> sched;
};

const std::vector<int32_t> kTwo = {100, 101};

}  // namespace

TEST_CASE("worker pool: one connection carries every call to a worker") {
  Fixture f;
  for (int i = 0; i < 3; ++i) {
    TokenSink s;
    f.run(s);
    REQUIRE(s.done.has_value());
    CHECK(s.done->ok);
    CHECK(s.tokens == kTwo);
  }
  CHECK(f.sched->pool().opened() == 1);
  REQUIRE(f.worker->conns.size() == 1);
  CHECK(f.worker->conns[0]->requests == 3);
  CHECK(f.worker->conns[0]->ids == std::vector<int64_t>{1, 2, 3});
  CHECK(f.sched->pool().connected(0));
}

TEST_CASE("worker pool: concurrent calls share the connection, and each gets its own events only") {
  Fixture f;
  f.worker->answer = [](const ds4::proto::GenerateRequest&, int64_t) { return std::string(); };  // answers below
  TokenSink a, b;
  f.submit(a, 2);
  f.submit(b, 2);
  f.settle();
  REQUIRE(f.worker->conns.size() == 1);
  REQUIRE(f.worker->conns[0]->ids == std::vector<int64_t>{1, 2});
  using ds4::proto::token_line;
  f.worker->send_to_all(token_line({0, 200, -0.5f, {}}, 2) + token_line({0, 100, -0.5f, {}}, 1) +
                        token_line({1, 201, -0.5f, {}}, 2) + ds4::proto::done_line("length", {}, 2) +
                        token_line({1, 101, -0.5f, {}}, 1) + ds4::proto::done_line("length", {}, 1));
  f.settle();
  CHECK(a.tokens == kTwo);
  CHECK(b.tokens == std::vector<int32_t>{200, 201});
  REQUIRE(a.done.has_value());
  REQUIRE(b.done.has_value());
  CHECK(a.done->ok);
  CHECK(b.done->ok);
  f.worker->answer = FakeWorker::complete;
  TokenSink c;
  f.run(c);
  CHECK(c.tokens == kTwo);
  CHECK(f.sched->pool().opened() == 1);
}

TEST_CASE("worker pool: a cancelled call's id is cancelled on the worker, its late events are dropped, the connection serves on") {
  Fixture f;
  f.worker->answer = [](const ds4::proto::GenerateRequest& g, int64_t id) {  // one token, then nothing (still generating)
    return ds4::proto::token_line({int64_t(g.generated.size()), 100, -0.5f, {}}, id);
  };
  TokenSink a;
  auto ja = f.submit(a, 50);
  f.settle();
  CHECK(a.tokens == std::vector<int32_t>{100});
  f.sched->cancel(ja);
  f.settle();
  REQUIRE(f.worker->conns.size() == 1);
  CHECK(f.worker->conns[0]->cancels == std::vector<int64_t>{1});
  CHECK_FALSE(f.worker->conns[0]->closed_by_peer);
  f.worker->send_to_all(ds4::proto::token_line({1, 666, -0.5f, {}}, 1) + ds4::proto::done_line("cancelled", {}, 1));

  f.worker->answer = FakeWorker::complete;
  TokenSink b;
  f.run(b);
  CHECK(b.tokens == kTwo);
  CHECK(a.tokens == std::vector<int32_t>{100});
  CHECK(f.sched->pool().opened() == 1);
  CHECK(f.worker->conns[0]->ids == std::vector<int64_t>{1, 2});
}

TEST_CASE("worker pool: an event without id breaks every call on the connection; they finish elsewhere with nothing lost") {
  Fixture f;
  f.worker->answer = [](const ds4::proto::GenerateRequest& g, int64_t id) {
    return g.generated.empty() ? ds4::proto::token_line({0, 100, -0.5f, {}}, id) : FakeWorker::complete(g, id);
  };
  TokenSink a, b;
  auto ja = f.submit(a, 2);
  auto jb = f.submit(b, 2);
  f.settle();
  REQUIRE(a.tokens == std::vector<int32_t>{100});
  REQUIRE(b.tokens == std::vector<int32_t>{100});
  SUBCASE("a token line without id") { f.worker->send_to_all(ds4::proto::token_line({1, 666, -0.5f, {}})); }
  SUBCASE("an error line without id: the worker refused a line") { f.worker->send_to_all(ds4::proto::error_line("bad line")); }
  SUBCASE("a line that is no event") { f.worker->send_to_all("{not json\n"); }
  f.settle();
  for (TokenSink* s : {&a, &b}) {
    REQUIRE(s->done.has_value());
    CHECK(s->done->ok);
    CHECK(s->tokens == kTwo);
  }
  CHECK(ja->gen.generated == kTwo);
  CHECK(jb->gen.generated == kTwo);
  CHECK(f.sched->pool().opened() == 2);
}

TEST_CASE("worker pool: a worker that stops being ready keeps its connection for the calls running on it") {
  Fixture f;
  f.worker->answer = [](const ds4::proto::GenerateRequest&, int64_t) { return std::string(); };
  TokenSink a;
  f.submit(a, 2);
  f.settle();
  f.reg.list[0].state = WorkerState::draining;
  f.reg.changed();
  CHECK_FALSE(f.sched->pool().connected(0));
  REQUIRE(f.worker->conns.size() == 1);
  f.settle();
  CHECK_FALSE(f.worker->conns[0]->closed_by_peer);
  f.worker->send_to_all(FakeWorker::complete(ds4::proto::GenerateRequest{{}, {}, 2, {}, 0, false}, 1));
  f.settle();
  CHECK(a.tokens == kTwo);
  REQUIRE(a.done.has_value());
  CHECK(a.done->ok);
  CHECK(f.worker->conns[0]->closed_by_peer);  // closed once its last call ended
}

TEST_CASE("worker pool: a worker restarted under an open connection loses and repeats nothing") {
  Fixture f;
  TokenSink a;
  f.run(a);
  REQUIRE(f.sched->pool().connected(0));

  SUBCASE("the proxy hears of the restart first") {
    f.restart_worker();
    f.reg.list[0].generation = 2;
    f.reg.changed();
    CHECK_FALSE(f.sched->pool().connected(0));
  }
  SUBCASE("the request goes out before the proxy sees the old connection close") {
    f.restart_worker();
  }
  SUBCASE("the worker dies in the middle of the answer") {
    f.worker->answer = [&f](const ds4::proto::GenerateRequest& g, int64_t id) {
      asio::post(f.io, [&f] { f.restart_worker(); });
      return ds4::proto::token_line({int64_t(g.generated.size()), 100, -0.5f, {}}, id);
    };
  }
  TokenSink b;
  auto jb = f.run(b);
  REQUIRE(b.done.has_value());
  CHECK(b.done->ok);
  CHECK(b.tokens == kTwo);
  CHECK(jb->gen.generated == kTwo);
}
