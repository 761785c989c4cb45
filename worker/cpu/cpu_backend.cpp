// The CPU backend: the reference forward pass, read top to bottom like
// llama2.c's run.c, with the matrix products on the kernel table of this CPU
// and every step spread over a thread pool.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <thread>
#include <vector>

#include "shared/error.h"
#include "worker/backend.h"
#include "worker/cpu/host_buffer.h"
#include "worker/cpu/kernels.h"
#include "worker/cpu/thread_pool.h"

namespace ds4 {
namespace {

using cpu::HostBuffer;
using cpu::MatmulArgs;

int64_t pad8(int64_t n) { return (n + 7) / 8 * 8; }

class CpuBackend final : public Backend {
 public:
  CpuBackend(const Model& model, int threads)
      : m_(model), hp_(model.hp()), k_(cpu::cpu_kernels()),
        pool_(threads > 0 ? threads : int(std::max(1u, std::thread::hardware_concurrency()))) {}

  std::string name() const override { return "cpu(" + std::string(k_.name) + ", " + std::to_string(pool_.size()) + " threads)"; }

  MemoryPlan plan(const EngineShape& s) const override {
    MemoryPlan p;
    p.weights = m_.w().bytes;
    p.kv = kv_cache_bytes(hp_, s);
    p.scratch = scratch_floats(s) * sizeof(float);
    return p;
  }

  void reserve(const EngineShape& s) override {
    if (s.ctx <= 0 || s.slots <= 0 || s.max_batch <= 0)
      throw Error("context, slots and batch must be positive");
    shape_ = s;
    kv_ = HostBuffer(kv_cache_bytes(hp_, s), "KV cache");
    scratch_ = HostBuffer(scratch_floats(s) * sizeof(float), "activations");
    // Carve the scratch: per-token buffers padded to multiples of 8 with zeros.
    float* f = scratch_.as<float>();
    auto take = [&](int64_t n) { float* r = f; f += n; return r; };
    const int64_t B = s.max_batch;
    x_ = take(B * ld_dim());
    xb_ = take(B * ld_dim());
    q_ = take(B * ld_q());
    kk_ = take(B * ld_kv());
    vv_ = take(B * ld_kv());
    att_ = take(B * ld_q());
    hb_ = take(B * ld_ff());
    hb2_ = take(B * ld_ff());
    xl_ = take(logit_rows() * ld_dim());
    logits_ = take(logit_rows() * hp_.n_vocab);
    rope_ = take(B * hp_.n_rot);
    xq_ = reinterpret_cast<cpu::BlockQ8Act*>(take(xq_floats()));
    xk_ = reinterpret_cast<cpu::BlockQ8K*>(take(xk_floats()));
    thread_scratch_ = take(pool_.size() * per_thread_floats());
  }

  void forward(std::span<const BatchToken> batch) override;

  std::span<const float> logits(int32_t row) const override {
    return {logits_ + int64_t(row) * hp_.n_vocab, size_t(hp_.n_vocab)};
  }

  void set_trace(TraceFn fn) override { trace_ = std::move(fn); }

 private:
  int64_t ld_dim() const { return pad8(hp_.dim); }
  int64_t ld_q() const { return pad8(hp_.q_dim()); }
  int64_t ld_kv() const { return pad8(hp_.kv_dim()); }
  int64_t ld_ff() const { return pad8(hp_.ff); }
  int64_t logit_rows() const { return shape_.slots + 1; }
  int64_t max_k() const { return std::max({hp_.dim, hp_.q_dim(), hp_.ff}); }
  /// Floats holding the input rows of one product quantized for Q8_0 weights.
  int64_t xq_floats() const {
    static_assert(sizeof(cpu::BlockQ8Act) % sizeof(float) == 0);
    const int64_t rows = std::max<int64_t>(shape_.max_batch, logit_rows());
    return rows * (max_k() / 32) * int64_t(sizeof(cpu::BlockQ8Act) / sizeof(float));
  }
  /// The same for weights taking Q8_K blocks (the K-quants).
  int64_t xk_floats() const {
    static_assert(sizeof(cpu::BlockQ8K) % sizeof(float) == 0);
    const int64_t rows = std::max<int64_t>(shape_.max_batch, logit_rows());
    return rows * (max_k() / 256) * int64_t(sizeof(cpu::BlockQ8K) / sizeof(float));
  }
  int64_t per_thread_floats() const {
    return cpu::matmul_scratch_floats(max_k()) + pad8(shape_.ctx) + pad8(hp_.head_dim);
  }
  int64_t scratch_floats(const EngineShape& s) const {
    EngineShape saved = shape_;
    const_cast<CpuBackend*>(this)->shape_ = s;
    const int64_t B = s.max_batch;
    const int64_t n = B * (2 * ld_dim() + 2 * ld_q() + 2 * ld_kv() + 2 * ld_ff() + hp_.n_rot) +
                      logit_rows() * (ld_dim() + hp_.n_vocab) + xq_floats() + xk_floats() + pool_.size() * per_thread_floats();
    const_cast<CpuBackend*>(this)->shape_ = saved;
    return n;
  }
  uint16_t* k_cache(int layer, int slot) const {
    return kv_.as<uint16_t>() + ((int64_t(layer) * shape_.slots + slot) * shape_.ctx) * hp_.kv_dim();
  }
  uint16_t* v_cache(int layer, int slot) const {
    return k_cache(layer, slot) + int64_t(hp_.n_layers) * shape_.slots * shape_.ctx * hp_.kv_dim();
  }
  float* thread_scratch(int t) const { return thread_scratch_ + int64_t(t) * per_thread_floats(); }

  /// Several products sharing one input, rows spread over the pool in one job.
  /// Quantized weights take the input quantized once per call and
  /// activation type (kernels.h, quant_types.h).
  struct Product {
    const Weight* w;
    const float* x;
    int64_t ldx;
    float* y;
    int64_t ldy;
  };
  void matmul(std::initializer_list<Product> ps, int64_t T);
  void rmsnorm(const float* x, int64_t ldx, const Weight& w, float* out, int64_t ldo, int64_t T);
  void trace(std::string_view name, int layer, const float* d, int64_t rows, int64_t cols, int64_t ld) {
    if (trace_) trace_(name, layer, d, rows, cols, ld);
  }
  /// Runs fn(i, n) on the pool, or inline as fn(0, 1) when `work` (multiply-adds)
  /// is too small to pay for waking the other threads.
  template <typename Fn>
  void parallel(int64_t work, Fn&& fn) {
    if (work < (int64_t(1) << 18)) return fn(0, 1);
    pool_.run(fn);
  }
  /// Runs fn(t) for each token, spread over the pool when the batch is large.
  template <typename Fn>
  void for_tokens(int64_t T, Fn&& fn) {
    parallel(T * std::max(hp_.dim, hp_.ff) * 8, [&](int i, int n) {
      for (int64_t t = i; t < T; t += n) fn(t);
    });
  }

  const Model& m_;
  const HParams& hp_;
  const cpu::KernelTable& k_;
  cpu::ThreadPool pool_;
  EngineShape shape_;
  HostBuffer kv_, scratch_;
  float *x_ = nullptr, *xb_ = nullptr, *q_ = nullptr, *kk_ = nullptr, *vv_ = nullptr, *att_ = nullptr;
  float *hb_ = nullptr, *hb2_ = nullptr, *xl_ = nullptr, *logits_ = nullptr, *rope_ = nullptr;
  float* thread_scratch_ = nullptr;
  cpu::BlockQ8Act* xq_ = nullptr;  // (max_batch, max_k / 32): the input of a product taking Q8_0 blocks
  cpu::BlockQ8K* xk_ = nullptr;    // (max_batch, max_k / 256): the input of one taking Q8_K blocks
  TraceFn trace_;
};

void CpuBackend::matmul(std::initializer_list<Product> ps, int64_t T) {
  int64_t work = 0;
  for (const Product& p : ps) work += p.w->rows * p.w->cols * T;
  // Rows are handed out in chunks from a shared counter, so a thread that is
  // descheduled (a busy machine) or slower leaves its share to the others.
  // The last rows of the job go out in smaller chunks (decode only: a
  // multi-token chunk packs a 16-row panel), so the threads finish together.
  // Each row's result does not depend on which thread computes it.
  struct Chunk {
    const Product* p;
    int64_t r0, r1;
  };
  const int64_t big = T >= 4 ? 16 : 64, small = 16, tail = int64_t(pool_.size()) * big;
  int64_t left = 0;
  for (const Product& p : ps) left += p.w->rows;
  std::vector<Chunk> chunks;
  for (const Product& p : ps)
    for (int64_t r0 = 0; r0 < p.w->rows;) {
      const int64_t r1 = std::min(p.w->rows, r0 + (left > tail ? big : small));
      chunks.push_back({&p, r0, r1});
      left -= r1 - r0;
      r0 = r1;
    }
  // Each activation type the products' weights take (quant_types.h) is
  // quantized once, from the input the products of that type share.
  const Product* by_act[3] = {nullptr, nullptr, nullptr};
  for (const Product& p : ps) {
    const cpu::QuantType* qt = cpu::quant_type(p.w->type);
    if (!qt || qt->act == cpu::ActType::F32) continue;
    const Product*& q = by_act[int(qt->act)];
    if (q && (p.x != q->x || p.ldx != q->ldx || p.w->cols != q->w->cols))
      throw Error("products of one activation type in one matmul must share their input");
    q = &p;
  }
  if (const Product* q = by_act[int(cpu::ActType::Q8_0)]) {
    const int64_t blocks = q->w->cols / 32;
    for_tokens(T, [&](int64_t t) { k_.quantize_q8(q->x + t * q->ldx, q->w->cols, xq_ + t * blocks); });
  }
  if (const Product* q = by_act[int(cpu::ActType::Q8_K)]) {
    const int64_t blocks = q->w->cols / 256;
    for_tokens(T, [&](int64_t t) { k_.quantize_q8k(q->x + t * q->ldx, q->w->cols, xk_ + t * blocks); });
  }
  std::atomic<int64_t> next{0};
  parallel(work, [&](int i, int) {
    float* scratch = thread_scratch(i);
    for (int64_t c = next.fetch_add(1, std::memory_order_relaxed); c < int64_t(chunks.size());
         c = next.fetch_add(1, std::memory_order_relaxed)) {
      const Product& p = *chunks[size_t(c)].p;
      MatmulArgs a{p.w->type, p.w->data, p.w->cols, p.w->rows, p.x, p.ldx, T, p.y, p.ldy};
      a.xq = xq_;
      a.ldxq = p.w->cols / 32;
      a.xk = xk_;
      a.ldxk = p.w->cols / 256;
      k_.matmul_rows(a, chunks[size_t(c)].r0, chunks[size_t(c)].r1, scratch);
    }
  });
}

// y = x / sqrt(mean(x^2) + eps) * w, with the sum of squares in double as ggml does.
void CpuBackend::rmsnorm(const float* x, int64_t ldx, const Weight& w, float* out, int64_t ldo, int64_t T) {
  const float* g = static_cast<const float*>(w.data);
  const int64_t n = hp_.dim;
  for_tokens(T, [&](int64_t t) {
    const float* xr = x + t * ldx;
    float* o = out + t * ldo;
    double sum = 0;
    for (int64_t i = 0; i < n; ++i) sum += double(xr[i] * xr[i]);
    const float mean = float(sum / double(n));
    const float scale = 1.0f / std::sqrt(mean + hp_.norm_eps);
    for (int64_t i = 0; i < n; ++i) o[i] = (xr[i] * scale) * g[i];
  });
}

void CpuBackend::forward(std::span<const BatchToken> batch) {
  const int64_t T = int64_t(batch.size());
  if (T == 0) return;
  if (T > shape_.max_batch) throw Error("batch of " + std::to_string(T) + " tokens exceeds max_batch");
  const ModelWeights& W = m_.w();
  const int64_t hd = hp_.head_dim, kvd = hp_.kv_dim();
  const int64_t group = hp_.n_heads / hp_.n_kv_heads;
  const float att_scale = 1.0f / std::sqrt(float(hd));

  // Token embeddings.
  for_tokens(T, [&](int64_t t) {
    cpu::dequantize_row(W.token_embd.type, W.token_embd.data, hp_.dim, batch[t].token, x_ + t * ld_dim());
  });
  // RoPE angles per token, as ggml's "normal" rope: theta_i = pos * base^(-2i/n_rot).
  const float theta_scale = std::pow(hp_.rope_base, -2.0f / float(hp_.n_rot));
  for_tokens(T, [&](int64_t t) {
    float theta = float(batch[t].pos);
    float* r = rope_ + t * hp_.n_rot;
    for (int64_t i = 0; i < hp_.n_rot; i += 2) {
      r[i] = std::cos(theta);
      r[i + 1] = std::sin(theta);
      theta *= theta_scale;
    }
  });

  for (int layer = 0; layer < int(hp_.n_layers); ++layer) {
    const LayerWeights& L = W.layers[layer];
    // Attention block.
    rmsnorm(x_, ld_dim(), L.attn_norm, xb_, ld_dim(), T);
    trace("attn_norm", layer, xb_, T, hp_.dim, ld_dim());
    matmul({{&L.wq, xb_, ld_dim(), q_, ld_q()}, {&L.wk, xb_, ld_dim(), kk_, ld_kv()},
            {&L.wv, xb_, ld_dim(), vv_, ld_kv()}}, T);
    for_tokens(T, [&](int64_t t) {
      const float* r = rope_ + t * hp_.n_rot;
      auto rotate = [&](float* v, int64_t heads) {
        for (int64_t h = 0; h < heads; ++h) {
          float* x = v + h * hd;
          for (int64_t i = 0; i < hp_.n_rot; i += 2) {
            const float x0 = x[i], x1 = x[i + 1];
            x[i] = x0 * r[i] - x1 * r[i + 1];
            x[i + 1] = x0 * r[i + 1] + x1 * r[i];
          }
        }
      };
      rotate(q_ + t * ld_q(), hp_.n_heads);
      rotate(kk_ + t * ld_kv(), hp_.n_kv_heads);
      const BatchToken& b = batch[t];
      k_.to_f16(kk_ + t * ld_kv(), k_cache(layer, b.slot) + int64_t(b.pos) * kvd, kvd);
      k_.to_f16(vv_ + t * ld_kv(), v_cache(layer, b.slot) + int64_t(b.pos) * kvd, kvd);
    });
    std::atomic<int64_t> next_job{0};
    // A cached position costs several multiply-adds of a product: two f16
    // rows (K and V) and its share of the softmax.
    parallel(8 * T * hp_.n_heads * hd * (batch.back().pos + 1), [&](int i, int) {
      float* scores = thread_scratch(i) + cpu::matmul_scratch_floats(max_k());
      for (int64_t job = next_job.fetch_add(1, std::memory_order_relaxed); job < T * hp_.n_heads;
           job = next_job.fetch_add(1, std::memory_order_relaxed)) {
        const int64_t t = job / hp_.n_heads, h = job % hp_.n_heads;
        const BatchToken& b = batch[t];
        const int64_t kvh = h / group;
        k_.attend(q_ + t * ld_q() + h * hd, k_cache(layer, b.slot) + kvh * hd,
                  v_cache(layer, b.slot) + kvh * hd, int64_t(b.pos) + 1, hd, kvd, att_scale,
                  att_ + t * ld_q() + h * hd, scores);
      }
    });
    matmul({{&L.wo, att_, ld_q(), xb_, ld_dim()}}, T);
    for_tokens(T, [&](int64_t t) {
      float* xr = x_ + t * ld_dim();
      const float* o = xb_ + t * ld_dim();
      for (int64_t i = 0; i < hp_.dim; ++i) xr[i] += o[i];
    });
    // Feed-forward block (SwiGLU).
    rmsnorm(x_, ld_dim(), L.ffn_norm, xb_, ld_dim(), T);
    matmul({{&L.w_gate, xb_, ld_dim(), hb_, ld_ff()}, {&L.w_up, xb_, ld_dim(), hb2_, ld_ff()}}, T);
    for_tokens(T, [&](int64_t t) { k_.silu_mul(hb_ + t * ld_ff(), hb2_ + t * ld_ff(), hp_.ff); });
    matmul({{&L.w_down, hb_, ld_ff(), xb_, ld_dim()}}, T);
    trace("ffn_out", layer, xb_, T, hp_.dim, ld_dim());
    for_tokens(T, [&](int64_t t) {
      float* xr = x_ + t * ld_dim();
      const float* o = xb_ + t * ld_dim();
      for (int64_t i = 0; i < hp_.dim; ++i) xr[i] += o[i];
    });
    trace("l_out", layer, x_, T, hp_.dim, ld_dim());
    during_step();
  }

  // Logits for the tokens that need them.
  int64_t rows = 0;
  std::vector<int64_t> src(size_t(logit_rows()), -1);
  for (int64_t t = 0; t < T; ++t) {
    const int32_t r = batch[t].logit_row;
    if (r < 0) continue;
    if (r >= logit_rows()) throw Error("logit row out of range");
    src[r] = t;
    rows = std::max<int64_t>(rows, r + 1);
  }
  if (rows == 0) return;
  for (int64_t r = 0; r < rows; ++r) {
    if (src[r] < 0) continue;
    std::copy_n(x_ + src[r] * ld_dim(), ld_dim(), xl_ + r * ld_dim());
  }
  rmsnorm(xl_, ld_dim(), W.output_norm, xl_, ld_dim(), rows);
  trace("result_norm", -1, xl_, rows, hp_.dim, ld_dim());
  matmul({{&W.output, xl_, ld_dim(), logits_, hp_.n_vocab}}, rows);
}

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(const Model& model, int threads) {
  return std::make_unique<CpuBackend>(model, threads);
}

}  // namespace ds4
