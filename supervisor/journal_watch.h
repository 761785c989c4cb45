#pragma once
/// Follows the journal live (sd-journal) for what the systemd backend needs
/// to know about worker units beyond their state:
///   - OOM kills: the kernel's "oom-kill:...,task_memcg=/.../ds4-worker@N.service,..."
///     line (cgroup v1 and v2), and systemd's "killed by the OOM killer" entry
///     (MESSAGE_ID fe6faa94e7774663a0da52717891d8ef, cgroup v2 only);
///   - the last error a unit's process logged (PRIORITY <= 3).
/// Entries from before the watcher started are ignored.

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "supervisor/asio.h"

namespace ds4::sup {

inline constexpr char kOomMessageId[] = "fe6faa94e7774663a0da52717891d8ef";

/// One journal entry's fields the watcher looks at.
struct JournalEntry {
  std::string message;
  std::string transport;  // _TRANSPORT
  std::string message_id;
  std::string user_unit;   // USER_UNIT (the manager's entries about a unit)
  std::string source_unit; // _SYSTEMD_USER_UNIT (entries a unit's processes wrote)
  int priority = 6;
  uint64_t realtime_us = 0;
};

/// What an entry says about which unit.
struct JournalFinding {
  enum class Kind { none, oom_kill, error_message } kind = Kind::none;
  std::string unit;    // the unit named ("" for an oom-kill line of a process in no unit)
  std::string cgroup;  // oom_kill from the kernel: the victim's whole task_memcg path
  std::string text;
};

/// Pure classification (unit-tested): the unit named by a kernel oom-kill
/// line's task_memcg, systemd's OOM entry, or an error a unit logged.
JournalFinding classify_journal_entry(const JournalEntry& e);
/// "…,task_memcg=/a/b/ds4-worker@0.service,task=…" → "ds4-worker@0.service".
std::optional<std::string> oom_line_unit(std::string_view message);
/// The task_memcg path of a kernel oom-kill line ("/a/b/ds4-worker@0.service").
std::optional<std::string> oom_line_cgroup(std::string_view message);

class JournalWatcher {
 public:
  using Handler = std::function<void(const JournalFinding&)>;
  /// Opens the local journal at its end. Throws ds4::Error when it cannot.
  JournalWatcher(asio::io_context& io, Handler handler);
  ~JournalWatcher();

 private:
  void do_wait();
  void do_tick();
  void drain();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ds4::sup
