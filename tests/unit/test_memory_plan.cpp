// The memory plan as a pure function of (hyper-parameters, shape, backend
// kind, weights) (model/memory_plan.h), the one figure of the supervisor's
// ladder and of each backend: the CPU backend's reserve() allocates exactly
// what the plan says.
#include <doctest/doctest.h>

#include <unistd.h>

#include <string>

#include "model/memory_plan.h"
#include "model/weights.h"
#include "shared/gguf.h"
#include "shared/model_store.h"
#include "supervisor/model_setup.h"
#include "worker/backend.h"

using namespace ds4;

namespace {

const std::string kStories = std::string(DS4_SHARED_MODELS) + "/stories260K.gguf";

HParams small_hp() {
  HParams hp;
  hp.arch = "qwen3";
  hp.n_vocab = 1000;
  hp.dim = 64;
  hp.n_layers = 3;
  hp.ff = 160;
  hp.n_heads = 4;
  hp.n_kv_heads = 2;
  hp.head_dim = 24;  // not dim / heads: the KV cache follows the head size
  hp.n_rot = 24;
  return hp;
}

}  // namespace

TEST_CASE("memory plan: the KV cache is f16 K and V per layer, slot, position and KV head value") {
  const HParams hp = small_hp();
  EngineShape s{1000, 3, 64};
  const MemoryPlan p = plan_memory(hp, s, {}, {BackendKind::cpu, 2});
  // 2 (K, V) x 3 layers x 3 slots x 1000 positions x (2 KV heads x 24) x 2 bytes.
  CHECK(p.kv == 2ull * 3 * 3 * 1000 * 48 * 2);
  CHECK(p.kv == kv_cache_bytes(hp, s));
  s.ctx = 2000;
  CHECK(plan_memory(hp, s, {}, {BackendKind::cpu, 2}).kv == 2 * p.kv);
}

TEST_CASE("memory plan: a pure function of its inputs") {
  const HParams hp = small_hp();
  const EngineShape s{512, 2, 128};
  const WeightsSummary w{123456, 0};
  for (BackendKind k : {BackendKind::cpu, BackendKind::cuda}) {
    const MemoryPlan a = plan_memory(hp, s, w, {k, 2}), b = plan_memory(hp, s, w, {k, 2});
    CHECK(a.weights == 123456);
    CHECK(a.kv == b.kv);
    CHECK(a.scratch == b.scratch);
    CHECK(a.own() == a.kv + a.scratch);
  }
  // Scratch follows the batch and the logit rows, and the CPU's per-thread share.
  const uint64_t base = plan_memory(hp, s, w, {BackendKind::cpu, 2}).scratch;
  CHECK(plan_memory(hp, {512, 2, 256}, w, {BackendKind::cpu, 2}).scratch > base);
  CHECK(plan_memory(hp, {512, 8, 128}, w, {BackendKind::cpu, 2}).scratch > base);
  CHECK(plan_memory(hp, s, w, {BackendKind::cpu, 4}).scratch > base);
  // The logits alone: (slots + 1) rows of n_vocab floats.
  CHECK(base >= uint64_t(s.slots + 1) * uint64_t(hp.n_vocab) * 4);
  // The CUDA plan counts the Q8_0 dequantisation buffer (f16) and not threads.
  const uint64_t cuda = plan_memory(hp, s, w, {BackendKind::cuda, 2}).scratch;
  CHECK(plan_memory(hp, s, w, {BackendKind::cuda, 16}).scratch == cuda);
  CHECK(plan_memory(hp, s, {123456, 1000}, {BackendKind::cuda, 2}).scratch == cuda + 2000);
}

TEST_CASE("memory plan: every activation has room for its rows at a stride of 8 floats") {
  const HParams hp = small_hp();
  const EngineShape s{256, 2, 16};
  const ScratchLayout l = cpu_scratch_layout(hp, s, 3);
  for (int i = 0; i + 1 < kActCount; ++i) {
    const ActShape a = act_shape(hp, s, Act(i));
    CHECK(a.ld % 8 == 0);
    CHECK(a.ld >= a.width);
    CHECK(l.act[size_t(i) + 1] - l.act[size_t(i)] == a.rows * a.ld);
  }
  CHECK(act_shape(hp, s, Act::q).width == 96);   // 4 heads x 24
  CHECK(act_shape(hp, s, Act::k).width == 48);   // 2 heads x 24
  CHECK(act_shape(hp, s, Act::xl).rows == 3);    // slots + 1
  CHECK(act_shape(hp, s, Act::logits).ld == 1000);
  CHECK(l.total * 4 == int64_t(plan_memory(hp, s, {}, {BackendKind::cpu, 3}).scratch));
}

TEST_CASE("memory plan: the CPU backend's plan is plan_memory, and reserve() allocates exactly that") {
  const gguf::File file = gguf::File::open(kStories);
  const Model model = Model::bind_file(file);
  for (int threads : {1, 3}) {
    auto backend = make_cpu_backend(model, threads);
    for (EngineShape s : {EngineShape{64, 1, 8}, EngineShape{300, 4, 32}}) {
      CAPTURE(threads);
      CAPTURE(s.ctx);
      const MemoryPlan want = plan_memory(model.hp(), s, WeightsSummary::of(model.w()), {BackendKind::cpu, threads});
      const MemoryPlan got = backend->plan(s);
      CHECK(got.weights == want.weights);
      CHECK(got.kv == want.kv);
      CHECK(got.scratch == want.scratch);
      backend->reserve(s);
      CHECK(backend->reserved_bytes() == want.own());
    }
  }
}

TEST_CASE("memory plan: the supervisor's ladder is the CPU worker's own figure, without the engine") {
  const std::string name = "ds4-test-" + std::to_string(::getpid()) + "-plan";
  store::remove(name);
  store::LoadOptions opts;
  opts.name = name;
  store::load(kStories, opts);
  sup::ModelInfo info;
  info.segment = name;
  const std::vector<sup::Rung> ladder = sup::plan_ladder(info, sup::ladder_rungs({256, 1024}), 2, 3);
  const gguf::File file = gguf::File::open(kStories);
  const Model model = Model::bind_file(file);
  auto backend = make_cpu_backend(model, 3);
  REQUIRE(ladder.size() == 2);
  CHECK(uint64_t(ladder[0].own_bytes) == backend->plan({256, 2, 256}).own());
  CHECK(uint64_t(ladder[1].own_bytes) == backend->plan({1024, 2, 256}).own());
  store::remove(name);
}
