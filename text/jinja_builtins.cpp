// Filters, tests, methods of strings, dicts and lists, and the globals
// (namespace, range, raise_exception, strftime_now, dict): the ones real
// chat templates use, with Python's meaning.
#include <algorithm>
#include <cmath>
#include <ctime>

#include "shared/error.h"
#include "text/jinja_eval.h"

namespace ds4::jinja {

namespace {

// Argument `index` by position, else by `name`; null when absent.
const Value* arg(const Args& a, size_t index, std::string_view name) {
  if (index < a.pos.size()) return &a.pos[index];
  return a.kwarg(name);
}

std::string str_arg(const Args& a, size_t index, std::string_view name, const std::string& what, const char* def = nullptr) {
  const Value* v = arg(a, index, name);
  if (!v || v->is_none() || v->is_undefined()) {
    if (def) return def;
    throw Error(what + ": missing argument '" + std::string(name) + "'");
  }
  if (!v->is_string()) throw Error(what + ": '" + std::string(name) + "' must be a string, not a " + v->type_name());
  return v->s;
}

bool bool_arg(const Args& a, size_t index, std::string_view name, bool def) {
  const Value* v = arg(a, index, name);
  return v && !v->is_undefined() ? v->truthy() : def;
}

int64_t int_arg(const Args& a, size_t index, std::string_view name, int64_t def, const std::string& what) {
  const Value* v = arg(a, index, name);
  if (!v || v->is_none() || v->is_undefined()) return def;
  if (v->t == Value::T::integer) return v->i;
  if (v->t == Value::T::boolean) return v->b;
  throw Error(what + ": '" + std::string(name) + "' must be an integer, not a " + v->type_name());
}

bool is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

// Python's str.strip family: whitespace, or any of `chars`.
std::string strip(std::string_view s, const Value* chars, bool left, bool right) {
  auto drop = [&](std::string_view c) {
    if (!chars || chars->is_none() || chars->is_undefined()) return c.size() == 1 && is_ws(c[0]);
    return chars->is_string() && chars->s.find(c) != std::string::npos;
  };
  const auto cs = utf8_chars(s);
  size_t b = 0, e = cs.size();
  if (left) while (b < e && drop(cs[b])) ++b;
  if (right) while (e > b && drop(cs[e - 1])) --e;
  std::string out;
  for (size_t k = b; k < e; ++k) out += cs[k];
  return out;
}

std::string ascii_case(std::string s, bool upper) {
  for (char& c : s) c = char(upper ? std::toupper(static_cast<unsigned char>(c)) : std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::string title(std::string s) {
  bool prev_letter = false;
  for (char& c : s) {
    const bool letter = std::isalpha(static_cast<unsigned char>(c));
    if (letter) c = char(prev_letter ? std::tolower(static_cast<unsigned char>(c)) : std::toupper(static_cast<unsigned char>(c)));
    prev_letter = letter;
  }
  return s;
}

std::string replace_all(const std::string& s, const std::string& from, const std::string& to, int64_t count, Interp& in) {
  std::string out;
  size_t k = 0;
  int64_t done = 0;
  if (from.empty()) {  // Python inserts `to` around every character
    for (std::string_view c : utf8_chars(s)) {
      if (count >= 0 && done >= count) {
        out += c;
        continue;
      }
      out += to;
      out += c;
      ++done;
      in.charge(out.size());
    }
    if (count < 0 || done < count) out += to;
    return out;
  }
  while (true) {
    const size_t m = (count >= 0 && done >= count) ? std::string::npos : s.find(from, k);
    if (m == std::string::npos) break;
    out.append(s, k, m - k);
    out += to;
    k = m + from.size();
    ++done;
    in.charge(out.size());
  }
  out.append(s, k, std::string::npos);
  in.charge(out.size());
  return out;
}

Value split(const std::string& s, const Value* sep, int64_t maxsplit, Interp& in) {
  std::vector<Value> parts;
  if (!sep || sep->is_none() || sep->is_undefined()) {
    size_t k = 0;
    while (true) {
      while (k < s.size() && is_ws(s[k])) ++k;
      if (k >= s.size()) break;
      if (maxsplit >= 0 && int64_t(parts.size()) >= maxsplit) {
        size_t e = s.size();
        while (e > k && is_ws(s[e - 1])) --e;
        parts.push_back(Value::string(s.substr(k, e - k)));
        break;
      }
      size_t e = k;
      while (e < s.size() && !is_ws(s[e])) ++e;
      parts.push_back(Value::string(s.substr(k, e - k)));
      k = e;
    }
  } else {
    if (!sep->is_string()) throw Error(std::string("split: the separator must be a string, not a ") + sep->type_name());
    if (sep->s.empty()) throw Error("split: empty separator");
    size_t k = 0;
    while (true) {
      const size_t m = (maxsplit >= 0 && int64_t(parts.size()) >= maxsplit) ? std::string::npos : s.find(sep->s, k);
      if (m == std::string::npos) break;
      parts.push_back(Value::string(s.substr(k, m - k)));
      k = m + sep->s.size();
    }
    parts.push_back(Value::string(s.substr(k)));
  }
  in.charge(parts.size());
  return Value::array(std::move(parts));
}

bool starts_or_ends(const std::string& s, const Value* p, bool start, const char* what) {
  auto one = [&](const Value& x) {
    if (!x.is_string()) throw Error(std::string(what) + ": the argument must be a string or a tuple of strings");
    if (x.s.size() > s.size()) return false;
    return start ? s.compare(0, x.s.size(), x.s) == 0 : s.compare(s.size() - x.s.size(), x.s.size(), x.s) == 0;
  };
  if (!p) throw Error(std::string(what) + "() takes one argument");
  if (p->is_array()) return std::any_of(p->a->items.begin(), p->a->items.end(), one);
  return one(*p);
}

// Items of an iterable for filters: lists as they are, dict keys, string characters.
std::vector<Value> items_of(const Value& v, const std::string& what) {
  if (v.is_array()) return v.a->items;
  if (v.is_undefined()) return {};
  if (v.is_attr_container()) {
    std::vector<Value> out;
    for (const auto& kv : v.o->items) out.push_back(Value::string(kv.first));
    return out;
  }
  if (v.is_string()) {
    std::vector<Value> out;
    for (std::string_view c : utf8_chars(v.s)) out.push_back(Value::string(std::string(c)));
    return out;
  }
  throw Error(what + ": expected a list, got a " + v.type_name());
}

// item.a.b for map(attribute=), sort(attribute=), selectattr: dotted paths, numeric parts index lists.
Value path(Interp& in, const Value& v, const std::string& attr) {
  Value cur = v;
  size_t k = 0;
  while (true) {
    const size_t dot = attr.find('.', k);
    const std::string part = attr.substr(k, dot == std::string::npos ? std::string::npos : dot - k);
    if (cur.is_array() && !part.empty() && std::all_of(part.begin(), part.end(), ::isdigit))
      cur = in.item(cur, Value::integer(std::strtoll(part.c_str(), nullptr, 10)));
    else
      cur = in.attr(cur, part);
    if (dot == std::string::npos) return cur;
    k = dot + 1;
  }
}

Value pairs(const Value& obj) {
  std::vector<Value> out;
  for (const auto& [k, v] : obj.o->items) out.push_back(Value::array({Value::string(k), v}));
  return Value::array(std::move(out));
}

Value keys_of(const Value& obj) {
  std::vector<Value> out;
  for (const auto& kv : obj.o->items) out.push_back(Value::string(kv.first));
  return Value::array(std::move(out));
}

Value values_of(const Value& obj) {
  std::vector<Value> out;
  for (const auto& kv : obj.o->items) out.push_back(kv.second);
  return Value::array(std::move(out));
}

// A bound method: obj.name(...).
Value method(const Value& obj, std::string name) {
  return Value::func([obj, name](Interp& in, Args& a) -> Value {
    if (obj.is_string()) {
      const std::string& s = obj.s;
      const std::string what = "str." + name;
      if (name == "upper") return Value::string(ascii_case(s, true));
      if (name == "lower") return Value::string(ascii_case(s, false));
      if (name == "strip") return Value::string(strip(s, arg(a, 0, "chars"), true, true));
      if (name == "lstrip") return Value::string(strip(s, arg(a, 0, "chars"), true, false));
      if (name == "rstrip") return Value::string(strip(s, arg(a, 0, "chars"), false, true));
      if (name == "title") return Value::string(title(s));
      if (name == "capitalize") return Value::string(s.empty() ? s : ascii_case(s.substr(0, 1), true) + ascii_case(s.substr(1), false));
      if (name == "startswith") return Value::boolean(starts_or_ends(s, arg(a, 0, "prefix"), true, "startswith"));
      if (name == "endswith") return Value::boolean(starts_or_ends(s, arg(a, 0, "suffix"), false, "endswith"));
      if (name == "split") return split(s, arg(a, 0, "sep"), int_arg(a, 1, "maxsplit", -1, what), in);
      if (name == "replace")
        return Value::string(replace_all(s, str_arg(a, 0, "old", what), str_arg(a, 1, "new", what), int_arg(a, 2, "count", -1, what), in));
      if (name == "find" || name == "rfind" || name == "count") {
        const std::string sub = str_arg(a, 0, "sub", what);
        if (name == "count") {
          if (sub.empty()) return Value::integer(int64_t(utf8_length(s)) + 1);
          int64_t n = 0;
          for (size_t k = s.find(sub); k != std::string::npos; k = s.find(sub, k + sub.size())) ++n;
          return Value::integer(n);
        }
        const size_t k = name == "find" ? s.find(sub) : s.rfind(sub);
        return Value::integer(k == std::string::npos ? -1 : int64_t(utf8_length(std::string_view(s).substr(0, k))));
      }
      if (name == "join") {
        std::string out;
        bool first = true;
        for (const Value& x : items_of(a.pos.empty() ? Value() : a.pos[0], what)) {
          if (!first) out += s;
          first = false;
          out += to_str(x);
          in.charge(out.size());
        }
        return Value::string(std::move(out));
      }
      if (name == "removeprefix" || name == "removesuffix") {
        const std::string x = str_arg(a, 0, "prefix", what);
        if (name == "removeprefix") return Value::string(s.compare(0, x.size(), x) == 0 ? s.substr(x.size()) : s);
        return Value::string(s.size() >= x.size() && s.compare(s.size() - x.size(), x.size(), x) == 0 ? s.substr(0, s.size() - x.size()) : s);
      }
      if (name == "isdigit" || name == "isalpha" || name == "isspace" || name == "isalnum") {
        if (s.empty()) return Value::boolean(false);
        auto pred = name == "isdigit" ? ::isdigit : name == "isalpha" ? ::isalpha : name == "isspace" ? ::isspace : ::isalnum;
        return Value::boolean(std::all_of(s.begin(), s.end(), [&](char c) { return pred(static_cast<unsigned char>(c)); }));
      }
      if (name == "islower") return Value::boolean(s == ascii_case(s, false) && s != ascii_case(s, true));
      if (name == "isupper") return Value::boolean(s == ascii_case(s, true) && s != ascii_case(s, false));
    } else if (obj.is_mapping()) {
      if (name == "get") {
        const Value* key = arg(a, 0, "key");
        if (key && key->is_string())
          if (const Value* v = obj.o->find(key->s)) return *v;
        const Value* def = arg(a, 1, "default");
        return def ? *def : Value::none();
      }
      if (name == "items") return pairs(obj);
      if (name == "keys") return keys_of(obj);
      if (name == "values") return values_of(obj);
    } else if (obj.is_array()) {
      if (name == "append") {
        if (a.pos.size() != 1) throw Error("list.append() takes exactly one argument");
        in.charge(obj.a->items.size() + 1);
        const Value& x = a.pos[0];
        if (x.depth() + 1 > kMaxNesting) throw Error("values nest deeper than " + std::to_string(kMaxNesting) + " lists and dicts");
        obj.a->depth = std::max(obj.a->depth, x.depth() + 1);
        obj.a->items.push_back(x);
        in.mutated(obj);
        return Value::none();
      }
      if (name == "index") {
        for (size_t k = 0; k < obj.a->items.size(); ++k)
          if (!a.pos.empty() && equals(obj.a->items[k], a.pos[0])) return Value::integer(int64_t(k));
        throw Error("list.index(x): x not in list");
      }
      if (name == "count") {
        int64_t n = 0;
        for (const Value& x : obj.a->items) n += !a.pos.empty() && equals(x, a.pos[0]);
        return Value::integer(n);
      }
    }
    throw Error(std::string("a ") + obj.type_name() + " has no method '" + name + "'");
  });
}

bool has_method(const Value& obj, const std::string& name) {
  static const char* const kStr[] = {"upper", "lower", "strip", "lstrip", "rstrip", "title", "capitalize",
                                     "startswith", "endswith", "split", "replace", "find", "rfind", "count",
                                     "join", "removeprefix", "removesuffix", "isdigit", "isalpha", "isspace",
                                     "isalnum", "islower", "isupper"};
  static const char* const kDict[] = {"get", "items", "keys", "values"};
  static const char* const kList[] = {"append", "index", "count"};
  auto in = [&](auto& list) { return std::any_of(std::begin(list), std::end(list), [&](const char* m) { return name == m; }); };
  if (obj.is_string()) return in(kStr);
  if (obj.is_mapping()) return in(kDict);
  if (obj.is_array()) return in(kList);
  return false;
}

}  // namespace

Value Interp::attr(const Value& obj, const std::string& name) {
  if (obj.is_attr_container()) {
    if (const Value* v = obj.o->find(name)) return *v;
  }
  if ((obj.is_string() || obj.is_array()) && name == "length")
    return Value::integer(int64_t(obj.is_string() ? utf8_length(obj.s) : obj.a->items.size()));
  if (has_method(obj, name)) return method(obj, name);
  return {};
}

Value Interp::item(const Value& obj, const Value& key) {
  if (obj.is_array() || obj.is_string()) {
    if (key.t == Value::T::integer || key.t == Value::T::boolean) {
      int64_t k = key.t == Value::T::boolean ? key.b : key.i;
      if (obj.is_array()) {
        const int64_t n = int64_t(obj.a->items.size());
        if (k < 0) k += n;
        return k >= 0 && k < n ? obj.a->items[size_t(k)] : Value();
      }
      const auto chars = utf8_chars(obj.s);
      const int64_t n = int64_t(chars.size());
      if (k < 0) k += n;
      return k >= 0 && k < n ? Value::string(std::string(chars[size_t(k)])) : Value();
    }
    if (key.is_string()) return attr(obj, key.s);
    if (key.is_undefined()) return {};
    throw Error(std::string("a ") + obj.type_name() + " index must be an integer, not a " + key.type_name());
  }
  if (obj.is_attr_container()) {
    if (key.is_string()) {
      const Value* v = obj.o->find(key.s);
      return v ? *v : Value();
    }
    return {};
  }
  return {};
}

// ---- tests ----

bool Interp::test(const std::string& name, const Value& v, Args& a) {
  const Value* x = arg(a, 0, "value");
  auto need = [&]() -> const Value& {
    if (!x) throw Error("test '" + name + "' needs an argument");
    return *x;
  };
  if (name == "defined") return !v.is_undefined();
  if (name == "undefined") return v.is_undefined();
  if (name == "none") return v.is_none();
  if (name == "string") return v.is_string();
  if (name == "mapping") return v.is_mapping();
  if (name == "sequence") return v.is_array() || v.is_string() || v.is_mapping();
  if (name == "iterable") return v.is_array() || v.is_string() || v.is_mapping();
  if (name == "number") return v.is_number();
  if (name == "integer") return v.t == Value::T::integer;
  if (name == "float") return v.t == Value::T::floating;
  if (name == "boolean") return v.t == Value::T::boolean;
  if (name == "true") return v.t == Value::T::boolean && v.b;
  if (name == "false") return v.t == Value::T::boolean && !v.b;
  if (name == "callable") return v.t == Value::T::func;
  if (name == "equalto" || name == "eq" || name == "==") return equals(v, need());
  if (name == "ne" || name == "!=") return !equals(v, need());
  if (name == "sameas") {
    const Value& y = need();
    if (v.t != y.t) return false;
    if (v.is_array()) return v.a == y.a;
    if (v.is_attr_container()) return v.o == y.o;
    return equals(v, y);
  }
  if (name == "lt" || name == "<" || name == "lessthan") return compare(v, need()) < 0;
  if (name == "le" || name == "<=") return compare(v, need()) <= 0;
  if (name == "gt" || name == ">" || name == "greaterthan") return compare(v, need()) > 0;
  if (name == "ge" || name == ">=") return compare(v, need()) >= 0;
  if (name == "in") {
    const Value& c = need();
    if (c.is_string()) return v.is_string() && c.s.find(v.s) != std::string::npos;
    if (c.is_array()) return std::any_of(c.a->items.begin(), c.a->items.end(), [&](const Value& y) { return equals(v, y); });
    if (c.is_attr_container()) return v.is_string() && c.o->find(v.s);
    return false;
  }
  if (name == "odd" || name == "even" || name == "divisibleby") {
    if (v.t != Value::T::integer) throw Error("test '" + name + "' needs an integer, not a " + v.type_name());
    if (name == "odd") return v.i % 2 != 0;
    if (name == "even") return v.i % 2 == 0;
    const Value& d = need();
    if (d.t != Value::T::integer || d.i == 0) throw Error("divisibleby needs a non-zero integer");
    return d.i == -1 || v.i % d.i == 0;
  }
  if (name == "lower") return v.is_string() && v.s == ascii_case(v.s, false);
  if (name == "upper") return v.is_string() && v.s == ascii_case(v.s, true);
  throw Error("unknown test '" + name + "'");
}

// ---- filters ----

Value Interp::filter(const std::string& name, Value v, Args& a) {
  const std::string what = "filter '" + name + "'";
  auto text = [&]() -> std::string { return v.is_string() ? v.s : to_str(v); };
  if (name == "safe" || name == "e" || name == "escape" || name == "forceescape") return v;  // no autoescape
  if (name == "tojson") {
    JsonFormat f;
    const Value* indent = arg(a, 0, "indent");
    if (indent && !indent->is_none() && !indent->is_undefined()) {
      if (indent->t != Value::T::integer) throw Error(what + ": 'indent' must be an integer");
      f.indent = int(std::clamp<int64_t>(indent->i, 0, 64));
      f.item_sep = ",";
    }
    f.ensure_ascii = bool_arg(a, 99, "ensure_ascii", false);
    f.sort_keys = bool_arg(a, 99, "sort_keys", false);
    if (const Value* sep = a.kwarg("separators"); sep && !sep->is_none()) {
      if (!sep->is_array() || sep->a->items.size() != 2 || !sep->a->items[0].is_string() || !sep->a->items[1].is_string())
        throw Error(what + ": 'separators' must be a pair of strings");
      f.item_sep = sep->a->items[0].s;
      f.key_sep = sep->a->items[1].s;
    }
    std::string s = to_json(v, f);
    charge(s.size());
    return Value::string(std::move(s));
  }
  if (name == "string") return Value::string(text());
  // Text filters on none fail, as the reference's do (Python would write "None").
  static const char* const kText[] = {"trim", "upper", "lower", "title", "capitalize", "replace", "indent", "wordcount"};
  if (v.is_none() && std::any_of(std::begin(kText), std::end(kText), [&](const char* f) { return name == f; }))
    throw Error(what + " needs a string, got none");
  if (name == "trim") {
    if (v.is_undefined()) return Value::string("");
    return Value::string(strip(text(), arg(a, 0, "chars"), true, true));
  }
  if (name == "length" || name == "count") {
    if (v.is_string()) return Value::integer(int64_t(utf8_length(v.s)));
    if (v.is_array()) return Value::integer(int64_t(v.a->items.size()));
    if (v.is_attr_container()) return Value::integer(int64_t(v.o->items.size()));
    if (v.is_undefined()) return Value::integer(0);
    throw Error(what + ": a " + v.type_name() + " has no length");
  }
  if (name == "upper" || name == "lower") return Value::string(ascii_case(text(), name == "upper"));
  if (name == "title") return Value::string(title(text()));
  if (name == "capitalize") {
    const std::string s = text();
    return Value::string(s.empty() ? s : ascii_case(s.substr(0, 1), true) + ascii_case(s.substr(1), false));
  }
  if (name == "replace") {
    return Value::string(replace_all(text(), str_arg(a, 0, "old", what), str_arg(a, 1, "new", what), int_arg(a, 2, "count", -1, what), *this));
  }
  if (name == "default" || name == "d") {
    const Value* def = arg(a, 0, "default_value");
    const bool boolean = bool_arg(a, 1, "boolean", false);
    if (v.is_undefined() || (boolean && !v.truthy())) return def ? *def : Value::string("");
    return v;
  }
  if (name == "items") {
    if (v.is_undefined()) return Value::array({});
    if (!v.is_attr_container()) throw Error(what + ": expected a dict, got a " + v.type_name());
    return pairs(v);
  }
  if (name == "dictsort") {
    if (!v.is_attr_container()) throw Error(what + ": expected a dict, got a " + v.type_name());
    const bool cs = bool_arg(a, 0, "case_sensitive", false);
    const std::string by = str_arg(a, 1, "by", what, "key");
    const bool rev = bool_arg(a, 2, "reverse", false);
    if (by != "key" && by != "value") throw Error(what + ": 'by' must be 'key' or 'value'");
    std::vector<Value> items = pairs(v).a->items;
    const size_t at = by == "key" ? 0 : 1;
    std::stable_sort(items.begin(), items.end(), [&](const Value& x, const Value& y) {
      const int c = compare(x.a->items[at], y.a->items[at], cs);
      return rev ? c > 0 : c < 0;
    });
    return Value::array(std::move(items));
  }
  if (name == "join") {
    const std::string sep = str_arg(a, 0, "d", what, "");
    const Value* attr_name = arg(a, 1, "attribute");
    std::string out;
    bool first = true;
    for (const Value& x : items_of(v, what)) {
      if (!first) out += sep;
      first = false;
      out += to_str(attr_name && attr_name->is_string() ? path(*this, x, attr_name->s) : x);
      charge(out.size());
    }
    return Value::string(std::move(out));
  }
  if (name == "first" || name == "last") {
    if (v.is_string()) {
      const auto cs = utf8_chars(v.s);
      if (cs.empty()) return {};
      return Value::string(std::string(name == "first" ? cs.front() : cs.back()));
    }
    const std::vector<Value> xs = items_of(v, what);
    if (xs.empty()) return {};
    return name == "first" ? xs.front() : xs.back();
  }
  if (name == "list") return Value::array(items_of(v, what));
  if (name == "reverse") {
    if (v.is_string()) {
      auto cs = utf8_chars(v.s);
      std::string out;
      for (size_t k = cs.size(); k-- > 0;) out += cs[k];
      return Value::string(std::move(out));
    }
    std::vector<Value> xs = items_of(v, what);
    std::reverse(xs.begin(), xs.end());
    return Value::array(std::move(xs));
  }
  if (name == "unique") {
    std::vector<Value> out;
    for (const Value& x : items_of(v, what)) {
      step(out.size() / 16 + 1);
      if (std::none_of(out.begin(), out.end(), [&](const Value& y) { return equals(x, y); })) out.push_back(x);
    }
    return Value::array(std::move(out));
  }
  if (name == "sort") {
    const bool rev = bool_arg(a, 0, "reverse", false);
    const bool cs = bool_arg(a, 1, "case_sensitive", false);
    const Value* at = arg(a, 2, "attribute");
    std::vector<Value> xs = items_of(v, what);
    step(xs.size());
    auto key = [&](const Value& x) { return at && at->is_string() ? path(*this, x, at->s) : x; };
    std::stable_sort(xs.begin(), xs.end(), [&](const Value& x, const Value& y) {
      const int c = compare(key(x), key(y), cs);
      return rev ? c > 0 : c < 0;
    });
    return Value::array(std::move(xs));
  }
  if (name == "map") {
    std::vector<Value> out;
    if (const Value* at = a.kwarg("attribute")) {
      if (!at->is_string() && at->t != Value::T::integer) throw Error(what + ": 'attribute' must be a string");
      const std::string p = at->is_string() ? at->s : std::to_string(at->i);
      const Value* def = a.kwarg("default");
      for (const Value& x : items_of(v, what)) {
        step();
        Value y = path(*this, x, p);
        out.push_back(y.is_undefined() && def ? *def : y);
      }
    } else {
      if (a.pos.empty() || !a.pos[0].is_string()) throw Error(what + ": expected attribute= or a filter name");
      const std::string f = a.pos[0].s;
      Args rest;
      rest.pos.assign(a.pos.begin() + 1, a.pos.end());
      rest.kw = a.kw;
      for (const Value& x : items_of(v, what)) {
        step();
        Args copy = rest;
        out.push_back(filter(f, x, copy));
      }
    }
    return Value::array(std::move(out));
  }
  if (name == "select" || name == "reject" || name == "selectattr" || name == "rejectattr") {
    const bool by_attr = name == "selectattr" || name == "rejectattr";
    const bool keep = name == "select" || name == "selectattr";
    size_t k = 0;
    std::string attr_name;
    if (by_attr) {
      attr_name = str_arg(a, 0, "attribute", what);
      k = 1;
    }
    std::string test_name;
    if (k < a.pos.size()) {
      if (!a.pos[k].is_string()) throw Error(what + ": the test name must be a string");
      test_name = a.pos[k].s;
    }
    Args targs;
    if (k + 1 < a.pos.size()) targs.pos.assign(a.pos.begin() + long(k) + 1, a.pos.end());
    std::vector<Value> out;
    for (const Value& x : items_of(v, what)) {
      step();
      const Value subject = by_attr ? path(*this, x, attr_name) : x;
      Args copy = targs;
      const bool pass = test_name.empty() ? subject.truthy() : test(test_name, subject, copy);
      if (pass == keep) out.push_back(x);
    }
    return Value::array(std::move(out));
  }
  if (name == "int") {
    const Value* def = arg(a, 0, "default");
    if (v.t == Value::T::integer) return v;
    if (v.t == Value::T::boolean) return Value::integer(v.b);
    if (v.t == Value::T::floating) {
      if (!std::isfinite(v.d) || std::fabs(v.d) >= 9.2e18) throw Error(what + ": the number is out of range");
      return Value::integer(int64_t(v.d));
    }
    if (v.is_string()) {
      errno = 0;
      char* end = nullptr;
      const std::string s = strip(v.s, nullptr, true, true);
      const long long x = std::strtoll(s.c_str(), &end, 10);
      if (!s.empty() && end && *end == '\0' && errno == 0) return Value::integer(x);
      const double d = std::strtod(s.c_str(), &end);
      if (!s.empty() && end && *end == '\0' && std::isfinite(d) && std::fabs(d) < 9.2e18) return Value::integer(int64_t(d));
    }
    return def ? *def : Value::integer(0);
  }
  if (name == "float") {
    const Value* def = arg(a, 0, "default");
    if (v.is_number() || v.t == Value::T::boolean)
      return Value::floating(v.t == Value::T::integer ? double(v.i) : v.t == Value::T::boolean ? double(v.b) : v.d);
    if (v.is_string()) {
      char* end = nullptr;
      const std::string s = strip(v.s, nullptr, true, true);
      const double d = std::strtod(s.c_str(), &end);
      if (!s.empty() && end && *end == '\0') return Value::floating(d);
    }
    return def ? *def : Value::floating(0);
  }
  if (name == "abs") {
    if (v.t == Value::T::integer) {
      if (v.i == INT64_MIN) throw Error("integer overflow");
      return Value::integer(v.i < 0 ? -v.i : v.i);
    }
    if (v.t == Value::T::floating) return Value::floating(std::fabs(v.d));
    throw Error(what + ": expected a number, got a " + v.type_name());
  }
  if (name == "round") {
    const int64_t prec = std::clamp<int64_t>(int_arg(a, 0, "precision", 0, what), -20, 20);
    const std::string how = str_arg(a, 1, "method", what, "common");
    if (!v.is_number()) throw Error(what + ": expected a number, got a " + v.type_name());
    const double x = v.t == Value::T::integer ? double(v.i) : v.d;
    const double m = std::pow(10.0, double(prec));
    const double r = how == "floor" ? std::floor(x * m) / m : how == "ceil" ? std::ceil(x * m) / m : std::round(x * m) / m;
    return Value::floating(r);
  }
  if (name == "min" || name == "max" || name == "sum") {
    const std::vector<Value> xs = items_of(v, what);
    const Value* at = a.kwarg("attribute");
    auto key = [&](const Value& x) { return at && at->is_string() ? path(*this, x, at->s) : x; };
    if (name == "sum") {
      Value total = a.kwarg("start") ? *a.kwarg("start") : Value::integer(0);
      for (const Value& x : xs) {
        const Value y = key(x);
        if (!y.is_number() || !total.is_number()) throw Error(what + ": expected numbers, got a " + y.type_name());
        int64_t r;
        if (total.t == Value::T::integer && y.t == Value::T::integer && !__builtin_add_overflow(total.i, y.i, &r))
          total = Value::integer(r);
        else
          total = Value::floating((total.t == Value::T::integer ? double(total.i) : total.d) + (y.t == Value::T::integer ? double(y.i) : y.d));
      }
      return total;
    }
    if (xs.empty()) return {};
    const bool cs = bool_arg(a, 0, "case_sensitive", false);
    Value best = xs[0];
    for (const Value& x : xs) {
      const int c = compare(key(x), key(best), cs);
      if (name == "min" ? c < 0 : c > 0) best = x;
    }
    return best;
  }
  if (name == "indent") {
    const Value* w = arg(a, 0, "width");
    std::string pad = "    ";
    if (w && w->t == Value::T::integer) pad.assign(size_t(std::clamp<int64_t>(w->i, 0, 1024)), ' ');
    else if (w && w->is_string()) pad = w->s;
    const bool first = bool_arg(a, 1, "first", false);
    const bool blank = bool_arg(a, 2, "blank", false);
    const std::string s = text();
    std::string out;
    size_t k = 0;
    bool line0 = true;
    while (true) {
      const size_t nl = s.find('\n', k);
      const std::string_view line = std::string_view(s).substr(k, nl == std::string::npos ? std::string::npos : nl - k);
      if ((!line0 || first) && (blank || !line.empty())) out += pad;
      out += line;
      charge(out.size());
      if (nl == std::string::npos) break;
      out += '\n';
      k = nl + 1;
      line0 = false;
    }
    return Value::string(std::move(out));
  }
  if (name == "wordcount") return Value::integer(int64_t(split(text(), nullptr, -1, *this).a->items.size()));
  if (name == "batch" || name == "slice" || name == "groupby")
    throw Error(what + " is not supported");
  throw Error("unknown filter '" + name + "'");
}

// ---- globals ----

void add_globals(std::unordered_map<std::string, Value>& vars) {
  vars["namespace"] = Value::func([](Interp&, Args& a) -> Value {
    std::vector<std::pair<std::string, Value>> items;
    if (!a.pos.empty()) {
      const Value& src = a.pos[0];
      if (src.is_attr_container()) items = src.o->items;
      else if (!src.is_none()) throw Error(std::string("namespace() takes a dict, not a ") + src.type_name());
    }
    for (auto& kv : a.kw) items.push_back(kv);
    return Value::ns(std::move(items));
  });
  vars["dict"] = Value::func([](Interp&, Args& a) -> Value {
    std::vector<std::pair<std::string, Value>> items;
    if (!a.pos.empty() && a.pos[0].is_attr_container()) items = a.pos[0].o->items;
    for (auto& kv : a.kw) items.push_back(kv);
    return Value::object(std::move(items));
  });
  vars["range"] = Value::func([](Interp& in, Args& a) -> Value {
    auto num = [](const Value& v) {
      if (v.t == Value::T::integer) return v.i;
      if (v.t == Value::T::boolean) return int64_t(v.b);
      throw Error(std::string("range() takes integers, not a ") + v.type_name());
    };
    if (a.pos.empty() || a.pos.size() > 3) throw Error("range() takes 1 to 3 integers");
    int64_t start = 0, stop, step = 1;
    if (a.pos.size() == 1) {
      stop = num(a.pos[0]);
    } else {
      start = num(a.pos[0]);
      stop = num(a.pos[1]);
      if (a.pos.size() == 3) step = num(a.pos[2]);
    }
    if (step == 0) throw Error("range() step must not be zero");
    __int128 count = 0;
    if (step > 0 && stop > start) count = ((__int128)stop - start + step - 1) / step;
    if (step < 0 && start > stop) count = ((__int128)start - stop - step - 1) / -(__int128)step;
    in.charge(count > (__int128)(SIZE_MAX / 2) ? SIZE_MAX / 2 : size_t(count));
    std::vector<Value> out;
    for (int64_t k = start, n = 0; n < int64_t(count); k += step, ++n) out.push_back(Value::integer(k));
    return Value::array(std::move(out));
  });
  vars["raise_exception"] = Value::func([](Interp&, Args& a) -> Value {
    throw Raised{a.pos.empty() ? std::string("raise_exception() was called") : to_str(a.pos[0])};
  });
  vars["strftime_now"] = Value::func([](Interp&, Args& a) -> Value {
    if (a.pos.empty() || !a.pos[0].is_string()) throw Error("strftime_now() takes a format string");
    const std::time_t now = std::time(nullptr);
    std::tm tm{};
    localtime_r(&now, &tm);
    char buf[512];
    const size_t n = std::strftime(buf, sizeof buf, a.pos[0].s.substr(0, 200).c_str(), &tm);
    return Value::string(std::string(buf, n));
  });
}

}  // namespace ds4::jinja
