#include "supervisor/proxy/json_util.h"

#include <array>
#include <charconv>
#include <cmath>

#include "shared/error.h"

namespace ds4::proxy {

size_t utf8_length(std::string_view s) {
  const auto b = [&](size_t i) { return static_cast<unsigned char>(s[i]); };
  const unsigned char c = b(0);
  size_t n;
  unsigned char lo = 0x80, hi = 0xBF;  // the second byte's range
  if (c < 0x80) return 1;
  if (c >= 0xC2 && c <= 0xDF) n = 2;
  else if (c >= 0xE0 && c <= 0xEF) n = 3, lo = c == 0xE0 ? 0xA0 : 0x80, hi = c == 0xED ? 0x9F : 0xBF;
  else if (c >= 0xF0 && c <= 0xF4) n = 4, lo = c == 0xF0 ? 0x90 : 0x80, hi = c == 0xF4 ? 0x8F : 0xBF;
  else return 0;
  if (s.size() < n || b(1) < lo || b(1) > hi) return 0;
  for (size_t i = 2; i < n; ++i)
    if (b(i) < 0x80 || b(i) > 0xBF) return 0;
  return n;
}

namespace {

// The bytes a JSON string holds as they are: printable ASCII but '"' and '\\'.
constexpr std::array<bool, 256> kPlain = [] {
  std::array<bool, 256> t{};
  for (int c = 0x20; c < 0x80; ++c) t[size_t(c)] = c != '"' && c != '\\';
  return t;
}();

}  // namespace

void put_json_string(std::string& out, std::string_view s) {
  out += '"';
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (kPlain[c]) {
      size_t j = i + 1;
      while (j < s.size() && kPlain[static_cast<unsigned char>(s[j])]) ++j;
      out.append(s.data() + i, j - i);
      i = j;
      continue;
    }
    switch (c) {
      case '"': out += "\\\""; ++i; continue;
      case '\\': out += "\\\\"; ++i; continue;
      case '\b': out += "\\b"; ++i; continue;
      case '\f': out += "\\f"; ++i; continue;
      case '\n': out += "\\n"; ++i; continue;
      case '\r': out += "\\r"; ++i; continue;
      case '\t': out += "\\t"; ++i; continue;
      default: break;
    }
    if (c < 0x20) {
      static constexpr char kHex[] = "0123456789abcdef";
      out += "\\u00";
      out += kHex[c >> 4];
      out += kHex[c & 15];
      ++i;
      continue;
    }
    const size_t n = utf8_length(s.substr(i));
    if (n == 0) {
      out += "\xEF\xBF\xBD";  // U+FFFD
      ++i;
    } else {
      out.append(s.data() + i, n);
      i += n;
    }
  }
  out += '"';
}

void JsonWriter::separate() {
  if (after_value_) out_ += ',';
  after_value_ = true;
}

JsonWriter& JsonWriter::open(char c) {
  separate();
  out_ += c;
  after_value_ = false;
  return *this;
}

JsonWriter& JsonWriter::close(char c) {
  out_ += c;
  after_value_ = true;
  return *this;
}

JsonWriter& JsonWriter::key(std::string_view k) {
  separate();
  put_json_string(out_, k);
  out_ += ':';
  after_value_ = false;
  return *this;
}

JsonWriter& JsonWriter::value(std::string_view s) {
  separate();
  put_json_string(out_, s);
  return *this;
}

JsonWriter& JsonWriter::value(int64_t v) {
  separate();
  char b[24];
  out_.append(b, std::to_chars(b, b + sizeof b, v).ptr);
  return *this;
}

JsonWriter& JsonWriter::value(double v) {
  separate();
  if (!std::isfinite(v)) {
    out_ += "null";
    return *this;
  }
  char b[40];
  const std::string_view text(b, size_t(std::to_chars(b, b + sizeof b, v).ptr - b));
  out_ += text;
  if (text.find_first_of(".e") == std::string_view::npos) out_ += ".0";  // as dump()
  return *this;
}

JsonWriter& JsonWriter::raw(std::string_view json) {
  separate();
  out_ += json;
  return *this;
}

namespace {

const json* field(const json& obj, const char* name) {
  auto it = obj.find(name);
  if (it == obj.end() || it->is_null()) return nullptr;
  return &*it;
}
std::string got(const json& v) { return std::string(v.type_name()); }
}  // namespace

std::variant<json, std::string> parse_body(std::string_view text) {
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    std::string why = e.what();  // "[json.exception.parse_error.101] parse error at ..."
    if (auto p = why.find("] "); why.starts_with("[json.exception") && p != std::string::npos) why.erase(0, p + 2);
    if (why.size() > 200) why = why.substr(0, 200) + "...";  // a cut character becomes U+FFFD in the answer
    return why;
  }
}

std::optional<bool> opt_bool(const json& obj, const char* name) {
  const json* v = field(obj, name);
  if (!v) return std::nullopt;
  if (!v->is_boolean()) throw Error(std::string("'") + name + "' must be true or false, got " + got(*v));
  return v->get<bool>();
}

std::optional<double> opt_number(const json& obj, const char* name, double lo, double hi) {
  const json* v = field(obj, name);
  if (!v) return std::nullopt;
  if (!v->is_number()) throw Error(std::string("'") + name + "' must be a number, got " + got(*v));
  const double d = v->get<double>();
  if (!std::isfinite(d) || d < lo || d > hi)
    throw Error(std::string("'") + name + "' = " + v->dump() + " is out of range [" + json(lo).dump() + ", " +
                json(hi).dump() + "]");
  return d;
}

std::optional<int64_t> opt_int(const json& obj, const char* name, int64_t lo, int64_t hi) {
  const json* v = field(obj, name);
  if (!v) return std::nullopt;
  int64_t i = 0;
  if (v->is_number_unsigned()) {
    const uint64_t u = v->get<uint64_t>();
    i = u > uint64_t(INT64_MAX) ? INT64_MAX : int64_t(u);
  } else if (v->is_number_integer()) {
    i = v->get<int64_t>();
  } else if (v->is_number_float() && std::isfinite(v->get<double>()) && v->get<double>() == std::floor(v->get<double>()) &&
             std::fabs(v->get<double>()) < 9e18) {
    i = int64_t(v->get<double>());
  } else {
    throw Error(std::string("'") + name + "' must be an integer, got " + (v->is_number() ? v->dump() : got(*v)));
  }
  if (i < lo || i > hi)
    throw Error(std::string("'") + name + "' = " + v->dump() + " is out of range [" + std::to_string(lo) + ", " +
                std::to_string(hi) + "]");
  return i;
}

std::optional<std::string> opt_string(const json& obj, const char* name) {
  const json* v = field(obj, name);
  if (!v) return std::nullopt;
  if (!v->is_string()) throw Error(std::string("'") + name + "' must be a string, got " + got(*v));
  return v->get<std::string>();
}

}  // namespace ds4::proxy
