#pragma once
/// The model segments this supervisor instance made or served, kept in a
/// file of its private runtime folder (`segments.list`, one name a line), so
/// that its sweeps remove only its own: another instance on the same machine
/// (another runtime folder) or another user keeps every segment it has. A
/// name stays listed from the moment it is served until a sweep removes it,
/// across restarts of the supervisor.
///
/// Only the io thread uses it. A file that cannot be read counts as empty
/// (nothing is removed); one that cannot be written is logged, and the names
/// are still known for the life of the process.

#include <set>
#include <string>

namespace ds4::sup {

class SegmentLedger {
 public:
  /// Reads `path` (a missing file is an empty ledger).
  explicit SegmentLedger(std::string path);

  bool contains(const std::string& name) const { return names_.count(name) > 0; }
  /// Adds `name` and writes the file (atomically: a temporary file renamed).
  void add(const std::string& name);
  /// Drops `name` and writes the file.
  void remove(const std::string& name);
  const std::set<std::string>& names() const { return names_; }
  const std::string& path() const { return path_; }

 private:
  void write() const;

  std::string path_;
  std::set<std::string> names_;
};

}  // namespace ds4::sup
