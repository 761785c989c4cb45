// Structured journal logging (shared/log.h): what is sent and printed.
#include <doctest/doctest.h>

#include <vector>

#include "shared/log.h"

TEST_CASE("log: field names are made valid for the journal") {
  CHECK(ds4::log::field_name("DS4_EVENT") == "DS4_EVENT");
  CHECK(ds4::log::field_name("ds4_worker") == "DS4_WORKER");
  CHECK(ds4::log::field_name("context-from") == "CONTEXT_FROM");
  CHECK(ds4::log::field_name("_PID") == "PID");  // trusted fields are journald's alone
  CHECK(ds4::log::field_name("9lives") == "LIVES");
  CHECK(ds4::log::field_name("") == "");
  CHECK(ds4::log::field_name(std::string(80, 'A')).size() == 64);
}

TEST_CASE("log: the stderr line") {
  const std::vector<ds4::log::Field> fields = {{"DS4_EVENT", "oom"}, {"DS4_WORKER", "0"}};
  CHECK(ds4::log::format_line("ds4-supervisor", ds4::log::Level::warn, "worker 0 OOM-killed", fields) ==
        "ds4-supervisor: warning: worker 0 OOM-killed (DS4_EVENT=oom, DS4_WORKER=0)\n");
  CHECK(ds4::log::format_line("ds4", ds4::log::Level::info, "ready", {}) == "ds4: ready\n");
  CHECK(ds4::log::format_line("ds4", ds4::log::Level::error, "boom", {}) == "ds4: error: boom\n");
  CHECK(ds4::log::format_line("ds4", ds4::log::Level::debug, "x", {}) == "ds4: debug: x\n");
}

TEST_CASE("log: calls from many threads do not crash, journal or not") {
  ds4::log::set_identifier("ds4-unit-test");
  ds4::log::set_level(ds4::log::Level::error);  // keep the test's output and the journal quiet
  ds4::log::info("dropped below the level", {{"DS4_TEST", "1"}});
  ds4::log::set_level(ds4::log::Level::debug);
  ds4::log::set_identifier("ds4");
}
