#pragma once
/// The queue and dispatch. One FIFO queue; a job goes to a ready worker with
/// a free slot (slots as the registry reports them), preferring the worker
/// whose recent requests share the longest token prefix with it (its KV cache
/// holds them). The queue is bounded by count (max_waiting) and time
/// (max_wait). When a worker connection breaks mid-answer, the job goes back
/// to the head of the queue with every token received so far and continues
/// on the next ready worker from exactly there: the worker samples token i
/// from (seed, i) only, so the continuation is the one an undisturbed run
/// would have produced. Calls go out on the WorkerPool's connections, one
/// per worker, shared by all calls to it (worker_call.h).
///
/// Everything runs on the io_context's one thread.

#include <utility>  // before Asio: Boost 1.74's awaitable.hpp needs std::exchange

#include <boost/asio.hpp>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "shared/config.h"
#include "shared/protocol.h"
#include "shared/worker_registry.h"
#include "supervisor/proxy/api_error.h"
#include "supervisor/proxy/engine_anthropic.h"
#include "supervisor/proxy/engine_call.h"
#include "supervisor/proxy/engine_resume.h"
#include "supervisor/proxy/job_result.h"
#include "supervisor/proxy/worker_call.h"

namespace ds4::proxy {

/// The request's owner (an HTTP exchange) hears about its job here.
class JobSink {
 public:
  virtual ~JobSink() = default;
  /// Waiting in the queue at `position` (1 = next); repeated now and then.
  virtual void on_waiting(int64_t position) = 0;
  /// A new token (index = tokens before it). Return false when the answer is
  /// complete (stop string, end of turn): the worker is told to stop.
  virtual bool on_token(const proto::TokenEvent& e) = 0;
  /// The end; nothing follows.
  virtual void on_done(const JobResult& r) = 0;
  /// Forwarded jobs (exec engines): the engine's answer as it comes: its
  /// status and content type once, then its body bytes, then on_done.
  virtual void on_engine_head(int status, const std::string& content_type, bool streaming) {}
  virtual void on_engine_data(std::string_view bytes) {}
  /// Each change to a forwarded stream (EngineOp: the engine's bytes, a
  /// continuation begun, a hole filled, an end written) comes with `apply`,
  /// which makes it and sends what it gives the client through
  /// on_engine_data. A journaling sink records the change with those bytes
  /// in one step, so that a restarted supervisor rebuilds the stream's
  /// filter from them (Scheduler::restore).
  virtual void on_engine_op(const EngineOp& op, const std::function<void()>& apply) { apply(); }
};

struct Job {
  proto::GenerateRequest gen;  // prompt, every token generated so far, limits, sampling
  JobSink* sink = nullptr;
  /// Exec engines (workers.engine: exec): the client's request, forwarded as
  /// it came to a worker's HTTP port instead of tokens to its socket.
  std::shared_ptr<const EngineRequest> forward;

  /// For the status page: "POST /v1/chat/completions", and when the
  /// scheduler first had it.
  std::string endpoint;
  std::chrono::steady_clock::time_point submitted{};

  // For DS4_TRACE (shared/request_trace.h): when the proxy had the request, and the client's port.
  int64_t trace_received = 0;
  int trace_port = 0;

  // Kept by the scheduler.
  enum class State { fresh, queued, running, done } state = State::fresh;
  uint64_t seq = 0;          // submission order
  int worker = -1;
  uint64_t worker_generation = 0;
  std::shared_ptr<WorkerCall> call;
  std::shared_ptr<EngineCall> engine_call;
  bool forwarded = false;    // engine bytes reached the sink: it can no longer be replayed
  /// Exec engines that resume (engine_resume.h): the stream's filter (it
  /// knows the generated ids), and the prompt's ids once a resume asked for them.
  std::unique_ptr<ResumableStream> resumable;
  ResumeKind resume_kind = ResumeKind::none;
  /// An Anthropic stream sent to the engine as chat (engine_anthropic.h):
  /// the chat stream turned back into Anthropic's events for the client.
  std::unique_ptr<AnthropicFromChat> anthropic;
  std::optional<std::vector<int32_t>> prompt_ids;
  int continuation_status = 0;
  std::chrono::steady_clock::time_point queued_at{}, call_started{}, first_token{}, last_token{};
  std::chrono::steady_clock::duration waited{};  // in the queue, all visits summed
  int64_t call_tokens = 0;   // tokens from the current call
  int64_t resumes = 0;       // times moved to another worker mid-answer
  int64_t last_position = 0;
  proto::Timings timings;
  std::unique_ptr<boost::asio::steady_timer> wait_timer;
};

struct SchedulerOptions {
  std::uint32_t max_waiting = 256;
  Duration max_wait = std::chrono::minutes(10);
  Duration notice_interval = std::chrono::seconds(2);  // ": waiting" lines to streams
  Duration retry_min = std::chrono::milliseconds(10);  // after a worker's connection failed …
  Duration retry_max = std::chrono::milliseconds(200); // … doubling up to this
  size_t prefix_history = 8;                           // recent sequences kept per worker
  EngineLimits engine;                                 // answers of exec engines
  /// Exec engines are probed at each start for what they can resume
  /// (engine_probe.h) before their first job; off: none resumes.
  bool resume_engines = false;
  std::chrono::milliseconds probe_timeout{std::chrono::seconds(5)};
};

/// A worker as dispatch sees it.
struct Candidate {
  int id = 0;
  int64_t context = 0;
  int64_t free_slots = 0;
  const std::deque<std::vector<int32_t>>* history = nullptr;  // recent token sequences
  bool http = false;  // an exec engine: takes forwarded jobs only
};

/// The worker for `tokens` among `cands` (all ready, not blocked): one with a
/// free slot and a context above `needed`, longest shared prefix first, then
/// most free slots, then lowest id. Pure.
std::optional<int> pick_worker(const std::vector<Candidate>& cands, const std::vector<int32_t>& tokens, int64_t needed);

/// Length of the common prefix.
size_t common_prefix(const std::vector<int32_t>& a, const std::vector<int32_t>& b);

struct SchedulerCounters {
  int64_t resumes = 0;            // jobs continued on another worker
  int64_t broken_calls = 0;       // worker connections that failed
  int64_t dispatched = 0;         // first dispatches
  double wait_seconds_sum = 0;    // queue wait of dispatched jobs (first dispatch)
  double wait_seconds_max = 0;
  int64_t timeouts = 0;           // max_wait reached
  int64_t rejected_full = 0;      // queue full
  int64_t tokens_out = 0;
};

class Scheduler {
 public:
  Scheduler(boost::asio::io_context& io, sup::WorkerRegistry& registry, SchedulerOptions options);
  ~Scheduler();

  /// Queues `job` (its gen and sink set). False when the queue is full
  /// (the caller answers 503); the sink hears nothing then. The job may end
  /// within the call (nothing to generate, a prompt no context holds), and
  /// its sink may drop the caller's reference then: `job` is taken by value.
  bool submit(std::shared_ptr<Job> job);
  /// The client went away: the job leaves the queue or its worker connection
  /// is closed (the worker stops). The sink hears nothing more.
  void cancel(const std::shared_ptr<Job>& job);

  void set_options(const SchedulerOptions& o) { opt_ = o; }
  const SchedulerOptions& options() const { return opt_; }
  sup::ProxyStats stats() const;
  /// The jobs waiting and running, oldest first, at most `limit` (the status page).
  std::vector<sup::RequestView> requests(size_t limit) const;
  const SchedulerCounters& counters() const { return counters_; }
  /// The largest context among the registry's workers (0 when none is known).
  int64_t max_context() const;
  size_t waiting() const { return queue_.size(); }
  size_t running() const { return running_.size(); }
  /// The connections to workers, one per worker.
  const WorkerPool& pool() const { return pool_; }
  /// The registry's workers as last reported.
  const std::vector<sup::WorkerInfo>& workers() const { return workers_; }
  /// What an exec engine was probed to resume (probed false: not yet).
  EngineCaps engine_caps(int worker) const;

  /// After a supervisor restart, a forwarded job (its forward and sink set,
  /// not submitted) whose stream went out in part: its filter rebuilt from
  /// the journaled `ops`, nothing sent. Returns why it cannot go on (its
  /// stream was not one an engine resumes), else "". Then: whole() says the
  /// answer is complete (end_restored sends what is left of its end), or
  /// submit it and an engine continues it from its last token.
  static std::string restore(Job& job, const std::vector<EngineOp>& ops);
  static bool whole(const Job& job);
  static void end_restored(Job& job);
  /// The filter for `job`'s stream on an engine that resumes `kind`, an
  /// Anthropic stream sent as chat when `as_chat`; returns the request to
  /// send (asking the generated ids). The same for a restored job.
  static EngineRequest resumable_request(Job& job, ResumeKind kind, bool as_chat);
  /// A change to the job's stream, through its sink (journaled), or applied
  /// alone. apply_op: the change itself; `deliver` false sends nothing.
  static void engine_op(Job& job, EngineOp op);
  static void apply_op(Job& job, const EngineOp& op, bool deliver);

 private:
  struct Block {
    uint64_t generation = 0;
    std::chrono::steady_clock::time_point until{};
    Duration delay{};
  };
  void pump();
  void start(const std::shared_ptr<Job>& job, const sup::WorkerInfo& w);
  void on_event(const std::shared_ptr<Job>& job, proto::Event&& e);
  void start_forward(const std::shared_ptr<Job>& job, const sup::WorkerInfo& w);
  void on_engine_broken(const std::shared_ptr<Job>& job, const std::string& why, bool replay);
  bool engine_probed(const sup::WorkerInfo& w);
  void start_resume(const std::shared_ptr<Job>& job, const sup::WorkerInfo& w);
  void fill_holes(const std::shared_ptr<Job>& job, int port);
  void send_continuation(const std::shared_ptr<Job>& job, int port);
  void fail_forward(const std::shared_ptr<Job>& job, const std::string& message);
  /// The engine's stream (as the resume filter passed it) on to the client,
  /// in Anthropic's events when the job was sent as chat.
  static void to_client(Job& job, std::string_view bytes);
  void on_broken(const std::shared_ptr<Job>& job, const std::string& why, bool answered);
  void requeue_front(const std::shared_ptr<Job>& job);
  void enqueue_timer(const std::shared_ptr<Job>& job);
  void leave_worker(const std::shared_ptr<Job>& job);
  void finish(const std::shared_ptr<Job>& job, JobResult r);
  void notify_positions(bool force);
  void arm_notices();
  void arm_retry();
  void remember(int worker, const Job& job);

  boost::asio::io_context& io_;
  sup::WorkerRegistry& registry_;
  SchedulerOptions opt_;
  std::deque<std::shared_ptr<Job>> queue_;
  std::map<Job*, std::shared_ptr<Job>> running_;
  std::map<int, int64_t> in_flight_;
  std::map<int, Block> blocked_;
  std::map<int, std::deque<std::vector<int32_t>>> history_;
  struct EngineState {
    uint64_t generation = 0;
    EngineCaps caps;
    bool probing = false;
  };
  std::map<int, EngineState> engines_;  // exec engines' probed caps, per worker and start
  boost::asio::steady_timer notice_timer_;
  boost::asio::steady_timer retry_timer_;
  bool notices_armed_ = false;
  bool pumping_ = false;
  uint64_t next_seq_ = 1;
  SchedulerCounters counters_;
  WorkerPool pool_;
  std::shared_ptr<bool> alive_;
  std::vector<sup::WorkerInfo> workers_;  // the registry's list, read again at each change it reports
  std::vector<Candidate> candidates_;     // pump's, kept for its capacity
};

}  // namespace ds4::proxy
