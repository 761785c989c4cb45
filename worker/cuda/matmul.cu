// Matrix products of the CUDA backend. Decode (1 to 8 tokens) is bound by
// memory bandwidth: a warp streams one weight row with 16-byte loads and keeps
// one sum per token, so each weight is read once per step whatever the batch.
// Prefill goes to cuBLAS on the tensor cores, with the activations (and a
// Q8_0 weight) converted to 16-bit floats first.
#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include "worker/cuda/kernels.cuh"
#include "worker/cuda/quant.cuh"

namespace ds4::cuda {
namespace {

constexpr int kGemvWarps = 4;
constexpr int kGemvThreads = kGemvWarps * 32;

/// One 16-byte load of weights that are read once per step: not kept in L1
/// (where the activations live), and the next 256 bytes asked of L2 with it.
__device__ __forceinline__ uint4 load_stream(const void* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

/// Weights of one type: E elements in 16 bytes, turned into floats.
template <GgmlType TY>
struct Chunk;

template <>
struct Chunk<GgmlType::F32> {
  static constexpr int E = 4;
  __device__ static void to_float(const uint4& u, float (&f)[E]) {
    f[0] = __uint_as_float(u.x); f[1] = __uint_as_float(u.y);
    f[2] = __uint_as_float(u.z); f[3] = __uint_as_float(u.w);
  }
};

template <>
struct Chunk<GgmlType::F16> {
  static constexpr int E = 8;
  __device__ static void to_float(const uint4& u, float (&f)[E]) {
    const __half2* h = reinterpret_cast<const __half2*>(&u);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 v = __half22float2(h[j]);
      f[2 * j] = v.x;
      f[2 * j + 1] = v.y;
    }
  }
};

template <>
struct Chunk<GgmlType::BF16> {
  static constexpr int E = 8;
  __device__ static void to_float(const uint4& u, float (&f)[E]) {
    const uint32_t words[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      f[2 * j] = __uint_as_float(words[j] << 16);
      f[2 * j + 1] = __uint_as_float(words[j] & 0xffff0000u);
    }
  }
};

/// Q8_0 quants only; the block scale is applied once per 16 products.
/// A quant becomes a float without I2F (a quarter-rate instruction): its
/// byte, offset to unsigned, goes under the exponent of 2^23 (one PRMT) and
/// 2^23 + 128 comes off again (one FADD), which is exact.
template <>
struct Chunk<GgmlType::Q8_0> {
  static constexpr int E = 16;
  __device__ static void to_float(const uint4& u, float (&f)[E]) {
    const uint32_t words[4] = {u.x ^ 0x80808080u, u.y ^ 0x80808080u, u.z ^ 0x80808080u, u.w ^ 0x80808080u};
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int b = 0; b < 4; ++b)
        f[4 * j + b] = __uint_as_float(__byte_perm(words[j], 0x4b000000u, 0x7440u + unsigned(b))) - 8388736.0f;
  }
};

template <GgmlType TY>
__host__ __device__ constexpr int64_t elem_bytes_x4() {  // bytes of 4 elements (Q8_0 quants: 1 byte each)
  return TY == GgmlType::F32 ? 16 : TY == GgmlType::Q8_0 ? 4 : 8;
}

/// Up to three products with one input; each block takes R rows of one of
/// them (blocks of the products laid end to end over the grid). With `glu`,
/// two products (gate, up) whose rows a block computes together, writing
/// silu(gate) * up to y[0] (the SwiGLU of the feed-forward block).
struct GemvJobs {
  const void* w[3];
  const __half* scales[3];
  float* y[3];
  int64_t ldy[3];
  int rows[3];
  int blocks[3];
  int accumulate[3];
  int n;
};

/// RMSNorm folded into a product: y = (W . (x o g)) / sqrt(mean(x^2) + eps),
/// with the sum of squares taken (in double, as the CPU does) from the same
/// reads of x that the product makes. g == nullptr: no norm.
struct GemvNorm {
  const float* g = nullptr;
  float eps = 0;
};

/// One 16-byte chunk of each of NR rows (Q8_0: with its block scale d) times
/// the E activations at k of NT tokens, into acc; with NORM, x is scaled by g
/// on the way and its squares summed (double) into ss. The tokens go in
/// groups of at most 4 (their activations in registers, each group over every
/// row): each (row, token) sum takes the same steps in the same order
/// whatever the group, so a token's result is its result alone.
template <GgmlType TY, int NT, int NR, bool NORM>
__device__ __forceinline__ void gemv_chunk(const uint4 (&raw)[NR], const float (&d)[NR], const float* __restrict__ x,
                                           int64_t ldx, int64_t k, const GemvNorm& norm, double (&ss)[NT],
                                           float (&acc)[NR][NT]) {
  using C = Chunk<TY>;
  constexpr int E = C::E;
  constexpr bool Q8 = TY == GgmlType::Q8_0;
  constexpr int TG = NT < 4 ? NT : 4;
  float gf[E];
  if (NORM) {
    const float4* gp = reinterpret_cast<const float4*>(norm.g + k);
#pragma unroll
    for (int q = 0; q < E / 4; ++q) {
      const float4 v = __ldg(gp + q);
      gf[4 * q] = v.x; gf[4 * q + 1] = v.y; gf[4 * q + 2] = v.z; gf[4 * q + 3] = v.w;
    }
  }
#pragma unroll
  for (int t0 = 0; t0 < NT; t0 += TG) {
    float xf[TG][E];
#pragma unroll
    for (int j = 0; j < TG; ++j) {
      if (t0 + j >= NT) break;
      const float4* xp = reinterpret_cast<const float4*>(x + (t0 + j) * ldx + k);
#pragma unroll
      for (int q = 0; q < E / 4; ++q) {
        const float4 v = __ldg(xp + q);
        xf[j][4 * q] = v.x; xf[j][4 * q + 1] = v.y; xf[j][4 * q + 2] = v.z; xf[j][4 * q + 3] = v.w;
      }
      if (NORM) {
#pragma unroll
        for (int e = 0; e < E; ++e) {
          ss[t0 + j] += double(xf[j][e] * xf[j][e]);
          xf[j][e] *= gf[e];
        }
      }
    }
#pragma unroll
    for (int i = 0; i < NR; ++i) {
      float wf[E];
      C::to_float(raw[i], wf);
#pragma unroll
      for (int j = 0; j < TG; ++j) {
        if (t0 + j >= NT) break;
        const int t = t0 + j;
        float s = Q8 ? 0.0f : acc[i][t];
#pragma unroll
        for (int e = 0; e < E; ++e) s = fmaf(wf[e], xf[j][e], s);
        acc[i][t] = Q8 ? fmaf(s, d[i], acc[i][t]) : s;
      }
    }
  }
}

/// Rows per block for a batch of NT tokens (GLU: of each of gate and up):
/// enough products per loaded x to keep the activations' reads near the
/// weights', few enough registers. Eight tokens over two rows read 16 bytes of
/// activations from L2 for each weight byte (an 8B model's decode step of 8
/// tokens: 5x the time of one, H200); over eight rows, 4.
template <int NT, bool GLU = false>
__host__ __device__ constexpr int gemv_rows() { return NT <= 2 ? 4 : GLU ? 4 : 8; }

/// Decode GEMV. The 128 threads of a block split K: thread i takes the
/// 16-byte chunks i, i+128, ... of each of the block's rows, so a step of the
/// block reads 2 KiB of every row. U chunks of each row are loaded before
/// any is used (NR*U 16-byte loads in flight per thread); the activations
/// come through L1 and are used for all NR rows. Partial sums meet in
/// shared memory at the end.
template <GgmlType TY, int NT, bool GLU, bool NORM>
__global__ void __launch_bounds__(kGemvThreads) gemv_kernel(GemvJobs jobs, int64_t K, const float* __restrict__ x,
                                                            int64_t ldx, GemvNorm norm) {
  using C = Chunk<TY>;
  constexpr int E = C::E, R = gemv_rows<NT, GLU>(), NW = GLU ? 2 : 1, NR = NW * R;
  constexpr int U = NR >= 8 ? 1 : 8 / NR;
  constexpr int64_t chunk_bytes = 16;
  int blk = int(blockIdx.x), j = 0;
  while (j + 1 < jobs.n && blk >= jobs.blocks[j]) blk -= jobs.blocks[j++];
  const int rows = jobs.rows[j];
  const int64_t row0 = int64_t(blk) * R;
  const int64_t rb = K / 4 * elem_bytes_x4<TY>();  // bytes of one row
  const char* wp[NR];
  const __half* sp[NR];
#pragma unroll
  for (int w = 0; w < NW; ++w)
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int64_t row = min(row0 + r, int64_t(rows) - 1);  // past the end: computed, not stored
      wp[w * R + r] = static_cast<const char*>(jobs.w[j + w]) + row * rb;
      sp[w * R + r] = TY == GgmlType::Q8_0 ? jobs.scales[j + w] + row * (K / 32) : nullptr;
    }
  // Weights do not depend on the previous kernel: ask L2 for this block's
  // rows while that kernel finishes.
#pragma unroll
  for (int i = 0; i < NR; ++i)
    for (int64_t off = int64_t(threadIdx.x) * 128; off < rb; off += int64_t(kGemvThreads) * 128)
      asm volatile("prefetch.global.L2 [%0];" ::"l"(wp[i] + off));
  pdl_wait();
  pdl_trigger();

  float acc[NR][NT];
  double ss[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    ss[t] = 0.0;
#pragma unroll
    for (int i = 0; i < NR; ++i) acc[i][t] = 0.0f;
  }
  for (int64_t k0 = int64_t(threadIdx.x) * E; k0 < K; k0 += int64_t(kGemvThreads) * E * U) {
    uint4 raw[U][NR];
    float d[U][NR];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t k = k0 + int64_t(u) * kGemvThreads * E;
#pragma unroll
      for (int i = 0; i < NR; ++i) {
        if (k < K) {
          raw[u][i] = load_stream(wp[i] + k / E * chunk_bytes);
          if (TY == GgmlType::Q8_0) d[u][i] = __half2float(__ldg(sp[i] + k / 32));
        }
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t k = k0 + int64_t(u) * kGemvThreads * E;
      if (k >= K) break;
      gemv_chunk<TY, NT, NR, NORM>(raw[u], d[u], x, ldx, k, norm, ss, acc);
    }
  }

  // Sum over the warp, then over the block's warps.
  __shared__ float red[kGemvWarps][NR * NT];
  __shared__ double red_ss[kGemvWarps][NT];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int i = 0; i < NR; ++i)
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      float v = acc[i][t];
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
      if (lane == 0) red[warp][i * NT + t] = v;
    }
  if (NORM) {
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      double v = ss[t];
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
      if (lane == 0) red_ss[warp][t] = v;
    }
  }
  __syncthreads();
  if (threadIdx.x >= R * NT) return;
  const int r = int(threadIdx.x) / NT, t = int(threadIdx.x) % NT;
  const int64_t row = row0 + r;
  if (row >= rows) return;
  float scale = 1.0f;
  if (NORM) {
    double sum = 0.0;
#pragma unroll
    for (int w = 0; w < kGemvWarps; ++w) sum += red_ss[w][t];
    scale = 1.0f / sqrtf(float(sum / double(K)) + norm.eps);
  }
  float v[NW];
#pragma unroll
  for (int w = 0; w < NW; ++w) {
    float s = 0.0f;
#pragma unroll
    for (int q = 0; q < kGemvWarps; ++q) s += red[q][(w * R + r) * NT + t];
    v[w] = s * scale;
  }
  float* dst = jobs.y[j] + t * jobs.ldy[j] + row;
  if (GLU) *dst = v[0] / (1.0f + expf(-v[0])) * v[NW - 1];
  else *dst = jobs.accumulate[j] ? *dst + v[0] : v[0];
}

/// Decode GEMV for NT tokens (launched for one), as a persistent grid of at
/// most MINB blocks of THREADS threads a multiprocessor, each block taking row
/// groups g, g + gridDim.x, ... of R rows. Threads split K as in gemv_kernel,
/// U chunks of each row a round. Loads run one round ahead: the next round's
/// (of this group or the block's next one) are issued before this round is
/// used and before the group's block-wide sum, so a block keeps its loads in
/// flight across its own tail. The first round is loaded before waiting on the
/// previous kernel (weights depend on no kernel); with PF_KB, L2 is also asked
/// for up to that many KiB of the block's next groups there.
template <GgmlType TY, int NT, bool GLU, bool NORM, int THREADS, int R, int U, int MINB, int PF_KB>
__global__ void __launch_bounds__(THREADS, MINB) gemv_stream_kernel(GemvJobs jobs, int groups, int64_t K,
                                                                    const float* __restrict__ x, int64_t ldx,
                                                                    GemvNorm norm) {
  using C = Chunk<TY>;
  constexpr int E = C::E, NW = GLU ? 2 : 1, NR = NW * R, WARPS = THREADS / 32;
  constexpr bool Q8 = TY == GgmlType::Q8_0;
  const int64_t rb = K / 4 * elem_bytes_x4<TY>();
  const int64_t per_round = int64_t(THREADS) * E * U;
  const int rounds = int((K + per_round - 1) / per_round);
  int g = int(blockIdx.x);
  if (g >= groups) return;

  // The product and first row of group g.
  auto locate = [&](int grp, int& j, int64_t& row0) {
    j = 0;
    while (j + 1 < jobs.n && grp >= jobs.blocks[j]) grp -= jobs.blocks[j++];
    row0 = int64_t(grp) * R;
  };
  auto load = [&](int grp, int r, uint4(&raw)[U][NR], float(&d)[U][NR]) {
    int j;
    int64_t row0;
    locate(grp, j, row0);
    const int64_t rows = jobs.rows[j];
#pragma unroll
    for (int w = 0; w < NW; ++w)
#pragma unroll
      for (int rr = 0; rr < R; ++rr) {
        const int64_t row = min(row0 + rr, rows - 1);  // past the end: computed, not stored
        const char* wp = static_cast<const char*>(jobs.w[j + w]) + row * rb;
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int64_t k = int64_t(r) * per_round + (int64_t(u) * THREADS + threadIdx.x) * E;
          if (k < K) {
            raw[u][w * R + rr] = load_stream(wp + k / E * 16);
            if (Q8) d[u][w * R + rr] = __half2float(__ldg(jobs.scales[j + w] + row * (K / 32) + k / 32));
          }
        }
      }
  };

  float acc[NR][NT];
  double ss[NT];
  auto clear = [&] {
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      ss[t] = 0.0;
#pragma unroll
      for (int i = 0; i < NR; ++i) acc[i][t] = 0.0f;
    }
  };
  clear();
  uint4 raw[U][NR], next[U][NR];
  float d[U][NR], next_d[U][NR];
  load(g, 0, raw, d);
  // Ask L2 for the rows of the block's next groups too, up to PF_KB KiB, while
  // the previous kernel finishes: small products then run from L2.
  if constexpr (PF_KB > 0) {
    const int ahead = int(int64_t(PF_KB) * 1024 / (int64_t(NR) * rb));
    for (int i = 1; i <= ahead; ++i) {
      const int pg = g + i * int(gridDim.x);
      if (pg >= groups) break;
      int j;
      int64_t row0;
      locate(pg, j, row0);
#pragma unroll
      for (int w = 0; w < NW; ++w)
#pragma unroll
        for (int rr = 0; rr < R; ++rr) {
          const char* wp = static_cast<const char*>(jobs.w[j + w]) + min(row0 + rr, int64_t(jobs.rows[j]) - 1) * rb;
          for (int64_t off = int64_t(threadIdx.x) * 128; off < rb; off += int64_t(THREADS) * 128)
            asm volatile("prefetch.global.L2 [%0];" ::"l"(wp + off));
        }
    }
  }
  pdl_wait();
  pdl_trigger();

  __shared__ float red[2][WARPS][NR * NT];
  __shared__ double red_ss[2][WARPS][NT];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int r = 0, par = 0;
  for (;;) {
    int ng = g, nr = r + 1;
    if (nr == rounds) {
      nr = 0;
      ng += int(gridDim.x);
    }
    const bool more = ng < groups;
    if (more) load(ng, nr, next, next_d);

#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t k = int64_t(r) * per_round + (int64_t(u) * THREADS + threadIdx.x) * E;
      if (k >= K) break;
      gemv_chunk<TY, NT, NR, NORM>(raw[u], d[u], x, ldx, k, norm, ss, acc);
    }

    if (r == rounds - 1) {  // the group's sums: over the warp, then the block's warps
#pragma unroll
      for (int i = 0; i < NR; ++i)
#pragma unroll
        for (int t = 0; t < NT; ++t) {
          float v = acc[i][t];
#pragma unroll
          for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
          if (lane == 0) red[par][warp][i * NT + t] = v;
        }
      if (NORM) {
#pragma unroll
        for (int t = 0; t < NT; ++t) {
          double v = ss[t];
#pragma unroll
          for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
          if (lane == 0) red_ss[par][warp][t] = v;
        }
      }
      clear();
      // One barrier a group: the buffer written next (red[par ^ 1]) was last
      // read before the previous group's barrier.
      __syncthreads();
      if (threadIdx.x < R * NT) {
        int j;
        int64_t row0;
        locate(g, j, row0);
        const int rr = int(threadIdx.x) / NT, t = int(threadIdx.x) % NT;
        const int64_t row = row0 + rr;
        if (row < jobs.rows[j]) {
          float scale = 1.0f;
          if (NORM) {
            double sum = 0.0;
#pragma unroll
            for (int w = 0; w < WARPS; ++w) sum += red_ss[par][w][t];
            scale = 1.0f / sqrtf(float(sum / double(K)) + norm.eps);
          }
          float v[NW];
#pragma unroll
          for (int w = 0; w < NW; ++w) {
            float s = 0.0f;
#pragma unroll
            for (int q = 0; q < WARPS; ++q) s += red[par][q][(w * R + rr) * NT + t];
            v[w] = s * scale;
          }
          float* dst = jobs.y[j] + t * jobs.ldy[j] + row;
          if (GLU) *dst = v[0] / (1.0f + expf(-v[0])) * v[NW - 1];
          else *dst = jobs.accumulate[j] ? *dst + v[0] : v[0];
        }
      }
      par ^= 1;
    }
    if (!more) break;
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int i = 0; i < NR; ++i) {
        raw[u][i] = next[u][i];
        d[u][i] = next_d[u][i];
      }
    g = ng;
    r = nr;
  }
}

/// Any shape, one element at a time: for rows whose length breaks 16-byte alignment.
__global__ void gemv_scalar_kernel(DeviceWeight w, const float* x, int64_t ldx, int T, float* y, int64_t ldy,
                                   int accumulate) {
  pdl_wait();
  pdl_trigger();
  const int lane = threadIdx.x % 32;
  const int64_t row = int64_t(blockIdx.x) * kGemvWarps + threadIdx.x / 32;
  if (row >= w.rows) return;
  for (int t = 0; t < T; ++t) {
    float acc = 0.0f;
    for (int64_t k = lane; k < w.cols; k += 32) {
      float wv;
      switch (w.type) {
        case GgmlType::F32: wv = static_cast<const float*>(w.data)[row * w.cols + k]; break;
        case GgmlType::F16: wv = __half2float(static_cast<const __half*>(w.data)[row * w.cols + k]); break;
        case GgmlType::BF16:
          wv = __bfloat162float(static_cast<const __nv_bfloat16*>(w.data)[row * w.cols + k]);
          break;
        default:
          wv = float(static_cast<const int8_t*>(w.data)[row * w.cols + k]) *
               __half2float(w.scales[row * (w.cols / 32) + k / 32]);
      }
      acc = fmaf(wv, x[t * ldx + k], acc);
    }
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (lane == 0) y[t * ldy + row] = accumulate ? y[t * ldy + row] + acc : acc;
  }
}

/// The decode GEMV's shape for one token: DS4_CUDA_GEMV=0 takes the one-shot
/// blocks of gemv_kernel, another number one of the persistent shapes of
/// launch_stream's table; unset, the fastest measured for the weight type.
int gemv_variant(GgmlType type) {
  static const int forced = [] {
    const char* env = std::getenv("DS4_CUDA_GEMV");
    return env ? std::atoi(env) : -1;
  }();
  if (forced >= 0) return forced;
  return type == GgmlType::Q8_0 ? 13 : 2;
}

template <GgmlType TY, int NT, bool GLU, bool NORM, int THREADS, int R, int U, int MINB, int PF_KB>
void launch_stream(GemvJobs jobs, int64_t K, const float* x, int64_t ldx, const GemvNorm& norm, cudaStream_t s) {
  int groups = 0;
  for (int i = 0; i < (GLU ? 1 : jobs.n); ++i) {
    jobs.blocks[i] = int(ceil_div(jobs.rows[i], R));
    groups += jobs.blocks[i];
  }
  // As many groups for every block (the last blocks finish with the rest).
  const int cap = multiprocessor_count() * MINB;
  const int per_block = int(ceil_div(groups, cap));
  const int grid = int(ceil_div(groups, per_block));
  launch(gemv_stream_kernel<TY, NT, GLU, NORM, THREADS, R, U, MINB, PF_KB>, dim3(unsigned(grid)),
         dim3(unsigned(THREADS)), s, jobs, groups, K, x, ldx, norm);
}

/// Whether the persistent kernel took the product (one token, F16 or Q8_0).
/// A shape: variant, threads, rows a group and loads in flight a row (plain
/// products, then gate/up), blocks a multiprocessor, KiB of L2 prefetch ahead.
template <GgmlType TY, bool GLU, bool NORM>
bool launch_stream(const GemvJobs& jobs, int64_t K, const float* x, int64_t ldx, int T, const GemvNorm& norm,
                   cudaStream_t s) {
  if constexpr (TY != GgmlType::F16 && TY != GgmlType::Q8_0) {
    return false;
  } else {
    if (T != 1) return false;
#define DS4_STREAM(V, TH, R, U, RG, UG, MINB, PF)                                                             \
  case V:                                                                                                     \
    launch_stream<TY, 1, GLU, NORM, TH, GLU ? RG : R, GLU ? UG : U, MINB, PF>(jobs, K, x, ldx, norm, s); \
    return true;
    // Measured on the H200 (NOTES.md, all shapes there): 2 for F16, 13 for Q8_0.
    switch (gemv_variant(TY)) {
      DS4_STREAM(1, 256, 4, 2, 4, 1, 2, 0)
      DS4_STREAM(2, 128, 4, 2, 4, 1, 4, 0)
      DS4_STREAM(11, 128, 8, 1, 4, 1, 4, 0)
      DS4_STREAM(13, 128, 4, 2, 4, 1, 4, 32)
      default: return false;
    }
#undef DS4_STREAM
  }
}

template <GgmlType TY, bool GLU, bool NORM>
void launch_gemv(GemvJobs jobs, int64_t K, const float* x, int64_t ldx, int T, const GemvNorm& norm,
                 cudaStream_t s) {
  if (launch_stream<TY, GLU, NORM>(jobs, K, x, ldx, T, norm, s)) return;
  const int R = T <= 2 ? gemv_rows<1, GLU>() : gemv_rows<3, GLU>();
  int blocks = 0;
  for (int i = 0; i < (GLU ? 1 : jobs.n); ++i) {
    jobs.blocks[i] = int(ceil_div(jobs.rows[i], R));
    blocks += jobs.blocks[i];
  }
  const dim3 grid{unsigned(blocks)}, block{unsigned(kGemvThreads)};
  switch (T) {
#define DS4_GEMV_CASE(N) \
  case N: launch(gemv_kernel<TY, N, GLU, NORM>, grid, block, s, jobs, K, x, ldx, norm); break;
    DS4_GEMV_CASE(1)
    DS4_GEMV_CASE(2)
    DS4_GEMV_CASE(3)
    DS4_GEMV_CASE(4)
    DS4_GEMV_CASE(5)
    DS4_GEMV_CASE(6)
    DS4_GEMV_CASE(7)
    DS4_GEMV_CASE(8)
#undef DS4_GEMV_CASE
    default: throw Error("GEMV: batch of " + std::to_string(T) + " tokens");
  }
}

template <GgmlType TY>
void launch_gemv(const GemvJobs& jobs, bool glu, int64_t K, const float* x, int64_t ldx, int T, const GemvNorm& norm,
                 cudaStream_t s) {
  const bool nm = norm.g != nullptr;
  if (glu) nm ? launch_gemv<TY, true, true>(jobs, K, x, ldx, T, norm, s)
              : launch_gemv<TY, true, false>(jobs, K, x, ldx, T, norm, s);
  else nm ? launch_gemv<TY, false, true>(jobs, K, x, ldx, T, norm, s)
          : launch_gemv<TY, false, false>(jobs, K, x, ldx, T, norm, s);
}

int chunk_elems(GgmlType t) {
  switch (t) {
    case GgmlType::F32: return 4;
    case GgmlType::F16:
    case GgmlType::BF16: return 8;
    default: return 16;
  }
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

/// Whether the products can share one vectorised GEMV launch: like types and
/// widths, 16-byte aligned rows and input.
bool gemv_vectorised(const Product* ps, int n, const float* x, int64_t ldx) {
  const DeviceWeight& w0 = *ps[0].w;
  bool ok = n <= 3 && !is_block_quant(w0.type) && (w0.cols % chunk_elems(w0.type)) == 0 && (ldx % 4) == 0 && aligned16(x);
  for (int i = 0; i < n && ok; ++i)
    ok = ps[i].w->type == w0.type && ps[i].w->cols == w0.cols && aligned16(ps[i].w->data);
  return ok;
}

void gemv(const Product* ps, int n, const float* x, int64_t ldx, int T, bool glu, const GemvNorm& norm,
          cudaStream_t s) {
  const DeviceWeight& w0 = *ps[0].w;
  const bool fused = gemv_vectorised(ps, n, x, ldx);
  if (glu && (!fused || n != 2 || ps[0].w->rows != ps[1].w->rows)) throw Error("GEMV: SwiGLU needs two like products");
  if (norm.g && (!fused || !aligned16(norm.g))) throw Error("GEMV: a folded RMSNorm needs the vectorised product");
  if (!fused) {
    for (int i = 0; i < n; ++i) {
      if (is_block_quant(ps[i].w->type)) {  // each product its own launch (quant.cu)
        gemv_quant(*ps[i].w, x, ldx, T, ps[i].y, ps[i].ldy, ps[i].accumulate, s);
        continue;
      }
      launch(gemv_scalar_kernel, dim3(unsigned(ceil_div(ps[i].w->rows, kGemvWarps))), dim3(kGemvWarps * 32), s,
             *ps[i].w, x, ldx, T, ps[i].y, ps[i].ldy, int(ps[i].accumulate));
      DS4_CUDA_LAUNCHED();
    }
    return;
  }
  GemvJobs jobs{};
  jobs.n = n;
  for (int i = 0; i < n; ++i) {
    jobs.w[i] = ps[i].w->data;
    jobs.scales[i] = ps[i].w->scales;
    jobs.y[i] = ps[i].y;
    jobs.ldy[i] = ps[i].ldy;
    jobs.rows[i] = int(ps[i].w->rows);
    jobs.accumulate[i] = ps[i].accumulate;
  }
  switch (w0.type) {
    case GgmlType::F32: launch_gemv<GgmlType::F32>(jobs, glu, w0.cols, x, ldx, T, norm, s); break;
    case GgmlType::F16: launch_gemv<GgmlType::F16>(jobs, glu, w0.cols, x, ldx, T, norm, s); break;
    case GgmlType::BF16: launch_gemv<GgmlType::BF16>(jobs, glu, w0.cols, x, ldx, T, norm, s); break;
    case GgmlType::Q8_0: launch_gemv<GgmlType::Q8_0>(jobs, glu, w0.cols, x, ldx, T, norm, s); break;
    default: throw Error("GEMV: unsupported weight type");
  }
  DS4_CUDA_LAUNCHED();
}

/// Where the products of a call can take the RMSNorm themselves.
bool norm_folds(const Product* ps, int n, const float* x, int64_t ldx, int T, bool force_gemm, const RmsNorm* norm) {
  return norm && T <= kMaxGemvTokens && !force_gemm && aligned16(norm->g) && gemv_vectorised(ps, n, x, ldx);
}

// --- prefill: cuBLAS -------------------------------------------------------

template <typename Out>
__device__ Out convert(float v);
template <>
__device__ __half convert<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __nv_bfloat16 convert<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

template <typename Out>
__global__ void to_16bit_kernel(const float* x, int64_t ldx, int64_t K, Out* out) {
  const int t = blockIdx.y;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < K; i += int64_t(gridDim.x) * blockDim.x)
    out[t * K + i] = convert<Out>(x[t * ldx + i]);
}

/// Q8_0 (split layout) to f16, 16 weights a thread.
__global__ void dequant_q8_kernel(const int8_t* qs, const __half* scales, int64_t n16, __half* out) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n16; i += int64_t(gridDim.x) * blockDim.x) {
    const uint4 u = reinterpret_cast<const uint4*>(qs)[i];
    const float d = __half2float(scales[i / 2]);
    const uint32_t words[4] = {u.x, u.y, u.z, u.w};
    __align__(16) __half h[16];
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int b = 0; b < 4; ++b) h[4 * j + b] = __float2half_rn(float(int8_t(words[j] >> (8 * b))) * d);
    reinterpret_cast<uint4*>(out)[2 * i] = reinterpret_cast<const uint4*>(h)[0];
    reinterpret_cast<uint4*>(out)[2 * i + 1] = reinterpret_cast<const uint4*>(h)[1];
  }
}

unsigned elem_grid(int64_t n) { return unsigned(std::clamp<int64_t>(ceil_div(n, 256), 1, 4096)); }

void gemm(const Product* ps, int n, const float* x, int64_t ldx, int T, GemmContext& g, cudaStream_t s) {
  DS4_BLAS_CHECK(blas::set_stream(g.blas, s));
  const int64_t K = ps[0].w->cols;
  bool have_f16 = false, have_bf16 = false;
  for (int i = 0; i < n; ++i) {
    const DeviceWeight& w = *ps[i].w;
    if (w.cols != K) throw Error("GEMM: products of one call must share their input width");
    if (g.tiled && T <= qgemm_max_tokens() && qgemm_takes(w.type, K)) {  // small batches: the tiled GEMM, no f16 copy
      qgemm(w, x, ldx, T, ps[i].y, ps[i].ldy, ps[i].accumulate, reinterpret_cast<float*>(g.deq), g.deq_bytes, s);
      continue;
    }
    const float alpha = 1.0f, beta = ps[i].accumulate ? 1.0f : 0.0f;
    const void* a = w.data;
    const void* b = x;
    cudaDataType ta = CUDA_R_32F, tb = CUDA_R_32F;
    int64_t ldb = ldx;
    if (w.type != GgmlType::F32) {
      const bool bf = w.type == GgmlType::BF16;
      if (size_t(T) * size_t(K) * 2 > g.act_bytes) throw Error("GEMM: activation scratch too small");
      if (bf ? !have_bf16 : !have_f16) {
        const dim3 grid(elem_grid(K), unsigned(T));
        if (bf) to_16bit_kernel<__nv_bfloat16><<<grid, 256, 0, s>>>(x, ldx, K, static_cast<__nv_bfloat16*>(g.act));
        else to_16bit_kernel<__half><<<grid, 256, 0, s>>>(x, ldx, K, static_cast<__half*>(g.act));
        DS4_CUDA_LAUNCHED();
        have_bf16 = bf;
        have_f16 = !bf;
      }
      b = g.act;
      ldb = K;
      ta = tb = bf ? CUDA_R_16BF : CUDA_R_16F;
      if (repacked(w.type)) {
        if (size_t(w.rows) * size_t(K) * 2 > g.deq_bytes) throw Error("GEMM: dequantisation scratch too small");
        if (!is_block_quant(w.type)) {  // Q8_0's split layout
          const int64_t n16 = w.rows * K / 16;
          dequant_q8_kernel<<<elem_grid(n16), 256, 0, s>>>(static_cast<const int8_t*>(w.data), w.scales, n16, g.deq);
        } else {
          dequant_quant_f16(w, g.deq, s);
        }
        DS4_CUDA_LAUNCHED();
        a = g.deq;
      }
    }
    // Column-major view: W is K x N (lda K), x is K x T, y is N x T (ldy).
    DS4_BLAS_CHECK(blas::gemm_ex(g.blas, CUBLAS_OP_T, CUBLAS_OP_N, int(w.rows), T, int(K), &alpha, a, ta, int(K), b,
                                tb, int(ldb), &beta, ps[i].y, CUDA_R_32F, int(ps[i].ldy), CUBLAS_COMPUTE_32F,
                                CUBLAS_GEMM_DEFAULT));
  }
}

__global__ void repack_q8_kernel(const uint8_t* blocks, int64_t n_blocks, int8_t* qs, __half* scales) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n_blocks * 32;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t b = i / 32;
    const int j = int(i % 32);
    const uint8_t* blk = blocks + b * 34;
    qs[i] = int8_t(blk[2 + j]);
    if (j == 0) scales[b] = __ushort_as_half(uint16_t(blk[0] | (blk[1] << 8)));
  }
}

}  // namespace

namespace {

/// Whether a decode batch's products take the tiled GEMM instead of the GEMV:
/// from 3 tokens for Q8_0 and 6 for block-quantised types, where it reads the
/// weights faster than the GEMV's passes (H200, 8B shapes: 36 against 72 us
/// for a Q8_0 14336 x 4096 matrix at 8 tokens; the GEMV wins below). Its
/// activations are halves, so a token batched with others may round apart
/// from the same token alone, as beyond 8 tokens. DS4_CUDA_QGEMM_MIN=N sets
/// the least batch for every type (9: never, the GEMV throughout).
bool small_batch_tiled(const Product* ps, int n, int T, const GemmContext& g) {
  static const int from_env = [] {
    const char* env = std::getenv("DS4_CUDA_QGEMM_MIN");
    return env ? std::max(1, std::atoi(env)) : 0;
  }();
  if (!g.tiled || T > kMaxGemvTokens || T > qgemm_max_tokens()) return false;
  for (int i = 0; i < n; ++i) {
    const GgmlType t = ps[i].w->type;
    if (!qgemm_takes(t, ps[i].w->cols) || T < (from_env ? from_env : t == GgmlType::Q8_0 ? 3 : 6)) return false;
  }
  return true;
}

}  // namespace

void matmul(const Product* ps, int n, const float* x, int64_t ldx, int T, GemmContext& g, cudaStream_t s,
            bool force_gemm, const RmsNorm* norm) {
  if (n <= 0 || T <= 0) return;
  force_gemm = force_gemm || small_batch_tiled(ps, n, T, g);
  if (norm_folds(ps, n, x, ldx, T, force_gemm, norm)) return gemv(ps, n, x, ldx, T, false, {norm->g, norm->eps}, s);
  if (norm) {
    rmsnorm(x, ldx, norm->g, ps[0].w->cols, norm->eps, norm->out, ldx, T, s);
    x = norm->out;
  }
  if (T <= kMaxGemvTokens && !force_gemm) return gemv(ps, n, x, ldx, T, false, {}, s);
  gemm(ps, n, x, ldx, T, g, s);
}

void matmul_swiglu(const DeviceWeight& gate, const DeviceWeight& up, const float* x, int64_t ldx, int T, float* h,
                   float* h_up, int64_t ldh, GemmContext& g, cudaStream_t s, bool force_gemm, const RmsNorm* norm) {
  const Product ps[2] = {{&gate, h, ldh}, {&up, h_up, ldh}};
  force_gemm = force_gemm || small_batch_tiled(ps, 2, T, g);
  const bool fusable = gate.rows == up.rows && gemv_vectorised(ps, 2, x, ldx);
  if (T <= kMaxGemvTokens && !force_gemm && fusable) {
    if (norm_folds(ps, 2, x, ldx, T, force_gemm, norm)) return gemv(ps, 2, x, ldx, T, true, {norm->g, norm->eps}, s);
    if (norm) {
      rmsnorm(x, ldx, norm->g, gate.cols, norm->eps, norm->out, ldx, T, s);
      x = norm->out;
    }
    return gemv(ps, 2, x, ldx, T, true, {}, s);
  }
  matmul(ps, 2, x, ldx, T, g, s, force_gemm, norm);
  swiglu(h, h_up, ldh, gate.rows, T, s);
}

void repack_q8_0(const void* blocks, int64_t n_blocks, int8_t* qs, __half* scales, cudaStream_t s) {
  repack_q8_kernel<<<elem_grid(n_blocks * 32), 256, 0, s>>>(static_cast<const uint8_t*>(blocks), n_blocks, qs,
                                                             scales);
  DS4_CUDA_LAUNCHED();
}

namespace {

/// Words of a hash of their index, masked so that halves, bf16 and floats
/// stay finite and below one (timing must not run on zeros).
__global__ void fill_kernel(uint32_t* p, int64_t n, uint32_t mask) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 0x9e3779b9u;
    h ^= h >> 16;
    h *= 0x85ebca6bu;
    h ^= h >> 13;
    p[i] = h & mask;
  }
}

}  // namespace

namespace {

/// Copies of an N x K weight of `type` (nw matrices a copy: a gate/up pair)
/// that together exceed 4x the L2 cache, so that timed launches read memory,
/// filled with finite synthetic values (timing must not run on zeros).
struct TimedWeights {
  DeviceBuffer buf;
  std::vector<DeviceWeight> ws;
  int copies = 0;
  TimedWeights(GgmlType type, int64_t N, int64_t K, int nw) {
    const Weight host{type, nullptr, K, N};
    const uint64_t wbytes = (device_weight_bytes(host) + 255) / 256 * 256;
    int dev = 0, l2 = 0;
    DS4_CUDA_CHECK(cudaGetDevice(&dev));
    DS4_CUDA_CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev));
    copies = int(std::max<uint64_t>(2, ceil_div(int64_t(4) * l2, int64_t(wbytes) * nw)));
    buf = DeviceBuffer(wbytes * nw * copies, "timed weights");
    const uint32_t mask = type == GgmlType::F32 ? 0x3f7fffffu : type == GgmlType::BF16 ? 0x3f7f3f7fu : 0x3bff3bffu;
    fill_kernel<<<1024, 256>>>(buf.as<uint32_t>(), int64_t(buf.size() / 4), mask);
    DS4_CUDA_LAUNCHED();
    ws.resize(size_t(copies * nw));
    for (size_t i = 0; i < ws.size(); ++i) {
      uint8_t* at = buf.as<uint8_t>() + i * wbytes;
      ws[i] = {type, at, nullptr, K, N};
      if (is_block_quant(type)) ws[i] = quant_view(type, at, N, K);
      if (type == GgmlType::Q8_0) ws[i].scales = reinterpret_cast<const __half*>(at + N * K);
    }
  }
};

/// Floats with the hash's values below one.
DeviceBuffer timed_floats(int64_t n, const char* what) {
  DeviceBuffer b(size_t(n) * 4, what);
  fill_kernel<<<64, 256>>>(b.as<uint32_t>(), n, 0x3f7fffffu);
  DS4_CUDA_LAUNCHED();
  return b;
}

/// Median milliseconds of five replays of `launches` calls of one(i, s),
/// captured in one graph.
template <typename F>
double graph_ms(F&& one, int launches) {
  DS4_CUDA_CHECK(cudaDeviceSynchronize());
  cudaStream_t s = nullptr;
  DS4_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  DS4_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < launches; ++i) one(i, s);
  DS4_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
  DS4_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t e0, e1;
  DS4_CUDA_CHECK(cudaEventCreate(&e0));
  DS4_CUDA_CHECK(cudaEventCreate(&e1));
  std::vector<float> ms;
  for (int rep = 0; rep < 5; ++rep) {
    DS4_CUDA_CHECK(cudaEventRecord(e0, s));
    DS4_CUDA_CHECK(cudaGraphLaunch(exec, s));
    DS4_CUDA_CHECK(cudaEventRecord(e1, s));
    DS4_CUDA_CHECK(cudaEventSynchronize(e1));
    float t = 0;
    DS4_CUDA_CHECK(cudaEventElapsedTime(&t, e0, e1));
    ms.push_back(t);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);
  std::sort(ms.begin(), ms.end());
  return double(ms[ms.size() / 2]);
}

}  // namespace

double gemv_bytes_per_second(GgmlType type, int64_t N, int64_t K, int T, bool glu, bool norm, int launches) {
  const int nw = glu ? 2 : 1;
  const TimedWeights tw(type, N, K, nw);
  const int64_t ld = (K + 7) / 8 * 8;
  DeviceBuffer x = timed_floats(T * ld, "x"), g = timed_floats(K, "g"), y(size_t(T * N) * 4 * 2, "y");
  const GemvNorm gn{norm ? g.as<float>() : nullptr, 1e-5f};
  const double ms = graph_ms(
      [&](int i, cudaStream_t s) {
        const int c = i % tw.copies;
        const Product ps[2] = {{&tw.ws[size_t(c * nw)], y.as<float>(), N},
                               {&tw.ws[size_t(c * nw + nw - 1)], y.as<float>() + T * N, N}};
        gemv(ps, nw, x.as<float>(), ld, T, glu, gn, s);
      },
      launches);
  const double bytes = double(device_weight_bytes({type, nullptr, K, N})) * nw * launches;
  return bytes / (ms * 1e-3);
}

double product_seconds(GgmlType type, int64_t N, int64_t K, int T, ProductWay way, int launches) {
  const TimedWeights tw(type, N, K, 1);
  DeviceBuffer x = timed_floats(int64_t(T) * K, "x"), y(size_t(T * N) * 4, "y");
  DeviceBuffer act(size_t(T * K) * 2, "act"), deq(size_t(N * K) * 2, "deq"), ws(size_t(32) << 20, "cuBLAS workspace");
  cublasHandle_t blas = nullptr;
  if (way == ProductWay::cublas) {
    DS4_BLAS_CHECK(blas::create(&blas));
    DS4_BLAS_CHECK(blas::set_workspace(blas, ws.as<void>(), ws.size()));
  }
  GemmContext g{blas, act.as<void>(), act.size(), deq.as<__half>(), deq.size(), way != ProductWay::cublas};
  double ms = 0;
  try {
    ms = graph_ms(
        [&](int i, cudaStream_t s) {
          const DeviceWeight& w = tw.ws[size_t(i % tw.copies)];
          const Product p{&w, y.as<float>(), N, false};
          if (way == ProductWay::gemv) gemv(&p, 1, x.as<float>(), K, T, false, {}, s);
          else if (way == ProductWay::tiled) qgemm(w, x.as<float>(), K, T, y.as<float>(), N, false, reinterpret_cast<float*>(deq.as<void>()), deq.size(), s);
          else gemm(&p, 1, x.as<float>(), K, T, g, s);
        },
        launches);
  } catch (...) {
    if (blas) blas::destroy(blas);
    throw;
  }
  if (blas) blas::destroy(blas);
  return ms * 1e-3 / launches;
}

}  // namespace ds4::cuda
