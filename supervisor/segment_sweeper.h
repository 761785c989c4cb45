#pragma once
/// Old model segments go away once nobody uses them (DESIGN.md, Shared
/// memory). The supervisor keeps the segment it serves mapped, so that every
/// sweep (its own, and that of another supervisor of the same user) sees it in
/// use even while none of its workers runs, and removes the other
/// `ds4-model-*` segments (an older version of the file, another layout,
/// another model.path) that no process maps: each removal is one journal
/// entry with DS4_SEGMENT and the bytes freed.
///
/// Only segments of this instance are candidates: those its SegmentLedger
/// lists (what it served, in this runtime folder, at this start or an
/// earlier one), owned by its own uid. Another instance's segment, or
/// another user's, is never touched, mapped or not.
///
/// A sweep runs when the served segment is set (start, reload with a new
/// model), when a worker process went away (the last worker of an old model
/// lets its segment go), and again a while after a sweep had to keep one.
/// Asking who maps what reads every process's maps, which on a big machine
/// takes tens of milliseconds: that part runs on a thread of its own, so the
/// proxy's streams on the io thread do not stall; what to remove is decided
/// (and removed) back on the io thread, against the segment served then.
///
/// Memfd segments the supervisor keeps (MemfdSegments) are swept the same
/// way: one that was served before (or that systemd gave back and the first
/// served one is not) and that no process maps is let go (closed, and removed
/// from systemd's fd store). One that was never served is a reload's new
/// model still on its way to being served, and is left alone.

#include <chrono>
#include <functional>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "shared/model_store.h"
#include "shared/worker_registry.h"
#include "shared/segment_sweep.h"
#include "supervisor/asio.h"
#include "supervisor/memfd_segments.h"
#include "supervisor/policy.h"
#include "supervisor/segment_ledger.h"

namespace ds4::sup {

struct SweeperSettings {
  /// Sweeps are at least this far apart: worker changes come in bursts, and a
  /// sweep that finds candidates reads every process's maps.
  Duration min_interval = std::chrono::seconds(2);
  /// After a sweep that kept a segment (mapped, being loaded, too young), the
  /// next one: catches what goes away without a worker of ours exiting.
  Duration recheck = std::chrono::seconds(30);
  /// Which segments, and how young a segment is spared (tests use their own names).
  store::SweepOptions sweep;
  /// Who maps what, asked anew at every sweep (tests pass their own).
  std::function<store::InUseFn()> in_use = [] { return store::mapped_by_some_process(); };
  /// The same for the memfd segments of `memfds`, by descriptor.
  std::function<store::FdInUseFn()> fd_in_use = [] { return store::fd_mapped_by_some_process(); };
  /// The file listing this instance's segments (SegmentLedger); empty: every
  /// segment of `sweep.prefix` owned by this uid is a candidate (tests with
  /// their own prefix).
  std::string ledger_path;
  /// The memfd segments to sweep too; null: none.
  MemfdSegments* memfds = nullptr;
};

class SegmentSweeper {
 public:
  explicit SegmentSweeper(asio::io_context& io, SweeperSettings settings = {});
  ~SegmentSweeper();
  SegmentSweeper(const SegmentSweeper&) = delete;
  SegmentSweeper& operator=(const SegmentSweeper&) = delete;

  /// The segment served from now on: mapped here (read-only) and never
  /// removed; the one served before is let go. Sweeps soon. A memfd
  /// segment's handle comes with its descriptor `fd`.
  void set_current(const std::string& segment, const store::UniqueFd* fd = nullptr);
  /// Sweeps soon after a worker process of `registry` went away.
  void watch(WorkerRegistry& registry);
  /// Sweeps soon: now, or min_interval after the last sweep.
  void request();
  /// No more sweeps (shutdown).
  void stop();

 private:
  void schedule(TimePoint when);
  void sweep();
  /// Back on the io thread: `used` are the candidates some process maps.
  void finish(const std::vector<std::string>& candidates, const std::set<std::string>& used,
              const std::vector<std::string>& unused_memfds);

  asio::io_context& io_;
  SweeperSettings s_;
  std::string current_;
  std::optional<store::Segment> held_;
  std::optional<SegmentLedger> ledger_;  // none: no ledger_path
  std::set<std::string> retired_memfds_;  // memfd handles that may be let go once unmapped
  std::set<int> pids_;  // worker processes seen at the last registry change
  asio::steady_timer timer_;
  std::optional<TimePoint> due_;  // when the timer fires; none when it is idle
  std::optional<TimePoint> last_sweep_;
  bool stopped_ = false;
  bool scanning_ = false;        // a scan is out on pool_; no second one meanwhile
  asio::thread_pool pool_{1};    // the scans; last, so it is joined before the rest goes
};

}  // namespace ds4::sup
