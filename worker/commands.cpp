#include "worker/commands.h"

#include <pthread.h>
#include <signal.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <random>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "shared/config.h"
#include "shared/error.h"
#include "shared/ggml_types.h"
#include "shared/log.h"
#include "shared/model_store.h"
#include "shared/segment_socket.h"
#include "shared/worker_launch.h"
#include "worker/cli.h"
#include "worker/engine.h"
#include "worker/exec_engine.h"
#include "worker/host_compute.h"
#include "worker/perplexity.h"
#include "shared/exec_command.h"
#include "worker/room_check.h"
#include "worker/runtime.h"
#include "worker/server.h"
#include "text/utf8.h"
#ifdef DS4_HAVE_CUDA
#include "worker/cuda/cuda_backend.h"
#endif

namespace ds4 {
namespace {

// Where a memfd segment ("memfd:<name>") is asked for: --segment-socket,
// else the supervisor's socket that it names in a worker's environment, else
// the default one.
std::string segment_socket(const Args& a) {
  return a.str("segment-socket", worker_launch_env("segment-socket").value_or(store::default_segment_socket()));
}

using Clock = std::chrono::steady_clock;

/// "0,4,8" -> {"0", "4", "8"}; "" -> {}.
std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  if (s.empty()) return out;
  size_t at = 0;
  for (;;) {
    const size_t comma = s.find(',', at);
    out.push_back(s.substr(at, comma == std::string::npos ? std::string::npos : comma - at));
    if (comma == std::string::npos) return out;
    at = comma + 1;
  }
}

/// The N of `cuda` (0) or `cuda:N`; -1 for anything that does not start with "cuda".
int cuda_index(const std::string& device) {
  if (device == "cuda") return 0;
  if (device.rfind("cuda", 0) != 0) return -1;
  const std::string n = device.rfind("cuda:", 0) == 0 ? device.substr(5) : "";
  if (n.empty() || n.size() > 4 || n.find_first_not_of("0123456789") != std::string::npos)
    throw Error("device '" + device + "': expected cuda:N with N a device number");
  return std::stoi(n);
}

/// A KV cache type by name (--kv-cache f16|q8_0).
KvType kv_cache_named(const std::string& name) {
  const auto t = kv_type_from(name);
  if (!t) throw Error("--kv-cache: '" + name + "' is not a KV cache type (expected f16 or q8_0)");
  return *t;
}

KvType kv_cache_arg(const Args& a) { return kv_cache_named(a.str("kv-cache", "f16")); }

/// How a GPU backend takes its weights (the CPU backend ignores it).
struct GpuWeightsChoice {
  std::string source = "auto";  // --gpu-weights: auto | holder | copy | host-mapped
  std::string holder_socket;    // --holder-socket
  int host_experts = 0;         // --host-experts: the expert rung
  int holder_experts = -1;      // --holder-experts: those the holder's image lacks
};

GpuWeightsChoice gpu_weights_of(const WorkerLaunch& l) {
  return {l.gpu_weights, l.holder_socket, int(l.host_experts), int(l.holder_experts)};
}

/// For `run` and `bench`: the command line, else the launch variables of the
/// environment (shared/worker_launch.h), else the defaults.
GpuWeightsChoice gpu_weights_of(const Args& a) {
  std::vector<std::string> args;
  for (const char* name : {"gpu-weights", "holder-socket", "host-experts", "holder-experts"})
    if (a.has(name) && !(std::string(name) == "host-experts" && a.str(name).find(',') != std::string::npos))
      args.insert(args.end(), {std::string("--") + name, a.str(name)});
  return gpu_weights_of(parse_worker_launch(args));
}

/// Backend for `--device`: cpu, cuda[:N], or auto (the first GPU when this
/// build has the CUDA backend and a device answers, else the CPU). A GPU
/// backend takes its weights as `gpu` says. `host_experts` >= 0 overrides
/// gpu.host_experts (bench's list of rungs).
std::unique_ptr<Backend> make_backend(const std::string& device, const LoadedModel& lm, int threads,
                                      const GpuWeightsChoice& gpu, int host_experts = -1) {
  const Model& model = lm.model;
  if (device == "cpu") return make_cpu_backend(model, threads);
#ifdef DS4_HAVE_CUDA
  if (const std::string why = cuda_unsupported(model.hp()); !why.empty()) {
    if (device == "auto") {
      log::warn("the CUDA backend does not run " + why + " yet; running on the CPU");
      return make_cpu_backend(model, threads);
    }
    if (cuda_index(device) >= 0)
      throw Error("device '" + device + "': the CUDA backend does not run " + why + " yet (use cpu or auto)");
  }
  CudaWeightsOptions weights;
  weights.mode = parse_cuda_weight_source(gpu.source);
  weights.holder_socket = gpu.holder_socket;
  weights.model_key = holder_model_key(lm.segment);
  weights.host_expert_layers = host_experts >= 0 ? host_experts : gpu.host_experts;
  weights.holder_expert_layers = gpu.holder_experts;
  weights.host = make_host_compute(model, threads);
  if (weights.host_expert_layers > 0 && !model.hp().moe())
    throw Error("--host-experts: " + model.hp().name + " is not a mixture of experts");
  if (device == "auto") {
    std::string why;
    if (cuda_available(&why)) return make_cuda_backend(model, 0, weights);
    log::info("no CUDA device (" + why + "); running on the CPU");
    return make_cpu_backend(model, threads);
  }
  if (const int n = cuda_index(device); n >= 0) return make_cuda_backend(model, n, weights);
#else
  (void)gpu;  // --gpu-weights, --holder-socket and --host-experts concern the CUDA backend only
  (void)host_experts;
  if (device == "auto") return make_cpu_backend(model, threads);
  if (cuda_index(device) >= 0)
    throw Error("device '" + device + "': this ds4-worker was built without the CUDA backend");
#endif
  throw Error("unknown device '" + device + "' (expected auto, cpu or cuda:N)");
}

/// Collects a one-shot generation.
class CollectSink : public RequestSink {
 public:
  explicit CollectSink(const Tokenizer& tok, bool echo) : tok_(tok), echo_(echo) {}
  void on_token(int64_t, const Sampled& s) override {
    tokens.push_back(s.token);
    if (echo_) {
      pending_ += tok_.piece(s.token);
      const size_t n = utf8_complete_prefix(pending_);
      std::fwrite(pending_.data(), 1, n, stdout);
      std::fflush(stdout);
      pending_.erase(0, n);
    }
  }
  void on_done(Finish r, const Timings& t, const std::string& e) override {
    reason = r;
    timings = t;
    error = e;
    if (echo_ && !pending_.empty()) std::fwrite(pending_.data(), 1, pending_.size(), stdout);
  }
  std::vector<int32_t> tokens;
  Finish reason = Finish::error;
  Timings timings;
  std::string error;

 private:
  const Tokenizer& tok_;
  bool echo_;
  std::string pending_;
};

}  // namespace

int cmd_run(const std::vector<std::string>& argv) {
  Args a(argv, {"model", "prompt", "n-predict", "temp", "seed", "top-k", "top-p", "min-p", "context", "threads", "device",
                "gpu-weights", "holder-socket", "host-experts", "holder-experts", "kv-cache"},
         {"json", "ignore-eos", "no-bos", "router-gaps"},
         {{"-m", "model"}, {"-p", "prompt"}, {"-n", "n-predict"}, {"-s", "seed"}, {"-t", "threads"}, {"--ctx", "context"}});
  auto lm = open_model(a.required("model"));
  const HParams& hp = lm->model.hp();
  const Tokenizer& tok = lm->tokenizer;
  GenerateRequest req;
  req.prompt = tok.encode(a.required("prompt"), tok.add_bos() && !a.has("no-bos"));
  req.max_tokens = int32_t(a.integer("n-predict", 64, 0, 1 << 20));
  req.sampling.temperature = float(a.real("temp", 0.8, 0, 100));
  req.sampling.seed = uint64_t(a.integer("seed", 0, 0, INT64_MAX));
  req.sampling.top_k = int32_t(a.integer("top-k", 40, 0, 1 << 30));
  req.sampling.top_p = float(a.real("top-p", 0.95, 0, 1));
  req.sampling.min_p = float(a.real("min-p", 0.05, 0, 1));
  req.ignore_eos = a.has("ignore-eos");

  EngineShape shape;
  const int64_t need = int64_t(req.prompt.size()) + req.max_tokens + 1;
  shape.ctx = a.integer("context", std::max<int64_t>(need, std::min<int64_t>(hp.train_ctx, 4096)), kMinContext, kMaxContext);
  if (int64_t(req.prompt.size()) >= shape.ctx)  // said before the prompt is echoed
    throw Error("the prompt has " + std::to_string(req.prompt.size()) + " tokens, and a context of " +
                std::to_string(shape.ctx) + " (--context) holds at most " + std::to_string(shape.ctx - 1) +
                " with room for one more");
  shape.slots = 1;
  shape.max_batch = 512;
  shape.kv = kv_cache_arg(a);
  auto backend = make_backend(a.str("device", "auto"), *lm, int(a.integer("threads", 0, 0, 1024)), gpu_weights_of(a));
  const MemoryPlan plan = backend->plan(shape);
  check_backend_plan_fits(*backend, plan, shape);
  backend->reserve(shape);

  const bool json = a.has("json");
  // --router-gaps (a mixture of experts, with --json): for each position the
  // engine ran, the smallest margin over the layers, in nats, between the
  // last expert a token chose and the best one it did not. Two engines that
  // round differently may choose other experts where it is small: the
  // comparisons against llama.cpp (tests/integration/arch_compare.py) say so.
  std::vector<double> router_gaps;
  if (a.has("router-gaps")) {
    if (!hp.moe() || !json) throw Error("--router-gaps goes with --json, on a mixture of experts");
    int64_t first = 0;
    backend->set_trace([&](std::string_view name, int layer, const float* d, int64_t rows, int64_t cols, int64_t ld) {
      if (name != "router") return;
      if (layer == 0) {
        first = int64_t(router_gaps.size());
        router_gaps.resize(size_t(first + rows), INFINITY);
      }
      std::vector<float> p(static_cast<size_t>(cols));
      for (int64_t r = 0; r < rows; ++r) {
        std::copy_n(d + r * ld, cols, p.begin());
        std::nth_element(p.begin(), p.begin() + hp.n_expert_used, p.end(), std::greater<>());
        const float last = *std::min_element(p.begin(), p.begin() + hp.n_expert_used);
        if (hp.n_expert_used < cols) {
          double& g = router_gaps[size_t(first + r)];
          g = std::min(g, std::log(double(last)) - std::log(double(p[size_t(hp.n_expert_used)])));
        }
      }
    });
  }
  Engine engine(*backend, hp, tok.eos(), shape);
  auto sink = std::make_shared<CollectSink>(tok, !json);
  if (!json) {
    std::fputs(a.str("prompt").c_str(), stdout);
    std::fflush(stdout);
  }
  engine.submit(req, sink);
  engine.run_until_idle();
  if (sink->reason == Finish::error) throw Error(sink->error);
  if (json) {
    nlohmann::json out = {{"prompt_tokens", req.prompt},
                          {"tokens", sink->tokens},
                          {"text", tok.decode(sink->tokens)},
                          {"finish_reason", finish_name(sink->reason)}};
    if (!router_gaps.empty()) out["router_gaps"] = router_gaps;
    std::cout << out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << std::endl;
  } else {
    std::cout << std::endl;
    const Timings& t = sink->timings;
    std::fprintf(stderr, "prompt: %lld tokens in %.1f ms (%.1f tok/s); generated: %lld tokens in %.1f ms (%.1f tok/s)\n",
                 (long long)t.prompt_n, t.prompt_ms, t.prompt_ms > 0 ? 1000.0 * t.prompt_n / t.prompt_ms : 0.0,
                 (long long)t.predicted_n, t.predicted_ms,
                 t.predicted_ms > 0 ? 1000.0 * t.predicted_n / t.predicted_ms : 0.0);
  }
  return 0;
}

int cmd_perplexity(const std::vector<std::string>& argv) {
  Args a(argv, {"model", "file", "context", "chunks", "threads", "device", "gpu-weights", "holder-socket", "host-experts",
                "holder-experts", "kv-cache", "save-logits", "kl-divergence"},
         {"json"}, {{"-m", "model"}, {"-f", "file"}, {"-c", "context"}, {"-t", "threads"}, {"--ctx", "context"}});
  auto lm = open_model(a.required("model"));
  const HParams& hp = lm->model.hp();
  const Tokenizer& tok = lm->tokenizer;
  PerplexityOptions o;
  o.n_ctx = a.integer("context", 512, kMinContext, kMaxContext);
  o.n_chunks = a.integer("chunks", -1, -1, 1 << 24);
  o.save_logits = a.str("save-logits");
  o.kl_divergence = a.str("kl-divergence");
  o.add_bos = tok.add_bos();
  o.bos = tok.bos();
  o.n_vocab = hp.n_vocab;
  std::vector<int32_t> tokens;
  if (a.has("file")) {
    std::ifstream in(a.str("file"), std::ios::binary);
    if (!in) throw Error("--file: cannot read '" + a.str("file") + "'");
    std::stringstream ss;
    ss << in.rdbuf();
    // As llama-perplexity: the whole text, BOS first when the vocabulary adds it.
    tokens = tok.encode(ss.str(), tok.add_bos());
  } else if (o.kl_divergence.empty()) {
    throw Error("--file: the text to measure is missing (with --kl-divergence the base's file holds it)");
  }
  EngineShape shape;
  shape.ctx = o.n_ctx;
  shape.slots = 1;
  shape.max_batch = std::min<int64_t>(o.n_ctx, 512);
  shape.kv = kv_cache_arg(a);
  o.max_batch = shape.max_batch;
  o.logit_rows = shape.slots + 1;
  auto backend = make_backend(a.str("device", "auto"), *lm, int(a.integer("threads", 0, 0, 1024)), gpu_weights_of(a));
  check_backend_plan_fits(*backend, backend->plan(shape), shape);
  backend->reserve(shape);
  const auto t0 = Clock::now();
  // --json: the chunks' lines on stderr as progress, one JSON line on stdout.
  const bool json = a.has("json");
  run_perplexity(*backend, std::move(tokens), o, json ? stderr : stdout, json ? stdout : nullptr);
  std::fprintf(stderr, "perplexity: %s, context %lld, %.2f s\n", backend->name().c_str(), (long long)o.n_ctx,
               std::chrono::duration<double>(Clock::now() - t0).count());
  return 0;
}

int cmd_bench(const std::vector<std::string>& argv) {
  Args a(argv, {"model", "n-prompt", "n-gen", "repetitions", "threads", "device", "segment", "segment-socket", "gpu-weights",
                "holder-socket", "host-experts", "holder-experts", "depth", "context", "kv-cache"}, {},
         {{"-m", "model"}, {"-p", "n-prompt"}, {"-n", "n-gen"}, {"-r", "repetitions"}, {"-t", "threads"}, {"-d", "depth"},
          {"--ctx", "context"}});
  const auto t_attach = Clock::now();
  auto lm = a.has("segment") ? attach_model(a.str("segment"), segment_socket(a)) : open_model(a.required("model"));
  const double attach_ms = std::chrono::duration<double, std::milli>(Clock::now() - t_attach).count();
  const HParams& hp = lm->model.hp();
  const int64_t np = a.integer("n-prompt", 128, 0, 1 << 20), ng = a.integer("n-gen", 128, 0, 1 << 20);
  const int64_t reps = a.integer("repetitions", 3, 1, 1000);
  // -d D: the runs start with D tokens in the cache, as llama-bench's -d.
  const int64_t depth = a.integer("depth", 0, 0, kMaxContext);
  const int threads = int(a.integer("threads", 0, 0, 1024));
  // --host-experts 0,4,8: the speed of each expert rung, one line each.
  std::vector<int> rungs;
  for (const std::string& v : split_list(a.str("host-experts"))) {
    if (v.empty() || v.size() > 5 || v.find_first_not_of("0123456789") != std::string::npos)
      throw Error("--host-experts: '" + v + "' is not a number of layers (expected N or a list N,M,...)");
    rungs.push_back(std::stoi(v));
  }
  if (rungs.empty()) rungs.push_back(-1);
  const GpuWeightsChoice gpu = gpu_weights_of(a);
  for (const int rung : rungs) {
    auto backend = make_backend(a.str("device", "cpu"), *lm, threads, gpu, rung);
    if (rung > 0 && !backend->memory_on_device())
      throw Error("--host-experts " + std::to_string(rung) + ": " + backend->name() +
                  " computes every expert on the host already; the expert rungs are a GPU worker's");
    EngineShape shape;
    // --context C: the slot's context, as a worker at that rung holds it (the
    // attention's plan follows the context, not the depth); default the runs' need.
    const int64_t need = depth + std::max<int64_t>(np, ng) + 1;
    shape.ctx = a.integer("context", need, kMinContext, kMaxContext);
    if (shape.ctx < need)
      throw Error("--context " + std::to_string(shape.ctx) + " is smaller than the runs need (" +
                  std::to_string(need) + ": -d + the longer of -p and -n + 1)");
    shape.slots = 1;
    shape.max_batch = std::max<int64_t>(1, std::min<int64_t>(std::max(np, depth), 512));
    shape.kv = kv_cache_arg(a);
    check_backend_plan_fits(*backend, backend->plan(shape), shape);
    backend->reserve(shape);

    std::mt19937 rng(42);
    auto random_token = [&] { return int32_t(rng() % uint32_t(hp.n_vocab)); };
    // n tokens in batches from position `from`, as llama-bench's pp test.
    auto prefill = [&](int64_t from, int64_t n) {
      std::vector<BatchToken> b;
      for (int64_t i = 0; i < n; i += shape.max_batch) {
        b.clear();
        for (int64_t j = i; j < std::min(n, i + shape.max_batch); ++j)
          b.push_back({random_token(), 0, int32_t(from + j), j == n - 1 ? 0 : -1});
        backend->forward(b);
      }
    };
    // The first `depth` positions are written once: every run after them
    // attends to them and writes only past them.
    const auto t_depth = Clock::now();
    prefill(0, depth);
    const double depth_ms = std::chrono::duration<double, std::milli>(Clock::now() - t_depth).count();
    auto run_pp = [&] { prefill(depth, np); };
    // N tokens one at a time after the depth, as llama-bench's tg test.
    auto run_tg = [&] {
      for (int64_t i = 0; i < ng; ++i) {
        BatchToken t{random_token(), 0, int32_t(depth + i), 0};
        backend->forward({&t, 1});
      }
    };
    auto measure = [&](auto&& fn, int64_t n) {
      std::vector<double> rates;
      if (n == 0) return std::pair{0.0, 0.0};
      fn();  // warm-up
      for (int64_t r = 0; r < reps; ++r) {
        const auto t0 = Clock::now();
        fn();
        rates.push_back(double(n) / std::chrono::duration<double>(Clock::now() - t0).count());
      }
      double mean = 0, var = 0;
      for (double x : rates) mean += x;
      mean /= double(rates.size());
      for (double x : rates) var += (x - mean) * (x - mean);
      const double sd = rates.size() > 1 ? std::sqrt(var / double(rates.size() - 1)) : 0.0;
      return std::pair{mean, sd};
    };
    const auto [pp, pp_sd] = measure(run_pp, np);
    const auto [tg, tg_sd] = measure(run_tg, ng);
    nlohmann::json out = {{"model", hp.name},
                          {"segment", lm->segment.name()},
                          {"backend", backend->name()},
                          {"n_prompt", np},
                          {"n_gen", ng},
                          {"depth", depth},
                          {"ctx", shape.ctx},
                          {"kv_cache", kv_type_name(shape.kv)},
                          {"depth_ms", depth_ms},
                          {"repetitions", reps},
                          {"weights_bytes", lm->model.w().bytes},
                          // Of the segment as this process maps it (after the runs touched it).
                          {"huge_page_bytes", store::pmd_mapped_bytes(lm->segment.base())},
                          {"attach_ms", attach_ms},
                          {"pp_tok_s", pp},
                          {"pp_sd", pp_sd},
                          {"tg_tok_s", tg},
                          {"tg_sd", tg_sd}};
    if (rung >= 0 && backend->memory_on_device()) out["host_expert_layers"] = rung;
    if (backend->memory_on_device()) {
      const MemoryPlan p = backend->plan(shape);
      out["device_weight_bytes"] = p.weights + p.experts;
    }
    std::cout << out.dump() << std::endl;
  }
  return 0;
}

namespace {

/// workers.engine: exec: the external server as the worker (exec_engine.h).
int run_engine(const WorkerLaunch& l) {
  if (l.port == 0) throw Error("engine: --port is required (where the server answers HTTP)");
  if (l.exec_command.empty()) throw Error("missing option '--command'");
  ExecEngineOptions o;
  o.id = int(l.id);
  o.port = int(l.port);
  o.context = l.context;
  o.slots = l.slots;
  o.start_timeout = std::chrono::milliseconds(l.start_timeout_ms);
  o.control = l.control;
  ExecValues v;
  v.ctx = o.context;
  v.port = o.port;
  v.slots = o.slots;
  v.threads = l.threads;
  v.model = l.model;
  o.argv = expand_exec_command(l.exec_command, v);
  return run_exec_engine(o);
}

}  // namespace

int cmd_engine(const std::vector<std::string>& argv) { return run_engine(parse_worker_launch(argv)); }

int cmd_serve(const std::vector<std::string>& argv) {
  // Its settings (shared/worker_launch.h) come on the command line from a
  // person or the process backend, and in the environment file of
  // ds4-worker@.service from the systemd backend.
  const WorkerLaunch l = parse_worker_launch(argv);
  // With workers.engine: exec the launch names the engine, and the worker is one.
  if (!l.exec_command.empty()) return run_engine(l);
  ServeOptions o;
  o.id = int(l.id);
  if (l.socket.empty()) throw Error("missing option '--socket'");
  o.socket_path = l.socket;
  o.shape.ctx = l.context;
  o.shape.slots = l.slots;
  o.shape.max_batch = l.prefill_chunk;
  o.shape.kv = kv_cache_named(l.kv_cache);
  o.threads = int(l.threads);
  o.device = l.device;
  o.busy_poll = std::chrono::microseconds(l.busy_poll_us);
  o.control = l.control;
  o.dies_with = int(l.dies_with);
  if (l.segment.empty() && l.model.empty()) throw Error("missing option '--model'");
  const auto t0 = Clock::now();
  auto lm = !l.segment.empty()
                ? attach_model(l.segment, l.segment_socket.empty() ? store::default_segment_socket() : l.segment_socket)
                : open_model(l.model);
  const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  log::info("attached model segment " + lm->segment.name() + " in " + std::to_string(ms) + " ms",
            {{"DS4_WORKER", std::to_string(o.id)}, {"DS4_SEGMENT", lm->segment.name()}});
  auto backend = make_backend(o.device, *lm, o.threads, gpu_weights_of(l));
  serve(*lm, *backend, o);
  return 0;
}

int cmd_hold(const std::vector<std::string>& argv) {
  Args a(argv, {"segment", "segment-socket", "model", "device", "socket", "host-experts"}, {});
#ifdef DS4_HAVE_CUDA
  const int dev = cuda_index(a.str("device", "cuda:0"));
  if (dev < 0) throw Error("device '" + a.str("device") + "': the holder keeps weights on a GPU (cuda:N)");
  if (std::string why; !cuda_available(&why)) throw Error("cuda:" + std::to_string(dev) + ": " + why);
  const std::string socket = a.str("socket", default_holder_socket(dev));
  if (cuda_integrated(dev)) {
    log::info("cuda:" + std::to_string(dev) + " is an integrated GPU (memory shared with the host): workers read the "
              "weights in place from shared memory, so there is nothing to hold",
              {{"DS4_DEVICE", "cuda:" + std::to_string(dev)}});
    return kExitNothingToHold;
  }
  auto lm = a.has("segment") ? attach_model(a.str("segment"), segment_socket(a)) : open_model(a.required("model"));
  // SIGTERM and SIGINT go to one thread that stops the holder (blocked here,
  // before any other thread exists, so every thread inherits the mask).
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  sd_notify(0, ("STATUS=copying the weights to cuda:" + std::to_string(dev)).c_str());
  const auto t0 = Clock::now();
  // The experts of the first N layers stay out of the image: the workers'
  // deepest expert rung (workers.moe_offload), whose experts are on the host.
  // (--host-experts, else the holder's rung of a worker's environment.)
  const int host_experts =
      int(a.integer("host-experts", std::max<int64_t>(parse_worker_launch({}).holder_experts, 0), 0, 1 << 16));
  CudaHolder holder(lm->model, dev, socket, holder_model_key(lm->segment), lm->segment.name(), host_experts);
  const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  std::thread waiter([&] {
    int sig = 0;
    sigwait(&stop_signals, &sig);
    holder.stop();
  });
  sd_notify(0, ("READY=1\nSTATUS=" + holder.status()).c_str());
  log::info(holder.status() + " (copied in " + std::to_string(int64_t(ms)) + " ms)",
            {{"DS4_SEGMENT", lm->segment.name()}, {"DS4_DEVICE", "cuda:" + std::to_string(dev)}});
  std::exception_ptr failed;
  try {
    holder.serve();
  } catch (...) {
    failed = std::current_exception();
  }
  sd_notify(0, "STOPPING=1");
  pthread_kill(waiter.native_handle(), SIGTERM);  // when serve() failed, the waiter still waits
  waiter.join();
  if (failed) std::rethrow_exception(failed);
  log::info("holder stopped; workers that mapped the weights keep them until they exit");
  return 0;
#else
  throw Error("this ds4-worker was built without the CUDA backend: nothing to hold");
#endif
}

int cmd_capabilities(const std::vector<std::string>& argv) {
  Args a(argv, {}, {});
  nlohmann::json backends = {"cpu"};
#ifdef DS4_HAVE_CUDA
  backends.push_back("cuda");
#endif
  nlohmann::json types = nlohmann::json::array();
  for (std::string_view list = supported_types(); !list.empty();) {
    const size_t comma = list.find(", ");
    types.push_back(std::string(list.substr(0, comma)));
    list = comma == std::string_view::npos ? std::string_view() : list.substr(comma + 2);
  }
  nlohmann::json kv = nlohmann::json::array();
  for (const KvType t : {KvType::f16, KvType::q8_0}) kv.push_back(kv_type_name(t));
  std::cout << nlohmann::json{{"backends", backends}, {"weight_types", types}, {"kv_cache", kv}}.dump() << std::endl;
  return 0;
}

int cmd_load(const std::vector<std::string>& argv) {
  Args a(argv, {"model"}, {"force"});
  store::LoadOptions opts;
  opts.force_rebuild = a.has("force");
  opts.progress = store::make_progress_reporter(a.required("model"));
  opts.check = [](const gguf::File& f) { Model::bind_file(f); };  // what a worker would refuse
  std::cout << store::ensure_loaded(a.required("model"), opts) << std::endl;
  return 0;
}

int cmd_unload(const std::vector<std::string>& argv) {
  Args a(argv, {"model", "segment"}, {});
  const std::string name = a.has("segment") ? a.str("segment") : store::segment_name(store::identify(a.required("model")));
  if (store::is_memfd_handle(name))
    throw Error(name + ": a memfd segment goes away when the supervisor that keeps it lets it go (or stops)");
  // Only what `load` makes: another program's shared memory, or ds4's control
  // block, is not this command's to remove.
  if (!name.starts_with("ds4-model-") || name.find('/') != std::string::npos)
    throw Error(name + " is not a model segment's name (ds4-model-…, as `ds4-worker load` prints)");
  if (!store::remove(name)) throw Error("no segment named " + name);
  std::cout << "removed " << name << std::endl;
  return 0;
}

}  // namespace ds4
