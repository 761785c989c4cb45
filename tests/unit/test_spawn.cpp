// spawn() with real processes: how they end, what they get (environment,
// descriptors, directory, process group, signal mask), and sd_notify
// messages read back by NotifySocket.
#include <doctest/doctest.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <string>

#include "shared/error.h"
#include "shared/fd_passing.h"
#include "shared/notify_socket.h"
#include "shared/spawn.h"

using namespace std::chrono_literals;
using ds4::Captured;
using ds4::ExitStatus;
using ds4::SpawnOptions;

namespace {

SpawnOptions sh(const std::string& script) {
  SpawnOptions o;
  o.argv = {"/bin/sh", "-c", script};
  return o;
}

Captured run(SpawnOptions o) { return ds4::run_captured(std::move(o), 10s); }

}  // namespace

TEST_CASE("spawn: the exit status and the killing signal") {
  const auto code = ds4::wait_for(ds4::spawn(sh("exit 3")));
  REQUIRE(code);
  CHECK(code->exited());
  CHECK(code->code == 3);
  CHECK(!code->success());
  CHECK(code->describe() == "exited with status 3");

  const auto killed = ds4::wait_for(ds4::spawn(sh("kill -KILL $$")));
  REQUIRE(killed);
  CHECK(killed->signalled());
  CHECK(killed->signal == SIGKILL);
  CHECK(killed->describe() == "killed by signal KILL");

  const auto ok = ds4::wait_for(ds4::spawn(sh("exit 0")));
  CHECK((ok && ok->success()));
}

TEST_CASE("spawn: a program that cannot run ends with 127 and says why") {
  int err[2];
  REQUIRE(::pipe2(err, O_CLOEXEC) == 0);
  SpawnOptions o;
  o.argv = {"/nonexistent/program"};
  o.stderr_fd = err[1];
  const auto st = ds4::wait_for(ds4::spawn(o));
  ::close(err[1]);
  char buf[256] = {};
  const ssize_t n = ::read(err[0], buf, sizeof buf - 1);
  ::close(err[0]);
  REQUIRE(st);
  CHECK(st->code == 127);
  CHECK(std::string(buf, n > 0 ? size_t(n) : 0) == "cannot run /nonexistent/program: No such file or directory\n");
  SpawnOptions path;
  path.argv = {"sh", "-c", "exit 4"};
  path.search_path = true;
  CHECK(ds4::wait_for(ds4::spawn(path))->code == 4);
}

TEST_CASE("spawn: the environment given, or ours without the dropped names") {
  SpawnOptions o = sh("printf '%s|%s' \"$A\" \"$PATH\"");
  o.env = std::vector<std::string>{"A=one two", "PATH=/usr/bin:/bin"};
  CHECK(run(o).out == "one two|/usr/bin:/bin");

  ::setenv("DS4_SPAWN_TEST_KEEP", "kept", 1);
  ::setenv("DS4_SPAWN_TEST_DROP", "dropped", 1);
  ::setenv("DS4_SPAWN_PREFIX_X", "dropped too", 1);
  SpawnOptions d = sh("printf '%s|%s|%s' \"$DS4_SPAWN_TEST_KEEP\" \"$DS4_SPAWN_TEST_DROP\" \"$DS4_SPAWN_PREFIX_X\"");
  d.env = ds4::environment_without({"DS4_SPAWN_TEST_DROP", "DS4_SPAWN_PREFIX_*"});
  CHECK(run(d).out == "kept||");
  ::unsetenv("DS4_SPAWN_TEST_KEEP");
  ::unsetenv("DS4_SPAWN_TEST_DROP");
  ::unsetenv("DS4_SPAWN_PREFIX_X");
}

TEST_CASE("spawn: only the kept descriptors reach the child, as 3, 4, ...") {
  int a[2], b[2];
  REQUIRE(::pipe(a) == 0);  // not close-on-exec: spawn must close it anyway
  REQUIRE(::pipe(b) == 0);
  SpawnOptions o = sh("ls /proc/self/fd | sort -n | tr '\\n' ' '; echo kept >&4");
  o.keep_fds = {a[0], b[1]};  // a's read end as 3, b's write end as 4
  o.set_listen_pid = true;
  const Captured c = run(o);
  ::close(b[1]);
  char buf[16] = {};
  CHECK(::read(b[0], buf, sizeof buf) == 5);
  CHECK(std::string(buf) == "kept\n");
  // 0 1 2, the two kept ones, and the one ls opens to list them.
  CHECK(c.out == "0 1 2 3 4 5 ");
  for (int fd : {a[0], a[1], b[0]}) ::close(fd);

  // As many as the keeper's fd store passes (over a thousand).
  std::vector<int> many;
  for (int i = 0; i < 1100; ++i) many.push_back(::fcntl(0, F_DUPFD_CLOEXEC, 3));
  SpawnOptions m = sh("ls /proc/self/fd | wc -l");
  m.keep_fds = many;
  CHECK(run(m).out == "1104\n");  // 0 1 2, 1100 kept, the listing's own
  for (int fd : many) ::close(fd);

  SpawnOptions l = sh("echo $LISTEN_PID $$");
  l.set_listen_pid = true;
  const std::string out = run(l).out;
  const size_t space = out.find(' ');
  REQUIRE(space != std::string::npos);
  CHECK(out.substr(0, space) + "\n" == out.substr(space + 1));
}

TEST_CASE("spawn: working directory, process group, session and signal mask") {
  SpawnOptions d = sh("pwd");
  d.cwd = "/tmp";
  CHECK(run(d).out == "/tmp\n");

  SpawnOptions g = sh("ps -o pgid= -p $$ | tr -d ' '; echo $$");
  g.new_process_group = true;
  const std::string out = run(g).out;
  const size_t nl = out.find('\n');
  CHECK(out.substr(0, nl + 1) == out.substr(nl + 1));  // its own group: pgid = pid

  SpawnOptions m;  // grep itself (a shell may set its own mask)
  m.argv = {"grep", "SigBlk", "/proc/self/status"};
  m.search_path = true;
  CHECK(run(m).out == "SigBlk:\t0000000000000000\n");
  sigset_t usr1;
  sigemptyset(&usr1);
  sigaddset(&usr1, SIGUSR1);
  m.signal_mask = usr1;
  CHECK(run(m).out == "SigBlk:\t0000000000000200\n");
}

TEST_CASE("spawn: run_captured kills what overstays its timeout") {
  const auto t0 = std::chrono::steady_clock::now();
  const Captured c = ds4::run_captured(sh("echo started; exec sleep 30"), 300ms);
  CHECK(c.timed_out);
  CHECK(c.out == "started\n");
  CHECK(c.status.signalled());
  CHECK(c.status.signal == SIGKILL);
  CHECK(std::chrono::steady_clock::now() - t0 < 5s);
}

TEST_CASE("notify socket: a datagram with its sender's pid and descriptors") {
  const std::string path = "/tmp/ds4-test-notify-" + std::to_string(::getpid()) + ".sock";
  ds4::NotifySocket n(path);
  CHECK(n.address() == path);
  CHECK(!n.receive());

  // As sd_notify sends it, from a child (its pid comes as credentials).
  SpawnOptions o = sh("printf 'READY=1\\nSTATUS=serving\\nSTATUS=busy' | "
                      "python3 -c 'import socket,sys; s=socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); "
                      "s.sendto(sys.stdin.buffer.read(), sys.argv[1])' " + path);
  const pid_t pid = ds4::spawn(o);
  ds4::wait_for(pid);
  const auto m = n.receive();
  REQUIRE(m);
  CHECK(m->pid > 0);
  CHECK(m->has("READY=1"));
  CHECK(!m->has("READY"));
  CHECK(m->value("STATUS") == "busy");
  CHECK(!m->value("FDNAME"));

  // FDSTORE=1 with a descriptor, from this process.
  int p[2];
  REQUIRE(::pipe(p) == 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  const int s = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  REQUIRE(::connect(s, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
  const std::string_view text = "FDSTORE=1\nFDNAME=conn";
  REQUIRE(ds4::send_with_fd(s, text, p[1]) == ssize_t(text.size()));
  ::close(s);
  const auto f = n.receive();
  REQUIRE(f);
  CHECK(f->pid == ::getpid());
  CHECK(f->has("FDSTORE=1"));
  CHECK(f->value("FDNAME") == "conn");
  REQUIRE(f->fds.size() == 1);
  CHECK(::write(f->fds[0], "x", 1) == 1);  // the pipe's write end, received
  char c = 0;
  CHECK(::read(p[0], &c, 1) == 1);
  for (int fd : {p[0], p[1], f->fds[0]}) ::close(fd);

  ds4::NotifySocket abstract("@ds4-test-notify-" + std::to_string(::getpid()));
  CHECK(abstract.fd() >= 0);
  CHECK_THROWS_AS(ds4::NotifySocket("/nonexistent/dir/notify.sock"), ds4::Error);
}
