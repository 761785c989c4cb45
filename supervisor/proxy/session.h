#pragma once
/// One client connection (Beast's listener/session pattern): reads requests
/// with the configured limits, answers at once what the router answers, or
/// runs a job and streams or sends its answer; keep-alive between requests.
/// While a job runs the connection is still read, so that a client that goes
/// away is noticed at once and its job cancelled.

#include <utility>  // before Asio: Boost 1.74's awaitable.hpp needs std::exchange

#include <boost/asio.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/http.hpp>
#include <deque>
#include <memory>
#include <optional>

#include "supervisor/proxy/answer.h"
#include "supervisor/proxy/api_response.h"
#include "supervisor/proxy/conn_journal.h"
#include "supervisor/proxy/core.h"
#include "supervisor/proxy/session_journal.h"
#include "supervisor/proxy/text_stream.h"

namespace ds4::proxy {

class Session : public std::enable_shared_from_this<Session>, public JobSink {
 public:
  Session(Core& core, boost::asio::ip::tcp::socket sock);
  ~Session() override;
  /// `reject`: too many connections, answer 503 and close. With a journal
  /// (the connection is in systemd's fd store under `store_name`), every
  /// byte read and every step of an answer is journaled first.
  void start(bool reject, std::unique_ptr<ConnJournal> journal = nullptr, std::string store_name = {});
  /// A connection a killed supervisor left in the fd store, `journal` read
  /// back from it: the exchange in progress is rebuilt from its steps and the
  /// answer goes on from the client's next byte (`written`: the socket's
  /// count). False, with `why`, when the journal cannot be continued: the
  /// caller closes the connection.
  /// `mid_answer`: set when an answer was under way (not a connection
  /// between requests, nor one whose answer was all written).
  bool recover(std::unique_ptr<ConnJournal> journal, std::string store_name, const JournalState& state,
               uint64_t read, uint64_t written, std::string* why, bool* mid_answer);
  void close();

 private:
  enum class Phase { header, body, busy, idle, closed };

  /// The socket as Beast reads it: each byte read is journaled before it is used.
  struct Reader {
    Session& s;
    using executor_type = boost::asio::ip::tcp::socket::executor_type;
    executor_type get_executor() { return s.sock_.get_executor(); }
    template <class Buffers, class Handler>
    void async_read_some(const Buffers& buffers, Handler&& handler);
  };
  /// Collects what a step writes; at its end (the outermost one) the step is
  /// journaled and only then are its bytes sent.
  class Step {
   public:
    Step(Session& s, JournalStep::Kind kind, std::string event = {});
    ~Step();
    Step(const Step&) = delete;
    Step& operator=(const Step&) = delete;
   private:
    Session& s_;
    bool outer_ = false;
  };

  void do_read_header();
  void on_header(const boost::system::error_code& ec);
  void on_body(const boost::system::error_code& ec);
  void handle();
  void plan_aside(const RouteContext& ctx);
  void routed(Route r, bool head);
  void start_job(Plan plan);
  void start_forward(EngineRequest f);
  void respond(const Response& r);                  // a whole answer; ends the exchange
  void respond_error(const ApiError& e) { respond(error_response(api_, e)); }
  /// The head of a chunked 200 answer (a stream), once.
  void send_head(std::string_view content_type = "text/event-stream");
  void chunk(const std::string& bytes);
  void end_exchange();
  void write(std::string bytes);
  /// To the socket, journaled or not.
  void send(std::string bytes);
  void do_write();
  bool output_pending() const { return writing_ || !out_.empty() || step_depth_ > 0; }
  bool submit(const std::shared_ptr<Job>& job);
  /// recover(): parses the request at the head of buf_ (all there), consuming it.
  bool parse_buffered_request();
  /// recover(): that request parsed and routed again (nullopt: it does not
  /// parse), with the journal's `seed` and no context limit.
  std::optional<Route> route_again(uint64_t seed);
  void forget_store();
  void after_exchange();
  void watch();
  void linger_close();
  void drain();
  void arm(Duration d);
  void wait_deadline();
  void on_deadline();

  /// Answer events to the responder (and the stream).
  void emit(std::vector<AnswerEvent> events);
  /// A thinking budget spent: the thought is closed and the answer goes on
  /// from the prompt, the tokens so far and `</think>`. False when no room is left.
  bool close_thought(const Job& done);
  void on_waiting(int64_t position) override;
  bool on_token(const proto::TokenEvent& e) override;
  void on_done(const JobResult& r) override;
  void on_engine_head(int status, const std::string& content_type, bool streaming) override;
  void on_engine_data(std::string_view bytes) override;
  void on_engine_op(const EngineOp& op, const std::function<void()>& apply) override;
  void end_forward(const JobResult& r);
  /// recover(): an exec engine's stream that went out in part, continued by
  /// an engine from the journaled stream (Scheduler::restore).
  bool recover_forward(const JournalState& st, const JournalStep* request, std::string rest, std::string* why);
  /// recover(): job_ back to the scheduler to go on (a full queue answers 503).
  void resubmit();

  Core& core_;
  std::weak_ptr<bool> core_alive_;
  boost::asio::ip::tcp::socket sock_;
  boost::asio::steady_timer timer_;
  boost::beast::flat_buffer buf_;
  std::optional<boost::beast::http::request_parser<boost::beast::http::string_body>> parser_;
  Phase phase_ = Phase::header;
  std::deque<std::string> out_;
  bool writing_ = false;
  bool watching_ = false;
  bool keep_alive_ = true;
  std::chrono::steady_clock::time_point deadline_;  // of the limit in force
  int64_t trace_received_ = 0;  // DS4_TRACE: when the request was all read
  int trace_port_ = 0;          // DS4_TRACE: the client's port
  std::string target_;          // the request's path, for the refusals' journal lines and the status page
  std::chrono::steady_clock::time_point received_{};  // when the request was all read: its latency starts
  bool timer_waiting_ = false;

  // Kept across a supervisor restart (conn_journal.h, session_journal.h).
  Reader reader_{*this};
  std::unique_ptr<ConnJournal> journal_;
  std::string store_name_;       // in the fd store under this name ("" = not)
  uint64_t read_total_ = 0;      // bytes read from the socket
  uint64_t written_total_ = 0;   // bytes handed to it
  int step_depth_ = 0;
  JournalStep step_;             // the step being recorded
  bool replaying_ = false;       // recover(): steps rebuild the state, nothing is sent or submitted
  bool continue_sent_ = false;   // "100 Continue" went out before a restart

  // The exchange in progress.
  Api api_ = Api::openai;
  bool exchange_done_ = true;
  std::optional<Plan> plan_;
  std::unique_ptr<Responder> responder_;
  std::shared_ptr<Job> job_;
  std::optional<TextStream> text_;
  std::optional<AnswerParser> answer_;
  std::string response_id_;
  std::string answer_text_;       // the content, for the Responses store
  json answer_calls_;   // the calls (template shape), for the Responses store
  int64_t thought_tokens_ = 0;    // tokens inside the thought (a thinking budget counts them)
  int64_t earlier_tokens_ = 0;    // tokens of the answer before the thought was closed
  bool closing_thought_ = false;  // the budget is spent: the job stops and goes on after </think>
  std::vector<TokenInfo> pending_tokens_;
  std::optional<JournalRequest> replayed_;  // recover(): the request step's choices
  bool stream_ = false;
  bool head_sent_ = false;
  // A forwarded exchange (exec engines): the engine's answer when it is not
  // a stream, kept until it ends.
  bool forwarding_ = false;
  int engine_status_ = 0;  // 0 = streaming, or nothing yet
  std::string engine_type_;
  std::string engine_body_;
};

}  // namespace ds4::proxy
