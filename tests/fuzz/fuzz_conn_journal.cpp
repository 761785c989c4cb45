// libFuzzer target: what a restarted supervisor reads back of a connection's
// journal (supervisor/proxy/conn_journal.h) and its steps' events
// (session_journal.h). A journal is torn by a kill at any byte, so any
// content must read back as a valid prefix or as "no base", and any event
// text must decode or be refused, never crash. The first byte picks: 0 the
// journal (the rest is the file), 1 a token, 2 a request, 3 a job's end;
// what decodes must encode back to the same value.
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "supervisor/proxy/conn_journal.h"
#include "supervisor/proxy/session_journal.h"

using namespace ds4::proxy;

namespace {

void must(bool ok) {
  if (!ok) std::abort();
}

void read_journal(std::string_view bytes) {
  const int fd = ::memfd_create("fuzz-journal", MFD_CLOEXEC);
  if (fd < 0) return;
  if (::write(fd, bytes.data(), bytes.size()) == ssize_t(bytes.size())) {
    std::string why;
    if (std::optional<JournalState> st = ConnJournal::read(fd, &why)) {
      must(st->journal_bytes <= bytes.size());
      must(st->leftover <= st->input.size());
      for (const JournalStep& s : st->steps) {
        (void)decode_token(s.event);
        (void)decode_request(s.event);
        (void)decode_result(s.event);
        (void)decode_engine_op(s.event);
      }
      // Records appended after what was read are read back after it.
      ConnJournal j(::dup(fd), *st);
      j.input("tail");
      std::optional<JournalState> again = ConnJournal::read(fd, &why);
      must(again && again->input == st->input + "tail" && again->steps.size() == st->steps.size());
    } else {
      must(!why.empty());
    }
  }
  ::close(fd);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string_view in(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (data[0] % 5) {
    case 0:
      read_journal(in);
      break;
    case 1:
      if (auto e = decode_token(in)) {
        auto back = decode_token(encode_token(*e));
        must(back && back->index == e->index && back->token == e->token && back->top.size() == e->top.size());
      }
      break;
    case 2:
      if (auto r = decode_request(in)) must(decode_request(encode_request(*r)) == r);
      break;
    case 3:
      if (auto r = decode_result(in)) {
        auto back = decode_result(encode_result(*r));
        must(back && back->ok == r->ok && back->reason == r->reason && back->error.message == r->error.message);
      }
      break;
    case 4:
      if (auto op = decode_engine_op(in)) must(decode_engine_op(encode_engine_op(*op)) == op);
      break;
  }
  return 0;
}
