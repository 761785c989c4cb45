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

#include "worker/cpu/kernels.h"

namespace ds4::cpu {
namespace {

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));  // (l0+l4)+(l2+l6), (l1+l5)+(l3+l7)
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

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

// --- matrix-vector path: weights converted on the fly (T <= 3) -------------
//
// Decode reads every weight once, straight from memory, and the hardware
// prefetchers stop at each 4 KiB page: the tiles below ask for the rows of the
// next tile, at the columns they are reading now (2-thread decode of the 207M
// synthetic llama on a Xeon: Q8_0 1.5x, F16 1.1x-1.2x tokens/s).

// Rows r0..r0+R of a 16-bit or f32 row-major matrix, C tokens.
template <int R, int C, typename Load, typename Elem>
void gemv_tile(const Elem* w, int64_t K, int64_t r0, const float* x, int64_t ldx, float* y,
               int64_t ldy, Load load) {
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  const int64_t kmain = K / 8 * 8;
  for (int64_t k = 0; k < kmain; k += 8) {
    // One row per step, in turn: a 64-byte line holds 4 steps of 16-bit weights.
    _mm_prefetch(reinterpret_cast<const char*>(w + (r0 + R + (k / 8) % R) * K + k), _MM_HINT_T0);
    __m256 xv[C];
    for (int c = 0; c < C; ++c) xv[c] = _mm256_loadu_ps(x + c * ldx + k);
    for (int r = 0; r < R; ++r) {
      const __m256 wv = load(w + (r0 + r) * K + k);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(wv, xv[c], acc[r][c]);
    }
  }
  if (kmain < K) {  // tail: weights past K are zero, as x is
    __m256 xv[C];
    for (int c = 0; c < C; ++c) xv[c] = _mm256_loadu_ps(x + c * ldx + kmain);
    for (int r = 0; r < R; ++r) {
      alignas(32) Elem tail[8] = {};
      std::memcpy(tail, w + (r0 + r) * K + kmain, size_t(K - kmain) * sizeof(Elem));
      const __m256 wv = load(tail);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(wv, xv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[c * ldy + r0 + r] = hsum(acc[r][c]);
}

template <int R, int C>
void gemv_tile_q8(const BlockQ8_0* w, int64_t K, int64_t r0, const float* x, int64_t ldx, float* y,
                  int64_t ldy) {
  const int64_t nb = K / 32;
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    for (int j = 0; j < 4; ++j) {
      __m256 xv[C];
      for (int c = 0; c < C; ++c) xv[c] = _mm256_loadu_ps(x + c * ldx + b * 32 + j * 8);
      for (int r = 0; r < R; ++r) {
        const BlockQ8_0& blk = w[(r0 + r) * nb + b];
        const __m256 wv = load_q8(blk.qs + j * 8, _mm256_set1_ps(_cvtsh_ss(blk.d)));
        for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(wv, xv[c], acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[c * ldy + r0 + r] = hsum(acc[r][c]);
}

template <int C>
void gemv_rows(const MatmulArgs& a, int64_t n0, int64_t n1, const float* x, float* y) {
  auto run = [&]<int R>(int64_t r0) {
    switch (a.type) {
      case GgmlType::F32:
        gemv_tile<R, C>(static_cast<const float*>(a.w), a.K, r0, x, a.ldx, y, a.ldy,
                        [](const float* p) { return load_f32(p); });
        break;
      case GgmlType::F16:
        gemv_tile<R, C>(static_cast<const uint16_t*>(a.w), a.K, r0, x, a.ldx, y, a.ldy,
                        [](const uint16_t* p) { return load_f16(p); });
        break;
      case GgmlType::BF16:
        gemv_tile<R, C>(static_cast<const uint16_t*>(a.w), a.K, r0, x, a.ldx, y, a.ldy,
                        [](const uint16_t* p) { return load_bf16(p); });
        break;
      case GgmlType::Q8_0:
        gemv_tile_q8<R, C>(static_cast<const BlockQ8_0*>(a.w), a.K, r0, x, a.ldx, y, a.ldy);
        break;
      default:
        break;
    }
  };
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) run.template operator()<4>(n);
  for (; n < n1; ++n) run.template operator()<1>(n);
}

// All tokens of a small batch (T <= 3), three at a time, weights converted on the fly.
void gemv_tokens(const MatmulArgs& a, int64_t n0, int64_t n1) {
  for (int64_t t = 0; t < a.T;) {
    const int64_t c = std::min<int64_t>(a.T - t, 3);
    const float* x = a.x + t * a.ldx;
    float* y = a.y + t * a.ldy;
    if (c == 3) gemv_rows<3>(a, n0, n1, x, y);
    else if (c == 2) gemv_rows<2>(a, n0, n1, x, y);
    else gemv_rows<1>(a, n0, n1, x, y);
    t += c;
  }
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
    out[b].d = zero ? 0.0f : amax / 127.0f;
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

// One weight block (w, and |w| as unsigned bytes) times one activation block:
// lane l holds the exact sum over k = 4l..4l+3, as floats. maddubs multiplies
// unsigned by signed bytes, so x takes w's sign; |x| <= 127 keeps its pair
// sums within int16, and w = -128 works because |w| = 128 is read unsigned.
inline __m256 block_dot_q8(__m256i w, __m256i w_abs, const int8_t* xq) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
  const __m256i pairs = _mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(x, w));
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

// Decode (T <= 3): rows r0..r0+R times C quantized token rows, all K/32
// blocks. The weights stream from memory once, so each tile asks for the next
// tile's rows as it reads its own.
template <int R, int C>
void q8x_decode_tile(const BlockQ8_0* w, int64_t nb, int64_t r0, const BlockQ8Act* x, int64_t ldxq, float* y,
                     int64_t ldy) {
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    for (int r = 0; r < R; ++r) {
      const BlockQ8_0& blk = w[(r0 + r) * nb + b];
      _mm_prefetch(reinterpret_cast<const char*>(&blk + R * nb), _MM_HINT_T0);  // the next tile
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk.qs));
      const __m256i wa = _mm256_sign_epi8(wv, wv);
      const __m256 dw = _mm256_set1_ps(_cvtsh_ss(blk.d));
      for (int c = 0; c < C; ++c) {
        const BlockQ8Act& xb = x[c * ldxq + b];
        const __m256 d = _mm256_mul_ps(dw, _mm256_broadcast_ss(&xb.d));
        acc[r][c] = _mm256_fmadd_ps(block_dot_q8(wv, wa, xb.qs), d, acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[c * ldy + r0 + r] = hsum(acc[r][c]);
}

template <int R, int C>
void q8x_decode_rows(const MatmulArgs& a, int64_t n0, int64_t n1) {
  const auto* w = static_cast<const BlockQ8_0*>(a.w);
  const int64_t nb = a.K / 32;
  int64_t r = n0;
  for (; r + R <= n1; r += R) q8x_decode_tile<R, C>(w, nb, r, a.xq, a.ldxq, a.y, a.ldy);
  for (; r < n1; ++r) q8x_decode_tile<1, C>(w, nb, r, a.xq, a.ldxq, a.y, a.ldy);
}

// Prefill (T >= 4): a panel of rows and a block of tokens, their scales
// converted to floats once, so that a tile multiplies its scales d_w * d_x
// eight blocks at a time before its integer products.
constexpr int64_t kQ8PanelRows = 16, kQ8TokenBlock = 64, kQ8TileRows = 2, kQ8TileTokens = 5;

struct Q8Panel {
  const BlockQ8_0* w;    // the panel's first row
  const float* dw;       // (rows, nbp): d_w, zeros past nb
  const BlockQ8Act* x;   // the block's first token
  int64_t ldxq;
  const float* dx;       // (tokens, nbp): d_x, zeros past nb
  float* dt;             // (R * C, nbp): one tile's d_w * d_x
  int64_t nb, nbp;
  float* y;              // y at the first token, first row of the panel
  int64_t ldy;
};

// Rows r..r+R of the panel times tokens t..t+C of the block. Every 32-block
// costs one load and five operations per row and token (sign, multiply-add
// bytes, multiply-add pairs, convert, fused multiply-add), with the rows'
// weights and the tokens' activations read from L1 across the tile.
template <int R, int C>
void q8x_prefill_tile(const Q8Panel& p, int64_t r, int64_t t) {
  const int64_t nb = p.nb, nbp = p.nbp;
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < C; ++c)
      for (int64_t b = 0; b < nb; b += 8)
        _mm256_storeu_ps(p.dt + (i * C + c) * nbp + b, _mm256_mul_ps(_mm256_loadu_ps(p.dw + (r + i) * nbp + b),
                                                                     _mm256_loadu_ps(p.dx + (t + c) * nbp + b)));
  __m256 acc[R][C];
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < C; ++c) acc[i][c] = _mm256_setzero_ps();
  const BlockQ8_0* w = p.w + r * nb;
  const BlockQ8Act* x = p.x + t * p.ldxq;
  for (int64_t b = 0; b < nb; ++b)
    for (int i = 0; i < R; ++i) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[i * nb + b].qs));
      const __m256i wa = _mm256_sign_epi8(wv, wv);
      for (int c = 0; c < C; ++c)
        acc[i][c] = _mm256_fmadd_ps(block_dot_q8(wv, wa, x[c * p.ldxq + b].qs),
                                    _mm256_broadcast_ss(p.dt + (i * C + c) * nbp + b), acc[i][c]);
    }
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < C; ++c) p.y[(t + c) * p.ldy + r + i] = hsum(acc[i][c]);
}

// Tokens t..t+C of the block against every row of the panel.
template <int C>
void q8x_prefill_rows(const Q8Panel& p, int64_t rows, int64_t t) {
  int64_t r = 0;
  for (; r + kQ8TileRows <= rows; r += kQ8TileRows) q8x_prefill_tile<kQ8TileRows, C>(p, r, t);
  for (; r < rows; ++r) q8x_prefill_tile<1, C>(p, r, t);
}

// Floats of scratch the prefill path uses for K.
constexpr int64_t q8x_scratch_floats(int64_t K) {
  return (kQ8PanelRows + kQ8TokenBlock + kQ8TileRows * kQ8TileTokens) * ((K / 32 + 7) / 8 * 8);
}

// Rows [n0, n1) for any number of tokens.
void matmul_rows_q8x(const MatmulArgs& a, int64_t n0, int64_t n1, float* scratch) {
  assert(q8x_scratch_floats(a.K) <= matmul_scratch_floats(a.K));
  if (a.T == 1) return q8x_decode_rows<4, 1>(a, n0, n1);
  if (a.T == 2) return q8x_decode_rows<4, 2>(a, n0, n1);
  if (a.T == 3) return q8x_decode_rows<2, 3>(a, n0, n1);
  const auto* w = static_cast<const BlockQ8_0*>(a.w);
  const int64_t nb = a.K / 32, nbp = (nb + 7) / 8 * 8;
  float* dw = scratch;
  float* dx = dw + kQ8PanelRows * nbp;
  Q8Panel p{nullptr, dw, nullptr, a.ldxq, dx, dx + kQ8TokenBlock * nbp, nb, nbp, nullptr, a.ldy};
  for (int64_t p0 = n0; p0 < n1; p0 += kQ8PanelRows) {
    const int64_t rows = std::min(kQ8PanelRows, n1 - p0);
    p.w = w + p0 * nb;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t b = 0; b < nbp; ++b) dw[r * nbp + b] = b < nb ? _cvtsh_ss(p.w[r * nb + b].d) : 0.0f;
    for (int64_t t0 = 0; t0 < a.T; t0 += kQ8TokenBlock) {
      const int64_t tokens = std::min(kQ8TokenBlock, a.T - t0);
      p.x = a.xq + t0 * a.ldxq;
      p.y = a.y + t0 * a.ldy + p0;
      for (int64_t t = 0; t < tokens; ++t)
        for (int64_t b = 0; b < nbp; ++b) dx[t * nbp + b] = b < nb ? p.x[t * a.ldxq + b].d : 0.0f;
      int64_t t = 0;
      for (; t + kQ8TileTokens <= tokens; t += kQ8TileTokens) q8x_prefill_rows<kQ8TileTokens>(p, rows, t);
      switch (tokens - t) {
        case 4: q8x_prefill_rows<4>(p, rows, t); break;
        case 3: q8x_prefill_rows<3>(p, rows, t); break;
        case 2: q8x_prefill_rows<2>(p, rows, t); break;
        case 1: q8x_prefill_rows<1>(p, rows, t); break;
        default: break;
      }
    }
  }
}

// --- matrix-matrix path: a panel of rows converted once, then f32 tiles -----

// Converts row n (K elements) to f32 with zeros up to kp.
void pack_row(const MatmulArgs& a, int64_t n, int64_t kp, float* out) {
  const int64_t kmain = a.K / 8 * 8;
  switch (a.type) {
    case GgmlType::F32: {
      const float* w = static_cast<const float*>(a.w) + n * a.K;
      std::memcpy(out, w, size_t(a.K) * 4);
      break;
    }
    case GgmlType::F16: {
      const uint16_t* w = static_cast<const uint16_t*>(a.w) + n * a.K;
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

void attend_x86(const float* q, const uint16_t* k, const uint16_t* v, int64_t n_pos, int64_t hd,
                 int64_t stride, float scale, float* out, float* scores) {
  const int64_t hmain = hd / 8 * 8;
  float mx = -INFINITY;
  for (int64_t p = 0; p < n_pos; ++p) {
    const uint16_t* kp = k + p * stride;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < hmain; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load_f16(kp + i), acc);
    float s = hsum(acc);
    for (int64_t i = hmain; i < hd; ++i) s += q[i] * fp16_to_fp32(kp[i]);
    scores[p] = s * scale;
    mx = std::max(mx, scores[p]);
  }
  // exp(score - max) eight positions at a time; the last few through a padded
  // copy, where exp(-inf) gives exactly zero.
  const __m256 vmx = _mm256_set1_ps(mx);
  __m256 vsum = _mm256_setzero_ps();
  int64_t e0 = 0;
  for (; e0 + 8 <= n_pos; e0 += 8) {
    const __m256 e = exp_x86(_mm256_sub_ps(_mm256_loadu_ps(scores + e0), vmx));
    _mm256_storeu_ps(scores + e0, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  if (e0 < n_pos) {
    alignas(32) float tail[8];
    for (int i = 0; i < 8; ++i) tail[i] = e0 + i < n_pos ? scores[e0 + i] : -INFINITY;
    const __m256 e = exp_x86(_mm256_sub_ps(_mm256_load_ps(tail), vmx));
    _mm256_store_ps(tail, e);
    vsum = _mm256_add_ps(vsum, e);
    for (int64_t i = e0; i < n_pos; ++i) scores[i] = tail[i - e0];
  }
  const float inv = 1.0f / hsum(vsum);
  for (int64_t i = 0; i < hd; ++i) out[i] = 0;
  for (int64_t p = 0; p < n_pos; ++p) {
    const uint16_t* vp = v + p * stride;
    const float wgt = scores[p] * inv;
    const __m256 w = _mm256_set1_ps(wgt);
    for (int64_t i = 0; i < hmain; i += 8)
      _mm256_storeu_ps(out + i, _mm256_fmadd_ps(w, load_f16(vp + i), _mm256_loadu_ps(out + i)));
    for (int64_t i = hmain; i < hd; ++i) out[i] += wgt * fp16_to_fp32(vp[i]);
  }
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
