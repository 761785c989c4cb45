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

std::string ApiKeys::presented(std::string_view authorization, std::string_view x_api_key) {
  authorization = trim(authorization);
  auto scheme_is = [&](std::string_view want) {  // case-insensitive, with its blank
    if (authorization.size() <= want.size()) return false;
    for (size_t i = 0; i < want.size(); ++i)
      if (std::tolower(static_cast<unsigned char>(authorization[i])) != want[i]) return false;
    return true;
  };
  if (scheme_is("bearer ")) return std::string(trim(authorization.substr(7)));
  if (scheme_is("basic ")) {
    const std::string pair = base64_decode(trim(authorization.substr(6)));
    const size_t colon = pair.find(':');
    if (colon == std::string::npos) return pair;
    return colon + 1 < pair.size() ? pair.substr(colon + 1) : pair.substr(0, colon);
  }
  return std::string(trim(x_api_key));
}

std::string base64_decode(std::string_view in) {
  auto value = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+' || c == '-') return 62;
    if (c == '/' || c == '_') return 63;
    return -1;
  };
  std::string out;
  uint32_t bits = 0;
  int n = 0;
  for (char c : in) {
    if (c == '=') break;
    const int v = value(c);
    if (v < 0) return {};  // not base64: no key
    bits = (bits << 6) | uint32_t(v);
    n += 6;
    if (n >= 8) {
      n -= 8;
      out += char((bits >> n) & 0xff);
    }
  }
  return out;
}

}  // namespace ds4::proxy
