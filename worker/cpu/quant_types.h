#pragma once
/// The weight types of the CPU backend, one row each (quant_type()), as
/// ggml's type_traits_cpu: the type's geometry and activation blocks (its
/// vec_dot_type) from the shared row (shared/ggml_types.h), and the kernels
/// registered against it here: how a row dequantizes (bit for bit as ggml's
/// dequantize_row_*), the reference dot product against those activation
/// blocks, and where there is one, the quantization of floats into the type. Each kernel table (generic,
/// AVX2, AVX-512) computes products of the same value; kernels.h has the
/// numerical contract, and the per-type integer sums are spelled out here.
///
/// Block layouts are ggml's (ggml-common.h), read byte for byte from GGUF.
///
/// Dot products with quantized activations. The activation row is rounded
/// once per product input (quantize_q8 / quantize_q8k of the kernel table).
/// Per weight block each output takes exact integer sums and then the same
/// float operations in every table. Every type steps into lanes (BlockLanes below): block i's first step into
/// lane 2 (i % 8), its second (where it has one) into lane 2 (i % 8) + 1, and
/// the output is reduce16 of the sixteen lanes. One chain of dependent steps,
/// block by block, bounded a decoded row (on Zen 4 ~8 of a Q4_K block's ~31
/// cycles; a Q4_0 row ~16 GB/s a core); in lanes, eight blocks take one
/// vector step each.
///   Q8_0, Q4_0, Q5_0, IQ4_NL (act Q8_0, 32 values): the weights are d_w * q
///     with q an int8 (q - 8, q - 16, the IQ4_NL table); s = sum q * q_x;
///     first fma(float(s), d_w * d_x, .).
///   Q4_1, Q5_1 (act Q8_0): weights d_w * q + m_w, q unsigned; s = sum q * q_x,
///     u = sum q_x; first fma(float(s), d_w * d_x, .), second
///     fma(float(u), m_w * d_x, .).
///   Q2_K, Q4_K, Q5_K (act Q8_K, 256 values): weights d * sc_j * q - dmin * m_j in sub-blocks j;
///     S = sum_j sc_j * (sum q * q_x over j), M = sum_j m_j * (sum q_x over j);
///     first fma(float(S), d * d_x, .), second fma(-float(M), dmin * d_x, .).
///   MXFP4 (act Q8_0, 32 values): weights d_w * q with d_w = 2^(e - 128) (the
///     E8M0 byte, halved as ggml does) and q from kMXFP4Values (twice the
///     E2M1 values); s = sum q * q_x; first fma(float(s), d_w * d_x, .).
///   Q3_K, Q6_K, IQ4_XS (act Q8_K): weights d * sc_j * q with signed sc_j and q;
///     S as above; first fma(float(S), d * d_x, .), no second step.
/// Every |S| < 2^31. Integer sums are exact in any grouping, so a table may
/// vectorise them as it likes; the float steps are the same everywhere (a lane
/// of a vector doing one output's steps is fine).

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "shared/ggml_types.h"

namespace ds4::cpu {

/// The reduction order of the contract (kernels.h), for scalar code.
inline float reduce16(const float l[16]) {
  float m[8];
  for (int i = 0; i < 8; ++i) m[i] = l[i] + l[i + 8];
  return ((m[0] + m[4]) + (m[2] + m[6])) + ((m[1] + m[5]) + (m[3] + m[7]));
}

/// One output's float steps in lanes, for the types whose contract says so
/// (above): block i's first step into lane 2 (i % 8), its second into
/// 2 (i % 8) + 1; total() is reduce16 of the lanes. Lanes start at +0.
struct BlockLanes {
  float l[16] = {};
  void first(int64_t i, float s, float w) { l[2 * (i & 7)] = std::fma(s, w, l[2 * (i & 7)]); }
  void second(int64_t i, float s, float w) { l[2 * (i & 7) + 1] = std::fma(s, w, l[2 * (i & 7) + 1]); }
  float total() const { return reduce16(l); }
};

/// Which activation blocks a weight type's products take (the shared row's).
using ActType = ActFormat;

/// 256 activations rounded as one block: x[i] ~ d * qs[i], d = 1 / (127 / max|x|),
/// qs = round-to-nearest-even(x * 127 / max|x|) (ggml's values, up to the sign
/// it gives d and qs); bsums[j] = the sum of qs over
/// positions 16j..16j+15, bsums32[j] = bsums[2j] + bsums[2j + 1] (the sums of
/// 32 that Q4_K's and Q5_K's mins meet). Zero when max|x| < kQ8ActTiny (kernels.h).
/// The fields are ggml's block_q8_K's, not its layout: qs starts a 64-byte
/// line and a block is five lines, so that each of a block's four 64-byte
/// loads of qs reads one line (with ggml's 292-byte blocks almost every one
/// crossed two: a 2 x 4 prefill tile's loop alone took 117 cycles a block
/// against 92, Zen 4, in L1). Blocks are 64-byte aligned (the memory plan's
/// region for them is).
struct alignas(64) BlockQ8K {
  float d;
  int16_t bsums[16];
  int16_t bsums32[8];
  uint8_t pad[12];  // zero
  int8_t qs[256];
};
static_assert(sizeof(BlockQ8K) == 320 && offsetof(BlockQ8K, qs) == 64);

// ggml's blocks (ggml-common.h), fp16 fields as raw bits.
struct BlockQ4_0 { uint16_t d; uint8_t qs[16]; };
struct BlockQ4_1 { uint16_t d, m; uint8_t qs[16]; };
struct BlockQ5_0 { uint16_t d; uint8_t qh[4]; uint8_t qs[16]; };
struct BlockQ5_1 { uint16_t d, m; uint8_t qh[4]; uint8_t qs[16]; };
struct BlockIQ4NL { uint16_t d; uint8_t qs[16]; };
struct BlockQ2K { uint8_t scales[16]; uint8_t qs[64]; uint16_t d, dmin; };
struct BlockQ3K { uint8_t hmask[32]; uint8_t qs[64]; uint8_t scales[12]; uint16_t d; };
struct BlockQ4K { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; };
struct BlockQ5K { uint16_t d, dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; };
struct BlockQ6K { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; uint16_t d; };
struct BlockIQ4XS { uint16_t d; uint16_t scales_h; uint8_t scales_l[4]; uint8_t qs[128]; };
/// MXFP4: an E8M0 exponent, then 32 E2M1 values as nibbles (j low, j + 16 high).
struct BlockMXFP4 { uint8_t e; uint8_t qs[16]; };
static_assert(sizeof(BlockMXFP4) == 17);
static_assert(sizeof(BlockQ4_0) == 18 && sizeof(BlockQ4_1) == 20 && sizeof(BlockQ5_0) == 22 &&
              sizeof(BlockQ5_1) == 24 && sizeof(BlockIQ4NL) == 18);
static_assert(sizeof(BlockQ2K) == 84 && sizeof(BlockQ3K) == 110 && sizeof(BlockQ4K) == 144 &&
              sizeof(BlockQ5K) == 176 && sizeof(BlockQ6K) == 210 && sizeof(BlockIQ4XS) == 136);

/// IQ4_NL's and IQ4_XS's 16 values (ggml's kvalues_iq4nl).
inline constexpr int8_t kIQ4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                          1,    13,   25,  38,  53,  69,  89,  113};

/// MXFP4's 16 values: twice the E2M1 floats (ggml's kvalues_mxfp4), so
/// that they are integers; the block's scale is halved to match.
inline constexpr int8_t kMXFP4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/// An E8M0 byte as ggml's halved scale, 2^(e - 128), exactly (e < 2: subnormal).
inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : uint32_t(e - 1) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

/// Q4_K's and Q5_K's 6-bit scale and min of sub-block j (ggml's get_scale_min_k4).
inline void scale_min_k4(int j, const uint8_t* q, uint8_t& sc, uint8_t& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = uint8_t((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
    m = uint8_t((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

/// Q3_K's sixteen 6-bit scales, minus 32.
void q3k_scales(const uint8_t packed[12], int8_t out[16]);

/// One weight type's row of the CPU backend: the shared row's geometry and
/// activation format, and the generic kernels (quants_generic.cpp). The
/// kernel tables (kernels.h) register their own products per type.
struct QuantType {
  GgmlType type;
  ActType act;
  int64_t block_elems;  // elements per block (1 for F32/F16/BF16)
  int64_t block_bytes;
  /// `nb` blocks of this type to nb * block_elems floats, as ggml's dequantize_row.
  void (*dequantize)(const void* blocks, int64_t nb, float* out);
  /// The reference dot product of nb weight blocks with nb activation blocks
  /// (BlockQ8Act for act Q8_0, BlockQ8K for Q8_K), per the contract above.
  /// Null for the float types.
  float (*dot)(const void* w, const void* x, int64_t nb);
  /// n floats (a multiple of block_elems) as n / block_elems blocks, as
  /// ggml's quantize_row_*_ref; null where ds4 has none (tools and tests
  /// make such weights from random bytes and fp16_scales instead).
  void (*from_float)(const float* x, int64_t n, void* blocks);
  /// Byte offsets in a block of its fp16 scale fields (-1: none), which
  /// random blocks need set to sane values (random bytes elsewhere).
  int16_t fp16_scales[2];
};

/// The row of a type the CPU backend computes with, or nullptr.
const QuantType* quant_type(GgmlType t);

/// The generic quantization of activations for K-quant products (K a multiple of 256).
void quantize_q8k_generic(const float* x, int64_t K, BlockQ8K* out);

}  // namespace ds4::cpu
