#pragma once
/// Routing and admission, as a plain function of the request: which endpoint,
/// authentication, and the answer for everything that needs no worker
/// (health, models, metrics, errors). Generation requests come back as a Plan
/// for the session to run. Tested without sockets.

#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include <boost/beast/http.hpp>

#include "shared/worker_registry.h"
#include "supervisor/proxy/api_error.h"
#include "supervisor/proxy/api_keys.h"
#include "supervisor/proxy/api_request.h"
#include "supervisor/proxy/engine_call.h"
#include "supervisor/proxy/model_text.h"

namespace ds4::proxy {

using HttpRequest = boost::beast::http::request<boost::beast::http::string_body>;

struct Response {
  int status = 200;
  std::string content_type = "application/json";
  std::string body;
  std::vector<std::pair<std::string, std::string>> headers;  // extra, e.g. Retry-After
  bool head_only = false;  // a HEAD request's answer: the headers of the GET, no body
};

/// An error answer in `api`'s shape (503 gets Retry-After).
Response error_response(Api api, const ApiError& e);

/// The bytes of a whole response with Content-Length (none on a 204).
std::string serialize(const Response& r, bool keep_alive);

/// The protocol whose error shape a path's answers take: Anthropic's for
/// /v1/messages, OpenAI's for every other path. Known from the request line
/// alone, so errors found before routing (a body too large) use it too.
Api api_of(std::string_view target);

struct RouteContext {
  const ModelText& model;
  const ApiKeys& keys;
  PlanLimits limits;
  std::function<std::vector<sup::WorkerInfo>()> workers;  // for /health
  std::function<std::string()> metrics;        // /metrics text
  bool stopping = false;                       // shutting down: no new work
  bool forward = false;                        // workers are exec engines: requests go to them as they came
  /// /status.json (the supervisor's status_json()); null: a short one made
  /// here from the registry (ds4-proxy on its own).
  std::function<std::string()> status = nullptr;
};

struct Route {
  Api api = Api::openai;              // whose error shape applies
  std::optional<Response> response;   // answer at once …
  std::optional<Plan> plan;           // … or generate
  std::optional<EngineRequest> forward;  // … or forward to an exec engine (RouteContext::forward)
};

/// The request to forward to an exec engine: the body must be a JSON object;
/// "stream" (a boolean) says how to answer. Pure.
std::variant<EngineRequest, ApiError> forward_request(const HttpRequest& req);

Route route(const HttpRequest& req, const RouteContext& ctx);

/// The status page (GET /status): one HTML document, its script and style
/// inline, that draws /status.json every few seconds.
std::string_view status_page();

}  // namespace ds4::proxy
