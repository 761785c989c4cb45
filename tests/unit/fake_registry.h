#pragma once
// An in-memory worker registry for the proxy's unit tests: a test sets the
// worker list and calls changed() as the supervisor's registry would.
#include <functional>
#include <utility>
#include <vector>

#include "shared/worker_registry.h"

namespace ds4::test {

class FakeRegistry : public ds4::sup::WorkerRegistry {
 public:
  std::vector<ds4::sup::WorkerInfo> list;
  std::vector<ds4::sup::WorkerInfo> workers() const override { return list; }
  void on_change(std::function<void()> fn) override { fns_.push_back(std::move(fn)); }
  void changed() {
    for (auto& f : fns_) f();
  }

 private:
  std::vector<std::function<void()>> fns_;
};

}  // namespace ds4::test
