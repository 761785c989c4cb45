#include "shared/progress.h"

#include <systemd/sd-daemon.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>

namespace ds4::store {

std::string format_progress(std::string_view what, uint64_t done, uint64_t total, double seconds) {
  const unsigned pct = total == 0 ? 100 : unsigned(done >= total ? 100 : done * 100.0 / double(total));
  std::string line = std::string(what) + ": " + std::to_string(pct) + "%";
  if (seconds > 1e-3) {
    const double mb_s = double(done) / 1e6 / seconds;
    char buf[32];
    std::snprintf(buf, sizeof buf, " %.0f MB/s", mb_s);
    line += buf;
  }
  return line;
}

ProgressFn make_progress_reporter(std::string what, ProgressSinks sinks) {
  struct State {
    std::string what;
    ProgressSinks sinks;
    double start = 0;
    double last = -1;
    bool finished = false;
  };
  auto st = std::make_shared<State>();
  st->what = std::move(what);
  st->sinks = std::move(sinks);
  if (!st->sinks.clock) {
    st->sinks.clock = [] {
      return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
    };
  }
  st->start = st->sinks.clock();
  return [st](uint64_t done, uint64_t total) {
    const bool final = done >= total;
    if (st->finished) return;
    const double now = st->sinks.clock();
    if (!final && st->last >= 0 && now - st->last < st->sinks.min_interval_s) return;
    st->last = now;
    st->finished = final;
    const std::string line = format_progress(st->what, done, total, now - st->start);
    if (st->sinks.terminal) st->sinks.terminal(line, final);
    if (st->sinks.notify) st->sinks.notify(line);
  };
}

ProgressSinks default_progress_sinks() {
  ProgressSinks s;
  if (::isatty(STDERR_FILENO)) {
    // \r and erase-to-end keep one line updating in place; the last one ends it.
    s.terminal = [](const std::string& line, bool final) {
      std::fprintf(stderr, "\r%s\033[K%s", line.c_str(), final ? "\n" : "");
      std::fflush(stderr);
    };
  }
  if (const char* sock = std::getenv("NOTIFY_SOCKET"); sock && *sock) {
    s.notify = [](const std::string& status) { sd_notify(0, ("STATUS=" + status).c_str()); };
  }
  return s;
}

ProgressFn make_progress_reporter(std::string what) {
  return make_progress_reporter(std::move(what), default_progress_sinks());
}

}  // namespace ds4::store
