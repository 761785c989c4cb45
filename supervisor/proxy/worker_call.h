#pragma once
/// Generate requests to workers over their Unix sockets (shared/protocol.h),
/// on connections kept open between requests. A call sends its request line
/// and reads event lines until done or error. Closing a connection cancels
/// the work on the worker, so a call that is cancelled, breaks, or ends any
/// other way than a clean done closes its connection; only a connection whose
/// call ended with done and nothing after it goes back to the pool, and an
/// idle connection that receives anything (EOF, a stray byte) is closed and
/// forgotten: a reused connection never carries an earlier request's events.
/// A call that fails or ends before done/error is reported as broken, with
/// whether the worker had answered at all (a refused connect is not a death
/// mid-answer).
///
/// Everything runs on the io_context's one thread.

#include <utility>  // before Asio: Boost 1.74's awaitable.hpp needs std::exchange

#include <boost/asio.hpp>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "shared/protocol.h"
#include "supervisor/worker_registry.h"

namespace ds4::proxy {

class WorkerLink;
class WorkerPool;

/// The worker process a call goes to.
struct WorkerTarget {
  int id = 0;
  uint64_t generation = 0;  // connections of another generation are never reused
  std::string socket_path;
  size_t max_idle = 1;      // connections kept open while idle (its slots)
};

class WorkerCall : public std::enable_shared_from_this<WorkerCall> {
 public:
  struct Handler {
    std::function<void(proto::Event&&)> on_event;             // token, then done or error
    std::function<void(const std::string& why, bool answered)> on_broken;
  };

  WorkerCall(std::string request_line, Handler h) : request_(std::move(request_line)), h_(std::move(h)) {}
  ~WorkerCall();
  /// Closes the connection (the worker stops); no callback runs after this.
  void cancel();

 private:
  friend class WorkerLink;
  friend class WorkerPool;
  void send();
  void broken(const std::string& why);

  std::string request_;
  Handler h_;
  std::shared_ptr<WorkerLink> link_;  // while the call runs
  bool answered_ = false;
  bool finished_ = false;
};

class WorkerPool {
 public:
  explicit WorkerPool(boost::asio::io_context& io) : io_(io) {}
  /// Closes every idle connection.
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  /// Starts a call with `request_line` on worker `w`: on its most recently
  /// used idle connection when it has one, else on a new connection. The
  /// handler runs only after this returns.
  std::shared_ptr<WorkerCall> call(const WorkerTarget& w, std::string request_line, WorkerCall::Handler h);
  /// Closes the idle connections of every worker that is not ready in
  /// `workers` or is another process (generation) now.
  void retain(const std::vector<sup::WorkerInfo>& workers);

  size_t idle(int worker) const;
  /// Connections opened so far.
  int64_t opened() const { return opened_; }

 private:
  friend class WorkerLink;
  void put(const std::shared_ptr<WorkerLink>& link);
  void forget(const WorkerLink* link);

  boost::asio::io_context& io_;
  std::map<int, std::vector<std::shared_ptr<WorkerLink>>> idle_;  // by worker id, most recent last
  int64_t opened_ = 0;
};

}  // namespace ds4::proxy
