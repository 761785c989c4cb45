#pragma once
/// The interpreter's values (internal to text/jinja*.cpp): undefined, none,
/// booleans, integers, floats, strings, lists, dicts (insertion-ordered, as
/// Python's), namespaces and callables. Lists, dicts and namespaces are shared
/// by reference, as in Python; a container records its nesting depth, and
/// every conversion that walks a value (tojson, string, equality) is bounded
/// by kMaxNesting, so no value can overflow the stack.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace ds4::jinja {

inline constexpr size_t kMaxNesting = 512;  // containers inside containers

struct Value;
struct Array;
struct Object;
class Interp;

/// Positional and keyword arguments of a call.
struct Args {
  std::vector<Value> pos;
  std::vector<std::pair<std::string, Value>> kw;
  const Value* kwarg(std::string_view name) const;
};

using Func = std::function<Value(Interp&, Args&)>;

struct Value {
  enum class T : uint8_t { undefined, none, boolean, integer, floating, string, array, object, ns, func };
  T t = T::undefined;
  bool b = false;
  int64_t i = 0;
  double d = 0;
  std::string s;
  std::shared_ptr<Array> a;   // array
  std::shared_ptr<Object> o;  // object, ns
  std::shared_ptr<Func> f;    // func

  Value() = default;
  static Value none() { Value v; v.t = T::none; return v; }
  static Value boolean(bool x) { Value v; v.t = T::boolean; v.b = x; return v; }
  static Value integer(int64_t x) { Value v; v.t = T::integer; v.i = x; return v; }
  static Value floating(double x) { Value v; v.t = T::floating; v.d = x; return v; }
  static Value string(std::string x) { Value v; v.t = T::string; v.s = std::move(x); return v; }
  /// Throws ds4::Error when the items nest deeper than kMaxNesting.
  static Value array(std::vector<Value> items);
  static Value object(std::vector<std::pair<std::string, Value>> items);
  static Value ns(std::vector<std::pair<std::string, Value>> items);
  static Value func(Func fn) { Value v; v.t = T::func; v.f = std::make_shared<Func>(std::move(fn)); return v; }

  bool is_undefined() const { return t == T::undefined; }
  bool is_none() const { return t == T::none; }
  bool is_string() const { return t == T::string; }
  bool is_number() const { return t == T::integer || t == T::floating; }
  bool is_array() const { return t == T::array; }
  bool is_mapping() const { return t == T::object; }
  bool is_attr_container() const { return t == T::object || t == T::ns; }
  /// Depth of nesting: 0 for a scalar, 1 + the deepest item for a container.
  size_t depth() const;
  /// Python's truth: empty strings, lists, dicts, 0, none and undefined are false.
  bool truthy() const;
  const char* type_name() const;
};

struct Array {
  std::vector<Value> items;
  size_t depth = 1;
};

struct Object {
  std::vector<std::pair<std::string, Value>> items;  // in insertion order
  size_t depth = 1;
  const Value* find(std::string_view key) const;
  /// Sets `key` (replacing or appending) and updates the recorded depth.
  void set(const std::string& key, Value v);
};

/// The value of a JSON document (objects keep their order). Throws ds4::Error
/// when it nests deeper than kMaxNesting.
Value from_json(const nlohmann::ordered_json& j);

struct JsonFormat {
  int indent = -1;  // < 0: one line
  bool ensure_ascii = false;
  bool sort_keys = false;
  std::string item_sep = ", ";
  std::string key_sep = ": ";
};
/// Python's json.dumps of `v` (undefined as null when `undefined_as_null`,
/// else an error is not raised but "undefined" written, as the reference
/// does inside |string).
std::string to_json(const Value& v, const JsonFormat& f = {}, bool undefined_as_null = true);
/// A JSON string literal of `s` (escapes as json.dumps does).
std::string json_quote(std::string_view s, bool ensure_ascii = false);

/// The text of a value as `~`, |string and join give it: strings as they are,
/// numbers as Python writes them, True/False/None, containers as JSON.
std::string to_str(const Value& v);
/// A float as Python's repr writes it (1.0, 0.1, 1e+20).
std::string float_str(double d);

/// Equality as Python's == (1 == 1.0, deep for lists and dicts).
bool equals(const Value& a, const Value& b, size_t depth = 0);
/// -1, 0, 1 for sorting and < >: numbers with numbers, strings with strings
/// (case-insensitive unless `case_sensitive`); other pairs throw ds4::Error.
int compare(const Value& a, const Value& b, bool case_sensitive = true);

/// Code points of a UTF-8 string (invalid bytes count one each).
std::vector<std::string_view> utf8_chars(std::string_view s);
size_t utf8_length(std::string_view s);

}  // namespace ds4::jinja
