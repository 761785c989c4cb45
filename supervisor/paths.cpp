#include "supervisor/paths.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "shared/error.h"
#include "shared/files.h"

namespace ds4::sup {

std::string runtime_dir() { return ds4_runtime_dir(); }

void ensure_private_dir(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) throw Error("cannot create " + dir + ": " + ec.message());
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0) throw Error("cannot stat " + dir + ": " + std::strerror(errno));
  if (!S_ISDIR(st.st_mode)) throw Error(dir + " is not a directory");
  if (st.st_uid != getuid()) throw Error(dir + " belongs to uid " + std::to_string(st.st_uid) + ", not to us");
  if (::chmod(dir.c_str(), 0700) != 0) throw Error("cannot chmod 0700 " + dir + ": " + std::strerror(errno));
}

std::string admin_socket_path() { return runtime_dir() + "/admin.sock"; }

std::string self_dir() {
  std::error_code ec;
  auto p = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::string(".") : p.parent_path().string();
}

}  // namespace ds4::sup
