#pragma once
// Launchers of the CUDA backend's kernels. Every launcher enqueues on the given
// stream and checks the launch; none synchronises, so a decode step can be
// captured in a CUDA graph. Per-token data (token id, slot, position, logit
// row) is read from `batch` in device memory, never passed by value, so one
// captured graph serves every step of the same batch size.
//
// Layouts: activations are rows of floats, one row per token, `ld` floats
// apart (a multiple of 8, so rows are 16-byte aligned). The KV cache of one
// layer is [slot][pos][kv_dim] values, K and V in separate arrays (KvLayer).

#include <algorithm>

#include "worker/backend.h"
#include "worker/cuda/common.cuh"

namespace ds4::cuda {

/// x[t] = row batch[t].token of `table`, converted to f32.
void embed(const DeviceWeight& table, const BatchToken* batch, int T, float* x, int64_t ldx, cudaStream_t s);

/// out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * g, with the sum of squares in
/// double as the CPU backend does. out may be x.
void rmsnorm(const float* x, int64_t ldx, const float* g, int64_t n, float eps, float* out, int64_t ldo, int T,
             cudaStream_t s);

struct RopeArgs {
  int n_heads = 0, n_kv_heads = 0, head_dim = 0, n_rot = 0;  // q heads, k (and v) heads
  float theta_scale = 1;  // rope_base^(-2/n_rot), computed on the host as the CPU does
  float freq_scale = 1;   // linear RoPE scaling: the angle times this
  bool neox = false;      // pairs (i, i + n_rot/2) instead of (2i, 2i + 1)
  const float* freq_factors = nullptr;  // (n_rot / 2) f32 on the device: each angle divided by its factor
  int64_t ctx = 0;        // positions per slot in the cache
};
/// Rotates the first n_rot values of each of q's n_heads heads and of k's
/// n_kv_heads heads in place (ggml's RoPE as the CPU backend computes it:
/// theta_i = pos * theta_scale^i by repeated multiplication, then
/// freq_scale * theta_i / ff[i]) and stores k and v as f16 at (slot, pos) of
/// this layer's cache. Any of q, k, v may be null (n_heads 0 for no q): a
/// RoPE alone leaves the caches null, a KV store alone has n_rot 0.
void rope_store(float* q, int64_t ldq, float* k, const float* v, int64_t ldkv, const BatchToken* batch, int T,
                const RopeArgs& a, __half* k_cache, __half* v_cache, cudaStream_t s);

/// One layer's cached K or V, [slot][pos][kv_dim] values: f16 (`scales`
/// null), or Q8_0 as int8 values in that order and, apart, one f16 scale per
/// 32 of them (value e is scales[e / 32] * values[e]).
struct KvLayer {
  void* values = nullptr;
  __half* scales = nullptr;
  bool q8() const { return scales != nullptr; }
};

/// Stores k and v (T rows of kv_dim floats, ldkv apart; each token's RoPE
/// already applied to k) at (slot, pos) of a Q8_0 layer: per 32 values
/// d = max|x| / 127 rounded to f16, q = round-to-nearest-even(x * 127 / max|x|)
/// (the CPU backend's store_kv_q8); a block below 1e-30 stores zeros.
void store_kv_q8(const float* k, const float* v, int64_t ldkv, const BatchToken* batch, int T, int kv_dim,
                 int64_t ctx, KvLayer k_cache, KvLayer v_cache, cudaStream_t s);

/// x[t][h] = rmsnorm(x[t][h]) * g for each of `heads` heads of n floats (the
/// per-head Q/K norm), the sum of squares in double.
void head_norm(float* x, int64_t ldx, int heads, int64_t n, const float* g, float eps, int T, cudaStream_t s);

/// y[t][i] += b[i], i < n.
void add_bias(float* y, int64_t ldy, const float* b, int64_t n, int T, cudaStream_t s);

struct AttentionArgs {
  int n_heads = 0, n_kv_heads = 0, head_dim = 0;
  int64_t ctx = 0;
  float scale = 1;
  int splits = 1;  // position ranges per (token, head), combined at the end
  int64_t split_positions = 128;  // the least a split takes (set by attention() itself)
  int64_t positions = 0;  // deepest_positions() of the batch (0: ctx): the decode kernel, the prefill splits
};
/// The deepest token's position + 1: the positions a batch's attention reads.
inline int64_t deepest_positions(const BatchToken* batch, int T) {
  int64_t p = 0;
  for (int t = 0; t < T; ++t) p = std::max<int64_t>(p, int64_t(batch[t].pos) + 1);
  return p;
}
/// Splits worth using for a decode batch of T tokens: enough blocks (a KV
/// head's group of query heads on the tensor cores, else up to 4 of them) to
/// give each multiprocessor 2 of them (DS4_CUDA_ATTN_BLOCKS=1..8 for another
/// count), splits of at least 128 positions (DS4_CUDA_ATTN_SPLIT=64..4096),
/// at most 64 and as many as the memory plan's partial rows hold.
int attention_splits(int T, int n_heads, int n_kv_heads, int head_dim, bool q8, int64_t positions, int64_t ctx,
                     int n_sm);
/// Decode batches whose deepest token has at least this many positions take
/// the tensor cores' kernel (an f16 cache, 2 to 16 query heads a KV head,
/// head size 64, 128 or 256): it streams the cache faster, but shallower its
/// start costs more than the warp kernel's. H200, 8B, tg tok/s tensor cores
/// / warp kernel: 287 / 315 on an empty cache, 247 / 270 after 4096 tokens,
/// 241 / 251 after 8192, 226 / 225 after 16384, 202 / 182 after 32768.
inline constexpr int64_t kDecodeMmaPositions = 16384;
/// Whether a decode batch (deepest token `positions`) takes that kernel.
bool decode_mma_takes(int n_heads, int n_kv_heads, int head_dim, bool q8, int64_t positions);
/// Splits of a prefill batch's positions (the tensor cores' kernel, tokens no
/// deeper than `positions`): as many as keep kCudaFaBlocksPerSm blocks a
/// multiprocessor in one wave, ranges of at least kCudaFaSplitPositions
/// (model/memory_plan.h); 1 = none. DS4_CUDA_FA_SPLITS caps them.
int prefill_splits(int T, int n_heads, int head_dim, int64_t positions, int n_sm);
/// Floats of scratch attention() needs (splits: the larger of the two kinds'
/// for a batch that may take either). The scratch must be zero when it is
/// first used (it holds counters that every launch leaves at zero).
int64_t attention_scratch_floats(int T, int n_heads, int head_dim, int splits);
/// out[t][h] = softmax(scale * q[t][h] . K[0..pos]) V over the token's own slot,
/// positions 0..batch[t].pos (grouped-query: head h reads KV head h / group).
/// Decode batches split each token's positions over blocks (a block takes a
/// KV head's group of query heads on the tensor cores with an f16 cache, else
/// up to four of them in f32), and the last block of each (token, heads)
/// merges the splits; prefill batches (more than kMaxGemvTokens tokens) take
/// flash attention on the tensor cores, tiles of 64 tokens x 64 positions,
/// unless `decode` (the decode kernel for any batch: tokens of many slots).
void attention(const float* q, int64_t ldq, KvLayer k_cache, KvLayer v_cache, const BatchToken* batch, int T,
               const AttentionArgs& a, float* scratch, float* out, int64_t ldo, cudaStream_t s, bool decode = false);

/// g[t][i] = silu(g[t][i]) * u[t][i].
void swiglu(float* g, const float* u, int64_t ld, int64_t n, int T, cudaStream_t s);
/// x[t][i] += o[t][i].
void add(float* x, const float* o, int64_t ld, int64_t n, int T, cudaStream_t s);
/// xl[batch[t].logit_row] = x[t] for the tokens that have a logit row.
void gather_logit_rows(const float* x, int64_t ld, const BatchToken* batch, int T, float* xl, cudaStream_t s);

/// dst[i] = src[rows[i]], the first n values of each of `count` rows (a
/// mixture of experts' input, gathered by expert).
void gather_rows(const float* src, int64_t ld_src, const int32_t* rows, int count, int64_t n, float* dst,
                 int64_t ld_dst, cudaStream_t s);

/// A mixture of experts' routing on the device, one warp a token (at most
/// 1024 experts): scores[t] (E values, ld apart) become their softmax in
/// place; the K largest (ties to the lower id) go to expert[t*K+k] with their
/// weight (renormalised to sum 1, at least 2^-14, when `norm`), as
/// worker/moe_routes.h's route_token; pair[i] = i (each (token, k) is its own
/// row, for moe_combine).
void moe_topk(float* scores, int64_t ld, int T, int E, int K, bool norm, int32_t* expert, float* weight, int32_t* pair,
              cudaStream_t s);

/// A prefill's routes grouped by expert on the device (one block of 1024
/// threads, at most 1024 experts): from moe_topk's expert_pair[i] and
/// weight[i] (i = t * K + k, P of them), expert e's rows [start[e],
/// start[e + 1]) with each row's token and weight (token_of, weight_of), each
/// pair's row written over expert_pair (as worker/moe_routes.h's pair), and
/// the jobs of up to job_rows rows (expert, first row, rows), their number at
/// *n_jobs. Rows of one expert come in no fixed order: each row's products
/// and the combine's sums do not depend on it.
void moe_group(int32_t* expert_pair, const float* weight, int P, int K, int E, int job_rows, int32_t* start,
               int32_t* token_of, float* weight_of, int32_t* jobs, int32_t* n_jobs, cudaStream_t s);

/// A mixture of experts' sum, per token t of T: a = sum over k of
/// weight_of[pair[t, k]] * y[pair[t, k]] (k in order), plus, when shared_y is
/// set, shared_y[t] * sigmoid(shared_gate . n[t]); out[t] = a, or out[t] += a
/// (`accumulate`). worker/moe_routes.h says what pair and weight_of hold.
struct MoeCombine {
  const float* y = nullptr;
  int64_t ldy = 0;
  const int32_t* pair = nullptr;
  const float* weight_of = nullptr;
  int K = 0;
  const float* shared_y = nullptr;     // (T, ldy), or nullptr
  const float* shared_gate = nullptr;  // (n) f32
  const float* n = nullptr;            // the experts' input (T, ldn)
  int64_t ldn = 0;
};
void moe_combine(const MoeCombine& c, float* out, int64_t ldo, bool accumulate, int64_t n, int T, cudaStream_t s);

// --- matrix products (matmul.cu) -------------------------------------------

/// One product of a fused matmul call: y[t][n] (+)= W[n] . x[t].
struct Product {
  const DeviceWeight* w = nullptr;
  float* y = nullptr;
  int64_t ldy = 0;
  bool accumulate = false;  // add to y instead of overwriting it
};

/// Scratch and handle the prefill path (cuBLAS) needs.
struct GemmContext {
  cublasHandle_t blas = nullptr;
  void* act = nullptr;  // T x K activations as f16 or bf16
  size_t act_bytes = 0;
  __half* deq = nullptr;  // a Q8_0 weight dequantised to f16
  size_t deq_bytes = 0;
  bool tiled = true;  // false: quantised products never take the tiled GEMM (timing cuBLAS)
};

/// Largest batch the GEMV (decode) kernels take; larger batches go to cuBLAS.
constexpr int kMaxGemvTokens = 8;

/// An RMSNorm in front of the products: they take rmsnorm(x) * g as input.
/// Decode GEMVs fold it into their own reads of x (no separate kernel, no
/// write); otherwise rmsnorm() writes the normalised rows to `out` (T rows,
/// ldx apart) first and the products read those.
struct RmsNorm {
  const float* g = nullptr;
  float eps = 0;
  float* out = nullptr;
};

/// Products sharing the input x (T rows of K = w->cols floats, ldx apart):
/// custom GEMV kernels, one launch for all, when T <= kMaxGemvTokens; cuBLAS
/// GEMMs otherwise (or when `force_gemm`).
void matmul(const Product* ps, int n, const float* x, int64_t ldx, int T, GemmContext& g, cudaStream_t s,
            bool force_gemm = false, const RmsNorm* norm = nullptr);

/// h[t] = silu(gate . x[t]) * (up . x[t]): one GEMV launch for decode batches
/// (a block computes rows of both), two products and swiglu() otherwise.
/// `h_up` is scratch of the same shape as h.
void matmul_swiglu(const DeviceWeight& gate, const DeviceWeight& up, const float* x, int64_t ldx, int T, float* h,
                   float* h_up, int64_t ldh, GemmContext& g, cudaStream_t s, bool force_gemm = false,
                   const RmsNorm* norm = nullptr);

/// Weight bytes per second the decode GEMV reads on an N x K weight of `type`
/// (`glu`: a fused gate/up pair; `norm`: RMSNorm folded in) for T tokens:
/// launches captured in a graph and replayed, over copies of the weight that
/// together exceed the L2 cache. For tuning; the weights are synthetic.
double gemv_bytes_per_second(GgmlType type, int64_t N, int64_t K, int T, bool glu, bool norm, int launches);

/// The ways a product of T tokens can run: the decode GEMV (T <= 8), the
/// tiled GEMM (qgemm, Q8_0 and block-quantised types) and cuBLAS (after an
/// f16 copy of a quantised matrix).
enum class ProductWay { gemv, tiled, cublas };
/// Seconds one N x K product of `type` takes that way, for T tokens (a graph
/// of `launches`, over copies of the weight that exceed the L2 cache). For
/// tuning which batches take which way; the weights are synthetic.
double product_seconds(GgmlType type, int64_t N, int64_t K, int T, ProductWay way, int launches);

/// Q8_0 blocks (GGUF layout, device memory) to the split layout of DeviceWeight.
void repack_q8_0(const void* blocks, int64_t n_blocks, int8_t* qs, __half* scales, cudaStream_t s);

}  // namespace ds4::cuda
