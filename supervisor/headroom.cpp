#include "supervisor/headroom.h"

#include <sstream>

#include "shared/files.h"
#include "shared/meminfo.h"

namespace ds4::sup {

std::optional<double> parse_psi_some_avg10(const std::string& text) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("some ", 0) != 0) continue;
    const auto pos = line.find("avg10=");
    if (pos == std::string::npos) return std::nullopt;
    try {
      return std::stod(line.substr(pos + 6));
    } catch (...) {
      return std::nullopt;
    }
  }
  return std::nullopt;
}

ProcMemorySource::ProcMemorySource(std::string meminfo, std::string pressure)
    : meminfo_(std::move(meminfo)), pressure_(std::move(pressure)) {}

Readings ProcMemorySource::read() {
  Readings r;
  r.available = mem::read_host_available(read_whole_file, meminfo_).value_or(0);
  r.psi_some_avg10 = parse_psi_some_avg10(read_whole_file(pressure_).value_or("")).value_or(0);
  return r;
}

}  // namespace ds4::sup
