// Matrix products of the CUDA backend. Decode (1 to 8 tokens) is bound by
// memory bandwidth: a warp streams one weight row with 16-byte loads and keeps
// one sum per token, so each weight is read once per step whatever the batch.
// Prefill goes to cuBLAS on the tensor cores, with the activations (and a
// Q8_0 weight) converted to 16-bit floats first.
#include <algorithm>
#include <string>

#include "worker/cuda/kernels.cuh"

namespace ds4::cuda {
namespace {

constexpr int kGemvWarps = 4;  // rows per block

/// Weights of one type, read E at a time with a 16-byte load.
template <GgmlType TY>
struct Chunk;

template <>
struct Chunk<GgmlType::F32> {
  static constexpr int E = 4;
  __device__ static void load(const void* w, const __half*, int64_t row, int64_t K, int64_t k, float (&f)[E]) {
    const float4 v = __ldg(reinterpret_cast<const float4*>(static_cast<const float*>(w) + row * K + k));
    f[0] = v.x; f[1] = v.y; f[2] = v.z; f[3] = v.w;
  }
};

template <>
struct Chunk<GgmlType::F16> {
  static constexpr int E = 8;
  __device__ static void load(const void* w, const __half*, int64_t row, int64_t K, int64_t k, float (&f)[E]) {
    const uint4 u = __ldg(reinterpret_cast<const uint4*>(static_cast<const __half*>(w) + row * K + k));
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
  __device__ static void load(const void* w, const __half*, int64_t row, int64_t K, int64_t k, float (&f)[E]) {
    const uint4 u = __ldg(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(w) + row * K + k));
    const uint32_t words[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      f[2 * j] = __uint_as_float(words[j] << 16);
      f[2 * j + 1] = __uint_as_float(words[j] & 0xffff0000u);
    }
  }
};

template <>
struct Chunk<GgmlType::Q8_0> {
  static constexpr int E = 16;
  __device__ static void load(const void* w, const __half* scales, int64_t row, int64_t K, int64_t k,
                              float (&f)[E]) {
    const uint4 u = __ldg(reinterpret_cast<const uint4*>(static_cast<const int8_t*>(w) + row * K + k));
    const float d = __half2float(__ldg(scales + row * (K / 32) + k / 32));
    const uint32_t words[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int b = 0; b < 4; ++b) f[4 * j + b] = float(int8_t(words[j] >> (8 * b))) * d;
    }
  }
};

/// Up to three products with one input, rows laid end to end over the grid.
/// With `glu`, two products (gate, up) whose rows one warp computes together,
/// writing silu(gate) * up to y[0] (the SwiGLU of the feed-forward block).
struct GemvJobs {
  const void* w[3];
  const __half* scales[3];
  float* y[3];
  int64_t ldy[3];
  int rows[3];
  int accumulate[3];
  int n;
};

__device__ int find_job(const GemvJobs& j, int64_t& row) {
  int i = 0;
  while (i + 1 < j.n && row >= j.rows[i]) row -= j.rows[i++];
  return i;
}

/// Asks L2 for a weight row before waiting on the previous kernel: weights do
/// not depend on it, so their fetch overlaps its tail.
__device__ void prefetch_row(const void* row, int64_t bytes, int lane) {
  const char* p = static_cast<const char*>(row);
  for (int64_t off = int64_t(lane) * 128; off < bytes; off += 32 * 128)
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p + off));
}

template <GgmlType TY>
__host__ __device__ constexpr int64_t row_bytes(int64_t K) {
  return TY == GgmlType::F32 ? K * 4 : TY == GgmlType::Q8_0 ? K : K * 2;
}

template <GgmlType TY, int NT, bool GLU>
__global__ void __launch_bounds__(kGemvWarps * 32) gemv_kernel(GemvJobs jobs, int64_t K, const float* __restrict__ x,
                                                               int64_t ldx) {
  constexpr int E = Chunk<TY>::E;
  constexpr int NW = GLU ? 2 : 1;
  const int lane = threadIdx.x % 32;
  int64_t row = int64_t(blockIdx.x) * kGemvWarps + threadIdx.x / 32;
  const int j = GLU ? 0 : find_job(jobs, row);
  const bool active = row < jobs.rows[j];
  if (active)
#pragma unroll
    for (int w = 0; w < NW; ++w)
      prefetch_row(static_cast<const char*>(jobs.w[j + w]) + row * row_bytes<TY>(K), row_bytes<TY>(K), lane);
  pdl_wait();
  pdl_trigger();
  if (!active) return;
  float acc[NW][NT];
#pragma unroll
  for (int w = 0; w < NW; ++w)
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[w][t] = 0.0f;
#pragma unroll 4
  for (int64_t k = int64_t(lane) * E; k < K; k += 32 * E) {
    float wf[NW][E];
#pragma unroll
    for (int w = 0; w < NW; ++w) Chunk<TY>::load(jobs.w[j + w], jobs.scales[j + w], row, K, k, wf[w]);
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      const float4* xp = reinterpret_cast<const float4*>(x + t * ldx + k);
#pragma unroll
      for (int q = 0; q < E / 4; ++q) {
        const float4 xv = __ldg(xp + q);
#pragma unroll
        for (int w = 0; w < NW; ++w) {
          acc[w][t] = fmaf(wf[w][4 * q], xv.x, acc[w][t]);
          acc[w][t] = fmaf(wf[w][4 * q + 1], xv.y, acc[w][t]);
          acc[w][t] = fmaf(wf[w][4 * q + 2], xv.z, acc[w][t]);
          acc[w][t] = fmaf(wf[w][4 * q + 3], xv.w, acc[w][t]);
        }
      }
    }
  }
#pragma unroll
  for (int w = 0; w < NW; ++w)
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) acc[w][t] += __shfl_xor_sync(0xffffffffu, acc[w][t], off);
  float* y = jobs.y[j];
  const int64_t ldy = jobs.ldy[j];
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    if (lane == t) {
      float* dst = y + t * ldy + row;
      if (GLU) {
        const float g = acc[0][t];
        *dst = g / (1.0f + expf(-g)) * acc[NW - 1][t];
      } else {
        *dst = jobs.accumulate[j] ? *dst + acc[0][t] : acc[0][t];
      }
    }
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

template <GgmlType TY, bool GLU>
void launch_gemv(const GemvJobs& jobs, int64_t K, const float* x, int64_t ldx, int T, cudaStream_t s) {
  int64_t rows = 0;
  for (int i = 0; i < (GLU ? 1 : jobs.n); ++i) rows += jobs.rows[i];
  const dim3 grid(unsigned(ceil_div(rows, kGemvWarps))), block(kGemvWarps * 32);
  switch (T) {
#define DS4_GEMV_CASE(N) \
  case N: launch(gemv_kernel<TY, N, GLU>, grid, block, s, jobs, K, x, ldx); break;
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
void launch_gemv(const GemvJobs& jobs, bool glu, int64_t K, const float* x, int64_t ldx, int T, cudaStream_t s) {
  if (glu) launch_gemv<TY, true>(jobs, K, x, ldx, T, s);
  else launch_gemv<TY, false>(jobs, K, x, ldx, T, s);
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

void gemv(const Product* ps, int n, const float* x, int64_t ldx, int T, bool glu, cudaStream_t s) {
  const DeviceWeight& w0 = *ps[0].w;
  bool fused = n <= 3 && (w0.cols % chunk_elems(w0.type)) == 0 && (ldx % 4) == 0 && aligned16(x);
  for (int i = 0; i < n && fused; ++i)
    fused = ps[i].w->type == w0.type && ps[i].w->cols == w0.cols && aligned16(ps[i].w->data);
  if (glu && (!fused || n != 2 || ps[0].w->rows != ps[1].w->rows)) throw Error("GEMV: SwiGLU needs two like products");
  if (!fused) {
    for (int i = 0; i < n; ++i) {
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
    case GgmlType::F32: return launch_gemv<GgmlType::F32>(jobs, glu, w0.cols, x, ldx, T, s);
    case GgmlType::F16: return launch_gemv<GgmlType::F16>(jobs, glu, w0.cols, x, ldx, T, s);
    case GgmlType::BF16: return launch_gemv<GgmlType::BF16>(jobs, glu, w0.cols, x, ldx, T, s);
    case GgmlType::Q8_0: return launch_gemv<GgmlType::Q8_0>(jobs, glu, w0.cols, x, ldx, T, s);
    default: throw Error("GEMV: unsupported weight type");
  }
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
  DS4_BLAS_CHECK(cublasSetStream(g.blas, s));
  const int64_t K = ps[0].w->cols;
  bool have_f16 = false, have_bf16 = false;
  for (int i = 0; i < n; ++i) {
    const DeviceWeight& w = *ps[i].w;
    if (w.cols != K) throw Error("GEMM: products of one call must share their input width");
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
      if (w.type == GgmlType::Q8_0) {
        if (size_t(w.rows) * size_t(K) * 2 > g.deq_bytes) throw Error("GEMM: dequantisation scratch too small");
        const int64_t n16 = w.rows * K / 16;
        dequant_q8_kernel<<<elem_grid(n16), 256, 0, s>>>(static_cast<const int8_t*>(w.data), w.scales, n16, g.deq);
        DS4_CUDA_LAUNCHED();
        a = g.deq;
      }
    }
    // Column-major view: W is K x N (lda K), x is K x T, y is N x T (ldy).
    DS4_BLAS_CHECK(cublasGemmEx(g.blas, CUBLAS_OP_T, CUBLAS_OP_N, int(w.rows), T, int(K), &alpha, a, ta, int(K), b,
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

void matmul(const Product* ps, int n, const float* x, int64_t ldx, int T, GemmContext& g, cudaStream_t s,
            bool force_gemm) {
  if (n <= 0 || T <= 0) return;
  if (T <= kMaxGemvTokens && !force_gemm) return gemv(ps, n, x, ldx, T, false, s);
  gemm(ps, n, x, ldx, T, g, s);
}

void matmul_swiglu(const DeviceWeight& gate, const DeviceWeight& up, const float* x, int64_t ldx, int T, float* h,
                   float* h_up, int64_t ldh, GemmContext& g, cudaStream_t s, bool force_gemm) {
  const Product ps[2] = {{&gate, h, ldh}, {&up, h_up, ldh}};
  const bool fusable = gate.type == up.type && gate.cols == up.cols && gate.rows == up.rows &&
                       gate.cols % chunk_elems(gate.type) == 0 && ldx % 4 == 0 && aligned16(x) &&
                       aligned16(gate.data) && aligned16(up.data);
  if (T <= kMaxGemvTokens && !force_gemm && fusable) return gemv(ps, 2, x, ldx, T, true, s);
  matmul(ps, 2, x, ldx, T, g, s, force_gemm);
  swiglu(h, h_up, ldh, gate.rows, T, s);
}

void repack_q8_0(const void* blocks, int64_t n_blocks, int8_t* qs, __half* scales, cudaStream_t s) {
  repack_q8_kernel<<<elem_grid(n_blocks * 32), 256, 0, s>>>(static_cast<const uint8_t*>(blocks), n_blocks, qs,
                                                             scales);
  DS4_CUDA_LAUNCHED();
}

}  // namespace ds4::cuda
