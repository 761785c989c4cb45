// ds4-kernel-bench: how fast one kernel table's product reads a weight
// type's rows, with no model: N rows of K random weights (valid fp16 scales)
// times T tokens, the rows held in L2 (--rows small) or streamed from memory
// (--rows large). One JSON line a round: GB/s of weights, us a call, and
// the outputs' bits as a hash (y_bits: the same in every table).
// A developer's tool for kernel work (worker/cpu/NOTES.md says what it showed);
// DS4_CPU_KERNELS picks the table as for the worker.
//
//   ds4-kernel-bench [--type Q4_K] [-k 2048] [--rows 64] [-t 1] [--seconds 1] [--rounds 3]

#include <sys/mman.h>

#include <algorithm>
#include <cctype>
#include <cstddef>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "shared/ggml_types.h"
#include "worker/cpu/kernels.h"
#include "worker/cpu/quant_types.h"

namespace ds4 {
namespace {

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr,
               "ds4-kernel-bench: %s\nusage: ds4-kernel-bench [--type T] [-k K] [--rows N] [-t TOKENS] "
               "[--seconds S] [--rounds R]\n  T: a weight type the CPU backend computes with (%.*s)\n",
               why, int(supported_types().size()), supported_types().data());
  std::exit(2);
}

std::optional<GgmlType> type_named(std::string_view name) {
  for (uint32_t t = 0; t < 64; ++t) {
    const auto tr = type_traits(t);
    if (!tr) continue;
    std::string a(tr->name), b(name);
    for (auto* s : {&a, &b})
      for (char& c : *s) c = char(std::toupper(static_cast<unsigned char>(c)));
    if (a == b && type_supported(GgmlType(t))) return GgmlType(t);
  }
  return std::nullopt;
}

int run(int argc, char** argv) {
  std::string type_name = "Q4_K";
  int64_t K = 2048, N = 64, T = 1;
  double seconds = 1;
  int rounds = 3;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    if (i + 1 >= argc) usage(("missing a value after " + std::string(a)).c_str());
    const char* v = argv[++i];
    if (a == "--type") type_name = v;
    else if (a == "-k") K = std::atoll(v);
    else if (a == "--rows") N = std::atoll(v);
    else if (a == "-t") T = std::atoll(v);
    else if (a == "--seconds") seconds = std::atof(v);
    else if (a == "--rounds") rounds = std::atoi(v);
    else usage(("unknown option " + std::string(a)).c_str());
  }
  const auto type = type_named(type_name);
  if (!type) usage(("unknown type " + type_name).c_str());
  const cpu::QuantType* q = cpu::quant_type(*type);
  if (!q) usage(("no CPU row for " + type_name).c_str());
  if (K <= 0 || K % 256 != 0 || N <= 0 || T <= 0 || T > 512 || rounds <= 0 || !(seconds > 0))
    usage("-k must be a positive multiple of 256, --rows and --rounds positive, -t 1..512, --seconds > 0");

  const int64_t rb = cpu::row_bytes(*type, K);
  const size_t bytes = size_t(rb) * size_t(N);
  // Shared anonymous pages, as the model segment's (4 KiB pages, tmpfs).
  void* map = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (map == MAP_FAILED) usage("cannot map the weights");
  auto* w = static_cast<uint8_t*>(map);
  std::mt19937_64 rng(42);
  for (size_t i = 0; i < bytes; ++i) w[i] = uint8_t(rng());
  const auto scale = [&] { return uint16_t(0x1000 + rng() % 0x0800); };  // ~2^-12 .. 2^-11, positive
  if (*type == GgmlType::F16) {
    for (size_t i = 0; i < bytes / 2; ++i) {
      const uint16_t h = uint16_t(0x3000 + rng() % 0x0c00) | uint16_t(rng() & 1 ? 0x8000 : 0);
      std::memcpy(w + 2 * i, &h, 2);
    }
  } else if (*type == GgmlType::BF16) {
    for (size_t i = 0; i < bytes / 2; ++i) {
      const uint16_t h = uint16_t(0x3e00 + rng() % 0x0100) | uint16_t(rng() & 1 ? 0x8000 : 0);
      std::memcpy(w + 2 * i, &h, 2);
    }
  } else if (*type == GgmlType::F32) {
    for (size_t i = 0; i < bytes / 4; ++i) {
      const float f = float(int(rng() % 2001) - 1000) / 1000.0f;
      std::memcpy(w + 4 * i, &f, 4);
    }
  } else if (q->from_float) {  // the type's own quantization of random weights
    std::vector<float> row(static_cast<size_t>(K));
    for (int64_t n = 0; n < N; ++n) {
      for (float& v : row) v = float(int(rng() % 2001) - 1000) / 1000.0f;
      q->from_float(row.data(), K, w + n * rb);
    }
  } else {  // random bytes, the fp16 scales (d, and m / dmin) sane: not infinities or NaNs
    for (size_t b = 0; b + q->block_bytes <= bytes; b += q->block_bytes)
      for (const int16_t off : q->fp16_scales) {
        if (off < 0) continue;
        const uint16_t h = scale();
        std::memcpy(w + b + size_t(off), &h, 2);
      }
  }

  const cpu::KernelTable& table = cpu::cpu_kernels();
  std::vector<float> x(size_t(T * K)), y(size_t(T * N));
  for (float& v : x) v = float(int(rng() % 2001) - 1000) / 1000.0f;
  cpu::MatmulArgs a;
  a.type = *type;
  a.w = w;
  a.K = K;
  a.N = N;
  a.x = x.data();
  a.ldx = K;
  a.T = T;
  a.y = y.data();
  a.ldy = N;
  std::vector<cpu::BlockQ8Act> xq;
  std::vector<cpu::BlockQ8K> xk;
  if (q->act == cpu::ActType::Q8_0) {
    xq.resize(size_t(T * K / 32));
    for (int64_t t = 0; t < T; ++t) table.quantize_q8(x.data() + t * K, K, xq.data() + t * (K / 32));
    a.xq = xq.data();
    a.ldxq = K / 32;
  } else if (q->act == cpu::ActType::Q8_K) {
    xk.resize(size_t(T * K / 256));
    for (int64_t t = 0; t < T; ++t) table.quantize_q8k(x.data() + t * K, K, xk.data() + t * (K / 256));
    a.xk = xk.data();
    a.ldxk = K / 256;
  }
  std::vector<float> scratch(size_t(cpu::matmul_scratch_floats(K)));
  table.matmul_rows(a, 0, N, scratch.data());  // warm: pages in, rows in the caches when they fit
  for (int r = 0; r < rounds; ++r) {
    int64_t calls = 0;
    const auto t0 = std::chrono::steady_clock::now();
    double s = 0;
    do {
      table.matmul_rows(a, 0, N, scratch.data());
      ++calls;
      s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    } while (s < seconds);
    // The outputs' bits (FNV-1a 64): every table must give the same (kernels.h).
    uint64_t h = 0xcbf29ce484222325ull;
    for (float v : y) {
      uint32_t u;
      std::memcpy(&u, &v, 4);
      for (int i = 0; i < 4; ++i) h = (h ^ ((u >> (8 * i)) & 0xff)) * 0x100000001b3ull;
    }
    std::printf(
        "{\"table\":\"%.*s\",\"type\":\"%s\",\"k\":%lld,\"rows\":%lld,\"tokens\":%lld,\"weights_bytes\":%zu,"
        "\"us_per_call\":%.2f,\"weights_gb_s\":%.2f,\"y0\":%.9g,\"y_bits\":\"%016llx\"}\n",
        int(table.name.size()), table.name.data(), type_name.c_str(), (long long)K, (long long)N, (long long)T, bytes,
        s / double(calls) * 1e6, double(bytes) * double(calls) / s / 1e9, double(y[0]), (unsigned long long)h);
    std::fflush(stdout);
  }
  munmap(map, bytes);
  return 0;
}

}  // namespace
}  // namespace ds4

int main(int argc, char** argv) { return ds4::run(argc, argv); }
