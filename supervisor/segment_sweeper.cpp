#include "supervisor/segment_sweeper.h"

#include <algorithm>

#include "shared/error.h"
#include "shared/log.h"

namespace ds4::sup {

SegmentSweeper::SegmentSweeper(asio::io_context& io, SweeperSettings settings)
    : io_(io), s_(std::move(settings)), timer_(io) {}

void SegmentSweeper::set_current(const std::string& segment) {
  if (segment != current_ || !held_) {
    held_.reset();
    current_ = segment;
    try {
      held_.emplace(store::Segment::attach(segment));
    } catch (const Error& e) {
      // Our own sweeps still spare it; another supervisor's may not.
      log::warn(std::string("cannot keep the model segment mapped: ") + e.what() + ", ignoring",
                {{"DS4_SEGMENT", segment}});
    }
  }
  request();
}

void SegmentSweeper::watch(WorkerRegistry& registry) {
  registry.on_change([this, &registry] {
    std::set<int> now;
    for (const WorkerInfo& w : registry.workers())
      if (w.pid > 0) now.insert(w.pid);
    // A pid no longer there: that process exited, and with it its mappings.
    const bool gone = std::any_of(pids_.begin(), pids_.end(), [&](int pid) { return !now.count(pid); });
    pids_ = std::move(now);
    if (gone) request();
  });
}

void SegmentSweeper::request() {
  const TimePoint t = std::chrono::steady_clock::now();
  schedule(last_sweep_ ? std::max(t, *last_sweep_ + s_.min_interval) : t);
}

void SegmentSweeper::stop() {
  stopped_ = true;
  due_.reset();
  timer_.cancel();
}

void SegmentSweeper::schedule(TimePoint when) {
  if (stopped_ || (due_ && *due_ <= when)) return;
  due_ = when;
  timer_.expires_at(when);  // cancels a later wait
  timer_.async_wait([this](boost::system::error_code ec) {
    if (ec || stopped_) return;
    due_.reset();
    sweep();
  });
}

void SegmentSweeper::sweep() {
  if (current_.empty()) return;  // nothing to spare yet
  last_sweep_ = std::chrono::steady_clock::now();
  store::SweepResult r;
  try {
    r = store::remove_unused_segments(current_, s_.in_use(), s_.sweep);
  } catch (const Error& e) {
    log::warn(std::string("cannot look for old model segments: ") + e.what() + ", ignoring");
    return;
  }
  for (const store::RemovedSegment& g : r.removed) {
    log::info("removed old model segment " + g.name + " (" + human_size(g.bytes) + " freed): no process maps it",
              {{"DS4_EVENT", "segment_removed"},
               {"DS4_SEGMENT", g.name},
               {"DS4_BYTES_FREED", std::to_string(g.bytes)}});
  }
  if (!r.kept.empty()) schedule(*last_sweep_ + s_.recheck);
}

}  // namespace ds4::sup
