#pragma once
/// Structured logging to the systemd journal.
///
///   ds4::log::info("worker 0 OOM-killed", {{"DS4_EVENT", "oom"}, {"DS4_WORKER", "0"}});
///
/// Each call is one journal entry with MESSAGE, PRIORITY, SYSLOG_IDENTIFIER
/// and the given fields. A plain line also goes to stderr (a terminal, or the
/// pipe of whoever started the process), except when stderr is itself a
/// journal stream ($JOURNAL_STREAM names it) that the entry already reached,
/// so that nothing is logged twice under systemd. All functions are thread-safe.

#include <functional>
#include <initializer_list>
#include <memory>
#include <source_location>
#include <span>
#include <string>
#include <string_view>
#include <utility>

namespace ds4::log {

/// syslog priorities, as the journal's PRIORITY= field has them.
enum class Level { error = 3, warn = 4, info = 6, debug = 7 };

/// One extra journal field. The name is upper-cased; characters the journal
/// does not allow in names become '_'. Values may hold any bytes.
using Field = std::pair<std::string_view, std::string_view>;
using Fields = std::initializer_list<Field>;

/// CODE_FILE, CODE_LINE and CODE_FUNC name the caller.
using Where = std::source_location;

void error(std::string_view message, Fields fields = {}, Where where = Where::current());
void warn(std::string_view message, Fields fields = {}, Where where = Where::current());
void info(std::string_view message, Fields fields = {}, Where where = Where::current());
void debug(std::string_view message, Fields fields = {}, Where where = Where::current());

/// The general form of the four above.
void write(Level level, std::string_view message, std::span<const Field> fields,
           Where where = Where::current());

/// SYSLOG_IDENTIFIER= of later entries and the prefix of stderr lines;
/// "ds4" until set (programs set their own name first thing in main).
void set_identifier(std::string_view identifier);

/// Entries less severe than `level` are dropped; the default is debug (the
/// journal keeps everything; `journalctl -p info` filters).
void set_level(Level level);

/// Sees every entry written (after the level filter), on the thread that
/// wrote it; it must not log itself. The supervisor keeps its DS4_EVENT
/// entries for the status page. An empty function removes it.
using Observer = std::function<void(Level level, std::string_view message, std::span<const Field> fields)>;
void set_observer(Observer observer);

/// The stderr line for an entry: "ident: warning: message (KEY=value, ...)".
/// Exposed for tests.
std::string format_line(std::string_view identifier, Level level, std::string_view message,
                        std::span<const Field> fields);

/// A valid journal field name made from `name` (see Field).
std::string field_name(std::string_view name);

}  // namespace ds4::log
