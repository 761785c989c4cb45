#pragma once
/// The CUDA backend's operations one at a time, on host arrays: each call
/// copies its inputs to the device, runs the same kernels forward() runs and
/// copies the result back. For the conformance tests (tests/unit/test_cuda.cpp),
/// which compare every operation with the CPU backend's; no CUDA header here.

#include <cstdint>
#include <utility>
#include <vector>

#include "model/weights.h"
#include "worker/backend.h"

namespace ds4::cuda_ops {

/// y[t*ldy + n] = W row n . x[t*ldx ...], for T tokens: the GEMV kernels when
/// T <= 8, cuBLAS otherwise or when `force_gemm`. With `fused`, the product is
/// run as the first of three sharing one launch (as Q, K and V are).
void matmul(const Weight& w, const float* x, int64_t ldx, int64_t T, float* y, int64_t ldy, bool force_gemm = false,
            bool fused = false);

/// The whole of a block-quantised weight (Q4_0 ... Q6_K, IQ4_NL, IQ4_XS) as
/// the device decodes it from its repacked planes: rows x cols floats,
/// bit-exact with llama.cpp's dequantize_row_*.
std::vector<float> dequantize(const Weight& w);

/// h[t*ldh + n] = silu(gate[n] . x[t]) * (up[n] . x[t]): the fused SwiGLU
/// products (one GEMV launch when T <= 8), or cuBLAS and swiglu when `force_gemm`.
void matmul_swiglu(const Weight& gate, const Weight& up, const float* x, int64_t ldx, int64_t T, float* h,
                   int64_t ldh, bool force_gemm = false);

/// matmul() or matmul_swiglu() (`glu`: w and `up`) of rmsnorm(x) * g, with the
/// norm folded into the products as decode steps run it (T <= 8: one GEMV
/// launch reads x, no separate norm kernel).
void rmsnorm_matmul(const Weight& w, const Weight* up, const float* g, float eps, const float* x, int64_t ldx,
                    int64_t T, float* y, int64_t ldy);

/// Weight bytes per second of the decode GEMV (see cuda::gemv_bytes_per_second).
double gemv_bytes_per_second(GgmlType type, int64_t N, int64_t K, int T, bool glu, bool norm, int launches);
/// Seconds of one product of T tokens (see cuda::product_seconds); way 0: the
/// decode GEMV, 1: the tiled GEMM, 2: cuBLAS.
double product_seconds(GgmlType type, int64_t N, int64_t K, int T, int way, int launches);

/// Each of `rows` rows of `n` logits (contiguous): its best kCudaTopLogits
/// (ranked, fewer when n is smaller) and log(sum(exp)), as the CUDA backend
/// finds them for sample_best().
std::vector<std::pair<std::vector<LogitCandidate>, double>> top_logits(const std::vector<float>& logits, int64_t n,
                                                                       int rows);

/// out[t] = rmsnorm(x[t]) * g, rows of n floats, contiguous.
void rmsnorm(const float* x, int64_t T, int64_t n, const float* g, float eps, float* out);

/// Row batch[t].token of `table` for each token, rows of table.cols floats.
void embed(const Weight& table, const std::vector<BatchToken>& batch, float* out);

/// RoPE and the KV store of one layer. q: T x n_heads*hd, k and v: T x n_kv*hd
/// (contiguous); on return q and k are rotated and k_cache/v_cache (slots x
/// ctx x n_kv*hd halves, as uint16_t) hold the f16 rows at (slot, pos).
/// `var`: NEOX pairing, frequency factors (n_rot / 2), linear scaling.
struct RopeVariant {
  bool neox = false;
  std::vector<float> freq_factors;
  float freq_scale = 1.0f;
};
void rope_store(std::vector<float>& q, std::vector<float>& k, const std::vector<float>& v,
                const std::vector<BatchToken>& batch, int n_heads, int n_kv_heads, int head_dim, int n_rot,
                float rope_base, int64_t slots, int64_t ctx, std::vector<uint16_t>& k_cache,
                std::vector<uint16_t>& v_cache, const RopeVariant& var = {});

/// Per-head RMSNorm: x (T x heads*n) in place, gain g (n).
void head_norm(std::vector<float>& x, int64_t T, int heads, const std::vector<float>& g, float eps);

/// y (T x n) += b (n) on each row.
void add_bias(std::vector<float>& y, int64_t T, const std::vector<float>& b);

/// Attention of each token's heads over its slot's positions 0..pos of the
/// given caches (slots x ctx x n_kv*hd f16). q and out: T x n_heads*hd.
void attention(const std::vector<float>& q, const std::vector<uint16_t>& k_cache, const std::vector<uint16_t>& v_cache,
               const std::vector<BatchToken>& batch, int n_heads, int n_kv_heads, int head_dim, int64_t slots,
               int64_t ctx, std::vector<float>& out);

/// The ranges attention() splits a prefill batch's positions into on this
/// GPU (cuda::prefill_splits; 1: none).
int prefill_splits(const std::vector<BatchToken>& batch, int n_heads, int head_dim);

/// Whether attention() takes a decode batch (f16 cache) to the tensor cores'
/// kernel (cuda::decode_mma_takes: deep enough, grouped-query heads).
bool decode_mma(const std::vector<BatchToken>& batch, int n_heads, int n_kv_heads, int head_dim);

/// A Q8_0 cache as the CUDA backend keeps it (slots x ctx x n_kv*hd int8
/// values; one f16 scale, as bits, per 32 of them).
struct Q8Cache {
  std::vector<int8_t> q;
  std::vector<uint16_t> d;
};
/// attention() over Q8_0 caches.
void attention_q8(const std::vector<float>& q, const Q8Cache& k_cache, const Q8Cache& v_cache,
                  const std::vector<BatchToken>& batch, int n_heads, int n_kv_heads, int head_dim, int64_t ctx,
                  std::vector<float>& out);
/// Stores k and v (T x kv_dim each) at each token's (slot, pos) of Q8_0 caches.
void store_kv_q8(const std::vector<float>& k, const std::vector<float>& v, const std::vector<BatchToken>& batch,
                 int kv_dim, int64_t ctx, Q8Cache& k_cache, Q8Cache& v_cache);

/// g[i] = silu(g[i]) * u[i].
void swiglu(std::vector<float>& g, const std::vector<float>& u);

}  // namespace ds4::cuda_ops
