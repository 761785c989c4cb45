// libFuzzer entry for the GGUF reader: any input must either parse or throw
// ds4::Error. Anything else (a crash, a sanitizer report, another exception
// escaping, an absurd allocation) is a bug.

#include <cstddef>
#include <cstdint>
#include <span>

#include "shared/error.h"
#include "shared/gguf.h"

namespace {

// Touches what a parsed file hands out, so reads past the range are caught.
uint64_t exercise(const ds4::gguf::File& f) {
  uint64_t sink = f.alignment() + f.data_offset() + f.header_bytes();
  for (const auto& [key, value] : f.metadata()) {
    sink += key.size() + value.array.size() + value.str.size();
    try {
      if (f.get_int(key)) sink += 1;
    } catch (const ds4::Error&) {
    }
    try {
      if (auto a = f.get_float_array(key)) sink += a->size();
    } catch (const ds4::Error&) {
    }
    try {
      if (auto a = f.get_string_array(key)) sink += a->size();
    } catch (const ds4::Error&) {
    }
  }
  for (const ds4::gguf::TensorInfo& t : f.tensors()) {
    if (f.find_tensor(t.name) != &t) __builtin_trap();
    try {
      const std::span<const uint8_t> d = f.tensor_data(t);
      if (d.size() != t.n_bytes) __builtin_trap();
      sink += d.front() + d.back();
    } catch (const ds4::Error&) {
    }
  }
  return sink;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const uint8_t> bytes(data, size);
  for (const bool check_data : {true, false}) {
    ds4::gguf::ParseOptions opts;
    opts.check_tensor_data = check_data;
    try {
      const ds4::gguf::File f = ds4::gguf::File::parse(bytes, "fuzz.gguf", opts);
      volatile uint64_t sink = exercise(f);
      (void)sink;
    } catch (const ds4::Error&) {
    }
  }
  return 0;
}
