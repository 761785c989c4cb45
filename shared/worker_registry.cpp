#include "shared/worker_registry.h"

namespace ds4::sup {

const char* state_name(WorkerState s) {
  switch (s) {
    case WorkerState::starting: return "starting";
    case WorkerState::ready: return "ready";
    case WorkerState::draining: return "draining";
    case WorkerState::restarting: return "restarting";
    case WorkerState::backoff: return "backoff";
    case WorkerState::stopped: return "stopped";
  }
  return "?";
}

}  // namespace ds4::sup
