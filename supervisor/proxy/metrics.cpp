#include "supervisor/proxy/metrics.h"

#include <sstream>

#include "supervisor/proxy/router.h"

namespace ds4::proxy {

namespace {
constexpr int64_t kRateWindow = 10;  // seconds behind ds4_tokens_per_second
// Upper bounds of ds4_request_duration_seconds's buckets: a short answer on
// a small model to a long one on a big model.
constexpr double kLatencyBuckets[] = {0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600};

int64_t now_s() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

void Metrics::add_tokens_out(int64_t n) {
  tokens_out_ += n;
  const int64_t s = now_s();
  if (per_second_.empty() || per_second_.back().first != s) per_second_.emplace_back(s, 0);
  per_second_.back().second += n;
  while (per_second_.front().first < s - kRateWindow) per_second_.pop_front();
}

void Metrics::observe_answer(double seconds) {
  ++answered_;
  answer_seconds_sum_ += seconds;
  if (answer_buckets_.empty()) answer_buckets_.assign(std::size(kLatencyBuckets), 0);
  for (size_t i = 0; i < std::size(kLatencyBuckets); ++i)
    if (seconds <= kLatencyBuckets[i]) ++answer_buckets_[i];
  recent_latency_.push_back(seconds);
  while (recent_latency_.size() > sup::ProxyActivity::kRecentLatencies) recent_latency_.pop_front();
}

void Metrics::fill(sup::ProxyActivity& a) const {
  a.generated_tokens = tokens_out_;
  a.answered = answered_;
  a.recent_latency_s.assign(recent_latency_.begin(), recent_latency_.end());
}

std::string Metrics::render(const std::vector<sup::WorkerInfo>& workers, const Scheduler& sched) const {
  std::ostringstream o;
  auto head = [&](const char* name, const char* type, const char* help) {
    o << "# HELP " << name << ' ' << help << "\n# TYPE " << name << ' ' << type << '\n';
  };
  head("ds4_http_requests_total", "counter", "HTTP answers by status code.");
  for (auto& [status, n] : by_status_) o << "ds4_http_requests_total{code=\"" << status << "\"} " << n << '\n';
  head("ds4_http_errors_total", "counter", "HTTP answers with status 400 or above, by status code.");
  for (auto& [status, n] : by_status_)
    if (status >= 400) o << "ds4_http_errors_total{code=\"" << status << "\"} " << n << '\n';

  const SchedulerCounters& c = sched.counters();
  head("ds4_queue_waiting", "gauge", "Requests waiting for a worker.");
  o << "ds4_queue_waiting " << sched.waiting() << '\n';
  head("ds4_requests_in_flight", "gauge", "Requests running on a worker.");
  o << "ds4_requests_in_flight " << sched.running() << '\n';
  head("ds4_queue_wait_seconds", "summary", "Time requests waited before their first worker.");
  o << "ds4_queue_wait_seconds_sum " << c.wait_seconds_sum << "\nds4_queue_wait_seconds_count " << c.dispatched << '\n';
  head("ds4_queue_wait_seconds_max", "gauge", "Longest wait before a first worker.");
  o << "ds4_queue_wait_seconds_max " << c.wait_seconds_max << '\n';
  head("ds4_queue_rejected_total", "counter", "Requests refused because the queue was full (503).");
  o << "ds4_queue_rejected_total " << c.rejected_full << '\n';
  head("ds4_queue_timeouts_total", "counter", "Requests that reached queue.max_wait.");
  o << "ds4_queue_timeouts_total " << c.timeouts << '\n';
  head("ds4_resumes_total", "counter", "Requests moved to another worker mid-answer.");
  o << "ds4_resumes_total " << c.resumes << '\n';
  head("ds4_worker_calls_broken_total", "counter", "Calls to workers that broke (the worker died, closed its connection or broke the protocol): each moves back to the queue.");
  o << "ds4_worker_calls_broken_total " << c.broken_calls << '\n';
  head("ds4_worker_connections_opened_total", "counter",
       "Connections opened to workers (one per worker process, shared by all its calls).");
  o << "ds4_worker_connections_opened_total " << sched.pool().opened() << '\n';
  head("ds4_prompt_tokens_total", "counter", "Prompt tokens received.");
  o << "ds4_prompt_tokens_total " << tokens_in_ << '\n';
  head("ds4_prompt_tokens_cached_total", "counter",
       "Prompt tokens taken from a slot's cache (a repeated prefix: an agent's next turn) instead of computed.");
  o << "ds4_prompt_tokens_cached_total " << tokens_cached_ << '\n';
  head("ds4_generated_tokens_total", "counter", "Tokens generated for clients.");
  o << "ds4_generated_tokens_total " << tokens_out_ << '\n';
  head("ds4_tokens_per_second", "gauge", "Generated tokens per second over the last 10 s.");
  int64_t recent = 0;
  const int64_t s = now_s();
  for (auto& [sec, n] : per_second_)
    if (sec >= s - kRateWindow && sec < s) recent += n;
  o << "ds4_tokens_per_second " << double(recent) / double(kRateWindow) << '\n';

  head("ds4_request_duration_seconds", "histogram",
       "Generation requests answered in full: seconds from the request read to the last byte of the answer.");
  for (size_t i = 0; i < std::size(kLatencyBuckets); ++i)
    o << "ds4_request_duration_seconds_bucket{le=\"" << kLatencyBuckets[i] << "\"} "
      << (answer_buckets_.empty() ? 0 : answer_buckets_[i]) << '\n';
  o << "ds4_request_duration_seconds_bucket{le=\"+Inf\"} " << answered_ << '\n';
  o << "ds4_request_duration_seconds_sum " << answer_seconds_sum_ << "\nds4_request_duration_seconds_count "
    << answered_ << '\n';

  const sup::ProxyStats st = sched.stats();
  head("ds4_worker_context", "gauge", "Context (tokens per slot) of each worker.");
  for (auto& w : workers) o << "ds4_worker_context{worker=\"" << w.id << "\"} " << w.context << '\n';
  head("ds4_worker_host_expert_layers", "gauge",
       "Expert rung of each worker: the first layers whose experts the CPU computes (workers.moe_offload).");
  for (auto& w : workers) o << "ds4_worker_host_expert_layers{worker=\"" << w.id << "\"} " << w.host_experts << '\n';
  head("ds4_worker_kv_cache_q8", "gauge",
       "KV cache rung of each worker: 1 when it keeps its cache in q8_0, 0 in f16 (workers.kv_cache).");
  for (auto& w : workers) o << "ds4_worker_kv_cache_q8{worker=\"" << w.id << "\"} " << (w.kv_cache == "q8_0") << '\n';
  head("ds4_worker_slots", "gauge", "Slots of each worker.");
  for (auto& w : workers) o << "ds4_worker_slots{worker=\"" << w.id << "\"} " << w.slots << '\n';
  head("ds4_worker_in_flight", "gauge", "Requests running on each worker.");
  for (auto& w : workers) {
    auto it = st.in_flight_by_worker.find(w.id);
    o << "ds4_worker_in_flight{worker=\"" << w.id << "\"} " << (it == st.in_flight_by_worker.end() ? 0 : it->second) << '\n';
  }
  head("ds4_worker_state", "gauge", "1 for each worker's current state.");
  static constexpr sup::WorkerState kStates[] = {sup::WorkerState::starting, sup::WorkerState::ready,
                                                 sup::WorkerState::draining, sup::WorkerState::restarting,
                                                 sup::WorkerState::backoff, sup::WorkerState::stopped};
  for (auto& w : workers)
    for (auto state : kStates)
      o << "ds4_worker_state{worker=\"" << w.id << "\",state=\"" << sup::state_name(state) << "\"} "
        << (w.state == state ? 1 : 0) << '\n';
  head("ds4_worker_restarts_total", "counter", "Restarts of each worker.");
  for (auto& w : workers) o << "ds4_worker_restarts_total{worker=\"" << w.id << "\"} " << w.restarts << '\n';
  head("ds4_worker_oom_kills_total", "counter", "OOM kills of each worker.");
  for (auto& w : workers) o << "ds4_worker_oom_kills_total{worker=\"" << w.id << "\"} " << w.oom_kills << '\n';
  head("ds4_worker_decisions_total", "counter",
       "Policy decisions for each worker, by event (downgrade, upgrade, hang, backoff, ...).");
  for (auto& w : workers)
    for (const char* event : sup::kDecisionEvents) {
      auto it = w.decisions.find(event);
      o << "ds4_worker_decisions_total{worker=\"" << w.id << "\",event=\"" << event << "\"} "
        << (it == w.decisions.end() ? 0 : it->second) << '\n';
    }
  return o.str();
}

}  // namespace ds4::proxy
