#pragma once
/// A fixed pool of threads for the forward pass. run(fn) calls fn(i, n) on n
/// threads (the caller is thread 0) and returns when all are done. Workers spin
/// briefly between jobs, then sleep on an atomic wait, so a decode step of a
/// hundred small jobs costs microseconds of synchronisation, and an idle worker
/// costs nothing.

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <thread>
#include <vector>

namespace ds4::cpu {

class ThreadPool {
 public:
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_; }
  void run(const std::function<void(int thread, int threads)>& fn);

 private:
  void worker(int id);

  int n_;
  std::vector<std::thread> threads_;
  const std::function<void(int, int)>* job_ = nullptr;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<bool> stop_{false};
};

/// Items [0, n) of one parallel job in contiguous ranges, one per thread:
/// each thread takes its own range front to back, then takes what is left of
/// the others' from their back ends. A thread thus walks one run of
/// consecutive items (one stream of weights, which the hardware prefetcher
/// follows: interleaved chunks are several short streams a thread), and one
/// that is descheduled or slower leaves the rest of its range to the others.
/// Every item is taken exactly once.
class RangeQueues {
 public:
  /// Thread i's range starts at starts[i] (non-decreasing, starts[0] = 0) and
  /// ends where the next one starts, the last one at n (all cut at n).
  RangeQueues(std::span<const int64_t> starts, int64_t n);
  /// The next item for thread i, or -1 when none is left anywhere.
  int64_t take(int i);

 private:
  struct alignas(64) Range {
    std::atomic<uint64_t> fb{0};  // front (low 32 bits) and back (high 32 bits), front <= back
  };
  static bool take_front(Range& r, int64_t& item);
  static bool take_back(Range& r, int64_t& item);
  std::unique_ptr<Range[]> ranges_;
  int n_ranges_ = 0;
};

/// Splits [0, n) into `parts` ranges on multiples of `grain`; returns part i.
inline std::pair<int64_t, int64_t> split_range(int64_t n, int64_t grain, int i, int parts) {
  const int64_t units = (n + grain - 1) / grain;
  const int64_t u0 = units * i / parts, u1 = units * (i + 1) / parts;
  return {std::min(n, u0 * grain), std::min(n, u1 * grain)};
}

}  // namespace ds4::cpu
