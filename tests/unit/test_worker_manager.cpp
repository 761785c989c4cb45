// The worker manager (supervisor/worker_manager.h) with an in-memory unit
// backend and scripted memory readings.
#include <doctest/doctest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <map>
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
  void start(const LaunchSpec& s) override { starts.push_back(s.launch); }
  void stop(int id) override { stops.push_back(id); }
  void kill(int id) override { kills.push_back(id); }
  std::string unit_name(int id) const override { return "fake@" + std::to_string(id); }
  std::vector<AdoptedWorker> find_running(const std::string&) override { return running; }
  void ready(int id, int pid) { cb_.ready(id, pid); }
  void exited(int id, ExitKind k, const std::string& m = "") { cb_.exited(id, k, m); }

  std::vector<WorkerLaunch> starts;  // the launch of each start
  std::vector<int> stops;
  std::vector<int> kills;
  std::vector<AdoptedWorker> running;
  BackendCallbacks cb_;
};

class FakeMemory : public MemorySource {
 public:
  Readings read() override { return {available, 0, std::nullopt, std::nullopt}; }
  Bytes available = 4096 * MiB;
};

/// Scripted control block records and socket probes.
class FakeHealth : public HealthSource {
 public:
  std::optional<control::Snapshot> record(int id) const override {
    auto it = records.find(id);
    if (it == records.end()) return std::nullopt;
    return it->second;
  }
  int64_t now_ns() const override { return clock_ns; }
  void probe(const std::string& socket, Duration, std::function<void(bool)> done) override {
    probed.push_back(socket);
    asio::post(*io, [this, done] { done(answers); });
  }
  asio::io_context* io = nullptr;
  std::map<int, control::Snapshot> records;
  int64_t clock_ns = 1'000'000'000'000;
  bool answers = true;
  std::vector<std::string> probed;
};

ManagerSettings settings(uint32_t count = 1) {
  ManagerSettings s;
  s.policy.ladder = {{.context = 2048, .own_bytes = 1000 * MiB}, {.context = 256, .own_bytes = 100 * MiB}};
  s.policy.reserve = 100 * MiB;
  s.policy.min_available = 500 * MiB;
  s.policy.low_for = 1s;
  s.policy.step_up_after = 0s;
  s.policy.backoff_initial = 100ms;
  s.policy.backoff_max = 1s;
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
  CHECK(be.starts[0].socket == "/run/test/worker-0.sock");
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

TEST_CASE("manager: a GPU worker's first start goes by the free memory the weights holder sees") {
  asio::io_context io;
  FakeBackend be;
  FakeMemory mem;
  mem.available = 64 * 1024 * MiB;  // the host's memory plays no part for a GPU worker
  ManagerSettings s = settings(2);
  s.gpu_workers = true;
  int asked = 0;
  SUBCASE("the holder says: the largest rung that fits, the second worker counting the first's plan") {
    WorkerManager m(io, be, mem, s);
    m.set_gpu_memory_source([&]() -> std::optional<GpuMemory> {
      ++asked;
      return GpuMemory{1200 * MiB, 8192 * MiB};  // 2048 (1000) fits with the 100 reserve; two do not
    });
    m.start();
    REQUIRE(be.starts.size() == 2);
    CHECK(asked == 2);
    CHECK(be.starts[0].context == 2048);
    CHECK(be.starts[1].context == 256);
    REQUIRE(m.events().size() == 2);
    CHECK(m.events()[0].decision.reason.find("largest rung that fits: needs 1000") != std::string::npos);
    CHECK(m.events()[0].decision.reason.find("free on the GPU") != std::string::npos);
    CHECK(m.events()[1].decision.reason.find("no rung fits") == std::string::npos);
  }
  SUBCASE("the holder says too little for the largest rung: the first start is already one lower") {
    ManagerSettings one = settings(1);
    one.gpu_workers = true;
    WorkerManager g(io, be, mem, one);
    g.set_gpu_memory_source([&]() -> std::optional<GpuMemory> { return GpuMemory{600 * MiB, 8192 * MiB}; });
    g.start();
    REQUIRE(be.starts.size() == 1);
    CHECK(be.starts[0].context == 256);
  }
  SUBCASE("nobody can say (no holder, or it does not answer): the largest rung, as before") {
    WorkerManager m(io, be, mem, s);
    m.set_gpu_memory_source([&]() -> std::optional<GpuMemory> { ++asked; return std::nullopt; });
    m.start();
    REQUIRE(be.starts.size() == 2);
    CHECK(asked == 2);
    CHECK(be.starts[0].context == 2048);
    CHECK(be.starts[1].context == 2048);
    CHECK(m.events()[0].decision.reason.find("not known yet") != std::string::npos);
  }
  SUBCASE("a worker that reports its GPU's memory is what counts; the holder is not asked") {
    FakeHealth health;
    health.io = &io;
    s.control = "/ds4-control-test";
    WorkerManager m(io, be, mem, s);
    m.set_health_source(&health);
    m.set_gpu_memory_source([&]() -> std::optional<GpuMemory> { ++asked; return GpuMemory{8192 * MiB, 8192 * MiB}; });
    // Worker 0 runs already (a restarted supervisor adopts it) and reports
    // its GPU; worker 1 starts.
    be.running = {AdoptedWorker{0, 42, 2048, "/run/test/worker-0.sock", 0}};
    control::Snapshot rec;
    rec.pid = 42;
    rec.heartbeat_ns = health.clock_ns;
    rec.gpu_free = 700ull * MiB;  // room for a 256 worker only
    rec.gpu_total = 8192ull * MiB;
    health.records[0] = rec;
    m.start();
    REQUIRE(be.starts.size() == 1);
    CHECK(be.starts[0].id == 1);
    CHECK(asked == 0);
    CHECK(be.starts[0].context == 256);
  }
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

TEST_CASE("manager: a worker whose heartbeat goes stale is killed and restarted at its context") {
  asio::io_context io;
  FakeBackend be;
  FakeMemory mem;
  FakeHealth health;
  health.io = &io;
  ManagerSettings s = settings();
  s.policy.hang_timeout = 500ms;
  s.control = "/ds4-control-test";
  WorkerManager m(io, be, mem, s);
  m.set_health_source(&health);
  m.start();
  REQUIRE(be.starts.size() == 1);
  CHECK(be.starts[0].control == "/ds4-control-test");
  be.ready(0, 42);
  control::Snapshot rec;
  rec.pid = 42;
  rec.heartbeat_ns = health.clock_ns - 50'000'000;  // 50 ms ago
  rec.requests = 3;
  rec.gpu_free = 5ull << 30;
  rec.gpu_total = 8ull << 30;
  health.records[0] = rec;
  io.run_for(300ms);
  CHECK(be.kills.empty());
  CHECK_FALSE(health.probed.empty());
  CHECK(health.probed[0] == "/run/test/worker-0.sock");
  // Status and headroom show the record's figures.
  auto st = m.status_json();
  CHECK(st[0]["heartbeat_age_ms"] == 50);
  CHECK(st[0]["counters"]["requests"] == 3);
  CHECK(m.last_readings().gpu_free == Bytes(5ull << 30));
  CHECK(m.last_readings().gpu_total == Bytes(8ull << 30));

  // A record of another process behind the id does not count as ours.
  health.records[0].pid = 41;
  CHECK(m.status_json()[0]["heartbeat_age_ms"].is_null());
  health.records[0].pid = 42;

  // The heartbeat stops: after hang_timeout it is killed, once.
  health.records[0].heartbeat_ns = health.clock_ns - 900'000'000;
  io.run_for(300ms);
  REQUIRE(be.kills == std::vector<int>{0});
  CHECK(m.workers()[0].state == WorkerState::restarting);
  REQUIRE_FALSE(m.events().empty());
  CHECK(m.events().back().decision.event == "hang");
  CHECK(be.starts.size() == 1);
  be.exited(0, ExitKind::clean, "killed by the supervisor (SIGKILL)");
  REQUIRE(be.starts.size() == 2);
  CHECK(be.starts[1].context == 2048);  // same rung
  CHECK(m.workers()[0].oom_kills == 0);
}

TEST_CASE("manager: a worker whose socket stops answering is killed; without a record the socket decides") {
  asio::io_context io;
  FakeBackend be;
  FakeMemory mem;
  FakeHealth health;
  health.io = &io;
  ManagerSettings s = settings();
  s.policy.hang_timeout = 500ms;
  WorkerManager m(io, be, mem, s);
  m.set_health_source(&health);
  m.start();
  be.ready(0, 42);  // no record: an older worker binary
  io.run_for(700ms);
  CHECK(be.kills.empty());
  CHECK(m.status_json()[0]["heartbeat_age_ms"].is_null());
  health.answers = false;
  io.run_for(1000ms);
  CHECK(be.kills == std::vector<int>{0});
}

TEST_CASE("manager: exec engines start at the largest rung with a port, are reached over HTTP, hang by heartbeat") {
  asio::io_context io;
  FakeBackend be;
  FakeMemory mem;
  mem.available = 300 * MiB;  // a native plan of 1000 MiB would not fit 2048
  FakeHealth health;
  health.io = &io;
  ManagerSettings s = settings();
  for (Rung& r : s.policy.ladder) r.own_bytes = 0;  // as the supervisor sets them for exec: unknown
  s.exec_command = "srv --port {port} -c {ctx}";
  s.model_path = "/m/x.gguf";
  s.policy.hang_timeout = 500ms;
  WorkerManager m(io, be, mem, s);
  m.set_health_source(&health);
  m.start();
  REQUIRE(be.starts.size() == 1);
  CHECK(be.starts[0].context == 2048);
  CHECK(be.starts[0].exec_command == "srv --port {port} -c {ctx}");
  CHECK(be.starts[0].model == "/m/x.gguf");
  CHECK(be.starts[0].start_timeout_ms == exec_start_timeout_ms(s.policy.start_timeout));
  const int port = be.starts[0].port;
  CHECK(port > 0);
  be.ready(0, 42);
  auto w = m.workers()[0];
  CHECK(w.http_port == port);
  CHECK(w.socket_path.empty());  // native jobs never go there
  CHECK(m.status_json()[0]["engine"] == "exec");
  CHECK(m.status_json()[0]["port"] == port);

  control::Snapshot rec;
  rec.pid = 42;
  rec.heartbeat_ns = health.clock_ns - 50'000'000;
  health.records[0] = rec;
  io.run_for(300ms);
  CHECK(health.probed.empty());  // no token socket to probe
  CHECK(be.kills.empty());
  health.records[0].heartbeat_ns = health.clock_ns - 900'000'000;
  io.run_for(300ms);
  CHECK(be.kills == std::vector<int>{0});

  // An OOM kill: one rung down, a new port.
  be.exited(0, ExitKind::oom);
  REQUIRE(be.starts.size() == 2);
  CHECK(be.starts[1].context == 256);
  CHECK(be.starts[1].port > 0);
  CHECK(be.starts[1].exec_command == s.exec_command);
}

namespace {

/// A socket listening on a port of 127.0.0.1 the kernel picks (`reuse`:
/// with SO_REUSEADDR, as engines bind); returns its fd, sets `a`.
int listen_loopback(bool reuse, sockaddr_in& a) {
  const int lfd = ::socket(AF_INET, SOCK_STREAM, 0);
  const int one = 1;
  if (reuse) ::setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  a = {};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  REQUIRE(::bind(lfd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  REQUIRE(::listen(lfd, 1) == 0);
  REQUIRE(::getsockname(lfd, reinterpret_cast<sockaddr*>(&a), &len) == 0);
  return lfd;
}

/// A port on 127.0.0.1 left in TIME_WAIT: a connection whose server side
/// closed first (what a killed engine leaves behind), its listener, which
/// set SO_REUSEADDR as engines do, gone.
int port_in_time_wait() {
  sockaddr_in a;
  const int lfd = listen_loopback(true, a);
  const int cfd = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(::connect(cfd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  const int sfd = ::accept(lfd, nullptr, nullptr);
  REQUIRE(sfd >= 0);
  ::close(sfd);  // the server closes first: its side ends in TIME_WAIT
  ::close(lfd);
  char b;
  (void)::read(cfd, &b, 1);  // the FIN
  ::close(cfd);
  return ntohs(a.sin_port);
}

struct EnvVar {
  EnvVar(const char* k, const std::string& v) : key(k) { ::setenv(k, v.c_str(), 1); }
  ~EnvVar() { ::unsetenv(key); }
  const char* key;
};

}  // namespace

TEST_CASE("manager: an exec engine's port left in TIME_WAIT by a killed engine is taken again") {
  const int p = port_in_time_wait();
  EnvVar range("DS4_EXEC_PORTS", std::to_string(p) + "-" + std::to_string(p));
  asio::io_context io;
  FakeBackend be;
  FakeMemory mem;
  ManagerSettings s = settings();
  s.exec_command = "engine --port {port}";
  WorkerManager m(io, be, mem, s);
  m.start();
  REQUIRE(be.starts.size() == 1);
  CHECK(be.starts[0].port == p);
}

TEST_CASE("manager: no free port for an exec engine is a failed start, not the supervisor's end") {
  // The only port of the range has a listener: every start fails to get one.
  sockaddr_in a;
  const int lfd = listen_loopback(false, a);
  const int p = ntohs(a.sin_port);
  EnvVar range("DS4_EXEC_PORTS", std::to_string(p) + "-" + std::to_string(p));
  asio::io_context io;
  FakeBackend be;
  FakeMemory mem;
  ManagerSettings s = settings();
  s.exec_command = "engine --port {port}";
  WorkerManager m(io, be, mem, s);
  CHECK_NOTHROW(m.start());
  io.run_for(50ms);
  CHECK(be.starts.empty());
  const auto w = m.workers()[0];
  CHECK(w.state == WorkerState::backoff);  // restarted at once, failed again: backing off
  CHECK(w.restarts >= 1);
  REQUIRE(!m.events().empty());
  CHECK(m.events().back().decision.reason.find("no free port for the engine in DS4_EXEC_PORTS=") != std::string::npos);
  ::close(lfd);
}

TEST_CASE("manager: an expert rung reaches the worker's start, its status, /metrics' registry and the journal event") {
  asio::io_context io;
  FakeBackend be;
  FakeMemory mem;
  mem.available = 64 * 1024 * MiB;
  ManagerSettings s = settings();
  s.gpu_workers = true;
  s.policy.ladder = ladder_rungs({2048, 256}, {}, {0, 4});  // (2048, 0), (2048, 4), (256, 4)
  const std::vector<Bytes> own = {1500 * MiB, 1000 * MiB, 100 * MiB};
  for (size_t i = 0; i < own.size(); ++i) s.policy.ladder[i].own_bytes = own[i];
  s.holder_experts = 4;
  WorkerManager m(io, be, mem, s);
  m.set_gpu_memory_source([&]() -> std::optional<GpuMemory> { return GpuMemory{1200 * MiB, 8192 * MiB}; });
  m.start();
  REQUIRE(be.starts.size() == 1);
  CHECK(be.starts[0].context == 2048);
  CHECK(be.starts[0].host_experts == 4);  // 1500 does not fit 1200 - 100, 1000 does
  CHECK(be.starts[0].holder_experts == 4);
  be.ready(0, 42);
  CHECK(m.workers()[0].host_experts == 4);
  CHECK(m.status_json()[0]["host_experts"] == 4);
  // Its rung indexes the ladder the status JSON lists, each rung with its plan.
  CHECK(m.status_json()[0]["rung"] == 1);
  CHECK(m.status_json()[0]["memory_plan"] == 1000 * MiB);
  const nlohmann::json ladder = m.ladder_json();
  REQUIRE(ladder.size() == 3);
  CHECK(ladder[1] == nlohmann::json{{"context", 2048}, {"kv_cache", "f16"}, {"host_experts", 4}, {"memory_plan", 1000 * MiB}});
  CHECK(ladder[2]["context"] == 256);
  be.exited(0, ExitKind::oom);
  REQUIRE(be.starts.size() == 2);
  CHECK(be.starts[1].context == 256);
  CHECK(be.starts[1].host_experts == 4);
  const Decision& d = m.events().back().decision;
  CHECK(d.event == "oom");
  CHECK(d.host_experts_from == std::optional<uint32_t>(4));
  CHECK(d.host_experts_to == std::optional<uint32_t>(4));
  // The adopted worker's rung comes from its unit's environment.
  FakeBackend be2;
  be2.running = {AdoptedWorker{0, 77, 2048, "/run/test/worker-0.sock", 0, 4}};
  WorkerManager m2(io, be2, mem, s);
  m2.start();
  CHECK(be2.starts.empty());
  CHECK(m2.workers()[0].host_experts == 4);
  CHECK(m2.workers()[0].context == 2048);
}
