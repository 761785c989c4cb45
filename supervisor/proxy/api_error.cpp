#include "supervisor/proxy/api_error.h"

#include <cctype>

#include "supervisor/proxy/json_util.h"

namespace ds4::proxy {

int status_of(ErrorKind k) {
  switch (k) {
    case ErrorKind::bad_request: return 400;
    case ErrorKind::unauthorized: return 401;
    case ErrorKind::not_found: return 404;
    case ErrorKind::method_not_allowed: return 405;
    case ErrorKind::request_timeout: return 408;
    case ErrorKind::too_large: return 413;
    case ErrorKind::headers_too_large: return 431;
    case ErrorKind::unavailable: return 503;
    case ErrorKind::timeout: return 504;
    case ErrorKind::internal: return 500;
  }
  return 500;
}

namespace {

// OpenAI's type and code strings for each kind.
std::pair<const char*, const char*> openai_type(ErrorKind k) {
  switch (k) {
    case ErrorKind::bad_request: return {"invalid_request_error", "invalid_request"};
    case ErrorKind::unauthorized: return {"authentication_error", "invalid_api_key"};
    case ErrorKind::not_found: return {"not_found_error", "not_found"};
    case ErrorKind::method_not_allowed: return {"invalid_request_error", "method_not_allowed"};
    case ErrorKind::request_timeout: return {"invalid_request_error", "request_timeout"};
    case ErrorKind::too_large: return {"invalid_request_error", "request_too_large"};
    case ErrorKind::headers_too_large: return {"invalid_request_error", "request_header_fields_too_large"};
    case ErrorKind::unavailable: return {"unavailable_error", "queue_full"};
    case ErrorKind::timeout: return {"timeout_error", "timeout"};
    case ErrorKind::internal: return {"server_error", "internal_error"};
  }
  return {"server_error", "internal_error"};
}

const char* anthropic_type(ErrorKind k) {
  switch (k) {
    case ErrorKind::bad_request: return "invalid_request_error";
    case ErrorKind::unauthorized: return "authentication_error";
    case ErrorKind::not_found: return "not_found_error";
    case ErrorKind::method_not_allowed: return "invalid_request_error";
    case ErrorKind::request_timeout: return "invalid_request_error";
    case ErrorKind::too_large: return "request_too_large";
    case ErrorKind::headers_too_large: return "request_too_large";
    case ErrorKind::unavailable: return "overloaded_error";
    case ErrorKind::timeout: return "timeout_error";
    case ErrorKind::internal: return "api_error";
  }
  return "api_error";
}

}  // namespace

std::string param_of(std::string_view m) {
  if (!m.starts_with('\'')) return {};
  const size_t end = m.find('\'', 1);
  if (end == std::string_view::npos || end == 1) return {};
  const std::string_view name = m.substr(1, end - 1);
  for (char c : name)  // a field path, not a quoted value
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' || c == '[' || c == ']' || c == '-')) return {};
  return std::string(name);
}

std::string error_body(Api api, const ApiError& e) {
  if (api == Api::anthropic)
    return dump({{"type", "error"}, {"error", {{"type", anthropic_type(e.kind)}, {"message", e.message}}}});
  auto [type, code] = openai_type(e.kind);
  return dump({{"error", {{"message", e.message}, {"type", type}, {"param", e.param.empty() ? json(nullptr) : json(e.param)}, {"code", code}}}});
}

}  // namespace ds4::proxy
