#pragma once
/// model.keep_resident: the model file of an exec engine mapped by the
/// supervisor and its pages kept in memory. The engine's own mmap of the
/// file shares these page-cache pages, so an engine restarted after a kill
/// reads no disk even when memory pressure would have evicted them.
/// MADV_WILLNEED reads the file ahead, mlock keeps it (root, or
/// LimitMEMLOCK= as large as the file); where the lock is refused, touch()
/// brings back what the kernel evicted, called now and then by the owner.

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>

namespace ds4::sup {

class ResidentFile {
 public:
  /// Maps `path` read-only and starts reading and locking it on a thread of
  /// its own (a large file takes a while; the engine starts meanwhile).
  /// Throws ds4::Error when the file cannot be opened or mapped.
  explicit ResidentFile(const std::string& path);
  ~ResidentFile();
  ResidentFile(const ResidentFile&) = delete;
  ResidentFile& operator=(const ResidentFile&) = delete;

  enum class Mode { loading, locked, touched };
  Mode mode() const { return mode_.load(); }
  /// Why the lock was refused (mode touched), for the warning.
  const std::string& lock_error() const { return lock_error_; }
  uint64_t bytes() const { return size_; }
  /// Pages of the file in memory now (mincore), in bytes.
  uint64_t resident_bytes() const;
  /// Reads one byte of each page not in memory: what the kernel evicted
  /// comes back. Returns the bytes brought back.
  uint64_t touch();
  static const char* mode_name(Mode m);

 private:
  void hold();
  std::string path_;
  void* map_ = nullptr;
  uint64_t size_ = 0;
  std::atomic<Mode> mode_{Mode::loading};
  std::string lock_error_;  // written before mode_ leaves loading
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace ds4::sup
