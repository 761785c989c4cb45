// Journal entries the systemd backend reacts to (supervisor/journal_watch.h),
// with the lines seen on this project's machines.
#include <doctest/doctest.h>

#include "supervisor/journal_watch.h"

using namespace ds4::sup;

TEST_CASE("journal: the kernel's oom-kill line names the unit by task_memcg") {
  const char* line =
      "oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,"
      "oom_memcg=/ds4-test-1.slice/user@0.service/app.slice/app-ds4\\x2dworker.slice/ds4-worker@0.service,"
      "task_memcg=/ds4-test-1.slice/user@0.service/app.slice/app-ds4\\x2dworker.slice/ds4-worker@0.service,"
      "task=ds4-worker,pid=11271,uid=0";
  CHECK(oom_line_unit(line) == "ds4-worker@0.service");
  JournalEntry e;
  e.transport = "kernel";
  e.message = line;
  const JournalFinding f = classify_journal_entry(e);
  CHECK(f.kind == JournalFinding::Kind::oom_kill);
  CHECK(f.unit == "ds4-worker@0.service");
  // The whole path: another user manager's ds4-worker@0 is told apart by it.
  CHECK(f.cgroup == "/ds4-test-1.slice/user@0.service/app.slice/app-ds4\\x2dworker.slice/ds4-worker@0.service");

  // An oom-kill line of a process in no unit still counts (the backend
  // matches lines against the kernel's counter), naming no unit.
  e.message = "oom-kill:constraint=CONSTRAINT_NONE,nodemask=(null),task_memcg=/,task=python3,pid=1,uid=0";
  CHECK(classify_journal_entry(e).kind == JournalFinding::Kind::oom_kill);
  CHECK(classify_journal_entry(e).unit.empty());

  CHECK_FALSE(oom_line_unit("Memory cgroup out of memory: Killed process 11271 (python3)"));
  CHECK_FALSE(oom_line_unit("oom-kill:constraint=CONSTRAINT_NONE,nodemask=(null)"));
  CHECK(oom_line_unit("oom-kill:constraint=CONSTRAINT_NONE,task_memcg=/,task=x") == std::nullopt);
  // The line from another process's OOM kill is not a worker's.
  CHECK(oom_line_unit("oom-kill:constraint=CONSTRAINT_MEMCG,task_memcg=/user.slice/oomtest.service,task=python3") ==
        "oomtest.service");
}

TEST_CASE("journal: systemd's OOM entry, a unit's error, and what is ignored") {
  JournalEntry sd;
  sd.message = "ds4-worker@1.service: A process of this unit has been killed by the OOM killer.";
  sd.message_id = kOomMessageId;
  sd.user_unit = "ds4-worker@1.service";
  CHECK(classify_journal_entry(sd).kind == JournalFinding::Kind::oom_kill);
  CHECK(classify_journal_entry(sd).unit == "ds4-worker@1.service");

  JournalEntry err;
  err.message = "ds4-worker serve: memory plan does not fit";
  err.source_unit = "ds4-worker@2.service";
  err.priority = 3;
  const JournalFinding f = classify_journal_entry(err);
  CHECK(f.kind == JournalFinding::Kind::error_message);
  CHECK(f.text == err.message);

  err.priority = 6;  // info: not an error
  CHECK(classify_journal_entry(err).kind == JournalFinding::Kind::none);

  JournalEntry exit;  // "Main process exited, code=killed, status=9/KILL": a unit result, not OOM evidence
  exit.message = "ds4-worker@0.service: Main process exited, code=killed, status=9/KILL";
  exit.user_unit = "ds4-worker@0.service";
  exit.message_id = "98e322203f7a4ed290d09fe03c09fe15";
  CHECK(classify_journal_entry(exit).kind == JournalFinding::Kind::none);
}
