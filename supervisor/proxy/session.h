#pragma once
/// One client connection (Beast's listener/session pattern): reads requests
/// with the configured limits, answers at once what the router answers, or
/// runs a job and streams or sends its answer; keep-alive between requests.
/// While a job runs the connection is still read, so that a client that goes
/// away is noticed at once and its job cancelled.
///
/// A session runs on its connection thread (core.h). On the core thread it
/// calls the scheduler and hears its job directly, as its JobSink. On another
/// one, its calls to the scheduler are posted to the core thread, and a
/// FrontSink there posts the job's events back; a stop string found on this
/// side reaches the scheduler as a stop() a moment later (tokens that come
/// meanwhile are dropped), and a stream's head goes out with its first event.

#include <utility>  // before Asio: Boost 1.74's awaitable.hpp needs std::exchange

#include <boost/asio.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/http.hpp>
#include <deque>
#include <memory>
#include <optional>

#include "supervisor/proxy/api_response.h"
#include "supervisor/proxy/core.h"
#include "supervisor/proxy/text_stream.h"

namespace ds4::proxy {

class Session : public std::enable_shared_from_this<Session>, public JobSink {
 public:
  /// `sock` belongs to front.io.
  Session(Core& core, Front& front, boost::asio::ip::tcp::socket sock);
  ~Session() override;
  /// `reject`: too many connections, answer 503 and close. On its thread.
  void start(bool reject);
  /// On its thread (or on any once the connection threads are joined).
  void close();
  /// close() from any thread.
  void close_on_its_thread();

 private:
  enum class Phase { header, body, busy, idle, closed };

  void do_read_header();
  void on_header(const boost::system::error_code& ec);
  void on_body(const boost::system::error_code& ec);
  void handle();
  void routed(Route r);
  void start_job(Plan plan);
  /// The job to the scheduler; cancelled; its answer complete (a stop string
  /// found off the core thread).
  void submit_job();
  void cancel_job();
  void stop_job();
  void on_rejected();
  void front_token(const proto::TokenEvent& e);
  void start_forward(EngineRequest f);
  void respond(const Response& r);                  // a whole answer; ends the exchange
  void respond_error(const ApiError& e) { respond(error_response(api_, e)); }
  /// The head of a chunked 200 answer (a stream), once.
  void send_head(std::string_view content_type = "text/event-stream");
  void chunk(const std::string& bytes);
  void end_exchange();
  void write(std::string bytes);
  void do_write();
  void after_exchange();
  void watch();
  void linger_close();
  void drain();
  void arm(Duration d);
  void wait_deadline();
  void on_deadline();

  void on_waiting(int64_t position) override;
  bool on_token(const proto::TokenEvent& e) override;
  void on_done(const JobResult& r) override;
  void on_engine_head(int status, const std::string& content_type, bool streaming) override;
  void on_engine_data(std::string_view bytes) override;
  void end_forward(const JobResult& r);

  friend class FrontSink;

  Core& core_;
  Front& front_;
  const bool on_core_;  // front_ is the core thread's
  std::weak_ptr<bool> core_alive_;
  std::shared_ptr<const ProxyConfig> cfg_;  // the config in force when the exchange began
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
  bool timer_waiting_ = false;

  // The exchange in progress.
  Api api_ = Api::openai;
  bool exchange_done_ = true;
  std::optional<Plan> plan_;
  std::unique_ptr<Responder> responder_;
  std::shared_ptr<Job> job_;
  std::optional<TextStream> text_;
  std::vector<TokenInfo> pending_tokens_;
  bool stream_ = false;
  bool head_sent_ = false;
  uint64_t exchange_ = 0;      // jobs started: a FrontSink's events for an older one are dropped
  int64_t tokens_seen_ = 0;    // tokens of the job's answer (end of turn included)
  bool stopped_ = false;       // the answer is complete (off the core thread: later tokens are dropped)
  // A forwarded exchange (exec engines): the engine's answer when it is not
  // a stream, kept until it ends.
  bool forwarding_ = false;
  int engine_status_ = 0;  // 0 = streaming, or nothing yet
  std::string engine_type_;
  std::string engine_body_;
};

}  // namespace ds4::proxy
