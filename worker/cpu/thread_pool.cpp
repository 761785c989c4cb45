#include "worker/cpu/thread_pool.h"

#include <immintrin.h>

#include <algorithm>

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

RangeQueues::RangeQueues(std::span<const int64_t> starts, int64_t n) {
  n_ranges_ = int(starts.size());
  ranges_ = std::make_unique<Range[]>(starts.size());
  for (int i = 0; i < n_ranges_; ++i) {
    const int64_t lo = std::min(starts[size_t(i)], n), hi = i + 1 < n_ranges_ ? std::min(starts[size_t(i) + 1], n) : n;
    ranges_[i].fb.store(uint64_t(uint32_t(lo)) | uint64_t(uint32_t(std::max(lo, hi))) << 32,
                        std::memory_order_relaxed);
  }
}

bool RangeQueues::take_front(Range& r, int64_t& item) {
  uint64_t v = r.fb.load(std::memory_order_relaxed);
  for (;;) {
    const uint32_t f = uint32_t(v), b = uint32_t(v >> 32);
    if (f >= b) return false;
    if (r.fb.compare_exchange_weak(v, v + 1, std::memory_order_relaxed)) {
      item = f;
      return true;
    }
  }
}

bool RangeQueues::take_back(Range& r, int64_t& item) {
  uint64_t v = r.fb.load(std::memory_order_relaxed);
  for (;;) {
    const uint32_t f = uint32_t(v), b = uint32_t(v >> 32);
    if (f >= b) return false;
    if (r.fb.compare_exchange_weak(v, uint64_t(f) | uint64_t(b - 1) << 32, std::memory_order_relaxed)) {
      item = b - 1;
      return true;
    }
  }
}

int64_t RangeQueues::take(int i) {
  int64_t item = -1;
  if (i < n_ranges_ && take_front(ranges_[i], item)) return item;
  for (int k = 1; k < n_ranges_; ++k)
    if (take_back(ranges_[(i + k) % n_ranges_], item)) return item;
  return -1;
}

}  // namespace ds4::cpu
