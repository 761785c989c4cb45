#pragma once
/// The memory a worker uses, as a pure function of the model's
/// hyper-parameters, the engine shape and the backend kind: the supervisor
/// plans each ladder rung with it (without linking the engine), and each
/// backend's plan() and reserve() use the same function, so the figure the
/// supervisor budgets is the one the worker allocates.
///
/// The activations the forward pass names (Act, worker/forward.h) are laid
/// out here, in one float buffer, per backend kind, together with the
/// backend's own scratch; a backend carves its buffer by scratch_layout().

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "model/hparams.h"

namespace ds4 {

struct ModelWeights;

/// How the KV cache stores a head's row of head_dim values: f16, or Q8_0
/// blocks as ggml lays them out (per 32 values an f16 scale d and 32 int8 q,
/// value = d * q; 34 bytes, 8.5 bits a value: the cache in 53% of f16's
/// memory, each value within about half a step, max|x| / 254, of its own). The CPU keeps
/// ggml's blocks; CUDA the same bytes as two arrays (the int8 values, then
/// the scales), so that its loads stay aligned.
enum class KvType : uint8_t { f16, q8_0 };
inline constexpr int64_t kKvQ8Block = 32;       // values of a Q8_0 block
inline constexpr int64_t kKvQ8BlockBytes = 34;  // its bytes
const char* kv_type_name(KvType t);  // "f16", "q8_0"
std::optional<KvType> kv_type_from(std::string_view name);  // the inverse; nullopt for anything else
/// Bytes of one cached row of hd values (hd a multiple of 32 for q8_0).
inline int64_t kv_row_bytes(KvType t, int64_t hd) {
  return t == KvType::q8_0 ? hd / kKvQ8Block * kKvQ8BlockBytes : hd * 2;
}

/// The sizes a worker is started with.
struct EngineShape {
  int64_t ctx = 2048;      // tokens per slot
  int64_t slots = 1;       // concurrent sequences
  int64_t max_batch = 256; // tokens per forward step (prefill chunk + decodes)
  KvType kv = KvType::f16; // the KV cache's storage
};

/// Memory a worker will use, known before anything is allocated.
struct MemoryPlan {
  uint64_t weights = 0;  // resident in the shared segment (not the worker's own)
  uint64_t kv = 0;       // KV cache, context x slots
  uint64_t scratch = 0;  // activations and logits for one step
  // A GPU worker on the expert rung: the experts it copied to the device
  // itself (the layers its holder lacks), allocated when it starts, before
  // reserve(); not in own(), which is what reserve() allocates.
  uint64_t experts = 0;
  uint64_t own() const { return kv + scratch; }
};

enum class BackendKind : uint8_t { cpu, cuda };

/// KV cache bytes for a shape (K and V for every layer, slot and position,
/// in shape.kv).
inline uint64_t kv_cache_bytes(const HParams& hp, const EngineShape& shape) {
  return 2ull * uint64_t(hp.n_layers) * uint64_t(shape.slots) * uint64_t(shape.ctx) * uint64_t(hp.n_kv_heads) *
         uint64_t(kv_row_bytes(shape.kv, hp.head_dim));
}

/// Why `hp` cannot keep its cache in `t`, or empty when it can (Q8_0 needs a
/// head size that is a multiple of 32).
std::string kv_type_unsupported(const HParams& hp, KvType t);

/// The activations of a step, by name. Token rows (max_batch of them):
/// x (the residual stream), xb (its normalised copy, a product's output),
/// q, k, v, att (attention output), hb, hb2 (feed-forward gate and up);
/// logit rows (slots + 1): xl (the rows that need logits), logits.
/// A mixture of experts adds token rows (empty for a dense model): router
/// (each token's expert scores), moe_in (each token's input once per expert
/// it chose, grouped by expert: max_batch x n_used rows, as hb and hb2 then
/// have) and moe_out (the experts' outputs on those rows).
enum class Act : uint8_t { x, xb, q, k, v, att, hb, hb2, xl, logits, router, moe_in, moe_out };
inline constexpr int kActCount = 13;

/// Rows, used width and row stride (floats) of an activation. Widths are
/// padded to a multiple of 8 (the padding holds zeros), logits are not.
struct ActShape {
  int64_t rows = 0;
  int64_t width = 0;
  int64_t ld = 0;
};
ActShape act_shape(const HParams& hp, const EngineShape& shape, Act a);

/// What of the weights the plan depends on besides their size.
struct WeightsSummary {
  uint64_t bytes = 0;               // all tensors the model uses
  uint64_t largest_q8_elems = 0;    // elements of the largest quantised matrix (CUDA's prefill dequantisation)
  static WeightsSummary of(const ModelWeights& w);
};

/// Per-backend inputs that are configuration, not hardware: the same on the
/// supervisor and in the worker.
struct BackendPlanOptions {
  BackendKind kind = BackendKind::cpu;
  int threads = 1;  // cpu: pool threads (each has its own scratch)
};

/// Float offsets of each part of a backend's scratch buffer.
/// Queries of one sequence and head the CPU backend attends in one pass over
/// the cached K and V (cpu::kAttendBlock): each thread keeps a score row for
/// each, of one tile of positions (cpu::kAttendTile), whatever the context.
inline constexpr int64_t kAttendQueriesPerThread = 8;
inline constexpr int64_t kAttendScoresPerQuery = 512;

struct ScratchLayout {
  std::array<int64_t, kActCount> act{};  // offset of each Act
  // CPU backend: RoPE cos/sin (max_batch x n_rot), the residual-add staging
  // rows (max_batch x ld(x)), the quantized input of a product, and each
  // pool thread's scratch (matmul, attention scores, a head).
  int64_t rope = 0, stage = 0, xq = 0, xk = 0, threads = 0;
  // A mixture of experts' routes: 4 x max_batch x n_used + n_expert + 1 words.
  int64_t moe = 0;
  // CUDA backend: the attention's split scratch (its counters first).
  int64_t attn = 0, attn_floats = 0;
  int64_t per_thread = 0;       // floats per thread
  int64_t matmul_per_thread = 0; // the part of it a matrix product may use
  int64_t xq_floats = 0;
  int64_t xk_floats = 0;          // the same in Q8_K blocks of 256 (320 bytes: 80 floats, 64-byte aligned)
  int64_t total = 0;            // floats
};

/// The CPU layout (`opt.threads` pool threads). The products' per-thread
/// scratch is 17 * pad16(K) + 64 floats for the largest K (kernels.h's
/// matmul_scratch_floats: the backend refuses to start when it needs more),
/// the quantized input 9 floats (a BlockQ8Act) per 32 values of a row.
ScratchLayout cpu_scratch_layout(const HParams& hp, const EngineShape& shape, int threads);

/// The CUDA layout of the float buffer: the activations (64-float aligned
/// parts), then the attention split scratch for any device of at most
/// kCudaPlanSms multiprocessors.
inline constexpr int kCudaPlanSms = 256;
/// The most attention blocks a multiprocessor the split kernel is given (DS4_CUDA_ATTN_BLOCKS).
inline constexpr int kCudaAttnBlocksPerSm = 8;
/// Partial result rows a decode step's splits may take beyond one a (token,
/// head) (cuda::attention_splits keeps within them).
inline constexpr int64_t kCudaAttnRows = 4 * kCudaAttnBlocksPerSm * kCudaPlanSms;
/// The prefill attention (flash attention on the tensor cores) takes kCudaFaRows
/// tokens of one head a block; deep in a context, when those blocks are too few
/// for kCudaFaBlocksPerSm a multiprocessor, each also splits its positions, in
/// ranges of at least kCudaFaSplitPositions, whose partial results are merged.
inline constexpr int kCudaFaRows = 64;
inline constexpr int kCudaFaBlocksPerSm = 4;
inline constexpr int64_t kCudaFaSplitPositions = 1024;
ScratchLayout cuda_scratch_layout(const HParams& hp, const EngineShape& shape);

/// Bytes of the CUDA backend's device scratch besides the KV cache: the
/// float buffer of cuda_scratch_layout(), the 16-bit activation copy, the
/// dequantisation buffer of the largest quantised matrix, the cuBLAS
/// workspace, the batch and the logit adjustments.
inline constexpr uint64_t kCudaBlasWorkspace = 32ull << 20;
/// A mixture of experts: the CUDA backend keeps a table of each expert's
/// device view (64 bytes) for the layers it routes on the device.
inline constexpr uint64_t kCudaDeviceWeightBytes = 64;
/// A sampled row's best logits the CUDA backend keeps on the device
/// (worker/cuda/sampling.cuh): kCudaTopLogits of them, found kCudaTopChunk
/// logits a block (each block's best in a buffer of ceil(n_vocab /
/// kCudaTopChunk) * kCudaTopLogits keys of 8 bytes a row), then the row's.
inline constexpr int kCudaTopLogits = 64;
inline constexpr int kCudaTopChunk = 2048;
/// Logit adjustments (a bias or a penalty: 12 bytes each) a step's logit
/// row takes on the device in one upload; more go up in several.
inline constexpr uint64_t kCudaAdjustsPerRow = 1024;
uint64_t cuda_act16_bytes(const HParams& hp, const EngineShape& shape);
uint64_t cuda_scratch_bytes(const HParams& hp, const EngineShape& shape, const WeightsSummary& w);

/// Bytes of the expert matrices of layers [from, to) (a mixture of experts;
/// 0 for a dense model): what the expert rung moves between host and device.
uint64_t expert_bytes(const ModelWeights& w, int from, int to);

/// The plan: weights (their size in the segment), the KV cache, the scratch.
MemoryPlan plan_memory(const HParams& hp, const EngineShape& shape, const WeightsSummary& w,
                       const BackendPlanOptions& opt);

}  // namespace ds4
