#include "supervisor/systemd_backend.h"

namespace ds4::sup {

std::unique_ptr<UnitBackend> make_systemd_backend(asio::io_context& io, const SystemdBackendOptions& options,
                                                  std::string* why_not) {
  if (why_not) *why_not = "the systemd backend is not built yet";
  return nullptr;
}

}  // namespace ds4::sup
