#include "worker/cpu/thread_pool.h"

#include <immintrin.h>

namespace ds4::cpu {

ThreadPool::ThreadPool(int threads) : n_(threads < 1 ? 1 : threads) {
  for (int i = 1; i < n_; ++i) threads_.emplace_back([this, i] { worker(i); });
}

ThreadPool::~ThreadPool() {
  stop_.store(true);
  generation_.fetch_add(1, std::memory_order_release);
  generation_.notify_all();
  for (auto& t : threads_) t.join();
}

void ThreadPool::run(const std::function<void(int, int)>& fn) {
  if (n_ == 1) return fn(0, 1);
  job_ = &fn;
  pending_.store(n_ - 1, std::memory_order_relaxed);
  generation_.fetch_add(1, std::memory_order_release);
  generation_.notify_all();
  fn(0, n_);
  while (pending_.load(std::memory_order_acquire) != 0) _mm_pause();
}

void ThreadPool::worker(int id) {
  uint64_t seen = 0;
  for (;;) {
    // Spin a little: jobs of one forward pass follow each other closely.
    uint64_t gen = generation_.load(std::memory_order_acquire);
    for (int spin = 0; gen == seen && spin < 20000; ++spin) {
      _mm_pause();
      gen = generation_.load(std::memory_order_acquire);
    }
    while (gen == seen) {
      generation_.wait(seen, std::memory_order_acquire);
      gen = generation_.load(std::memory_order_acquire);
    }
    seen = gen;
    if (stop_.load()) return;
    (*job_)(id, n_);
    pending_.fetch_sub(1, std::memory_order_acq_rel);
  }
}

}  // namespace ds4::cpu
