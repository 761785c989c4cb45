// A connection's journal (supervisor/proxy/conn_journal.h), its events
// (session_journal.h) and the kernel's byte counts of a TCP connection
// (tcp_bytes.h), which a restarted supervisor checks the journal against.
#include <doctest/doctest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <string>

#include "supervisor/proxy/conn_journal.h"
#include "supervisor/proxy/conn_store.h"
#include "supervisor/proxy/session_journal.h"
#include "supervisor/proxy/tcp_bytes.h"

using namespace ds4;
using namespace ds4::proxy;

namespace {

JournalStep step_of(JournalStep::Kind k, std::string event, std::string out, bool done = false) {
  JournalStep s;
  s.kind = k;
  s.event = std::move(event);
  s.output = std::move(out);
  s.exchange_done = done;
  s.keep_alive = done;
  return s;
}

JournalState read_back(const ConnJournal& j) {
  std::string why;
  std::optional<JournalState> st = ConnJournal::read(j.fd(), &why);
  REQUIRE_MESSAGE(st, why);
  return *st;
}

}  // namespace

TEST_CASE("conn journal: an exchange's input and steps read back in order") {
  auto j = ConnJournal::create("ds4-test-journal");
  REQUIRE(j);
  j->base(100, 2000, "GET /he");
  j->input("alth HTTP/1.1\r\n\r\nPOST");
  const JournalStep a = step_of(JournalStep::Kind::request, "{}", "HTTP/1.1 200 OK\r\n");
  const JournalStep b = step_of(JournalStep::Kind::token, std::string("\0\1\2", 3), "data: x\n\n");
  const JournalStep c = step_of(JournalStep::Kind::done, "", "0\r\n\r\n", true);
  j->step(a);
  j->input(" /v1");
  j->step(b);
  j->step(c);
  REQUIRE(j->ok());
  const JournalState st = read_back(*j);
  CHECK(st.read_at_base == 100);
  CHECK(st.written_at_base == 2000);
  CHECK(st.leftover == 7);
  CHECK(st.input == "GET /health HTTP/1.1\r\n\r\nPOST /v1");
  CHECK(st.read_total() == 100 + st.input.size() - 7);
  REQUIRE(st.steps.size() == 3);
  CHECK(st.steps[0] == a);
  CHECK(st.steps[1] == b);
  CHECK(st.steps[2] == c);
  CHECK(st.output() == "HTTP/1.1 200 OK\r\ndata: x\n\n0\r\n\r\n");
}

TEST_CASE("conn journal: a new exchange forgets the records of the one before") {
  auto j = ConnJournal::create("ds4-test-journal");
  REQUIRE(j);
  j->base(0, 0, {});
  j->input(std::string(5000, 'a'));
  j->step(step_of(JournalStep::Kind::output, "", std::string(3000, 'b'), true));
  j->base(5000, 3000, "x");
  // The file ends at the new base: no bytes of the old exchange (a client's
  // own) stay behind it to be read as records later.
  struct stat file {};
  REQUIRE(::fstat(j->fd(), &file) == 0);
  CHECK(file.st_size == off_t(read_back(*j).journal_bytes));
  j->input("yz");
  JournalState st = read_back(*j);
  CHECK(st.read_at_base == 5000);
  CHECK(st.input == "xyz");
  CHECK(st.steps.empty());
  // Taken over after a restart: the next records follow, the next base wins.
  ConnJournal again(::dup(j->fd()), st);
  again.step(step_of(JournalStep::Kind::output, "", "ok"));
  st = read_back(again);
  CHECK(st.input == "xyz");
  REQUIRE(st.steps.size() == 1);
  again.base(5002, 3002, {});
  st = read_back(again);
  CHECK(st.read_at_base == 5002);
  CHECK(st.steps.empty());
  CHECK(st.input.empty());
}

TEST_CASE("conn journal: a torn or foreign record ends the read; no base is an error") {
  auto j = ConnJournal::create("ds4-test-journal");
  REQUIRE(j);
  j->base(0, 0, {});
  j->input("abc");
  j->step(step_of(JournalStep::Kind::output, "", "hello"));
  const JournalState whole = read_back(*j);
  // A record cut short (a kill during its write) is not read, nor what follows.
  REQUIRE(::ftruncate(j->fd(), off_t(whole.journal_bytes - 2)) == 0);
  JournalState st = read_back(*j);
  CHECK(st.input == "abc");
  CHECK(st.steps.empty());
  // A flipped byte in a record fails its check.
  j = ConnJournal::create("ds4-test-journal");
  j->base(0, 0, {});
  j->input("abc");
  const JournalState one = read_back(*j);
  char c = 'X';
  REQUIRE(::pwrite(j->fd(), &c, 1, off_t(one.journal_bytes - 1)) == 1);
  CHECK(read_back(*j).input.empty());
  // Not a journal at all.
  auto empty = ConnJournal::create("ds4-test-journal");
  std::string why;
  CHECK_FALSE(ConnJournal::read(empty->fd(), &why));
  CHECK(why.find("base") != std::string::npos);
  REQUIRE(::pwrite(empty->fd(), "garbage that is long enough to be a header", 42, 0) == 42);
  CHECK_FALSE(ConnJournal::read(empty->fd(), &why));
  // A header whose length runs past the file (a torn write, or not a length
  // at all: 3.9 GB here) is not read, nor allocated (fuzz_conn_journal's find).
  auto torn = ConnJournal::create("ds4-test-journal");
  torn->base(0, 0, "abc");
  const uint32_t huge = 0xe8000000u;
  REQUIRE(::pwrite(torn->fd(), &huge, 4, 12) == 4);
  CHECK_FALSE(ConnJournal::read(torn->fd(), &why));
}

TEST_CASE("conn journal: taken over after a torn record, what follows it is never read") {
  // fuzz_conn_journal's third find: a broken record with a whole one behind
  // it. The new owner's first record covered only the broken one's start, and
  // the whole one then read as if it followed. Taking over cuts the file.
  auto j = ConnJournal::create("ds4-test-journal");
  REQUIRE(j);
  j->base(0, 0, {});
  j->input("abc");
  const uint64_t good = read_back(*j).journal_bytes;
  j->input("0123456789");
  j->step(step_of(JournalStep::Kind::output, "", "forged"));
  char c = 'X';
  REQUIRE(::pwrite(j->fd(), &c, 1, off_t(good + 24)) == 1);  // the second input's first payload byte
  const JournalState st = read_back(*j);
  CHECK(st.input == "abc");
  CHECK(st.steps.empty());
  ConnJournal again(::dup(j->fd()), st);
  again.input("ABCDEFGHIJ");  // as long as the broken one: the whole one would follow at once
  const JournalState after = read_back(again);
  CHECK(after.input == "abcABCDEFGHIJ");
  CHECK(after.steps.empty());
}

TEST_CASE("session journal: events round-trip; malformed ones are refused") {
  JournalRequest r{"chatcmpl-1", 1700000000, 0xfedcba9876543210ull, 77, false};
  CHECK(decode_request(encode_request(r)) == r);
  CHECK_FALSE(decode_request("{\"id\":1}"));
  CHECK_FALSE(decode_request("not json"));
  // Numbers past their field's type are refused, not converted (fuzz_conn_journal's find).
  CHECK_FALSE(decode_request(
      R"({"id":"x","created":34000777777777777777,"seed":1,"max_tokens":8,"forward":false})"));
  CHECK_FALSE(decode_request(R"({"id":"x","created":1,"seed":-1,"max_tokens":8,"forward":false})"));
  CHECK_FALSE(decode_request(R"({"id":"x","created":1,"seed":1,"max_tokens":3000000000,"forward":false})"));
  CHECK_FALSE(decode_request(R"({"id":"x","created":1.5,"seed":1,"max_tokens":8,"forward":false})"));
  CHECK_FALSE(decode_result(R"({"ok":true,"reason":"stop","timings":[1,0,2,0.5,1.5],"error":[99,"",0,""]})"));
  proto::TokenEvent e;
  e.index = 41;
  e.token = 1234;
  e.logprob = -0.5f;
  e.top = {{5, -1.f}, {6, -2.f}};
  const std::optional<proto::TokenEvent> back = decode_token(encode_token(e));
  REQUIRE(back);
  CHECK(back->index == 41);
  CHECK(back->token == 1234);
  CHECK(back->logprob == -0.5f);
  CHECK(back->top == e.top);
  const std::string enc = encode_token(e);
  CHECK_FALSE(decode_token(enc.substr(0, enc.size() - 1)));
  CHECK_FALSE(decode_token(enc + "x"));
  JobResult res;
  res.ok = false;
  res.reason = "length";
  res.timings = {10, 2, 30, 1.5, 2.5};
  res.error = ApiError(ErrorKind::timeout, "slow", 3, "messages");
  const std::optional<JobResult> rb = decode_result(encode_result(res));
  REQUIRE(rb);
  CHECK(rb->ok == false);
  CHECK(rb->reason == "length");
  CHECK(rb->timings.predicted_n == 30);
  CHECK(rb->timings.predicted_ms == 2.5);
  CHECK(rb->error.kind == ErrorKind::timeout);
  CHECK(rb->error.param == "messages");
  EngineOp op;
  op.kind = EngineOp::Kind::hole;
  op.resume = ResumeKind::chat;
  op.as_chat = true;
  op.at = 12;
  op.id = 151643;
  op.bytes = std::string("data: {}\n\n\0x", 12);
  CHECK(decode_engine_op(encode_engine_op(op)) == op);
  const std::string eop = encode_engine_op(op);
  CHECK_FALSE(decode_engine_op(eop.substr(0, 14)));
  for (size_t at : {size_t(0), size_t(1), size_t(2)}) {  // kind, resume kind, flag out of range
    std::string bad = eop;
    bad[at] = char(9);
    CHECK_FALSE(decode_engine_op(bad));
  }
  CHECK(stored_connection_number("ds4-conn-42") == 42u);
  CHECK_FALSE(stored_connection_number("ds4-conn-"));
  CHECK_FALSE(stored_connection_number("ds4-conn-4x"));
  CHECK_FALSE(stored_connection_number("ds4-model-1"));
}

TEST_CASE("tcp bytes: the kernel's counts of what the owner read and wrote") {
  const int lst = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(lst >= 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(lst, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  REQUIRE(::listen(lst, 1) == 0);
  socklen_t len = sizeof a;
  REQUIRE(::getsockname(lst, reinterpret_cast<sockaddr*>(&a), &len) == 0);
  const int client = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(::connect(client, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  const int server = ::accept(lst, nullptr, nullptr);
  REQUIRE(server >= 0);
  const std::optional<TcpBytes> listening = tcp_bytes(lst);
  CHECK((!listening || listening->written == 0));

  const std::string req(1000, 'q');
  REQUIRE(::write(client, req.data(), req.size()) == ssize_t(req.size()));
  char buf[4096];
  REQUIRE(::read(server, buf, 300) == 300);  // 700 left in the queue
  const std::string answer(5000, 'a');
  REQUIRE(::write(server, answer.data(), answer.size()) == ssize_t(answer.size()));
  ::usleep(20000);
  std::optional<TcpBytes> b = tcp_bytes(server);
  REQUIRE(b);
  CHECK(b->read == 300);
  CHECK(b->written == 5000);  // whether the client read it or not
  CHECK_FALSE(b->peer_closed);
  // The client's FIN is not a byte read.
  REQUIRE(::shutdown(client, SHUT_WR) == 0);
  ::usleep(20000);
  b = tcp_bytes(server);
  REQUIRE(b);
  CHECK(b->peer_closed);
  CHECK(b->read == 300);
  size_t got = 0;
  ssize_t r;
  while ((r = ::read(server, buf, sizeof buf)) > 0) got += size_t(r);
  CHECK(got == 700);
  b = tcp_bytes(server);
  REQUIRE(b);
  CHECK(b->read == 1000);
  CHECK_FALSE(tcp_bytes(::fileno(stdin)));
  ::close(client);
  ::close(server);
  ::close(lst);
}
