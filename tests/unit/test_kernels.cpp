// CPU kernels: every table against the generic reference (bit-identical matrix
// products, close attention), products against a double-precision sum, and
// batch invariance: a token's result does not depend on its batch.
#include <doctest/doctest.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "worker/cpu/kernels.h"
#include "worker/cpu/thread_pool.h"

using namespace ds4;
using namespace ds4::cpu;

namespace {

struct Matrix {
  GgmlType type;
  int64_t K, N;
  std::vector<uint8_t> bytes;
};

Matrix random_matrix(GgmlType type, int64_t N, int64_t K, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.f, 1.f);
  Matrix m{type, K, N, std::vector<uint8_t>(size_t(row_bytes(type, K) * N))};
  for (int64_t n = 0; n < N; ++n) {
    uint8_t* row = m.bytes.data() + n * row_bytes(type, K);
    for (int64_t k = 0; k < K; ++k) {
      const float v = nd(rng);
      if (type == GgmlType::F32) std::memcpy(row + 4 * k, &v, 4);
      if (type == GgmlType::F16) { uint16_t h = fp32_to_fp16(v); std::memcpy(row + 2 * k, &h, 2); }
      if (type == GgmlType::BF16) { uint16_t h = fp32_to_bf16(v); std::memcpy(row + 2 * k, &h, 2); }
    }
    if (type == GgmlType::Q8_0) {
      auto* b = reinterpret_cast<BlockQ8_0*>(row);
      for (int64_t i = 0; i < K / 32; ++i) {
        b[i].d = fp32_to_fp16(0.01f + 0.001f * float(rng() % 100));
        for (int j = 0; j < 32; ++j) b[i].qs[j] = int8_t(int(rng() % 256) - 128);  // -128 too
      }
    }
  }
  return m;
}

std::vector<float> random_x(int64_t T, int64_t K, int64_t ldx, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> x(size_t(T * ldx), 0.f);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; ++k) x[size_t(t * ldx + k)] = nd(rng);
  return x;
}

std::vector<BlockQ8Act> quantize(const KernelTable& kt, const std::vector<float>& x, int64_t T, int64_t K,
                                 int64_t ldx) {
  std::vector<BlockQ8Act> xq(size_t(T * K / 32));
  for (int64_t t = 0; t < T; ++t) kt.quantize_q8(x.data() + t * ldx, K, xq.data() + t * K / 32);
  return xq;
}

// With `quantized`, Q8_0 weights take x quantized by the same table, as the engine does.
std::vector<float> product(const KernelTable& kt, const Matrix& m, const std::vector<float>& x, int64_t T,
                           int64_t ldx, bool quantized = false) {
  std::vector<float> y(size_t(T * m.N), NAN);
  std::vector<float> scratch(size_t(matmul_scratch_floats(m.K)));
  MatmulArgs a{m.type, m.bytes.data(), m.K, m.N, x.data(), ldx, T, y.data(), m.N};
  std::vector<BlockQ8Act> xq;
  if (quantized) {
    xq = quantize(kt, x, T, m.K, ldx);
    a.xq = xq.data();
    a.ldxq = m.K / 32;
  }
  // Two uneven ranges, as two threads would split it.
  kt.matmul_rows(a, 0, 5, scratch.data());
  kt.matmul_rows(a, 5, m.N, scratch.data());
  return y;
}

std::vector<const KernelTable*> tables() {
  std::vector<const KernelTable*> t{&generic_kernels()};
  if (avx2_kernels() && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c"))
    t.push_back(avx2_kernels());
  if (avx512_kernels() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    t.push_back(avx512_kernels());
  else
    MESSAGE("this CPU has no AVX-512: the avx512 table is not exercised here");
  if (avx512vnni_kernels() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vnni"))
    t.push_back(avx512vnni_kernels());
  else
    MESSAGE("this CPU has no AVX-512 VNNI: the avx512vnni table is not exercised here");
  return t;
}

}  // namespace

TEST_CASE("kernels: matrix products match a double-precision sum and the generic table bit for bit") {
  std::mt19937 rng(1);
  for (GgmlType type : {GgmlType::F32, GgmlType::F16, GgmlType::BF16, GgmlType::Q8_0}) {
    // 40, 172, 1000, 1700: a tail past the last 16 lanes; 1700, 2816: the AVX-512 f32 products take K in parts
    for (int64_t K : {32, 40, 96, 172, 1000, 1024, 1700, 2816}) {
      if (type == GgmlType::Q8_0 && K % 32) continue;
      const int64_t N = 37, ldx = (K + 7) / 8 * 8;
      const Matrix m = random_matrix(type, N, K, rng);
      for (int64_t T : {1, 2, 3, 4, 5, 7, 13, 24, 50, 70})  // 70: more than one 64-token block of the Q8_0 prefill
        for (bool quantized : {false, true}) {
          if (quantized && type != GgmlType::Q8_0) continue;
          CAPTURE(int(type));
          CAPTURE(K);
          CAPTURE(T);
          CAPTURE(quantized);
          auto x = random_x(T, K, ldx, rng);
          const auto ref = product(generic_kernels(), m, x, T, ldx, quantized);
          // The exact sum is over the values the product sees: quantized x when it is.
          std::vector<float> xs = x;
          if (quantized) {
            const auto xq = quantize(generic_kernels(), x, T, K, ldx);
            for (int64_t t = 0; t < T; ++t)
              for (int64_t k = 0; k < K; ++k) {
                const BlockQ8Act& b = xq[size_t(t * K / 32 + k / 32)];
                xs[size_t(t * ldx + k)] = b.d * float(b.qs[k % 32]);
              }
          }
          std::vector<float> w(static_cast<size_t>(K));
          for (int64_t n = 0; n < N; ++n) {
            dequantize_row(type, m.bytes.data(), K, n, w.data());
            for (int64_t t = 0; t < T; ++t) {
              double s = 0, mag = 0;
              for (int64_t k = 0; k < K; ++k) {
                s += double(w[size_t(k)]) * double(xs[size_t(t * ldx + k)]);
                mag += std::fabs(double(w[size_t(k)]) * double(xs[size_t(t * ldx + k)]));
              }
              REQUIRE(std::fabs(double(ref[size_t(t * N + n)]) - s) <= 1e-5 * mag + 1e-6);
            }
          }
          for (const KernelTable* kt : tables()) {
            CAPTURE(kt->name);
            const auto y = product(*kt, m, x, T, ldx, quantized);
            REQUIRE(std::memcmp(y.data(), ref.data(), y.size() * 4) == 0);
            // Batch invariance: each token alone gives the same bits.
            for (int64_t t = 0; t < T; ++t) {
              std::vector<float> one(x.begin() + t * ldx, x.begin() + (t + 1) * ldx);
              const auto y1 = product(*kt, m, one, 1, ldx, quantized);
              REQUIRE(std::memcmp(y1.data(), y.data() + t * N, size_t(N) * 4) == 0);
            }
          }
        }
    }
  }
}

TEST_CASE("kernels: Q8_0 activation quantization rounds each block to its own scale, the same in every table") {
  std::mt19937 rng(4);
  const int64_t K = 256;
  std::vector<float> x = random_x(1, K, K, rng);
  for (int i = 0; i < 32; ++i) x[size_t(32 + i)] = 0.0f;                   // an all-zero block
  for (int i = 0; i < 32; ++i) x[size_t(64 + i)] = i % 2 ? 1e-31f : 0.0f;  // below kQ8ActTiny
  for (int i = 0; i < 32; ++i) x[size_t(128 + i)] = i == 5 ? -1e-29f : 0.0f;  // tiny but kept
  // Block 3 has max|x| = 127, so x * 127 / max|x| = x: halves round to even.
  const float halves[7] = {127.0f, 2.5f, 3.5f, -2.5f, -0.5f, 0.5f, 1.5f};
  const int8_t rounded[7] = {127, 2, 4, -2, 0, 0, 2};
  for (int i = 0; i < 32; ++i) x[size_t(96 + i)] = i < 7 ? halves[i] : 0.0f;
  const auto ref = quantize(generic_kernels(), x, 1, K, K);
  for (int64_t b = 0; b < K / 32; ++b) {
    CAPTURE(b);
    float amax = 0;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[size_t(b * 32 + i)]));
    const BlockQ8Act& q = ref[size_t(b)];
    const bool kept = amax >= kQ8ActTiny;
    // The scale is stored as ggml stores it, rounded to fp16 (below 2^-24 it is zero).
    const float exact = amax / 127.0f;
    CHECK(q.d == (kept ? fp16_to_fp32(fp32_to_fp16(exact)) : 0.0f));
    bool hit_max = false;
    for (int i = 0; i < 32; ++i) {
      const float v = x[size_t(b * 32 + i)];
      REQUIRE(q.qs[i] >= -127);
      REQUIRE(std::fabs(v - q.d * float(q.qs[i])) <=
              (kept ? (0.5f * exact + 127.0f * std::fabs(q.d - exact)) * 1.0001f : kQ8ActTiny));
      hit_max |= std::abs(q.qs[i]) == 127;
    }
    CHECK(hit_max == kept);
  }
  for (int i = 0; i < 7; ++i) CHECK(ref[3].qs[i] == rounded[i]);
  for (const KernelTable* kt : tables()) {
    CAPTURE(kt->name);
    const auto got = quantize(*kt, x, 1, K, K);
    REQUIRE(std::memcmp(got.data(), ref.data(), got.size() * sizeof(BlockQ8Act)) == 0);
  }
}

// One head's cached rows in `type`, each row followed by `pad` bytes that
// the attention must skip, built from f32 values (rounded as kv_store rounds
// them) and read back as the attention must see them.
struct TestCache {
  KvType type;
  int64_t hd, row_bytes;
  std::vector<uint8_t> bytes;
  TestCache(KvType t, int64_t hd_, int64_t n_pos, int64_t pad, const std::vector<float>& values)
      : type(t), hd(hd_), row_bytes(kv_row_bytes(t, hd_) + pad), bytes(size_t(n_pos * row_bytes), 0xA5) {
    for (int64_t p = 0; p < n_pos; ++p) {
      uint8_t* row = bytes.data() + p * row_bytes;
      if (t == KvType::q8_0) {
        store_kv_q8(generic_kernels(), values.data() + p * hd, hd, row);
      } else {
        for (int64_t i = 0; i < hd; ++i) {
          const uint16_t h = fp32_to_fp16(values[size_t(p * hd + i)]);
          std::memcpy(row + 2 * i, &h, 2);
        }
      }
    }
  }
  KvRows rows() const { return {bytes.data(), type, row_bytes}; }
  double value(int64_t p, int64_t i) const {
    const uint8_t* row = bytes.data() + p * row_bytes;
    uint16_t h;
    if (type == KvType::f16) {
      std::memcpy(&h, row + 2 * i, 2);
      return fp16_to_fp32(h);
    }
    const uint8_t* b = row + i / 32 * 34;
    std::memcpy(&h, b, 2);
    return double(fp16_to_fp32(h)) * int8_t(b[2 + i % 32]);
  }
};

TEST_CASE("kernels: a q8_0 cache row holds each value within half a step of its block's scale") {
  std::mt19937 rng(9);
  std::normal_distribution<float> nd(0.f, 3.f);
  for (int64_t hd : {32, 128}) {
    std::vector<float> x(static_cast<size_t>(hd));
    for (auto& v : x) v = nd(rng);
    x[5] = 0.0f;
    const TestCache c(KvType::q8_0, hd, 1, 0, x);
    for (int64_t b = 0; b < hd / 32; ++b) {
      float amax = 0;
      for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[size_t(b * 32 + i)]));
      // q = round(x * 127 / max|x|), d = max|x| / 127 rounded to f16: half a
      // step of max|x| / 127, plus |q| <= 127 times d's own rounding.
      const double d = fp16_to_fp32(fp32_to_fp16(amax / 127.0f)), step = double(amax) / 127.0;
      bool reached = false;
      for (int64_t i = b * 32; i < b * 32 + 32; ++i) {
        CHECK(std::fabs(c.value(0, i) - x[size_t(i)]) <= step * 0.5 * (1 + 1e-6) + 127 * std::fabs(d - step));
        reached |= std::fabs(c.value(0, i)) >= d * 127 - 1e-9;
      }
      CHECK(reached);  // the largest value maps to +-127
    }
    CHECK(c.value(0, 5) == 0.0);
  }
  // An all-zero block stays zero (no division by zero).
  const TestCache z(KvType::q8_0, 32, 1, 0, std::vector<float>(32, 0.0f));
  for (int i = 0; i < 32; ++i) CHECK(z.value(0, i) == 0.0);
}

TEST_CASE("kernels: attention agrees across tables and with a direct softmax, over one tile and many") {
  std::mt19937 rng(2);
  std::normal_distribution<float> nd(0.f, 1.f);
  // `rising`: the scores grow along the positions, so that each tile's maximum
  // is a new one and the output so far is rescaled at every tile (the online
  // softmax's step that a flat score profile never takes); the last tile
  // then carries almost all the weight.
  for (KvType type : {KvType::f16, KvType::q8_0})
  for (bool rising : {false, true})
    for (int64_t hd : {8, 64, 100, 128})
      for (int64_t n_pos : {int64_t(37), kAttendTile, kAttendTile + 1, int64_t(1000)}) {
        if (type == KvType::q8_0 && hd % 32 != 0) continue;
        std::vector<float> q(static_cast<size_t>(hd));
        for (auto& v : q) v = nd(rng);
        std::vector<float> kf(size_t(n_pos * hd)), vf(kf.size());
        for (int64_t p = 0; p < n_pos; ++p)
          for (int64_t i = 0; i < hd; ++i) {
            const float grow = rising ? 8.0f * float(p) / float(n_pos) * q[size_t(i)] / float(hd) : 0.0f;
            kf[size_t(p * hd + i)] = nd(rng) + grow * std::sqrt(float(hd));
            vf[size_t(p * hd + i)] = nd(rng);
          }
        // Rows farther apart than their values (a head's rows of other data between).
        const TestCache k(type, hd, n_pos, 2 * hd, kf), v(type, hd, n_pos, 2 * hd, vf);
        const float scale = 1.0f / std::sqrt(float(hd));
        std::vector<double> ref(static_cast<size_t>(hd), 0.0), s(static_cast<size_t>(n_pos));
        double mx = -1e30, sum = 0;
        for (int64_t p = 0; p < n_pos; ++p) {
          double d = 0;
          for (int64_t i = 0; i < hd; ++i) d += double(q[size_t(i)]) * k.value(p, i);
          s[size_t(p)] = d * scale;
          mx = std::max(mx, s[size_t(p)]);
        }
        for (auto& e : s) sum += (e = std::exp(e - mx));
        for (int64_t p = 0; p < n_pos; ++p)
          for (int64_t i = 0; i < hd; ++i) ref[size_t(i)] += s[size_t(p)] / sum * v.value(p, i);
        for (const KernelTable* kt : tables()) {
          CAPTURE(kt->name);
          CAPTURE(kv_type_name(type));
          CAPTURE(hd);
          CAPTURE(n_pos);
          CAPTURE(rising);
          // The score row is one tile long, whatever the depth.
          std::vector<float> out(static_cast<size_t>(hd)), scores(static_cast<size_t>(kAttendTile));
          kt->attend(q.data(), k.rows(), v.rows(), n_pos, hd, scale, out.data(), scores.data());
          for (int64_t i = 0; i < hd; ++i)
            CHECK(out[size_t(i)] == doctest::Approx(ref[size_t(i)]).epsilon(1e-5));
        }
      }
}

TEST_CASE("kernels: a block of queries attends exactly as each query alone (a prompt chunk equals its tokens one by one)") {
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.f, 1.f);
  // The deepest query 45 positions into a third tile (not a multiple of 8),
  // or 3 into it, so that the first queries of a block end with the second
  // tile and sit the third one out.
  for (KvType type : {KvType::f16, KvType::q8_0})
  for (int64_t most : {2 * kAttendTile + 45, 2 * kAttendTile + 3})
  for (int64_t hd : {64, 100, 128}) {
    if (type == KvType::q8_0 && hd % 32 != 0) continue;
    const int64_t score_stride = kAttendTile;
    std::vector<float> kf(size_t(most * hd)), vf(kf.size());
    for (auto& e : kf) e = nd(rng);
    for (auto& e : vf) e = nd(rng);
    const TestCache k(type, hd, most, 16, kf), v(type, hd, most, 16, vf);
    const float scale = 1.0f / std::sqrt(float(hd));
    for (int nq = 1; nq <= kAttendBlock; ++nq) {
      // Consecutive positions of one sequence, the last query at the deepest one.
      std::vector<std::vector<float>> q{size_t(nq), std::vector<float>(size_t(hd))};
      std::vector<int64_t> n_pos(static_cast<size_t>(nq));
      for (int j = 0; j < nq; ++j) {
        for (auto& e : q[size_t(j)]) e = nd(rng);
        n_pos[size_t(j)] = most - (nq - 1 - j);
      }
      for (const KernelTable* kt : tables()) {
        std::vector<std::vector<float>> one{size_t(nq), std::vector<float>(size_t(hd))}, block = one;
        std::vector<float> scores(static_cast<size_t>(kAttendBlock * score_stride));
        const float* qs[kAttendBlock];
        float* outs[kAttendBlock];
        for (int j = 0; j < nq; ++j) {
          kt->attend(q[size_t(j)].data(), k.rows(), v.rows(), n_pos[size_t(j)], hd, scale, one[size_t(j)].data(),
                     scores.data());
          qs[j] = q[size_t(j)].data();
          outs[j] = block[size_t(j)].data();
        }
        kt->attend_block(qs, n_pos.data(), nq, k.rows(), v.rows(), hd, scale, outs, scores.data(), score_stride);
        for (int j = 0; j < nq; ++j)
          REQUIRE_MESSAGE(std::memcmp(one[size_t(j)].data(), block[size_t(j)].data(), size_t(hd) * 4) == 0,
                          kt->name << " " << kv_type_name(type) << ": query " << j << " of " << nq << ", head size "
                                   << hd);
      }
    }
  }
}

TEST_CASE("kernels: f16 conversions are exact and round to nearest even") {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = fp16_to_fp32(uint16_t(h));
    if (std::isnan(f)) continue;
    REQUIRE(fp32_to_fp16(f) == h);
  }
  CHECK(fp32_to_fp16(1.0f + 1.0f / 2048) == fp32_to_fp16(1.0f));  // tie to even
  CHECK(fp16_to_fp32(fp32_to_fp16(65520.f)) == INFINITY);           // overflow
  CHECK(fp16_to_fp32(fp32_to_fp16(1e-8f)) == 0.0f);                 // underflow
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.f, 100.f);
  for (const KernelTable* kt : tables()) {
    std::vector<float> src(1003);
    for (auto& e : src) e = nd(rng) * float(rng() % 3 == 0 ? 1e-6 : 1.0);
    std::vector<uint16_t> dst(src.size());
    kt->to_f16(src.data(), dst.data(), int64_t(src.size()));
    for (size_t i = 0; i < src.size(); ++i) REQUIRE(dst[i] == fp32_to_fp16(src[i]));
  }
  CHECK(bf16_to_fp32(fp32_to_bf16(1.5f)) == 1.5f);
}

TEST_CASE("kernels: SwiGLU's gate agrees with std::exp in every table, out to overflow") {
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.f, 4.f);
  for (int64_t n : {1, 8, 13, 2816}) {  // whole vectors and padded tails
    std::vector<float> g(static_cast<size_t>(n)), u(static_cast<size_t>(n));
    for (auto& e : g) e = nd(rng);
    for (auto& e : u) e = nd(rng);
    const float extremes[6] = {0.0f, -0.0f, 100.0f, -100.0f, 88.5f, -88.5f};  // e^-g: 1, 1, 0, inf, 0, inf
    for (int i = 0; i < 6 && i < n; ++i) g[size_t(i)] = extremes[i];
    for (const KernelTable* kt : tables()) {
      CAPTURE(kt->name);
      CAPTURE(n);
      std::vector<float> out = g;
      kt->silu_mul(out.data(), u.data(), n);
      for (int64_t i = 0; i < n; ++i) {
        const double x = g[size_t(i)];
        const double ref = x / (1.0 + std::exp(-x)) * u[size_t(i)];
        REQUIRE(std::isfinite(out[size_t(i)]));
        REQUIRE(std::fabs(out[size_t(i)] - ref) <= 4e-7 * std::fabs(ref) + 1e-30);
      }
    }
  }
}

TEST_CASE("thread pool: range queues give every item once, each thread its own run in order first") {
  using ds4::cpu::RangeQueues;
  using ds4::cpu::ThreadPool;
  SUBCASE("one thread takes its run front to back, then the others' from their back ends") {
    const std::vector<int64_t> starts{0, 3, 3, 5};  // runs [0,3) [3,3) [3,5) [5,8)
    RangeQueues q(starts, 8);
    std::vector<int64_t> got;
    for (int64_t c = q.take(0); c >= 0; c = q.take(0)) got.push_back(c);
    CHECK(got == std::vector<int64_t>{0, 1, 2, 4, 3, 7, 6, 5});
    CHECK(q.take(1) == -1);
    CHECK(q.take(3) == -1);
  }
  SUBCASE("more runs than items, and no items") {
    const std::vector<int64_t> starts{0, 1, 1, 1};
    RangeQueues q(starts, 1);
    CHECK(q.take(2) == 0);
    CHECK(q.take(0) == -1);
    RangeQueues none(starts, 0);
    CHECK(none.take(0) == -1);
  }
  SUBCASE("threads at once, one of them slow: all items taken exactly once") {
    for (int threads : {2, 3, 8}) {
      ThreadPool pool(threads);
      for (int round = 0; round < 50; ++round) {
        const int64_t n = 1 + round * 37 % 500;
        std::vector<int64_t> starts(static_cast<size_t>(threads));
        for (int i = 0; i < threads; ++i) starts[size_t(i)] = n * i / threads;
        RangeQueues q(starts, n);
        std::vector<std::atomic<int>> taken(static_cast<size_t>(n));
        std::vector<std::vector<int64_t>> order(static_cast<size_t>(threads));
        std::atomic<bool> first_done{false};
        pool.run([&](int i, int) {
          for (int64_t c = q.take(i); c >= 0; c = q.take(i)) {
            taken[size_t(c)].fetch_add(1);
            order[size_t(i)].push_back(c);
            // Thread 1 stalls after its first item (descheduled) until thread 0 has run out.
            if (i == 1) first_done.wait(false);
          }
          if (i == 0) {
            first_done.store(true);
            first_done.notify_all();
          }
        });
        for (int64_t c = 0; c < n; ++c) REQUIRE_MESSAGE(taken[size_t(c)].load() == 1, "item " << c);
        // A thread's own items come first and in order.
        for (int i = 0; i < threads; ++i) {
          const int64_t lo = starts[size_t(i)], hi = i + 1 < threads ? starts[size_t(i) + 1] : n;
          for (size_t k = 0; k < order[size_t(i)].size() && order[size_t(i)][k] >= lo && order[size_t(i)][k] < hi;
               ++k)
            REQUIRE(order[size_t(i)][k] == lo + int64_t(k));
        }
        // The stalled thread's run went to the others (all of it when thread 0 ran out first).
        CHECK(order[1].size() <= 1);
      }
    }
  }
}
