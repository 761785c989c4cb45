#pragma once
// Building blocks shared by the AVX2 and AVX-512 kernel tables: exact weight
// loads, the matrix-vector path, row packing, attention and f16 stores. Each
// table's file includes this under its own compiler flags; the anonymous
// namespace keeps each copy private to its file, so no AVX-512 code can stand
// in for the AVX2 one at link time.
#include <immintrin.h>

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <utility>

#include "worker/cpu/kernels.h"

namespace ds4::cpu {
namespace {

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));  // (l0+l4)+(l2+l6), (l1+l5)+(l3+l7)
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// Lane p: hsum(v[p]), with the same additions in the same order.
inline __m256 hsums8(const __m256 v[8]) {
  __m256 a[4];  // positions p and p + 4: (l0+l4, l1+l5, l2+l6, l3+l7) of each, then reordered to pair l0+l4 with l2+l6
  for (int p = 0; p < 4; ++p)
    a[p] = _mm256_permute_ps(_mm256_add_ps(_mm256_permute2f128_ps(v[p], v[p + 4], 0x20),
                                           _mm256_permute2f128_ps(v[p], v[p + 4], 0x31)),
                             _MM_SHUFFLE(3, 1, 2, 0));
  return _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
}

// The types the f32 paths below convert themselves (each table registers its
// f32 product for them; others keep the generic table's).
constexpr GgmlType kSimdF32Types[] = {GgmlType::F32, GgmlType::F16, GgmlType::BF16, GgmlType::Q8_0};

// Eight consecutive weights of one row, converted exactly to f32.
inline __m256 load_f32(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load_f16(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load_bf16(const uint16_t* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
inline __m256 load_q8(const int8_t* q, __m256 d) {
  const __m256i w = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(w), d);
}

// --- the contract's 16 lanes (kernels.h) -----------------------------------
//
// One output's 16 lanes are kRegs registers of kRegLanes floats: one 512-bit
// register in the AVX-512 tables, two 256-bit ones (lanes 0-7 and 8-15) in
// the AVX2 table. Either way lane l takes k = l, l + 16, ... by fused
// multiply-adds, and hsum16 adds lanes l and l + 8 before hsum's order:
// reduce16's. Tiles keep plain arrays of Vec (GCC keeps an array of structs
// of registers in memory, storing it back every step).
#ifdef __AVX512F__
using Vec = __m512;
constexpr int kRegs = 1, kRegLanes = 16;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vfma(Vec w, Vec x, Vec acc) { return _mm512_fmadd_ps(w, x, acc); }
inline Vec vload_f32(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vload_f16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
// Sixteen bf16 values as f32 (exact: the bits are f32's upper half).
inline Vec bf16x16_to_f32(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
inline Vec vload_bf16(const uint16_t* p) {
  return bf16x16_to_f32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline Vec vload_q8(const int8_t* q, __m256 d) {
  const __m512i w = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  return _mm512_mul_ps(_mm512_cvtepi32_ps(w), _mm512_broadcast_f32x8(d));
}
inline float hsum16(const Vec v[kRegs]) {
  return hsum(_mm256_add_ps(_mm512_castps512_ps256(v[0]), _mm512_extractf32x8_ps(v[0], 1)));
}
#else
using Vec = __m256;
constexpr int kRegs = 2, kRegLanes = 8;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vfma(Vec w, Vec x, Vec acc) { return _mm256_fmadd_ps(w, x, acc); }
inline Vec vload_f32(const float* p) { return load_f32(p); }
inline Vec vload_f16(const uint16_t* p) { return load_f16(p); }
inline Vec vload_bf16(const uint16_t* p) { return load_bf16(p); }
inline Vec vload_q8(const int8_t* q, __m256 d) { return load_q8(q, d); }
inline float hsum16(const Vec v[kRegs]) { return hsum(_mm256_add_ps(v[0], v[1])); }
#endif

// --- matrix-vector path: weights converted on the fly (T <= 3) -------------
//
// Decode reads every weight once, straight from memory, and the hardware
// prefetchers stop at each 4 KiB page: the tiles below ask for their rows'
// lines kRowsAhead bytes on (gemv_rows_tokens says what that is worth).

// Rows r0..r0+R of a 16-bit or f32 row-major matrix, C tokens.
// With `ahead` > 0 each row also asks for its cache line `ahead` bytes on.
template <int R, int C, typename Load, typename Elem>
void gemv_tile(const Elem* w, int64_t K, int64_t r0, const float* x, int64_t ldx, float* y,
               int64_t ldy, Load load, int64_t ahead = 0) {
  Vec acc[R][C][kRegs];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      for (int h = 0; h < kRegs; ++h) acc[r][c][h] = vzero();
  // 16 weights of each row from wr[r], 16 values of each token from xr[c].
  const auto step = [&](const Elem* const wr[R], const float* const xr[C]) __attribute__((always_inline)) {
    for (int h = 0; h < kRegs; ++h) {
      Vec xv[C];
      for (int c = 0; c < C; ++c) xv[c] = vload_f32(xr[c] + h * kRegLanes);
      for (int r = 0; r < R; ++r) {
        const Vec wv = load(wr[r] + h * kRegLanes);
        for (int c = 0; c < C; ++c) acc[r][c][h] = vfma(wv, xv[c], acc[r][c][h]);
      }
    }
  };
  const int64_t kmain = K / 16 * 16;
  constexpr int64_t line = 64 / sizeof(Elem);  // elements a cache line (a multiple of 16)
  for (int64_t k = 0; k < kmain; k += 16) {
    if (ahead && k % line == 0)
      for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(w + (r0 + r) * K + k) + ahead, _MM_HINT_T0);
    const Elem* wr[R];
    const float* xr[C];
    for (int r = 0; r < R; ++r) wr[r] = w + (r0 + r) * K + k;
    for (int c = 0; c < C; ++c) xr[c] = x + c * ldx + k;
    step(wr, xr);
  }
  if (kmain < K) {  // tail: weights and x past K are zero (x is not read there)
    alignas(64) Elem wt[R][16] = {};
    alignas(64) float xt[C][16] = {};
    const Elem* wr[R];
    const float* xr[C];
    for (int r = 0; r < R; ++r) {
      std::memcpy(wt[r], w + (r0 + r) * K + kmain, size_t(K - kmain) * sizeof(Elem));
      wr[r] = wt[r];
    }
    for (int c = 0; c < C; ++c) {
      std::memcpy(xt[c], x + c * ldx + kmain, size_t(K - kmain) * 4);
      xr[c] = xt[c];
    }
    step(wr, xr);
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[c * ldy + r0 + r] = hsum16(acc[r][c]);
}

template <int R, int C>
void gemv_tile_q8(const BlockQ8_0* w, int64_t K, int64_t r0, const float* x, int64_t ldx, float* y,
                  int64_t ldy) {
  const int64_t nb = K / 32;
  Vec acc[R][C][kRegs];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      for (int h = 0; h < kRegs; ++h) acc[r][c][h] = vzero();
  for (int64_t b = 0; b < nb; ++b) {
    for (int j = 0; j < 32 / kRegLanes; ++j) {
      const int h = j % kRegs;  // columns 32b + j * kRegLanes.. are register h of the 16 lanes
      Vec xv[C];
      for (int c = 0; c < C; ++c) xv[c] = vload_f32(x + c * ldx + b * 32 + j * kRegLanes);
      for (int r = 0; r < R; ++r) {
        const BlockQ8_0& blk = w[(r0 + r) * nb + b];
        const Vec wv = vload_q8(blk.qs + j * kRegLanes, _mm256_set1_ps(_cvtsh_ss(blk.d)));
        for (int c = 0; c < C; ++c) acc[r][c][h] = vfma(wv, xv[c], acc[r][c][h]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[c * ldy + r0 + r] = hsum16(acc[r][c]);
}

// Rows r0..r0+R of the product for C tokens, weights converted on the fly
// (16- and 32-bit weights prefetched `ahead` bytes on when it is not 0).
template <int R, int C>
void gemv_block(const MatmulArgs& a, int64_t r0, const float* x, float* y, int64_t ahead = 0) {
  switch (a.type) {
    case GgmlType::F32:
      gemv_tile<R, C>(static_cast<const float*>(a.w), a.K, r0, x, a.ldx, y, a.ldy,
                      [](const float* p) { return vload_f32(p); }, ahead);
      break;
    case GgmlType::F16:
      gemv_tile<R, C>(static_cast<const uint16_t*>(a.w), a.K, r0, x, a.ldx, y, a.ldy,
                      [](const uint16_t* p) { return vload_f16(p); }, ahead);
      break;
    case GgmlType::BF16:
      gemv_tile<R, C>(static_cast<const uint16_t*>(a.w), a.K, r0, x, a.ldx, y, a.ldy,
                      [](const uint16_t* p) { return vload_bf16(p); }, ahead);
      break;
    case GgmlType::Q8_0:
      gemv_tile_q8<R, C>(static_cast<const BlockQ8_0*>(a.w), a.K, r0, x, a.ldx, y, a.ldy);
      break;
    default:
      break;
  }
}

// A batch of a few tokens: R rows at a time, taken by every group of up to
// G tokens (in L1 after the first group), weights converted on the fly and
// read from memory once.
// - Decode (T <= 3) takes R = decode_walk().rows (kernels.h): a row is one
//   chain of dependent multiply-adds, the contract's 16 lanes (8 lanes, as
//   before, capped a core at 8 weights every 4 cycles: ~15 GB/s of f16 on Zen
//   4, ~20 on Zen 5). Side by side, two rows are two streams, which the
//   hardware prefetcher follows badly (Zen 5: one row 21 GB/s a core, two
//   13), so each row also asks for its line `ahead` bytes on: on Zen 5 two
//   8-lane rows then read 30 GB/s a core (f16, K 1024; 207M F16, 2 threads:
//   tg 79 -> 101-104 tok/s). On Zen 4 two rows stay slow with any distance
//   (16 lanes, 1 thread: 18-22 tok/s); one 16-lane row reads 41-46 tok/s a
//   thread without a prefetch (34 with 8 lanes), 31-32 asking 4 KiB on. An
//   Intel Xeon wants the opposite (2 threads: 45 tok/s 4 KiB on, 29-31 without).
// - Several slots' decode steps (T >= 4) take R = 4 (the AVX2 table 2 rows
//   of 3 tokens: an output is two of its registers): bound by arithmetic and
//   loads rather than the stream, and R rows share each token's loads (207M
//   F16, Zen 4, 2 threads, an 8-token batch: 95-130 tok/s one row at a time,
//   181-189 four), prefetched likewise (Zen 5: T = 8 241-271 -> 284-335
//   tok/s, T = 16 324-350 -> 359-382). Each table says up to how many tokens
//   this beats its panel tiles.
// - `ahead` > 0: the rows' weights are also prefetched that many bytes on.
constexpr int64_t kRowsAhead = 8192;

template <int R, int G = 4>
void gemv_rows_tokens(const MatmulArgs& a, int64_t n0, int64_t n1, int64_t ahead = 0) {
  static_assert(G >= 3 && G <= 4);
  const int64_t groups = (a.T + G - 1) / G;  // of balanced sizes: a group of one would be one chain
  auto rows = [&]<int RR>(int64_t n) {
    for (int64_t g = 0, t = 0; g < groups; ++g) {
      const int64_t c = (a.T - t) / (groups - g);
      const float* x = a.x + t * a.ldx;
      float* y = a.y + t * a.ldy;
      if constexpr (G == 4)
        if (c == 4) {
          gemv_block<RR, 4>(a, n, x, y, ahead);
          t += c;
          continue;
        }
      if (c == 3) gemv_block<RR, 3>(a, n, x, y, ahead);
      else if (c == 2) gemv_block<RR, 2>(a, n, x, y, ahead);
      else gemv_block<RR, 1>(a, n, x, y, ahead);
      t += c;
    }
  };
  int64_t n = n0;
  for (; n + R <= n1; n += R) rows.template operator()<R>(n);
  for (; n < n1; ++n) rows.template operator()<1>(n);
}

// --- Q8_0 weights times quantized activations (integer products) -----------

void quantize_q8_x86(const float* x, int64_t K, BlockQ8Act* out) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int64_t b = 0; b < K / 32; ++b) {
    __m256 v[4];
    __m256 mx = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_loadu_ps(x + b * 32 + j * 8);
      mx = _mm256_max_ps(mx, _mm256_and_ps(v[j], abs_mask));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
    const bool zero = !(amax >= kQ8ActTiny);
    const __m256 id = _mm256_set1_ps(zero ? 0.0f : 127.0f / amax);
    out[b].d = zero ? 0.0f : _cvtsh_ss(_cvtss_sh(amax / 127.0f, _MM_FROUND_TO_NEAREST_INT));
    __m256i q[4];
    for (int j = 0; j < 4; ++j)
      q[j] = _mm256_cvtps_epi32(
          _mm256_round_ps(_mm256_mul_ps(v[j], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    // The two packs interleave 4-value groups across the 128-bit halves; the permute restores order.
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[b].qs),
                        _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  }
}

// Partial sums of one weight block (w, and |w| as unsigned bytes) times one
// activation block x, in 8 int32 lanes; only their total is used. maddubs
// multiplies unsigned by signed bytes, so x takes w's sign; |x| <= 127 keeps
// its pair sums within int16, and w = -128 works because |w| = 128 is read
// unsigned.
inline __m256i block_dot_i32(__m256i w, __m256i w_abs, __m256i x) {
#ifdef __AVX512VNNI__
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w_abs, _mm256_sign_epi8(x, w));
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(x, w)), _mm256_set1_epi16(1));
#endif
}

// acc + the int16 pair products of a and b summed into int32 lanes (one
// vpdpwssd with VNNI). Exact either way.
inline __m256i madd_acc(__m256i acc, __m256i a, __m256i b) {
#ifdef __AVX512VNNI__
  return _mm256_dpwssd_epi32(acc, a, b);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

// v with lanes 4-7 shifted right by Shift (arithmetic), lanes 0-3 as they are.
template <int Shift>
inline __m256i shift_upper_half(__m256i v) {
  if constexpr (Shift == 0) return v;
  return _mm256_srav_epi32(v, _mm256_setr_epi32(0, 0, 0, 0, Shift, Shift, Shift, Shift));
}

// Lane i of the result: the total of v[i]'s eight lanes. With HiShift, the
// part of lanes 4-7 is shifted right by HiShift before it joins lanes 0-3's
// (exact where those lanes hold multiples of 2^HiShift: split nibbles,
// quants_x86.h). The sums stay in their 128-bit halves up to the last step.
template <int HiShift = 0>
inline __m256i totals8_i32(const __m256i v[8]) {
  __m256i s[4];
  for (int j = 0; j < 4; ++j)
    s[j] = _mm256_add_epi32(_mm256_unpacklo_epi32(v[2 * j], v[2 * j + 1]),
                            _mm256_unpackhi_epi32(v[2 * j], v[2 * j + 1]));
  const __m256i lo = shift_upper_half<HiShift>(
      _mm256_add_epi32(_mm256_unpacklo_epi64(s[0], s[1]), _mm256_unpackhi_epi64(s[0], s[1])));
  const __m256i hi = shift_upper_half<HiShift>(
      _mm256_add_epi32(_mm256_unpacklo_epi64(s[2], s[3]), _mm256_unpackhi_epi64(s[2], s[3])));
  return _mm256_add_epi32(_mm256_permute2x128_si256(lo, hi, 0x20), _mm256_permute2x128_si256(lo, hi, 0x31));
}

inline int32_t total_i32(__m256i v) {
  const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i t = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 1)));
}

inline __m256i load_i8x32(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// The sum of a block's 32 signed bytes (exact: |sum| < 2^12).
inline int32_t block_sum_i32(__m256i q) {
  return total_i32(_mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), q), _mm256_set1_epi16(1)));
}
// The same as float (an activation block's sum, for the offset types' step).
inline float block_sum(__m256i q) { return float(block_sum_i32(q)); }

// Decode (T <= 3): a row's blocks read straight from the weights, eight at a
// time: their integer totals come out of one transposing sum, and their float
// steps are one vector multiply-add into the lanes of quant_types.h (two with
// an offset). Every type goes one row at a time: a single sequential stream
// is what the hardware prefetcher follows (Zen 4: one row read 12-14 GB/s a
// core, eight side by side 7-9). While a row's steps were one chain of
// dependent multiply-adds, the smaller blocks (Q4_0, Q5_0, IQ4_NL, Q4_1,
// Q5_1: 18-24 bytes) went four rows side by side, the chain being slower
// than their stream; in lanes, one row streams faster (ds4-kernel-bench,
// rows from memory, one thread: Q4_0 16.4-17.2 GB/s against 12.2-12.9 with
// four rows, Q4_1 13.7-15.1 against 10.9-11.0, Q5_0 14.3-14.8 against 11.6-11.7).
// Each group asks for its lines kQ8RowAhead bytes on (207M Q8_0, 2 threads,
// Zen 5: 544 bytes 129-133 tok/s, 2048 144-157, 4096 147-164, 8192 141-153).
constexpr int64_t kQ8RowAhead = 4096;

// The int32 lanes of sum u * x over a block, u unsigned bytes (< 32 here, so
// maddubs's pair sums stay within int16), x signed.
inline __m256i block_udot_i32(__m256i u, __m256i x) {
#ifdef __AVX512VNNI__
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1));
#endif
}

#ifdef __AVX512VNNI__
constexpr bool kVnni = true;
#else
constexpr bool kVnni = false;
#endif

// How a weight type's block reads as a Q8_0 block in registers: q(block) is
// its 32 values as bytes, signed (kBias 0, kUnsigned false: the sign trick of
// block_dot_i32) or unsigned with q - kBias the value (the block's sum is then
// sum u * x - kBias * sum x, exact in integers). kOffset: the block has an m
// (d * q + m). kSplit (with VNNI only: the products exceed maddubs's int16
// pairs): the 16 packed bytes are read once into both halves, the low nibbles
// kept in the lower and the high nibbles, in place (16 x their value), in the
// upper, and the upper half's sums are divided by 16 (shift_upper_half).
// Q8_0 is here, the others with their unpacking in quants_x86.h.
struct Q8Src {
  using Block = BlockQ8_0;
  static constexpr bool kUnsigned = false, kOffset = false, kSplit = false;
  static constexpr int kBias = 0;
  static __m256i q(const Block& b) { return load_i8x32(b.qs); }
};

// A block's scale as f32: its fp16 d, or Src::d(block) where the type has
// another (MXFP4's E8M0 byte); d8: eight consecutive blocks' at once.
template <class Src>
inline float src_d(const typename Src::Block& b) {
  if constexpr (requires { Src::d(b); }) return Src::d(b);
  else return _cvtsh_ss(b.d);
}
template <class Src>
inline __m256 src_d8(const typename Src::Block* w) {
  if constexpr (requires { Src::d8(w); }) {
    return Src::d8(w);
  } else {
    return _mm256_cvtph_ps(_mm_setr_epi16(short(w[0].d), short(w[1].d), short(w[2].d), short(w[3].d), short(w[4].d),
                                          short(w[5].d), short(w[6].d), short(w[7].d)));
  }
}

template <class Src>
inline __m256i src_block_dot(const typename Src::Block& w, __m256i x) {
  const __m256i q = Src::q(w);
  if constexpr (Src::kUnsigned) return block_udot_i32(q, x);
  return block_dot_i32(q, _mm256_sign_epi8(q, q), x);
}

// Row r (its nb blocks at w) times each token; ux: each token's block sums of
// its activations (for kBias and kOffset types). An offset type takes the
// second float step of quant_types.h too.
template <class Src>
void q8x_row(const typename Src::Block* w, int64_t nb, int64_t r, const MatmulArgs& a, const float* ux) {
  constexpr int kLines = (8 * int(sizeof(typename Src::Block)) + 63) / 64 + 1;
  for (int64_t t = 0; t < a.T; ++t) {
    const BlockQ8Act* x = a.xq + t * a.ldxq;
    const float* u = ux + t * nb;
    // The row's lanes 2p (first steps) in lane p of accS, 2p + 1 in accM (quant_types.h).
    __m256 accS = _mm256_setzero_ps(), accM = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8) {
      // Built in registers: a vector load of eight scalar stores waits for them to retire.
      const __m256 dxv = _mm256_setr_ps(x[b].d, x[b + 1].d, x[b + 2].d, x[b + 3].d, x[b + 4].d, x[b + 5].d,
                                        x[b + 6].d, x[b + 7].d);
      // The out-of-order window alone holds too little of the stream.
      const char* ahead = reinterpret_cast<const char*>(w + b) + kQ8RowAhead;
      for (int l = 0; l < kLines; ++l) _mm_prefetch(ahead + 64 * l, _MM_HINT_T0);
      __m256i v[8];
      for (int i = 0; i < 8; ++i) v[i] = src_block_dot<Src>(w[b + i], load_i8x32(x[b + i].qs));
      const auto halves = [&](auto field) {
        return _mm_setr_epi16(short(field(w[b])), short(field(w[b + 1])), short(field(w[b + 2])),
                              short(field(w[b + 3])), short(field(w[b + 4])), short(field(w[b + 5])),
                              short(field(w[b + 6])), short(field(w[b + 7])));
      };
      __m256 sf = _mm256_cvtepi32_ps(totals8_i32<Src::kSplit ? 4 : 0>(v));
      if constexpr (Src::kBias != 0)
        sf = _mm256_fnmadd_ps(_mm256_set1_ps(float(Src::kBias)), _mm256_loadu_ps(u + b), sf);  // exact
      accS = _mm256_fmadd_ps(sf, _mm256_mul_ps(src_d8<Src>(w + b), dxv), accS);
      if constexpr (Src::kOffset) {
        const __m128i mh = halves([](const typename Src::Block& k) { return k.m; });
        accM = _mm256_fmadd_ps(_mm256_loadu_ps(u + b), _mm256_mul_ps(_mm256_cvtph_ps(mh), dxv), accM);
      }
    }
    BlockLanes lanes;
    alignas(32) float sl[8], ml[8];
    _mm256_store_ps(sl, accS);
    _mm256_store_ps(ml, accM);
    for (int p = 0; p < 8; ++p) lanes.l[2 * p] = sl[p], lanes.l[2 * p + 1] = ml[p];
    for (int64_t i = b; i < nb; ++i) {  // the last nb % 8 blocks
      const typename Src::Block& blk = w[i];
      const int32_t s = total_i32(shift_upper_half<Src::kSplit ? 4 : 0>(src_block_dot<Src>(blk, load_i8x32(x[i].qs))));
      const float sf = float(s) - float(Src::kBias) * (Src::kBias != 0 ? u[i] : 0.0f);
      lanes.first(i, sf, src_d<Src>(blk) * x[i].d);
      if constexpr (Src::kOffset) lanes.second(i, u[i], _cvtsh_ss(blk.m) * x[i].d);
    }
    a.y[t * a.ldy + r] = lanes.total();
  }
}

// Decode rows [n0, n1) of a type read through Src, one row at a time.
template <class Src>
void q8x_decode(const MatmulArgs& a, int64_t n0, int64_t n1, const float* ux) {
  const auto* w = static_cast<const typename Src::Block*>(a.w);
  const int64_t nb = a.K / 32;
  for (int64_t r = n0; r < n1; ++r) q8x_row<Src>(w + r * nb, nb, r, a, ux);
}

// Prefill (T >= 4): eight tokens at a time, one lane each. Their blocks are
// first transposed so that one 32-byte vector holds the same four positions
// of all eight tokens; a row's four weights at those positions are broadcast
// against it. A 32-block then costs four operations per four positions of
// eight tokens (sign, multiply-add bytes, multiply-add pairs, add), plus a
// conversion, a scale product and a fused multiply-add per eight outputs.
constexpr int64_t kQ8PanelRows = 16, kQ8TileRows = 4;

struct Q8Group {  // eight tokens' block b, transposed
  float d[8];
  float u[8];        // the sum of each token's 32 values (offset types)
  int8_t qs[8][32];  // qs[j]: positions 4j..4j+3 of tokens 0..7
};

struct Q8Prefill {
  const BlockQ8_0* w;  // the panel's first row
  const int8_t* wabs;  // (rows, nb, 32): |w|, as unsigned bytes
  const float* dw;     // (rows, nb): d_w
  const Q8Group* g;    // (nb): the token group
  int64_t nb;
  const float* mw = nullptr;  // (rows, nb): m_w of an offset type (Q4_1, Q5_1)
};

inline __m256i broadcast_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// reduce16 (kernels.h) of eight outputs' lanes at once, one output a lane:
// its lane 2p in s[p], 2p + 1 in m[p].
inline __m256 lanes_total8(const __m256 s[8], const __m256 m[8]) {
  __m256 sp[4], mp[4];  // m_2j = l_2j + l_2j+8, m_2j+1 = l_2j+1 + l_2j+9
  for (int j = 0; j < 4; ++j) sp[j] = _mm256_add_ps(s[j], s[j + 4]), mp[j] = _mm256_add_ps(m[j], m[j + 4]);
  // ((m0 + m4) + (m2 + m6)) + ((m1 + m5) + (m3 + m7))
  return _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(sp[0], sp[2]), _mm256_add_ps(sp[1], sp[3])),
                       _mm256_add_ps(_mm256_add_ps(mp[0], mp[2]), _mm256_add_ps(mp[1], mp[3])));
}

// lanes_total8 for four outputs in 128-bit registers.
inline __m128 lanes_total4(const __m128 s[8], const __m128 m[8]) {
  __m128 sp[4], mp[4];
  for (int j = 0; j < 4; ++j) sp[j] = _mm_add_ps(s[j], s[j + 4]), mp[j] = _mm_add_ps(m[j], m[j + 4]);
  return _mm_add_ps(_mm_add_ps(_mm_add_ps(sp[0], sp[2]), _mm_add_ps(sp[1], sp[3])),
                    _mm_add_ps(_mm_add_ps(mp[0], mp[2]), _mm_add_ps(mp[1], mp[3])));
}

// Tile outputs for tokens t0..t0+n: acc[i] lane t is y[t0 + t][col + i].
template <class Vec>
inline void store_token_lanes(const MatmulArgs& a, int64_t t0, int64_t n, int64_t col, const Vec* acc, int R) {
  constexpr int kLanes = sizeof(Vec) / sizeof(float);
  for (int i = 0; i < R; ++i) {
    alignas(64) float lanes[kLanes];
    std::memcpy(lanes, &acc[i], sizeof(Vec));
    for (int64_t t = 0; t < n; ++t) a.y[(t0 + t) * a.ldy + col + i] = lanes[t];
  }
}

#ifdef __AVX512F__
// A panel's rows [0, rows) (its first is the product's row p0) against the
// token group t0..t0+n of the sixteen-token tiles: tiles of R rows, then the
// rest one row at a time. tile(std::integral_constant<int, R'>, r, out) fills
// out[0..R') with rows r..r+R', token t in lane t.
template <int R, class Tile>
void token16_row_tiles(const MatmulArgs& a, int64_t t0, int64_t n, int64_t p0, int64_t rows, const Tile& tile) {
  int64_t r = 0;
  for (; r + R <= rows; r += R) {
    __m512 out[R];
    tile(std::integral_constant<int, R>{}, r, out);
    store_token_lanes(a, t0, n, p0 + r, out, R);
  }
  for (; r < rows; ++r) {
    __m512 out[1];
    tile(std::integral_constant<int, 1>{}, r, out);
    store_token_lanes(a, t0, n, p0 + r, out, 1);
  }
}
#endif

// Rows r..r+R of the panel times the token group: acc[i] lane t = y[t][r + i].
template <int R, bool Offset>
void q8x_prefill_tile(const Q8Prefill& p, int64_t r, __m256 acc[R]) {
  const int64_t nb = p.nb;
  __m256 accS[R][8], accM[R][8];  // row i's lanes 2q and 2q + 1 (quant_types.h), tokens in the vector lanes
  for (int i = 0; i < R; ++i)
    for (int q = 0; q < 8; ++q) accS[i][q] = accM[i][q] = _mm256_setzero_ps();
  // Block b into lanes Q (= b % 8, known at compile time: the accumulators
  // can stay in registers, as many as there are).
  const auto block = [&]<int Q>(int64_t b, std::integral_constant<int, Q>) __attribute__((always_inline)) {
    const Q8Group& g = p.g[b];
    __m256i s[R];
    for (int i = 0; i < R; ++i) s[i] = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {
      const __m256i xv = load_i8x32(g.qs[j]);
      for (int i = 0; i < R; ++i) {
        const __m256i wq = broadcast_i32(p.w[(r + i) * nb + b].qs + 4 * j);
        const __m256i aq = broadcast_i32(p.wabs + ((r + i) * nb + b) * 32 + 4 * j);
#ifdef __AVX512VNNI__
        s[i] = _mm256_dpbusd_epi32(s[i], aq, _mm256_sign_epi8(xv, wq));
#else
        s[i] = _mm256_add_epi32(s[i], _mm256_madd_epi16(_mm256_maddubs_epi16(aq, _mm256_sign_epi8(xv, wq)),
                                                        _mm256_set1_epi16(1)));
#endif
      }
    }
    const __m256 dx = _mm256_loadu_ps(g.d);
    // With an offset, twice the accumulators: they spill whatever the
    // indexing, and a computed index was faster (Q4_1, T = 128, rows in L2:
    // 314 against 394 us a call on Zen 4).
    const int q = Offset ? int(b & 7) : Q;
    for (int i = 0; i < R; ++i) {
      accS[i][q] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[i]),
                                   _mm256_mul_ps(_mm256_broadcast_ss(p.dw + (r + i) * nb + b), dx), accS[i][q]);
      if constexpr (Offset)
        accM[i][q] = _mm256_fmadd_ps(_mm256_loadu_ps(g.u),
                                     _mm256_mul_ps(_mm256_broadcast_ss(p.mw + (r + i) * nb + b), dx), accM[i][q]);
    }
  };
  for (int64_t b0 = 0; b0 < nb; b0 += 8)
    [&]<int... Q>(std::integer_sequence<int, Q...>) {
      ((b0 + Q < nb ? block(b0 + Q, std::integral_constant<int, Q>{}) : void()), ...);
    }(std::make_integer_sequence<int, 8>{});
  for (int i = 0; i < R; ++i) acc[i] = lanes_total8(accS[i], accM[i]);
}

// Eight tokens' blocks v[t] (32 values each) transposed: out[j] holds
// positions 4j..4j+3 of tokens 0..7, four bytes a token.
inline void transpose_blocks8(const __m256i v[8], __m256i out[8]) {
  __m256i u[8];
  for (int h = 0; h < 2; ++h) {  // tokens 4h..4h+3
    const __m256i* q = v + 4 * h;
    const __m256i t01l = _mm256_unpacklo_epi32(q[0], q[1]), t01h = _mm256_unpackhi_epi32(q[0], q[1]);
    const __m256i t23l = _mm256_unpacklo_epi32(q[2], q[3]), t23h = _mm256_unpackhi_epi32(q[2], q[3]);
    u[4 * h + 0] = _mm256_unpacklo_epi64(t01l, t23l);  // positions group 0 | 4
    u[4 * h + 1] = _mm256_unpackhi_epi64(t01l, t23l);  // 1 | 5
    u[4 * h + 2] = _mm256_unpacklo_epi64(t01h, t23h);  // 2 | 6
    u[4 * h + 3] = _mm256_unpackhi_epi64(t01h, t23h);  // 3 | 7
  }
  for (int j = 0; j < 4; ++j) {
    out[j] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x20);
    out[j + 4] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x31);
  }
}

// Tokens t0..t0+n (n <= 8) transposed into groups, missing tokens as zeros.
// With Offset, also each token's block sums (u).
template <bool Offset>
void q8x_transpose_tokens(const MatmulArgs& a, int64_t t0, int64_t n, int64_t nb, Q8Group* g) {
  for (int64_t b = 0; b < nb; ++b) {
    __m256i v[8];
    for (int t = 0; t < 8; ++t) {
      const bool real = t < n;
      const BlockQ8Act& xb = a.xq[(t0 + (real ? t : 0)) * a.ldxq + b];
      v[t] = real ? load_i8x32(xb.qs) : _mm256_setzero_si256();
      g[b].d[t] = real ? xb.d : 0.0f;
      if constexpr (Offset) g[b].u[t] = block_sum(v[t]);
    }
    __m256i out[8];
    transpose_blocks8(v, out);
    for (int j = 0; j < 8; ++j) _mm256_storeu_si256(reinterpret_cast<__m256i*>(g[b].qs[j]), out[j]);
  }
}

// Bytes of scratch the prefill path uses for K: the token groups, the
// panel's scales (and offsets) and |w|, the panel as Q8_0 blocks (weights of
// another type) and their offsets as f16. Decode takes less: three tokens'
// block sums.
constexpr int64_t q8x_scratch_bytes(int64_t K) {
  return kQ8PanelRows * (K / 32) * (32 + 8 + 34 + 2) + (K / 32) * int64_t(sizeof(Q8Group)) + 64;
}

// Rows [r0, r0 + rows) of a type whose weights are d * q as Q8_0 blocks
// (quants_x86.h), q an int8; an offset type (Q4_1, Q5_1) writes each block's
// m to mh as well.
void to_q8_0_rows(const MatmulArgs& a, int64_t r0, int64_t rows, BlockQ8_0* out, uint16_t* mh);
// Decode (T <= 3) of those types straight from their blocks (quants_x86.h).
void q8x_decode_other(const MatmulArgs& a, int64_t n0, int64_t n1, const float* ux);

#ifdef __AVX512VNNI__
// ---- Q8_0-family prefill with VNNI: sixteen tokens a 512-bit register -------
//
// The types without an offset (Q8_0, Q4_0, Q5_0, IQ4_NL) take the
// activations as unsigned bytes x + 128 against the signed weights, one
// vpdpbusd for sixteen tokens, from a start of -128 * (the block's weight
// sum): the integer sums of q8x_prefill_tile's |w| * sign(x, w) exactly, so
// the same float steps and the same bits, with one broadcast and one
// multiply-add where that tile takes two broadcasts, a sign and a
// multiply-add for eight tokens. (Without VNNI the unsigned-by-signed byte
// product is vpmaddubsw's, whose int16 pairs would saturate on x + 128.)
struct Q8Group16 {  // sixteen tokens' block b, transposed
  float d[16];
  uint8_t qs[8][64];  // qs[j]: positions 4j..4j+3 of tokens 0..15, each + 128
};
constexpr int kQ8Tile16Rows = 2;

// reduce16 of sixteen outputs' lanes at once: their lane 2p in s[p], 2p + 1
// in m[p] (lanes_total8's order).
inline __m512 lanes_total16(const __m512 s[8], const __m512 m[8]) {
  __m512 sp[4], mp[4];
  for (int j = 0; j < 4; ++j) sp[j] = _mm512_add_ps(s[j], s[j + 4]), mp[j] = _mm512_add_ps(m[j], m[j + 4]);
  return _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(sp[0], sp[2]), _mm512_add_ps(sp[1], sp[3])),
                       _mm512_add_ps(_mm512_add_ps(mp[0], mp[2]), _mm512_add_ps(mp[1], mp[3])));
}

// Rows r..r+R of a panel (w: Q8_0 blocks, wsum: 128 * each block's weight
// sum, dw: each block's d as f32) times a group of sixteen tokens: acc[i]
// lane t = y[t][r + i].
template <int R>
void q8x_prefill_tile16(const BlockQ8_0* w, const int32_t* wsum, const float* dw, const Q8Group16* g, int64_t nb,
                        int64_t r, __m512 acc[R]) {
  __m512 accS[R][8];
  for (int i = 0; i < R; ++i)
    for (int q = 0; q < 8; ++q) accS[i][q] = _mm512_setzero_ps();
  const auto block = [&]<int Q>(int64_t b, std::integral_constant<int, Q>) __attribute__((always_inline)) {
    const Q8Group16& gb = g[b];
    __m512i s[R];
    for (int i = 0; i < R; ++i) s[i] = _mm512_set1_epi32(-wsum[(r + i) * nb + b]);
    for (int j = 0; j < 8; ++j) {
      const __m512i xv = _mm512_load_si512(gb.qs[j]);
      for (int i = 0; i < R; ++i) {
        int32_t wq;
        std::memcpy(&wq, w[(r + i) * nb + b].qs + 4 * j, 4);
        s[i] = _mm512_dpbusd_epi32(s[i], xv, _mm512_set1_epi32(wq));
      }
    }
    const __m512 dx = _mm512_load_ps(gb.d);
    for (int i = 0; i < R; ++i)
      accS[i][Q] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[i]), _mm512_mul_ps(_mm512_set1_ps(dw[(r + i) * nb + b]), dx),
                                   accS[i][Q]);
  };
  for (int64_t b0 = 0; b0 < nb; b0 += 8)
    [&]<int... Q>(std::integer_sequence<int, Q...>) {
      ((b0 + Q < nb ? block(b0 + Q, std::integral_constant<int, Q>{}) : void()), ...);
    }(std::make_integer_sequence<int, 8>{});
  __m512 none[8];  // the second steps these types do not have (+0, as lanes_total8's m)
  for (int q = 0; q < 8; ++q) none[q] = _mm512_setzero_ps();
  for (int i = 0; i < R; ++i) acc[i] = lanes_total16(accS[i], none);
}

// Tokens t0..t0+n (n <= 16) into sixteen-token groups, missing tokens as
// zeros (their x + 128 times the weights is what the start takes off again).
inline void q8x_transpose_tokens16(const MatmulArgs& a, int64_t t0, int64_t n, int64_t nb, Q8Group16* g) {
  const __m256i bias = _mm256_set1_epi8(char(0x80));
  for (int64_t b = 0; b < nb; ++b)
    for (int h = 0; h < 2; ++h) {
      __m256i v[8];
      for (int t = 0; t < 8; ++t) {
        const int64_t tt = 8 * h + t;
        const bool real = tt < n;
        const BlockQ8Act& xb = a.xq[(t0 + (real ? tt : 0)) * a.ldxq + b];
        v[t] = real ? load_i8x32(xb.qs) : _mm256_setzero_si256();
        g[b].d[tt] = real ? xb.d : 0.0f;
      }
      __m256i out[8];
      transpose_blocks8(v, out);
      for (int j = 0; j < 8; ++j)
        _mm256_store_si256(reinterpret_cast<__m256i*>(g[b].qs[j] + 32 * h), _mm256_xor_si256(out[j], bias));
    }
}

// Prefill of the types without an offset, a panel of kQ8PanelRows rows at a
// time (converted to Q8_0 blocks unless they are), over groups of sixteen tokens.
inline void matmul_rows_q8x16(const MatmulArgs& a, int64_t n0, int64_t n1, int8_t* base) {
  const bool direct = a.type == GgmlType::Q8_0;
  const auto* w = static_cast<const BlockQ8_0*>(a.w);
  const int64_t nb = a.K / 32;
  auto* g = reinterpret_cast<Q8Group16*>(base);
  auto* dw = reinterpret_cast<float*>(g + nb);
  auto* wsum = reinterpret_cast<int32_t*>(dw + kQ8PanelRows * nb);
  auto* conv = reinterpret_cast<BlockQ8_0*>(wsum + kQ8PanelRows * nb);
  for (int64_t p0 = n0; p0 < n1; p0 += kQ8PanelRows) {
    const int64_t rows = std::min(kQ8PanelRows, n1 - p0);
    if (!direct) to_q8_0_rows(a, p0, rows, conv, nullptr);
    const BlockQ8_0* pw = direct ? w + p0 * nb : conv;
    for (int64_t i = 0; i < rows * nb; ++i) {
      wsum[i] = 128 * block_sum_i32(load_i8x32(pw[i].qs));
      dw[i] = _cvtsh_ss(pw[i].d);
    }
    for (int64_t t0 = 0; t0 < a.T; t0 += 16) {
      const int64_t n = std::min<int64_t>(16, a.T - t0);
      q8x_transpose_tokens16(a, t0, n, nb, g);
      token16_row_tiles<kQ8Tile16Rows>(a, t0, n, p0, rows, [&](auto R, int64_t r, __m512* acc) {
        q8x_prefill_tile16<R>(pw, wsum, dw, g, nb, r, acc);
      });
    }
  }
}
#endif

// Rows [n0, n1) for any number of tokens. Decode reads every type's blocks
// directly; prefill converts weights of another type than Q8_0 (Q4_0, Q5_0,
// IQ4_NL; Q4_1, Q5_1 with their offsets) to Q8_0 blocks in scratch, one panel
// at a time.
template <bool Offset>
void matmul_rows_q8x_as(const MatmulArgs& a, int64_t n0, int64_t n1, float* scratch) {
  assert(q8x_scratch_bytes(a.K) <= matmul_scratch_floats(a.K) * 4);
  const bool direct = a.type == GgmlType::Q8_0;
  const auto* w = static_cast<const BlockQ8_0*>(a.w);
  const int64_t nb = a.K / 32;
  auto* base = reinterpret_cast<int8_t*>((reinterpret_cast<uintptr_t>(scratch) + 63) / 64 * 64);
  if (a.T <= 3) {
    // Each token's block sums first (the bias and offset types' second term).
    auto* ux = reinterpret_cast<float*>(base);
    if (!direct)
      for (int64_t t = 0; t < a.T; ++t)
        for (int64_t b = 0; b < nb; ++b) ux[t * nb + b] = block_sum(load_i8x32(a.xq[t * a.ldxq + b].qs));
    if (direct) return q8x_decode<Q8Src>(a, n0, n1, ux);
    return q8x_decode_other(a, n0, n1, ux);
  }
#ifdef __AVX512VNNI__
  // Up to eight tokens the eight-token tile is faster (Zen 4, Q4_0, 64 rows of
  // K 2048: T = 8 20 us against 24; T = 16 24 against 36, T = 128 152-186
  // against 304-331).
  if constexpr (!Offset)
    if (a.T > 8) return matmul_rows_q8x16(a, n0, n1, base);
#endif
  auto* g = reinterpret_cast<Q8Group*>(base);
  auto* dw = reinterpret_cast<float*>(base + nb * int64_t(sizeof(Q8Group)));
  float* mw = dw + kQ8PanelRows * nb;
  int8_t* wabs = reinterpret_cast<int8_t*>(mw + kQ8PanelRows * nb);
  auto* conv = reinterpret_cast<BlockQ8_0*>(wabs + kQ8PanelRows * nb * 32);
  auto* mh = reinterpret_cast<uint16_t*>(conv + kQ8PanelRows * nb);
  for (int64_t p0 = n0; p0 < n1; p0 += kQ8PanelRows) {
    const int64_t rows = std::min(kQ8PanelRows, n1 - p0);
    if (!direct) to_q8_0_rows(a, p0, rows, conv, mh);
    const Q8Prefill p{direct ? w + p0 * nb : conv, wabs, dw, g, nb, mw};
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t b = 0; b < nb; ++b) {
        const __m256i wv = load_i8x32(p.w[r * nb + b].qs);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(wabs + (r * nb + b) * 32), _mm256_sign_epi8(wv, wv));
        dw[r * nb + b] = _cvtsh_ss(p.w[r * nb + b].d);
        if constexpr (Offset) mw[r * nb + b] = _cvtsh_ss(mh[r * nb + b]);
      }
    for (int64_t t0 = 0; t0 < a.T; t0 += 8) {
      const int64_t n = std::min<int64_t>(8, a.T - t0);
      q8x_transpose_tokens<Offset>(a, t0, n, nb, g);
      const auto store = [&](int64_t r, const __m256* acc, int R) { store_token_lanes(a, t0, n, p0 + r, acc, R); };
      int64_t r = 0;
      for (; r + kQ8TileRows <= rows; r += kQ8TileRows) {
        __m256 acc[kQ8TileRows];
        q8x_prefill_tile<kQ8TileRows, Offset>(p, r, acc);
        store(r, acc, kQ8TileRows);
      }
      for (; r < rows; ++r) {
        __m256 acc[1];
        q8x_prefill_tile<1, Offset>(p, r, acc);
        store(r, acc, 1);
      }
    }
  }
}


// --- matrix-matrix path: a panel of rows converted once, then f32 tiles -----

// Converts row n (K elements) to f32 with zeros up to kp. With `ahead` > 0
// (rows), a 16-bit row also asks for row n + ahead's lines (L2): the next
// panel arrives while this one's products run.
void pack_row(const MatmulArgs& a, int64_t n, int64_t kp, float* out, int64_t ahead = 0) {
  const int64_t kmain = a.K / 8 * 8;
  switch (a.type) {
    case GgmlType::F32: {
      const float* w = static_cast<const float*>(a.w) + n * a.K;
      std::memcpy(out, w, size_t(a.K) * 4);
      break;
    }
    case GgmlType::F16: {
      const uint16_t* w = static_cast<const uint16_t*>(a.w) + n * a.K;
      if (ahead && n + ahead < a.N)
        for (int64_t k = 0; k < a.K; k += 32) _mm_prefetch(reinterpret_cast<const char*>(w + ahead * a.K + k), _MM_HINT_T1);
      for (int64_t k = 0; k < kmain; k += 8) _mm256_storeu_ps(out + k, load_f16(w + k));
      for (int64_t k = kmain; k < a.K; ++k) out[k] = fp16_to_fp32(w[k]);
      break;
    }
    case GgmlType::BF16: {
      const uint16_t* w = static_cast<const uint16_t*>(a.w) + n * a.K;
      for (int64_t k = 0; k < kmain; k += 8) _mm256_storeu_ps(out + k, load_bf16(w + k));
      for (int64_t k = kmain; k < a.K; ++k) out[k] = bf16_to_fp32(w[k]);
      break;
    }
    case GgmlType::Q8_0: {
      const int64_t nb = a.K / 32;
      const BlockQ8_0* w = static_cast<const BlockQ8_0*>(a.w) + n * nb;
      for (int64_t b = 0; b < nb; ++b) {
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(w[b].d));
        for (int j = 0; j < 4; ++j) _mm256_storeu_ps(out + b * 32 + j * 8, load_q8(w[b].qs + j * 8, d));
      }
      break;
    }
    default:
      break;
  }
  for (int64_t k = a.K; k < kp; ++k) out[k] = 0;
}

// --- attention --------------------------------------------------------------

// e^x within 1 ulp of std::exp: x = n ln2 + r with |r| <= ln2/2, e^r by a
// degree-6 polynomial (Cephes' expf coefficients), then 2^n put into the
// exponent. Below -87.3 (2^n would leave the normal range) the result is zero,
// as for -inf; above 88 it is infinity.
inline __m256 exp_x86(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3f), hi = _mm256_set1_ps(88.0f);
  const __m256 xc = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 q = _mm256_set1_ps(1.9875691500e-4f);
  q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(1.3981999507e-3f));
  q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(8.3334519073e-3f));
  q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(4.1665795894e-2f));
  q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(1.6666665459e-1f));
  q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(5.0000001201e-1f));
  q = _mm256_fmadd_ps(_mm256_mul_ps(q, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 e = _mm256_and_ps(_mm256_mul_ps(q, _mm256_castsi256_ps(scale)), _mm256_cmp_ps(x, lo, _CMP_GE_OQ));
  return _mm256_blendv_ps(e, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(x, hi, _CMP_GT_OQ));
}

// Attention in tiles of kAttendTile positions with an online softmax: a
// query keeps its running maximum m, its running sum l and its unnormalised
// output in `out`; each tile's scores are exponentiated against the new
// maximum, and what came before is scaled by e^(m_old - m_new). No row of a
// query's scores longer than a tile is ever kept, at any depth.
//
// The steps of one query, shared by attend_x86 (one query) and
// attend_block_x86 (several over the same K and V, loops in another order):
// each query's arithmetic is these steps in this order, whichever calls them.

// One head's cached rows as the attention reads them: load8(p, i) gives
// values i..i+7 of row p (i a multiple of 8), one(p, i) value i, both
// exactly as f32; from(p0) the rows from p0 on.
struct F16Rows {
  const uint8_t* base;
  int64_t row_bytes;
  F16Rows from(int64_t p0) const { return {base + p0 * row_bytes, row_bytes}; }
  const uint16_t* row(int64_t p) const { return reinterpret_cast<const uint16_t*>(base + p * row_bytes); }
  __m256 load8(int64_t p, int64_t i) const { return load_f16(row(p) + i); }
  float one(int64_t p, int64_t i) const { return fp16_to_fp32(row(p)[i]); }
};
// ggml's Q8_0 blocks (an f16 scale d, 32 int8 q): value d * q.
struct Q8Rows {
  const uint8_t* base;
  int64_t row_bytes;
  Q8Rows from(int64_t p0) const { return {base + p0 * row_bytes, row_bytes}; }
  const uint8_t* block(int64_t p, int64_t i) const {
    return base + p * row_bytes + i / kKvQ8Block * kKvQ8BlockBytes;
  }
  static float scale(const uint8_t* b) {
    uint16_t d;
    std::memcpy(&d, b, 2);
    return _cvtsh_ss(d);
  }
  __m256 load8(int64_t p, int64_t i) const {
    const uint8_t* b = block(p, i);
    return load_q8(reinterpret_cast<const int8_t*>(b + 2 + i % kKvQ8Block), _mm256_set1_ps(scale(b)));
  }
  float one(int64_t p, int64_t i) const {
    const uint8_t* b = block(p, i);
    return scale(b) * float(int8_t(b[2 + i % kKvQ8Block]));
  }
};

// Scores of positions p0..p0+8 of the tile k for Q queries (eight sums a
// query in one transposing reduction): each row of K is converted once for
// all Q, and every query's sums take the same steps as alone.
template <int Q, class Rows>
inline void score8(const float* const* q, const Rows& k, int64_t p0, int64_t hd, float scale, float* const* sc,
                   float* mx) {
  const int64_t hmain = hd / 8 * 8;
  __m256 acc[Q][8];
  for (int j = 0; j < Q; ++j)
    for (int r = 0; r < 8; ++r) acc[j][r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < hmain; i += 8) {
    __m256 qv[Q];
    for (int j = 0; j < Q; ++j) qv[j] = _mm256_loadu_ps(q[j] + i);
    for (int r = 0; r < 8; ++r) {
      const __m256 kv = k.load8(p0 + r, i);
      for (int j = 0; j < Q; ++j) acc[j][r] = _mm256_fmadd_ps(qv[j], kv, acc[j][r]);
    }
  }
  for (int j = 0; j < Q; ++j) {
    alignas(32) float sums[8];
    _mm256_store_ps(sums, hsums8(acc[j]));
    for (int r = 0; r < 8; ++r) {
      float s = sums[r];
      for (int64_t i = hmain; i < hd; ++i) s += q[j][i] * k.one(p0 + r, i);
      sc[j][p0 + r] = s * scale;
      mx[j] = std::max(mx[j], sc[j][p0 + r]);
    }
  }
}

// The score of position p alone.
template <class Rows>
inline void score1(const float* q, const Rows& k, int64_t p, int64_t hd, float scale, float* sc, float& mx) {
  const int64_t hmain = hd / 8 * 8;
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < hmain; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), k.load8(p, i), acc);
  float s = hsum(acc);
  for (int64_t i = hmain; i < hd; ++i) s += q[i] * k.one(p, i);
  sc[p] = s * scale;
  mx = std::max(mx, sc[p]);
}

// exp(score - max) in place, eight positions at a time; the last few
// through a padded copy, where exp(-inf) gives exactly zero. Returns the sum.
inline float softmax_x86(float* sc, int64_t n, float mx) {
  const __m256 vmx = _mm256_set1_ps(mx);
  __m256 vsum = _mm256_setzero_ps();
  int64_t e0 = 0;
  for (; e0 + 8 <= n; e0 += 8) {
    const __m256 e = exp_x86(_mm256_sub_ps(_mm256_loadu_ps(sc + e0), vmx));
    _mm256_storeu_ps(sc + e0, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  if (e0 < n) {
    alignas(32) float tail[8];
    for (int i = 0; i < 8; ++i) tail[i] = e0 + i < n ? sc[e0 + i] : -INFINITY;
    const __m256 e = exp_x86(_mm256_sub_ps(_mm256_load_ps(tail), vmx));
    _mm256_store_ps(tail, e);
    vsum = _mm256_add_ps(vsum, e);
    for (int64_t i = e0; i < n; ++i) sc[i] = tail[i - e0];
  }
  return hsum(vsum);
}

// One query's running state across tiles.
struct OnlineSoftmax {
  float m = -INFINITY;  // the largest score so far
  float l = 0;          // sum of e^(score - m) so far
  // A tile's scores (their maximum mx) become e^(score - m_new) in place;
  // returns the factor e^(m_old - m_new) for the output so far (1 when the
  // maximum stays: e^0 is exactly 1).
  float tile(float* sc, int64_t n, float mx) {
    const float m_new = std::max(m, mx);
    float alpha = 1.0f;
    if (m_new != m) {
      alignas(32) float e[8];
      _mm256_store_ps(e, exp_x86(_mm256_set1_ps(m - m_new)));  // m = -inf at the first tile: 0
      alpha = e[0];
    }
    m = m_new;
    const float sum = softmax_x86(sc, n, m);
    l = l * alpha + sum;
    return alpha;
  }
};

// For each of Q queries: out[c0..c0+8N) = out * alpha + sum over its
// positions [0, n) of e[p] * V[p], in position order, the running sums in
// registers; `first`: they start at zero. The queries share each row of V
// up to the fewest positions among them; each then takes its own last ones.
template <int Q, int N, class Rows>
void attend_values_tile(const float* const* e, const float* alpha, const Rows& v, const int64_t* n, int64_t c0,
                        float* const* out, bool first) {
  __m256 acc[Q][N];
  int64_t common = n[0];
  for (int j = 0; j < Q; ++j) {
    common = std::min(common, n[j]);
    const __m256 a = _mm256_set1_ps(alpha[j]);
    for (int i = 0; i < N; ++i)
      acc[j][i] = first ? _mm256_setzero_ps() : _mm256_mul_ps(_mm256_loadu_ps(out[j] + c0 + 8 * i), a);
  }
  for (int64_t p = 0; p < common; ++p) {
    __m256 w[Q];
    for (int j = 0; j < Q; ++j) w[j] = _mm256_set1_ps(e[j][p]);
    for (int i = 0; i < N; ++i) {
      const __m256 vv = v.load8(p, c0 + 8 * i);
      for (int j = 0; j < Q; ++j) acc[j][i] = _mm256_fmadd_ps(w[j], vv, acc[j][i]);
    }
  }
  for (int j = 0; j < Q; ++j) {
    for (int64_t p = common; p < n[j]; ++p) {
      const __m256 w = _mm256_set1_ps(e[j][p]);
      for (int i = 0; i < N; ++i) acc[j][i] = _mm256_fmadd_ps(w, v.load8(p, c0 + 8 * i), acc[j][i]);
    }
    for (int i = 0; i < N; ++i) _mm256_storeu_ps(out[j] + c0 + 8 * i, acc[j][i]);
  }
}

// The value dims one call of attend_values_at takes for Q queries: at most
// sixteen running sums (one query: 64 dims, eight sums).
template <int Q>
inline constexpr int64_t kValueDims = 8 * std::min(8, 16 / Q);

// Value dims [c0, c0 + kValueDims<Q>) (fewer at the end of the multiples of
// 8) of one tile (v at its first position) into Q queries' outputs, the sums
// in registers.
template <int Q, class Rows>
inline void attend_values_at(const float* const* e, const float* alpha, const Rows& v, const int64_t* n,
                             int64_t hmain, int64_t c0, float* const* out, bool first) {
  constexpr int kMost = int(kValueDims<Q> / 8);
  auto tile = [&]<int N>(auto self) {
    if constexpr (N > 1)
      if ((hmain - c0) / 8 < N) return self.template operator()<N - 1>(self);
    attend_values_tile<Q, N>(e, alpha, v, n, c0, out, first);
  };
  tile.template operator()<kMost>(tile);
}

// The dims past the last multiple of 8 of one tile, position by position.
template <class Rows>
inline void attend_values_rest(const float* e, float alpha, const Rows& v, int64_t n, int64_t hd, float* out,
                               bool first) {
  for (int64_t i = hd / 8 * 8; i < hd; ++i) {
    float o = first ? 0.0f : out[i] * alpha;
    for (int64_t p = 0; p < n; ++p) o += e[p] * v.one(p, i);
    out[i] = o;
  }
}

// The output divided by the running sum.
inline void attend_finish(const OnlineSoftmax& st, int64_t hd, float* out) {
  const float inv = 1.0f / st.l;
  for (int64_t i = 0; i < hd; ++i) out[i] *= inv;
}

template <class Rows>
void attend_rows_x86(const float* q, const Rows& k, const Rows& v, int64_t n_pos, int64_t hd, float scale, float* out,
                     float* scores) {
  const int64_t hmain = hd / 8 * 8;
  OnlineSoftmax st;
  for (int64_t t0 = 0; t0 < n_pos; t0 += kAttendTile) {
    const int64_t n = std::min(kAttendTile, n_pos - t0);
    const Rows kt = k.from(t0), vt = v.from(t0);
    float mx = -INFINITY;
    int64_t p = 0;
    for (; p + 8 <= n; p += 8) score8<1>(&q, kt, p, hd, scale, &scores, &mx);
    for (; p < n; ++p) score1(q, kt, p, hd, scale, scores, mx);
    const float alpha = st.tile(scores, n, mx);
    const float* e = scores;
    for (int64_t c0 = 0; c0 < hmain; c0 += kValueDims<1>)
      attend_values_at<1>(&e, &alpha, vt, &n, hmain, c0, &out, t0 == 0);
    attend_values_rest(scores, alpha, vt, n, hd, out, t0 == 0);
  }
  attend_finish(st, hd, out);
}

// Queries an AVX-512 table's attention takes together, their running sums in
// its 32 registers: two queries' scores of eight positions (16 sums) share
// each row of K, two queries' 64 value dims (16 sums) each row of V. 207M
// F16, Zen 4, 2 threads, pp512 at depth 4096, alternated: one query at a
// time 188-190 tok/s, two 194-204; three for the scores 188-190, four for
// the values (32 dims a pass over the tile) 177-181. The AVX2 table's
// sixteen registers hold one query's.
#ifdef __AVX512F__
inline constexpr int kScoreGroup = 2, kValueGroup = 2;
#else
inline constexpr int kScoreGroup = 1, kValueGroup = 1;
#endif

// f.template operator()<G>(idx) on the m indices idx[0..m) in groups of
// Group, then one at a time.
template <int Group, class F>
inline void in_attend_groups(const int* idx, int m, F&& f) {
  int g = 0;
  if constexpr (Group > 1)
    for (; g + Group <= m; g += Group) f.template operator()<Group>(idx + g);
  for (; g < m; ++g) f.template operator()<1>(idx + g);
}

// Several queries of one head (a prefill chunk's tokens of one sequence):
// each query's steps are attend_rows_x86's, with the same arithmetic, but the
// queries take each piece of a tile in turn while it is in L1: eight
// positions of K for every query's scores, then 64 dims of the tile's V for
// every query's outputs (at a depth of 16K positions one head's K and V are
// 4 MB: one pass per query streamed them from L3 each time). Queries go in
// groups (kScoreGroup, kValueGroup) that convert each row of K and V once.
template <class Rows>
void attend_block_rows_x86(const float* const* q, const int64_t* n_pos, int nq, const Rows& k, const Rows& v,
                           int64_t hd, float scale, float* const* out, float* scores, int64_t score_stride) {
  const int64_t hmain = hd / 8 * 8;
  int64_t most = 0;
  for (int j = 0; j < nq; ++j) most = std::max(most, n_pos[j]);
  OnlineSoftmax st[kAttendBlock];
  float alpha[kAttendBlock], mx[kAttendBlock];
  int64_t n[kAttendBlock];
  float* sc[kAttendBlock];
  for (int j = 0; j < nq; ++j) sc[j] = scores + j * score_stride;
  int idx[kAttendBlock];
  for (int64_t t0 = 0; t0 < most; t0 += kAttendTile) {
    const Rows kt = k.from(t0), vt = v.from(t0);
    for (int j = 0; j < nq; ++j) {
      n[j] = std::clamp<int64_t>(n_pos[j] - t0, 0, kAttendTile);
      mx[j] = -INFINITY;
    }
    for (int64_t p = 0; p + 8 <= kAttendTile; p += 8) {
      int m = 0;
      for (int j = 0; j < nq; ++j)
        if (p + 8 <= n[j]) idx[m++] = j;
      if (m == 0) break;
      in_attend_groups<kScoreGroup>(idx, m, [&]<int G>(const int* g) {
        const float* qg[G];
        float* sg[G];
        float mg[G];
        for (int i = 0; i < G; ++i) qg[i] = q[g[i]], sg[i] = sc[g[i]], mg[i] = mx[g[i]];
        score8<G>(qg, kt, p, hd, scale, sg, mg);
        for (int i = 0; i < G; ++i) mx[g[i]] = mg[i];
      });
    }
    int m = 0;
    for (int j = 0; j < nq; ++j) {
      if (n[j] == 0) continue;
      idx[m++] = j;
      for (int64_t p = n[j] / 8 * 8; p < n[j]; ++p) score1(q[j], kt, p, hd, scale, sc[j], mx[j]);
      alpha[j] = st[j].tile(sc[j], n[j], mx[j]);
    }
    in_attend_groups<kValueGroup>(idx, m, [&]<int G>(const int* g) {
      const float* eg[G];
      float ag[G];
      int64_t ng[G];
      float* og[G];
      for (int i = 0; i < G; ++i) eg[i] = sc[g[i]], ag[i] = alpha[g[i]], ng[i] = n[g[i]], og[i] = out[g[i]];
      for (int64_t c0 = 0; c0 < hmain; c0 += kValueDims<G>)
        attend_values_at<G>(eg, ag, vt, ng, hmain, c0, og, t0 == 0);
    });
    for (int j = 0; j < nq; ++j)
      if (n[j] > 0) attend_values_rest(sc[j], alpha[j], vt, n[j], hd, out[j], t0 == 0);
  }
  for (int j = 0; j < nq; ++j) attend_finish(st[j], hd, out[j]);
}

inline const uint8_t* kv_bytes(const KvRows& r) { return static_cast<const uint8_t*>(r.data); }

void attend_x86(const float* q, KvRows k, KvRows v, int64_t n_pos, int64_t hd, float scale, float* out,
                float* scores) {
  if (k.type == KvType::q8_0)
    return attend_rows_x86(q, Q8Rows{kv_bytes(k), k.row_bytes}, Q8Rows{kv_bytes(v), v.row_bytes}, n_pos, hd, scale,
                           out, scores);
  attend_rows_x86(q, F16Rows{kv_bytes(k), k.row_bytes}, F16Rows{kv_bytes(v), v.row_bytes}, n_pos, hd, scale, out,
                  scores);
}

void attend_block_x86(const float* const* q, const int64_t* n_pos, int nq, KvRows k, KvRows v, int64_t hd,
                      float scale, float* const* out, float* scores, int64_t score_stride) {
  if (k.type == KvType::q8_0)
    return attend_block_rows_x86(q, n_pos, nq, Q8Rows{kv_bytes(k), k.row_bytes}, Q8Rows{kv_bytes(v), v.row_bytes},
                                 hd, scale, out, scores, score_stride);
  attend_block_rows_x86(q, n_pos, nq, F16Rows{kv_bytes(k), k.row_bytes}, F16Rows{kv_bytes(v), v.row_bytes}, hd,
                        scale, out, scores, score_stride);
}

// Eight values of SwiGLU's gate: g / (1 + e^-g) * u, in the scalar order.
inline __m256 silu_mul8(__m256 g, __m256 u) {
  const __m256 e = exp_x86(_mm256_sub_ps(_mm256_setzero_ps(), g));
  return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u);
}

void silu_mul_x86(float* g, const float* u, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(g + i, silu_mul8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
  if (i < n) {  // the last few through a padded copy, so every value takes the same path
    alignas(32) float gt[8] = {}, ut[8] = {};
    std::copy(g + i, g + n, gt);
    std::copy(u + i, u + n, ut);
    _mm256_store_ps(gt, silu_mul8(_mm256_load_ps(gt), _mm256_load_ps(ut)));
    std::copy(gt, gt + (n - i), g + i);
  }
}

void to_f16_x86(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) dst[i] = fp32_to_fp16(src[i]);
}


}  // namespace
}  // namespace ds4::cpu
