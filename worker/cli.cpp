#include "worker/cli.h"

#include "shared/error.h"

namespace ds4 {

Args::Args(const std::vector<std::string>& argv, std::set<std::string> with_value, std::set<std::string> flags,
           std::map<std::string, std::string> aliases) {
  for (size_t i = 0; i < argv.size(); ++i) {
    std::string a = argv[i];
    if (auto it = aliases.find(a); it != aliases.end()) a = "--" + it->second;
    else if (const auto eq = a.find('='); eq != std::string::npos)  // --ctx=N as --ctx N
      if (auto it2 = aliases.find(a.substr(0, eq)); it2 != aliases.end()) a = "--" + it2->second + a.substr(eq);
    if (a.rfind("--", 0) != 0) throw Error("unexpected argument '" + argv[i] + "'");
    std::string name = a.substr(2), value;
    bool inline_value = false;
    if (auto eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      inline_value = true;
    }
    if (flags.count(name)) {
      flags_.insert(name);
      continue;
    }
    if (!with_value.count(name)) throw Error("unknown option '" + argv[i] + "'");
    if (!inline_value) {
      if (i + 1 >= argv.size()) throw Error("option '--" + name + "' needs a value");
      value = argv[++i];
    }
    values_[name] = value;
  }
}

bool Args::has(const std::string& name) const { return values_.count(name) || flags_.count(name); }

std::string Args::str(const std::string& name, const std::string& def) const {
  auto it = values_.find(name);
  return it == values_.end() ? def : it->second;
}

std::string Args::required(const std::string& name) const {
  auto it = values_.find(name);
  if (it == values_.end()) throw Error("missing option '--" + name + "'");
  return it->second;
}

int64_t Args::integer(const std::string& name, int64_t def, int64_t lo, int64_t hi) const {
  auto it = values_.find(name);
  if (it == values_.end()) return def;
  size_t used = 0;
  int64_t v = 0;
  try {
    v = std::stoll(it->second, &used);
  } catch (...) {
    used = 0;
  }
  if (used != it->second.size() || it->second.empty())
    throw Error("option '--" + name + "' expects an integer, got '" + it->second + "'");
  if (v < lo || v > hi)
    throw Error("option '--" + name + "' = " + it->second + " is out of range [" + std::to_string(lo) + ", " +
                std::to_string(hi) + "]");
  return v;
}

double Args::real(const std::string& name, double def, double lo, double hi) const {
  auto it = values_.find(name);
  if (it == values_.end()) return def;
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(it->second, &used);
  } catch (...) {
    used = 0;
  }
  if (used != it->second.size() || it->second.empty())
    throw Error("option '--" + name + "' expects a number, got '" + it->second + "'");
  if (!(v >= lo && v <= hi))
    throw Error("option '--" + name + "' = " + it->second + " is out of range");
  return v;
}

}  // namespace ds4
