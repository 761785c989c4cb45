#include "supervisor/memfd_segments.h"

#include <sys/stat.h>
#include <systemd/sd-bus.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

#include "shared/bytes.h"
#include "shared/log.h"
#include "supervisor/keeper.h"
#include "supervisor/policy.h"

namespace ds4::sup {

MemfdSegments::MemfdSegments(bool fd_store) : fd_store_(fd_store) {}

namespace {

// Our unit's FileDescriptorStoreMax=, from the manager that runs us; nullopt
// when it cannot be asked.
std::optional<uint32_t> fd_store_max() {
  if (const char* k = std::getenv(kFdStoreMaxEnv); k && *k) return uint32_t(std::strtoul(k, nullptr, 10));  // the keeper's
  sd_bus* bus = nullptr;
  if (sd_bus_open_user(&bus) < 0) return std::nullopt;
  sd_bus_set_method_call_timeout(bus, 2 * 1000 * 1000);  // µs: a start does not wait on a stuck bus
  std::optional<uint32_t> max;
  sd_bus_error err = SD_BUS_ERROR_NULL;
  sd_bus_message* reply = nullptr;
  const char* path = nullptr;
  if (sd_bus_call_method(bus, "org.freedesktop.systemd1", "/org/freedesktop/systemd1",
                         "org.freedesktop.systemd1.Manager", "GetUnitByPID", &err, &reply, "u",
                         uint32_t(::getpid())) >= 0 &&
      sd_bus_message_read(reply, "o", &path) >= 0) {
    uint32_t v = 0;
    sd_bus_error e2 = SD_BUS_ERROR_NULL;
    sd_bus_message* prop = nullptr;
    if (sd_bus_get_property(bus, "org.freedesktop.systemd1", path, "org.freedesktop.systemd1.Service",
                            "FileDescriptorStoreMax", &e2, &prop, "u") >= 0 &&
        sd_bus_message_read(prop, "u", &v) >= 0) {
      max = v;
    }
    sd_bus_message_unref(prop);
    sd_bus_error_free(&e2);
  }
  sd_bus_message_unref(reply);
  sd_bus_error_free(&err);
  sd_bus_flush_close_unref(bus);
  return max;
}

}  // namespace

bool MemfdSegments::systemd_fd_store_available(std::optional<uint32_t>* max_out) {
  const char* s = std::getenv("NOTIFY_SOCKET");
  if (!s || !*s) return false;
  const std::optional<uint32_t> max = fd_store_max();
  if (max_out) *max_out = max;
  if (max == uint32_t(0)) {
    log::warn("this unit has FileDescriptorStoreMax=0: a model kept in a memfd is loaded again at every restart "
              "of the supervisor (the shipped ds4-supervisor.service sets it; reinstall it), ignoring");
    return false;
  }
  return true;
}

PassedFds MemfdSegments::recover() {
  PassedFds passed;
  char** names = nullptr;
  const int n = sd_listen_fds_with_names(1, &names);
  if (n <= 0) return passed;
  for (int i = 0; i < n; ++i) {
    const int fd = SD_LISTEN_FDS_START + i;
    const std::string name = names && names[i] ? names[i] : "";
    std::free(names ? names[i] : nullptr);
    ::fcntl(fd, F_SETFD, FD_CLOEXEC);
    if (sd_is_socket(fd, AF_UNSPEC, SOCK_STREAM, 1) > 0) {  // the socket unit's listening socket
      passed.listeners.push_back(fd);
      continue;
    }
    if (name.starts_with("ds4-conn-")) {  // a client connection or its journal (the proxy's)
      passed.connections[name].push_back(fd);
      continue;
    }
    auto owned = std::make_shared<store::UniqueFd>(fd);
    const int seals = ::fcntl(fd, F_GET_SEALS);
    const std::optional<store::Identity> id =
        (seals & store::kMemfdSeals) == store::kMemfdSeals ? store::ready_identity(fd) : std::nullopt;
    if (!name.starts_with("ds4-model-") || !id) {
      log::warn("dropped descriptor '" + name + "' from systemd's fd store: it holds no ready, sealed ds4 model segment",
                {{"DS4_EVENT", "fdstore_dropped"}, {"DS4_SEGMENT", name}});
      if (!name.empty()) remove_from_systemd(name);
      continue;
    }
    struct stat st {};
    ::fstat(fd, &st);
    KeptMemfd k{store::memfd_handle(name), std::move(owned), *id, uint64_t(st.st_size)};
    log::info("recovered memfd segment " + name + " (" + format_bytes(k.bytes) + ", " + id->path +
                  ") from systemd's fd store",
              {{"DS4_EVENT", "fdstore_recovered"}, {"DS4_SEGMENT", k.handle}, {"DS4_MODEL", id->path}});
    std::lock_guard lock(mu_);
    kept_[k.handle] = std::move(k);
  }
  std::free(names);
  return passed;
}

void MemfdSegments::add(const std::string& handle, std::shared_ptr<store::UniqueFd> fd) {
  KeptMemfd k;
  k.handle = handle;
  k.fd = std::move(fd);
  struct stat st {};
  ::fstat(k.fd->get(), &st);
  k.bytes = uint64_t(st.st_size);
  if (std::optional<store::Identity> id = store::ready_identity(k.fd->get())) k.identity = *id;
  if (fd_store_) store_in_systemd(std::string(store::handle_name(handle)), k.fd->get());
  std::lock_guard lock(mu_);
  kept_[handle] = std::move(k);
}

std::optional<KeptMemfd> MemfdSegments::find(const store::Identity& id) const {
  std::lock_guard lock(mu_);
  for (const auto& [handle, k] : kept_)
    if (k.identity == id) return k;
  return std::nullopt;
}

std::shared_ptr<store::UniqueFd> MemfdSegments::fd(const std::string& handle) const {
  std::lock_guard lock(mu_);
  const auto it = kept_.find(store::memfd_handle(store::handle_name(handle)));
  return it == kept_.end() ? nullptr : it->second.fd;
}

std::vector<std::string> MemfdSegments::handles() const {
  std::lock_guard lock(mu_);
  std::vector<std::string> out;
  for (const auto& [handle, k] : kept_) out.push_back(handle);
  return out;
}

uint64_t MemfdSegments::release(const std::string& handle) {
  uint64_t bytes = 0;
  {
    std::lock_guard lock(mu_);
    const auto it = kept_.find(handle);
    if (it == kept_.end()) return 0;
    bytes = it->second.bytes;
    kept_.erase(it);  // our descriptor closes with the last reference
  }
  if (fd_store_) remove_from_systemd(std::string(store::handle_name(handle)));
  return bytes;
}

void MemfdSegments::store_in_systemd(const std::string& name, int fd) const {
  const std::string msg = "FDSTORE=1\nFDNAME=" + name;
  const int r = sd_pid_notify_with_fds(0, 0, msg.c_str(), &fd, 1);
  if (r > 0) {
    log::info("memfd segment " + name + " stored in systemd's fd store: a restart of the supervisor reuses it",
              {{"DS4_EVENT", "fdstore_stored"}, {"DS4_SEGMENT", store::memfd_handle(name)}});
  } else {
    log::warn("cannot store memfd segment " + name + " in systemd's fd store (" +
                  (r < 0 ? std::string(std::strerror(-r)) : std::string("no NOTIFY_SOCKET")) +
                  "): a restart of the supervisor will load the model again, ignoring",
              {{"DS4_SEGMENT", store::memfd_handle(name)}});
  }
}

void MemfdSegments::remove_from_systemd(const std::string& name) const {
  sd_notify(0, ("FDSTOREREMOVE=1\nFDNAME=" + name).c_str());
}

}  // namespace ds4::sup
