#include "supervisor/proxy/response_store.h"

namespace ds4::proxy {

void ResponseStore::set_capacity(size_t n) {
  std::lock_guard lock(mu_);
  capacity_ = n;
  trim();
}

size_t ResponseStore::capacity() const {
  std::lock_guard lock(mu_);
  return capacity_;
}

size_t ResponseStore::size() const {
  std::lock_guard lock(mu_);
  return items_.size();
}

void ResponseStore::put(const std::string& id, json conversation) {
  std::lock_guard lock(mu_);
  if (capacity_ == 0) return;
  auto [it, fresh] = items_.insert_or_assign(id, std::move(conversation));
  if (fresh) order_.push_back(id);
  trim();
}

std::optional<json> ResponseStore::get(const std::string& id) const {
  std::lock_guard lock(mu_);
  auto it = items_.find(id);
  if (it == items_.end()) return std::nullopt;
  return it->second;
}

void ResponseStore::trim() {
  while (items_.size() > capacity_ && !order_.empty()) {
    items_.erase(order_.front());
    order_.pop_front();
  }
}

}  // namespace ds4::proxy
