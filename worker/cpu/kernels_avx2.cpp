// AVX2 + FMA + F16C kernels. Compiled with those flags only for this file;
// cpu_kernels() picks this table when the CPU has them. Same numerical
// contract as kernels_generic.cpp (see kernels.h).
#include "worker/cpu/x86_common.h"
#include "worker/cpu/quants_x86.h"

namespace ds4::cpu {
namespace {

// R panel rows x C tokens. An output's 16 lanes are two registers; the tile
// takes lanes 0-7 of every output over all of K, then lanes 8-15, so that
// R x C registers hold all it sums at once. The panel holds each row's lanes
// 0-7 of every 16 columns first, then its lanes 8-15 (pack_halves), so each
// pass reads one stretch of it. Zen 4's avx2 table, 207M F16, 2 threads,
// pp128 alternated: 2 x 3 tiles holding both halves 254-291 tok/s, two passes
// over the rows as stored 281-313, over the halves' stretches 354-355, the
// same in chunks of 256 columns (both halves' sums kept in memory between
// chunks) 311-314; 8 lanes (before) 389-430.
template <int R, int C>
void gemm_tile(const float* wp, int64_t kp, int64_t K, const float* x, int64_t ldx, float* y, int64_t ldy) {
  __m256 lo[R][C];
  const int64_t kmain = K / 16 * 16;
  alignas(32) float xt[C][16] = {};
  if (kmain < K)
    for (int c = 0; c < C; ++c) std::memcpy(xt[c], x + c * ldx + kmain, size_t(K - kmain) * 4);
  for (int h = 0; h < 2; ++h) {
    const float* wh = wp + h * (kp / 2);
    __m256 acc[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
    // Columns k + 8h.. k + 8h + 7: the panel's, and each token's from xr[c].
    const auto step = [&](int64_t k, const float* const xr[C]) __attribute__((always_inline)) {
      __m256 xv[C];
      for (int c = 0; c < C; ++c) xv[c] = _mm256_loadu_ps(xr[c] + 8 * h);
      for (int r = 0; r < R; ++r) {
        const __m256 wv = _mm256_loadu_ps(wh + r * kp + k / 2);
        for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(wv, xv[c], acc[r][c]);
      }
    };
    for (int64_t k = 0; k < kmain; k += 16) {
      const float* xr[C];
      for (int c = 0; c < C; ++c) xr[c] = x + c * ldx + k;
      step(k, xr);
    }
    if (kmain < K) {  // the panel holds zeros past K; x is not read there
      const float* xr[C];
      for (int c = 0; c < C; ++c) xr[c] = xt[c];
      step(kmain, xr);
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) {
        if (h == 0) lo[r][c] = acc[r][c];
        else y[c * ldy + r] = hsum(_mm256_add_ps(lo[r][c], acc[r][c]));
      }
  }
}

// Row n converted to f32 (rowbuf), then stored in `out` as gemm_tile reads
// it: lanes 0-7 of each 16 columns, then lanes 8-15.
void pack_halves(const MatmulArgs& a, int64_t n, int64_t kp, float* rowbuf, float* out, int64_t ahead) {
  pack_row(a, n, kp, rowbuf, ahead);
  for (int64_t k = 0; k < kp; k += 16) {
    _mm256_storeu_ps(out + k / 2, _mm256_loadu_ps(rowbuf + k));
    _mm256_storeu_ps(out + kp / 2 + k / 2, _mm256_loadu_ps(rowbuf + k + 8));
  }
}

template <int R>
void gemm_panel_rows(const float* wp, int64_t kp, const MatmulArgs& a, int64_t t0, int64_t t1,
                     int64_t n) {
  int64_t t = t0;
  for (; t + 3 <= t1; t += 3) gemm_tile<R, 3>(wp, kp, a.K, a.x + t * a.ldx, a.ldx, a.y + t * a.ldy + n, a.ldy);
  for (; t < t1; ++t) gemm_tile<R, 1>(wp, kp, a.K, a.x + t * a.ldx, a.ldx, a.y + t * a.ldy + n, a.ldy);
}

constexpr int64_t kPanelRows = 16;
constexpr int64_t kTokenBlock = 48;  // tokens whose x rows stay in cache across a panel
// Batches up to this many tokens take gemv_rows_tokens (this table on the
// Zen 4 box, 207M F16, 2 threads, tok/s, panels -> rows: T=4 86-97 -> 131-135,
// T=8 111-163 -> 153-162; T=16 176-222 -> 184-203 stays on the panels).
constexpr int64_t kRowPathMaxT = 8;

void gemm_rows(const MatmulArgs& a, int64_t n0, int64_t n1, float* scratch) {
  const int64_t kp = pad16(a.K);
  for (int64_t p0 = n0; p0 < n1; p0 += kPanelRows) {
    const int64_t rows = std::min(kPanelRows, n1 - p0);
    float* rowbuf = scratch + kPanelRows * kp;
    for (int64_t r = 0; r < rows; ++r)
      pack_halves(a, p0 + r, kp, rowbuf, scratch + r * kp, 2 * kPanelRows);  // as kernels_avx512.cpp's kPackAhead
    for (int64_t t0 = 0; t0 < a.T; t0 += kTokenBlock) {
      const int64_t t1 = std::min(a.T, t0 + kTokenBlock);
      int64_t r = 0;
      for (; r + 4 <= rows; r += 4) gemm_panel_rows<4>(scratch + r * kp, kp, a, t0, t1, p0 + r);
      for (; r < rows; ++r) gemm_panel_rows<1>(scratch + r * kp, kp, a, t0, t1, p0 + r);
    }
  }
}

// The f32 product of the types x86_common.h converts (kSimdF32Types).
void matmul_rows_f32_avx2(const MatmulArgs& a, int64_t n0, int64_t n1, float* scratch) {
  if (a.T > kRowPathMaxT) return gemm_rows(a, n0, n1, scratch);
  // Two registers an output: two rows of three tokens fill twelve of sixteen.
  if (a.T >= 4) return gemv_rows_tokens<2, 3>(a, n0, n1, kRowsAhead);
  const DecodeWalk& walk = decode_walk();
  if (walk.rows == 2) return gemv_rows_tokens<2, 3>(a, n0, n1, walk.ahead);
  gemv_rows_tokens<1, 3>(a, n0, n1, walk.ahead);
}

// This table's kernels, per type: looked up once per product.
const TypeKernelTable& avx2_types() {
  static const TypeKernelTable table = x86_type_table(matmul_rows_f32_avx2);
  return table;
}

void matmul_rows_avx2(const MatmulArgs& a, int64_t n0, int64_t n1, float* scratch) {
  avx2_types().matmul_rows(a, n0, n1, scratch);
}

}  // namespace

const KernelTable* avx2_kernels() {
  static const KernelTable table{"avx2", matmul_rows_avx2, attend_x86, attend_block_x86, to_f16_x86, quantize_q8_x86, quantize_q8k_x86,
                                 silu_mul_x86};
  return &table;
}

}  // namespace ds4::cpu
