// The quantized weight types (worker/cpu/quant_types.h): every kernel table's
// products equal the generic row's bit for bit, alone or batched; the
// generic row is close to a double-precision sum of the dequantized values;
// and, given files made by llama.cpp (tests/integration/test_quants_llamacpp.sh),
// dequantize_row equals ggml's own dequantization bit for bit.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "shared/gguf.h"
#include "worker/cpu/kernels.h"

#include "skip.h"

using namespace ds4;
using namespace ds4::cpu;

namespace {

constexpr GgmlType kQuantTypes[] = {GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0,
                                    GgmlType::Q5_1, GgmlType::IQ4_NL, GgmlType::Q2_K, GgmlType::Q3_K,
                                    GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K, GgmlType::IQ4_XS,
                                    GgmlType::MXFP4};

// Random blocks: random bytes everywhere, then sane fp16 scales (positive and
// negative, as files have), so every bit pattern of the quants occurs.
std::vector<uint8_t> random_rows(GgmlType type, int64_t N, int64_t K, std::mt19937& rng) {
  const QuantType& q = *quant_type(type);
  std::vector<uint8_t> bytes(size_t(N * row_bytes(type, K)));
  for (auto& b : bytes) b = uint8_t(rng());
  auto scale = [&](uint8_t* p, float lo) {
    const float v = (lo + 0.001f * float(rng() % 100)) * (rng() % 4 == 0 ? -1.f : 1.f);
    const uint16_t h = fp32_to_fp16(v);
    std::memcpy(p, &h, 2);
  };
  for (int64_t i = 0; i < int64_t(bytes.size()) / q.block_bytes; ++i) {
    uint8_t* b = bytes.data() + i * q.block_bytes;
    switch (type) {
      case GgmlType::Q8_0: case GgmlType::Q4_0: case GgmlType::Q5_0: case GgmlType::IQ4_NL:
        scale(b, 0.01f);
        break;
      case GgmlType::Q4_1: case GgmlType::Q5_1:
        scale(b, 0.01f);
        scale(b + 2, 0.05f);
        break;
      case GgmlType::Q2_K: scale(b + 80, 0.01f); scale(b + 82, 0.01f); break;
      case GgmlType::Q3_K: scale(b + 108, 0.01f); break;
      case GgmlType::Q4_K: case GgmlType::Q5_K: scale(b, 0.01f); scale(b + 2, 0.01f); break;
      case GgmlType::Q6_K: scale(b + 208, 0.001f); break;
      case GgmlType::IQ4_XS: scale(b, 0.001f); break;
      case GgmlType::MXFP4: b[0] = uint8_t(118 + rng() % 12); break;  // scales 2^-10 .. 2^1
      default: break;
    }
  }
  return bytes;
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

struct Acts {
  std::vector<BlockQ8Act> xq;
  std::vector<BlockQ8K> xk;
};

Acts quantize(const KernelTable& kt, const std::vector<float>& x, int64_t T, int64_t K, int64_t ldx) {
  Acts a;
  a.xq.resize(size_t(T * K / 32));
  for (int64_t t = 0; t < T; ++t) kt.quantize_q8(x.data() + t * ldx, K, a.xq.data() + t * K / 32);
  if (K % 256 == 0) {
    a.xk.resize(size_t(T * K / 256));
    for (int64_t t = 0; t < T; ++t) kt.quantize_q8k(x.data() + t * ldx, K, a.xk.data() + t * K / 256);
  }
  return a;
}

std::vector<float> product(const KernelTable& kt, GgmlType type, const std::vector<uint8_t>& w, int64_t N, int64_t K,
                           const std::vector<float>& x, int64_t T, int64_t ldx) {
  const Acts acts = quantize(kt, x, T, K, ldx);
  std::vector<float> y(size_t(T * N), NAN);
  std::vector<float> scratch(size_t(matmul_scratch_floats(K)));
  MatmulArgs a{type, w.data(), K, N, x.data(), ldx, T, y.data(), N};
  a.xq = acts.xq.data();
  a.ldxq = K / 32;
  a.xk = acts.xk.empty() ? nullptr : acts.xk.data();
  a.ldxk = K / 256;
  REQUIRE(a.quantized());
  // Uneven ranges, as threads would split it (one of 8 rows, the decode group).
  kt.matmul_rows(a, 0, 3, scratch.data());
  kt.matmul_rows(a, 3, 11, scratch.data());
  kt.matmul_rows(a, 11, N, scratch.data());
  return y;
}

}  // namespace

TEST_CASE("quants: activation blocks are the same from every table") {
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> x(1024);
  for (auto& v : x) v = nd(rng);
  x[5] = 0;
  for (int i = 512; i < 768; ++i) x[size_t(i)] = 0;  // an all-zero block
  const Acts ref = quantize(generic_kernels(), x, 1, 1024, 1024);
  for (const KernelTable* kt : tables()) {
    CAPTURE(kt->name);
    const Acts a = quantize(*kt, x, 1, 1024, 1024);
    CHECK(std::memcmp(a.xq.data(), ref.xq.data(), ref.xq.size() * sizeof(BlockQ8Act)) == 0);
    CHECK(std::memcmp(a.xk.data(), ref.xk.data(), ref.xk.size() * sizeof(BlockQ8K)) == 0);
  }
  // bsums are the sums of the rounded values.
  for (const BlockQ8K& b : ref.xk)
    for (int j = 0; j < 16; ++j) {
      int s = 0;
      for (int i = 0; i < 16; ++i) s += b.qs[16 * j + i];
      CHECK(b.bsums[j] == s);
    }
}

TEST_CASE("quants: every table's products equal the generic row bit for bit, alone or batched") {
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (GgmlType type : kQuantTypes) {
    const QuantType& q = *quant_type(type);
    for (int64_t K : {256, 768, 2048, 352}) {
      // 2048 columns: more rows than one prefill panel of the K-quant kernels holds;
      // 352: eleven 32-blocks, a row's last blocks past its groups of eight.
      if (K % q.block_elems != 0) continue;
      const int64_t N = K == 2048 ? 150 : 21, ldx = K;
      const auto w = random_rows(type, N, K, rng);
      for (int64_t T : {1, 2, 3, 4, 5, 9, 12, 19}) {
        CAPTURE(type_traits(uint32_t(type))->name);
        CAPTURE(K);
        CAPTURE(T);
        std::vector<float> x(size_t(T * ldx));
        for (auto& v : x) v = nd(rng);
        const auto ref = product(generic_kernels(), type, w, N, K, x, T, ldx);
        // The reference row against a double sum of what it multiplies.
        const Acts acts = quantize(generic_kernels(), x, T, K, ldx);
        std::vector<float> wd(static_cast<size_t>(K));
        for (int64_t n = 0; n < N; ++n) {
          dequantize_row(type, w.data(), K, n, wd.data());
          for (int64_t t = 0; t < T; ++t) {
            double s = 0, mag = 0;
            for (int64_t k = 0; k < K; ++k) {
              const double xv = q.act == ActType::Q8_0
                                    ? double(acts.xq[size_t(t * K / 32 + k / 32)].d) * acts.xq[size_t(t * K / 32 + k / 32)].qs[k % 32]
                                    : double(acts.xk[size_t(t * K / 256 + k / 256)].d) * acts.xk[size_t(t * K / 256 + k / 256)].qs[k % 256];
              s += double(wd[size_t(k)]) * xv;
              mag += std::fabs(double(wd[size_t(k)]) * xv);
            }
            REQUIRE(std::fabs(double(ref[size_t(t * N + n)]) - s) <= 1e-5 * mag + 1e-6);
          }
        }
        for (const KernelTable* kt : tables()) {
          CAPTURE(kt->name);
          const auto y = product(*kt, type, w, N, K, x, T, ldx);
          REQUIRE(std::memcmp(y.data(), ref.data(), y.size() * 4) == 0);
          for (int64_t t = 0; t < T; t += 4) {  // a token alone gives the same bits
            std::vector<float> one(x.begin() + t * ldx, x.begin() + (t + 1) * ldx);
            const auto y1 = product(*kt, type, w, N, K, one, 1, ldx);
            REQUIRE(std::memcmp(y1.data(), y.data() + t * N, size_t(N) * 4) == 0);
          }
        }
      }
    }
  }
}

TEST_CASE("quants: the f32 path (no activation blocks) takes the dequantized weights") {
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (GgmlType type : {GgmlType::Q4_K, GgmlType::Q4_0, GgmlType::Q6_K}) {
    const int64_t N = 9, K = 512;
    const auto w = random_rows(type, N, K, rng);
    std::vector<float> wd(size_t(N * K));
    for (int64_t n = 0; n < N; ++n) dequantize_row(type, w.data(), K, n, wd.data() + n * K);
    for (int64_t T : {1, 6}) {
      std::vector<float> x(size_t(T * K));
      for (auto& v : x) v = nd(rng);
      for (const KernelTable* kt : tables()) {
        std::vector<float> y(size_t(T * N)), yf(size_t(T * N));
        std::vector<float> scratch(size_t(matmul_scratch_floats(K)));
        kt->matmul_rows(MatmulArgs{type, w.data(), K, N, x.data(), K, T, y.data(), N}, 0, N, scratch.data());
        kt->matmul_rows(MatmulArgs{GgmlType::F32, wd.data(), K, N, x.data(), K, T, yf.data(), N}, 0, N, scratch.data());
        CAPTURE(kt->name);
        CHECK(std::memcmp(y.data(), yf.data(), y.size() * 4) == 0);
      }
    }
  }
}

namespace {
test::needs needs_quant_pairs() {
  const char* env = std::getenv("DS4_QUANT_PAIRS");
  if (env && *env) return {};
  return {nullptr, "DS4_QUANT_PAIRS is not set (tests/integration/test_quants_llamacpp.sh sets it)"};
}
}  // namespace

// Pairs of files from llama.cpp: DS4_QUANT_PAIRS="quant.gguf=f32.gguf;..." where
// the second is llama-quantize's F32 dequantization of the first. Every
// quantized tensor of the first, dequantized by ds4, equals the second's bits.
TEST_CASE("quants: dequantize_row equals llama.cpp's dequantization (DS4_QUANT_PAIRS)" * needs_quant_pairs()) {
  std::stringstream list(std::getenv("DS4_QUANT_PAIRS"));
  std::string pair;
  std::map<std::string, int> checked;  // type name -> tensors
  while (std::getline(list, pair, ';')) {
    const auto eq = pair.find('=');
    REQUIRE_MESSAGE(eq != std::string::npos, "DS4_QUANT_PAIRS entry without '=': " << pair);
    const gguf::File qf = gguf::File::open(pair.substr(0, eq));
    const gguf::File ff = gguf::File::open(pair.substr(eq + 1));
    std::map<std::string, const gguf::TensorInfo*> f32;
    for (const auto& t : ff.tensors()) f32[t.name] = &t;
    for (const auto& t : qf.tensors()) {
      CAPTURE(pair);
      CAPTURE(t.name);
      REQUIRE(f32.count(t.name));
      const gguf::TensorInfo& ft = *f32[t.name];
      REQUIRE(ft.type == GgmlType::F32);
      REQUIRE(ft.n_elements == t.n_elements);
      if (t.type == GgmlType::F32) continue;
      const std::string tname(type_traits(uint32_t(t.type))->name);
      CAPTURE(tname);
      REQUIRE(type_supported(t.type));
      const int64_t K = int64_t(t.dims[0]), rows = int64_t(t.n_elements) / K;
      const auto qd = qf.tensor_data(t);
      const auto fd = ff.tensor_data(ft);
      std::vector<float> row(static_cast<size_t>(K));
      for (int64_t r = 0; r < rows; ++r) {
        dequantize_row(t.type, qd.data(), K, r, row.data());
        if (std::memcmp(row.data(), fd.data() + r * K * 4, size_t(K) * 4) != 0) {
          const float* want = reinterpret_cast<const float*>(fd.data() + r * K * 4);
          int64_t k = 0;
          while (row[size_t(k)] == want[k] || (std::isnan(row[size_t(k)]) && std::isnan(want[k]))) ++k;
          FAIL("row " << r << " element " << k << ": ds4 " << row[size_t(k)] << ", llama.cpp " << want[k]);
        }
      }
      ++checked[tname];
    }
  }
  std::string summary;
  for (const auto& [name, n] : checked) summary += name + ":" + std::to_string(n) + " ";
  MESSAGE("tensors equal to llama.cpp's, by type: " << summary);
  CHECK(!checked.empty());
}

TEST_CASE("quants: every type ds4 computes with has a CPU row of its shared row's geometry, and a product in every table") {
  std::string names;
  int supported = 0;
  for (uint32_t n = 0; n < TypeKernelTable::kSlots; ++n) {
    const GgmlType t = GgmlType(n);
    const TypeTraits* row = type_row(t);
    const QuantType* q = quant_type(t);
    if (!row || !type_supported(t)) {
      CHECK(q == nullptr);
      continue;
    }
    CAPTURE(row->name);
    ++supported;
    names += (names.empty() ? "" : ", ") + std::string(row->name);
    REQUIRE(q != nullptr);
    CHECK(q->type == t);
    CHECK(q->block_elems == int64_t(row->block_elems));
    CHECK(q->block_bytes == int64_t(row->block_bytes));
    CHECK(q->act == row->act);
    CHECK(bool(q->dequantize));
    CHECK((q->dot != nullptr) == (row->act != ActType::F32));  // a quantized type has its reference dot
    CHECK(row->device != DeviceLayout::none);
    CHECK(row_bytes(t, 256) == int64_t(type_bytes(t, 256)));
    for (const KernelTable* kt : tables()) {
      CAPTURE(kt->name);
      CHECK(bool(kt->matmul_rows));
    }
  }
  CHECK(supported >= 15);
  CHECK(names.size() == supported_types().size());  // the same names, in the rows' order there
  for (size_t at = 0, end; at < names.size(); at = end + 2) {
    end = std::min(names.find(", ", at), names.size());
    CHECK(supported_types().find(names.substr(at, end - at)) != std::string_view::npos);
  }
}

namespace {

// An E2M1 code (sign, two exponent bits, one mantissa bit) as its value,
// from the OCP MX format's definition.
double e2m1(unsigned code) {
  const unsigned exp = (code >> 1) & 3, man = code & 1;
  const double mag = exp == 0 ? 0.5 * man : std::ldexp(1.0 + 0.5 * man, int(exp) - 1);
  return code & 8 ? -mag : mag;
}

}  // namespace

TEST_CASE("quants: MXFP4 dequantizes as E2M1 values times the E8M0 scale, for every exponent") {
  // One block per exponent byte 0..255, its 32 codes cycling through all 16.
  std::vector<uint8_t> w(256 * 17);
  for (int e = 0; e < 256; ++e) {
    w[size_t(e * 17)] = uint8_t(e);
    for (int j = 0; j < 16; ++j) w[size_t(e * 17 + 1 + j)] = uint8_t((j + e) % 16 | ((j * 7 + e) % 16) << 4);
  }
  std::vector<float> got(256 * 32);
  dequantize_row(GgmlType::MXFP4, w.data(), 256 * 32, 0, got.data());
  for (int e = 0; e < 256; ++e)
    for (int j = 0; j < 32; ++j) {
      const uint8_t byte = w[size_t(e * 17 + 1 + j % 16)];
      const unsigned code = j < 16 ? byte & 0xF : byte >> 4;
      // 2^(e - 127), the E8M0 scale, as a double (exact); the product is exact
      // in double and rounds only where f32 overflows (e = 255, |v| >= 2) or
      // has too few bits (none here: at most two significant bits).
      const double want = e2m1(code) * std::ldexp(1.0, e - 127);
      CAPTURE(e);
      CAPTURE(code);
      CHECK(got[size_t(e * 32 + j)] == float(want));  // == : ggml's -0 code gives +0
    }
}

TEST_CASE("quants: MXFP4 products equal a double sum of the dequantized weights and activations, in every table") {
  std::mt19937 rng(21);
  std::normal_distribution<float> nd(0.f, 1.f);
  const int64_t N = 37, K = 1024;
  const auto w = random_rows(GgmlType::MXFP4, N, K, rng);
  std::vector<float> wd(static_cast<size_t>(K));
  for (int64_t T : {1, 3, 4, 9}) {
    std::vector<float> x(size_t(T * K));
    for (auto& v : x) v = nd(rng);
    for (const KernelTable* kt : tables()) {
      CAPTURE(kt->name);
      CAPTURE(T);
      const auto y = product(*kt, GgmlType::MXFP4, w, N, K, x, T, K);
      const Acts acts = quantize(*kt, x, T, K, K);
      for (int64_t n = 0; n < N; ++n) {
        dequantize_row(GgmlType::MXFP4, w.data(), K, n, wd.data());
        for (int64_t t = 0; t < T; ++t) {
          double s = 0, mag = 0;
          for (int64_t k = 0; k < K; ++k) {
            const BlockQ8Act& xb = acts.xq[size_t(t * K / 32 + k / 32)];
            const double p = double(wd[size_t(k)]) * double(xb.d) * xb.qs[k % 32];
            s += p;
            mag += std::fabs(p);
          }
          REQUIRE(std::fabs(double(y[size_t(t * N + n)]) - s) <= 1e-5 * mag + 1e-6);
        }
      }
    }
  }
}

TEST_CASE("quants: MXFP4's quantization picks ggml's exponent and the nearest value of each") {
  const QuantType& q = *quant_type(GgmlType::MXFP4);
  REQUIRE(bool(q.from_float));
  std::mt19937 rng(22);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> x(32 * 64), y(x.size());
  for (size_t i = 0; i < x.size(); ++i) x[i] = nd(rng) * std::ldexp(1.0f, int(i / 32) % 40 - 20);
  for (int j = 0; j < 32; ++j) x[size_t(5 * 32 + j)] = 0;  // an all-zero block: exponent byte 0
  std::vector<uint8_t> w(64 * 17);
  q.from_float(x.data(), int64_t(x.size()), w.data());
  dequantize_row(GgmlType::MXFP4, w.data(), int64_t(x.size()), 0, y.data());
  for (int b = 0; b < 64; ++b) {
    CAPTURE(b);
    float amax = 0;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[size_t(b * 32 + j)]));
    const int e = amax > 0 ? int(std::floor(std::log2(amax))) - 2 + 127 : 0;
    CHECK(int(w[size_t(b * 17)]) == e);
    const double d = std::ldexp(1.0, e - 128);  // the halved scale of ggml's doubled values
    for (int j = 0; j < 32; ++j) {
      const double v = x[size_t(b * 32 + j)];
      double best = INFINITY;
      for (unsigned c = 0; c < 16; ++c) best = std::min(best, std::fabs(2 * e2m1(c) * d - v));
      CHECK(std::fabs(double(y[size_t(b * 32 + j)]) - v) == doctest::Approx(best).epsilon(1e-6));
    }
  }
}
