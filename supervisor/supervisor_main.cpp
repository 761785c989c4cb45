// ds4-supervisor: the daemon (supervisor/supervisor.h).
#include <sys/stat.h>
#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "shared/error.h"
#include "shared/log.h"
#include "shared/model_store.h"
#include "shared/crash_report.h"
#include "supervisor/keeper.h"
#include "supervisor/proxy/proxy.h"
#include "supervisor/status_history.h"
#include "supervisor/supervisor.h"

static const char* kUsage =
    "usage: ds4-supervisor [--config FILE]\n"
    "  Loads the model into shared memory, runs the workers (systemd user units,\n"
    "  or child processes without a user manager) and keeps them at the largest\n"
    "  context that memory allows. Default config: config/ds4.yaml (without it:\n"
    "  the embedded defaults); a --config FILE must exist.\n"
    "  SIGHUP re-reads the config. SIGTERM (or SIGINT) answers the requests in\n"
    "  flight (at most restart.drain_deadline; a second signal: at once), then\n"
    "  stops the workers and exits; during the model load it stops the load and\n"
    "  removes what it wrote.\n"
    "  Started by hand (not by systemd), it runs under a small parent of its own\n"
    "  (the keeper) that holds the port and the requests in flight and starts it\n"
    "  again if it is killed, as the systemd units do; --no-keeper: without it.\n";

// The descriptors the fd store kept under each ds4-conn-N: its socket and its journal.
static std::vector<ds4::proxy::StoredConnection> stored_connections(std::map<std::string, std::vector<int>> named) {
  std::vector<ds4::proxy::StoredConnection> out;
  for (auto& [name, fds] : named) {
    ds4::proxy::StoredConnection c;
    c.name = name;
    for (int fd : fds) {
      struct stat st {};
      int& slot = ::fstat(fd, &st) == 0 && S_ISSOCK(st.st_mode) ? c.socket : c.journal;
      if (slot >= 0) ::close(slot);  // a second one of a kind: not ours
      slot = fd;
    }
    out.push_back(std::move(c));
  }
  return out;
}

int main(int argc, char** argv) {
  ds4::log::set_identifier("ds4-supervisor");
  ds4::sup::SupervisorOptions opts;
  opts.config_path = "config/ds4.yaml";
  bool keeper = true;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    }
    if ((a == "--config" || a == "-c") && i + 1 < argc) {
      opts.config_path = argv[++i];
      opts.config_given = true;
    } else if (a.rfind("--config=", 0) == 0) {
      opts.config_path = a.substr(9);
      opts.config_given = true;
    } else if (a == "--no-keeper") {
      keeper = false;
    } else {
      std::fprintf(stderr, "ds4-supervisor: unknown argument '%s'\n%s", a.c_str(), kUsage);
      return 2;
    }
  }
  try {
    // Started by hand (no service manager): a small parent keeps the port,
    // the fd store and the restarts that systemd's units give (keeper.h).
    const char* notify = std::getenv("NOTIFY_SOCKET");
    if (keeper && !(notify && *notify) && !ds4::sup::under_keeper()) {
      const int rc = ds4::sup::run_keeper(std::vector<std::string>(argv, argv + argc), opts.config_path,
                                          opts.config_given);
      if (rc >= 0) return rc;
    }
    // A fault says where it happened before the keeper (or systemd) restarts us.
    ds4::install_crash_report("ds4-supervisor");
    ds4::sup::Supervisor sup(opts);
    sup.prepare();
    // The front proxy (supervisor/proxy/proxy.h) on the supervisor's io_context;
    // its tokenizer and chat template come from the model's metadata.
    std::optional<ds4::proxy::ModelText> text;
    ds4::sup::with_metadata(sup.model(), [&](const ds4::gguf::File& meta) {
      text.emplace(ds4::proxy::ModelText::from_gguf(meta, sup.model().name));
    });
    if (!text->template_error().empty())
      ds4::log::warn("the model's chat template does not parse (" + text->template_error() +
                     "); chat prompts use the " + ds4::family_name(text->family()) + " format instead");
    else if (text->jinja_template())
      ds4::log::info("chat prompts are rendered with the model's own template (tokenizer.chat_template)");
    ds4::proxy::Proxy proxy(sup.io(), sup.config().proxy, std::move(*text), sup.registry());
    proxy.set_exec_engines(sup.config().workers.engine == ds4::WorkerEngine::exec);
    proxy.keep_connections(sup.connection_slots());
    proxy.start(sup.inherited_listen_fd());
    proxy.adopt_connections(stored_connections(sup.take_stored_connections()));
    const auto ep = proxy.endpoint();
    const std::string host = ep.address().is_v6() ? "[" + ep.address().to_string() + "]" : ep.address().to_string();
    ds4::log::info("proxy listening on " + host + ":" + std::to_string(ep.port()) +
                   " (OpenAI and Anthropic APIs at http://" + host + ":" + std::to_string(ep.port()) +
                   "/v1, the status page at http://" + host + ":" + std::to_string(ep.port()) + "/status)");
    sup.set_proxy_stats(&proxy);
    // /metrics also shows the supervisor's headroom readings (ds4ctl status's),
    // each worker's uptime and the model's size (the status page's figures).
    proxy.set_metrics_extra([&sup] { return ds4::sup::status_metrics(sup.status_json(false)); });
    // GET /status.json: what ds4ctl status shows, with the page's history.
    proxy.set_status_source([&sup] {
      return sup.status_json().dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    });
    sup.on_reload([&](const ds4::Config&, const ds4::Config& after, const ds4::ConfigChanges& changes) {
      if (changes.listen)
        ds4::log::warn("proxy.listen changed: it applies at the next start (under systemd: `systemctl --user "
                       "daemon-reload`, `systemctl --user stop ds4-supervisor.socket`, `systemctl --user restart "
                       "ds4-supervisor`), ignoring");
      proxy.set_exec_engines(after.workers.engine == ds4::WorkerEngine::exec);
      try {
        proxy.apply(after.proxy);
      } catch (const ds4::Error& e) {
        ds4::log::error(std::string("Failed to apply the proxy settings, keeping the old api keys: ") + e.what());
      }
    });
    // SIGHUP also rereads the key file when the config itself did not change.
    boost::asio::signal_set hup(sup.io(), SIGHUP);
    std::function<void()> wait_hup = [&] {
      hup.async_wait([&](const boost::system::error_code& ec, int) {
        if (ec) return;
        try {
          proxy.reload_keys();
        } catch (const ds4::Error& e) {
          ds4::log::warn(std::string("Failed to reload the api keys, keeping the old ones: ") + e.what());
        }
        wait_hup();
      });
    };
    wait_hup();
    // SIGTERM: no new connections or requests; those in flight (queued ones
    // too) are answered, within the deadline; then the workers stop.
    sup.on_stop([&](ds4::Duration deadline, std::function<void()> done) {
      hup.cancel();
      proxy.stop(deadline, std::move(done));
    });
    return sup.run();
  } catch (const ds4::store::LoadCancelled& e) {
    // SIGTERM or SIGINT before the model was loaded: a stop, not a failure.
    ds4::log::info(std::string("stopped during the model load: ") + e.what() + "; nothing of it is kept");
    return 0;
  } catch (const ds4::Error& e) {
    ds4::log::error(e.what());
    return 1;
  } catch (const std::exception& e) {
    ds4::log::error(std::string("unexpected error: ") + e.what());
    return 1;
  }
}
