#include "supervisor/proxy/conn_journal.h"

#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace ds4::proxy {

namespace {

constexpr uint32_t kMagic = 0x4a345344;  // "DS4J"
constexpr size_t kHeader = 24;           // magic, type, 3 spare, generation, length, check
constexpr uint8_t kBase = 1, kInput = 2, kStep = 3;

template <class T>
void put(std::string& s, T v) {
  s.append(reinterpret_cast<const char*>(&v), sizeof v);
}
template <class T>
T get(std::string_view s, size_t at) {
  T v;
  std::memcpy(&v, s.data() + at, sizeof v);
  return v;
}

uint64_t check(uint8_t type, uint32_t generation, std::string_view a, std::string_view b) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&h](std::string_view s) {
    for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  };
  const char head[5] = {char(type), char(generation), char(generation >> 8), char(generation >> 16), char(generation >> 24)};
  mix({head, sizeof head});
  mix(a);
  mix(b);
  return h;
}

bool pread_all(int fd, char* p, size_t n, uint64_t at) {
  while (n > 0) {
    const ssize_t r = ::pread(fd, p, n, off_t(at));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    p += r;
    n -= size_t(r);
    at += uint64_t(r);
  }
  return true;
}

}  // namespace

std::string JournalState::output() const {
  std::string out;
  for (const JournalStep& s : steps) out += s.output;
  return out;
}

std::unique_ptr<ConnJournal> ConnJournal::create(const std::string& name) {
  const int fd = ::memfd_create(name.c_str(), MFD_CLOEXEC);
  if (fd < 0) return nullptr;
  return std::unique_ptr<ConnJournal>(new ConnJournal(fd));
}

ConnJournal::ConnJournal(int fd, const JournalState& state)
    : fd_(fd), generation_(state.generation), end_(state.journal_bytes) {
  // What lies past the records read (a torn record) goes: the next records
  // would cover only its start, and its rest could then read as records.
  struct stat st {};
  high_ = ::fstat(fd, &st) == 0 ? uint64_t(st.st_size) : end_;
  if (high_ > end_) cut();
}

ConnJournal::~ConnJournal() {
  if (fd_ >= 0) ::close(fd_);
}

void ConnJournal::append(uint8_t type, std::string_view a, std::string_view b) {
  if (!ok_) return;
  const uint64_t length = a.size() + b.size();
  if (length > UINT32_MAX) {
    ok_ = false;
    return;
  }
  std::string rec;
  rec.reserve(kHeader + length);
  put(rec, kMagic);
  put(rec, type);
  rec.append(3, '\0');
  put(rec, generation_);
  put(rec, uint32_t(length));
  put(rec, check(type, generation_, a, b));
  rec.append(a);
  rec.append(b);
  // One write per record: a kill cannot leave half of it behind the check.
  size_t done = 0;
  while (done < rec.size()) {
    const ssize_t r = ::pwrite(fd_, rec.data() + done, rec.size() - done, off_t(end_ + done));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      ok_ = false;  // ENOSPC (the memory cgroup): from here on, unprotected
      return;
    }
    done += size_t(r);
  }
  end_ += rec.size();
  high_ = std::max(high_, end_);
}

void ConnJournal::base(uint64_t read, uint64_t written, std::string_view leftover) {
  if (!ok_) return;
  ++generation_;
  end_ = 0;
  std::string head;
  put(head, read);
  put(head, written);
  append(kBase, head, leftover);
  // The last exchange's records go, rather than stay behind the end: a
  // client's own bytes in them must never read as records of a later one.
  if (ok_ && high_ > end_) cut();
}

void ConnJournal::cut() {
  if (::ftruncate(fd_, off_t(end_)) == 0)
    high_ = end_;
  else
    ok_ = false;  // stale records could follow ours: from here on, unprotected
}

void ConnJournal::input(std::string_view bytes) {
  if (!bytes.empty()) append(kInput, bytes);
}

void ConnJournal::step(const JournalStep& s) {
  std::string head;
  put(head, uint8_t(s.kind));
  put(head, uint8_t((s.exchange_done ? 1 : 0) | (s.keep_alive ? 2 : 0)));
  put(head, uint32_t(s.event.size()));
  head += s.event;
  append(kStep, head, s.output);
}

std::optional<JournalState> ConnJournal::read(int fd, std::string* why) {
  auto fail = [why](std::string w) -> std::optional<JournalState> {
    if (why) *why = std::move(w);
    return std::nullopt;
  };
  JournalState st;
  uint64_t at = 0;
  bool first = true;
  struct stat file {};
  if (::fstat(fd, &file) != 0) return fail(std::string("fstat: ") + std::strerror(errno));
  const uint64_t size = uint64_t(file.st_size);
  for (;;) {
    char h[kHeader];
    if (!pread_all(fd, h, kHeader, at)) break;
    const std::string_view hv(h, kHeader);
    const uint8_t type = uint8_t(h[4]);
    const uint32_t generation = get<uint32_t>(hv, 8), length = get<uint32_t>(hv, 12);
    if (get<uint32_t>(hv, 0) != kMagic || (!first && generation != st.generation)) break;
    if (at + kHeader + length > size) break;  // torn (or not a length at all): read nothing past the file
    std::string payload(length, '\0');
    if (!pread_all(fd, payload.data(), length, at + kHeader) ||
        check(type, generation, payload, {}) != get<uint64_t>(hv, 16))
      break;
    if (first) {
      if (type != kBase || length < 16) break;
      st.generation = generation;
      st.read_at_base = get<uint64_t>(payload, 0);
      st.written_at_base = get<uint64_t>(payload, 8);
      st.input.assign(payload, 16);
      st.leftover = st.input.size();
      first = false;
    } else if (type == kInput) {
      st.input += payload;
    } else if (type == kStep && length >= 6) {
      JournalStep s;
      s.kind = JournalStep::Kind(uint8_t(payload[0]));
      s.exchange_done = payload[1] & 1;
      s.keep_alive = payload[1] & 2;
      const uint32_t n = get<uint32_t>(payload, 2);
      if (6 + uint64_t(n) > length) break;
      s.event.assign(payload, 6, n);
      s.output.assign(payload, 6 + n);
      st.steps.push_back(std::move(s));
    } else {
      break;
    }
    at += kHeader + length;
  }
  if (first) return fail("it does not begin with a whole base record");
  st.journal_bytes = at;
  return st;
}

}  // namespace ds4::proxy
