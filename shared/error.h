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

/// A worker's memory plan (KV cache and scratch at its context) does not fit
/// the memory free, on the host or on the GPU. The worker then exits with
/// kExitDoesNotFit, and the supervisor restarts it one rung lower at once
/// instead of counting a crash.
class DoesNotFit : public Error {
 public:
  using Error::Error;
};
inline constexpr int kExitDoesNotFit = 75;

/// `ds4-worker hold` on an integrated GPU (memory shared with the host): a
/// copy of the weights would be a second one in the same memory, so workers
/// read them in place and there is nothing to hold. The supervisor does not
/// restart a holder that exits with this.
inline constexpr int kExitNothingToHold = 76;

}  // namespace ds4
