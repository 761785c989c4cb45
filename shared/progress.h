#pragma once
/// Progress reporting for long loads, split so the formatting and the rate
/// limit are testable without a terminal or systemd.

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include "shared/model_store.h"

namespace ds4::store {

/// `what: 45% 812 MB/s` (MB = 10^6 bytes; the rate is left out while `seconds` is ~0).
std::string format_progress(std::string_view what, uint64_t done, uint64_t total, double seconds);

/// Where a reporter's lines go. Empty functions are skipped.
struct ProgressSinks {
  std::function<void(const std::string& line, bool final)> terminal;  // one updating line
  std::function<void(const std::string& status)> notify;              // sd_notify STATUS=
  std::function<double()> clock;                                      // monotonic seconds
  double min_interval_s = 0.2;                                        // rate limit (~5/s)
};

/// Reports at most once per `min_interval_s`, and always once when done == total.
ProgressFn make_progress_reporter(std::string what, ProgressSinks sinks);

/// Sinks for this process: stderr when it is a terminal, sd_notify when $NOTIFY_SOCKET is set.
ProgressSinks default_progress_sinks();

}  // namespace ds4::store
