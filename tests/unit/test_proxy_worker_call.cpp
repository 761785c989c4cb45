// The proxy's connections to workers, kept open between requests: reuse after
// a finished request, none after a cancel, nothing stale ever reaches a new
// request, and a restarted worker loses no token. The worker is a fake on a
// real Unix socket, on the test's io_context; the scheduler drives the calls.
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
/// lines `answer` makes of it (by default tokens 100 + i up to max_tokens,
/// then done), on connections it keeps open.
class FakeWorker {
 public:
  struct Conn {
    explicit Conn(asio::io_context& io) : sock(io) {}
    local::socket sock;
    std::string buf;
    char in[4096];
    int requests = 0;
    bool closed_by_peer = false;
  };

  FakeWorker(asio::io_context& io, std::string path) : io_(io), path_(std::move(path)), acc_(io) { listen(); }

  static std::string complete(const ds4::proto::GenerateRequest& g) {
    std::string out;
    for (int64_t i = int64_t(g.generated.size()); i < g.max_tokens; ++i)
      out += ds4::proto::token_line({i, int32_t(100 + i), -0.5f, {}});
    return out + ds4::proto::done_line("length", {});
  }
  std::function<std::string(const ds4::proto::GenerateRequest&)> answer = complete;

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
        ++c->requests;
        const std::string out = answer(req.generate);
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
    reg.list.push_back({0, WorkerState::ready, dir + "/w.sock", 512, 2, 0, 1});
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

TEST_CASE("worker pool: a finished request's connection carries the next ones") {
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
  CHECK(f.sched->pool().idle(0) == 1);
}

TEST_CASE("worker pool: concurrent requests get their own connections, all kept for the next ones") {
  Fixture f;
  f.worker->answer = [](const ds4::proto::GenerateRequest&) { return std::string(); };  // answers below
  TokenSink a, b;
  f.submit(a, 2);
  f.submit(b, 2);
  f.settle();
  REQUIRE(f.worker->conns.size() == 2);
  ds4::proto::GenerateRequest two;
  two.max_tokens = 2;
  f.worker->send_to_all(FakeWorker::complete(two));
  f.settle();
  CHECK(a.tokens == kTwo);
  CHECK(b.tokens == kTwo);
  CHECK(f.sched->pool().idle(0) == 2);
  f.worker->answer = FakeWorker::complete;
  TokenSink c;
  f.run(c);
  CHECK(c.tokens == kTwo);
  CHECK(f.sched->pool().opened() == 2);
}

TEST_CASE("worker pool: a cancelled request's connection closes and is never reused") {
  Fixture f;
  f.worker->answer = [](const ds4::proto::GenerateRequest& g) {  // one token, then nothing (still generating)
    return ds4::proto::token_line({int64_t(g.generated.size()), 100, -0.5f, {}});
  };
  TokenSink a;
  auto ja = f.submit(a, 50);
  f.settle();
  CHECK(a.tokens == std::vector<int32_t>{100});
  f.sched->cancel(ja);
  f.settle();
  REQUIRE(f.worker->conns.size() == 1);
  CHECK(f.worker->conns[0]->closed_by_peer);  // the worker sees the cancel as EOF
  CHECK(f.sched->pool().idle(0) == 0);

  f.worker->answer = FakeWorker::complete;
  TokenSink b;
  f.run(b);
  CHECK(b.tokens == kTwo);
  CHECK(f.sched->pool().opened() == 2);
}

TEST_CASE("worker pool: a connection that sends anything while idle is dropped; the next request sees only its own events") {
  Fixture f;
  TokenSink a;
  f.run(a);
  REQUIRE(f.sched->pool().idle(0) == 1);
  f.worker->send_to_all(ds4::proto::token_line({2, 666, -0.5f, {}}));  // a stale event
  f.settle();
  CHECK(f.sched->pool().idle(0) == 0);
  TokenSink b;
  f.run(b);
  CHECK(b.tokens == kTwo);
  CHECK(f.sched->pool().opened() == 2);
}

TEST_CASE("worker pool: extra lines after done close the connection instead of pooling it") {
  Fixture f;
  f.worker->answer = [](const ds4::proto::GenerateRequest&) {
    return ds4::proto::token_line({0, 100, -0.5f, {}}) + ds4::proto::token_line({1, 101, -0.5f, {}}) +
           ds4::proto::done_line("length", {}) + ds4::proto::token_line({2, 666, -0.5f, {}});
  };
  TokenSink a;
  f.run(a);
  CHECK(a.tokens == kTwo);
  f.settle();
  CHECK(f.sched->pool().idle(0) == 0);
}

TEST_CASE("worker pool: a worker restarted under idle pooled connections loses and repeats nothing") {
  Fixture f;
  TokenSink a;
  f.run(a);
  REQUIRE(f.sched->pool().idle(0) == 1);

  SUBCASE("the proxy hears of the restart first") {
    f.restart_worker();
    f.reg.list[0].generation = 2;
    f.reg.changed();
    CHECK(f.sched->pool().idle(0) == 0);
  }
  SUBCASE("the request goes out before the proxy sees the old connection close") {
    f.restart_worker();
  }
  SUBCASE("the worker dies in the middle of the answer on a reused connection") {
    f.worker->answer = [&f](const ds4::proto::GenerateRequest& g) {
      asio::post(f.io, [&f] { f.restart_worker(); });
      return ds4::proto::token_line({int64_t(g.generated.size()), 100, -0.5f, {}});
    };
  }
  TokenSink b;
  auto jb = f.run(b);
  REQUIRE(b.done.has_value());
  CHECK(b.done->ok);
  CHECK(b.tokens == kTwo);
  CHECK(jb->gen.generated == kTwo);
}
