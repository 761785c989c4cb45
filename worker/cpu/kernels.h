#pragma once
/// CPU compute kernels, one table per instruction set (generic, AVX2+FMA+F16C,
/// AVX-512), chosen once at run time by cpu_kernels().
///
/// Numerical contract, relied on for "greedy output is the same alone or
/// batched": every weight type converts exactly to f32 (F16, BF16, and Q8_0's
/// d*q all fit f32 without rounding), and each output y[t][n] = sum_k W[n][k] *
/// x[t][k] is accumulated in 16 lanes (lane l takes k = l, l+16, ... in order,
/// one fused multiply-add each, K padded with zeros to a multiple of 16), then
/// reduced as reduce16 does: m_i = l_i + l_(i+8), then ((m0+m4)+(m2+m6)) +
/// ((m1+m5)+(m3+m7)). That order does not depend on how many tokens are in the
/// batch, on threads, or on the tiling, so results are bit-identical. Sixteen
/// lanes are one 512-bit register or two 256-bit chains: a decoded row is not
/// bound by one chain's latency (8 lanes were: a row read ~15 GB/s a core on
/// Zen 4, less than its share of the memory).
///
/// Q8_0 weights with quantized activations (MatmulArgs::xq, what the engine
/// uses, as llama.cpp does): each x row is first rounded per 32-block by
/// quantize_q8 to d_x * q, q in [-127, 127], the values ggml's x86 code gives. Each output then takes, block by
/// block, the exact integer s = sum of q_w[k] * q_x[k] over the block's 32
/// positions and one fused multiply-add into one of sixteen float lanes:
/// block i's l[2 (i % 8)] = fma(float(s), d_w * d_x, l[2 (i % 8)]) (|s| <
/// 2^24, so float(s) is exact), and the output is reduce16 of the lanes. One
/// chain a row, block by block, bounded a decoded row by the multiply-add's
/// latency (Q4_0: 18 bytes a block, one chain ~16 GB/s a core on Zen 4).
/// Integer sums are exact in any order, so the x86 tables may group them as
/// their vectors like (eight outputs in the lanes of one register), and every
/// table and batch size again gives the same bits.
///
/// The other quantized types (quant_types.h) follow the same pattern: each
/// type names its activation blocks (Q8_0-style blocks of 32, or Q8_K-style
/// blocks of 256 with their 16-sums), every output takes exact integer sums
/// per weight block and one or two float steps per block into the block's
/// lanes (BlockLanes); quant_types.h spells out each type's steps. Without activations
/// quantized (xq / xk unset) every type takes the f32 path above on its
/// dequantized weights.

#include <cstdint>
#include <string_view>

#include "model/memory_plan.h"
#include "shared/ggml_types.h"
#include "worker/cpu/quant_types.h"

namespace ds4::cpu {

/// One head's cached K or V: a row of hd values per position, `row_bytes`
/// apart, in `type` (f16, or ggml's Q8_0 blocks: kv_row_bytes()). The
/// attention converts each value exactly to f32 (f16, and Q8_0's d * q, fit
/// f32 without rounding), so both types take the same float arithmetic.
struct KvRows {
  const void* data = nullptr;
  KvType type = KvType::f16;
  int64_t row_bytes = 0;
};

/// 32 activations rounded for the integer product with Q8_0 weights:
/// x[i] ~ d * qs[i], qs = round-to-nearest-even(x * 127 / max|x|), d = max|x| / 127
/// rounded to fp16 (as ggml stores it: the same activations as llama.cpp's).
/// A block with max|x| below kQ8ActTiny (where 127 / max|x| could overflow) is all zeros.
inline constexpr float kQ8ActTiny = 1e-30f;
struct BlockQ8Act {
  float d;
  int8_t qs[32];
};

/// y[t*ldy + n] = dot(W row n, x[t*ldx ...]) for n in [n0, n1), t in [0, T).
/// x rows hold K floats (ldx >= K; nothing past K is read).
/// For a quantized weight type, the activation blocks its row names
/// (quant_type(type)->act) hold the same rows quantized: `xq` (quantize_q8,
/// row t at xq + t * ldxq) for act Q8_0, `xk` (quantize_q8k, row t at
/// xk + t * ldxk) for act Q8_K, and the integer product is used; without them
/// the product takes the f32 x (exact weights, the reference that other
/// backends' tests compare with).
struct MatmulArgs {
  GgmlType type = GgmlType::F32;
  const void* w = nullptr;  // N rows of K elements, row-major, as stored in GGUF
  int64_t K = 0;
  int64_t N = 0;
  const float* x = nullptr;
  int64_t ldx = 0;
  int64_t T = 0;
  float* y = nullptr;
  int64_t ldy = 0;
  const BlockQ8Act* xq = nullptr;
  int64_t ldxq = 0;
  const BlockQ8K* xk = nullptr;
  int64_t ldxk = 0;
  /// True when the activation blocks this weight type's product takes are set.
  bool quantized() const;
};

/// Floats of scratch one thread needs for matmul_rows with this K.
int64_t matmul_scratch_floats(int64_t K);

/// Rows [n0, n1) of a product; `scratch` holds matmul_scratch_floats(K) floats.
using MatmulRows = void (*)(const MatmulArgs& a, int64_t n0, int64_t n1, float* scratch);

/// One kernel table's products for one weight type (ggml's type_traits_cpu
/// vec_dot, per instruction set): `quantized` with the activation blocks of
/// the type's row (a.quantized()), `f32` on f32 activations. A table
/// registers them once per type (TypeKernelTable::set); matmul_rows looks
/// them up once per call.
struct TypeKernels {
  MatmulRows quantized = nullptr;
  MatmulRows f32 = nullptr;
};

/// A table's entries, by type number. Every type the CPU backend runs
/// (quant_type()) starts with the generic table's entries.
class TypeKernelTable {
 public:
  static constexpr size_t kSlots = 64;  // more than any GgmlType's number
  TypeKernelTable();  // the generic entries
  void set(GgmlType t, TypeKernels k) { at_[size_t(t)] = k; }
  void set_quantized(GgmlType t, MatmulRows f) { at_[size_t(t)].quantized = f; }
  void set_f32(GgmlType t, MatmulRows f) { at_[size_t(t)].f32 = f; }
  const TypeKernels& operator[](GgmlType t) const { return at_[size_t(t) < kSlots ? size_t(t) : 0]; }
  /// Rows [n0, n1) of a's product through the type's entry.
  void matmul_rows(const MatmulArgs& a, int64_t n0, int64_t n1, float* scratch) const {
    const TypeKernels& k = (*this)[a.type];
    (a.quantized() ? k.quantized : k.f32)(a, n0, n1, scratch);
  }

 private:
  TypeKernels at_[kSlots];
};

struct KernelTable {
  std::string_view name;
  /// Rows [n0, n1) of the product; `scratch` holds matmul_scratch_floats(K) floats
  /// (through the table's TypeKernels for a.type).
  MatmulRows matmul_rows;
  /// Attention of one query head over n_pos cached positions (K and V rows
  /// of `hd` values, of one type): out = softmax(scale * q.K) V,
  /// in tiles of kAttendTile positions with an online softmax (flash
  /// attention: the maximum and sum so far, the output rescaled when the
  /// maximum grows). `scores` holds kAttendTile floats, at any depth.
  void (*attend)(const float* q, KvRows k, KvRows v, int64_t n_pos, int64_t hd, float scale, float* out,
                 float* scores);
  /// attend() for nq queries of one head over the same cached K and V (the
  /// tokens of one sequence in a prefill chunk): query j attends its first
  /// n_pos[j] positions, out[j] gets its result, bit for bit attend()'s.
  /// Reads each tile of K and V once for all of them. `scores` holds
  /// nq * score_stride floats (score_stride >= kAttendTile).
  void (*attend_block)(const float* const* q, const int64_t* n_pos, int nq, KvRows k, KvRows v, int64_t hd,
                       float scale, float* const* out, float* scores, int64_t score_stride);
  /// dst[i] = f16(src[i]), round to nearest even.
  void (*to_f16)(const float* src, uint16_t* dst, int64_t n);
  /// The K floats of x (K a multiple of 32) as K/32 blocks for Q8_0 products.
  void (*quantize_q8)(const float* x, int64_t K, BlockQ8Act* out);
  /// The K floats of x (K a multiple of 256) as K/256 blocks for K-quant products.
  void (*quantize_q8k)(const float* x, int64_t K, BlockQ8K* out);
  /// SwiGLU: g[i] = g[i] / (1 + e^-g[i]) * u[i], e^x within 1 ulp of std::exp.
  void (*silu_mul)(float* g, const float* u, int64_t n);
};

/// The queries a block of attend_block takes at most (scratch: that many score rows).
inline constexpr int kAttendBlock = 8;
/// Positions of K and V one step of the online softmax takes (a score row's length).
inline constexpr int64_t kAttendTile = 512;

/// attend_block as nq calls of attend (the generic table's).
void attend_block_by_query(const KernelTable& t, const float* const* q, const int64_t* n_pos, int nq, KvRows k,
                           KvRows v, int64_t hd, float scale, float* const* out, float* scores, int64_t score_stride);

/// A cache row of n values (n a multiple of 32) as Q8_0 blocks: each block's
/// values rounded as quantize_q8 rounds them (d = max|x| / 127 stored as f16,
/// q = round-to-nearest-even(x * 127 / max|x|): ggml's x86 values), through
/// table `t`'s quantize_q8.
void store_kv_q8(const KernelTable& t, const float* x, int64_t n, void* blocks);

const KernelTable& generic_kernels();
const KernelTable* avx2_kernels();    // nullptr when not built
const KernelTable* avx512_kernels();  // nullptr when not built
const KernelTable* avx512vnni_kernels();  // the same with VNNI; nullptr when not built
/// The best table this CPU runs (env DS4_CPU_KERNELS=generic|avx2|avx512|avx512vnni forces one).
const KernelTable& cpu_kernels();

/// How the x86 tables' decode (T <= 3) walks 16/32-bit weight rows: `rows`
/// side by side (1 or 2: one multiply-add chain each) and how many bytes on
/// each row asks for its lines (0: none). Which is faster depends on the
/// core, not the ISA (207M F16, 2 threads, 8-lane chains: Zen 5 tg 79 ->
/// 101-104 tok/s with two rows; Zen 4 one row 71, two 45; 16-lane chains on
/// Zen 4: one row 45 tok/s a thread without a prefetch, 31 asking 4 KiB on,
/// two rows 18-22; an Intel Xeon with AVX-512, 2 threads: one row 45 asking
/// 4 KiB on, 29-31 without), so it is chosen once from the CPU: two rows 8 KiB
/// on for AMD family 26 (Zen 5) and later, one row without a prefetch for AMD
/// family 25 (Zen 3, Zen 4), one row 4 KiB on elsewhere;
/// DS4_CPU_DECODE_ROWS=1|2 and DS4_CPU_DECODE_AHEAD=bytes override. The
/// results are the same bits either way (a row's chain is its own).
struct DecodeWalk {
  int rows;
  int64_t ahead;
};
const DecodeWalk& decode_walk();

/// How the AVX-512 tables' K-quant prefill tiles a product: 1 (one row times
/// eight tokens a pass) or 2 (two rows times four). Zen 4 (AMD family 25)
/// takes one row: ds4-kernel-bench, 64 rows of K 2048 times 128 tokens,
/// avx512vnni, Q4_K 238 us against 271, Q5_K 252 / 288, Q6_K 233 / 245, Q3_K
/// 256 / 273, Q2_K 228 / 233. Elsewhere two rows, as measured on Zen 5 (1B
/// Q4_K_M pp128 158-185 tok/s; one row not tried there). DS4_CPU_PREFILL_ROWS=1|2
/// overrides. The same bits either way (each output's steps are its own).
/// In the avx512vnni table, batches of twelve tokens or more take neither:
/// sixteen tokens a register (quants_x86.h, kquant_rows_tokens16).
int kquant_prefill_rows();

/// Row `row` of a weight matrix with K columns, converted exactly to f32.
void dequantize_row(GgmlType type, const void* w, int64_t K, int64_t row, float* out);
/// Bytes of one row of K elements.
int64_t row_bytes(GgmlType type, int64_t K);
/// Rows [n0, n1) of a product with quantized activations (a.quantized()),
/// through the reference dot product of the type's row: the fallback of every
/// table for the types it has no own kernel for.
void matmul_rows_quantized_generic(const MatmulArgs& a, int64_t n0, int64_t n1);

/// n rounded up to the contract's 16 lanes.
inline constexpr int64_t pad16(int64_t n) { return (n + 15) / 16 * 16; }

}  // namespace ds4::cpu
