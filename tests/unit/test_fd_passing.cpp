// A descriptor sent with bytes on a Unix socket arrives with them, usable;
// a second one is closed rather than leaked, and bytes without one leave the
// receiver's descriptor alone.
#include <doctest/doctest.h>

#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>

#include "shared/fd_passing.h"

namespace {

struct Pair {
  int a = -1, b = -1;
  Pair() { REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, &a) == 0); }
  ~Pair() {
    ::close(a);
    ::close(b);
  }
};

bool is_open(int fd) { return ::fcntl(fd, F_GETFD) != -1; }

}  // namespace

TEST_CASE("fd passing: the descriptor arrives with its bytes and works; only the first is kept") {
  Pair s;
  int p[2];
  REQUIRE(::pipe(p) == 0);
  CHECK(ds4::send_with_fd(s.a, "hello\n", p[1]) == 6);
  int q[2];
  REQUIRE(::pipe(q) == 0);
  CHECK(ds4::send_with_fd(s.a, "again\n", q[1]) == 6);

  char buf[64];
  int fd = -1;
  std::string got;
  while (got.size() < 12) {
    const ssize_t n = ds4::recv_with_fd(s.b, buf, sizeof buf, fd);
    REQUIRE(n > 0);
    got.append(buf, size_t(n));
  }
  CHECK(got == "hello\nagain\n");
  REQUIRE(fd >= 0);
  CHECK(fd != p[1]);
  CHECK((::fcntl(fd, F_GETFD) & FD_CLOEXEC) != 0);
  // It is the first pipe's write end: what goes in comes out of p[0].
  CHECK(::write(fd, "x", 1) == 1);
  char c = 0;
  CHECK(::read(p[0], &c, 1) == 1);
  CHECK(c == 'x');
  // The second was closed: with its sender's copy closed too, q[0] reads EOF
  // (a copy left open would make it read EAGAIN).
  ::close(q[1]);
  REQUIRE(::fcntl(q[0], F_SETFL, O_NONBLOCK) == 0);
  CHECK(::read(q[0], &c, 1) == 0);
  ::close(fd);
  ::close(p[0]);
  ::close(p[1]);
  ::close(q[0]);
}

TEST_CASE("fd passing: bytes without a descriptor, and EOF") {
  Pair s;
  REQUIRE(::send(s.a, "plain", 5, 0) == 5);
  char buf[16];
  int fd = -1;
  CHECK(ds4::recv_with_fd(s.b, buf, sizeof buf, fd) == 5);
  CHECK(fd == -1);
  ::shutdown(s.a, SHUT_WR);
  CHECK(ds4::recv_with_fd(s.b, buf, sizeof buf, fd) == 0);
  CHECK(fd == -1);
  CHECK(is_open(s.b));
}
