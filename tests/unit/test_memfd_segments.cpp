// MemfdSegments (supervisor/memfd_segments.h): what the supervisor does with
// the descriptors systemd's fd store passes back at a start. A child process
// gets them laid out as systemd does (fds 3.., LISTEN_PID, LISTEN_FDS,
// LISTEN_FDNAMES) and reports what it kept.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "shared/model_store.h"
#include "supervisor/memfd_segments.h"

using namespace ds4;
using namespace ds4::sup;

namespace {

const std::string kStories = std::string(DS4_SHARED_MODELS) + "/stories260K.gguf";

store::UniqueFd memfd_of(const std::vector<uint8_t>& bytes, int seals) {
  store::UniqueFd fd(::memfd_create("ds4-test-passed", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  REQUIRE(fd);
  REQUIRE(::write(fd.get(), bytes.data(), bytes.size()) == ssize_t(bytes.size()));
  if (seals) REQUIRE(::fcntl(fd.get(), F_ADD_SEALS, seals) == 0);
  return fd;
}

// In a child: `fds` become 3, 4, ... named `names` (':'-separated), then
// recover() runs; the child writes what it kept, and which passed
// descriptors are still open, to the returned text.
std::string recover_in_child(const std::vector<int>& fds, const std::string& names) {
  int pipefd[2];
  REQUIRE(::pipe(pipefd) == 0);
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    const int out = ::fcntl(pipefd[1], F_DUPFD, 200);
    std::vector<int> high;
    for (int fd : fds) high.push_back(::fcntl(fd, F_DUPFD, 210));
    for (size_t i = 0; i < high.size(); ++i) ::dup2(high[i], 3 + int(i));
    for (int fd : high) ::close(fd);
    ::setenv("LISTEN_PID", std::to_string(::getpid()).c_str(), 1);
    ::setenv("LISTEN_FDS", std::to_string(fds.size()).c_str(), 1);
    ::setenv("LISTEN_FDNAMES", names.c_str(), 1);
    ::unsetenv("NOTIFY_SOCKET");
    // Whatever happens, the child ends here: an exception must not carry it
    // back into the test runner (it would run the remaining tests again).
    std::string report;
    try {
      MemfdSegments m(false);
      m.recover();
      for (const std::string& h : m.handles()) report += "kept " + h + "\n";
      for (size_t i = 0; i < fds.size(); ++i)
        report += "fd " + std::to_string(3 + i) + (::fcntl(3 + int(i), F_GETFD) >= 0 ? " open\n" : " closed\n");
      if (const auto k = m.find(store::identify(kStories))) report += "found " + k->handle + "\n";
      report += std::string("env ") + (std::getenv("LISTEN_FDS") ? "left" : "cleared") + "\n";
    } catch (const std::exception& e) {
      report += std::string("error: ") + e.what() + "\n";
    }
    (void)!::write(out, report.data(), report.size());
    ::_exit(0);
  }
  ::close(pipefd[1]);
  std::string text;
  char buf[512];
  ssize_t n;
  while ((n = ::read(pipefd[0], buf, sizeof buf)) > 0) text.append(buf, size_t(n));
  ::close(pipefd[0]);
  int st = 0;
  ::waitpid(pid, &st, 0);
  CHECK(WIFEXITED(st));
  return text;
}

}  // namespace

TEST_CASE("memfd segments: recover() keeps the ready ds4 segments systemd passes back and drops the rest") {
  store::LoadOptions opts;
  opts.name = "ds4-test-" + std::to_string(::getpid()) + "-recover";
  opts.backing = store::BackingChoice::memfd;
  const store::LoadResult r = store::load(kStories, opts);
  std::vector<uint8_t> whole(r.bytes);
  REQUIRE(::pread(r.fd->get(), whole.data(), whole.size(), 0) == ssize_t(whole.size()));
  const store::UniqueFd unsealed = memfd_of(whole, 0);
  const store::UniqueFd junk = memfd_of(std::vector<uint8_t>(8192, 0x11), store::kMemfdSeals);

  const std::string report =
      recover_in_child({r.fd->get(), unsealed.get(), junk.get(), r.fd->get()},
                       "ds4-model-0123456789abcdef:ds4-model-unsealed:ds4-model-junk:not-ours");
  CHECK(report ==
        "kept memfd:ds4-model-0123456789abcdef\n"
        "fd 3 open\n"     // a ready, sealed segment: kept
        "fd 4 closed\n"   // could still shrink under a reader: dropped
        "fd 5 closed\n"   // no ds4 segment: dropped
        "fd 6 closed\n"   // not named like ours: dropped
        "found memfd:ds4-model-0123456789abcdef\n"  // found by the model's identity
        "env cleared\n");  // workers started later do not inherit LISTEN_FDS
}
