#pragma once
/// The Responses API's recent answers, for previous_response_id: each
/// response id with its whole conversation (the input it continued and its
/// output, as chat messages). Bounded by count (proxy.responses.store): the
/// oldest goes first. Thread-safe (requests are planned on several threads).

#include <cstddef>
#include <deque>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>

#include "supervisor/proxy/json_util.h"

namespace ds4::proxy {

class ResponseStore {
 public:
  explicit ResponseStore(size_t capacity = 256) : capacity_(capacity) {}
  void set_capacity(size_t n);
  size_t capacity() const;
  size_t size() const;
  /// Keeps `conversation` (a JSON array of messages) under `id`.
  void put(const std::string& id, json conversation);
  std::optional<json> get(const std::string& id) const;

 private:
  void trim();
  mutable std::mutex mu_;
  size_t capacity_;
  std::deque<std::string> order_;
  std::unordered_map<std::string, json> items_;
};

}  // namespace ds4::proxy
