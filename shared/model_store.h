#pragma once
/// The model store: a GGUF file loaded once into a named shared-memory segment
/// (Boost.Interprocess shared_memory_object, /dev/shm/<name>) that outlives the
/// processes using it, or, where /dev/shm cannot hold it, into an anonymous
/// memfd (memfd_create: sized only by RAM and cgroup limits) that lives as long
/// as a descriptor or a mapping of it does: the supervisor keeps the descriptor
/// and hands it to workers (shared/segment_socket.h). Such a segment is named by
/// the handle "memfd:<name>". Layout, in both (all offsets from the segment start):
///   SegmentHeader | GGUF header blob (metadata + tensor directory, as in the
///   file) | tensor directory (TensorRecord[]) | vocabulary | tensor data,
///   each tensor aligned to kDataAlignment.
/// The loader writes everything with state `loading`, then publishes `ready`
/// with a release store. Readers map it read-only and refuse anything else.
/// In three parts: loading (model_store.cpp), attaching (segment_reader.cpp),
/// and removing old named segments (shared/segment_sweep.h).

#include <fcntl.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <stop_token>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shared/error.h"
#include "shared/ggml_types.h"
#include "shared/gguf.h"

namespace ds4::store {

inline constexpr char kMagic[8] = {'D', 'S', '4', 'M', 'O', 'D', 'E', 'L'};
inline constexpr uint32_t kLayoutVersion = 1;
inline constexpr uint64_t kDataAlignment = 256;  // SIMD loads and GPU copies

enum class SegmentState : uint32_t { loading = 0, ready = 1 };

/// Where named segments live (shm_open's filesystem); its free space is checked before loading.
inline constexpr char kShmDir[] = "/dev/shm";
inline constexpr size_t kMaxPath = 4096;
/// A memfd segment's handle is this prefix and its name, which is the name a
/// named segment of the same file would have and a tag of its own load:
/// "memfd:ds4-model-<16 hex>.<16 hex>". Two loads of one file are two
/// memfds, and two handles.
inline constexpr std::string_view kMemfdPrefix = "memfd:";

/// How a segment is backed.
enum class Backing {
  shm,    // a named POSIX segment in kShmDir: found by name, survives every process
  memfd,  // an anonymous memfd: reached only through a descriptor (or a mapping) of it
};
/// "shared memory" or "memfd".
std::string_view backing_name(Backing b);

/// Whether `handle` names a memfd segment ("memfd:..."), and its name without the prefix.
bool is_memfd_handle(std::string_view handle);
std::string memfd_handle(std::string_view name);
std::string_view handle_name(std::string_view handle);
/// The name without the prefix and a memfd's load tag: segment_name() of the
/// identity it was loaded from (or the name a test gave).
std::string_view base_name(std::string_view handle);

/// An owned file descriptor, closed on destruction. Movable.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& o) noexcept : fd_(o.release()) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept;
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd();
  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }
  explicit operator bool() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

/// The seals every loaded memfd segment carries: its size cannot change (no
/// reader can lose pages under a mapping: no SIGBUS) and nobody can write it.
inline constexpr int kMemfdSeals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL;

/// The segment's first bytes. `magic` and `layout_version` keep these offsets in
/// every layout, so a reader tells another layout apart before trusting the rest.
/// Regions are [offset, offset + bytes) from the segment start.
struct SegmentHeader {
  char magic[8];
  uint32_t layout_version;
  std::atomic<uint32_t> state;         // SegmentState; `ready` is published with a release store
  uint64_t total_bytes;                // the whole segment (= its size)
  int64_t loader_pid;
  std::atomic<uint64_t> bytes_done;    // tensor bytes copied so far (waiters show progress)
  int64_t loaded_at_ns;                // CLOCK_REALTIME when loading began
  // identity
  uint64_t file_size;
  int64_t mtime_ns;
  uint64_t header_hash;
  uint64_t path_len;
  char path[kMaxPath];
  // regions
  uint64_t blob_offset, blob_bytes;    // GGUF file bytes [0, data section)
  uint64_t dir_offset, n_tensors;      // TensorRecord[n_tensors]
  uint64_t vocab_offset, vocab_bytes;  // VocabHeader and its arrays
  uint64_t data_offset, data_bytes;    // tensor data, each tensor aligned to kDataAlignment
};
static_assert(std::atomic<uint32_t>::is_always_lock_free && std::atomic<uint64_t>::is_always_lock_free);

/// One tensor in the directory region.
struct TensorRecord {
  char name[256];     // NUL-terminated, up to 255 bytes
  uint32_t type;      // GgmlType
  uint32_t n_dims;
  uint64_t dims[4];   // unused ones are 1
  uint64_t offset;    // from the segment start, a multiple of kDataAlignment
  uint64_t n_bytes;
};

/// Start of the vocabulary region; offsets are from the region start, 0 = absent.
struct VocabHeader {
  uint64_t n_tokens;
  uint64_t offsets_offset;  // uint64_t[n_tokens + 1]: token i is strings[offsets[i], offsets[i + 1])
  uint64_t scores_offset;   // float[n_tokens] (tokenizer.ggml.scores)
  uint64_t types_offset;    // int32_t[n_tokens] (tokenizer.ggml.token_type)
  uint64_t strings_offset;  // token bytes (tokenizer.ggml.tokens)
  uint64_t strings_bytes;
};

/// The vocabulary as stored in a segment (pointers into the mapping).
struct VocabView {
  uint64_t n_tokens = 0;
  const uint64_t* offsets = nullptr;
  const char* strings = nullptr;
  const float* scores = nullptr;    // null when the file has none
  const int32_t* types = nullptr;   // null when the file has none
  std::string_view token(uint64_t i) const {
    return {strings + offsets[i], size_t(offsets[i + 1] - offsets[i])};
  }
};

/// What a segment was loaded from. Two identities are equal when every field is.
struct Identity {
  std::string path;        // absolute path of the GGUF file
  uint64_t size = 0;
  int64_t mtime_ns = 0;
  uint64_t header_hash = 0;  // FNV-1a 64 of the GGUF header bytes (up to the data section)
  bool operator==(const Identity&) const = default;
};

/// Reads `path`'s identity (stat + header hash). Throws ds4::Error naming the path.
Identity identify(const std::string& path);

/// "ds4-model-<16 hex digits>": derived from the identity and the layout version.
std::string segment_name(const Identity& id);

// ---- attaching (shared/segment_reader.cpp) -----------------------------

/// One tensor as the engine sees it: a pointer into the mapped segment.
struct TensorRef {
  std::string_view name;
  GgmlType type = GgmlType::F32;
  uint32_t n_dims = 0;
  uint64_t dims[4] = {1, 1, 1, 1};  // ne[0] innermost
  const void* data = nullptr;
  uint64_t n_bytes = 0;
};

/// Load progress: bytes done out of total. Called often; cheap.
using ProgressFn = std::function<void(uint64_t done, uint64_t total)>;

/// A read-only attachment to a ready segment. Movable; unmaps on destruction.
class Segment {
 public:
  /// Attaches `name`. Throws ds4::Error with a clear message when it is missing,
  /// has a bad magic, another layout version, is still `loading` (half-written),
  /// or is truncated. A memfd handle is refused here: it has no name to open
  /// (attach_fd, or open_segment() of shared/segment_socket.h, attach it).
  static Segment attach(const std::string& name);
  /// Attaches the segment behind `fd` (not taken: the caller closes it; the
  /// mapping stays valid after that), named `handle` in messages and name().
  /// The same checks as attach(); a memfd must also be sealed against
  /// shrinking and growing (F_SEAL_SHRINK, F_SEAL_GROW: the loader adds every
  /// one of kMemfdSeals), else its pages could vanish under the mapping.
  static Segment attach_fd(int fd, const std::string& handle);

  Segment(Segment&&) noexcept;
  Segment& operator=(Segment&&) noexcept;
  ~Segment();

  /// The name, or for a memfd segment its handle ("memfd:<name>").
  const std::string& name() const;
  Backing backing() const;
  Identity identity() const;
  /// Whether it holds the model its name says: a segment named as the loader
  /// names them ("ds4-model-<16 hex digits>", a memfd's too) must have the
  /// name its header's identity (path, size, mtime, header hash) gives.
  /// nullopt when it does; else why not. Other names (tests give their own)
  /// are not checked. A worker refuses a segment that fails this (DESIGN.md:
  /// magic, layout version and model identity). It costs a few hashed bytes,
  /// not a pass over the GGUF header: a worker's restart stays milliseconds.
  std::optional<std::string> identity_mismatch() const;
  uint64_t bytes() const;          // whole segment
  uint64_t weight_bytes() const;   // the tensor data region (tensors and their alignment padding)
  /// Metadata parsed from the header blob (tensor_data() of it is not usable:
  /// use tensors()/find_tensor()).
  const gguf::File& metadata() const;
  std::span<const TensorRef> tensors() const;
  const TensorRef* find_tensor(std::string_view name) const;
  /// Base address and length of the mapping (for residency checks and GPU registration).
  const void* base() const;
  /// How much of the segment is in 2 MiB pages: this process's mapping is
  /// touched once every 2 MiB (read-only, a few thousand faults for 80 GB)
  /// and its PMD-mapped part measured (pmd_mapped_bytes).
  uint64_t huge_page_bytes() const;
  /// The header as mapped (loader pid, load time, region offsets).
  const SegmentHeader& header() const;
  /// Tokens, scores and types for the proxy's tokenizer (n_tokens 0 when the file has none).
  const VocabView& vocab() const;

 private:
  struct Impl;
  explicit Segment(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// ---- loading (shared/model_store.cpp) -----------------------------------

/// Which backing load() uses.
enum class BackingChoice {
  automatic,  // a named segment when kShmDir has room for it (or one is ready), else a memfd
  shm,        // a named segment only: a model larger than kShmDir's free space is an error
  memfd,      // a memfd only (a named segment is neither reused nor made)
};

struct LoadOptions {
  BackingChoice backing = BackingChoice::automatic;
  bool force_rebuild = false;   // rebuild even when a ready, matching segment exists
  ProgressFn progress;          // may be empty
  std::string name;             // segment name; empty = segment_name(identity) (tests set their own)
  /// How long to wait for another live process that is loading the same segment.
  std::chrono::milliseconds wait_timeout = std::chrono::minutes(10);
  /// Tests: pretend the backing filesystem has this many bytes free.
  std::optional<uint64_t> assume_free_bytes;
  /// Tests: pretend this much memory is available to a memfd (MemAvailable,
  /// and what the cgroup's memory.max leaves).
  std::optional<uint64_t> assume_available_memory;
  /// Once a stop is requested, a load in progress stops (within one copy
  /// chunk) with LoadCancelled and removes what it wrote; so does a wait for
  /// another process's load.
  std::stop_token stop;
  /// Checks the model before anything is written or reused (the engine's own
  /// shape checks: the store knows the file format, not the model family);
  /// throws ds4::Error naming the file. Else a model no worker can run was
  /// copied whole into memory first, and its segment outlived the refusal.
  std::function<void(const gguf::File&)> check;
  /// Put a segment written now in 2 MiB pages where the kernel can (model.huge_pages).
  bool huge_pages = true;
};

/// A load stopped through LoadOptions::stop.
struct LoadCancelled : Error {
  using Error::Error;
};

struct LoadResult {
  std::string name;      // the segment's name, or a memfd segment's handle ("memfd:<name>")
  Backing backing = Backing::shm;
  /// A memfd segment's only reference besides mappings: read-write, sealed
  /// (kMemfdSeals). Empty for a named segment.
  std::shared_ptr<UniqueFd> fd;
  bool reused = false;   // a ready, matching segment existed: nothing was copied
  uint64_t bytes = 0;    // segment size
  std::string rebuild_reason;  // why an existing segment was replaced; empty when none was
  std::string memfd_reason;    // why a memfd backs it ("/dev/shm has ... free"); empty for shm
  uint64_t huge_page_bytes = 0;  // of a segment written now: the part in 2 MiB pages (pmd_mapped_bytes)
};

/// How much of this process's mapping that starts at or contains `addr` the
/// kernel maps with 2 MiB pages (smaps' ShmemPmdMapped / FilePmdMapped /
/// AnonHugePages); 0 when it cannot tell. Weights read from 2 MiB pages
/// stream up to 1.4x faster on the CPU backend: shared memory gets them
/// where /dev/shm is mounted with huge=within_size (named segments) or
/// /sys/kernel/mm/transparent_hugepage/shmem_enabled allows them (memfd).
uint64_t pmd_mapped_bytes(const void* addr);

/// ensure_loaded(), also telling whether the segment was reused.
LoadResult load(const std::string& gguf_path, const LoadOptions& opts = {});

/// Makes sure a ready segment for `gguf_path` exists and returns its name:
/// reuses one that is ready and matches the identity; otherwise (missing,
/// half-written by a dead loader, other layout) removes it and loads afresh.
/// Checks the backing space (/dev/shm) before writing and throws a clear
/// ds4::Error instead of dying with SIGBUS when the model does not fit.
/// Validates the GGUF completely first (bad files never reach shared memory).
/// A memfd segment (opts.backing) is created anew, sealed and returned with
/// its descriptor in LoadResult::fd: it goes away with the last descriptor and
/// mapping, so only load() (not ensure_loaded) can make one. Its memory is
/// checked against MemAvailable and the cgroup's limits (shared/meminfo.h),
/// then reserved (fallocate) before anything is written: a model that does
/// not fit fails with a clear ds4::Error, never with SIGBUS or an OOM kill
/// mid-load.
/// BackingChoice::automatic means shm here, and memfd is refused.
std::string ensure_loaded(const std::string& gguf_path, const LoadOptions& opts = {});

/// Reads the identity a segment was loaded from without attaching it fully
/// (header only); nullopt when `fd` does not hold a ready ds4 segment of this
/// layout. For a supervisor checking memfds it got back from systemd.
std::optional<Identity> ready_identity(int fd);

/// Removes the named segment (its pages are freed once no process maps it).
/// Returns false when there was none.
bool remove(const std::string& name);

/// Names in kShmDir that start with `prefix`, sorted: how a supervisor finds
/// segments of older files or layouts to remove.
std::vector<std::string> list_segments(std::string_view prefix = "ds4-model-");

/// A progress reporter for long loads: on a terminal a single updating line with
/// percent and MB/s; under systemd `STATUS=` via sd_notify (rate-limited).
/// `what` starts the line: "loading stories260K.gguf" gives
/// `loading stories260K.gguf: 45% 812 MB/s`. (shared/progress.h has the parts.)
ProgressFn make_progress_reporter(std::string what);

}  // namespace ds4::store
