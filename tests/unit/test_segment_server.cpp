// The segment socket (shared/segment_socket.h, supervisor/segment_server.h):
// the supervisor's server hands a kept memfd segment to a client as a
// read-only descriptor; every failure a worker can meet gives a clear error
// within the client's timeout.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <thread>

#include "shared/error.h"
#include "shared/model_store.h"
#include "shared/segment_socket.h"
#include "supervisor/memfd_segments.h"
#include "supervisor/segment_server.h"

using namespace ds4;
using namespace ds4::sup;
using namespace std::chrono_literals;

namespace {

const std::string kStories = std::string(DS4_SHARED_MODELS) + "/stories260K.gguf";

std::string socket_path(const std::string& what) {
  return (std::filesystem::temp_directory_path() / ("ds4-test-" + std::to_string(::getpid()) + "-" + what + ".sock"))
      .string();
}

std::string fetch_error(const std::string& path, const std::string& handle, std::chrono::milliseconds timeout) {
  try {
    store::fetch_segment_fd(path, handle, timeout);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// The server on an io_context of its own thread, as in the supervisor.
struct Served {
  asio::io_context io;
  MemfdSegments memfds{false};
  std::unique_ptr<SegmentServer> server;
  std::thread thread;
  explicit Served(const std::string& path) {
    server = std::make_unique<SegmentServer>(io, path, memfds, 200ms);
  }
  void start() {
    thread = std::thread([this] {
      auto work = asio::make_work_guard(io);
      io.run();
    });
  }
  ~Served() {
    io.stop();
    if (thread.joinable()) thread.join();
  }
};

}  // namespace

TEST_CASE("segment socket: a worker gets the supervisor's memfd read-only and attaches it") {
  const std::string path = socket_path("segments");
  Served s(path);
  store::LoadOptions opts;
  opts.name = "ds4-test-" + std::to_string(::getpid()) + "-served";
  opts.backing = store::BackingChoice::memfd;
  const store::LoadResult r = store::load(kStories, opts);
  s.memfds.add(r.name, r.fd);
  s.start();

  const store::UniqueFd fd = store::fetch_segment_fd(path, r.name);
  CHECK((::fcntl(fd.get(), F_GETFL) & O_ACCMODE) == O_RDONLY);
  struct stat mine {}, got {};
  ::fstat(r.fd->get(), &mine);
  ::fstat(fd.get(), &got);
  CHECK(mine.st_ino == got.st_ino);  // the same memory, no copy
  const store::Segment seg = store::open_segment(r.name, path);
  CHECK(seg.backing() == store::Backing::memfd);
  CHECK(seg.identity() == store::identify(kStories));
  CHECK(seg.tensors().size() == 48);

  // One it does not keep (an old model's, let go since): refused with why.
  CHECK(fetch_error(path, "memfd:ds4-model-0000000000000000", 2s) ==
        "memfd segment 'ds4-model-0000000000000000': cannot get it from the supervisor's socket " + path +
            ": this supervisor keeps no memfd segment named ds4-model-0000000000000000 (the model changed or was "
            "reloaded; the worker is restarted on the current one)");
  CHECK(fetch_error(path, "memfd:../etc", 2s).find("is not a segment name") != std::string::npos);

  // Let go: later workers cannot get it.
  CHECK(s.memfds.release(r.name) == r.bytes);
  CHECK(fetch_error(path, r.name, 2s).find("keeps no memfd segment") != std::string::npos);
  // A named segment needs no socket at all.
  CHECK_THROWS_WITH_AS(store::open_segment("ds4-test-none", "/nonexistent.sock"),
                       doctest::Contains("does not exist (/dev/shm/ds4-test-none)"), Error);
}

TEST_CASE("segment socket: with no supervisor, or one that does not answer, a worker fails at once or in time") {
  const std::string path = socket_path("gone");
  std::filesystem::remove(path);
  // Nobody there: at once, saying what to check.
  auto t0 = std::chrono::steady_clock::now();
  CHECK(fetch_error(path, "memfd:ds4-model-0123456789abcdef", 5s) ==
        "memfd segment 'ds4-model-0123456789abcdef': cannot get it from the supervisor's socket " + path +
            ": No such file or directory (is ds4-supervisor running? it serves the model's memfd)");
  CHECK(std::chrono::steady_clock::now() - t0 < 1s);

  // A socket that accepts (the kernel does, into its backlog) but nobody answers.
  const int listener = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size());
  REQUIRE(::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
  REQUIRE(::listen(listener, 4) == 0);
  t0 = std::chrono::steady_clock::now();
  CHECK(fetch_error(path, "memfd:ds4-model-0123456789abcdef", 300ms).find("no answer within 300 ms") !=
        std::string::npos);
  const auto waited = std::chrono::steady_clock::now() - t0;
  CHECK(waited >= 250ms);
  CHECK(waited < 2s);
  ::close(listener);
  // Closed since (a supervisor that died): refused at once.
  CHECK(fetch_error(path, "memfd:ds4-model-0123456789abcdef", 5s).find("Connection refused (is ds4-supervisor") !=
        std::string::npos);
  std::filesystem::remove(path);
}

TEST_CASE("segment socket: the server drops a client that never finishes its request") {
  const std::string path = socket_path("slow");
  Served s(path);
  s.start();
  const int c = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size());
  REQUIRE(::connect(c, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
  REQUIRE(::send(c, "ds4-model", 9, 0) == 9);  // no newline, ever
  timeval tv{2, 0};
  ::setsockopt(c, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  char buf[16];
  const auto t0 = std::chrono::steady_clock::now();
  CHECK(::recv(c, buf, sizeof buf, 0) == 0);  // closed by the server after its 200 ms
  CHECK(std::chrono::steady_clock::now() - t0 < 1500ms);
  ::close(c);
}
