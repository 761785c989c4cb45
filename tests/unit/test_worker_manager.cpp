// The worker manager (supervisor/worker_manager.h) with an in-memory unit
// backend and scripted memory readings.
#include <doctest/doctest.h>

#include <vector>

#include "supervisor/worker_manager.h"

using namespace ds4;
using namespace ds4::sup;
using namespace std::chrono_literals;

namespace {

constexpr Bytes MiB = 1 << 20;

class FakeBackend : public UnitBackend {
 public:
  std::string name() const override { return "fake"; }
  void set_callbacks(BackendCallbacks cb) override { cb_ = cb; }
  void start(const LaunchSpec& s) override { starts.push_back(s); }
  void stop(int id) override { stops.push_back(id); }
  std::string unit_name(int id) const override { return "fake@" + std::to_string(id); }
  std::vector<AdoptedWorker> find_running(const std::string&) override { return running; }
  void ready(int id, int pid) { cb_.ready(id, pid); }
  void exited(int id, ExitKind k, const std::string& m = "") { cb_.exited(id, k, m); }

  std::vector<LaunchSpec> starts;
  std::vector<int> stops;
  std::vector<AdoptedWorker> running;
  BackendCallbacks cb_;
};

class FakeMemory : public MemorySource {
 public:
  Readings read() override { return {available, 0, std::nullopt}; }
  Bytes available = 4096 * MiB;
};

ManagerSettings settings(uint32_t count = 1) {
  ManagerSettings s;
  s.policy.ladder = {2048, 256};
  s.policy.reserve = 100 * MiB;
  s.policy.min_available = 500 * MiB;
  s.policy.low_for = 1s;
  s.policy.step_up_after = 0s;
  s.policy.backoff_initial = 100ms;
  s.policy.backoff_max = 1s;
  s.own_bytes = {1000 * MiB, 100 * MiB};
  s.count = count;
  s.slots = 4;
  s.segment = "seg";
  s.socket_dir = "/run/test";
  s.sample_every = 10ms;
  return s;
}

}  // namespace

TEST_CASE("manager: start, OOM one rung down, status and registry") {
  asio::io_context io;
  FakeBackend be;
  FakeMemory mem;
  WorkerManager m(io, be, mem, settings());
  int changes = 0;
  m.on_change([&] { ++changes; });
  m.start();
  REQUIRE(be.starts.size() == 1);
  CHECK(be.starts[0].context == 2048);
  CHECK(be.starts[0].socket_path == "/run/test/worker-0.sock");
  CHECK(be.starts[0].segment == "seg");
  CHECK(m.workers()[0].state == WorkerState::starting);

  be.ready(0, 42);
  CHECK(m.workers()[0].state == WorkerState::ready);
  CHECK(m.workers()[0].pid == 42);
  const uint64_t gen = m.workers()[0].generation;

  be.exited(0, ExitKind::oom);
  REQUIRE(be.starts.size() == 2);
  CHECK(be.starts[1].context == 256);
  be.ready(0, 43);
  const auto w = m.workers()[0];
  CHECK(w.context == 256);
  CHECK(w.oom_kills == 1);
  CHECK(w.restarts == 1);
  CHECK(w.generation == gen + 1);
  CHECK(changes >= 3);
  const auto st = m.status_json();
  CHECK(st[0]["unit"] == "fake@0");
  CHECK(st[0]["oom_kills"] == 1);
  CHECK(st[0].contains("last_downtime_ms"));
  REQUIRE(m.events().size() == 2);
  CHECK(m.events()[1].decision.event == "oom");
}

TEST_CASE("manager: a second worker starting counts the first one's plan as taken") {
  asio::io_context io;
  FakeBackend be;
  FakeMemory mem;
  mem.available = 1700 * MiB;  // one 2048 worker fits (1000 + 100 reserve), not two
  WorkerManager m(io, be, mem, settings(2));
  m.start();
  REQUIRE(be.starts.size() == 2);
  CHECK(be.starts[0].context == 2048);
  CHECK(be.starts[1].context == 256);
}

TEST_CASE("manager: low headroom drains, stops, restarts lower; admin drain keeps it stopped") {
  asio::io_context io;
  FakeBackend be;
  FakeMemory mem;
  WorkerManager m(io, be, mem, settings());
  m.start();
  be.ready(0, 7);
  mem.available = 100 * MiB;
  io.run_for(1300ms);
  REQUIRE(be.stops.size() == 1);
  CHECK(m.workers()[0].state == WorkerState::restarting);
  be.exited(0, ExitKind::clean);
  REQUIRE(be.starts.size() == 2);
  CHECK(be.starts[1].context == 256);
  be.ready(0, 8);

  m.drain(0);
  io.run_for(50ms);
  REQUIRE(be.stops.size() == 2);
  be.exited(0, ExitKind::clean);
  CHECK(m.workers()[0].state == WorkerState::stopped);
  CHECK(be.starts.size() == 2);
  CHECK_THROWS(m.drain(5));
}

TEST_CASE("manager: running workers are adopted, not restarted; stop stops them") {
  asio::io_context io;
  FakeBackend be;
  be.running = {{0, 99, 256, "/run/test/worker-0.sock"}};
  FakeMemory mem;
  WorkerManager m(io, be, mem, settings());
  m.start();
  CHECK(be.starts.empty());
  CHECK(m.workers()[0].state == WorkerState::ready);
  CHECK(m.workers()[0].pid == 99);
  CHECK(m.workers()[0].context == 256);
  bool done = false;
  m.stop([&] { done = true; });
  REQUIRE(be.stops.size() == 1);
  be.exited(0, ExitKind::clean);
  io.run_for(20ms);
  CHECK(done);
  CHECK(m.workers()[0].state == WorkerState::stopped);
}
