// ds4ctl: talks to ds4-supervisor over its admin socket (supervisor/admin.h).
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <iostream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "shared/bytes.h"
#include "shared/config.h"
#include "shared/error.h"
#include "supervisor/admin.h"
#include "supervisor/paths.h"
#include "supervisor/policy.h"
#include "supervisor/status_client.h"

namespace {

const char* kUsage =
    "usage: ds4ctl [--socket PATH] COMMAND\n"
    "  status [--json] [--url http://HOST:PORT [--key KEY]]\n"
    "                       workers, headroom, queue and model; with --url, read over\n"
    "                       HTTP from the proxy's GET /status.json (the status page's;\n"
    "                       the key also from $DS4_API_KEY)\n"
    "  events [--json]      the supervisor's last decisions\n"
    "  drain N              stop giving worker N work, then stop it\n"
    "  restart N            restart worker N at its current context\n"
    "  context N SIZE       restart worker N at context SIZE (a ladder rung)\n"
    "  reload               re-read the config (like SIGHUP)\n"
    "The supervisor is found at $XDG_RUNTIME_DIR/ds4/admin.sock.\n";

// A whole number from 0 to 2^31 - 1 (as int, 4294967296 was 0: worker 0 drained).
int parse_int(const std::string& s, const char* what) {
  int64_t v = -1;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || end != s.data() + s.size() || v < 0 || v > INT32_MAX)
    throw ds4::Error(std::string("expected ") + what + " (a whole number from 0 to " + std::to_string(INT32_MAX) +
                     "), got '" + s + "'");
  return int(v);
}

// "1h02m", "3m05s", "12.3s": how long a worker has been up.
std::string uptime_text(int64_t ms) {
  char b[32];
  const int64_t s = ms / 1000;
  if (s >= 86400) std::snprintf(b, sizeof b, "%lldd%02lldh", (long long)(s / 86400), (long long)(s % 86400 / 3600));
  else if (s >= 3600) std::snprintf(b, sizeof b, "%lldh%02lldm", (long long)(s / 3600), (long long)(s % 3600 / 60));
  else if (s >= 60) std::snprintf(b, sizeof b, "%lldm%02llds", (long long)(s / 60), (long long)(s % 60));
  else std::snprintf(b, sizeof b, "%.1fs", double(ms) / 1000.0);
  return b;
}

void print_status(nlohmann::json s) {
  for (const char* part : {"model", "headroom", "queue"})  // a proxy without a supervisor has none of these
    if (!s.contains(part) || !s[part].is_object()) s[part] = nlohmann::json::object();
  if (!s.contains("workers") || !s["workers"].is_array()) s["workers"] = nlohmann::json::array();
  const auto& m = s["model"];
  std::printf("model     %s  segment %s  %s in %s%s\n", m.value("name", "").c_str(), m.value("segment", "").c_str(),
              ds4::format_bytes(m.value("bytes", uint64_t(0))).c_str(), m.value("backing", "shared memory").c_str(),
              m.value("synthetic", false) ? "  (SYNTHETIC, RANDOM WEIGHTS)" : "");
  if (!m.value("segment", "").empty() && m.contains("huge_page_bytes"))  // an exec engine's file has none
    std::printf("pages     %s of the segment in 2 MiB pages%s\n",
                ds4::format_bytes(m.value("huge_page_bytes", uint64_t(0))).c_str(),
                m.value("huge_page_bytes", uint64_t(0)) * 2 < m.value("bytes", uint64_t(0))
                    ? " (4 KiB pages for the rest: slower CPU decoding; see docs/memory.md)" : "");
  if (m.contains("resident") && m["resident"].is_object())
    std::printf("resident  %s of %s kept in memory for the engine (%s)\n",
                ds4::format_bytes(m["resident"].value("resident", uint64_t(0))).c_str(),
                ds4::format_bytes(m["resident"].value("bytes", uint64_t(0))).c_str(),
                m["resident"].value("mode", "").c_str());
  const auto& h = s["headroom"];
  std::printf("headroom  %s available (min %s), PSI some avg10 %.2f%%\n",
              ds4::format_bytes(h.value("host_available", uint64_t(0))).c_str(),
              ds4::format_bytes(h.value("min_available", uint64_t(0))).c_str(), h.value("psi_some_avg10", 0.0));
  if (h.contains("gpu_free") && h["gpu_free"].is_number())
    std::printf("gpu       %s free of %s (the tightest device a worker reports)\n",
                ds4::format_bytes(h["gpu_free"].get<uint64_t>()).c_str(),
                ds4::format_bytes(h.value("gpu_total", uint64_t(0))).c_str());
  std::string per_worker;  // requests running on each worker
  for (const auto& w : s["workers"])
    per_worker += (per_worker.empty() ? " (worker " : ", worker ") + std::to_string(w.value("id", 0)) + ": " +
                  std::to_string(w.value("in_flight", int64_t(0)));
  std::printf("queue     %lld waiting, %lld in flight%s%s\n", (long long)s["queue"].value("waiting", int64_t(0)),
              (long long)s["queue"].value("in_flight", int64_t(0)), per_worker.c_str(), per_worker.empty() ? "" : ")");
  std::printf("backend   %s\n", s.value("backend", "").c_str());
  if (s.contains("holder") && s["holder"].is_object()) {  // GPU weights held across worker restarts
    const auto& g = s["holder"];
    std::string pid = g.contains("pid") && g["pid"].is_number() ? ", pid " + std::to_string(g["pid"].get<int64_t>()) : "";
    std::string last = g.contains("last_exit") && g["last_exit"].is_string() ? ", last exit: " + g["last_exit"].get<std::string>() : "";
    std::printf("holder    %s on %s%s, restarts %lld%s\n", g.value("state", "").c_str(), g.value("device", "").c_str(),
                pid.c_str(), (long long)g.value("restarts", int64_t(0)), last.c_str());
  }
  std::printf("\n");
  std::printf("%-3s %-22s %-10s %-8s %-8s %-5s %-8s %-4s %-10s %s\n", "ID", "UNIT", "STATE", "PID", "CONTEXT", "SLOTS",
              "RESTARTS", "OOM", "HEARTBEAT", "UP");
  for (const auto& w : s["workers"]) {
    std::string state = w.value("state", "");
    if (w.value("degraded", false)) state += "!";
    // Heartbeat age from the worker's control block record; "-" when it keeps none.
    std::string beat = "-";
    if (w.contains("heartbeat_age_ms") && w["heartbeat_age_ms"].is_number()) {
      char b[32];
      std::snprintf(b, sizeof b, "%.1fs ago", double(w["heartbeat_age_ms"].get<int64_t>()) / 1000.0);
      beat = b;
    }
    const std::string up = w.contains("uptime_ms") && w["uptime_ms"].is_number() ? uptime_text(w["uptime_ms"].get<int64_t>()) : "-";
    std::printf("%-3d %-22s %-10s %-8d %-8u %-5u %-8lld %-4lld %-10s %s\n", w.value("id", 0), w.value("unit", "").c_str(),
                state.c_str(), w.value("pid", 0), w.value("context", 0u), w.value("slots", 0u),
                (long long)w.value("restarts", int64_t(0)), (long long)w.value("oom_kills", int64_t(0)), beat.c_str(),
                up.c_str());
    if (w.value("kv_cache", std::string("f16")) != "f16")
      std::printf("    KV cache: %s (a rung of workers.kv_cache)\n", w.value("kv_cache", std::string()).c_str());
    if (w.value("host_experts", 0u) > 0)
      std::printf("    experts on the host: the first %u layers' (an expert rung of workers.moe_offload)\n",
                  w.value("host_experts", 0u));
    if (w.contains("counters")) {
      const auto& c = w["counters"];
      std::printf("    served: %llu requests, %llu tokens in, %llu out, %llu errors\n",
                  (unsigned long long)c.value("requests", uint64_t(0)), (unsigned long long)c.value("tokens_in", uint64_t(0)),
                  (unsigned long long)c.value("tokens_out", uint64_t(0)), (unsigned long long)c.value("errors", uint64_t(0)));
    }
    if (w.contains("decisions") && w["decisions"].is_object()) {
      std::string taken;
      for (const auto& [event, n] : w["decisions"].items())
        if (event != "start" && n.is_number_integer() && n.get<int64_t>() > 0)
          taken += (taken.empty() ? "" : ", ") + std::to_string(n.get<int64_t>()) + " " + event;
      if (!taken.empty()) std::printf("    decisions: %s (ds4ctl events says why)\n", taken.c_str());
    }
    if (w.contains("binary")) {
      std::string cmd = w["binary"].get<std::string>();
      for (const auto& a : w["args"]) cmd += " " + a.get<std::string>();
      std::printf("    runs: %s\n", cmd.c_str());
    }
    if (w.value("degraded", false)) {
      std::printf("    degraded: %lld failures in a row", (long long)w.value("failures", int64_t(0)));
      if (w.contains("backoff_ms")) std::printf(", next try in %lld ms", (long long)w.value("backoff_ms", int64_t(0)));
      std::printf("\n");
    }
    if (!w.value("last_error", "").empty()) std::printf("    last error: %s\n", w.value("last_error", "").c_str());
  }
}

void print_events(const nlohmann::json& a) {
  for (const auto& e : a["events"]) {
    const std::time_t t = std::time_t(e.value("time_ms", int64_t(0)) / 1000);
    char when[32];
    std::strftime(when, sizeof when, "%F %T", std::localtime(&t));
    // An expert rung reads 32768/e4: context 32768 with the experts of 4 layers
    // on the host; a KV rung 32768/q8_0.
    auto rung = [&](const char* ctx, const char* kv, const char* experts) {
      std::string r = std::to_string(e.value(ctx, 0u));
      if (e.contains(kv)) r += "/" + e.value(kv, std::string());
      if (e.contains(experts)) r += "/e" + std::to_string(e.value(experts, 0u));
      return r;
    };
    std::printf("%s  worker %d  %-9s %s -> %s  %s\n", when, e.value("worker", 0), e.value("event", "").c_str(),
                rung("context_from", "kv_cache_from", "host_experts_from").c_str(),
                rung("context_to", "kv_cache_to", "host_experts_to").c_str(),
                e.value("reason", "").c_str());
  }
}

int run(std::vector<std::string> args) {
  std::string socket = ds4::sup::admin_socket_path();
  if (args.size() == 1 && args[0] == "--socket") throw ds4::Error(std::string("--socket needs a PATH\n") + kUsage);
  if (args.size() >= 2 && args[0] == "--socket") {
    socket = args[1];
    args.erase(args.begin(), args.begin() + 2);
  }
  if (args.empty() || args[0] == "--help" || args[0] == "-h") {
    std::fputs(kUsage, args.empty() ? stderr : stdout);
    return args.empty() ? 2 : 0;
  }
  const std::string cmd = args[0];
  std::string url, key;
  if (cmd == "status") {  // --url and --key: over HTTP instead of the admin socket
    for (size_t i = 1; i < args.size();) {
      if ((args[i] == "--url" || args[i] == "--key") && i + 1 < args.size()) {
        (args[i] == "--url" ? url : key) = args[i + 1];
        args.erase(args.begin() + std::ptrdiff_t(i), args.begin() + std::ptrdiff_t(i) + 2);
      } else if (args[i] == "--url" || args[i] == "--key") {
        throw ds4::Error(args[i] + " needs a value\n" + kUsage);
      } else {
        ++i;
      }
    }
    if (!key.empty() && url.empty()) throw ds4::Error(std::string("--key goes with --url\n") + kUsage);
    if (key.empty())
      if (const char* k = std::getenv("DS4_API_KEY")) key = k;
  }
  const bool json = args.size() > 1 && args.back() == "--json";
  nlohmann::json req = {{"cmd", cmd}};
  auto want = [&](size_t n) {
    if (args.size() != n + 1) throw ds4::Error("'" + cmd + "' takes " + std::to_string(n) + " argument(s)\n" + kUsage);
  };
  if (cmd == "status" || cmd == "events") {
    if (args.size() > 2 || (args.size() == 2 && !json))
      throw ds4::Error("'" + cmd + "' takes only --json, not '" + args[1] + "'\n" + kUsage);
  } else if (cmd == "drain" || cmd == "restart") {
    want(1);
    req["worker"] = parse_int(args[1], "a worker id");
  } else if (cmd == "context") {
    want(2);
    req["worker"] = parse_int(args[1], "a worker id");
    req["size"] = parse_int(args[2], "a context size");
  } else if (cmd == "reload") {
    want(0);
  } else {
    throw ds4::Error("unknown command '" + cmd + "'\n" + kUsage);
  }
  nlohmann::json a;
  if (!url.empty()) {
    a = ds4::sup::fetch_status(url, key);
    a["ok"] = true;
  } else {
    a = ds4::sup::admin_call(socket, req);
  }
  if (!a.value("ok", false)) {
    std::fprintf(stderr, "ds4ctl: %s\n", a.value("error", "failed").c_str());
    return 1;
  }
  if (json) {
    nlohmann::json out = a;
    out.erase("ok");
    std::cout << out.dump(2) << std::endl;
  } else if (cmd == "status") {
    print_status(a);
  } else if (cmd == "events") {
    print_events(a);
  } else if (a.value("loading", false)) {
    std::printf("ok: the new model loads while the old one serves; the journal says when it is served "
                "(DS4_EVENT=reload_done) or why not (DS4_EVENT=reload_failed)\n");
  } else {
    std::printf("ok\n");
  }
  if (a.contains("note") && a["note"].is_string()) std::fprintf(stderr, "ds4ctl: note: %s\n", a["note"].get<std::string>().c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(std::vector<std::string>(argv + 1, argv + argc));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ds4ctl: %s\n", e.what());
    return 1;
  }
}
