#include "supervisor/segment_ledger.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>

#include "shared/log.h"

namespace ds4::sup {

namespace {

// A segment name as the store writes them: no slash, no newline, not empty.
bool plausible(const std::string& name) {
  return !name.empty() && name.size() < 256 && name.find_first_of("/\n\r") == std::string::npos;
}

}  // namespace

SegmentLedger::SegmentLedger(std::string path) : path_(std::move(path)) {
  std::ifstream in(path_);
  std::string line;
  while (std::getline(in, line))
    if (plausible(line)) names_.insert(line);
}

void SegmentLedger::add(const std::string& name) {
  if (!plausible(name) || !names_.insert(name).second) return;
  write();
}

void SegmentLedger::remove(const std::string& name) {
  if (names_.erase(name)) write();
}

void SegmentLedger::write() const {
  const std::string tmp = path_ + ".tmp";
  std::string text;
  for (const std::string& n : names_) text += n + "\n";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  bool ok = fd >= 0;
  if (ok) {
    ok = ::write(fd, text.data(), text.size()) == ssize_t(text.size());
    ok = ::close(fd) == 0 && ok;
  }
  if (ok) ok = ::rename(tmp.c_str(), path_.c_str()) == 0;
  if (!ok) {
    const std::string why = std::strerror(errno);
    ::unlink(tmp.c_str());
    log::warn("cannot write the list of this instance's model segments " + path_ + ": " + why +
                  ", ignoring (a later start may leave them in /dev/shm)",
              {{"DS4_PATH", path_}});
  }
}

}  // namespace ds4::sup
