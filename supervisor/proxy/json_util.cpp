#include "supervisor/proxy/json_util.h"

#include <cmath>

#include "shared/error.h"

namespace ds4::proxy {

namespace {
const json* field(const json& obj, const char* name) {
  auto it = obj.find(name);
  if (it == obj.end() || it->is_null()) return nullptr;
  return &*it;
}
std::string got(const json& v) { return std::string(v.type_name()); }
}  // namespace

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
