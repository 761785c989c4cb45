// Block-quantised weights: GGUF blocks repacked into planes (quant.cuh), and
// the kernels that read the planes: exact dequantisation (prefill, embedding,
// tests) and the decode GEMV.
#include "worker/cuda/quant.cuh"

#include <algorithm>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "worker/cuda/kernels.cuh"
#include "worker/cuda/quant_read.cuh"

namespace ds4::cuda {
namespace {

using namespace qread;

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;

// --- GGUF blocks to planes -----------------------------------------------------

__device__ __forceinline__ uint32_t rd32(const uint8_t* p) {
  return uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24;
}

/// Quant i of a GGUF block, high bits included (llama.cpp's block layouts).
template <GgmlType TY>
__device__ uint32_t native_q(const uint8_t* blk, int i) {
  if constexpr (TY == GgmlType::Q4_0 || TY == GgmlType::Q4_1 || TY == GgmlType::IQ4_NL || TY == GgmlType::MXFP4) {
    const uint8_t b = blk[(TY == GgmlType::Q4_1 ? 4 : TY == GgmlType::MXFP4 ? 1 : 2) + i % 16];
    return i < 16 ? b & 15 : b >> 4;
  } else if constexpr (TY == GgmlType::Q5_0 || TY == GgmlType::Q5_1) {
    const int qh = TY == GgmlType::Q5_0 ? 2 : 4;
    const uint8_t b = blk[qh + 4 + i % 16];
    return (i < 16 ? b & 15 : b >> 4) | ((rd32(blk + qh) >> i) & 1) << 4;
  } else if constexpr (TY == GgmlType::Q2_K) {  // scales[16] qs[64] d dmin
    const int n = i / 128, r = i % 128;
    return (blk[16 + 32 * n + r % 32] >> (2 * (r / 32))) & 3;
  } else if constexpr (TY == GgmlType::Q3_K) {  // hmask[32] qs[64] scales[12] d
    const int n = i / 128, r = i % 128, j = r / 32;
    const uint32_t q = (blk[32 + 32 * n + r % 32] >> (2 * j)) & 3;
    return q | ((blk[r % 32] >> (4 * n + j)) & 1) << 2;
  } else if constexpr (TY == GgmlType::Q4_K || TY == GgmlType::Q5_K) {  // d dmin scales[12] (qh[32]) qs[128]
    const int sub = i / 32, l = i % 32;
    const int qs = TY == GgmlType::Q4_K ? 16 : 48;
    const uint8_t b = blk[qs + 32 * (sub / 2) + l];
    uint32_t q = sub & 1 ? b >> 4 : b & 15;
    if (TY == GgmlType::Q5_K) q |= ((blk[16 + l] >> sub) & 1) << 4;
    return q;
  } else if constexpr (TY == GgmlType::Q6_K) {  // ql[128] qh[64] scales[16] d
    const int n = i / 128, r = i % 128, k = r / 32, l = r % 32;
    const uint8_t b = blk[64 * n + l + 32 * (k & 1)];
    return (k >= 2 ? b >> 4 : b & 15) | ((blk[128 + 32 * n + l] >> (2 * k)) & 3) << 4;
  } else {  // IQ4_XS: d scales_h scales_l[4] qs[128]
    const int ib = i / 32, j = i % 32;
    const uint8_t b = blk[8 + 16 * ib + j % 16];
    return j < 16 ? b & 15 : b >> 4;
  }
}

/// Q3_K's sixteen 6-bit scales (0..63; the weight takes scale - 32).
__device__ int q3k_scale(const uint8_t* sc, int is) {
  const int lo = is < 8 ? sc[is] & 15 : sc[is - 8] >> 4;
  const int hi = (sc[8 + is % 4] >> (2 * (is / 4))) & 3;
  return lo | hi << 4;
}

/// Q4_K/Q5_K's scale and min of sub-block j (llama.cpp's get_scale_min_k4).
__device__ void k4_scale_min(const uint8_t* q, int j, uint8_t& d, uint8_t& m) {
  if (j < 4) {
    d = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j - 0] >> 6) << 4);
  }
}

/// One thread a group of 32: its quants into lo/hi, its sub record, and (the
/// block's first group) the block's halves into sup.
template <GgmlType TY>
__global__ void repack_kernel(const uint8_t* blocks, int64_t groups, uint8_t* lo, uint8_t* hi, uint8_t* sub,
                              uint8_t* sup) {
  using Q = QT<TY>;
  constexpr int GPB = Q::BE / 32;
  for (int64_t g = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; g < groups; g += int64_t(gridDim.x) * blockDim.x) {
    const int64_t bi = g / GPB;
    const int gi = int(g % GPB);
    const uint8_t* blk = blocks + bi * Q::BB;
    uint32_t q[32];
#pragma unroll
    for (int e = 0; e < 32; ++e) q[e] = native_q<TY>(blk, gi * 32 + e);
    if constexpr (Q::L == 4) {
      uint32_t w[4] = {0, 0, 0, 0};
#pragma unroll
      for (int j = 0; j < 16; ++j) w[j / 4] |= ((q[j] & 15) | (q[16 + j] & 15) << 4) << (8 * (j % 4));
      reinterpret_cast<uint4*>(lo)[g] = make_uint4(w[0], w[1], w[2], w[3]);
    } else {
      uint32_t w[2] = {0, 0};
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int k = 0; k < 4; ++k)
#pragma unroll
          for (int b = 0; b < 4; ++b) w[h] |= (q[16 * h + 4 * k + b] & 3) << (8 * b + 2 * k);
      reinterpret_cast<uint2*>(lo)[g] = make_uint2(w[0], w[1]);
    }
    if constexpr (Q::H == 1) {
      uint32_t w = 0;
#pragma unroll
      for (int k = 0; k < 4; ++k)
#pragma unroll
        for (int b = 0; b < 4; ++b)
          w |= ((q[4 * k + b] >> Q::L) & 1) << (8 * b + k) | ((q[16 + 4 * k + b] >> Q::L) & 1) << (8 * b + 4 + k);
      reinterpret_cast<uint32_t*>(hi)[g] = w;
    } else if constexpr (Q::H == 2) {
      uint32_t w[2] = {0, 0};
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int k = 0; k < 4; ++k)
#pragma unroll
          for (int b = 0; b < 4; ++b) w[h] |= ((q[16 * h + 4 * k + b] >> 4) & 3) << (8 * b + 2 * k);
      reinterpret_cast<uint2*>(hi)[g] = make_uint2(w[0], w[1]);
    }
    // The sub record.
    if constexpr (TY == GgmlType::Q2_K) {
      sub[2 * g] = blk[2 * gi];
      sub[2 * g + 1] = blk[2 * gi + 1];
    } else if constexpr (TY == GgmlType::Q3_K) {
      sub[2 * g] = uint8_t(q3k_scale(blk + 96, 2 * gi));
      sub[2 * g + 1] = uint8_t(q3k_scale(blk + 96, 2 * gi + 1));
    } else if constexpr (TY == GgmlType::Q4_K || TY == GgmlType::Q5_K) {
      k4_scale_min(blk + 4, gi, sub[2 * g], sub[2 * g + 1]);
    } else if constexpr (TY == GgmlType::Q6_K) {
      sub[2 * g] = blk[192 + 2 * gi];
      sub[2 * g + 1] = blk[192 + 2 * gi + 1];
    } else if constexpr (TY == GgmlType::IQ4_XS) {
      const int ls = ((blk[4 + gi / 2] >> (4 * (gi % 2))) & 0xf) | (((blk[2] | blk[3] << 8) >> (2 * gi)) & 3) << 4;
      sub[g] = uint8_t(ls);
    }
    if (gi == 0) {  // the halves: d, then dmin or m
      const int at = TY == GgmlType::Q2_K ? 80 : TY == GgmlType::Q3_K ? 108 : TY == GgmlType::Q6_K ? 208 : 0;
#pragma unroll
      for (int i = 0; i < Q::SUP; ++i) sup[bi * Q::SUP + i] = blk[at + i];
    }
  }
}

template <GgmlType TY, typename Out>
__global__ void dequant_kernel(DeviceWeight w, int64_t groups, Out* out) {
  pdl_wait();
  pdl_trigger();
  for (int64_t g = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; g < groups; g += int64_t(gridDim.x) * blockDim.x) {
    float v[32];
    decode_group<TY>(w, g, v);
    if constexpr (sizeof(Out) == 4) {
      float4* o = reinterpret_cast<float4*>(out + g * 32);
#pragma unroll
      for (int i = 0; i < 8; ++i) o[i] = make_float4(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]);
    } else {
      __align__(16) __half h[32];
#pragma unroll
      for (int i = 0; i < 32; ++i) h[i] = __float2half_rn(v[i]);
      uint4* o = reinterpret_cast<uint4*>(out + g * 32);
#pragma unroll
      for (int i = 0; i < 4; ++i) o[i] = reinterpret_cast<const uint4*>(h)[i];
    }
  }
}

template <GgmlType TY>
__global__ void embed_quant_kernel(DeviceWeight w, const BatchToken* batch, float* x, int64_t ldx) {
  pdl_wait();
  pdl_trigger();
  const int t = blockIdx.x;
  const int64_t gpr = w.cols / 32, row = batch[t].token;
  for (int64_t i = threadIdx.x; i < gpr; i += blockDim.x) {
    float v[32];
    decode_group<TY>(w, row * gpr + i, v);
#pragma unroll
    for (int e = 0; e < 32; ++e) x[t * ldx + i * 32 + e] = v[e];
  }
}

// --- decode GEMV -----------------------------------------------------------------

/// Rows a block takes for NT tokens.
template <int NT>
__host__ __device__ constexpr int quant_rows() { return NT <= 2 ? 4 : 2; }

/// A block of 128 threads takes R rows; thread i takes groups i, i + 128, ...
/// of each, U groups of every row loaded before any is used. Per group and
/// token: the integer quants times x in f32, per half (16 weights), then
/// a * sum (+ b * sum of x) into the row's sum.
template <GgmlType TY, int NT>
__global__ void __launch_bounds__(kThreads) gemv_quant_kernel(DeviceWeight w, const float* __restrict__ x, int64_t ldx,
                                                              float* y, int64_t ldy, int accumulate) {
  using Q = QT<TY>;
  constexpr int R = quant_rows<NT>(), U = 2;
  const int64_t gpr = w.cols / 32;
  const int64_t row0 = int64_t(blockIdx.x) * R;
  int64_t rowg[R];
#pragma unroll
  for (int r = 0; r < R; ++r) rowg[r] = min(row0 + r, w.rows - 1) * gpr;  // past the end: computed, not stored
  // Weights do not depend on the previous kernel: ask L2 for this block's
  // low bits while that kernel finishes.
  constexpr int LB = Q::L * 4;
#pragma unroll
  for (int r = 0; r < R; ++r)
    for (int64_t off = int64_t(threadIdx.x) * 128; off < gpr * LB; off += int64_t(kThreads) * 128)
      asm volatile("prefetch.global.L2 [%0];" ::"l"(static_cast<const uint8_t*>(w.data) + rowg[r] * LB + off));
  pdl_wait();
  pdl_trigger();
  float acc[R][NT];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[r][t] = 0.0f;

  for (int64_t i0 = threadIdx.x; i0 < gpr; i0 += int64_t(kThreads) * U) {
    Raw raw[U][R];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t i = i0 + int64_t(u) * kThreads;
      if (i < gpr) {
#pragma unroll
        for (int r = 0; r < R; ++r) load_raw<TY>(w, rowg[r] + i, raw[u][r]);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t i = i0 + int64_t(u) * kThreads;
      if (i >= gpr) break;
      float s[R][NT][2], sx[NT][2];
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        sx[t][0] = sx[t][1] = 0.0f;
#pragma unroll
        for (int r = 0; r < R; ++r) s[r][t][0] = s[r][t][1] = 0.0f;
      }
#pragma unroll
      for (int kk = 0; kk < 8; ++kk) {
        float4 xv[NT];
#pragma unroll
        for (int t = 0; t < NT; ++t) {
          xv[t] = __ldg(reinterpret_cast<const float4*>(x + t * ldx + i * 32) + kk);
          if (Q::MIN) sx[t][kk / 4] += (xv[t].x + xv[t].y) + (xv[t].z + xv[t].w);
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const uint32_t q = quad<TY>(raw[u][r], kk);
          const float f0 = qf<Q::OFF>(q, 0), f1 = qf<Q::OFF>(q, 1), f2 = qf<Q::OFF>(q, 2), f3 = qf<Q::OFF>(q, 3);
#pragma unroll
          for (int t = 0; t < NT; ++t) {
            float v = s[r][t][kk / 4];
            v = fmaf(f0, xv[t].x, v);
            v = fmaf(f1, xv[t].y, v);
            v = fmaf(f2, xv[t].z, v);
            v = fmaf(f3, xv[t].w, v);
            s[r][t][kk / 4] = v;
          }
        }
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        float a[2], b[2];
        group_scales<TY>(w, rowg[r] + i, a, b);
#pragma unroll
        for (int t = 0; t < NT; ++t) {
          float v = acc[r][t];
          v = fmaf(a[0], s[r][t][0], v);
          v = fmaf(a[1], s[r][t][1], v);
          if (Q::MIN) {
            v = fmaf(b[0], sx[t][0], v);
            v = fmaf(b[1], sx[t][1], v);
          }
          acc[r][t] = v;
        }
      }
    }
  }

  __shared__ float red[kWarps][R * NT];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      float v = acc[r][t];
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
      if (lane == 0) red[warp][r * NT + t] = v;
    }
  __syncthreads();
  if (threadIdx.x >= R * NT) return;
  const int r = int(threadIdx.x) / NT, t = int(threadIdx.x) % NT;
  const int64_t row = row0 + r;
  if (row >= w.rows) return;
  float v = 0.0f;
#pragma unroll
  for (int q = 0; q < kWarps; ++q) v += red[q][r * NT + t];
  float* dst = y + t * ldy + row;
  *dst = accumulate ? *dst + v : v;
}

// --- decode GEMV on int8 dot products (1-2 tokens) ------------------------------

/// Activations quantised for dp4a, in shared memory: per token, K int8
/// quants, then per group of 32 its scale dx (x ~ dx * q), the sums of its
/// two halves' quants and the exact sums of their x.
struct XQ {
  int8_t* q;
  float* dx;
  int* sq;
  float* sx;
};

/// Each array starts 16-byte aligned (sq and sx are read in pairs).
__host__ __device__ constexpr int64_t xq_align16(int64_t n) { return (n + 15) / 16 * 16; }
__host__ __device__ constexpr int64_t xq_bytes(int NT, int64_t K) {
  return xq_align16(NT * K) + xq_align16(NT * K / 32 * 4) + 2 * xq_align16(NT * K / 32 * 8);
}

__device__ __forceinline__ XQ xq_at(void* smem, int NT, int64_t K) {
  XQ a;
  const int64_t G = K / 32;
  a.q = static_cast<int8_t*>(smem);
  a.dx = reinterpret_cast<float*>(a.q + xq_align16(NT * K));
  a.sq = reinterpret_cast<int*>(reinterpret_cast<int8_t*>(a.dx) + xq_align16(NT * G * 4));
  a.sx = reinterpret_cast<float*>(reinterpret_cast<int8_t*>(a.sq) + xq_align16(NT * G * 8));
  return a;
}

__device__ __forceinline__ uint32_t dp4a_us(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t r;
  asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
}

// --- decode GEMV, a warp per row group ------------------------------------------

constexpr int kWarpGemvThreads = 256;
constexpr int kWarpGemvWarps = kWarpGemvThreads / 32;

/// x's NT rows quantised for dp4a into shared memory (XQ), once per block:
/// four threads a group of 32, eight values each.
template <int NT, bool GLU = false>
__device__ __forceinline__ void quantise_x(const XQ& xq, const float* __restrict__ x, int64_t ldx, int64_t K,
                                           const float* __restrict__ x_up = nullptr) {
  const int64_t G = K / 32, items = int64_t(NT) * G * 4;
  for (int64_t base = 0; base < items; base += kWarpGemvThreads) {
    const int64_t it = base + threadIdx.x;
    const bool active = it < items;
    const int64_t gi = it / 4;  // t * G + g
    const int part = int(it % 4);
    float v[8];
    if (active) {
      const int64_t t = gi / G, g = gi % G;
      const float4* p = reinterpret_cast<const float4*>(x + t * ldx + g * 32 + part * 8);
      const float4 f0 = __ldg(p), f1 = __ldg(p + 1);
      v[0] = f0.x; v[1] = f0.y; v[2] = f0.z; v[3] = f0.w;
      v[4] = f1.x; v[5] = f1.y; v[6] = f1.z; v[7] = f1.w;
      if constexpr (GLU) {
        const float4* pu = reinterpret_cast<const float4*>(x_up + t * ldx + g * 32 + part * 8);
        const float4 u0 = __ldg(pu), u1 = __ldg(pu + 1);
        const float u[8] = {u0.x, u0.y, u0.z, u0.w, u1.x, u1.y, u1.z, u1.w};
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = silu_mul(v[e], u[e]);
      }
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) v[e] = 0.0f;
    }
    float amax = 0.0f, sum = 0.0f;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      amax = fmaxf(amax, fabsf(v[e]));
      sum += v[e];
    }
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
    uint32_t words[2] = {0, 0};
    int qsum = 0;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int qi = __float2int_rn(v[e] * id);
      qsum += qi;
      words[e / 4] |= uint32_t(qi & 0xff) << (8 * (e % 4));
    }
    // Parts 0-1 are the group's first half (16 weights), 2-3 its second.
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    qsum += __shfl_xor_sync(0xffffffffu, qsum, 1);
    if (active) {
      const int64_t t = gi / G, g = gi % G;
      *reinterpret_cast<uint2*>(xq.q + t * K + g * 32 + part * 8) = make_uint2(words[0], words[1]);
      if (part == 0) xq.dx[gi] = d;
      if (part % 2 == 0) {
        xq.sq[2 * gi + part / 2] = qsum;
        xq.sx[2 * gi + part / 2] = sum;
      }
    }
  }
}

/// One lane's share of a chunk of R rows: U groups of each (lane, lane + 32, ...).
template <GgmlType TY, int R, int U>
struct LaneChunk {
  Raw raw[R][U];
  GroupScaleBits bits[R][U];
};

template <GgmlType TY, int R, int U>
__device__ __forceinline__ void load_chunk(const DeviceWeight& w, int64_t rg, int64_t i0, LaneChunk<TY, R, U>& c) {
  const int64_t G = w.cols / 32;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int64_t rowg = min(rg * R + r, w.rows - 1) * G;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t i = i0 + 32 * u;
      if (i < G) {
        load_raw<TY>(w, rowg + i, c.raw[r][u]);
        c.bits[r][u] = load_scale_bits<TY>(w, rowg + i);
      }
    }
  }
}

/// A persistent grid of blocks of 256 threads. Each block quantises x's NT
/// rows into shared memory once (int8 per 32, as llama.cpp's q8_1); then each
/// warp takes row groups of R rows on its own, its lanes splitting a row's
/// groups of 32, U of them per lane and chunk: the next chunk's loads (the
/// next part of the rows, or the warp's next row group) go out before the
/// current one is used, and a row's sum is a warp's shuffle, so nothing waits
/// for the rest of the block. Per group and token: the quants (unsigned bytes)
/// times x's (signed) by dp4a, minus OFF times the sum of x's quants, scaled
/// by a * dx, plus b times the exact sum of x.
template <GgmlType TY, int NT, int R, int U, bool GLU = false>
__device__ __forceinline__ void gemv_warp_body(const DeviceWeight& w, const float* __restrict__ x, int64_t ldx, float* y,
                                               int64_t ldy, int accumulate, int64_t block, int64_t blocks,
                                               const float* __restrict__ x_up = nullptr) {
  using Q = QT<TY>;
  extern __shared__ int4 smem[];
  const int64_t K = w.cols, G = K / 32;
  const XQ xq = xq_at(smem, NT, K);
  const int lane = threadIdx.x % 32;
  const int64_t n_rg = ceil_div(w.rows, R), stride = blocks * kWarpGemvWarps;
  const int64_t n_chunks = ceil_div(G, 32 * U);
  int64_t rg = block * kWarpGemvWarps + threadIdx.x / 32;
  // The first chunk's weights do not depend on x: their loads go out before
  // the previous kernel ends and while x is quantised.
  LaneChunk<TY, R, U> cur;
  if (rg < n_rg) load_chunk<TY, R, U>(w, rg, lane, cur);
  pdl_wait();
  pdl_trigger();
  quantise_x<NT, GLU>(xq, x, ldx, K, x_up);
  __syncthreads();

  for (; rg < n_rg; rg += stride) {
    float acc[R][NT];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int t = 0; t < NT; ++t) acc[r][t] = 0.0f;
    for (int64_t c = 0; c < n_chunks; ++c) {
      LaneChunk<TY, R, U> nxt;
      const bool last = c + 1 == n_chunks;
      const int64_t nrg = last ? rg + stride : rg;
      if (nrg < n_rg) load_chunk<TY, R, U>(w, nrg, (last ? 0 : (c + 1) * 32 * U) + lane, nxt);
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t i = c * 32 * U + 32 * u + lane;
        if (i >= G) break;
        int4 xw[NT][2];
        float dx[NT];
        int2 sq[NT];
        float2 sx[NT];
#pragma unroll
        for (int t = 0; t < NT; ++t) {
          const int4* p = reinterpret_cast<const int4*>(xq.q + t * K + i * 32);
          xw[t][0] = p[0];
          xw[t][1] = p[1];
          const int64_t xi = t * G + i;
          dx[t] = xq.dx[xi];
          sq[t] = reinterpret_cast<const int2*>(xq.sq)[xi];
          if (Q::MIN) sx[t] = reinterpret_cast<const float2*>(xq.sx)[xi];
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
          uint32_t dot[NT][2];
#pragma unroll
          for (int t = 0; t < NT; ++t) dot[t][0] = dot[t][1] = 0;
#pragma unroll
          for (int kk = 0; kk < 8; ++kk) {
            const uint32_t q = quad<TY>(cur.raw[r][u], kk);
#pragma unroll
            for (int t = 0; t < NT; ++t) {
              const int4& v = xw[t][kk / 4];
              const int xv = (kk % 4) == 0 ? v.x : (kk % 4) == 1 ? v.y : (kk % 4) == 2 ? v.z : v.w;
              dot[t][kk / 4] = dp4a_us(q, uint32_t(xv), dot[t][kk / 4]);
            }
          }
          float a[2], b[2];
          scales_of<TY>(cur.bits[r][u], a, b);
#pragma unroll
          for (int t = 0; t < NT; ++t) {
            const int i0 = int(dot[t][0]) - Q::OFF * sq[t].x, i1 = int(dot[t][1]) - Q::OFF * sq[t].y;
            float v = acc[r][t];
            v = fmaf(a[0] * dx[t], float(i0), v);
            v = fmaf(a[1] * dx[t], float(i1), v);
            if (Q::MIN) {
              v = fmaf(b[0], sx[t].x, v);
              v = fmaf(b[1], sx[t].y, v);
            }
            acc[r][t] = v;
          }
        }
      }
      cur = nxt;
    }
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        float v = acc[r][t];
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
        const int64_t row = rg * R + r;
        if (lane == r * NT + t && row < w.rows) {
          float* dst = y + t * ldy + row;
          *dst = accumulate ? *dst + v : v;
        }
      }
  }
}

template <GgmlType TY, int NT, int R, int U>
__global__ void __launch_bounds__(kWarpGemvThreads, 2)
    gemv_warp_kernel(DeviceWeight w, const float* __restrict__ x, int64_t ldx, float* y, int64_t ldy, int accumulate) {
  gemv_warp_body<TY, NT, R, U>(w, x, ldx, y, ldy, accumulate, blockIdx.x, gridDim.x);
}

/// The experts of a mixture, all pairs of a step in one launch: pair p
/// (blockIdx.y) is y[p] = table[expert_of[p]] . x[p / x_div] (blockIdx.z 1:
/// second's matrices into y2), each pair's rows over blockIdx.x as
/// gemv_warp_kernel's; with GLU the input is SwiGLU(x, x_up). The expert ids
/// are an earlier kernel's output: it waits for that kernel (pdl_wait) before
/// reading them. (Read first, under programmatic serialisation, they can be
/// the step before's: graph-captured decode steps then gave an illegal
/// address and logits far from the host-routed steps'.)
template <GgmlType TY, int R, int U, bool GLU>
__global__ void __launch_bounds__(kWarpGemvThreads, 2)
    expert_gemv_kernel(const DeviceWeight* __restrict__ table, const DeviceWeight* __restrict__ second,
                       const int32_t* __restrict__ expert_of, int x_div, const float* __restrict__ x,
                       const float* __restrict__ x_up, int64_t ldx, float* y, float* y2, int64_t ldy) {
  pdl_wait();
  const int64_t p = blockIdx.y;
  const bool two = blockIdx.z != 0;
  const DeviceWeight w = (two ? second : table)[expert_of[p]];
  const int64_t xr = (p / x_div) * ldx;
  gemv_warp_body<TY, 1, R, U, GLU>(w, x + xr, ldx, (two ? y2 : y) + p * ldy, ldy, 0, blockIdx.x, gridDim.x,
                                   GLU ? x_up + xr : nullptr);
}

/// A prefill's expert groups (ExpertGroups): group blockIdx.y's rows through
/// gemv_warp_body for its count of tokens, its matrix's rows over blockIdx.x.
template <GgmlType TY>
__global__ void __launch_bounds__(kWarpGemvThreads, 2)
    expert_groups_kernel(const DeviceWeight* __restrict__ table, const int32_t* __restrict__ jobs,
                         const float* __restrict__ x, int64_t ldx, float* y, int64_t ldy) {
  pdl_wait();  // before the jobs, which may be an earlier kernel's output
  const int32_t* j = jobs + 3 * int64_t(blockIdx.y);
  const DeviceWeight w = table[j[0]];
  const float* xr = x + int64_t(j[1]) * ldx;
  float* yr = y + int64_t(j[1]) * ldy;
  switch (j[2]) {
    case 1: gemv_warp_body<TY, 1, 1, 2>(w, xr, ldx, yr, ldy, 0, blockIdx.x, gridDim.x); break;
    case 2: gemv_warp_body<TY, 2, 1, 2>(w, xr, ldx, yr, ldy, 0, blockIdx.x, gridDim.x); break;
    case 3: gemv_warp_body<TY, 3, 1, 2>(w, xr, ldx, yr, ldy, 0, blockIdx.x, gridDim.x); break;
    case 4: gemv_warp_body<TY, 4, 1, 2>(w, xr, ldx, yr, ldy, 0, blockIdx.x, gridDim.x); break;
    case 5: gemv_warp_body<TY, 5, 1, 2>(w, xr, ldx, yr, ldy, 0, blockIdx.x, gridDim.x); break;
    case 6: gemv_warp_body<TY, 6, 1, 2>(w, xr, ldx, yr, ldy, 0, blockIdx.x, gridDim.x); break;
    case 7: gemv_warp_body<TY, 7, 1, 2>(w, xr, ldx, yr, ldy, 0, blockIdx.x, gridDim.x); break;
    default: gemv_warp_body<TY, 8, 1, 2>(w, xr, ldx, yr, ldy, 0, blockIdx.x, gridDim.x); break;
  }
}

/// Shared memory the dp4a kernel may take for x's quants.
constexpr int64_t kDp4aSmem = 200 * 1024;

/// DS4_CUDA_QGEMV=float takes the f32 GEMV for every batch (comparison);
/// otherwise decode batches take the dp4a kernel where x's quants fit in
/// kDp4aSmem of shared memory.
bool dp4a_enabled() {
  static const bool on = [] {
    const char* env = std::getenv("DS4_CUDA_QGEMV");
    return !(env && std::string(env) == "float");
  }();
  return on;
}

template <GgmlType TY, int NT, int R, int U>
void launch_warp(const DeviceWeight& w, const float* x, int64_t ldx, float* y, int64_t ldy, bool accumulate,
                 cudaStream_t s) {
  static const bool opted = [] {
    DS4_CUDA_CHECK(cudaFuncSetAttribute(gemv_warp_kernel<TY, NT, R, U>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        int(kDp4aSmem)));
    return true;
  }();
  (void)opted;
  const int64_t smem = xq_bytes(NT, w.cols);
  const int per_sm = 2 * smem <= 200 * 1024 ? 2 : 1;
  const int64_t warps = ceil_div(w.rows, R);
  const int grid = int(std::min<int64_t>(ceil_div(warps, kWarpGemvWarps), int64_t(multiprocessor_count()) * per_sm));
  launch_smem(gemv_warp_kernel<TY, NT, R, U>, dim3(unsigned(grid)), dim3(kWarpGemvThreads), size_t(smem), s, w, x, ldx, y,
              ldy, int(accumulate));
}

template <GgmlType TY, int R, int U, bool GLU>
void launch_expert(const ExpertGemv& g, cudaStream_t s) {
  static const bool opted = [] {
    DS4_CUDA_CHECK(cudaFuncSetAttribute(expert_gemv_kernel<TY, R, U, GLU>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, int(kDp4aSmem)));
    return true;
  }();
  (void)opted;
  const int64_t smem = xq_bytes(1, g.cols);
  // Enough blocks for the whole GPU over all pairs (of both tables), each
  // pair's rows split among a few: 2 blocks a multiprocessor in all.
  const int64_t warps = ceil_div(g.rows, R), tables = g.second ? 2 : 1;
  const int64_t per_pair = std::max<int64_t>(1, ceil_div(int64_t(multiprocessor_count()) * 2, g.pairs * tables));
  const unsigned gx = unsigned(std::min<int64_t>(ceil_div(warps, kWarpGemvWarps), per_pair));
  launch_smem(expert_gemv_kernel<TY, R, U, GLU>, dim3(gx, unsigned(g.pairs), unsigned(tables)), dim3(kWarpGemvThreads),
              size_t(smem), s, g.table, g.second ? g.second : g.table, g.expert_of, g.x_div, g.x, g.x_up, g.ldx, g.y,
              g.y2 ? g.y2 : g.y, g.ldy);
}

template <GgmlType TY>
void launch_groups(const ExpertGroups& g, cudaStream_t s) {
  static const bool opted = [] {
    DS4_CUDA_CHECK(cudaFuncSetAttribute(expert_groups_kernel<TY>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        int(kDp4aSmem)));
    return true;
  }();
  (void)opted;
  const int64_t smem = xq_bytes(8, g.cols);
  // As launch_expert: 2 blocks a multiprocessor over all groups, a group's
  // rows split among a few when there are few groups.
  const int64_t warps = g.rows;
  const int64_t per_job = std::max<int64_t>(1, ceil_div(int64_t(multiprocessor_count()) * 2, g.n_jobs));
  const unsigned gx = unsigned(std::min<int64_t>(ceil_div(warps, kWarpGemvWarps), per_job));
  launch_smem(expert_groups_kernel<TY>, dim3(gx, unsigned(g.n_jobs)), dim3(kWarpGemvThreads), size_t(smem), s, g.table,
              g.jobs, g.x, g.ldx, g.y, g.ldy);
}

unsigned grid_for(int64_t n) { return unsigned(std::clamp<int64_t>(ceil_div(n, 256), 1, 8192)); }

uint64_t align16(uint64_t n) { return (n + 15) / 16 * 16; }

}  // namespace

namespace {

// --- the launchers of one type -----------------------------------------------------

template <GgmlType TY>
void repack_of(const void* blocks, const DeviceWeight& d, cudaStream_t s) {
  const int64_t groups = d.rows * d.cols / 32;
  repack_kernel<TY><<<grid_for(groups), 256, 0, s>>>(
      static_cast<const uint8_t*>(blocks), groups, static_cast<uint8_t*>(const_cast<void*>(d.data)),
      const_cast<uint8_t*>(d.hi), const_cast<uint8_t*>(d.sub), const_cast<uint8_t*>(d.sup));
}

template <GgmlType TY, typename Out>
void dequant_of(const DeviceWeight& w, Out* out, cudaStream_t s) {
  const int64_t groups = w.rows * w.cols / 32;
  launch(dequant_kernel<TY, Out>, dim3(grid_for(groups)), dim3(256), s, w, groups, out);
}

template <GgmlType TY>
void embed_of(const DeviceWeight& table, const BatchToken* batch, int T, float* x, int64_t ldx, cudaStream_t s) {
  launch(embed_quant_kernel<TY>, dim3(unsigned(T)), dim3(128), s, table, batch, x, ldx);
}

template <GgmlType TY>
void gemv_of(const DeviceWeight& w, const float* x, int64_t ldx, int T, float* y, int64_t ldy, bool accumulate,
             cudaStream_t s) {
  if (dp4a_enabled() && xq_bytes(T, w.cols) <= kDp4aSmem) {
    switch (T) {
      // High bits (Q5_*, Q3_K, Q6_K) take more registers: two groups a row and chunk.
      case 1: return launch_warp<TY, 1, 2, QT<TY>::H ? 2 : 4>(w, x, ldx, y, ldy, accumulate, s);
      case 2: return launch_warp<TY, 2, 2, QT<TY>::H ? 2 : 4>(w, x, ldx, y, ldy, accumulate, s);
      case 3: return launch_warp<TY, 3, 1, 4>(w, x, ldx, y, ldy, accumulate, s);
      case 4: return launch_warp<TY, 4, 1, 4>(w, x, ldx, y, ldy, accumulate, s);
      case 5: return launch_warp<TY, 5, 1, 2>(w, x, ldx, y, ldy, accumulate, s);
      case 6: return launch_warp<TY, 6, 1, 2>(w, x, ldx, y, ldy, accumulate, s);
      case 7: return launch_warp<TY, 7, 1, 2>(w, x, ldx, y, ldy, accumulate, s);
      case 8: return launch_warp<TY, 8, 1, 2>(w, x, ldx, y, ldy, accumulate, s);
      default: break;
    }
  }
  switch (T) {
#define DS4_QCASE(N)                                                                                     \
  case N:                                                                                                \
    launch(gemv_quant_kernel<TY, N>, dim3(unsigned(ceil_div(w.rows, quant_rows<N>()))), dim3(kThreads), s, w, x, \
           ldx, y, ldy, int(accumulate));                                                                \
    break;
    DS4_QCASE(1)
    DS4_QCASE(2)
    DS4_QCASE(3)
    DS4_QCASE(4)
    DS4_QCASE(5)
    DS4_QCASE(6)
    DS4_QCASE(7)
    DS4_QCASE(8)
#undef DS4_QCASE
    default: throw Error("GEMV: batch of " + std::to_string(T) + " tokens");
  }
}

template <GgmlType TY>
void expert_gemv_of(const ExpertGemv& g, cudaStream_t s) {
  constexpr int U = QT<TY>::H ? 2 : 4;
  if (g.x_up) launch_expert<TY, 2, U, true>(g, s);
  else launch_expert<TY, 2, U, false>(g, s);
}

template <GgmlType TY>
constexpr QuantKernels kernels_of() {
  using Q = QT<TY>;
  return QuantKernels{TY,
                      QuantPlanes{Q::L * 4, Q::H * 4, Q::SUB, Q::SUP, Q::BE, Q::BB},
                      repack_of<TY>,
                      dequant_of<TY, __half>,
                      dequant_of<TY, float>,
                      embed_of<TY>,
                      gemv_of<TY>,
                      expert_gemv_of<TY>,
                      launch_groups<TY>};
}

// One entry a type of the planes layout.
#define DS4_PLANE_ENTRY(TY) kernels_of<GgmlType::TY>(),
constexpr QuantKernels kPlaneKernels[] = {DS4_PLANE_TYPES(DS4_PLANE_ENTRY)};
#undef DS4_PLANE_ENTRY

const QuantKernels& checked(GgmlType t, const char* who) {
  const QuantKernels* k = quant_kernels(t);
  if (!k) throw Error(std::string(who) + ": weight type " + std::to_string(int(t)) + " is not block-quantised");
  return *k;
}

}  // namespace

const QuantKernels* quant_kernels(GgmlType t) {
  for (const QuantKernels& k : kPlaneKernels)
    if (k.type == t) return &k;
  return nullptr;
}

bool is_block_quant(GgmlType t) { return quant_kernels(t) != nullptr; }

QuantPlanes quant_planes(GgmlType t) { return checked(t, "CUDA backend").planes; }

uint64_t quant_device_bytes(GgmlType t, int64_t rows, int64_t cols) {
  const QuantPlanes p = quant_planes(t);
  if (cols <= 0 || cols % p.block_elems != 0) {
    const TypeTraits* tt = type_row(t);
    throw Error(std::string("a ") + std::string(tt ? tt->name : "quantised") + " weight with " +
                std::to_string(cols) + " columns (its rows must be whole blocks of " +
                std::to_string(p.block_elems) + ")");
  }
  const uint64_t groups = uint64_t(rows) * uint64_t(cols) / 32;
  const uint64_t blocks = uint64_t(rows) * uint64_t(cols) / uint64_t(p.block_elems);
  return align16(groups * p.lo) + align16(groups * p.hi) + align16(groups * p.sub) + align16(blocks * p.sup);
}

DeviceWeight quant_view(GgmlType t, const void* base, int64_t rows, int64_t cols) {
  const QuantPlanes p = quant_planes(t);
  const uint64_t groups = uint64_t(rows) * uint64_t(cols) / 32;
  DeviceWeight d;
  d.type = t;
  d.rows = rows;
  d.cols = cols;
  const uint8_t* at = static_cast<const uint8_t*>(base);
  d.data = at;
  at += align16(groups * p.lo);
  d.hi = at;
  at += align16(groups * p.hi);
  d.sub = at;
  at += align16(groups * p.sub);
  d.sup = at;
  return d;
}

DeviceWeight repack_quant(GgmlType t, const void* blocks, int64_t rows, int64_t cols, void* dst, cudaStream_t s) {
  quant_device_bytes(t, rows, cols);  // checks the shape
  const DeviceWeight d = quant_view(t, dst, rows, cols);
  checked(t, "repack").repack(blocks, d, s);
  DS4_CUDA_LAUNCHED();
  return d;
}

void dequant_quant_f16(const DeviceWeight& w, __half* out, cudaStream_t s) {
  checked(w.type, "dequantise").dequant_f16(w, out, s);
}

void dequant_quant_f32(const DeviceWeight& w, float* out, cudaStream_t s) {
  checked(w.type, "dequantise").dequant_f32(w, out, s);
}

void embed_quant(const DeviceWeight& table, const BatchToken* batch, int T, float* x, int64_t ldx, cudaStream_t s) {
  checked(table.type, "embedding").embed(table, batch, T, x, ldx, s);
}

bool expert_gemv_takes(GgmlType type, int64_t cols) {
  return is_block_quant(type) && dp4a_enabled() && xq_bytes(1, cols) <= kDp4aSmem;
}

void expert_gemv(const ExpertGemv& g, cudaStream_t s) {
  if (!expert_gemv_takes(g.type, g.cols)) throw Error("expert GEMV: a type or width the dp4a kernel does not take");
  if ((g.ldx % 4) != 0 || (reinterpret_cast<uintptr_t>(g.x) & 15) != 0)
    throw Error("expert GEMV: activation rows must be 16-byte aligned");
  if (g.pairs <= 0) return;
  if (g.x_up && ((reinterpret_cast<uintptr_t>(g.x_up) & 15) != 0 || g.second))
    throw Error("expert GEMV: a SwiGLU input needs 16-byte aligned rows and one table");
  quant_kernels(g.type)->expert_gemv(g, s);
}

bool expert_groups_take(GgmlType type, int64_t cols) {
  return expert_gemv_takes(type, cols) && xq_bytes(8, cols) <= kDp4aSmem;
}

void expert_groups(const ExpertGroups& g, cudaStream_t s) {
  if (!expert_groups_take(g.type, g.cols)) throw Error("expert groups: a type or width the dp4a kernel does not take");
  if ((g.ldx % 4) != 0 || (reinterpret_cast<uintptr_t>(g.x) & 15) != 0)
    throw Error("expert groups: activation rows must be 16-byte aligned");
  if (g.n_jobs <= 0) return;
  quant_kernels(g.type)->expert_groups(g, s);
}

void gemv_quant(const DeviceWeight& w, const float* x, int64_t ldx, int T, float* y, int64_t ldy, bool accumulate,
                cudaStream_t s) {
  if ((ldx % 4) != 0 || (reinterpret_cast<uintptr_t>(x) & 15) != 0)
    throw Error("GEMV: a quantised product needs 16-byte aligned activation rows");
  checked(w.type, "GEMV").gemv(w, x, ldx, T, y, ldy, accumulate, s);
}

}  // namespace ds4::cuda
