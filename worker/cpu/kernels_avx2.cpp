// AVX2 + FMA + F16C kernels. Compiled with those flags only for this file;
// cpu_kernels() picks this table when the CPU has them. Same numerical
// contract as kernels_generic.cpp (see kernels.h).
#include "worker/cpu/x86_common.h"
#include "worker/cpu/quants_x86.h"

namespace ds4::cpu {
namespace {

// R panel rows x C tokens, each output's 16 lanes in two registers.
template <int R, int C>
void gemm_tile(const float* wp, int64_t kp, int64_t K, const float* x, int64_t ldx, float* y, int64_t ldy) {
  Lanes16 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = zero16();
  auto step = [&](int64_t k, const Lanes16* xv) {
    for (int r = 0; r < R; ++r) {
      const Lanes16 wv = load16_f32(wp + r * kp + k);
      for (int c = 0; c < C; ++c) acc[r][c] = fma16(wv, xv[c], acc[r][c]);
    }
  };
  const int64_t kmain = K / 16 * 16;
  for (int64_t k = 0; k < kmain; k += 16) {
    Lanes16 xv[C];
    for (int c = 0; c < C; ++c) xv[c] = load16_f32(x + c * ldx + k);
    step(k, xv);
  }
  if (kmain < K) {  // the panel holds zeros past K; x is not read there
    Lanes16 xv[C];
    for (int c = 0; c < C; ++c) xv[c] = load16_part(x + c * ldx + kmain, K - kmain);
    step(kmain, xv);
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[c * ldy + r] = hsum16(acc[r][c]);
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
    for (int64_t r = 0; r < rows; ++r) pack_row(a, p0 + r, kp, scratch + r * kp, 2 * kPanelRows);  // as kernels_avx512.cpp's kPackAhead
    for (int64_t t0 = 0; t0 < a.T; t0 += kTokenBlock) {
      const int64_t t1 = std::min(a.T, t0 + kTokenBlock);
      int64_t r = 0;
      for (; r + 2 <= rows; r += 2) gemm_panel_rows<2>(scratch + r * kp, kp, a, t0, t1, p0 + r);
      for (; r < rows; ++r) gemm_panel_rows<1>(scratch + r * kp, kp, a, t0, t1, p0 + r);
    }
  }
}

void matmul_rows_avx2(const MatmulArgs& a, int64_t n0, int64_t n1, float* scratch) {
  if (a.quantized()) return matmul_rows_quantized_x86(a, n0, n1, scratch);
  if (!simd_f32_type(a.type)) return generic_kernels().matmul_rows(a, n0, n1, scratch);
  if (a.T > kRowPathMaxT) return gemm_rows(a, n0, n1, scratch);
  // Two registers an output: two rows of three tokens fill twelve of sixteen.
  if (a.T >= 4) return gemv_rows_tokens<2, 3>(a, n0, n1, kRowsAhead);
  const DecodeWalk& walk = decode_walk();
  if (walk.rows == 2) return gemv_rows_tokens<2, 3>(a, n0, n1, walk.ahead);
  gemv_rows_tokens<1, 3>(a, n0, n1, walk.ahead);
}

}  // namespace

const KernelTable* avx2_kernels() {
  static const KernelTable table{"avx2", matmul_rows_avx2, attend_x86, attend_block_x86, to_f16_x86, quantize_q8_x86, quantize_q8k_x86,
                                 silu_mul_x86};
  return &table;
}

}  // namespace ds4::cpu
