// Greedy sampling on the device (sampling.cuh): each logit row is cut into
// kSplits chunks, one block each, so that the pick reads the vocabulary with
// the whole GPU (one block a row, a 128K vocabulary took ~190 us of a ~4.3 ms
// 8B decode step, its double exponentials on one multiprocessor); a warp per
// row then merges the chunks.
#include "worker/cuda/sampling.cuh"

#include <cstdint>

namespace ds4::cuda {
namespace {

constexpr int kPickThreads = 256;
constexpr int kSplits = 64;  // chunks of a row

struct Best {
  float logit;
  int32_t id;
};

// A chunk's best and sum(exp(l - its best)) in double.
struct Partial {
  Best best;
  double sum;
};

// The host sampler's order: higher logit first, then the lower id.
__device__ __forceinline__ bool better(Best a, Best b) { return a.logit > b.logit || (a.logit == b.logit && a.id < b.id); }

__device__ __forceinline__ float clean(float x) { return isnan(x) ? -INFINITY : x; }

__device__ __forceinline__ Best warp_best(Best b) {
  for (int off = 16; off > 0; off >>= 1) {
    const Best o{__shfl_xor_sync(0xffffffffu, b.logit, off), __shfl_xor_sync(0xffffffffu, b.id, off)};
    if (better(o, b)) b = o;
  }
  return b;
}

__device__ __forceinline__ double warp_sum(double s) {
  for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
  return s;
}

// grid (kSplits, rows): chunk blockIdx.x of row blockIdx.y.
__global__ void __launch_bounds__(kPickThreads) pick_chunks_kernel(const float* logits, int64_t n, int64_t ld,
                                                                  Partial* partials) {
  pdl_wait();
  pdl_trigger();
  const float* row = logits + int64_t(blockIdx.y) * ld;
  const int64_t chunk = (n + kSplits - 1) / kSplits;
  const int64_t lo = int64_t(blockIdx.x) * chunk, hi = lo + chunk < n ? lo + chunk : n;
  __shared__ Best s_best[kPickThreads / 32];
  __shared__ double s_sum[kPickThreads / 32];
  __shared__ Best s_win;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  Best b{-INFINITY, INT32_MAX};
  for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    const Best c{clean(row[i]), int32_t(i)};
    if (better(c, b)) b = c;
  }
  b = warp_best(b);
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
  double sum = 0;
  if (isfinite(win.logit))
    for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) sum += exp(double(clean(row[i])) - double(win.logit));
  sum = warp_sum(sum);
  if (lane == 0) s_sum[warp] = sum;
  __syncthreads();
  if (threadIdx.x == 0) {
    double total = 0;
    for (int i = 0; i < kPickThreads / 32; ++i) total += s_sum[i];
    partials[int64_t(blockIdx.y) * kSplits + blockIdx.x] = {win, total};
  }
}

// grid (rows), one warp: the row's best of its chunks' bests, and
// log(sum(exp(l - max))) + max as the host's log_sum_exp (an infinite
// maximum is its own normaliser there too).
__global__ void merge_picks_kernel(const Partial* partials, GreedyPick* out, double* lse_out) {
  pdl_wait();
  pdl_trigger();
  const Partial* p = partials + int64_t(blockIdx.x) * kSplits;
  Best b{-INFINITY, INT32_MAX};
  for (int j = threadIdx.x; j < kSplits; j += 32)
    if (better(p[j].best, b)) b = p[j].best;
  b = warp_best(b);
  double sum = 0;
  if (isfinite(b.logit))
    for (int j = threadIdx.x; j < kSplits; j += 32)
      if (isfinite(p[j].best.logit)) sum += p[j].sum * exp(double(p[j].best.logit) - double(b.logit));
  sum = warp_sum(sum);
  if (threadIdx.x == 0) {
    const double lse = isfinite(b.logit) ? double(b.logit) + log(sum) : double(b.logit);
    const int32_t id = b.id == INT32_MAX ? 0 : b.id;
    out[blockIdx.x] = {id, float(double(b.logit) - lse)};
    if (lse_out) lse_out[blockIdx.x] = lse;
  }
}

__global__ void add_to_logits_kernel(float* logits, int64_t ld, const LogitAdjust* adds, int n) {
  pdl_wait();
  pdl_trigger();
  const int i = int(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) logits[int64_t(adds[i].row) * ld + adds[i].token] += adds[i].delta;
}

}  // namespace

void add_to_logits(float* logits, int64_t ld, const LogitAdjust* adds, int n, cudaStream_t s) {
  if (n <= 0) return;
  constexpr int kThreads = 256;
  launch(add_to_logits_kernel, dim3(unsigned((n + kThreads - 1) / kThreads)), dim3(kThreads), s, logits, ld, adds, n);
}

size_t greedy_scratch_bytes(int rows) { return size_t(rows > 0 ? rows : 0) * kSplits * sizeof(Partial); }

void greedy_pick(const float* logits, int64_t n, int64_t ld, int rows, GreedyPick* out, void* scratch,
                 cudaStream_t s, double* lse) {
  if (rows <= 0) return;
  auto* partials = static_cast<Partial*>(scratch);
  launch(pick_chunks_kernel, dim3(unsigned(kSplits), unsigned(rows)), dim3(kPickThreads), s, logits, n, ld, partials);
  launch(merge_picks_kernel, dim3(unsigned(rows)), dim3(32), s, static_cast<const Partial*>(partials), out, lse);
}

namespace {

// A logit and its id as one key that orders as the host ranks: the float's
// bits made monotonic above, 2^32 - 1 - id below (the lower id the larger
// key). NaN counts as -inf and -0 as +0, as the host's comparisons do. Key
// 0 is below every logit's: it pads a short block.
__device__ __forceinline__ uint64_t rank_key(float x, uint32_t id) {
  const uint32_t bits = __float_as_uint(clean(x) + 0.0f);
  const uint32_t u = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
  return (uint64_t(u) << 32) | (0xffffffffu - id);
}

__device__ __forceinline__ LogitCandidate from_key(uint64_t key) {
  const uint32_t u = uint32_t(key >> 32);
  const uint32_t bits = (u & 0x80000000u) ? (u & 0x7fffffffu) : ~u;
  return {__uint_as_float(bits), int32_t(0xffffffffu - uint32_t(key))};
}

// Sorts the N keys of `k` (shared memory) largest first, blockDim.x threads.
template <int N>
__device__ void sort_keys_descending(uint64_t* k) {
  for (int size = 2; size <= N; size <<= 1)
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int i = threadIdx.x; i < N; i += blockDim.x) {
        const int j = i ^ stride;
        if (j <= i) continue;
        const bool down = (i & size) == 0;  // this run goes largest first
        const uint64_t a = k[i], b = k[j];
        if (down ? a < b : a > b) {
          k[i] = b;
          k[j] = a;
        }
      }
      __syncthreads();
    }
}

constexpr int kTopThreads = 256;
constexpr int kMergeKeys = 4096;  // a row's merge sorts its best so far with 63 blocks' best at a time
constexpr int kMergeThreads = 1024;
static_assert(kMergeKeys % kCudaTopLogits == 0 && kMergeKeys > 2 * kCudaTopLogits, "merge groups");

int top_blocks(int64_t n) { return int((n + kCudaTopChunk - 1) / kCudaTopChunk); }

// grid (blocks, rows): block blockIdx.x's kCudaTopLogits best keys of row blockIdx.y.
__global__ void __launch_bounds__(kTopThreads) top_blocks_kernel(const float* logits, int64_t n, int64_t ld,
                                                                uint64_t* keys) {
  pdl_wait();
  pdl_trigger();
  __shared__ uint64_t k[kCudaTopChunk];
  const float* row = logits + int64_t(blockIdx.y) * ld;
  const int64_t lo = int64_t(blockIdx.x) * kCudaTopChunk;
  for (int i = threadIdx.x; i < kCudaTopChunk; i += blockDim.x)
    k[i] = lo + i < n ? rank_key(row[lo + i], uint32_t(lo + i)) : 0;
  __syncthreads();
  sort_keys_descending<kCudaTopChunk>(k);
  uint64_t* out = keys + (int64_t(blockIdx.y) * gridDim.x + blockIdx.x) * kCudaTopLogits;
  for (int i = threadIdx.x; i < kCudaTopLogits; i += blockDim.x) out[i] = k[i];
}

// grid (rows): the row's best of its blocks' best, a group of blocks at a time.
__global__ void __launch_bounds__(kMergeThreads) merge_top_kernel(const uint64_t* keys, int blocks, int64_t n,
                                                                 const double* lse, TopLogits* out) {
  pdl_wait();
  pdl_trigger();
  __shared__ uint64_t k[kMergeKeys];
  const uint64_t* row = keys + int64_t(blockIdx.x) * blocks * kCudaTopLogits;
  const int total = blocks * kCudaTopLogits;
  for (int i = threadIdx.x; i < kCudaTopLogits; i += blockDim.x) k[i] = 0;
  for (int from = 0; from < total; from += kMergeKeys - kCudaTopLogits) {
    for (int i = kCudaTopLogits + threadIdx.x; i < kMergeKeys; i += blockDim.x) {
      const int at = from + i - kCudaTopLogits;
      k[i] = at < total ? row[at] : 0;
    }
    __syncthreads();
    sort_keys_descending<kMergeKeys>(k);  // the best so far stay in front
  }
  TopLogits& o = out[blockIdx.x];
  for (int i = threadIdx.x; i < kCudaTopLogits; i += blockDim.x) o.best[i] = from_key(k[i]);
  if (threadIdx.x == 0) {
    o.lse = lse[blockIdx.x];
    o.count = int32_t(n < kCudaTopLogits ? n : kCudaTopLogits);
    o.unused = 0;
  }
}

}  // namespace

size_t top_scratch_bytes(int rows, int64_t n) {
  return size_t(rows > 0 ? rows : 0) * size_t(top_blocks(n)) * kCudaTopLogits * sizeof(uint64_t);
}

void top_logits(const float* logits, int64_t n, int64_t ld, int rows, const double* lse, TopLogits* out,
                void* scratch, cudaStream_t s) {
  if (rows <= 0) return;
  auto* keys = static_cast<uint64_t*>(scratch);
  const int blocks = top_blocks(n);
  launch(top_blocks_kernel, dim3(unsigned(blocks), unsigned(rows)), dim3(kTopThreads), s, logits, n, ld, keys);
  launch(merge_top_kernel, dim3(unsigned(rows)), dim3(kMergeThreads), s, static_cast<const uint64_t*>(keys), blocks, n,
         lse, out);
}

}  // namespace ds4::cuda
