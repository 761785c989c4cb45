// The supervisor's keeper of the GPU weights holder (supervisor/holder_keeper.h),
// with stand-in holder programs (shell scripts): the real holder needs a GPU
// (tests/integration/test_supervisor_gpu.sh runs it on one).
#include <doctest/doctest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "shared/error.h"
#include "supervisor/holder_keeper.h"

using namespace ds4::sup;
namespace fs = std::filesystem;

namespace {

/// A temporary folder with an executable `holder` script that exits with `status`.
struct FakeHolder {
  std::string dir;
  HolderSettings settings;
  explicit FakeHolder(int status) {
    char tmpl[] = "/tmp/ds4-holder-test.XXXXXX";
    REQUIRE(mkdtemp(tmpl));
    dir = tmpl;
    settings.worker_binary = dir + "/holder";
    std::ofstream(settings.worker_binary) << "#!/bin/sh\nexit " << status << "\n";
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
