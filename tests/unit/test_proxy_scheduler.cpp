// Dispatch choices and the queue's bounds, with an in-memory registry (no
// worker is ever reached: these jobs only wait).
#include <doctest/doctest.h>

#include "supervisor/proxy/scheduler.h"
#include "tests/unit/fake_registry.h"

using namespace ds4::proxy;
using ds4::sup::WorkerInfo;
using ds4::test::FakeRegistry;
using ds4::sup::WorkerState;

namespace {

struct RecordingSink : JobSink {
  std::vector<int64_t> positions;
  std::optional<JobResult> done;
  void on_waiting(int64_t p) override { positions.push_back(p); }
  bool on_token(const ds4::proto::TokenEvent&) override { return true; }
  void on_done(const JobResult& r) override { done = r; }
};

std::shared_ptr<Job> job(JobSink& sink, std::vector<int32_t> prompt = {1, 2, 3}) {
  auto j = std::make_shared<Job>();
  j->gen.prompt = std::move(prompt);
  j->gen.max_tokens = 8;
  j->sink = &sink;
  return j;
}

}  // namespace

TEST_CASE("pick_worker: longest shared prefix, then most free slots, then lowest id; context must fit") {
  std::deque<std::vector<int32_t>> h0 = {{1, 2, 9}}, h1 = {{1, 2, 3, 4}};
  std::vector<Candidate> c = {{0, 100, 2, &h0}, {1, 100, 1, &h1}, {2, 100, 3, nullptr}};
  CHECK(pick_worker(c, {1, 2, 3, 4, 5}, 5) == 1);
  CHECK(pick_worker(c, {7, 7}, 2) == 2);  // no prefix anywhere: most free slots
  c[1].free_slots = 0;
  CHECK(pick_worker(c, {1, 2, 3, 4, 5}, 5) == 0);
  c[0].context = 5;  // needs a context above 5
  CHECK(pick_worker(c, {1, 2, 3, 4, 5}, 5) == 2);
  c[2].free_slots = 0;
  CHECK_FALSE(pick_worker(c, {1, 2, 3, 4, 5}, 5).has_value());
  CHECK(common_prefix({1, 2, 3}, {1, 2, 4}) == 2);
}

TEST_CASE("queue: jobs wait while no worker is ready; a full queue refuses; cancel frees a place") {
  boost::asio::io_context io;
  FakeRegistry reg;
  reg.list.push_back({.id = 0, .state = WorkerState::restarting, .socket_path = "/nonexistent", .context = 512, .slots = 2});
  SchedulerOptions o;
  o.max_waiting = 2;
  Scheduler s(io, reg, o);
  RecordingSink a, b, c;
  auto ja = job(a), jb = job(b), jc = job(c);
  CHECK(s.submit(ja));
  CHECK(s.submit(jb));
  CHECK_FALSE(s.submit(jc));  // full
  CHECK(s.waiting() == 2);
  CHECK(a.positions == std::vector<int64_t>{1});
  CHECK(b.positions == std::vector<int64_t>{2});
  s.cancel(ja);
  CHECK(s.waiting() == 1);
  CHECK(b.positions.back() == 1);  // moved up
  CHECK(s.submit(jc));
  CHECK(s.stats().waiting == 2);
  CHECK_FALSE(a.done.has_value());  // a cancelled job hears nothing
}

TEST_CASE("queue: max_wait ends a waiting job with a timeout error") {
  boost::asio::io_context io;
  FakeRegistry reg;
  SchedulerOptions o;
  o.max_wait = std::chrono::milliseconds(30);
  Scheduler s(io, reg, o);
  RecordingSink a;
  auto ja = job(a);
  CHECK(s.submit(ja));
  io.run_for(std::chrono::milliseconds(300));
  REQUIRE(a.done.has_value());
  CHECK_FALSE(a.done->ok);
  CHECK(a.done->error.kind == ErrorKind::timeout);
  CHECK(s.waiting() == 0);
  CHECK(s.counters().timeouts == 1);
}

TEST_CASE("queue: a prompt that no worker's context can hold ends with a 400") {
  boost::asio::io_context io;
  FakeRegistry reg;
  reg.list.push_back({.id = 0, .state = WorkerState::ready, .socket_path = "/nonexistent", .context = 3, .slots = 1});
  Scheduler s(io, reg, {});
  RecordingSink a;
  auto ja = job(a, {1, 2, 3, 4});
  CHECK(s.submit(ja));
  REQUIRE(a.done.has_value());
  CHECK(a.done->error.kind == ErrorKind::bad_request);
  CHECK(a.done->error.message.find("context is 3") != std::string::npos);
}

TEST_CASE("queue: a job that ends within submit may be dropped by its sink (the session does)") {
  // max_tokens 0: nothing to generate, so the job ends before submit returns.
  // The session's sink lets go of the job in on_done; submit must not touch
  // it through the caller's reference afterwards (it did: a segfault).
  struct DroppingSink : RecordingSink {
    std::shared_ptr<Job> owned;
    void on_done(const JobResult& r) override {
      RecordingSink::on_done(r);
      owned.reset();
    }
  };
  boost::asio::io_context io;
  FakeRegistry reg;
  reg.list.push_back({.id = 0, .state = WorkerState::ready, .socket_path = "/nonexistent", .context = 512, .slots = 1});
  Scheduler s(io, reg, {});
  DroppingSink a;
  a.owned = job(a);
  a.owned->gen.max_tokens = 0;
  std::weak_ptr<Job> gone = a.owned;
  CHECK(s.submit(a.owned));
  REQUIRE(a.done.has_value());
  CHECK(a.done->ok);
  CHECK(a.done->reason == "length");
  CHECK(gone.expired());
  CHECK(s.waiting() == 0);
}

TEST_CASE("dispatch: a worker that refuses connections is retried with backoff, the job keeps waiting") {
  boost::asio::io_context io;
  FakeRegistry reg;
  reg.list.push_back({.id = 0, .state = WorkerState::ready, .socket_path = "/nonexistent/ds4.sock", .context = 512, .slots = 1});
  SchedulerOptions o;
  o.max_wait = std::chrono::milliseconds(400);
  Scheduler s(io, reg, o);
  RecordingSink a;
  auto ja = job(a);
  CHECK(s.submit(ja));
  io.run_for(std::chrono::milliseconds(200));
  CHECK_FALSE(a.done.has_value());
  CHECK(s.counters().broken_calls >= 2);
  CHECK(s.counters().broken_calls < 40);  // backoff, not a busy loop
  io.restart();
  io.run_for(std::chrono::milliseconds(600));
  REQUIRE(a.done.has_value());
  CHECK(a.done->error.kind == ErrorKind::timeout);
}
