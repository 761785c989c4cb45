#include "supervisor/segment_sweeper.h"

#include <algorithm>

#include "shared/bytes.h"
#include "shared/error.h"
#include "shared/log.h"

namespace ds4::sup {

SegmentSweeper::SegmentSweeper(asio::io_context& io, SweeperSettings settings)
    : io_(io), s_(std::move(settings)), timer_(io) {
  if (!s_.ledger_path.empty()) ledger_.emplace(s_.ledger_path);
}

void SegmentSweeper::set_current(const std::string& segment, const store::UniqueFd* fd) {
  if (s_.memfds) {
    if (current_.empty()) {
      // The first one served: what systemd gave back besides it is left over.
      for (const std::string& handle : s_.memfds->handles()) retired_memfds_.insert(handle);
    } else if (segment != current_ && store::is_memfd_handle(current_)) {
      retired_memfds_.insert(current_);
    }
    retired_memfds_.erase(segment);
  }
  if (segment != current_ || !held_) {
    held_.reset();
    current_ = segment;
    if (segment.empty()) return request();  // none served (an exec engine reads the file itself)
    if (ledger_ && !store::is_memfd_handle(segment)) ledger_->add(segment);
    try {
      held_.emplace(fd ? store::Segment::attach_fd(fd->get(), segment) : store::Segment::attach(segment));
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

SegmentSweeper::~SegmentSweeper() {
  stop();
  pool_.join();  // a scan still out finishes; its result is dropped with the io_context's queue
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
  if (scanning_) return request();
  last_sweep_ = std::chrono::steady_clock::now();
  std::vector<std::string> candidates;
  try {
    for (std::string& name : store::list_segments(s_.sweep.prefix))
      if (name != current_ && (!ledger_ || ledger_->contains(name))) candidates.push_back(std::move(name));
  } catch (const Error& e) {
    log::warn(std::string("cannot look for old model segments: ") + e.what() + ", ignoring");
  }
  // Memfd segments kept and not served, with their descriptors (alive while asked about).
  std::vector<std::pair<std::string, std::shared_ptr<store::UniqueFd>>> memfds;
  if (s_.memfds) {
    for (const std::string& handle : s_.memfds->handles())
      if (handle != current_ && retired_memfds_.count(handle))
        if (auto fd = s_.memfds->fd(handle)) memfds.emplace_back(handle, std::move(fd));
  }
  if (candidates.empty() && memfds.empty()) return;
  scanning_ = true;
  // The work guard keeps io_ running until the answer is back on it.
  asio::post(pool_, [this, candidates = std::move(candidates), memfds = std::move(memfds), in_use = s_.in_use(),
                     fd_in_use = s_.fd_in_use(), work = asio::make_work_guard(io_)]() mutable {
    std::set<std::string> used;
    for (const std::string& name : candidates) {
      try {
        if (in_use(name)) used.insert(name);
      } catch (...) {
        used.insert(name);  // not knowable: kept
      }
    }
    std::vector<std::string> unused_memfds;
    for (const auto& [handle, fd] : memfds) {
      try {
        if (!fd_in_use(fd->get())) unused_memfds.push_back(handle);
      } catch (...) {
        // not knowable: kept
      }
    }
    const bool kept_memfd = unused_memfds.size() < memfds.size();
    asio::post(io_, [this, candidates = std::move(candidates), used = std::move(used),
                     unused_memfds = std::move(unused_memfds), kept_memfd] {
      scanning_ = false;
      if (stopped_) return;
      finish(candidates, used, unused_memfds);
      if (kept_memfd) schedule(*last_sweep_ + s_.recheck);
    });
  });
}

void SegmentSweeper::finish(const std::vector<std::string>& candidates, const std::set<std::string>& used,
                            const std::vector<std::string>& unused_memfds) {
  for (const std::string& handle : unused_memfds) {
    // Served again since it was asked about: kept.
    if (handle == current_ || !s_.memfds || !retired_memfds_.count(handle)) continue;
    retired_memfds_.erase(handle);
    const uint64_t bytes = s_.memfds->release(handle);
    if (bytes == 0) continue;
    log::info("released old memfd segment " + handle + " (" + format_bytes(bytes) + " freed): no process maps it",
              {{"DS4_EVENT", "segment_removed"},
               {"DS4_SEGMENT", handle},
               {"DS4_BACKING", "memfd"},
               {"DS4_BYTES_FREED", std::to_string(bytes)}});
  }
  if (candidates.empty()) return;
  // A segment that was no candidate (it came since, or became the served one's
  // neighbour in between) was not asked about: kept until the next sweep.
  const auto in_use = [&](const std::string& name) {
    return used.count(name) > 0 || std::find(candidates.begin(), candidates.end(), name) == candidates.end();
  };
  // Listed but gone (removed by hand, or by this instance before a crash): unlisted.
  if (ledger_) {
    const std::vector<std::string> present = store::list_segments(s_.sweep.prefix);
    for (const std::string& name : std::set<std::string>(ledger_->names()))
      if (name != current_ && std::find(present.begin(), present.end(), name) == present.end()) ledger_->remove(name);
  }
  store::SweepResult r;
  try {
    r = store::remove_unused_segments(current_, in_use, s_.sweep);
  } catch (const Error& e) {
    log::warn(std::string("cannot look for old model segments: ") + e.what() + ", ignoring");
    return;
  }
  for (const store::RemovedSegment& g : r.removed) {
    if (ledger_) ledger_->remove(g.name);
    log::info("removed old model segment " + g.name + " (" + format_bytes(g.bytes) + " freed): no process maps it",
              {{"DS4_EVENT", "segment_removed"},
               {"DS4_SEGMENT", g.name},
               {"DS4_BYTES_FREED", std::to_string(g.bytes)}});
  }
  if (!r.kept.empty()) schedule(*last_sweep_ + s_.recheck);
}

}  // namespace ds4::sup
