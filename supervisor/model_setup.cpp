#include "supervisor/model_setup.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <thread>

#include "shared/bytes.h"
#include "shared/spawn.h"
#include "shared/error.h"
#include "shared/gguf_writer.h"
#include "shared/log.h"
#include "shared/model_store.h"
#include "supervisor/memfd_segments.h"
#include "supervisor/policy.h"
#include "model/exec_plan.h"
#include "model/memory_plan.h"
#include "shared/exec_command.h"
#include "model/weights.h"

namespace ds4::sup {

namespace fs = std::filesystem;

void write_byte_vocab(const std::string& path) {
  gguf::Writer w;
  std::vector<std::string> tokens = {"<unk>", "<s>", "</s>"};
  std::vector<int32_t> types = {2, 3, 3};  // unknown, control, control
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof name, "<0x%02X>", b);
    tokens.push_back(name);
    types.push_back(6);  // byte
  }
  w.set_string("general.architecture", "llama");
  w.set_string("tokenizer.ggml.model", "llama");
  w.set_string_array("tokenizer.ggml.tokens", tokens);
  w.set_f32_array("tokenizer.ggml.scores", std::vector<float>(tokens.size(), 0.0f));
  w.set_i32_array("tokenizer.ggml.token_type", types);
  w.set_u32("tokenizer.ggml.unknown_token_id", 0);
  w.set_u32("tokenizer.ggml.bos_token_id", 1);
  w.set_u32("tokenizer.ggml.eos_token_id", 2);
  w.write(path);
}

std::string make_synthetic_model(const std::string& dir, const std::string& bin_dir) {
  const std::string out = dir + "/synthetic-stories-like.gguf";
  if (fs::exists(out)) return out;
  const std::string vocab = dir + "/byte-vocab.gguf";
  write_byte_vocab(vocab);
  const std::string mkmodel = bin_dir + "/ds4-mkmodel";
  if (access(mkmodel.c_str(), X_OK) != 0)
    throw Error("cannot make a synthetic model: no executable " + mkmodel + " beside ds4-supervisor");
  SpawnOptions o;
  o.argv = {mkmodel, "--out", out, "--vocab-from", vocab, "--preset", "stories-like", "--name", "ds4-synthetic-random-weights"};
  // Its progress output is not wanted on ours.
  const int null_fd = ::open("/dev/null", O_WRONLY | O_CLOEXEC);
  o.stdout_fd = null_fd;
  std::optional<ExitStatus> st;
  try {
    st = wait_for(spawn(o));
  } catch (const Error& e) {
    if (null_fd >= 0) ::close(null_fd);
    throw Error(std::string("cannot make a synthetic model: ") + e.what());
  }
  if (null_fd >= 0) ::close(null_fd);
  if (!st || !st->success() || !fs::exists(out))
    throw Error("cannot make a synthetic model: " + mkmodel + " --out " + out + " failed");
  return out;
}

namespace {

// Whether the weights just written sit in 2 MiB pages: the CPU backend
// streams them up to 1.4x faster from those (decode is bound by memory). The
// loader asks the kernel for them (MADV_COLLAPSE); an older kernel than 6.1,
// shmem_enabled "deny" or fragmented memory give fewer.
void log_page_size(const store::LoadResult& r) {
  const bool memfd = r.backing == store::Backing::memfd;
  std::string msg = "model segment " + r.name + ": " + format_bytes(r.huge_page_bytes) + " of " + format_bytes(r.bytes) +
                    " in 2 MiB pages";
  if (r.huge_page_bytes * 2 < r.bytes)
    msg += std::string("; the kernel did not collapse it (Linux 6.1 does); for faster CPU decoding ") +
           (memfd ? "allow them for memfd segments: echo within_size > /sys/kernel/mm/transparent_hugepage/shmem_enabled"
                  : "mount /dev/shm with them: mount -o remount,huge=within_size /dev/shm");
  log::info(msg, {{"DS4_SEGMENT", r.name}, {"DS4_HUGE_PAGE_BYTES", std::to_string(r.huge_page_bytes)}});
}

store::BackingChoice backing_choice(ModelBacking b) {
  switch (b) {
    case ModelBacking::shm: return store::BackingChoice::shm;
    case ModelBacking::memfd: return store::BackingChoice::memfd;
    case ModelBacking::automatic: break;
  }
  return store::BackingChoice::automatic;
}

}  // namespace

store::Segment attach_served(const ModelInfo& m) {
  return m.fd ? store::Segment::attach_fd(m.fd->get(), m.segment) : store::Segment::attach(m.segment);
}

void with_metadata(const ModelInfo& m, const std::function<void(const gguf::File&)>& fn) {
  if (m.file_only) return fn(gguf::File::open(m.path));
  const store::Segment seg = attach_served(m);
  fn(seg.metadata());
}

ModelInfo prepare_model(const Config& config, const std::string& runtime_dir, const std::string& bin_dir,
                        MemfdSegments& memfds, std::stop_token stop) {
  ModelInfo m;
  m.path = config.model.path.string();
  m.name = config.model.name;
  if (m.path.empty()) {
    const std::string why = "no model.path is configured";
    m.path = make_synthetic_model(runtime_dir, bin_dir);
    m.synthetic = true;
    if (m.name.empty()) m.name = "ds4-synthetic";
    const std::string msg = "THE MODEL HAS RANDOM WEIGHTS: " + why + ", so a small synthetic model (" + m.path +
                            ") is served; its answers are gibberish. Set model.path in the config to a GGUF file.";
    log::warn(msg, {{"DS4_MODEL_SYNTHETIC", "1"}});
    std::fprintf(stderr, "\n*** ds4-supervisor: %s ***\n\n", msg.c_str());
  }
  if (m.name.empty()) m.name = fs::path(m.path).stem().string();
  m.file_key = store::segment_name(store::identify(m.path));
  if (config.workers.engine == WorkerEngine::exec) {
    // The engine reads the file itself: a segment would be a second copy of
    // the weights in memory.
    m.file_only = true;
    m.bytes = fs::file_size(m.path);
    log::info("model " + m.path + " is loaded by the exec engine itself: ds4 keeps no copy of it",
              {{"DS4_MODEL", m.path}});
    return m;
  }
  const store::BackingChoice want = backing_choice(config.model.backing);
  if (want != store::BackingChoice::shm) {
    // A memfd segment of this very file that we keep (systemd gave it back
    // at this start, or an earlier load made it): no copy at all.
    if (const std::optional<KeptMemfd> k = memfds.find(store::identify(m.path))) {
      m.segment = k->handle;
      m.backing = store::Backing::memfd;
      m.fd = k->fd;
      m.bytes = k->bytes;
      m.reused = true;
      const store::Segment seg = attach_served(m);
      m.weight_bytes = seg.weight_bytes();
      m.huge_page_bytes = seg.huge_page_bytes();
      log::info("reused memfd segment " + m.segment + " (" + format_bytes(m.bytes) + ") kept " +
                    (memfds.fd_store() ? "in systemd's fd store" : "by this supervisor") + ": nothing loaded",
                {{"DS4_EVENT", "segment_reused"}, {"DS4_SEGMENT", m.segment}, {"DS4_BACKING", "memfd"}});
      return m;
    }
  }
  store::LoadOptions opts;
  opts.backing = want;
  opts.huge_pages = config.model.huge_pages;
  opts.stop = std::move(stop);
  opts.check = [](const gguf::File& f) { Model::bind_file(f); };  // what every worker would refuse
  opts.progress = store::make_progress_reporter("loading " + fs::path(m.path).filename().string());
  const store::LoadResult r = store::load(m.path, opts);
  m.segment = r.name;
  m.backing = r.backing;
  m.fd = r.fd;
  m.bytes = r.bytes;
  m.reused = r.reused;
  if (!r.reused) log_page_size(r);
  if (!r.rebuild_reason.empty())
    log::info("rebuilt model segment " + r.name + ": " + r.rebuild_reason, {{"DS4_SEGMENT", r.name}});
  if (r.fd) {
    log::info("model " + m.path + " loaded into memfd segment " + r.name + " (" + format_bytes(r.bytes) +
                  "), kept by the supervisor and handed to workers over its segment socket: " + r.memfd_reason,
              {{"DS4_EVENT", "segment_memfd"}, {"DS4_SEGMENT", r.name}, {"DS4_BACKING", "memfd"}});
    memfds.add(r.name, r.fd);
  }
  const store::Segment seg = attach_served(m);
  m.weight_bytes = seg.weight_bytes();
  m.huge_page_bytes = seg.huge_page_bytes();
  return m;
}

std::vector<uint32_t> expert_rungs(const ModelInfo& model, const WorkersConfig& w, bool on_gpu, std::string* note) {
  const std::vector<uint32_t> none = {0};
  if (w.moe_offload == none) return none;
  auto refuse = [&](const std::string& why) {
    if (note) *note = "workers.moe_offload is not used: " + why;
    return none;
  };
  if (w.engine == WorkerEngine::exec) return refuse("an exec engine places its own experts");
  if (!on_gpu) return refuse("the workers run on the CPU, where every expert is on the host already");
  const store::Segment seg = attach_served(model);
  const Model m = Model::bind(seg.metadata(), segment_tensors(seg));
  if (!m.hp().moe()) return refuse(m.hp().name + " is not a mixture of experts");
  std::vector<uint32_t> out;
  for (uint32_t o : w.moe_offload) {
    const uint32_t n = std::min<uint32_t>(o, uint32_t(m.hp().n_layers));
    if (out.empty() || n > out.back()) out.push_back(n);
  }
  if (note && out.back() != w.moe_offload.back())
    *note = "workers.moe_offload: the model has " + std::to_string(m.hp().n_layers) + " layers; rungs past it are cut to " +
            std::to_string(out.back());
  return out;
}

std::vector<std::string> kv_rungs(const ModelInfo& model, const WorkersConfig& w, std::string* note) {
  const std::vector<std::string> none = {"f16"};
  if (w.kv_cache == none) return none;
  if (w.engine == WorkerEngine::exec) {
    if (note) *note = "workers.kv_cache is not used: an exec engine keeps its cache as its command line says";
    return none;
  }
  const store::Segment seg = attach_served(model);
  const Model m = Model::bind(seg.metadata(), segment_tensors(seg));
  std::vector<std::string> out;
  for (const std::string& k : w.kv_cache) {
    const auto t = kv_type_from(k);
    const std::string why = t ? kv_type_unsupported(m.hp(), *t) : "unknown KV cache type '" + k + "'";
    if (why.empty()) out.push_back(k);
    else if (note) *note = "workers.kv_cache: " + k + " is not used: " + why;
  }
  return out.empty() ? none : out;
}

std::vector<Rung> plan_ladder(const ModelInfo& model, std::vector<Rung> ladder, uint32_t slots, uint32_t threads,
                              uint32_t prefill_chunk, uint32_t holder_experts) {
  const store::Segment seg = attach_served(model);
  const Model m = Model::bind(seg.metadata(), segment_tensors(seg));
  const WeightsSummary w = WeightsSummary::of(m.w());
  // The CPU worker's figure: threads as ds4-worker takes them (0: one per core).
  const int t = threads > 0 ? int(threads) : int(std::max(1u, std::thread::hardware_concurrency()));
  for (Rung& r : ladder) {
    EngineShape shape;
    shape.ctx = r.context;
    shape.slots = slots;
    shape.max_batch = prefill_chunk;  // ds4-worker serve --batch
    shape.kv = kv_type_from(r.kv_cache).value_or(KvType::f16);
    r.own_bytes = plan_memory(m.hp(), shape, w, {BackendKind::cpu, t}).own();
    if (r.host_experts < holder_experts) r.own_bytes += expert_bytes(m.w(), int(r.host_experts), int(holder_experts));
  }
  return ladder;
}

std::vector<Rung> plan_exec_ladder(const std::string& model_path, const WorkersConfig& w, bool resident,
                                   std::string* detail) {
  const gguf::File f = gguf::File::open(model_path);
  const ExecKvGeometry g = read_exec_kv_geometry(f);
  const Bytes file = Bytes(fs::file_size(model_path));
  std::vector<Rung> out = ladder_rungs(w.ladder);
  for (Rung& r : out) {
    const uint32_t ctx = r.context;
    ExecValues v;
    v.ctx = ctx;
    v.port = 1;  // not known yet; it does not change the plan
    v.slots = w.slots;
    v.threads = w.threads;
    v.model = model_path;
    const ExecKvArgs a = read_exec_kv_args(expand_exec_command(w.exec_command, v));
    const int64_t tokens = a.tokens > 0 ? a.tokens : int64_t(ctx) * int64_t(w.slots);
    auto bytes_of = [](const std::string& type) {
      if (auto b = kv_cache_type_bytes(type)) return *b;
      log::warn("workers.exec.command: KV cache type '" + type + "' unknown to the plan; counted as f32, ignoring");
      return 4.0;
    };
    const Bytes kv = exec_kv_bytes(g, tokens, w.slots, bytes_of(a.type_k), bytes_of(a.type_v));
    r.own_bytes = kv + w.exec_overhead + (resident ? 0 : file);
    if (detail)
      *detail += "context " + std::to_string(ctx) + ": " + format_bytes(r.own_bytes) + " (KV " + format_bytes(kv) + " for " +
                 std::to_string(tokens) + " tokens, " + a.type_k + "/" + a.type_v + ", + overhead " +
                 format_bytes(w.exec_overhead) + (resident ? "" : ", + the file " + format_bytes(file)) + "); ";
  }
  return out;
}

}  // namespace ds4::sup
