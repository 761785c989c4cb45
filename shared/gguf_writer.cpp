#include "shared/gguf_writer.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <set>

#include "shared/error.h"

namespace ds4::gguf {

Value make_uint(ValueType t, uint64_t v) {
  Value x;
  x.type = t;
  x.u = v;
  return x;
}

Value make_int(ValueType t, int64_t v) {
  Value x;
  x.type = t;
  x.i = v;
  return x;
}

Value make_float(ValueType t, double v) {
  Value x;
  x.type = t;
  x.f = v;
  return x;
}

Value make_bool(bool v) { return make_uint(ValueType::BOOL, v ? 1 : 0); }

Value make_string(std::string v) {
  Value x;
  x.type = ValueType::STRING;
  x.str = std::move(v);
  return x;
}

Value make_array(ValueType elem_type, std::vector<Value> elems) {
  Value x;
  x.type = ValueType::ARRAY;
  x.elem_type = elem_type;
  x.array = std::move(elems);
  return x;
}

namespace {

// Counts what goes out so padding can be computed.
class Out {
 public:
  explicit Out(const std::function<void(const void*, size_t)>& put) : put_(put) {}
  uint64_t written() const { return written_; }
  void bytes(const void* p, size_t n) {
    put_(p, n);
    written_ += n;
  }
  template <class T>
  void scalar(T v) { bytes(&v, sizeof v); }
  void string(const std::string& s) {
    scalar<uint64_t>(s.size());
    bytes(s.data(), s.size());
  }
  void pad_to(uint64_t align) {
    static const uint8_t zeros[256] = {};
    while (written_ % align != 0) bytes(zeros, size_t(std::min<uint64_t>(sizeof zeros, align - written_ % align)));
  }

 private:
  const std::function<void(const void*, size_t)>& put_;
  uint64_t written_ = 0;
};

void emit_value(Out& out, const std::string& key, const Value& v, bool with_type) {
  if (with_type) out.scalar<uint32_t>(uint32_t(v.type));
  switch (v.type) {
    case ValueType::UINT8: out.scalar<uint8_t>(uint8_t(v.u)); break;
    case ValueType::INT8: out.scalar<int8_t>(int8_t(v.i)); break;
    case ValueType::UINT16: out.scalar<uint16_t>(uint16_t(v.u)); break;
    case ValueType::INT16: out.scalar<int16_t>(int16_t(v.i)); break;
    case ValueType::UINT32: out.scalar<uint32_t>(uint32_t(v.u)); break;
    case ValueType::INT32: out.scalar<int32_t>(int32_t(v.i)); break;
    case ValueType::UINT64: out.scalar<uint64_t>(v.u); break;
    case ValueType::INT64: out.scalar<int64_t>(v.i); break;
    case ValueType::FLOAT32: out.scalar<float>(float(v.f)); break;
    case ValueType::FLOAT64: out.scalar<double>(v.f); break;
    case ValueType::BOOL: out.scalar<uint8_t>(v.u ? 1 : 0); break;
    case ValueType::STRING: out.string(v.str); break;
    case ValueType::ARRAY:
      out.scalar<uint32_t>(uint32_t(v.elem_type));
      out.scalar<uint64_t>(v.array.size());
      for (size_t k = 0; k < v.array.size(); ++k) {
        if (v.array[k].type != v.elem_type) {
          throw Error("gguf writer: key '" + key + "': element " + std::to_string(k) + " is " +
                      std::string(value_type_name(v.array[k].type)) + ", expected " +
                      std::string(value_type_name(v.elem_type)));
        }
        emit_value(out, key, v.array[k], false);
      }
      break;
    default:
      throw Error("gguf writer: key '" + key + "': unknown value type " + std::to_string(uint32_t(v.type)));
  }
}

uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

// Writes through a large buffer to a file descriptor.
class FileOut {
 public:
  FileOut(std::string path, int fd) : path_(std::move(path)), fd_(fd) { buf_.reserve(kBuffer); }
  void put(const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    if (n >= kBuffer) {
      flush();
      write_all(b, n);
      return;
    }
    if (buf_.size() + n > kBuffer) flush();
    buf_.insert(buf_.end(), b, b + n);
  }
  void flush() {
    write_all(buf_.data(), buf_.size());
    buf_.clear();
  }

 private:
  static constexpr size_t kBuffer = size_t(4) << 20;
  void write_all(const uint8_t* p, size_t n) {
    while (n > 0) {
      const ssize_t w = ::write(fd_, p, n);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) throw Error(path_ + ": write failed: " + std::strerror(errno));
      p += w;
      n -= size_t(w);
    }
  }
  std::string path_;
  int fd_;
  std::vector<uint8_t> buf_;
};

}  // namespace

void Writer::set(std::string key, Value v) {
  for (auto& [k, old] : kv_) {
    if (k == key) {
      old = std::move(v);
      return;
    }
  }
  kv_.emplace_back(std::move(key), std::move(v));
}

void Writer::set_string(std::string key, std::string v) { set(std::move(key), make_string(std::move(v))); }
void Writer::set_u32(std::string key, uint32_t v) { set(std::move(key), make_uint(ValueType::UINT32, v)); }
void Writer::set_i32(std::string key, int32_t v) { set(std::move(key), make_int(ValueType::INT32, v)); }
void Writer::set_f32(std::string key, float v) { set(std::move(key), make_float(ValueType::FLOAT32, v)); }
void Writer::set_bool(std::string key, bool v) { set(std::move(key), make_bool(v)); }
void Writer::set_u64(std::string key, uint64_t v) { set(std::move(key), make_uint(ValueType::UINT64, v)); }
void Writer::set_i64(std::string key, int64_t v) { set(std::move(key), make_int(ValueType::INT64, v)); }
void Writer::set_f64(std::string key, double v) { set(std::move(key), make_float(ValueType::FLOAT64, v)); }

void Writer::set_string_array(std::string key, const std::vector<std::string>& v) {
  std::vector<Value> a;
  a.reserve(v.size());
  for (const auto& s : v) a.push_back(make_string(s));
  set(std::move(key), make_array(ValueType::STRING, std::move(a)));
}

void Writer::set_f32_array(std::string key, const std::vector<float>& v) {
  std::vector<Value> a;
  a.reserve(v.size());
  for (float x : v) a.push_back(make_float(ValueType::FLOAT32, x));
  set(std::move(key), make_array(ValueType::FLOAT32, std::move(a)));
}

void Writer::set_i32_array(std::string key, const std::vector<int32_t>& v) {
  std::vector<Value> a;
  a.reserve(v.size());
  for (int32_t x : v) a.push_back(make_int(ValueType::INT32, x));
  set(std::move(key), make_array(ValueType::INT32, std::move(a)));
}

uint64_t Writer::tensor_bytes(const std::vector<uint64_t>& dims, GgmlType type) {
  const std::optional<TypeTraits> traits = type_traits(uint32_t(type));
  if (!traits) throw Error("gguf writer: unknown ggml type " + std::to_string(uint32_t(type)));
  if (dims.empty() || dims.size() > 4) {
    throw Error("gguf writer: " + std::to_string(dims.size()) + " dimensions (expected 1..4)");
  }
  uint64_t n = 1;
  for (uint64_t d : dims) {
    if (d == 0 || __builtin_mul_overflow(n, d, &n)) throw Error("gguf writer: dimension 0 or element count overflow");
  }
  if (dims[0] % traits->block_elems != 0) {
    throw Error("gguf writer: ne[0] = " + std::to_string(dims[0]) + " is not a multiple of the " +
                std::string(traits->name) + " block size " + std::to_string(traits->block_elems));
  }
  uint64_t bytes = 0;
  if (__builtin_mul_overflow(n / traits->block_elems, traits->block_bytes, &bytes)) {
    throw Error("gguf writer: tensor byte size overflows 64 bits");
  }
  return bytes;
}

void Writer::add(Tensor t) {
  if (t.name.size() > kMaxTensorName) {
    throw Error("gguf writer: tensor name '" + t.name + "' is longer than " + std::to_string(kMaxTensorName) + " bytes");
  }
  for (const Tensor& o : tensors_) {
    if (o.name == t.name) throw Error("gguf writer: duplicate tensor '" + t.name + "'");
  }
  try {
    t.n_bytes = tensor_bytes(t.dims, t.type);
  } catch (const Error& e) {
    throw Error(std::string(e.what()) + " (tensor '" + t.name + "')");
  }
  tensors_.push_back(std::move(t));
}

void Writer::add_tensor(std::string name, std::vector<uint64_t> dims, GgmlType type, std::vector<uint8_t> data) {
  Tensor t{std::move(name), std::move(dims), type, std::move(data), nullptr, 0};
  const size_t have = t.data.size();
  const std::string n = t.name;
  add(std::move(t));
  if (tensors_.back().n_bytes != have) {
    const uint64_t want = tensors_.back().n_bytes;
    tensors_.pop_back();
    throw Error("gguf writer: tensor '" + n + "' has " + std::to_string(have) + " bytes of data, its type and dims need " +
                std::to_string(want));
  }
}

void Writer::add_tensor_generated(std::string name, std::vector<uint64_t> dims, GgmlType type, TensorGenerator gen) {
  if (!gen) throw Error("gguf writer: tensor '" + name + "' has no generator");
  add(Tensor{std::move(name), std::move(dims), type, {}, std::move(gen), 0});
}

uint64_t Writer::alignment() const {
  for (const auto& [k, v] : kv_) {
    if (k != "general.alignment") continue;
    const int64_t a = v.is_integer() ? v.as_int() : 0;
    if (a <= 0 || (a & (a - 1)) != 0) throw Error("gguf writer: general.alignment must be a power of two");
    return uint64_t(a);
  }
  return 32;
}

void Writer::emit(const std::function<void(const void*, size_t)>& put) const {
  const uint64_t align = alignment();
  Out out(put);
  out.bytes("GGUF", 4);
  out.scalar<uint32_t>(3);
  out.scalar<uint64_t>(tensors_.size());
  out.scalar<uint64_t>(kv_.size());
  for (const auto& [k, v] : kv_) {
    out.string(k);
    emit_value(out, k, v, true);
  }
  uint64_t offset = 0;
  for (const Tensor& t : tensors_) {
    out.string(t.name);
    out.scalar<uint32_t>(uint32_t(t.dims.size()));
    for (uint64_t d : t.dims) out.scalar<uint64_t>(d);
    out.scalar<uint32_t>(uint32_t(t.type));
    out.scalar<uint64_t>(offset);
    offset = align_up(offset + t.n_bytes, align);
  }
  out.pad_to(align);
  std::vector<uint8_t> scratch;
  for (const Tensor& t : tensors_) {
    if (t.gen) {
      scratch.assign(t.n_bytes, 0);
      t.gen(scratch.data(), t.n_bytes);
      out.bytes(scratch.data(), scratch.size());
    } else {
      out.bytes(t.data.data(), t.data.size());
    }
    out.pad_to(align);
  }
}

std::vector<uint8_t> Writer::to_bytes() const {
  std::vector<uint8_t> bytes;
  emit([&](const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    bytes.insert(bytes.end(), b, b + n);
  });
  return bytes;
}

void Writer::write(const std::string& out_path) const {
  // The file is written beside its target and renamed over it: a symlink is
  // followed (the rename would replace the link), and only a regular file is
  // replaced (not /dev/null, a FIFO, a folder).
  namespace fs = std::filesystem;
  fs::path target = out_path;
  for (int hops = 0; fs::is_symlink(fs::symlink_status(target)); ++hops) {  // a dangling link too
    if (hops == 40) throw Error(out_path + ": too many levels of symbolic links");
    const fs::path next = fs::read_symlink(target);
    target = next.is_absolute() ? next : target.parent_path() / next;
  }
  const std::string path = target.string();
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode))
    throw Error(out_path + " is not a regular file: a model is written to a new file or over a regular one");
  // Tensors of a mistyped size would fill the disk before failing: check first.
  uint64_t data = 0;
  for (const Tensor& t : tensors_) data = align_up(data + t.n_bytes, alignment());
  const fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  struct statvfs vfs {};
  if (::statvfs(dir.c_str(), &vfs) == 0 && data > uint64_t(vfs.f_bavail) * vfs.f_frsize)
    throw Error(out_path + ": the model's tensors take " + std::to_string(data / 1000000) + " MB, and " + dir.string() +
                " has " + std::to_string(uint64_t(vfs.f_bavail) * vfs.f_frsize / 1000000) + " MB free");
  const std::string tmp = path + ".tmp-" + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw Error(tmp + ": cannot create: " + std::strerror(errno));
  try {
    FileOut out(tmp, fd);
    emit([&](const void* p, size_t n) { out.put(p, n); });
    out.flush();
    if (::fsync(fd) != 0) throw Error(tmp + ": fsync failed: " + std::strerror(errno));
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  if (::close(fd) != 0) {
    ::unlink(tmp.c_str());
    throw Error(tmp + ": close failed: " + std::strerror(errno));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int e = errno;
    ::unlink(tmp.c_str());
    throw Error(path + ": cannot rename " + tmp + " to it: " + std::strerror(e));
  }
}

}  // namespace ds4::gguf
