// The CUDA backend against the CPU backend: every operation on random inputs
// of realistic shapes (normalised error ‖gpu − cpu‖ / ‖cpu‖), then the whole
// model end to end on stories260K (logits close, greedy tokens identical).
// Without a GPU (or without the CUDA build) the cases that need one are
// skipped (skip.h), in the test suite "cuda" that ctest's unit_cuda runs.
#include <doctest/doctest.h>

#ifdef DS4_HAVE_CUDA

#include <cuda_runtime.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <thread>
#include <vector>

#include "shared/error.h"
#include "shared/gguf.h"
#include "shared/gguf_writer.h"
#include "worker/backend.h"
#include "worker/cpu/kernels.h"
#include "worker/cpu/quant_types.h"
#include "worker/cuda/cuda_backend.h"
#include "worker/cuda/cuda_ops.h"
#include "worker/engine.h"
#include "model/weights.h"
#include "worker/sampler.h"
#include "text/tokenizer.h"

#include "skip.h"

using namespace ds4;

namespace {

/// The decorator of every case that needs a CUDA device: such cases form the
/// test suite "cuda" (ctest's unit_cuda), skipped where there is none. Asked
/// once, as the cases register: cudaGetDeviceCount loads the driver but makes
/// no context.
const test::needs& needs_gpu() {
  static const test::needs gpu{"cuda", [] {
                                 std::string why;
                                 return cuda_available(&why) ? std::string() : why;
                               }()};
  return gpu;
}

bool have_gpu() { return needs_gpu().missing.empty(); }

double rel_err(const float* got, const float* want, size_t n) {
  double e = 0, w = 0;
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(got[i])) return INFINITY;  // unwritten (poisoned) or NaN
    e += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
    w += double(want[i]) * want[i];
  }
  return std::sqrt(e / std::max(w, 1e-30));
}
double rel_err(const std::vector<float>& got, const std::vector<float>& want) {
  REQUIRE(got.size() == want.size());
  return rel_err(got.data(), want.data(), got.size());
}

std::vector<uint8_t> random_weight(GgmlType type, int64_t N, int64_t K, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<uint8_t> bytes(size_t(cpu::row_bytes(type, K) * N));
  for (int64_t n = 0; n < N; ++n) {
    uint8_t* row = bytes.data() + n * cpu::row_bytes(type, K);
    if (type == GgmlType::Q8_0) {
      auto* b = reinterpret_cast<BlockQ8_0*>(row);
      for (int64_t i = 0; i < K / 32; ++i) {
        b[i].d = fp32_to_fp16(0.01f + 0.001f * float(rng() % 100));
        for (int j = 0; j < 32; ++j) b[i].qs[j] = int8_t(int(rng() % 255) - 127);
      }
      continue;
    }
    for (int64_t k = 0; k < K; ++k) {
      const float v = nd(rng);
      if (type == GgmlType::F32) std::memcpy(row + 4 * k, &v, 4);
      if (type == GgmlType::F16) { const uint16_t h = fp32_to_fp16(v); std::memcpy(row + 2 * k, &h, 2); }
      if (type == GgmlType::BF16) { const uint16_t h = fp32_to_bf16(v); std::memcpy(row + 2 * k, &h, 2); }
    }
  }
  return bytes;
}

std::vector<float> random_floats(size_t n, std::mt19937& rng, float sd = 1.0f) {
  std::normal_distribution<float> nd(0.f, sd);
  std::vector<float> v(n);
  for (float& x : v) x = nd(rng);
  return v;
}

std::vector<uint16_t> random_halves(size_t n, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<uint16_t> v(n);
  for (uint16_t& h : v) h = fp32_to_fp16(nd(rng));
  return v;
}

const char* type_name(GgmlType t) {
  switch (t) {
    case GgmlType::F32: return "f32";
    case GgmlType::F16: return "f16";
    case GgmlType::BF16: return "bf16";
    default: return "q8_0";
  }
}

// --- block-quantised types: the reference decoding --------------------------
// Written from llama.cpp's block layouts (ggml-common.h) and its
// dequantize_row_* loops, independently of the device's repacked planes.

const GgmlType kQuantTypes[] = {GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1,
                                GgmlType::Q2_K, GgmlType::Q3_K, GgmlType::Q4_K, GgmlType::Q5_K,
                                GgmlType::Q6_K, GgmlType::IQ4_NL, GgmlType::IQ4_XS};

/// Whether a product of T tokens takes 16-bit activations on the device:
/// cuBLAS or the tiled GEMM beyond 8 tokens, and the tiled GEMM from 3 tokens
/// for Q8_0 and 6 for block-quantised types (matmul.cu's small_batch_tiled).
bool half_activations(GgmlType type, int64_t T) {
  if (T > 8) return type != GgmlType::F32;
  if (type == GgmlType::Q8_0) return T >= 3;
  return type != GgmlType::F32 && type != GgmlType::F16 && type != GgmlType::BF16 && T >= 6;
}

const char* quant_name(GgmlType t) {
  static std::string name;
  name = std::string(type_traits(uint32_t(t))->name);
  return name.c_str();
}

float half_at(const uint8_t* p) { return fp16_to_fp32(uint16_t(p[0] | p[1] << 8)); }

const int8_t kIq4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

void k4_scale_min(int j, const uint8_t* q, uint8_t* d, uint8_t* m) {
  if (j < 4) {
    *d = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j - 0] >> 6) << 4);
  }
}

/// One GGUF block of `type` decoded into y (block_elems floats).
void ref_block(GgmlType type, const uint8_t* x, float* y) {
  switch (type) {
    case GgmlType::Q4_0:
    case GgmlType::Q4_1:
    case GgmlType::IQ4_NL: {
      const float d = half_at(x);
      const uint8_t* qs = x + (type == GgmlType::Q4_1 ? 4 : 2);
      for (int j = 0; j < 16; ++j) {
        if (type == GgmlType::Q4_0) {
          y[j] = float((qs[j] & 0x0F) - 8) * d;
          y[j + 16] = float((qs[j] >> 4) - 8) * d;
        } else if (type == GgmlType::Q4_1) {
          const float m = half_at(x + 2);
          y[j] = float(qs[j] & 0x0F) * d + m;
          y[j + 16] = float(qs[j] >> 4) * d + m;
        } else {
          y[j] = d * float(kIq4Values[qs[j] & 0xf]);
          y[j + 16] = d * float(kIq4Values[qs[j] >> 4]);
        }
      }
      return;
    }
    case GgmlType::Q5_0:
    case GgmlType::Q5_1: {
      const bool one = type == GgmlType::Q5_1;
      const float d = half_at(x), m = one ? half_at(x + 2) : 0.0f;
      uint32_t qh;
      std::memcpy(&qh, x + (one ? 4 : 2), 4);
      const uint8_t* qs = x + (one ? 8 : 6);
      for (int j = 0; j < 16; ++j) {
        const uint8_t xh0 = uint8_t(((qh >> (j + 0)) << 4) & 0x10);
        const uint8_t xh1 = uint8_t((qh >> (j + 12)) & 0x10);
        const int x0 = (qs[j] & 0x0F) | xh0, x1 = (qs[j] >> 4) | xh1;
        if (one) {
          y[j] = float(x0) * d + m;
          y[j + 16] = float(x1) * d + m;
        } else {
          y[j] = float(x0 - 16) * d;
          y[j + 16] = float(x1 - 16) * d;
        }
      }
      return;
    }
    case GgmlType::Q2_K: {
      const float d = half_at(x + 80), min = half_at(x + 82);
      const uint8_t* q = x + 16;
      int is = 0;
      for (int n = 0; n < 256; n += 128) {
        int shift = 0;
        for (int j = 0; j < 4; ++j) {
          uint8_t sc = x[is++];
          float dl = d * float(sc & 0xF), ml = min * float(sc >> 4);
          for (int l = 0; l < 16; ++l) *y++ = dl * float(int8_t((q[l] >> shift) & 3)) - ml;
          sc = x[is++];
          dl = d * float(sc & 0xF);
          ml = min * float(sc >> 4);
          for (int l = 0; l < 16; ++l) *y++ = dl * float(int8_t((q[l + 16] >> shift) & 3)) - ml;
          shift += 2;
        }
        q += 32;
      }
      return;
    }
    case GgmlType::Q3_K: {
      const uint32_t kmask1 = 0x03030303, kmask2 = 0x0f0f0f0f;
      const float d_all = half_at(x + 108);
      const uint8_t* q = x + 32;
      const uint8_t* hm = x;
      uint8_t m = 1;
      uint32_t aux[4];
      std::memcpy(aux, x + 96, 12);
      const uint32_t tmp = aux[2];
      aux[2] = ((aux[0] >> 4) & kmask2) | (((tmp >> 4) & kmask1) << 4);
      aux[3] = ((aux[1] >> 4) & kmask2) | (((tmp >> 6) & kmask1) << 4);
      aux[0] = (aux[0] & kmask2) | (((tmp >> 0) & kmask1) << 4);
      aux[1] = (aux[1] & kmask2) | (((tmp >> 2) & kmask1) << 4);
      const int8_t* scales = reinterpret_cast<const int8_t*>(aux);
      int is = 0;
      for (int n = 0; n < 256; n += 128) {
        int shift = 0;
        for (int j = 0; j < 4; ++j) {
          float dl = d_all * float(scales[is++] - 32);
          for (int l = 0; l < 16; ++l)
            *y++ = dl * float(int8_t((q[l + 0] >> shift) & 3) - ((hm[l + 0] & m) ? 0 : 4));
          dl = d_all * float(scales[is++] - 32);
          for (int l = 0; l < 16; ++l)
            *y++ = dl * float(int8_t((q[l + 16] >> shift) & 3) - ((hm[l + 16] & m) ? 0 : 4));
          shift += 2;
          m <<= 1;
        }
        q += 32;
      }
      return;
    }
    case GgmlType::Q4_K:
    case GgmlType::Q5_K: {
      const bool five = type == GgmlType::Q5_K;
      const float d = half_at(x), min = half_at(x + 2);
      const uint8_t* scales = x + 4;
      const uint8_t* qh = x + 16;
      const uint8_t* q = x + (five ? 48 : 16);
      int is = 0;
      uint8_t sc, m, u1 = 1, u2 = 2;
      for (int j = 0; j < 256; j += 64) {
        k4_scale_min(is + 0, scales, &sc, &m);
        const float d1 = d * float(sc), m1 = min * float(m);
        k4_scale_min(is + 1, scales, &sc, &m);
        const float d2 = d * float(sc), m2 = min * float(m);
        for (int l = 0; l < 32; ++l) *y++ = d1 * float((q[l] & 0xF) + (five && (qh[l] & u1) ? 16 : 0)) - m1;
        for (int l = 0; l < 32; ++l) *y++ = d2 * float((q[l] >> 4) + (five && (qh[l] & u2) ? 16 : 0)) - m2;
        q += 32;
        is += 2;
        u1 <<= 2;
        u2 <<= 2;
      }
      return;
    }
    case GgmlType::Q6_K: {
      const float d = half_at(x + 208);
      const uint8_t* ql = x;
      const uint8_t* qh = x + 128;
      const int8_t* sc = reinterpret_cast<const int8_t*>(x + 192);
      for (int n = 0; n < 256; n += 128) {
        for (int l = 0; l < 32; ++l) {
          const int is = l / 16;
          const int8_t q1 = int8_t((ql[l + 0] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
          const int8_t q2 = int8_t((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
          const int8_t q3 = int8_t((ql[l + 0] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
          const int8_t q4 = int8_t((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
          y[l + 0] = d * float(sc[is + 0]) * float(q1);
          y[l + 32] = d * float(sc[is + 2]) * float(q2);
          y[l + 64] = d * float(sc[is + 4]) * float(q3);
          y[l + 96] = d * float(sc[is + 6]) * float(q4);
        }
        y += 128;
        ql += 64;
        qh += 32;
        sc += 8;
      }
      return;
    }
    case GgmlType::IQ4_XS: {
      const float d = half_at(x);
      const uint16_t scales_h = uint16_t(x[2] | x[3] << 8);
      const uint8_t* scales_l = x + 4;
      const uint8_t* qs = x + 8;
      for (int ib = 0; ib < 8; ++ib) {
        const int ls = ((scales_l[ib / 2] >> 4 * (ib % 2)) & 0xf) | (((scales_h >> 2 * ib) & 3) << 4);
        const float dl = d * float(ls - 32);
        for (int j = 0; j < 16; ++j) {
          y[j + 0] = dl * float(kIq4Values[qs[j] & 0xf]);
          y[j + 16] = dl * float(kIq4Values[qs[j] >> 4]);
        }
        y += 32;
        qs += 16;
      }
      return;
    }
    default: FAIL("no reference for type " << int(type));
  }
}

std::vector<float> ref_dequant(GgmlType type, const std::vector<uint8_t>& w, int64_t N, int64_t K) {
  const auto tt = *type_traits(uint32_t(type));
  std::vector<float> out(size_t(N * K));
  for (int64_t b = 0; b < N * K / tt.block_elems; ++b)
    ref_block(type, w.data() + b * tt.block_bytes, out.data() + b * tt.block_elems);
  return out;
}

/// Random blocks of `type` (N rows of K): random quant and scale bytes, the
/// blocks' halves (d, dmin, m) finite and small, of both signs.
std::vector<uint8_t> random_blocks(GgmlType type, int64_t N, int64_t K, std::mt19937& rng) {
  const auto tt = *type_traits(uint32_t(type));
  std::vector<uint8_t> w(size_t(N * K / tt.block_elems * tt.block_bytes));
  for (uint8_t& b : w) b = uint8_t(rng());
  std::vector<int> halves;
  switch (type) {
    case GgmlType::Q4_1: case GgmlType::Q5_1: case GgmlType::Q4_K: case GgmlType::Q5_K: halves = {0, 2}; break;
    case GgmlType::Q2_K: halves = {80, 82}; break;
    case GgmlType::Q3_K: halves = {108}; break;
    case GgmlType::Q6_K: halves = {208}; break;
    default: halves = {0};
  }
  std::uniform_real_distribution<float> ud(0.002f, 0.02f);
  for (size_t b = 0; b < w.size(); b += tt.block_bytes)
    for (int at : halves) {
      const uint16_t h = fp32_to_fp16((rng() % 4 == 0 ? -1.0f : 1.0f) * ud(rng));
      w[b + at] = uint8_t(h & 0xff);
      w[b + at + 1] = uint8_t(h >> 8);
    }
  return w;
}

/// The decode GEMV's bound for quantised weights: `dp4a` for the int8 dot
/// products (x quantised per 32), 1e-5 when DS4_CUDA_QGEMV=float runs them in f32.
double quant_gemv_bound(double dp4a) {
  const char* env = std::getenv("DS4_CUDA_QGEMV");
  return env && std::string(env) == "float" ? 1e-5 : dp4a;
}

/// y[t][n] = sum_k w[n][k] x[t][k] in double, over the reference weights.
std::vector<float> ref_matmul(const std::vector<float>& w, int64_t N, int64_t K, const std::vector<float>& x,
                              int64_t ldx, int64_t T) {
  std::vector<float> y(size_t(T * N));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t n = 0; n < N; ++n) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k) s += double(w[size_t(n * K + k)]) * x[size_t(t * ldx + k)];
      y[size_t(t * N + n)] = float(s);
    }
  return y;
}

}  // namespace

TEST_CASE("cuda: matrix products of every weight type match the CPU kernels" * needs_gpu()) {
  std::mt19937 rng(7);
  struct Shape { int64_t N, K; };
  for (GgmlType type : {GgmlType::F32, GgmlType::F16, GgmlType::BF16, GgmlType::Q8_0}) {
    for (Shape sh : {Shape{1024, 4096}, Shape{4096, 1024}, Shape{256, 2048}, Shape{64, 14336}}) {
      const auto w = random_weight(type, sh.N, sh.K, rng);
      const Weight W{type, w.data(), sh.K, sh.N};
      for (int64_t T : {1, 2, 5, 8, 64, 100}) {
        const int64_t ldx = (sh.K + 7) / 8 * 8;
        std::vector<float> x(size_t(T * ldx), 0.f);
        for (int64_t t = 0; t < T; ++t)
          for (int64_t k = 0; k < sh.K; ++k) x[size_t(t * ldx + k)] = random_floats(1, rng)[0];
        std::vector<float> want(size_t(T * sh.N)), got(size_t(T * sh.N));
        std::vector<float> scratch(size_t(cpu::matmul_scratch_floats(sh.K)));
        const cpu::MatmulArgs a{type, w.data(), sh.K, sh.N, x.data(), ldx, T, want.data(), sh.N};
        cpu::cpu_kernels().matmul_rows(a, 0, sh.N, scratch.data());
        cuda_ops::matmul(W, x.data(), ldx, T, got.data(), sh.N);
        CAPTURE(type_name(type));
        CAPTURE(sh.N);
        CAPTURE(sh.K);
        CAPTURE(T);
        const bool gemm = half_activations(type, T);
        // GEMV keeps f32 throughout; cuBLAS and the tiled GEMM (Q8_0, 3 to
        // 64 tokens) take 16-bit activations (bf16 for bf16 weights, f16
        // otherwise; f32 weights stay f32).
        const double bound = !gemm || type == GgmlType::F32 ? 1e-5 : type == GgmlType::BF16 ? 1e-2 : 2e-3;
        CHECK(rel_err(got, want) < bound);
        if (T == 2) {  // the same product as the first of a fused Q/K/V launch
          cuda_ops::matmul(W, x.data(), ldx, T, got.data(), sh.N, false, true);
          CHECK(rel_err(got, want) < 1e-5);
        }
        if (T == 8) {  // and through cuBLAS at a decode batch size
          cuda_ops::matmul(W, x.data(), ldx, T, got.data(), sh.N, true);
          CHECK(rel_err(got, want) < (type == GgmlType::F32 ? 1e-5 : type == GgmlType::BF16 ? 1e-2 : 2e-3));
        }
      }
    }
  }
}

TEST_CASE("cuda: the fused gate/up SwiGLU product matches the CPU's two products and SwiGLU" * needs_gpu()) {
  std::mt19937 rng(14);
  const int64_t N = 5632, K = 2048, ldx = K;
  for (GgmlType type : {GgmlType::F16, GgmlType::Q8_0, GgmlType::BF16, GgmlType::F32}) {
    const auto wg = random_weight(type, N, K, rng), wu = random_weight(type, N, K, rng);
    for (int64_t T : {1, 4, 8, 33}) {
      auto x = random_floats(size_t(T * ldx), rng, 0.05f);
      std::vector<float> g(size_t(T * N)), u(size_t(T * N)), got(size_t(T * N));
      std::vector<float> scratch(size_t(cpu::matmul_scratch_floats(K)));
      cpu::cpu_kernels().matmul_rows({type, wg.data(), K, N, x.data(), ldx, T, g.data(), N}, 0, N, scratch.data());
      cpu::cpu_kernels().matmul_rows({type, wu.data(), K, N, x.data(), ldx, T, u.data(), N}, 0, N, scratch.data());
      for (size_t i = 0; i < g.size(); ++i) g[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
      cuda_ops::matmul_swiglu({type, wg.data(), K, N}, {type, wu.data(), K, N}, x.data(), ldx, T, got.data(), N);
      CAPTURE(type_name(type));
      CAPTURE(T);
      CHECK(rel_err(got, g) < (!half_activations(type, T) ? 1e-5 : type == GgmlType::BF16 ? 2e-2 : 4e-3));
    }
  }
}

TEST_CASE("cuda: RMSNorm folded into the decode products matches the CPU's norm then products" * needs_gpu()) {
  std::mt19937 rng(21);
  const int64_t N = 1000, K = 2048, ldx = K;  // N not a multiple of the rows a block takes
  for (GgmlType type : {GgmlType::F16, GgmlType::Q8_0, GgmlType::BF16, GgmlType::F32}) {
    const auto w = random_weight(type, N, K, rng), u = random_weight(type, N, K, rng);
    const auto g = random_floats(size_t(K), rng);
    for (int64_t T : {1, 2, 3, 8, 20}) {
      const auto x = random_floats(size_t(T * ldx), rng, 2.0f);
      std::vector<float> xn(x.size());
      for (int64_t t = 0; t < T; ++t) {
        double sum = 0;
        for (int64_t i = 0; i < K; ++i) sum += double(x[t * K + i] * x[t * K + i]);
        const float scale = 1.0f / std::sqrt(float(sum / double(K)) + 1e-5f);
        for (int64_t i = 0; i < K; ++i) xn[t * K + i] = (x[t * K + i] * scale) * g[i];
      }
      std::vector<float> want(size_t(T * N)), up(size_t(T * N)), got(size_t(T * N));
      std::vector<float> scratch(size_t(cpu::matmul_scratch_floats(K)));
      cpu::cpu_kernels().matmul_rows({type, w.data(), K, N, xn.data(), ldx, T, want.data(), N}, 0, N, scratch.data());
      const Weight W{type, w.data(), K, N}, U{type, u.data(), K, N};
      CAPTURE(type_name(type));
      CAPTURE(T);
      const double bound = !half_activations(type, T) ? 1e-5 : type == GgmlType::BF16 ? 2e-2 : 4e-3;
      cuda_ops::rmsnorm_matmul(W, nullptr, g.data(), 1e-5f, x.data(), ldx, T, got.data(), N);
      CHECK(rel_err(got, want) < bound);
      cpu::cpu_kernels().matmul_rows({type, u.data(), K, N, xn.data(), ldx, T, up.data(), N}, 0, N, scratch.data());
      for (size_t i = 0; i < want.size(); ++i) want[i] = want[i] / (1.0f + std::exp(-want[i])) * up[i];
      cuda_ops::rmsnorm_matmul(W, &U, g.data(), 1e-5f, x.data(), ldx, T, got.data(), N);
      CHECK(rel_err(got, want) < bound);
    }
  }
}

// Timing only, skipped unless asked for (--no-skip): weight bytes per second
// of the decode GEMV on the 7B and 1B shapes, against the 4.3 TB/s copy.
TEST_CASE("cuda: decode GEMV bandwidth" * needs_gpu() * doctest::skip()) {
  struct Case { const char* what; GgmlType type; int64_t N, K; bool glu, norm; };
  const Case cases[] = {
      {"7B wq (norm)", GgmlType::F16, 4096, 4096, false, true},   {"7B wo", GgmlType::F16, 4096, 4096, false, false},
      {"7B gate/up (norm)", GgmlType::F16, 14336, 4096, true, true}, {"7B down", GgmlType::F16, 4096, 14336, false, false},
      {"1B wq (norm)", GgmlType::F16, 2048, 2048, false, true},   {"1B gate/up (norm)", GgmlType::F16, 5632, 2048, true, true},
      {"1B down", GgmlType::F16, 2048, 5632, false, false},        {"1B q8 gate/up", GgmlType::Q8_0, 5632, 2048, true, true},
      {"1B q8 down", GgmlType::Q8_0, 2048, 5632, false, false},    {"7B q8 down", GgmlType::Q8_0, 4096, 14336, false, false},
      {"8B q4_k wq", GgmlType::Q4_K, 4096, 4096, false, false},     {"8B q4_k gate", GgmlType::Q4_K, 14336, 4096, false, false},
      {"8B q6_k down", GgmlType::Q6_K, 4096, 14336, false, false},  {"8B q4_k down", GgmlType::Q4_K, 4096, 14336, false, false},
      {"8B q5_k gate", GgmlType::Q5_K, 14336, 4096, false, false},  {"8B q4_0 gate", GgmlType::Q4_0, 14336, 4096, false, false},
      {"8B q3_k gate", GgmlType::Q3_K, 14336, 4096, false, false},  {"8B q2_k gate", GgmlType::Q2_K, 14336, 4096, false, false},
      {"8B q6_k output", GgmlType::Q6_K, 128256, 4096, false, false},
  };
  for (const Case& c : cases)
    for (int T : {1, 2, 4, 8}) {
      const double bps = cuda_ops::gemv_bytes_per_second(c.type, c.N, c.K, T, c.glu, c.norm, 64);
      std::printf("gemv %-20s T=%d  %7.0f GB/s\n", c.what, T, bps / 1e9);
    }
}

// Which way a batch's product should take: the tiled GEMM against the
// dequantise-then-cuBLAS way (and the GEMV at 8 tokens), 8B shapes.
TEST_CASE("cuda: tiled GEMM and cuBLAS speed by batch size" * needs_gpu() * doctest::skip()) {
  struct Case { const char* what; GgmlType type; int64_t N, K; };
  const Case cases[] = {{"8B q8 wq", GgmlType::Q8_0, 4096, 4096},      {"8B q8 gate", GgmlType::Q8_0, 14336, 4096},
                        {"8B q8 down", GgmlType::Q8_0, 4096, 14336},   {"8B q4_k wq", GgmlType::Q4_K, 4096, 4096},
                        {"8B q4_k gate", GgmlType::Q4_K, 14336, 4096}, {"8B q6_k down", GgmlType::Q6_K, 4096, 14336},
                        {"30B-A3B q4_k expert", GgmlType::Q4_K, 768, 2048}};
  for (const Case& c : cases)
    for (int T : {1, 2, 4, 8, 16, 32, 64, 96, 128, 256, 512}) {
      const double tiled = cuda_ops::product_seconds(c.type, c.N, c.K, T, 1, 32),
                   blas = T >= 8 ? cuda_ops::product_seconds(c.type, c.N, c.K, T, 2, 32) : 0.0,
                   gemv = T <= 8 ? cuda_ops::product_seconds(c.type, c.N, c.K, T, 0, 32) : 0.0;
      std::printf("%-20s T=%3d  tiled %8.1f us  cublas %8.1f us  gemv %8.1f us\n", c.what, T, tiled * 1e6,
                  blas * 1e6, gemv * 1e6);
    }
}

TEST_CASE("cuda: every quantised type dequantises on the device bit-exactly as llama.cpp's blocks define" * needs_gpu()) {
  std::mt19937 rng(31);
  const int64_t N = 48, K = 1024;
  for (GgmlType type : kQuantTypes) {
    const auto w = random_blocks(type, N, K, rng);
    const auto want = ref_dequant(type, w, N, K);
    const auto got = cuda_ops::dequantize({type, w.data(), K, N});
    CAPTURE(quant_name(type));
    REQUIRE(got.size() == want.size());
    size_t bad = 0, first = got.size();
    for (size_t i = 0; i < got.size(); ++i)
      if (std::memcmp(&got[i], &want[i], 4) != 0) {
        ++bad;
        first = std::min(first, i);
      }
    CAPTURE(first);
    CAPTURE(first < got.size() ? got[first] : 0.0f);
    CAPTURE(first < got.size() ? want[first] : 0.0f);
    CHECK(bad == 0);
    // And against the CPU backend's own rows, where it has the type.
    if (cpu::row_bytes(type, K) > 0) {
      std::vector<float> cpu_rows(size_t(N * K));
      for (int64_t n = 0; n < N; ++n) cpu::dequantize_row(type, w.data(), K, n, cpu_rows.data() + n * K);
      CHECK(std::memcmp(got.data(), cpu_rows.data(), got.size() * 4) == 0);
    } else {
      MESSAGE("the CPU backend has no " << std::string(quant_name(type)) << " rows in this build: the reference above only");
    }
  }
}

TEST_CASE("cuda: decode GEMV and prefill GEMM of every quantised type match the dequantised reference" * needs_gpu()) {
  std::mt19937 rng(32);
  struct Shape { int64_t N, K; };
  for (GgmlType type : kQuantTypes) {
    for (Shape sh : {Shape{1000, 2048}, Shape{256, 4096}, Shape{64, 14336}}) {
      const auto w = random_blocks(type, sh.N, sh.K, rng);
      const auto wf = ref_dequant(type, w, sh.N, sh.K);
      const Weight W{type, w.data(), sh.K, sh.N};
      for (int64_t T : {1, 2, 3, 8, 20, 33, 64, 100}) {
        const int64_t ldx = sh.K + 8;
        const auto x = random_floats(size_t(T * ldx), rng);
        const auto want = ref_matmul(wf, sh.N, sh.K, x, ldx, T);
        std::vector<float> got(size_t(T * sh.N));
        cuda_ops::matmul(W, x.data(), ldx, T, got.data(), sh.N);
        CAPTURE(quant_name(type));
        CAPTURE(sh.N);
        CAPTURE(sh.K);
        CAPTURE(T);
        // Decode: int8 dot products (x quantised per 32 as llama.cpp's q8_1;
        // DS4_CUDA_QGEMV=float: f32 throughout, within 1e-5); GEMM (the tiled
        // one up to 64 tokens: 1000 rows end inside a block, 64 x 14336 is
        // split along its columns; cuBLAS at 100): weights and activations in f16.
        CHECK(rel_err(got, want) < (half_activations(type, T) ? 3e-3 : quant_gemv_bound(1.5e-2)));
        if (T == 8) {
          cuda_ops::matmul(W, x.data(), ldx, T, got.data(), sh.N, true);
          CHECK(rel_err(got, want) < 3e-3);
        }
      }
    }
  }
}

TEST_CASE("cuda: quantised gate/up, norm-then-products and embedding rows match the reference" * needs_gpu()) {
  std::mt19937 rng(33);
  const int64_t N = 768, K = 1024, ldx = K;
  for (GgmlType type : kQuantTypes) {
    const auto wg = random_blocks(type, N, K, rng), wu = random_blocks(type, N, K, rng);
    const auto fg = ref_dequant(type, wg, N, K), fu = ref_dequant(type, wu, N, K);
    const auto gain = random_floats(size_t(K), rng);
    CAPTURE(quant_name(type));
    for (int64_t T : {1, 5, 24}) {
      CAPTURE(T);
      const auto x = random_floats(size_t(T * ldx), rng, 0.1f);
      auto g = ref_matmul(fg, N, K, x, ldx, T);
      const auto u = ref_matmul(fu, N, K, x, ldx, T);
      for (size_t i = 0; i < g.size(); ++i) g[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
      std::vector<float> got(size_t(T * N));
      cuda_ops::matmul_swiglu({type, wg.data(), K, N}, {type, wu.data(), K, N}, x.data(), ldx, T, got.data(), N);
      CHECK(rel_err(got, g) < (half_activations(type, T) ? 4e-3 : quant_gemv_bound(3e-2)));
      // RMSNorm in front (the decode path folds it only for unquantised types).
      std::vector<float> xn(x.size());
      for (int64_t t = 0; t < T; ++t) {
        double sum = 0;
        for (int64_t i = 0; i < K; ++i) sum += double(x[t * K + i] * x[t * K + i]);
        const float scale = 1.0f / std::sqrt(float(sum / double(K)) + 1e-5f);
        for (int64_t i = 0; i < K; ++i) xn[t * K + i] = (x[t * K + i] * scale) * gain[i];
      }
      const auto want = ref_matmul(fg, N, K, xn, ldx, T);
      cuda_ops::rmsnorm_matmul({type, wg.data(), K, N}, nullptr, gain.data(), 1e-5f, x.data(), ldx, T, got.data(), N);
      CHECK(rel_err(got, want) < (half_activations(type, T) ? 4e-3 : quant_gemv_bound(1.5e-2)));
    }
    const std::vector<BatchToken> batch{{3, 0, 0, -1}, {767, 0, 1, -1}, {0, 0, 2, 0}, {200, 1, 7, 1}};
    std::vector<float> got(batch.size() * K);
    cuda_ops::embed({type, wg.data(), K, N}, batch, got.data());
    bool same = true;
    for (size_t t = 0; t < batch.size(); ++t)
      same = same && std::memcmp(got.data() + t * K, fg.data() + batch[t].token * K, size_t(K) * 4) == 0;
    CHECK(same);
  }
}

TEST_CASE("cuda: a quantised weight whose rows are not whole blocks is refused, naming the type" * needs_gpu()) {
  std::vector<uint8_t> w(size_t(4 * 3 * 144));
  bool refused = false;
  try {
    cuda_ops::dequantize({GgmlType::Q4_K, w.data(), 768 + 32, 4});
  } catch (const Error& e) {
    refused = std::string(e.what()).find("Q4_K") != std::string::npos;
    MESSAGE(std::string(e.what()));
  }
  CHECK(refused);
}

TEST_CASE("cuda: rows that break 16-byte alignment take the scalar product" * needs_gpu()) {
  std::mt19937 rng(8);
  for (GgmlType type : {GgmlType::F32, GgmlType::F16, GgmlType::BF16}) {
    const int64_t N = 64, K = 172, ldx = 176, T = 3;  // stories260K's feed-forward width
    const auto w = random_weight(type, N, K, rng);
    std::vector<float> x(size_t(T * ldx), 0.f);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t k = 0; k < K; ++k) x[size_t(t * ldx + k)] = random_floats(1, rng)[0];
    std::vector<float> want(size_t(T * N)), got(size_t(T * N));
    std::vector<float> scratch(size_t(cpu::matmul_scratch_floats(K)));
    cpu::cpu_kernels().matmul_rows({type, w.data(), K, N, x.data(), ldx, T, want.data(), N}, 0, N, scratch.data());
    cuda_ops::matmul({type, w.data(), K, N}, x.data(), ldx, T, got.data(), N);
    CAPTURE(type_name(type));
    CHECK(rel_err(got, want) < 1e-5);
  }
}

TEST_CASE("cuda: embedding rows are the exact f32 values of every weight type" * needs_gpu()) {
  std::mt19937 rng(9);
  const int64_t V = 512, D = 4096;
  for (GgmlType type : {GgmlType::F32, GgmlType::F16, GgmlType::BF16, GgmlType::Q8_0}) {
    const auto w = random_weight(type, V, D, rng);
    const std::vector<BatchToken> batch{{3, 0, 0, -1}, {511, 0, 1, -1}, {0, 0, 2, 0}, {200, 1, 7, 1}};
    std::vector<float> got(batch.size() * D), want(batch.size() * D);
    cuda_ops::embed({type, w.data(), D, V}, batch, got.data());
    for (size_t t = 0; t < batch.size(); ++t) cpu::dequantize_row(type, w.data(), D, batch[t].token, want.data() + t * D);
    CAPTURE(type_name(type));
    CHECK(std::memcmp(got.data(), want.data(), got.size() * 4) == 0);
  }
}

TEST_CASE("cuda: RMSNorm matches the CPU formula" * needs_gpu()) {
  std::mt19937 rng(10);
  for (int64_t n : {64, 2048, 4096, 8192}) {
    const int64_t T = 7;
    const auto x = random_floats(size_t(T * n), rng, 3.0f), g = random_floats(size_t(n), rng);
    std::vector<float> got(x.size()), want(x.size());
    for (int64_t t = 0; t < T; ++t) {
      double sum = 0;
      for (int64_t i = 0; i < n; ++i) sum += double(x[t * n + i] * x[t * n + i]);
      const float scale = 1.0f / std::sqrt(float(sum / double(n)) + 1e-5f);
      for (int64_t i = 0; i < n; ++i) want[t * n + i] = (x[t * n + i] * scale) * g[i];
    }
    cuda_ops::rmsnorm(x.data(), T, n, g.data(), 1e-5f, got.data());
    CAPTURE(n);
    CHECK(rel_err(got, want) < 1e-6);
  }
}

TEST_CASE("cuda: RoPE (normal and NEOX pairs, frequency factors, linear scaling, partial) and the f16 KV store match the CPU backend" * needs_gpu()) {
  std::mt19937 rng(11);
  struct Heads { int h, kv, hd, rot; bool neox; bool factors; float scale; };
  for (Heads hs : {Heads{32, 8, 128, 128, false, false, 1.0f}, Heads{32, 4, 64, 64, false, false, 1.0f},
                   Heads{8, 4, 8, 8, false, false, 1.0f}, Heads{16, 8, 128, 128, true, false, 1.0f},
                   Heads{8, 2, 64, 64, false, true, 0.25f}, Heads{8, 4, 64, 32, true, true, 0.5f},
                   Heads{4, 2, 32, 16, false, false, 1.0f}}) {
    const int64_t slots = 2, ctx = 4096;
    const std::vector<BatchToken> batch{{1, 0, 0, -1}, {1, 0, 1, -1}, {1, 1, 517, 0}, {1, 0, 4095, 1}};
    const int64_t T = int64_t(batch.size()), qd = int64_t(hs.h) * hs.hd, kvd = int64_t(hs.kv) * hs.hd;
    auto q = random_floats(size_t(T * qd), rng), k = random_floats(size_t(T * kvd), rng);
    const auto v = random_floats(size_t(T * kvd), rng);
    std::vector<uint16_t> kc(size_t(slots * ctx * kvd), 0), vc(kc.size(), 0);
    cuda_ops::RopeVariant var;
    var.neox = hs.neox;
    var.freq_scale = hs.scale;
    for (int i = 0; hs.factors && i < hs.rot / 2; ++i) var.freq_factors.push_back(1.0f + 0.75f * float(i % 7));
    auto wq = q, wk = k;
    std::vector<uint16_t> wkc = kc, wvc = vc;
    const float theta_scale = std::pow(10000.0f, -2.0f / float(hs.rot));
    for (int64_t t = 0; t < T; ++t) {
      // The CPU backend's formula (worker/cpu/cpu_backend.cpp), written out.
      auto rotate = [&](float* row, int heads) {
        for (int h = 0; h < heads; ++h) {
          float theta = float(batch[t].pos);
          for (int i = 0; i < hs.rot; i += 2) {
            float* x = row + h * hs.hd;
            const float a = hs.scale * (hs.factors ? theta / var.freq_factors[size_t(i / 2)] : theta);
            const int i0 = hs.neox ? i / 2 : i, i1 = hs.neox ? i / 2 + hs.rot / 2 : i + 1;
            const float c = std::cos(a), s = std::sin(a), x0 = x[i0], x1 = x[i1];
            x[i0] = x0 * c - x1 * s;
            x[i1] = x0 * s + x1 * c;
            theta *= theta_scale;
          }
        }
      };
      rotate(wq.data() + t * qd, hs.h);
      rotate(wk.data() + t * kvd, hs.kv);
      const int64_t at = (batch[t].slot * ctx + batch[t].pos) * kvd;
      for (int64_t i = 0; i < kvd; ++i) {
        wkc[size_t(at + i)] = fp32_to_fp16(wk[size_t(t * kvd + i)]);
        wvc[size_t(at + i)] = fp32_to_fp16(v[size_t(t * kvd + i)]);
      }
    }
    cuda_ops::rope_store(q, k, v, batch, hs.h, hs.kv, hs.hd, hs.rot, 10000.0f, slots, ctx, kc, vc, var);
    CAPTURE(hs.hd);
    CAPTURE(hs.rot);
    CAPTURE(hs.neox);
    CAPTURE(hs.factors);
    CHECK(rel_err(q, wq) < 1e-6);
    CHECK(rel_err(k, wk) < 1e-6);
    CHECK(vc == wvc);
    size_t differ = 0;
    for (size_t i = 0; i < kc.size(); ++i)
      if (kc[i] != wkc[i]) {
        ++differ;
        CHECK(std::abs(fp16_to_fp32(kc[i]) - fp16_to_fp32(wkc[i])) <= 1e-3f * std::abs(fp16_to_fp32(wkc[i])) + 1e-6f);
      }
    CHECK(differ * 1000 <= size_t(T * kvd));  // at most a rounding-boundary few
  }
}

TEST_CASE("cuda: the per-head Q/K norm and the QKV bias match the CPU formulas" * needs_gpu()) {
  std::mt19937 rng(15);
  for (int hd : {32, 64, 128, 256}) {
    const int64_t T = 5;
    const int heads = 6;
    auto x = random_floats(size_t(T * heads * hd), rng, 3.0f);
    const auto g = random_floats(size_t(hd), rng);
    auto want = x;
    for (int64_t r = 0; r < T * heads; ++r) {  // worker/cpu/cpu_backend.cpp's head_norm
      float* xr = want.data() + r * hd;
      double sum = 0;
      for (int i = 0; i < hd; ++i) sum += double(xr[i] * xr[i]);
      const float scale = 1.0f / std::sqrt(float(sum / double(hd)) + 1e-6f);
      for (int i = 0; i < hd; ++i) xr[i] = (xr[i] * scale) * g[size_t(i)];
    }
    cuda_ops::head_norm(x, T, heads, g, 1e-6f);
    CAPTURE(hd);
    CHECK(rel_err(x, want) < 1e-6);
    auto y = random_floats(size_t(T * heads * hd), rng);
    const auto b = random_floats(size_t(heads * hd), rng);
    auto yb = y;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i < heads * hd; ++i) yb[size_t(t * heads * hd + i)] += b[size_t(i)];
    cuda_ops::add_bias(y, T, b);
    CHECK(y == yb);
  }
}

TEST_CASE("cuda: grouped-query attention over the cache matches the CPU kernel" * needs_gpu()) {
  std::mt19937 rng(12);
  struct Heads { int h, kv, hd; };
  for (Heads hs : {Heads{32, 8, 128}, Heads{32, 4, 64}, Heads{8, 4, 8}, Heads{16, 16, 256}}) {
    // 1 and 3 tokens: the decode (warp) kernel; 2: two decode tokens deep
    // enough for the tensor cores' decode kernel (positions 20479 and 17000);
    // 70: the prefill kernel with tokens of two slots at scattered positions;
    // 200: a prompt chunk deep in one slot (consecutive positions
    // 3800..3999), as a long prompt's prefill takes it. Both are deep enough
    // for the prefill kernel to split the positions of its blocks
    // (cuda::prefill_splits: 2 or more ranges of 1024 on a GPU of 132
    // multiprocessors), two slots' ranges in the first.
    for (int64_t T : {1, 2, 3, 70, 200}) {
      const int64_t slots = 2, ctx = T == 2 ? 20480 : 4096, qd = int64_t(hs.h) * hs.hd, kvd = int64_t(hs.kv) * hs.hd;
      std::vector<BatchToken> batch;
      for (int64_t t = 0; t < T; ++t)
        batch.push_back(T == 200 ? BatchToken{0, 1, int32_t(3800 + t), -1}
                        : T == 2 ? BatchToken{0, int32_t(t), int32_t(t == 0 ? ctx - 1 : 17000), -1}
                                 : BatchToken{0, int32_t(t % 2), int32_t(t == 0 ? 0 : t == 1 ? ctx - 1 : (rng() % ctx)), -1});
      const auto q = random_floats(size_t(T * qd), rng);
      const auto kc = random_halves(size_t(slots * ctx * kvd), rng), vc = random_halves(kc.size(), rng);
      std::vector<float> want(size_t(T * qd)), got;
      std::vector<float> scores(static_cast<size_t>(ctx));
      const float scale = 1.0f / std::sqrt(float(hs.hd));
      for (int64_t t = 0; t < T; ++t)
        for (int h = 0; h < hs.h; ++h) {
          const int kvh = h / (hs.h / hs.kv);
          const int64_t base = batch[t].slot * ctx * kvd + kvh * hs.hd;
          cpu::cpu_kernels().attend(q.data() + t * qd + h * hs.hd, {kc.data() + base, KvType::f16, kvd * 2},
                                    {vc.data() + base, KvType::f16, kvd * 2}, batch[t].pos + 1, hs.hd, scale,
                                    want.data() + t * qd + h * hs.hd, scores.data());
        }
      cuda_ops::attention(q, kc, vc, batch, hs.h, hs.kv, hs.hd, slots, ctx, got);
      CAPTURE(hs.hd);
      CAPTURE(T);
      // Prefill batches of head sizes 64-256 go through the tensor cores, and
      // so do decode batches of grouped-query heads (2-16 a KV head): queries
      // and softmax weights in f16 (as llama.cpp's flash attention), sums in
      // f32. Everything else is f32 throughout.
      const bool tensor_hd = hs.hd == 64 || hs.hd == 128 || hs.hd == 256;
      const int group = hs.h / hs.kv;
      const bool deep_decode = T == 2 && tensor_hd && group >= 2 && group <= 16;
      CHECK(cuda_ops::decode_mma(batch, hs.h, hs.kv, hs.hd) == deep_decode);
      const bool mma = tensor_hd && (T > 8 || deep_decode);
      CHECK(rel_err(got, want) < (mma ? 2e-3 : 1e-5));
      if (tensor_hd && T > 8) CHECK(cuda_ops::prefill_splits(batch, hs.h, hs.hd) > 1);
    }
  }
}

TEST_CASE("cuda: a q8_0 cache stores the CPU's blocks, and its attention matches the CPU kernel" * needs_gpu()) {
  std::mt19937 rng(13);
  struct Heads { int h, kv, hd; };
  for (Heads hs : {Heads{32, 8, 128}, Heads{16, 16, 64}, Heads{8, 2, 256}}) {
    const int64_t slots = 2, ctx = 2048, kvd = int64_t(hs.kv) * hs.hd, qd = int64_t(hs.h) * hs.hd;
    // Fill both slots' caches through the store kernel, 256 positions a call.
    cuda_ops::Q8Cache kc{std::vector<int8_t>(size_t(slots * ctx * kvd)), std::vector<uint16_t>(size_t(slots * ctx * kvd / 32))};
    cuda_ops::Q8Cache vc = kc;
    std::vector<uint8_t> cpu_k(size_t(slots * ctx * kvd / 32 * 34)), cpu_v(cpu_k.size());
    for (int64_t slot = 0; slot < slots; ++slot)
      for (int64_t p0 = 0; p0 < ctx; p0 += 256) {
        std::vector<BatchToken> batch;
        for (int64_t p = p0; p < p0 + 256; ++p) batch.push_back(BatchToken{0, int32_t(slot), int32_t(p), -1});
        auto k = random_floats(size_t(256 * kvd), rng), v = random_floats(size_t(256 * kvd), rng);
        if (p0 == 0) std::fill_n(k.begin(), 32, 0.0f);  // an all-zero block
        cuda_ops::store_kv_q8(k, v, batch, int(kvd), ctx, kc, vc);
        for (int64_t t = 0; t < 256; ++t) {
          const int64_t row = (slot * ctx + p0 + t) * kvd / 32 * 34;
          cpu::store_kv_q8(cpu::cpu_kernels(), k.data() + t * kvd, kvd, cpu_k.data() + row);
          cpu::store_kv_q8(cpu::cpu_kernels(), v.data() + t * kvd, kvd, cpu_v.data() + row);
        }
      }
    // The device's blocks are the CPU's, bit for bit (values and scales).
    for (const auto& [dev, host] : {std::pair{&kc, &cpu_k}, std::pair{&vc, &cpu_v}}) {
      size_t bad = 0;
      for (size_t b = 0; b < dev->d.size(); ++b) {
        uint16_t d;
        std::memcpy(&d, host->data() + b * 34, 2);
        bad += d != dev->d[b] || std::memcmp(host->data() + b * 34 + 2, dev->q.data() + b * 32, 32) != 0;
      }
      CHECK_MESSAGE(bad == 0, bad << " blocks differ from the CPU's");
    }
    for (int64_t T : {1, 3, 200}) {
      std::vector<BatchToken> batch;
      for (int64_t t = 0; t < T; ++t)
        batch.push_back(T == 200 ? BatchToken{0, 1, int32_t(1800 + t), -1}
                                 : BatchToken{0, int32_t(t % 2), int32_t(t == 0 ? 0 : t == 1 ? ctx - 1 : (rng() % ctx)), -1});
      const auto q = random_floats(size_t(T * qd), rng);
      std::vector<float> want(size_t(T * qd)), got, scores(static_cast<size_t>(cpu::kAttendTile));
      const float scale = 1.0f / std::sqrt(float(hs.hd));
      for (int64_t t = 0; t < T; ++t)
        for (int h = 0; h < hs.h; ++h) {
          const int kvh = h / (hs.h / hs.kv);
          const int64_t at = (batch[t].slot * ctx * kvd + kvh * hs.hd) / 32 * 34, row = kvd / 32 * 34;
          cpu::cpu_kernels().attend(q.data() + t * qd + h * hs.hd, {cpu_k.data() + at, KvType::q8_0, row},
                                    {cpu_v.data() + at, KvType::q8_0, row}, batch[t].pos + 1, hs.hd, scale,
                                    want.data() + t * qd + h * hs.hd, scores.data());
        }
      cuda_ops::attention_q8(q, kc, vc, batch, hs.h, hs.kv, hs.hd, ctx, got);
      CAPTURE(hs.hd);
      CAPTURE(T);
      // The prefill chunk goes through the tensor cores, the values as f16.
      CHECK(rel_err(got, want) < (T > 8 ? 2e-3 : 1e-5));
    }
  }
}

TEST_CASE("cuda: SwiGLU matches the CPU formula" * needs_gpu()) {
  std::mt19937 rng(13);
  auto g = random_floats(14336, rng, 4.0f);
  const auto u = random_floats(g.size(), rng);
  std::vector<float> want(g.size());
  for (size_t i = 0; i < g.size(); ++i) want[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
  cuda_ops::swiglu(g, u);
  CHECK(rel_err(g, want) < 1e-6);
}

// --- end to end on stories260K -----------------------------------------------

namespace {

const std::string kModel = std::string(DS4_SHARED_MODELS) + "/stories260K.gguf";

struct Fixture {
  gguf::File file = gguf::File::open(kModel);
  Model model = Model::bind_file(file);
  Tokenizer tok = Tokenizer::from_gguf(file);
};

Fixture& fixture() {
  static Fixture f;
  return f;
}

struct Collect : RequestSink {
  std::vector<int32_t> tokens;
  Finish reason = Finish::error;
  std::string error;
  void on_token(int64_t, const Sampled& s) override { tokens.push_back(s.token); }
  void on_done(Finish r, const Timings&, const std::string& e) override {
    reason = r;
    error = e;
  }
};

/// Greedy continuations of all prompts, run together on one engine
/// (`reserved`: b.reserve(shape) was already called).
std::vector<std::vector<int32_t>> generate(Backend& b, const EngineShape& shape, const std::vector<std::string>& prompts,
                                           int n, bool reserved = false) {
  Fixture& f = fixture();
  if (!reserved) b.reserve(shape);
  Engine engine(b, f.model.hp(), f.tok.eos(), shape);
  std::vector<std::shared_ptr<Collect>> sinks;
  for (const auto& p : prompts) {
    GenerateRequest r;
    r.prompt = f.tok.encode(p, true);
    r.max_tokens = n;
    r.sampling.temperature = 0;
    r.ignore_eos = true;
    sinks.push_back(std::make_shared<Collect>());
    engine.submit(r, sinks.back());
  }
  engine.run_until_idle();
  std::vector<std::vector<int32_t>> out;
  for (auto& s : sinks) {
    CHECK(s->error == "");
    out.push_back(s->tokens);
  }
  return out;
}

/// The CPU backend's greedy continuation of each prompt, alone: the reference.
std::vector<std::vector<int32_t>> cpu_greedy(const std::vector<std::string>& prompts, int ctx, int n) {
  auto cpu = make_cpu_backend(fixture().model, 2);
  std::vector<std::vector<int32_t>> out;
  for (const auto& p : prompts) out.push_back(generate(*cpu, {ctx, 1, 64}, {p}, n)[0]);
  return out;
}

/// A prompt's prefill batch in `slot`: logits for its last token only (row 0).
std::vector<BatchToken> prefill_batch(const std::vector<int32_t>& toks, int32_t slot) {
  std::vector<BatchToken> b;
  for (size_t p = 0; p < toks.size(); ++p) b.push_back({toks[p], slot, int32_t(p), p + 1 == toks.size() ? 0 : -1});
  return b;
}

}  // namespace

TEST_CASE("cuda: stories260K logits agree with the CPU backend, prefill and decode" * needs_gpu()) {
  Fixture& f = fixture();
  auto cpu = make_cpu_backend(f.model, 2);
  auto gpu = make_cuda_backend(f.model, 0);
  const EngineShape shape{256, 2, 64};
  cpu->reserve(shape);
  gpu->reserve(shape);
  const std::vector<int32_t> toks = f.tok.encode("Once upon a time, there was a little dog named Max who", true);
  const std::vector<BatchToken> prefill = prefill_batch(toks, 1);
  const int64_t V = f.model.hp().n_vocab;
  auto compare = [&](std::span<const BatchToken> batch, int rows) {
    cpu->forward(batch);
    gpu->forward(batch);
    for (int r = 0; r < rows; ++r) {
      const auto a = gpu->logits(r), b = cpu->logits(r);
      CAPTURE(r);
      CHECK(rel_err(a.data(), b.data(), size_t(V)) < 1e-4);
    }
  };
  compare(prefill, 1);  // cuBLAS
  for (int i = 0; i < 12; ++i) {  // decode steps (GEMV, CUDA graph), two slots in one batch
    const BatchToken step[2] = {{toks[size_t(i)], 0, int32_t(i), 0}, {toks[size_t(i) % 5], 1, int32_t(toks.size()) + i, 1}};
    compare(step, 2);
  }
}

TEST_CASE("cuda: stories260K greedy tokens are identical to the CPU backend's, alone and batched" * needs_gpu()) {
  Fixture& f = fixture();
  const std::vector<std::string> prompts{"Once upon a time", "The cat sat on the mat and", "Lily and Ben went",
                                         "One day, a big red ball"};
  const auto cpu_out = cpu_greedy(prompts, 512, 100);
  auto gpu = make_cuda_backend(f.model, 0);
  for (size_t i = 0; i < prompts.size(); ++i) {
    CAPTURE(prompts[i]);
    CHECK(generate(*gpu, {512, 1, 64}, {prompts[i]}, 100)[0] == cpu_out[i]);
  }
  auto gpu2 = make_cuda_backend(f.model, 0);
  const auto batched = generate(*gpu2, {512, 4, 16}, prompts, 100);  // 4 slots, chunked prefill
  for (size_t i = 0; i < prompts.size(); ++i) {
    CAPTURE(prompts[i]);
    CHECK(batched[i] == cpu_out[i]);
  }
}

namespace {

/// A small model of one architecture's variations with seeded random
/// weights (matrices of `type`, vectors f32), written with GGUF's names.
struct ArchCase {
  const char* name;
  std::string arch = "llama";
  uint32_t heads = 4, kv_heads = 2, head_dim = 0, rot = 0;  // 0: dim / heads, the whole head
  bool bias = false, qk_norm = false, rope_freqs = false, tied = false;
  float rope_scale = 0;  // linear rope.scaling.factor (0: none)
  GgmlType type = GgmlType::F16;
  uint32_t experts = 0, experts_used = 2, expert_ff = 64;  // a mixture of experts when experts > 0
  bool shared_expert = false;                              // qwen2moe's, of size ff
};

struct ArchModel {
  std::vector<uint8_t> bytes;
  gguf::File file;
  Model model;
};

std::unique_ptr<ArchModel> arch_model(const ArchCase& c) {
  constexpr uint32_t dim = 128, layers = 2, ff = 256, vocab = 96;
  std::mt19937 rng(21);
  std::normal_distribution<float> nd(0.f, 1.f);
  gguf::Writer w;
  const std::string p = c.arch + ".";
  w.set_string("general.architecture", c.arch);
  w.set_u32(p + "embedding_length", dim);
  w.set_u32(p + "block_count", layers);
  w.set_u32(p + "feed_forward_length", ff);
  w.set_u32(p + "attention.head_count", c.heads);
  w.set_u32(p + "attention.head_count_kv", c.kv_heads);
  w.set_u32(p + "context_length", 512);
  const uint32_t hd = c.head_dim ? c.head_dim : dim / c.heads, rot = c.rot ? c.rot : hd;
  if (c.head_dim) {
    w.set_u32(p + "attention.key_length", hd);
    w.set_u32(p + "attention.value_length", hd);
  }
  if (c.rot) w.set_u32(p + "rope.dimension_count", rot);
  if (c.experts) {
    w.set_u32(p + "expert_count", c.experts);
    w.set_u32(p + "expert_used_count", c.experts_used);
    w.set_u32(p + "expert_feed_forward_length", c.expert_ff);
  }
  if (c.rope_scale > 0) {
    w.set_string(p + "rope.scaling.type", "linear");
    w.set_f32(p + "rope.scaling.factor", c.rope_scale);
  }
  std::vector<std::string> toks;
  for (uint32_t i = 0; i < vocab; ++i) toks.push_back("t" + std::to_string(i));
  w.set_string_array("tokenizer.ggml.tokens", toks);
  auto vec = [&](const std::string& name, uint64_t n, float base, float sd) {
    std::vector<uint8_t> b(n * 4);
    for (uint64_t i = 0; i < n; ++i) {
      const float v = base + sd * nd(rng);
      std::memcpy(b.data() + 4 * i, &v, 4);
    }
    w.add_tensor(name, {n}, GgmlType::F32, std::move(b));
  };
  // Rows of K values with a spread of sd: f16, or Q8_0 blocks of them.
  // A stack of E such matrices (a layer's experts) when E > 1.
  auto mat = [&](const std::string& name, uint64_t K, uint64_t N, float sd, uint64_t E = 1) {
    const GgmlType t = c.type;
    std::vector<uint8_t> b(size_t(cpu::row_bytes(t, int64_t(K)) * N * E));
    for (uint64_t n = 0; n < N * E; ++n) {
      uint8_t* row = b.data() + n * cpu::row_bytes(t, int64_t(K));
      std::vector<float> x(K);
      for (float& v : x) v = sd * nd(rng);
      if (t == GgmlType::F16) {
        for (uint64_t k = 0; k < K; ++k) {
          const uint16_t h = fp32_to_fp16(x[k]);
          std::memcpy(row + 2 * k, &h, 2);
        }
        continue;
      }
      if (t == GgmlType::Q4_0) {  // as llama.cpp's quantize_row_q4_0: d = the signed extreme / -8
        auto* q4 = reinterpret_cast<cpu::BlockQ4_0*>(row);
        for (uint64_t i = 0; i < K / 32; ++i) {
          float amax = 0, mx = 0;
          for (int j = 0; j < 32; ++j)
            if (std::abs(x[i * 32 + j]) > amax) {
              amax = std::abs(x[i * 32 + j]);
              mx = x[i * 32 + j];
            }
          const float d = mx / -8.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
          q4[i].d = fp32_to_fp16(d);
          for (int j = 0; j < 16; ++j) {
            const int lo = std::min(15, int(x[i * 32 + j] * id + 8.5f));
            const int hi = std::min(15, int(x[i * 32 + 16 + j] * id + 8.5f));
            q4[i].qs[j] = uint8_t(lo | (hi << 4));
          }
        }
        continue;
      }
      auto* blk = reinterpret_cast<BlockQ8_0*>(row);
      for (uint64_t i = 0; i < K / 32; ++i) {
        float amax = 0;
        for (int j = 0; j < 32; ++j) amax = std::max(amax, std::abs(x[i * 32 + j]));
        const float d = amax / 127.0f;
        blk[i].d = fp32_to_fp16(d);
        for (int j = 0; j < 32; ++j) blk[i].qs[j] = int8_t(std::lround(d > 0 ? x[i * 32 + j] / d : 0.0f));
      }
    }
    if (E > 1)
      w.add_tensor(name, {K, N, E}, t, std::move(b));
    else
      w.add_tensor(name, {K, N}, t, std::move(b));
  };
  auto router = [&](const std::string& name, uint64_t K, uint64_t N, float sd) {  // F32, as llama.cpp keeps it
    std::vector<uint8_t> b(K * N * 4);
    for (uint64_t i = 0; i < K * N; ++i) {
      const float v = sd * nd(rng);
      std::memcpy(b.data() + 4 * i, &v, 4);
    }
    w.add_tensor(name, {K, N}, GgmlType::F32, std::move(b));
  };
  const uint64_t q = uint64_t(c.heads) * hd, kv = uint64_t(c.kv_heads) * hd;
  mat("token_embd.weight", dim, vocab, 1.0f);
  vec("output_norm.weight", dim, 1.0f, 0.1f);
  if (!c.tied) mat("output.weight", dim, vocab, 0.3f);
  if (c.rope_freqs) {
    std::vector<uint8_t> b(rot / 2 * 4);
    for (uint32_t i = 0; i < rot / 2; ++i) {
      const float f = 1.0f + 0.5f * float(i % 9);
      std::memcpy(b.data() + 4 * i, &f, 4);
    }
    w.add_tensor("rope_freqs.weight", {rot / 2}, GgmlType::F32, std::move(b));
  }
  for (uint32_t l = 0; l < layers; ++l) {
    const std::string b = "blk." + std::to_string(l) + ".";
    vec(b + "attn_norm.weight", dim, 1.0f, 0.1f);
    mat(b + "attn_q.weight", dim, q, 0.15f);
    mat(b + "attn_k.weight", dim, kv, 0.15f);
    mat(b + "attn_v.weight", dim, kv, 0.15f);
    if (c.bias) {
      vec(b + "attn_q.bias", q, 0.0f, 0.5f);
      vec(b + "attn_k.bias", kv, 0.0f, 0.5f);
      vec(b + "attn_v.bias", kv, 0.0f, 0.5f);
    }
    if (c.qk_norm) {
      vec(b + "attn_q_norm.weight", hd, 1.0f, 0.2f);
      vec(b + "attn_k_norm.weight", hd, 1.0f, 0.2f);
    }
    mat(b + "attn_output.weight", q, dim, 0.1f);
    vec(b + "ffn_norm.weight", dim, 1.0f, 0.1f);
    if (c.experts) {
      router(b + "ffn_gate_inp.weight", dim, c.experts, 0.2f);
      mat(b + "ffn_gate_exps.weight", dim, c.expert_ff, 0.1f, c.experts);
      mat(b + "ffn_up_exps.weight", dim, c.expert_ff, 0.1f, c.experts);
      mat(b + "ffn_down_exps.weight", c.expert_ff, dim, 0.12f, c.experts);
      if (c.shared_expert) {
        vec(b + "ffn_gate_inp_shexp.weight", dim, 0.0f, 0.1f);
        mat(b + "ffn_gate_shexp.weight", dim, ff, 0.1f);
        mat(b + "ffn_up_shexp.weight", dim, ff, 0.1f);
        mat(b + "ffn_down_shexp.weight", ff, dim, 0.08f);
      }
      continue;
    }
    mat(b + "ffn_gate.weight", dim, ff, 0.1f);
    mat(b + "ffn_up.weight", dim, ff, 0.1f);
    mat(b + "ffn_down.weight", ff, dim, 0.08f);
  }
  auto m = std::make_unique<ArchModel>();
  m->bytes = w.to_bytes();
  m->file = gguf::File::parse(m->bytes, std::string(c.name) + ".gguf");
  m->model = Model::bind_file(m->file);
  return m;
}

/// The greedy pick of a logit row and its margin over the runner-up.
struct Pick {
  int32_t token;
  float margin;
};
Pick greedy_pick(std::span<const float> l) {
  const int32_t best = int32_t(std::max_element(l.begin(), l.end()) - l.begin());
  float second = -INFINITY;
  for (size_t i = 0; i < l.size(); ++i)
    if (int32_t(i) != best) second = std::max(second, l[i]);
  return {best, l[size_t(best)] - second};
}

/// Greedy continuation of `prompt` (slot 0): the prefill as one step, then
/// one token a step.
std::vector<Pick> greedy_ids(Backend& b, const std::vector<int32_t>& prompt, int n) {
  std::vector<BatchToken> pre;
  for (size_t i = 0; i < prompt.size(); ++i)
    pre.push_back({prompt[i], 0, int32_t(i), i + 1 == prompt.size() ? 0 : -1});
  b.forward(pre);
  std::vector<Pick> out{greedy_pick(b.logits(0))};
  for (int i = 1; i < n; ++i) {
    const BatchToken step{out.back().token, 0, int32_t(prompt.size()) + i - 1, 0};
    b.forward({&step, 1});
    out.push_back(greedy_pick(b.logits(0)));
  }
  return out;
}

/// The picks of `b` along another engine's greedy path (`path`, after
/// `prompt`): step i is fed path[i - 1], so one near tie does not end the
/// comparison of the steps after it.
std::vector<Pick> picks_along(Backend& b, const std::vector<int32_t>& prompt, const std::vector<Pick>& path) {
  std::vector<BatchToken> pre;
  for (size_t i = 0; i < prompt.size(); ++i)
    pre.push_back({prompt[i], 0, int32_t(i), i + 1 == prompt.size() ? 0 : -1});
  b.forward(pre);
  std::vector<Pick> out{greedy_pick(b.logits(0))};
  for (size_t i = 1; i < path.size(); ++i) {
    const BatchToken step{path[i - 1].token, 0, int32_t(prompt.size() + i - 1), 0};
    b.forward({&step, 1});
    out.push_back(greedy_pick(b.logits(0)));
  }
  return out;
}

}  // namespace

TEST_CASE("cuda: under a grammar (eager and lazy), greedy and sampled answers are the CPU backend's" * needs_gpu()) {
  Fixture& f = fixture();
  auto table = TokenTable::from_model(f.file, f.tok);
  // The GPU's greedy pick is tried against the grammar first, the row
  // fetched only when the grammar refuses it: the same tokens as the CPU's.
  struct Case {
    std::string grammar;
    std::vector<GrammarTrigger> triggers;
    float temperature;
  };
  const std::string object = R"(root ::= "{" ws "\"name\":" ws "\"" [a-z]{1,8} "\"" ws "}"
ws ::= [ ]?)";
  const std::vector<Case> cases{{object, {}, 0.0f},
                                {object, {}, 1.0f},
                                {R"(root ::= " was " ("happy" | "sad") ".")", {{" was", false}}, 0.0f},
                                {R"(root ::= " was " ("happy" | "sad") ".")", {{" was", false}}, 1.0f}};
  auto run = [&](Backend& b, const Case& c, uint64_t seed) {
    const EngineShape shape{256, 1, 32};
    b.reserve(shape);
    Engine engine(b, f.model.hp(), f.tok.eos(), shape);
    engine.set_token_table(table);
    GenerateRequest r;
    r.prompt = f.tok.encode("Once upon a time", true);
    r.max_tokens = 60;
    r.sampling.temperature = c.temperature;
    r.sampling.seed = seed;
    r.grammar = c.grammar;
    r.grammar_triggers = c.triggers;
    auto sink = std::make_shared<Collect>();
    engine.submit(r, sink);
    engine.run_until_idle();
    CHECK(sink->error == "");
    return sink->tokens;
  };
  auto cpu = make_cpu_backend(f.model, 2);
  auto gpu = make_cuda_backend(f.model, 0);
  for (size_t k = 0; k < cases.size(); ++k)
    for (uint64_t seed : {1u, 2u}) {
      CAPTURE(k);
      CAPTURE(seed);
      const auto want = run(*cpu, cases[k], seed);
      CHECK_FALSE(want.empty());
      CHECK(run(*gpu, cases[k], seed) == want);
    }
}

TEST_CASE("cuda: every architecture's variations give the CPU backend's logits and greedy tokens" * needs_gpu()) {
  const std::vector<ArchCase> cases = {
      {.name = "llama3 (rope_freqs, linear scaling, GQA)", .rope_freqs = true, .rope_scale = 2.0f},
      {.name = "llama, RoPE over half of each head", .heads = 4, .kv_heads = 4, .rot = 16},
      {.name = "qwen2 (QKV bias, NEOX)", .arch = "qwen2", .bias = true},
      {.name = "qwen3 (Q/K norm, head 64 != 128 / 4, NEOX)", .arch = "qwen3", .head_dim = 64, .qk_norm = true},
      {.name = "qwen3 Q8_0", .arch = "qwen3", .head_dim = 64, .qk_norm = true, .type = GgmlType::Q8_0},
      {.name = "tied embeddings", .tied = true},
      {.name = "tied Q8_0, qwen2", .arch = "qwen2", .bias = true, .tied = true, .type = GgmlType::Q8_0},
      {.name = "qwen3moe (8 experts, 2 a token)", .arch = "qwen3moe", .head_dim = 64, .qk_norm = true, .experts = 8},
      {.name = "qwen2moe Q8_0 (a shared expert)", .arch = "qwen2moe", .bias = true, .type = GgmlType::Q8_0,
       .experts = 8, .shared_expert = true},
      // Block-quantised experts: decode steps routed on the device (expert GEMV, graphs).
      {.name = "qwen3moe Q4_0 (routed on the device)", .arch = "qwen3moe", .head_dim = 64, .qk_norm = true,
       .type = GgmlType::Q4_0, .experts = 8},
      {.name = "qwen2moe Q4_0 (routed on the device, a shared expert)", .arch = "qwen2moe", .bias = true,
       .type = GgmlType::Q4_0, .experts = 8, .shared_expert = true},
  };
  for (const ArchCase& c : cases) {
    const std::string name = c.name;
    CAPTURE(name);
    // How far apart two correct engines' logits may be. F16 weights: the GPU's
    // prefill products take f16 activations (cuBLAS), the CPU keeps f32.
    // Q8_0: the CPU rounds activations to 8 bits a block of 32 (as llama.cpp
    // does), the GPU multiplies f32 activations: errors of about 1e-2. Q4_0:
    // both round activations to 8 bits, each its own way.
    const bool q8 = c.type != GgmlType::F16;
    const double tol = q8 ? 4e-2 : 3e-3;
    const float near_tie = q8 ? 0.25f : 0.03f;  // logits: where the greedy answers may part
    auto m = arch_model(c);
    const HParams& hp = m->model.hp();
    CHECK(cuda_unsupported(hp) == "");
    auto cpu = make_cpu_backend(m->model, 2);
    auto gpu = make_cuda_backend(m->model, 0);
    const EngineShape shape{256, 2, 64};
    cpu->reserve(shape);
    gpu->reserve(shape);
    std::vector<int32_t> prompt;
    for (int i = 0; i < 23; ++i) prompt.push_back(int32_t((i * 37 + 5) % hp.n_vocab));
    std::vector<BatchToken> prefill;  // 23 tokens on slot 1: cuBLAS products, tiled attention
    for (size_t p = 0; p < prompt.size(); ++p)
      prefill.push_back({prompt[p], 1, int32_t(p), p + 1 == prompt.size() ? 0 : -1});
    auto compare = [&](std::span<const BatchToken> batch, int rows, const char* what) {
      cpu->forward(batch);
      gpu->forward(batch);
      for (int r = 0; r < rows; ++r) {
        const auto a = gpu->logits(r), b = cpu->logits(r);
        const std::string step = what;
        CAPTURE(step);
        CAPTURE(r);
        CHECK(rel_err(a.data(), b.data(), size_t(hp.n_vocab)) < tol);
      }
    };
    compare(prefill, 1, "prefill");
    for (int i = 0; i < 6; ++i) {  // decode steps of two slots (GEMV, CUDA graph)
      const BatchToken step[2] = {{prompt[size_t(i)], 0, int32_t(i), 0},
                                  {prompt[size_t(i) % 5], 1, int32_t(prompt.size()) + i, 1}};
      compare(step, 2, "decode");
    }
    auto cpu1 = make_cpu_backend(m->model, 2);
    auto gpu1 = make_cuda_backend(m->model, 0);
    cpu1->reserve({256, 1, 64});
    gpu1->reserve({256, 1, 64});
    const auto want = greedy_ids(*cpu1, prompt, 24), got = greedy_ids(*gpu1, prompt, 24);
    size_t same = 0;
    while (same < want.size() && got[same].token == want[same].token) ++same;
    CAPTURE(same);
    if (same < want.size()) {
      MESSAGE(name << ": greedy parts from the CPU's at token " << same << ", the CPU's margin there "
                   << want[same].margin);
      CHECK(want[same].margin < near_tie);  // parted only at the CPU's own near tie
    }
    // Along the CPU's path, every pick is the CPU's but at its own near ties.
    auto gpu2 = make_cuda_backend(m->model, 0);
    gpu2->reserve({256, 1, 64});
    const auto along = picks_along(*gpu2, prompt, want);
    int agree = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      CAPTURE(i);
      if (along[i].token == want[i].token) ++agree;
      else CHECK(want[i].margin < near_tie);
    }
    CHECK(agree >= int(want.size()) * 3 / 4);
  }
}

TEST_CASE("cuda: MoE decode steps routed on the device (captured as graphs) give the host-routed steps' logits, "
          "and two expert launches a step give four launches' bits" * needs_gpu()) {
  for (const ArchCase& c : {ArchCase{.name = "qwen3moe Q4_0", .arch = "qwen3moe", .head_dim = 64, .qk_norm = true,
                                     .type = GgmlType::Q4_0, .experts = 8},
                            ArchCase{.name = "qwen2moe Q4_0", .arch = "qwen2moe", .bias = true, .type = GgmlType::Q4_0,
                                     .experts = 8, .shared_expert = true}}) {
    const std::string name = c.name;
    CAPTURE(name);
    auto m = arch_model(c);
    const HParams& hp = m->model.hp();
    auto device = make_cuda_backend(m->model, 0);
    setenv("DS4_CUDA_MOE_HOST_ROUTES", "1", 1);  // the step that brings the scores to the host
    auto host = make_cuda_backend(m->model, 0);
    unsetenv("DS4_CUDA_MOE_HOST_ROUTES");
    setenv("DS4_CUDA_MOE_FUSE", "0", 1);  // gate, up, SwiGLU and down each a launch
    auto unfused = make_cuda_backend(m->model, 0);
    unsetenv("DS4_CUDA_MOE_FUSE");
    const EngineShape shape{256, 4, 64};
    device->reserve(shape);
    host->reserve(shape);
    unfused->reserve(shape);
    std::vector<BatchToken> prefill;
    for (int i = 0; i < 19; ++i) prefill.push_back({int32_t((i * 29 + 3) % hp.n_vocab), 3, int32_t(i), i == 18 ? 0 : -1});
    device->forward(prefill);
    host->forward(prefill);
    unfused->forward(prefill);
    CHECK(rel_err(device->logits(0).data(), host->logits(0).data(), size_t(hp.n_vocab)) < 1e-4);
    for (int i = 0; i < 6; ++i) {  // 1, 2 and 4 tokens a step: graphs of each shape, replayed
      std::vector<BatchToken> step;
      const int n = i < 2 ? 1 : i < 4 ? 2 : 4;
      for (int sl = 0; sl < n; ++sl) step.push_back({int32_t((i * 7 + sl * 13) % hp.n_vocab), sl, int32_t(19 + i), sl});
      device->forward(step);
      host->forward(step);
      unfused->forward(step);
      for (int r = 0; r < n; ++r) {
        CAPTURE(i);
        CAPTURE(r);
        CHECK(rel_err(device->logits(r).data(), host->logits(r).data(), size_t(hp.n_vocab)) < 1e-4);
        CHECK(device->greedy(r)->token == host->greedy(r)->token);
        // The same SwiGLU expression (silu_mul) before the same quantisation: the same bits.
        const auto fused_logits = device->logits(r), unfused_logits = unfused->logits(r);
        CHECK(std::memcmp(fused_logits.data(), unfused_logits.data(), size_t(hp.n_vocab) * 4) == 0);
      }
    }
  }
}

TEST_CASE("cuda: a MoE prefill's expert tiles and groups (one launch a matrix) give the per-expert products' logits" * needs_gpu()) {
  for (const ArchCase& c : {ArchCase{.name = "qwen3moe Q4_0", .arch = "qwen3moe", .head_dim = 64, .qk_norm = true,
                                     .type = GgmlType::Q4_0, .experts = 8},
                            ArchCase{.name = "qwen2moe Q4_0", .arch = "qwen2moe", .bias = true, .type = GgmlType::Q4_0,
                                     .experts = 8, .shared_expert = true}}) {
    const std::string name = c.name;
    CAPTURE(name);
    auto m = arch_model(c);
    const HParams& hp = m->model.hp();
    auto cpu = make_cpu_backend(m->model, 2);
    const EngineShape shape{256, 2, 160};
    cpu->reserve(shape);
    // 150 tokens: each expert's rows in tiles of 64 (groups of 8) and a
    // shorter last one, over two slots' prompts in one batch.
    std::vector<BatchToken> prefill;
    for (int i = 0; i < 150; ++i)
      prefill.push_back({int32_t((i * 41 + 7) % hp.n_vocab), i % 2, int32_t(i / 2), i >= 148 ? i - 148 : -1});
    cpu->forward(prefill);
    // Each way: tiles of up to 64 rows through the tiled GEMM (the default),
    // groups of up to 8 rows through the GEMV body, and each expert's rows
    // through its own cuBLAS GEMMs (the two ways before).
    std::map<std::string, std::vector<std::vector<float>>> logits;
    for (const char* how : {"tiles", "groups", "each"}) {
      auto gpu = make_cuda_backend(m->model, 0);
      gpu->reserve(shape);
      setenv("DS4_CUDA_MOE_PREFILL", how, 1);
      gpu->forward(prefill);
      unsetenv("DS4_CUDA_MOE_PREFILL");
      for (int r = 0; r < 2; ++r) {
        const auto l = gpu->logits(r);
        logits[how].emplace_back(l.begin(), l.end());
      }
    }
    for (int r = 0; r < 2; ++r) {
      CAPTURE(r);
      const float* want = cpu->logits(r).data();
      const double tiles = rel_err(logits["tiles"][size_t(r)].data(), want, size_t(hp.n_vocab)),
                   groups = rel_err(logits["groups"][size_t(r)].data(), want, size_t(hp.n_vocab)),
                   each = rel_err(logits["each"][size_t(r)].data(), want, size_t(hp.n_vocab));
      MESSAGE(name << " row " << r << ": against the CPU, tiles " << tiles << ", groups " << groups
                   << ", each expert " << each);
      // Each rounds activations its own way (f16 for tiles and each, int8
      // blocks for groups): the architecture cases' quantised tolerance
      // against the CPU, and as close to the CPU as the ways before, within a third.
      CHECK(tiles < 4e-2);
      CHECK(groups < 4e-2);
      CHECK(each < 4e-2);
      CHECK(tiles < each * 1.33 + 1e-3);
      CHECK(groups < each * 1.33 + 1e-3);
    }
  }
}

TEST_CASE("cuda: a batch mixing one slot's prompt with other slots' decode tokens gives the CPU backend's logits" * needs_gpu()) {
  auto m = arch_model(ArchCase{.name = "llama Q8_0 mixed", .type = GgmlType::Q8_0});
  const HParams& hp = m->model.hp();
  const EngineShape shape{256, 6, 64};
  auto cpu = make_cpu_backend(m->model, 2);
  cpu->reserve(shape);
  setenv("DS4_CUDA_MIXED_ATTN", "0", 1);  // the whole batch through the prefill kernel (the way before)
  auto one_launch = make_cuda_backend(m->model, 0);
  unsetenv("DS4_CUDA_MIXED_ATTN");
  auto gpu = make_cuda_backend(m->model, 0);
  one_launch->reserve(shape);
  gpu->reserve(shape);
  // Slots 0-5 each get a prompt of their own length first.
  for (int sl = 0; sl < 6; ++sl) {
    std::vector<BatchToken> prompt;
    for (int i = 0; i < 10 + 7 * sl; ++i) prompt.push_back({int32_t((i * 13 + sl * 5) % hp.n_vocab), sl, i, -1});
    for (Backend* b : {cpu.get(), one_launch.get(), gpu.get()}) b->forward(prompt);
  }
  // Then one step: two decode tokens, 20 more tokens of slot 0's prompt (the
  // prefill kernel), two decode tokens and a short run of slot 5 (the decode
  // kernel); the logits of each slot's last token read.
  std::vector<BatchToken> mixed;
  int row = 0;
  mixed.push_back({7, 1, 17, row++});
  mixed.push_back({9, 2, 24, row++});
  for (int i = 0; i < 20; ++i) mixed.push_back({int32_t((i * 11 + 3) % hp.n_vocab), 0, 10 + i, i == 19 ? row++ : -1});
  mixed.push_back({5, 3, 31, row++});
  mixed.push_back({6, 4, 38, row++});
  for (int i = 0; i < 3; ++i) mixed.push_back({int32_t(i + 1), 5, 45 + i, i == 2 ? row++ : -1});
  for (Backend* b : {cpu.get(), one_launch.get(), gpu.get()}) b->forward(mixed);
  for (int r = 0; r < row; ++r) {
    CAPTURE(r);
    const auto want = cpu->logits(r);
    const std::vector<float> w(want.begin(), want.end());
    const auto a = gpu->logits(r);
    const double split = rel_err(std::vector<float>(a.begin(), a.end()), w);
    const auto b = one_launch->logits(r);
    const double one = rel_err(std::vector<float>(b.begin(), b.end()), w);
    // The architecture cases' tolerance for quantised weights on the device.
    CHECK(split < 4e-2);
    CHECK(one < 4e-2);
  }
}

TEST_CASE("cuda: a head size the attention kernels do not take is named, so device auto runs it on the CPU") {
  ArchCase c{.name = "qwen3 head 48", .arch = "qwen3", .head_dim = 48, .qk_norm = true};
  auto m = arch_model(c);
  CHECK(cuda_unsupported(m->model.hp()) == "a head size of 48 (its attention takes 8, 16, 32, 64, 128 or 256)");
}

TEST_CASE("cuda: the backend refuses a head size its attention kernels do not take, naming it" * needs_gpu()) {
  ArchCase c{.name = "qwen3 head 48", .arch = "qwen3", .head_dim = 48, .qk_norm = true};
  auto m = arch_model(c);
  CHECK_THROWS_WITH(make_cuda_backend(m->model, 0),
                    doctest::Contains("CUDA backend: a head size of 48"));
}

TEST_CASE("cuda: work done while the GPU computes a step (set_during_step) leaves the answers unchanged" * needs_gpu()) {
  Fixture& f = fixture();
  const std::vector<std::string> prompts{"Once upon a time", "Lily and Ben went"};
  const auto cpu_out = cpu_greedy(prompts, 512, 100);
  auto gpu = make_cuda_backend(f.model, 0);
  int calls = 0;
  gpu->set_during_step([&] {
    ++calls;
    std::this_thread::sleep_for(std::chrono::microseconds(20));  // as long as a worker's socket reads
  });
  const auto out = generate(*gpu, {512, 2, 16}, prompts, 100);
  for (size_t i = 0; i < prompts.size(); ++i) {
    CAPTURE(prompts[i]);
    CHECK(out[i] == cpu_out[i]);
  }
  MESSAGE("during-step calls: " << calls);  // how many depends on how fast the GPU is
}

TEST_CASE("cuda: a step launched kernel by kernel reads between its layers, not only at its end" * needs_gpu()) {
  // A step not replayed from a graph (here: traced, and a prefill longer
  // than a graph takes) keeps the worker's thread launching for most of the
  // step; the requests that come meanwhile must be read between the layers.
  Fixture& f = fixture();
  auto gpu = make_cuda_backend(f.model, 0);
  gpu->reserve({128, 1, 32});
  std::vector<std::string> order;  // "l_out N" and "read", as they happen
  gpu->set_trace([&](std::string_view name, int layer, const float*, int64_t, int64_t, int64_t) {
    if (name == "l_out") order.push_back("l_out " + std::to_string(layer));
  });
  gpu->set_during_step([&] { order.push_back("read"); });
  const std::vector<int32_t> toks = f.tok.encode("Lily found a shiny stone in the garden and ran home to show", true);
  REQUIRE(toks.size() > 8);
  const std::vector<BatchToken> prefill = prefill_batch(toks, 0);
  gpu->forward(prefill);
  const int layers = int(f.model.hp().n_layers);
  REQUIRE(layers > 1);
  for (int l = 0; l + 1 < layers; ++l) {
    CAPTURE(l);
    const auto at = std::find(order.begin(), order.end(), "l_out " + std::to_string(l));
    const auto next = std::find(order.begin(), order.end(), "l_out " + std::to_string(l + 1));
    REQUIRE(at < next);
    CHECK(std::find(at, next, "read") != next);
  }
}

namespace {

/// What the process writes to stderr while `f` runs (the backend's warnings).
template <class F>
std::string stderr_of(F&& f) {
  char path[] = "/tmp/ds4-stderr.XXXXXX";
  const int tmp = mkstemp(path);
  REQUIRE(tmp >= 0);
  ::unlink(path);
  std::fflush(stderr);
  const int saved = ::dup(2);
  ::dup2(tmp, 2);
  f();
  std::fflush(stderr);
  ::dup2(saved, 2);
  ::close(saved);
  std::string out(size_t(::lseek(tmp, 0, SEEK_END)), '\0');
  if (::pread(tmp, out.data(), out.size(), 0) != ssize_t(out.size())) out.clear();
  ::close(tmp);
  return out;
}

}  // namespace

TEST_CASE("cuda: on a full GPU a step that would need a new graph runs without one, with the same tokens" * needs_gpu()) {
  // A worker's plan (KV cache, scratch) is reserved at start; a CUDA graph's
  // instantiation takes device memory outside it. Once the GPU has none, a
  // step of a shape not captured yet must launch kernel by kernel, not fail.
  Fixture& f = fixture();
  const std::vector<std::string> prompts{"Once upon a time", "Lily and Ben went"};
  const auto cpu_out = cpu_greedy(prompts, 256, 40);
  auto gpu = make_cuda_backend(f.model, 0);
  const EngineShape shape{256, 2, 64};
  gpu->reserve(shape);
  // Take every byte the device still gives, down to 4 KiB pieces.
  std::vector<void*> taken;
  size_t free = 0, total = 0;
  REQUIRE(cudaMemGetInfo(&free, &total) == cudaSuccess);
  for (size_t piece = free; piece >= 4096;) {
    void* p = nullptr;
    if (cudaMalloc(&p, piece) == cudaSuccess) {
      taken.push_back(p);
    } else {
      cudaGetLastError();
      piece /= 2;
    }
  }
  cudaMemGetInfo(&free, &total);
  std::vector<std::vector<int32_t>> out;
  const std::string said = stderr_of([&] { out = generate(*gpu, shape, prompts, 40, true); });
  for (void* p : taken) cudaFree(p);
  MESSAGE("device memory left while it ran: " << free / 1024 << " KiB; the backend said: " << said);
  CHECK(said.find("no device memory left for another CUDA graph") != std::string::npos);
  for (size_t i = 0; i < prompts.size(); ++i) {
    CAPTURE(prompts[i]);
    CHECK(out[i] == cpu_out[i]);
  }
}

TEST_CASE("cuda: greedy picks on the device are the host sampler's, with its log-probability" * needs_gpu()) {
  Fixture& f = fixture();
  auto cpu = make_cpu_backend(f.model, 2);
  auto gpu = make_cuda_backend(f.model, 0);
  const EngineShape shape{128, 2, 32};
  cpu->reserve(shape);
  gpu->reserve(shape);
  const std::vector<int32_t> toks = f.tok.encode("Lily found a shiny stone in the garden and", true);
  const std::vector<BatchToken> prefill = prefill_batch(toks, 0);
  SamplingParams greedy;
  greedy.temperature = 0;
  std::vector<float> scratch;
  auto compare = [&](std::span<const BatchToken> batch, int rows) {
    cpu->forward(batch);
    gpu->forward(batch);
    for (int r = 0; r < rows; ++r) {
      CAPTURE(r);
      const std::optional<TokenLogprob> picked = gpu->greedy(r);
      REQUIRE(picked.has_value());
      const Sampled on_host = sample(gpu->logits(r), greedy, 0, 0, scratch);
      const Sampled on_cpu = sample(cpu->logits(r), greedy, 0, 0, scratch);
      CHECK(picked->token == on_host.token);
      CHECK(picked->token == on_cpu.token);
      CHECK(std::fabs(picked->logprob - on_host.logprob) < 1e-5f);
    }
  };
  compare(prefill, 1);
  for (int i = 0; i < 8; ++i) {
    const BatchToken step[2] = {{toks[size_t(i)], 0, int32_t(toks.size()) + i, 0}, {toks[size_t(i) % 3], 1, i, 1}};
    compare(step, 2);
  }
  CHECK_FALSE(cpu->greedy(0).has_value());  // the CPU samples from its logits, as before
}

TEST_CASE("cuda: a row's best 64 logits found on the device are the host's ranking, with its log-sum-exp" * needs_gpu()) {
  std::mt19937_64 rng(5);
  std::normal_distribution<float> g(0.0f, 3.0f);
  for (const int64_t n : {int64_t(40), int64_t(5000), int64_t(128256), int64_t(300000)}) {
    CAPTURE(n);
    const int rows = 5;
    std::vector<float> logits(size_t(n * rows));
    for (float& x : logits) x = g(rng);
    // Ties, NaN and -inf near each row's best; one row's best at zero of either sign.
    for (int r = 0; r < rows; ++r) {
      float* row = logits.data() + r * n;
      if (r == 3) {
        for (int64_t i = 0; i < n; ++i) row[i] = -std::fabs(row[i]);
        for (int64_t i = 0; i < n; i += 7) row[i] = (i / 7) % 2 ? -0.0f : 0.0f;
      }
      const int64_t best = std::max_element(row, row + n) - row;
      for (int64_t i = 0; i < 20; ++i) row[(best + 97 * (i + 1)) % n] = row[best] - float(i % 4);
      row[(best + 5) % n] = std::numeric_limits<float>::quiet_NaN();
      row[(best + 6) % n] = -std::numeric_limits<float>::infinity();
    }
    const auto got = cuda_ops::top_logits(logits, n, rows);
    REQUIRE(got.size() == size_t(rows));
    for (int r = 0; r < rows; ++r) {
      CAPTURE(r);
      std::vector<LogitCandidate> want;
      for (int64_t i = 0; i < n; ++i) {
        const float x = logits[size_t(r * n + i)];
        want.push_back({std::isnan(x) ? -INFINITY : x, int32_t(i)});
      }
      std::stable_sort(want.begin(), want.end(), [](auto& a, auto& b) { return a.logit > b.logit; });
      double sum = 0;
      for (int64_t i = 0; i < n; ++i)
        if (!std::isnan(logits[size_t(r * n + i)])) sum += std::exp(double(logits[size_t(r * n + i)]) - want[0].logit);
      want.resize(std::min<size_t>(64, want.size()));
      REQUIRE(got[size_t(r)].first.size() == want.size());
      int same = 0;
      for (size_t i = 0; i < want.size(); ++i)
        same += got[size_t(r)].first[i].id == want[i].id && got[size_t(r)].first[i].logit == want[i].logit;
      CHECK(same == int(want.size()));
      CHECK(got[size_t(r)].second == doctest::Approx(double(want[0].logit) + std::log(sum)).epsilon(1e-9));
    }
  }
}

TEST_CASE("cuda: logit_bias and penalties are added on the device; greedy picks them, sampled rows are the CPU's" * needs_gpu()) {
  Fixture& f = fixture();
  auto cpu = make_cpu_backend(f.model, 2);
  auto gpu = make_cuda_backend(f.model, 0);
  const EngineShape shape{128, 4, 32};
  cpu->reserve(shape);
  gpu->reserve(shape);
  const std::vector<int32_t> toks = f.tok.encode("Lily found a shiny stone in the garden and", true);
  const std::vector<BatchToken> prefill = prefill_batch(toks, 0);
  cpu->forward(prefill);
  gpu->forward(prefill);
  const int32_t first = gpu->greedy(0)->token;
  SamplingParams greedy;
  greedy.temperature = 0;
  std::vector<float> scratch;
  // Row 0: its greedy token banned and another raised; row 1 untouched;
  // row 2: penalties over a made-up answer.
  SamplingParams ban = greedy, penal = greedy;
  ban.logit_bias = {{first, -100.f}, {42, 3.f}};
  penal.frequency_penalty = 2.0f;
  penal.presence_penalty = 1.0f;
  const std::vector<int32_t> answer{first, first, 42, 7};
  std::vector<LogitAdjust> adjust;
  std::vector<int32_t> s2;
  logit_adjustments(ban, {}, int32_t(f.model.hp().n_vocab), 0, adjust, s2);
  logit_adjustments(penal, answer, int32_t(f.model.hp().n_vocab), 2, adjust, s2);
  const BatchToken step[3] = {{toks[1], 0, int32_t(toks.size()), 0}, {toks[2], 1, 0, 1}, {toks[3], 2, 0, 2}};
  cpu->forward(step, adjust);
  gpu->forward(step, adjust);
  for (int r = 0; r < 3; ++r) {
    CAPTURE(r);
    const std::optional<TokenLogprob> picked = gpu->greedy(r);
    REQUIRE(picked.has_value());
    const Sampled on_host = sample(gpu->logits(r), greedy, 0, 0, scratch);  // the adjusted row
    const Sampled on_cpu = sample(cpu->logits(r), greedy, 0, 0, scratch);
    CHECK(picked->token == on_host.token);
    CHECK(picked->token == on_cpu.token);
    CHECK(std::fabs(picked->logprob - on_host.logprob) < 1e-5f);
  }
  CHECK(gpu->greedy(0)->token != first);
  CHECK(gpu->logits(0)[size_t(first)] < cpu->logits(1)[size_t(first)] - 50);
  // The same adjustments twice over the step's rows are refused, not written past them.
  const std::vector<LogitAdjust> outside{{3, 1, 1.0f}};
  CHECK_THROWS_AS(gpu->forward(step, outside), Error);

  // Through the engine, four requests at once: sampled (drawn on the host's
  // threads from rows fetched together), biased, penalized, with
  // alternatives: the CPU backend's answers.
  std::vector<GenerateRequest> reqs(4);
  const std::vector<std::string> prompts{"Once upon a time", "The cat sat on the mat and", "Lily and Ben went",
                                         "One day, a big red ball"};
  for (size_t i = 0; i < reqs.size(); ++i) {
    reqs[i].prompt = f.tok.encode(prompts[i], true);
    reqs[i].max_tokens = 40;
    reqs[i].sampling.temperature = 0;
    reqs[i].sampling.seed = 11 + i;
  }
  reqs[0].sampling.temperature = 0.8f;
  reqs[1].sampling.logit_bias = {{first, -100.f}};
  reqs[2].sampling.frequency_penalty = 1.0f;
  reqs[2].sampling.presence_penalty = 0.5f;
  reqs[3].sampling.temperature = 1.0f;
  reqs[3].sampling.logit_bias = {{42, 1.5f}};
  reqs[3].n_probs = 2;
  auto run = [&](Backend& b) {
    Engine engine(b, f.model.hp(), f.tok.eos(), shape);
    std::vector<std::shared_ptr<Collect>> sinks;
    for (const auto& r : reqs) {
      sinks.push_back(std::make_shared<Collect>());
      engine.submit(r, sinks.back());
    }
    engine.run_until_idle();
    std::vector<std::vector<int32_t>> out;
    for (auto& c : sinks) {
      CHECK(c->error == "");
      out.push_back(c->tokens);
    }
    return out;
  };
  const auto want = run(*cpu);
  const auto got = run(*gpu);
  for (size_t i = 0; i < reqs.size(); ++i) {
    CAPTURE(i);
    CHECK_FALSE(want[i].empty());
    CHECK(got[i] == want[i]);
  }
  CHECK(std::count(got[1].begin(), got[1].end(), first) == 0);
}

namespace {

std::string temp_socket(const char* what) {
  return "/tmp/ds4-test-" + std::string(what) + "-" + std::to_string(getpid()) + ".sock";
}

/// A holder serving on its own thread until stopped (as `ds4-worker hold` runs it).
struct RunningHolder {
  CudaHolder holder;
  std::thread thread;
  RunningHolder(const Model& m, const std::string& socket, const std::string& key, int host_expert_layers = 0)
      : holder(m, 0, socket, key, "test-segment", host_expert_layers), thread([this] { holder.serve(); }) {}
  ~RunningHolder() {
    holder.stop();
    thread.join();
  }
};

CudaWeightsOptions from_holder(const std::string& socket, const std::string& key) {
  CudaWeightsOptions o;
  o.mode = CudaWeightSource::holder;
  o.holder_socket = socket;
  o.model_key = key;
  return o;
}

}  // namespace

TEST_CASE("cuda: weights mapped from a holder give the copy's tokens, and outlive the holder" * needs_gpu()) {
  Fixture& f = fixture();
  const std::vector<std::string> prompts{"Once upon a time", "The little bird"};
  const EngineShape shape{256, 2, 16};
  auto copy = make_cuda_backend(f.model, 0);
  CHECK(copy->name().find("weights: copy") != std::string::npos);
  const auto want = generate(*copy, shape, prompts, 60);
  copy.reset();

  const std::string socket = temp_socket("holder");
  auto holder = std::make_unique<RunningHolder>(f.model, socket, "stories-key");
  CHECK(holder->holder.status().find("holding") != std::string::npos);
  // One GPU, one holder: a second one on the same socket refuses to start.
  std::string refused;
  try {
    CudaHolder second(f.model, 0, socket, "stories-key", "test-segment");
  } catch (const Error& e) {
    refused = e.what();
  }
  CHECK(refused.find("already answers") != std::string::npos);

  auto mapped = make_cuda_backend(f.model, 0, from_holder(socket, "stories-key"));
  CHECK(mapped->name().find("weights: holder") != std::string::npos);
  CHECK(generate(*mapped, shape, prompts, 60) == want);

  // An image of another model is refused: the worker copies instead.
  auto other = make_cuda_backend(f.model, 0, from_holder(socket, "another-model"));
  CHECK(other->name().find("weights: copy") != std::string::npos);
  other.reset();

  // The holder goes away; the worker that mapped the weights keeps them.
  holder.reset();
  CHECK(access(socket.c_str(), F_OK) != 0);
  CHECK(generate(*mapped, shape, prompts, 60) == want);
  // The next worker falls back to a copy; a restarted holder serves again.
  auto fallback = make_cuda_backend(f.model, 0, from_holder(socket, "stories-key"));
  CHECK(fallback->name().find("weights: copy") != std::string::npos);
  fallback.reset();
  holder = std::make_unique<RunningHolder>(f.model, socket, "stories-key");
  auto again = make_cuda_backend(f.model, 0, from_holder(socket, "stories-key"));
  CHECK(again->name().find("weights: holder") != std::string::npos);
  CHECK(generate(*again, shape, prompts, 60) == want);
}

TEST_CASE("cuda: experts on the host (the expert rung) give the device's tokens, and the image holds only the rest" * needs_gpu()) {
  const std::vector<ArchCase> cases = {
      {.name = "qwen3moe F16", .arch = "qwen3moe", .head_dim = 64, .qk_norm = true, .experts = 8},
      {.name = "qwen2moe Q8_0 (a shared expert)", .arch = "qwen2moe", .bias = true, .type = GgmlType::Q8_0,
       .experts = 8, .shared_expert = true},
  };
  for (const ArchCase& c : cases) {
    const std::string name = c.name;
    CAPTURE(name);
    const bool q8 = c.type == GgmlType::Q8_0;
    const double tol = q8 ? 4e-2 : 3e-3;        // as the architecture case: two correct engines
    const float near_tie = q8 ? 0.25f : 0.03f;  // where greedy answers may part
    auto m = arch_model(c);
    const HParams& hp = m->model.hp();
    REQUIRE(hp.n_layers == 2);
    std::vector<int32_t> prompt;
    for (int i = 0; i < 23; ++i) prompt.push_back(int32_t((i * 37 + 5) % hp.n_vocab));
    const EngineShape one{256, 1, 64};
    auto cpu = make_cpu_backend(m->model, 2);
    cpu->reserve(one);
    const auto want = greedy_ids(*cpu, prompt, 24);
    auto device = make_cuda_backend(m->model, 0);
    const uint64_t all_on_device = device->plan(one).weights;
    device.reset();
    auto rung = [&](int host, int holder_layers) {
      CudaWeightsOptions o;
      o.host_expert_layers = host;
      o.holder_expert_layers = holder_layers;
      o.host = make_host_compute(m->model, 2);
      return make_cuda_backend(m->model, 0, o);
    };
    // Same tokens as the CPU (up to its own near tie) for each rung: the
    // host's layers run the CPU backend's experts, the rest the GPU's.
    auto same_tokens = [&](Backend& b) {
      b.reserve(one);
      const auto got = greedy_ids(b, prompt, 24);
      size_t same = 0;
      while (same < want.size() && got[same].token == want[same].token) ++same;
      CAPTURE(same);
      if (same < want.size()) CHECK(want[same].margin < near_tie);
      CHECK(same >= 8);
      return got;
    };
    for (int host : {1, 2}) {
      CAPTURE(host);
      auto gpu = rung(host, -1);
      CHECK(gpu->name().find("experts of " + std::to_string(host) + " layers on the host") != std::string::npos);
      const MemoryPlan p = gpu->plan(one);
      CHECK(p.weights < all_on_device);  // the host layers' experts are not on the device
      CHECK(p.experts == 0);
      same_tokens(*gpu);
      // Logits of a prefill and of two slots' decode steps, against the CPU's.
      auto cpu2 = make_cpu_backend(m->model, 2);
      auto gpu2 = rung(host, -1);
      const EngineShape two{256, 2, 64};
      cpu2->reserve(two);
      gpu2->reserve(two);
      std::vector<BatchToken> prefill;
      for (size_t i = 0; i < prompt.size(); ++i)
        prefill.push_back({prompt[i], 1, int32_t(i), i + 1 == prompt.size() ? 0 : -1});
      cpu2->forward(prefill);
      gpu2->forward(prefill);
      CHECK(rel_err(gpu2->logits(0).data(), cpu2->logits(0).data(), size_t(hp.n_vocab)) < tol);
      for (int i = 0; i < 4; ++i) {
        const BatchToken step[2] = {{prompt[size_t(i)], 0, int32_t(i), 0},
                                    {prompt[size_t(i) % 5], 1, int32_t(prompt.size()) + i, 1}};
        cpu2->forward(step);
        gpu2->forward(step);
        for (int r = 0; r < 2; ++r) CHECK(rel_err(gpu2->logits(r).data(), cpu2->logits(r).data(), size_t(hp.n_vocab)) < tol);
      }
    }
    // A holder without the experts of both layers (the deepest rung): a
    // worker at rung 1 maps it and copies layer 1's experts itself; one at
    // rung 0 copies both layers'. Each gives the copy's tokens.
    const std::string socket = temp_socket("holder-moe");
    RunningHolder holder(m->model, socket, "moe-key", 2);
    for (int host : {0, 1}) {
      CAPTURE(host);
      CudaWeightsOptions o = from_holder(socket, "moe-key");
      o.host_expert_layers = host;
      o.holder_expert_layers = 2;
      o.host = make_host_compute(m->model, 2);
      auto mapped = make_cuda_backend(m->model, 0, o);
      CHECK(mapped->name().find("weights: holder") != std::string::npos);
      const MemoryPlan p = mapped->plan(one);
      CHECK(p.experts > 0);
      // Rung 0 holds every expert (the holder's image and its own copy); rung 1 not layer 0's.
      if (host == 0) CHECK(p.weights + p.experts == all_on_device);
      else CHECK(p.weights + p.experts < all_on_device);
      const auto via_holder = same_tokens(*mapped);
      auto copied = rung(host, -1);
      const auto via_copy = same_tokens(*copied);
      for (size_t i = 0; i < via_copy.size(); ++i) CHECK(via_holder[i].token == via_copy[i].token);
    }
    // A holder whose image keeps the experts a worker wants on the host is
    // another layout: that worker copies instead of mapping it.
    CudaWeightsOptions o = from_holder(socket, "moe-key");
    o.host_expert_layers = 1;
    o.holder_expert_layers = 1;
    o.host = make_host_compute(m->model, 2);
    auto other = make_cuda_backend(m->model, 0, o);
    CHECK(other->name().find("weights: copy") != std::string::npos);
  }
}

namespace {

/// stories260K's tensors copied into anonymous read-only pages, as a segment
/// maps them (a file mapping may refuse to be registered with the driver).
struct PagesFixture {
  size_t bytes = 0;
  uint8_t* base = nullptr;
  std::map<std::string, TensorView, std::less<>> views;
  Model model;

  explicit PagesFixture(const gguf::File& file) : model(bind(file)) {}
  ~PagesFixture() {
    if (base) munmap(base, bytes);
  }
  Model bind(const gguf::File& file) {
    for (const auto& t : file.tensors()) bytes += (t.n_bytes + 255) / 256 * 256;
    base = static_cast<uint8_t*>(mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    REQUIRE(base != MAP_FAILED);
    size_t at = 0;
    for (const auto& t : file.tensors()) {
      TensorView v = tensor_view(file, t);
      std::memcpy(base + at, v.data, t.n_bytes);
      v.data = base + at;
      views[t.name] = v;
      at += (t.n_bytes + 255) / 256 * 256;
    }
    REQUIRE(mprotect(base, bytes, PROT_READ) == 0);
    return Model::bind(file, [this](std::string_view name, TensorView& out) {
      auto it = views.find(name);
      if (it == views.end()) return false;
      out = it->second;
      return true;
    });
  }
};

}  // namespace

TEST_CASE("cuda: auto weights are read in place on an integrated GPU, else the holder's or a copy") {
  // No GPU needed: the choice itself (an integrated GPU cannot be had on the test machines).
  using W = CudaWeightSource;
  CHECK(resolve_weight_source(W::automatic, true, true) == W::host_mapped);
  CHECK(resolve_weight_source(W::automatic, true, false) == W::host_mapped);
  CHECK(resolve_weight_source(W::automatic, false, true) == W::holder);
  CHECK(resolve_weight_source(W::automatic, false, false) == W::copy);
  // A person's explicit choice stands, integrated or not.
  CHECK(resolve_weight_source(W::copy, true, true) == W::copy);
  CHECK(resolve_weight_source(W::holder, true, false) == W::holder);
  CHECK(resolve_weight_source(W::host_mapped, false, true) == W::host_mapped);
  if (have_gpu()) MESSAGE("cuda:0 is " << std::string(cuda_integrated(0) ? "an integrated" : "a discrete") << " GPU");
}

TEST_CASE("cuda: host-mapped weights are used in place and give the CPU's tokens" * needs_gpu()) {
  Fixture& f = fixture();
  PagesFixture pages(f.file);
  const std::vector<std::string> prompts{"Once upon a time", "Tom had a red"};
  const EngineShape shape{256, 2, 16};
  auto cpu = make_cpu_backend(f.model, 2);
  const auto want = generate(*cpu, shape, prompts, 60);
  CudaWeightsOptions o;
  o.mode = CudaWeightSource::host_mapped;
  auto gpu = make_cuda_backend(pages.model, 0, o);
  CHECK(gpu->name().find("weights: host-mapped") != std::string::npos);
  CHECK(generate(*gpu, shape, prompts, 60) == want);
}

TEST_CASE("cuda: MXFP4 dequantises bit-exactly as the CPU row, and its GEMV and GEMM match the dequantised reference" * needs_gpu()) {
  std::mt19937 rng(39);
  const int64_t N = 1000, K = 2048;
  std::vector<uint8_t> w(size_t(N * K / 32 * 17));
  for (uint8_t& b : w) b = uint8_t(rng());
  for (size_t b = 0; b < w.size(); b += 17) w[b] = uint8_t(118 + rng() % 12);  // scales 2^-10 .. 2^1
  // The reference: E2M1 codes (sign, two exponent bits, one mantissa bit) times 2^(e - 127).
  std::vector<float> want(size_t(N * K));
  for (int64_t b = 0; b < N * K / 32; ++b)
    for (int j = 0; j < 32; ++j) {
      const uint8_t byte = w[size_t(b * 17 + 1 + j % 16)];
      const unsigned code = j < 16 ? byte & 0xF : byte >> 4, ex = (code >> 1) & 3, man = code & 1;
      const double mag = ex == 0 ? 0.5 * man : std::ldexp(1.0 + 0.5 * man, int(ex) - 1);
      want[size_t(b * 32 + j)] = float((code & 8 ? -mag : mag) * std::ldexp(1.0, int(w[size_t(b * 17)]) - 127));
    }
  const auto got = cuda_ops::dequantize({GgmlType::MXFP4, w.data(), K, N});
  REQUIRE(got.size() == want.size());
  size_t bad = 0;
  for (size_t i = 0; i < got.size(); ++i) bad += got[i] != want[i];  // != : the -0 code is +0, as ggml's
  CHECK(bad == 0);
  std::vector<float> cpu_rows(size_t(N * K));
  for (int64_t n = 0; n < N; ++n) cpu::dequantize_row(GgmlType::MXFP4, w.data(), K, n, cpu_rows.data() + n * K);
  CHECK(std::memcmp(got.data(), cpu_rows.data(), got.size() * 4) == 0);
  const Weight W{GgmlType::MXFP4, w.data(), K, N};
  for (int64_t T : {1, 2, 3, 8, 20, 64, 100}) {
    const int64_t ldx = K + 8;
    const auto x = random_floats(size_t(T * ldx), rng);
    const auto ref = ref_matmul(want, N, K, x, ldx, T);
    std::vector<float> y(size_t(T * N));
    cuda_ops::matmul(W, x.data(), ldx, T, y.data(), N);
    CAPTURE(T);
    CHECK(rel_err(y, ref) < (half_activations(GgmlType::MXFP4, T) ? 3e-3 : quant_gemv_bound(1.5e-2)));
  }
}

#else

#include "skip.h"

// Held back, never run: the unit_cuda entry reads Skipped, saying why.
TEST_CASE("cuda: the CUDA backend" * ds4::test::needs("cuda", "this build has no CUDA backend (DS4_CUDA=OFF)")) {}

#endif
