// The supervisor's admin socket (supervisor/admin.h) and runtime paths.
#include <doctest/doctest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <thread>

#include "shared/error.h"
#include "supervisor/admin.h"
#include "supervisor/paths.h"

using namespace ds4::sup;

TEST_CASE("paths: runtime dir under XDG_RUNTIME_DIR, else /tmp/ds4-UID") {
  const char* old = std::getenv("XDG_RUNTIME_DIR");
  const std::string saved = old ? old : "";
  setenv("XDG_RUNTIME_DIR", "/run/user/1234", 1);
  CHECK(runtime_dir() == "/run/user/1234/ds4");
  CHECK(admin_socket_path() == "/run/user/1234/ds4/admin.sock");
  unsetenv("XDG_RUNTIME_DIR");
  CHECK(runtime_dir() == "/tmp/ds4-" + std::to_string(getuid()));
  if (old) setenv("XDG_RUNTIME_DIR", saved.c_str(), 1);
}

TEST_CASE("admin: one request, one answer, over a 0600 socket in a 0700 dir") {
  char tmpl[] = "/tmp/ds4-admin-test.XXXXXX";
  REQUIRE(mkdtemp(tmpl));
  const std::string dir = std::string(tmpl) + "/ds4";
  ensure_private_dir(dir);
  struct stat st {};
  REQUIRE(stat(dir.c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0700);

  asio::io_context io;
  const std::string path = dir + "/admin.sock";
  AdminServer server(io, path, [](const nlohmann::json& r) -> nlohmann::json {
    if (r.value("cmd", "") == "boom") throw ds4::Error("no such thing");
    return {{"ok", true}, {"echo", r}};
  });
  REQUIRE(stat(path.c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0600);

  std::thread t([&] { io.run_for(std::chrono::seconds(5)); });
  const nlohmann::json a = admin_call(path, {{"cmd", "status"}});
  CHECK(a["ok"] == true);
  CHECK(a["echo"]["cmd"] == "status");
  const nlohmann::json b = admin_call(path, {{"cmd", "boom"}});
  CHECK(b["ok"] == false);
  CHECK(b["error"] == "no such thing");
  io.stop();
  t.join();
  server.close();
  CHECK_THROWS_AS(admin_call(path, {{"cmd", "status"}}), ds4::Error);
  std::filesystem::remove_all(tmpl);
}
