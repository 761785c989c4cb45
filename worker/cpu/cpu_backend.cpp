// The CPU backend: the reference implementation of the forward pass's ops
// (worker/forward.h), with the matrix products on the kernel table of this
// CPU and every op spread over a thread pool. Its memory is the plan of
// model/memory_plan.h (cpu_scratch_layout), carved as laid out there.
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
#include "worker/forward.h"
#include "worker/host_compute.h"
#include "worker/moe_routes.h"

namespace ds4 {
namespace {

using cpu::HostBuffer;
using cpu::MatmulArgs;

class CpuBackend final : public Backend, private ForwardOps {
 public:
  CpuBackend(const Model& model, int threads)
      : m_(model), hp_(model.hp()), k_(cpu::cpu_kernels()),
        pool_(threads > 0 ? threads : int(std::max(1u, std::thread::hardware_concurrency()))) {}

  /// The kernel table, the threads and, for the x86 tables, the decode walk
  /// (kernels.h): "cpu(avx512vnni, 2 threads, 1-row decode)".
  std::string name() const override {
    std::string n = "cpu(" + std::string(k_.name) + ", " + std::to_string(pool_.size()) + " threads";
    if (k_.name != "generic") n += ", " + std::to_string(cpu::decode_walk().rows) + "-row decode";
    return n + ")";
  }

  MemoryPlan plan(const EngineShape& s) const override {
    return plan_memory(hp_, s, WeightsSummary::of(m_.w()), {BackendKind::cpu, int(pool_.size())});
  }

  uint64_t reserved_bytes() const override { return kv_.size() + scratch_.size(); }

  void reserve(const EngineShape& s) override {
    if (s.ctx <= 0 || s.slots <= 0 || s.max_batch <= 0)
      throw Error("context, slots and batch must be positive");
    const ScratchLayout l = cpu_scratch_layout(hp_, s, int(pool_.size()));
    const int64_t max_k = std::max({hp_.dim, hp_.q_dim(), hp_.ffn_width()});
    if (cpu::matmul_scratch_floats(max_k) > l.matmul_per_thread)
      throw Error("CPU backend: the kernels need " + std::to_string(cpu::matmul_scratch_floats(max_k)) +
                  " floats of scratch per thread, the memory plan gives " + std::to_string(l.matmul_per_thread) +
                  " (model/memory_plan.cpp must follow kernels.h)");
    static_assert(sizeof(cpu::BlockQ8Act) == 9 * sizeof(float), "the memory plan gives 9 floats per 32 values");
    static_assert(sizeof(cpu::BlockQ8K) == 80 * sizeof(float), "the memory plan gives 80 floats per 256 values");
    if (const std::string why = kv_type_unsupported(hp_, s.kv); !why.empty()) throw Error(why);
    shape_ = s;
    layout_ = l;
    kv_ = HostBuffer(kv_cache_bytes(hp_, s), "KV cache");
    scratch_ = HostBuffer(size_t(l.total) * sizeof(float), "activations");
    float* f = scratch_.as<float>();
    for (int i = 0; i < kActCount; ++i) act_[size_t(i)] = f + l.act[size_t(i)];
    rope_ = f + l.rope;
    stage_ = f + l.stage;
    xq_ = reinterpret_cast<cpu::BlockQ8Act*>(f + l.xq);
    thread_scratch_ = f + l.threads;
    xk_ = reinterpret_cast<cpu::BlockQ8K*>(f + l.xk);
    if (reinterpret_cast<uintptr_t>(xk_) % alignof(cpu::BlockQ8K) != 0)
      throw Error("CPU backend: the Q8_K activation blocks are not 64-byte aligned (model/memory_plan.cpp)");
    moe_ = f + l.moe;
  }

  void forward(std::span<const BatchToken> batch, std::span<const LogitAdjust> adjust) override {
    const int64_t T = int64_t(batch.size());
    if (T == 0) return;
    if (T > shape_.max_batch) throw Error("batch of " + std::to_string(T) + " tokens exceeds max_batch");
    const int64_t rows = logit_rows_of(batch);
    if (rows > logit_rows()) throw Error("logit row out of range");
    check_adjustments(adjust, rows, hp_.n_vocab);
    run_forward(m_, *this, batch);
    float* logits = act_[size_t(Act::logits)];
    for (const LogitAdjust& a : adjust) logits[int64_t(a.row) * hp_.n_vocab + a.token] += a.delta;
  }

  void host_parallel(int n, const std::function<void(int)>& fn) override {
    if (n <= 1 || pool_.size() == 1) return Backend::host_parallel(n, fn);
    std::atomic<int> next{0};
    pool_.run([&](int, int) {
      for (int i = next.fetch_add(1, std::memory_order_relaxed); i < n; i = next.fetch_add(1, std::memory_order_relaxed))
        fn(i);
    });
  }

  std::span<const float> logits(int32_t row) const override {
    return {act_[size_t(Act::logits)] + int64_t(row) * hp_.n_vocab, size_t(hp_.n_vocab)};
  }

  void set_trace(TraceFn fn) override { trace_ = std::move(fn); }

  /// HostExperts::run on this backend's activations (a backend reserved for
  /// steps of max_batch tokens; `tokens` are that many placeholders).
  void host_moe(std::span<const BatchToken> tokens, const MoeSpec& spec, const float* n, int64_t ldn, int64_t T,
                float* out, int64_t ldo, float* router, int64_t ldr) {
    if (T > shape_.max_batch) throw Error("host experts: a step of " + std::to_string(T) + " tokens exceeds max_batch");
    begin_step(tokens.first(size_t(T)), 0);
    float* xb = ptr(Act::xb);
    const int64_t ldxb = ld(Act::xb);
    for_tokens(T, [&](int64_t t) { std::copy_n(n + t * ldn, hp_.dim, xb + t * ldxb); });
    moe_ffn(Act::xb, nullptr, spec, Act::x, false);
    const float* x = ptr(Act::x);
    const int64_t ldx = ld(Act::x);
    for_tokens(T, [&](int64_t t) { std::copy_n(x + t * ldx, hp_.dim, out + t * ldo); });
    if (router)
      for (int64_t t = 0; t < T; ++t) std::copy_n(ptr(Act::router) + t * ld(Act::router), hp_.n_expert, router + t * ldr);
  }

 private:
  // --- ForwardOps --------------------------------------------------------
  void begin_step(std::span<const BatchToken> batch, int64_t logit_rows) override {
    batch_ = batch;
    rows_ = logit_rows;
    rope_ready_ = false;
  }
  void embed(const Weight& table, Act out) override;
  void rmsnorm(Act in, const Weight& g, float eps, Act out) override;
  void products(Act in, const NormSpec* norm, std::span<const ProductSpec> ps) override;
  void swiglu(Act g, Act u) override;
  void moe_ffn(Act in, const NormSpec* norm, const MoeSpec& spec, Act out, bool accumulate) override;
  void head_norm(Act qk, int64_t heads, const Weight& g, float eps) override;
  void rope(Act qk, int64_t heads, const RopeSpec& r) override;
  void kv_store(int layer, Act k, Act v) override;
  void attention(int layer, Act q, Act out, const AttentionSpec& a) override;
  void add(Act x, Act o) override;
  void gather_logit_rows(Act x, Act xl) override;
  void trace(std::string_view name, int layer, Act a, int64_t cols) override {
    if (trace_) trace_(name, layer, ptr(a), rows(a), cols, ld(a));
  }
  bool tracing() const override { return bool(trace_); }
  void step_point(StepPoint p, int layer) override {
    if (p == StepPoint::layer_done) during_step();
  }

  float* ptr(Act a) const { return act_[size_t(a)]; }
  int64_t ld(Act a) const { return act_shape(hp_, shape_, a).ld; }
  /// The rows an op on `a` covers this step.
  int64_t rows(Act a) const { return a == Act::xl || a == Act::logits ? rows_ : int64_t(batch_.size()); }
  int64_t logit_rows() const { return shape_.slots + 1; }
  int64_t max_k() const { return std::max({hp_.dim, hp_.q_dim(), hp_.ffn_width()}); }
  /// A slot's cache of one layer is head-major, [kv head][position][head
  /// dim]: the positions one head attends to are one stream of memory (with
  /// positions outermost, a head's 2 rows of 64 values sat in each 2 KiB,
  /// and decode deep in a context read them at 9 GB/s against 12 or more).
  /// A row is kv_row_bytes(shape_.kv, head_dim): f16 values or Q8_0 blocks.
  uint8_t* k_cache(int layer, int slot, int64_t kv_head = 0) const {
    return kv_.as<uint8_t>() + (((int64_t(layer) * shape_.slots + slot) * hp_.n_kv_heads + kv_head) * shape_.ctx) *
                                   kv_row();
  }
  uint8_t* v_cache(int layer, int slot, int64_t kv_head = 0) const {
    return k_cache(layer, slot, kv_head) + int64_t(hp_.n_layers) * shape_.slots * hp_.n_kv_heads * shape_.ctx * kv_row();
  }
  int64_t kv_head_dim() const { return hp_.head_dim; }
  int64_t kv_row() const { return kv_row_bytes(shape_.kv, hp_.head_dim); }
  cpu::KvRows kv_rows(const uint8_t* p) const { return {p, shape_.kv, kv_row()}; }
  float* thread_scratch(int t) const { return thread_scratch_ + int64_t(t) * layout_.per_thread; }

  /// Several products sharing one input, rows spread over the pool in one job.
  /// Quantized weights take the input quantized once per call and
  /// activation type (kernels.h, quant_types.h).
  struct Product {
    const Weight* w;
    const float* x;
    int64_t ldx;
    float* y;
    int64_t ldy;
    // Rows [row0, row0 + rows) of x and y (rows < 0: all T): products of
    // one call may take different rows of one input (the experts of a
    // batch, each over its own tokens), which is quantized once.
    int64_t row0 = 0;
    int64_t rows = -1;
  };
  void matmul(std::span<const Product> ps, int64_t T);
  /// Runs fn(i, n) on the pool, or inline as fn(0, 1) when `work` (multiply-adds)
  /// is too small to pay for waking the other threads.
  template <typename Fn>
  void parallel(int64_t work, Fn&& fn) {
    if (work < (int64_t(1) << 18)) return fn(0, 1);
    pool_.run(fn);
  }
  /// Runs fn(t) for each of T rows, spread over the pool when there are many.
  template <typename Fn>
  void for_tokens(int64_t T, Fn&& fn) {
    parallel(T * std::max(hp_.dim, hp_.ffn_width()) * 8, [&](int i, int n) {
      for (int64_t t = i; t < T; t += n) fn(t);
    });
  }

  const Model& m_;
  const HParams& hp_;
  const cpu::KernelTable& k_;
  cpu::ThreadPool pool_;
  EngineShape shape_;
  ScratchLayout layout_;
  HostBuffer kv_, scratch_;
  std::array<float*, kActCount> act_{};
  float* rope_ = nullptr;   // (max_batch, n_rot): cos, sin of each pair's angle
  float* stage_ = nullptr;  // (max_batch, ld(x)): a product that adds into its output
  float* thread_scratch_ = nullptr;
  cpu::BlockQ8Act* xq_ = nullptr;  // (max_batch, max_k / 32): the input of a product taking Q8_0 blocks
  cpu::BlockQ8K* xk_ = nullptr;    // (max_batch, max_k / 256): the input of one taking Q8_K blocks
  float* moe_ = nullptr;           // a mixture of experts' routes (cpu_scratch_layout: moe)
  std::span<const BatchToken> batch_;
  int64_t rows_ = 0;
  bool rope_ready_ = false;
  TraceFn trace_;
};

void CpuBackend::matmul(std::span<const Product> ps, int64_t T) {
  auto rows_of = [T](const Product& p) { return p.rows < 0 ? T : p.rows; };
  int64_t work = 0;
  for (const Product& p : ps) work += p.w->rows * p.w->cols * rows_of(p);
  // Rows go in chunks, and each thread has a contiguous run of them (its
  // share of the rows) that it takes in order: one stream of weights a
  // thread, which the hardware prefetcher follows (1B Q4_K_M decode, Zen 4,
  // 2 threads, alternated: 52-54 tok/s with the chunks interleaved from one
  // counter, 57-68 in runs). A thread that is descheduled (a busy machine)
  // or slower leaves the end of its run to the others (RangeQueues), and
  // the last rows of each run go in smaller chunks (decode only: a
  // multi-token chunk packs a 16-row panel), so the threads finish together.
  // Each row's result does not depend on which thread computes it.
  struct Chunk {
    const Product* p;
    int64_t r0, r1;
  };
  const int parts = pool_.size();
  int64_t total = 0;
  for (const Product& p : ps) total += p.w->rows;
  std::vector<Chunk> chunks;
  std::vector<int64_t> starts(size_t(parts), 0);
  const auto run_end = [&](int part) { return total * (part + 1) / parts; };  // in rows of all products
  int part = 0;
  int64_t g0 = 0;  // rows of the products before p
  for (const Product& p : ps) {
    // Decode chunks hold about 64 rows of K 2048: short rows (a mixture of
    // experts' 512 or 1024) in bigger chunks, so that taking one stays a
    // small part of its work.
    const int64_t decode = std::clamp<int64_t>(64 * 2048 / std::max<int64_t>(p.w->cols, 1), 64, 256) / 16 * 16;
    const int64_t big = rows_of(p) >= 4 ? 16 : decode, small = 16;
    for (int64_t r0 = 0; r0 < p.w->rows;) {
      while (part + 1 < parts && g0 + r0 >= run_end(part)) starts[size_t(++part)] = int64_t(chunks.size());
      // This run's end in p, on a multiple of 16 rows (past r0: g0 + r0 < run_end).
      const int64_t end = std::min(p.w->rows, (run_end(part) - g0 + 15) / 16 * 16), left = end - r0;
      const int64_t r1 = r0 + std::min(left, left > big ? big : small);
      chunks.push_back({&p, r0, r1});
      r0 = r1;
    }
    g0 += p.w->rows;
  }
  while (part + 1 < parts) starts[size_t(++part)] = int64_t(chunks.size());
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
  cpu::RangeQueues queues(starts, int64_t(chunks.size()));
  parallel(work, [&](int i, int) {
    float* scratch = thread_scratch(i);
    for (int64_t c = queues.take(i); c >= 0; c = queues.take(i)) {
      const Product& p = *chunks[size_t(c)].p;
      MatmulArgs a{p.w->type, p.w->data, p.w->cols, p.w->rows, p.x + p.row0 * p.ldx, p.ldx, rows_of(p),
                   p.y + p.row0 * p.ldy, p.ldy};
      a.ldxq = p.w->cols / 32;
      a.xq = xq_ + p.row0 * a.ldxq;
      a.ldxk = p.w->cols / 256;
      a.xk = xk_ + p.row0 * a.ldxk;
      k_.matmul_rows(a, chunks[size_t(c)].r0, chunks[size_t(c)].r1, scratch);
    }
  });
}

void CpuBackend::embed(const Weight& table, Act out) {
  float* o = ptr(out);
  const int64_t ldo = ld(out);
  for_tokens(int64_t(batch_.size()), [&](int64_t t) {
    cpu::dequantize_row(table.type, table.data, table.cols, batch_[size_t(t)].token, o + t * ldo);
  });
}

// The sum of x[i]^2 (each square in float, as ggml) in double, in eight
// running sums (value i into sum i % 8) added pairwise at the end: one chain
// of dependent double additions took ~4 cycles a value (1.7% of a 207M F16
// prefill). The CUDA kernel sums in an order of its own too.
double sum_squares(const float* x, int64_t n) {
  double part[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int k = 0; k < 8; ++k) part[k] += double(x[i + k] * x[i + k]);
  for (; i < n; ++i) part[i % 8] += double(x[i] * x[i]);
  return ((part[0] + part[4]) + (part[2] + part[6])) + ((part[1] + part[5]) + (part[3] + part[7]));
}

// y = x / sqrt(mean(x^2) + eps) * w.
void CpuBackend::rmsnorm(Act in, const Weight& w, float eps, Act out) {
  const float* g = static_cast<const float*>(w.data);
  const float* x = ptr(in);
  float* y = ptr(out);
  const int64_t n = w.cols, ldx = ld(in), ldo = ld(out);
  for_tokens(rows(in), [&](int64_t t) {
    const float* xr = x + t * ldx;
    float* o = y + t * ldo;
    const float mean = float(sum_squares(xr, n) / double(n));
    const float scale = 1.0f / std::sqrt(mean + eps);
    for (int64_t i = 0; i < n; ++i) o[i] = (xr[i] * scale) * g[i];
  });
}

void CpuBackend::products(Act in, const NormSpec* norm, std::span<const ProductSpec> ps) {
  if (norm) {
    rmsnorm(in, *norm->g, norm->eps, norm->out);
    in = norm->out;
  }
  const int64_t T = rows(in);
  std::vector<Product> mm;
  const ProductSpec* staged = nullptr;
  for (const ProductSpec& p : ps) {
    float* y = ptr(p.out);
    int64_t ldy = ld(p.out);
    if (p.accumulate) {
      // Computed into the staging rows, then added: the same bits as a
      // product followed by add().
      if (staged || ldy > ld(Act::x)) throw Error("CPU backend: one product per call may add into its output, of at most ld(x)");
      staged = &p;
      y = stage_;
    }
    mm.push_back({p.w, ptr(in), ld(in), y, ldy});
  }
  matmul(mm, T);
  for (size_t i = 0; i < ps.size(); ++i) {
    const ProductSpec& p = ps[i];
    if (!p.bias && !p.accumulate) continue;
    const float* b = p.bias ? static_cast<const float*>(p.bias->data) : nullptr;
    float* y = ptr(p.out);
    const float* r = mm[i].y;
    const int64_t n = p.w->rows, ldy = mm[i].ldy;
    for_tokens(T, [&](int64_t t) {
      float* yr = y + t * ldy;
      const float* rr = r + t * ldy;
      if (b)
        for (int64_t j = 0; j < n; ++j) yr[j] = p.accumulate ? yr[j] + (rr[j] + b[j]) : yr[j] + b[j];
      else
        for (int64_t j = 0; j < n; ++j) yr[j] += rr[j];
    });
  }
}

void CpuBackend::swiglu(Act g, Act u) {
  float* gp = ptr(g);
  const float* up = ptr(u);
  const int64_t ldg = ld(g), ldu = ld(u);
  for_tokens(rows(g), [&](int64_t t) { k_.silu_mul(gp + t * ldg, up + t * ldu, hp_.ff); });
}

void CpuBackend::moe_ffn(Act in, const NormSpec* norm, const MoeSpec& m, Act out, bool accumulate) {
  if (norm) {
    rmsnorm(in, *norm->g, norm->eps, norm->out);
    in = norm->out;
  }
  const int64_t T = rows(in), E = m.n_expert, K = m.n_used, dim = hp_.dim;
  const float* n = ptr(in);
  const int64_t ldn = ld(in), ldr = ld(Act::router), ldm = ld(Act::moe_in), ldh = ld(Act::hb);
  float* scores = ptr(Act::router);
  float* gathered = ptr(Act::moe_in);
  float* expert_out = ptr(Act::moe_out);
  float* hb = ptr(Act::hb);
  float* hb2 = ptr(Act::hb2);
  float* acc = stage_;  // (T, ld(x)): the sum of the experts' outputs
  const int64_t lda = ld(Act::x);
  // The routes (cpu_scratch_layout's moe part, worker/moe_routes.h).
  const ExpertRoutes r = ExpertRoutes::in(moe_, T, K, E);
  const int32_t* start = r.start;
  const int32_t* token_of = r.token_of;
  const float* weight_of = r.weight_of;
  const Product router{m.router, n, ldn, scores, ldr};
  matmul({&router, 1}, T);
  for_tokens(T, [&](int64_t t) { route_token(scores + t * ldr, E, K, m.norm_weights, r.pair + t * K, r.weight + t * K); });
  group_routes(r, T, K, E);
  for_tokens(T, [&](int64_t t) { std::fill_n(acc + t * lda, dim, 0.0f); });
  // The rows of every chosen expert, one after the other (expert e's at
  // start[e]...): gate and up of all of them in one job over the pool, the
  // input quantized once, then down likewise. Each row is one token's, so
  // a token's result does not depend on the batch it came in.
  const int64_t pairs = T * K;
  for_tokens(pairs, [&](int64_t i) { std::copy_n(n + int64_t(token_of[i]) * ldn, dim, gathered + i * ldm); });
  std::vector<Product> gu, dn;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t c0 = start[e], c = start[e + 1] - c0;
    if (c == 0) continue;
    const size_t i = size_t(e);
    gu.push_back({&m.gate[i], gathered, ldm, hb, ldh, c0, c});
    gu.push_back({&m.up[i], gathered, ldm, hb2, ldh, c0, c});
    dn.push_back({&m.down[i], hb, ldh, expert_out, ldm, c0, c});
  }
  matmul(gu, pairs);
  for_tokens(pairs, [&](int64_t i) { k_.silu_mul(hb + i * ldh, hb2 + i * ldh, m.expert_ff); });
  matmul(dn, pairs);
  // Each token's experts in the order of their weights, as llama.cpp sums them.
  for_tokens(T, [&](int64_t t) {
    float* a = acc + t * lda;
    for (int64_t k = 0; k < K; ++k) {
      const int32_t i = r.pair[t * K + k];
      const float* y = expert_out + int64_t(i) * ldm;
      const float w = weight_of[i];
      for (int64_t j = 0; j < dim; ++j) a[j] += y[j] * w;
    }
  });
  if (m.shared_gate_inp) {
    // The shared expert, on every token, under its sigmoid gate.
    const Product gu[2] = {{m.shared_gate, n, ldn, hb, ldh}, {m.shared_up, n, ldn, hb2, ldh}};
    matmul(gu, T);
    for_tokens(T, [&](int64_t t) { k_.silu_mul(hb + t * ldh, hb2 + t * ldh, m.shared_ff); });
    const Product d{m.shared_down, hb, ldh, expert_out, ldm};
    matmul({&d, 1}, T);
    const float* g = static_cast<const float*>(m.shared_gate_inp->data);
    for_tokens(T, [&](int64_t t) {
      const float* nr = n + t * ldn;
      float s = 0;
      for (int64_t j = 0; j < dim; ++j) s += g[j] * nr[j];
      const float gate = 1.0f / (1.0f + std::exp(-s));
      float* a = acc + t * lda;
      const float* y = expert_out + t * ldm;
      for (int64_t j = 0; j < dim; ++j) a[j] += y[j] * gate;
    });
  }
  float* o = ptr(out);
  const int64_t ldo = ld(out);
  for_tokens(T, [&](int64_t t) {
    float* orow = o + t * ldo;
    const float* a = acc + t * lda;
    if (accumulate)
      for (int64_t j = 0; j < dim; ++j) orow[j] += a[j];
    else
      std::copy_n(a, dim, orow);
  });
}

void CpuBackend::head_norm(Act qk, int64_t heads, const Weight& w, float eps) {
  const float* g = static_cast<const float*>(w.data);
  float* x = ptr(qk);
  const int64_t n = w.cols, ldx = ld(qk);
  for_tokens(rows(qk), [&](int64_t t) {
    for (int64_t h = 0; h < heads; ++h) {
      float* xr = x + t * ldx + h * n;
      const float mean = float(sum_squares(xr, n) / double(n));
      const float scale = 1.0f / std::sqrt(mean + eps);
      for (int64_t i = 0; i < n; ++i) xr[i] = (xr[i] * scale) * g[i];
    }
  });
}

void CpuBackend::rope(Act qk, int64_t heads, const RopeSpec& rs) {
  const int64_t T = rows(qk), n_rot = rs.n_rot, hd = rs.head_dim;
  if (!rope_ready_) {
    // Angles per token, as ggml's rope: theta_i = pos * base^(-2i/n_rot),
    // divided by the frequency factor, times the linear scale.
    const float theta_scale = std::pow(rs.base, -2.0f / float(n_rot));
    const float* ff = rs.freq_factors ? static_cast<const float*>(rs.freq_factors->data) : nullptr;
    for_tokens(T, [&](int64_t t) {
      float theta = float(batch_[size_t(t)].pos);
      float* r = rope_ + t * n_rot;
      for (int64_t i = 0; i < n_rot; i += 2) {
        const float a = rs.freq_scale * (ff ? theta / ff[i / 2] : theta);
        r[i] = std::cos(a);
        r[i + 1] = std::sin(a);
        theta *= theta_scale;
      }
    });
    rope_ready_ = true;
  }
  float* v = ptr(qk);
  const int64_t ldv = ld(qk);
  // normal pairs (x[i], x[i+1]); NEOX pairs (x[i/2], x[i/2 + n_rot/2]).
  const int64_t half = n_rot / 2;
  const bool neox = rs.type == RopeType::neox;
  for_tokens(T, [&](int64_t t) {
    const float* r = rope_ + t * n_rot;
    for (int64_t h = 0; h < heads; ++h) {
      float* x = v + t * ldv + h * hd;
      // The two layouts in loops of their own, which the compiler vectorises.
      if (neox) {
        for (int64_t j = 0; j < half; ++j) {
          const float x0 = x[j], x1 = x[j + half], c = r[2 * j], sn = r[2 * j + 1];
          x[j] = x0 * c - x1 * sn;
          x[j + half] = x0 * sn + x1 * c;
        }
      } else {
        for (int64_t i = 0; i < n_rot; i += 2) {
          const float x0 = x[i], x1 = x[i + 1];
          x[i] = x0 * r[i] - x1 * r[i + 1];
          x[i + 1] = x0 * r[i + 1] + x1 * r[i];
        }
      }
    }
  });
}

void CpuBackend::kv_store(int layer, Act k, Act v) {
  const float *kp = ptr(k), *vp = ptr(v);
  const int64_t ldk = ld(k), ldv = ld(v);
  const int64_t hd = kv_head_dim();
  for_tokens(rows(k), [&](int64_t t) {
    const BatchToken& b = batch_[size_t(t)];
    const int64_t at = int64_t(b.pos) * kv_row();
    for (int64_t h = 0; h < hp_.n_kv_heads; ++h) {
      const float *kr = kp + t * ldk + h * hd, *vr = vp + t * ldv + h * hd;
      uint8_t *kc = k_cache(layer, b.slot, h) + at, *vc = v_cache(layer, b.slot, h) + at;
      if (shape_.kv == KvType::q8_0) {
        cpu::store_kv_q8(k_, kr, hd, kc);
        cpu::store_kv_q8(k_, vr, hd, vc);
      } else {
        k_.to_f16(kr, reinterpret_cast<uint16_t*>(kc), hd);
        k_.to_f16(vr, reinterpret_cast<uint16_t*>(vc), hd);
      }
    }
  });
}

void CpuBackend::attention(int layer, Act qa, Act outa, const AttentionSpec& a) {
  static_assert(cpu::kAttendBlock == kAttendQueriesPerThread && cpu::kAttendTile == kAttendScoresPerQuery,
                "the memory plan's score rows per thread");
  const int64_t T = rows(qa), hd = a.head_dim;
  const int64_t group = a.n_heads / a.n_kv_heads, ldq = ld(qa), ldo = ld(outa);
  const float* q = ptr(qa);
  float* out = ptr(outa);
  // Blocks of up to kAttendBlock tokens of one sequence (a prompt chunk's
  // tokens follow each other in the batch): one pass over a head's cached K
  // and V serves the whole block. A generating slot's token is a block alone.
  std::vector<std::pair<int64_t, int64_t>> blocks;  // [t0, t1)
  for (int64_t t = 0; t < T;) {
    int64_t e = t + 1;
    while (e < T && e - t < cpu::kAttendBlock && batch_[size_t(e)].slot == batch_[size_t(t)].slot) ++e;
    blocks.push_back({t, e});
    t = e;
  }
  // A job is one block's queries of one head, or of every head that shares
  // a KV head (grouped-query attention) when they fit one pass: a
  // generating token's 4 heads of Llama 3 read their KV head's cache once,
  // not four times. Each query's arithmetic is the same either way.
  struct Job {
    int64_t t0, t1, h0, heads;
  };
  std::vector<Job> jobs;
  for (const auto& [t0, t1] : blocks) {
    if ((t1 - t0) * group <= cpu::kAttendBlock)
      for (int64_t kvh = 0; kvh < a.n_kv_heads; ++kvh) jobs.push_back({t0, t1, kvh * group, group});
    else
      for (int64_t h = 0; h < a.n_heads; ++h) jobs.push_back({t0, t1, h, 1});
  }
  const int64_t score_stride = cpu::kAttendTile;
  std::atomic<int64_t> next_job{0};
  // A cached position costs several multiply-adds of a product: two f16
  // rows (K and V) and its share of the softmax.
  parallel(8 * T * a.n_heads * hd * (batch_.back().pos + 1), [&](int i, int) {
    float* scores = thread_scratch(i) + layout_.matmul_per_thread;
    for (int64_t j = next_job.fetch_add(1, std::memory_order_relaxed); j < int64_t(jobs.size());
         j = next_job.fetch_add(1, std::memory_order_relaxed)) {
      const Job& job = jobs[size_t(j)];
      const int64_t kvh = job.h0 / group;
      const int slot = batch_[size_t(job.t0)].slot;
      const float* qs[cpu::kAttendBlock];
      float* outs[cpu::kAttendBlock];
      int64_t n_pos[cpu::kAttendBlock];
      int nq = 0;
      for (int64_t h = job.h0; h < job.h0 + job.heads; ++h)
        for (int64_t t = job.t0; t < job.t1; ++t, ++nq) {
          qs[nq] = q + t * ldq + h * hd;
          outs[nq] = out + t * ldo + h * hd;
          n_pos[nq] = int64_t(batch_[size_t(t)].pos) + 1;
        }
      k_.attend_block(qs, n_pos, nq, kv_rows(k_cache(layer, slot, kvh)), kv_rows(v_cache(layer, slot, kvh)), hd,
                      a.scale, outs, scores, score_stride);
    }
  });
}

void CpuBackend::add(Act xa, Act oa) {
  float* x = ptr(xa);
  const float* o = ptr(oa);
  const int64_t ldx = ld(xa), ldo = ld(oa);
  for_tokens(rows(xa), [&](int64_t t) {
    float* xr = x + t * ldx;
    const float* orow = o + t * ldo;
    for (int64_t i = 0; i < hp_.dim; ++i) xr[i] += orow[i];
  });
}

void CpuBackend::gather_logit_rows(Act xa, Act xla) {
  const float* x = ptr(xa);
  float* xl = ptr(xla);
  const int64_t ldx = ld(xa), ldl = ld(xla);
  for (size_t t = 0; t < batch_.size(); ++t)
    if (const int32_t r = batch_[t].logit_row; r >= 0) std::copy_n(x + int64_t(t) * ldx, ldl, xl + r * ldl);
}

class CpuHostExperts final : public HostExperts {
 public:
  CpuHostExperts(const Model& model, int threads, int64_t max_batch)
      : be_(model, threads), tokens_(size_t(std::max<int64_t>(max_batch, 1))) {
    // One position of one slot: the KV cache and the attention's score rows
    // are never used, only the activations of a step and the kernels' scratch.
    EngineShape s;
    s.ctx = 1;
    s.slots = 1;
    s.max_batch = std::max<int64_t>(max_batch, 1);
    be_.reserve(s);
  }
  void run(const MoeSpec& spec, const float* n, int64_t ldn, int64_t T, float* out, int64_t ldo, float* router,
           int64_t ldr) override {
    be_.host_moe(tokens_, spec, n, ldn, T, out, ldo, router, ldr);
  }
  uint64_t bytes() const override { return be_.reserved_bytes(); }

 private:
  CpuBackend be_;
  std::vector<BatchToken> tokens_;
};

class CpuHostCompute final : public HostCompute {
 public:
  CpuHostCompute(const Model& model, int expert_threads, int threads)
      : model_(model), expert_threads_(expert_threads), pool_(threads) {}
  void parallel(int n, const std::function<void(int)>& fn) override {
    if (n <= 1 || pool_.size() == 1) {
      for (int i = 0; i < n; ++i) fn(i);
      return;
    }
    std::atomic<int> next{0};
    pool_.run([&](int, int) {
      for (int i = next.fetch_add(1, std::memory_order_relaxed); i < n; i = next.fetch_add(1, std::memory_order_relaxed))
        fn(i);
    });
  }
  std::unique_ptr<HostExperts> experts(int64_t max_batch) override {
    return std::make_unique<CpuHostExperts>(model_, expert_threads_, max_batch);
  }

 private:
  const Model& model_;
  int expert_threads_;
  cpu::ThreadPool pool_;
};

}  // namespace

std::unique_ptr<HostExperts> make_host_experts(const Model& model, int threads, int64_t max_batch) {
  return std::make_unique<CpuHostExperts>(model, threads, max_batch);
}

std::unique_ptr<HostCompute> make_host_compute(const Model& model, int expert_threads) {
  // Sampling a 128K-token row takes ~0.1 ms: a step of 32 sampled slots
  // spreads over up to 8 of the cores the GPU leaves idle.
  const int cores = int(std::max(1u, std::thread::hardware_concurrency()));
  return std::make_unique<CpuHostCompute>(model, expert_threads, std::clamp(cores / 2, 1, 8));
}

std::unique_ptr<Backend> make_cpu_backend(const Model& model, int threads) {
  return std::make_unique<CpuBackend>(model, threads);
}

}  // namespace ds4
