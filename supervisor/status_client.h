#pragma once
/// `ds4ctl status --url`: the status JSON read over HTTP (GET /status.json,
/// the page's own), for a supervisor whose admin socket is out of reach (on
/// another machine, in another user's runtime folder).

#include <chrono>
#include <string>

#include <nlohmann/json.hpp>

namespace ds4::sup {

/// Where to ask: "http://HOST:PORT" (the path is /status.json) or a full
/// "http://HOST:PORT/PATH". Throws ds4::Error naming what is wrong.
struct StatusUrl {
  std::string host;
  std::string port;
  std::string target;
};
StatusUrl parse_status_url(const std::string& url);

/// GET `url` with `key` (when not empty) as a Bearer key; the answer's JSON.
/// Throws ds4::Error on no answer, a status other than 200 (with the
/// server's message) or a body that is not JSON.
nlohmann::json fetch_status(const std::string& url, const std::string& key,
                            std::chrono::milliseconds timeout = std::chrono::seconds(10));

}  // namespace ds4::sup
