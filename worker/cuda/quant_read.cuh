#pragma once
/// Reading block-quantised weights in their device planes (quant.cuh says the
/// layout): each type's constants, the dispatch from a runtime type, and a
/// group's quants and scales as registers. Device code shared by the GEMVs
/// (quant.cu) and the tiled GEMM (qgemm.cu). Included only by worker/cuda/*.cu.

#include <type_traits>

#include "worker/cuda/quant.cuh"

namespace ds4::cuda::qread {

// --- per-type constants ------------------------------------------------------

/// L, H: low and high bits of a quant; SUB, SUP: bytes of the sub and sup
/// records; BE, BB: GGUF block elements and bytes; OFF: w = a * (q - OFF) + b;
/// MIN: b != 0 (+1: b is the block's m, -1: b is -(dmin * m)); TABLE: the
/// values of a table type (1: IQ4's non-linear ones, 2: MXFP4's E2M1 ones),
/// 0 for none. Two 16-weight sub-blocks a group or one of 32 is
/// group_scales' business (a[0], a[1]).
template <GgmlType TY>
struct QT;
#define DS4_QT(TY, L_, H_, SUB_, SUP_, BE_, BB_, OFF_, MIN_, TABLE_)                              \
  template <>                                                                                        \
  struct QT<GgmlType::TY> {                                                                          \
    static constexpr int L = L_, H = H_, SUB = SUB_, SUP = SUP_, BE = BE_, BB = BB_, OFF = OFF_;     \
    static constexpr int MIN = MIN_;                                                                 \
    static constexpr int TABLE = TABLE_;                                                            \
  };
DS4_QT(Q4_0, 4, 0, 0, 2, 32, 18, 8, 0, 0)
DS4_QT(Q4_1, 4, 0, 0, 4, 32, 20, 0, 1, 0)
DS4_QT(Q5_0, 4, 1, 0, 2, 32, 22, 16, 0, 0)
DS4_QT(Q5_1, 4, 1, 0, 4, 32, 24, 0, 1, 0)
DS4_QT(Q2_K, 2, 0, 2, 4, 256, 84, 0, -1, 0)
DS4_QT(Q3_K, 2, 1, 2, 2, 256, 110, 4, 0, 0)
DS4_QT(Q4_K, 4, 0, 2, 4, 256, 144, 0, -1, 0)
DS4_QT(Q5_K, 4, 1, 2, 4, 256, 176, 0, -1, 0)
DS4_QT(Q6_K, 4, 2, 2, 2, 256, 210, 32, 0, 0)
DS4_QT(IQ4_NL, 4, 0, 0, 2, 32, 18, 128, 0, 1)
DS4_QT(IQ4_XS, 4, 0, 1, 2, 256, 136, 128, 0, 1)
DS4_QT(MXFP4, 4, 0, 0, 1, 32, 17, 128, 0, 2)  // sup: the E8M0 byte
#undef DS4_QT

/// Calls f(QT<TY>-tagged integral constant) for the runtime type (one of
/// DS4_PLANE_TYPES, quant.cuh).
template <typename F>
auto dispatch(GgmlType t, F&& f) {
  switch (t) {
#define DS4_CASE(TY) \
  case GgmlType::TY: return f(std::integral_constant<GgmlType, GgmlType::TY>{});
    DS4_PLANE_TYPES(DS4_CASE)
#undef DS4_CASE
    default: throw Error("CUDA backend: weight type " + std::to_string(int(t)) + " is not block-quantised");
  }
}

/// A table type's values + 128, four to a word (bytes, little-endian):
/// IQ4's (TABLE 1), MXFP4's (TABLE 2).
template <int TABLE>
__device__ __forceinline__ uint32_t table_word(int i) {
  constexpr uint32_t iq4[4] = {0x3f2d1801u, 0x766a5d4fu, 0xa6998d81u, 0xf1d9c5b5u};
  constexpr uint32_t mxfp4[4] = {0x83828180u, 0x8c888684u, 0x7d7e7f80u, 0x74787a7cu};
  return TABLE == 1 ? iq4[i] : mxfp4[i];
}


// --- reading the planes ---------------------------------------------------------

/// One group's quants as the planes hold them.
struct Raw {
  uint32_t lo[4];
  uint32_t hi[2];
};

/// A streaming load (read once per step, kept out of L1).
__device__ __forceinline__ uint4 ld_stream4(const void* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}
__device__ __forceinline__ uint2 ld_stream2(const void* p) {
  uint2 v;
  asm("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}
__device__ __forceinline__ uint32_t ld_stream1(const void* p) {
  uint32_t v;
  asm("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

template <GgmlType TY>
__device__ __forceinline__ void load_raw(const DeviceWeight& w, int64_t g, Raw& r) {
  using Q = QT<TY>;
  if constexpr (Q::L == 4) {
    const uint4 v = ld_stream4(static_cast<const uint8_t*>(w.data) + 16 * g);
    r.lo[0] = v.x; r.lo[1] = v.y; r.lo[2] = v.z; r.lo[3] = v.w;
  } else {
    const uint2 v = ld_stream2(static_cast<const uint8_t*>(w.data) + 8 * g);
    r.lo[0] = v.x; r.lo[1] = v.y; r.lo[2] = 0; r.lo[3] = 0;
  }
  if constexpr (Q::H == 1) {
    r.hi[0] = ld_stream1(w.hi + 4 * g);
    r.hi[1] = 0;
  } else if constexpr (Q::H == 2) {
    const uint2 v = ld_stream2(w.hi + 8 * g);
    r.hi[0] = v.x; r.hi[1] = v.y;
  } else {
    r.hi[0] = r.hi[1] = 0;
  }
}

/// The quants of quad kk (weights 4kk..4kk+3) of a group, one a byte.
template <GgmlType TY>
__device__ __forceinline__ uint32_t quad(const Raw& r, int kk) {
  using Q = QT<TY>;
  const int h = kk / 4, k = kk % 4;
  uint32_t q;
  if constexpr (Q::L == 4) q = (r.lo[k] >> (4 * h)) & 0x0f0f0f0fu;
  else q = (r.lo[h] >> (2 * k)) & 0x03030303u;
  if constexpr (Q::H == 1) q |= ((r.hi[0] >> (4 * h + k)) & 0x01010101u) << Q::L;
  if constexpr (Q::H == 2) q |= ((r.hi[h] >> (2 * k)) & 0x03030303u) << 4;
  if constexpr (Q::TABLE != 0) {  // nibble -> table value + 128, by byte permutes
    const uint32_t s = q & 0x07070707u;
    const uint32_t s2 = s | (s >> 4);
    const uint32_t sel = (s2 & 0xffu) | ((s2 >> 8) & 0xff00u);
    const uint32_t a = __byte_perm(table_word<Q::TABLE>(0), table_word<Q::TABLE>(1), sel),
                   b = __byte_perm(table_word<Q::TABLE>(2), table_word<Q::TABLE>(3), sel);
    const uint32_t m = ((q >> 3) & 0x01010101u) * 0xffu;
    q = (a & ~m) | (b & m);
  }
  return q;
}

/// Byte b of q minus OFF as a float, exactly: the byte under 2^23's exponent
/// (one PRMT) and 2^23 + OFF off again (one FADD).
template <int OFF>
__device__ __forceinline__ float qf(uint32_t q, int b) {
  return __uint_as_float(__byte_perm(q, 0x4b000000u, 0x7440u + unsigned(b))) - (8388608.0f + float(OFF));
}

/// A group's scale records as loaded: its sub bytes (the low 16 bits) and
/// its GGUF block's halves (d in the low 16 bits, dmin or m in the high 16).
struct GroupScaleBits {
  uint32_t sub = 0, sup = 0;
};

template <GgmlType TY>
__device__ __forceinline__ GroupScaleBits load_scale_bits(const DeviceWeight& w, int64_t g) {
  using Q = QT<TY>;
  constexpr int GPB = Q::BE / 32;
  GroupScaleBits s;
  const unsigned short* sp = reinterpret_cast<const unsigned short*>(w.sup + (g / GPB) * Q::SUP);
  if constexpr (Q::SUP == 4) s.sup = __ldg(reinterpret_cast<const uint32_t*>(sp));
  else if constexpr (Q::SUP == 1) s.sup = __ldg(w.sup + g / GPB);
  else s.sup = __ldg(sp);
  if constexpr (Q::SUB == 2) s.sub = __ldg(reinterpret_cast<const unsigned short*>(w.sub) + g);
  else if constexpr (Q::SUB == 1) s.sub = __ldg(w.sub + g);
  return s;
}

/// a and b of the group's two halves (the same for a 32-weight sub-block),
/// from its scale records.
template <GgmlType TY>
__device__ __forceinline__ void scales_of(GroupScaleBits bits, float (&a)[2], float (&b)[2]) {
  using Q = QT<TY>;
  const float d = __half2float(__ushort_as_half(static_cast<unsigned short>(bits.sup & 0xffffu)));
  const float d2 = Q::SUP == 4 ? __half2float(__ushort_as_half(static_cast<unsigned short>(bits.sup >> 16))) : 0.0f;
  const uint32_t s0 = bits.sub & 0xff, s1 = (bits.sub >> 8) & 0xff;
  b[0] = b[1] = 0.0f;
  if constexpr (TY == GgmlType::Q2_K) {
    a[0] = __fmul_rn(d, float(s0 & 15));
    a[1] = __fmul_rn(d, float(s1 & 15));
    b[0] = -__fmul_rn(d2, float(s0 >> 4));
    b[1] = -__fmul_rn(d2, float(s1 >> 4));
  } else if constexpr (TY == GgmlType::Q3_K) {
    a[0] = __fmul_rn(d, float(int(s0) - 32));
    a[1] = __fmul_rn(d, float(int(s1) - 32));
  } else if constexpr (TY == GgmlType::Q4_K || TY == GgmlType::Q5_K) {
    a[0] = a[1] = __fmul_rn(d, float(s0));
    b[0] = b[1] = -__fmul_rn(d2, float(s1));
  } else if constexpr (TY == GgmlType::Q6_K) {
    a[0] = __fmul_rn(d, float(int8_t(s0)));
    a[1] = __fmul_rn(d, float(int8_t(s1)));
  } else if constexpr (TY == GgmlType::IQ4_XS) {
    a[0] = a[1] = __fmul_rn(d, float(int(s0) - 32));
  } else if constexpr (TY == GgmlType::MXFP4) {  // 2^(e - 128), ggml's halved E8M0 scale
    const uint32_t e = bits.sup & 0xff;
    a[0] = a[1] = __uint_as_float(e < 2 ? 0x00200000u << e : (e - 1) << 23);
  } else {  // 32-blocks: d, and m
    a[0] = a[1] = d;
    if (Q::MIN) b[0] = b[1] = d2;
  }
}

template <GgmlType TY>
__device__ __forceinline__ void group_scales(const DeviceWeight& w, int64_t g, float (&a)[2], float (&b)[2]) {
  scales_of<TY>(load_scale_bits<TY>(w, g), a, b);
}

/// The 32 weights of group g, exact.
template <GgmlType TY>
__device__ __forceinline__ void decode_group(const DeviceWeight& w, int64_t g, float (&out)[32]) {
  using Q = QT<TY>;
  Raw r;
  load_raw<TY>(w, g, r);
  float a[2], b[2];
  group_scales<TY>(w, g, a, b);
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) {
    const uint32_t q = quad<TY>(r, kk);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float p = __fmul_rn(a[kk / 4], qf<Q::OFF>(q, e));
      out[4 * kk + e] = Q::MIN ? __fadd_rn(p, b[kk / 4]) : p;
    }
  }
}


}  // namespace ds4::cuda::qread
