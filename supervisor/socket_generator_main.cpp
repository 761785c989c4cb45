// ds4-socket-generator: a systemd user generator (systemd.generator(7)) that
// gives ds4-supervisor.socket the address of proxy.listen, so that the port
// is set where every other setting is, in the config the service runs with
// (~/.config/ds4/ds4.yaml, as ds4-supervisor.service's ExecStart= names it).
// The user manager runs it at its start and at every daemon-reload:
//   ds4-socket-generator NORMAL_DIR [EARLY_DIR LATE_DIR]
// and it writes NORMAL_DIR/ds4-supervisor.socket.d/10-proxy-listen.conf:
//   [Socket]
//   ListenStream=
//   ListenStream=127.0.0.1:9000
// Edit proxy.listen, `systemctl --user daemon-reload`, restart the socket and
// the service, and the new port serves. Drop-ins apply in the order of their
// names, whatever their folder: one of the user's own (`systemctl --user
// edit ds4-supervisor.socket` writes override.conf) sorts after this one and
// wins.
//
// It writes nothing when the config is absent (the socket unit's own
// address is proxy.listen's default) or invalid: the problems go to stderr
// (the manager's log) and it exits 0, since a bad config must not fail the
// manager's start; the supervisor refuses the same file with the same
// messages. The file is read with the supervisor's own parser, so the rules
// are the same. It exits 1 only when it cannot write its drop-in.
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <system_error>

#include "shared/config.h"
#include "shared/error.h"

namespace fs = std::filesystem;

namespace {

constexpr const char* kName = "ds4-socket-generator";

int run(const fs::path& normal_dir) {
  const char* home = std::getenv("HOME");
  if (home == nullptr || *home == '\0') {
    std::cerr << kName << ": HOME is not set, so there is no ~/.config/ds4/ds4.yaml to read, ignoring\n";
    return 0;
  }
  const fs::path config = fs::path(home) / ".config/ds4/ds4.yaml";
  std::error_code ec;
  if (!fs::exists(config, ec)) return 0;  // the socket unit's address is the default's

  ds4::Config c;
  try {
    c = ds4::load_config(config);
  } catch (const ds4::Error& e) {
    std::cerr << kName << ": " << config.string() << " is not valid, ds4-supervisor.socket keeps its own address:\n"
              << e.what() << "\n";
    return 0;
  }
  if (c.proxy.listen.port == 0) {
    std::cerr << kName << ": proxy.listen " << c.proxy.listen.str()
              << " asks for any free port, which a socket unit cannot hold for the next start, ignoring\n";
    return 0;
  }

  const fs::path dir = normal_dir / "ds4-supervisor.socket.d";
  const fs::path file = dir / "10-proxy-listen.conf";
  fs::create_directories(dir, ec);
  if (ec) {
    std::cerr << kName << ": Failed to create " << dir.string() << ": " << ec.message() << "\n";
    return 1;
  }
  std::ofstream out(file);
  out << "# Written by " << kName << " from proxy.listen in " << config.string() << ".\n"
      << "[Socket]\nListenStream=\nListenStream=" << c.proxy.listen.str() << "\n";
  out.close();
  if (!out) {
    std::cerr << kName << ": Failed to write " << file.string() << "\n";
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2 && argc != 4) {
    std::cerr << "usage: " << kName << " NORMAL_DIR [EARLY_DIR LATE_DIR] (a systemd user generator)\n";
    return 2;
  }
  try {
    return run(argv[1]);
  } catch (const std::exception& e) {
    std::cerr << kName << ": " << e.what() << ", ignoring\n";
    return 0;
  }
}
