#include "shared/config.h"

#include <arpa/inet.h>
#include <yaml-cpp/depthguard.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <sstream>
#include <thread>
#include <unistd.h>

#include "shared/error.h"
#include "shared/files.h"
#include "shared/meminfo.h"

namespace ds4 {
namespace fs = std::filesystem;

// ---------------------------------------------------------------------------
// Units

namespace {

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out)
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  return out;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

/// Splits "1.5GiB" into 1.5 and "GiB". Only plain decimal numbers: no sign,
/// exponent, hex or infinity.
bool split_number(std::string_view text, double& value, std::string_view& unit, bool& fractional) {
  text = trim(text);
  size_t i = 0;
  while (i < text.size() && ((text[i] >= '0' && text[i] <= '9') || text[i] == '.')) ++i;
  const std::string_view number = text.substr(0, i);
  if (number.empty() || std::count(number.begin(), number.end(), '.') > 1 || number == ".") return false;
  fractional = number.find('.') != std::string_view::npos;
  value = std::strtod(std::string(number).c_str(), nullptr);
  unit = trim(text.substr(i));
  return true;
}

}  // namespace

std::optional<Bytes> parse_size(std::string_view text, std::string* why) {
  auto fail = [&](std::string msg) -> std::optional<Bytes> {
    if (why) *why = std::move(msg);
    return std::nullopt;
  };
  double value = 0;
  std::string_view unit;
  bool fractional = false;
  if (!split_number(text, value, unit, fractional)) return fail("expected a size like 4GiB");
  const std::string u = lower(unit);
  static const std::map<std::string, double, std::less<>> kUnits = {
      {"", 1}, {"b", 1},
      {"kib", 1024.0}, {"mib", 1024.0 * 1024}, {"gib", 1024.0 * 1024 * 1024},
      {"tib", 1024.0 * 1024 * 1024 * 1024},
      {"kb", 1e3}, {"mb", 1e6}, {"gb", 1e9}, {"tb", 1e12}};
  if (u == "k" || u == "m" || u == "g" || u == "t") {
    const std::string up(1, static_cast<char>(u[0] - 'a' + 'A'));
    return fail("ambiguous unit '" + std::string(unit) + "': write " + up + "iB (powers of 1024) or " + up +
                "B (powers of 1000)");
  }
  const auto it = kUnits.find(u);
  if (it == kUnits.end())
    return fail("expected a size like 4GiB (units B, KiB, MiB, GiB, TiB, or KB, MB, GB, TB)");
  if (fractional && it->second == 1) return fail("expected a whole number of bytes");
  const double bytes = std::round(value * it->second);
  if (bytes >= 18446744073709551615.0) return fail("size too large");
  return static_cast<Bytes>(bytes);
}

std::optional<Duration> parse_duration(std::string_view text, std::string* why) {
  auto fail = [&](std::string msg) -> std::optional<Duration> {
    if (why) *why = std::move(msg);
    return std::nullopt;
  };
  double value = 0;
  std::string_view unit;
  bool fractional = false;
  if (!split_number(text, value, unit, fractional)) return fail("expected a duration like 30s");
  static const std::map<std::string, double, std::less<>> kUnits = {
      {"ms", 1}, {"s", 1e3}, {"m", 60e3}, {"h", 3600e3}};
  if (unit.empty()) {
    if (value == 0) return Duration(0);
    return fail("missing unit: write ms, s, m or h (e.g. 30s)");
  }
  const auto it = kUnits.find(unit);
  if (it == kUnits.end()) return fail("expected a duration like 30s (units ms, s, m, h)");
  const double ms = std::round(value * it->second);
  if (ms > 1e15) return fail("duration too long");
  return Duration(static_cast<Duration::rep>(ms));
}

std::string format_size(Bytes bytes) {
  static const std::pair<Bytes, const char*> kUnits[] = {
      {Bytes(1) << 40, "TiB"}, {Bytes(1) << 30, "GiB"}, {Bytes(1) << 20, "MiB"}, {Bytes(1) << 10, "KiB"}};
  if (bytes == 0) return "0";
  for (const auto& [unit, name] : kUnits)
    if (bytes % unit == 0) return std::to_string(bytes / unit) + name;
  for (const auto& [unit, name] : kUnits) {
    if (bytes < unit) continue;
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.1f%s", static_cast<double>(bytes) / static_cast<double>(unit), name);
    return buf;
  }
  return std::to_string(bytes) + "B";
}

std::chrono::microseconds busy_poll_for(const std::optional<std::chrono::microseconds>& setting) {
  if (setting) return *setting;
  static const unsigned cores = std::thread::hardware_concurrency();
  return std::chrono::microseconds(cores >= 8 ? 100 : 0);
}

std::string format_duration(Duration d) {
  const auto ms = d.count();
  if (ms == 0) return "0";
  if (ms % 3600000 == 0) return std::to_string(ms / 3600000) + "h";
  if (ms % 60000 == 0) return std::to_string(ms / 60000) + "m";
  if (ms % 1000 == 0) return std::to_string(ms / 1000) + "s";
  return std::to_string(ms) + "ms";
}

std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diagonal = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

Bytes read_mem_total() {
  const std::optional<std::string> meminfo = read_whole_file("/proc/meminfo");
  return meminfo ? mem::meminfo_bytes(*meminfo, "MemTotal").value_or(0) : 0;
}

// ---------------------------------------------------------------------------
// Small value types

bool ListenAddress::is_loopback() const {
  in_addr v4{};
  if (inet_pton(AF_INET, host.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6{};
  if (inet_pton(AF_INET6, host.c_str(), &v6) == 1) {
    if (IN6_IS_ADDR_LOOPBACK(&v6)) return true;
    return IN6_IS_ADDR_V4MAPPED(&v6) && v6.s6_addr[12] == 127;
  }
  return false;
}

std::string ListenAddress::str() const {
  const bool v6 = host.find(':') != std::string::npos;
  return (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

std::string Device::str() const {
  switch (kind) {
    case Kind::automatic: return "auto";
    case Kind::cpu: return "cpu";
    case Kind::cuda: return "cuda:" + std::to_string(index);
  }
  return "auto";
}

bool Config::operator==(const Config& o) const {
  return model == o.model && proxy == o.proxy && workers == o.workers && headroom == o.headroom &&
         restart == o.restart && gpu == o.gpu && status == o.status;
}

// ---------------------------------------------------------------------------
// Reading YAML into a Config, collecting every error

namespace {

/// One `key: value` of a mapping being read.
struct Entry {
  YAML::Node key;
  YAML::Node value;
  std::string path;  // dotted, e.g. "workers.context.ladder"
  YAML::Mark mark;   // the value's position, or the key's where the value has none
};

struct Key {
  std::string_view name;
  std::function<void(const Entry&)> read;
};

std::string describe(const YAML::Node& n) {
  if (n.IsMap()) return "a mapping";
  if (n.IsSequence()) return "a list";
  if (n.IsNull()) return "nothing";
  return "'" + n.Scalar() + "'";
}

std::string suggestion(std::string_view word, const std::vector<std::string_view>& candidates) {
  std::string_view best;
  std::size_t best_distance = std::max<std::size_t>(2, word.size() / 3) + 1;
  for (auto c : candidates) {
    const std::size_t d = edit_distance(lower(word), c);
    if (d < best_distance) best_distance = d, best = c;
  }
  return best.empty() ? "" : " (did you mean '" + std::string(best) + "'?)";
}

class Reader {
 public:
  Reader(std::string file, fs::path base_dir) : file_(std::move(file)), base_dir_(std::move(base_dir)) {}

  std::vector<std::string> errors;
  std::map<std::string, YAML::Mark> marks;  // where each key's value is, for checks across keys

  void error(const YAML::Mark& m, const std::string& what) {
    if (m.is_null()) errors.push_back(file_ + ": " + what);
    else errors.push_back(file_ + ":" + std::to_string(m.line + 1) + ":" + std::to_string(m.column + 1) + ": " + what);
  }
  /// An error about a key found earlier (or its default, where the file does not set it).
  void error_at(const std::string& path, const std::string& what) {
    const auto it = marks.find(path);
    error(it == marks.end() ? YAML::Mark::null_mark() : it->second, what);
  }
  bool has(const std::string& path) const { return marks.count(path) != 0; }

  /// Calls each known key's reader; reports unknown and duplicate keys.
  void mapping(const YAML::Node& node, const YAML::Mark& where, const std::string& path,
               const std::vector<Key>& keys) {
    if (!node || node.IsNull()) return;
    std::vector<std::string_view> names;
    for (const auto& k : keys) names.push_back(k.name);
    if (!node.IsMap()) {
      std::string list;
      for (auto n : names) list += (list.empty() ? "" : ", ") + std::string(n);
      error(node.Mark().is_null() ? where : node.Mark(),
            (path.empty() ? "" : path + ": ") + "expected a mapping with keys " + list + ", got " + describe(node));
      return;
    }
    std::map<std::string, YAML::Mark> seen;
    for (const auto& kv : node) {
      const YAML::Node& k = kv.first;
      if (!k.IsScalar()) {
        error(k.Mark(), "expected a key name, got " + describe(k));
        continue;
      }
      const std::string name = k.Scalar();
      const std::string full = path.empty() ? name : path + "." + name;
      if (const auto s = seen.find(name); s != seen.end()) {
        error(k.Mark(), "duplicate key '" + name + "' (first at line " + std::to_string(s->second.line + 1) + ")");
        continue;
      }
      seen.emplace(name, k.Mark());
      const auto known = std::find_if(keys.begin(), keys.end(), [&](const Key& key) { return key.name == name; });
      if (known == keys.end()) {
        error(k.Mark(), "unknown key '" + name + "'" + suggestion(name, names));
        continue;
      }
      const YAML::Node& v = kv.second;
      Entry e{k, v, full, v.Mark().is_null() || v.IsNull() ? k.Mark() : v.Mark()};
      marks[full] = e.mark;
      known->read(e);
    }
  }

  /// The value's text, or nullopt (after reporting it unless it is null,
  /// which keeps the default).
  std::optional<std::string> scalar(const Entry& e, std::string_view expected) {
    if (!e.value || e.value.IsNull()) return std::nullopt;
    if (!e.value.IsScalar()) {
      error(e.mark, e.path + ": expected " + std::string(expected) + ", got " + describe(e.value));
      return std::nullopt;
    }
    return e.value.Scalar();
  }

  template <typename T>
  void integer(const Entry& e, T& out, std::int64_t min, std::int64_t max) {
    const auto text = scalar(e, "a whole number");
    if (!text) return;
    std::int64_t v = 0;
    const std::string_view t = trim(*text);
    const auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), v);
    if (t.empty() || ec != std::errc() || end != t.data() + t.size()) {
      error(e.mark, e.path + ": expected a whole number, got '" + *text + "'");
      return;
    }
    if (v < min || v > max) {
      error(e.mark, e.path + ": " + std::to_string(v) + " is out of range (" + std::to_string(min) + " to " +
                        std::to_string(max) + ")");
      return;
    }
    out = static_cast<T>(v);
  }

  void number(const Entry& e, double& out, double min, double max) {
    const auto text = scalar(e, "a number");
    if (!text) return;
    double v = 0;
    std::string_view unit;
    bool fractional = false;
    const std::string_view t = trim(*text);
    const bool negative = t.starts_with('-');  // split_number reads sizes: no sign
    if (!split_number(negative ? t.substr(1) : t, v, unit, fractional) || !unit.empty()) {
      error(e.mark, e.path + ": expected a number, got '" + *text + "'");
      return;
    }
    if (negative) v = -v;
    if (v < min || v > max) {
      error(e.mark, e.path + ": " + *text + " is out of range (" + format_number(min) + " to " + format_number(max) + ")");
      return;
    }
    out = v;
  }

  void size(const Entry& e, Bytes& out) {
    const auto text = scalar(e, "a size like 4GiB");
    if (!text) return;
    std::string why;
    if (const auto v = parse_size(*text, &why)) out = *v;
    else error(e.mark, e.path + ": " + why + ", got '" + *text + "'");
  }

  void duration(const Entry& e, Duration& out) {
    const auto text = scalar(e, "a duration like 30s");
    if (!text) return;
    std::string why;
    if (const auto v = parse_duration(*text, &why)) out = *v;
    else error(e.mark, e.path + ": " + why + ", got '" + *text + "'");
  }

  /// auto, off, or a short duration in us or ms (at most 10ms: a longer spin
  /// would hold a core for nothing).
  void busy_poll(const Entry& e, std::optional<std::chrono::microseconds>& out) {
    const auto text = scalar(e, "auto, off or a duration like 100us");
    if (!text) return;
    const std::string t = lower(trim(*text));
    if (t == "auto") {
      out.reset();
      return;
    }
    if (t == "off" || t == "0") {
      out = std::chrono::microseconds(0);
      return;
    }
    double v = 0;
    std::string_view unit;
    bool fractional = false;
    const double scale = !split_number(t, v, unit, fractional) ? 0 : unit == "us" ? 1 : unit == "ms" ? 1000 : 0;
    if (scale == 0 || v * scale > 10000) {
      error(e.mark, e.path + ": expected auto, off or a duration up to 10ms like 100us, got '" + *text + "'");
      return;
    }
    out = std::chrono::microseconds(static_cast<std::int64_t>(std::round(v * scale)));
  }

  void boolean(const Entry& e, bool& out) {
    const auto text = scalar(e, "true or false");
    if (!text) return;
    const std::string t = lower(trim(*text));
    if (t == "true" || t == "yes" || t == "on") out = true;
    else if (t == "false" || t == "no" || t == "off") out = false;
    else error(e.mark, e.path + ": expected true or false, got '" + *text + "'");
  }

  void string(const Entry& e, std::string& out) {
    if (const auto text = scalar(e, "a string")) out = *text;
  }

  /// A file path; relative ones are taken from the config file's folder.
  void path(const Entry& e, fs::path& out) {
    const auto text = scalar(e, "a file path");
    if (!text) return;
    out = resolve(*text);
  }

  fs::path resolve(const std::string& text) const {
    if (text.empty()) return {};
    fs::path p(text);
    if (text == "~" || text.starts_with("~/")) {
      const char* home = std::getenv("HOME");
      p = fs::path(home ? home : "/") / text.substr(std::min<std::size_t>(2, text.size()));
    }
    if (p.is_relative()) p = base_dir_ / p;
    return p.lexically_normal();
  }

  template <typename T>
  void choice(const Entry& e, T& out, const std::vector<std::pair<std::string_view, T>>& options) {
    std::string list;
    std::vector<std::string_view> names;
    for (const auto& [name, value] : options) {
      list += (list.empty() ? "" : ", ") + std::string(name);
      names.push_back(name);
    }
    const auto text = scalar(e, "one of " + list);
    if (!text) return;
    for (const auto& [name, value] : options)
      if (name == *text) {
        out = value;
        return;
      }
    error(e.mark, e.path + ": expected one of " + list + ", got '" + *text + "'" + suggestion(*text, names));
  }

 private:
  static std::string format_number(double v) {
    std::ostringstream s;
    s << v;
    return s.str();
  }

  std::string file_;
  fs::path base_dir_;
};

void read_device(Reader& r, const Entry& e, Device& out) {
  const auto text = r.scalar(e, "auto, cpu or cuda:N");
  if (!text) return;
  const std::string& t = *text;
  if (t == "auto") out = {Device::Kind::automatic, 0};
  else if (t == "cpu") out = {Device::Kind::cpu, 0};
  else if (t == "cuda") out = {Device::Kind::cuda, 0};
  else if (t.starts_with("cuda:")) {
    int index = -1;
    const char* first = t.data() + 5;
    const char* last = t.data() + t.size();
    const auto [end, ec] = std::from_chars(first, last, index);
    if (first == last || ec != std::errc() || end != last || index < 0 || index > 255)
      r.error(e.mark, e.path + ": expected cuda:N with N a GPU index, got '" + t + "'");
    else out = {Device::Kind::cuda, index};
  } else {
    r.error(e.mark, e.path + ": expected auto, cpu or cuda:N, got '" + t + "'" +
                        suggestion(t, {"auto", "cpu", "cuda"}));
  }
}

std::optional<ListenAddress> parse_listen(const std::string& text) {
  ListenAddress out;
  std::string host, port;
  if (text.starts_with("[")) {
    const auto close = text.find(']');
    if (close == std::string::npos || close + 1 >= text.size() || text[close + 1] != ':') return std::nullopt;
    host = text.substr(1, close - 1);
    port = text.substr(close + 2);
    in6_addr a{};
    if (inet_pton(AF_INET6, host.c_str(), &a) != 1) return std::nullopt;
  } else {
    const auto colon = text.rfind(':');
    if (colon == std::string::npos) return std::nullopt;
    host = text.substr(0, colon);
    port = text.substr(colon + 1);
    if (host == "localhost") host = "127.0.0.1";
    in_addr a{};
    if (inet_pton(AF_INET, host.c_str(), &a) != 1) return std::nullopt;
  }
  unsigned value = 0;
  const auto [end, ec] = std::from_chars(port.data(), port.data() + port.size(), value);
  if (port.empty() || ec != std::errc() || end != port.data() + port.size() || value > 65535) return std::nullopt;
  out.host = host;
  out.port = static_cast<std::uint16_t>(value);
  return out;
}

void read_listen(Reader& r, const Entry& e, ListenAddress& out) {
  const auto text = r.scalar(e, "an address like 127.0.0.1:8080");
  if (!text) return;
  if (const auto a = parse_listen(*text)) out = *a;
  else
    r.error(e.mark, e.path + ": expected an address like 127.0.0.1:8080, 0.0.0.0:8080 or [::1]:8080, got '" +
                        *text + "'");
}

// A list of rungs (workers.context.ladder, workers.moe_offload): whole
// numbers in range, each further than the one before in one direction; each
// wrong one an error at its own line:column, and the list kept only whole.
struct RungList {
  std::string expected;    // "a list of context sizes like [8192, 4096, 2048]"
  std::string empty;       // what to give when it is empty
  std::string item;        // "a context size"
  std::int64_t lo, hi;     // the range …
  bool own_range_message;  // … said in the list's words (else the reader's)
  bool descending;
  std::string order;       // why each rung must pass the one before it
};

void read_rungs(Reader& r, const Entry& e, const RungList& spec, std::vector<std::uint32_t>& out) {
  if (!e.value || e.value.IsNull()) return;
  if (!e.value.IsSequence()) {
    r.error(e.mark, e.path + ": expected " + spec.expected + ", got " + describe(e.value));
    return;
  }
  if (e.value.size() == 0) {
    r.error(e.mark, e.path + ": " + spec.empty);
    return;
  }
  std::vector<std::uint32_t> rungs;
  bool ok = true;
  for (std::size_t i = 0; i < e.value.size(); ++i) {
    const YAML::Node& item = e.value[i];
    const std::string where = e.path + "[" + std::to_string(i) + "]";
    Entry rung{e.key, item, where, item.Mark().is_null() ? e.mark : item.Mark()};
    std::int64_t v = -1;
    const std::size_t before = r.errors.size();
    if (spec.own_range_message)
      r.integer(rung, v, std::numeric_limits<std::int64_t>::min(), std::numeric_limits<std::int64_t>::max());
    else
      r.integer(rung, v, spec.lo, spec.hi);
    if (r.errors.size() != before || !item.IsScalar()) {
      if (item.IsNull()) r.error(rung.mark, where + ": expected " + spec.item + ", got nothing");
      ok = false;
      continue;
    }
    if (spec.own_range_message && (v < spec.lo || v > spec.hi)) {
      r.error(rung.mark, where + ": " + spec.item.substr(2) + " " + std::to_string(v) + " must be between " +
                             std::to_string(spec.lo) + " and " + std::to_string(spec.hi) + " tokens");
      ok = false;
      continue;
    }
    const std::uint32_t u = static_cast<std::uint32_t>(v);
    if (!rungs.empty() && (spec.descending ? u >= rungs.back() : u <= rungs.back())) {
      r.error(rung.mark, where + ": " + std::to_string(v) + " is not " + (spec.descending ? "smaller" : "larger") +
                             " than the rung before it (" + std::to_string(rungs.back()) + "); " + spec.order);
      ok = false;
    }
    rungs.push_back(u);
  }
  if (ok) out = std::move(rungs);
}

void read_ladder(Reader& r, const Entry& e, std::vector<std::uint32_t>& out) {
  read_rungs(r, e,
             {"a list of context sizes like [8192, 4096, 2048]", "the ladder is empty; give at least one context size",
              "a context size", kMinContext, kMaxContext, true, true, "the ladder goes from the largest context down"},
             out);
}

void read_moe_offload(Reader& r, const Entry& e, std::vector<std::uint32_t>& out) {
  read_rungs(r, e,
             {"a list of layer counts like [0, 4, 8] (the first layers whose experts stay on the host, one rung each)",
              "the list is empty; give at least one rung ([0]: every expert on the GPU)", "a number of layers", 0,
              65535, false, false, "each rung keeps more layers' experts on the host"},
             out);
}

// workers.kv_cache: one KV type, or a list of them from the most memory to the least.
void read_kv_cache(Reader& r, const Entry& e, std::vector<std::string>& out) {
  static const std::vector<std::string_view> kTypes = {"f16", "q8_0"};
  if (!e.value || e.value.IsNull()) return;
  std::vector<std::string> rungs;
  bool ok = true;
  auto one = [&](const Entry& x) {
    std::string v;
    const std::size_t before = r.errors.size();
    r.choice(x, v, {{"f16", std::string("f16")}, {"q8_0", std::string("q8_0")}});
    if (r.errors.size() != before) return (void)(ok = false);
    const auto rank = [](const std::string& t) { return std::find(kTypes.begin(), kTypes.end(), t) - kTypes.begin(); };
    if (!rungs.empty() && rank(v) <= rank(rungs.back())) {
      r.error(x.mark, x.path + ": '" + v + "' does not take less memory than the rung before it ('" + rungs.back() +
                          "'); the rungs go from the most memory to the least, as [f16, q8_0]");
      ok = false;
    }
    rungs.push_back(v);
  };
  if (e.value.IsSequence()) {
    if (e.value.size() == 0) return r.error(e.mark, e.path + ": the list is empty; give at least one KV cache type (f16)");
    for (std::size_t i = 0; i < e.value.size(); ++i) {
      const YAML::Node& item = e.value[i];
      one(Entry{e.key, item, e.path + "[" + std::to_string(i) + "]", item.Mark().is_null() ? e.mark : item.Mark()});
    }
  } else {
    one(e);
  }
  if (ok) out = std::move(rungs);
}

void read_document(Reader& r, const YAML::Node& root, Config& c) {
  const YAML::Mark top = root.Mark();
  r.mapping(root, top, "", {
    {"model", [&](const Entry& e) {
      r.mapping(e.value, e.mark, e.path, {
        {"path", [&](const Entry& x) { r.path(x, c.model.path); }},
        {"name", [&](const Entry& x) { r.string(x, c.model.name); }},
        {"backing", [&](const Entry& x) {
          r.choice(x, c.model.backing,
                   {{"auto", ModelBacking::automatic}, {"shm", ModelBacking::shm}, {"memfd", ModelBacking::memfd}});
        }},
        {"keep_resident", [&](const Entry& x) {
          int v = 0;
          r.choice(x, v, {{"auto", 0}, {"on", 1}, {"off", 2}, {"true", 1}, {"false", 2}});
          c.model.keep_resident = v == 0 ? std::nullopt : std::optional<bool>(v == 1);
        }},
        {"huge_pages", [&](const Entry& x) {
          r.choice(x, c.model.huge_pages, {{"on", true}, {"off", false}, {"true", true}, {"false", false}});
        }},
      });
    }},
    {"proxy", [&](const Entry& e) {
      r.mapping(e.value, e.mark, e.path, {
        {"listen", [&](const Entry& x) { read_listen(r, x, c.proxy.listen); }},
        {"api_keys_file", [&](const Entry& x) { r.path(x, c.proxy.api_keys_file); }},
        {"busy_poll", [&](const Entry& x) { r.busy_poll(x, c.proxy.busy_poll); }},
        {"responses_store", [&](const Entry& x) { r.integer(x, c.proxy.responses_store, 0, 1000000); }},
        {"queue", [&](const Entry& q) {
          r.mapping(q.value, q.mark, q.path, {
            {"max_waiting", [&](const Entry& x) { r.integer(x, c.proxy.queue.max_waiting, 0, 1000000); }},
            {"max_wait", [&](const Entry& x) { r.duration(x, c.proxy.queue.max_wait); }},
          });
        }},
        {"limits", [&](const Entry& l) {
          auto& L = c.proxy.limits;
          r.mapping(l.value, l.mark, l.path, {
            {"max_header_bytes", [&](const Entry& x) { r.size(x, L.max_header_bytes); }},
            {"max_body_bytes", [&](const Entry& x) { r.size(x, L.max_body_bytes); }},
            {"request_timeout", [&](const Entry& x) { r.duration(x, L.request_timeout); }},
            {"header_timeout", [&](const Entry& x) { r.duration(x, L.header_timeout); }},
            {"body_timeout", [&](const Entry& x) { r.duration(x, L.body_timeout); }},
            {"max_connections", [&](const Entry& x) { r.integer(x, L.max_connections, 1, 1000000); }},
            {"max_tokens_per_request", [&](const Entry& x) { r.integer(x, L.max_tokens_per_request, 1, 1 << 30); }},
            {"allow_insecure_bind", [&](const Entry& x) { r.boolean(x, L.allow_insecure_bind); }},
          });
        }},
      });
    }},
    {"workers", [&](const Entry& e) {
      auto& W = c.workers;
      r.mapping(e.value, e.mark, e.path, {
        {"backend", [&](const Entry& x) {
          r.choice(x, W.backend, {{"auto", WorkerBackend::automatic}, {"systemd", WorkerBackend::systemd},
                                  {"process", WorkerBackend::process}});
        }},
        {"count", [&](const Entry& x) { r.integer(x, W.count, 1, 256); }},
        {"device", [&](const Entry& x) { read_device(r, x, W.device); }},
        {"slots", [&](const Entry& x) { r.integer(x, W.slots, 1, 4096); }},
        {"threads", [&](const Entry& x) { r.integer(x, W.threads, 0, 4096); }},
        {"prefill_chunk", [&](const Entry& x) { r.integer(x, W.prefill_chunk, 16, 8192); }},
        {"busy_poll", [&](const Entry& x) { r.busy_poll(x, W.busy_poll); }},
        {"context", [&](const Entry& x) {
          r.mapping(x.value, x.mark, x.path, {{"ladder", [&](const Entry& l) { read_ladder(r, l, W.ladder); }}});
        }},
        {"moe_offload", [&](const Entry& x) { read_moe_offload(r, x, W.moe_offload); }},
        {"kv_cache", [&](const Entry& x) { read_kv_cache(r, x, W.kv_cache); }},
        {"memory_max", [&](const Entry& x) { r.size(x, W.memory_max); }},
        {"reserve", [&](const Entry& x) { r.size(x, W.reserve); }},
        {"engine", [&](const Entry& x) {
          r.choice(x, W.engine, {{"native", WorkerEngine::native}, {"exec", WorkerEngine::exec}});
        }},
        {"exec", [&](const Entry& x) {
          r.mapping(x.value, x.mark, x.path, {
            {"command", [&](const Entry& cmd) { r.string(cmd, W.exec_command); }},
            {"overhead", [&](const Entry& o) { r.size(o, W.exec_overhead); }},
          });
        }},
      });
    }},
    {"headroom", [&](const Entry& e) {
      auto& H = c.headroom;
      r.mapping(e.value, e.mark, e.path, {
        {"min_available", [&](const Entry& x) { r.size(x, H.min_available); }},
        {"for", [&](const Entry& x) { r.duration(x, H.for_); }},
        {"step_up_after", [&](const Entry& x) { r.duration(x, H.step_up_after); }},
        {"psi", [&](const Entry& x) { r.number(x, H.psi, 0, 100); }},
      });
    }},
    {"restart", [&](const Entry& e) {
      r.mapping(e.value, e.mark, e.path, {
        {"backoff_initial", [&](const Entry& x) { r.duration(x, c.restart.backoff_initial); }},
        {"backoff_max", [&](const Entry& x) { r.duration(x, c.restart.backoff_max); }},
        {"healthy_after", [&](const Entry& x) { r.duration(x, c.restart.healthy_after); }},
        {"hang_timeout", [&](const Entry& x) { r.duration(x, c.restart.hang_timeout); }},
        {"start_timeout", [&](const Entry& x) { r.duration(x, c.restart.start_timeout); }},
        {"drain_deadline", [&](const Entry& x) { r.duration(x, c.restart.drain_deadline); }},
      });
    }},
    {"gpu", [&](const Entry& e) {
      r.mapping(e.value, e.mark, e.path, {
        {"weights", [&](const Entry& x) {
          r.choice(x, c.gpu.weights, {{"device", GpuWeights::device}, {"host-mapped", GpuWeights::host_mapped}});
        }},
      });
    }},
    {"status", [&](const Entry& e) {
      r.mapping(e.value, e.mark, e.path, {
        {"sample_every", [&](const Entry& x) { r.duration(x, c.status.sample_every); }},
        {"history", [&](const Entry& x) { r.duration(x, c.status.history); }},
        {"events_kept", [&](const Entry& x) { r.integer(x, c.status.events_kept, 1, 1000000); }},
      });
    }},
  });
}

// Checks across keys, once every key has been read.

void check_positive(Reader& r, const std::string& key, Duration d) {
  if (d.count() <= 0) r.error_at(key, key + ": must be longer than 0");
}

void check_exec_command(Reader& r, const WorkersConfig& w) {
  if (w.engine != WorkerEngine::exec) return;
  const std::string key = "workers.exec.command";
  if (trim(w.exec_command).empty()) {
    r.error_at(r.has(key) ? key : "workers.engine",
               "workers.engine is exec but workers.exec.command is empty: give the server's command line with {port}");
    return;
  }
  static const std::vector<std::string_view> kPlaceholders = {"ctx", "port", "slots", "threads", "model"};
  bool has_port = false;
  for (std::size_t open = w.exec_command.find('{'); open != std::string::npos;
       open = w.exec_command.find('{', open + 1)) {
    const std::size_t close = w.exec_command.find('}', open);
    if (close == std::string::npos) {
      r.error_at(key, key + ": unmatched '{' at character " + std::to_string(open + 1));
      return;
    }
    const std::string name = w.exec_command.substr(open + 1, close - open - 1);
    if (name == "port") has_port = true;
    if (std::find(kPlaceholders.begin(), kPlaceholders.end(), name) == kPlaceholders.end())
      r.error_at(key, key + ": unknown placeholder {" + name + "} (known: {ctx}, {port}, {slots}, {threads}, {model})" +
                          suggestion(name, kPlaceholders));
  }
  if (!has_port) r.error_at(key, key + ": needs {port}, where the supervisor reaches the server");
}

void check(Reader& r, Config& c, const LoadOptions& options) {
  const Bytes mem_total = options.mem_total ? options.mem_total : read_mem_total();
  // A path that names nothing is a mistake, not a wish for the synthetic
  // model (that is an empty path): it would serve random weights.
  std::error_code ec;
  if (options.model_file_must_exist && !c.model.path.empty() && !fs::is_regular_file(c.model.path, ec))
    r.error_at("model.path", "model.path: " + c.model.path.string() +
                                 (fs::exists(c.model.path, ec) ? " is not a file" : ": no such file") +
                                 " (leave it empty to serve a small synthetic model with random weights)");
  const auto& W = c.workers;
  if (mem_total > 0) {
    if (W.reserve >= mem_total)
      r.error_at("workers.reserve", "workers.reserve " + format_size(W.reserve) +
                                        " is not smaller than this machine's memory (MemTotal " +
                                        format_size(mem_total) + ")");
    if (c.headroom.min_available >= mem_total)
      r.error_at("headroom.min_available", "headroom.min_available " + format_size(c.headroom.min_available) +
                                               " is not smaller than this machine's memory (MemTotal " +
                                               format_size(mem_total) + ")");
  }
  if (W.memory_max != 0 && W.memory_max < (Bytes(16) << 20))
    r.error_at("workers.memory_max", "workers.memory_max " + format_size(W.memory_max) +
                                         " is too small for a worker (at least 16MiB, or 0 for no limit)");
  check_exec_command(r, W);

  const auto& P = c.proxy;
  if (!P.listen.is_loopback() && P.api_keys_file.empty() && !P.limits.allow_insecure_bind)
    r.error_at("proxy.listen", "proxy.listen " + P.listen.str() +
                                   " is reachable from other machines but proxy.api_keys_file is empty: set "
                                   "api_keys_file, or proxy.limits.allow_insecure_bind: true to serve without keys");
  std::error_code keys_ec;
  if (!P.api_keys_file.empty() && access(P.api_keys_file.c_str(), R_OK) != 0)
    r.error_at("proxy.api_keys_file", "proxy.api_keys_file: cannot read '" + P.api_keys_file.string() + "'");
  else if (!P.api_keys_file.empty() && fs::is_directory(P.api_keys_file, keys_ec))  // readable, and no keys in it
    r.error_at("proxy.api_keys_file", "proxy.api_keys_file: '" + P.api_keys_file.string() + "' is a folder, not a file of keys");
  check_positive(r, "proxy.queue.max_wait", P.queue.max_wait);
  check_positive(r, "proxy.limits.request_timeout", P.limits.request_timeout);
  check_positive(r, "proxy.limits.header_timeout", P.limits.header_timeout);
  check_positive(r, "proxy.limits.body_timeout", P.limits.body_timeout);
  if (P.limits.max_header_bytes < 1024)
    r.error_at("proxy.limits.max_header_bytes", "proxy.limits.max_header_bytes: at least 1KiB");
  if (P.limits.max_body_bytes < 1024)
    r.error_at("proxy.limits.max_body_bytes", "proxy.limits.max_body_bytes: at least 1KiB");

  check_positive(r, "restart.backoff_initial", c.restart.backoff_initial);
  check_positive(r, "restart.backoff_max", c.restart.backoff_max);
  check_positive(r, "restart.healthy_after", c.restart.healthy_after);
  if (c.restart.backoff_initial > c.restart.backoff_max)
    r.error_at(r.has("restart.backoff_initial") ? "restart.backoff_initial" : "restart.backoff_max",
               "restart.backoff_initial " + format_duration(c.restart.backoff_initial) +
                   " is longer than restart.backoff_max " + format_duration(c.restart.backoff_max));
  // Shorter than a few heartbeats (50 ms apart) or a step of a loaded machine
  // would kill healthy workers.
  if (c.restart.start_timeout.count() != 0 && c.restart.start_timeout < std::chrono::seconds(1))
    r.error_at("restart.start_timeout", "restart.start_timeout " + format_duration(c.restart.start_timeout) +
                                            " is too short: at least 1s, or 0 for no limit");
  if (c.restart.hang_timeout.count() != 0 && c.restart.hang_timeout < std::chrono::milliseconds(500))
    r.error_at("restart.hang_timeout", "restart.hang_timeout " + format_duration(c.restart.hang_timeout) +
                                           " is too short: at least 500ms, or 0 to turn hang detection off");
  check_positive(r, "restart.drain_deadline", c.restart.drain_deadline);
  if (c.status.sample_every < std::chrono::milliseconds(100))
    r.error_at("status.sample_every", "status.sample_every: must be at least 100ms");
  else if (c.status.history < c.status.sample_every || c.status.history / c.status.sample_every > 100000)
    r.error_at("status.history", "status.history: must hold from 1 to 100000 samples of status.sample_every");

  if (c.model.name.empty() && !c.model.path.empty()) c.model.name = c.model.path.stem().string();
}

}  // namespace

Config parse_config(const std::string& yaml, const fs::path& file, const LoadOptions& options) {
  const std::string name = file.empty() ? "<config>" : file.string();
  const fs::path base = file.empty() ? fs::current_path() : fs::absolute(file).parent_path();
  Config c;
  c.file = file;
  c.file_found = true;
  // yaml-cpp reads a NUL as the end of an escape ("unknown escape character"), a column off.
  if (const size_t nul = yaml.find('\0'); nul != std::string::npos) {
    const size_t line_start = yaml.rfind('\n', nul) == std::string::npos ? 0 : yaml.rfind('\n', nul) + 1;
    throw Error(name + ":" + std::to_string(std::count(yaml.begin(), yaml.begin() + std::ptrdiff_t(nul), '\n') + 1) +
                ":" + std::to_string(nul - line_start + 1) + ": a NUL byte: the config is a text file");
  }
  YAML::Node root;
  try {
    std::vector<YAML::Node> documents = YAML::LoadAll(yaml);
    if (documents.size() > 1) {  // Load() read the first and dropped the rest without a word
      const YAML::Mark m = documents[1].Mark();
      throw Error(name + (m.is_null() ? std::string() : ":" + std::to_string(m.line + 1) + ":" + std::to_string(m.column + 1)) +
                  ": a second YAML document (after '---'): the config is one document");
    }
    if (!documents.empty()) root = documents[0];
  } catch (const YAML::Exception& e) {
    const std::string where = e.mark.is_null()
                                  ? name
                                  : name + ":" + std::to_string(e.mark.line + 1) + ":" + std::to_string(e.mark.column + 1);
    // yaml-cpp says "bad file" when its parser stops at its depth limit.
    const bool too_deep = dynamic_cast<const YAML::DeepRecursion*>(&e) != nullptr;
    throw Error(where + ": YAML syntax error: " + (too_deep ? "nested too deeply (more than 2000 levels)" : e.msg));
  }
  Reader r(name, base);
  try {
    read_document(r, root, c);
  } catch (const YAML::Exception& e) {  // yaml-cpp surprises (aliases, odd nodes): still name the place
    r.error(e.mark, e.msg);
  }
  check(r, c, options);
  if (!r.errors.empty()) {
    std::string all;
    for (const auto& line : r.errors) all += (all.empty() ? "" : "\n") + line;
    throw Error(all);
  }
  return c;
}

Config load_config(const fs::path& file, const LoadOptions& options) {
  std::error_code ec;
  if (!fs::exists(file, ec)) {
    Config c = parse_config("", file, options);  // the defaults, checked against this machine
    c.file_found = false;
    return c;
  }
  if (fs::is_directory(file, ec)) throw Error(file.string() + ": is a folder, not a config file");
  // Reading a FIFO would wait for a writer, with the stop signals held (start_signals.h).
  if (!fs::is_regular_file(file, ec)) throw Error(file.string() + ": is not a regular file (a FIFO or a device?)");
  std::ifstream in(file, std::ios::binary);
  if (!in) throw Error(file.string() + ": cannot read the config file");
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) throw Error(file.string() + ": cannot read the config file");
  return parse_config(text.str(), file, options);
}

// ---------------------------------------------------------------------------
// Reload

bool ConfigChanges::changed(std::string_view key) const {
  return std::find(keys.begin(), keys.end(), key) != keys.end();
}

ConfigChanges diff(const Config& a, const Config& b) {
  ConfigChanges c;
  auto note = [&](bool differs, const char* key, bool& group) {
    if (!differs) return;
    c.keys.emplace_back(key);
    group = true;
  };
  note(a.model.path != b.model.path, "model.path", c.model);
  note(a.model.name != b.model.name, "model.name", c.in_place);
  // The model is loaded again into the new backing, while the old one serves.
  note(a.model.backing != b.model.backing, "model.backing", c.model);
  note(a.model.keep_resident != b.model.keep_resident, "model.keep_resident", c.model);
  // The segment in memory keeps its pages: the next load of the model takes the new setting.
  note(a.model.huge_pages != b.model.huge_pages, "model.huge_pages", c.in_place);

  const auto &P = a.proxy, &Q = b.proxy;
  note(P.listen != Q.listen, "proxy.listen", c.listen);
  note(P.api_keys_file != Q.api_keys_file, "proxy.api_keys_file", c.in_place);
  note(P.busy_poll != Q.busy_poll, "proxy.busy_poll", c.in_place);
  note(P.responses_store != Q.responses_store, "proxy.responses_store", c.in_place);
  note(P.queue.max_waiting != Q.queue.max_waiting, "proxy.queue.max_waiting", c.in_place);
  note(P.queue.max_wait != Q.queue.max_wait, "proxy.queue.max_wait", c.in_place);
  note(P.limits.max_header_bytes != Q.limits.max_header_bytes, "proxy.limits.max_header_bytes", c.in_place);
  note(P.limits.max_body_bytes != Q.limits.max_body_bytes, "proxy.limits.max_body_bytes", c.in_place);
  note(P.limits.request_timeout != Q.limits.request_timeout, "proxy.limits.request_timeout", c.in_place);
  note(P.limits.header_timeout != Q.limits.header_timeout, "proxy.limits.header_timeout", c.in_place);
  note(P.limits.body_timeout != Q.limits.body_timeout, "proxy.limits.body_timeout", c.in_place);
  note(P.limits.max_connections != Q.limits.max_connections, "proxy.limits.max_connections", c.in_place);
  note(P.limits.max_tokens_per_request != Q.limits.max_tokens_per_request, "proxy.limits.max_tokens_per_request",
       c.in_place);
  note(P.limits.allow_insecure_bind != Q.limits.allow_insecure_bind, "proxy.limits.allow_insecure_bind", c.in_place);

  // What a worker process was started with: changing it means drain + restart.
  const auto &V = a.workers, &W = b.workers;
  note(V.backend != W.backend, "workers.backend", c.worker_settings);
  note(V.count != W.count, "workers.count", c.worker_count);
  note(V.device != W.device, "workers.device", c.worker_settings);
  note(V.slots != W.slots, "workers.slots", c.worker_settings);
  note(V.threads != W.threads, "workers.threads", c.worker_settings);
  note(V.prefill_chunk != W.prefill_chunk, "workers.prefill_chunk", c.worker_settings);
  note(V.busy_poll != W.busy_poll, "workers.busy_poll", c.worker_settings);
  note(V.ladder != W.ladder, "workers.context.ladder", c.worker_settings);
  note(V.moe_offload != W.moe_offload, "workers.moe_offload", c.worker_settings);
  note(V.kv_cache != W.kv_cache, "workers.kv_cache", c.worker_settings);
  note(V.memory_max != W.memory_max, "workers.memory_max", c.worker_settings);
  note(V.reserve != W.reserve, "workers.reserve", c.in_place);  // policy only
  note(V.engine != W.engine, "workers.engine", c.worker_settings);
  note(V.exec_command != W.exec_command, "workers.exec.command", c.worker_settings);
  note(V.exec_overhead != W.exec_overhead, "workers.exec.overhead", c.in_place);  // the plan only
  note(a.gpu.weights != b.gpu.weights, "gpu.weights", c.worker_settings);

  note(a.headroom.min_available != b.headroom.min_available, "headroom.min_available", c.in_place);
  note(a.headroom.for_ != b.headroom.for_, "headroom.for", c.in_place);
  note(a.headroom.step_up_after != b.headroom.step_up_after, "headroom.step_up_after", c.in_place);
  note(a.headroom.psi != b.headroom.psi, "headroom.psi", c.in_place);
  note(a.restart.backoff_initial != b.restart.backoff_initial, "restart.backoff_initial", c.in_place);
  note(a.restart.backoff_max != b.restart.backoff_max, "restart.backoff_max", c.in_place);
  note(a.restart.healthy_after != b.restart.healthy_after, "restart.healthy_after", c.in_place);
  note(a.restart.hang_timeout != b.restart.hang_timeout, "restart.hang_timeout", c.in_place);
  note(a.restart.start_timeout != b.restart.start_timeout, "restart.start_timeout", c.in_place);
  note(a.restart.drain_deadline != b.restart.drain_deadline, "restart.drain_deadline", c.in_place);
  note(a.status.sample_every != b.status.sample_every, "status.sample_every", c.in_place);
  note(a.status.history != b.status.history, "status.history", c.in_place);
  note(a.status.events_kept != b.status.events_kept, "status.events_kept", c.in_place);
  return c;
}

}  // namespace ds4
