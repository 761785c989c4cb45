#include "shared/model_store.h"

#include <sys/mman.h>
#include <sys/stat.h>
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "shared/error.h"
#include "shared/files.h"
#include "shared/model_store_internal.h"

// Attaching a segment read-only (Segment), with every region and record
// checked before it is trusted; and pmd_mapped_bytes.

namespace ds4::store {

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
