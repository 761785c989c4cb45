#include "shared/gguf.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <numeric>

#include "shared/error.h"

namespace ds4::gguf {

namespace {

constexpr uint8_t kMagic[4] = {'G', 'G', 'U', 'F'};
constexpr uint32_t kMaxDims = 4;

// Smallest encodings, used to reject counts that cannot fit in the bytes left
// before anything is allocated for them.
constexpr uint64_t kMinKvBytes = 8 + 4 + 1;                  // key length, type, 1-byte value
constexpr uint64_t kMinTensorInfoBytes = 8 + 4 + 8 + 4 + 8;  // name length, n_dims, 1 dim, type, offset

// Size of a scalar in the file; 0 for STRING and ARRAY, which have their own encodings.
uint64_t scalar_size(ValueType t) {
  switch (t) {
    case ValueType::UINT8: case ValueType::INT8: case ValueType::BOOL: return 1;
    case ValueType::UINT16: case ValueType::INT16: return 2;
    case ValueType::UINT32: case ValueType::INT32: case ValueType::FLOAT32: return 4;
    case ValueType::UINT64: case ValueType::INT64: case ValueType::FLOAT64: return 8;
    case ValueType::STRING: case ValueType::ARRAY: return 0;
  }
  return 0;
}

// Smallest encoding of one array element of type `t`.
uint64_t min_element_size(ValueType t) {
  if (t == ValueType::STRING) return 8;
  if (t == ValueType::ARRAY) return 4 + 8;
  return scalar_size(t);
}

bool is_float_type(ValueType t) { return t == ValueType::FLOAT32 || t == ValueType::FLOAT64; }

bool is_integer_type(ValueType t) {
  switch (t) {
    case ValueType::UINT8: case ValueType::INT8: case ValueType::UINT16: case ValueType::INT16:
    case ValueType::UINT32: case ValueType::INT32: case ValueType::UINT64: case ValueType::INT64:
      return true;
    default:
      return false;
  }
}

bool is_signed_type(ValueType t) {
  return t == ValueType::INT8 || t == ValueType::INT16 || t == ValueType::INT32 || t == ValueType::INT64;
}

std::string describe(const Value& v) {
  std::string s(value_type_name(v.type));
  if (v.type == ValueType::ARRAY) s += " of " + std::string(value_type_name(v.elem_type));
  return s;
}

std::string quoted(std::string_view s) { return "'" + std::string(s) + "'"; }

// A bounds-checked cursor over the file. Every read names what it was reading
// so that a truncated file says where it ended.
class Reader {
 public:
  Reader(std::span<const uint8_t> bytes, const std::string& source) : bytes_(bytes), source_(source) {}

  uint64_t pos() const { return pos_; }
  uint64_t remaining() const { return bytes_.size() - pos_; }
  uint64_t size() const { return bytes_.size(); }

  [[noreturn]] void fail(uint64_t at, const std::string& what) const {
    throw Error(source_ + ": offset " + std::to_string(at) + ": " + what);
  }

  void need(uint64_t n, std::string_view what) const {
    if (n > remaining()) {
      fail(pos_, "file ends inside " + std::string(what) + ": need " + std::to_string(n) +
                     " bytes, " + std::to_string(remaining()) + " left (size " +
                     std::to_string(size()) + ")");
    }
  }

  template <class T>
  T read(std::string_view what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, bytes_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }

  std::string read_string(std::string_view what, uint64_t max_len = UINT64_MAX) {
    const uint64_t at = pos_;
    const uint64_t len = read<uint64_t>(what);
    if (len > remaining()) {
      fail(at, std::string(what) + ": string length " + std::to_string(len) +
                   " runs past end of file (size " + std::to_string(size()) + ")");
    }
    if (len > max_len) {
      fail(at, std::string(what) + ": length " + std::to_string(len) + " exceeds the limit of " +
                   std::to_string(max_len) + " bytes");
    }
    std::string s(reinterpret_cast<const char*>(bytes_.data() + pos_), len);
    pos_ += len;
    return s;
  }

 private:
  std::span<const uint8_t> bytes_;
  const std::string& source_;
  uint64_t pos_ = 0;
};

ValueType read_value_type(Reader& r, const std::string& what) {
  const uint64_t at = r.pos();
  const uint32_t t = r.read<uint32_t>(what + " type");
  if (t > uint32_t(ValueType::FLOAT64)) {
    r.fail(at, what + ": unknown value type " + std::to_string(t) + " (expected 0..12)");
  }
  return ValueType(t);
}

Value read_value(Reader& r, ValueType type, const std::string& what, uint32_t depth);

Value read_array(Reader& r, const std::string& what, uint32_t depth) {
  const uint64_t at = r.pos();
  if (depth >= kMaxArrayDepth) {
    r.fail(at, what + ": arrays nested deeper than " + std::to_string(kMaxArrayDepth) + " levels");
  }
  Value v;
  v.type = ValueType::ARRAY;
  v.elem_type = read_value_type(r, what + " element");
  const uint64_t count_at = r.pos();
  const uint64_t count = r.read<uint64_t>(what + " array length");
  const uint64_t min_size = min_element_size(v.elem_type);
  if (count > r.remaining() / min_size) {
    r.fail(count_at, what + ": array of " + std::to_string(count) + " " +
                         std::string(value_type_name(v.elem_type)) + " elements runs past end of file (size " +
                         std::to_string(r.size()) + ")");
  }
  if (count > kMaxArrayElements) {
    r.fail(count_at, what + ": array of " + std::to_string(count) + " elements exceeds the limit of " +
                         std::to_string(kMaxArrayElements));
  }
  v.array.reserve(count);
  for (uint64_t i = 0; i < count; ++i) {
    v.array.push_back(read_value(r, v.elem_type, what + "[" + std::to_string(i) + "]", depth + 1));
  }
  return v;
}

Value read_value(Reader& r, ValueType type, const std::string& what, uint32_t depth) {
  Value v;
  v.type = type;
  switch (type) {
    case ValueType::UINT8: v.u = r.read<uint8_t>(what); break;
    case ValueType::INT8: v.i = r.read<int8_t>(what); break;
    case ValueType::UINT16: v.u = r.read<uint16_t>(what); break;
    case ValueType::INT16: v.i = r.read<int16_t>(what); break;
    case ValueType::UINT32: v.u = r.read<uint32_t>(what); break;
    case ValueType::INT32: v.i = r.read<int32_t>(what); break;
    case ValueType::UINT64: v.u = r.read<uint64_t>(what); break;
    case ValueType::INT64: v.i = r.read<int64_t>(what); break;
    case ValueType::FLOAT32: v.f = r.read<float>(what); break;
    case ValueType::FLOAT64: v.f = r.read<double>(what); break;
    case ValueType::BOOL: v.u = r.read<uint8_t>(what) != 0; break;
    case ValueType::STRING: v.str = r.read_string(what); break;
    case ValueType::ARRAY: return read_array(r, what, depth);
  }
  return v;
}

// a * b, or false on overflow.
bool mul_overflows(uint64_t a, uint64_t b, uint64_t* out) { return __builtin_mul_overflow(a, b, out); }
bool add_overflows(uint64_t a, uint64_t b, uint64_t* out) { return __builtin_add_overflow(a, b, out); }

std::string range_str(uint64_t begin, uint64_t end) {
  return "[" + std::to_string(begin) + ", " + std::to_string(end) + ")";
}

}  // namespace

std::string_view value_type_name(ValueType t) {
  switch (t) {
    case ValueType::UINT8: return "uint8";
    case ValueType::INT8: return "int8";
    case ValueType::UINT16: return "uint16";
    case ValueType::INT16: return "int16";
    case ValueType::UINT32: return "uint32";
    case ValueType::INT32: return "int32";
    case ValueType::FLOAT32: return "float32";
    case ValueType::BOOL: return "bool";
    case ValueType::STRING: return "string";
    case ValueType::ARRAY: return "array";
    case ValueType::UINT64: return "uint64";
    case ValueType::INT64: return "int64";
    case ValueType::FLOAT64: return "float64";
  }
  return "unknown";
}

bool Value::is_integer() const { return is_integer_type(type); }

int64_t Value::as_int() const {
  if (!is_integer()) throw Error("expected an integer, got " + describe(*this));
  if (is_signed_type(type)) return i;
  if (u > uint64_t(INT64_MAX)) throw Error("integer " + std::to_string(u) + " does not fit int64");
  return int64_t(u);
}

File File::parse(std::span<const uint8_t> bytes, std::string source) {
  return parse(bytes, std::move(source), ParseOptions{});
}

File File::parse(std::span<const uint8_t> bytes, std::string source, const ParseOptions& opts) {
  File f;
  f.source_ = std::move(source);
  f.bytes_ = bytes;
  Reader r(bytes, f.source_);

  // Header: magic, version, counts.
  r.need(4, "the magic");
  if (std::memcmp(bytes.data(), kMagic, 4) != 0) {
    r.fail(0, "bad magic: expected 'GGUF' (47 47 55 46), this is not a GGUF file");
  }
  r.read<uint32_t>("the magic");
  f.version_ = r.read<uint32_t>("the version");
  if (f.version_ == 1) {
    r.fail(4, "GGUF version 1 is not supported (expected 2 or 3; convert the file with a current llama.cpp)");
  }
  if (f.version_ != 2 && f.version_ != 3) {
    r.fail(4, "unsupported GGUF version " + std::to_string(f.version_) + " (expected 2 or 3)");
  }
  const uint64_t n_tensors = r.read<uint64_t>("the tensor count");
  const uint64_t n_kv_at = r.pos();
  const uint64_t n_kv = r.read<uint64_t>("the metadata count");
  if (n_kv > r.remaining() / kMinKvBytes) {
    r.fail(n_kv_at, "metadata count " + std::to_string(n_kv) + " cannot fit in the " +
                        std::to_string(r.remaining()) + " bytes left (size " + std::to_string(r.size()) + ")");
  }

  // Metadata.
  for (uint64_t k = 0; k < n_kv; ++k) {
    const uint64_t at = r.pos();
    const std::string what = "metadata key " + std::to_string(k);
    std::string key = r.read_string(what);
    const std::string named = what + " " + quoted(key);
    const ValueType type = read_value_type(r, named);
    Value v = read_value(r, type, named, 0);
    if (!f.kv_index_.emplace(key, f.kv_.size()).second) {
      r.fail(at, named + ": duplicate key");
    }
    f.kv_.emplace_back(std::move(key), std::move(v));
  }

  if (const Value* a = f.find("general.alignment")) {
    if (!a->is_integer() || (is_signed_type(a->type) ? a->i : int64_t(a->u)) <= 0) {
      throw Error(f.source_ + ": key 'general.alignment': expected a positive integer, got " + describe(*a));
    }
    const uint64_t align = is_signed_type(a->type) ? uint64_t(a->i) : a->u;
    if ((align & (align - 1)) != 0 || align > (uint64_t(1) << 30)) {
      throw Error(f.source_ + ": key 'general.alignment': " + std::to_string(align) +
                  " is not a power of two up to 2^30");
    }
    f.alignment_ = align;
  }

  // Tensor directory.
  const uint64_t n_tensors_at = r.pos();
  if (n_tensors > r.remaining() / kMinTensorInfoBytes) {
    r.fail(n_tensors_at, "tensor count " + std::to_string(n_tensors) + " cannot fit in the " +
                             std::to_string(r.remaining()) + " bytes left (size " + std::to_string(r.size()) + ")");
  }
  std::vector<uint64_t> info_at;
  f.tensors_.reserve(n_tensors);
  for (uint64_t t = 0; t < n_tensors; ++t) {
    const uint64_t at = r.pos();
    info_at.push_back(at);
    const std::string what = "tensor " + std::to_string(t);
    TensorInfo info;
    info.name = r.read_string(what + " name", kMaxTensorName);
    const std::string named = "tensor " + quoted(info.name);
    const uint32_t n_dims = r.read<uint32_t>(named + " n_dims");
    if (n_dims == 0 || n_dims > kMaxDims) {
      r.fail(at, named + ": n_dims " + std::to_string(n_dims) + " (expected 1.." + std::to_string(kMaxDims) + ")");
    }
    info.n_elements = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
      const uint64_t ne = r.read<uint64_t>(named + " dimension " + std::to_string(d));
      if (ne == 0) r.fail(at, named + ": dimension " + std::to_string(d) + " is 0 (expected >= 1)");
      if (mul_overflows(info.n_elements, ne, &info.n_elements)) {
        r.fail(at, named + ": element count overflows 64 bits at dimension " + std::to_string(d));
      }
      info.dims.push_back(ne);
    }
    const uint32_t type = r.read<uint32_t>(named + " type");
    const std::optional<TypeTraits> traits = type_traits(type);
    if (!traits) r.fail(at, named + ": unknown ggml type " + std::to_string(type));
    info.type = GgmlType(type);
    if (info.dims[0] % traits->block_elems != 0) {
      r.fail(at, named + ": ne[0] = " + std::to_string(info.dims[0]) + " is not a multiple of the " +
                     std::string(traits->name) + " block size " + std::to_string(traits->block_elems));
    }
    if (mul_overflows(info.n_elements / traits->block_elems, traits->block_bytes, &info.n_bytes)) {
      r.fail(at, named + ": byte size overflows 64 bits");
    }
    info.offset = r.read<uint64_t>(named + " offset");
    if (info.offset % f.alignment_ != 0) {
      r.fail(at, named + ": data offset " + std::to_string(info.offset) + " is not a multiple of the alignment " +
                     std::to_string(f.alignment_));
    }
    if (!f.tensor_index_.emplace(info.name, f.tensors_.size()).second) {
      r.fail(at, named + ": duplicate tensor name");
    }
    f.tensors_.push_back(std::move(info));
  }
  f.header_bytes_ = r.pos();
  if (add_overflows(f.header_bytes_, f.alignment_ - 1, &f.data_offset_)) {
    r.fail(f.header_bytes_, "data section offset overflows 64 bits");
  }
  f.data_offset_ &= ~(f.alignment_ - 1);

  // Tensor data: inside the file (when asked) and never overlapping.
  for (size_t t = 0; t < f.tensors_.size(); ++t) {
    const TensorInfo& info = f.tensors_[t];
    uint64_t begin = 0, end = 0;
    if (add_overflows(f.data_offset_, info.offset, &begin) || add_overflows(begin, info.n_bytes, &end)) {
      r.fail(info_at[t], "tensor " + quoted(info.name) + ": data offset " + std::to_string(info.offset) +
                             " + size " + std::to_string(info.n_bytes) + " overflows 64 bits");
    }
    if (opts.check_tensor_data && end > bytes.size()) {
      r.fail(info_at[t], "tensor " + quoted(info.name) + ": data " + range_str(begin, end) +
                             " runs past end of file (size " + std::to_string(bytes.size()) + ")");
    }
  }
  std::vector<size_t> order(f.tensors_.size());
  std::iota(order.begin(), order.end(), size_t(0));
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return f.tensors_[a].offset < f.tensors_[b].offset; });
  for (size_t k = 1; k < order.size(); ++k) {
    const TensorInfo& prev = f.tensors_[order[k - 1]];
    const TensorInfo& cur = f.tensors_[order[k]];
    if (prev.offset + prev.n_bytes > cur.offset) {
      const uint64_t base = f.data_offset_;
      r.fail(info_at[order[k]], "tensor " + quoted(cur.name) + ": data " +
                                    range_str(base + cur.offset, base + cur.offset + cur.n_bytes) +
                                    " overlaps tensor " + quoted(prev.name) + " " +
                                    range_str(base + prev.offset, base + prev.offset + prev.n_bytes));
    }
  }
  return f;
}

File File::open(const std::string& path) {
  // O_NONBLOCK: opening a FIFO waits for a writer otherwise (the check below refuses it).
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) throw Error(path + ": cannot open: " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    throw Error(path + ": cannot stat: " + std::strerror(e));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw Error(path + ": not a regular file");
  }
  const size_t size = size_t(st.st_size);
  std::shared_ptr<void> mapping;
  if (size > 0) {
    void* p = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
    const int e = errno;
    ::close(fd);
    if (p == MAP_FAILED) throw Error(path + ": cannot map " + std::to_string(size) + " bytes: " + std::strerror(e));
    mapping = std::shared_ptr<void>(p, [size](void* q) { ::munmap(q, size); });
  } else {
    ::close(fd);
  }
  File f = parse(std::span<const uint8_t>(static_cast<const uint8_t*>(mapping.get()), size), path);
  f.mapping_ = std::move(mapping);
  return f;
}

const Value* File::find(std::string_view key) const {
  const auto it = kv_index_.find(key);
  return it == kv_index_.end() ? nullptr : &kv_[it->second].second;
}

namespace {

[[noreturn]] void wrong_type(const std::string& source, std::string_view key, std::string_view expected,
                             const Value& v) {
  throw Error(source + ": key " + quoted(key) + ": expected " + std::string(expected) + ", got " + describe(v));
}

double numeric(const Value& v) {
  if (is_float_type(v.type)) return v.f;
  return is_signed_type(v.type) ? double(v.i) : double(v.u);
}

bool is_numeric(ValueType t) { return is_integer_type(t) || is_float_type(t); }

}  // namespace

std::optional<std::string> File::get_string(std::string_view key) const {
  const Value* v = find(key);
  if (!v) return std::nullopt;
  if (v->type != ValueType::STRING) wrong_type(source_, key, "string", *v);
  return v->str;
}

std::optional<int64_t> File::get_int(std::string_view key) const {
  const Value* v = find(key);
  if (!v) return std::nullopt;
  if (!v->is_integer()) wrong_type(source_, key, "an integer", *v);
  if (!is_signed_type(v->type) && v->u > uint64_t(INT64_MAX)) {
    throw Error(source_ + ": key " + quoted(key) + ": " + std::to_string(v->u) + " does not fit int64");
  }
  return v->as_int();
}

std::optional<double> File::get_float(std::string_view key) const {
  const Value* v = find(key);
  if (!v) return std::nullopt;
  if (!is_numeric(v->type)) wrong_type(source_, key, "a number", *v);
  return numeric(*v);
}

std::optional<bool> File::get_bool(std::string_view key) const {
  const Value* v = find(key);
  if (!v) return std::nullopt;
  if (v->type != ValueType::BOOL) wrong_type(source_, key, "bool", *v);
  return v->u != 0;
}

std::optional<std::vector<std::string>> File::get_string_array(std::string_view key) const {
  const Value* v = find(key);
  if (!v) return std::nullopt;
  if (v->type != ValueType::ARRAY || v->elem_type != ValueType::STRING) wrong_type(source_, key, "array of string", *v);
  std::vector<std::string> out;
  out.reserve(v->array.size());
  for (const Value& e : v->array) out.push_back(e.str);
  return out;
}

std::optional<std::vector<float>> File::get_float_array(std::string_view key) const {
  const Value* v = find(key);
  if (!v) return std::nullopt;
  if (v->type != ValueType::ARRAY || !is_numeric(v->elem_type)) wrong_type(source_, key, "array of numbers", *v);
  std::vector<float> out;
  out.reserve(v->array.size());
  for (const Value& e : v->array) out.push_back(float(numeric(e)));
  return out;
}

std::optional<std::vector<int64_t>> File::get_int_array(std::string_view key) const {
  const Value* v = find(key);
  if (!v) return std::nullopt;
  if (v->type != ValueType::ARRAY || !is_integer_type(v->elem_type)) wrong_type(source_, key, "array of integers", *v);
  std::vector<int64_t> out;
  out.reserve(v->array.size());
  for (size_t k = 0; k < v->array.size(); ++k) {
    const Value& e = v->array[k];
    if (!is_signed_type(e.type) && e.u > uint64_t(INT64_MAX)) {
      throw Error(source_ + ": key " + quoted(key) + "[" + std::to_string(k) + "]: " + std::to_string(e.u) +
                  " does not fit int64");
    }
    out.push_back(e.as_int());
  }
  return out;
}

const TensorInfo* File::find_tensor(std::string_view name) const {
  const auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

std::span<const uint8_t> File::tensor_data(const TensorInfo& t) const {
  const uint64_t begin = data_offset_ + t.offset;
  if (begin > bytes_.size() || t.n_bytes > bytes_.size() - begin) {
    throw Error(source_ + ": tensor " + quoted(t.name) + ": data " + range_str(begin, begin + t.n_bytes) +
                " is not inside the parsed bytes (size " + std::to_string(bytes_.size()) + ")");
  }
  return bytes_.subspan(begin, t.n_bytes);
}

}  // namespace ds4::gguf
