// Portable kernels: the reference for the numerical contract in kernels.h,
// written as plain loops over 8 emulated lanes.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>

#include "worker/cpu/kernels.h"

namespace ds4::cpu {

int64_t row_bytes(GgmlType type, int64_t K) {
  switch (type) {
    case GgmlType::F32: return K * 4;
    case GgmlType::F16:
    case GgmlType::BF16: return K * 2;
    case GgmlType::Q8_0: return K / 32 * int64_t(sizeof(BlockQ8_0));
    default: return 0;
  }
}

void dequantize_row(GgmlType type, const void* w, int64_t K, int64_t row, float* out) {
  const auto* base = static_cast<const uint8_t*>(w) + row * row_bytes(type, K);
  switch (type) {
    case GgmlType::F32:
      std::memcpy(out, base, size_t(K) * 4);
      break;
    case GgmlType::F16: {
      const auto* h = reinterpret_cast<const uint16_t*>(base);
      for (int64_t k = 0; k < K; ++k) out[k] = fp16_to_fp32(h[k]);
      break;
    }
    case GgmlType::BF16: {
      const auto* h = reinterpret_cast<const uint16_t*>(base);
      for (int64_t k = 0; k < K; ++k) out[k] = bf16_to_fp32(h[k]);
      break;
    }
    case GgmlType::Q8_0: {
      const auto* b = reinterpret_cast<const BlockQ8_0*>(base);
      for (int64_t i = 0; i < K / 32; ++i) {
        const float d = fp16_to_fp32(b[i].d);
        for (int j = 0; j < 32; ++j) out[i * 32 + j] = float(b[i].qs[j]) * d;
      }
      break;
    }
    default:
      std::abort();  // the model loader refuses other types
  }
}

// The larger of: 16 packed rows plus one row of packing buffer (the AVX-512
// table's f32 products), and the Q8_0 prefill's block scales, 16 rows + 64
// tokens + one 2x5 tile's products, per 32-block rounded up to 8 blocks
// (x86_common.h, q8x_scratch_floats).
int64_t matmul_scratch_floats(int64_t K) {
  return 17 * ((K + 7) / 8 * 8) + 64;
}

namespace {

// Q8_0 weights times quantized activations, per the contract in kernels.h.
void matmul_rows_q8_generic(const MatmulArgs& a, int64_t n0, int64_t n1) {
  const int64_t nb = a.K / 32;
  for (int64_t n = n0; n < n1; ++n) {
    const BlockQ8_0* w = static_cast<const BlockQ8_0*>(a.w) + n * nb;
    for (int64_t t = 0; t < a.T; ++t) {
      const BlockQ8Act* x = a.xq + t * a.ldxq;
      float acc = 0;
      for (int64_t b = 0; b < nb; ++b) {
        int32_t s = 0;
        for (int i = 0; i < 32; ++i) s += int32_t(w[b].qs[i]) * int32_t(x[b].qs[i]);
        acc = std::fma(float(s), fp16_to_fp32(w[b].d) * x[b].d, acc);
      }
      a.y[t * a.ldy + n] = acc;
    }
  }
}

void matmul_rows_generic(const MatmulArgs& a, int64_t n0, int64_t n1, float* scratch) {
  if (a.type == GgmlType::Q8_0 && a.xq) return matmul_rows_q8_generic(a, n0, n1);
  const int64_t kp = (a.K + 7) / 8 * 8;
  float* wrow = scratch;
  for (int64_t n = n0; n < n1; ++n) {
    dequantize_row(a.type, a.w, a.K, n, wrow);
    for (int64_t k = a.K; k < kp; ++k) wrow[k] = 0;
    for (int64_t t = 0; t < a.T; ++t) {
      const float* x = a.x + t * a.ldx;
      float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int64_t k = 0; k < kp; k += 8)
        for (int l = 0; l < 8; ++l) lanes[l] = std::fma(wrow[k + l], x[k + l], lanes[l]);
      a.y[t * a.ldy + n] = reduce8(lanes);
    }
  }
}

void attend_generic(const float* q, const uint16_t* k, const uint16_t* v, int64_t n_pos,
                    int64_t hd, int64_t stride, float scale, float* out, float* scores) {
  float mx = -INFINITY;
  for (int64_t p = 0; p < n_pos; ++p) {
    float s = 0;
    for (int64_t i = 0; i < hd; ++i) s += q[i] * fp16_to_fp32(k[p * stride + i]);
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
    const float w = scores[p] * inv;
    for (int64_t i = 0; i < hd; ++i) out[i] += w * fp16_to_fp32(v[p * stride + i]);
  }
}

void silu_mul_generic(float* g, const float* u, int64_t n) {
  for (int64_t i = 0; i < n; ++i) g[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
}

void to_f16_generic(const float* src, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = fp32_to_fp16(src[i]);
}

void quantize_q8_generic(const float* x, int64_t K, BlockQ8Act* out) {
  for (int64_t b = 0; b < K / 32; ++b) {
    const float* v = x + b * 32;
    float amax = 0;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(v[i]));
    const bool zero = !(amax >= kQ8ActTiny);
    const float id = zero ? 0.0f : 127.0f / amax;
    out[b].d = zero ? 0.0f : amax / 127.0f;
    // nearbyint rounds to nearest even in the default rounding mode, as the SIMD round does.
    for (int i = 0; i < 32; ++i) {
      const float q = std::nearbyint(v[i] * id);
      out[b].qs[i] = int8_t(q >= -127 && q <= 127 ? q : 0);  // NaN or inf input: no undefined cast
    }
  }
}

}  // namespace

const KernelTable& generic_kernels() {
  static const KernelTable table{"generic", matmul_rows_generic, attend_generic, to_f16_generic,
                                 quantize_q8_generic, silu_mul_generic};
  return table;
}

const KernelTable& cpu_kernels() {
  static const KernelTable* chosen = [] {
    const char* force = std::getenv("DS4_CPU_KERNELS");
    const std::string want = force ? force : "";
    __builtin_cpu_init();
    const bool has512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    const bool has2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                      __builtin_cpu_supports("f16c");
    if (want == "generic") return &generic_kernels();
    if (want != "avx2" && has512 && avx512_kernels()) return avx512_kernels();
    if (has2 && avx2_kernels()) return avx2_kernels();
    return &generic_kernels();
  }();
  return *chosen;
}

}  // namespace ds4::cpu
