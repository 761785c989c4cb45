#include "supervisor/proxy/api_keys.h"

#include <filesystem>
#include <fstream>

#include "shared/error.h"

namespace ds4::proxy {

namespace {
std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t' || s.front() == '\r')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) s.remove_suffix(1);
  return s;
}
}  // namespace

bool constant_time_equal(std::string_view a, std::string_view b) {
  // Every byte of the longer string is visited whatever the contents.
  const size_t n = std::max(a.size(), b.size());
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff |= static_cast<unsigned char>(x ^ y);
  }
  return diff == 0;
}

void ApiKeys::reload() {
  if (file_.empty()) {
    enabled_ = false;
    keys_.clear();
    return;
  }
  std::error_code ec;
  if (std::filesystem::is_directory(file_, ec))  // it opens, and reads as no keys (the config refuses it too)
    throw Error(file_.string() + ": cannot read the api keys file: it is a folder");
  std::ifstream in(file_);
  if (!in) throw Error(file_.string() + ": cannot read the api keys file");
  std::vector<std::string> keys;
  for (std::string line; std::getline(in, line);) {
    std::string_view k = trim(line);
    if (k.empty() || k.front() == '#') continue;
    keys.emplace_back(k);
  }
  keys_ = std::move(keys);
  enabled_ = true;  // an empty file locks everyone out rather than opening up
}

void ApiKeys::set(std::vector<std::string> keys) {
  keys_ = std::move(keys);
  enabled_ = true;
}

bool ApiKeys::accepts(std::string_view key) const {
  if (!enabled_) return true;
  bool ok = false;
  for (const std::string& k : keys_) ok |= constant_time_equal(k, key);  // no early exit
  return ok && !key.empty();
}

std::string_view ApiKeys::presented(std::string_view authorization, std::string_view x_api_key) {
  authorization = trim(authorization);
  if (authorization.size() > 7) {
    std::string scheme(authorization.substr(0, 7));
    for (char& c : scheme) c = char(std::tolower(static_cast<unsigned char>(c)));
    if (scheme == "bearer ") return trim(authorization.substr(7));
  }
  return trim(x_api_key);
}

}  // namespace ds4::proxy
