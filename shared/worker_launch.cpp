#include "shared/worker_launch.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <variant>

#include "shared/config.h"
#include "shared/error.h"

extern char** environ;

namespace ds4 {
namespace {

struct Integer {
  int64_t WorkerLaunch::*field;
  int64_t lo, hi;
};
struct Text {
  std::string WorkerLaunch::*field;
  std::vector<std::string_view> choices;  // empty: any text
};

/// One row of the table: where the setting lives in the struct, its flag and
/// variable, and what values it takes.
struct Row {
  std::string_view flag;
  std::string_view env;
  std::variant<Integer, Text> value;
  std::string_view what;
};

// The one list of launch settings. Ranges are the worker's limits; the
// supervisor's config checks its own before it gets here.
const std::vector<Row>& rows() {
  using W = WorkerLaunch;
  static const std::vector<Row> r = {
      {"id", "", Integer{&W::id, 0, 1 << 20}, "the worker's number (ds4-worker@N)"},
      {"segment", "DS4_SEGMENT", Text{&W::segment, {}}, "the model segment to attach (ds4-model-..., memfd:<name>)"},
      {"segment-socket", "DS4_SEGMENT_SOCKET", Text{&W::segment_socket, {}},
       "the supervisor's socket that hands out memfd segments"},
      {"model", "DS4_MODEL", Text{&W::model, {}}, "a GGUF file to open (by hand), or an exec engine's {model}"},
      {"socket", "DS4_SOCKET", Text{&W::socket, {}}, "the Unix socket the worker serves the token protocol on"},
      {"context", "DS4_CONTEXT", Integer{&W::context, kMinContext, kMaxContext}, "tokens per slot (the context rung)"},
      {"slots", "DS4_SLOTS", Integer{&W::slots, 1, 256}, "concurrent sequences"},
      {"device", "DS4_DEVICE", Text{&W::device, {}}, "auto | cpu | cuda:N"},
      {"threads", "DS4_THREADS", Integer{&W::threads, 0, 1024}, "CPU threads; 0 = all cores"},
      {"batch", "DS4_PREFILL_CHUNK", Integer{&W::prefill_chunk, 1, 8192},
       "prompt tokens per engine step (workers.prefill_chunk)"},
      {"busy-poll-us", "DS4_BUSY_POLL_US", Integer{&W::busy_poll_us, 0, 10000},
       "how long the idle worker polls before it sleeps, in us (workers.busy_poll)"},
      {"control", "DS4_CONTROL", Text{&W::control, {}},
       "the supervisor's control block (heartbeat, plan, counters); empty = none"},
      {"gpu-weights", "DS4_GPU_WEIGHTS", Text{&W::gpu_weights, {"auto", "holder", "copy", "host-mapped"}},
       "where a GPU worker's weights come from"},
      {"holder-socket", "DS4_HOLDER_SOCKET", Text{&W::holder_socket, {}}, "the GPU holder's socket; empty = the default"},
      {"host-experts", "DS4_HOST_EXPERTS", Integer{&W::host_experts, 0, 1 << 16},
       "the first layers whose experts the CPU computes (the expert rung)"},
      {"holder-experts", "DS4_HOLDER_EXPERTS", Integer{&W::holder_experts, -1, 1 << 16},
       "the layers whose experts the GPU holder's image lacks; -1 = as --host-experts"},
      {"kv-cache", "DS4_KV_CACHE", Text{&W::kv_cache, {}}, "how the KV cache is kept: f16 | q8_0 (the KV rung)"},
      {"dies-with", "DS4_WORKER_DIES_WITH", Integer{&W::dies_with, 0, int64_t(1) << 31},
       "a pid (the supervisor's keeper) whose end stops the worker; 0 = none"},
      {"command", "DS4_EXEC_COMMAND", Text{&W::exec_command, {}},
       "workers.engine exec: the server's command template; empty = the native engine"},
      {"port", "DS4_PORT", Integer{&W::port, 0, 65535}, "workers.engine exec: where the server answers HTTP"},
      {"start-timeout", "DS4_START_TIMEOUT_MS", Integer{&W::start_timeout_ms, 100, 86400000},
       "workers.engine exec: how long the server may take to answer, in ms"},
  };
  return r;
}

const Row* row_of_flag(std::string_view flag) {
  if (flag == "ctx") flag = "context";  // the name `run` and `bench` used
  for (const Row& r : rows())
    if (r.flag == flag) return &r;
  return nullptr;
}

std::string text_of(const Row& r, const WorkerLaunch& l) {
  if (const auto* i = std::get_if<Integer>(&r.value)) return std::to_string(l.*(i->field));
  return l.*(std::get<Text>(r.value).field);
}

/// Sets `r` from `value`; `where` names the source in errors ("--context",
/// "DS4_CONTEXT=abc (--context)").
void set(const Row& r, WorkerLaunch& l, const std::string& value, const std::string& where) {
  if (const auto* i = std::get_if<Integer>(&r.value)) {
    size_t used = 0;
    int64_t v = 0;
    try {
      v = std::stoll(value, &used);
    } catch (...) {
      used = 0;
    }
    if (value.empty() || used != value.size()) throw Error(where + ": '" + value + "' is not an integer");
    if (v < i->lo || v > i->hi)
      throw Error(where + ": " + value + " is out of range [" + std::to_string(i->lo) + ", " + std::to_string(i->hi) + "]");
    l.*(i->field) = v;
    return;
  }
  const Text& t = std::get<Text>(r.value);
  if (!t.choices.empty() && std::find(t.choices.begin(), t.choices.end(), value) == t.choices.end()) {
    std::string list;
    for (size_t k = 0; k < t.choices.size(); ++k)
      list += std::string(k == 0 ? "" : k + 1 == t.choices.size() ? " or " : ", ") + std::string(t.choices[k]);
    throw Error(where + ": '" + value + "': expected " + list);
  }
  l.*(t.field) = value;
}

/// Whether `v` can stand unquoted in an environment file (systemd strips
/// unquoted whitespace and reads backslashes and quotes).
bool plain(const std::string& v) {
  return !v.empty() && std::all_of(v.begin(), v.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || std::string_view("_./:@,+-=%").find(c) != std::string_view::npos;
  });
}

}  // namespace

const std::vector<WorkerLaunchSetting>& worker_launch_settings() {
  static const std::vector<WorkerLaunchSetting> s = [] {
    std::vector<WorkerLaunchSetting> out;
    const WorkerLaunch defaults;
    for (const Row& r : rows())
      out.push_back({std::string(r.flag), std::string(r.env), text_of(r, defaults), std::string(r.what)});
    return out;
  }();
  return s;
}

std::vector<std::string> worker_launch_env_names() {
  std::vector<std::string> out;
  for (const Row& r : rows())
    if (!r.env.empty()) out.emplace_back(r.env);
  return out;
}

std::vector<std::string> WorkerLaunch::to_args() const {
  std::vector<std::string> out;
  for (const Row& r : rows()) {
    std::string v = text_of(r, *this);
    if (v.empty()) continue;
    out.push_back("--" + std::string(r.flag));
    out.push_back(std::move(v));
  }
  return out;
}

std::vector<std::string> WorkerLaunch::to_env() const {
  std::vector<std::string> out;
  for (const Row& r : rows())
    if (!r.env.empty()) out.push_back(std::string(r.env) + "=" + text_of(r, *this));
  return out;
}

std::string WorkerLaunch::to_env_file() const {
  std::string out;
  for (const std::string& line : to_env()) {
    const size_t eq = line.find('=');
    const std::string v = line.substr(eq + 1);
    out += line.substr(0, eq + 1);
    if (plain(v) || v.empty()) {
      out += v;
    } else {  // double quotes, with \ " $ ` escaped; a newline cannot be carried
      out += '"';
      for (char c : v) {
        if (c == '\\' || c == '"' || c == '$' || c == '`') out += '\\';
        if (c != '\n') out += c;
      }
      out += '"';
    }
    out += '\n';
  }
  return out;
}

WorkerLaunch parse_worker_launch(const std::vector<std::string>& args, const std::vector<std::string>& env) {
  WorkerLaunch l;
  for (const std::string& e : env) {
    const size_t eq = e.find('=');
    if (eq == std::string::npos || eq + 1 == e.size()) continue;  // unset or empty: the default
    const std::string_view name(e.data(), eq);
    for (const Row& r : rows())
      if (!r.env.empty() && r.env == name)
        set(r, l, e.substr(eq + 1), e + " (--" + std::string(r.flag) + ")");
  }
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (!a.starts_with("--")) throw Error("unexpected argument '" + a + "'");
    std::string name = a.substr(2), value;
    const size_t eq = name.find('=');
    const bool inline_value = eq != std::string::npos;
    if (inline_value) {
      value = name.substr(eq + 1);
      name.resize(eq);
    }
    const Row* r = row_of_flag(name);
    if (!r) throw Error("unknown option '" + a + "'");
    if (!inline_value) {
      if (i + 1 >= args.size()) throw Error("option '--" + name + "' needs a value");
      value = args[++i];
    }
    set(*r, l, value, "--" + name);
  }
  return l;
}

WorkerLaunch parse_worker_launch(const std::vector<std::string>& args) {
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) env.emplace_back(*e);
  return parse_worker_launch(args, env);
}

std::optional<std::string> worker_launch_env(std::string_view flag) {
  const Row* r = row_of_flag(flag);
  if (!r || r->env.empty()) return std::nullopt;
  const char* v = std::getenv(std::string(r->env).c_str());
  if (!v || !*v) return std::nullopt;
  return std::string(v);
}

std::vector<std::string> decode_env_file(std::string_view text) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at < text.size()) {
    size_t end = text.find('\n', at);
    if (end == std::string_view::npos) end = text.size();
    std::string_view line = text.substr(at, end - at);
    at = end + 1;
    while (!line.empty() && (line.front() == ' ' || line.front() == '\t')) line.remove_prefix(1);
    const size_t eq = line.find('=');
    if (line.empty() || line.front() == '#' || line.front() == ';' || eq == std::string_view::npos) continue;
    std::string value;
    std::string_view raw = line.substr(eq + 1);
    if (!raw.empty() && (raw.front() == '"' || raw.front() == '\'')) {
      const char q = raw.front();
      for (size_t k = 1; k < raw.size() && raw[k] != q; ++k) {
        if (q == '"' && raw[k] == '\\' && k + 1 < raw.size()) ++k;
        value += raw[k];
      }
    } else {
      while (!raw.empty() && (raw.back() == ' ' || raw.back() == '\t' || raw.back() == '\r')) raw.remove_suffix(1);
      value = std::string(raw);
    }
    out.push_back(std::string(line.substr(0, eq)) + "=" + value);
  }
  return out;
}

}  // namespace ds4
