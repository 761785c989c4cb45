// The CUDA backend: worker/forward.h's ops on the GPU (run_forward() sequences
// them for every architecture; the CPU backend is the reference of each op).
// The weights are a weight image (weights.cuh): mapped from the GPU's holder,
// copied to device memory, or the shared pages used in place. The KV cache and
// every scratch buffer are allocated in reserve(), so forward() allocates
// nothing. A decode step (up to kMaxGemvTokens tokens) is captured once per
// batch shape in a CUDA graph and replayed: all per-token data lives in device
// memory. Logits stay on the device: a step brings back only each row's greedy
// pick; logits(row) copies a row when the host sampler needs it.
#include "worker/cuda/cuda_backend.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <map>
#include <tuple>
#include <optional>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "shared/log.h"
#include "worker/forward.h"
#include "worker/host_compute.h"
#include "worker/moe_routes.h"
#include "worker/cuda/common.cuh"
#include "worker/cuda/holder.cuh"
#include "worker/cuda/kernels.cuh"
#include "worker/cuda/quant.cuh"
#include "worker/cuda/sampling.cuh"
#include "worker/cuda/weights.cuh"

namespace ds4 {
namespace {

using cuda::DeviceBuffer;
using cuda::DeviceWeight;


/// Pinned host memory (cudaMallocHost), for the transfers of every step.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  PinnedBuffer(size_t bytes, const char* what) : bytes_(bytes) {
    if (bytes && cudaMallocHost(&ptr_, bytes) != cudaSuccess) {
      cudaGetLastError();
      throw Error(std::string("cannot allocate pinned host memory for the ") + what);
    }
  }
  PinnedBuffer(PinnedBuffer&& o) noexcept { *this = std::move(o); }
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  ~PinnedBuffer() {
    if (ptr_) cudaFreeHost(ptr_);
  }
  template <typename T>
  T* as() const { return static_cast<T*>(ptr_); }
  size_t size() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

class CudaBackend final : public Backend, ForwardOps {
 public:
  CudaBackend(const Model& model, int device, const CudaWeightsOptions& weights);
  ~CudaBackend() override;

  std::string name() const override {
    std::string n = "cuda(" + device_name_ + ", weights: " + image_->source();
    if (host_layers_ > 0) n += ", experts of " + std::to_string(host_layers_) + " layers on the host";
    return n + ")";
  }
  bool memory_on_device() const override { return true; }
  std::optional<DeviceRoom> device_room() const override;
  MemoryPlan plan(const EngineShape& s) const override;
  void reserve(const EngineShape& s) override;
  void forward(std::span<const BatchToken> batch, std::span<const LogitAdjust> adjust) override;
  std::span<const float> logits(int32_t row) const override;
  void fetch_logits(std::span<const int32_t> rows) const override;
  void host_parallel(int n, const std::function<void(int)>& fn) override;
  std::optional<TokenLogprob> greedy(int32_t row) const override;
  std::optional<RowBest> best_logits(int32_t row) const override;
  void set_trace(TraceFn fn) override { trace_ = std::move(fn); }

 private:
  // --- ForwardOps (worker/forward.h) ------------------------------------
  void begin_step(std::span<const BatchToken> batch, int64_t logit_rows) override;
  void embed(const Weight& table, Act out) override;
  void rmsnorm(Act in, const Weight& g, float eps, Act out) override;
  void products(Act in, const NormSpec* norm, std::span<const ProductSpec> ps) override;
  void ffn_swiglu(Act in, const NormSpec* norm, const Weight& gate, const Weight& up, Act h, Act h_up) override;
  void swiglu(Act g, Act u) override;
  void moe_ffn(Act in, const NormSpec* norm, const MoeSpec& spec, Act out, bool accumulate) override;
  void head_norm(Act qk, int64_t heads, const Weight& g, float eps) override;
  void rope(Act qk, int64_t heads, const RopeSpec& r) override;
  void kv_store(int layer, Act k, Act v) override;
  void rope_kv_store(int layer, Act q, int64_t q_heads, Act k, int64_t kv_heads, Act v, const RopeSpec& r) override;
  void attention(int layer, Act q, Act out, const AttentionSpec& a) override;
  void add(Act x, Act o) override;
  void gather_logit_rows(Act x, Act xl) override;
  void trace(std::string_view name, int layer, Act a, int64_t cols) override {
    trace_rows(name, layer, ptr(a), rows(a), cols, ld(a));
  }
  bool tracing() const override { return bool(trace_); }
  void step_point(StepPoint p, int layer) override;

  float* ptr(Act a) const { return f(sc_.act[size_t(a)]); }
  int64_t ld(Act a) const { return act_shape(hp_, shape_, a).ld; }
  /// The rows an op on `a` covers this step.
  int rows(Act a) const { return a == Act::xl || a == Act::logits ? step_rows_ : step_tokens_; }
  const BatchToken* batch_dev() const { return tokens_dev_.as<BatchToken>(); }
  /// The device view of one of the model's weights (keyed by its host data).
  const DeviceWeight& dev(const Weight& w) const;
  const float* dev_f32(const Weight& w) const { return static_cast<const float*>(dev(w).data); }
  cuda::RopeArgs rope_args(const RopeSpec& r, int64_t q_heads, int64_t kv_heads) const;

  int64_t logit_rows() const { return shape_.slots + 1; }
  int attention_splits(int T, int64_t positions) const {
    return cuda::attention_splits(T, int(hp_.n_heads), int(hp_.n_kv_heads), int(hp_.head_dim),
                                  shape_.kv == KvType::q8_0, positions, shape_.ctx, n_sm_);
  }

  /// The weight image `o` asks for (holder, copy or host-mapped); falls back to a copy, saying why.
  std::unique_ptr<cuda::WeightImage> make_image(const CudaWeightsOptions& o);
  std::unique_ptr<cuda::WeightImage> image_from_holder(const CudaWeightsOptions& o, std::string& why);
  void bind_weights();
  /// The end of moe_ffn: the shared expert (if any) into `shared_y`, then
  /// each token's experts (and the shared one under its gate) summed into `out`.
  void combine_experts(const MoeSpec& m, cuda::MoeCombine c, Act in, float* shared_y, Act out, bool accumulate);
  /// moe_ffn for a layer whose experts stay on the host (HostExperts).
  void moe_on_host(Act in, const MoeSpec& m, Act out, bool accumulate);
  /// moe_ffn of a decode step routed on the device: top-k there, each
  /// stack's chosen experts in one launch (expert_gemv); no host round trip,
  /// so the step can be a CUDA graph.
  void moe_on_device(Act in, const MoeSpec& m, Act out, bool accumulate);
  /// moe_ffn of a prefill chunk routed on the device: top-k and the grouping
  /// by expert there (moe_group), each stack's rows through the tiled GEMM in
  /// one launch; the GPU never waits on the host mid-step.
  void moe_prefill_on_device(Act in, const MoeSpec& m, Act out, bool accumulate);
  /// Builds each layer's device tables of its experts' views, where every
  /// stack takes the expert GEMV; true when every layer on the device has them.
  bool make_expert_tables();
  /// Enqueues the whole step for T tokens (already in tokens_dev_) on stream_.
  /// `reads`: how many times a layer the worker reads its socket meanwhile
  /// (0 while a graph is captured). `pick`: the greedy picks too.
  void enqueue(int T, int rows, int reads, bool pick = true);
  /// The greedy picks of the step's `rows` logit rows, and their copy to picks_host_.
  void pick(int rows);
  /// Adds `adjust` to the step's logits (in uploads of adjust_host_'s size).
  void add_adjustments(std::span<const LogitAdjust> adjust);
  /// Launches the step of (T, rows) as its graph, captured now if it is new.
  /// False, with nothing launched, for a new shape past kMaxGraphs or when
  /// the GPU has no memory for the graph: the step is then launched kernel
  /// by kernel.
  bool launch_graph(int T, int rows);
  void no_room_for_graphs(int T, int rows);
  void trace_rows(std::string_view name, int layer, const float* dev, int64_t rows, int64_t cols, int64_t ld);
  /// The cache: K of every layer, then V. f16: [layer][slot][pos][kv_dim]
  /// halves each. q8_0: the int8 values of every layer in that order, then
  /// their scales (one half per 32 values), for K and then for V; the same
  /// bytes as kv_cache_bytes().
  cuda::KvLayer k_cache(int layer) const { return kv_layer(layer, false); }
  cuda::KvLayer v_cache(int layer) const { return kv_layer(layer, true); }
  cuda::KvLayer kv_layer(int layer, bool v) const {
    const int64_t n = shape_.slots * shape_.ctx * hp_.kv_dim();  // values a layer
    if (shape_.kv == KvType::f16)
      return {kv_.as<__half>() + (int64_t(v) * hp_.n_layers + layer) * n, nullptr};
    int8_t* part = kv_.as<int8_t>() + int64_t(v) * hp_.n_layers * n * kKvQ8BlockBytes / kKvQ8Block;
    return {part + int64_t(layer) * n,
            reinterpret_cast<__half*>(part + hp_.n_layers * n) + int64_t(layer) * n / kKvQ8Block};
  }
  static __half* half_cache(cuda::KvLayer c) { return static_cast<__half*>(c.values); }
  float* f(int64_t off) const { return scratch_.as<float>() + off; }

  const Model& m_;
  const HParams& hp_;
  int device_ = 0;
  int n_sm_ = 0;
  std::string device_name_;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t blas_ = nullptr;

  cuda::ImageLayout layout_;
  std::unique_ptr<cuda::WeightImage> image_;
  // The expert rung (CudaWeightsOptions): experts of layers below
  // host_layers_ run on the host; those of [host_layers_, holder_layers_),
  // which the image lacks, are this worker's own copy (extra_).
  int host_layers_ = 0, holder_layers_ = 0;
  cuda::ImageLayout extra_layout_;
  std::unique_ptr<cuda::WeightImage> extra_;
  std::unique_ptr<HostExperts> host_experts_;
  PinnedBuffer host_in_, host_out_;
  // Per layer, the offsets (in views) of its gate, up and down tables in
  // expert_tables_ (-1: that layer routes on the host).
  struct LayerTables {
    int64_t gate = -1, up = -1, down = -1;
  };
  std::vector<LayerTables> tables_;
  DeviceBuffer expert_tables_;
  std::unordered_map<const void*, DeviceWeight> views_;  // Weight::data -> its view in the image
  WeightsSummary summary_;

  EngineShape shape_;
  bool reserved_ = false;
  DeviceBuffer kv_, scratch_, act_, deq_, blas_ws_, tokens_dev_, picks_dev_, adjust_dev_, top_dev_;
  PinnedBuffer tokens_host_, logits_host_, picks_host_, adjust_host_, top_host_;
  // Whether top_host_ holds this step's best logits (best_logits).
  mutable bool top_ready_ = false;
  // Which rows of logits_host_ hold this step's logits (fetch_logits).
  mutable std::vector<uint8_t> fetched_;
  // The host's cores (CudaWeightsOptions::host): the experts of the layers
  // below host_layers_, and sampling the rows the device does not
  // (host_parallel). Null: none given, host_parallel runs on the caller.
  std::shared_ptr<HostCompute> host_;
  // A mixture of experts: the routes on the device, and the router scores
  // and routes on the host, where they are computed (worker/moe_routes.h).
  DeviceBuffer routes_dev_;
  PinnedBuffer routes_host_, router_host_;

  int rows_ = 0;  // logit rows of the last step
  int step_tokens_ = 0, step_rows_ = 0, step_reads_now_ = 0;  // the step being enqueued
  ScratchLayout sc_{};
  cuda::GemmContext gemm_{};

  // (tokens, logit rows, whether the attention is the deep decode kernel) -> decode step
  std::map<std::tuple<int, int, bool>, cudaGraphExec_t> graphs_;
  bool use_graphs_ = true;
  bool host_routes_ = std::getenv("DS4_CUDA_MOE_HOST_ROUTES") != nullptr;  // route every step on the host (comparison)
  // How a prefill's experts run (DS4_CUDA_MOE_PREFILL): tiles (the tiled GEMM, default), groups (groups of 8
  // rows through the decode GEMV's body) or each (one expert at a time through cuBLAS): the last two for comparison.
  enum class MoePrefill { tiles, groups, each };
  MoePrefill moe_prefill_ = [] {
    const char* how = std::getenv("DS4_CUDA_MOE_PREFILL");
    if (how && std::strcmp(how, "groups") == 0) return MoePrefill::groups;
    if (how && std::strcmp(how, "each") == 0) return MoePrefill::each;
    return MoePrefill::tiles;
  }();
  // The view of layer expert table entry `at` (a stack's first expert) for an expert launch.
  cuda::ExpertProduct expert_product(int64_t at, const Weight& w, const float* x, int64_t ldx, float* y,
                                     int64_t ldy) const {
    return {expert_tables_.as<DeviceWeight>() + at, x, ldx, y, ldy, w.type, w.rows, w.cols};
  }
  // DS4_CUDA_MOE_FUSE=0: a decode step's experts as four launches (gate, up,
  // SwiGLU, down: the way before, for comparison) instead of two.
  bool moe_fuse_ = !(std::getenv("DS4_CUDA_MOE_FUSE") && std::strcmp(std::getenv("DS4_CUDA_MOE_FUSE"), "0") == 0);
  // DS4_CUDA_MIXED_ATTN=0: a mixed batch's attention in one prefill launch (the way before, for comparison).
  int mixed_attention_ = std::getenv("DS4_CUDA_MIXED_ATTN") ? std::atoi(std::getenv("DS4_CUDA_MIXED_ATTN")) : 1;
  // Steps of up to graph_tokens_ tokens are captured once per (tokens, logit
  // rows) and replayed: a step launched kernel by kernel keeps the thread
  // launching longer than a small model's GPU computes it. At most
  // kMaxGraphs shapes (a decode step of n slots is (n, n); prefill chunks
  // add others); past that a new shape is launched.
  static constexpr size_t kMaxGraphs = 256;
  // A graph's instantiation takes device memory outside the plan (reserve()
  // does not count it). When the GPU has none left for one, steps of shapes
  // not captured yet launch kernel by kernel from then on: the worker keeps
  // serving rather than failing a step for an optimisation.
  bool graphs_full_ = false;
  int graph_tokens_ = cuda::kMaxGemvTokens;  // DS4_CUDA_GRAPH_TOKENS (see NOTES.md: 64 halves c=32 latency, but captures cost p99)
  int step_reads_ = 2;  // reads a layer in a launched step: after the attention and after the layer (DS4_CUDA_STEP_READS)
  TraceFn trace_;
};

CudaBackend::CudaBackend(const Model& model, int device, const CudaWeightsOptions& weights)
    : m_(model), hp_(model.hp()), device_(device) {
  DS4_CUDA_CHECK(cudaSetDevice(device));
  cudaDeviceProp prop{};
  DS4_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  n_sm_ = prop.multiProcessorCount;
  device_name_ = std::to_string(device) + ": " + prop.name;
  if (const std::string why = cuda_unsupported(hp_); !why.empty()) throw Error("CUDA backend: " + why);
  if (const char* g = std::getenv("DS4_CUDA_GRAPHS")) use_graphs_ = std::strcmp(g, "0") != 0;
  if (const char* g = std::getenv("DS4_CUDA_GRAPH_TOKENS")) graph_tokens_ = std::max(1, std::atoi(g));
  if (const char* r = std::getenv("DS4_CUDA_STEP_READS")) step_reads_ = std::clamp(std::atoi(r), 0, 2);
  DS4_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  DS4_BLAS_CHECK(cuda::blas::create(&blas_));
  DS4_BLAS_CHECK(cuda::blas::set_stream(blas_, stream_));
  if (weights.host_expert_layers > 0 && !hp_.moe())
    throw Error("CUDA backend: experts on the host (--host-experts) need a mixture-of-experts model");
  host_layers_ = int(std::clamp<int64_t>(weights.host_expert_layers, 0, hp_.n_layers));
  holder_layers_ = std::max(host_layers_, int(std::clamp<int64_t>(weights.holder_expert_layers, -1, hp_.n_layers)));
  host_ = weights.host;
  if (host_layers_ > 0 && !host_)
    throw Error("CUDA backend: experts on the host (--host-experts) need the host's cores (CudaWeightsOptions::host)");
  // The weights read in place need no copy of their own: the image is what the device reads.
  if (resolve_weight_source(weights.mode, cuda_integrated(device), false) == CudaWeightSource::host_mapped)
    holder_layers_ = host_layers_;
  layout_ = cuda::ImageLayout::of(m_.w(), holder_layers_);
  extra_layout_ = cuda::ImageLayout::experts_of(m_.w(), host_layers_, holder_layers_);
  summary_ = WeightsSummary::of(m_.w());
  if (layout_.max_q8_elems > summary_.largest_q8_elems)
    throw Error("CUDA backend: the memory plan's dequantisation scratch (" + std::to_string(summary_.largest_q8_elems) +
                " values) is smaller than the largest repacked weight's (" + std::to_string(layout_.max_q8_elems) +
                "): model/memory_plan.cpp must follow worker/cuda/weights.cu");
  image_ = make_image(weights);
  if (!extra_layout_.entries.empty()) extra_ = cuda::copy_image(extra_layout_, stream_);
  bind_weights();
  // A mixture of experts routes its decode steps on the device where every
  // layer's experts take the expert GEMV (block-quantised types) and none is
  // on the host: those steps are captured as graphs like a dense model's. A
  // step routed on the host synchronises mid-step: no graphs then.
  if (hp_.moe()) {
    const bool device_routed = make_expert_tables() && host_layers_ == 0 && !host_routes_;
    if (!device_routed) use_graphs_ = false;
    graph_tokens_ = std::min(graph_tokens_, cuda::kMaxGemvTokens);
  }
  if (holder_layers_ > 0) {
    const std::string copied = extra_ ? "the experts of layers " + std::to_string(host_layers_) + " to " +
                                            std::to_string(holder_layers_ - 1) + " copied to this worker (" +
                                            std::to_string(extra_layout_.total >> 20) + " MiB; the holder lacks them)"
                                      : std::string();
    const std::string host = host_layers_ > 0 ? "the experts of the first " + std::to_string(host_layers_) +
                                                    " layers are computed on the host"
                                              : "every expert on the device";
    log::info("cuda:" + std::to_string(device) + ": " + host + (copied.empty() ? "" : ", " + copied),
              {{"DS4_HOST_EXPERTS", std::to_string(host_layers_)}});
  }
}

CudaBackend::~CudaBackend() {
  for (auto& [key, g] : graphs_) cudaGraphExecDestroy(g);
  if (stream_) cudaStreamSynchronize(stream_);
  if (blas_) cuda::blas::destroy(blas_);
  if (stream_) cudaStreamDestroy(stream_);
}

std::unique_ptr<cuda::WeightImage> CudaBackend::make_image(const CudaWeightsOptions& o) {
  const std::string dev = "cuda:" + std::to_string(device_);
  const std::string socket = o.holder_socket.empty() ? default_holder_socket(device_) : o.holder_socket;
  const bool integrated = cuda_integrated(device_);
  const CudaWeightSource mode = resolve_weight_source(o.mode, integrated, access(socket.c_str(), F_OK) == 0);
  if (mode == CudaWeightSource::host_mapped) {
    if (o.mode == CudaWeightSource::automatic)
      log::info(dev + " is an integrated GPU (memory shared with the host): the weights are read in place from "
                "shared memory, no second copy", {{"DS4_GPU_WEIGHTS", "host-mapped"}});
    return cuda::host_mapped_image(layout_, stream_);
  }
  if (mode == CudaWeightSource::holder) {
    std::string why;
    if (auto image = image_from_holder(o, why)) {
      log::info(dev + ": weights mapped from the holder at " + socket, {{"DS4_GPU_WEIGHTS", "holder"}});
      return image;
    }
    log::warn(dev + ": no weights from the holder at " + socket + " (" + why +
                  "); copying them from shared memory instead",
              {{"DS4_GPU_WEIGHTS", "copy"}, {"DS4_HOLDER_ERROR", why}});
  }
  return cuda::copy_image(layout_, stream_);
}

// The holder's image is used only when it is exactly what this worker would
// build: same layout version and hash, same model, same device.
std::unique_ptr<cuda::WeightImage> CudaBackend::image_from_holder(const CudaWeightsOptions& o, std::string& why) {
  const std::string socket = o.holder_socket.empty() ? default_holder_socket(device_) : o.holder_socket;
  int fd = -1;
  try {
    cuda::HolderOffer offer = cuda::ask_holder(socket, o.holder_timeout_ms);
    fd = offer.fd;
    const nlohmann::json& d = offer.desc;
    std::string mismatch;
    if (d.value("version", 0u) != cuda::kImageLayoutVersion) mismatch = "another image layout version";
    else if (d.value("model_key", "") != o.model_key) mismatch = "another model (" + d.value("model_key", "") + ")";
    else if (d.value("device_uuid", "") != cuda::device_uuid(device_)) mismatch = "another GPU";
    else if (d.value("layout_hash", "") != cuda::hex64(layout_.hash) || d.value("image_bytes", uint64_t(0)) != layout_.total)
      mismatch = "another weight layout";
    else if (d.value("bytes", uint64_t(0)) < layout_.total) mismatch = "an allocation too small";
    if (!mismatch.empty()) {
      ::close(fd);
      why = "its image is of " + mismatch;
      return nullptr;
    }
    const uint64_t bytes = d.value("bytes", uint64_t(0));
    return cuda::imported_image(layout_, cuda::VmmAllocation::import(device_, std::exchange(fd, -1), bytes));
  } catch (const Error& e) {
    why = e.what();
  } catch (const nlohmann::json::exception& e) {
    why = std::string("bad description: ") + e.what();
  }
  if (fd >= 0) ::close(fd);
  return nullptr;
}

void CudaBackend::bind_weights() {
  for (const cuda::ImageLayout::Entry& e : layout_.entries) views_.emplace(e.w->data, image_->view(*e.w));
  for (const cuda::ImageLayout::Entry& e : extra_layout_.entries) views_.emplace(e.w->data, extra_->view(*e.w));
}

bool CudaBackend::make_expert_tables() {
  static_assert(sizeof(DeviceWeight) == kCudaDeviceWeightBytes, "model/memory_plan.h counts 64 bytes a view");
  tables_.assign(size_t(hp_.n_layers), {});
  std::vector<DeviceWeight> host;
  bool all = true;
  for (int64_t l = 0; l < hp_.n_layers; ++l) {
    const LayerWeights& L = m_.w().layers[size_t(l)];
    if (l < host_layers_) continue;
    bool takes = !L.gate_mats.empty();
    for (const std::vector<Weight>* mats : {&L.gate_mats, &L.up_mats, &L.down_mats})
      for (const Weight& w : *mats) takes = takes && cuda::expert_gemv_takes(w.type, w.cols);
    if (!takes) {
      all = false;
      continue;
    }
    LayerTables& t = tables_[size_t(l)];
    int64_t* at[3] = {&t.gate, &t.up, &t.down};
    int i = 0;
    for (const std::vector<Weight>* mats : {&L.gate_mats, &L.up_mats, &L.down_mats}) {
      *at[i++] = int64_t(host.size());
      for (const Weight& w : *mats) host.push_back(dev(w));
    }
  }
  if (!host.empty()) {
    expert_tables_ = DeviceBuffer(host.size() * sizeof(DeviceWeight), "expert tables");
    DS4_CUDA_CHECK(cudaMemcpy(expert_tables_.as<void>(), host.data(), host.size() * sizeof(DeviceWeight),
                              cudaMemcpyHostToDevice));
  }
  return all;
}

const DeviceWeight& CudaBackend::dev(const Weight& w) const {
  const auto it = views_.find(w.data);
  if (it == views_.end()) throw Error("CUDA backend: a weight of " + std::to_string(w.rows) + " x " +
                                      std::to_string(w.cols) + " is not in the weight image");
  return it->second;
}

// The plan of model/memory_plan.h, except that the weights counted are the
// image on the device (what this worker holds there), not the segment.
MemoryPlan CudaBackend::plan(const EngineShape& s) const {
  MemoryPlan p = plan_memory(hp_, s, summary_, {BackendKind::cuda, 1});
  p.weights = layout_.total;
  p.experts = extra_layout_.total;
  return p;
}

std::optional<DeviceRoom> CudaBackend::device_room() const {
  DS4_CUDA_CHECK(cudaSetDevice(device_));
  size_t free = 0, total = 0;
  DS4_CUDA_CHECK(cudaMemGetInfo(&free, &total));
  return DeviceRoom{free, total};
}

void CudaBackend::reserve(const EngineShape& s) {
  if (s.ctx <= 0 || s.slots <= 0 || s.max_batch <= 0) throw Error("context, slots and batch must be positive");
  DS4_CUDA_CHECK(cudaSetDevice(device_));
  const MemoryPlan p = plan(s);
  size_t free = 0, total = 0;
  DS4_CUDA_CHECK(cudaMemGetInfo(&free, &total));
  if (p.kv + p.scratch > free)
    throw DoesNotFit("CUDA device " + device_name_ + ": the KV cache (" + std::to_string(p.kv >> 20) + " MiB) and scratch (" +
                std::to_string(p.scratch >> 20) + " MiB) do not fit the " + std::to_string(free >> 20) +
                " MiB of device memory free");
  const ScratchLayout l = cuda_scratch_layout(hp_, s);
  for (int T = 1; T <= int(s.max_batch); ++T) {
    int splits = cuda::prefill_splits(T, int(hp_.n_heads), int(hp_.head_dim), s.ctx, n_sm_);
    for (const int64_t positions : {int64_t(1), s.ctx})  // either decode kernel
      splits = std::max(splits, cuda::attention_splits(T, int(hp_.n_heads), int(hp_.n_kv_heads), int(hp_.head_dim),
                                                       s.kv == KvType::q8_0, positions, s.ctx, n_sm_));
    if (cuda::attention_scratch_floats(T, int(hp_.n_heads), int(hp_.head_dim), splits) > l.attn_floats)
      throw Error("CUDA backend: the attention of " + std::to_string(T) + " tokens needs more scratch than the memory "
                  "plan gives (model/memory_plan.cpp must follow worker/cuda/kernels.cu)");
  }
  if (const std::string why = kv_type_unsupported(hp_, s.kv); !why.empty()) throw Error(why);
  for (auto& [key, g] : graphs_) cudaGraphExecDestroy(g);
  graphs_.clear();
  shape_ = s;
  sc_ = l;
  kv_ = DeviceBuffer(kv_cache_bytes(hp_, s), "KV cache");
  scratch_ = DeviceBuffer(size_t(sc_.total) * 4, "activations");
  act_ = DeviceBuffer(cuda_act16_bytes(hp_, s), "16-bit activations");
  deq_ = DeviceBuffer(summary_.largest_q8_elems * 2, "weight dequantisation");
  blas_ws_ = DeviceBuffer(kCudaBlasWorkspace, "cuBLAS workspace");
  tokens_dev_ = DeviceBuffer(size_t(s.max_batch) * sizeof(BatchToken), "batch");
  tokens_host_ = PinnedBuffer(size_t(s.max_batch) * sizeof(BatchToken), "batch");
  logits_host_ = PinnedBuffer(size_t(logit_rows() * hp_.n_vocab) * 4, "logits");
  picks_dev_ = DeviceBuffer(size_t(logit_rows()) * sizeof(cuda::GreedyPick) + cuda::greedy_scratch_bytes(int(logit_rows())),
                            "greedy picks");
  static_assert(sizeof(cuda::TopLogits) == 16 + kCudaTopLogits * 8, "model/memory_plan.cpp counts a row's best logits");
  top_dev_ = DeviceBuffer(size_t(logit_rows()) * (sizeof(double) + sizeof(cuda::TopLogits)) +
                              cuda::top_scratch_bytes(int(logit_rows()), hp_.n_vocab),
                          "best logits");
  top_host_ = PinnedBuffer(size_t(logit_rows()) * sizeof(cuda::TopLogits), "best logits");
  picks_host_ = PinnedBuffer(size_t(logit_rows()) * sizeof(cuda::GreedyPick), "greedy picks");
  static_assert(sizeof(LogitAdjust) == 12, "model/memory_plan.cpp counts 12 bytes an adjustment");
  adjust_dev_ = DeviceBuffer(size_t(logit_rows()) * kCudaAdjustsPerRow * sizeof(LogitAdjust), "logit adjustments");
  adjust_host_ = PinnedBuffer(size_t(logit_rows()) * kCudaAdjustsPerRow * sizeof(LogitAdjust), "logit adjustments");
  fetched_.assign(size_t(logit_rows()), 0);
  if (hp_.moe()) {
    const size_t words = size_t(ExpertRoutes::words(s.max_batch, hp_.n_expert_used, hp_.n_expert) +
                                ExpertRoutes::job_words(s.max_batch, hp_.n_expert_used, hp_.n_expert));
    routes_dev_ = DeviceBuffer(words * 4, "expert routes");
    routes_host_ = PinnedBuffer(words * 4, "expert routes");
    router_host_ = PinnedBuffer(size_t(s.max_batch * ld(Act::router)) * 4, "router scores");

  }
  if (host_layers_ > 0) {
    host_experts_ = host_->experts(s.max_batch);
    host_in_ = PinnedBuffer(size_t(s.max_batch * ld(Act::x)) * 4, "host experts' input");
    host_out_ = PinnedBuffer(size_t(s.max_batch * ld(Act::x)) * 4, "host experts' output");
  }
  // Touch everything now: a worker learns at start whether the memory is there.
  DS4_CUDA_CHECK(cudaMemsetAsync(kv_.as<void>(), 0, kv_.size(), stream_));
  DS4_CUDA_CHECK(cudaMemsetAsync(scratch_.as<void>(), 0, scratch_.size(), stream_));
  DS4_BLAS_CHECK(cuda::blas::set_workspace(blas_, blas_ws_.as<void>(), blas_ws_.size()));
  DS4_CUDA_CHECK(cudaStreamSynchronize(stream_));
  gemm_ = {blas_, act_.as<void>(), act_.size(), deq_.as<__half>(), deq_.size()};
  reserved_ = true;
}

void CudaBackend::trace_rows(std::string_view name, int layer, const float* dev, int64_t rows, int64_t cols,
                             int64_t ld) {
  if (!trace_) return;
  std::vector<float> host(size_t(rows * ld));
  DS4_CUDA_CHECK(cudaMemcpyAsync(host.data(), dev, host.size() * 4, cudaMemcpyDeviceToHost, stream_));
  DS4_CUDA_CHECK(cudaStreamSynchronize(stream_));
  trace_(name, layer, host.data(), rows, cols, ld);
}

// --- ForwardOps ------------------------------------------------------------

void CudaBackend::begin_step(std::span<const BatchToken> batch, int64_t logit_rows) {
  step_tokens_ = int(batch.size());
  step_rows_ = int(logit_rows);
  // The kernels read the batch from device memory (a captured graph replays
  // this copy from the pinned buffer forward() filled).
  DS4_CUDA_CHECK(cudaMemcpyAsync(tokens_dev_.as<void>(), tokens_host_.as<void>(), batch.size_bytes(),
                                 cudaMemcpyHostToDevice, stream_));
}

void CudaBackend::embed(const Weight& table, Act out) {
  cuda::embed(dev(table), batch_dev(), step_tokens_, ptr(out), ld(out), stream_);
}

void CudaBackend::rmsnorm(Act in, const Weight& g, float eps, Act out) {
  cuda::rmsnorm(ptr(in), ld(in), dev_f32(g), g.cols, eps, ptr(out), ld(out), rows(in), stream_);
}

// RMSNorm goes into the products that read it (decode GEMVs fold it in;
// otherwise it writes norm->out first), up to three products a launch; a
// bias is added after its product.
void CudaBackend::products(Act in, const NormSpec* norm, std::span<const ProductSpec> ps) {
  if (ps.size() > 4) throw Error("CUDA backend: more than 4 products share one input");
  cuda::Product cp[4];
  for (size_t i = 0; i < ps.size(); ++i) cp[i] = {&dev(*ps[i].w), ptr(ps[i].out), ld(ps[i].out), ps[i].accumulate};
  const cuda::RmsNorm rn{norm ? dev_f32(*norm->g) : nullptr, norm ? norm->eps : 0.0f, norm ? ptr(norm->out) : nullptr};
  if (norm && ld(norm->out) != ld(in)) throw Error("CUDA backend: a folded norm writes rows of its input's stride");
  cuda::matmul(cp, int(ps.size()), ptr(in), ld(in), rows(in), gemm_, stream_, false, norm ? &rn : nullptr);
  for (const ProductSpec& p : ps)
    if (p.bias) cuda::add_bias(ptr(p.out), ld(p.out), dev_f32(*p.bias), p.w->rows, rows(in), stream_);
}

void CudaBackend::ffn_swiglu(Act in, const NormSpec* norm, const Weight& gate, const Weight& up, Act h, Act h_up) {
  const cuda::RmsNorm rn{norm ? dev_f32(*norm->g) : nullptr, norm ? norm->eps : 0.0f, norm ? ptr(norm->out) : nullptr};
  cuda::matmul_swiglu(dev(gate), dev(up), ptr(in), ld(in), rows(in), ptr(h), ptr(h_up), ld(h), gemm_, stream_, false,
                      norm ? &rn : nullptr);
}

void CudaBackend::swiglu(Act g, Act u) { cuda::swiglu(ptr(g), ptr(u), ld(g), hp_.ff, rows(g), stream_); }

// The router's scores come to the host, which routes the tokens as the CPU
// does (worker/moe_routes.h) and sends the routes back; then each chosen
// expert runs its fused gate/up/SwiGLU and its down product over its own
// rows (the tokens gathered by expert), and one kernel sums each token's
// experts in the order of their weights, with the shared expert.
void CudaBackend::moe_ffn(Act in, const NormSpec* norm, const MoeSpec& m, Act out, bool accumulate) {
  if (norm) {
    rmsnorm(in, *norm->g, norm->eps, norm->out);
    in = norm->out;
  }
  if (m.layer >= 0 && m.layer < host_layers_) return moe_on_host(in, m, out, accumulate);
  const bool tabled = m.layer >= 0 && tables_[size_t(m.layer)].gate >= 0;
  auto all_take = [&](bool (*takes)(GgmlType, int64_t)) {
    return takes(m.gate[0].type, m.gate[0].cols) && takes(m.up[0].type, m.up[0].cols) &&
           takes(m.down[0].type, m.down[0].cols);
  };
  const bool tiles = tabled && moe_prefill_ == MoePrefill::tiles && cuda::qgemm_max_tokens() > 0 &&
                     all_take(cuda::qgemm_takes);
  if (tabled && !host_routes_) {
    if (rows(in) <= cuda::kMaxGemvTokens) return moe_on_device(in, m, out, accumulate);
    if (tiles) return moe_prefill_on_device(in, m, out, accumulate);
  }
  const int T = rows(in);
  const int64_t E = m.n_expert, K = m.n_used, ldr = ld(Act::router), ldm = ld(Act::moe_in), ldh = ld(Act::hb);
  const float* n = ptr(in);
  float* gathered = ptr(Act::moe_in);
  float* expert_out = ptr(Act::moe_out);
  float* hb = ptr(Act::hb);
  float* hb2 = ptr(Act::hb2);
  const cuda::Product router{&dev(*m.router), ptr(Act::router), ldr, false};
  cuda::matmul(&router, 1, n, ld(in), T, gemm_, stream_);
  float* scores = router_host_.as<float>();
  DS4_CUDA_CHECK(cudaMemcpyAsync(scores, ptr(Act::router), size_t(T * ldr) * 4, cudaMemcpyDeviceToHost, stream_));
  DS4_CUDA_CHECK(cudaStreamSynchronize(stream_));
  const ExpertRoutes r = ExpertRoutes::in(routes_host_.as<void>(), T, K, E);
  for (int t = 0; t < T; ++t) route_token(scores + t * ldr, E, K, m.norm_weights, r.pair + t * K, r.weight + t * K);
  group_routes(r, T, K, E);
  // Routed on the host (DS4_CUDA_MOE_HOST_ROUTES, or a way below): block-
  // quantised experts with device tables, every job of every expert in one
  // launch a matrix: tiles of up to 64 of an expert's rows through the tiled
  // GEMM (tensor cores, the weights read once a tile); DS4_CUDA_MOE_PREFILL=
  // groups: groups of up to 8 rows through the decode GEMV's body; =each:
  // each expert's rows through cuBLAS, one expert at a time (dequantised to
  // f16). The last two are the ways before (comparisons).
  const bool tiled = tiles && T > cuda::kMaxGemvTokens;  // decode steps: the GEMV body, as moe_on_device's
  const bool grouped = tiled || (tabled && moe_prefill_ != MoePrefill::each && all_take(cuda::expert_groups_take));
  const int job_rows = tiled ? cuda::kQgemmTokens : 8;
  int jobs = 0, max_rows = 0;
  if (grouped) {
    int32_t* job_host = static_cast<int32_t*>(routes_host_.as<void>()) + ExpertRoutes::words(T, K, E);
    for (int64_t e = 0; e < E; ++e)
      for (int32_t at = r.start[e]; at < r.start[e + 1]; at += job_rows) {
        job_host[3 * jobs] = int32_t(e);
        job_host[3 * jobs + 1] = at;
        job_host[3 * jobs + 2] = std::min<int32_t>(job_rows, r.start[e + 1] - at);
        max_rows = std::max(max_rows, job_host[3 * jobs + 2]);
        ++jobs;
      }
  }
  DS4_CUDA_CHECK(cudaMemcpyAsync(routes_dev_.as<void>(), routes_host_.as<void>(),
                                 size_t(ExpertRoutes::words(T, K, E) + 3 * jobs) * 4, cudaMemcpyHostToDevice, stream_));
  if (trace_)  // the probabilities, where the trace reads them
    DS4_CUDA_CHECK(cudaMemcpyAsync(ptr(Act::router), scores, size_t(T * ldr) * 4, cudaMemcpyHostToDevice, stream_));
  const ExpertRoutes rd = ExpertRoutes::in(routes_dev_.as<void>(), T, K, E);
  cuda::gather_rows(n, ld(in), rd.token_of, int(T * K), hp_.dim, gathered, ldm, stream_);
  if (grouped) {
    const LayerTables& lt = tables_[size_t(m.layer)];
    const int32_t* job_dev = static_cast<const int32_t*>(routes_dev_.as<void>()) + ExpertRoutes::words(T, K, E);
    auto run = [&](int64_t at, const Weight& w, const float* x, int64_t ldx, float* y, int64_t ldy) {
      const cuda::ExpertGroups g{expert_product(at, w, x, ldx, y, ldy), job_dev, jobs};
      if (tiled) cuda::qgemm_experts(g, max_rows, stream_);
      else cuda::expert_groups(g, stream_);
    };
    run(lt.gate, m.gate[0], gathered, ldm, hb, ldh);
    run(lt.up, m.up[0], gathered, ldm, hb2, ldh);
    cuda::swiglu(hb, hb2, ldh, m.expert_ff, int(T * K), stream_);
    run(lt.down, m.down[0], hb, ldh, expert_out, ldm);
  } else {
    for (int64_t e = 0; e < E; ++e) {
      const int c0 = r.start[e], c = r.start[e + 1] - c0;
      if (c == 0) continue;
      cuda::matmul_swiglu(dev(m.gate[size_t(e)]), dev(m.up[size_t(e)]), gathered + c0 * ldm, ldm, c, hb + c0 * ldh,
                          hb2 + c0 * ldh, ldh, gemm_, stream_);
      const cuda::Product down{&dev(m.down[size_t(e)]), expert_out + c0 * ldm, ldm, false};
      cuda::matmul(&down, 1, hb + c0 * ldh, ldh, c, gemm_, stream_);
    }
  }
  // The shared expert's output goes where the gathered rows were (read by
  // now, in stream order).
  combine_experts(m, {expert_out, ldm, rd.pair, rd.weight_of, int(K)}, in, gathered, out, accumulate);
}

void CudaBackend::combine_experts(const MoeSpec& m, cuda::MoeCombine c, Act in, float* shared_y, Act out,
                                  bool accumulate) {
  const int T = rows(in);
  if (m.shared_gate_inp) {  // qwen2moe's shared expert over every token, under its sigmoid gate
    const int64_t ldh = ld(Act::hb);
    float* hb = ptr(Act::hb);
    cuda::matmul_swiglu(dev(*m.shared_gate), dev(*m.shared_up), ptr(in), ld(in), T, hb, ptr(Act::hb2), ldh, gemm_,
                        stream_);
    const cuda::Product down{&dev(*m.shared_down), shared_y, ld(Act::moe_in), false};
    cuda::matmul(&down, 1, hb, ldh, T, gemm_, stream_);
    c.shared_y = shared_y;
    c.shared_gate = dev_f32(*m.shared_gate_inp);
    c.n = ptr(in);
    c.ldn = ld(in);
  }
  cuda::moe_combine(c, ptr(out), ld(out), accumulate, hp_.dim, T, stream_);
}

// A decode step's experts without the host: the router's scores become the
// routes on the device, then each of the T x K (token, expert) pairs is its
// own row: gate and up of every pair in one launch each, SwiGLU, down in one
// launch, and moe_combine sums each token's K rows in order of weight.
void CudaBackend::moe_on_device(Act in, const MoeSpec& m, Act out, bool accumulate) {
  const int T = rows(in);
  const int64_t E = m.n_expert, K = m.n_used, P = T * K, ldr = ld(Act::router), ldm = ld(Act::moe_in),
                ldh = ld(Act::hb);
  const float* n = ptr(in);
  const cuda::Product router{&dev(*m.router), ptr(Act::router), ldr, false};
  cuda::matmul(&router, 1, n, ld(in), T, gemm_, stream_);
  const int64_t B = shape_.max_batch * K;  // the routes' arrays, each of the largest step's size
  int32_t* expert = routes_dev_.as<int32_t>();
  float* weight = reinterpret_cast<float*>(expert + B);
  int32_t* pair = expert + 2 * B;
  cuda::moe_topk(ptr(Act::router), ldr, T, int(E), int(K), m.norm_weights, expert, weight, pair, stream_);
  const LayerTables& lt = tables_[size_t(m.layer)];
  float* hb = ptr(Act::hb);
  float* hb2 = ptr(Act::hb2);
  float* expert_out = ptr(Act::moe_out);
  auto run = [&](int64_t at, const Weight& w, int x_div, const float* x, int64_t ldx, float* y, int64_t ldy) {
    cuda::expert_gemv({expert_product(at, w, x, ldx, y, ldy), expert, int(P), x_div}, stream_);
  };
  if (moe_fuse_) {
    // Gate and up in one launch, SwiGLU taken by down as it quantises its input.
    cuda::ExpertGemv gate_up{expert_product(lt.gate, m.gate[0], n, ld(in), hb, ldh), expert, int(P), int(K)};
    gate_up.second = expert_tables_.as<DeviceWeight>() + lt.up;
    gate_up.y2 = hb2;
    cuda::expert_gemv(gate_up, stream_);
    cuda::ExpertGemv down{expert_product(lt.down, m.down[0], hb, ldh, expert_out, ldm), expert, int(P), 1};
    down.x_up = hb2;
    cuda::expert_gemv(down, stream_);
  } else {
    run(lt.gate, m.gate[0], int(K), n, ld(in), hb, ldh);
    run(lt.up, m.up[0], int(K), n, ld(in), hb2, ldh);
    cuda::swiglu(hb, hb2, ldh, m.expert_ff, int(P), stream_);
    run(lt.down, m.down[0], 1, hb, ldh, expert_out, ldm);
  }
  combine_experts(m, {expert_out, ldm, pair, weight, int(K)}, in, ptr(Act::moe_in) /* free in this path */, out,
                  accumulate);
}

// A prefill chunk routed on the device: the router's scores become each
// token's top k there (moe_topk), the (token, expert) pairs are grouped by
// expert and cut into jobs of up to 64 rows (moe_group), the rows gathered,
// and each stack's jobs run through the tiled GEMM in one launch (blocks past
// the jobs' number, which only the device knows, return at once).
void CudaBackend::moe_prefill_on_device(Act in, const MoeSpec& m, Act out, bool accumulate) {
  const int T = rows(in);
  const int64_t E = m.n_expert, K = m.n_used, P = T * K, ldr = ld(Act::router), ldm = ld(Act::moe_in),
                ldh = ld(Act::hb);
  const float* n = ptr(in);
  const cuda::Product router{&dev(*m.router), ptr(Act::router), ldr, false};
  cuda::matmul(&router, 1, n, ld(in), T, gemm_, stream_);
  const ExpertRoutes rd = ExpertRoutes::in(routes_dev_.as<void>(), T, K, E);
  int32_t* jobs = static_cast<int32_t*>(routes_dev_.as<void>()) + ExpertRoutes::words(T, K, E);
  // The jobs' number goes in the last word of their space, which jobs of 64
  // rows never reach (the space is counted for jobs of 8).
  const int64_t job_words = ExpertRoutes::job_words(T, K, E), max_jobs = cuda::ceil_div(P, cuda::kQgemmTokens) + E;
  if (3 * max_jobs >= job_words) throw Error("CUDA MoE prefill: no room for the jobs of " + std::to_string(T) + " tokens");
  int32_t* n_jobs = jobs + job_words - 1;
  cuda::moe_topk(ptr(Act::router), ldr, T, int(E), int(K), m.norm_weights, rd.pair, rd.weight, rd.token_of, stream_);
  cuda::moe_group(rd.pair, rd.weight, int(P), int(K), int(E), cuda::kQgemmTokens, rd.start, rd.token_of, rd.weight_of,
                  jobs, n_jobs, stream_);
  float* gathered = ptr(Act::moe_in);
  cuda::gather_rows(n, ld(in), rd.token_of, int(P), hp_.dim, gathered, ldm, stream_);
  const LayerTables& lt = tables_[size_t(m.layer)];
  float* hb = ptr(Act::hb);
  float* hb2 = ptr(Act::hb2);
  float* expert_out = ptr(Act::moe_out);
  auto run = [&](int64_t at, const Weight& w, const float* x, int64_t ldx, float* y, int64_t ldy) {
    const cuda::ExpertGroups g{expert_product(at, w, x, ldx, y, ldy), jobs, int(max_jobs), n_jobs};
    cuda::qgemm_experts(g, std::min(T, cuda::kQgemmTokens), stream_);  // an expert has at most T rows
  };
  run(lt.gate, m.gate[0], gathered, ldm, hb, ldh);
  run(lt.up, m.up[0], gathered, ldm, hb2, ldh);
  cuda::swiglu(hb, hb2, ldh, m.expert_ff, int(P), stream_);
  run(lt.down, m.down[0], hb, ldh, expert_out, ldm);
  combine_experts(m, {expert_out, ldm, rd.pair, rd.weight_of, int(K)}, in, gathered, out, accumulate);
}

// The expert rung: the normalised rows go to the host, the CPU backend's
// mixture of experts runs there on the weights in shared memory, and its
// result comes back (added into the residual, or written to `out`).
void CudaBackend::moe_on_host(Act in, const MoeSpec& m, Act out, bool accumulate) {
  const int T = rows(in);
  const int64_t ldx = ld(Act::x);
  if (ld(in) != ldx || ld(out) != ldx || ld(Act::moe_out) != ldx)
    throw Error("CUDA backend: host experts take rows of the residual's stride");
  float* hin = host_in_.as<float>();
  float* hout = host_out_.as<float>();
  DS4_CUDA_CHECK(cudaMemcpyAsync(hin, ptr(in), size_t(T * ldx) * 4, cudaMemcpyDeviceToHost, stream_));
  DS4_CUDA_CHECK(cudaStreamSynchronize(stream_));
  float* router = trace_ ? router_host_.as<float>() : nullptr;
  host_experts_->run(m, hin, ldx, T, hout, ldx, router, ld(Act::router));
  if (router)
    DS4_CUDA_CHECK(cudaMemcpyAsync(ptr(Act::router), router, size_t(T * ld(Act::router)) * 4, cudaMemcpyHostToDevice,
                                   stream_));
  if (accumulate) {
    DS4_CUDA_CHECK(cudaMemcpyAsync(ptr(Act::moe_out), hout, size_t(T * ldx) * 4, cudaMemcpyHostToDevice, stream_));
    cuda::add(ptr(out), ptr(Act::moe_out), ldx, hp_.dim, T, stream_);
  } else {
    DS4_CUDA_CHECK(cudaMemcpyAsync(ptr(out), hout, size_t(T * ldx) * 4, cudaMemcpyHostToDevice, stream_));
  }
  // The pinned rows are rewritten by the next layer's call: wait for the copy.
  DS4_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void CudaBackend::head_norm(Act qk, int64_t heads, const Weight& g, float eps) {
  cuda::head_norm(ptr(qk), ld(qk), int(heads), g.cols, dev_f32(g), eps, rows(qk), stream_);
}

cuda::RopeArgs CudaBackend::rope_args(const RopeSpec& r, int64_t q_heads, int64_t kv_heads) const {
  cuda::RopeArgs a;
  a.n_heads = int(q_heads);
  a.n_kv_heads = int(kv_heads);
  a.head_dim = int(r.head_dim);
  a.n_rot = int(r.n_rot);
  a.theta_scale = std::pow(r.base, -2.0f / float(r.n_rot));  // as the CPU computes it
  a.freq_scale = r.freq_scale;
  a.neox = r.type == RopeType::neox;
  a.freq_factors = r.freq_factors ? dev_f32(*r.freq_factors) : nullptr;
  a.ctx = shape_.ctx;
  return a;
}

void CudaBackend::rope(Act qk, int64_t heads, const RopeSpec& r) {
  cuda::rope_store(ptr(qk), ld(qk), nullptr, nullptr, 0, batch_dev(), rows(qk), rope_args(r, heads, 0), nullptr, nullptr,
                   stream_);
}

void CudaBackend::kv_store(int layer, Act k, Act v) {
  if (shape_.kv == KvType::q8_0)
    return cuda::store_kv_q8(ptr(k), ptr(v), ld(k), batch_dev(), rows(k), int(hp_.kv_dim()), shape_.ctx,
                             k_cache(layer), v_cache(layer), stream_);
  cuda::RopeArgs a;
  a.n_kv_heads = int(hp_.n_kv_heads);
  a.head_dim = int(hp_.head_dim);
  a.ctx = shape_.ctx;  // n_rot 0: nothing rotated, k and v stored
  cuda::rope_store(nullptr, 0, ptr(k), ptr(v), ld(k), batch_dev(), rows(k), a, half_cache(k_cache(layer)),
                   half_cache(v_cache(layer)), stream_);
}

void CudaBackend::rope_kv_store(int layer, Act q, int64_t q_heads, Act k, int64_t kv_heads, Act v, const RopeSpec& r) {
  if (ld(k) != ld(v)) throw Error("CUDA backend: k and v rows of different strides");
  if (shape_.kv == KvType::q8_0) {  // rotate q and k in place, then store k and v as blocks
    cuda::rope_store(ptr(q), ld(q), ptr(k), nullptr, ld(k), batch_dev(), rows(q), rope_args(r, q_heads, kv_heads),
                     nullptr, nullptr, stream_);
    return kv_store(layer, k, v);
  }
  cuda::rope_store(ptr(q), ld(q), ptr(k), ptr(v), ld(k), batch_dev(), rows(q), rope_args(r, q_heads, kv_heads),
                   half_cache(k_cache(layer)), half_cache(v_cache(layer)), stream_);
}

// A batch of more than 8 tokens mixes prompts (runs of one slot's tokens)
// with other slots' decode tokens. The prefill kernel takes 64 tokens a block
// and walks each slot among them in turn, so it is kept for runs of at least
// kPrefillRun tokens of one slot; the tokens between them (each its slot's
// own, or short runs) take the decode kernel, every token its own blocks, as
// a step of them alone would. Decode steps (8 tokens or fewer) are one launch.
void CudaBackend::attention(int layer, Act q, Act out, const AttentionSpec& a) {
  constexpr int kPrefillRun = 16;
  const int T = rows(q);
  const BatchToken* b = tokens_host_.as<BatchToken>();  // this step's tokens (a prefill's are not a graph's)
  auto launch = [&](int t0, int n, bool decode) {
    cuda::AttentionArgs aa{int(a.n_heads), int(a.n_kv_heads), int(a.head_dim), shape_.ctx, a.scale};
    aa.positions = cuda::deepest_positions(b + t0, n);
    aa.splits = attention_splits(n, aa.positions);
    cuda::attention(ptr(q) + t0 * ld(q), ld(q), k_cache(layer), v_cache(layer), batch_dev() + t0, n, aa, f(sc_.attn),
                    ptr(out) + t0 * ld(out), ld(out), stream_, decode);
  };
  if (T <= cuda::kMaxGemvTokens || mixed_attention_ == 0) return launch(0, T, false);
  auto run_end = [&](int t) {
    int e = t + 1;
    while (e < T && b[e].slot == b[t].slot) ++e;
    return e;
  };
  for (int t = 0; t < T;) {
    const int e = run_end(t);
    if (e - t >= kPrefillRun) {
      launch(t, e - t, false);
      t = e;
      continue;
    }
    int end = e;  // short runs up to the next long one
    while (end < T && run_end(end) - end < kPrefillRun) end = run_end(end);
    launch(t, end - t, true);
    t = end;
  }
}

void CudaBackend::add(Act x, Act o) { cuda::add(ptr(x), ptr(o), ld(x), hp_.dim, rows(x), stream_); }

void CudaBackend::gather_logit_rows(Act x, Act xl) {
  cuda::gather_logit_rows(ptr(x), ld(x), batch_dev(), step_tokens_, ptr(xl), stream_);
}

// A step launched kernel by kernel (prefill, or more tokens than a graph
// takes) keeps this thread busy for most of its time: the requests that come
// meanwhile are read here, as the CPU backend reads them between its layers,
// so that their timings start when they arrive.
void CudaBackend::step_point(StepPoint p, int) {
  if (p == StepPoint::attention_done ? step_reads_now_ >= 2 : step_reads_now_ >= 1) during_step();
}

void CudaBackend::enqueue(int T, int rows, int reads, bool pick_too) {
  step_reads_now_ = reads;
  run_forward(m_, *this, {tokens_host_.as<BatchToken>(), size_t(T)});
  if (pick_too) pick(rows);
}

void CudaBackend::pick(int rows) {
  if (rows == 0) return;
  cuda::GreedyPick* picks = picks_dev_.as<cuda::GreedyPick>();
  cuda::greedy_pick(ptr(Act::logits), hp_.n_vocab, hp_.n_vocab, rows, picks, picks + logit_rows(), stream_,
                    top_dev_.as<double>());
  DS4_CUDA_CHECK(cudaMemcpyAsync(picks_host_.as<void>(), picks, size_t(rows) * sizeof(cuda::GreedyPick),
                                 cudaMemcpyDeviceToHost, stream_));
}

void CudaBackend::add_adjustments(std::span<const LogitAdjust> adjust) {
  const size_t room = adjust_host_.size() / sizeof(LogitAdjust);
  for (size_t from = 0; from < adjust.size(); from += room) {
    if (from > 0) DS4_CUDA_CHECK(cudaStreamSynchronize(stream_));  // the last upload has left adjust_host_
    const size_t n = std::min(room, adjust.size() - from);
    std::memcpy(adjust_host_.as<void>(), adjust.data() + from, n * sizeof(LogitAdjust));
    DS4_CUDA_CHECK(cudaMemcpyAsync(adjust_dev_.as<void>(), adjust_host_.as<void>(), n * sizeof(LogitAdjust),
                                   cudaMemcpyHostToDevice, stream_));
    cuda::add_to_logits(ptr(Act::logits), hp_.n_vocab, adjust_dev_.as<LogitAdjust>(), int(n), stream_);
  }
}

std::span<const float> CudaBackend::logits(int32_t row) const {
  if (row < 0 || row >= rows_) throw Error("CUDA backend: no logits for row " + std::to_string(row));
  float* host = logits_host_.as<float>() + int64_t(row) * hp_.n_vocab;
  if (!fetched_[size_t(row)]) {
    DS4_CUDA_CHECK(cudaMemcpyAsync(host, ptr(Act::logits) + int64_t(row) * hp_.n_vocab, size_t(hp_.n_vocab) * 4,
                                   cudaMemcpyDeviceToHost, stream_));
    DS4_CUDA_CHECK(cudaStreamSynchronize(stream_));
    fetched_[size_t(row)] = 1;
  }
  return {host, size_t(hp_.n_vocab)};
}

// Runs of consecutive rows go in one copy each; one wait for all of them.
void CudaBackend::fetch_logits(std::span<const int32_t> rows) const {
  std::vector<int32_t> want;
  for (int32_t r : rows) {
    if (r < 0 || r >= rows_) throw Error("CUDA backend: no logits for row " + std::to_string(r));
    if (!fetched_[size_t(r)]) want.push_back(r);
  }
  if (want.empty()) return;
  std::sort(want.begin(), want.end());
  want.erase(std::unique(want.begin(), want.end()), want.end());
  const size_t n = size_t(hp_.n_vocab);
  for (size_t i = 0; i < want.size();) {
    size_t j = i + 1;
    while (j < want.size() && want[j] == want[j - 1] + 1) ++j;
    DS4_CUDA_CHECK(cudaMemcpyAsync(logits_host_.as<float>() + size_t(want[i]) * n, ptr(Act::logits) + size_t(want[i]) * n,
                                   (j - i) * n * 4, cudaMemcpyDeviceToHost, stream_));
    i = j;
  }
  DS4_CUDA_CHECK(cudaStreamSynchronize(stream_));
  for (int32_t r : want) fetched_[size_t(r)] = 1;
}

void CudaBackend::host_parallel(int n, const std::function<void(int)>& fn) {
  if (n <= 1 || !host_) return Backend::host_parallel(n, fn);
  host_->parallel(n, fn);
}

// The first call of a step finds every row's best on the device (a block
// sorts each 2048 logits, then a row's blocks are merged) and brings them
// back in one copy: ~33 KiB for 64 rows instead of 512 KiB a 128K-token row.
std::optional<RowBest> CudaBackend::best_logits(int32_t row) const {
  if (row < 0 || row >= rows_) throw Error("CUDA backend: no logits for row " + std::to_string(row));
  auto* top = reinterpret_cast<cuda::TopLogits*>(top_dev_.as<double>() + logit_rows());
  if (!top_ready_) {
    cuda::top_logits(ptr(Act::logits), hp_.n_vocab, hp_.n_vocab, rows_, top_dev_.as<double>(), top,
                     top + logit_rows(), stream_);
    DS4_CUDA_CHECK(cudaMemcpyAsync(top_host_.as<void>(), top, size_t(rows_) * sizeof(cuda::TopLogits),
                                   cudaMemcpyDeviceToHost, stream_));
    DS4_CUDA_CHECK(cudaStreamSynchronize(stream_));
    top_ready_ = true;
  }
  const cuda::TopLogits& t = top_host_.as<cuda::TopLogits>()[row];
  return RowBest{{t.best, size_t(t.count)}, t.lse};
}

std::optional<TokenLogprob> CudaBackend::greedy(int32_t row) const {
  if (row < 0 || row >= rows_) throw Error("CUDA backend: no logits for row " + std::to_string(row));
  const cuda::GreedyPick p = picks_host_.as<cuda::GreedyPick>()[row];
  return TokenLogprob{p.token, p.logprob};
}

bool CudaBackend::launch_graph(int T, int rows) {
  // The attention kernel a step takes depends on its tokens' depth (the host
  // chooses it): a graph is captured for each.
  const int64_t positions = cuda::deepest_positions(tokens_host_.as<BatchToken>(), T);
  const std::tuple<int, int, bool> key{T, rows,
                                       cuda::decode_mma_takes(int(hp_.n_heads), int(hp_.n_kv_heads), int(hp_.head_dim),
                                                              shape_.kv == KvType::q8_0, positions)};
  auto it = graphs_.find(key);
  if (it == graphs_.end()) {
    if (graphs_.size() >= kMaxGraphs || graphs_full_) return false;  // a new shape: launched
    it = graphs_.emplace(key, nullptr).first;
  }
  cudaGraphExec_t& exec = it->second;
  if (!exec) {
    cudaGraph_t graph = nullptr;
    DS4_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
    try {
      enqueue(T, rows, 0);
    } catch (...) {
      cudaStreamEndCapture(stream_, &graph);
      if (graph) cudaGraphDestroy(graph);
      graphs_.erase(key);
      throw;
    }
    DS4_CUDA_CHECK(cudaStreamEndCapture(stream_, &graph));
    const cudaError_t e = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    if (e != cudaSuccess) {
      graphs_.erase(key);
      if (e != cudaErrorMemoryAllocation) DS4_CUDA_CHECK(e);
      cudaGetLastError();  // not sticky: the device is fine, only full
      no_room_for_graphs(T, rows);
      return false;
    }
  }
  const cudaError_t e = cudaGraphLaunch(exec, stream_);
  if (e == cudaErrorMemoryAllocation) {  // its first launch uploads it
    cudaGetLastError();
    cudaGraphExecDestroy(exec);
    graphs_.erase(key);
    no_room_for_graphs(T, rows);
    return false;
  }
  DS4_CUDA_CHECK(e);
  return true;
}

void CudaBackend::no_room_for_graphs(int T, int rows) {
  graphs_full_ = true;
  log::warn("cuda:" + std::to_string(device_) + ": no device memory left for another CUDA graph (a step of " +
                std::to_string(T) + " tokens, " + std::to_string(rows) + " logit rows): steps not captured yet " +
                "launch kernel by kernel from now on",
            {{"DS4_GRAPHS", std::to_string(graphs_.size())}});
}

void CudaBackend::forward(std::span<const BatchToken> batch, std::span<const LogitAdjust> adjust) {
  const int T = int(batch.size());
  if (T == 0) return;
  if (!reserved_) throw Error("CUDA backend: forward() before reserve()");
  if (T > shape_.max_batch) throw Error("batch of " + std::to_string(T) + " tokens exceeds max_batch");
  int rows = 0;
  for (const BatchToken& b : batch) {
    if (b.token < 0 || b.token >= hp_.n_vocab) throw Error("token id " + std::to_string(b.token) + " out of range");
    if (b.slot < 0 || b.slot >= shape_.slots || b.pos < 0 || b.pos >= shape_.ctx)
      throw Error("slot or position out of range");
    if (b.logit_row >= logit_rows()) throw Error("logit row out of range");
    rows = std::max(rows, b.logit_row + 1);
  }
  check_adjustments(adjust, rows, hp_.n_vocab);
  std::memcpy(tokens_host_.as<void>(), batch.data(), batch.size_bytes());
  rows_ = 0;  // until the step is done
  std::fill(fetched_.begin(), fetched_.end(), uint8_t(0));
  top_ready_ = false;
  // A step's graph picks from the logits as the forward pass left them; the
  // rows a request adjusts are picked again after the adjustments.
  if (!use_graphs_ || trace_ || T > graph_tokens_ || !launch_graph(T, rows))
    enqueue(T, rows, step_reads_, adjust.empty());
  if (!adjust.empty()) {
    add_adjustments(adjust);
    pick(rows);
  }
  // The pinned batch is rewritten by the next step and the picks are read
  // after this returns: wait for the step.
  for (;;) {
    const cudaError_t e = cudaStreamQuery(stream_);
    if (e == cudaSuccess) break;
    if (e != cudaErrorNotReady) DS4_CUDA_CHECK(e);
    if (!during_step()) {
      DS4_CUDA_CHECK(cudaStreamSynchronize(stream_));
      break;
    }
  }
  rows_ = rows;
}

}  // namespace

std::string cuda_unsupported(const HParams& hp) {
  const int64_t hd = hp.head_dim;
  if (hd != 8 && hd != 16 && hd != 32 && hd != 64 && hd != 128 && hd != 256)
    return "a head size of " + std::to_string(hd) + " (its attention takes 8, 16, 32, 64, 128 or 256)";
  if (hp.n_rot % 2 != 0 || hp.n_rot > hd)
    return "RoPE over " + std::to_string(hp.n_rot) + " values of a head of " + std::to_string(hd);
  if (hp.n_kv_heads <= 0 || hp.n_heads % hp.n_kv_heads != 0)
    return std::to_string(hp.n_heads) + " heads over " + std::to_string(hp.n_kv_heads) + " KV heads";
  return "";
}

bool cuda_available(std::string* why) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();
    if (why) {
      int driver = 0, runtime = 0;
      cudaDriverGetVersion(&driver);
      cudaRuntimeGetVersion(&runtime);
      *why = std::string("no usable CUDA device: ") + cudaGetErrorString(e);
      if (e == cudaErrorInsufficientDriver && driver == 0)
        *why = "no NVIDIA driver is loaded (no CUDA device to use)";
      else if (e == cudaErrorInsufficientDriver)
        *why += " (driver supports CUDA " + std::to_string(driver / 1000) + "." + std::to_string(driver % 1000 / 10) +
                ", ds4 was built with " + std::to_string(runtime / 1000) + "." + std::to_string(runtime % 1000 / 10) +
                ")";
    }
    return false;
  }
  if (n == 0) {
    if (why) *why = "no CUDA device found";
    return false;
  }
  return true;
}

bool cuda_integrated(int device_index) {
  int integrated = 0;
  DS4_CUDA_CHECK(cudaDeviceGetAttribute(&integrated, cudaDevAttrIntegrated, device_index));
  return integrated != 0;
}

CudaMemory cuda_memory(int device_index) {
  DS4_CUDA_CHECK(cudaSetDevice(device_index));
  size_t free = 0, total = 0;
  DS4_CUDA_CHECK(cudaMemGetInfo(&free, &total));
  return {free, total};
}

std::unique_ptr<Backend> make_cuda_backend(const Model& model, int device_index, const CudaWeightsOptions& weights) {
  std::string why;
  if (!cuda_available(&why)) throw Error("device cuda:" + std::to_string(device_index) + ": " + why);
  int n = 0;
  DS4_CUDA_CHECK(cudaGetDeviceCount(&n));
  if (device_index < 0 || device_index >= n)
    throw Error("device cuda:" + std::to_string(device_index) + ": there are " + std::to_string(n) +
                " CUDA devices (cuda:0 to cuda:" + std::to_string(n - 1) + ")");
  return std::make_unique<CudaBackend>(model, device_index, weights);
}

}  // namespace ds4
