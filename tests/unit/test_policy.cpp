// The worker policy (supervisor/policy.h) with a fake clock and scripted readings.
#include <doctest/doctest.h>

#include "shared/error.h"
#include "supervisor/policy.h"

using namespace ds4;
using namespace ds4::sup;
using namespace std::chrono_literals;

namespace {

constexpr Bytes MiB = 1 << 20;

/// KV + scratch per rung: 800, 400, 200 MiB.
std::vector<Bytes> plans() { return {800 * MiB, 400 * MiB, 200 * MiB}; }

/// `ladder`, rung i with the plan own[i].
std::vector<Rung> planned(std::vector<Rung> ladder, const std::vector<Bytes>& own) {
  REQUIRE(ladder.size() == own.size());
  for (size_t i = 0; i < ladder.size(); ++i) ladder[i].own_bytes = own[i];
  return ladder;
}

std::vector<uint32_t> contexts(const std::vector<Rung>& ladder) {
  std::vector<uint32_t> out;
  for (const Rung& r : ladder) out.push_back(r.context);
  return out;
}

std::vector<uint32_t> host_experts(const std::vector<Rung>& ladder) {
  std::vector<uint32_t> out;
  for (const Rung& r : ladder) out.push_back(r.host_experts);
  return out;
}

std::vector<std::string> kv_caches(const std::vector<Rung>& ladder) {
  std::vector<std::string> out;
  for (const Rung& r : ladder) out.push_back(r.kv_cache);
  return out;
}

PolicyConfig test_config() {
  PolicyConfig c;
  c.ladder = planned(ladder_rungs({8192, 4096, 2048}), plans());
  c.reserve = 100 * MiB;
  c.min_available = 200 * MiB;
  c.low_for = 10s;
  c.step_up_after = 60s;
  c.backoff_initial = 1s;
  c.backoff_max = 8s;
  return c;
}

struct Fixture {
  TimePoint t{};  // the fake clock
  WorkerPolicy p{0, test_config()};
  Readings mem(Bytes mib) { return Readings{mib * MiB, 0, std::nullopt, std::nullopt}; }
  void advance(std::chrono::milliseconds d) { t += d; }
};

bool has(const Step& s, Action::Kind k, uint32_t ctx = 0) {
  for (const auto& a : s.actions)
    if (a.kind == k && (ctx == 0 || a.context == ctx)) return true;
  return false;
}

}  // namespace

TEST_CASE("policy: start picks the largest rung that fits available - reserve") {
  Fixture f;
  Step s = f.p.start(f.t, f.mem(1000));  // 900 after reserve: 8192 fits
  CHECK(has(s, Action::Kind::start, 8192));
  REQUIRE(s.decisions.size() == 1);
  CHECK(s.decisions[0].event == "start");

  Fixture g;
  s = g.p.start(g.t, g.mem(600));  // 500 after reserve: 4096
  CHECK(has(s, Action::Kind::start, 4096));
  CHECK(g.p.state() == WorkerState::starting);

  Fixture h;
  s = h.p.start(h.t, h.mem(150));  // nothing fits: the smallest, said so
  CHECK(has(s, Action::Kind::start, 2048));
  CHECK(s.decisions[0].reason.find("no rung fits") != std::string::npos);
}

TEST_CASE("policy: an OOM kill restarts one rung lower at once, down to the bottom") {
  Fixture f;
  f.p.start(f.t, f.mem(1000));
  f.p.on_ready(f.t, 100);
  CHECK(f.p.state() == WorkerState::ready);
  f.advance(5s);
  Step s = f.p.on_exit(f.t, ExitKind::oom, "");
  CHECK(has(s, Action::Kind::start, 4096));
  REQUIRE(s.decisions.size() == 1);
  CHECK(s.decisions[0].event == "oom");
  CHECK(s.decisions[0].context_from == 8192);
  CHECK(s.decisions[0].context_to == 4096);
  CHECK(f.p.oom_kills() == 1);
  CHECK(f.p.restarts() == 1);
  CHECK(f.p.state() == WorkerState::starting);

  // OOM again before ready: one more rung down, still at once.
  s = f.p.on_exit(f.t, ExitKind::oom, "");
  CHECK(has(s, Action::Kind::start, 2048));
  CHECK(f.p.oom_kills() == 2);
  // At the bottom: restarted at the same rung once, then backoff.
  s = f.p.on_exit(f.t, ExitKind::oom, "");
  CHECK(has(s, Action::Kind::start, 2048));
  s = f.p.on_exit(f.t, ExitKind::oom, "");
  CHECK(s.actions.empty());
  CHECK(f.p.state() == WorkerState::backoff);
  CHECK(s.decisions[0].event == "backoff");
}

TEST_CASE("policy: a worker whose memory plan does not fit (host or GPU) restarts one rung lower, not as a crash") {
  Fixture f;
  f.p.start(f.t, f.mem(1000));  // 8192: the supervisor's host figures fit, the GPU's did not
  const std::string why = "memory plan does not fit the device: ... the device has only 300.0 MiB free";
  Step s = f.p.on_exit(f.t, ExitKind::no_fit, why);
  CHECK(has(s, Action::Kind::start, 4096));
  REQUIRE(s.decisions.size() == 1);
  CHECK(s.decisions[0].event == "downgrade");
  CHECK(s.decisions[0].context_from == 8192);
  CHECK(s.decisions[0].context_to == 4096);
  CHECK(s.decisions[0].reason.find("did not fit") != std::string::npos);
  CHECK(s.decisions[0].reason.find(why) != std::string::npos);  // the worker's own figures
  CHECK(f.p.oom_kills() == 0);
  CHECK(f.p.restarts() == 1);
  CHECK(f.p.last_error() == why);
  s = f.p.on_exit(f.t, ExitKind::no_fit, why);
  CHECK(has(s, Action::Kind::start, 2048));
  s = f.p.on_ready(f.t, 101);
  CHECK(f.p.state() == WorkerState::ready);
  CHECK(f.p.context() == 2048);

  // At the bottom it is a failure: once at once, then backoff (and never a loop at full speed).
  Fixture g;
  g.p.start(g.t, g.mem(150));
  s = g.p.on_exit(g.t, ExitKind::no_fit, why);
  CHECK(has(s, Action::Kind::start, 2048));
  s = g.p.on_exit(g.t, ExitKind::no_fit, why);
  CHECK(s.actions.empty());
  CHECK(g.p.state() == WorkerState::backoff);
  REQUIRE(s.decisions.size() == 1);
  CHECK(s.decisions[0].event == "backoff");
  CHECK(s.decisions[0].reason.find("did not fit at the smallest context 2048") != std::string::npos);
}

TEST_CASE("policy: low headroom for `for` drains, then restarts one rung lower") {
  Fixture f;
  f.p.start(f.t, f.mem(1000));
  f.p.on_ready(f.t, 100);
  CHECK(f.p.on_readings(f.t, f.mem(150), true).actions.empty());  // low starts counting
  f.advance(5s);
  CHECK(f.p.on_readings(f.t, f.mem(150), true).actions.empty());
  f.advance(2s);
  CHECK(f.p.on_readings(f.t, f.mem(500), true).actions.empty());  // recovered: count restarts
  f.advance(1s);
  CHECK(f.p.on_readings(f.t, f.mem(150), true).actions.empty());
  f.advance(9s);
  CHECK(f.p.on_readings(f.t, f.mem(150), true).actions.empty());
  f.advance(1s);
  Step s = f.p.on_readings(f.t, f.mem(150), true);
  CHECK(has(s, Action::Kind::drain));
  REQUIRE(s.decisions.size() == 1);
  CHECK(s.decisions[0].event == "downgrade");
  CHECK(s.decisions[0].context_to == 4096);
  CHECK(f.p.state() == WorkerState::draining);

  s = f.p.on_drained(f.t);
  CHECK(has(s, Action::Kind::stop));
  CHECK(f.p.state() == WorkerState::restarting);
  s = f.p.on_exit(f.t, ExitKind::clean, "");
  CHECK(has(s, Action::Kind::start, 4096));
  CHECK(f.p.oom_kills() == 0);
  CHECK(f.p.restarts() == 1);
  CHECK(f.p.failures() == 0);
}

TEST_CASE("policy: PSI above its threshold counts as low headroom") {
  Fixture f;
  PolicyConfig c = test_config();
  c.psi = 20;
  WorkerPolicy p(1, c);
  p.start(f.t, f.mem(1000));
  p.on_ready(f.t, 5);
  Readings r = f.mem(5000);
  r.psi_some_avg10 = 35;
  p.on_readings(f.t, r, true);
  f.advance(10s);
  CHECK(has(p.on_readings(f.t, r, true), Action::Kind::drain));
}

TEST_CASE("policy: ample headroom for step_up_after steps up one rung, only when idle") {
  Fixture f;
  f.p.start(f.t, f.mem(600));  // 4096
  f.p.on_ready(f.t, 100);
  REQUIRE(f.p.context() == 4096);
  // 8192 needs 400 MiB more; with 500 available 100 would be left: not ample.
  f.p.on_readings(f.t, f.mem(500), true);
  f.advance(120s);
  CHECK(f.p.on_readings(f.t, f.mem(500), true).actions.empty());
  // 700: 300 left above max(min_available 200, reserve 100): ample.
  CHECK(f.p.on_readings(f.t, f.mem(700), true).actions.empty());
  f.advance(59s);
  CHECK(f.p.on_readings(f.t, f.mem(700), true).actions.empty());
  f.advance(2s);
  CHECK(f.p.on_readings(f.t, f.mem(700), false).actions.empty());  // busy: wait
  f.advance(1s);
  Step s = f.p.on_readings(f.t, f.mem(700), true);
  CHECK(has(s, Action::Kind::drain));
  CHECK(s.decisions[0].event == "upgrade");
  CHECK(s.decisions[0].context_to == 8192);
  f.p.on_drained(f.t);
  s = f.p.on_exit(f.t, ExitKind::clean, "");
  CHECK(has(s, Action::Kind::start, 8192));
}

TEST_CASE("policy: a worker on a GPU goes by the GPU's free memory, not the host's") {
  Fixture f;
  PolicyConfig c = test_config();
  c.psi = 20;
  WorkerPolicy p(0, c);
  auto gpu = [](Bytes host_mib, Bytes gpu_mib, double psi = 0) {
    return Readings{host_mib * MiB, psi, gpu_mib * MiB, 80000 * MiB};
  };
  // Start: the rung that fits the GPU's free memory (600 − 100 reserve: 4096), not the host's 100 GiB.
  Step s = p.start(f.t, gpu(100000, 600));
  CHECK(has(s, Action::Kind::start, 4096));
  REQUIRE(s.decisions.size() == 1);
  CHECK(s.decisions[0].reason.find("free on the GPU") != std::string::npos);
  p.on_ready(f.t, 7);

  SUBCASE("host memory low, or host PSI high: nothing, a smaller plan would free none there") {
    for (int i = 0; i < 5; ++i) {
      CHECK(p.on_readings(f.t, gpu(50, 5000, 90), true).actions.empty());
      f.advance(10s);
    }
    CHECK(p.state() == WorkerState::ready);
  }
  SUBCASE("GPU free memory low for `for`: drain, one rung lower") {
    CHECK(p.on_readings(f.t, gpu(100000, 150), true).actions.empty());
    f.advance(10s);
    s = p.on_readings(f.t, gpu(100000, 150), true);
    CHECK(has(s, Action::Kind::drain));
    REQUIRE(s.decisions.size() == 1);
    CHECK(s.decisions[0].event == "downgrade");
    CHECK(s.decisions[0].context_to == 2048);
    CHECK(s.decisions[0].reason.find("150.0 MiB free on the GPU < min_available") != std::string::npos);
    bool figure = false;
    for (const auto& [k, v] : s.decisions[0].figures) figure |= k == "DS4_GPU_FREE" && v == std::to_string(150 * MiB);
    CHECK(figure);
  }
  SUBCASE("step up only when the GPU has room for the larger plan") {
    // 8192 needs 400 MiB more: 500 free on the GPU would leave 100, below min_available; host is ample.
    for (int i = 0; i < 5; ++i) {
      CHECK(p.on_readings(f.t, gpu(100000, 500), true).actions.empty());
      f.advance(60s);
    }
    CHECK(p.on_readings(f.t, gpu(100000, 700), true).actions.empty());
    f.advance(61s);
    s = p.on_readings(f.t, gpu(100000, 700), true);
    CHECK(has(s, Action::Kind::drain));
    REQUIRE(s.decisions.size() == 1);
    CHECK(s.decisions[0].event == "upgrade");
    CHECK(s.decisions[0].context_to == 8192);
  }
}

TEST_CASE("policy: a GPU worker whose GPU's free memory is not known yet starts at the largest rung") {
  Fixture f;
  Readings r{100 * MiB, 0, std::nullopt, std::nullopt};  // host: far too little for any plan
  r.on_gpu = true;                                      // but the plan lives on the GPU
  Step s = f.p.start(f.t, r);
  CHECK(has(s, Action::Kind::start, 8192));
  REQUIRE(s.decisions.size() == 1);
  CHECK(s.decisions[0].reason.find("not known yet") != std::string::npos);
  f.p.on_ready(f.t, 3);
  // Nothing known, nothing decided: no downgrade however long.
  for (int i = 0; i < 5; ++i) {
    CHECK(f.p.on_readings(f.t, r, true).actions.empty());
    f.advance(30s);
  }
  // The same host reading for a host worker picks the smallest rung.
  WorkerPolicy host(1, test_config());
  r.on_gpu = false;
  CHECK(has(host.start(f.t, r), Action::Kind::start, 2048));
}

TEST_CASE("policy: step_up_after 0 never steps up") {
  Fixture f;
  PolicyConfig c = test_config();
  c.step_up_after = 0s;
  WorkerPolicy p(0, c);
  p.start(f.t, f.mem(600));
  p.on_ready(f.t, 1);
  for (int i = 0; i < 10; ++i) {
    f.advance(1h);
    CHECK(p.on_readings(f.t, f.mem(100000), true).actions.empty());
  }
}

TEST_CASE("policy: a crash loop backs off exponentially up to backoff_max and keeps the error") {
  Fixture f;
  f.p.start(f.t, f.mem(1000));
  f.p.on_ready(f.t, 100);
  Step s = f.p.on_exit(f.t, ExitKind::crash, "boom 1");
  CHECK(has(s, Action::Kind::start, 8192));  // the first: at once
  CHECK(s.decisions[0].event == "restart");
  CHECK_FALSE(f.p.degraded());
  std::vector<Duration> waits;
  for (int i = 0; i < 6; ++i) {
    s = f.p.on_exit(f.t, ExitKind::crash, "boom " + std::to_string(i + 2));
    CHECK(s.actions.empty());
    CHECK(f.p.state() == WorkerState::backoff);
    CHECK(f.p.degraded());
    REQUIRE(f.p.next_wakeup());
    waits.push_back(std::chrono::duration_cast<Duration>(*f.p.next_wakeup() - f.t));
    CHECK(s.decisions[0].event == "backoff");
    // Not before the time.
    CHECK(f.p.on_timer(f.t + waits.back() - 1ms).actions.empty());
    f.t += waits.back();
    s = f.p.on_timer(f.t);
    CHECK(has(s, Action::Kind::start, 8192));
  }
  CHECK(waits == std::vector<Duration>{1s, 2s, 4s, 8s, 8s, 8s});
  CHECK(f.p.last_error() == "boom 7");
  // Ready for healthy_after ends the loop.
  f.p.on_ready(f.t, 7);
  f.advance(3s);
  s = f.p.on_exit(f.t, ExitKind::crash, "again");
  CHECK(has(s, Action::Kind::start));
  CHECK(f.p.failures() == 1);
}

TEST_CASE("policy: a worker that served and is then killed again and again is restarted at once each time") {
  Fixture f;
  f.p.start(f.t, f.mem(1000));
  f.p.on_ready(f.t, 100);
  f.advance(10s);  // served for 10 s
  for (int kill = 0; kill < 3; ++kill) {  // then killed three times in 20 s
    Step s = f.p.on_exit(f.t, ExitKind::killed, "");
    CHECK(has(s, Action::Kind::start, 8192));
    CHECK(s.decisions[0].event == "restart");
    CHECK(f.p.state() != WorkerState::backoff);
    CHECK_FALSE(f.p.degraded());
    f.advance(200ms);
    f.p.on_ready(f.t, 101 + kill);
    f.advance(6500ms);
  }
  // Dying soon after it is ready is a crash loop: the second such exit backs off.
  f.p.on_exit(f.t, ExitKind::crash, "first");
  f.advance(200ms);
  f.p.on_ready(f.t, 200);
  f.advance(1s);  // less than healthy_after
  Step s = f.p.on_exit(f.t, ExitKind::crash, "second");
  CHECK(f.p.state() == WorkerState::backoff);
  CHECK(s.decisions[0].event == "backoff");
}

TEST_CASE("policy: a person's kill restarts at the same rung, not lower") {
  Fixture f;
  f.p.start(f.t, f.mem(1000));
  f.p.on_ready(f.t, 100);
  Step s = f.p.on_exit(f.t, ExitKind::killed, "");
  CHECK(has(s, Action::Kind::start, 8192));
  CHECK(f.p.oom_kills() == 0);
}

TEST_CASE("policy: admin drain, restart and context") {
  Fixture f;
  f.p.start(f.t, f.mem(1000));
  f.p.on_ready(f.t, 100);
  Step s = f.p.request_drain(f.t);
  CHECK(has(s, Action::Kind::drain));
  REQUIRE(s.decisions.size() == 1);  // journalctl DS4_EVENT=stop finds it
  CHECK(s.decisions[0].event == "stop");
  CHECK(s.decisions[0].reason.find("drain requested by an administrator") != std::string::npos);
  CHECK(f.p.state() == WorkerState::draining);
  CHECK(has(f.p.on_drained(f.t), Action::Kind::stop));
  CHECK(f.p.on_exit(f.t, ExitKind::clean, "").actions.empty());
  CHECK(f.p.state() == WorkerState::stopped);

  s = f.p.request_restart(f.t);
  CHECK(has(s, Action::Kind::start, 8192));
  f.p.on_ready(f.t, 101);

  CHECK_THROWS_AS(f.p.request_context(f.t, 1000), ds4::Error);
  s = f.p.request_context(f.t, 2048);
  CHECK(has(s, Action::Kind::drain));
  CHECK(s.decisions[0].event == "downgrade");
  f.p.on_drained(f.t);
  CHECK(has(f.p.on_exit(f.t, ExitKind::clean, ""), Action::Kind::start, 2048));
}

TEST_CASE("policy: stop, adopt and reconfigure") {
  Fixture f;
  f.p.adopt(f.t, 4096, 55);
  CHECK(f.p.state() == WorkerState::ready);
  CHECK(f.p.context() == 4096);
  Step s = f.p.request_stop(f.t);
  CHECK(has(s, Action::Kind::stop));
  REQUIRE(s.decisions.size() == 1);
  CHECK(s.decisions[0].event == "stop");
  CHECK(s.decisions[0].reason == "the supervisor is stopping");
  CHECK(f.p.on_exit(f.t, ExitKind::clean, "").actions.empty());
  CHECK(f.p.state() == WorkerState::stopped);
  CHECK(f.p.request_stop(f.t).decisions.empty());  // stopped already: nothing to decide

  Fixture g;
  g.p.start(g.t, g.mem(1000));
  g.p.on_ready(g.t, 1);
  PolicyConfig c = test_config();
  c.ladder = planned(ladder_rungs({8192, 1024}), {800 * MiB, 100 * MiB});
  CHECK(g.p.reconfigure(g.t, c).actions.empty());  // 8192 still there
  c.ladder = planned(ladder_rungs({4096, 1024}), {400 * MiB, 100 * MiB});
  s = g.p.reconfigure(g.t, c);
  CHECK(has(s, Action::Kind::drain));
  g.p.on_drained(g.t);
  CHECK(has(g.p.on_exit(g.t, ExitKind::clean, ""), Action::Kind::start, 4096));
}

#include "shared/meminfo.h"
#include "supervisor/headroom.h"

TEST_CASE("headroom: /proc/meminfo and /proc/pressure/memory parsers") {
  CHECK(ds4::mem::meminfo_bytes("MemTotal:       24000000 kB\nMemFree:  1 kB\nMemAvailable:   2048 kB\n", "MemAvailable") ==
        2048u * 1024);
  CHECK_FALSE(ds4::mem::meminfo_bytes("MemTotal: 5 kB\n", "MemAvailable"));
  CHECK(parse_psi_some_avg10("some avg10=12.50 avg60=0.00 avg300=0.00 total=5\nfull avg10=1.00 avg60=0 avg300=0 total=0\n") ==
        doctest::Approx(12.5));
  CHECK_FALSE(parse_psi_some_avg10(""));
  ProcMemorySource real;
  CHECK(real.read().available > 0);
}

TEST_CASE("policy: a stale heartbeat or a mute socket is a hang: kill, then restart at the same rung") {
  Fixture f;
  PolicyConfig c = test_config();
  c.hang_timeout = 2s;
  WorkerPolicy p{3, c};
  p.start(f.t, f.mem(600));  // 4096
  // Not judged before it is ready.
  CHECK(p.on_health(f.t, {Duration(60s), 60s}).actions.empty());
  p.on_ready(f.t, 4242);
  // Fresh heartbeat, answering socket: nothing.
  CHECK(p.on_health(f.t, {Duration(100ms), 0ms}).actions.empty());
  // Exactly the timeout is not yet stale.
  CHECK(p.on_health(f.t, {Duration(2s), 2s}).actions.empty());
  // A worker without a record is judged by its socket alone.
  CHECK(p.on_health(f.t, {std::nullopt, 1s}).actions.empty());

  Step s = p.on_health(f.t, {Duration(2500ms), 0ms});
  REQUIRE(has(s, Action::Kind::kill));
  REQUIRE(s.decisions.size() == 1);
  const Decision& d = s.decisions[0];
  CHECK(d.event == "hang");
  CHECK(d.worker == 3);
  CHECK(d.context_from == 4096);
  CHECK(d.context_to == 4096);
  CHECK(d.reason.find("no heartbeat for 2500ms") != std::string::npos);
  CHECK(d.reason.find("pid 4242") != std::string::npos);
  bool age = false;
  for (const auto& [k, v] : d.figures) age = age || (k == "DS4_HEARTBEAT_AGE_MS" && v == "2500");
  CHECK(age);
  CHECK(p.state() == WorkerState::restarting);
  // Further readings while it dies change nothing.
  CHECK(p.on_health(f.t, {Duration(9s), 9s}).actions.empty());

  // Our SIGKILL's exit: the same rung, at once; not an OOM kill.
  s = p.on_exit(f.t, ExitKind::clean, "killed by the supervisor (SIGKILL)");
  CHECK(has(s, Action::Kind::start, 4096));
  CHECK(p.oom_kills() == 0);
  CHECK(p.restarts() == 1);
  CHECK(p.failures() == 1);

  // A mute socket with a fresh heartbeat (stuck I/O thread) is a hang too.
  p.on_ready(f.t, 4243);
  s = p.on_health(f.t, {Duration(10ms), 3s});
  REQUIRE(has(s, Action::Kind::kill));
  CHECK(s.decisions[0].reason.find("socket unanswered for 3s") != std::string::npos);
  // The second failure in a row backs off instead of restarting at once.
  s = p.on_exit(f.t, ExitKind::clean, "");
  CHECK(s.actions.empty());
  CHECK(p.state() == WorkerState::backoff);
  CHECK(s.decisions[0].event == "backoff");
  REQUIRE(p.next_wakeup());
  f.advance(1s);
  CHECK(has(p.on_timer(f.t), Action::Kind::start, 4096));
}

TEST_CASE("policy: a worker not ready start_timeout after its start is hung there: kill, start again, then back off") {
  Fixture f;
  PolicyConfig c = test_config();
  c.start_timeout = 60s;
  WorkerPolicy p{1, c};
  p.start(f.t, f.mem(600));  // 4096
  f.advance(60s);
  CHECK(p.on_health(f.t, {}).actions.empty());  // exactly the timeout: not yet
  f.advance(1s);
  Step s = p.on_health(f.t, {});
  REQUIRE(has(s, Action::Kind::kill));
  REQUIRE(s.decisions.size() == 1);
  CHECK(s.decisions[0].event == "hang");
  CHECK(s.decisions[0].reason.starts_with("not ready 1m after its start (restart.start_timeout): hung at start"));
  CHECK(p.state() == WorkerState::restarting);
  s = p.on_exit(f.t, ExitKind::clean, "killed by the supervisor (SIGKILL)");
  CHECK(has(s, Action::Kind::start, 4096));
  // A worker that became ready in time is not judged by its start any more.
  p.on_ready(f.t, 7);
  f.advance(10min);
  CHECK(p.on_health(f.t, {}).actions.empty());
  // Hung at start twice in a row: a backoff, not a loop of starts.
  f.advance(1s);
  p.on_exit(f.t, ExitKind::crash, "exited with status 1");  // restarts at once (its first failure)
  f.advance(61s);
  REQUIRE(has(p.on_health(f.t, {}), Action::Kind::kill));
  s = p.on_exit(f.t, ExitKind::clean, "");
  CHECK(p.state() == WorkerState::backoff);
  // start_timeout 0: never.
  Fixture g;
  g.p.start(g.t, g.mem(1000));
  g.advance(24h);
  CHECK(g.p.on_health(g.t, {}).actions.empty());
}

TEST_CASE("policy: hang detection off (hang_timeout 0), or the worker not ready, never kills") {
  Fixture f;  // test_config(): hang_timeout 0
  f.p.start(f.t, f.mem(1000));
  f.p.on_ready(f.t, 1);
  CHECK(f.p.on_health(f.t, {Duration(1h), 1h}).actions.empty());

  PolicyConfig c = test_config();
  c.hang_timeout = 1s;
  WorkerPolicy p{0, c};
  p.start(f.t, f.mem(1000));
  p.on_ready(f.t, 2);
  CHECK(has(p.request_drain(f.t), Action::Kind::drain));
  CHECK(p.on_health(f.t, {Duration(1h), 1h}).actions.empty());  // draining: the drain deadline handles it
}

TEST_CASE("policy: a rung is one record; an empty ladder is refused") {
  // Each rung carries its context, KV cache, host experts and plan together:
  // a reload that changes the plans alone keeps the worker where it is.
  Fixture f;
  f.p.start(f.t, f.mem(1000));
  f.p.on_ready(f.t, 1);
  CHECK(f.p.current() == Rung{8192, 0, "f16", 800 * MiB});
  PolicyConfig c = test_config();
  c.ladder[0].own_bytes = 900 * MiB;
  CHECK(f.p.reconfigure(f.t, c).actions.empty());
  CHECK(f.p.current().own_bytes == 900 * MiB);
  c.ladder.clear();
  CHECK_THROWS_AS(WorkerPolicy(1, c), Error);
  CHECK_THROWS_AS(f.p.reconfigure(f.t, c), Error);
}

TEST_CASE("policy: KV cache rungs (workers.kv_cache) come before expert rungs and a smaller context") {
  PolicyConfig c = test_config();
  c.ladder = ladder_rungs({8192, 4096}, {"f16", "q8_0"}, {0, 4});
  CHECK(contexts(c.ladder) == std::vector<uint32_t>{8192, 8192, 8192, 4096});
  CHECK(kv_caches(c.ladder) == std::vector<std::string>{"f16", "q8_0", "q8_0", "q8_0"});
  CHECK(host_experts(c.ladder) == std::vector<uint32_t>{0, 0, 4, 4});
  CHECK(c.ladder[0].text() == "context 8192");
  CHECK(c.ladder[1].text() == "context 8192 with a q8_0 KV cache");
  CHECK(c.ladder[2].text() == "context 8192 with a q8_0 KV cache and the experts of 4 layers on the host");
  CHECK(find_rung(c.ladder, 8192, 0, "q8_0") == std::optional<size_t>(1));
  CHECK(!find_rung(c.ladder, 4096, 4, "f16"));
  // Without expert rungs: only the KV rungs; a single q8_0 is q8_0 everywhere.
  PolicyConfig k = test_config();
  k.ladder = ladder_rungs({8192, 4096}, {"f16", "q8_0"}, {0});
  CHECK(contexts(k.ladder) == std::vector<uint32_t>{8192, 8192, 4096});
  CHECK(!has_expert_rungs(k.ladder));
  PolicyConfig q = test_config();
  q.ladder = ladder_rungs({8192, 4096}, {"q8_0"}, {0});
  CHECK(contexts(q.ladder) == std::vector<uint32_t>{8192, 4096});
  CHECK(kv_caches(q.ladder) == std::vector<std::string>{"q8_0", "q8_0"});
  const std::vector<Rung> none = ladder_rungs(contexts(test_config().ladder), {"f16"}, {0});
  CHECK(!has_kv_rungs(none));
  CHECK(contexts(none) == contexts(test_config().ladder));

  // An OOM kill at the largest context: the same context with a q8_0 cache.
  const std::vector<Bytes> own = {900 * MiB, 500 * MiB, 300 * MiB};
  k.ladder = planned(k.ladder, own);
  TimePoint t{};
  WorkerPolicy p(0, k);
  Step s = p.start(t, Readings{5000 * MiB});
  REQUIRE(s.actions.size() == 1);
  CHECK(s.actions[0].context == 8192);
  CHECK(s.actions[0].kv_cache == "f16");
  p.on_ready(t, 10);
  t += 5s;
  s = p.on_exit(t, ExitKind::oom, "");
  REQUIRE(s.actions.size() == 1);
  CHECK(s.actions[0].context == 8192);
  CHECK(s.actions[0].kv_cache == "q8_0");
  CHECK(p.kv_cache() == "q8_0");
  REQUIRE(s.decisions.size() == 1);
  CHECK(s.decisions[0].kv_cache_from == std::optional<std::string>("f16"));
  CHECK(s.decisions[0].kv_cache_to == std::optional<std::string>("q8_0"));
  CHECK(s.decisions[0].reason.find("with a q8_0 KV cache") != std::string::npos);
  p.on_ready(t, 11);
  // The next one: a smaller context, still q8_0.
  t += 5s;
  s = p.on_exit(t, ExitKind::oom, "");
  REQUIRE(s.actions.size() == 1);
  CHECK(s.actions[0].context == 4096);
  CHECK(s.actions[0].kv_cache == "q8_0");
  // Start with little room: the q8_0 rung at the largest context fits where f16 does not.
  WorkerPolicy r(1, k);
  s = r.start(t, Readings{650 * MiB});  // 650 - 100 reserve: 500 fits, 900 does not
  REQUIRE(s.actions.size() == 1);
  CHECK(s.actions[0].context == 8192);
  CHECK(s.actions[0].kv_cache == "q8_0");
  // Adopted after a supervisor restart, a worker keeps its KV rung.
  WorkerPolicy a(2, k);
  a.adopt(t, 8192, 30, 0, "q8_0");
  CHECK(a.rung() == 1);
}

TEST_CASE("policy: expert rungs (workers.moe_offload) come before a smaller context, down and back up") {
  PolicyConfig c = test_config();
  c.ladder = ladder_rungs({8192, 4096}, {}, {0, 4, 8});
  // The largest context with each expert rung, then the smaller one with the last.
  CHECK(contexts(c.ladder) == std::vector<uint32_t>{8192, 8192, 8192, 4096});
  CHECK(host_experts(c.ladder) == std::vector<uint32_t>{0, 4, 8, 8});
  CHECK(c.ladder[1].text() == "context 8192 with the experts of 4 layers on the host");
  CHECK(c.ladder[0].text() == "context 8192");
  CHECK(find_rung(c.ladder, 8192, 8) == std::optional<size_t>(2));
  CHECK(!find_rung(c.ladder, 4096, 0));
  const std::vector<Rung> one = ladder_rungs(contexts(test_config().ladder), {}, {0});  // the default: nothing changes
  CHECK(contexts(one) == contexts(test_config().ladder));
  CHECK(!has_expert_rungs(one));

  // A GPU worker's plans: its own copy of the experts its holder lacks shrinks rung by rung.
  const std::vector<Bytes> own = {900 * MiB, 600 * MiB, 300 * MiB, 150 * MiB};
  c.ladder = planned(c.ladder, own);
  TimePoint t{};
  WorkerPolicy p(0, c);
  auto gpu = [](Bytes free_mib) { return Readings{100000 * MiB, 0, free_mib * MiB, 80000 * MiB}; };
  // Start: the largest rung that fits (750 - 100 reserve: the 4-layer rung's 600).
  Step s = p.start(t, gpu(750));
  REQUIRE(s.actions.size() == 1);
  CHECK(s.actions[0].context == 8192);
  CHECK(s.actions[0].host_experts == 4);
  CHECK(p.host_experts() == 4);
  p.on_ready(t, 10);
  // An OOM kill: more experts on the host at the same context ...
  t += 5s;
  s = p.on_exit(t, ExitKind::oom, "");
  REQUIRE(s.actions.size() == 1);
  CHECK(s.actions[0].context == 8192);
  CHECK(s.actions[0].host_experts == 8);
  REQUIRE(s.decisions.size() == 1);
  CHECK(s.decisions[0].event == "oom");
  CHECK(s.decisions[0].host_experts_from == std::optional<uint32_t>(4));
  CHECK(s.decisions[0].host_experts_to == std::optional<uint32_t>(8));
  CHECK(s.decisions[0].reason.find("with the experts of 4 layers on the host") != std::string::npos);
  p.on_ready(t, 11);
  // ... and only past the last expert rung a smaller context.
  t += 5s;
  s = p.on_exit(t, ExitKind::oom, "");
  REQUIRE(s.actions.size() == 1);
  CHECK(s.actions[0].context == 4096);
  CHECK(s.actions[0].host_experts == 8);
  CHECK(s.decisions[0].context_from == 8192);
  CHECK(s.decisions[0].context_to == 4096);
  p.on_ready(t, 12);
  // Low GPU headroom at the bottom: nothing lower, the kernel decides.
  CHECK(p.on_readings(t, gpu(100), true).actions.empty());
  // Ample headroom steps back up the same path: the larger context first, experts still on the host.
  t += 1s;
  CHECK(p.on_readings(t, gpu(5000), true).actions.empty());
  t += 61s;
  s = p.on_readings(t, gpu(5000), true);
  CHECK(has(s, Action::Kind::drain));
  REQUIRE(s.decisions.size() == 1);
  CHECK(s.decisions[0].event == "upgrade");
  CHECK(s.decisions[0].context_to == 8192);
  CHECK(s.decisions[0].host_experts_to == std::optional<uint32_t>(8));
  s = p.on_drained(t);
  s = p.on_exit(t, ExitKind::clean, "");
  REQUIRE(s.actions.size() == 1);
  CHECK(s.actions[0].context == 8192);
  CHECK(s.actions[0].host_experts == 8);
  p.on_ready(t, 13);
  t += 1s;
  CHECK(p.on_readings(t, gpu(5000), true).actions.empty());
  t += 61s;
  s = p.on_readings(t, gpu(5000), true);
  REQUIRE(s.decisions.size() == 1);
  CHECK(s.decisions[0].host_experts_from == std::optional<uint32_t>(8));
  CHECK(s.decisions[0].host_experts_to == std::optional<uint32_t>(4));

  // An administrator's context: of its rungs, the one with the fewest experts on the host.
  WorkerPolicy q(1, c);
  q.start(t, gpu(5000));
  q.on_ready(t, 20);
  s = q.request_context(t, 8192);
  CHECK(s.decisions[0].host_experts_to == std::optional<uint32_t>(0));
  std::string refused;
  try {
    q.request_context(t, 1234);
  } catch (const Error& e) {
    refused = e.what();
  }
  CHECK(refused.find("not on the ladder [8192, 4096]") != std::string::npos);

  // A worker adopted after a supervisor restart keeps its expert rung.
  WorkerPolicy r(2, c);
  r.adopt(t, 8192, 30, 8);
  CHECK(r.rung() == 2);
  CHECK(r.host_experts() == 8);
  // A reload that keeps the rung keeps the worker; one without expert rungs moves it.
  CHECK(r.reconfigure(t, c).actions.empty());
  CHECK(r.rung() == 2);
  s = r.reconfigure(t, test_config());
  REQUIRE(s.decisions.size() == 1);
  CHECK(s.decisions[0].context_to == 8192);
  CHECK(has(s, Action::Kind::drain));
}
