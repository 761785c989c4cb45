#include "supervisor/proxy/conn_store.h"

#include <systemd/sd-daemon.h>

#include <charconv>

namespace ds4::proxy {

namespace {
constexpr std::string_view kConnPrefix = "ds4-conn-";
}  // namespace

std::string ConnStore::add(int socket, int journal) {
  if (stored_ >= capacity_) return {};
  const std::string name = std::string(kConnPrefix) + std::to_string(next_++);
  const std::string msg = "FDSTORE=1\nFDNAME=" + name;
  const int fds[2] = {socket, journal};
  if (sd_pid_notify_with_fds(0, 0, msg.c_str(), fds, 2) <= 0) return {};
  ++stored_;
  return name;
}

void ConnStore::remove(const std::string& name) {
  if (name.empty()) return;
  sd_notify(0, ("FDSTOREREMOVE=1\nFDNAME=" + name).c_str());
  if (stored_ > 0) --stored_;
}

std::optional<uint64_t> stored_connection_number(std::string_view name) {
  if (!name.starts_with(kConnPrefix)) return std::nullopt;
  name.remove_prefix(kConnPrefix.size());
  uint64_t n = 0;
  const auto [p, ec] = std::from_chars(name.data(), name.data() + name.size(), n);
  if (ec != std::errc() || p != name.data() + name.size() || name.empty()) return std::nullopt;
  return n;
}

}  // namespace ds4::proxy
