#pragma once
/// Memory readings behind an interface: the real one reads /proc/meminfo and
/// /proc/pressure/memory; tests script their own.

#include <memory>
#include <optional>
#include <string>

#include "supervisor/policy.h"

namespace ds4::sup {

class MemorySource {
 public:
  virtual ~MemorySource() = default;
  /// The current reading. Never throws: what cannot be read is 0.
  virtual Readings read() = 0;
};

/// /proc/meminfo MemAvailable (the host's: shared/meminfo.h says why that
/// figure) and /proc/pressure/memory "some avg10" (0 when the kernel has no
/// PSI). Paths are parameters for tests. The supervisor's own cgroup is not
/// read: the workers run in cgroups of their own, and each checks its plan
/// against its own limit when it starts (a worker allocates nothing later).
class ProcMemorySource : public MemorySource {
 public:
  explicit ProcMemorySource(std::string meminfo = "/proc/meminfo",
                            std::string pressure = "/proc/pressure/memory");
  Readings read() override;

 private:
  std::string meminfo_, pressure_;
};

/// "some avg10=1.23 ..." → 1.23; nullopt when absent. Exposed for tests.
std::optional<double> parse_psi_some_avg10(const std::string& pressure_text);

}  // namespace ds4::sup
