// The supervisor's GPU decisions follow what ds4-worker says it runs
// (`ds4-worker capabilities`), not how the supervisor was built.
#include <doctest/doctest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <string>

#include "shared/error.h"
#include "supervisor/worker_capabilities.h"

using namespace ds4;
using namespace ds4::sup;

namespace {

/// A stand-in ds4-worker that answers `capabilities` with `body` (a shell script's).
std::string fake_worker(const std::string& name, const std::string& body) {
  const std::string path = "/tmp/ds4-test-caps-" + std::to_string(::getpid()) + "-" + name;
  std::ofstream(path) << "#!/bin/sh\n[ \"$1\" = capabilities ] || exit 2\n" << body << "\n";
  ::chmod(path.c_str(), 0755);
  return path;
}

Device cuda0() {
  Device d;
  d.kind = Device::Kind::cuda;
  return d;
}

}  // namespace

TEST_CASE("worker capabilities: parsed, and what is wrong with an answer said") {
  const WorkerCapabilities c = parse_worker_capabilities(
      R"({"backends":["cpu","cuda"],"weight_types":["F32","Q8_0"],"kv_cache":["f16","q8_0"]})");
  CHECK(c.has_backend("cuda"));
  CHECK(c.has_backend("cpu"));
  CHECK(c.weight_types == std::vector<std::string>{"F32", "Q8_0"});
  CHECK_THROWS_WITH_AS(parse_worker_capabilities("usage: ds4-worker"),
                       "ds4-worker capabilities: its answer is not a JSON object: 'usage: ds4-worker'", Error);
  CHECK_THROWS_WITH_AS(parse_worker_capabilities("{}"), "ds4-worker capabilities: no \"backends\" in its answer", Error);
  CHECK_THROWS_WITH_AS(parse_worker_capabilities(R"({"backends":"cpu"})"),
                       "ds4-worker capabilities: \"backends\" is not a list", Error);
}

TEST_CASE("worker capabilities: the supervisor's device decisions follow the worker's answer") {
  std::string why;
  const std::string cpu_worker = fake_worker("cpu", R"(echo '{"backends":["cpu"],"weight_types":["F32"]}')");
  const std::string gpu_worker = fake_worker("gpu", R"(echo '{"backends":["cpu","cuda"],"weight_types":["F32"]}')");
  const auto cpu = ask_worker_capabilities(cpu_worker, &why);
  REQUIRE_MESSAGE(cpu, why);
  const auto gpu = ask_worker_capabilities(gpu_worker, &why);
  REQUIRE_MESSAGE(gpu, why);

  // cuda:0 is refused before the load for a CPU-only worker, never for a GPU one.
  CHECK(device_refusal(cuda0(), cpu).starts_with("workers.device cuda:0: this build has no CUDA backend"));
  CHECK(device_refusal(cuda0(), gpu) == "");
  CHECK(device_refusal(Device{}, cpu) == "");  // auto runs on the CPU then
  // auto: a GPU only where the worker has the backend and the machine a driver.
  CHECK(!workers_on_gpu(Device{}, cpu, true));
  CHECK(workers_on_gpu(Device{}, gpu, true));
  CHECK(!workers_on_gpu(Device{}, gpu, false));
  CHECK(workers_on_gpu(cuda0(), cpu, false));  // asked for: its workers say why they cannot

  // A worker that does not answer refuses nothing; why is said.
  const std::string old_worker = fake_worker("old", "echo \"ds4-worker: unknown command '$1'\" >&2; exit 2");
  const auto unknown = ask_worker_capabilities(old_worker, &why);
  CHECK(!unknown);
  CHECK(why == old_worker + " capabilities exited with status 2");
  CHECK(device_refusal(cuda0(), unknown) == "");
  CHECK(workers_on_gpu(Device{}, unknown, true));
  CHECK(!ask_worker_capabilities("/nonexistent/ds4-worker", &why));
  CHECK(why == "/nonexistent/ds4-worker capabilities exited with status 127");
  const std::string slow = fake_worker("slow", "exec sleep 30");
  CHECK(!ask_worker_capabilities(slow, &why, std::chrono::milliseconds(200)));
  CHECK(why == slow + " capabilities did not answer within 200 ms");
  for (const auto& p : {cpu_worker, gpu_worker, old_worker, slow}) ::unlink(p.c_str());
}


namespace {
std::string built_worker() {
  char self[4096];
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0) return "";
  std::string dir(self, size_t(n));
  return dir.substr(0, dir.rfind('/')) + "/ds4-worker";
}
}  // namespace

TEST_CASE("worker capabilities: this build's ds4-worker answers what the supervisor reads" *
          doctest::skip(::access(built_worker().c_str(), X_OK) != 0)) {
  std::string why;
  const auto caps = ask_worker_capabilities(built_worker(), &why);
  REQUIRE_MESSAGE(caps, why);
  CHECK(caps->has_backend("cpu"));
  CHECK(!caps->weight_types.empty());
  CHECK(caps->kv_cache == std::vector<std::string>{"f16", "q8_0"});
}
