#pragma once
/// /metrics in Prometheus text format (version 0.0.4): HTTP answers by
/// status, queue depth and wait, tokens in and out, tokens/s over the last
/// 10 s, the latency of answered requests (a histogram), and per-worker context, slots, state, restarts and OOM kills from the
/// registry.

#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <string>
#include <vector>

#include "shared/worker_registry.h"
#include "supervisor/proxy/scheduler.h"

namespace ds4::proxy {

class Metrics {
 public:
  void count(int status) { ++by_status_[status]; }
  void add_tokens_in(int64_t n) { tokens_in_ += n; }
  /// Prompt tokens a worker took from a slot's cache instead of computing them.
  void add_tokens_cached(int64_t n) { tokens_cached_ += n; }
  void add_tokens_out(int64_t n);
  /// A generation request answered in full, `seconds` after it was read.
  void observe_answer(double seconds);
  /// The totals and recent latencies the status page samples.
  void fill(sup::ProxyActivity& a) const;
  std::string render(const std::vector<sup::WorkerInfo>& workers, const Scheduler& sched) const;

 private:
  std::map<int, int64_t> by_status_;
  int64_t tokens_in_ = 0;
  int64_t tokens_cached_ = 0;
  int64_t tokens_out_ = 0;
  int64_t answered_ = 0;
  double answer_seconds_sum_ = 0;
  std::vector<int64_t> answer_buckets_;  // cumulative counts, one per kLatencyBuckets bound
  std::deque<double> recent_latency_;    // newest last, at most ProxyActivity::kRecentLatencies
  mutable std::deque<std::pair<int64_t, int64_t>> per_second_;  // (second, tokens)
};

}  // namespace ds4::proxy
