#pragma once
/// The model the supervisor serves: the configured GGUF file (or, when none is
/// configured or it is missing, a small synthetic one with RANDOM weights made
/// by ds4-mkmodel), loaded once into its shared-memory segment, and the
/// memory plan of a worker at every rung of its ladder.

#include <cstdint>
#include <functional>
#include <memory>
#include <stop_token>
#include <string>
#include <vector>

#include "shared/config.h"
#include "shared/gguf.h"
#include "shared/model_store.h"
#include "supervisor/ladder.h"

namespace ds4::sup {

struct ModelInfo {
  std::string path;        // the GGUF file served
  std::string name;        // served id (config model.name, else the file's stem)
  bool synthetic = false;  // random weights: made because no model was found
  std::string segment;      // its name, or a memfd segment's handle "memfd:<name>"
  store::Backing backing = store::Backing::shm;
  std::shared_ptr<store::UniqueFd> fd;  // a memfd segment's descriptor (kept in MemfdSegments too)
  uint64_t bytes = 0;      // segment size
  uint64_t weight_bytes = 0;
  bool reused = false;     // the segment existed already (supervisor restart)
  uint64_t huge_page_bytes = 0;  // the part of the segment in 2 MiB pages (Segment::huge_page_bytes)
  /// store::segment_name() of the file's identity when it was prepared: a
  /// reload compares it with the file's now (changed on disk?).
  std::string file_key;
  /// An exec engine serves it: the engine loads the file itself, so ds4 keeps
  /// no segment of it (segment empty) and reads its metadata from the file.
  bool file_only = false;
};

class MemfdSegments;

/// Attaches the served segment read-only: by name, or a memfd from its descriptor.
store::Segment attach_served(const ModelInfo& m);
/// The model's GGUF metadata (tokenizer, chat template): from its segment, or
/// from the file when ds4 keeps no segment (file_only). Calls `fn` with it.
void with_metadata(const ModelInfo& m, const std::function<void(const gguf::File&)>& fn);

/// Makes a synthetic model under `dir` with the ds4-mkmodel in `bin_dir`
/// (a byte-level vocabulary is written first), unless one is there already.
/// Returns its path. Throws ds4::Error naming the step that failed.
std::string make_synthetic_model(const std::string& dir, const std::string& bin_dir);

/// Resolves (synthesizing if needed, with a loud warning) and loads the model
/// as model.backing says (not at all for workers.engine: exec: file_only): a memfd segment of this model that `memfds` keeps
/// (one systemd gave back) is reused; a new memfd segment is added to it.
/// A stop requested through `stop` ends a load in progress (store::LoadCancelled).
ModelInfo prepare_model(const Config& config, const std::string& runtime_dir, const std::string& bin_dir,
                        MemfdSegments& memfds, std::stop_token stop = {});

/// `ladder` with each rung's plan: KV + scratch of a worker at its context
/// and KV cache type (slots and threads as configured), computed by the CPU
/// backend's own planner on the segment, and for an expert rung a GPU
/// worker's own copy of the experts its holder lacks, those of layers
/// [host_experts, holder_experts).
std::vector<Rung> plan_ladder(const ModelInfo& model, std::vector<Rung> ladder, uint32_t slots, uint32_t threads,
                              uint32_t prefill_chunk = 256, uint32_t holder_experts = 0);

/// workers.kv_cache as it applies: the types the model's heads can be kept
/// in (q8_0 needs a head size that is a multiple of 32; such rungs are
/// dropped, with `note`), for the native engine (an exec engine's cache is
/// its command line's: {"f16"}, with `note` when kv_cache asks for more).
std::vector<std::string> kv_rungs(const ModelInfo& model, const WorkersConfig& w, std::string* note = nullptr);

/// workers.moe_offload as it applies: the model is a mixture of experts and
/// its workers run on a GPU with the native engine. Rungs past the model's
/// layers are cut to its layer count (duplicates dropped). Otherwise {0},
/// with `note` (if given) saying why the setting is not used.
std::vector<uint32_t> expert_rungs(const ModelInfo& model, const WorkersConfig& w, bool on_gpu, std::string* note = nullptr);

/// workers.engine: exec — a rung per context of w.ladder (f16, no experts on
/// the host: the command line decides), each with its plan: the KV cache the
/// engine's command line asks for at that rung (model/exec_plan.h: its -c,
/// else ctx x slots; its -ctk/-ctv), workers.exec.overhead, and the file's
/// size unless the supervisor keeps the file resident (`resident`: it holds
/// those pages already, outside MemAvailable). Throws ds4::Error when the
/// file lacks the hyper-parameters; `detail` gets one line per rung for the log.
std::vector<Rung> plan_exec_ladder(const std::string& model_path, const WorkersConfig& w, bool resident,
                                   std::string* detail = nullptr);

/// Writes a GGUF holding only a byte-level llama vocabulary (<unk>, <s>,
/// </s>, <0x00>..<0xFF>), which is all ds4-mkmodel needs from --vocab-from.
void write_byte_vocab(const std::string& path);

}  // namespace ds4::sup
