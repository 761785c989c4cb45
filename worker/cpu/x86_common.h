#pragma once
// Building blocks shared by the AVX2 and AVX-512 kernel tables: exact weight
// loads, the matrix-vector path, row packing, attention and f16 stores. Each
// table's file includes this under its own compiler flags; the anonymous
// namespace keeps each copy private to its file, so no AVX-512 code can stand
// in for the AVX2 one at link time.
#include <immintrin.h>

#include <algorithm>
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

// Rows r0..r0+R of a 16-bit or f32 row-major matrix, C tokens.
template <int R, int C, typename Load, typename Elem>
void gemv_tile(const Elem* w, int64_t K, int64_t r0, const float* x, int64_t ldx, float* y,
               int64_t ldy, Load load) {
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  const int64_t kmain = K / 8 * 8;
  for (int64_t k = 0; k < kmain; k += 8) {
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
  float sum = 0;
  for (int64_t p = 0; p < n_pos; ++p) {
    scores[p] = std::exp(scores[p] - mx);
    sum += scores[p];
  }
  const float inv = 1.0f / sum;
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

void to_f16_x86(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) dst[i] = fp32_to_fp16(src[i]);
}


}  // namespace
}  // namespace ds4::cpu
