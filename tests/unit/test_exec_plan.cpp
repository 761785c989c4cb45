// The memory plan of an external engine: the KV geometry read from a GGUF's
// own keys (any architecture, per-layer head counts, sliding windows), the
// cache types and context of llama-server's command line, and the bytes.
#include <doctest/doctest.h>

#include <functional>
#include <string>
#include <vector>

#include "model/exec_plan.h"
#include "shared/error.h"
#include "shared/gguf.h"
#include "shared/gguf_writer.h"

using namespace ds4;

namespace {

struct Meta {
  std::vector<uint8_t> bytes;
  gguf::File file;
};

Meta meta(const std::function<void(gguf::Writer&)>& keys) {
  gguf::Writer w;
  keys(w);
  Meta m{w.to_bytes(), {}};
  m.file = gguf::File::parse(m.bytes, "test.gguf");
  return m;
}

}  // namespace

TEST_CASE("exec plan: a Llama 3 8B's KV cache is 128 KiB a token in f16; q8_0 takes 34 bytes a block of 32") {
  Meta m = meta([](gguf::Writer& w) {
    w.set_string("general.architecture", "llama");
    w.set_u32("llama.block_count", 32);
    w.set_u32("llama.embedding_length", 4096);
    w.set_u32("llama.attention.head_count", 32);
    w.set_u32("llama.attention.head_count_kv", 8);
  });
  const ExecKvGeometry g = read_exec_kv_geometry(m.file);
  CHECK(g.n_layers == 32);
  CHECK(g.key_length == 128);  // embedding_length / head_count
  CHECK(g.value_length == 128);
  CHECK(g.kv_heads == std::vector<int64_t>(32, 8));
  // 32 layers x 8 heads x (128 + 128) x 2 bytes = 128 KiB a token, as llama.cpp prints it.
  CHECK(exec_kv_bytes(g, 8192, 1, 2.0, 2.0) == uint64_t(8192) * 131072);
  CHECK(exec_kv_bytes(g, 8192, 4, 2.0, 2.0) == uint64_t(8192) * 131072);  // -c is shared by the slots
  CHECK(exec_kv_bytes(g, 1024, 1, *kv_cache_type_bytes("q8_0"), *kv_cache_type_bytes("q8_0")) ==
        uint64_t(1024) * 32 * 8 * 256 * 34 / 32);
  CHECK_FALSE(kv_cache_type_bytes("q3_k").has_value());
}

TEST_CASE("exec plan: key lengths, per-layer head counts and sliding-window layers of other architectures") {
  Meta m = meta([](gguf::Writer& w) {
    w.set_string("general.architecture", "gemma3");
    w.set_u32("gemma3.block_count", 6);
    w.set_u32("gemma3.embedding_length", 1152);
    w.set_u32("gemma3.attention.head_count", 4);
    w.set_i32_array("gemma3.attention.head_count_kv", {1, 1, 1, 1, 1, 2});
    w.set_u32("gemma3.attention.key_length", 256);
    w.set_u32("gemma3.attention.value_length", 128);
    w.set_u32("gemma3.attention.sliding_window", 512);
    w.set_u32("gemma3.attention.sliding_window_pattern", 6);  // every sixth layer full
  });
  const ExecKvGeometry g = read_exec_kv_geometry(m.file);
  CHECK(g.key_length == 256);
  CHECK(g.value_length == 128);
  CHECK(g.swa == std::vector<bool>{true, true, true, true, true, false});
  // 5 window layers hold min(ctx, 512 x slots + 512); the full one holds ctx.
  const double per_token_swa = 1 * (256 * 2.0 + 128 * 2.0), per_token_full = 2 * (256 * 2.0 + 128 * 2.0);
  CHECK(exec_kv_bytes(g, 32768, 2, 2.0, 2.0) == uint64_t(5 * 1536 * per_token_swa + 32768 * per_token_full));
  CHECK(exec_kv_bytes(g, 256, 2, 2.0, 2.0) == uint64_t(5 * 256 * per_token_swa + 256 * per_token_full));
}

TEST_CASE("exec plan: a file without the keys is refused naming the key") {
  Meta none = meta([](gguf::Writer& w) { w.set_string("general.name", "x"); });
  CHECK_THROWS_WITH_AS(read_exec_kv_geometry(none.file), doctest::Contains("general.architecture"), Error);
  Meta no_layers = meta([](gguf::Writer& w) {
    w.set_string("general.architecture", "qwen3");
    w.set_u32("qwen3.attention.head_count", 8);
  });
  CHECK_THROWS_WITH_AS(read_exec_kv_geometry(no_layers.file), doctest::Contains("qwen3.block_count"), Error);
  Meta bad_array = meta([](gguf::Writer& w) {
    w.set_string("general.architecture", "llama");
    w.set_u32("llama.block_count", 3);
    w.set_u32("llama.embedding_length", 64);
    w.set_i32_array("llama.attention.head_count", {4, 4});
  });
  CHECK_THROWS_WITH_AS(read_exec_kv_geometry(bad_array.file), doctest::Contains("2 entries for 3 layers"), Error);
}

TEST_CASE("exec plan: the context and cache types of llama-server's command line") {
  ExecKvArgs a = read_exec_kv_args({"llama-server", "-m", "x.gguf", "-c", "16384", "-ctk", "q8_0", "--cache-type-v=q4_0"});
  CHECK(a.tokens == 16384);
  CHECK(a.type_k == "q8_0");
  CHECK(a.type_v == "q4_0");
  a = read_exec_kv_args({"llama-server", "--ctx-size=4096"});
  CHECK(a.tokens == 4096);
  CHECK(a.type_k == "f16");
  CHECK(a.type_v == "f16");
  CHECK(read_exec_kv_args({"llama-server", "-c"}).tokens == 0);  // no value: not given
}
