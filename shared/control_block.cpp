#include "shared/control_block.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <utility>

#include "shared/error.h"

namespace ds4::control {

namespace {

constexpr char kMagic[8] = {'D', 'S', '4', 'C', 'T', 'R', 'L', '\0'};

/// The segment's first 256 bytes; the records follow.
struct Header {
  char magic[8];
  std::atomic<uint32_t> layout;
  uint32_t capacity;
  uint32_t record_bytes;
  uint8_t reserved[256 - 20];
};
static_assert(sizeof(Header) == 256);

constexpr size_t kBytes = sizeof(Header) + sizeof(Record) * kMaxWorkers;

Header& header(void* base) { return *static_cast<Header*>(base); }

bool header_matches(const Header& h) {
  return std::memcmp(h.magic, kMagic, sizeof kMagic) == 0 && h.layout.load(std::memory_order_acquire) == kControlLayout &&
         h.capacity == kMaxWorkers && h.record_bytes == sizeof(Record);
}

std::string errno_text() { return std::strerror(errno); }

/// Maps `fd` (at least kBytes long) read-write; closes fd.
void* map_fd(int fd, const std::string& name) {
  void* p = ::mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int e = errno;
  ::close(fd);
  if (p == MAP_FAILED) throw Error("control block " + name + ": cannot map it: " + std::strerror(e));
  return p;
}

}  // namespace

const char* record_state_name(RecordState s) {
  switch (s) {
    case RecordState::empty: return "empty";
    case RecordState::starting: return "starting";
    case RecordState::ready: return "ready";
    case RecordState::stopping: return "stopping";
  }
  return "?";
}

int64_t monotonic_ns() {
  timespec ts;
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

int64_t Snapshot::heartbeat_age_ms(int64_t now_ns) const {
  return now_ns > heartbeat_ns ? (now_ns - heartbeat_ns) / 1000000 : 0;
}

std::optional<Snapshot> read_record(const Record& r) {
  if (r.layout.load(std::memory_order_acquire) != kControlLayout) return std::nullopt;
  Snapshot s;
  // pid first: the writer stores it after the first heartbeat, so a matching
  // pid comes with a heartbeat of that process.
  s.pid = r.pid.load(std::memory_order_acquire);
  s.id = r.id.load(std::memory_order_relaxed);
  s.state = RecordState(r.state.load(std::memory_order_relaxed));
  s.heartbeat_ns = r.heartbeat_ns.load(std::memory_order_acquire);
  s.beats = r.beats.load(std::memory_order_relaxed);
  s.started_ns = r.started_ns.load(std::memory_order_relaxed);
  s.context = r.context.load(std::memory_order_relaxed);
  s.slots = r.slots.load(std::memory_order_relaxed);
  s.plan_weights = r.plan_weights.load(std::memory_order_relaxed);
  s.plan_kv = r.plan_kv.load(std::memory_order_relaxed);
  s.plan_scratch = r.plan_scratch.load(std::memory_order_relaxed);
  s.requests = r.requests.load(std::memory_order_relaxed);
  s.tokens_in = r.tokens_in.load(std::memory_order_relaxed);
  s.tokens_out = r.tokens_out.load(std::memory_order_relaxed);
  s.errors = r.errors.load(std::memory_order_relaxed);
  s.gpu_free = r.gpu_free.load(std::memory_order_relaxed);
  s.gpu_total = r.gpu_total.load(std::memory_order_relaxed);
  // A record being re-initialised by a new process reads as absent.
  if (r.layout.load(std::memory_order_acquire) != kControlLayout) return std::nullopt;
  return s;
}

std::string segment_name_for(const std::string& runtime_dir) {
  // FNV-1a, 64 bits: stable across builds and runs.
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : runtime_dir) {
    h ^= c;
    h *= 1099511628211ull;
  }
  char buf[64];
  std::snprintf(buf, sizeof buf, "/ds4-control-%u-%016llx", unsigned(::getuid()), (unsigned long long)h);
  return buf;
}

Block Block::create_or_open(const std::string& name) {
  int fd = ::shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0600);
  if (fd >= 0) {
    struct stat st{};
    // An older supervisor's block may hold holes: its pages are taken here too.
    if (::fstat(fd, &st) == 0 && size_t(st.st_size) == kBytes && ::posix_fallocate(fd, 0, off_t(kBytes)) == 0) {
      void* p = map_fd(fd, name);
      if (header_matches(header(p))) return Block(name, p, kBytes);
      ::munmap(p, kBytes);
    } else {
      ::close(fd);
    }
    // Another layout (an older supervisor) or half-made: a new one under the
    // same name. Workers still mapping the old one keep writing there,
    // unseen, until they are restarted.
    ::shm_unlink(name.c_str());
  }
  fd = ::shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) throw Error("control block " + name + ": cannot create it: " + errno_text());
  if (::ftruncate(fd, off_t(kBytes)) != 0) {
    const std::string e = errno_text();
    ::close(fd);
    ::shm_unlink(name.c_str());
    throw Error("control block " + name + ": cannot size it to " + std::to_string(kBytes) + " bytes: " + e);
  }
  // ftruncate reserves nothing on tmpfs: with /dev/shm full, the first store
  // into the mapping would be a SIGBUS. Take the pages now, or say why not.
  if (const int rc = ::posix_fallocate(fd, 0, off_t(kBytes)); rc != 0) {
    ::close(fd);
    ::shm_unlink(name.c_str());
    throw Error("control block /dev/shm" + name + ": cannot reserve its " + std::to_string(kBytes) + " bytes: " +
                std::strerror(rc) + (rc == ENOSPC ? " (/dev/shm is full)" : ""));
  }
  void* p = map_fd(fd, name);
  Header& h = header(p);
  std::memcpy(h.magic, kMagic, sizeof kMagic);
  h.capacity = kMaxWorkers;
  h.record_bytes = sizeof(Record);
  h.layout.store(kControlLayout, std::memory_order_release);
  return Block(name, p, kBytes);
}

Block Block::attach(const std::string& name) {
  const int fd = ::shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) throw Error("control block " + name + ": cannot open it: " + errno_text());
  struct stat st{};
  if (::fstat(fd, &st) != 0 || size_t(st.st_size) < sizeof(Header)) {
    ::close(fd);
    throw Error("control block " + name + ": too small to be one");
  }
  if (size_t(st.st_size) != kBytes) {
    ::close(fd);
    throw Error("control block " + name + ": " + std::to_string(st.st_size) + " bytes, expected " +
                std::to_string(kBytes) + " (another layout version)");
  }
  void* p = map_fd(fd, name);
  const Header& h = header(p);
  if (!header_matches(h)) {
    const uint32_t v = h.layout.load();
    ::munmap(p, kBytes);
    throw Error("control block " + name + ": layout version " + std::to_string(v) + ", this worker writes " +
                std::to_string(kControlLayout));
  }
  return Block(name, p, kBytes);
}

bool Block::remove(const std::string& name) { return ::shm_unlink(name.c_str()) == 0; }

Block::Block(Block&& o) noexcept
    : name_(std::move(o.name_)), base_(std::exchange(o.base_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}

Block& Block::operator=(Block&& o) noexcept {
  if (this != &o) {
    if (base_) ::munmap(base_, bytes_);
    name_ = std::move(o.name_);
    base_ = std::exchange(o.base_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
  }
  return *this;
}

Block::~Block() {
  if (base_) ::munmap(base_, bytes_);
}

Record& Block::record(int id) {
  if (id < 0 || uint32_t(id) >= kMaxWorkers)
    throw Error("control block: worker id " + std::to_string(id) + " out of range (0.." +
                std::to_string(kMaxWorkers - 1) + ")");
  return reinterpret_cast<Record*>(static_cast<char*>(base_) + sizeof(Header))[id];
}

std::optional<Snapshot> Block::read(int id) const {
  if (id < 0 || uint32_t(id) >= kMaxWorkers || !base_) return std::nullopt;
  return read_record(reinterpret_cast<const Record*>(static_cast<const char*>(base_) + sizeof(Header))[id]);
}

Writer::Writer(Block block, int id, int pid) : block_(std::move(block)), rec_(&block_.record(id)) {
  Record& r = *rec_;
  r.layout.store(0, std::memory_order_release);  // readers: absent while we reset it
  r.pid.store(0, std::memory_order_relaxed);
  r.id.store(id, std::memory_order_relaxed);
  r.state.store(uint32_t(RecordState::starting), std::memory_order_relaxed);
  r.beats.store(0, std::memory_order_relaxed);
  for (auto* a : {&r.context, &r.slots}) a->store(0, std::memory_order_relaxed);
  for (auto* a : {&r.plan_weights, &r.plan_kv, &r.plan_scratch, &r.requests, &r.tokens_in, &r.tokens_out,
                  &r.errors, &r.gpu_free, &r.gpu_total})
    a->store(0, std::memory_order_relaxed);
  const int64_t now = monotonic_ns();
  r.started_ns.store(now, std::memory_order_relaxed);
  r.heartbeat_ns.store(now, std::memory_order_release);
  r.pid.store(pid, std::memory_order_release);
  r.layout.store(kControlLayout, std::memory_order_release);
}

void Writer::set_plan(int64_t context, int64_t slots, uint64_t weights, uint64_t kv, uint64_t scratch) {
  rec_->context.store(context, std::memory_order_relaxed);
  rec_->slots.store(slots, std::memory_order_relaxed);
  rec_->plan_weights.store(weights, std::memory_order_relaxed);
  rec_->plan_kv.store(kv, std::memory_order_relaxed);
  rec_->plan_scratch.store(scratch, std::memory_order_release);
}

void Writer::set_state(RecordState s) { rec_->state.store(uint32_t(s), std::memory_order_release); }

void Writer::beat() {
  rec_->heartbeat_ns.store(monotonic_ns(), std::memory_order_release);
  rec_->beats.fetch_add(1, std::memory_order_relaxed);
}

void Writer::set_device_memory(uint64_t free, uint64_t total) {
  rec_->gpu_free.store(free, std::memory_order_relaxed);
  rec_->gpu_total.store(total, std::memory_order_release);
}

void Writer::count_request(uint64_t tokens_in, uint64_t tokens_out, bool error) {
  rec_->requests.fetch_add(1, std::memory_order_relaxed);
  rec_->tokens_in.fetch_add(tokens_in, std::memory_order_relaxed);
  rec_->tokens_out.fetch_add(tokens_out, std::memory_order_relaxed);
  if (error) rec_->errors.fetch_add(1, std::memory_order_relaxed);
}

void Writer::count_error() { rec_->errors.fetch_add(1, std::memory_order_relaxed); }

}  // namespace ds4::control
