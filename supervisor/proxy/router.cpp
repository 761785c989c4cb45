#include "supervisor/proxy/router.h"

#include <algorithm>
#include <cctype>

#include "supervisor/proxy/json_util.h"
#include "supervisor/proxy/status_page_html.h"

namespace ds4::proxy {

namespace http = boost::beast::http;

Response error_response(Api api, const ApiError& e) {
  Response r;
  r.status = status_of(e.kind);
  r.body = error_body(api, e);
  if (e.kind == ErrorKind::unavailable || e.kind == ErrorKind::timeout)  // not request_timeout: the client was slow
    r.headers.emplace_back("Retry-After", std::to_string(e.retry_after_s > 0 ? e.retry_after_s : 1));
  if (e.kind == ErrorKind::unauthorized && api == Api::openai) r.headers.emplace_back("WWW-Authenticate", "Bearer");
  return r;
}

std::string serialize(const Response& r, bool keep_alive) {
  std::string out = "HTTP/1.1 " + std::to_string(r.status) + " " +
                    std::string(http::obsolete_reason(http::int_to_status(unsigned(r.status)))) + "\r\n";
  if (r.status != 204) {  // No Content: no body, so neither its type nor its length (RFC 9110)
    out += "Content-Type: " + r.content_type + "\r\n";
    out += "Content-Length: " + std::to_string(r.body.size()) + "\r\n";
  }
  out += keep_alive ? "Connection: keep-alive\r\n" : "Connection: close\r\n";
  for (auto& [k, v] : r.headers) out += k + ": " + v + "\r\n";
  out += "\r\n";
  if (!r.head_only && r.status != 204) out += r.body;
  return out;
}

namespace {

// The target without its query and trailing slashes; an absolute-form target
// (http://host/path, which servers must accept: RFC 9112 3.2.2) as its path.
std::string_view path_of(std::string_view target) {
  for (std::string_view scheme : {"http://", "https://"})
    if (target.size() > scheme.size() &&
        std::equal(scheme.begin(), scheme.end(), target.begin(), [](char a, char b) { return a == std::tolower(static_cast<unsigned char>(b)); })) {
      const size_t slash = target.find('/', scheme.size());
      target = slash == std::string_view::npos ? std::string_view("/") : target.substr(slash);
    }
  if (auto q = target.find('?'); q != std::string_view::npos) target = target.substr(0, q);
  while (target.size() > 1 && target.back() == '/') target.remove_suffix(1);
  return target;
}

// "/v1/models/NAME" (OpenAI's model retrieval): NAME, else empty.
std::string_view model_of(std::string_view path) {
  for (std::string_view prefix : {"/v1/models/", "/models/"})
    if (path.size() > prefix.size() && path.starts_with(prefix)) return path.substr(prefix.size());
  return {};
}

// What a path is: the methods it answers (its Allow header; empty: no such
// path) and, for the generation paths (POST), their endpoint.
struct PathRoute {
  std::string_view allow;
  std::optional<Endpoint> endpoint;
};

PathRoute route_of(std::string_view path) {
  if (path == "/v1/chat/completions" || path == "/chat/completions") return {"POST, OPTIONS", Endpoint::chat};
  if (path == "/v1/completions" || path == "/completions") return {"POST, OPTIONS", Endpoint::completion};
  if (path == "/v1/messages") return {"POST, OPTIONS", Endpoint::messages};
  if (path == "/v1/messages/count_tokens") return {"POST, OPTIONS", Endpoint::count_tokens};
  if (path == "/v1/responses" || path == "/responses") return {"POST, OPTIONS", Endpoint::responses};
  if (path == "/" || path == "/health" || path == "/metrics" || path == "/v1/models" || path == "/models" ||
      path == "/status" || path == "/status.json" || !model_of(path).empty())
    return {"GET, HEAD, OPTIONS", std::nullopt};
  return {};
}

Api api_for(const PathRoute& r) {
  return r.endpoint == Endpoint::messages || r.endpoint == Endpoint::count_tokens ? Api::anthropic : Api::openai;
}

Response json_response(int status, const json& j) {
  Response r;
  r.status = status;
  r.body = dump(j);
  return r;
}

Response health(const RouteContext& ctx) {
  json workers = json::array();
  int ready = 0;
  for (const auto& w : ctx.workers()) {
    ready += w.state == sup::WorkerState::ready;
    workers.push_back({{"id", w.id}, {"state", sup::state_name(w.state)}, {"context", w.context}, {"slots", w.slots}});
  }
  const bool ok = ready > 0 && !ctx.stopping;
  Response r = json_response(ok ? 200 : 503, {{"status", ok ? "ok" : (ctx.stopping ? "stopping" : "unavailable")},
                                              {"workers_ready", ready},
                                              {"workers", workers}});
  if (!ok) r.headers.emplace_back("Retry-After", "1");
  return r;
}

json model_object(const RouteContext& ctx) {
  return {{"id", ctx.model.name()},
          {"object", "model"},
          {"created", 0},
          {"owned_by", "ds4"},
          {"meta",
           {{"chat_template", family_name(ctx.model.family())},
            {"n_vocab", ctx.model.tokenizer().n_vocab()},
            {"n_ctx", ctx.limits.context}}}};
}

Response models(const RouteContext& ctx) {
  return json_response(200, {{"object", "list"}, {"data", json::array({model_object(ctx)})}});
}

// /status.json without a supervisor behind the proxy: the workers and the queue.
std::string short_status(const RouteContext& ctx) {
  json workers = json::array();
  if (ctx.workers)  // not on the planner's threads (a GET with a long body goes there)
    for (const auto& w : ctx.workers())
      workers.push_back({{"id", w.id},
                       {"state", sup::state_name(w.state)},
                       {"pid", w.pid},
                       {"context", w.context},
                       {"slots", w.slots},
                       {"restarts", w.restarts},
                       {"oom_kills", w.oom_kills}});
  return dump(json{{"workers", workers}, {"model", {{"name", ctx.model.name()}}}});
}

// The page and its data are the service's state: never cached, and the
// page may load nothing from anywhere (everything it needs is inline).
Response status_response(std::string content_type, std::string body) {
  Response r;
  r.content_type = std::move(content_type);
  r.body = std::move(body);
  r.headers.emplace_back("Cache-Control", "no-store");
  r.headers.emplace_back("X-Content-Type-Options", "nosniff");
  r.headers.emplace_back("Content-Security-Policy",
                         "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                         "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'");
  return r;
}

}  // namespace

std::string_view status_page() { return kStatusPageHtml; }

Api api_of(std::string_view target) { return api_for(route_of(path_of(target))); }

Route route(const HttpRequest& req, const RouteContext& ctx) {
  Route out;
  const std::string_view target = path_of(std::string_view(req.target().data(), req.target().size()));
  const PathRoute path = route_of(target);
  const std::string_view allowed = path.allow;
  out.api = api_for(path);
  if (allowed.empty()) {
    out.response = error_response(out.api, {ErrorKind::not_found, "no route for " + std::string(req.method_string()) +
                                                                      " " + std::string(target)});
    return out;
  }
  if (req.method() == http::verb::options) {
    Response r;
    r.status = 204;
    r.headers.emplace_back("Allow", std::string(allowed));
    return out.response = std::move(r), out;
  }
  const bool reads = !path.endpoint;
  if (reads ? req.method() != http::verb::get && req.method() != http::verb::head : req.method() != http::verb::post) {
    out.response = error_response(out.api, {ErrorKind::method_not_allowed,
                                            std::string(req.method_string()) + " " + std::string(target) +
                                                " is not served: use " + (reads ? "GET" : "POST")});
    out.response->headers.emplace_back("Allow", std::string(allowed));
    return out;
  }

  if (target == "/") return out.response = json_response(200, {{"status", "ok"}, {"model", ctx.model.name()}}), out;  // clients probe it
  if (target == "/health") return out.response = health(ctx), out;
  if (target == "/metrics") {
    Response r;
    r.content_type = "text/plain; version=0.0.4; charset=utf-8";
    r.body = ctx.metrics ? ctx.metrics() : "";
    out.response = std::move(r);
    return out;
  }


  auto header = [&](http::field f) {
    auto it = req.find(f);
    return it == req.end() ? std::string_view() : std::string_view(it->value().data(), it->value().size());
  };
  auto x_api_key = [&] {
    auto it = req.find("x-api-key");
    return it == req.end() ? std::string_view() : std::string_view(it->value().data(), it->value().size());
  };
  if (!ctx.keys.accepts(ApiKeys::presented(header(http::field::authorization), x_api_key()))) {
    out.response = error_response(out.api, {ErrorKind::unauthorized, "invalid or missing API key"});
    if (target == "/status" || target == "/status.json")  // a browser asks for the key (as the password)
      out.response->headers = {{"WWW-Authenticate", "Basic realm=\"ds4\", charset=\"UTF-8\""}};
    return out;
  }

  if (target == "/status") return out.response = status_response("text/html; charset=utf-8", std::string(status_page())), out;
  if (target == "/status.json")
    return out.response = status_response("application/json", ctx.status ? ctx.status() : short_status(ctx)), out;

  if (target == "/v1/models" || target == "/models") return out.response = models(ctx), out;
  if (const std::string_view name = model_of(target); !name.empty()) {
    if (name == ctx.model.name()) return out.response = json_response(200, model_object(ctx)), out;
    out.response = error_response(out.api, {ErrorKind::not_found, "no model '" + std::string(name) + "' here; this server serves '" +
                                                                      ctx.model.name() + "'"});
    return out;
  }
  if (ctx.stopping) {
    out.response = error_response(out.api, {ErrorKind::unavailable, "the server is shutting down", 5});
    return out;
  }
  if (ctx.forward) {
    auto f = forward_request(req);
    if (auto* e = std::get_if<ApiError>(&f)) out.response = error_response(out.api, *e);
    else out.forward = std::move(std::get<EngineRequest>(f));
    return out;
  }
  auto plan = parse_request(*path.endpoint, req.body(), ctx.model, ctx.limits);
  if (auto* e = std::get_if<ApiError>(&plan)) out.response = error_response(out.api, *e);
  else if (*path.endpoint == Endpoint::count_tokens)  // Anthropic's: the prompt's length, nothing generated
    out.response = json_response(200, {{"input_tokens", std::get<Plan>(plan).gen.prompt.size()}});
  else out.plan = std::move(std::get<Plan>(plan));
  return out;
}

}  // namespace ds4::proxy
