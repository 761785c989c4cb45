#pragma once
/// Block-quantised weights on the device: Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K,
/// Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4 (Q8_0 has its own split layout, common.cuh).
///
/// The device layout ("planes"). A row is cut into groups of 32 weights; for
/// group g of the matrix (row-major, g = row * cols/32 + i):
///   lo  (data)  the low bits of the 32 quants: 16 bytes (4 bits each) or 8
///               bytes (2 bits each), so the GEMV reads them in 16/8-byte loads;
///   hi          the high bits: 4 bytes (1 bit each: Q5_*, Q3_K) or 8 bytes
///               (2 bits: Q6_K), or none;
///   sub         the group's sub-block scale bytes as the format stores them
///               (2 bytes: two 16-weight sub-blocks, or scale + min of one
///               32-weight sub-block; 1 byte for IQ4_XS; none for 32-blocks);
///   sup         the block's halves (d, and dmin or m where the type has one;
///               MXFP4: its E8M0 exponent byte), one record per GGUF block (8
///               groups for K-types, 1 otherwise).
/// Quant order within a group: quad k (0..7) holds weights 4k..4k+3; with
/// 4 low bits, byte j of lo has weight j in its low nibble and 16+j in its high
/// one; with 2 bits, word h (0, 1) of lo has weight 16h+4k+b at bits 8b+2k;
/// one high bit of weight 4k+b (16+4k+b) at bit 8b+k (8b+4+k); two high bits
/// as the 2-bit low ones. Each plane starts 16-byte aligned.
///
/// A weight is w = a * (q - OFF) + b (IQ4: a * table[q]), where a and b are
/// computed in f32 exactly as llama.cpp's dequantize_row_* does (one rounding
/// per product, no fused multiply-add), so dequantisation is bit-exact.
/// Included only by worker/cuda/*.cu.

#include "worker/backend.h"
#include "worker/cuda/common.cuh"

namespace ds4::cuda {

/// Bytes a group takes in each plane, and the GGUF block geometry.
struct QuantPlanes {
  int lo = 0, hi = 0, sub = 0;  // bytes per group of 32
  int sup = 0;                  // bytes per GGUF block
  int block_elems = 0, block_bytes = 0;
};

/// The types laid out in planes: each has its constants (quant_read.cuh,
/// QT<TY>), its GGUF block's reading (quant.cu, native_q and the sub/sup
/// records) and an entry of kernels below. Adding one is a QT row, those two
/// readers, and its name here (the shared row's DeviceLayout::planes).
#define DS4_PLANE_TYPES(X) X(Q4_0) X(Q4_1) X(Q5_0) X(Q5_1) X(Q2_K) X(Q3_K) X(Q4_K) X(Q5_K) X(Q6_K) X(IQ4_NL) X(IQ4_XS) X(MXFP4)

/// True for the types laid out in planes (see above).
bool is_block_quant(GgmlType t);
/// The planes of a block-quantised type (throws for another type).
QuantPlanes quant_planes(GgmlType t);
/// Device bytes of a rows x cols block-quantised matrix (the four planes,
/// each rounded up to 16 bytes). Throws ds4::Error naming the type when cols
/// is not a multiple of its block.
uint64_t quant_device_bytes(GgmlType t, int64_t rows, int64_t cols);
/// The view of such a matrix laid out at `base` (device memory).
DeviceWeight quant_view(GgmlType t, const void* base, int64_t rows, int64_t cols);
/// GGUF blocks (device memory, rows x cols weights) into the planes at `dst`
/// (quant_device_bytes of device memory); returns the view.
DeviceWeight repack_quant(GgmlType t, const void* blocks, int64_t rows, int64_t cols, void* dst, cudaStream_t s);

/// The whole matrix as f16 (rows x cols, row-major): the exact f32 weight,
/// rounded to nearest. For the prefill GEMM.
void dequant_quant_f16(const DeviceWeight& w, __half* out, cudaStream_t s);
/// The whole matrix as f32, bit-exact with llama.cpp's dequantize_row_*.
void dequant_quant_f32(const DeviceWeight& w, float* out, cudaStream_t s);

/// One stack of a layer's expert matrices (a table of DeviceWeight views,
/// each `type`, `rows` x `cols`) applied to rows of x (ldx floats apart) into
/// rows of y: what the expert launches below have in common.
struct ExpertProduct {
  const DeviceWeight* table = nullptr;
  const float* x = nullptr;
  int64_t ldx = 0;
  float* y = nullptr;
  int64_t ldy = 0;
  GgmlType type = GgmlType::F32;
  int64_t rows = 0, cols = 0;
};

/// A mixture of experts' products for a step's (token, expert) pairs in one
/// launch: y[p] = table[expert_of[p]] . x[p / x_div] for p < pairs (rows of
/// ldx and ldy floats). Every matrix of the table has `type`, `rows` and
/// `cols`; the table, the expert ids and x are device memory.
struct ExpertGemv : ExpertProduct {
  const int32_t* expert_of = nullptr;
  int pairs = 0;
  int x_div = 1;
  /// A second table of like matrices over the same x, into y2, in the same
  /// launch (a mixture's gate and up).
  const DeviceWeight* second = nullptr;
  float* y2 = nullptr;
  /// When set, the input is SwiGLU(x, x_up) (silu_mul, rows of ldx floats),
  /// taken as x is quantised: no SwiGLU launch before a mixture's down.
  const float* x_up = nullptr;
};
/// Whether expert_gemv() takes matrices of `type` and `cols` (block-quantised
/// types whose row fits the dp4a kernel's shared memory).
bool expert_gemv_takes(GgmlType type, int64_t cols);
void expert_gemv(const ExpertGemv& g, cudaStream_t s);

/// A mixture of experts' products for a prefill, its rows grouped by expert:
/// job j (three words at jobs + 3j: expert, first row, rows 1..8) is
/// y[r] = table[expert] . x[r] for its rows, each group through the decode
/// GEMV's body, so an expert's weights are read once a group of 8 rows. Every
/// matrix of the table has `type`, `rows` and `cols`; table, jobs and x are
/// device memory; rows 16-byte aligned.
struct ExpertGroups : ExpertProduct {
  const int32_t* jobs = nullptr;
  int n_jobs = 0;
  const int32_t* count = nullptr;  // qgemm_experts: device memory, the jobs' number (at most n_jobs), or none
};
/// Whether expert_groups() takes matrices of `type` and `cols`.
bool expert_groups_take(GgmlType type, int64_t cols);
void expert_groups(const ExpertGroups& g, cudaStream_t s);

/// The tiled GEMM (qgemm.cu): y[t] (+)= W . x[t] for a batch of tokens, the
/// matrix (Q8_0 or block-quantised, columns a multiple of 64) unpacked to
/// halves a tile at a time in shared memory and multiplied with the tokens'
/// activations (rounded to halves) on the tensor cores, f32 sums: the inputs
/// of the dequantise-then-cuBLAS way without its f16 copy of the matrix.
/// Blocks of 128 rows x up to 64 tokens; when they are too few for the GPU
/// the columns are split, each split's sums kept in `part` (T x rows floats
/// a split, as many splits as part_bytes holds) and added in a fixed order.
constexpr int kQgemmTokens = 64;
/// Batches up to this many tokens take qgemm() (DS4_CUDA_QGEMM_TOKENS;
/// DS4_CUDA_QGEMM=off: none, the way before, for comparison).
int qgemm_max_tokens();
bool qgemm_takes(GgmlType type, int64_t cols);
void qgemm(const DeviceWeight& w, const float* x, int64_t ldx, int T, float* y, int64_t ldy, bool accumulate,
           float* part, size_t part_bytes, cudaStream_t s);
/// A mixture of experts' prefill on the same kernel: ExpertGroups' jobs, of
/// up to `max_rows` (<= 64) rows each.
void qgemm_experts(const ExpertGroups& g, int max_rows, cudaStream_t s);

/// One planes type's device kernels (as ggml-cuda's per-type dequantize,
/// mul_mat_vec and mul_mat_q): built from the type's constants when quant.cu
/// is compiled, looked up once per launch. The functions above and below
/// check their arguments, then call these.
struct QuantKernels {
  GgmlType type;
  QuantPlanes planes;
  /// GGUF blocks (device memory) into the planes of `d` (quant_view).
  void (*repack)(const void* blocks, const DeviceWeight& d, cudaStream_t s);
  void (*dequant_f16)(const DeviceWeight& w, __half* out, cudaStream_t s);
  void (*dequant_f32)(const DeviceWeight& w, float* out, cudaStream_t s);
  void (*embed)(const DeviceWeight& table, const BatchToken* batch, int T, float* x, int64_t ldx, cudaStream_t s);
  void (*gemv)(const DeviceWeight& w, const float* x, int64_t ldx, int T, float* y, int64_t ldy, bool accumulate,
               cudaStream_t s);
  void (*expert_gemv)(const ExpertGemv& g, cudaStream_t s);
  void (*expert_groups)(const ExpertGroups& g, cudaStream_t s);
};
/// The entry of a planes type, or nullptr.
const QuantKernels* quant_kernels(GgmlType t);

/// Decode GEMV: y[t*ldy + n] (+)= W[n] . x[t*ldx ...] for T <= kMaxGemvTokens
/// tokens; x rows 16-byte aligned (ldx a multiple of 4). Each weight's
/// quants are multiplied with x as small integers turned into floats, and the
/// sub-block's a and b applied once per 16 or 32 products.
void gemv_quant(const DeviceWeight& w, const float* x, int64_t ldx, int T, float* y, int64_t ldy, bool accumulate,
                cudaStream_t s);

/// x[t] = row batch[t].token of a block-quantised table, dequantised (f32, exact).
void embed_quant(const DeviceWeight& table, const BatchToken* batch, int T, float* x, int64_t ldx, cudaStream_t s);

}  // namespace ds4::cuda
