#pragma once
/// Generate requests to workers over their Unix sockets (shared/protocol.h).
/// All calls to one worker process share one connection: each request line
/// carries an id, the worker's events come back with it, and a step's events
/// of every call arrive in one read. A call reads its events until done or
/// error; cancelling it sends the worker a cancel for its id (events still
/// on their way for it are dropped). When the connection fails (the worker
/// died, closed it, or broke the protocol), every call on it is reported as
/// broken, with whether the worker had answered it at all (a refused connect
/// is not a death mid-answer). A worker that stops being ready, or is
/// replaced, keeps its connection only for the calls still running on it.
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
#include "shared/worker_registry.h"

namespace ds4::proxy {

class WorkerLink;
class WorkerPool;

/// The worker process a call goes to.
struct WorkerTarget {
  int id = 0;
  uint64_t generation = 0;  // a connection to another generation (process) is never used for new calls
  std::string socket_path;
};

class WorkerCall : public std::enable_shared_from_this<WorkerCall> {
 public:
  struct Handler {
    std::function<void(proto::Event&&)> on_event;             // token, then done or error
    std::function<void(const std::string& why, bool answered)> on_broken;
  };

  explicit WorkerCall(Handler h) : h_(std::move(h)) {}
  ~WorkerCall();
  /// Tells the worker to stop it; no callback runs after this.
  void cancel();
  /// Its request id on its connection to the worker.
  int64_t id() const { return id_; }

 private:
  friend class WorkerLink;
  void broken(const std::string& why);

  Handler h_;
  std::shared_ptr<WorkerLink> link_;  // while the call runs
  int64_t id_ = 0;                    // its request id on the link
  bool answered_ = false;
  bool finished_ = false;
};

class WorkerPool {
 public:
  explicit WorkerPool(boost::asio::io_context& io) : io_(io) {}
  /// Closes every connection.
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  /// Starts a call of `g` on worker `w`, on its connection (opened now if it
  /// has none). The handler runs only after this returns.
  std::shared_ptr<WorkerCall> call(const WorkerTarget& w, const proto::GenerateRequest& g, WorkerCall::Handler h);
  /// Retires the connection of every worker that is not ready in `workers`
  /// or is another process (generation) now: it takes no new call and closes
  /// once its running calls end.
  void retain(const std::vector<sup::WorkerInfo>& workers);

  /// Whether worker `worker` has a connection for new calls.
  bool connected(int worker) const;
  /// Connections opened so far.
  int64_t opened() const { return opened_; }

 private:
  friend class WorkerLink;
  void forget(const WorkerLink* link);

  boost::asio::io_context& io_;
  std::map<int, std::shared_ptr<WorkerLink>> links_;  // by worker id: the connection new calls take
  int64_t opened_ = 0;
  std::shared_ptr<bool> alive_ = std::make_shared<bool>(true);
};

}  // namespace ds4::proxy
