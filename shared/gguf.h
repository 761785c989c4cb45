#pragma once
/// GGUF reader (versions 2 and 3). Parses the header, every metadata value
/// type and the tensor directory from a byte range, and checks everything:
/// each defect throws ds4::Error naming the source, the byte offset or key, and
/// what was expected, e.g.
///   `model.gguf: offset 24: metadata key 3: string length 9999999 runs past end of file (size 1200)`.
/// It never reads outside the range it was given.

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "shared/ggml_types.h"

namespace ds4::gguf {

enum class ValueType : uint32_t {
  UINT8 = 0, INT8 = 1, UINT16 = 2, INT16 = 3, UINT32 = 4, INT32 = 5, FLOAT32 = 6,
  BOOL = 7, STRING = 8, ARRAY = 9, UINT64 = 10, INT64 = 11, FLOAT64 = 12,
};

std::string_view value_type_name(ValueType t);

/// One metadata value. Scalars are widened (integers to int64/uint64, floats to
/// double); `type` keeps what the file said. Arrays hold their elements.
struct Value {
  ValueType type = ValueType::UINT8;
  uint64_t u = 0;        // unsigned integers and bool
  int64_t i = 0;         // signed integers
  double f = 0;          // FLOAT32 / FLOAT64
  std::string str;       // STRING
  ValueType elem_type = ValueType::UINT8;  // ARRAY
  std::vector<Value> array;                // ARRAY

  bool is_integer() const;
  /// Integer value as int64 (throws ds4::Error when not an integer or out of range).
  int64_t as_int() const;
};

/// Limits that keep a hostile file from making the reader allocate absurd amounts.
inline constexpr uint64_t kMaxArrayElements = uint64_t(1) << 24;  // per metadata array
inline constexpr uint32_t kMaxArrayDepth = 8;                     // nested arrays
inline constexpr uint64_t kMaxTensorName = 255;                   // bytes, as in the model store

/// How much parse() checks beyond the header and directory.
struct ParseOptions {
  /// When false, tensors may point past the end of the range: used to re-read a
  /// header blob (bytes [0, data_offset) of a file) kept apart from the data.
  /// Alignment, overlap and size checks still apply.
  bool check_tensor_data = true;
};

struct TensorInfo {
  std::string name;
  std::vector<uint64_t> dims;  // ne[0] (innermost, contiguous) first
  GgmlType type = GgmlType::F32;
  uint64_t offset = 0;         // from the start of the data section
  uint64_t n_elements = 0;
  uint64_t n_bytes = 0;
};

class File {
 public:
  /// Parses `bytes` (the whole file). `source` names it in errors. The span must
  /// outlive the File only for tensor_data().
  static File parse(std::span<const uint8_t> bytes, std::string source);
  static File parse(std::span<const uint8_t> bytes, std::string source, const ParseOptions& opts);
  /// Maps `path` read-only and parses it; the mapping lives as long as the File.
  static File open(const std::string& path);

  uint32_t version() const { return version_; }
  const std::string& source() const { return source_; }
  uint64_t alignment() const { return alignment_; }
  uint64_t data_offset() const { return data_offset_; }     // start of tensor data in the file
  uint64_t header_bytes() const { return header_bytes_; }   // end of the tensor directory
  uint64_t file_size() const { return bytes_.size(); }
  std::span<const uint8_t> bytes() const { return bytes_; }

  const std::vector<std::pair<std::string, Value>>& metadata() const { return kv_; }
  const Value* find(std::string_view key) const;
  /// Typed getters: nullopt when the key is absent; ds4::Error (naming the key
  /// and the expected type) when present with an incompatible type.
  std::optional<std::string> get_string(std::string_view key) const;
  std::optional<int64_t> get_int(std::string_view key) const;
  std::optional<double> get_float(std::string_view key) const;  // any numeric type
  std::optional<bool> get_bool(std::string_view key) const;
  /// Array getters (ds4::Error when the element type does not fit).
  std::optional<std::vector<std::string>> get_string_array(std::string_view key) const;
  std::optional<std::vector<float>> get_float_array(std::string_view key) const;
  std::optional<std::vector<int64_t>> get_int_array(std::string_view key) const;

  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const TensorInfo* find_tensor(std::string_view name) const;
  /// Bytes of one tensor inside the parsed range (ds4::Error when it lies past
  /// the end, as it may after parse with check_tensor_data = false).
  std::span<const uint8_t> tensor_data(const TensorInfo& t) const;

 private:
  std::string source_;
  std::shared_ptr<void> mapping_;  // keeps an mmap alive for open()
  std::span<const uint8_t> bytes_;
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  uint64_t data_offset_ = 0;
  uint64_t header_bytes_ = 0;
  std::vector<std::pair<std::string, Value>> kv_;
  std::map<std::string, size_t, std::less<>> kv_index_;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t, std::less<>> tensor_index_;
};

}  // namespace ds4::gguf
