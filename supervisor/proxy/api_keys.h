#pragma once
/// API keys from proxy.api_keys_file: one key per line; blank lines and lines
/// starting with '#' are skipped, surrounding blanks trimmed. Checked in
/// constant time (for a given number of keys) against `Authorization: Bearer
/// KEY`, `x-api-key: KEY` or, for browsers (the status page), `Authorization:
/// Basic` with the key as the password (or as the user name when the password
/// is empty). Reloaded on demand (SIGHUP).

#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace ds4::proxy {

class ApiKeys {
 public:
  ApiKeys() = default;
  /// No file: authentication off.
  explicit ApiKeys(std::filesystem::path file) : file_(std::move(file)) {}

  /// Reads the file. Throws ds4::Error naming it when it cannot be read; the
  /// keys loaded before stay in force then.
  void reload();
  /// For tests: keys given directly (authentication on).
  void set(std::vector<std::string> keys);

  bool enabled() const { return enabled_; }
  size_t size() const { return keys_.size(); }
  /// True when auth is off or `key` equals one of the keys.
  bool accepts(std::string_view key) const;
  /// The key a request presents, from its Authorization or x-api-key header
  /// values (either may be empty).
  static std::string presented(std::string_view authorization, std::string_view x_api_key);

 private:
  std::filesystem::path file_;
  std::vector<std::string> keys_;
  bool enabled_ = false;
};

/// Standard or URL-safe base64 ('=' padding optional); empty when `in` is not base64.
std::string base64_decode(std::string_view in);

/// Equal strings, in time that depends only on the lengths.
bool constant_time_equal(std::string_view a, std::string_view b);

}  // namespace ds4::proxy
