#pragma once
/// How a job ended (the scheduler's word to the request's owner).

#include <string>

#include "shared/protocol.h"
#include "supervisor/proxy/api_error.h"

namespace ds4::proxy {

struct JobResult {
  bool ok = true;
  std::string reason;     // ok: "stop" (end of turn, or the sink stopped it) or "length"
  proto::Timings timings; // summed over every worker that worked on it
  ApiError error;         // !ok
};

}  // namespace ds4::proxy
