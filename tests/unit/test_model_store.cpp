// Model store: loading a GGUF into a named shared-memory segment (or a sealed
// memfd when /dev/shm cannot hold it), reusing it, refusing and rebuilding
// broken ones, sweeping unused ones, and the progress reporter.
// Segments get a per-process test name, so these tests never touch real ones.

#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <stop_token>
#include <string>
#include <vector>

#include "shared/error.h"
#include "shared/files.h"
#include "shared/gguf.h"
#include "shared/gguf_writer.h"
#include "shared/model_store.h"
#include "shared/progress.h"
#include "shared/segment_sweep.h"
#include "worker/runtime.h"

using namespace ds4;
using namespace ds4::store;

namespace {

const std::string kStories = std::string(DS4_SHARED_MODELS) + "/stories260K.gguf";

std::string test_name(const std::string& what) { return "ds4-test-" + std::to_string(::getpid()) + "-" + what; }

std::string temp_path(const std::string& leaf) {
  return (std::filesystem::temp_directory_path() / ("ds4-test-" + std::to_string(::getpid()) + "-" + leaf)).string();
}

// Removes the segment when the test ends, whatever happens.
struct SegmentGuard {
  std::string name;
  explicit SegmentGuard(std::string n) : name(std::move(n)) { remove(name); }
  ~SegmentGuard() { remove(name); }
};

// Maps a segment read-write to damage it the way a crash or an old build would.
struct RawSegment {
  int fd = -1;
  size_t size = 0;
  SegmentHeader* header = nullptr;
  explicit RawSegment(const std::string& name) {
    fd = ::open(("/dev/shm/" + name).c_str(), O_RDWR);
    REQUIRE(fd >= 0);
    size = size_t(::lseek(fd, 0, SEEK_END));
    void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    REQUIRE(p != MAP_FAILED);
    header = static_cast<SegmentHeader*>(p);
  }
  ~RawSegment() {
    ::munmap(header, size);
    ::close(fd);
  }
};

pid_t dead_pid() {
  const pid_t pid = ::fork();
  if (pid == 0) ::_exit(0);
  ::waitpid(pid, nullptr, 0);
  return pid;
}

// A plain file in /dev/shm, as an old or foreign segment looks to a sweep.
void make_shm_file(const std::string& name, size_t bytes) {
  const int fd = ::open(("/dev/shm/" + name).c_str(), O_RDWR | O_CREAT | O_EXCL, 0644);
  REQUIRE(fd >= 0);
  REQUIRE(::posix_fallocate(fd, 0, off_t(bytes)) == 0);
  ::close(fd);
}

// Maps a /dev/shm file read-only for as long as it lives.
struct Mapping {
  void* p = MAP_FAILED;
  size_t size = 0;
  Mapping(const std::string& name, size_t n) : size(n) {
    const int fd = ::open(("/dev/shm/" + name).c_str(), O_RDONLY);
    REQUIRE(fd >= 0);
    p = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
    ::close(fd);
    REQUIRE(p != MAP_FAILED);
  }
  ~Mapping() { ::munmap(p, size); }
};

std::string attach_error(const std::string& name) {
  try {
    Segment::attach(name);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("store: identity and segment name") {
  const Identity id = identify(kStories);
  CHECK(id.path == std::filesystem::canonical(kStories).string());
  CHECK(id.size == 1185376);
  CHECK(id.mtime_ns > 0);
  CHECK(id.header_hash != 0);
  const std::string name = segment_name(id);
  CHECK(name.size() == 10 + 16);
  CHECK(name.rfind("ds4-model-", 0) == 0);
  CHECK(segment_name(id) == name);
  Identity other = id;
  other.mtime_ns += 1;
  CHECK(segment_name(other) != name);
  CHECK_THROWS_WITH_AS(identify("/nonexistent.gguf"), doctest::Contains("/nonexistent.gguf: cannot open"), Error);
}

TEST_CASE("store: loads stories260K into a segment byte for byte") {
  SegmentGuard g(test_name("stories"));
  LoadOptions opts;
  opts.name = g.name;
  std::vector<std::pair<uint64_t, uint64_t>> calls;
  opts.progress = [&](uint64_t done, uint64_t total) { calls.emplace_back(done, total); };
  const LoadResult r = load(kStories, opts);
  CHECK(r.name == g.name);
  CHECK_FALSE(r.reused);
  CHECK(r.rebuild_reason == "");
  REQUIRE(!calls.empty());
  CHECK(calls.back().first == calls.back().second);
  CHECK(calls.back().second > 1000000);

  const gguf::File file = gguf::File::open(kStories);
  const Segment seg = Segment::attach(g.name);
  CHECK(seg.name() == g.name);
  CHECK(seg.identity() == identify(kStories));
  CHECK(seg.bytes() == r.bytes);
  CHECK(seg.bytes() % 4096 == 0);
  CHECK(seg.weight_bytes() >= 1000000);
  CHECK(seg.header().loader_pid == ::getpid());
  CHECK(seg.metadata().metadata().size() == 19);
  CHECK(seg.metadata().get_string("general.architecture") == "llama");
  REQUIRE(seg.tensors().size() == 48);
  for (const gguf::TensorInfo& t : file.tensors()) {
    const TensorRef* ref = seg.find_tensor(t.name);
    REQUIRE(ref);
    CHECK(ref->type == t.type);
    CHECK(ref->n_dims == t.dims.size());
    CHECK(ref->dims[0] == t.dims[0]);
    CHECK(ref->n_bytes == t.n_bytes);
    CHECK(reinterpret_cast<uintptr_t>(ref->data) % kDataAlignment == 0);
    CHECK(std::memcmp(ref->data, file.tensor_data(t).data(), t.n_bytes) == 0);
  }
  CHECK(seg.find_tensor("no.such.tensor") == nullptr);

  const VocabView& v = seg.vocab();
  const auto tokens = *file.get_string_array("tokenizer.ggml.tokens");
  const auto scores = *file.get_float_array("tokenizer.ggml.scores");
  const auto types = *file.get_int_array("tokenizer.ggml.token_type");
  REQUIRE(v.n_tokens == 512);
  REQUIRE(v.scores);
  REQUIRE(v.types);
  for (uint64_t i = 0; i < v.n_tokens; ++i) {
    CHECK(v.token(i) == tokens[i]);
    CHECK(v.scores[i] == scores[i]);
    CHECK(v.types[i] == types[i]);
  }
}

TEST_CASE("store: a ready, matching segment is reused without copying") {
  SegmentGuard g(test_name("reuse"));
  LoadOptions opts;
  opts.name = g.name;
  CHECK_FALSE(load(kStories, opts).reused);
  const int64_t first_load = Segment::attach(g.name).header().loaded_at_ns;

  int progress_calls = 0;
  opts.progress = [&](uint64_t, uint64_t) { ++progress_calls; };
  const LoadResult again = load(kStories, opts);
  CHECK(again.reused);
  CHECK(progress_calls == 0);
  CHECK(Segment::attach(g.name).header().loaded_at_ns == first_load);
  CHECK(ensure_loaded(kStories, opts) == g.name);

  opts.force_rebuild = true;
  const LoadResult forced = load(kStories, opts);
  CHECK_FALSE(forced.reused);
  CHECK(forced.rebuild_reason == "rebuild forced");
  CHECK(Segment::attach(g.name).header().loaded_at_ns > first_load);
}

TEST_CASE("store: a load stopped midway removes what it wrote, named or memfd") {
  // The supervisor stops a reload's load when it is stopped itself.
  for (const BackingChoice backing : {BackingChoice::shm, BackingChoice::memfd}) {
    CAPTURE(int(backing));
    SegmentGuard g(test_name("stopped"));
    std::stop_source stop;
    LoadOptions opts;
    opts.name = g.name;
    opts.backing = backing;
    opts.stop = stop.get_token();
    uint64_t last_done = 0;
    opts.progress = [&](uint64_t done, uint64_t) {
      last_done = done;
      if (done > 0) stop.request_stop();  // after the first tensor
    };
    CHECK_THROWS_WITH_AS(load(kStories, opts), doctest::Contains("loading stopped at"), LoadCancelled);
    CHECK(last_done > 0);
    CHECK(list_segments(g.name).empty());  // nothing half-written is left behind
    // …nor a memfd: no descriptor or mapping of one by that name in this process.
    bool memfd_left = read_whole_file("/proc/self/maps").value_or("").find("/memfd:" + g.name) != std::string::npos;
    for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) {
      std::error_code ec;
      memfd_left |= std::filesystem::read_symlink(e.path(), ec).string().starts_with("/memfd:" + g.name);
    }
    CHECK_FALSE(memfd_left);
    // A later load with no stop asked goes through.
    opts.stop = {};
    opts.progress = nullptr;
    const LoadResult r = load(kStories, opts);
    CHECK(r.bytes > 0);
    CHECK_FALSE(r.reused);
  }
}

TEST_CASE("store: a half-written segment is refused by attach and rebuilt by load") {
  SegmentGuard g(test_name("half"));
  LoadOptions opts;
  opts.name = g.name;
  load(kStories, opts);
  const pid_t dead = dead_pid();
  {
    RawSegment raw(g.name);
    raw.header->state.store(uint32_t(SegmentState::loading));
    raw.header->loader_pid = dead;
  }
  CHECK(attach_error(g.name) == "shared-memory segment '" + g.name + "': was left half-written by loader pid " +
                                    std::to_string(dead) + ", which is no longer running; ensure_loaded rebuilds it");
  const LoadResult r = load(kStories, opts);
  CHECK_FALSE(r.reused);
  CHECK(r.rebuild_reason == "it was left half-written by loader pid " + std::to_string(dead));
  CHECK(Segment::attach(g.name).tensors().size() == 48);
}

TEST_CASE("store: a segment another live process is loading is waited for") {
  SegmentGuard g(test_name("live"));
  LoadOptions opts;
  opts.name = g.name;
  load(kStories, opts);
  RawSegment raw(g.name);
  raw.header->state.store(uint32_t(SegmentState::loading));
  REQUIRE(::flock(raw.fd, LOCK_EX) == 0);  // what a loader holds while it writes
  CHECK(attach_error(g.name).find("still loading (loader pid " + std::to_string(::getpid()) + " is running)") !=
        std::string::npos);
  opts.wait_timeout = std::chrono::milliseconds(150);
  CHECK_THROWS_WITH_AS(load(kStories, opts), doctest::Contains("another process is still loading it"), Error);
  // A stop (the supervisor stopped during its start) ends the wait at once.
  std::stop_source stop;
  stop.request_stop();
  LoadOptions stopping = opts;
  stopping.stop = stop.get_token();
  stopping.wait_timeout = std::chrono::minutes(1);
  CHECK_THROWS_WITH_AS(load(kStories, stopping), doctest::Contains("stopped waiting for another process"),
                       LoadCancelled);
  // The loader finishes: the waiter then finds it ready.
  raw.header->state.store(uint32_t(SegmentState::ready), std::memory_order_release);
  ::flock(raw.fd, LOCK_UN);
  CHECK(load(kStories, opts).reused);
}

TEST_CASE("store: another layout version is refused and rebuilt") {
  SegmentGuard g(test_name("layout"));
  LoadOptions opts;
  opts.name = g.name;
  load(kStories, opts);
  RawSegment(g.name).header->layout_version = 99;
  CHECK(attach_error(g.name) == "shared-memory segment '" + g.name +
                                    "': layout version 99, this build reads layout version 1; the supervisor must "
                                    "rebuild it (restart it, or run ensure_loaded)");
  const LoadResult r = load(kStories, opts);
  CHECK_FALSE(r.reused);
  CHECK(r.rebuild_reason == "it has layout version 99, this build writes 1");
  CHECK_NOTHROW(Segment::attach(g.name));
}

TEST_CASE("store: attach refuses what is not a whole ds4 segment") {
  SegmentGuard g(test_name("junk"));
  CHECK(attach_error(g.name) == "shared-memory segment '" + g.name + "': does not exist (/dev/shm/" + g.name +
                                    "); the supervisor creates it when it loads the model");
  const std::string path = "/dev/shm/" + g.name;
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT, 0600);
  REQUIRE(fd >= 0);
  REQUIRE(::write(fd, "DS4M", 4) == 4);
  CHECK(attach_error(g.name).find("truncated: 4 bytes") != std::string::npos);
  REQUIRE(::ftruncate(fd, 8192) == 0);
  CHECK(attach_error(g.name).find("bad magic") != std::string::npos);
  ::close(fd);

  LoadOptions opts;
  opts.name = g.name;
  remove(g.name);
  load(kStories, opts);
  {
    RawSegment raw(g.name);
    REQUIRE(::ftruncate(raw.fd, off_t(raw.size - 4096)) == 0);
  }
  CHECK(attach_error(g.name).find("differs from the") != std::string::npos);
  {
    RawSegment raw(g.name);
    REQUIRE(::ftruncate(raw.fd, off_t(raw.size + 4096)) == 0);
    auto* records = reinterpret_cast<TensorRecord*>(reinterpret_cast<uint8_t*>(raw.header) + raw.header->dir_offset);
    records[3].offset += 8;
  }
  CHECK(attach_error(g.name).find("tensor record 3 '") != std::string::npos);
}

TEST_CASE("store: remove") {
  SegmentGuard g(test_name("remove"));
  LoadOptions opts;
  opts.name = g.name;
  load(kStories, opts);
  const Segment seg = Segment::attach(g.name);
  const auto listed = list_segments(test_name(""));
  CHECK(std::find(listed.begin(), listed.end(), g.name) != listed.end());
  CHECK(remove(g.name));
  CHECK_FALSE(remove(g.name));
  CHECK(list_segments(g.name).empty());
  CHECK(attach_error(g.name).find("does not exist") != std::string::npos);
  CHECK(seg.tensors().size() == 48);  // an existing mapping stays valid
  CHECK(seg.find_tensor("output.weight")->n_bytes == 64 * 512 * 4);
}

TEST_CASE("store: a sweep removes the segments nobody uses, and only those") {
  SegmentGuard current(test_name("sweep-current")), loading(test_name("sweep-loading")),
      mapped(test_name("sweep-mapped")), old(test_name("sweep-old"));
  for (const SegmentGuard* g : {&current, &loading, &mapped, &old}) make_shm_file(g->name, 8192);
  // A live loader holds its lock while it writes (and maps only later).
  const int lock_fd = ::open(("/dev/shm/" + loading.name).c_str(), O_RDONLY);
  REQUIRE(lock_fd >= 0);
  REQUIRE(::flock(lock_fd, LOCK_EX) == 0);
  SweepOptions opts;
  opts.prefix = test_name("sweep-");
  std::vector<std::string> asked;
  const InUseFn in_use = [&](const std::string& name) {
    asked.push_back(name);
    return name == mapped.name;
  };

  SUBCASE("old enough") {
    opts.min_age = std::chrono::milliseconds(0);
    const SweepResult r = remove_unused_segments(current.name, in_use, opts);
    REQUIRE(r.removed.size() == 1);
    CHECK(r.removed[0].name == old.name);
    CHECK(r.removed[0].bytes == 8192);
    CHECK(r.kept == std::vector<std::string>{loading.name, mapped.name});
    CHECK(list_segments(opts.prefix) == std::vector<std::string>{current.name, loading.name, mapped.name});
    CHECK(asked == std::vector<std::string>{mapped.name, old.name});  // the lock and `keep` decide first
    ::close(lock_fd);  // the loader died: its half-written segment goes too
    const SweepResult again = remove_unused_segments(current.name, in_use, opts);
    REQUIRE(again.removed.size() == 1);
    CHECK(again.removed[0].name == loading.name);
    CHECK(again.kept == std::vector<std::string>{mapped.name});
  }
  SUBCASE("too young: a loader may not hold its lock yet") {
    opts.min_age = std::chrono::minutes(1);
    const SweepResult r = remove_unused_segments(current.name, in_use, opts);
    CHECK(r.removed.empty());
    CHECK(r.kept.size() == 3);
    CHECK(asked.empty());
    ::close(lock_fd);
  }
  CHECK(list_segments(opts.prefix).front() == current.name);
}

TEST_CASE("store: mapped_by_some_process reads every process's maps") {
  SegmentGuard g(test_name("maps"));
  make_shm_file(g.name, 8192);
  CHECK_FALSE(mapped_by_some_process()(g.name));
  CHECK_FALSE(mapped_by_some_process()(test_name("no-such-file")));
  {
    Mapping m(g.name, 8192);
    CHECK(mapped_by_some_process()(g.name));
    // Another file under the same name is not the one mapped.
    REQUIRE(::unlink(("/dev/shm/" + g.name).c_str()) == 0);
    make_shm_file(g.name, 8192);
    CHECK_FALSE(mapped_by_some_process()(g.name));
  }
  // Another process's mapping counts the same.
  int ready[2], hold[2];
  REQUIRE(::pipe(ready) == 0);
  REQUIRE(::pipe(hold) == 0);
  const pid_t child = ::fork();
  if (child == 0) {
    ::close(hold[1]);
    const int fd = ::open(("/dev/shm/" + g.name).c_str(), O_RDONLY);
    void* p = fd >= 0 ? ::mmap(nullptr, 8192, PROT_READ, MAP_SHARED, fd, 0) : MAP_FAILED;
    char c = p == MAP_FAILED ? 'n' : 'y';
    (void)!::write(ready[1], &c, 1);
    (void)!::read(hold[0], &c, 1);  // until the parent closes its end
    ::_exit(0);
  }
  char c = 0;
  REQUIRE(::read(ready[0], &c, 1) == 1);
  REQUIRE(c == 'y');
  const InUseFn seen = mapped_by_some_process();
  CHECK(seen(g.name));
  ::close(hold[1]);
  ::waitpid(child, nullptr, 0);
  CHECK(seen(g.name));  // one look at /proc, taken at the first question
  CHECK_FALSE(mapped_by_some_process()(g.name));
  for (int fd : {ready[0], ready[1], hold[0]}) ::close(fd);

  // The maps format, from a made-up /proc (other entries are ignored).
  struct stat st {};
  REQUIRE(::stat(("/dev/shm/" + g.name).c_str(), &st) == 0);
  const std::filesystem::path proc = temp_path("proc");
  std::filesystem::create_directories(proc / "123");
  std::filesystem::create_directories(proc / "self");
  char line[512];
  std::snprintf(line, sizeof line, "7f0000000000-7f0000002000 r--s 00000000 %02x:%02x %llu        /dev/shm/%s\n",
                major(st.st_dev), minor(st.st_dev), static_cast<unsigned long long>(st.st_ino), g.name.c_str());
  std::ofstream(proc / "123" / "maps") << "55d0c0000000-55d0c0001000 r-xp 00000000 08:01 42  /usr/bin/true\n";
  CHECK_FALSE(mapped_by_some_process(proc.string())(g.name));
  std::ofstream(proc / "123" / "maps", std::ios::app) << line;
  CHECK(mapped_by_some_process(proc.string())(g.name));
  std::filesystem::remove_all(proc);
}

TEST_CASE("store: refuses what ds4 cannot load, before touching shared memory") {
  SegmentGuard g(test_name("refuse"));
  LoadOptions opts;
  opts.name = g.name;
  const std::string path = temp_path("q4k.gguf");

  SUBCASE("a type ds4 cannot compute") {
    gguf::Writer w;
    w.add_tensor("ok", {32}, GgmlType::Q8_0, std::vector<uint8_t>(34));
    w.add_tensor("blk.0.ffn_up.weight", {256}, GgmlType::IQ2_XXS, std::vector<uint8_t>(66));
    w.write(path);
    CHECK_THROWS_WITH_AS(load(path, opts),
                         (path + ": tensor 'blk.0.ffn_up.weight' has type IQ2_XXS, which ds4 cannot compute (supported: "
                                 "F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, "
                                 "IQ4_XS, MXFP4)").c_str(),
                         Error);
  }
  SUBCASE("a model the caller's check refuses (the engine's shape checks, in the daemons)") {
    int checked = 0;
    opts.check = [&](const gguf::File& f) {
      ++checked;
      throw Error(f.source() + ": general.architecture is 'gpt2x'");
    };
    CHECK_THROWS_WITH_AS(load(kStories, opts), (kStories + ": general.architecture is 'gpt2x'").c_str(), Error);
    CHECK(checked == 1);
  }
  SUBCASE("a broken file") {
    const gguf::File stories = gguf::File::open(kStories);  // the bytes below live in its mapping
    const auto head = stories.bytes().first(5000);
    {
      std::ofstream out(path, std::ios::binary);
      out.write(reinterpret_cast<const char*>(head.data()), long(head.size()));
    }
    CHECK_THROWS_WITH_AS(load(path, opts), doctest::Contains((path + ": offset ").c_str()), Error);
  }
  SUBCASE("not enough shared memory, and only shared memory wanted") {
    opts.assume_free_bytes = 1000;
    opts.backing = BackingChoice::shm;
    CHECK_THROWS_WITH_AS(load(kStories, opts),
                         (kStories + ": model needs 1.2 MiB of shared memory, /dev/shm has 1000 bytes free; enlarge it "
                                     "(mount -o remount,size=<bytes> /dev/shm) or remove unused segments there").c_str(),
                         Error);
  }
  CHECK(attach_error(g.name).find("does not exist") != std::string::npos);
  std::filesystem::remove(path);
}

TEST_CASE("store: a synthetic model of every computable type loads") {
  SegmentGuard g(test_name("synthetic"));
  const std::string path = temp_path("synthetic.gguf");
  gguf::Writer w;
  w.set_string("general.architecture", "llama");
  w.add_tensor_generated("f16", {64, 3}, GgmlType::F16, [](uint8_t* out, uint64_t n) { std::memset(out, 1, n); });
  w.add_tensor_generated("bf16", {5}, GgmlType::BF16, [](uint8_t* out, uint64_t n) { std::memset(out, 2, n); });
  w.add_tensor_generated("q8", {64, 2}, GgmlType::Q8_0, [](uint8_t* out, uint64_t n) { std::memset(out, 3, n); });
  w.add_tensor("f32", {1}, GgmlType::F32, {0, 0, 128, 63});
  w.write(path);
  LoadOptions opts;
  opts.name = g.name;
  load(path, opts);
  const Segment seg = Segment::attach(g.name);
  CHECK(seg.vocab().n_tokens == 0);
  REQUIRE(seg.tensors().size() == 4);
  const TensorRef* q8 = seg.find_tensor("q8");
  REQUIRE(q8);
  CHECK(q8->n_bytes == 4 * 34);
  CHECK(static_cast<const uint8_t*>(q8->data)[135] == 3);
  CHECK(*static_cast<const float*>(seg.find_tensor("f32")->data) == 1.0f);
  CHECK(seg.find_tensor("bf16")->n_bytes == 10);
  for (const TensorRef& t : seg.tensors()) CHECK(reinterpret_cast<uintptr_t>(t.data) % kDataAlignment == 0);
  std::filesystem::remove(path);
}

TEST_CASE("store: progress reporter formats and rate-limits") {
  CHECK(format_progress("loading stories260K.gguf", 45, 100, 0) == "loading stories260K.gguf: 45%");
  CHECK(format_progress("loading m.gguf", 812000000, 1624000000, 1.0) == "loading m.gguf: 50% 812 MB/s");
  CHECK(format_progress("loading m.gguf", 0, 0, 1.0) == "loading m.gguf: 100% 0 MB/s");

  double now = 0;
  std::vector<std::string> lines, statuses;
  bool final_seen = false;
  ProgressSinks sinks;
  sinks.clock = [&] { return now; };
  sinks.terminal = [&](const std::string& line, bool final) {
    lines.push_back(line);
    final_seen = final;
  };
  sinks.notify = [&](const std::string& s) { statuses.push_back(s); };
  const ProgressFn report = make_progress_reporter("loading m.gguf", sinks);
  report(0, 1000);
  now = 0.1;
  report(100, 1000);  // too soon: dropped
  now = 0.3;
  report(300, 1000);
  now = 0.35;
  report(1000, 1000);  // the end is always shown
  report(1000, 1000);  // once
  REQUIRE(lines.size() == 3);
  CHECK(lines[1] == "loading m.gguf: 30% 0 MB/s");
  CHECK(lines[2] == "loading m.gguf: 100% 0 MB/s");
  CHECK(final_seen);
  CHECK(statuses == lines);
}

// ---- memfd segments -----------------------------------------------------

namespace {

std::string attach_fd_error(int fd, const std::string& handle) {
  try {
    Segment::attach_fd(fd, handle);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// A memfd holding `bytes` (sealed with `seals`), as a foreign or damaged one would.
UniqueFd raw_memfd(std::span<const uint8_t> bytes, int seals) {
  UniqueFd fd(::memfd_create("ds4-test-raw", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  REQUIRE(fd);
  REQUIRE(::write(fd.get(), bytes.data(), bytes.size()) == ssize_t(bytes.size()));
  if (seals) REQUIRE(::fcntl(fd.get(), F_ADD_SEALS, seals) == 0);
  return fd;
}

}  // namespace

TEST_CASE("store: a model /dev/shm cannot hold goes into a sealed memfd, byte for byte") {
  SegmentGuard g(test_name("memfd-auto"));
  LoadOptions opts;
  opts.name = g.name;
  opts.assume_free_bytes = 1000;  // a container's tiny /dev/shm
  const LoadResult r = load(kStories, opts);
  CHECK(r.backing == Backing::memfd);
  CHECK(r.name.starts_with("memfd:" + g.name + "."));
  CHECK(r.name.size() == 6 + g.name.size() + 17);  // its load's tag
  CHECK(is_memfd_handle(r.name));
  CHECK(handle_name(r.name) == r.name.substr(6));
  CHECK(base_name(r.name) == g.name);
  CHECK(r.memfd_reason.find("/dev/shm cannot hold it") != std::string::npos);
  REQUIRE(r.fd);
  CHECK_FALSE(std::filesystem::exists("/dev/shm/" + g.name));  // nothing named was made
  CHECK(r.bytes == uint64_t(::lseek(r.fd->get(), 0, SEEK_END)));

  // Sealed: its size and bytes can no longer change, by anyone.
  CHECK(::fcntl(r.fd->get(), F_GET_SEALS) == kMemfdSeals);
  // errno is read at once: doctest's reporting between two checks may set it (-s: ENOTTY).
  const int truncated = ::ftruncate(r.fd->get(), off_t(r.bytes / 2));
  const int truncate_errno = errno;
  const ssize_t written = ::pwrite(r.fd->get(), "x", 1, 0);
  const int write_errno = errno;
  CHECK(truncated == -1);
  CHECK(truncate_errno == EPERM);
  CHECK(written == -1);
  CHECK(write_errno == EPERM);
  CHECK(::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, r.fd->get(), 0) == MAP_FAILED);

  // Attached from the descriptor: the same checks and contents as a named one.
  const Segment seg = Segment::attach_fd(r.fd->get(), r.name);
  CHECK(seg.name() == r.name);
  CHECK(seg.backing() == Backing::memfd);
  CHECK(seg.identity() == identify(kStories));
  CHECK(seg.header().state.load() == uint32_t(SegmentState::ready));
  const gguf::File file = gguf::File::open(kStories);
  REQUIRE(seg.tensors().size() == file.tensors().size());
  for (const gguf::TensorInfo& t : file.tensors()) {
    const TensorRef* ref = seg.find_tensor(t.name);
    REQUIRE(ref);
    const auto want = file.tensor_data(t);
    CHECK(std::memcmp(ref->data, want.data(), want.size()) == 0);
  }
  CHECK(seg.vocab().n_tokens == 512);
  // The mapping is read-only and cannot be made writable.
  CHECK(::mprotect(const_cast<void*>(seg.base()), 4096, PROT_READ | PROT_WRITE) == -1);
  CHECK(ready_identity(r.fd->get()) == identify(kStories));
  // A name cannot reach it.
  CHECK(attach_error(r.name).find("has no name to open") != std::string::npos);
}

TEST_CASE("store: model.backing memfd loads into a memfd even where /dev/shm has room") {
  SegmentGuard g(test_name("memfd-chosen"));
  LoadOptions opts;
  opts.name = g.name;
  opts.backing = BackingChoice::memfd;
  const LoadResult first = load(kStories, opts);
  CHECK(first.backing == Backing::memfd);
  CHECK_FALSE(std::filesystem::exists("/dev/shm/" + g.name));
  // Each load makes its own: a memfd cannot be found again by name.
  const LoadResult second = load(kStories, opts);
  CHECK(first.name != second.name);  // two copies, two handles
  struct stat a {}, b {};
  ::fstat(first.fd->get(), &a);
  ::fstat(second.fd->get(), &b);
  CHECK(a.st_ino != b.st_ino);
  // ensure_loaded returns only a name, which would lose a memfd at once.
  CHECK_THROWS_WITH_AS(ensure_loaded(kStories, opts), doctest::Contains("lives only as long as its descriptor"), Error);
  // The mapping outlives the descriptor.
  std::optional<Segment> seg;
  {
    LoadResult r = load(kStories, opts);
    seg.emplace(Segment::attach_fd(r.fd->get(), r.name));
  }
  CHECK(seg->tensors().size() == 48);
  CHECK(seg->find_tensor("output.weight") != nullptr);
}

TEST_CASE("store: a memfd that does not fit memory is refused before anything is written") {
  SegmentGuard g(test_name("memfd-nomem"));
  LoadOptions opts;
  opts.name = g.name;
  opts.backing = BackingChoice::memfd;
  SUBCASE("less memory available than the model needs") {
    opts.assume_available_memory = 1000;
    CHECK_THROWS_WITH_AS(load(kStories, opts),
                         (kStories + ": model needs 1.2 MiB of memory for a memfd segment, only 1000 bytes is "
                                     "available; free memory, raise the cgroup's MemoryMax=, or use a smaller model")
                             .c_str(),
                         Error);
  }
  SUBCASE("the kernel refuses the reservation") {
    // A file-size limit makes the kernel refuse fallocate (EFBIG) as it
    // would refuse memory it cannot charge: the load must stop there.
    rlimit old {};
    REQUIRE(::getrlimit(RLIMIT_FSIZE, &old) == 0);
    const auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
    rlimit small = old;
    small.rlim_cur = 64 * 1024;
    REQUIRE(::setrlimit(RLIMIT_FSIZE, &small) == 0);
    std::string err;
    try {
      load(kStories, opts);
    } catch (const Error& e) {
      err = e.what();
    }
    ::setrlimit(RLIMIT_FSIZE, &old);
    std::signal(SIGXFSZ, old_handler);
    CHECK(err == kStories + ": cannot reserve 1.2 MiB of memory for a memfd segment: File too large");
  }
}

TEST_CASE("store: attach_fd refuses a memfd that is not a whole, sealed ds4 segment") {
  SegmentGuard g(test_name("memfd-bad"));
  LoadOptions opts;
  opts.name = g.name;
  opts.backing = BackingChoice::memfd;
  const LoadResult r = load(kStories, opts);
  const std::string handle = "memfd:" + g.name;
  std::vector<uint8_t> whole(r.bytes);
  REQUIRE(::pread(r.fd->get(), whole.data(), whole.size(), 0) == ssize_t(whole.size()));

  SUBCASE("a good copy, sealed, is accepted") {
    const UniqueFd fd = raw_memfd(whole, kMemfdSeals);
    CHECK(attach_fd_error(fd.get(), handle) == "");
  }
  SUBCASE("unsealed: its size could change under a reader") {
    const UniqueFd fd = raw_memfd(whole, 0);
    CHECK(attach_fd_error(fd.get(), handle) ==
          "memfd segment '" + g.name + "': is a memfd whose size is not sealed; it was not made by the ds4 loader");
    CHECK_FALSE(ready_identity(fd.get()) == std::nullopt);  // the header alone is fine
  }
  SUBCASE("truncated") {
    const UniqueFd fd = raw_memfd(std::span(whole).first(whole.size() - 4096), kMemfdSeals);
    CHECK(attach_fd_error(fd.get(), handle).find("differs from the") != std::string::npos);
    CHECK(ready_identity(fd.get()) == std::nullopt);
  }
  SUBCASE("too small for a header") {
    const UniqueFd fd = raw_memfd(std::span(whole).first(6), kMemfdSeals);
    CHECK(attach_fd_error(fd.get(), handle).find("truncated: 6 bytes") != std::string::npos);
    CHECK(ready_identity(fd.get()) == std::nullopt);
  }
  SUBCASE("not a ds4 segment") {
    std::vector<uint8_t> junk(whole.size(), 0x5a);
    const UniqueFd fd = raw_memfd(junk, kMemfdSeals);
    CHECK(attach_fd_error(fd.get(), handle).find("bad magic") != std::string::npos);
    CHECK(ready_identity(fd.get()) == std::nullopt);
  }
  SUBCASE("half-written: its loader died before `ready`") {
    reinterpret_cast<SegmentHeader*>(whole.data())->state.store(uint32_t(SegmentState::loading));
    const UniqueFd fd = raw_memfd(whole, kMemfdSeals);
    CHECK(attach_fd_error(fd.get(), handle).find("half-written") != std::string::npos);
    CHECK(ready_identity(fd.get()) == std::nullopt);
  }
}

TEST_CASE("store: fd_mapped_by_some_process finds a memfd's mappings") {
  LoadOptions opts;
  opts.name = test_name("memfd-mapped");
  opts.backing = BackingChoice::memfd;
  const LoadResult r = load(kStories, opts);
  CHECK_FALSE(fd_mapped_by_some_process()(r.fd->get()));
  const Segment seg = Segment::attach_fd(r.fd->get(), r.name);
  CHECK(fd_mapped_by_some_process()(r.fd->get()));
}

TEST_CASE("store: a worker refuses a segment that is not the model it names") {
  SUBCASE("the loader's own segment holds the model its name says") {
    // A copy of the model at a path of this test's own: the name the loader
    // gives it (segment_name of its identity) is no real segment's.
    const std::string copy = temp_path("identity.gguf");
    std::filesystem::copy_file(kStories, copy, std::filesystem::copy_options::overwrite_existing);
    SegmentGuard g(segment_name(identify(copy)));
    LoadOptions opts;
    const LoadResult r = load(copy, opts);
    CHECK(r.name == g.name);
    std::filesystem::remove(copy);
    const Segment seg = Segment::attach(r.name);
    CHECK(seg.identity_mismatch() == std::nullopt);
    CHECK(attach_model(r.name, "")->model.hp().n_vocab > 0);
  }
  SUBCASE("a loader-style name that another model's identity does not give") {
    char name[32];
    std::snprintf(name, sizeof name, "ds4-model-%016llx", 0xd5400000000ull + unsigned(::getpid()));
    SegmentGuard g(name);
    LoadOptions opts;
    opts.name = g.name;
    load(kStories, opts);
    const auto why = Segment::attach(g.name).identity_mismatch();
    REQUIRE(why);
    const Identity id = identify(kStories);
    CHECK(*why == "it holds " + id.path + " (" + std::to_string(id.size) + " bytes, mtime " +
                      std::to_string(id.mtime_ns) + " ns), whose segment is " + segment_name(id) + ", not " + g.name);
    CHECK_THROWS_WITH(attach_model(g.name, ""),
                      doctest::Contains(doctest::String(("model segment " + g.name + " is not the model it names: it holds").c_str())));
  }
  SUBCASE("a header whose identity was changed after the loader named the segment") {
    const std::string copy = temp_path("identity2.gguf");
    std::filesystem::copy_file(kStories, copy, std::filesystem::copy_options::overwrite_existing);
    SegmentGuard g(segment_name(identify(copy)));
    LoadOptions opts;
    load(copy, opts);
    std::filesystem::remove(copy);
    REQUIRE(Segment::attach(g.name).identity_mismatch() == std::nullopt);
    {
      RawSegment raw(g.name);
      raw.header->mtime_ns += 1;
    }
    const auto why = Segment::attach(g.name).identity_mismatch();
    REQUIRE(why);
    CHECK(why->find(", not " + g.name) != std::string::npos);
    CHECK_THROWS_WITH(attach_model(g.name, ""), doctest::Contains("is not the model it names: it holds"));
  }
  SUBCASE("test names are not checked against the identity") {
    SegmentGuard g(test_name("named"));
    LoadOptions opts;
    opts.name = g.name;
    load(kStories, opts);
    CHECK(Segment::attach(g.name).identity_mismatch() == std::nullopt);
  }
}

TEST_CASE("model store: pmd_mapped_bytes tells how much of a mapping has 2 MiB pages") {
  constexpr size_t kHuge = size_t(2) << 20, kLen = 3 * kHuge;
  void* raw = ::mmap(nullptr, kLen + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  REQUIRE(raw != MAP_FAILED);
  auto* p = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + kHuge - 1) / kHuge * kHuge);
  // Small pages only: none.
  REQUIRE(::madvise(p, kLen, MADV_NOHUGEPAGE) == 0);
  std::memset(p, 1, kLen);
  CHECK(ds4::store::pmd_mapped_bytes(p) == 0);
  ::munmap(raw, kLen + kHuge);
  raw = ::mmap(nullptr, kLen + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  REQUIRE(raw != MAP_FAILED);
  p = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + kHuge - 1) / kHuge * kHuge);
  const std::optional<std::string> thp = ds4::read_whole_file("/sys/kernel/mm/transparent_hugepage/enabled");
  if (!thp || thp->find("[never]") != std::string::npos || ::madvise(p, kLen, MADV_HUGEPAGE) != 0) {
    MESSAGE("skipped the 2 MiB half: transparent huge pages are off on this machine");
  } else {
    std::memset(p, 1, kLen);
    const uint64_t huge = ds4::store::pmd_mapped_bytes(p + 100);  // any address inside the mapping
    CHECK(huge >= kHuge);
    CHECK(huge <= kLen + kHuge);
  }
  ::munmap(raw, kLen + kHuge);
  CHECK(ds4::store::pmd_mapped_bytes(nullptr) == 0);  // no mapping there
}

// Whether this kernel collapses a memfd's pages into 2 MiB ones on request
// (MADV_COLLAPSE, Linux 6.1; not where shmem_enabled is "deny").
static bool kernel_collapses_shmem() {
  constexpr size_t kHuge = size_t(2) << 20;
  const UniqueFd fd(::memfd_create("ds4-test-collapse", MFD_CLOEXEC));
  if (!fd || ::ftruncate(fd.get(), off_t(2 * kHuge)) != 0) return false;
  void* raw = ::mmap(nullptr, 3 * kHuge, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return false;
  auto* at = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + kHuge - 1) / kHuge * kHuge);
  bool ok = false;
  if (::mmap(at, 2 * kHuge, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd.get(), 0) != MAP_FAILED) {
    std::memset(at, 1, 2 * kHuge);
    ok = ::madvise(at, 2 * kHuge, 25 /* MADV_COLLAPSE */) == 0;
  }
  ::munmap(raw, 3 * kHuge);
  return ok;
}

TEST_CASE("store: a segment's weights sit in 2 MiB pages, for its writer and for every reader") {
  // What `ds4ctl status` and the journal report, and what CPU decoding
  // streams from: without any machine setting (Debian's shmem_enabled is
  // "never"), the loader asks for them, and readers map at 2 MiB boundaries.
  constexpr uint64_t kHuge = uint64_t(2) << 20;
  const std::string path = temp_path("huge.gguf");
  gguf::Writer w;
  w.set_string("general.architecture", "llama");
  w.add_tensor_generated("big", {4096, 1536}, GgmlType::F16, [](uint8_t* out, uint64_t n) {  // 12 MiB
    for (uint64_t i = 0; i < n; ++i) out[i] = uint8_t(i * 7);
  });
  w.write(path);
  const bool collapses = kernel_collapses_shmem();
  for (const BackingChoice backing : {BackingChoice::shm, BackingChoice::memfd}) {
    CAPTURE(int(backing));
    SegmentGuard g(test_name("huge"));
    LoadOptions opts;
    opts.name = g.name;
    opts.backing = backing;
    const LoadResult r = load(path, opts);
    CHECK(r.huge_page_bytes <= r.bytes + kHuge);
    const Segment seg = r.fd ? Segment::attach_fd(r.fd->get(), r.name) : Segment::attach(g.name);
    CHECK(reinterpret_cast<uintptr_t>(seg.base()) % kHuge == 0);
    const TensorRef* big = seg.find_tensor("big");
    REQUIRE(big);
    uint64_t sum = 0;  // touch every page, and check the bytes
    for (uint64_t i = 0; i < big->n_bytes; i += 4096) sum += static_cast<const uint8_t*>(big->data)[i] == uint8_t(i * 7);
    CHECK(sum == big->n_bytes / 4096);
    if (!collapses) {
      MESSAGE("skipped the 2 MiB checks: this kernel does not collapse shared memory into 2 MiB pages (MADV_COLLAPSE)");
      continue;
    }
    // 12 MiB of weights: at least the five whole 2 MiB pages inside them.
    CHECK(r.huge_page_bytes >= 5 * kHuge);
    CHECK(pmd_mapped_bytes(seg.base()) >= 5 * kHuge);
  }
  std::filesystem::remove(path);
}
