#include "supervisor/status_client.h"

#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include "shared/error.h"
#include "supervisor/asio.h"

namespace ds4::sup {

namespace beast = boost::beast;
namespace http = beast::http;

StatusUrl parse_status_url(const std::string& url) {
  const std::string scheme = "http://";
  if (url.rfind(scheme, 0) != 0)
    throw Error("--url " + url + ": expected http://HOST:PORT (https is not served; put a TLS proxy in front)");
  std::string rest = url.substr(scheme.size());
  StatusUrl u;
  const size_t slash = rest.find('/');
  u.target = slash == std::string::npos ? "/" : rest.substr(slash);
  rest = rest.substr(0, slash);
  if (u.target == "/") u.target = "/status.json";
  if (!rest.empty() && rest.front() == '[') {  // [::1]:8080
    const size_t close = rest.find(']');
    if (close == std::string::npos) throw Error("--url " + url + ": no ']' after the IPv6 address");
    u.host = rest.substr(1, close - 1);
    rest = rest.substr(close + 1);
    if (!rest.empty() && rest.front() == ':') u.port = rest.substr(1);
    else if (!rest.empty()) throw Error("--url " + url + ": expected ':PORT' after ']'");
  } else {
    const size_t colon = rest.rfind(':');
    u.host = rest.substr(0, colon);
    if (colon != std::string::npos) u.port = rest.substr(colon + 1);
  }
  if (u.host.empty()) throw Error("--url " + url + ": no host");
  if (u.port.empty()) u.port = "80";
  return u;
}

nlohmann::json fetch_status(const std::string& url, const std::string& key, std::chrono::milliseconds timeout) {
  const StatusUrl u = parse_status_url(url);
  asio::io_context io;
  beast::tcp_stream stream(io);
  http::response<http::string_body> res;
  beast::error_code failed;
  std::string stage = "resolve";
  asio::ip::tcp::resolver resolver(io);
  http::request<http::empty_body> req{http::verb::get, u.target, 11};
  req.set(http::field::host, u.host + ":" + u.port);
  req.set(http::field::user_agent, "ds4ctl");
  if (!key.empty()) req.set(http::field::authorization, "Bearer " + key);
  beast::flat_buffer buf;
  stream.expires_after(timeout);
  resolver.async_resolve(u.host, u.port, [&](beast::error_code ec, asio::ip::tcp::resolver::results_type r) {
    if (ec) return void(failed = ec);
    stage = "connect";
    stream.async_connect(r, [&](beast::error_code ec, const asio::ip::tcp::endpoint&) {
      if (ec) return void(failed = ec);
      stage = "send";
      http::async_write(stream, req, [&](beast::error_code ec, size_t) {
        if (ec) return void(failed = ec);
        stage = "read the answer";
        http::async_read(stream, buf, res, [&](beast::error_code ec, size_t) { failed = ec; });
      });
    });
  });
  io.run();
  if (failed)
    throw Error("cannot " + stage + " " + url + ": " + failed.message() + " (is ds4-supervisor serving there?)");
  if (res.result_int() != 200) {
    std::string why = res.body();
    const auto j = nlohmann::json::parse(why, nullptr, false);
    if (j.is_object() && j.contains("error") && j["error"].is_object()) why = j["error"].value("message", why);
    throw Error(url + " answered " + std::to_string(res.result_int()) + ": " + why.substr(0, 300) +
                (res.result_int() == 401 ? " (give the key with --key or $DS4_API_KEY)" : ""));
  }
  auto j = nlohmann::json::parse(res.body(), nullptr, false);
  if (j.is_discarded() || !j.is_object()) throw Error(url + ": the answer is not a JSON object");
  return j;
}

}  // namespace ds4::sup
