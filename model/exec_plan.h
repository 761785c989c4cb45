#pragma once
/// The memory plan of an external engine (workers.engine: exec), beside the
/// native plan (memory_plan.h): the KV cache from the GGUF's hyper-parameters
/// and the cache type of the engine's command line. The supervisor adds the
/// configured overhead (workers.exec.overhead) and picks the largest rung
/// that fits, as for native workers.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "shared/gguf.h"

namespace ds4 {

/// An external engine's KV cache (workers.engine: exec), from the GGUF's own
/// keys under its architecture's prefix: any architecture, ds4's or not.
struct ExecKvGeometry {
  int64_t n_layers = 0;
  std::vector<int64_t> kv_heads;  // per layer (head_count_kv, else head_count)
  int64_t key_length = 0;         // attention.key_length, else embedding_length / head_count
  int64_t value_length = 0;
  int64_t sliding_window = 0;     // attention.sliding_window; 0 = none
  std::vector<bool> swa;          // per layer: a sliding-window layer (attention.sliding_window_pattern)
};

/// Throws ds4::Error naming the key that is missing or out of range.
ExecKvGeometry read_exec_kv_geometry(const gguf::File& meta);

/// Bytes an element of a KV cache type takes (llama.cpp's -ctk/-ctv names:
/// f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl); nullopt when unknown.
std::optional<double> kv_cache_type_bytes(std::string_view type);

/// KV bytes of an engine that holds `tokens` positions in all (llama-server's
/// -c, shared by its `slots`). A sliding-window layer holds at most its
/// window per slot plus one batch of 512 (llama.cpp's SWA cache).
uint64_t exec_kv_bytes(const ExecKvGeometry& g, int64_t tokens, int64_t slots, double k_bytes, double v_bytes);

/// What an exec engine's command line says about its KV cache.
struct ExecKvArgs {
  int64_t tokens = 0;        // -c / --ctx-size; 0 when not given
  std::string type_k = "f16", type_v = "f16";  // -ctk / -ctv
};
ExecKvArgs read_exec_kv_args(const std::vector<std::string>& argv);

}  // namespace ds4
