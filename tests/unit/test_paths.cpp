// The supervisor's runtime folder: one supervisor per folder (RuntimeDirLock).
#include <doctest/doctest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "shared/error.h"
#include "supervisor/paths.h"

using namespace ds4::sup;

TEST_CASE("runtime folder: a second supervisor's lock is refused, naming the first's pid; free again once released") {
  const std::string dir = std::filesystem::temp_directory_path().string() + "/ds4-test-lock-" + std::to_string(getpid());
  ensure_private_dir(dir);
  {
    RuntimeDirLock first(dir);
    std::string pid;
    std::ifstream(dir + "/supervisor.lock") >> pid;
    CHECK(pid == std::to_string(getpid()));
    // flock conflicts between two opens of the file, in one process as across two.
    CHECK_THROWS_WITH_AS(RuntimeDirLock{dir},
                         ("another ds4-supervisor (pid " + std::to_string(getpid()) + ") runs on " + dir +
                          ": stop it first, or start this one with its own XDG_RUNTIME_DIR")
                             .c_str(),
                         ds4::Error);
    RuntimeDirLock moved = std::move(first);  // still held
    CHECK_THROWS_AS(RuntimeDirLock{dir}, ds4::Error);
  }
  CHECK_NOTHROW(RuntimeDirLock{dir});  // released with its holder
  std::filesystem::remove_all(dir);
}
