#include "shared/log.h"

#include <sys/stat.h>
#include <sys/uio.h>
// The location sd_journal_sendv would add is this file; callers' is sent instead.
#define SD_JOURNAL_SUPPRESS_LOCATION
#include <systemd/sd-journal.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <vector>

namespace ds4::log {
namespace {

std::mutex g_mutex;  // guards g_identifier and whole-line writes to stderr
std::string g_identifier = "ds4";
std::atomic<int> g_level{static_cast<int>(Level::debug)};
std::shared_ptr<const Observer> g_observer;  // guarded by g_mutex; called outside it

/// Where stderr leads, decided once: systemd tells a service that its stderr
/// is a journal stream through JOURNAL_STREAM=<dev>:<ino>.
enum class Stderr { terminal, journal, other };

Stderr classify_stderr() {
  if (isatty(STDERR_FILENO)) return Stderr::terminal;
  const char* js = std::getenv("JOURNAL_STREAM");
  struct stat st {};
  if (js && fstat(STDERR_FILENO, &st) == 0) {
    unsigned long long dev = 0, ino = 0;
    if (std::sscanf(js, "%llu:%llu", &dev, &ino) == 2 && dev == st.st_dev && ino == st.st_ino)
      return Stderr::journal;
  }
  return Stderr::other;
}

Stderr stderr_kind() {
  static const Stderr kind = classify_stderr();
  return kind;
}

std::string_view level_word(Level level) {
  switch (level) {
    case Level::error: return "error: ";
    case Level::warn: return "warning: ";
    case Level::info: return "";
    case Level::debug: return "debug: ";
  }
  return "";
}

/// Sends one entry; returns false when the journal did not take it.
bool send_to_journal(const std::string& identifier, Level level, std::string_view message,
                     std::span<const Field> fields, const Where& where) {
  // sd_journal_sendv() reports success when the socket does not exist
  // (journal-send.c ignores ENOENT), so look first.
  if (access("/run/systemd/journal/socket", F_OK) != 0) return false;
  std::vector<std::string> items;
  items.reserve(fields.size() + 6);
  items.push_back("MESSAGE=" + std::string(message));
  items.push_back("PRIORITY=" + std::to_string(static_cast<int>(level)));
  items.push_back("SYSLOG_IDENTIFIER=" + identifier);
  items.push_back(std::string("CODE_FILE=") + where.file_name());
  items.push_back("CODE_LINE=" + std::to_string(where.line()));
  items.push_back(std::string("CODE_FUNC=") + where.function_name());
  for (const auto& [name, value] : fields) {
    std::string item = field_name(name);
    if (item.empty()) continue;
    item += '=';
    item += value;
    items.push_back(std::move(item));
  }
  std::vector<iovec> iov(items.size());
  for (size_t i = 0; i < items.size(); ++i) iov[i] = {items[i].data(), items[i].size()};
  return sd_journal_sendv(iov.data(), static_cast<int>(iov.size())) >= 0;
}

}  // namespace

std::string field_name(std::string_view name) {
  std::string out;
  for (char c : name) {
    if (c >= 'a' && c <= 'z') c = static_cast<char>(c - 'a' + 'A');
    const bool ok = (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
    out += ok ? c : '_';
  }
  // Names starting with '_' are trusted fields only journald may set; a
  // leading digit is not allowed either.
  while (!out.empty() && (out[0] == '_' || (out[0] >= '0' && out[0] <= '9'))) out.erase(0, 1);
  if (out.size() > 64) out.resize(64);
  return out;
}

std::string format_line(std::string_view identifier, Level level, std::string_view message,
                        std::span<const Field> fields) {
  std::string line;
  line.append(identifier).append(": ").append(level_word(level)).append(message);
  if (!fields.empty()) {
    line += " (";
    for (size_t i = 0; i < fields.size(); ++i) {
      if (i) line += ", ";
      line.append(fields[i].first).append("=").append(fields[i].second);
    }
    line += ')';
  }
  line += '\n';
  return line;
}

void write(Level level, std::string_view message, std::span<const Field> fields, Where where) {
  if (static_cast<int>(level) > g_level.load(std::memory_order_relaxed)) return;
  std::string identifier;
  std::shared_ptr<const Observer> observer;
  {
    std::lock_guard lock(g_mutex);
    identifier = g_identifier;
    observer = g_observer;
  }
  if (observer) (*observer)(level, message, fields);
  const bool journaled = send_to_journal(identifier, level, message, fields, where);
  // A stderr that is a journal stream is the fallback when the native
  // socket failed, and otherwise stays quiet: the entry is already there.
  // Any other stderr (a terminal, a pipe to the supervisor or a test) gets
  // the line too: whoever started the process reads it there.
  const Stderr kind = stderr_kind();
  const bool to_stderr = !journaled || kind != Stderr::journal;
  if (!to_stderr) return;
  const std::string line = format_line(identifier, level, message, fields);
  std::lock_guard lock(g_mutex);
  std::fwrite(line.data(), 1, line.size(), stderr);
  std::fflush(stderr);
}

void error(std::string_view message, Fields fields, Where where) {
  write(Level::error, message, {fields.begin(), fields.size()}, where);
}
void warn(std::string_view message, Fields fields, Where where) {
  write(Level::warn, message, {fields.begin(), fields.size()}, where);
}
void info(std::string_view message, Fields fields, Where where) {
  write(Level::info, message, {fields.begin(), fields.size()}, where);
}
void debug(std::string_view message, Fields fields, Where where) {
  write(Level::debug, message, {fields.begin(), fields.size()}, where);
}

void set_identifier(std::string_view identifier) {
  std::lock_guard lock(g_mutex);
  g_identifier = std::string(identifier);
}

void set_observer(Observer observer) {
  std::lock_guard lock(g_mutex);
  g_observer = observer ? std::make_shared<const Observer>(std::move(observer)) : nullptr;
}

void set_level(Level level) { g_level.store(static_cast<int>(level), std::memory_order_relaxed); }

}  // namespace ds4::log
