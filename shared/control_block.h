#pragma once
/// The control block (DESIGN.md, "Shared memory"): one small named POSIX
/// shared-memory segment per supervisor instance, one fixed-size record per
/// worker id. The supervisor creates it and only reads records; worker N
/// attaches it by name (`--control NAME`, or DS4_CONTROL in its environment)
/// and is the only writer of record N. Every field is a lock-free atomic, so
/// there is no lock to be left held by a killed process, and a reader sees
/// each figure whole (a snapshot may mix figures of two moments, never a torn
/// number).
///
/// Liveness: the worker stores its heartbeat (CLOCK_MONOTONIC, the same clock
/// in every process of the machine) from its engine loop. A record counts for
/// a process only when its pid matches: a record left by the previous process
/// behind an id is never taken for the new one's.
///
/// Versions: the segment header and each record carry kControlLayout. A
/// worker refuses a segment of another layout; the supervisor refuses (reads
/// as absent) a record written by a worker of another layout, and rebuilds a
/// segment of another layout under the same name.

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>

namespace ds4::control {

inline constexpr uint32_t kControlLayout = 1;
/// workers.count is at most 256.
inline constexpr uint32_t kMaxWorkers = 256;

/// What a worker says it is doing.
enum class RecordState : uint32_t { empty = 0, starting = 1, ready = 2, stopping = 3 };
const char* record_state_name(RecordState s);

/// One worker's record as it lies in shared memory (256 bytes, aligned).
struct alignas(64) Record {
  std::atomic<uint32_t> layout;        // the writer's kControlLayout; 0 while (re)initialised
  std::atomic<uint32_t> state;         // RecordState
  std::atomic<int32_t> pid;
  std::atomic<int32_t> id;
  std::atomic<int64_t> heartbeat_ns;   // CLOCK_MONOTONIC of the last beat
  std::atomic<uint64_t> beats;
  std::atomic<int64_t> started_ns;     // CLOCK_MONOTONIC when the process attached
  std::atomic<int64_t> context;        // tokens per slot
  std::atomic<int64_t> slots;
  std::atomic<uint64_t> plan_weights;  // memory plan, bytes
  std::atomic<uint64_t> plan_kv;
  std::atomic<uint64_t> plan_scratch;
  std::atomic<uint64_t> requests;      // finished requests (any outcome)
  std::atomic<uint64_t> tokens_in;     // prompt tokens evaluated
  std::atomic<uint64_t> tokens_out;    // tokens generated
  std::atomic<uint64_t> errors;        // requests that ended in an error, bad request lines
  std::atomic<uint64_t> gpu_free;      // the device's memory; both 0 when not on a GPU
  std::atomic<uint64_t> gpu_total;
  uint8_t reserved_[256 - 128];
};
static_assert(sizeof(Record) == 256, "the record layout is part of kControlLayout");
static_assert(std::atomic<uint64_t>::is_always_lock_free && std::atomic<int64_t>::is_always_lock_free,
              "records in shared memory need lock-free 64-bit atomics");

/// A copy of one record, taken by the reader.
struct Snapshot {
  int id = 0;
  int pid = 0;
  RecordState state = RecordState::empty;
  int64_t heartbeat_ns = 0;
  uint64_t beats = 0;
  int64_t started_ns = 0;
  int64_t context = 0;
  int64_t slots = 0;
  uint64_t plan_weights = 0, plan_kv = 0, plan_scratch = 0;
  uint64_t requests = 0, tokens_in = 0, tokens_out = 0, errors = 0;
  uint64_t gpu_free = 0, gpu_total = 0;
  bool on_gpu() const { return gpu_total > 0; }
  /// Milliseconds since the last beat at `now_ns` (CLOCK_MONOTONIC); 0 when
  /// the beat is in the future (clock read before the beat).
  int64_t heartbeat_age_ms(int64_t now_ns) const;
};

/// CLOCK_MONOTONIC in nanoseconds.
int64_t monotonic_ns();

/// Copies a record; nullopt when it was never written or carries another
/// layout version. Exposed for tests (Block::read uses it).
std::optional<Snapshot> read_record(const Record& r);

/// The segment's name for a supervisor instance: "/ds4-control-<uid>-<hash of
/// the runtime dir>", so that instances with different runtime dirs (tests,
/// several users) never share one, and a restarted supervisor finds its own.
std::string segment_name_for(const std::string& runtime_dir);

/// A mapped control block.
class Block {
 public:
  /// Supervisor: opens the segment `name` when it exists with this layout
  /// (a restarted supervisor keeps its workers' records), else (re)creates it
  /// empty. Throws ds4::Error.
  static Block create_or_open(const std::string& name);
  /// Worker: attaches an existing segment. Throws ds4::Error when it is
  /// missing, too small, or of another layout.
  static Block attach(const std::string& name);
  /// Removes the name (the supervisor, on a clean stop). False when absent.
  static bool remove(const std::string& name);

  Block(Block&& o) noexcept;
  Block& operator=(Block&& o) noexcept;
  Block(const Block&) = delete;
  Block& operator=(const Block&) = delete;
  ~Block();

  const std::string& name() const { return name_; }
  /// Record `id`; throws ds4::Error when id >= kMaxWorkers.
  Record& record(int id);
  std::optional<Snapshot> read(int id) const;

 private:
  Block(std::string name, void* base, size_t bytes) : name_(std::move(name)), base_(base), bytes_(bytes) {}
  std::string name_;
  void* base_ = nullptr;
  size_t bytes_ = 0;
};

/// The worker's side: the one writer of its record. Beats and counters may be
/// called from any of the worker's threads.
class Writer {
 public:
  /// Claims record `id` for process `pid`: resets it and marks it starting.
  Writer(Block block, int id, int pid);

  void set_plan(int64_t context, int64_t slots, uint64_t weights, uint64_t kv, uint64_t scratch);
  void set_state(RecordState s);
  void beat();
  void set_device_memory(uint64_t free, uint64_t total);
  /// One request finished: its prompt tokens evaluated and tokens generated.
  void count_request(uint64_t tokens_in, uint64_t tokens_out, bool error);
  void count_error();

  Record& record() { return *rec_; }

 private:
  Block block_;
  Record* rec_;
};

}  // namespace ds4::control
