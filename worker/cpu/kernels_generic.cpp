// Portable kernels: the reference for the numerical contract in kernels.h,
// written as plain loops over 8 emulated lanes.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#if defined(__x86_64__)
#include <cpuid.h>
#endif

#include "worker/cpu/kernels.h"

namespace ds4::cpu {

bool MatmulArgs::quantized() const {
  const QuantType* q = quant_type(type);
  if (!q) return false;
  return (q->act == ActType::Q8_0 && xq) || (q->act == ActType::Q8_K && xk);
}

int64_t row_bytes(GgmlType type, int64_t K) {
  const QuantType* q = quant_type(type);
  return q ? K / q->block_elems * q->block_bytes : 0;
}

void dequantize_row(GgmlType type, const void* w, int64_t K, int64_t row, float* out) {
  const QuantType* q = quant_type(type);
  if (!q) std::abort();  // the model loader refuses other types
  q->dequantize(static_cast<const uint8_t*>(w) + row * row_bytes(type, K), K / q->block_elems, out);
}

void matmul_rows_quantized_generic(const MatmulArgs& a, int64_t n0, int64_t n1) {
  const QuantType& q = *quant_type(a.type);
  const int64_t nb = a.K / q.block_elems, rb = nb * q.block_bytes;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* w = static_cast<const uint8_t*>(a.w) + n * rb;
    for (int64_t t = 0; t < a.T; ++t) {
      const void* x = q.act == ActType::Q8_0 ? static_cast<const void*>(a.xq + t * a.ldxq)
                                             : static_cast<const void*>(a.xk + t * a.ldxk);
      a.y[t * a.ldy + n] = q.dot(w, x, nb);
    }
  }
}

// The larger of: 16 packed rows plus one row of packing buffer (the AVX-512
// table's f32 products), and the Q8_0 prefill's block scales, 16 rows + 64
// tokens + one 2x5 tile's products, per 32-block rounded up to 8 blocks
// (x86_common.h, q8x_scratch_floats).
int64_t matmul_scratch_floats(int64_t K) {
  return 17 * pad16(K) + 64;
}

namespace {

// The reference of the contract: each row dequantized, then 16 lanes of
// fused multiply-adds per output.
void matmul_rows_f32_generic(const MatmulArgs& a, int64_t n0, int64_t n1, float* scratch) {
  const int64_t kp = pad16(a.K);
  float* wrow = scratch;
  for (int64_t n = n0; n < n1; ++n) {
    dequantize_row(a.type, a.w, a.K, n, wrow);
    for (int64_t k = a.K; k < kp; ++k) wrow[k] = 0;
    for (int64_t t = 0; t < a.T; ++t) {
      const float* x = a.x + t * a.ldx;
      float lanes[16] = {};
      for (int64_t k = 0; k < kp; k += 16)
        for (int l = 0; l < 16; ++l) lanes[l] = std::fma(wrow[k + l], k + l < a.K ? x[k + l] : 0.0f, lanes[l]);
      a.y[t * a.ldy + n] = reduce16(lanes);
    }
  }
}

void matmul_rows_quantized_generic_entry(const MatmulArgs& a, int64_t n0, int64_t n1, float*) {
  matmul_rows_quantized_generic(a, n0, n1);
}

void matmul_rows_generic(const MatmulArgs& a, int64_t n0, int64_t n1, float* scratch) {
  static const TypeKernelTable types;
  types.matmul_rows(a, n0, n1, scratch);
}

// Value i of row p of cached rows, exactly as f32.
float kv_value(const KvRows& r, int64_t p, int64_t i) {
  const auto* row = static_cast<const uint8_t*>(r.data) + p * r.row_bytes;
  if (r.type == KvType::f16) {
    uint16_t h;
    std::memcpy(&h, row + 2 * i, 2);
    return fp16_to_fp32(h);
  }
  const uint8_t* b = row + i / kKvQ8Block * kKvQ8BlockBytes;
  uint16_t d;
  std::memcpy(&d, b, 2);
  return fp16_to_fp32(d) * float(int8_t(b[2 + i % kKvQ8Block]));
}

void attend_generic(const float* q, KvRows k, KvRows v, int64_t n_pos, int64_t hd, float scale, float* out,
                    float* scores) {
  float m = -INFINITY, l = 0;
  for (int64_t t0 = 0; t0 < n_pos; t0 += kAttendTile) {
    const int64_t n = std::min(kAttendTile, n_pos - t0);
    float mx = -INFINITY;
    for (int64_t p = 0; p < n; ++p) {
      float s = 0;
      for (int64_t i = 0; i < hd; ++i) s += q[i] * kv_value(k, t0 + p, i);
      scores[p] = s * scale;
      mx = std::max(mx, scores[p]);
    }
    const float m_new = std::max(m, mx), alpha = m_new == m ? 1.0f : std::exp(m - m_new);
    m = m_new;
    float sum = 0;
    for (int64_t p = 0; p < n; ++p) sum += (scores[p] = std::exp(scores[p] - m));
    l = l * alpha + sum;
    for (int64_t i = 0; i < hd; ++i) out[i] = t0 == 0 ? 0.0f : out[i] * alpha;
    for (int64_t p = 0; p < n; ++p)
      for (int64_t i = 0; i < hd; ++i) out[i] += scores[p] * kv_value(v, t0 + p, i);
  }
  const float inv = 1.0f / l;
  for (int64_t i = 0; i < hd; ++i) out[i] *= inv;
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
    out[b].d = zero ? 0.0f : fp16_to_fp32(fp32_to_fp16(amax / 127.0f));  // the scale as ggml stores it
    // nearbyint rounds to nearest even in the default rounding mode, as the SIMD round does.
    for (int i = 0; i < 32; ++i) {
      const float q = std::nearbyint(v[i] * id);
      out[b].qs[i] = int8_t(q >= -127 && q <= 127 ? q : 0);  // NaN or inf input: no undefined cast
    }
  }
}

}  // namespace

TypeKernelTable::TypeKernelTable() {
  for (TypeKernels& k : at_) k = {matmul_rows_quantized_generic_entry, matmul_rows_f32_generic};
}

void attend_block_by_query(const KernelTable& t, const float* const* q, const int64_t* n_pos, int nq, KvRows k,
                           KvRows v, int64_t hd, float scale, float* const* out, float* scores, int64_t score_stride) {
  for (int j = 0; j < nq; ++j) t.attend(q[j], k, v, n_pos[j], hd, scale, out[j], scores + j * score_stride);
}

void store_kv_q8(const KernelTable& t, const float* x, int64_t n, void* blocks) {
  BlockQ8Act tmp[16];
  auto* out = static_cast<uint8_t*>(blocks);
  for (int64_t b0 = 0; b0 < n / kKvQ8Block; b0 += 16) {
    const int64_t nb = std::min<int64_t>(16, n / kKvQ8Block - b0);
    t.quantize_q8(x + b0 * kKvQ8Block, nb * kKvQ8Block, tmp);
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* o = out + (b0 + b) * kKvQ8BlockBytes;
      const uint16_t d = fp32_to_fp16(tmp[b].d);  // d is an f16 value already: exact
      std::memcpy(o, &d, 2);
      std::memcpy(o + 2, tmp[b].qs, kKvQ8Block);
    }
  }
}

namespace {
void attend_block_generic(const float* const* q, const int64_t* n_pos, int nq, KvRows k, KvRows v, int64_t hd,
                          float scale, float* const* out, float* scores, int64_t score_stride) {
  attend_block_by_query(generic_kernels(), q, n_pos, nq, k, v, hd, scale, out, scores, score_stride);
}
}  // namespace

const KernelTable& generic_kernels() {
  static const KernelTable table{"generic", matmul_rows_generic, attend_generic, attend_block_generic, to_f16_generic,
                                 quantize_q8_generic, quantize_q8k_generic,
                                 silu_mul_generic};
  return table;
}

namespace {
// The CPU's family when its vendor is AMD, else 0.
unsigned amd_family() {
  static const unsigned family = [] {
    unsigned f = 0;
#if defined(__x86_64__)
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    char vendor[13] = {};
    if (__get_cpuid(0, &eax, &ebx, &ecx, &edx)) {
      std::memcpy(vendor, &ebx, 4);
      std::memcpy(vendor + 4, &edx, 4);
      std::memcpy(vendor + 8, &ecx, 4);
    }
    if (std::string_view(vendor) == "AuthenticAMD" && __get_cpuid(1, &eax, &ebx, &ecx, &edx)) {
      const unsigned base = (eax >> 8) & 0xF;
      f = base == 0xF ? base + ((eax >> 20) & 0xFF) : base;
    }
#endif
    return f;
  }();
  return family;
}
}  // namespace

int kquant_prefill_rows() {
  static const int rows = [] {
    if (const char* v = std::getenv("DS4_CPU_PREFILL_ROWS"); v && (std::string_view(v) == "1" || std::string_view(v) == "2"))
      return v[0] - '0';
    return amd_family() == 0x19 ? 1 : 2;
  }();
  return rows;
}

const DecodeWalk& decode_walk() {
  static const DecodeWalk walk = [] {
    const bool amd_family_25 = amd_family() == 0x19;  // Zen 3, Zen 4
    int rows = amd_family() >= 0x1A ? 2 : 1;
    if (const char* v = std::getenv("DS4_CPU_DECODE_ROWS"); v && (std::string_view(v) == "1" || std::string_view(v) == "2"))
      rows = v[0] - '0';
    // Two streams side by side need their lines asked for further on. One
    // row of 16-lane steps wants its line 4 KiB on from an Intel Xeon (45
    // tok/s against 29-31 without), and none from Zen 4 (45 against 31).
    int64_t ahead = rows == 2 ? 8192 : amd_family_25 ? 0 : 4096;
    if (const char* v = std::getenv("DS4_CPU_DECODE_AHEAD")) ahead = std::max<int64_t>(0, std::atoll(v));
    return DecodeWalk{rows, ahead};
  }();
  return walk;
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
    const bool vnni = has512 && __builtin_cpu_supports("avx512vnni");
    if (want == "generic") return &generic_kernels();
    if (want != "avx2" && want != "avx512" && vnni && avx512vnni_kernels()) return avx512vnni_kernels();
    if (want != "avx2" && has512 && avx512_kernels()) return avx512_kernels();
    if (has2 && avx2_kernels()) return avx2_kernels();
    return &generic_kernels();
  }();
  return *chosen;
}

}  // namespace ds4::cpu
