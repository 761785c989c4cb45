#pragma once
/// The context ladder: the rungs a worker can run at, from the most memory to
/// the least. A rung is one record: what a worker at it starts with (its
/// context, its KV cache type, the layers whose experts stay on the host) and
/// the memory that takes (its plan). ladder_rungs() lays the rungs out from
/// the config, plan_ladder() (model_setup.h) gives each its plan, and the
/// policy, the status JSON and `ds4ctl` read that one vector.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "shared/config.h"

namespace ds4::sup {

struct Rung {
  uint32_t context = 0;          // tokens per slot
  uint32_t host_experts = 0;     // a mixture of experts on a GPU: its first layers whose experts stay on the host
  std::string kv_cache = "f16";  // the KV cache type
  /// Its plan: KV + scratch, and a GPU worker's own copy of the experts its
  /// weights holder lacks. 0: not known (an exec engine without a plan).
  Bytes own_bytes = 0;

  /// "context 32768", "context 32768 with a q8_0 KV cache and the experts of 4 layers on the host".
  std::string text() const;
  bool operator==(const Rung&) const = default;
};

/// The rungs of the context ladder `contexts` (workers.context.ladder, most
/// memory first) with the KV cache rungs `kv` (workers.kv_cache, most memory
/// first) and the expert rungs `offload` (workers.moe_offload, ascending):
/// at the largest context every KV rung, then every further expert rung with
/// the last KV rung; each smaller context with the last of both.
/// [32768, 16384] x [f16, q8_0] x [0, 4]: (32768, f16, 0), (32768, q8_0, 0),
/// (32768, q8_0, 4), (16384, q8_0, 4). Empty or [f16], empty or [0]: one rung
/// a context, f16 and no experts on the host. Plans are left 0.
std::vector<Rung> ladder_rungs(const std::vector<uint32_t>& contexts, const std::vector<std::string>& kv = {},
                               const std::vector<uint32_t>& offload = {});

/// Whether some rung keeps experts on the host (the ladder has expert rungs).
bool has_expert_rungs(const std::vector<Rung>& ladder);
/// Whether some rung keeps its KV cache in another type than f16.
bool has_kv_rungs(const std::vector<Rung>& ladder);

/// The first rung of (context, host experts, KV cache); nullopt when none is.
std::optional<size_t> find_rung(const std::vector<Rung>& ladder, uint32_t context, uint32_t host_experts = 0,
                                const std::string& kv_cache = "f16");

}  // namespace ds4::sup
