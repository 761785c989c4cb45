#include "text/jinja_value.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "shared/error.h"

namespace ds4::jinja {

const Value* Args::kwarg(std::string_view name) const {
  for (const auto& [k, v] : kw)
    if (k == name) return &v;
  return nullptr;
}

namespace {

void check_depth(size_t depth) {
  if (depth > kMaxNesting)
    throw Error("values nest deeper than " + std::to_string(kMaxNesting) + " lists and dicts");
}

}  // namespace

Value Value::array(std::vector<Value> items) {
  Value v;
  v.t = T::array;
  v.a = std::make_shared<Array>();
  size_t d = 0;
  for (const Value& x : items) d = std::max(d, x.depth());
  check_depth(d + 1);
  v.a->items = std::move(items);
  v.a->depth = d + 1;
  return v;
}

Value Value::object(std::vector<std::pair<std::string, Value>> items) {
  Value v;
  v.t = T::object;
  v.o = std::make_shared<Object>();
  for (auto& [k, x] : items) v.o->set(k, std::move(x));
  return v;
}

Value Value::ns(std::vector<std::pair<std::string, Value>> items) {
  Value v = object(std::move(items));
  v.t = T::ns;
  return v;
}

size_t Value::depth() const {
  if (t == T::array) return a->depth;
  if (t == T::object || t == T::ns) return o->depth;
  return 0;
}

bool Value::truthy() const {
  switch (t) {
    case T::undefined: case T::none: return false;
    case T::boolean: return b;
    case T::integer: return i != 0;
    case T::floating: return d != 0;
    case T::string: return !s.empty();
    case T::array: return !a->items.empty();
    case T::object: return !o->items.empty();
    case T::ns: case T::func: return true;
  }
  return false;
}

const char* Value::type_name() const {
  switch (t) {
    case T::undefined: return "undefined";
    case T::none: return "none";
    case T::boolean: return "boolean";
    case T::integer: return "integer";
    case T::floating: return "float";
    case T::string: return "string";
    case T::array: return "list";
    case T::object: return "dict";
    case T::ns: return "namespace";
    case T::func: return "function";
  }
  return "?";
}

const Value* Object::find(std::string_view key) const {
  for (const auto& [k, v] : items)
    if (k == key) return &v;
  return nullptr;
}

void Object::set(const std::string& key, Value v) {
  check_depth(v.depth() + 1);
  depth = std::max(depth, v.depth() + 1);
  for (auto& [k, x] : items) {
    if (k == key) {
      x = std::move(v);
      return;
    }
  }
  items.emplace_back(key, std::move(v));
}

namespace {

Value from_json_at(const nlohmann::ordered_json& j, size_t depth) {
  using J = nlohmann::ordered_json::value_t;
  switch (j.type()) {
    case J::null: case J::discarded: return Value::none();
    case J::boolean: return Value::boolean(j.get<bool>());
    case J::number_integer: return Value::integer(j.get<int64_t>());
    case J::number_unsigned: {
      const uint64_t u = j.get<uint64_t>();
      return u > uint64_t(INT64_MAX) ? Value::floating(double(u)) : Value::integer(int64_t(u));
    }
    case J::number_float: return Value::floating(j.get<double>());
    case J::string: return Value::string(j.get<std::string>());
    case J::binary: return Value::none();
    case J::array: {
      check_depth(depth + 1);
      std::vector<Value> items;
      items.reserve(j.size());
      for (const auto& x : j) items.push_back(from_json_at(x, depth + 1));
      return Value::array(std::move(items));
    }
    case J::object: {
      check_depth(depth + 1);
      std::vector<std::pair<std::string, Value>> items;
      items.reserve(j.size());
      for (const auto& [k, x] : j.items()) items.emplace_back(k, from_json_at(x, depth + 1));
      return Value::object(std::move(items));
    }
  }
  return Value::none();
}

void put_hex4(std::string& out, unsigned cp) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "\\u%04x", cp);
  out += buf;
}

void json_at(std::string& out, const Value& v, const JsonFormat& f, bool undef_null, size_t depth) {
  if (depth > kMaxNesting) throw Error("tojson: the value nests deeper than " + std::to_string(kMaxNesting));
  auto newline = [&](size_t level) {
    out += '\n';
    out.append(size_t(f.indent) * level, ' ');
  };
  switch (v.t) {
    case Value::T::undefined: out += undef_null ? "null" : "undefined"; return;
    case Value::T::none: out += "null"; return;
    case Value::T::boolean: out += v.b ? "true" : "false"; return;
    case Value::T::integer: out += std::to_string(v.i); return;
    case Value::T::floating:
      if (!std::isfinite(v.d)) out += std::isnan(v.d) ? "NaN" : (v.d > 0 ? "Infinity" : "-Infinity");
      else out += float_str(v.d);
      return;
    case Value::T::string: out += json_quote(v.s, f.ensure_ascii); return;
    case Value::T::func: out += "null"; return;
    case Value::T::array: {
      const auto& items = v.a->items;
      out += '[';
      for (size_t k = 0; k < items.size(); ++k) {
        if (k) out += f.item_sep;
        if (f.indent >= 0) newline(depth + 1);
        json_at(out, items[k], f, undef_null, depth + 1);
      }
      if (f.indent >= 0 && !items.empty()) newline(depth);
      out += ']';
      return;
    }
    case Value::T::object: case Value::T::ns: {
      std::vector<const std::pair<std::string, Value>*> items;
      for (const auto& kv : v.o->items) items.push_back(&kv);
      if (f.sort_keys)
        std::stable_sort(items.begin(), items.end(), [](auto* x, auto* y) { return x->first < y->first; });
      out += '{';
      for (size_t k = 0; k < items.size(); ++k) {
        if (k) out += f.item_sep;
        if (f.indent >= 0) newline(depth + 1);
        out += json_quote(items[k]->first, f.ensure_ascii);
        out += f.key_sep;
        json_at(out, items[k]->second, f, undef_null, depth + 1);
      }
      if (f.indent >= 0 && !items.empty()) newline(depth);
      out += '}';
      return;
    }
  }
}

// Decodes one UTF-8 sequence at s[k]; returns its length (1 for an invalid byte).
size_t utf8_seq(std::string_view s, size_t k, unsigned* cp) {
  const unsigned char c = static_cast<unsigned char>(s[k]);
  size_t n = c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 0;
  if (n == 0 || k + n > s.size()) {
    *cp = 0xFFFD;
    return 1;
  }
  unsigned x = n == 1 ? c : c & (0x7F >> n);
  for (size_t m = 1; m < n; ++m) {
    const unsigned char cc = static_cast<unsigned char>(s[k + m]);
    if ((cc & 0xC0) != 0x80) {
      *cp = 0xFFFD;
      return 1;
    }
    x = (x << 6) | (cc & 0x3F);
  }
  *cp = x;
  return n;
}

}  // namespace

Value from_json(const nlohmann::ordered_json& j) { return from_json_at(j, 0); }

std::string json_quote(std::string_view s, bool ensure_ascii) {
  std::string out;
  out.reserve(s.size() + 2);
  out += '"';
  for (size_t k = 0; k < s.size();) {
    const unsigned char c = static_cast<unsigned char>(s[k]);
    if (c >= 0x80) {
      unsigned cp;
      const size_t n = utf8_seq(s, k, &cp);
      if (n == 1 || ensure_ascii) {
        // Invalid bytes become U+FFFD, as a JavaScript or Python string would hold them.
        if (!ensure_ascii) out += "\xef\xbf\xbd";
        else if (cp >= 0x10000) {
          put_hex4(out, 0xD800 + ((cp - 0x10000) >> 10));
          put_hex4(out, 0xDC00 + ((cp - 0x10000) & 0x3FF));
        } else {
          put_hex4(out, cp);
        }
      } else {
        out.append(s.substr(k, n));
      }
      k += n;
      continue;
    }
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (c < 0x20 || (ensure_ascii && c == 0x7F)) put_hex4(out, c);
        else out += char(c);
    }
    ++k;
  }
  out += '"';
  return out;
}

std::string to_json(const Value& v, const JsonFormat& f, bool undefined_as_null) {
  std::string out;
  json_at(out, v, f, undefined_as_null, 0);
  return out;
}

std::string float_str(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  if (d == std::floor(d) && std::fabs(d) < 1e16) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.1f", d);
    return buf;
  }
  // The shortest text that reads back as the same double, as repr() gives.
  char buf[40];
  for (int prec = 1; prec <= 17; ++prec) {
    std::snprintf(buf, sizeof buf, "%.*g", prec, d);
    if (std::strtod(buf, nullptr) == d) break;
  }
  std::string s = buf;
  // %g writes 1e+20 as Python does, but 1e-05 as Python's 1e-05 too.
  return s;
}

std::string to_str(const Value& v) {
  switch (v.t) {
    case Value::T::undefined: return "";
    case Value::T::none: return "None";
    case Value::T::boolean: return v.b ? "True" : "False";
    case Value::T::integer: return std::to_string(v.i);
    case Value::T::floating: return float_str(v.d);
    case Value::T::string: return v.s;
    case Value::T::func: return "<function>";
    default: return to_json(v, {}, false);
  }
}

bool equals(const Value& a, const Value& b, size_t depth) {
  if (depth > kMaxNesting) throw Error("==: the values nest deeper than " + std::to_string(kMaxNesting));
  if (a.is_number() && b.is_number()) {
    if (a.t == Value::T::integer && b.t == Value::T::integer) return a.i == b.i;
    const double x = a.t == Value::T::integer ? double(a.i) : a.d;
    const double y = b.t == Value::T::integer ? double(b.i) : b.d;
    return x == y;
  }
  if ((a.t == Value::T::boolean && b.is_number()) || (b.t == Value::T::boolean && a.is_number()))
    return equals(a.t == Value::T::boolean ? Value::integer(a.b) : a, b.t == Value::T::boolean ? Value::integer(b.b) : b, depth);
  if (a.t != b.t) return false;
  switch (a.t) {
    case Value::T::undefined: case Value::T::none: return true;
    case Value::T::boolean: return a.b == b.b;
    case Value::T::string: return a.s == b.s;
    case Value::T::func: return a.f == b.f;
    case Value::T::ns: return a.o == b.o;
    case Value::T::array: {
      if (a.a == b.a) return true;
      if (a.a->items.size() != b.a->items.size()) return false;
      for (size_t k = 0; k < a.a->items.size(); ++k)
        if (!equals(a.a->items[k], b.a->items[k], depth + 1)) return false;
      return true;
    }
    case Value::T::object: {
      if (a.o == b.o) return true;
      if (a.o->items.size() != b.o->items.size()) return false;
      for (const auto& [k, x] : a.o->items) {
        const Value* y = b.o->find(k);
        if (!y || !equals(x, *y, depth + 1)) return false;
      }
      return true;
    }
    default: return false;
  }
}

int compare(const Value& a, const Value& b, bool case_sensitive) {
  auto num = [](const Value& v) { return v.t == Value::T::integer ? double(v.i) : v.t == Value::T::boolean ? double(v.b) : v.d; };
  auto numeric = [](const Value& v) { return v.is_number() || v.t == Value::T::boolean; };
  if (numeric(a) && numeric(b)) {
    if (a.t == Value::T::integer && b.t == Value::T::integer) return a.i < b.i ? -1 : a.i > b.i ? 1 : 0;
    const double x = num(a), y = num(b);
    return x < y ? -1 : x > y ? 1 : 0;
  }
  if (a.is_string() && b.is_string()) {
    if (case_sensitive) return a.s < b.s ? -1 : a.s > b.s ? 1 : 0;
    std::string x = a.s, y = b.s;
    for (char& c : x) c = char(std::tolower(static_cast<unsigned char>(c)));
    for (char& c : y) c = char(std::tolower(static_cast<unsigned char>(c)));
    return x < y ? -1 : x > y ? 1 : 0;
  }
  if (a.is_array() && b.is_array()) {
    const size_t n = std::min(a.a->items.size(), b.a->items.size());
    for (size_t k = 0; k < n; ++k) {
      const int c = compare(a.a->items[k], b.a->items[k], case_sensitive);
      if (c) return c;
    }
    return a.a->items.size() < b.a->items.size() ? -1 : a.a->items.size() > b.a->items.size() ? 1 : 0;
  }
  if (a.is_none() && b.is_none()) return 0;
  throw Error(std::string("cannot compare ") + a.type_name() + " with " + b.type_name());
}

std::vector<std::string_view> utf8_chars(std::string_view s) {
  std::vector<std::string_view> out;
  out.reserve(s.size());
  for (size_t k = 0; k < s.size();) {
    unsigned cp;
    const size_t n = utf8_seq(s, k, &cp);
    out.push_back(s.substr(k, n));
    k += n;
  }
  return out;
}

size_t utf8_length(std::string_view s) {
  size_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}

}  // namespace ds4::jinja
