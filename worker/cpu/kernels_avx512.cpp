// AVX-512 kernels (F, BW, VL, DQ). Same numerical contract as the other tables
// (kernels.h): a 512-bit register holds the 8 lanes of two weight rows side by
// side, so every output still sums k in the same 8 lanes and order, and the
// results are bit-identical to the AVX2 and generic tables. Matrix-vector
// products (decode, memory-bound) use the shared AVX2-width code; the
// matrix-matrix path packs weight rows in interleaved pairs and runs 8-row x
// 4-token tiles in 32 registers.
#include "worker/cpu/x86_common.h"
#include "worker/cpu/quants_x86.h"

namespace ds4::cpu {
namespace {

constexpr int64_t kPanelPairs = 8;   // 16 rows converted to f32 at once
constexpr int64_t kTokenBlock = 48;  // tokens per pass over a panel
// Batches up to this many tokens take gemv_rows_tokens<4> (207M F16, Zen 4, 2
// threads, a forward of T tokens in tok/s, panels -> rows: T=4 75-82 ->
// 117-123, T=8 134-154 -> 179-183, T=16 219-250 -> 262-287, T=24 259-265 ->
// 301-308; T=32 286-300 -> 299-312 and T=64 328-352 -> 303-346 are even).
constexpr int64_t kRowPathMaxT = 24;

// Packing a row asks for the row this many rows on: the panel after next,
// which is what a thread takes next while two threads alternate 16-row
// chunks (207M F16, Zen 5, 2 threads, pp128: 0 651-686 tok/s, 16 rows
// 671-677, 32 693-706, 48 668-675, 64 691-700).
constexpr int64_t kPackAhead = 4 * kPanelPairs;

// Interleaves rows 2p and 2p+1 chunk by chunk: [row0 k0..7][row1 k0..7][row0 k8..15]...
void pack_pairs(const MatmulArgs& a, int64_t n0, int64_t rows, int64_t kp, float* rowbuf, float* panel) {
  for (int64_t r = 0; r < (rows + 1) / 2 * 2; ++r) {
    if (r < rows) pack_row(a, n0 + r, kp, rowbuf, kPackAhead);
    else std::fill(rowbuf, rowbuf + kp, 0.0f);  // odd count: a zero partner row
    float* dst = panel + (r / 2) * 2 * kp + (r % 2) * 8;
    for (int64_t k = 0; k < kp; k += 8) std::memcpy(dst + 2 * k, rowbuf + k, 8 * sizeof(float));
  }
}

template <int P, int C>
void tile512(const float* panel, int64_t kp, const float* x, int64_t ldx, float* y, int64_t ldy, int64_t rows_left) {
  __m512 acc[P][C];
  for (int p = 0; p < P; ++p)
    for (int c = 0; c < C; ++c) acc[p][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < kp; k += 8) {
    __m512 xv[C];
    for (int c = 0; c < C; ++c) xv[c] = _mm512_broadcast_f32x8(_mm256_loadu_ps(x + c * ldx + k));
    for (int p = 0; p < P; ++p) {
      const __m512 wv = _mm512_loadu_ps(panel + p * 2 * kp + 2 * k);
      for (int c = 0; c < C; ++c) acc[p][c] = _mm512_fmadd_ps(wv, xv[c], acc[p][c]);
    }
  }
  for (int p = 0; p < P; ++p)
    for (int c = 0; c < C; ++c) {
      y[c * ldy + 2 * p] = hsum(_mm512_castps512_ps256(acc[p][c]));
      if (2 * p + 1 < rows_left) y[c * ldy + 2 * p + 1] = hsum(_mm512_extractf32x8_ps(acc[p][c], 1));
    }
}

template <int P>
void tokens512(const float* panel, int64_t kp, const MatmulArgs& a, int64_t t0, int64_t t1, int64_t n,
               int64_t rows_left) {
  int64_t t = t0;
  for (; t + 4 <= t1; t += 4) tile512<P, 4>(panel, kp, a.x + t * a.ldx, a.ldx, a.y + t * a.ldy + n, a.ldy, rows_left);
  for (; t < t1; ++t) tile512<P, 1>(panel, kp, a.x + t * a.ldx, a.ldx, a.y + t * a.ldy + n, a.ldy, rows_left);
}

void gemm_rows512(const MatmulArgs& a, int64_t n0, int64_t n1, float* scratch) {
  const int64_t kp = (a.K + 7) / 8 * 8;
  float* rowbuf = scratch;
  float* panel = scratch + kp;
  for (int64_t r0 = n0; r0 < n1; r0 += 2 * kPanelPairs) {
    const int64_t rows = std::min(2 * kPanelPairs, n1 - r0);
    const int64_t pairs = (rows + 1) / 2;
    pack_pairs(a, r0, rows, kp, rowbuf, panel);
    for (int64_t t0 = 0; t0 < a.T; t0 += kTokenBlock) {
      const int64_t t1 = std::min(a.T, t0 + kTokenBlock);
      int64_t p = 0;
      for (; p + 4 <= pairs; p += 4)
        tokens512<4>(panel + p * 2 * kp, kp, a, t0, t1, r0 + 2 * p, rows - 2 * p);
      for (; p < pairs; ++p) tokens512<1>(panel + p * 2 * kp, kp, a, t0, t1, r0 + 2 * p, rows - 2 * p);
    }
  }
}

void matmul_rows_avx512(const MatmulArgs& a, int64_t n0, int64_t n1, float* scratch) {
  if (a.quantized()) return matmul_rows_quantized_x86(a, n0, n1, scratch);
  if (!simd_f32_type(a.type)) return generic_kernels().matmul_rows(a, n0, n1, scratch);
  if (a.T > kRowPathMaxT) return gemm_rows512(a, n0, n1, scratch);
  if (a.T >= 4) return gemv_rows_tokens<4>(a, n0, n1, kRowsAhead);
  const DecodeWalk& walk = decode_walk();
  if (walk.rows == 2) return gemv_rows_tokens<2>(a, n0, n1, walk.ahead);
  gemv_rows_tokens<1>(a, n0, n1, walk.ahead);
}

}  // namespace

#ifdef __AVX512VNNI__
const KernelTable* avx512vnni_kernels() {
  static const KernelTable table{"avx512vnni", matmul_rows_avx512, attend_x86, attend_block_x86, to_f16_x86, quantize_q8_x86,
                                 quantize_q8k_x86, silu_mul_x86};
  return &table;
}
#else
const KernelTable* avx512_kernels() {
  static const KernelTable table{"avx512", matmul_rows_avx512, attend_x86, attend_block_x86, to_f16_x86, quantize_q8_x86, quantize_q8k_x86,
                                 silu_mul_x86};
  return &table;
}
#endif

}  // namespace ds4::cpu
