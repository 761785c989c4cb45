#include "shared/model_store.h"

#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/sysmacros.h>
#include <fcntl.h>
#include <unistd.h>

#include <boost/interprocess/mapped_region.hpp>
#include <boost/interprocess/shared_memory_object.hpp>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <new>
#include <set>
#include <thread>
#include <utility>

#include "shared/bytes.h"
#include "shared/error.h"
#include "shared/files.h"
#include "shared/meminfo.h"

namespace ds4::store {

namespace bip = boost::interprocess;

namespace {

constexpr uint64_t kRegionAlignment = 64;
constexpr uint64_t kCopyChunk = uint64_t(8) << 20;  // progress granularity while copying
// 2 MiB pages: a CPU decode step streams every weight once, and from 2 MiB
// pages it runs up to ~1.2x faster than from 4 KiB ones (fewer TLB misses
// and page walks). Shared memory has them only where the machine allows it
// (shmem_enabled, or a tmpfs mounted huge=), which Debian does not by
// default; MADV_COLLAPSE (Linux 6.1) makes them for a range of a memfd or a
// tmpfs file whatever those settings say (but "deny"), without privileges.
// A 2 MiB page maps only where the virtual address and the file offset agree
// modulo 2 MiB: every mapping of a segment starts on a 2 MiB boundary.
constexpr uint64_t kHugePage = uint64_t(2) << 20;
// The writer collapses what it has copied in steps of this many bytes, while
// they are still in the cache.
constexpr uint64_t kCollapseStep = uint64_t(64) << 20;
#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25
#endif

// A segment this young with no header yet is being created by someone right now.
constexpr int64_t kCreationGraceNs = int64_t(5) * 1000 * 1000 * 1000;

uint64_t fnv1a(const void* p, size_t n, uint64_t h = 0xcbf29ce484222325ull) {
  const auto* b = static_cast<const uint8_t*>(p);
  for (size_t i = 0; i < n; ++i) {
    h ^= b[i];
    h *= 0x100000001b3ull;
  }
  return h;
}

uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

// Maps [0, bytes) of fd at a 2 MiB boundary (see kHugePage); MAP_FAILED with
// errno set when it cannot. Unmapped with munmap(p, bytes) like any mapping.
void* map_segment(int fd, uint64_t bytes, int prot) {
  const uint64_t span = bytes + kHugePage;
  void* r = ::mmap(nullptr, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (r == MAP_FAILED) return MAP_FAILED;
  const uintptr_t lo = reinterpret_cast<uintptr_t>(r);
  const uintptr_t at = (lo + kHugePage - 1) & ~uintptr_t(kHugePage - 1);
  void* p = ::mmap(reinterpret_cast<void*>(at), bytes, prot, MAP_SHARED | MAP_FIXED, fd, 0);
  if (p == MAP_FAILED) {
    const int e = errno;
    ::munmap(r, span);
    errno = e;
    return MAP_FAILED;
  }
  // The reservation's ends around the mapping go back.
  const uintptr_t end = at + align_up(bytes, uint64_t(::sysconf(_SC_PAGESIZE)));
  if (at > lo) ::munmap(r, at - lo);
  if (lo + span > end) ::munmap(reinterpret_cast<void*>(end), lo + span - end);
  return p;
}

// Puts a segment mapped by map_segment into 2 MiB pages where the kernel can,
// on a thread of its own that follows the copy (`written`, the bytes before
// which everything is final) in steps of kCollapseStep: a collapse copies
// each 2 MiB piece again, which on one thread added half to a load from the
// page cache; behind the copy it costs no time. Best effort: an older kernel,
// shmem_enabled "deny" or memory too fragmented leave 4 KiB pages, which work
// as well, slower; what it gave is measured afterwards (pmd_mapped_bytes).
class Collapser {
 public:
  explicit Collapser(uint8_t* base) : base_(base), thread_([this] { run(); }) {}
  ~Collapser() { finish(0); }
  // Everything before `written` is final.
  void written(uint64_t written) {
    {
      const std::lock_guard lock(mu_);
      written_ = written;
    }
    cv_.notify_one();
  }
  // Collapses up to `end` (0: nothing more, as when a load is cancelled) and waits for it.
  void finish(uint64_t end) {
    if (!thread_.joinable()) return;
    {
      const std::lock_guard lock(mu_);
      written_ = std::max(written_, end);
      last_ = true;
    }
    cv_.notify_one();
    thread_.join();
  }

 private:
  void run() {
    uint64_t done = 0;
    for (;;) {
      uint64_t upto;
      bool last;
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return last_ || written_ >= done + kCollapseStep; });
        upto = written_, last = last_;
      }
      const uint64_t from = align_up(done, kHugePage), to = upto / kHugePage * kHugePage;
      if (to > from) (void)::madvise(base_ + from, to - from, MADV_COLLAPSE);
      done = std::max(done, to);
      if (last) return;
    }
  }
  uint8_t* base_;
  std::mutex mu_;
  std::condition_variable cv_;
  uint64_t written_ = 0;
  bool last_ = false;
  std::thread thread_;  // last: it starts once the rest is ready
};

int64_t realtime_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_REALTIME, &ts);
  return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

// The loader holds an exclusive flock on the segment for the whole load; the
// kernel drops it when the loader dies, so a free lock means nobody is loading.
bool loader_lock_held(int fd) {
  if (::flock(fd, LOCK_SH | LOCK_NB) == 0) {
    ::flock(fd, LOCK_UN);
    return false;
  }
  return errno == EWOULDBLOCK;
}

bool recently_created(int fd) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return false;
  const int64_t ctime_ns = int64_t(st.st_ctim.tv_sec) * 1000000000 + st.st_ctim.tv_nsec;
  return realtime_ns() - ctime_ns < kCreationGraceNs;
}

std::string segment_label(const std::string& handle) {
  if (is_memfd_handle(handle)) return "memfd segment '" + std::string(handle_name(handle)) + "'";
  return "shared-memory segment '" + handle + "'";
}

Identity identity_of(const gguf::File& f, const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) throw Error(path + ": cannot stat: " + std::strerror(errno));
  if (uint64_t(st.st_size) != f.file_size()) throw Error(path + ": file changed while it was being read");
  std::error_code ec;
  const std::filesystem::path abs = std::filesystem::canonical(path, ec);
  if (ec) throw Error(path + ": cannot resolve the absolute path: " + ec.message());
  Identity id;
  id.path = abs.string();
  if (id.path.size() >= kMaxPath) throw Error(path + ": absolute path longer than " + std::to_string(kMaxPath - 1) + " bytes");
  id.size = uint64_t(st.st_size);
  id.mtime_ns = int64_t(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
  id.header_hash = fnv1a(f.bytes().data(), size_t(std::min(f.data_offset(), f.file_size())));
  return id;
}

Identity header_identity(const SegmentHeader& h) {
  Identity id;
  id.path.assign(h.path, size_t(std::min<uint64_t>(h.path_len, kMaxPath)));
  id.size = h.file_size;
  id.mtime_ns = h.mtime_ns;
  id.header_hash = h.header_hash;
  return id;
}

void refuse_unsupported(const gguf::File& f) {
  for (const gguf::TensorInfo& t : f.tensors()) {
    if (!type_supported(t.type)) {
      throw Error(f.source() + ": tensor '" + t.name + "' has type " +
                  std::string(type_traits(uint32_t(t.type))->name) +
                  ", which ds4 cannot compute (supported: " + std::string(supported_types()) + ")");
    }
  }
}

// ---- layout -------------------------------------------------------------

struct Vocab {
  std::vector<std::string> tokens;
  std::vector<float> scores;
  std::vector<int32_t> types;
  VocabHeader header{};
  uint64_t bytes = 0;
};

Vocab read_vocab(const gguf::File& f) {
  Vocab v;
  v.tokens = f.get_string_array("tokenizer.ggml.tokens").value_or(std::vector<std::string>{});
  const uint64_t n = v.tokens.size();
  if (auto scores = f.get_float_array("tokenizer.ggml.scores")) {
    if (scores->size() != n) {
      throw Error(f.source() + ": key 'tokenizer.ggml.scores': " + std::to_string(scores->size()) +
                  " entries, expected " + std::to_string(n) + " (one per token)");
    }
    v.scores = std::move(*scores);
  }
  if (auto types = f.get_int_array("tokenizer.ggml.token_type")) {
    if (types->size() != n) {
      throw Error(f.source() + ": key 'tokenizer.ggml.token_type': " + std::to_string(types->size()) +
                  " entries, expected " + std::to_string(n) + " (one per token)");
    }
    for (int64_t t : *types) {
      if (t < INT32_MIN || t > INT32_MAX) throw Error(f.source() + ": key 'tokenizer.ggml.token_type': value out of int32 range");
      v.types.push_back(int32_t(t));
    }
  }
  VocabHeader& h = v.header;
  uint64_t off = sizeof(VocabHeader);
  h.n_tokens = n;
  h.offsets_offset = off;
  off += (n + 1) * sizeof(uint64_t);
  if (!v.scores.empty()) {
    h.scores_offset = off;
    off += n * sizeof(float);
  }
  if (!v.types.empty()) {
    h.types_offset = off;
    off += n * sizeof(int32_t);
  }
  h.strings_offset = off;
  for (const std::string& t : v.tokens) h.strings_bytes += t.size();
  v.bytes = off + h.strings_bytes;
  return v;
}

struct Plan {
  uint64_t blob_offset = 0, blob_bytes = 0;
  uint64_t dir_offset = 0;
  uint64_t vocab_offset = 0;
  uint64_t data_offset = 0, data_bytes = 0;
  uint64_t total = 0;
  uint64_t tensor_bytes = 0;  // sum of the tensors' own bytes (progress total)
  std::vector<uint64_t> tensor_offsets;
  Vocab vocab;
};

Plan plan_layout(const gguf::File& f) {
  Plan p;
  uint64_t off = align_up(sizeof(SegmentHeader), kRegionAlignment);
  p.blob_offset = off;
  p.blob_bytes = std::min(f.data_offset(), f.file_size());
  off = align_up(off + p.blob_bytes, kRegionAlignment);
  p.dir_offset = off;
  off = align_up(off + f.tensors().size() * sizeof(TensorRecord), kRegionAlignment);
  p.vocab_offset = off;
  p.vocab = read_vocab(f);
  off += p.vocab.bytes;
  p.data_offset = align_up(off, kDataAlignment);
  off = p.data_offset;
  for (const gguf::TensorInfo& t : f.tensors()) {
    p.tensor_offsets.push_back(off);
    off = align_up(off + t.n_bytes, kDataAlignment);
    p.tensor_bytes += t.n_bytes;
  }
  p.data_bytes = off - p.data_offset;
  p.total = align_up(std::max(off, p.data_offset), 4096);
  return p;
}

// ---- writing ------------------------------------------------------------

void write_vocab(uint8_t* region, const Vocab& v) {
  std::memcpy(region, &v.header, sizeof v.header);
  auto* offsets = reinterpret_cast<uint64_t*>(region + v.header.offsets_offset);
  char* strings = reinterpret_cast<char*>(region + v.header.strings_offset);
  uint64_t at = 0;
  for (size_t i = 0; i < v.tokens.size(); ++i) {
    offsets[i] = at;
    std::memcpy(strings + at, v.tokens[i].data(), v.tokens[i].size());
    at += v.tokens[i].size();
  }
  offsets[v.tokens.size()] = at;
  if (!v.scores.empty()) std::memcpy(region + v.header.scores_offset, v.scores.data(), v.scores.size() * sizeof(float));
  if (!v.types.empty()) std::memcpy(region + v.header.types_offset, v.types.data(), v.types.size() * sizeof(int32_t));
}

[[noreturn]] void throw_cancelled(const std::string& source, uint64_t done, uint64_t total) {
  throw LoadCancelled(source + ": loading stopped at " + format_bytes(done) + " of " + format_bytes(total) +
                      " (the supervisor is stopping)");
}

void write_segment(uint8_t* base, const Plan& p, const gguf::File& f, const Identity& id, const LoadOptions& opts) {
  const ProgressFn& progress = opts.progress;
  auto* h = new (base) SegmentHeader();
  std::memcpy(h->magic, kMagic, sizeof h->magic);
  h->layout_version = kLayoutVersion;
  h->state.store(uint32_t(SegmentState::loading), std::memory_order_relaxed);
  h->total_bytes = p.total;
  h->loader_pid = ::getpid();
  h->loaded_at_ns = realtime_ns();
  h->file_size = id.size;
  h->mtime_ns = id.mtime_ns;
  h->header_hash = id.header_hash;
  h->path_len = id.path.size();
  std::memcpy(h->path, id.path.data(), id.path.size());
  h->blob_offset = p.blob_offset;
  h->blob_bytes = p.blob_bytes;
  h->dir_offset = p.dir_offset;
  h->n_tensors = f.tensors().size();
  h->vocab_offset = p.vocab_offset;
  h->vocab_bytes = p.vocab.bytes;
  h->data_offset = p.data_offset;
  h->data_bytes = p.data_bytes;

  std::memcpy(base + p.blob_offset, f.bytes().data(), p.blob_bytes);
  auto* records = reinterpret_cast<TensorRecord*>(base + p.dir_offset);
  for (size_t i = 0; i < f.tensors().size(); ++i) {
    const gguf::TensorInfo& t = f.tensors()[i];
    TensorRecord& r = records[i];
    std::memcpy(r.name, t.name.data(), t.name.size());  // the reader caps names at 255 bytes
    r.type = uint32_t(t.type);
    r.n_dims = uint32_t(t.dims.size());
    for (int d = 0; d < 4; ++d) r.dims[d] = d < int(t.dims.size()) ? t.dims[d] : 1;
    r.offset = p.tensor_offsets[i];
    r.n_bytes = t.n_bytes;
  }
  write_vocab(base + p.vocab_offset, p.vocab);

  uint64_t done = 0;
  std::optional<Collapser> collapser;
  if (opts.huge_pages) collapser.emplace(base);
  if (progress) progress(0, p.tensor_bytes);
  for (size_t i = 0; i < f.tensors().size(); ++i) {
    const std::span<const uint8_t> src = f.tensor_data(f.tensors()[i]);
    uint8_t* dst = base + p.tensor_offsets[i];
    for (uint64_t at = 0; at < src.size(); at += kCopyChunk) {
      if (opts.stop.stop_requested()) throw_cancelled(f.source(), done, p.tensor_bytes);
      const uint64_t n = std::min<uint64_t>(kCopyChunk, src.size() - at);
      std::memcpy(dst + at, src.data() + at, n);
      done += n;
      h->bytes_done.store(done, std::memory_order_relaxed);
      if (collapser) collapser->written(p.tensor_offsets[i] + at + n);  // tensors lie in offset order
      if (progress && done < p.tensor_bytes) progress(done, p.tensor_bytes);
    }
  }
  // Before it is ready: a reader that maps it later maps the 2 MiB pages whole.
  if (collapser) collapser->finish(p.total);
  h->state.store(uint32_t(SegmentState::ready), std::memory_order_release);
  if (progress) progress(p.tensor_bytes, p.tensor_bytes);
}

uint64_t free_bytes(const LoadOptions& opts) {
  if (opts.assume_free_bytes) return *opts.assume_free_bytes;
  struct statvfs vfs {};
  if (::statvfs(kShmDir, &vfs) != 0) throw Error(std::string(kShmDir) + ": statvfs failed: " + std::strerror(errno));
  return uint64_t(vfs.f_bavail) * vfs.f_frsize;
}

// /dev/shm cannot hold the model: BackingChoice::automatic then takes a memfd.
struct NoSpace : Error {
  using Error::Error;
};

[[noreturn]] void throw_no_space(const std::string& source, uint64_t need, uint64_t have) {
  throw NoSpace(source + ": model needs " + format_bytes(need) + " of shared memory, " + kShmDir + " has " +
              format_bytes(have) + " free; enlarge it (mount -o remount,size=<bytes> " + kShmDir +
              ") or remove unused segments there");
}

// posix_fallocate over [0, bytes), a GiB at a time so that a stop asked
// meanwhile is seen (reserving 80 GB takes seconds). Returns its error code.
int allocate_pages(int fd, uint64_t bytes, const std::string& source, const LoadOptions& opts) {
  constexpr uint64_t kStep = uint64_t(1) << 30;
  for (uint64_t at = 0; at < bytes; at += kStep) {
    if (opts.stop.stop_requested()) throw_cancelled(source, 0, bytes);
    int rc;
    do {
      rc = ::posix_fallocate(fd, off_t(at), off_t(std::min(kStep, bytes - at)));
    } while (rc == EINTR);
    if (rc != 0) return rc;
  }
  return 0;
}

// Reserves the pages for real, so that a full tmpfs fails here and not with SIGBUS mid-copy.
void reserve(int fd, uint64_t bytes, const std::string& source, const LoadOptions& opts) {
  const int rc = allocate_pages(fd, bytes, source, opts);
  if (rc == ENOSPC) throw_no_space(source, bytes, free_bytes(opts));
  if (rc != 0) throw Error(source + ": cannot reserve " + format_bytes(bytes) + " of shared memory: " + std::strerror(rc));
}

// Creates and fills the segment; nullopt when someone else created it first.
std::optional<LoadResult> create_segment(const std::string& name, const gguf::File& f, const Identity& id,
                                         const LoadOptions& opts) {
  const Plan p = plan_layout(f);
  const uint64_t have = free_bytes(opts);
  if (p.total > have) throw_no_space(f.source(), p.total, have);

  std::optional<bip::shared_memory_object> shm;
  try {
    shm.emplace(bip::create_only, name.c_str(), bip::read_write, bip::permissions(0644));
  } catch (const bip::interprocess_exception& e) {
    if (e.get_error_code() == bip::already_exists_error) return std::nullopt;
    throw Error(segment_label(name) + ": cannot create: " + e.what());
  }
  const int fd = shm->get_mapping_handle().handle;
  ::flock(fd, LOCK_EX);  // held until `shm` closes: others see a live loader
  uint64_t huge = 0;
  try {
    reserve(fd, p.total, f.source(), opts);
    void* base = map_segment(fd, p.total, PROT_READ | PROT_WRITE);
    if (base == MAP_FAILED)
      throw Error(segment_label(name) + ": cannot map " + format_bytes(p.total) + ": " + std::strerror(errno));
    try {
      write_segment(static_cast<uint8_t*>(base), p, f, id, opts);
    } catch (...) {
      ::munmap(base, p.total);
      throw;
    }
    huge = pmd_mapped_bytes(base);
    ::munmap(base, p.total);
  } catch (...) {
    bip::shared_memory_object::remove(name.c_str());
    throw;
  }
  LoadResult r;
  r.name = name;
  r.bytes = p.total;
  r.huge_page_bytes = huge;
  return r;
}

// ---- memfd segments -----------------------------------------------------

// The memory a new memfd may take (shared/meminfo.h): its pages are shared
// memory, charged to our cgroup and never reclaimed.
uint64_t available_memory(const LoadOptions& opts) {
  if (opts.assume_available_memory) return *opts.assume_available_memory;
  return mem::read_memory_room().usable();
}

[[noreturn]] void throw_no_memory(const std::string& source, uint64_t need, const std::string& why) {
  throw Error(source + ": model needs " + format_bytes(need) + " of memory for a memfd segment, " + why +
              "; free memory, raise the cgroup's MemoryMax=, or use a smaller model");
}

// Creates, fills and seals a memfd segment. Its pages are reserved (and
// charged to our cgroup) before anything is written.
LoadResult create_memfd_segment(const std::string& base_name, const gguf::File& f, const Identity& id,
                                const LoadOptions& opts) {
  const Plan p = plan_layout(f);
  // Each memfd is another copy of the weights: its name tells it apart from
  // an earlier one of the same file, so that no worker still mapping that
  // one is taken for a worker of this one.
  char tag[24];
  std::snprintf(tag, sizeof tag, ".%016llx", static_cast<unsigned long long>(realtime_ns()));
  const std::string name = base_name + tag;
  const std::string handle = memfd_handle(name);
  const uint64_t avail = available_memory(opts);
  if (p.total > avail) throw_no_memory(f.source(), p.total, "only " + format_bytes(avail) + " is available");
  auto fd = std::make_shared<UniqueFd>(::memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!*fd) throw Error(segment_label(handle) + ": memfd_create failed: " + std::strerror(errno));
  const int rc = allocate_pages(fd->get(), p.total, f.source(), opts);
  if (rc == ENOSPC || rc == ENOMEM) throw_no_memory(f.source(), p.total, "the kernel refused to reserve it");
  if (rc != 0) {
    throw Error(f.source() + ": cannot reserve " + format_bytes(p.total) + " of memory for a memfd segment: " +
                std::strerror(rc));
  }
  // From here on its size is fixed: no reader can ever map past its end.
  if (::fcntl(fd->get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) != 0)
    throw Error(segment_label(handle) + ": cannot seal its size: " + std::strerror(errno));
  void* base = map_segment(fd->get(), p.total, PROT_READ | PROT_WRITE);
  if (base == MAP_FAILED)
    throw Error(segment_label(handle) + ": cannot map " + format_bytes(p.total) + ": " + std::strerror(errno));
  try {
    write_segment(static_cast<uint8_t*>(base), p, f, id, opts);
  } catch (...) {
    ::munmap(base, p.total);  // with the descriptor, the last reference: the pages go
    throw;
  }
  const uint64_t huge = pmd_mapped_bytes(base);
  ::munmap(base, p.total);
  // No writable mapping is left, so the write seal takes: readers may trust it.
  if (::fcntl(fd->get(), F_ADD_SEALS, F_SEAL_WRITE | F_SEAL_SEAL) != 0)
    throw Error(segment_label(handle) + ": cannot seal it against writes: " + std::strerror(errno));
  LoadResult r;
  r.name = handle;
  r.backing = Backing::memfd;
  r.fd = std::move(fd);
  r.bytes = p.total;
  r.huge_page_bytes = huge;
  return r;
}

// ---- looking at an existing segment -------------------------------------

enum class Found { missing, ready, loading, stale };

struct Inspection {
  Found found = Found::missing;
  std::string why;  // for stale ones
  uint64_t bytes = 0;
  uint64_t done = 0, total = 0;  // a live loader's progress
};

Inspection inspect(const std::string& name, const Identity& id) {
  Inspection s;
  std::optional<bip::shared_memory_object> shm;
  try {
    shm.emplace(bip::open_only, name.c_str(), bip::read_only);
  } catch (const bip::interprocess_exception& e) {
    if (e.get_error_code() == bip::not_found_error) return s;
    throw Error(segment_label(name) + ": cannot open: " + e.what());
  }
  bip::offset_t size = 0;
  shm->get_size(size);
  s.bytes = uint64_t(size);
  const int fd = shm->get_mapping_handle().handle;
  const bool locked = loader_lock_held(fd);
  const bool young = recently_created(fd);
  if (uint64_t(size) < sizeof(SegmentHeader)) {
    s.found = locked || young ? Found::loading : Found::stale;
    s.why = "it is too small (" + std::to_string(size) + " bytes) to hold a header";
    return s;
  }
  bip::mapped_region region(*shm, bip::read_only, 0, sizeof(SegmentHeader));
  const auto* h = static_cast<const SegmentHeader*>(region.get_address());
  if (std::memcmp(h->magic, kMagic, sizeof kMagic) != 0) {
    s.found = locked || young ? Found::loading : Found::stale;
    s.why = "it has no ds4 magic";
    return s;
  }
  if (h->layout_version != kLayoutVersion) {
    s.found = Found::stale;
    s.why = "it has layout version " + std::to_string(h->layout_version) + ", this build writes " +
            std::to_string(kLayoutVersion);
    return s;
  }
  if (h->state.load(std::memory_order_acquire) != uint32_t(SegmentState::ready)) {
    s.found = locked ? Found::loading : Found::stale;
    s.why = "it was left half-written by loader pid " + std::to_string(h->loader_pid);
    s.done = h->bytes_done.load(std::memory_order_relaxed);
    s.total = h->data_bytes;
    return s;
  }
  if (h->total_bytes != uint64_t(size)) {
    s.found = Found::stale;
    s.why = "its size " + std::to_string(size) + " differs from its header's " + std::to_string(h->total_bytes);
    return s;
  }
  if (!(header_identity(*h) == id)) {
    s.found = Found::stale;
    s.why = "it holds another model or version of the file (" + header_identity(*h).path + ")";
    return s;
  }
  s.found = Found::ready;
  return s;
}

}  // namespace

// ---- public: identity, loading, removal ---------------------------------

UniqueFd& UniqueFd::operator=(UniqueFd&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = o.release();
  }
  return *this;
}

UniqueFd::~UniqueFd() {
  if (fd_ >= 0) ::close(fd_);
}

std::string_view backing_name(Backing b) { return b == Backing::memfd ? "memfd" : "shared memory"; }

bool is_memfd_handle(std::string_view handle) { return handle.starts_with(kMemfdPrefix); }
std::string memfd_handle(std::string_view name) { return std::string(kMemfdPrefix) + std::string(name); }
std::string_view handle_name(std::string_view handle) {
  return is_memfd_handle(handle) ? handle.substr(kMemfdPrefix.size()) : handle;
}
std::string_view base_name(std::string_view handle) {
  const std::string_view name = handle_name(handle);
  return is_memfd_handle(handle) ? name.substr(0, name.rfind('.')) : name;
}

Identity identify(const std::string& path) {
  const gguf::File f = gguf::File::open(path);
  return identity_of(f, path);
}

std::string segment_name(const Identity& id) {
  uint64_t h = fnv1a(id.path.data(), id.path.size());
  h = fnv1a(&id.size, sizeof id.size, h);
  h = fnv1a(&id.mtime_ns, sizeof id.mtime_ns, h);
  h = fnv1a(&id.header_hash, sizeof id.header_hash, h);
  h = fnv1a(&kLayoutVersion, sizeof kLayoutVersion, h);
  char buf[32];
  std::snprintf(buf, sizeof buf, "ds4-model-%016llx", static_cast<unsigned long long>(h));
  return buf;
}

LoadResult load(const std::string& gguf_path, const LoadOptions& opts) {
  const gguf::File file = gguf::File::open(gguf_path);  // validates everything
  refuse_unsupported(file);
  if (opts.check) opts.check(file);
  const Identity id = identity_of(file, gguf_path);
  const std::string name = opts.name.empty() ? segment_name(id) : opts.name;
  if (opts.backing == BackingChoice::memfd) {
    LoadResult r = create_memfd_segment(name, file, id, opts);
    r.memfd_reason = "model.backing is memfd";
    return r;
  }
  const auto deadline = std::chrono::steady_clock::now() + opts.wait_timeout;
  bool force = opts.force_rebuild;
  std::string reason;
  for (;;) {
    const Inspection s = inspect(name, id);
    if (s.found == Found::ready && !force) {
      LoadResult r;
      r.name = name;
      r.reused = true;
      r.bytes = s.bytes;
      return r;
    }
    if (s.found == Found::loading) {
      if (opts.stop.stop_requested())
        throw LoadCancelled(segment_label(name) + ": stopped waiting for another process that is loading it");
      if (std::chrono::steady_clock::now() >= deadline) {
        throw Error(segment_label(name) + ": another process is still loading it after " +
                    std::to_string(opts.wait_timeout.count() / 1000) + " s; giving up");
      }
      if (opts.progress && s.total > 0 && s.done < s.total) opts.progress(s.done, s.total);
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      continue;
    }
    if (s.found != Found::missing) {
      reason = s.found == Found::ready ? "rebuild forced" : s.why;
      bip::shared_memory_object::remove(name.c_str());  // mappings that exist stay valid
    }
    force = false;
    try {
      if (std::optional<LoadResult> r = create_segment(name, file, id, opts)) {
        r->rebuild_reason = reason;
        return *r;
      }
    } catch (const NoSpace& e) {
      if (opts.backing != BackingChoice::automatic) throw;
      LoadResult r = create_memfd_segment(name, file, id, opts);
      r.rebuild_reason = reason;
      r.memfd_reason = std::string(kShmDir) + " cannot hold it (" + e.what() + ")";
      return r;
    }
    // Another process created it between our look and our create: look again.
  }
}

std::string ensure_loaded(const std::string& gguf_path, const LoadOptions& opts) {
  if (opts.backing == BackingChoice::memfd)
    throw Error(gguf_path + ": a memfd segment lives only as long as its descriptor; load() returns it");
  LoadOptions named = opts;
  named.backing = BackingChoice::shm;
  return load(gguf_path, named).name;
}

std::optional<Identity> ready_identity(int fd) {
  struct stat st {};
  if (::fstat(fd, &st) != 0 || uint64_t(st.st_size) < sizeof(SegmentHeader)) return std::nullopt;
  void* p = ::mmap(nullptr, sizeof(SegmentHeader), PROT_READ, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return std::nullopt;
  const auto* h = static_cast<const SegmentHeader*>(p);
  std::optional<Identity> id;
  if (std::memcmp(h->magic, kMagic, sizeof kMagic) == 0 && h->layout_version == kLayoutVersion &&
      h->state.load(std::memory_order_acquire) == uint32_t(SegmentState::ready) &&
      h->total_bytes == uint64_t(st.st_size) && h->path_len < kMaxPath) {
    id = header_identity(*h);
  }
  ::munmap(p, sizeof(SegmentHeader));
  return id;
}

bool remove(const std::string& name) { return bip::shared_memory_object::remove(name.c_str()); }

std::vector<std::string> list_segments(std::string_view prefix) {
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(kShmDir, ec)) {
    std::string leaf = entry.path().filename().string();
    if (leaf.starts_with(prefix)) names.push_back(std::move(leaf));
  }
  if (ec) throw Error(std::string(kShmDir) + ": cannot list: " + ec.message());
  std::sort(names.begin(), names.end());
  return names;
}

// ---- sweeping old segments ----------------------------------------------

namespace {

// Which kShmDir files the processes map, from one pass over /proc.
struct MapScan {
  std::set<std::pair<dev_t, ino_t>> mapped;  // device and inode of each mapped file
  bool ds4_unreadable = false;               // a ds4 process whose maps cannot be read
};

// A maps line: "start-end perms offset major:minor inode   path"; a memfd's
// path is "/memfd:<name> (deleted)".
void add_mappings(const std::string& maps, MapScan& scan) {
  const std::string dir = std::string(kShmDir) + "/";
  constexpr std::string_view kMemfdPath = "/memfd:";
  size_t at = 0;
  while (at < maps.size()) {
    size_t end = maps.find('\n', at);
    if (end == std::string::npos) end = maps.size();
    const std::string_view line(maps.data() + at, end - at);
    at = end + 1;
    size_t path = line.find(dir);
    if (path == std::string_view::npos) path = line.find(kMemfdPath);
    if (path == std::string_view::npos) continue;
    unsigned major_no = 0, minor_no = 0;
    unsigned long long inode = 0;
    if (std::sscanf(std::string(line.substr(0, path)).c_str(), "%*s %*s %*s %x:%x %llu", &major_no, &minor_no,
                    &inode) != 3) {
      continue;
    }
    scan.mapped.emplace(makedev(major_no, minor_no), ino_t(inode));
  }
}

// Whether a /proc/<pid>/cmdline runs a ds4 program (ds4-worker, ds4-supervisor).
bool runs_ds4(const std::string& cmdline) {
  const std::string argv0 = cmdline.substr(0, cmdline.find('\0'));
  const size_t slash = argv0.rfind('/');
  return argv0.compare(slash == std::string::npos ? 0 : slash + 1, 4, "ds4-") == 0;
}

MapScan scan_processes(const std::string& proc_dir) {
  MapScan scan;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(proc_dir, ec)) {
    const std::string pid = entry.path().filename().string();
    if (pid.empty() || !std::all_of(pid.begin(), pid.end(), [](char c) { return c >= '0' && c <= '9'; })) continue;
    if (const std::optional<std::string> maps = read_whole_file(proc_dir + "/" + pid + "/maps")) {
      add_mappings(*maps, scan);
    } else if (errno == EACCES || errno == EPERM) {
      // Not ours to read (a non-dumpable process, another user's, or one in
      // another user namespace): only a ds4 program would map a segment.
      if (const std::optional<std::string> cmdline = read_whole_file(proc_dir + "/" + pid + "/cmdline"))
        scan.ds4_unreadable = scan.ds4_unreadable || runs_ds4(*cmdline);
    }
    // Anything else: the process is gone.
  }
  return scan;
}

bool changed_within(const struct stat& st, std::chrono::milliseconds age) {
  const int64_t ctime_ns = int64_t(st.st_ctim.tv_sec) * 1000000000 + st.st_ctim.tv_nsec;
  const int64_t mtime_ns = int64_t(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
  return realtime_ns() - std::max(ctime_ns, mtime_ns) < int64_t(age.count()) * 1000000;
}

enum class Swept { removed, kept, gone };

Swept sweep_one(const std::string& name, const InUseFn& in_use, const SweepOptions& opts, uint64_t& freed) {
  const std::string path = std::string(kShmDir) + "/" + name;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (fd < 0) return errno == ENOENT ? Swept::gone : Swept::kept;
  struct stat st {};
  const bool ok = ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode);
  const uid_t me = ::geteuid();
  // A loader holds the lock from right after creating the segment until it is
  // ready, and maps it only once the pages are reserved.
  // Another user's segment is never ours to remove, root's sweeps included.
  const bool keep = !ok || st.st_uid != me || loader_lock_held(fd) || changed_within(st, opts.min_age);
  ::close(fd);
  if (keep || in_use(name)) return Swept::kept;
  struct stat now {};
  if (::stat(path.c_str(), &now) != 0) return Swept::gone;
  if (now.st_ino != st.st_ino || now.st_dev != st.st_dev) return Swept::kept;  // replaced since: look next time
  if (::unlink(path.c_str()) != 0) return errno == ENOENT ? Swept::gone : Swept::kept;
  freed = uint64_t(st.st_blocks) * 512;
  return Swept::removed;
}

}  // namespace

InUseFn mapped_by_some_process(std::string proc_dir) {
  auto scan = std::make_shared<std::optional<MapScan>>();
  return [scan, proc_dir = std::move(proc_dir)](const std::string& name) {
    struct stat st {};
    if (::stat((std::string(kShmDir) + "/" + name).c_str(), &st) != 0) return false;
    if (!*scan) *scan = scan_processes(proc_dir);
    const MapScan& s = **scan;
    return s.ds4_unreadable || s.mapped.count({st.st_dev, st.st_ino}) > 0;
  };
}

FdInUseFn fd_mapped_by_some_process(std::string proc_dir) {
  auto scan = std::make_shared<std::optional<MapScan>>();
  return [scan, proc_dir = std::move(proc_dir)](int fd) {
    struct stat st {};
    if (::fstat(fd, &st) != 0) return false;
    if (!*scan) *scan = scan_processes(proc_dir);
    const MapScan& s = **scan;
    return s.ds4_unreadable || s.mapped.count({st.st_dev, st.st_ino}) > 0;
  };
}

SweepResult remove_unused_segments(std::string_view keep, const InUseFn& in_use, const SweepOptions& opts) {
  SweepResult r;
  for (const std::string& name : list_segments(opts.prefix)) {
    if (name == keep) continue;
    uint64_t freed = 0;
    switch (sweep_one(name, in_use, opts, freed)) {
      case Swept::removed:
        r.removed.push_back({name, freed});
        break;
      case Swept::kept:
        r.kept.push_back(name);
        break;
      case Swept::gone:
        break;
    }
  }
  return r;
}

// ---- attaching ----------------------------------------------------------

// Whether `fd` is a memfd: its /proc link reads "/memfd:<name> ...".
static bool is_memfd(int fd) {
  char link[64];
  const ssize_t n = ::readlink(("/proc/self/fd/" + std::to_string(fd)).c_str(), link, sizeof link);
  return n >= 7 && std::string_view(link, size_t(n)).starts_with("/memfd:");
}

// A read-only mapping of a whole segment, unmapped on destruction.
struct Mapping {
  void* addr = nullptr;
  size_t bytes = 0;
  Mapping() = default;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() {
    if (addr) ::munmap(addr, bytes);
  }
};

struct Segment::Impl {
  std::string name;
  Backing backing = Backing::shm;
  Mapping region;
  const SegmentHeader* header = nullptr;
  gguf::File metadata;
  std::vector<TensorRef> tensors;
  std::map<std::string_view, size_t, std::less<>> index;
  VocabView vocab;
};

namespace {

class Checker {
 public:
  Checker(const std::string& name, uint64_t size) : name_(name), size_(size) {}

  [[noreturn]] void fail(const std::string& what) const { throw Error(segment_label(name_) + ": " + what); }

  // [offset, offset + bytes) lies inside the segment.
  void region(std::string_view what, uint64_t offset, uint64_t bytes) const {
    if (offset > size_ || bytes > size_ - offset) {
      fail(std::string(what) + " [" + std::to_string(offset) + ", +" + std::to_string(bytes) +
           ") lies outside the segment (size " + std::to_string(size_) + "); it is corrupt");
    }
  }

 private:
  const std::string& name_;
  uint64_t size_;
};

// count elements of `elem` bytes at `offset` fit in `limit` bytes, suitably aligned.
bool fits(uint64_t offset, uint64_t count, uint64_t elem, uint64_t limit) {
  if (offset % elem != 0 || offset > limit) return false;
  return count <= (limit - offset) / elem;
}

VocabView check_vocab(const Checker& c, const uint8_t* base, const SegmentHeader& h) {
  c.region("vocabulary", h.vocab_offset, h.vocab_bytes);
  if (h.vocab_bytes < sizeof(VocabHeader) || h.vocab_offset % 8 != 0) c.fail("vocabulary region is corrupt (header)");
  const uint8_t* region = base + h.vocab_offset;
  const auto* vh = reinterpret_cast<const VocabHeader*>(region);
  const uint64_t n = vh->n_tokens, limit = h.vocab_bytes;
  if (n >= limit || !fits(vh->offsets_offset, n + 1, 8, limit) ||
      (vh->scores_offset && !fits(vh->scores_offset, n, 4, limit)) ||
      (vh->types_offset && !fits(vh->types_offset, n, 4, limit)) ||
      !fits(vh->strings_offset, vh->strings_bytes, 1, limit)) {
    c.fail("vocabulary region is corrupt (" + std::to_string(n) + " tokens do not fit its " + std::to_string(limit) +
           " bytes)");
  }
  VocabView v;
  v.n_tokens = n;
  v.offsets = reinterpret_cast<const uint64_t*>(region + vh->offsets_offset);
  v.strings = reinterpret_cast<const char*>(region + vh->strings_offset);
  v.scores = vh->scores_offset ? reinterpret_cast<const float*>(region + vh->scores_offset) : nullptr;
  v.types = vh->types_offset ? reinterpret_cast<const int32_t*>(region + vh->types_offset) : nullptr;
  for (uint64_t i = 0; i < n; ++i) {
    if (v.offsets[i] > v.offsets[i + 1]) c.fail("vocabulary token " + std::to_string(i) + " has a negative length");
  }
  if (v.offsets[0] != 0 || v.offsets[n] > vh->strings_bytes) c.fail("vocabulary strings run past their region");
  return v;
}

void check_header(const Checker& c, const SegmentHeader& h, uint64_t size, int fd) {
  if (std::memcmp(h.magic, kMagic, sizeof kMagic) != 0) c.fail("bad magic: this is not a ds4 model segment");
  if (h.layout_version != kLayoutVersion) {
    c.fail("layout version " + std::to_string(h.layout_version) + ", this build reads layout version " +
           std::to_string(kLayoutVersion) + "; the supervisor must rebuild it (restart it, or run ensure_loaded)");
  }
  if (size < sizeof(SegmentHeader)) c.fail("truncated: " + std::to_string(size) + " bytes, smaller than its header");
  if (h.state.load(std::memory_order_acquire) != uint32_t(SegmentState::ready)) {
    const std::string pid = std::to_string(h.loader_pid);
    if (loader_lock_held(fd)) {
      c.fail("still loading (loader pid " + pid + " is running); wait until it is ready");
    }
    c.fail("was left half-written by loader pid " + pid + ", which is no longer running; ensure_loaded rebuilds it");
  }
  if (h.total_bytes != size) {
    c.fail("size " + std::to_string(size) + " differs from the " + std::to_string(h.total_bytes) +
           " bytes its header records; it is truncated or corrupt");
  }
  if (h.path_len >= kMaxPath) c.fail("header is corrupt (path length " + std::to_string(h.path_len) + ")");
  c.region("GGUF header blob", h.blob_offset, h.blob_bytes);
  if (h.n_tensors > size / sizeof(TensorRecord) || h.dir_offset % 8 != 0) c.fail("tensor directory is corrupt");
  c.region("tensor directory", h.dir_offset, h.n_tensors * sizeof(TensorRecord));
  c.region("tensor data", h.data_offset, h.data_bytes);
}

TensorRef check_record(const Checker& c, const uint8_t* base, const SegmentHeader& h, const TensorRecord& r, size_t i) {
  const std::string what = "tensor record " + std::to_string(i);
  const void* nul = std::memchr(r.name, 0, sizeof r.name);
  if (!nul) c.fail(what + ": name is not terminated");
  TensorRef t;
  t.name = std::string_view(r.name, size_t(static_cast<const char*>(nul) - r.name));
  const std::optional<TypeTraits> traits = type_traits(r.type);
  if (!traits || r.n_dims == 0 || r.n_dims > 4) c.fail(what + " '" + std::string(t.name) + "': bad type or n_dims");
  uint64_t n = 1;
  for (int d = 0; d < 4; ++d) {
    if (r.dims[d] == 0 || __builtin_mul_overflow(n, r.dims[d], &n)) c.fail(what + " '" + std::string(t.name) + "': bad dims");
    t.dims[d] = r.dims[d];
  }
  if (r.dims[0] % traits->block_elems != 0 || n / traits->block_elems * traits->block_bytes != r.n_bytes) {
    c.fail(what + " '" + std::string(t.name) + "': size " + std::to_string(r.n_bytes) + " does not match its type and dims");
  }
  if (r.offset % kDataAlignment != 0 || r.offset < h.data_offset || r.offset - h.data_offset > h.data_bytes ||
      r.n_bytes > h.data_bytes - (r.offset - h.data_offset)) {
    c.fail(what + " '" + std::string(t.name) + "': data at " + std::to_string(r.offset) +
           " is misaligned or outside the data region");
  }
  t.type = GgmlType(r.type);
  t.n_dims = r.n_dims;
  t.data = base + r.offset;
  t.n_bytes = r.n_bytes;
  return t;
}

}  // namespace

Segment::Segment(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Segment::Segment(Segment&&) noexcept = default;
Segment& Segment::operator=(Segment&&) noexcept = default;
Segment::~Segment() = default;

Segment Segment::attach(const std::string& name) {
  if (is_memfd_handle(name)) {
    throw Error(segment_label(name) + ": a memfd segment has no name to open; it is reached through the "
                "supervisor's descriptor (ds4-worker fetches it from the supervisor's segment socket)");
  }
  const UniqueFd fd(::shm_open(("/" + name).c_str(), O_RDONLY | O_CLOEXEC, 0));
  if (!fd) {
    if (errno == ENOENT) {
      throw Error(segment_label(name) + ": does not exist (" + kShmDir + "/" + name +
                  "); the supervisor creates it when it loads the model");
    }
    throw Error(segment_label(name) + ": cannot open: " + std::strerror(errno));
  }
  return attach_fd(fd.get(), name);
}

Segment Segment::attach_fd(int fd, const std::string& name) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw Error(segment_label(name) + ": cannot stat: " + std::strerror(errno));
  const uint64_t size = uint64_t(st.st_size);
  const Checker c(name, size);
  // A memfd whose size can still change could lose pages under our mapping.
  const bool memfd = is_memfd(fd);
  if (memfd && (::fcntl(fd, F_GET_SEALS) & (F_SEAL_SHRINK | F_SEAL_GROW)) != (F_SEAL_SHRINK | F_SEAL_GROW))
    c.fail("is a memfd whose size is not sealed; it was not made by the ds4 loader");
  // magic and layout version come first in every layout.
  if (size < sizeof(kMagic) + sizeof(uint32_t)) {
    c.fail("truncated: " + std::to_string(size) + " bytes, too small for a ds4 model segment");
  }
  auto impl = std::make_unique<Impl>();
  impl->name = name;
  impl->backing = memfd ? Backing::memfd : Backing::shm;
  void* addr = map_segment(fd, size, PROT_READ);
  if (addr == MAP_FAILED) c.fail(std::string("cannot map: ") + std::strerror(errno));
  impl->region.addr = addr;
  impl->region.bytes = size_t(size);
  const auto* base = static_cast<const uint8_t*>(addr);
  const auto& h = *reinterpret_cast<const SegmentHeader*>(base);
  check_header(c, h, size, fd);
  impl->header = &h;

  gguf::ParseOptions po;
  po.check_tensor_data = false;
  try {
    impl->metadata = gguf::File::parse(std::span<const uint8_t>(base + h.blob_offset, h.blob_bytes),
                                       segment_label(name) + " GGUF header", po);
  } catch (const Error& e) {
    c.fail(std::string("its GGUF header does not parse: ") + e.what());
  }
  if (impl->metadata.tensors().size() != h.n_tensors) c.fail("tensor directory and GGUF header disagree on the tensor count");
  const auto* records = reinterpret_cast<const TensorRecord*>(base + h.dir_offset);
  impl->tensors.reserve(h.n_tensors);
  for (size_t i = 0; i < h.n_tensors; ++i) {
    impl->tensors.push_back(check_record(c, base, h, records[i], i));
    if (!impl->index.emplace(impl->tensors.back().name, i).second) {
      c.fail("tensor '" + std::string(impl->tensors.back().name) + "' appears twice");
    }
  }
  impl->vocab = check_vocab(c, base, h);
  return Segment(std::move(impl));
}

const std::string& Segment::name() const { return impl_->name; }
Backing Segment::backing() const { return impl_->backing; }
Identity Segment::identity() const { return header_identity(*impl_->header); }

std::optional<std::string> Segment::identity_mismatch() const {
  const std::string_view named = base_name(impl_->name);
  constexpr std::string_view kPrefix = "ds4-model-";
  const bool loader_name = named.size() == kPrefix.size() + 16 && named.starts_with(kPrefix) &&
                           named.substr(kPrefix.size()).find_first_not_of("0123456789abcdef") == std::string_view::npos;
  const Identity id = identity();
  if (loader_name && segment_name(id) != named)
    return "it holds " + id.path + " (" + std::to_string(id.size) + " bytes, mtime " + std::to_string(id.mtime_ns) +
           " ns), whose segment is " + segment_name(id) + ", not " + std::string(named);
  return std::nullopt;
}
uint64_t Segment::bytes() const { return impl_->header->total_bytes; }
uint64_t Segment::weight_bytes() const { return impl_->header->data_bytes; }
const gguf::File& Segment::metadata() const { return impl_->metadata; }
std::span<const TensorRef> Segment::tensors() const { return impl_->tensors; }
const void* Segment::base() const { return impl_->region.addr; }
uint64_t Segment::huge_page_bytes() const {
  const auto* p = static_cast<const volatile uint8_t*>(impl_->region.addr);
  for (uint64_t at = 0; at < impl_->region.bytes; at += kHugePage) (void)p[at];
  return pmd_mapped_bytes(impl_->region.addr);
}
const SegmentHeader& Segment::header() const { return *impl_->header; }
const VocabView& Segment::vocab() const { return impl_->vocab; }

const TensorRef* Segment::find_tensor(std::string_view name) const {
  const auto it = impl_->index.find(name);
  return it == impl_->index.end() ? nullptr : &impl_->tensors[it->second];
}

uint64_t pmd_mapped_bytes(const void* addr) {
  const std::optional<std::string> smaps = read_whole_file("/proc/self/smaps");
  if (!smaps) return 0;
  const auto a = reinterpret_cast<uintptr_t>(addr);
  bool in = false;
  uint64_t kib = 0;
  size_t at = 0;
  while (at < smaps->size()) {
    size_t end = smaps->find('\n', at);
    if (end == std::string::npos) end = smaps->size();
    const std::string_view line(smaps->data() + at, end - at);
    at = end + 1;
    unsigned long long lo = 0, hi = 0;
    int used = 0;
    // A mapping's first line: "lo-hi perms offset dev inode path".
    if (std::sscanf(std::string(line.substr(0, 40)).c_str(), "%llx-%llx %n", &lo, &hi, &used) == 2 && used > 0) {
      if (in) break;  // past our mapping
      in = a >= lo && a < hi;
      continue;
    }
    if (!in) continue;
    for (const char* key : {"ShmemPmdMapped:", "FilePmdMapped:", "AnonHugePages:"})
      if (line.starts_with(key)) {
        unsigned long long v = 0;
        if (std::sscanf(std::string(line.substr(std::strlen(key))).c_str(), "%llu", &v) == 1) kib += v;
      }
  }
  return kib * 1024;
}

}  // namespace ds4::store
