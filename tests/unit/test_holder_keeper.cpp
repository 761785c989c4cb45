// The supervisor's keeper of the GPU weights holder (supervisor/holder_keeper.h),
// with stand-in holder programs (shell scripts): the real holder needs a GPU
// (tests/integration/test_supervisor_gpu.sh runs it on one).
#include <doctest/doctest.h>

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include "shared/error.h"
#include "shared/fd_passing.h"
#include "supervisor/holder_keeper.h"

using namespace ds4::sup;
namespace fs = std::filesystem;

namespace {

/// A temporary folder with an executable `holder` script that exits with
/// `status`, or with `script` as the holder.
struct FakeHolder {
  std::string dir;
  HolderSettings settings;
  explicit FakeHolder(int status, const std::string& script = "") {
    char tmpl[] = "/tmp/ds4-holder-test.XXXXXX";
    REQUIRE(mkdtemp(tmpl));
    dir = tmpl;
    settings.worker_binary = dir + "/holder";
    std::ofstream(settings.worker_binary) << (script.empty() ? "#!/bin/sh\nexit " + std::to_string(status) + "\n" : script);
    REQUIRE(chmod(settings.worker_binary.c_str(), 0755) == 0);
    settings.segment = "ds4-model-test";
    settings.socket = dir + "/holder.sock";
    settings.ready_timeout = std::chrono::seconds(3);
  }
  ~FakeHolder() { fs::remove_all(dir); }
};

/// Runs `io` for `d` (the keeper's timers: its watch and its restart backoff).
void run_for(asio::io_context& io, std::chrono::milliseconds d) {
  io.restart();
  io.run_for(d);
}

}  // namespace

TEST_CASE("holder keeper: a holder with nothing to hold (integrated GPU) is not restarted") {
  FakeHolder f(ds4::kExitNothingToHold);
  asio::io_context io;
  HolderKeeper k(io, f.settings);
  k.start();
  CHECK(k.status()["state"] == "not_needed");
  run_for(io, std::chrono::milliseconds(2500));  // past the first restart backoff (1 s)
  CHECK(k.status()["state"] == "not_needed");
  CHECK(k.status()["restarts"] == 0);
  CHECK(k.status()["pid"].is_null());
  k.stop();
}

TEST_CASE("holder keeper: a holder that fails is restarted after a backoff") {
  FakeHolder f(1);
  asio::io_context io;
  HolderKeeper k(io, f.settings);
  k.start();
  CHECK(k.status()["state"] == "stopped");
  run_for(io, std::chrono::milliseconds(2500));
  CHECK(k.status()["restarts"].get<int>() >= 1);
  k.stop();
}

namespace {

/// A holder that answers on its --socket after `delay_s` (as the real one
/// does once the weights are on the GPU) and then waits to be stopped.
std::string answering_holder(double delay_s) {
  return "#!/usr/bin/env python3\n"
         "import os, socket, sys, time\n"
         "time.sleep(" + std::to_string(delay_s) + ")\n"
         "path = sys.argv[sys.argv.index('--socket') + 1]\n"
         "if os.path.exists(path): os.unlink(path)  # left by the one before, as the real holder does\n"
         "s = socket.socket(socket.AF_UNIX)\n"
         "s.bind(path)\n"
         "s.listen(8)\n"
         "time.sleep(60)\n";
}

}  // namespace

TEST_CASE("holder keeper: start_async does not block, and settles once the holder answers") {
  FakeHolder f(0, answering_holder(0.4));
  asio::io_context io;
  HolderKeeper k(io, f.settings);
  const auto t0 = std::chrono::steady_clock::now();
  std::chrono::steady_clock::time_point settled_at, ticked_at;
  k.start_async([&] { settled_at = std::chrono::steady_clock::now(); });
  CHECK(k.status()["state"] == "starting");
  // The io thread keeps running other work while the holder copies.
  asio::steady_timer tick(io);
  tick.expires_after(std::chrono::milliseconds(100));
  tick.async_wait([&](boost::system::error_code) { ticked_at = std::chrono::steady_clock::now(); });
  while (settled_at == std::chrono::steady_clock::time_point{} && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(5))
    run_for(io, std::chrono::milliseconds(20));
  REQUIRE(settled_at != std::chrono::steady_clock::time_point{});
  CHECK(ticked_at != std::chrono::steady_clock::time_point{});
  CHECK(ticked_at < settled_at);
  CHECK(settled_at - t0 >= std::chrono::milliseconds(400));
  CHECK(k.status()["state"] == "ready");
  k.stop();
  CHECK(k.status()["state"] == "stopped");
}

TEST_CASE("holder keeper: start_async settles when the holder dies or never answers; stop calls it off") {
  SUBCASE("dies") {
    FakeHolder f(1);
    asio::io_context io;
    HolderKeeper k(io, f.settings);
    bool settled = false;
    k.start_async([&] { settled = true; });
    run_for(io, std::chrono::milliseconds(500));
    CHECK(settled);
    CHECK(k.status()["last_exit"] == "exited with status 1");
    k.stop();
  }
  SUBCASE("never answers: settles at ready_timeout, and the workers copy") {
    FakeHolder f(0, answering_holder(30));
    f.settings.ready_timeout = std::chrono::milliseconds(300);
    asio::io_context io;
    HolderKeeper k(io, f.settings);
    bool settled = false;
    k.start_async([&] { settled = true; });
    run_for(io, std::chrono::milliseconds(150));
    CHECK_FALSE(settled);
    run_for(io, std::chrono::milliseconds(400));
    CHECK(settled);
    CHECK(k.status()["state"] == "starting");  // still watched: it may answer later
    k.stop();
  }
  SUBCASE("stopped first: never settles") {
    FakeHolder f(0, answering_holder(0.2));
    asio::io_context io;
    HolderKeeper k(io, f.settings);
    bool settled = false;
    k.start_async([&] { settled = true; });
    k.stop();
    run_for(io, std::chrono::milliseconds(500));
    CHECK_FALSE(settled);
  }
}

TEST_CASE("holder keeper: change_segment replaces the holder without blocking; the same segment settles at once") {
  FakeHolder f(0, answering_holder(0.1));
  asio::io_context io;
  HolderKeeper k(io, f.settings);
  k.start();
  REQUIRE(k.status()["state"] == "ready");
  const int old_pid = k.status()["pid"].get<int>();
  bool same = false;
  k.change_segment(f.settings.segment, [&] { same = true; });
  run_for(io, std::chrono::milliseconds(10));
  CHECK(same);
  CHECK(k.status()["pid"].get<int>() == old_pid);
  bool settled = false;
  k.change_segment("ds4-model-other", [&] { settled = true; });
  CHECK(k.status()["segment"] == "ds4-model-other");
  CHECK(k.status()["state"] == "starting");
  for (int i = 0; i < 100 && !settled; ++i) run_for(io, std::chrono::milliseconds(20));
  CHECK(settled);
  CHECK(k.status()["state"] == "ready");
  CHECK(k.status()["pid"].get<int>() != old_pid);
  k.stop();
}

namespace {

/// A holder's socket in this process: answers `answers` clients with `line`
/// and a pipe's descriptor attached, as the real holder sends its weights'.
struct LineHolder {
  std::string dir, socket;
  int listener = -1;
  std::thread thread;
  LineHolder(std::string line, int answers) {
    char tmpl[] = "/tmp/ds4-holder-line.XXXXXX";
    REQUIRE(mkdtemp(tmpl));
    dir = tmpl;
    socket = dir + "/holder.sock";
    listener = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::strcpy(a.sun_path, socket.c_str());
    REQUIRE(::bind(listener, reinterpret_cast<const sockaddr*>(&a), sizeof a) == 0);
    REQUIRE(::listen(listener, 4) == 0);
    thread = std::thread([this, line, answers] {
      for (int i = 0; i < answers; ++i) {
        const int c = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
        if (c < 0) return;
        int p[2];
        if (::pipe2(p, O_CLOEXEC) == 0) {
          ds4::send_with_fd(c, line, p[0]);
          ::close(p[0]);
          ::close(p[1]);
        }
        ::close(c);
      }
    });
  }
  /// Until it has answered its clients (and closed what it sent).
  void wait() {
    if (thread.joinable()) thread.join();
  }
  ~LineHolder() {
    ::shutdown(listener, SHUT_RDWR);
    wait();
    ::close(listener);
    fs::remove_all(dir);
  }
};

int open_fds() {
  int n = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator("/proc/self/fd")) ++n;
  return n;
}

}  // namespace

TEST_CASE("holder keeper: the holder's answer gives its GPU's free memory; its descriptor is not kept") {
  SUBCASE("figures") {
    LineHolder h(R"({"ev":"weights","device_free":123456789,"device_total":987654321,"pid":1})" "\n", 1);
    const int before = open_fds();
    const auto m = ask_holder_memory(h.socket, std::chrono::milliseconds(1000));
    h.wait();  // its own ends of the pipe and the connection are closed too
    REQUIRE(m);
    CHECK(m->free == 123456789u);
    CHECK(m->total == 987654321u);
    CHECK(open_fds() == before);  // the weights' descriptor that came along is closed
  }
  SUBCASE("a holder that cannot say (an older one, or CUDA failed): none") {
    LineHolder h(R"({"ev":"weights","pid":1})" "\n", 1);
    CHECK_FALSE(ask_holder_memory(h.socket, std::chrono::milliseconds(1000)));
  }
  SUBCASE("not JSON, or wrong types: none") {
    LineHolder h("{\"device_free\":\"lots\",\"device_total\":1}\nnot json\n", 1);
    CHECK_FALSE(ask_holder_memory(h.socket, std::chrono::milliseconds(1000)));
  }
  SUBCASE("nobody there: none, at once") {
    CHECK_FALSE(ask_holder_memory("/tmp/ds4-no-such-holder.sock", std::chrono::milliseconds(1000)));
  }
  SUBCASE("a holder that never answers: none, within the timeout") {
    LineHolder h("", 0);  // listens, never accepts
    const auto t0 = std::chrono::steady_clock::now();
    CHECK_FALSE(ask_holder_memory(h.socket, std::chrono::milliseconds(200)));
    CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(2));
  }
}

TEST_CASE("holder keeper: device_memory asks the holder once it is ready") {
  // A stand-in holder that answers every client with its figures.
  FakeHolder f(0, "#!/usr/bin/env python3\n"
                  "import os, socket, sys\n"
                  "path = sys.argv[sys.argv.index('--socket') + 1]\n"
                  "s = socket.socket(socket.AF_UNIX)\n"
                  "s.bind(path)\n"
                  "s.listen(8)\n"
                  "while True:\n"
                  "    c, _ = s.accept()\n"
                  "    try: c.sendall(b'{\"ev\":\"weights\",\"device_free\":5000,\"device_total\":8000}\\n')\n"
                  "    except OSError: pass  # the keeper's readiness probe does not read\n"
                  "    c.close()\n");
  asio::io_context io;
  HolderKeeper k(io, f.settings);
  CHECK_FALSE(k.device_memory());  // not started: nobody to ask
  k.start();
  REQUIRE(k.status()["state"] == "ready");
  const auto m = k.device_memory();
  REQUIRE(m);
  CHECK(m->free == 5000u);
  CHECK(m->total == 8000u);
  k.stop();
  CHECK_FALSE(k.device_memory());
}
