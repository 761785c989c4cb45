// AVX-512 kernels (F, BW, VL, DQ). Same numerical contract as the other tables
// (kernels.h): a 512-bit register holds one output's 16 lanes, so the results
// are bit-identical to the AVX2 and generic tables. Matrix-vector products
// (decode, memory-bound) take x86_common.h's rows; the matrix-matrix path
// converts a panel of rows to f32 once and runs tiles of rows x tokens over it.
#include "worker/cpu/x86_common.h"
#include "worker/cpu/quants_x86.h"

namespace ds4::cpu {
namespace {

constexpr int64_t kPanelRows = 16;  // rows converted to f32 at once
constexpr int64_t kTokenBlock = 48;  // tokens per pass over a panel
// Batches up to this many tokens take gemv_rows_tokens<4> (207M F16, Zen 4, 2
// threads, a forward of T tokens in tok/s, panels -> rows: T=4 75-82 ->
// 117-123, T=8 134-154 -> 179-183, T=16 219-250 -> 262-287, T=24 259-265 ->
// 301-308; T=32 286-300 -> 299-312 and T=64 328-352 -> 303-346 are even).
constexpr int64_t kRowPathMaxT = 24;

// Packing a row (the f32 panels of F32 and Q8_0 weights) asks for the row
// this many rows on: the panel after next (207M F16, which was packed too,
// Zen 5, 2 threads, pp128, when two threads alternated 16-row chunks: 0
// 651-686 tok/s, 16 rows 671-677, 32 693-706, 48 668-675, 64 691-700; Zen 4
// with each thread's run of consecutive panels: 16, 32 and 64 rows even).
constexpr int64_t kPackAhead = 2 * kPanelRows;

// reduce16 of sixteen outputs' lanes at once, the same additions in the same
// order as hsum16 (lane i + lane i + 8, then i + 4, then i + 2, then i + 1),
// each level adding the two halves of pairs of registers: 45 operations
// where sixteen hsum16 take ~100. Lane 4 j + i of the result is v[4 i + j]'s
// sum: with v[4 r + c] a 4 x 4 tile's output (row r, token c), token c's
// four rows are lanes 4c..4c+3.
inline __m512 hsums16(const __m512 v[16]) {
  __m512 m[8], n[4], p[2];
  for (int i = 0; i < 8; ++i)  // [l0..7 + l8..15 of v[2i] | of v[2i+1]]
    m[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 4; ++i)  // four lanes (i, i + 4 added) of v[4i], ..., v[4i+3]
    n[i] = _mm512_add_ps(_mm512_shuffle_f32x4(m[2 * i], m[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(m[2 * i], m[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int i = 0; i < 2; ++i)  // 128-bit lane j: two lanes of v[8i + j], two of v[8i + 4 + j]
    p[i] = _mm512_add_ps(_mm512_shuffle_ps(n[2 * i], n[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(n[2 * i], n[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_ps(p[0], p[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_ps(p[0], p[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// Sixteen weights of a tile's row as f32 (x86_common.h's conversions): from
// a packed panel (zeros past K, so its tail is a plain load), or straight
// from F16 / BF16 rows (the tail's lanes past K loaded as zeros).
struct Bf16 {
  uint16_t bits;
};
inline __m512 load16w(const float* p) { return vload_f32(p); }
inline __m512 load16w(const uint16_t* p) { return vload_f16(p); }
inline __m512 load16w(const Bf16* p) { return vload_bf16(&p->bits); }
inline __m512 load16w_tail(const float* p, __mmask16) { return vload_f32(p); }
inline __m512 load16w_tail(const uint16_t* p, __mmask16 m) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p)); }
inline __m512 load16w_tail(const Bf16* p, __mmask16 m) { return bf16x16_to_f32(_mm256_maskz_loadu_epi16(m, p)); }

// R rows x C tokens, one register of the contract's 16 lanes each; the rows
// are kp elements apart (a packed panel's, or the weights' own).
template <int R, int C, class W = float>
void tile512(const W* panel, int64_t kp, int64_t K, const float* x, int64_t ldx, float* y, int64_t ldy) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  auto step = [&](int64_t k, auto load_x, auto load_w) {
    __m512 xv[C];
    for (int c = 0; c < C; ++c) xv[c] = load_x(x + c * ldx + k);
    for (int r = 0; r < R; ++r) {
      const __m512 wv = load_w(panel + r * kp + k);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(wv, xv[c], acc[r][c]);
    }
  };
  const int64_t kmain = K / 16 * 16;
  for (int64_t k = 0; k < kmain; k += 16)
    step(k, [](const float* p) { return _mm512_loadu_ps(p); }, [](const W* p) { return load16w(p); });
  if (kmain < K) {  // the panel holds zeros past K; x is not read there
    const __mmask16 m = __mmask16((1u << (K - kmain)) - 1);
    step(kmain, [m](const float* p) { return _mm512_maskz_loadu_ps(m, p); },
         [m](const W* p) { return load16w_tail(p, m); });
  }
  if constexpr (R == 4) {  // four tokens at a time: a 128-bit store of each one's four rows
    for (int c0 = 0; c0 < C; c0 += 4) {
      __m512 v[16];
      for (int r = 0; r < 4; ++r)
        for (int j = 0; j < 4; ++j) v[4 * r + j] = acc[r][std::min(c0 + j, C - 1)];  // past C: unused
      const __m512 s = hsums16(v);
      for (int j = 0; j < 4 && c0 + j < C; ++j)
        _mm_storeu_ps(y + (c0 + j) * ldy, j == 0 ? _mm512_castps512_ps128(s) : _mm512_extractf32x4_ps(s, j));
    }
  } else {
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) y[c * ldy + r] = hsum16(&acc[r][c]);
  }
}

// Tiles of 4 rows x 4 tokens (16 registers; 207M F16, Zen 4, 2 threads,
// pp256 alternated: 4 x 4 396-428 tok/s, 4 x 5 380-394, 4 x 6 359-404,
// 6 x 4 328-350, 8 x 3 337-357, 3 x 8 336-347, 5 x 5 349-388). Measured
// again with the last tokens of a block in one narrower tile (not one tile
// a token) and the transposing sums: 4 x 6 is 8% faster on K 2816 alone
// (one thread, 64 rows from L2) but pp128 went 448-450 -> 438-440 tok/s.
constexpr int kTileRows = 4, kTileTokens = 4;

template <int R, class W = float>
void tokens512(const W* panel, int64_t kp, const MatmulArgs& a, int64_t t0, int64_t t1, int64_t n) {
  int64_t t = t0;
  for (; t + kTileTokens <= t1; t += kTileTokens)
    tile512<R, kTileTokens>(panel, kp, a.K, a.x + t * a.ldx, a.ldx, a.y + t * a.ldy + n, a.ldy);
  auto rest = [&]<int C>(auto self) {  // the last t1 - t < kTileTokens tokens in one tile
    if constexpr (C > 0) {
      if (t1 - t == C) return tile512<R, C>(panel, kp, a.K, a.x + t * a.ldx, a.ldx, a.y + t * a.ldy + n, a.ldy);
      self.template operator()<C - 1>(self);
    }
  };
  rest.template operator()<kTileTokens - 1>(rest);
}

// F16 and BF16 tiles read the weights where they are, converting each
// register as they load it: no panel to pack, half the bytes in L1 and L2
// (K 2816, 128 tokens, one thread: 474 -> 415 us; 207M F16 pp128, 2
// threads, alternated: 427-429 -> 450-452 tok/s). Each panel's rows ask for
// the next panel's. Other types are converted to an f32 panel once.
// Rows r0..r0+rows of the product (kp elements apart from `panel` on) for
// every token: blocks of kTokenBlock tokens, each taken by tiles of
// kTileRows rows in turn, then by the rows left one at a time.
template <class W>
void panel_tiles(const W* panel, int64_t kp, const MatmulArgs& a, int64_t r0, int64_t rows) {
  for (int64_t t0 = 0; t0 < a.T; t0 += kTokenBlock) {
    const int64_t t1 = std::min(a.T, t0 + kTokenBlock);
    int64_t r = 0;
    for (; r + kTileRows <= rows; r += kTileRows) tokens512<kTileRows>(panel + r * kp, kp, a, t0, t1, r0 + r);
    for (; r < rows; ++r) tokens512<1>(panel + r * kp, kp, a, t0, t1, r0 + r);
  }
}

template <class W>
void gemm_rows512_direct(const W* w, const MatmulArgs& a, int64_t n0, int64_t n1) {
  for (int64_t r0 = n0; r0 < n1; r0 += kPanelRows) {
    if (r0 + 2 * kPanelRows <= a.N) {
      const char* next = reinterpret_cast<const char*>(w + (r0 + kPanelRows) * a.K);
      for (int64_t b = 0; b < kPanelRows * a.K * int64_t(sizeof(W)); b += 64) _mm_prefetch(next + b, _MM_HINT_T1);
    }
    panel_tiles(w + r0 * a.K, a.K, a, r0, std::min(kPanelRows, n1 - r0));
  }
}

void gemm_rows512(const MatmulArgs& a, int64_t n0, int64_t n1, float* scratch) {
  if (a.type == GgmlType::F16) return gemm_rows512_direct(static_cast<const uint16_t*>(a.w), a, n0, n1);
  if (a.type == GgmlType::BF16) return gemm_rows512_direct(reinterpret_cast<const Bf16*>(a.w), a, n0, n1);
  const int64_t kp = pad16(a.K);
  for (int64_t r0 = n0; r0 < n1; r0 += kPanelRows) {
    const int64_t rows = std::min(kPanelRows, n1 - r0);
    for (int64_t r = 0; r < rows; ++r) pack_row(a, r0 + r, kp, scratch + r * kp, kPackAhead);
    panel_tiles(scratch, kp, a, r0, rows);
  }
}

// The f32 product of the types x86_common.h converts (kSimdF32Types).
void matmul_rows_f32_avx512(const MatmulArgs& a, int64_t n0, int64_t n1, float* scratch) {
  if (a.T > kRowPathMaxT) return gemm_rows512(a, n0, n1, scratch);
  if (a.T >= 4) return gemv_rows_tokens<4>(a, n0, n1, kRowsAhead);
  const DecodeWalk& walk = decode_walk();
  if (walk.rows == 2) return gemv_rows_tokens<2>(a, n0, n1, walk.ahead);
  gemv_rows_tokens<1>(a, n0, n1, walk.ahead);
}

// This table's kernels, per type: looked up once per product.
const TypeKernelTable& avx512_types() {
  static const TypeKernelTable table = x86_type_table(matmul_rows_f32_avx512);
  return table;
}

void matmul_rows_avx512(const MatmulArgs& a, int64_t n0, int64_t n1, float* scratch) {
  avx512_types().matmul_rows(a, n0, n1, scratch);
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
