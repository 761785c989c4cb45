#pragma once
/// A fixed pool of threads for the forward pass. run(fn) calls fn(i, n) on n
/// threads (the caller is thread 0) and returns when all are done. Workers spin
/// briefly between jobs, then sleep on an atomic wait, so a decode step of a
/// hundred small jobs costs microseconds of synchronisation, and an idle worker
/// costs nothing.

#include <atomic>
#include <cstdint>
#include <functional>
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

/// Splits [0, n) into `parts` ranges on multiples of `grain`; returns part i.
inline std::pair<int64_t, int64_t> split_range(int64_t n, int64_t grain, int i, int parts) {
  const int64_t units = (n + grain - 1) / grain;
  const int64_t u0 = units * i / parts, u1 = units * (i + 1) / parts;
  return {std::min(n, u0 * grain), std::min(n, u1 * grain)};
}

}  // namespace ds4::cpu
