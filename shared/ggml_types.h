#pragma once
/// Tensor element types as GGUF numbers them (ggml's `enum ggml_type`), their
/// block geometry, and exact scalar conversions for the types ds4 runs.

#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>

namespace ds4 {

enum class GgmlType : uint32_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q8_1 = 9,
  Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, Q8_K = 15,
  IQ2_XXS = 16, IQ2_XS = 17, IQ3_XXS = 18, IQ1_S = 19, IQ4_NL = 20, IQ3_S = 21,
  IQ2_S = 22, IQ4_XS = 23, I8 = 24, I16 = 25, I32 = 26, I64 = 27, F64 = 28,
  IQ1_M = 29, BF16 = 30, TQ1_0 = 34, TQ2_0 = 35, MXFP4 = 39,
};

/// Which activation blocks a weight type's products take (ggml's
/// vec_dot_type): the activations are rounded to these once per product input.
enum class ActFormat : uint8_t {
  F32,   // the activations as they are (float weights: F32, F16, BF16)
  Q8_0,  // blocks of 32 int8 with one scale
  Q8_K,  // blocks of 256 int8 with one scale and the sums of each 16
  none,  // ds4 does not compute with the type (last: the others index arrays)
};

/// How a GPU backend keeps a weight type in device memory.
enum class DeviceLayout : uint8_t {
  none,      // not taken by a GPU backend
  as_is,     // the file's bytes, copied (F32, F16, BF16)
  q8_split,  // Q8_0: all the int8 quants, then all the f16 scales
  planes,    // repacked into bit planes and scale records (worker/cuda/quant.cuh)
};

/// One weight type's row: its geometry, the activations its products take,
/// and its device layout. Every backend reads these; each registers its own
/// kernels against the type (worker/cpu/quant_types.h, worker/cuda/quant.cuh).
struct TypeTraits {
  std::string_view name;
  uint32_t block_elems = 0;  // elements per block (1 for the scalar types)
  uint32_t block_bytes = 0;  // bytes per block
  ActFormat act = ActFormat::none;
  DeviceLayout device = DeviceLayout::none;
};

/// The row of a type ggml defines, or nullptr.
const TypeTraits* type_row(GgmlType t);
/// Traits of a type number found in a file, or nullopt when ggml has no such type.
std::optional<TypeTraits> type_traits(uint32_t type);
/// Bytes of `n` elements of a type (n a multiple of its block); 0 for a type ggml has not.
uint64_t type_bytes(GgmlType t, uint64_t n);

/// True for the types ds4 computes with (a row with an activation format):
/// the CPU backend takes every one. Another backend may take fewer: it says
/// so when it binds the weights.
bool type_supported(GgmlType t);
/// The names of those types, for messages: "F32, F16, ...".
std::string_view supported_types();

/// Q8_0: 32 int8 weights sharing one fp16 scale (weight = d * q, exact in f32).
struct BlockQ8_0 {
  uint16_t d;
  int8_t qs[32];
};
static_assert(sizeof(BlockQ8_0) == 34);

inline float fp16_to_fp32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: renormalise
      exp = 127 - 15 + 1;
      while ((mant & 0x400) == 0) { mant <<= 1; --exp; }
      mant &= 0x3ff;
      bits = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

/// Round to nearest even, as F16C's vcvtps2ph with rounding mode 0.
inline uint16_t fp32_to_fp16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000;
  const uint32_t absx = x & 0x7fffffff;
  if (absx >= 0x7f800000) {  // inf or nan
    return uint16_t(sign | 0x7c00 | (absx > 0x7f800000 ? 0x200 : 0));
  }
  if (absx >= 0x477ff000) return uint16_t(sign | 0x7c00);  // overflow to inf
  if (absx < 0x38800000) {  // subnormal or zero in half
    const int shift = 126 - int(absx >> 23);  // value = mant * 2^(e-150), half ulp = 2^-24
    if (shift > 24) return uint16_t(sign);
    const uint32_t mant = (absx & 0x7fffff) | 0x800000;
    const uint32_t half_ulp = 1u << (shift - 1);
    uint32_t r = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1);
    if (rem > half_ulp || (rem == half_ulp && (r & 1))) ++r;
    return uint16_t(sign | r);
  }
  uint32_t r = absx - (112u << 23);  // rebias exponent
  const uint32_t rem = r & 0x1fff;
  r >>= 13;
  if (rem > 0x1000 || (rem == 0x1000 && (r & 1))) ++r;
  return uint16_t(sign | r);
}

inline float bf16_to_fp32(uint16_t h) {
  const uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t fp32_to_bf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffff) > 0x7f800000) return uint16_t((x >> 16) | 0x40);  // quiet nan
  return uint16_t((x + 0x7fff + ((x >> 16) & 1)) >> 16);
}

}  // namespace ds4
