// Greedy sampling on the device (sampling.cuh): one block per logit row.
#include "worker/cuda/sampling.cuh"

#include <cstdint>

namespace ds4::cuda {
namespace {

constexpr int kPickThreads = 512;

struct Best {
  float logit;
  int32_t id;
};

// The host sampler's order: higher logit first, then the lower id.
__device__ __forceinline__ bool better(Best a, Best b) { return a.logit > b.logit || (a.logit == b.logit && a.id < b.id); }

__device__ __forceinline__ float clean(float x) { return isnan(x) ? -INFINITY : x; }

__global__ void greedy_kernel(const float* logits, int64_t n, int64_t ld, GreedyPick* out) {
  pdl_wait();
  pdl_trigger();
  const float* row = logits + int64_t(blockIdx.x) * ld;
  __shared__ Best s_best[kPickThreads / 32];
  __shared__ double s_sum[kPickThreads / 32];
  __shared__ Best s_win;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  Best b{-INFINITY, INT32_MAX};
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const Best c{clean(row[i]), int32_t(i)};
    if (better(c, b)) b = c;
  }
  for (int off = 16; off > 0; off >>= 1) {
    const Best o{__shfl_xor_sync(0xffffffffu, b.logit, off), __shfl_xor_sync(0xffffffffu, b.id, off)};
    if (better(o, b)) b = o;
  }
  if (lane == 0) s_best[warp] = b;
  __syncthreads();
  if (threadIdx.x == 0) {
    Best w = s_best[0];
    for (int i = 1; i < kPickThreads / 32; ++i)
      if (better(s_best[i], w)) w = s_best[i];
    s_win = w;
  }
  __syncthreads();
  const Best win = s_win;
  // log(sum(exp(l - max))) + max, as the host's log_sum_exp; an infinite
  // maximum is its own normaliser there too.
  double sum = 0;
  if (isfinite(win.logit))
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) sum += exp(double(clean(row[i])) - double(win.logit));
  for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  if (lane == 0) s_sum[warp] = sum;
  __syncthreads();
  if (threadIdx.x == 0) {
    double total = 0;
    for (int i = 0; i < kPickThreads / 32; ++i) total += s_sum[i];
    const double lse = isfinite(win.logit) ? double(win.logit) + log(total) : double(win.logit);
    const int32_t id = win.id == INT32_MAX ? 0 : win.id;
    out[blockIdx.x] = {id, float(double(win.logit) - lse)};
  }
}

}  // namespace

void greedy_pick(const float* logits, int64_t n, int64_t ld, int rows, GreedyPick* out, cudaStream_t s) {
  if (rows <= 0) return;
  launch(greedy_kernel, dim3(unsigned(rows)), dim3(kPickThreads), s, logits, n, ld, out);
}

}  // namespace ds4::cuda
