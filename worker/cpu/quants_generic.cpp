// The weight types' rows (quant_types.h): ggml's dequantization, written
// after its reference C (dequantize_row_* in ggml-quants.c) so that every value
// comes out with the same float operations, and the reference dot products of
// the contract, as plain loops.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "worker/cpu/kernels.h"
#include "worker/cpu/quant_types.h"

namespace ds4::cpu {

void q3k_scales(const uint8_t packed[12], int8_t out[16]) {
  constexpr uint32_t kmask1 = 0x03030303, kmask2 = 0x0f0f0f0f;
  uint32_t aux[4];
  std::memcpy(aux, packed, 12);
  const uint32_t tmp = aux[2];
  aux[2] = ((aux[0] >> 4) & kmask2) | (((tmp >> 4) & kmask1) << 4);
  aux[3] = ((aux[1] >> 4) & kmask2) | (((tmp >> 6) & kmask1) << 4);
  aux[0] = (aux[0] & kmask2) | (((tmp >> 0) & kmask1) << 4);
  aux[1] = (aux[1] & kmask2) | (((tmp >> 2) & kmask1) << 4);
  std::memcpy(out, aux, 16);
  for (int i = 0; i < 16; ++i) out[i] = int8_t(out[i] - 32);
}

void quantize_q8k_generic(const float* x, int64_t K, BlockQ8K* out) {
  for (int64_t b = 0; b < K / 256; ++b) {
    const float* v = x + b * 256;
    float amax = 0;
    for (int i = 0; i < 256; ++i) amax = std::max(amax, std::fabs(v[i]));
    const bool zero = !(amax >= kQ8ActTiny);
    const float id = zero ? 0.0f : 127.0f / amax;
    out[b].d = zero ? 0.0f : 1.0f / id;  // as ggml: the inverse of the rounding factor
    std::memset(out[b].pad, 0, sizeof out[b].pad);
    for (int i = 0; i < 256; ++i) {
      const float q = std::nearbyint(v[i] * id);
      out[b].qs[i] = int8_t(q >= -127 && q <= 127 ? q : 0);
    }
    for (int j = 0; j < 16; ++j) {
      int s = 0;
      for (int i = 0; i < 16; ++i) s += out[b].qs[16 * j + i];
      out[b].bsums[j] = int16_t(s);
    }
    for (int j = 0; j < 8; ++j) out[b].bsums32[j] = int16_t(out[b].bsums[2 * j] + out[b].bsums[2 * j + 1]);
  }
}

namespace {

// ---- dequantization (ggml's order of operations) ---------------------------

void deq_f32(const void* w, int64_t n, float* y) { std::memcpy(y, w, size_t(n) * 4); }
void deq_f16(const void* w, int64_t n, float* y) {
  const auto* h = static_cast<const uint16_t*>(w);
  for (int64_t i = 0; i < n; ++i) y[i] = fp16_to_fp32(h[i]);
}
void deq_bf16(const void* w, int64_t n, float* y) {
  const auto* h = static_cast<const uint16_t*>(w);
  for (int64_t i = 0; i < n; ++i) y[i] = bf16_to_fp32(h[i]);
}

void deq_q8_0(const void* w, int64_t nb, float* y) {
  const auto* b = static_cast<const BlockQ8_0*>(w);
  for (int64_t i = 0; i < nb; ++i, y += 32) {
    const float d = fp16_to_fp32(b[i].d);
    for (int j = 0; j < 32; ++j) y[j] = float(b[i].qs[j]) * d;
  }
}

void deq_q4_0(const void* w, int64_t nb, float* y) {
  const auto* b = static_cast<const BlockQ4_0*>(w);
  for (int64_t i = 0; i < nb; ++i, y += 32) {
    const float d = fp16_to_fp32(b[i].d);
    for (int j = 0; j < 16; ++j) {
      y[j] = float((b[i].qs[j] & 0x0F) - 8) * d;
      y[j + 16] = float((b[i].qs[j] >> 4) - 8) * d;
    }
  }
}

void deq_q4_1(const void* w, int64_t nb, float* y) {
  const auto* b = static_cast<const BlockQ4_1*>(w);
  for (int64_t i = 0; i < nb; ++i, y += 32) {
    const float d = fp16_to_fp32(b[i].d), m = fp16_to_fp32(b[i].m);
    for (int j = 0; j < 16; ++j) {
      const float a = float(b[i].qs[j] & 0x0F) * d, c = float(b[i].qs[j] >> 4) * d;
      y[j] = a + m;
      y[j + 16] = c + m;
    }
  }
}

void deq_q5_0(const void* w, int64_t nb, float* y) {
  const auto* b = static_cast<const BlockQ5_0*>(w);
  for (int64_t i = 0; i < nb; ++i, y += 32) {
    const float d = fp16_to_fp32(b[i].d);
    uint32_t qh;
    std::memcpy(&qh, b[i].qh, 4);
    for (int j = 0; j < 16; ++j) {
      const uint8_t h0 = uint8_t(((qh >> j) << 4) & 0x10), h1 = uint8_t((qh >> (j + 12)) & 0x10);
      y[j] = float(((b[i].qs[j] & 0x0F) | h0) - 16) * d;
      y[j + 16] = float(((b[i].qs[j] >> 4) | h1) - 16) * d;
    }
  }
}

void deq_q5_1(const void* w, int64_t nb, float* y) {
  const auto* b = static_cast<const BlockQ5_1*>(w);
  for (int64_t i = 0; i < nb; ++i, y += 32) {
    const float d = fp16_to_fp32(b[i].d), m = fp16_to_fp32(b[i].m);
    uint32_t qh;
    std::memcpy(&qh, b[i].qh, 4);
    for (int j = 0; j < 16; ++j) {
      const uint8_t h0 = uint8_t(((qh >> j) << 4) & 0x10), h1 = uint8_t((qh >> (j + 12)) & 0x10);
      const float a = float((b[i].qs[j] & 0x0F) | h0) * d, c = float((b[i].qs[j] >> 4) | h1) * d;
      y[j] = a + m;
      y[j + 16] = c + m;
    }
  }
}

void deq_iq4_nl(const void* w, int64_t nb, float* y) {
  const auto* b = static_cast<const BlockIQ4NL*>(w);
  for (int64_t i = 0; i < nb; ++i, y += 32) {
    const float d = fp16_to_fp32(b[i].d);
    for (int j = 0; j < 16; ++j) {
      y[j] = d * float(kIQ4Values[b[i].qs[j] & 0xF]);
      y[j + 16] = d * float(kIQ4Values[b[i].qs[j] >> 4]);
    }
  }
}

void deq_mxfp4(const void* w, int64_t nb, float* y) {
  const auto* b = static_cast<const BlockMXFP4*>(w);
  for (int64_t i = 0; i < nb; ++i, y += 32) {
    const float d = e8m0_half(b[i].e);
    for (int j = 0; j < 16; ++j) {
      y[j] = float(kMXFP4Values[b[i].qs[j] & 0xF]) * d;
      y[j + 16] = float(kMXFP4Values[b[i].qs[j] >> 4]) * d;
    }
  }
}

// ggml's quantize_row_mxfp4_ref: the exponent puts the largest magnitude at
// 4..8 times the halved scale (the table's top is 12), each value the first
// of the nearest table entries.
void quantize_mxfp4(const float* x, int64_t n, void* blocks) {
  auto* b = static_cast<BlockMXFP4*>(blocks);
  for (int64_t i = 0; i < n / 32; ++i, x += 32) {
    float amax = 0;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[j]));
    const float e = amax > 0 ? std::floor(std::log2(amax)) - 2 + 127 : 0;
    b[i].e = uint8_t(std::clamp(e, 0.0f, 255.0f));
    const float d = e8m0_half(b[i].e);
    const auto nearest = [d](float v) {
      int best = 0;
      float err = std::fabs(float(kMXFP4Values[0]) * d - v);
      for (int k = 1; k < 16; ++k) {
        const float e2 = std::fabs(float(kMXFP4Values[k]) * d - v);
        if (e2 < err) best = k, err = e2;
      }
      return uint8_t(best);
    };
    for (int j = 0; j < 16; ++j) b[i].qs[j] = uint8_t(nearest(x[j]) | nearest(x[j + 16]) << 4);
  }
}

void deq_q2_k(const void* w, int64_t nb, float* y) {
  const auto* b = static_cast<const BlockQ2K*>(w);
  for (int64_t i = 0; i < nb; ++i) {
    const float d = fp16_to_fp32(b[i].d), mn = fp16_to_fp32(b[i].dmin);
    const uint8_t* q = b[i].qs;
    int is = 0;
    for (int n = 0; n < 256; n += 128, q += 32)
      for (int shift = 0; shift < 8; shift += 2)
        for (int half = 0; half < 2; ++half) {
          const uint8_t sc = b[i].scales[is++];
          const float dl = d * float(sc & 0xF), ml = mn * float(sc >> 4);
          for (int l = 0; l < 16; ++l) {
            const float p = dl * float((q[l + 16 * half] >> shift) & 3);
            *y++ = p - ml;
          }
        }
  }
}

void deq_q3_k(const void* w, int64_t nb, float* y) {
  const auto* b = static_cast<const BlockQ3K*>(w);
  for (int64_t i = 0; i < nb; ++i) {
    const float d = fp16_to_fp32(b[i].d);
    int8_t sc[16];
    q3k_scales(b[i].scales, sc);
    const uint8_t* q = b[i].qs;
    uint8_t m = 1;
    int is = 0;
    for (int n = 0; n < 256; n += 128, q += 32)
      for (int shift = 0; shift < 8; shift += 2, m = uint8_t(m << 1))
        for (int half = 0; half < 2; ++half) {
          const float dl = d * float(sc[is++]);
          for (int l = 0; l < 16; ++l) {
            const int k = l + 16 * half;
            *y++ = dl * float(((q[k] >> shift) & 3) - ((b[i].hmask[k] & m) ? 0 : 4));
          }
        }
  }
}

void deq_q4_k(const void* w, int64_t nb, float* y) {
  const auto* b = static_cast<const BlockQ4K*>(w);
  for (int64_t i = 0; i < nb; ++i) {
    const float d = fp16_to_fp32(b[i].d), mn = fp16_to_fp32(b[i].dmin);
    const uint8_t* q = b[i].qs;
    for (int j = 0; j < 8; j += 2, q += 32) {
      uint8_t sc, m;
      scale_min_k4(j, b[i].scales, sc, m);
      const float d1 = d * float(sc), m1 = mn * float(m);
      scale_min_k4(j + 1, b[i].scales, sc, m);
      const float d2 = d * float(sc), m2 = mn * float(m);
      for (int l = 0; l < 32; ++l) { const float p = d1 * float(q[l] & 0xF); *y++ = p - m1; }
      for (int l = 0; l < 32; ++l) { const float p = d2 * float(q[l] >> 4); *y++ = p - m2; }
    }
  }
}

void deq_q5_k(const void* w, int64_t nb, float* y) {
  const auto* b = static_cast<const BlockQ5K*>(w);
  for (int64_t i = 0; i < nb; ++i) {
    const float d = fp16_to_fp32(b[i].d), mn = fp16_to_fp32(b[i].dmin);
    const uint8_t* ql = b[i].qs;
    uint8_t u1 = 1, u2 = 2;
    for (int j = 0; j < 8; j += 2, ql += 32, u1 = uint8_t(u1 << 2), u2 = uint8_t(u2 << 2)) {
      uint8_t sc, m;
      scale_min_k4(j, b[i].scales, sc, m);
      const float d1 = d * float(sc), m1 = mn * float(m);
      scale_min_k4(j + 1, b[i].scales, sc, m);
      const float d2 = d * float(sc), m2 = mn * float(m);
      for (int l = 0; l < 32; ++l) {
        const float p = d1 * float((ql[l] & 0xF) + (b[i].qh[l] & u1 ? 16 : 0));
        *y++ = p - m1;
      }
      for (int l = 0; l < 32; ++l) {
        const float p = d2 * float((ql[l] >> 4) + (b[i].qh[l] & u2 ? 16 : 0));
        *y++ = p - m2;
      }
    }
  }
}

void deq_q6_k(const void* w, int64_t nb, float* y) {
  const auto* b = static_cast<const BlockQ6K*>(w);
  for (int64_t i = 0; i < nb; ++i) {
    const float d = fp16_to_fp32(b[i].d);
    const uint8_t* ql = b[i].ql;
    const uint8_t* qh = b[i].qh;
    const int8_t* sc = b[i].scales;
    for (int n = 0; n < 256; n += 128, y += 128, ql += 64, qh += 32, sc += 8)
      for (int l = 0; l < 32; ++l) {
        const int is = l / 16;
        const int q1 = int8_t((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
        const int q2 = int8_t((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
        const int q3 = int8_t((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        const int q4 = int8_t((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        y[l] = d * float(sc[is]) * float(q1);
        y[l + 32] = d * float(sc[is + 2]) * float(q2);
        y[l + 64] = d * float(sc[is + 4]) * float(q3);
        y[l + 96] = d * float(sc[is + 6]) * float(q4);
      }
  }
}

void deq_iq4_xs(const void* w, int64_t nb, float* y) {
  const auto* b = static_cast<const BlockIQ4XS*>(w);
  for (int64_t i = 0; i < nb; ++i) {
    const float d = fp16_to_fp32(b[i].d);
    const uint8_t* qs = b[i].qs;
    for (int ib = 0; ib < 8; ++ib, qs += 16, y += 32) {
      const int ls = ((b[i].scales_l[ib / 2] >> 4 * (ib % 2)) & 0xf) | (((b[i].scales_h >> 2 * ib) & 3) << 4);
      const float dl = d * float(ls - 32);
      for (int j = 0; j < 16; ++j) {
        y[j] = dl * float(kIQ4Values[qs[j] & 0xf]);
        y[j + 16] = dl * float(kIQ4Values[qs[j] >> 4]);
      }
    }
  }
}

// ---- reference dot products (quant_types.h) ---------------------------------

// Types whose 32-block is d_w * int8: the int8 values of block i.
template <typename Block>
float dot_int8_blocks(const void* w, const void* x, int64_t nb, void (*unpack)(const Block&, int8_t[32])) {
  const auto* b = static_cast<const Block*>(w);
  const auto* a = static_cast<const BlockQ8Act*>(x);
  BlockLanes lanes;
  for (int64_t i = 0; i < nb; ++i) {
    int8_t q[32];
    unpack(b[i], q);
    int32_t s = 0;
    for (int j = 0; j < 32; ++j) s += int32_t(q[j]) * a[i].qs[j];
    lanes.first(i, float(s), fp16_to_fp32(b[i].d) * a[i].d);
  }
  return lanes.total();
}

void unpack_q8_0(const BlockQ8_0& b, int8_t q[32]) { std::memcpy(q, b.qs, 32); }
void unpack_q4_0(const BlockQ4_0& b, int8_t q[32]) {
  for (int j = 0; j < 16; ++j) {
    q[j] = int8_t((b.qs[j] & 0xF) - 8);
    q[j + 16] = int8_t((b.qs[j] >> 4) - 8);
  }
}
void unpack_q5_0(const BlockQ5_0& b, int8_t q[32]) {
  uint32_t qh;
  std::memcpy(&qh, b.qh, 4);
  for (int j = 0; j < 16; ++j) {
    q[j] = int8_t(((b.qs[j] & 0xF) | (((qh >> j) << 4) & 0x10)) - 16);
    q[j + 16] = int8_t(((b.qs[j] >> 4) | ((qh >> (j + 12)) & 0x10)) - 16);
  }
}
void unpack_iq4_nl(const BlockIQ4NL& b, int8_t q[32]) {
  for (int j = 0; j < 16; ++j) {
    q[j] = kIQ4Values[b.qs[j] & 0xF];
    q[j + 16] = kIQ4Values[b.qs[j] >> 4];
  }
}

float dot_q8_0(const void* w, const void* x, int64_t nb) { return dot_int8_blocks<BlockQ8_0>(w, x, nb, unpack_q8_0); }
float dot_q4_0(const void* w, const void* x, int64_t nb) { return dot_int8_blocks<BlockQ4_0>(w, x, nb, unpack_q4_0); }
float dot_q5_0(const void* w, const void* x, int64_t nb) { return dot_int8_blocks<BlockQ5_0>(w, x, nb, unpack_q5_0); }
float dot_iq4_nl(const void* w, const void* x, int64_t nb) {
  return dot_int8_blocks<BlockIQ4NL>(w, x, nb, unpack_iq4_nl);
}

// MXFP4: the table's values, the block's E8M0 scale.
float dot_mxfp4(const void* w, const void* x, int64_t nb) {
  const auto* b = static_cast<const BlockMXFP4*>(w);
  const auto* a = static_cast<const BlockQ8Act*>(x);
  BlockLanes lanes;
  for (int64_t i = 0; i < nb; ++i) {
    int32_t s = 0;
    for (int j = 0; j < 16; ++j)
      s += kMXFP4Values[b[i].qs[j] & 0xF] * a[i].qs[j] + kMXFP4Values[b[i].qs[j] >> 4] * a[i].qs[j + 16];
    lanes.first(i, float(s), e8m0_half(b[i].e) * a[i].d);
  }
  return lanes.total();
}

// Q4_1 and Q5_1: unsigned q plus a per-block offset m.
template <typename Block>
float dot_offset_blocks(const void* w, const void* x, int64_t nb) {
  const auto* b = static_cast<const Block*>(w);
  const auto* a = static_cast<const BlockQ8Act*>(x);
  BlockLanes lanes;
  for (int64_t i = 0; i < nb; ++i) {
    uint32_t qh = 0;
    if constexpr (sizeof(Block) == sizeof(BlockQ5_1)) std::memcpy(&qh, b[i].qh, 4);
    int32_t s = 0, u = 0;
    for (int j = 0; j < 16; ++j) {
      int q0 = b[i].qs[j] & 0xF, q1 = b[i].qs[j] >> 4;
      if constexpr (sizeof(Block) == sizeof(BlockQ5_1)) {
        q0 |= ((qh >> j) << 4) & 0x10;
        q1 |= (qh >> (j + 12)) & 0x10;
      }
      s += q0 * a[i].qs[j] + q1 * a[i].qs[j + 16];
      u += a[i].qs[j] + a[i].qs[j + 16];
    }
    lanes.first(i, float(s), fp16_to_fp32(b[i].d) * a[i].d);
    lanes.second(i, float(u), fp16_to_fp32(b[i].m) * a[i].d);
  }
  return lanes.total();
}
float dot_q4_1(const void* w, const void* x, int64_t nb) { return dot_offset_blocks<BlockQ4_1>(w, x, nb); }
float dot_q5_1(const void* w, const void* x, int64_t nb) { return dot_offset_blocks<BlockQ5_1>(w, x, nb); }

// The K-quants: each 256-block as integer values q[256] and scales per
// sub-block, then S (and M) of the contract.
int32_t sub_dot(const int8_t* q, const int8_t* x, int n) {
  int32_t s = 0;
  for (int i = 0; i < n; ++i) s += int32_t(q[i]) * x[i];
  return s;
}

float dot_q2_k(const void* w, const void* x, int64_t nb) {
  const auto* b = static_cast<const BlockQ2K*>(w);
  const auto* a = static_cast<const BlockQ8K*>(x);
  BlockLanes lanes;
  for (int64_t i = 0; i < nb; ++i) {
    int8_t q[256];
    for (int n = 0; n < 2; ++n)
      for (int s = 0; s < 4; ++s)
        for (int l = 0; l < 32; ++l) q[128 * n + 32 * s + l] = int8_t((b[i].qs[32 * n + l] >> (2 * s)) & 3);
    int32_t S = 0, M = 0;
    for (int j = 0; j < 16; ++j) {
      S += (b[i].scales[j] & 0xF) * sub_dot(q + 16 * j, a[i].qs + 16 * j, 16);
      M += (b[i].scales[j] >> 4) * a[i].bsums[j];
    }
    lanes.first(i, float(S), fp16_to_fp32(b[i].d) * a[i].d);
    lanes.second(i, -float(M), fp16_to_fp32(b[i].dmin) * a[i].d);
  }
  return lanes.total();
}

float dot_q3_k(const void* w, const void* x, int64_t nb) {
  const auto* b = static_cast<const BlockQ3K*>(w);
  const auto* a = static_cast<const BlockQ8K*>(x);
  BlockLanes lanes;
  for (int64_t i = 0; i < nb; ++i) {
    int8_t q[256], sc[16];
    q3k_scales(b[i].scales, sc);
    for (int n = 0; n < 2; ++n)
      for (int s = 0; s < 4; ++s)
        for (int l = 0; l < 32; ++l) {
          const int hbit = (b[i].hmask[l] >> (4 * n + s)) & 1;
          q[128 * n + 32 * s + l] = int8_t(((b[i].qs[32 * n + l] >> (2 * s)) & 3) - (hbit ? 0 : 4));
        }
    int32_t S = 0;
    for (int j = 0; j < 16; ++j) S += sc[j] * sub_dot(q + 16 * j, a[i].qs + 16 * j, 16);
    lanes.first(i, float(S), fp16_to_fp32(b[i].d) * a[i].d);
  }
  return lanes.total();
}

template <bool Q5>
float dot_q45_k(const void* w, const void* x, int64_t nb) {
  using Block = std::conditional_t<Q5, BlockQ5K, BlockQ4K>;
  const auto* b = static_cast<const Block*>(w);
  const auto* a = static_cast<const BlockQ8K*>(x);
  BlockLanes lanes;
  for (int64_t i = 0; i < nb; ++i) {
    int8_t q[256];
    for (int j = 0; j < 4; ++j)
      for (int l = 0; l < 32; ++l) {
        int lo = b[i].qs[32 * j + l] & 0xF, hi = b[i].qs[32 * j + l] >> 4;
        if constexpr (Q5) {
          lo += ((b[i].qh[l] >> (2 * j)) & 1) << 4;
          hi += ((b[i].qh[l] >> (2 * j + 1)) & 1) << 4;
        }
        q[64 * j + l] = int8_t(lo);
        q[64 * j + 32 + l] = int8_t(hi);
      }
    int32_t S = 0, M = 0;
    for (int j = 0; j < 8; ++j) {
      uint8_t sc, m;
      scale_min_k4(j, b[i].scales, sc, m);
      S += sc * sub_dot(q + 32 * j, a[i].qs + 32 * j, 32);
      M += m * (a[i].bsums[2 * j] + a[i].bsums[2 * j + 1]);
    }
    lanes.first(i, float(S), fp16_to_fp32(b[i].d) * a[i].d);
    lanes.second(i, -float(M), fp16_to_fp32(b[i].dmin) * a[i].d);
  }
  return lanes.total();
}

float dot_q6_k(const void* w, const void* x, int64_t nb) {
  const auto* b = static_cast<const BlockQ6K*>(w);
  const auto* a = static_cast<const BlockQ8K*>(x);
  BlockLanes lanes;
  for (int64_t i = 0; i < nb; ++i) {
    int8_t q[256];
    for (int n = 0; n < 2; ++n)
      for (int l = 0; l < 32; ++l) {
        const uint8_t* ql = b[i].ql + 64 * n;
        const uint8_t h = b[i].qh[32 * n + l];
        q[128 * n + l] = int8_t(((ql[l] & 0xF) | ((h & 3) << 4)) - 32);
        q[128 * n + 32 + l] = int8_t(((ql[l + 32] & 0xF) | (((h >> 2) & 3) << 4)) - 32);
        q[128 * n + 64 + l] = int8_t(((ql[l] >> 4) | (((h >> 4) & 3) << 4)) - 32);
        q[128 * n + 96 + l] = int8_t(((ql[l + 32] >> 4) | (((h >> 6) & 3) << 4)) - 32);
      }
    int32_t S = 0;
    for (int j = 0; j < 16; ++j) S += b[i].scales[j] * sub_dot(q + 16 * j, a[i].qs + 16 * j, 16);
    lanes.first(i, float(S), fp16_to_fp32(b[i].d) * a[i].d);
  }
  return lanes.total();
}

float dot_iq4_xs(const void* w, const void* x, int64_t nb) {
  const auto* b = static_cast<const BlockIQ4XS*>(w);
  const auto* a = static_cast<const BlockQ8K*>(x);
  BlockLanes lanes;
  for (int64_t i = 0; i < nb; ++i) {
    int32_t S = 0;
    for (int ib = 0; ib < 8; ++ib) {
      const int ls = ((b[i].scales_l[ib / 2] >> 4 * (ib % 2)) & 0xf) | (((b[i].scales_h >> 2 * ib) & 3) << 4);
      int8_t q[32];
      for (int j = 0; j < 16; ++j) {
        q[j] = kIQ4Values[b[i].qs[16 * ib + j] & 0xF];
        q[j + 16] = kIQ4Values[b[i].qs[16 * ib + j] >> 4];
      }
      S += (ls - 32) * sub_dot(q, a[i].qs + 32 * ib, 32);
    }
    lanes.first(i, float(S), fp16_to_fp32(b[i].d) * a[i].d);
  }
  return lanes.total();
}

// The generic kernels of each type the CPU backend runs (geometry and
// activation format come from the shared row): dequantize, dot, from_float,
// and the fp16 scale fields of a block.
struct CpuKernels {
  GgmlType type;
  void (*dequantize)(const void*, int64_t, float*);
  float (*dot)(const void*, const void*, int64_t);
  void (*from_float)(const float*, int64_t, void*);
  int16_t fp16_scales[2];
};

constexpr CpuKernels kKernels[] = {
    {GgmlType::F32, deq_f32, nullptr, nullptr, {-1, -1}},
    {GgmlType::F16, deq_f16, nullptr, nullptr, {-1, -1}},
    {GgmlType::BF16, deq_bf16, nullptr, nullptr, {-1, -1}},
    {GgmlType::Q8_0, deq_q8_0, dot_q8_0, nullptr, {0, -1}},
    {GgmlType::Q4_0, deq_q4_0, dot_q4_0, nullptr, {0, -1}},
    {GgmlType::Q4_1, deq_q4_1, dot_q4_1, nullptr, {0, 2}},
    {GgmlType::Q5_0, deq_q5_0, dot_q5_0, nullptr, {0, -1}},
    {GgmlType::Q5_1, deq_q5_1, dot_q5_1, nullptr, {0, 2}},
    {GgmlType::IQ4_NL, deq_iq4_nl, dot_iq4_nl, nullptr, {0, -1}},
    {GgmlType::Q2_K, deq_q2_k, dot_q2_k, nullptr, {80, 82}},
    {GgmlType::Q3_K, deq_q3_k, dot_q3_k, nullptr, {108, -1}},
    {GgmlType::Q4_K, deq_q4_k, dot_q45_k<false>, nullptr, {0, 2}},
    {GgmlType::Q5_K, deq_q5_k, dot_q45_k<true>, nullptr, {0, 2}},
    {GgmlType::Q6_K, deq_q6_k, dot_q6_k, nullptr, {208, -1}},
    {GgmlType::IQ4_XS, deq_iq4_xs, dot_iq4_xs, nullptr, {0, -1}},
    {GgmlType::MXFP4, deq_mxfp4, dot_mxfp4, quantize_mxfp4, {-1, -1}},
};

constexpr size_t kNumTypes = sizeof kKernels / sizeof kKernels[0];

// The rows, each the shared row's geometry with the kernels above.
struct Rows {
  QuantType at[kNumTypes];
};
const Rows& rows() {
  static const Rows r = [] {
    Rows out{};
    for (size_t i = 0; i < kNumTypes; ++i) {
      const CpuKernels& k = kKernels[i];
      const TypeTraits& t = *type_row(k.type);
      out.at[i] = QuantType{k.type, t.act, t.block_elems, t.block_bytes, k.dequantize, k.dot, k.from_float,
                            {k.fp16_scales[0], k.fp16_scales[1]}};
    }
    return out;
  }();
  return r;
}

}  // namespace

const QuantType* quant_type(GgmlType t) {
  for (const QuantType& q : rows().at)
    if (q.type == t) return &q;
  return nullptr;
}

}  // namespace ds4::cpu
