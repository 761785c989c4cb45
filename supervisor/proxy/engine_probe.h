#pragma once
/// Asking an exec engine things besides forwarding a client's request: one
/// request whose whole answer is wanted (stream or not), and the probe of
/// what the engine can do for a resume (engine_resume.h), run once per
/// engine start before the engine gets its first job.

#include <utility>  // before Asio: Boost 1.74's awaitable.hpp needs std::exchange

#include <boost/asio.hpp>
#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "supervisor/proxy/engine_call.h"
#include "supervisor/proxy/engine_resume.h"

namespace ds4::proxy {

/// The answer of one request, whole: `status` 0 with `why` when none came;
/// `replay` as EngineCall's broken (another try may succeed).
struct EngineReply {
  int status = 0;
  std::string body;
  std::string why;
  bool replay = true;
};

/// Sends `req` and reads its whole answer (a stream's events concatenated).
std::shared_ptr<EngineCall> fetch_whole(boost::asio::io_context& io, int port, const EngineRequest& req,
                                        const EngineLimits& limits, std::function<void(EngineReply)> done);

/// Probes the engine on `port`: /tokenize, /apply-template, a one-token
/// completion of ids with n_probs. Each step bounded by `timeout`; `done`
/// gets the caps (probed; what did not answer as llama-server does is false).
void probe_engine(boost::asio::io_context& io, int port, const EngineLimits& limits,
                  std::chrono::milliseconds timeout, std::function<void(EngineCaps)> done);

}  // namespace ds4::proxy
