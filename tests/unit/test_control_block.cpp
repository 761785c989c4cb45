// The control block (shared/control_block.h): a real POSIX shared-memory
// segment, written through Writer and read back as the supervisor does.
#include <doctest/doctest.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <string>

#include "shared/control_block.h"
#include "shared/error.h"

using namespace ds4;
using namespace ds4::control;

namespace {

/// A segment name of its own per test run; removed afterwards.
struct TempSegment {
  std::string name = "/ds4-control-test-" + std::to_string(getpid());
  TempSegment() { Block::remove(name); }
  ~TempSegment() { Block::remove(name); }
};

}  // namespace

TEST_CASE("control block: a worker's record is read back by the supervisor") {
  TempSegment seg;
  Block sup = Block::create_or_open(seg.name);
  CHECK_FALSE(sup.read(2).has_value());  // never written

  Writer w(Block::attach(seg.name), 2, 4321);
  auto r = sup.read(2);
  REQUIRE(r);
  CHECK(r->pid == 4321);
  CHECK(r->id == 2);
  CHECK(r->state == RecordState::starting);

  w.set_plan(2048, 4, 1000, 2000, 300);
  w.set_state(RecordState::ready);
  w.count_request(10, 5, false);
  w.count_request(7, 0, true);
  w.count_error();
  w.set_device_memory(3ull << 30, 8ull << 30);
  w.beat();
  r = sup.read(2);
  REQUIRE(r);
  CHECK(r->state == RecordState::ready);
  CHECK(r->context == 2048);
  CHECK(r->slots == 4);
  CHECK(r->plan_weights == 1000);
  CHECK(r->plan_kv == 2000);
  CHECK(r->plan_scratch == 300);
  CHECK(r->requests == 2);
  CHECK(r->tokens_in == 17);
  CHECK(r->tokens_out == 5);
  CHECK(r->errors == 2);
  CHECK(r->on_gpu());
  CHECK(r->gpu_free == (3ull << 30));
  CHECK(r->gpu_total == (8ull << 30));
  CHECK(r->beats == 1);
  CHECK(sup.read(1) == std::nullopt);  // other records stay empty

  // A supervisor restarted finds the same segment and the record in it.
  Block again = Block::create_or_open(seg.name);
  REQUIRE(again.read(2));
  CHECK(again.read(2)->requests == 2);

  // A new process behind the same id starts from zero.
  Writer w2(Block::attach(seg.name), 2, 5555);
  r = sup.read(2);
  REQUIRE(r);
  CHECK(r->pid == 5555);
  CHECK(r->requests == 0);
  CHECK_FALSE(r->on_gpu());
  CHECK_THROWS_AS(Writer(Block::attach(seg.name), int(kMaxWorkers), 1), Error);
}

TEST_CASE("control block: heartbeat age tells a live worker from a stale one") {
  TempSegment seg;
  Block sup = Block::create_or_open(seg.name);
  Writer w(Block::attach(seg.name), 0, 99);
  w.beat();
  const int64_t beat = sup.read(0)->heartbeat_ns;
  CHECK(sup.read(0)->heartbeat_age_ms(beat + 150'000'000) == 150);
  CHECK(sup.read(0)->heartbeat_age_ms(beat - 5) == 0);  // a clock read before the beat
  // Real time: without beats the age grows; a beat makes it fresh again.
  usleep(120'000);
  CHECK(sup.read(0)->heartbeat_age_ms(monotonic_ns()) >= 100);
  w.beat();
  CHECK(sup.read(0)->heartbeat_age_ms(monotonic_ns()) < 100);
  CHECK(sup.read(0)->beats == 2);
}

TEST_CASE("control block: another layout version is refused") {
  TempSegment seg;
  Block sup = Block::create_or_open(seg.name);
  Writer w(Block::attach(seg.name), 1, 77);
  REQUIRE(sup.read(1));
  // A record written by a worker of another layout reads as absent.
  w.record().layout.store(kControlLayout + 1);
  CHECK_FALSE(sup.read(1).has_value());
  CHECK_FALSE(read_record(w.record()).has_value());
  w.record().layout.store(kControlLayout);
  CHECK(sup.read(1));

  // A segment of another layout: a worker refuses it, saying why; the
  // supervisor makes a new one under the same name.
  {
    const int fd = shm_open(seg.name.c_str(), O_RDWR, 0);
    REQUIRE(fd >= 0);
    void* p = mmap(nullptr, 256, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    REQUIRE(p != MAP_FAILED);
    reinterpret_cast<std::atomic<uint32_t>*>(static_cast<char*>(p) + 8)->store(kControlLayout + 1);
    munmap(p, 256);
  }
  CHECK_THROWS_WITH_AS(Block::attach(seg.name),
                       ("control block " + seg.name + ": layout version " + std::to_string(kControlLayout + 1) +
                        ", this worker writes " + std::to_string(kControlLayout))
                           .c_str(),
                       Error);
  Block fresh = Block::create_or_open(seg.name);
  CHECK_FALSE(fresh.read(1).has_value());  // rebuilt empty
  CHECK_NOTHROW(Block::attach(seg.name));
  // No segment at all: the worker says so.
  Block::remove(seg.name);
  CHECK_THROWS_AS(Block::attach(seg.name), Error);
}

TEST_CASE("control block: the segment name is per runtime dir and user") {
  CHECK(segment_name_for("/run/user/1000/ds4") == segment_name_for("/run/user/1000/ds4"));
  CHECK(segment_name_for("/run/user/1000/ds4") != segment_name_for("/tmp/other/ds4"));
  CHECK(segment_name_for("/x").starts_with("/ds4-control-" + std::to_string(getuid()) + "-"));
}
