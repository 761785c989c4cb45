// The tiled quantised GEMM: batches of 9-64 tokens (and a mixture of experts'
// prefill rows) times a Q8_0 or block-quantised matrix, read once a tile as
// it is stored, on the tensor cores. quant.cuh declares it.
#include <algorithm>
#include <cstdlib>
#include <string>

#include "worker/cuda/mma.cuh"
#include "worker/cuda/quant.cuh"
#include "worker/cuda/quant_read.cuh"

namespace ds4::cuda {
namespace {

using namespace qread;

// A block takes 128 rows of the matrix (8 warps, 16 rows each) against up to
// 64 tokens (MT tiles of 16), 64 columns a step: each thread unpacks one group
// of 32 weights a step into shared memory as halves, the next step's group and
// activations already on their way while the warps multiply the current one.
constexpr int kQgRows = 128, kQgK = 64, kQgThreads = 256;
constexpr int kQgLd = kQgK + 8;  // halves a shared row: ldmatrix's 8 rows fall on distinct banks

/// One group of 32 weights in registers, from its load to its halves.
template <GgmlType TY>
struct GroupRegs {
  Raw r;
  GroupScaleBits s;
  __device__ __forceinline__ void load(const DeviceWeight& w, int64_t g) {
    load_raw<TY>(w, g, r);
    s = load_scale_bits<TY>(w, g);
  }
  /// The exact f32 weights (as decode_group), rounded to halves, two a word.
  __device__ __forceinline__ void halves(uint32_t (&h)[16]) const {
    using Q = QT<TY>;
    float a[2], b[2];
    scales_of<TY>(s, a, b);
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {
      const uint32_t q = quad<TY>(r, kk);
      float v[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float p = __fmul_rn(a[kk / 4], qf<Q::OFF>(q, e));
        v[e] = Q::MIN ? __fadd_rn(p, b[kk / 4]) : p;
      }
      h[2 * kk] = pack_half2(v[0], v[1]);
      h[2 * kk + 1] = pack_half2(v[2], v[3]);
    }
  }
};

/// Q8_0's split layout: 32 int8 quants and one half scale a group.
template <>
struct GroupRegs<GgmlType::Q8_0> {
  uint4 q[2];
  unsigned short d;
  __device__ __forceinline__ void load(const DeviceWeight& w, int64_t g) {
    const uint8_t* p = static_cast<const uint8_t*>(w.data) + 32 * g;
    q[0] = ld_stream4(p);
    q[1] = ld_stream4(p + 16);
    d = __ldg(reinterpret_cast<const unsigned short*>(w.scales) + g);
  }
  /// float(q) * d rounded to a half, as the f16 dequantisation does.
  __device__ __forceinline__ void halves(uint32_t (&h)[16]) const {
    const float dd = __half2float(__ushort_as_half(d));
    const uint32_t words[8] = {q[0].x, q[0].y, q[0].z, q[0].w, q[1].x, q[1].y, q[1].z, q[1].w};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const uint32_t u = words[j] ^ 0x80808080u;  // int8 + 128 as a byte
      h[2 * j] = pack_half2(__fmul_rn(qf<128>(u, 0), dd), __fmul_rn(qf<128>(u, 1), dd));
      h[2 * j + 1] = pack_half2(__fmul_rn(qf<128>(u, 2), dd), __fmul_rn(qf<128>(u, 3), dd));
    }
  }
};

struct QgemmArgs {
  DeviceWeight w;                      // the matrix, without a table
  const DeviceWeight* table = nullptr;  // experts: job j's matrix is table[jobs[3j]]
  const int32_t* jobs = nullptr;        // (matrix, first row, rows); none: job y is tokens [16 MT y, ...) of T
  const int32_t* n_jobs = nullptr;      // device: jobs past this number are none
  const float* x = nullptr;
  int64_t ldx = 0;
  float* y = nullptr;
  int64_t ldy = 0;
  int T = 0;
  int accumulate = 0;
  float* part = nullptr;  // splits > 1: each split's sums, [split][T][rows]
  int splits = 1;
};

template <GgmlType TY, int MT>
__global__ void __launch_bounds__(kQgThreads, 2) qgemm_kernel(QgemmArgs a) {
  constexpr int BT = 16 * MT;
  __shared__ __align__(16) __half ws[kQgRows * kQgLd];
  __shared__ __align__(16) __half xs[BT * kQgLd];
  pdl_wait();
  DeviceWeight w;
  int first = 0, count = 0;
  if (a.jobs) {
    if (a.n_jobs && int(blockIdx.y) >= *a.n_jobs) return;
    const int32_t* j = a.jobs + 3 * blockIdx.y;
    w = a.table[j[0]];
    first = j[1];
    count = j[2];
  } else {
    w = a.w;
    first = int(blockIdx.y) * BT;
    count = min(BT, a.T - first);
  }
  const int64_t row0 = int64_t(blockIdx.x) * kQgRows;
  if (row0 >= w.rows) return;
  const int steps = int(w.cols / kQgK);
  const int s0 = int(int64_t(steps) * blockIdx.z / a.splits), s1 = int(int64_t(steps) * (blockIdx.z + 1) / a.splits);
  const int tid = int(threadIdx.x), warp = tid / 32, lane = tid % 32;
  // Thread tid unpacks group tid % 2 of the step's two in row tid / 2 (rows
  // past the end read the last row; their sums are not stored).
  const int64_t g0 = min(row0 + tid / 2, w.rows - 1) * (w.cols / 32) + (tid & 1);
  GroupRegs<TY> wr;
  float4 xr[MT];
  auto load = [&](int step) {
    wr.load(w, g0 + 2 * step);
#pragma unroll
    for (int i = 0; i < MT; ++i) {
      const int idx = tid + kQgThreads * i, t = idx / 16, c = idx % 16;
      xr[i] = t < count ? __ldg(reinterpret_cast<const float4*>(a.x + (first + t) * a.ldx + step * kQgK + 4 * c))
                        : make_float4(0.f, 0.f, 0.f, 0.f);
    }
  };
  float acc[MT][2][4] = {};
  if (s0 < s1) load(s0);
  for (int step = s0; step < s1; ++step) {
    __syncthreads();  // the last step's tiles are read
    {
      uint32_t h[16];
      wr.halves(h);
      uint4* dst = reinterpret_cast<uint4*>(ws + (tid / 2) * kQgLd + 32 * (tid & 1));
#pragma unroll
      for (int j = 0; j < 4; ++j) dst[j] = make_uint4(h[4 * j], h[4 * j + 1], h[4 * j + 2], h[4 * j + 3]);
    }
#pragma unroll
    for (int i = 0; i < MT; ++i) {
      const int idx = tid + kQgThreads * i, t = idx / 16, c = idx % 16;
      *reinterpret_cast<uint2*>(xs + t * kQgLd + 4 * c) =
          make_uint2(pack_half2(xr[i].x, xr[i].y), pack_half2(xr[i].z, xr[i].w));
    }
    __syncthreads();
    if (step + 1 < s1) load(step + 1);
#pragma unroll
    for (int kk = 0; kk < kQgK / 16; ++kk) {
      const int m = lane / 8;
      uint32_t b[4];  // rows 16 warp .. +7 (b[0], b[1]: k 0-7, 8-15), +8 .. +15 (b[2], b[3])
      ldmatrix_x4(b, ws + (16 * warp + (m >> 1) * 8 + lane % 8) * kQgLd + 16 * kk + (m & 1) * 8);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        uint32_t af[4];
        ldmatrix_x4(af, xs + (16 * mt + (m & 1) * 8 + lane % 8) * kQgLd + 16 * kk + (m >> 1) * 8);
        mma_16816(acc[mt][0], af, b[0], b[1]);
        mma_16816(acc[mt][1], af, b[2], b[3]);
      }
    }
  }
  pdl_trigger();
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int hv = 0; hv < 2; ++hv) {
        const int t = 16 * mt + lane / 4 + 8 * hv;
        if (t >= count) continue;
        const int64_t n = row0 + 16 * warp + 8 * nt + 2 * (lane % 4);
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          if (n + e >= w.rows) continue;
          const float v = acc[mt][nt][2 * hv + e];
          if (a.splits > 1) {
            a.part[(int64_t(blockIdx.z) * a.T + first + t) * w.rows + n + e] = v;
          } else {
            float* py = a.y + (first + t) * a.ldy + n + e;
            *py = a.accumulate ? *py + v : v;
          }
        }
      }
}

/// y (+)= the splits' sums, in split order.
__global__ void qgemm_reduce_kernel(const float* part, int splits, int T, int64_t rows, float* y, int64_t ldy,
                                    int accumulate) {
  pdl_wait();
  pdl_trigger();
  const int64_t n_all = int64_t(T) * rows;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n_all; i += int64_t(gridDim.x) * blockDim.x) {
    float s = 0.0f;
    for (int z = 0; z < splits; ++z) s += part[z * n_all + i];
    float* py = y + (i / rows) * ldy + i % rows;
    *py = accumulate ? *py + s : s;
  }
}

/// f(tag) for Q8_0 or a block-quantised type.
template <typename F>
auto dispatch_q(GgmlType t, F&& f) {
  if (t == GgmlType::Q8_0) return f(std::integral_constant<GgmlType, GgmlType::Q8_0>{});
  return dispatch(t, f);
}

/// Token tiles of 16 a block, for batches of up to `tokens`.
int tiles_for(int tokens) { return std::clamp((tokens + 15) / 16, 1, 4); }

template <GgmlType TY>
void launch_qgemm(const QgemmArgs& a, int mt, dim3 grid, cudaStream_t s) {
  switch (mt) {
    case 1: launch(qgemm_kernel<TY, 1>, grid, dim3(kQgThreads), s, a); break;
    case 2: launch(qgemm_kernel<TY, 2>, grid, dim3(kQgThreads), s, a); break;
    case 3: launch(qgemm_kernel<TY, 3>, grid, dim3(kQgThreads), s, a); break;
    default: launch(qgemm_kernel<TY, 4>, grid, dim3(kQgThreads), s, a); break;
  }
}

void check_x(const float* x, int64_t ldx, const char* who) {
  if ((ldx % 4) != 0 || (reinterpret_cast<uintptr_t>(x) & 15) != 0)
    throw Error(std::string(who) + ": activation rows must be 16-byte aligned");
}

}  // namespace

int qgemm_max_tokens() {
  static const int n = [] {
    const char* env = std::getenv("DS4_CUDA_QGEMM");
    if (env && std::string(env) == "off") return 0;
    const char* tokens = std::getenv("DS4_CUDA_QGEMM_TOKENS");
    return tokens ? std::max(0, std::atoi(tokens)) : kQgemmTokens;
  }();
  return n;
}

bool qgemm_takes(GgmlType type, int64_t cols) {
  return repacked(type) && cols > 0 && cols % kQgK == 0;
}

void qgemm(const DeviceWeight& w, const float* x, int64_t ldx, int T, float* y, int64_t ldy, bool accumulate,
           float* part, size_t part_bytes, cudaStream_t s) {
  if (!qgemm_takes(w.type, w.cols)) throw Error("tiled GEMM: a type or width it does not take");
  check_x(x, ldx, "tiled GEMM");
  if (T <= 0) return;
  QgemmArgs a;
  a.w = w;
  a.x = x;
  a.ldx = ldx;
  a.y = y;
  a.ldy = ldy;
  a.T = T;
  a.accumulate = int(accumulate);
  const int mt = tiles_for(T);
  const int64_t row_blocks = ceil_div(w.rows, kQgRows), token_blocks = ceil_div(T, 16 * mt);
  // Few blocks (small batches, narrow matrices): split the columns so that
  // two blocks a multiprocessor run (four from 32 tokens), each split at
  // least 4 steps, its sums kept apart and added in order (the same result
  // at every launch). H200, 8B shapes at 32 tokens: a Q8_0 4096 x 14336
  // matrix 64.5 us with two, 45.5 with four; at 16 tokens two are better
  // (14336 x 4096: 37.7 against 44.2 us). DS4_CUDA_QGEMM_BLOCKS sets it.
  static const int per_sm_env = [] {
    const char* env = std::getenv("DS4_CUDA_QGEMM_BLOCKS");
    return env ? std::clamp(std::atoi(env), 1, 16) : 0;
  }();
  const int per_sm = per_sm_env ? per_sm_env : T >= 32 ? 4 : 2;
  const int64_t blocks = row_blocks * token_blocks, want = per_sm * int64_t(multiprocessor_count());
  int64_t splits = blocks < want ? ceil_div(want, blocks) : 1;
  splits = std::min({splits, int64_t(16), w.cols / kQgK / 4,
                     int64_t(part_bytes / (size_t(T) * size_t(w.rows) * sizeof(float)))});
  a.splits = int(std::max<int64_t>(1, splits));
  a.part = part;
  const dim3 grid(unsigned(row_blocks), unsigned(token_blocks), unsigned(a.splits));
  dispatch_q(w.type, [&](auto tag) {
    launch_qgemm<decltype(tag)::value>(a, mt, grid, s);
    return 0;
  });
  if (a.splits > 1) {
    const int64_t n = int64_t(T) * w.rows;
    launch(qgemm_reduce_kernel, dim3(unsigned(std::clamp<int64_t>(ceil_div(n, 256), 1, 4096))), dim3(256), s,
           static_cast<const float*>(part), a.splits, T, w.rows, y, ldy, int(accumulate));
  }
}

void qgemm_experts(const ExpertGroups& g, int max_rows, cudaStream_t s) {
  if (!qgemm_takes(g.type, g.cols)) throw Error("tiled expert GEMM: a type or width it does not take");
  if (max_rows < 1 || max_rows > kQgemmTokens) throw Error("tiled expert GEMM: jobs of 1 to 64 rows");
  check_x(g.x, g.ldx, "tiled expert GEMM");
  if (g.n_jobs <= 0) return;
  QgemmArgs a;
  a.table = g.table;
  a.jobs = g.jobs;
  a.n_jobs = g.count;
  a.x = g.x;
  a.ldx = g.ldx;
  a.y = g.y;
  a.ldy = g.ldy;
  const dim3 grid(unsigned(ceil_div(g.rows, kQgRows)), unsigned(g.n_jobs), 1);
  dispatch_q(g.type, [&](auto tag) {
    launch_qgemm<decltype(tag)::value>(a, tiles_for(max_rows), grid, s);
    return 0;
  });
}

}  // namespace ds4::cuda
