// ds4-supervisor: the daemon (supervisor/supervisor.h).
#include <cstdio>
#include <cstring>
#include <string>

#include "shared/error.h"
#include "shared/log.h"
#include "supervisor/supervisor.h"

static const char* kUsage =
    "usage: ds4-supervisor [--config FILE]\n"
    "  Loads the model into shared memory, runs the workers (systemd user units,\n"
    "  or child processes without a user manager) and keeps them at the largest\n"
    "  context that memory allows. Default config: config/ds4.yaml.\n"
    "  SIGHUP re-reads the config; SIGTERM stops the workers and exits.\n";

int main(int argc, char** argv) {
  ds4::log::set_identifier("ds4-supervisor");
  ds4::sup::SupervisorOptions opts;
  opts.config_path = "config/ds4.yaml";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    }
    if ((a == "--config" || a == "-c") && i + 1 < argc) {
      opts.config_path = argv[++i];
    } else if (a.rfind("--config=", 0) == 0) {
      opts.config_path = a.substr(9);
    } else {
      std::fprintf(stderr, "ds4-supervisor: unknown argument '%s'\n%s", a.c_str(), kUsage);
      return 2;
    }
  }
  try {
    ds4::sup::Supervisor sup(opts);
    sup.prepare();
    return sup.run();
  } catch (const ds4::Error& e) {
    ds4::log::error(std::string("ds4-supervisor: ") + e.what());
    return 1;
  } catch (const std::exception& e) {
    ds4::log::error(std::string("ds4-supervisor: unexpected error: ") + e.what());
    return 1;
  }
}
