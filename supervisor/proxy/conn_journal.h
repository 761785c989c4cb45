#pragma once
/// The journal of one client connection, so that a supervisor killed in the
/// middle of an answer loses nothing (DESIGN.md): a restarted supervisor takes
/// the connection back from systemd's fd store, reads this journal and goes on
/// answering on the client's own socket from the next byte.
///
/// It lives in a memfd (kept in the fd store next to the socket) and is
/// written with pwrite, never mapped: a full memory cgroup gives an error,
/// never SIGBUS. A failed write stops the journal (ok() false): the connection
/// goes on serving, unprotected. The single writer is the session's thread.
///
/// What it holds, in records that carry a generation and a checksum:
///   base   the bytes read from and written to the socket when the current
///          exchange began, and the input already read and not yet used
///          (a pipelined request);
///   input  every byte read from the socket since, in order;
///   step   what the exchange did: one event (the request's planning, a token,
///          the job's end) and every byte of output it wrote. A step is
///          recorded before its bytes reach the socket.
/// A base starts a new generation at offset 0: the records after it that
/// belong to an older generation end the read.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace ds4::proxy {

struct JournalStep {
  enum class Kind : uint8_t {
    output = 0,   // bytes only (an error answer, a waiting notice, 100 Continue)
    request = 1,  // the request planned: JournalRequest
    token = 2,    // a token of the answer: proto::TokenEvent (journal_codec)
    done = 3,     // the job ended: JobResult
    engine = 4,   // an exec engine's stream: EngineOp (session_journal.h)
  };
  Kind kind = Kind::output;
  bool exchange_done = false;  // the answer is whole after this step's bytes
  bool keep_alive = false;     // and the connection then waits for the next request
  std::string event;           // the kind's encoding
  std::string output;          // every byte this step wrote, in order
  bool operator==(const JournalStep&) const = default;
};

/// What a journal holds, read back.
struct JournalState {
  uint32_t generation = 0;
  uint64_t read_at_base = 0;     // bytes read from the socket when the exchange began
  uint64_t written_at_base = 0;  // bytes written to it then
  size_t leftover = 0;           // `input` begins with this many bytes read before the base
  std::string input;             // the leftover, then every byte read since
  std::vector<JournalStep> steps;
  uint64_t journal_bytes = 0;    // where the next record goes

  /// Bytes the socket must have given by now.
  uint64_t read_total() const { return read_at_base + (input.size() - leftover); }
  /// Every byte of output the exchange produced.
  std::string output() const;
};

class ConnJournal {
 public:
  /// A new journal in a memfd named `name`; nullptr (errno set) when none can be made.
  static std::unique_ptr<ConnJournal> create(const std::string& name);
  /// Takes over `fd` (a journal read back): the next records follow `state`'s,
  /// and whatever lay past them in the file is cut.
  ConnJournal(int fd, const JournalState& state);
  ~ConnJournal();
  ConnJournal(const ConnJournal&) = delete;
  ConnJournal& operator=(const ConnJournal&) = delete;

  int fd() const { return fd_; }
  bool ok() const { return ok_; }

  /// A new exchange: `read`/`written` are the socket's byte counts, `leftover`
  /// what was read and not used yet. Forgets every record before (the file
  /// is cut after the base).
  void base(uint64_t read, uint64_t written, std::string_view leftover);
  void input(std::string_view bytes);
  void step(const JournalStep& s);

  /// Reads a journal back. nullopt and `why` when it does not begin with a
  /// valid base (a torn base write, another file).
  static std::optional<JournalState> read(int fd, std::string* why);

 private:
  ConnJournal(int fd) : fd_(fd) {}
  void append(uint8_t type, std::string_view a, std::string_view b = {});
  void cut();  // the file ends where the records do
  int fd_ = -1;
  bool ok_ = true;
  uint32_t generation_ = 0;
  uint64_t end_ = 0;
  uint64_t high_ = 0;  // the file's size
};

}  // namespace ds4::proxy
