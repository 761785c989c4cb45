#pragma once
/// Errors as each API shapes them. OpenAI: {"error":{"message","type","param","code"}};
/// Anthropic: {"type":"error","error":{"type","message"}}. The status code and
/// the error type travel together so that a handler names one thing: ApiError.

#include <string>
#include <string_view>

namespace ds4::proxy {

enum class Api { openai, anthropic };

enum class ErrorKind {
  bad_request,     // 400
  unauthorized,    // 401
  not_found,           // 404
  method_not_allowed,  // 405 (the router adds Allow)
  request_timeout,     // 408: the client did not send its request in time
  too_large,       // 413
  headers_too_large,   // 431
  unavailable,     // 503 (Retry-After)
  timeout,         // 504
  internal,        // 500
};

struct ApiError {
  ApiError() = default;
  ApiError(ErrorKind k, std::string m, int retry = 0, std::string p = {})
      : kind(k), message(std::move(m)), retry_after_s(retry), param(std::move(p)) {}
  ErrorKind kind = ErrorKind::internal;
  std::string message;
  int retry_after_s = 0;  // 503: seconds for Retry-After
  std::string param;      // OpenAI's `param`: the request field at fault ("" = null)
};

/// The field a message names first: "'messages[1].role' is …" → "messages[1].role"; "" when none.
std::string param_of(std::string_view message);

int status_of(ErrorKind k);
/// The JSON body of an error, in `api`'s shape.
std::string error_body(Api api, const ApiError& e);

/// A 400 whose param is the field its message names first.
inline ApiError bad_request(std::string m) {
  std::string p = param_of(m);
  return {ErrorKind::bad_request, std::move(m), 0, std::move(p)};
}

}  // namespace ds4::proxy
