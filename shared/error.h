#pragma once
/// ds4's one error type. Library code throws it with a message that names the
/// place (file, offset, key, line:column) and what was expected; only a
/// program's main logs it, once.

#include <stdexcept>
#include <string>

namespace ds4 {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

}  // namespace ds4
