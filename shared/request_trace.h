#pragma once
/// Timestamps of each request's way through the proxy and its worker, for
/// finding where its time goes (bench/proxy_trace.sh reads them). Off unless
/// the environment's DS4_TRACE names a file prefix: a process that calls
/// open() then writes fixed-size records to PREFIX.TAG through a shared file
/// mapping (a killed process loses none): PREFIX.proxy, and
/// PREFIX.worker-ID-PID for each worker process. Off, a mark is one load and a
/// branch; the callers take their clock readings only when on().
#include <atomic>
#include <cstdint>

namespace ds4::trace {

/// Where a record was taken. The id is the request's id between the proxy
/// and the worker (the worker protocol's "id").
enum class Stage : int32_t {
  proxy_received = 1,  // the proxy has the whole HTTP request; extra: the client's port
  proxy_dispatch = 2,  // the scheduler starts the call to a worker; extra: the worker's id
  proxy_line = 4,      // the proxy read a line of the worker for it; extra: its place in that read
  proxy_handled = 5,   // ...and handled it (for the last line: the answer was sent)
  worker_read = 6,     // the worker read the request (its timings start)
  worker_step_end = 7, // the step that ended it is over; extra: requests ended in that step
};

/// One record as written: 24 bytes, little-endian, after a 64-byte header
/// whose first 8 bytes count the records taken.
struct Record {
  int64_t ns;  // CLOCK_MONOTONIC
  int64_t id;
  int32_t stage;
  int32_t extra;
};

/// Opens PREFIX.`tag` when DS4_TRACE is set (once a process; later calls do
/// nothing). A file that cannot be made is reported on stderr and tracing
/// stays off.
void open(const char* tag);

namespace detail {
extern std::atomic<Record*> records;
}

inline bool on() { return detail::records.load(std::memory_order_relaxed) != nullptr; }

/// CLOCK_MONOTONIC in ns.
int64_t now_ns();

/// Records `stage` for request `id` at `ns` (now when 0). Thread-safe; past
/// the file's room (about 2.8 million records) records are dropped.
void mark(Stage stage, int64_t id, int64_t ns = 0, int32_t extra = 0);

}  // namespace ds4::trace
