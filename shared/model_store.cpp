#include "shared/model_store.h"

#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
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
#include <mutex>
#include <new>
#include <thread>
#include <utility>

#include "shared/bytes.h"
#include "shared/error.h"
#include "shared/files.h"
#include "shared/meminfo.h"
#include "shared/model_store_internal.h"

namespace ds4::store {

namespace bip = boost::interprocess;

namespace {

constexpr uint64_t kRegionAlignment = 64;
constexpr uint64_t kCopyChunk = uint64_t(8) << 20;  // progress granularity while copying
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

}  // namespace

// ---- shared with segment_reader.cpp and segment_sweep.cpp ----------------

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

int64_t realtime_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_REALTIME, &ts);
  return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

bool loader_lock_held(int fd) {
  if (::flock(fd, LOCK_SH | LOCK_NB) == 0) {
    ::flock(fd, LOCK_UN);
    return false;
  }
  return errno == EWOULDBLOCK;
}

std::string segment_label(const std::string& handle) {
  if (is_memfd_handle(handle)) return "memfd segment '" + std::string(handle_name(handle)) + "'";
  return "shared-memory segment '" + handle + "'";
}

Identity header_identity(const SegmentHeader& h) {
  Identity id;
  id.path.assign(h.path, size_t(std::min<uint64_t>(h.path_len, kMaxPath)));
  id.size = h.file_size;
  id.mtime_ns = h.mtime_ns;
  id.header_hash = h.header_hash;
  return id;
}

namespace {

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

bool recently_created(int fd) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return false;
  const int64_t ctime_ns = int64_t(st.st_ctim.tv_sec) * 1000000000 + st.st_ctim.tv_nsec;
  return realtime_ns() - ctime_ns < kCreationGraceNs;
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

}  // namespace ds4::store
