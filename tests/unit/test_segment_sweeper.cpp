// The segment sweeper (supervisor/segment_sweeper.h): it keeps the served
// segment mapped and removes the others once nobody uses them, when a worker
// process goes away and at most once per interval. The segments here have
// per-process test names; who maps them is scripted.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <unistd.h>

#include <filesystem>
#include <set>
#include <string>

#include "fake_registry.h"
#include "shared/model_store.h"
#include "supervisor/memfd_segments.h"
#include "supervisor/segment_sweeper.h"

using namespace ds4;
using namespace ds4::sup;
using namespace std::chrono_literals;

namespace {

const std::string kStories = std::string(DS4_SHARED_MODELS) + "/stories260K.gguf";

std::string sweeper_name(const std::string& what) {
  return "ds4-test-" + std::to_string(::getpid()) + "-sweeper-" + what;
}

bool exists(const std::string& name) { return std::filesystem::exists("/dev/shm/" + name); }

struct Names {
  std::vector<std::string> all;
  ~Names() {
    for (const auto& n : all) store::remove(n);
  }
  std::string add(const std::string& what) {
    all.push_back(sweeper_name(what));
    store::remove(all.back());
    return all.back();
  }
};

void load_as(const std::string& name) {
  store::LoadOptions o;
  o.name = name;
  store::load(kStories, o);
}

void make_file(const std::string& name) {
  const int fd = ::open(("/dev/shm/" + name).c_str(), O_RDWR | O_CREAT | O_EXCL, 0644);
  REQUIRE(fd >= 0);
  REQUIRE(::ftruncate(fd, 4096) == 0);
  ::close(fd);
}

WorkerInfo worker(int id, int pid) {
  WorkerInfo w;
  w.id = id;
  w.pid = pid;
  w.state = pid > 0 ? WorkerState::ready : WorkerState::restarting;
  return w;
}

}  // namespace

TEST_CASE("sweeper: an old segment goes once its last worker has, the served one stays mapped") {
  Names n;
  const std::string current = n.add("current"), next = n.add("next"), old = n.add("old"), stray = n.add("stray");
  load_as(current);
  load_as(next);
  make_file(old);

  asio::io_context io;
  auto run = [&](std::chrono::milliseconds d) {
    io.restart();
    io.run_for(d);
  };
  std::set<std::string> mapped = {old};  // by worker 0's first process
  int scans = 0;
  SweeperSettings ss;
  ss.sweep.prefix = sweeper_name("");
  ss.sweep.min_age = 0ms;
  ss.min_interval = 300ms;
  ss.recheck = 10min;  // only worker exits sweep again here
  ss.in_use = [&] {
    ++scans;
    return [&](const std::string& name) { return mapped.count(name) > 0; };
  };
  SegmentSweeper sweeper(io, ss);
  test::FakeRegistry registry;
  registry.list = {worker(0, 4242)};
  sweeper.watch(registry);
  registry.changed();

  sweeper.set_current(current);
  CHECK(store::mapped_by_some_process()(current));  // by this process: the sweeper holds it
  run(50ms);
  CHECK(scans == 1);
  CHECK(exists(old));  // its worker still maps it
  CHECK_FALSE(exists(next));  // nobody maps it
  CHECK(exists(current));

  // Worker 0 is replaced: its old process, and its mapping, went away.
  mapped.clear();
  registry.list = {worker(0, 0)};
  registry.changed();
  run(50ms);
  CHECK(exists(old));  // one sweep per min_interval
  run(500ms);
  CHECK_FALSE(exists(old));
  CHECK(scans == 2);

  // Changes that take no process away sweep nothing.
  make_file(stray);
  registry.list = {worker(0, 4343)};
  registry.changed();
  registry.changed();
  run(500ms);
  CHECK(exists(stray));
  CHECK(scans == 2);

  // A new model: the sweeper maps the new segment and lets the old one go.
  load_as(next);
  sweeper.set_current(next);
  CHECK(store::mapped_by_some_process()(next));
  CHECK_FALSE(store::mapped_by_some_process()(current));
  run(500ms);
  CHECK_FALSE(exists(current));
  CHECK_FALSE(exists(stray));
  CHECK(exists(next));

  sweeper.stop();
  make_file(stray);
  sweeper.request();
  run(500ms);
  CHECK(exists(stray));
}

TEST_CASE("sweeper: an old memfd segment is let go once no process maps it; the served one is kept") {
  asio::io_context io;
  auto run = [&](std::chrono::milliseconds d) {
    io.restart();
    io.run_for(d);
  };
  MemfdSegments memfds(false);
  auto load_memfd = [&](const std::string& what) {
    store::LoadOptions o;
    o.name = sweeper_name(what);
    o.backing = store::BackingChoice::memfd;
    store::LoadResult r = store::load(kStories, o);
    memfds.add(r.name, r.fd);
    return r;
  };
  const store::LoadResult first = load_memfd("memfd-first"), second = load_memfd("memfd-second");
  SweeperSettings ss;
  ss.sweep.prefix = sweeper_name("nothing-named-");  // named segments are not this test's business
  ss.min_interval = 100ms;
  ss.recheck = 200ms;
  ss.memfds = &memfds;  // who maps what: the real scan of /proc
  SegmentSweeper sweeper(io, ss);

  // A worker of the first model still maps it (here: this process).
  std::optional<store::Segment> worker_mapping(store::Segment::attach_fd(first.fd->get(), first.name));
  sweeper.set_current(second.name, second.fd.get());
  run(300ms);
  CHECK(memfds.fd(first.name) != nullptr);  // mapped: kept
  CHECK(memfds.fd(second.name) != nullptr);  // served

  // Its last worker is gone: released at the next recheck.
  worker_mapping.reset();
  run(500ms);
  CHECK(memfds.fd(first.name) == nullptr);
  CHECK(memfds.fd(second.name) != nullptr);  // served, and mapped by the sweeper itself
  CHECK(store::fd_mapped_by_some_process()(second.fd->get()));
  CHECK(memfds.handles() == std::vector<std::string>{second.name});

  // A reload's new model, loaded but not served yet: nobody maps it, and it
  // must stay (workers are about to ask for it).
  const store::LoadResult third = load_memfd("memfd-third");
  sweeper.request();
  run(500ms);
  CHECK(memfds.fd(third.name) != nullptr);
  // Served now: the one before goes.
  sweeper.set_current(third.name, third.fd.get());
  run(500ms);
  CHECK(memfds.handles() == std::vector<std::string>{third.name});
}

TEST_CASE("sweeper: only this instance's segments are removed; another instance's stay, mapped or not") {
  Names n;
  const std::string mine_old = n.add("mine-old"), mine_now = n.add("mine-now"), theirs = n.add("theirs"),
                    mine_gone = n.add("mine-gone");
  load_as(mine_old);
  load_as(mine_now);
  make_file(theirs);  // another supervisor's (another runtime folder), mapped by nobody
  const std::string ledger_path =
      (std::filesystem::temp_directory_path() / ("ds4-test-ledger-" + std::to_string(::getpid()))).string();
  std::filesystem::remove(ledger_path);
  {
    SegmentLedger earlier(ledger_path);  // what an earlier start of this instance served
    earlier.add(mine_old);
    earlier.add(mine_gone);  // removed by hand since
  }
  asio::io_context io;
  SweeperSettings ss;
  ss.sweep.prefix = sweeper_name("");
  ss.sweep.min_age = 0ms;
  ss.ledger_path = ledger_path;
  ss.in_use = [] { return [](const std::string&) { return false; }; };
  {
    SegmentSweeper sweeper(io, ss);
    sweeper.set_current(mine_now);
    io.run_for(300ms);
    sweeper.stop();
  }
  CHECK_FALSE(exists(mine_old));  // served by this instance before: removed
  CHECK(exists(mine_now));
  CHECK(exists(theirs));  // never served here: kept though nobody maps it
  const SegmentLedger after(ledger_path);
  CHECK(after.names() == std::set<std::string>{mine_now});  // the removed and the gone are unlisted
  std::filesystem::remove(ledger_path);
}
