#include "model/memory_plan.h"

#include <algorithm>

#include "model/weights.h"

namespace ds4 {
namespace {

int64_t pad8(int64_t n) { return (n + 7) / 8 * 8; }
int64_t pad16(int64_t n) { return (n + 15) / 16 * 16; }
uint64_t align256(uint64_t n) { return (n + 255) / 256 * 256; }

// The CUDA attention's counters and its largest batch of the split kernel
// (worker/cuda/kernels.cu); the split count is ceil(4 * SMs / (T * heads)),
// so T * heads * splits < T * heads + 4 * SMs for every T.
constexpr int64_t kCudaAttnCounters = 4096;
constexpr uint64_t kBatchTokenBytes = 16;  // sizeof(BatchToken)
constexpr uint64_t kLogitAdjustBytes = 12;  // sizeof(LogitAdjust)

}  // namespace

ActShape act_shape(const HParams& hp, const EngineShape& s, Act a) {
  const int64_t B = s.max_batch, R = s.slots + 1;
  switch (a) {
    case Act::x:
    case Act::xb: return {B, hp.dim, pad8(hp.dim)};
    case Act::q:
    case Act::att: return {B, hp.q_dim(), pad8(hp.q_dim())};
    case Act::k:
    case Act::v: return {B, hp.kv_dim(), pad8(hp.kv_dim())};
    case Act::hb:
    case Act::hb2: return {hp.moe() ? B * hp.n_expert_used : B, hp.ffn_width(), pad8(hp.ffn_width())};
    case Act::xl: return {R, hp.dim, pad8(hp.dim)};
    case Act::logits: return {R, hp.n_vocab, hp.n_vocab};
    case Act::router: return {B, hp.n_expert, pad8(hp.n_expert)};
    case Act::moe_in:
    case Act::moe_out: return hp.moe() ? ActShape{B * hp.n_expert_used, hp.dim, pad8(hp.dim)} : ActShape{B, 0, 0};
  }
  return {};
}

WeightsSummary WeightsSummary::of(const ModelWeights& w) {
  WeightsSummary s;
  s.bytes = w.bytes;
  auto see = [&](const Weight& x) {
    // A matrix the device keeps repacked is dequantised to f16 for a prefill's GEMM.
    const TypeTraits* row = type_row(x.type);
    const bool quantised = row && row->device != DeviceLayout::as_is;
    if (x && quantised) s.largest_q8_elems = std::max(s.largest_q8_elems, uint64_t(x.rows * x.cols));
  };
  see(w.token_embd);
  see(w.output);
  for (const LayerWeights& L : w.layers)
    for (const Weight* x : {&L.wq, &L.wk, &L.wv, &L.wo, &L.w_gate, &L.w_up, &L.w_down, &L.gate_exps, &L.up_exps,
                            &L.down_exps, &L.gate_shexp, &L.up_shexp, &L.down_shexp})
      see(*x);  // an expert stack counts one matrix: it is used one expert at a time
  return s;
}

uint64_t expert_bytes(const ModelWeights& w, int from, int to) {
  uint64_t b = 0;
  for (int i = std::max(from, 0); i < std::min<int>(to, int(w.layers.size())); ++i) {
    const LayerWeights& L = w.layers[size_t(i)];
    for (const std::vector<Weight>* mats : {&L.gate_mats, &L.up_mats, &L.down_mats})
      for (const Weight& m : *mats) b += m.row_bytes() * uint64_t(m.rows);
  }
  return b;
}

ScratchLayout cpu_scratch_layout(const HParams& hp, const EngineShape& s, int threads) {
  ScratchLayout l;
  int64_t at = 0;
  auto take = [&](int64_t n) { const int64_t r = at; at += n; return r; };
  for (int i = 0; i < kActCount; ++i) {
    const ActShape a = act_shape(hp, s, Act(i));
    l.act[size_t(i)] = take(a.rows * a.ld);
  }
  const int64_t B = s.max_batch, R = s.slots + 1;
  l.rope = take(B * hp.n_rot);
  l.stage = take(B * pad8(hp.dim));
  const int64_t max_k = std::max({hp.dim, hp.q_dim(), hp.ffn_width()});
  // A mixture of experts quantizes the rows of all chosen experts at once.
  const int64_t q_rows = std::max({B, R, hp.moe() ? B * hp.n_expert_used : 0});
  l.xq_floats = q_rows * (max_k / 32) * 9;
  l.xq = take(l.xq_floats);
  // Q8_K blocks (worker/cpu/quant_types.h): 320 bytes, 64-byte aligned.
  l.xk_floats = q_rows * (max_k / 256) * 80;
  at = (at + 15) / 16 * 16;
  l.xk = take(l.xk_floats);
  l.moe = take(hp.moe() ? 4 * B * hp.n_expert_used + hp.n_expert + 1 : 0);  // worker/moe_routes.h's words
  l.matmul_per_thread = 17 * pad16(max_k) + 64;
  l.per_thread = l.matmul_per_thread + kAttendQueriesPerThread * kAttendScoresPerQuery + pad8(hp.head_dim);
  l.threads = take(int64_t(std::max(threads, 1)) * l.per_thread);
  l.total = at;
  return l;
}

ScratchLayout cuda_scratch_layout(const HParams& hp, const EngineShape& s) {
  ScratchLayout l;
  int64_t at = 0;
  auto take = [&](int64_t n) {
    const int64_t r = at;
    at += (n + 63) / 64 * 64;
    return r;
  };
  for (int i = 0; i < kActCount; ++i) {
    const ActShape a = act_shape(hp, s, Act(i));
    l.act[size_t(i)] = take(a.rows * a.ld);
  }
  // Partial results of split attention, rows of head_dim + 2 floats: a decode
  // step's, kCudaAttnRows (cuda::attention_splits); a prefill's, one wave of
  // kCudaFaBlocksPerSm blocks of kCudaFaRows rows a multiprocessor, when the
  // context is deep enough to split (cuda::prefill_splits).
  const int64_t decode_rows = kCudaAttnRows;
  const int64_t prefill_rows = s.ctx >= 2 * kCudaFaSplitPositions ? kCudaFaRows * kCudaFaBlocksPerSm * kCudaPlanSms : 0;
  l.attn_floats = kCudaAttnCounters + (s.max_batch * hp.n_heads + std::max(decode_rows, prefill_rows)) * (hp.head_dim + 2);
  l.attn = take(l.attn_floats);
  l.total = at;
  return l;
}

uint64_t cuda_act16_bytes(const HParams& hp, const EngineShape& s) {
  return align256(uint64_t(s.max_batch) * uint64_t(std::max({hp.dim, hp.q_dim(), hp.ffn_width()})) * 2);
}

uint64_t cuda_scratch_bytes(const HParams& hp, const EngineShape& s, const WeightsSummary& w) {
  // A mixture of experts' routes and a prefill's expert jobs (worker/moe_routes.h's
  // words and job_words) on the device.
  const int64_t pairs = int64_t(s.max_batch) * hp.n_expert_used;
  const uint64_t routes =
      hp.moe() ? uint64_t(4 * pairs + hp.n_expert + 1 + 3 * ((pairs + 7) / 8 + hp.n_expert)) * 4 : 0;
  const uint64_t tables = hp.moe() ? uint64_t(hp.n_layers * 3 * hp.n_expert) * kCudaDeviceWeightBytes : 0;
  // A row's best logits: the blocks' keys, its log-sum-exp and the result (cuda::TopLogits).
  const uint64_t top_row_bytes = uint64_t((hp.n_vocab + kCudaTopChunk - 1) / kCudaTopChunk) * kCudaTopLogits * 8 + 8 +
                                 16 + uint64_t(kCudaTopLogits) * 8;
  return uint64_t(cuda_scratch_layout(hp, s).total) * 4 + cuda_act16_bytes(hp, s) + w.largest_q8_elems * 2 +
         kCudaBlasWorkspace + uint64_t(s.max_batch) * kBatchTokenBytes + routes + tables +
         uint64_t(s.slots + 1) * kCudaAdjustsPerRow * kLogitAdjustBytes + uint64_t(s.slots + 1) * top_row_bytes;
}

const char* kv_type_name(KvType t) { return t == KvType::q8_0 ? "q8_0" : "f16"; }

std::optional<KvType> kv_type_from(std::string_view name) {
  if (name == "f16") return KvType::f16;
  if (name == "q8_0") return KvType::q8_0;
  return std::nullopt;
}

std::string kv_type_unsupported(const HParams& hp, KvType t) {
  if (t == KvType::q8_0 && hp.head_dim % kKvQ8Block != 0)
    return "a q8_0 KV cache needs a head size that is a multiple of 32; this model's is " +
           std::to_string(hp.head_dim);
  return {};
}

MemoryPlan plan_memory(const HParams& hp, const EngineShape& s, const WeightsSummary& w,
                       const BackendPlanOptions& opt) {
  MemoryPlan p;
  p.weights = w.bytes;
  p.kv = kv_cache_bytes(hp, s);
  p.scratch = opt.kind == BackendKind::cpu ? uint64_t(cpu_scratch_layout(hp, s, opt.threads).total) * 4
                                           : cuda_scratch_bytes(hp, s, w);
  return p;
}

}  // namespace ds4
