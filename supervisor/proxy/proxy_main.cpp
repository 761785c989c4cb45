// ds4-proxy: the front proxy on its own, over fixed worker sockets (tests,
// and a proxy for workers someone else runs). The product runs the same
// proxy inside ds4-supervisor.
//
//   ds4-proxy --config FILE [--model GGUF] [--listen HOST:PORT] --worker-socket PATH [--worker-socket PATH ...]
//
// Prints "listening on HOST:PORT" once it serves. SIGHUP rereads the key
// file; SIGTERM/SIGINT stop gracefully.
#include <unistd.h>

#include <utility>  // before Asio: Boost 1.74's awaitable.hpp needs std::exchange

#include <boost/asio.hpp>
#include <iostream>
#include <string>
#include <vector>

#include "shared/busy_poll.h"
#include "shared/crash_report.h"
#include "shared/config.h"
#include "shared/error.h"
#include "shared/gguf.h"
#include "shared/log.h"
#include "supervisor/proxy/proxy.h"
#include "supervisor/proxy/static_registry.h"

namespace {

int usage() {
  std::cerr << "usage: ds4-proxy --config FILE [--model GGUF] [--listen HOST:PORT] --worker-socket PATH...\n";
  return 2;
}

int run(int argc, char** argv) {
  std::string config_file, model_path, listen;
  std::vector<std::string> sockets;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw ds4::Error(a + ": expected a value");
      return argv[++i];
    };
    if (a == "--config") config_file = value();
    else if (a == "--model") model_path = value();
    else if (a == "--listen") listen = value();
    else if (a == "--worker-socket") sockets.push_back(value());
    else if (a == "-h" || a == "--help") return usage();
    else throw ds4::Error("unknown argument '" + a + "'");
  }
  if (sockets.empty()) return usage();
  ds4::Config cfg = config_file.empty() ? ds4::Config{} : ds4::load_config(config_file);
  if (!listen.empty()) {
    const auto colon = listen.rfind(':');
    if (colon == std::string::npos) throw ds4::Error("--listen: expected HOST:PORT, got '" + listen + "'");
    cfg.proxy.listen.host = listen.substr(0, colon);
    cfg.proxy.listen.port = uint16_t(std::stoi(listen.substr(colon + 1)));
  }
  if (!model_path.empty()) cfg.model.path = model_path;
  if (cfg.model.path.empty()) throw ds4::Error("no model: give --model or model.path in the config");
  const std::string name = cfg.model.name.empty() ? cfg.model.path.stem().string() : cfg.model.name;
  const ds4::gguf::File meta = ds4::gguf::File::open(cfg.model.path.string());

  boost::asio::io_context io;
  ds4::proxy::StaticRegistry registry(io, sockets);
  ds4::proxy::Proxy proxy(io, cfg.proxy, ds4::proxy::ModelText::from_gguf(meta, name), registry);
  registry.start();
  proxy.start();
  const auto ep = proxy.endpoint();
  std::cout << "listening on " << ep.address().to_string() << ":" << ep.port() << std::endl;
  ds4::log::info("ds4-proxy listening on " + ep.address().to_string() + ":" + std::to_string(ep.port()));

  boost::asio::signal_set stop_signals(io, SIGTERM, SIGINT);
  boost::asio::signal_set hup(io, SIGHUP);
  std::function<void()> wait_hup = [&] {
    hup.async_wait([&](const boost::system::error_code& ec, int) {
      if (ec) return;
      try {
        proxy.reload_keys();
        ds4::log::info("api keys reloaded");
      } catch (const ds4::Error& e) {
        ds4::log::warn(std::string("Failed to reload api keys, keeping the old ones: ") + e.what());
      }
      wait_hup();
    });
  };
  wait_hup();
  stop_signals.async_wait([&](const boost::system::error_code& ec, int) {
    if (ec) return;
    proxy.stop(std::chrono::seconds(10), [&] {
      hup.cancel();
      io.stop();
    });
  });
  ds4::run_busy_polling(io, [&cfg] { return ds4::busy_poll_for(cfg.proxy.busy_poll); });
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  ds4::log::set_identifier("ds4-proxy");
  ds4::install_crash_report("ds4-proxy");
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    ds4::log::error(e.what());
    return 1;
  }
}
