#include "supervisor/journal_watch.h"

#include <systemd/sd-journal.h>

#include <cstring>

#include "shared/error.h"

namespace ds4::sup {

std::optional<std::string> oom_line_cgroup(std::string_view m) {
  if (m.find("oom-kill:") == std::string_view::npos) return std::nullopt;
  const auto pos = m.find("task_memcg=");
  if (pos == std::string_view::npos) return std::nullopt;
  std::string_view path = m.substr(pos + 11);
  return std::string(path.substr(0, path.find(',')));
}

std::optional<std::string> oom_line_unit(std::string_view m) {
  const auto cg = oom_line_cgroup(m);
  if (!cg) return std::nullopt;
  std::string_view path = *cg;
  const auto slash = path.rfind('/');
  std::string_view last = slash == std::string_view::npos ? path : path.substr(slash + 1);
  if (last.empty()) return std::nullopt;
  return std::string(last);
}

JournalFinding classify_journal_entry(const JournalEntry& e) {
  JournalFinding f;
  if (e.transport == "kernel") {
    // Every kernel oom-kill line counts (the backend matches them against
    // the kernel's oom_kill counter); the unit only where the path names one.
    if (e.message.rfind("oom-kill:", 0) == 0) {
      f.kind = JournalFinding::Kind::oom_kill;
      f.cgroup = oom_line_cgroup(e.message).value_or("");
      f.unit = oom_line_unit(e.message).value_or("");
      f.text = e.message;
    }
    return f;
  }
  if (e.message_id == kOomMessageId && !e.user_unit.empty()) {
    f.kind = JournalFinding::Kind::oom_kill;
    f.unit = e.user_unit;
    f.text = e.message;
    return f;
  }
  if (!e.source_unit.empty() && e.priority <= 3) {
    f.kind = JournalFinding::Kind::error_message;
    f.unit = e.source_unit;
    f.text = e.message;
  }
  return f;
}

struct JournalWatcher::Impl {
  sd_journal* j = nullptr;
  std::unique_ptr<asio::posix::stream_descriptor> fd;
  std::unique_ptr<asio::steady_timer> timer;
  Handler handler;
};

namespace {
std::string field(sd_journal* j, const char* name) {
  const void* d = nullptr;
  size_t n = 0;
  if (sd_journal_get_data(j, name, &d, &n) < 0) return "";
  const size_t skip = std::strlen(name) + 1;  // "NAME="
  return n > skip ? std::string(static_cast<const char*>(d) + skip, n - skip) : "";
}
}  // namespace

JournalWatcher::JournalWatcher(asio::io_context& io, Handler handler) : impl_(std::make_unique<Impl>()) {
  impl_->handler = std::move(handler);
  int r = sd_journal_open(&impl_->j, SD_JOURNAL_LOCAL_ONLY);
  if (r < 0) throw Error(std::string("cannot open the journal: ") + std::strerror(-r));
  sd_journal_seek_tail(impl_->j);
  // seek_tail puts us after the last entry: previous() then next() start from new ones.
  sd_journal_previous(impl_->j);
  const int fd = sd_journal_get_fd(impl_->j);
  if (fd < 0) {
    sd_journal_close(impl_->j);
    throw Error(std::string("cannot follow the journal: ") + std::strerror(-fd));
  }
  impl_->fd = std::make_unique<asio::posix::stream_descriptor>(io, fd);
  impl_->timer = std::make_unique<asio::steady_timer>(io);
  drain();
  do_wait();
  do_tick();
}

JournalWatcher::~JournalWatcher() {
  if (impl_->fd) impl_->fd->release();  // sd_journal owns the descriptor
  impl_->fd.reset();
  if (impl_->timer) impl_->timer->cancel();
  if (impl_->j) sd_journal_close(impl_->j);
}

void JournalWatcher::do_wait() {
  impl_->fd->async_wait(asio::posix::stream_descriptor::wait_read, [this](boost::system::error_code ec) {
    if (ec) return;
    sd_journal_process(impl_->j);
    drain();
    do_wait();
  });
}

void JournalWatcher::do_tick() {
  // inotify wakes do_wait(); this is the safety net for file rotation and
  // for entries that raced the wake-up.
  impl_->timer->expires_after(std::chrono::milliseconds(250));
  impl_->timer->async_wait([this](boost::system::error_code ec) {
    if (ec) return;
    sd_journal_process(impl_->j);
    drain();
    do_tick();
  });
}

void JournalWatcher::drain() {
  while (sd_journal_next(impl_->j) > 0) {
    JournalEntry e;
    e.transport = field(impl_->j, "_TRANSPORT");
    e.message = field(impl_->j, "MESSAGE");
    e.message_id = field(impl_->j, "MESSAGE_ID");
    e.user_unit = field(impl_->j, "USER_UNIT");
    e.source_unit = field(impl_->j, "_SYSTEMD_USER_UNIT");
    const std::string p = field(impl_->j, "PRIORITY");
    e.priority = p.empty() ? 6 : std::atoi(p.c_str());
    const JournalFinding f = classify_journal_entry(e);
    if (f.kind != JournalFinding::Kind::none && impl_->handler) impl_->handler(f);
  }
}

}  // namespace ds4::sup
