// Element-wise and attention kernels of the CUDA backend. Each mirrors one
// step of the CPU reference forward pass (worker/cpu/cpu_backend.cpp).
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>

#include "worker/cuda/kernels.cuh"
#include "worker/cuda/mma.cuh"
#include "worker/cuda/quant.cuh"

namespace ds4::cuda {
namespace {

constexpr int kThreads = 256;

__device__ float load_weight(const DeviceWeight& w, int64_t row, int64_t i) {
  switch (w.type) {
    case GgmlType::F32: return static_cast<const float*>(w.data)[row * w.cols + i];
    case GgmlType::F16: return __half2float(static_cast<const __half*>(w.data)[row * w.cols + i]);
    case GgmlType::BF16: return __bfloat162float(static_cast<const __nv_bfloat16*>(w.data)[row * w.cols + i]);
    case GgmlType::Q8_0:
      return float(static_cast<const int8_t*>(w.data)[row * w.cols + i]) *
             __half2float(w.scales[row * (w.cols / 32) + i / 32]);
    default: return 0.0f;
  }
}

__global__ void embed_kernel(DeviceWeight table, const BatchToken* batch, float* x, int64_t ldx) {
  pdl_wait();
  pdl_trigger();
  const int t = blockIdx.x;
  const int64_t row = batch[t].token;
  for (int64_t i = threadIdx.x; i < table.cols; i += blockDim.x) x[t * ldx + i] = load_weight(table, row, i);
}

template <typename T>
__device__ T block_sum(T v, T* shared) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  T total = 0;
  for (int w = 0; w < int(blockDim.x / 32); ++w) total += shared[w];
  __syncthreads();
  return total;
}

__global__ void rmsnorm_kernel(const float* x, int64_t ldx, const float* g, int64_t n, float eps, float* out,
                               int64_t ldo) {
  __shared__ double partial[32];
  pdl_wait();
  pdl_trigger();
  const int t = blockIdx.x;
  const float* xr = x + t * ldx;
  double sum = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) sum += double(xr[i] * xr[i]);
  sum = block_sum(sum, partial);
  const float mean = float(sum / double(n));
  const float scale = 1.0f / sqrtf(mean + eps);
  float* o = out + t * ldo;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) o[i] = (xr[i] * scale) * g[i];
}

// One job a thread: a pair of q or k (rotated when it is among the first
// n_rot / 2 pairs of its head; k then stored as f16), or a pair of v to store.
// Pair i of a head is values (2i, 2i + 1), or for NEOX (i, i + n_rot/2) while
// it is rotated; the values past n_rot are left as they are (stored for k).
__global__ void rope_store_kernel(float* q, int64_t ldq, float* k, const float* v, int64_t ldkv,
                                  const BatchToken* batch, RopeArgs a, __half* kc, __half* vc) {
  pdl_wait();
  pdl_trigger();
  const int t = blockIdx.y;
  const BatchToken b = batch[t];
  const int pairs = a.n_rot / 2, half_hd = a.head_dim / 2;
  const int n_k = k ? a.n_kv_heads : 0, n_v = v ? a.n_kv_heads : 0;
  const int qk_jobs = (a.n_heads + n_k) * half_hd, jobs = qk_jobs + n_v * half_hd;
  const int64_t at = (int64_t(b.slot) * a.ctx + b.pos) * int64_t(a.n_kv_heads) * a.head_dim;
  for (int job = blockIdx.x * blockDim.x + threadIdx.x; job < jobs; job += gridDim.x * blockDim.x) {
    if (job >= qk_jobs) {
      const int64_t e = 2 * int64_t(job - qk_jobs);
      vc[at + e] = __float2half_rn(v[t * ldkv + e]);
      vc[at + e + 1] = __float2half_rn(v[t * ldkv + e + 1]);
      continue;
    }
    const int h = job / half_hd, i = job % half_hd;
    const bool is_q = h < a.n_heads;
    float* row = is_q ? q + t * ldq + int64_t(h) * a.head_dim : k + t * ldkv + int64_t(h - a.n_heads) * a.head_dim;
    const bool rotated = i < pairs;
    const int i0 = rotated && a.neox ? i : 2 * i, i1 = rotated && a.neox ? i + pairs : 2 * i + 1;
    float x0 = row[i0], x1 = row[i1];
    if (rotated) {
      // theta_i = pos * scale^i, by the same repeated multiplication as the CPU.
      float theta = float(b.pos);
      for (int j = 0; j < i; ++j) theta *= a.theta_scale;
      const float angle = a.freq_scale * (a.freq_factors ? theta / a.freq_factors[i] : theta);
      const float c = cosf(angle), s = sinf(angle);
      const float r0 = x0 * c - x1 * s, r1 = x0 * s + x1 * c;
      x0 = r0;
      x1 = r1;
      row[i0] = x0;
      row[i1] = x1;
    }
    if (!is_q && kc) {
      const int64_t e = int64_t(h - a.n_heads) * a.head_dim;
      kc[at + e + i0] = __float2half_rn(x0);
      kc[at + e + i1] = __float2half_rn(x1);
    }
  }
}

// One block a (token, head): RMSNorm of the head's n values.
__global__ void head_norm_kernel(float* x, int64_t ldx, int heads, int64_t n, const float* g, float eps) {
  __shared__ double partial[32];
  pdl_wait();
  pdl_trigger();
  const int t = blockIdx.x / heads, h = blockIdx.x % heads;
  float* xr = x + t * ldx + int64_t(h) * n;
  double sum = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) sum += double(xr[i] * xr[i]);
  sum = block_sum(sum, partial);
  const float mean = float(sum / double(n));
  const float scale = 1.0f / sqrtf(mean + eps);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) xr[i] = (xr[i] * scale) * g[i];
}

__global__ void add_bias_kernel(float* y, int64_t ldy, const float* b, int64_t n) {
  pdl_wait();
  pdl_trigger();
  const int t = blockIdx.y;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    y[t * ldy + i] += b[i];
}

// Attention. A block takes one (token, head, split): the positions of its
// split, in lane groups of G = head_dim / 8 lanes, each lane holding 8
// consecutive dimensions (one 16-byte load of K and of V per position). Each
// group keeps an online softmax (max, sum, weighted V); the block merges its
// groups into one result; a (token, head) whose positions span several
// splits gets partial results that the last of its blocks to finish merges.
constexpr int kAttnWarps = 8;
constexpr int kAttnUnroll = 4;  // positions a lane group loads before using them
// A split costs partial results, a fence, an arrival and a merge: worth it
// only for at least this many positions. H200, 8B, a token 4096 deep: 269.5
// tok/s with 128 (64: 268.5), 260.6 with 256; no change at 0, 8192, 16384.
constexpr int64_t kAttnSplitPositions = 128;
// The split kernel's scratch starts with arrival counters, one per (token,
// head), at the same place for every batch size, so nothing else ever writes
// them: zero when the scratch is allocated, set back to zero by each user.
// Splits are only asked for while tokens x heads < 4 x multiprocessors.
constexpr int kAttnCounters = 4096;

__device__ void load8(const __half* p, float (&f)[8]) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  const __half2* h = reinterpret_cast<const __half2*>(&u);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 v = __half22float2(h[j]);
    f[2 * j] = v.x;
    f[2 * j + 1] = v.y;
  }
}

// A layer's cached K or V as the attention kernels read it: load8(e, f)
// gives values e..e+7 (e a multiple of 8) as f32; stage8(dst, e, valid)
// puts them as f16 in shared memory at dst (zeros when !valid): by cp.async
// for f16 (visible after cp_async_wait_all() and a barrier), by the thread
// itself for q8_0 (after a barrier).
struct KvF16 {
  const __half* p;
  __device__ void load8(int64_t e, float (&f)[8]) const { ::ds4::cuda::load8(p + e, f); }
  __device__ void stage8(__half* dst, int64_t e, bool valid) const { cp_async16(dst, p + (valid ? e : 0), valid); }
};
struct KvQ8 {
  const int8_t* q;
  const __half* d;
  __device__ void load8(int64_t e, float (&f)[8]) const {
    const int2 u = *reinterpret_cast<const int2*>(q + e);
    const int8_t* b = reinterpret_cast<const int8_t*>(&u);
    const float s = __half2float(d[e / 32]);
#pragma unroll
    for (int j = 0; j < 8; ++j) f[j] = s * float(b[j]);
  }
  __device__ uint4 half8(int64_t e) const {
    float f[8];
    load8(e, f);
    uint4 r;
    __half2* h = reinterpret_cast<__half2*>(&r);
#pragma unroll
    for (int j = 0; j < 4; ++j) h[j] = __floats2half2_rn(f[2 * j], f[2 * j + 1]);
    return r;
  }
  __device__ void stage8(__half* dst, int64_t e, bool valid) const {
    *reinterpret_cast<uint4*>(dst) = valid ? half8(e) : make_uint4(0, 0, 0, 0);
  }
};

/// out[h * hd + d] for h < heads: the merge of `count` partial results of
/// each head (hd sums, max, sum of weights; hd + 2 floats apart), head h's at
/// p + h * head_stride, by the calling block's threads; `scratch`: 2 x heads
/// x count floats of shared memory. Every load is issued before its sum needs
/// it (the splits' maxima and sums first, all at once, then the values), so
/// the merge costs a few trips to L2, not one per split and head. Reads
/// through L2: other blocks wrote the partials.
__device__ void combine_heads(const float* p, int64_t head_stride, int hd, int count, int heads, float* out,
                              float* scratch) {
  float* sw = scratch;                  // [head][split]: the split's maximum, then its share of the weights
  float* sl = scratch + heads * count;  // [head][split]: the split's sum of weights
  for (int i = threadIdx.x; i < heads * count; i += blockDim.x) {
    const float* ps = p + (i / count) * head_stride + (i % count) * (hd + 2);
    sw[i] = __ldcg(ps + hd);
    sl[i] = __ldcg(ps + hd + 1);
  }
  __syncthreads();
  for (int h = threadIdx.x; h < heads; h += blockDim.x) {
    float* w = sw + h * count;
    float M = -INFINITY;
    for (int s = 0; s < count; ++s) M = fmaxf(M, w[s]);
    float L = 0.f;
    for (int s = 0; s < count; ++s) {
      w[s] = w[s] == -INFINITY ? 0.f : expf(w[s] - M);
      L += sl[h * count + s] * w[s];
    }
    const float inv = 1.0f / L;
    for (int s = 0; s < count; ++s) w[s] *= inv;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < heads * hd; e += blockDim.x) {
    const int h = e / hd, d = e % hd;
    const float* ph = p + h * head_stride + d;
    const float* w = sw + h * count;
    float A = 0.f;
#pragma unroll 8
    for (int s = 0; s < count; ++s) A = fmaf(__ldcg(ph + s * (hd + 2)), w[s], A);
    out[h * hd + d] = A;
  }
}

/// The end of a split block of the decode kernels: the last of the `active`
/// split blocks of (token t, heads h0..h0 + heads) to finish merges their
/// partial results into out (combine_heads, `scratch` as its), and sets the
/// arrival counter (head h0's) back to zero for the next launch. Every thread
/// of the block calls it, after writing its partial result.
__device__ void merge_if_last(float* partial, int t, int n_heads, int h0, int splits, int hd, int active, int heads,
                              float* out, float* scratch) {
  __shared__ bool s_last;
  __threadfence();
  __syncthreads();
  unsigned* count = reinterpret_cast<unsigned*>(partial - kAttnCounters) + int64_t(t) * n_heads + h0;
  if (threadIdx.x == 0) s_last = atomicAdd(count, 1u) == unsigned(active - 1);
  __syncthreads();
  if (!s_last) return;
  if (threadIdx.x == 0) *count = 0;
  __threadfence();
  combine_heads(partial + (int64_t(t) * n_heads + h0) * splits * (hd + 2), int64_t(splits) * (hd + 2), hd, active,
                heads, out, scratch);
}

// QH query heads of one grouped-query group a block (they read the same KV
// head): each position's K and V are loaded once for all of them. Decode
// deep in a context reads the cache at memory speed, and one block per query
// head read each KV head group-size times.
template <int G, int QH, class Kv>
__global__ void __launch_bounds__(kAttnWarps * 32, QH >= 4 ? 2 : 1) attention_kernel(const float* q, int64_t ldq, Kv kc,
                                                                     Kv vc, const BatchToken* batch,
                                                                     AttentionArgs a, float* partial, float* out,
                                                                     int64_t ldo) {
  pdl_wait();
  pdl_trigger();
  constexpr int kGroups = kAttnWarps * 32 / G;
  constexpr int HD = G * 8;
  // Four heads: two positions a round, so that two blocks fit a multiprocessor's registers.
  constexpr int kUnroll = QH >= 4 ? 2 : kAttnUnroll;
  __shared__ float s_m[QH][kGroups], s_l[QH][kGroups];
  __shared__ float s_acc[QH][kGroups][HD];
  const int h0 = blockIdx.x * QH, t = blockIdx.y, split = blockIdx.z;
  const BatchToken b = batch[t];
  const int64_t n_pos = int64_t(b.pos) + 1;
  // The token's positions (not the context's) shared by the splits, at least
  // a.split_positions (kAttnSplitPositions, 128) each: a token early in a long context still takes as
  // many blocks as its positions are worth. Splits past the end have nothing
  // to do; the others merge.
  const int64_t chunk = max(a.split_positions, (n_pos + a.splits - 1) / a.splits);
  const int64_t p0 = int64_t(split) * chunk, p1 = min(n_pos, p0 + chunk);
  const int active = int((n_pos + chunk - 1) / chunk);
  if (split >= active) return;
  const int group = threadIdx.x / G, gl = threadIdx.x % G;
  const int kvh = h0 / (a.n_heads / a.n_kv_heads);
  const int64_t kvd = int64_t(a.n_kv_heads) * HD;

  float qv[QH][8];
#pragma unroll
  for (int qh = 0; qh < QH; ++qh) {
    const float4* qp = reinterpret_cast<const float4*>(q + t * ldq + int64_t(h0 + qh) * HD + gl * 8);
    const float4 x0 = qp[0], x1 = qp[1];
    qv[qh][0] = x0.x; qv[qh][1] = x0.y; qv[qh][2] = x0.z; qv[qh][3] = x0.w;
    qv[qh][4] = x1.x; qv[qh][5] = x1.y; qv[qh][6] = x1.z; qv[qh][7] = x1.w;
  }
  float m[QH], l[QH], acc[QH][8];
#pragma unroll
  for (int qh = 0; qh < QH; ++qh) {
    m[qh] = -INFINITY;
    l[qh] = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[qh][j] = 0.0f;
  }
  const int64_t kvbase = int64_t(b.slot) * a.ctx * kvd + int64_t(kvh) * HD + gl * 8;
  // A group takes kUnroll positions a round, their K and V loaded before
  // any is used. Every lane runs the same rounds (the shuffles need the whole
  // warp); a group past the end of the range computes and drops.
  for (int64_t base = p0; base < p1; base += int64_t(kGroups) * kUnroll) {
    float kf[kUnroll][8], vf[kUnroll][8];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t p = base + u * kGroups + group;
      if (p < p1) {
        kc.load8(kvbase + p * kvd, kf[u]);
        vc.load8(kvbase + p * kvd, vf[u]);
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) kf[u][j] = vf[u][j] = 0.0f;
      }
    }
#pragma unroll
    for (int qh = 0; qh < QH; ++qh) {
      float sc[kUnroll];
      float m_new = m[qh];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        float d = 0.0f;
#pragma unroll
        for (int j = 0; j < 8; ++j) d = fmaf(qv[qh][j], kf[u][j], d);
#pragma unroll
        for (int off = G / 2; off > 0; off >>= 1) d += __shfl_xor_sync(0xffffffffu, d, off, G);
        sc[u] = base + u * kGroups + group < p1 ? d * a.scale : -INFINITY;
        m_new = fmaxf(m_new, sc[u]);
      }
      if (m_new == -INFINITY) continue;  // no position of this group in the round
      const float corr = expf(m[qh] - m_new);  // 0 while m = -inf
      l[qh] *= corr;
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[qh][j] *= corr;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const float e = expf(sc[u] - m_new);  // 0 for a dropped position
        l[qh] += e;
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[qh][j] = fmaf(e, vf[u][j], acc[qh][j]);
      }
      m[qh] = m_new;
    }
  }
#pragma unroll
  for (int qh = 0; qh < QH; ++qh) {
    if (gl == 0) {
      s_m[qh][group] = m[qh];
      s_l[qh][group] = l[qh];
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) s_acc[qh][group][gl * 8 + j] = acc[qh][j];
  }
  __syncthreads();
  // Merge the groups: thread d < HD takes dimension d of each head.
  if (threadIdx.x < HD) {
    for (int qh = 0; qh < QH; ++qh) {
      const int h = h0 + qh;
      float M = -INFINITY;
      for (int g = 0; g < kGroups; ++g) M = fmaxf(M, s_m[qh][g]);
      float L = 0.0f, A = 0.0f;
      if (M != -INFINITY) {
        for (int g = 0; g < kGroups; ++g) {
          const float w = expf(s_m[qh][g] - M);
          L += s_l[qh][g] * w;
          A += s_acc[qh][g][threadIdx.x] * w;
        }
      }
      if (active == 1) {  // the whole range: no partial to merge
        out[int64_t(t) * ldo + int64_t(h) * HD + threadIdx.x] = A / L;
        continue;
      }
      float* part = partial + ((int64_t(t) * a.n_heads + h) * a.splits + split) * (HD + 2);
      part[threadIdx.x] = A;
      if (threadIdx.x == 0) {
        part[HD] = M;
        part[HD + 1] = L;
      }
    }
  }
  if (active == 1) return;
  merge_if_last(partial, t, a.n_heads, h0, a.splits, HD, active, QH, out + int64_t(t) * ldo + int64_t(h0) * HD,
                &s_acc[0][0][0]);  // s_acc is free by now
}


// Prefill attention, tiled: a block takes one head and kTileQ consecutive
// tokens of the batch. K and V of kTileK positions at a time go through
// shared memory (as floats) and serve all the block's tokens, so the cache is
// read once per tile of tokens instead of once per token. Thread (rp, jq)
// computes the scores of tokens 2rp, 2rp+1 at positions jq + 16c and owns
// their outputs at dimensions 4jq + 64c; the 16 threads of a token pair are
// one half-warp, which keeps the online softmax (as in attention_kernel)
// inside shuffles. The tokens' slots are taken one at a time, in increasing
// order (a prefill batch has one or a few); a token attends only to its own.
constexpr int kTileQ = 16, kTileK = 64, kTileThreads = 128;

template <int HD>
constexpr size_t tiled_smem_bytes() {
  return size_t(kTileQ * (HD + 4) + 2 * kTileK * (HD + 4) + kTileQ * (kTileK + 4)) * sizeof(float);
}

template <int HD, class Kv>
__global__ void __launch_bounds__(kTileThreads) attention_tiled_kernel(const float* q, int64_t ldq, Kv kc,
                                                                       Kv vc, const BatchToken* batch,
                                                                       int T, AttentionArgs a, float* out,
                                                                       int64_t ldo) {
  constexpr int LD = HD + 4;  // floats a row of the Q, K and V tiles: 16-byte rows, no bank conflicts
  constexpr int LP = kTileK + 4;
  constexpr int PC = kTileK / 16;  // positions a thread
  constexpr int DC = HD / 64;      // float4s of output a thread and token
  extern __shared__ float4 tiles[];
  float* sq = reinterpret_cast<float*>(tiles);
  float* sk = sq + kTileQ * LD;
  float* sv = sk + kTileK * LD;
  float* sp = sv + kTileK * LD;
  __shared__ int s_slot[kTileQ], s_pos[kTileQ];
  pdl_wait();
  pdl_trigger();
  const int h = blockIdx.x, t0 = int(blockIdx.y) * kTileQ, tid = threadIdx.x;
  const int jq = tid % 16, rp = tid / 16;
  const int kvh = h / (a.n_heads / a.n_kv_heads);
  const int64_t kvd = int64_t(a.n_kv_heads) * HD;
  if (tid < kTileQ) {
    const int t = t0 + tid;
    s_slot[tid] = t < T ? batch[t].slot : -1;
    s_pos[tid] = t < T ? batch[t].pos : -1;
  }
  for (int i = tid; i < kTileQ * HD / 4; i += kTileThreads) {
    const int r = i / (HD / 4), c = i % (HD / 4), t = t0 + r;
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    if (t < T) v = *reinterpret_cast<const float4*>(q + t * ldq + int64_t(h) * HD + c * 4);
    *reinterpret_cast<float4*>(sq + r * LD + c * 4) = v;
  }
  __syncthreads();
  const int my_slot[2] = {s_slot[2 * rp], s_slot[2 * rp + 1]}, my_pos[2] = {s_pos[2 * rp], s_pos[2 * rp + 1]};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  float o[2][DC * 4];
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int i = 0; i < DC * 4; ++i) o[r][i] = 0.f;

  for (int slot = -1;;) {
    int next = INT_MAX;
    for (int r = 0; r < kTileQ; ++r)
      if (s_slot[r] > slot && s_slot[r] < next) next = s_slot[r];
    if (next == INT_MAX) break;
    slot = next;
    int last = -1;
    for (int r = 0; r < kTileQ; ++r)
      if (s_slot[r] == slot) last = max(last, s_pos[r]);
    const int64_t kvbase = int64_t(slot) * a.ctx * kvd + int64_t(kvh) * HD;
    for (int p0 = 0; p0 <= last; p0 += kTileK) {
      __syncthreads();  // the last tile's readers are done
      for (int i = tid; i < kTileK * HD / 8; i += kTileThreads) {
        const int j = i / (HD / 8), c = i % (HD / 8), p = p0 + j;
        float kf[8] = {0, 0, 0, 0, 0, 0, 0, 0}, vf[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        if (p <= last) {  // past it: zeros (weight 0 times a zero, never garbage)
          kc.load8(kvbase + int64_t(p) * kvd + c * 8, kf);
          vc.load8(kvbase + int64_t(p) * kvd + c * 8, vf);
        }
        float4* kd = reinterpret_cast<float4*>(sk + j * LD + c * 8);
        float4* vd = reinterpret_cast<float4*>(sv + j * LD + c * 8);
        kd[0] = make_float4(kf[0], kf[1], kf[2], kf[3]);
        kd[1] = make_float4(kf[4], kf[5], kf[6], kf[7]);
        vd[0] = make_float4(vf[0], vf[1], vf[2], vf[3]);
        vd[1] = make_float4(vf[4], vf[5], vf[6], vf[7]);
      }
      __syncthreads();
      float sc[2][PC];
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int c = 0; c < PC; ++c) sc[r][c] = 0.f;
#pragma unroll 4
      for (int d = 0; d < HD; d += 4) {
        const float4 qa = *reinterpret_cast<const float4*>(sq + (2 * rp) * LD + d);
        const float4 qb = *reinterpret_cast<const float4*>(sq + (2 * rp + 1) * LD + d);
#pragma unroll
        for (int c = 0; c < PC; ++c) {
          const float4 kv = *reinterpret_cast<const float4*>(sk + (jq + 16 * c) * LD + d);
          sc[0][c] = fmaf(qa.x, kv.x, sc[0][c]);
          sc[0][c] = fmaf(qa.y, kv.y, sc[0][c]);
          sc[0][c] = fmaf(qa.z, kv.z, sc[0][c]);
          sc[0][c] = fmaf(qa.w, kv.w, sc[0][c]);
          sc[1][c] = fmaf(qb.x, kv.x, sc[1][c]);
          sc[1][c] = fmaf(qb.y, kv.y, sc[1][c]);
          sc[1][c] = fmaf(qb.z, kv.z, sc[1][c]);
          sc[1][c] = fmaf(qb.w, kv.w, sc[1][c]);
        }
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float tile_max = -INFINITY;
#pragma unroll
        for (int c = 0; c < PC; ++c) {
          const int p = p0 + jq + 16 * c;
          sc[r][c] = my_slot[r] == slot && p <= my_pos[r] ? sc[r][c] * a.scale : -INFINITY;
          tile_max = fmaxf(tile_max, sc[r][c]);
        }
#pragma unroll
        for (int off = 8; off > 0; off >>= 1) tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, off));
        const float m_new = fmaxf(m[r], tile_max);
        float corr = 1.f, sum = 0.f;
        if (m_new != -INFINITY) {
          corr = expf(m[r] - m_new);  // 0 while m is still -inf
#pragma unroll
          for (int c = 0; c < PC; ++c) {
            sc[r][c] = expf(sc[r][c] - m_new);
            sum += sc[r][c];
          }
        } else {
#pragma unroll
          for (int c = 0; c < PC; ++c) sc[r][c] = 0.f;
        }
#pragma unroll
        for (int off = 8; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
        l[r] = l[r] * corr + sum;
        m[r] = m_new;
#pragma unroll
        for (int i = 0; i < DC * 4; ++i) o[r][i] *= corr;
#pragma unroll
        for (int c = 0; c < PC; ++c) sp[(2 * rp + r) * LP + jq + 16 * c] = sc[r][c];
      }
      __syncwarp();  // a token's weights are written and read by its own half-warp
#pragma unroll 2
      for (int j = 0; j < kTileK; j += 4) {
        const float4 pa = *reinterpret_cast<const float4*>(sp + (2 * rp) * LP + j);
        const float4 pb = *reinterpret_cast<const float4*>(sp + (2 * rp + 1) * LP + j);
        const float wa[4] = {pa.x, pa.y, pa.z, pa.w}, wb[4] = {pb.x, pb.y, pb.z, pb.w};
#pragma unroll
        for (int jj = 0; jj < 4; ++jj)
#pragma unroll
          for (int c = 0; c < DC; ++c) {
            const float4 v = *reinterpret_cast<const float4*>(sv + (j + jj) * LD + 4 * jq + 64 * c);
            o[0][4 * c] = fmaf(wa[jj], v.x, o[0][4 * c]);
            o[0][4 * c + 1] = fmaf(wa[jj], v.y, o[0][4 * c + 1]);
            o[0][4 * c + 2] = fmaf(wa[jj], v.z, o[0][4 * c + 2]);
            o[0][4 * c + 3] = fmaf(wa[jj], v.w, o[0][4 * c + 3]);
            o[1][4 * c] = fmaf(wb[jj], v.x, o[1][4 * c]);
            o[1][4 * c + 1] = fmaf(wb[jj], v.y, o[1][4 * c + 1]);
            o[1][4 * c + 2] = fmaf(wb[jj], v.z, o[1][4 * c + 2]);
            o[1][4 * c + 3] = fmaf(wb[jj], v.w, o[1][4 * c + 3]);
          }
      }
      __syncwarp();  // the weights are read before the next tile writes them
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int t = t0 + 2 * rp + r;
    if (t >= T) continue;
    const float inv_l = 1.0f / l[r];
#pragma unroll
    for (int c = 0; c < DC; ++c) {
      const float4 v = make_float4(o[r][4 * c] * inv_l, o[r][4 * c + 1] * inv_l, o[r][4 * c + 2] * inv_l,
                                   o[r][4 * c + 3] * inv_l);
      *reinterpret_cast<float4*>(out + int64_t(t) * ldo + int64_t(h) * HD + 4 * jq + 64 * c) = v;
    }
  }
}

__global__ void swiglu_kernel(float* g, const float* u, int64_t ld, int64_t n) {
  pdl_wait();
  pdl_trigger();
  const int t = blockIdx.y;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    g[t * ld + i] = silu_mul(g[t * ld + i], u[t * ld + i]);
  }
}

__global__ void add_kernel(float* x, const float* o, int64_t ld, int64_t n) {
  pdl_wait();
  pdl_trigger();
  const int t = blockIdx.y;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    x[t * ld + i] += o[t * ld + i];
}

__global__ void gather_kernel(const float* x, int64_t ld, const BatchToken* batch, float* xl) {
  pdl_wait();
  pdl_trigger();
  const int t = blockIdx.x;
  const int r = batch[t].logit_row;
  if (r < 0) return;
  for (int64_t i = threadIdx.x; i < ld; i += blockDim.x) xl[int64_t(r) * ld + i] = x[t * ld + i];
}

__global__ void gather_rows_kernel(const float* src, int64_t ld_src, const int32_t* rows, int64_t n, float* dst,
                                   int64_t ld_dst) {
  pdl_wait();
  pdl_trigger();
  const int i = blockIdx.x;
  const float* from = src + int64_t(rows[i]) * ld_src;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) dst[int64_t(i) * ld_dst + j] = from[j];
}

// One warp a token, as worker/moe_routes.h's route_token: the softmax in
// place (exp(s - max), the sum in double), then K rounds of a warp's argmax
// over the experts not taken (ties to the lower id), renormalised in k order.
__global__ void __launch_bounds__(1024) moe_group_kernel(int32_t* ep, const float* weight, int P, int K, int E,
                                                         int job_rows, int32_t* start, int32_t* token_of,
                                                         float* weight_of, int32_t* jobs, int32_t* n_jobs) {
  __shared__ int count[1024], first[1024], cursor[1024], job_at[1024];
  pdl_wait();
  pdl_trigger();
  const int tid = int(threadIdx.x);
  if (tid < E) count[tid] = cursor[tid] = 0;
  __syncthreads();
  for (int i = tid; i < P; i += blockDim.x) atomicAdd(&count[ep[i]], 1);
  __syncthreads();
  if (tid == 0) {  // each expert's first row and first job
    int at = 0, j = 0;
    for (int e = 0; e < E; ++e) {
      first[e] = at;
      job_at[e] = j;
      at += count[e];
      j += (count[e] + job_rows - 1) / job_rows;
    }
    start[E] = at;
    *n_jobs = j;
  }
  __syncthreads();
  if (tid < E) {
    start[tid] = first[tid];
    for (int r = 0, j = job_at[tid]; r < count[tid]; r += job_rows, ++j) {
      jobs[3 * j] = tid;
      jobs[3 * j + 1] = first[tid] + r;
      jobs[3 * j + 2] = min(job_rows, count[tid] - r);
    }
  }
  for (int i = tid; i < P; i += blockDim.x) {  // each pair read, then overwritten, by one thread
    const int e = ep[i];
    const int row = first[e] + atomicAdd(&cursor[e], 1);
    token_of[row] = i / K;
    weight_of[row] = weight[i];
    ep[i] = row;
  }
}

constexpr int kMaxCombine = 64;  // experts a token moe_combine takes

__global__ void moe_topk_kernel(float* scores, int64_t ld, int T, int E, int K, int norm, int32_t* expert,
                                float* weight, int32_t* pair) {
  pdl_wait();
  pdl_trigger();
  const int t = int(blockIdx.x) * int(blockDim.x / 32) + int(threadIdx.x / 32);
  const int lane = threadIdx.x % 32;
  if (t >= T) return;
  float* p = scores + int64_t(t) * ld;
  float mx = -INFINITY;
  for (int e = lane; e < E; e += 32) mx = fmaxf(mx, p[e]);
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  double sum = 0;
  for (int e = lane; e < E; e += 32) {
    const float v = expf(p[e] - mx);
    p[e] = v;
    sum += double(v);
  }
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  const float inv = float(1.0 / sum);
  for (int e = lane; e < E; e += 32) p[e] *= inv;
  uint32_t taken = 0;  // bit j: expert lane + 32 j
  float wsum = 0;
  for (int k = 0; k < K; ++k) {
    float best = -1.0f;
    int best_e = INT_MAX;
    for (int j = 0, e = lane; e < E; ++j, e += 32)
      if (!((taken >> j) & 1u) && p[e] > best) {
        best = p[e];
        best_e = e;
      }
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, best, o);
      const int oe = __shfl_xor_sync(0xffffffffu, best_e, o);
      if (ov > best || (ov == best && oe < best_e)) {
        best = ov;
        best_e = oe;
      }
    }
    if (best_e % 32 == lane) taken |= 1u << (best_e / 32);
    wsum += best;
    if (lane == 0) {
      const int i = t * K + k;
      expert[i] = best_e;
      weight[i] = best;
      pair[i] = i;
    }
  }
  if (norm && lane == 0) {
    const float s = fmaxf(wsum, 6.103515625e-5f);
    for (int k = 0; k < K; ++k) weight[t * K + k] /= s;
  }
}

// Token blockIdx.y's sum of its experts' rows, in order of weight (and the
// shared expert under its gate), over a slice of the columns a block: a
// decode step's one token over one block took ~19 us (H200, 2048 wide, 8
// experts), each of its threads waiting on loads in turn.
__global__ void moe_combine_kernel(MoeCombine c, float* out, int64_t ldo, bool accumulate, int64_t n) {
  pdl_wait();
  pdl_trigger();
  const int t = blockIdx.y;
  __shared__ float gate;
  __shared__ int32_t rows[kMaxCombine];
  __shared__ float weights[kMaxCombine];
  if (int(threadIdx.x) < c.K) {
    const int32_t r = c.pair[t * c.K + int(threadIdx.x)];
    rows[threadIdx.x] = r;
    weights[threadIdx.x] = c.weight_of[r];
  }
  __syncthreads();
  if (c.shared_y) {
    // The shared expert's gate: sigmoid(shared_gate . n[t]), a block sum.
    __shared__ float part[32];
    float d = 0;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) d += c.shared_gate[j] * c.n[t * c.ldn + j];
    for (int o = 16; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = d;
    __syncthreads();
    if (threadIdx.x == 0) {
      float sum = 0;
      for (unsigned w = 0; w < (blockDim.x + 31) / 32; ++w) sum += part[w];
      gate = 1.0f / (1.0f + expf(-sum));
    }
    __syncthreads();
  }
  for (int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; j < n; j += int64_t(gridDim.x) * blockDim.x) {
    float a = 0;
    for (int k = 0; k < c.K; ++k) a += c.y[int64_t(rows[k]) * c.ldy + j] * weights[k];
    if (c.shared_y) a += c.shared_y[t * c.ldy + j] * gate;
    float* o = out + t * ldo + j;
    *o = accumulate ? *o + a : a;
  }
}

dim3 rows_grid(int64_t n, int T) { return dim3(unsigned(std::min<int64_t>(ceil_div(n, kThreads), 1024)), unsigned(T)); }

}  // namespace

void embed(const DeviceWeight& table, const BatchToken* batch, int T, float* x, int64_t ldx, cudaStream_t s) {
  if (is_block_quant(table.type)) return embed_quant(table, batch, T, x, ldx, s);
  launch(embed_kernel, dim3(T), dim3(kThreads), s, table, batch, x, ldx);
  DS4_CUDA_LAUNCHED();
}

void rmsnorm(const float* x, int64_t ldx, const float* g, int64_t n, float eps, float* out, int64_t ldo, int T,
             cudaStream_t s) {
  launch(rmsnorm_kernel, dim3(T), dim3(512), s, x, ldx, g, n, eps, out, ldo);
  DS4_CUDA_LAUNCHED();
}

void rope_store(float* q, int64_t ldq, float* k, const float* v, int64_t ldkv, const BatchToken* batch, int T,
                const RopeArgs& a, __half* k_cache, __half* v_cache, cudaStream_t s) {
  const int heads = a.n_heads + (k ? a.n_kv_heads : 0) + (v ? a.n_kv_heads : 0);
  const int jobs = heads * (a.head_dim / 2);
  if (jobs == 0 || T == 0) return;
  const dim3 grid(unsigned(std::min<int64_t>(ceil_div(jobs, kThreads), 64)), unsigned(T));
  launch(rope_store_kernel, grid, dim3(kThreads), s, q, ldq, k, v, ldkv, batch, a, k_cache, v_cache);
  DS4_CUDA_LAUNCHED();
}

namespace {

// Prefill attention on the tensor cores (flash attention): a block takes one
// head and kFaRows consecutive tokens of the batch, four warps of 16 rows.
// K and V of kFaKeys positions at a time go into shared memory as they are
// cached (f16); each warp multiplies its rows' queries (f16) by the tile's
// keys with mma.sync m16n8k16 (f32 sums), keeps the online softmax of its rows
// in registers (a row's maximum and sum shared by the four lanes that hold
// it), and multiplies the weights (f16, straight from the score registers)
// by the values into its f32 outputs. The copies overlap the products: a
// tile's V arrives (cp.async) while its scores are computed, the next tile's K
// while the values are weighed. The tokens' slots are taken one at a time, in
// increasing order, as in attention_tiled_kernel; a token attends only to its
// own slot's positions up to its own. Deep in a context the blocks split a
// slot's tiles (gridDim.z ranges, blockIdx.z this block's): each range's
// unnormalised outputs, maximum and sum go to `partial` (as the decode
// kernel's splits), and attention_combine_kernel merges them.
constexpr int kFaRows = kCudaFaRows, kFaKeys = 64, kFaThreads = 128, kMaxPrefillSplits = 32;

template <int HD>
__host__ __device__ constexpr int fa_ld() { return HD + 8; }  // halves a shared row: 16-byte rows, no bank conflicts

template <int HD>
constexpr size_t fa_smem_bytes() {
  return size_t(kFaRows + 2 * kFaKeys) * fa_ld<HD>() * sizeof(__half);
}

// Blocks a multiprocessor keeps: 4 (kCudaFaBlocksPerSm) up to 128 dimensions
// (52 KiB of shared memory, 128 registers a thread), 2 at 256 (the outputs
// alone take 128 registers).
template <int HD>
__host__ __device__ constexpr int fa_blocks_per_sm() { return HD <= 128 ? kCudaFaBlocksPerSm : 2; }

template <int HD, class Kv>
__global__ void __launch_bounds__(kFaThreads, fa_blocks_per_sm<HD>())
    attention_mma_kernel(const float* q, int64_t ldq, Kv kc, Kv vc, const BatchToken* batch, int T,
                         AttentionArgs a, float* partial, float* out, int64_t ldo) {
  constexpr int LD = fa_ld<HD>();
  constexpr int NT = kFaKeys / 8;  // score tiles of 8 positions a warp
  constexpr int OT = HD / 8;       // output tiles of 8 dimensions a warp
  constexpr float kLn2 = 0.6931471805599453f;
  extern __shared__ float4 fa_smem[];
  __half* sq = reinterpret_cast<__half*>(fa_smem);
  __half* sk = sq + kFaRows * LD;
  __half* sv = sk + kFaKeys * LD;
  __shared__ int s_slot[kFaRows], s_pos[kFaRows];
  pdl_wait();
  pdl_trigger();
  const int h = blockIdx.x, t0 = int(blockIdx.y) * kFaRows, tid = threadIdx.x;
  const int split = blockIdx.z, splits = gridDim.z;
  const int warp = tid / 32, lane = tid % 32, g = lane / 4, tq = lane % 4;
  const int kvh = h / (a.n_heads / a.n_kv_heads);
  const int64_t kvd = int64_t(a.n_kv_heads) * HD;
  if (tid < kFaRows) {
    const int t = t0 + tid;
    s_slot[tid] = t < T ? batch[t].slot : -1;
    s_pos[tid] = t < T ? batch[t].pos : -1;
  }
  for (int i = tid; i < kFaRows * HD / 4; i += kFaThreads) {
    const int r = i / (HD / 4), c = i % (HD / 4), t = t0 + r;
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    if (t < T) v = *reinterpret_cast<const float4*>(q + t * ldq + int64_t(h) * HD + c * 4);
    uint2 packed;
    packed.x = pack_half2(v.x, v.y);
    packed.y = pack_half2(v.z, v.w);
    *reinterpret_cast<uint2*>(sq + r * LD + c * 4) = packed;
  }
  __syncthreads();
  // This lane's two rows: g and g + 8 of its warp's 16.
  const int r0 = warp * 16 + g, r1 = r0 + 8;
  const int my_slot[2] = {s_slot[r0], s_slot[r1]}, my_pos[2] = {s_pos[r0], s_pos[r1]};
  const float scale = a.scale * 1.4426950408889634f;  // scores in log2 units: exp2f
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  float o[OT][4];
#pragma unroll
  for (int n = 0; n < OT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  const __half* qw = sq + (warp * 16) * LD;

  for (int slot = -1;;) {
    int next = INT_MAX;
    for (int r = 0; r < kFaRows; ++r)
      if (s_slot[r] > slot && s_slot[r] < next) next = s_slot[r];
    if (next == INT_MAX) break;
    slot = next;
    int last = -1;
    for (int r = 0; r < kFaRows; ++r)
      if (s_slot[r] == slot) last = max(last, s_pos[r]);
    // This block's range of the slot's tiles.
    const int tiles = last / kFaKeys + 1;
    const int tile_begin = int(int64_t(tiles) * split / splits), tile_end = int(int64_t(tiles) * (split + 1) / splits);
    if (tile_begin == tile_end) continue;
    // A tile below every row of the warp needs no mask: all 16 rows in this
    // slot, its last position at most the shallowest row's.
    const bool in_slot = my_slot[0] == slot && my_slot[1] == slot;
    const bool warp_in_slot = __all_sync(0xffffffffu, in_slot);
    const int warp_lowest = __reduce_min_sync(0xffffffffu, in_slot ? min(my_pos[0], my_pos[1]) : -1);
    const int64_t kvbase = int64_t(slot) * a.ctx * kvd + int64_t(kvh) * HD;
    // One tile of K or V (positions from p0) into shared memory; past `last`,
    // zeros (weight 0 times a zero, never garbage).
    auto stage = [&](__half* dst, const Kv& c, int p0) {
      for (int i = tid; i < kFaKeys * HD / 8; i += kFaThreads) {
        const int j = i / (HD / 8), cc = i % (HD / 8), p = p0 + j;
        c.stage8(dst + j * LD + cc * 8, kvbase + int64_t(p) * kvd + cc * 8, p <= last);
      }
      cp_async_commit();
    };
    __syncthreads();  // the previous slot's readers of sk and sv are done
    stage(sk, kc, tile_begin * kFaKeys);
    for (int tile = tile_begin; tile < tile_end; ++tile) {
      const int p0 = tile * kFaKeys;
      cp_async_wait_all();
      __syncthreads();  // this tile's K is in place; the last tile's values are read
      stage(sv, vc, p0);
      // Scores: 16 rows x kFaKeys positions a warp.
      float sc[NT][4];
#pragma unroll
      for (int n = 0; n < NT; ++n) sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.f;
#pragma unroll
      for (int k0 = 0; k0 < HD; k0 += 16) {
        uint32_t qa[4];
        qa[0] = *reinterpret_cast<const uint32_t*>(qw + g * LD + k0 + 2 * tq);
        qa[1] = *reinterpret_cast<const uint32_t*>(qw + (g + 8) * LD + k0 + 2 * tq);
        qa[2] = *reinterpret_cast<const uint32_t*>(qw + g * LD + k0 + 8 + 2 * tq);
        qa[3] = *reinterpret_cast<const uint32_t*>(qw + (g + 8) * LD + k0 + 8 + 2 * tq);
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          const __half* kr = sk + (n * 8 + g) * LD + k0 + 2 * tq;
          mma_16816(sc[n], qa, *reinterpret_cast<const uint32_t*>(kr), *reinterpret_cast<const uint32_t*>(kr + 8));
        }
      }
      const bool masked = !warp_in_slot || p0 + kFaKeys - 1 > warp_lowest;
      // The online softmax of rows r0 (sums 0, 1) and r1 (sums 2, 3).
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float tile_max = -INFINITY;
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int p = p0 + n * 8 + 2 * tq + e;
            float& x = sc[n][2 * r + e];
            x = !masked || (my_slot[r] == slot && p <= my_pos[r]) ? x * scale : -INFINITY;
            tile_max = fmaxf(tile_max, x);
          }
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
        const float m_new = fmaxf(m[r], tile_max);
        float corr = 1.f, sum = 0.f;
        if (m_new != -INFINITY) {
          corr = exp2f(m[r] - m_new);  // 0 while m is still -inf
#pragma unroll
          for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              float& x = sc[n][2 * r + e];
              x = exp2f(x - m_new);  // 0 for a masked position
              sum += x;
            }
        } else {
#pragma unroll
          for (int n = 0; n < NT; ++n) sc[n][2 * r] = sc[n][2 * r + 1] = 0.f;
        }
        l[r] = l[r] * corr + sum;  // this lane's columns; the four lanes of a row add up at the end
        m[r] = m_new;
#pragma unroll
        for (int n = 0; n < OT; ++n) {
          o[n][2 * r] *= corr;
          o[n][2 * r + 1] *= corr;
        }
      }
      cp_async_wait_all();
      __syncthreads();  // this tile's V is in place; every warp's scores are done with K
      if (tile + 1 < tile_end) stage(sk, kc, p0 + kFaKeys);
      // Outputs: the weights of 16 positions at a time as the A operand, the
      // values (transposed by ldmatrix) as B, two output tiles a load.
#pragma unroll
      for (int kk = 0; kk < kFaKeys / 16; ++kk) {
        uint32_t pa[4];
        pa[0] = pack_half2(sc[2 * kk][0], sc[2 * kk][1]);
        pa[1] = pack_half2(sc[2 * kk][2], sc[2 * kk][3]);
        pa[2] = pack_half2(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
        pa[3] = pack_half2(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
        const int mi = lane / 8, rr = lane % 8;
        const __half* vrow = sv + (kk * 16 + (mi & 1) * 8 + rr) * LD + (mi >> 1) * 8;
#pragma unroll
        for (int n = 0; n < OT; n += 2) {
          uint32_t vb4[4];
          ldmatrix_x4_trans(vb4, vrow + n * 8);
          mma_16816(o[n], pa, vb4[0], vb4[1]);
          mma_16816(o[n + 1], pa, vb4[2], vb4[3]);
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float sum = l[r];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const int t = t0 + (r == 0 ? r0 : r1);
    if (t >= T) continue;
    if (splits > 1) {  // this range's share: unnormalised sums, maximum (natural units), sum of weights
      float* part = partial + ((int64_t(t) * a.n_heads + h) * splits + split) * (HD + 2);
#pragma unroll
      for (int n = 0; n < OT; ++n)
        *reinterpret_cast<float2*>(part + n * 8 + 2 * tq) = make_float2(o[n][2 * r], o[n][2 * r + 1]);
      if (tq == 0) {
        part[HD] = m[r] * kLn2;
        part[HD + 1] = sum;
      }
      continue;
    }
    const float inv = 1.0f / sum;
    float* orow = out + int64_t(t) * ldo + int64_t(h) * HD + 2 * tq;
#pragma unroll
    for (int n = 0; n < OT; ++n)
      *reinterpret_cast<float2*>(orow + n * 8) = make_float2(o[n][2 * r] * inv, o[n][2 * r + 1] * inv);
  }
}

// Decode attention on the tensor cores, for grouped-query heads with an f16
// cache: a block takes one KV head of one token and one range of its
// positions (the warp kernel's splits, merged the same way); the group's
// query heads (2 to 16) are the rows of one m16n8k16 tile, queries and
// weights f16 as in the prefill kernel. K and V stream into shared memory by
// cp.async, dec_stages<HD>() tiles of kDecKeys positions on their way at
// once, so a block keeps the memory busy while it computes (the warp kernel
// waited for each lane's loads before using them); each warp takes 16
// positions of a tile with its own online softmax, and the warps' results
// merge at the end.
constexpr int kDecKeys = 64, kDecThreads = 128, kDecWarps = kDecThreads / 32;

template <int HD>
__host__ __device__ constexpr int dec_stages() { return HD <= 128 ? 3 : 2; }

template <int HD>
constexpr size_t dec_smem_bytes() {
  return size_t(16 + 2 * dec_stages<HD>() * kDecKeys) * fa_ld<HD>() * sizeof(__half);
}

template <int HD>
__global__ void __launch_bounds__(kDecThreads) attention_decode_mma_kernel(const float* q, int64_t ldq, KvF16 kc,
                                                                          KvF16 vc, const BatchToken* batch,
                                                                          AttentionArgs a, float* partial, float* out,
                                                                          int64_t ldo) {
  constexpr int LD = fa_ld<HD>(), OT = HD / 8, S = dec_stages<HD>();
  constexpr float kLn2 = 0.6931471805599453f;
  static_assert(size_t(kDecWarps) * 16 * (HD + 2) * 4 <= size_t(2 * S * kDecKeys) * LD * 2, "merge area");
  extern __shared__ float4 dec_smem[];
  __half* sq = reinterpret_cast<__half*>(dec_smem);
  __half* sk = sq + 16 * LD;
  __half* sv = sk + S * kDecKeys * LD;
  pdl_wait();
  pdl_trigger();
  const int kvh = blockIdx.x, t = blockIdx.y, split = blockIdx.z, tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32, g = lane / 4, tq = lane % 4;
  const int G = a.n_heads / a.n_kv_heads, h0 = kvh * G;
  const BatchToken b = batch[t];
  const int64_t n_pos = int64_t(b.pos) + 1;
  // The token's positions shared by the splits, as attention_kernel's.
  const int64_t chunk = max(a.split_positions, (n_pos + a.splits - 1) / a.splits);
  const int64_t p0 = int64_t(split) * chunk, p1 = min(n_pos, p0 + chunk);
  const int active = int((n_pos + chunk - 1) / chunk);
  if (split >= active) return;
  const int64_t kvd = int64_t(a.n_kv_heads) * HD;
  const int64_t kvbase = int64_t(b.slot) * a.ctx * kvd + int64_t(kvh) * HD;
  const int tiles = int((p1 - p0 + kDecKeys - 1) / kDecKeys);
  // Tile i of the range into stage i % S (positions past p1: zeros). Every
  // thread commits a group per call, empty past the last tile, so that
  // "all but S - 2 groups done" always means "tile i is here".
  auto stage = [&](int i) {
    if (i < tiles) {
      __half* dk = sk + (i % S) * kDecKeys * LD;
      __half* dv = sv + (i % S) * kDecKeys * LD;
      for (int e = tid; e < kDecKeys * HD / 8; e += kDecThreads) {
        const int j = e / (HD / 8), c = e % (HD / 8);
        const int64_t p = p0 + int64_t(i) * kDecKeys + j, at = kvbase + p * kvd + c * 8;
        kc.stage8(dk + j * LD + c * 8, at, p < p1);
        vc.stage8(dv + j * LD + c * 8, at, p < p1);
      }
    }
    cp_async_commit();
  };
  for (int i = 0; i < S - 1; ++i) stage(i);
  for (int i = tid; i < 16 * HD / 4; i += kDecThreads) {
    const int r = i / (HD / 4), c = i % (HD / 4);
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    if (r < G) v = *reinterpret_cast<const float4*>(q + t * ldq + int64_t(h0 + r) * HD + c * 4);
    uint2 packed;
    packed.x = pack_half2(v.x, v.y);
    packed.y = pack_half2(v.z, v.w);
    *reinterpret_cast<uint2*>(sq + r * LD + c * 4) = packed;
  }
  const float scale = a.scale * 1.4426950408889634f;  // log2 units: exp2f
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  float o[OT][4];
#pragma unroll
  for (int n = 0; n < OT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  for (int i = 0; i < tiles; ++i) {
    cp_async_wait<S - 2>();
    __syncthreads();  // tile i is in place for all; tile i - 1's stage is read (refilled next)
    stage(i + S - 1);
    const __half* kt = sk + (i % S) * kDecKeys * LD + warp * 16 * LD;
    const __half* vt = sv + (i % S) * kDecKeys * LD + warp * 16 * LD;
    float sc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int k0 = 0; k0 < HD; k0 += 16) {
      uint32_t qa[4];
      qa[0] = *reinterpret_cast<const uint32_t*>(sq + g * LD + k0 + 2 * tq);
      qa[1] = *reinterpret_cast<const uint32_t*>(sq + (g + 8) * LD + k0 + 2 * tq);
      qa[2] = *reinterpret_cast<const uint32_t*>(sq + g * LD + k0 + 8 + 2 * tq);
      qa[3] = *reinterpret_cast<const uint32_t*>(sq + (g + 8) * LD + k0 + 8 + 2 * tq);
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        const __half* kr = kt + (n * 8 + g) * LD + k0 + 2 * tq;
        mma_16816(sc[n], qa, *reinterpret_cast<const uint32_t*>(kr), *reinterpret_cast<const uint32_t*>(kr + 8));
      }
    }
    const int64_t pw = p0 + int64_t(i) * kDecKeys + warp * 16;  // this warp's first position
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float tile_max = -INFINITY;
#pragma unroll
      for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = sc[n][2 * r + e];
          x = pw + n * 8 + 2 * tq + e < p1 ? x * scale : -INFINITY;
          tile_max = fmaxf(tile_max, x);
        }
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
      const float m_new = fmaxf(m[r], tile_max);
      float corr = 1.f, sum = 0.f;
      if (m_new != -INFINITY) {
        corr = exp2f(m[r] - m_new);
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float& x = sc[n][2 * r + e];
            x = exp2f(x - m_new);
            sum += x;
          }
      } else {
        sc[0][2 * r] = sc[0][2 * r + 1] = sc[1][2 * r] = sc[1][2 * r + 1] = 0.f;
      }
      l[r] = l[r] * corr + sum;
      m[r] = m_new;
#pragma unroll
      for (int n = 0; n < OT; ++n) {
        o[n][2 * r] *= corr;
        o[n][2 * r + 1] *= corr;
      }
    }
    uint32_t pa[4];
    pa[0] = pack_half2(sc[0][0], sc[0][1]);
    pa[1] = pack_half2(sc[0][2], sc[0][3]);
    pa[2] = pack_half2(sc[1][0], sc[1][1]);
    pa[3] = pack_half2(sc[1][2], sc[1][3]);
    const int mi = lane / 8, rr = lane % 8;
    const __half* vrow = vt + ((mi & 1) * 8 + rr) * LD + (mi >> 1) * 8;
#pragma unroll
    for (int n = 0; n < OT; n += 2) {
      uint32_t vb4[4];
      ldmatrix_x4_trans(vb4, vrow + n * 8);
      mma_16816(o[n], pa, vb4[0], vb4[1]);
      mma_16816(o[n + 1], pa, vb4[2], vb4[3]);
    }
  }
  // The warps' results meet in the stages' memory: unnormalised outputs,
  // maximum and sum of each of the 16 rows.
  cp_async_wait_all();
  __syncthreads();
  float* so = reinterpret_cast<float*>(sk);
  float* sm = so + kDecWarps * 16 * HD;
  float* sl = sm + kDecWarps * 16;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = warp * 16 + g + 8 * r;
    float sum = l[r];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    if (tq == 0) {
      sm[row] = m[r];
      sl[row] = sum;
    }
#pragma unroll
    for (int n = 0; n < OT; ++n)
      *reinterpret_cast<float2*>(so + row * HD + n * 8 + 2 * tq) = make_float2(o[n][2 * r], o[n][2 * r + 1]);
  }
  __syncthreads();
  for (int e = tid; e < G * HD; e += kDecThreads) {
    const int r = e / HD, d = e % HD;
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < kDecWarps; ++w) M = fmaxf(M, sm[w * 16 + r]);
    float L = 0.f, A = 0.f;
#pragma unroll
    for (int w = 0; w < kDecWarps; ++w) {
      const float mw = sm[w * 16 + r];
      if (mw == -INFINITY) continue;  // a warp with no position of the range
      const float wt = exp2f(mw - M);
      L += sl[w * 16 + r] * wt;
      A += so[(w * 16 + r) * HD + d] * wt;
    }
    if (active == 1) {
      out[int64_t(t) * ldo + int64_t(h0 + r) * HD + d] = A / L;
      continue;
    }
    float* part = partial + ((int64_t(t) * a.n_heads + h0 + r) * a.splits + split) * (HD + 2);
    part[d] = A;
    if (d == 0) {
      part[HD] = M * kLn2;
      part[HD + 1] = L;
    }
  }
  if (active == 1) return;
  merge_if_last(partial, t, a.n_heads, h0, a.splits, HD, active, G, out + int64_t(t) * ldo + int64_t(h0) * HD,
                so);  // the stages are free by now
}

// out[t][h] = the merge of the prefill kernel's splits of (t, h): a block each.
__global__ void attention_combine_kernel(const float* partial, int hd, int splits, int n_heads, float* out,
                                         int64_t ldo) {
  __shared__ float scratch[2 * kMaxPrefillSplits];
  pdl_wait();
  pdl_trigger();
  const int h = blockIdx.x, t = blockIdx.y;
  combine_heads(partial + (int64_t(t) * n_heads + h) * splits * (hd + 2), 0, hd, splits, 1,
                out + int64_t(t) * ldo + int64_t(h) * hd, scratch);
}

}  // namespace

void head_norm(float* x, int64_t ldx, int heads, int64_t n, const float* g, float eps, int T, cudaStream_t s) {
  if (heads == 0 || T == 0) return;
  launch(head_norm_kernel, dim3(unsigned(T * heads)), dim3(n >= 128 ? 128 : 64), s, x, ldx, heads, n, g, eps);
  DS4_CUDA_LAUNCHED();
}

void add_bias(float* y, int64_t ldy, const float* b, int64_t n, int T, cudaStream_t s) {
  launch(add_bias_kernel, rows_grid(n, T), dim3(kThreads), s, y, ldy, b, n);
  DS4_CUDA_LAUNCHED();
}

namespace {
// Query heads a block of the split kernel takes: as many of a group as
// divide it, up to 4 (the merge's shared memory is 8 KiB a head).
int heads_per_block(int n_heads, int n_kv_heads) {
  const int group = n_heads / n_kv_heads;
  return group % 4 == 0 ? 4 : group % 2 == 0 ? 2 : 1;
}

}  // namespace

bool decode_mma_takes(int n_heads, int n_kv_heads, int head_dim, bool q8, int64_t positions) {
  // DS4_CUDA_ATTN_DECODE=warp or mma: one kernel at any depth (comparisons).
  static const int forced = [] {
    const char* e = std::getenv("DS4_CUDA_ATTN_DECODE");
    return e && std::strcmp(e, "warp") == 0 ? 0 : e && std::strcmp(e, "mma") == 0 ? 1 : -1;
  }();
  const int group = n_heads / n_kv_heads;
  const bool takes = !q8 && group >= 2 && group <= 16 && (head_dim == 64 || head_dim == 128 || head_dim == 256);
  return takes && (forced == 1 || (forced == -1 && positions >= kDecodeMmaPositions));
}

namespace {

int env_int(const char* name, int def, int lo, int hi) {
  const char* v = std::getenv(name);
  return v && *v ? std::clamp(std::atoi(v), lo, hi) : def;
}

// The least positions a split takes.
int64_t split_positions() {
  static const int64_t positions = env_int("DS4_CUDA_ATTN_SPLIT", int(kAttnSplitPositions), 64, 4096);
  return positions;
}
}  // namespace

int attention_splits(int T, int n_heads, int n_kv_heads, int head_dim, bool q8, int64_t positions, int64_t ctx,
                     int n_sm) {
  // Two blocks a multiprocessor: as many as stay resident (the four-head
  // kernel's registers and the tensor cores' kernel's shared memory allow
  // two), so that the splits run in one wave. On the H200, a token 32768
  // deep in an 8B model: 202 / 182 tok/s (tensor cores / warp kernel) with
  // 2 a multiprocessor, 196 / 140 with 1, 183 / 169 with 4.
  static const int per_sm = env_int("DS4_CUDA_ATTN_BLOCKS", 2, 1, kCudaAttnBlocksPerSm);
  const int64_t least = split_positions();
  const int64_t blocks = int64_t(T) * (decode_mma_takes(n_heads, n_kv_heads, head_dim, q8, positions)
                                           ? n_kv_heads
                                           : n_heads / heads_per_block(n_heads, n_kv_heads));
  const int64_t want = ceil_div(int64_t(std::min(n_sm, kCudaPlanSms)) * per_sm, blocks);
  const int64_t most = std::max<int64_t>(1, ceil_div(ctx, least));
  // The memory plan's partial rows: T x n_heads a split, kCudaAttnRows more than T x n_heads in all.
  const int64_t room = 1 + kCudaAttnRows / (int64_t(T) * n_heads);
  return int(std::clamp<int64_t>(want, 1, std::min<int64_t>({most, room, 64})));
}

int prefill_splits(int T, int n_heads, int head_dim, int64_t positions, int n_sm) {
  // DS4_CUDA_FA_SPLITS=1: never split (comparison).
  static const int most = env_int("DS4_CUDA_FA_SPLITS", kMaxPrefillSplits, 1, kMaxPrefillSplits);
  const int64_t blocks = ceil_div(T, kFaRows) * n_heads;
  const int per_sm = head_dim <= 128 ? fa_blocks_per_sm<128>() : fa_blocks_per_sm<256>();
  const int64_t wave = int64_t(std::min(n_sm, kCudaPlanSms)) * per_sm / blocks;
  return int(std::clamp<int64_t>(std::min(wave, positions / kCudaFaSplitPositions), 1, most));
}

int64_t attention_scratch_floats(int T, int n_heads, int head_dim, int splits) {
  return kAttnCounters + int64_t(T) * n_heads * splits * (head_dim + 2);
}

namespace {

/// The prefill kernel (batches of more than kMaxGemvTokens tokens):
/// DS4_CUDA_ATTN=mma (the tensor cores, default), tiled (f32, the one before
/// it) or split (the decode kernel for every batch), for comparison.
enum class PrefillAttention { mma, tiled, split };
PrefillAttention prefill_attention() {
  static const PrefillAttention kind = [] {
    const char* env = std::getenv("DS4_CUDA_ATTN");
    if (env && std::strcmp(env, "tiled") == 0) return PrefillAttention::tiled;
    if (env && std::strcmp(env, "split") == 0) return PrefillAttention::split;
    const char* old = std::getenv("DS4_CUDA_ATTN_TILED");  // the earlier switch: 0 = split
    if (old && std::strcmp(old, "0") == 0) return PrefillAttention::split;
    return PrefillAttention::mma;
  }();
  return kind;
}

// A kernel with `smem` bytes of dynamic shared memory, opted in on first use.
template <auto kKernel, class... Args>
void launch_opted(size_t smem, dim3 grid, int threads, cudaStream_t s, Args... args) {
  static const bool opted = [smem] {
    DS4_CUDA_CHECK(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    return true;
  }();
  (void)opted;
  launch_smem(kKernel, grid, dim3(threads), smem, s, args...);
}

// A prefill kernel over blocks of `rows` tokens of one head (x `splits`
// ranges of positions).
template <auto kKernel, class... Args>
void launch_prefill(size_t smem, int rows, int threads, int T, int n_heads, int splits, cudaStream_t s,
                    Args... args) {
  launch_opted<kKernel>(smem, dim3(unsigned(n_heads), unsigned(ceil_div(T, rows)), unsigned(splits)), threads, s,
                        args...);
}

// The tensor cores' kernel (its splits merged after it) or the f32 tiled
// one, for head size HD.
template <int HD, class Kv>
void launch_prefill(PrefillAttention kind, const float* q, int64_t ldq, Kv k_cache, Kv v_cache,
                    const BatchToken* batch, int T, const AttentionArgs& a, float* partial, float* out, int64_t ldo,
                    cudaStream_t s) {
  if (kind == PrefillAttention::tiled)
    return launch_prefill<attention_tiled_kernel<HD, Kv>>(tiled_smem_bytes<HD>(), kTileQ, kTileThreads, T, a.n_heads,
                                                          1, s, q, ldq, k_cache, v_cache, batch, T, a, out, ldo);
  const int splits = prefill_splits(T, a.n_heads, HD, a.positions > 0 ? a.positions : a.ctx, multiprocessor_count());
  launch_prefill<attention_mma_kernel<HD, Kv>>(fa_smem_bytes<HD>(), kFaRows, kFaThreads, T, a.n_heads, splits, s, q,
                                               ldq, k_cache, v_cache, batch, T, a, partial, out, ldo);
  if (splits > 1)
    launch(attention_combine_kernel, dim3(unsigned(a.n_heads), unsigned(T)), dim3(std::min(HD, 128)), s,
           static_cast<const float*>(partial), HD, splits, a.n_heads, out, ldo);
}

// attention() for one way of keeping the cache.
template <class Kv>
void attention_on(const float* q, int64_t ldq, Kv k_cache, Kv v_cache, const BatchToken* batch, int T,
                  AttentionArgs a, float* scratch, float* out, int64_t ldo, cudaStream_t s, bool decode) {
  a.split_positions = split_positions();
  const PrefillAttention kind = prefill_attention();
  float* partial = scratch + kAttnCounters;
  if (T > kMaxGemvTokens && !decode && kind != PrefillAttention::split &&
      (a.head_dim == 64 || a.head_dim == 128 || a.head_dim == 256)) {
    switch (a.head_dim) {
      case 64: launch_prefill<64>(kind, q, ldq, k_cache, v_cache, batch, T, a, partial, out, ldo, s); break;
      case 128: launch_prefill<128>(kind, q, ldq, k_cache, v_cache, batch, T, a, partial, out, ldo, s); break;
      default: launch_prefill<256>(kind, q, ldq, k_cache, v_cache, batch, T, a, partial, out, ldo, s); break;
    }
    DS4_CUDA_LAUNCHED();
    return;
  }
  if (a.splits > 1 && int64_t(T) * a.n_heads > kAttnCounters)
    throw Error("CUDA attention: " + std::to_string(a.splits) + " splits for " + std::to_string(T) + " tokens x " +
                std::to_string(a.n_heads) + " heads");
  if (decode_mma_takes(a.n_heads, a.n_kv_heads, a.head_dim, std::is_same_v<Kv, KvQ8>,
                       a.positions > 0 ? a.positions : a.ctx)) {
    if constexpr (std::is_same_v<Kv, KvF16>) {
      const dim3 grid(unsigned(a.n_kv_heads), unsigned(T), unsigned(a.splits));
      switch (a.head_dim) {
        case 64: launch_opted<attention_decode_mma_kernel<64>>(dec_smem_bytes<64>(), grid, kDecThreads, s, q, ldq,
                                                               k_cache, v_cache, batch, a, partial, out, ldo); break;
        case 128: launch_opted<attention_decode_mma_kernel<128>>(dec_smem_bytes<128>(), grid, kDecThreads, s, q, ldq,
                                                                 k_cache, v_cache, batch, a, partial, out, ldo); break;
        default: launch_opted<attention_decode_mma_kernel<256>>(dec_smem_bytes<256>(), grid, kDecThreads, s, q, ldq,
                                                                k_cache, v_cache, batch, a, partial, out, ldo); break;
      }
      DS4_CUDA_LAUNCHED();
      return;
    }
  }
  const int qh = heads_per_block(a.n_heads, a.n_kv_heads);
  const dim3 grid(unsigned(a.n_heads / qh), unsigned(T), unsigned(a.splits));
  switch (a.head_dim) {
#define DS4_ATTN_CASE(HD)                                                                                         \
  case HD:                                                                                                        \
    if (qh == 4)                                                                                                  \
      launch(attention_kernel<HD / 8, 4, Kv>, grid, dim3(kAttnWarps * 32), s, q, ldq, k_cache, v_cache, batch, a, \
             partial, out, ldo);                                                                                  \
    else if (qh == 2)                                                                                             \
      launch(attention_kernel<HD / 8, 2, Kv>, grid, dim3(kAttnWarps * 32), s, q, ldq, k_cache, v_cache, batch, a, \
             partial, out, ldo);                                                                                  \
    else                                                                                                          \
      launch(attention_kernel<HD / 8, 1, Kv>, grid, dim3(kAttnWarps * 32), s, q, ldq, k_cache, v_cache, batch, a, \
             partial, out, ldo);                                                                                  \
    break;
    DS4_ATTN_CASE(8)
    DS4_ATTN_CASE(16)
    DS4_ATTN_CASE(32)
    DS4_ATTN_CASE(64)
    DS4_ATTN_CASE(128)
    DS4_ATTN_CASE(256)
#undef DS4_ATTN_CASE
    default:
      throw Error("CUDA attention: head dimension " + std::to_string(a.head_dim) +
                  " is not supported (8, 16, 32, 64, 128 or 256)");
  }
  DS4_CUDA_LAUNCHED();
}

// One warp a 32-value block of one token's k or v row: the block's largest
// magnitude by shuffles, then each lane its value.
__global__ void store_kv_q8_kernel(const float* k, const float* v, int64_t ldkv, const BatchToken* batch, int kvd,
                                   int64_t ctx, int8_t* kq, __half* kd, int8_t* vq, __half* vd) {
  pdl_wait();
  pdl_trigger();
  const int t = blockIdx.y, lane = threadIdx.x % 32;
  const int blocks = kvd / 32;
  const int job = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;  // [k blocks][v blocks]
  if (job >= 2 * blocks) return;
  const bool is_v = job >= blocks;
  const int blk = is_v ? job - blocks : job;
  const BatchToken b = batch[t];
  const float x = (is_v ? v : k)[t * ldkv + blk * 32 + lane];
  float amax = fabsf(x);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  const bool zero = !(amax >= 1e-30f);
  const int64_t e = (int64_t(b.slot) * ctx + b.pos) * kvd + blk * 32;
  (is_v ? vq : kq)[e + lane] = zero ? int8_t(0) : int8_t(__float2int_rn(x * (127.0f / amax)));
  if (lane == 0) (is_v ? vd : kd)[e / 32] = __float2half_rn(zero ? 0.0f : amax / 127.0f);
}

}  // namespace

void attention(const float* q, int64_t ldq, KvLayer k_cache, KvLayer v_cache, const BatchToken* batch, int T,
               const AttentionArgs& a, float* scratch, float* out, int64_t ldo, cudaStream_t s, bool decode) {
  if (k_cache.q8())
    return attention_on(q, ldq, KvQ8{static_cast<const int8_t*>(k_cache.values), k_cache.scales},
                        KvQ8{static_cast<const int8_t*>(v_cache.values), v_cache.scales}, batch, T, a, scratch, out,
                        ldo, s, decode);
  attention_on(q, ldq, KvF16{static_cast<const __half*>(k_cache.values)},
               KvF16{static_cast<const __half*>(v_cache.values)}, batch, T, a, scratch, out, ldo, s, decode);
}

void store_kv_q8(const float* k, const float* v, int64_t ldkv, const BatchToken* batch, int T, int kv_dim,
                 int64_t ctx, KvLayer k_cache, KvLayer v_cache, cudaStream_t s) {
  if (T == 0) return;
  constexpr int kWarps = 8;
  const dim3 grid(unsigned(ceil_div(2 * (kv_dim / 32), kWarps)), unsigned(T));
  launch(store_kv_q8_kernel, grid, dim3(kWarps * 32), s, k, v, ldkv, batch, kv_dim, ctx,
         static_cast<int8_t*>(k_cache.values), k_cache.scales, static_cast<int8_t*>(v_cache.values), v_cache.scales);
  DS4_CUDA_LAUNCHED();
}

void swiglu(float* g, const float* u, int64_t ld, int64_t n, int T, cudaStream_t s) {
  launch(swiglu_kernel, rows_grid(n, T), dim3(kThreads), s, g, u, ld, n);
  DS4_CUDA_LAUNCHED();
}

void add(float* x, const float* o, int64_t ld, int64_t n, int T, cudaStream_t s) {
  launch(add_kernel, rows_grid(n, T), dim3(kThreads), s, x, o, ld, n);
  DS4_CUDA_LAUNCHED();
}

void gather_rows(const float* src, int64_t ld_src, const int32_t* rows, int count, int64_t n, float* dst,
                 int64_t ld_dst, cudaStream_t s) {
  if (count == 0) return;
  launch(gather_rows_kernel, dim3(unsigned(count)), dim3(kThreads), s, src, ld_src, rows, n, dst, ld_dst);
  DS4_CUDA_LAUNCHED();
}

void moe_group(int32_t* expert_pair, const float* weight, int P, int K, int E, int job_rows, int32_t* start,
               int32_t* token_of, float* weight_of, int32_t* jobs, int32_t* n_jobs, cudaStream_t s) {
  if (E > 1024 || job_rows < 1) throw Error("moe_group: " + std::to_string(E) + " experts");
  launch(moe_group_kernel, dim3(1), dim3(1024), s, expert_pair, weight, P, K, E, job_rows, start, token_of, weight_of,
         jobs, n_jobs);
  DS4_CUDA_LAUNCHED();
}

void moe_topk(float* scores, int64_t ld, int T, int E, int K, bool norm, int32_t* expert, float* weight, int32_t* pair,
              cudaStream_t s) {
  if (E > 32 * 32 || K > E) throw Error("moe_topk: " + std::to_string(E) + " experts, " + std::to_string(K) + " a token");
  launch(moe_topk_kernel, dim3(unsigned((T + 3) / 4)), dim3(128), s, scores, ld, T, E, K, int(norm), expert, weight,
         pair);
  DS4_CUDA_LAUNCHED();
}

void moe_combine(const MoeCombine& c, float* out, int64_t ldo, bool accumulate, int64_t n, int T, cudaStream_t s) {
  if (c.K > kMaxCombine) throw Error("MoE combine: " + std::to_string(c.K) + " experts a token (at most 64)");
  // Every block takes the shared expert's gate over all of c.n: where out is
  // c.n itself, one block a token (it reads n before it writes).
  const dim3 grid = c.shared_y && c.n == out ? dim3(1, unsigned(T)) : rows_grid(n, T);
  launch(moe_combine_kernel, grid, dim3(kThreads), s, c, out, ldo, accumulate, n);
  DS4_CUDA_LAUNCHED();
}

void gather_logit_rows(const float* x, int64_t ld, const BatchToken* batch, int T, float* xl, cudaStream_t s) {
  launch(gather_kernel, dim3(T), dim3(kThreads), s, x, ld, batch, xl);
  DS4_CUDA_LAUNCHED();
}

}  // namespace ds4::cuda
