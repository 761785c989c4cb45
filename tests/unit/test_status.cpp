// The status page's data: the journal events it keeps, the sampled figures,
// their JSON, the route (keys, Basic auth for browsers) and ds4ctl's URL.
#include <doctest/doctest.h>

#include <regex>
#include <set>

#include <nlohmann/json.hpp>

#include "shared/error.h"
#include "shared/gguf.h"
#include "shared/log.h"
#include "supervisor/proxy/api_keys.h"
#include "supervisor/proxy/metrics.h"
#include "supervisor/proxy/router.h"
#include "supervisor/status_client.h"
#include "supervisor/status_history.h"
#include "supervisor/worker_manager.h"

using namespace ds4::sup;
namespace http = boost::beast::http;

namespace {

std::optional<StatusEvent> event_of(std::initializer_list<ds4::log::Field> fields, int64_t t = 1000) {
  return status_event(ds4::log::Level::warn, "worker 0 OOM-killed", std::span<const ds4::log::Field>(fields.begin(), fields.size()), t);
}

}  // namespace

TEST_CASE("status events: the journal's DS4_EVENT entries, refused requests left out") {
  auto e = event_of({{"DS4_EVENT", "downgrade"}, {"DS4_WORKER", "2"}, {"DS4_CONTEXT_FROM", "4096"}, {"DS4_CONTEXT_TO", "2048"},
                     {"DS4_REASON", "oom"}});
  REQUIRE(e);
  CHECK(e->event == "downgrade");
  CHECK(e->worker == 2);
  CHECK(e->context_from == 4096);
  CHECK(e->context_to == 2048);
  CHECK(e->level == "warning");
  CHECK(e->message == "worker 0 OOM-killed");
  CHECK(e->time_ms == 1000);
  CHECK_FALSE(event_of({{"DS4_WORKER", "0"}}));            // no DS4_EVENT: a plain line
  CHECK_FALSE(event_of({{"DS4_EVENT", "refused"}}));       // one per refused request: /metrics counts them
  auto r = event_of({{"DS4_EVENT", "reload"}, {"DS4_WORKER", "x"}});
  REQUIRE(r);
  CHECK(r->worker == -1);  // not a number: not about one worker
}

TEST_CASE("status events: the ring keeps the last N, and what is since a time") {
  EventRing ring(3);
  for (int i = 0; i < 5; ++i) ring.add({.time_ms = 1000 * i, .event = "e" + std::to_string(i)});
  CHECK(ring.size() == 3);
  auto all = ring.since(0);
  REQUIRE(all.size() == 3);
  CHECK(all.front().event == "e2");
  CHECK(all.back().event == "e4");
  CHECK(ring.since(3000).size() == 2);
  CHECK(ring.since(5000).empty());
  ring.set_capacity(1);
  CHECK(ring.since(0).size() == 1);
  CHECK(ring.since(0)[0].event == "e4");

  const nlohmann::json j = events_json({{.time_ms = 5, .event = "oom", .worker = 0, .context_from = 8, .context_to = 4},
                                        {.time_ms = 6, .event = "reload"}});
  REQUIRE(j.size() == 2);
  CHECK(j[0]["worker"] == 0);
  CHECK(j[0]["context_to"] == 4);
  CHECK(j[1]["worker"].is_null());
  CHECK_FALSE(j[1].contains("context_from"));
}

TEST_CASE("status events: the log observer sees every entry once, from any thread") {
  EventRing ring(10);
  ds4::log::set_observer([&](ds4::log::Level l, std::string_view m, std::span<const ds4::log::Field> f) {
    if (auto e = status_event(l, m, f, 1)) ring.add(std::move(*e));
  });
  ds4::log::set_level(ds4::log::Level::info);
  ds4::log::info("worker 1 ready", {{"DS4_WORKER", "1"}});
  ds4::log::warn("worker 1 hung", {{"DS4_EVENT", "hang"}, {"DS4_WORKER", "1"}});
  std::thread([] { ds4::log::info("reload", {{"DS4_EVENT", "reload"}}); }).join();
  ds4::log::set_observer(nullptr);
  ds4::log::info("after", {{"DS4_EVENT", "backoff"}});
  ds4::log::set_level(ds4::log::Level::debug);
  auto got = ring.since(0);
  REQUIRE(got.size() == 2);
  CHECK(got[0].event == "hang");
  CHECK(got[1].event == "reload");
}

TEST_CASE("status samples: a bounded ring, as columns") {
  SampleRing ring(3);
  for (int i = 0; i < 4; ++i) {
    StatusSample s;
    s.time_ms = i;
    s.host_available = 100 + i;
    s.min_available = 50;
    s.waiting = i;
    if (i == 3) {
      s.gpu_free = 7;
      s.latency_p50_s = 0.5;
    }
    ring.push(s);
  }
  REQUIRE(ring.samples().size() == 3);
  const nlohmann::json j = samples_json(ring.samples());
  CHECK(j["time_ms"] == nlohmann::json({1, 2, 3}));
  CHECK(j["host_available"] == nlohmann::json({101, 102, 103}));
  CHECK(j["gpu_free"] == nlohmann::json({nullptr, nullptr, 7}));
  CHECK(j["latency_p50_s"][2] == 0.5);
  CHECK(j["latency_max_s"][2].is_null());
  for (const char* k : {"min_available", "waiting", "in_flight", "tokens_per_s", "answered"}) CHECK(j[k].size() == 3);
  ring.set_capacity(1);
  CHECK(samples_json(ring.samples())["time_ms"] == nlohmann::json({3}));
  CHECK(samples_json({})["time_ms"].empty());
}

TEST_CASE("status samples: tokens/s and the latencies of the requests answered between two readings") {
  ProxyActivity a, b;
  a.generated_tokens = 100;
  a.answered = 2;
  a.recent_latency_s = {9, 9};
  b.generated_tokens = 150;
  b.answered = 5;
  b.recent_latency_s = {9, 9, 0.3, 0.1, 0.2};
  ActivityDelta d = activity_delta(a, b, 5.0);
  CHECK(d.tokens_per_s == doctest::Approx(10));
  CHECK(d.answered == 3);
  REQUIRE(d.latency_p50_s);
  CHECK(*d.latency_p50_s == doctest::Approx(0.2));
  CHECK(*d.latency_max_s == doctest::Approx(0.3));

  d = activity_delta(b, b, 5.0);  // nothing answered: no latency (not 0)
  CHECK(d.answered == 0);
  CHECK_FALSE(d.latency_p50_s);
  CHECK(d.tokens_per_s == 0);

  ProxyActivity c = b;  // more answered than kept: the kept ones
  c.answered = b.answered + 100;
  d = activity_delta(b, c, 1.0);
  CHECK(d.answered == 100);
  CHECK(*d.latency_max_s == 9);

  ProxyActivity restarted;  // counters went back (a new proxy): no negative rates
  d = activity_delta(b, restarted, 1.0);
  CHECK(d.tokens_per_s == 0);
  CHECK(d.answered == 0);
}

TEST_CASE("status: requests in flight") {
  std::vector<RequestView> v(2);
  v[0] = {.endpoint = "POST /v1/chat/completions", .running = true, .worker = 1, .age_ms = 1500, .prompt_tokens = 12,
          .generated = 3, .resumes = 1};
  v[1] = {.endpoint = "POST /v1/messages", .running = false, .worker = 4};
  const nlohmann::json j = requests_json(v);
  CHECK(j[0]["state"] == "running");
  CHECK(j[0]["worker"] == 1);
  CHECK(j[0]["resumes"] == 1);
  CHECK(j[1]["state"] == "waiting");
  CHECK(j[1]["worker"].is_null());  // waiting: on no worker
}

TEST_CASE("api keys: Basic authorization carries the key as the password, for browsers") {
  using ds4::proxy::ApiKeys;
  CHECK(ds4::proxy::base64_decode("dXNlcjpzZWNyZXQ=") == "user:secret");
  CHECK(ds4::proxy::base64_decode("dXNlcjpzZWNyZXQ") == "user:secret");
  CHECK(ds4::proxy::base64_decode("not base64!").empty());
  CHECK(ApiKeys::presented("Basic dXNlcjpzZWNyZXQ=", "") == "secret");
  CHECK(ApiKeys::presented("basic c2VjcmV0Og==", "") == "secret");  // "secret:": the user name
  CHECK(ApiKeys::presented("Basic !!!", "other") == "");
  CHECK(ApiKeys::presented("Bearer k", "") == "k");
}

namespace {

const ds4::proxy::ModelText& stories() {
  static const ds4::gguf::File file = ds4::gguf::File::open(DS4_SHARED_MODELS "/stories260K.gguf");
  static const ds4::proxy::ModelText m = ds4::proxy::ModelText::from_gguf(file, "stories");
  return m;
}

ds4::proxy::HttpRequest get(const std::string& target, const std::string& auth = "") {
  ds4::proxy::HttpRequest r{http::verb::get, target, 11};
  if (!auth.empty()) r.set(http::field::authorization, auth);
  return r;
}

std::string header(const ds4::proxy::Response& r, const std::string& name) {
  for (const auto& [k, v] : r.headers)
    if (k == name) return v;
  return {};
}

}  // namespace

TEST_CASE("router: /status is the page, /status.json its data, both behind the API's keys") {
  ds4::proxy::ApiKeys keys;
  std::vector<WorkerInfo> workers(1);
  workers[0].state = WorkerState::ready;
  workers[0].context = 4096;
  workers[0].restarts = 2;
  ds4::proxy::PlanLimits limits;
  limits.context = 512;
  ds4::proxy::RouteContext ctx{stories(), keys, limits, [&] { return workers; }, nullptr, false};

  auto r = ds4::proxy::route(get("/status"), ctx);
  REQUIRE(r.response);
  CHECK(r.response->status == 200);
  CHECK(r.response->content_type.starts_with("text/html"));
  CHECK(header(*r.response, "Cache-Control") == "no-store");
  CHECK(header(*r.response, "Content-Security-Policy").find("default-src 'none'") != std::string::npos);
  const std::string& page = r.response->body;
  CHECK(page.find("<meta name=\"viewport\"") != std::string::npos);
  CHECK(page.find("status.json") != std::string::npos);
  // Self-contained: nothing loaded from elsewhere.
  CHECK(page.find("<script src") == std::string::npos);
  CHECK(page.find("<link") == std::string::npos);
  CHECK(page.find("https://") == std::string::npos);

  // Without a supervisor behind the proxy: the workers from the registry.
  r = ds4::proxy::route(get("/status.json"), ctx);
  REQUIRE(r.response);
  CHECK(r.response->status == 200);
  auto j = nlohmann::json::parse(r.response->body);
  CHECK(j["workers"][0]["state"] == "ready");
  CHECK(j["workers"][0]["restarts"] == 2);
  CHECK(j["model"]["name"] == "stories");
  // With one: its JSON as it is.
  ctx.status = [] { return std::string(R"({"from":"supervisor"})"); };
  r = ds4::proxy::route(get("/status.json?x=1"), ctx);
  CHECK(nlohmann::json::parse(r.response->body)["from"] == "supervisor");
  // HEAD answers; POST does not.
  auto head = get("/status");
  head.method(http::verb::head);
  CHECK(ds4::proxy::route(head, ctx).response->status == 200);
  auto post = get("/status.json");
  post.method(http::verb::post);
  CHECK(ds4::proxy::route(post, ctx).response->status == 405);

  keys.set({"sk-1"});
  for (const char* path : {"/status", "/status.json"}) {
    r = ds4::proxy::route(get(path), ctx);
    CHECK(r.response->status == 401);
    CHECK(header(*r.response, "WWW-Authenticate").starts_with("Basic realm="));  // a browser asks for it
    CHECK(ds4::proxy::route(get(path, "Bearer sk-2"), ctx).response->status == 401);
    CHECK(ds4::proxy::route(get(path, "Bearer sk-1"), ctx).response->status == 200);
    CHECK(ds4::proxy::route(get(path, "Basic ZHM0OnNrLTE="), ctx).response->status == 200);  // ds4:sk-1
  }
  // The API keeps its own challenge.
  r = ds4::proxy::route(get("/v1/models"), ctx);
  CHECK(header(*r.response, "WWW-Authenticate") == "Bearer");
}

TEST_CASE("metrics: request latency histogram, and the totals the status page samples") {
  ds4::proxy::Metrics m;
  m.observe_answer(0.03);
  m.observe_answer(0.7);
  m.observe_answer(1000);
  m.add_tokens_out(5);
  ProxyActivity a;
  m.fill(a);
  CHECK(a.answered == 3);
  CHECK(a.generated_tokens == 5);
  CHECK(a.recent_latency_s == std::vector<double>{0.03, 0.7, 1000});
  for (int i = 0; i < int(ProxyActivity::kRecentLatencies); ++i) m.observe_answer(0.1);
  m.fill(a);
  CHECK(a.recent_latency_s.size() == ProxyActivity::kRecentLatencies);
}

TEST_CASE("ds4ctl status --url: the address of the status JSON") {
  auto u = parse_status_url("http://127.0.0.1:18080");
  CHECK(u.host == "127.0.0.1");
  CHECK(u.port == "18080");
  CHECK(u.target == "/status.json");
  u = parse_status_url("http://[::1]:8080/");
  CHECK(u.host == "::1");
  CHECK(u.target == "/status.json");
  u = parse_status_url("http://box/ds4/status.json");
  CHECK(u.port == "80");
  CHECK(u.target == "/ds4/status.json");
  CHECK_THROWS_AS(parse_status_url("https://box"), ds4::Error);
  CHECK_THROWS_AS(parse_status_url("http://:80"), ds4::Error);
  CHECK_THROWS_AS(fetch_status("http://127.0.0.1:1", "", std::chrono::milliseconds(500)), ds4::Error);
}

TEST_CASE("status metrics: headroom figures, worker uptime and the model's size for /metrics") {
  const nlohmann::json s = {{"headroom", {{"host_available", 100}, {"gpu_free", nullptr}, {"min_available", 5}}},
                            {"workers", {{{"id", 0}, {"uptime_ms", 1500}}, {{"id", 1}, {"uptime_ms", nullptr}}}},
                            {"model", {{"bytes", 1234}}}};
  const std::string m = status_metrics(s);
  CHECK(m.find("ds4_headroom{reading=\"host_available\"} 100\n") != std::string::npos);
  CHECK(m.find("gpu_free") == std::string::npos);  // not known: no sample (not 0)
  CHECK(m.find("ds4_worker_uptime_seconds{worker=\"0\"} 1.500\n") != std::string::npos);
  CHECK(m.find("ds4_worker_uptime_seconds{worker=\"1\"} 0.000\n") != std::string::npos);
  CHECK(m.find("ds4_model_bytes 1234\n") != std::string::npos);
  CHECK(m.find("# TYPE ds4_worker_uptime_seconds gauge") != std::string::npos);
}

TEST_CASE("status events: a decision on an expert rung reaches the timeline with both rungs") {
  EventRing ring(10);
  ds4::log::set_observer([&](ds4::log::Level l, std::string_view m, std::span<const ds4::log::Field> f) {
    if (auto e = status_event(l, m, f, 1)) ring.add(std::move(*e));
  });
  ds4::sup::Decision d;
  d.event = "downgrade";
  d.worker = 0;
  d.context_from = d.context_to = 32768;
  d.host_experts_from = 0;
  d.host_experts_to = 12;
  d.reason = "headroom low";
  ds4::sup::log_decision(d);
  ds4::log::set_observer(nullptr);
  const auto got = ring.since(0);
  REQUIRE(got.size() == 1);
  CHECK(got[0].host_experts_from == 0);
  CHECK(got[0].host_experts_to == 12);
  CHECK(got[0].message == "worker 0: downgrade 32768/e0 -> 32768/e12: headroom low");
  const nlohmann::json j = events_json(got);
  CHECK(j[0]["host_experts_to"] == 12);
}
