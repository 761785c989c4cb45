// Element-wise and attention kernels of the CUDA backend. Each mirrors one
// step of the CPU reference forward pass (worker/cpu/cpu_backend.cpp).
#include <algorithm>
#include <cmath>
#include <string>

#include "worker/cuda/kernels.cuh"

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

__global__ void rope_store_kernel(float* q, int64_t ldq, float* k, const float* v, int64_t ldkv,
                                  const BatchToken* batch, RopeArgs a, __half* kc, __half* vc) {
  pdl_wait();
  pdl_trigger();
  const int t = blockIdx.x;
  const BatchToken b = batch[t];
  const int pairs = a.n_rot / 2;
  const int heads = a.n_heads + a.n_kv_heads;
  for (int job = threadIdx.x; job < heads * pairs; job += blockDim.x) {
    const int h = job / pairs, i = job % pairs;
    // theta_i = pos * scale^i, by the same repeated multiplication as the CPU.
    float theta = float(b.pos);
    for (int j = 0; j < i; ++j) theta *= a.theta_scale;
    const float c = cosf(theta), s = sinf(theta);
    float* row = h < a.n_heads ? q + t * ldq + int64_t(h) * a.head_dim
                               : k + t * ldkv + int64_t(h - a.n_heads) * a.head_dim;
    const float x0 = row[2 * i], x1 = row[2 * i + 1];
    row[2 * i] = x0 * c - x1 * s;
    row[2 * i + 1] = x0 * s + x1 * c;
  }
  __syncthreads();
  const int64_t kvd = int64_t(a.n_kv_heads) * a.head_dim;
  const int64_t at = (int64_t(b.slot) * a.ctx + b.pos) * kvd;
  for (int64_t i = threadIdx.x; i < kvd; i += blockDim.x) {
    kc[at + i] = __float2half_rn(k[t * ldkv + i]);
    vc[at + i] = __float2half_rn(v[t * ldkv + i]);
  }
}

// Attention. A block takes one (token, head, split): the positions of its
// split, in lane groups of G = head_dim / 8 lanes, each lane holding 8
// consecutive dimensions (one 16-byte load of K and of V per position). Each
// group keeps an online softmax (max, sum, weighted V); the block merges its
// groups into one partial result, and attention_combine merges the splits.
constexpr int kAttnWarps = 8;

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

template <int G>
__global__ void __launch_bounds__(kAttnWarps * 32) attention_kernel(const float* q, int64_t ldq, const __half* kc,
                                                                     const __half* vc, const BatchToken* batch,
                                                                     AttentionArgs a, float* partial) {
  pdl_wait();
  pdl_trigger();
  constexpr int kGroups = kAttnWarps * 32 / G;
  constexpr int HD = G * 8;
  __shared__ float s_m[kGroups], s_l[kGroups];
  __shared__ float s_acc[kGroups][HD];
  const int h = blockIdx.x, t = blockIdx.y, split = blockIdx.z;
  const BatchToken b = batch[t];
  const int64_t n_pos = int64_t(b.pos) + 1;
  const int64_t chunk = (a.ctx + a.splits - 1) / a.splits;
  const int64_t p0 = int64_t(split) * chunk, p1 = min(n_pos, p0 + chunk);
  const int group = threadIdx.x / G, gl = threadIdx.x % G;
  const int kvh = h / (a.n_heads / a.n_kv_heads);
  const int64_t kvd = int64_t(a.n_kv_heads) * HD;

  float qv[8];
  {
    const float4* qp = reinterpret_cast<const float4*>(q + t * ldq + int64_t(h) * HD + gl * 8);
    const float4 x0 = qp[0], x1 = qp[1];
    qv[0] = x0.x; qv[1] = x0.y; qv[2] = x0.z; qv[3] = x0.w;
    qv[4] = x1.x; qv[5] = x1.y; qv[6] = x1.z; qv[7] = x1.w;
  }
  float m = -INFINITY, l = 0.0f, acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  const __half* kbase = kc + int64_t(b.slot) * a.ctx * kvd + int64_t(kvh) * HD + gl * 8;
  const __half* vbase = vc + int64_t(b.slot) * a.ctx * kvd + int64_t(kvh) * HD + gl * 8;
  // Every lane runs the same number of iterations (the shuffles need the
  // whole warp); a group past the end of the range computes and drops.
  for (int64_t base = p0; base < p1; base += kGroups) {
    const int64_t p = base + group;
    const bool valid = p < p1;
    float kf[8] = {0, 0, 0, 0, 0, 0, 0, 0}, vf[8];
    if (valid) {
      load8(kbase + p * kvd, kf);
      load8(vbase + p * kvd, vf);
    }
    float d = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j) d = fmaf(qv[j], kf[j], d);
#pragma unroll
    for (int off = G / 2; off > 0; off >>= 1) d += __shfl_xor_sync(0xffffffffu, d, off, G);
    if (!valid) continue;
    const float s = d * a.scale;
    const float m_new = fmaxf(m, s);
    const float corr = expf(m - m_new);  // 0 for the first position (m = -inf)
    const float e = expf(s - m_new);
    l = l * corr + e;
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[j] = acc[j] * corr + e * vf[j];
    m = m_new;
  }
  if (gl == 0) {
    s_m[group] = m;
    s_l[group] = l;
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) s_acc[group][gl * 8 + j] = acc[j];
  __syncthreads();
  // Merge the groups: thread d < HD takes dimension d.
  float* out = partial + ((int64_t(t) * a.n_heads + h) * a.splits + split) * (HD + 2);
  if (threadIdx.x < HD) {
    float M = -INFINITY;
    for (int g = 0; g < kGroups; ++g) M = fmaxf(M, s_m[g]);
    float L = 0.0f, A = 0.0f;
    if (M != -INFINITY) {
      for (int g = 0; g < kGroups; ++g) {
        const float w = expf(s_m[g] - M);
        L += s_l[g] * w;
        A += s_acc[g][threadIdx.x] * w;
      }
    }
    out[threadIdx.x] = A;
    if (threadIdx.x == 0) {
      out[HD] = M;
      out[HD + 1] = L;
    }
  }
}

__global__ void attention_combine_kernel(const float* partial, int n_heads, int hd, int splits, float* out,
                                         int64_t ldo) {
  pdl_wait();
  pdl_trigger();
  const int h = blockIdx.x, t = blockIdx.y;
  const float* p = partial + (int64_t(t) * n_heads + h) * splits * (hd + 2);
  float M = -INFINITY;
  for (int s = 0; s < splits; ++s) M = fmaxf(M, p[s * (hd + 2) + hd]);
  for (int d = threadIdx.x; d < hd; d += blockDim.x) {
    float L = 0.0f, A = 0.0f;
    for (int s = 0; s < splits; ++s) {
      const float* ps = p + s * (hd + 2);
      if (ps[hd] == -INFINITY) continue;
      const float w = expf(ps[hd] - M);
      L += ps[hd + 1] * w;
      A += ps[d] * w;
    }
    out[int64_t(t) * ldo + int64_t(h) * hd + d] = A / L;
  }
}

__global__ void swiglu_kernel(float* g, const float* u, int64_t ld, int64_t n) {
  pdl_wait();
  pdl_trigger();
  const int t = blockIdx.y;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float x = g[t * ld + i];
    g[t * ld + i] = x / (1.0f + expf(-x)) * u[t * ld + i];
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

dim3 rows_grid(int64_t n, int T) { return dim3(unsigned(std::min<int64_t>(ceil_div(n, kThreads), 1024)), unsigned(T)); }

}  // namespace

void embed(const DeviceWeight& table, const BatchToken* batch, int T, float* x, int64_t ldx, cudaStream_t s) {
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
  launch(rope_store_kernel, dim3(T), dim3(kThreads), s, q, ldq, k, v, ldkv, batch, a, k_cache, v_cache);
  DS4_CUDA_LAUNCHED();
}

int attention_splits(int T, int n_heads, int64_t ctx, int n_sm) {
  const int64_t blocks = int64_t(T) * n_heads;
  const int64_t want = ceil_div(int64_t(n_sm) * 4, blocks);
  const int64_t most = std::max<int64_t>(1, ceil_div(ctx, 64));  // at least 64 positions a split
  return int(std::clamp<int64_t>(want, 1, std::min<int64_t>(most, 64)));
}

int64_t attention_scratch_floats(int T, int n_heads, int head_dim, int splits) {
  return int64_t(T) * n_heads * splits * (head_dim + 2);
}

void attention(const float* q, int64_t ldq, const __half* k_cache, const __half* v_cache, const BatchToken* batch,
               int T, const AttentionArgs& a, float* scratch, float* out, int64_t ldo, cudaStream_t s) {
  const dim3 grid(unsigned(a.n_heads), unsigned(T), unsigned(a.splits));
  switch (a.head_dim) {
#define DS4_ATTN_CASE(HD)                                                                             \
  case HD:                                                                                            \
    launch(attention_kernel<HD / 8>, grid, dim3(kAttnWarps * 32), s, q, ldq, k_cache, v_cache, batch, a, scratch); \
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
  launch(attention_combine_kernel, dim3(unsigned(a.n_heads), unsigned(T)), dim3(128), s, scratch, a.n_heads,
         a.head_dim, a.splits, out, ldo);
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

void gather_logit_rows(const float* x, int64_t ld, const BatchToken* batch, int T, float* xl, cudaStream_t s) {
  launch(gather_kernel, dim3(T), dim3(kThreads), s, x, ld, batch, xl);
  DS4_CUDA_LAUNCHED();
}

}  // namespace ds4::cuda
