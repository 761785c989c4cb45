#pragma once
/// Writes GGUF v3 files: metadata of any value type and tensors, data aligned to
/// `general.alignment` (32 unless set). Used by ds4-mkmodel and by tests that
/// craft good and broken files.

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "shared/gguf.h"

namespace ds4::gguf {

/// Value builders, for set() and for tests that need every type.
Value make_uint(ValueType t, uint64_t v);    // UINT8/16/32/64
Value make_int(ValueType t, int64_t v);      // INT8/16/32/64
Value make_float(ValueType t, double v);     // FLOAT32/64
Value make_bool(bool v);
Value make_string(std::string v);
Value make_array(ValueType elem_type, std::vector<Value> elems);  // elements of elem_type

/// Produces a tensor's `n_bytes` encoded bytes into `out` at write time.
using TensorGenerator = std::function<void(uint8_t* out, uint64_t n_bytes)>;

class Writer {
 public:
  /// Sets a key; setting it again replaces the value in place (keys stay unique).
  void set(std::string key, Value v);
  void set_string(std::string key, std::string v);
  void set_u32(std::string key, uint32_t v);
  void set_i32(std::string key, int32_t v);
  void set_f32(std::string key, float v);
  void set_bool(std::string key, bool v);
  void set_string_array(std::string key, const std::vector<std::string>& v);
  void set_f32_array(std::string key, const std::vector<float>& v);
  void set_i32_array(std::string key, const std::vector<int32_t>& v);
  void set_u64(std::string key, uint64_t v);
  void set_i64(std::string key, int64_t v);
  void set_f64(std::string key, double v);
  /// Adds a tensor; `data` holds the encoded bytes (n_bytes for its type and dims).
  /// Throws ds4::Error when dims or the data size do not fit the type, or the name repeats.
  void add_tensor(std::string name, std::vector<uint64_t> dims, GgmlType type,
                  std::vector<uint8_t> data);
  /// Adds a tensor whose bytes `gen` produces while the file is written (one
  /// tensor in memory at a time), so multi-GiB synthetic models stream to disk.
  void add_tensor_generated(std::string name, std::vector<uint64_t> dims, GgmlType type,
                            TensorGenerator gen);
  /// Bytes of the encoded tensor data for `dims` of `type` (ds4::Error when invalid).
  static uint64_t tensor_bytes(const std::vector<uint64_t>& dims, GgmlType type);
  /// Serialises the whole file into memory.
  std::vector<uint8_t> to_bytes() const;
  /// Writes to `path` (throws ds4::Error naming the path on failure). Streams
  /// tensor data so files of many GiB need not fit in memory twice.
  /// The file goes to a temporary name beside `path` and is renamed at the end,
  /// so a reader never sees half a file.
  void write(const std::string& path) const;

 private:
  // Serialises everything through `put`, which receives the bytes in order.
  void emit(const std::function<void(const void* p, size_t n)>& put) const;
  uint64_t alignment() const;

  std::vector<std::pair<std::string, Value>> kv_;
  struct Tensor {
    std::string name;
    std::vector<uint64_t> dims;
    GgmlType type;
    std::vector<uint8_t> data;
    TensorGenerator gen;  // set instead of data for generated tensors
    uint64_t n_bytes = 0;
  };
  void add(Tensor t);
  std::vector<Tensor> tensors_;
};

}  // namespace ds4::gguf
