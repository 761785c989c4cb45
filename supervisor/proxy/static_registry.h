#pragma once
/// A WorkerRegistry over a fixed list of worker sockets, for ds4-proxy's
/// standalone mode and the tests: each socket is probed with {"op":"info"}
/// every `interval`; a worker that answers is ready (context and slots from
/// its answer), one that does not is restarting. A new pid, or a return
/// after an outage, is a new generation. Tests may force a state.

#include <utility>  // before Asio: Boost 1.74's awaitable.hpp needs std::exchange

#include <boost/asio.hpp>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "shared/config.h"
#include "shared/worker_registry.h"

namespace ds4::proxy {

class StaticRegistry : public sup::WorkerRegistry {
 public:
  StaticRegistry(boost::asio::io_context& io, std::vector<std::string> sockets,
                 Duration interval = std::chrono::milliseconds(50));
  ~StaticRegistry() override;

  /// Starts probing.
  void start();
  std::vector<sup::WorkerInfo> workers() const override { return workers_; }
  void on_change(std::function<void()> fn) override { listeners_.push_back(std::move(fn)); }
  /// Holds worker `id` in `state` (nullopt: back to what probing finds).
  void force_state(int id, std::optional<sup::WorkerState> state);

 private:
  struct Probe;
  void probe(size_t i);
  void probed(size_t i, bool ok, int64_t ctx, int64_t slots, int pid);
  void changed();

  boost::asio::io_context& io_;
  Duration interval_;
  std::vector<sup::WorkerInfo> workers_;
  std::vector<std::optional<sup::WorkerState>> forced_;
  std::vector<sup::WorkerState> probed_state_;
  std::vector<std::function<void()>> listeners_;
  std::shared_ptr<bool> alive_;
};

}  // namespace ds4::proxy
