// config/ds4.yaml loading and validation (shared/config.h).
#include <doctest/doctest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include "shared/config.h"
#include "shared/error.h"

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using ds4::Bytes;

namespace {

constexpr Bytes GiB = Bytes(1) << 30;
constexpr Bytes MiB = Bytes(1) << 20;
const fs::path kFile = "/etc/ds4test/ds4.yaml";  // never read: parse_config gets the text

ds4::Config parse(const std::string& yaml, Bytes mem_total = 64 * GiB) {
  return ds4::parse_config(yaml, kFile, {.mem_total = mem_total});
}

/// The error text for `yaml` ("" when it loads), reported as config/ds4.yaml.
std::string errors(const std::string& yaml, Bytes mem_total = 64 * GiB) {
  try {
    ds4::parse_config(yaml, "config/ds4.yaml", {.mem_total = mem_total});
  } catch (const ds4::Error& e) {
    return e.what();
  }
  return "";
}

struct TempDir {
  fs::path path;
  TempDir() {
    char tmpl[] = "/tmp/ds4-config-test.XXXXXX";
    path = mkdtemp(tmpl);
  }
  ~TempDir() { fs::remove_all(path); }
};

}  // namespace

TEST_CASE("config: an empty document gives every default") {
  for (const char* text : {"", "# only a comment\n", "---\n", "model:\n"}) {
    CAPTURE(text);
    const ds4::Config c = parse(text);
    CHECK(c.model.path.empty());
    CHECK(c.model.name.empty());
    CHECK(c.model.backing == ds4::ModelBacking::automatic);
    CHECK(c.model.huge_pages);
    CHECK(c.proxy.listen.host == "127.0.0.1");
    CHECK(c.proxy.listen.port == 8080);
    CHECK(c.proxy.listen.is_loopback());
    CHECK(c.proxy.api_keys_file.empty());
    CHECK_FALSE(c.proxy.busy_poll);
    CHECK(c.proxy.queue.max_waiting == 256);
    CHECK(c.proxy.queue.max_wait == 10min);
    CHECK(c.proxy.limits.max_header_bytes == 64 * 1024);
    CHECK(c.proxy.limits.max_body_bytes == 16 * MiB);
    CHECK(c.proxy.limits.request_timeout == 30min);
    CHECK(c.proxy.limits.header_timeout == 30s);
    CHECK(c.proxy.limits.body_timeout == 30s);
    CHECK(c.proxy.limits.max_connections == 512);
    CHECK(c.proxy.limits.max_tokens_per_request == 32768);
    CHECK_FALSE(c.proxy.limits.allow_insecure_bind);
    CHECK(c.workers.backend == ds4::WorkerBackend::automatic);
    CHECK(c.workers.count == 1);
    CHECK(c.workers.device.kind == ds4::Device::Kind::automatic);
    CHECK(c.workers.slots == 2);
    CHECK(c.workers.threads == 0);
    CHECK(c.workers.prefill_chunk == 256);
    CHECK(c.workers.ladder == std::vector<std::uint32_t>{32768, 16384, 8192, 4096, 2048});
    CHECK(c.workers.moe_offload == std::vector<std::uint32_t>{0});
    CHECK(c.workers.memory_max == 0);
    CHECK(c.workers.reserve == 1 * GiB);
    CHECK(c.workers.engine == ds4::WorkerEngine::native);
    CHECK(c.workers.exec_command.empty());
    CHECK(c.headroom.min_available == 1 * GiB);
    CHECK(c.headroom.for_ == 10s);
    CHECK(c.headroom.step_up_after == 30min);
    CHECK(c.headroom.psi == 0);
    CHECK(c.restart.backoff_initial == 1s);
    CHECK(c.restart.backoff_max == 60s);
    CHECK(c.restart.healthy_after == 3s);
    CHECK(c.restart.hang_timeout == 30s);
    CHECK(c.restart.drain_deadline == 30s);
    CHECK(c.gpu.weights == ds4::GpuWeights::device);
    CHECK(c == ds4::Config{});
  }
}

TEST_CASE("config: every key set") {
  const ds4::Config c = parse(R"(
model:
  path: /models/big.gguf
  name: big-one
  backing: memfd
  huge_pages: off
proxy:
  listen: "[::1]:9000"
  api_keys_file: /dev/null
  busy_poll: 250us
  queue:
    max_waiting: 10
    max_wait: 90s
  limits:
    max_header_bytes: 8KiB
    max_body_bytes: 1MB
    request_timeout: 1h
    header_timeout: 500ms
    body_timeout: 2s
    max_connections: 64
    max_tokens_per_request: 4096
    allow_insecure_bind: true
workers:
  backend: systemd
  count: 3
  device: cuda:1
  slots: 4
  threads: 8
  context:
    ladder: [32768, 16384, 256]
  moe_offload: [0, 4, 8]
  kv_cache: [f16, q8_0]
  memory_max: 6GiB
  reserve: 512MiB
  engine: exec
  exec:
    command: llama-server -m {model} -c {ctx} --port {port} -np {slots} -t {threads}
headroom:
  min_available: 2GiB
  for: 1.5s
  step_up_after: 0
  psi: 12.5
restart:
  backoff_initial: 250ms
  backoff_max: 2m
gpu:
  weights: host-mapped
)");
  CHECK(c.model.path == "/models/big.gguf");
  CHECK(c.model.backing == ds4::ModelBacking::memfd);
  CHECK_FALSE(c.model.huge_pages);
  CHECK(c.model.name == "big-one");
  CHECK(c.proxy.listen.host == "::1");
  CHECK(c.proxy.listen.port == 9000);
  CHECK(c.proxy.listen.is_loopback());
  CHECK(c.proxy.listen.str() == "[::1]:9000");
  CHECK(c.proxy.api_keys_file == "/dev/null");
  CHECK(c.proxy.busy_poll == 250us);
  CHECK(c.proxy.queue.max_waiting == 10);
  CHECK(c.proxy.queue.max_wait == 90s);
  CHECK(c.proxy.limits.max_header_bytes == 8192);
  CHECK(c.proxy.limits.max_body_bytes == 1000000);
  CHECK(c.proxy.limits.request_timeout == 1h);
  CHECK(c.proxy.limits.header_timeout == 500ms);
  CHECK(c.proxy.limits.body_timeout == 2s);
  CHECK(c.proxy.limits.max_connections == 64);
  CHECK(c.proxy.limits.max_tokens_per_request == 4096);
  CHECK(c.proxy.limits.allow_insecure_bind);
  CHECK(c.workers.backend == ds4::WorkerBackend::systemd);
  CHECK(c.workers.count == 3);
  CHECK(c.workers.device.kind == ds4::Device::Kind::cuda);
  CHECK(c.workers.device.index == 1);
  CHECK(c.workers.device.str() == "cuda:1");
  CHECK(c.workers.slots == 4);
  CHECK(c.workers.threads == 8);
  CHECK(c.workers.ladder == std::vector<std::uint32_t>{32768, 16384, 256});
  CHECK(c.workers.moe_offload == std::vector<std::uint32_t>{0, 4, 8});
  CHECK(c.workers.kv_cache == std::vector<std::string>{"f16", "q8_0"});
  CHECK(c.workers.memory_max == 6 * GiB);
  CHECK(c.workers.reserve == 512 * MiB);
  CHECK(c.workers.engine == ds4::WorkerEngine::exec);
  CHECK(c.workers.exec_command == "llama-server -m {model} -c {ctx} --port {port} -np {slots} -t {threads}");
  CHECK(c.headroom.min_available == 2 * GiB);
  CHECK(c.headroom.for_ == 1500ms);
  CHECK(c.headroom.step_up_after == 0ms);
  CHECK(c.headroom.psi == 12.5);
  CHECK(c.restart.backoff_initial == 250ms);
  CHECK(c.restart.backoff_max == 2min);
  CHECK(c.gpu.weights == ds4::GpuWeights::host_mapped);
}

TEST_CASE("config: a file with only model.path works; relative paths follow the file") {
  const ds4::Config c = parse("model:\n  path: models/stories260K.gguf\n");
  CHECK(c.model.path == "/etc/ds4test/models/stories260K.gguf");
  CHECK(c.model.name == "stories260K");  // the default name is the file's stem
  CHECK(c.workers.ladder == std::vector<std::uint32_t>{32768, 16384, 8192, 4096, 2048});

  CHECK(parse("model:\n  path: ../m/x.gguf\n").model.path == "/etc/m/x.gguf");
  CHECK(parse("model:\n  path: /abs/y.gguf\n").model.path == "/abs/y.gguf");
  CHECK(parse("proxy:\n  api_keys_file: ../../dev/null\n").proxy.api_keys_file == "/dev/null");

  const char* home = std::getenv("HOME");
  REQUIRE(home);
  CHECK(parse("model:\n  path: ~/m.gguf\n").model.path == (fs::path(home) / "m.gguf").lexically_normal());

  // A relative config file name is taken from the current directory.
  const ds4::Config rel = ds4::parse_config("model: {path: a.gguf}\n", "conf/ds4.yaml", {.mem_total = 64 * GiB});
  CHECK(rel.model.path == fs::current_path() / "conf/a.gguf");
}

TEST_CASE("config: load_config reads the file, and a missing file gives the defaults") {
  TempDir dir;
  const fs::path file = dir.path / "ds4.yaml";
  const ds4::Config none = ds4::load_config(file, {.mem_total = 64 * GiB});
  CHECK_FALSE(none.file_found);
  CHECK(none == ds4::Config{});

  std::ofstream(file) << "model:\n  path: weights/m.gguf\nworkers:\n  slots: 3\n";
  const ds4::Config c = ds4::load_config(file, {.mem_total = 64 * GiB});
  CHECK(c.file_found);
  CHECK(c.file == file);
  CHECK(c.model.path == dir.path / "weights/m.gguf");
  CHECK(c.workers.slots == 3);

  CHECK_THROWS_WITH_AS(ds4::load_config(dir.path, {.mem_total = 64 * GiB}),
                       (dir.path.string() + ": is a folder, not a config file").c_str(), ds4::Error);
  // A FIFO: refused at once (reading it waited for a writer, deaf to SIGTERM).
  const auto fifo = dir.path / "fifo.yaml";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  CHECK_THROWS_WITH_AS(ds4::load_config(fifo, {.mem_total = 64 * GiB}),
                       (fifo.string() + ": is not a regular file (a FIFO or a device?)").c_str(), ds4::Error);

  std::ofstream(file) << "workers:\n  slots: 0\n";
  try {
    ds4::load_config(file, {.mem_total = 64 * GiB});
    FAIL("no error");
  } catch (const ds4::Error& e) {
    CHECK(std::string(e.what()) == file.string() + ":2:10: workers.slots: 0 is out of range (1 to 4096)");
  }
}

TEST_CASE("config: unknown keys, with the nearest known key suggested") {
  CHECK(errors("workers:\n  context:\n    ladderr: [4096]\n") ==
        "config/ds4.yaml:3:5: unknown key 'ladderr' (did you mean 'ladder'?)");
  CHECK(errors("worker:\n  count: 2\n") == "config/ds4.yaml:1:1: unknown key 'worker' (did you mean 'workers'?)");
  CHECK(errors("proxy:\n  queue:\n    max_wiat: 1m\n") ==
        "config/ds4.yaml:3:5: unknown key 'max_wiat' (did you mean 'max_wait'?)");
  CHECK(errors("headroom:\n  MIN_AVAILABLE: 1GiB\n") ==
        "config/ds4.yaml:2:3: unknown key 'MIN_AVAILABLE' (did you mean 'min_available'?)");
  // Nothing close: no suggestion.
  CHECK(errors("model:\n  colour: blue\n") == "config/ds4.yaml:2:3: unknown key 'colour'");
  CHECK(errors("workers:\n  count: 1\n  count: 2\n") ==
        "config/ds4.yaml:3:3: duplicate key 'count' (first at line 2)");
}

TEST_CASE("config: wrong types") {
  CHECK(errors("workers:\n  reserve: lots\n") ==
        "config/ds4.yaml:2:12: workers.reserve: expected a size like 4GiB, got 'lots'");
  CHECK(errors("workers:\n  count: two\n") ==
        "config/ds4.yaml:2:10: workers.count: expected a whole number, got 'two'");
  CHECK(errors("workers:\n  count: 1.5\n") ==
        "config/ds4.yaml:2:10: workers.count: expected a whole number, got '1.5'");
  CHECK(errors("workers:\n  slots: [1, 2]\n") ==
        "config/ds4.yaml:2:10: workers.slots: expected a whole number, got a list");
  CHECK(errors("workers: 3\n") ==
        "config/ds4.yaml:1:10: workers: expected a mapping with keys backend, count, device, slots, threads, prefill_chunk, "
        "busy_poll, context, moe_offload, kv_cache, memory_max, reserve, engine, exec, got '3'");
  CHECK(errors("workers:\n  prefill_chunk: 8\n") ==
        "config/ds4.yaml:2:18: workers.prefill_chunk: 8 is out of range (16 to 8192)");
  CHECK(errors("- a\n- b\n") ==
        "config/ds4.yaml:1:1: expected a mapping with keys model, proxy, workers, headroom, restart, gpu, status, got a list");
  CHECK(errors("headroom:\n  for: 10\n") ==
        "config/ds4.yaml:2:8: headroom.for: missing unit: write ms, s, m or h (e.g. 30s), got '10'");
  CHECK(errors("proxy:\n  queue:\n    max_wait: 10 minutes\n") ==
        "config/ds4.yaml:3:15: proxy.queue.max_wait: expected a duration like 30s (units ms, s, m, h), got '10 minutes'");
  CHECK(errors("proxy:\n  limits:\n    allow_insecure_bind: maybe\n") ==
        "config/ds4.yaml:3:26: proxy.limits.allow_insecure_bind: expected true or false, got 'maybe'");
  CHECK(errors("workers:\n  backend: sytemd\n") ==
        "config/ds4.yaml:2:12: workers.backend: expected one of auto, systemd, process, got 'sytemd' "
        "(did you mean 'systemd'?)");
  CHECK(errors("workers:\n  device: gpu\n") ==
        "config/ds4.yaml:2:11: workers.device: expected auto, cpu or cuda:N, got 'gpu' (did you mean 'cpu'?)");
  CHECK(errors("workers:\n  device: cuda:x\n") ==
        "config/ds4.yaml:2:11: workers.device: expected cuda:N with N a GPU index, got 'cuda:x'");
  CHECK(errors("model:\n  backing: memfdd\n") ==
        "config/ds4.yaml:2:12: model.backing: expected one of auto, shm, memfd, got 'memfdd' (did you mean 'memfd'?)");
  CHECK(errors("model:\n  backing: [shm]\n") ==
        "config/ds4.yaml:2:12: model.backing: expected one of auto, shm, memfd, got a list");
  CHECK(errors("model:\n  huge_pages: yes\n") ==
        "config/ds4.yaml:2:15: model.huge_pages: expected one of on, off, true, false, got 'yes'");
  CHECK(errors("gpu:\n  weights: host_mapped\n") ==
        "config/ds4.yaml:2:12: gpu.weights: expected one of device, host-mapped, got 'host_mapped' "
        "(did you mean 'host-mapped'?)");
  CHECK(errors("headroom:\n  psi: 120\n") == "config/ds4.yaml:2:8: headroom.psi: 120 is out of range (0 to 100)");
  CHECK(errors("workers:\n  memory_max: 4G\n") ==
        "config/ds4.yaml:2:15: workers.memory_max: ambiguous unit 'G': write GiB (powers of 1024) or GB (powers of "
        "1000), got '4G'");
}

TEST_CASE("config: impossible values") {
  SUBCASE("kv_cache") {
    CHECK(errors("workers:\n  kv_cache: [q8_0, f16]\n") ==
          "config/ds4.yaml:2:20: workers.kv_cache[1]: 'f16' does not take less memory than the rung before it "
          "('q8_0'); the rungs go from the most memory to the least, as [f16, q8_0]");
    CHECK(errors("workers:\n  kv_cache: q4\n") ==
          "config/ds4.yaml:2:13: workers.kv_cache: expected one of f16, q8_0, got 'q4'");
    CHECK(errors("workers:\n  kv_cache: [f16, q8]\n").find("config/ds4.yaml:2:19: workers.kv_cache[1]: expected one "
                                                          "of f16, q8_0, got 'q8' (did you mean 'q8_0'?)") == 0);
    CHECK(errors("workers:\n  kv_cache: []\n").find("workers.kv_cache: the list is empty") != std::string::npos);
    CHECK(errors("workers:\n  kv_cache: q8_0\n") == "");
    CHECK(parse("workers:\n  kv_cache: q8_0\n").workers.kv_cache == std::vector<std::string>{"q8_0"});
  }
  SUBCASE("moe_offload") {
    CHECK(errors("workers:\n  moe_offload: [4, 2]\n") ==
          "config/ds4.yaml:2:20: workers.moe_offload[1]: 2 is not larger than the rung before it (4); each rung keeps "
          "more layers' experts on the host");
    CHECK(errors("workers:\n  moe_offload: []\n") ==
          "config/ds4.yaml:2:16: workers.moe_offload: the list is empty; give at least one rung ([0]: every expert on "
          "the GPU)");
    CHECK(errors("workers:\n  moe_offload: 4\n").find("workers.moe_offload: expected a list of layer counts") !=
          std::string::npos);
    CHECK(errors("workers:\n  moe_offload: [0, -4]\n").find("config/ds4.yaml:2:20: workers.moe_offload[1]") == 0);
    CHECK(errors("workers:\n  moe_offload: [0, x]\n").find("config/ds4.yaml:2:20: workers.moe_offload[1]") == 0);
    CHECK(errors("workers:\n  moe_offload: [0, 4]\n") == "");
  }
  SUBCASE("ladder") {
    CHECK(errors("workers:\n  context:\n    ladder: []\n") ==
          "config/ds4.yaml:3:13: workers.context.ladder: the ladder is empty; give at least one context size");
    CHECK(errors("workers:\n  context:\n    ladder: [2048, 4096]\n") ==
          "config/ds4.yaml:3:20: workers.context.ladder[1]: 4096 is not smaller than the rung before it (2048); "
          "the ladder goes from the largest context down");
    CHECK(errors("workers:\n  context:\n    ladder: [4096, 4096]\n") ==
          "config/ds4.yaml:3:20: workers.context.ladder[1]: 4096 is not smaller than the rung before it (4096); "
          "the ladder goes from the largest context down");
    CHECK(errors("workers:\n  context:\n    ladder: [4096, 0]\n") ==
          "config/ds4.yaml:3:20: workers.context.ladder[1]: context size 0 must be between 16 and 16777216 tokens");
    // Below the worker's smallest context: accepted once, then a crash loop.
    CHECK(errors("workers:\n  context:\n    ladder: [1]\n") ==
          "config/ds4.yaml:3:14: workers.context.ladder[0]: context size 1 must be between 16 and 16777216 tokens");
    CHECK(errors("workers:\n  context:\n    ladder: [4096, -5]\n") ==
          "config/ds4.yaml:3:20: workers.context.ladder[1]: context size -5 must be between 16 and 16777216 tokens");
    CHECK(errors("workers:\n  context:\n    ladder:\n      - 4096\n      - big\n") ==
          "config/ds4.yaml:5:9: workers.context.ladder[1]: expected a whole number, got 'big'");
    CHECK(errors("workers:\n  context:\n    ladder: 4096\n") ==
          "config/ds4.yaml:3:13: workers.context.ladder: expected a list of context sizes like [8192, 4096, 2048], "
          "got '4096'");
  }
  SUBCASE("counts") {
    CHECK(errors("workers:\n  count: 0\n") == "config/ds4.yaml:2:10: workers.count: 0 is out of range (1 to 256)");
    CHECK(errors("workers:\n  slots: 0\n") == "config/ds4.yaml:2:10: workers.slots: 0 is out of range (1 to 4096)");
    CHECK(errors("workers:\n  threads: -1\n") ==
          "config/ds4.yaml:2:12: workers.threads: -1 is out of range (0 to 4096)");
  }
  SUBCASE("memory of this machine") {
    CHECK(errors("workers:\n  reserve: 8GiB\n", 4 * GiB) ==
          "config/ds4.yaml:2:12: workers.reserve 8GiB is not smaller than this machine's memory (MemTotal 4GiB)");
    CHECK(errors("headroom:\n  min_available: 5GiB\n", 4 * GiB) ==
          "config/ds4.yaml:2:18: headroom.min_available 5GiB is not smaller than this machine's memory "
          "(MemTotal 4GiB)");
    CHECK(errors("workers:\n  reserve: 8GiB\n", 16 * GiB) == "");
    // A default that does not fit has no line to point at.
    CHECK(errors("", 512 * MiB) ==
          "config/ds4.yaml: workers.reserve 1GiB is not smaller than this machine's memory (MemTotal 512MiB)\n"
          "config/ds4.yaml: headroom.min_available 1GiB is not smaller than this machine's memory (MemTotal 512MiB)");
    CHECK(errors("workers:\n  memory_max: 1MiB\n") ==
          "config/ds4.yaml:2:15: workers.memory_max 1MiB is too small for a worker (at least 16MiB, or 0 for no limit)");
  }
  SUBCASE("listen address") {
    CHECK(errors("proxy:\n  listen: 8080\n") ==
          "config/ds4.yaml:2:11: proxy.listen: expected an address like 127.0.0.1:8080, 0.0.0.0:8080 or [::1]:8080, "
          "got '8080'");
    CHECK(errors("proxy:\n  listen: 127.0.0.1:99999\n") ==
          "config/ds4.yaml:2:11: proxy.listen: expected an address like 127.0.0.1:8080, 0.0.0.0:8080 or [::1]:8080, "
          "got '127.0.0.1:99999'");
    CHECK(errors("proxy:\n  listen: 300.1.1.1:80\n") != "");
    CHECK(errors("proxy:\n  listen: \"[fe80::zz]:80\"\n") != "");
    CHECK(errors("proxy:\n  listen: 0.0.0.0:8080\n") ==
          "config/ds4.yaml:2:11: proxy.listen 0.0.0.0:8080 is reachable from other machines but "
          "proxy.api_keys_file is empty: set api_keys_file, or proxy.limits.allow_insecure_bind: true to serve "
          "without keys");
    CHECK(errors("proxy:\n  listen: 0.0.0.0:8080\n  limits: {allow_insecure_bind: true}\n") == "");
    CHECK(errors("proxy:\n  listen: 0.0.0.0:8080\n  api_keys_file: /dev/null\n") == "");
    CHECK(parse("proxy:\n  listen: localhost:0\n").proxy.listen.str() == "127.0.0.1:0");
    CHECK(errors("proxy:\n  api_keys_file: /nonexistent/keys\n") ==
          "config/ds4.yaml:2:18: proxy.api_keys_file: cannot read '/nonexistent/keys'");
    // A folder is readable, and holds no key: every request would get 401.
    CHECK(errors("proxy:\n  api_keys_file: /tmp\n") ==
          "config/ds4.yaml:2:18: proxy.api_keys_file: '/tmp' is a folder, not a file of keys");
  }
  SUBCASE("engine exec") {
    CHECK(errors("workers:\n  engine: exec\n") ==
          "config/ds4.yaml:2:11: workers.engine is exec but workers.exec.command is empty: give the server's command "
          "line with {port}");
    CHECK(errors("workers:\n  engine: exec\n  exec:\n    command: srv -c {ctx}\n") ==
          "config/ds4.yaml:4:14: workers.exec.command: needs {port}, where the supervisor reaches the server");
    CHECK(errors("workers:\n  engine: exec\n  exec:\n    command: srv --port {port} -c {ctxx}\n") ==
          "config/ds4.yaml:4:14: workers.exec.command: unknown placeholder {ctxx} (known: {ctx}, {port}, {slots}, "
          "{threads}, {model}) (did you mean 'ctx'?)");
  }
  SUBCASE("durations") {
    CHECK(errors("restart:\n  backoff_initial: 2m\n  backoff_max: 1m\n") ==
          "config/ds4.yaml:2:20: restart.backoff_initial 2m is longer than restart.backoff_max 1m");
    CHECK(errors("proxy:\n  queue:\n    max_wait: 0\n") ==
          "config/ds4.yaml:3:15: proxy.queue.max_wait: must be longer than 0");
    CHECK(errors("restart:\n  hang_timeout: 100ms\n") ==
          "config/ds4.yaml:2:17: restart.hang_timeout 100ms is too short: at least 500ms, or 0 to turn hang "
          "detection off");
    CHECK(errors("restart:\n  hang_timeout: 0\n") == "");
    CHECK(parse("restart:\n  hang_timeout: 2s\n  drain_deadline: 5s\n").restart.hang_timeout == 2s);
    CHECK(parse("restart:\n  drain_deadline: 5s\n").restart.drain_deadline == 5s);
    CHECK(errors("restart:\n  drain_deadline: 0\n") ==
          "config/ds4.yaml:2:19: restart.drain_deadline: must be longer than 0");
    CHECK(errors("restart:\n  hang_timeout: soon\n").starts_with("config/ds4.yaml:2:17: "));
  }
}

TEST_CASE("config: a negative number is out of range, not 'not a number'") {
  CHECK(errors("headroom:\n  psi: -5\n") == "config/ds4.yaml:2:8: headroom.psi: -5 is out of range (0 to 100)");
  CHECK(errors("headroom:\n  psi: -x\n") == "config/ds4.yaml:2:8: headroom.psi: expected a number, got '-x'");
}

TEST_CASE("config: YAML syntax errors carry their line and column") {
  const std::string e = errors("workers:\n  count: 1\n  slots: [1, 2\n");
  CHECK(e.starts_with("config/ds4.yaml:"));
  CHECK(e.find(": YAML syntax error: ") != std::string::npos);
  CHECK(errors("workers:\n  count: 1\n bad: 2\n") == "config/ds4.yaml:3:2: YAML syntax error: end of map not found");
  CHECK(errors("model:\n  path: a: b\n") == "config/ds4.yaml:2:10: YAML syntax error: illegal map value");
  CHECK(errors("model: {path: \"a.gguf\"\n") != "");
  CHECK(errors(std::string("workers:\n  count: 1\0junk\n", 25)) ==
        "config/ds4.yaml:2:11: a NUL byte: the config is a text file");
  CHECK(errors("workers:\n  count: 1\n---\nworkers:\n  count: 5\n") ==
        "config/ds4.yaml:4:1: a second YAML document (after '---'): the config is one document");
  CHECK(errors("---\nworkers:\n  count: 1\n") == "");  // one document, marked as such
  // yaml-cpp's own words for its depth limit are "bad file".
  const std::string deep = errors("model:\n  path: " + std::string(5000, '[') + "\n");
  CHECK(deep.starts_with("config/ds4.yaml:"));
  CHECK(deep.ends_with(": YAML syntax error: nested too deeply (more than 2000 levels)"));
}

TEST_CASE("config: all errors are reported together, in file order") {
  CHECK(errors(R"(workers:
  count: 0
  slots: many
  context:
    ladderr: [1]
proxy:
  listen: nowhere
headroom:
  for: soon
)") == "config/ds4.yaml:2:10: workers.count: 0 is out of range (1 to 256)\n"
       "config/ds4.yaml:3:10: workers.slots: expected a whole number, got 'many'\n"
       "config/ds4.yaml:5:5: unknown key 'ladderr' (did you mean 'ladder'?)\n"
       "config/ds4.yaml:7:11: proxy.listen: expected an address like 127.0.0.1:8080, 0.0.0.0:8080 or [::1]:8080, "
       "got 'nowhere'\n"
       "config/ds4.yaml:9:8: headroom.for: expected a duration like 30s, got 'soon'");
}

TEST_CASE("config: sizes") {
  CHECK(ds4::parse_size("0") == 0u);
  CHECK(ds4::parse_size("1024") == 1024u);
  CHECK(ds4::parse_size("1024B") == 1024u);
  CHECK(ds4::parse_size("512MiB") == 512 * MiB);
  CHECK(ds4::parse_size("4GiB") == 4 * GiB);
  CHECK(ds4::parse_size("4 GiB") == 4 * GiB);
  CHECK(ds4::parse_size("4gib") == 4 * GiB);
  CHECK(ds4::parse_size("1.5GiB") == 3 * GiB / 2);
  CHECK(ds4::parse_size("2TiB") == 2 * 1024 * GiB);
  CHECK(ds4::parse_size("1KiB") == 1024u);
  CHECK(ds4::parse_size("1KB") == 1000u);
  CHECK(ds4::parse_size("1kB") == 1000u);
  CHECK(ds4::parse_size("3MB") == 3000000u);
  CHECK(ds4::parse_size("2GB") == 2000000000u);
  CHECK(ds4::parse_size("1TB") == 1000000000000u);
  std::string why;
  CHECK_FALSE(ds4::parse_size("4G", &why));
  CHECK(why == "ambiguous unit 'G': write GiB (powers of 1024) or GB (powers of 1000)");
  CHECK_FALSE(ds4::parse_size("1.5", &why));
  CHECK(why == "expected a whole number of bytes");
  CHECK_FALSE(ds4::parse_size("-1GiB"));
  CHECK_FALSE(ds4::parse_size("GiB"));
  CHECK_FALSE(ds4::parse_size("1..2GiB"));
  CHECK_FALSE(ds4::parse_size("4 GiBs"));
  CHECK_FALSE(ds4::parse_size("99999999TiB", &why));
  CHECK(why == "size too large");

  CHECK(ds4::format_size(0) == "0");
  CHECK(ds4::format_size(4 * GiB) == "4GiB");
  CHECK(ds4::format_size(512 * MiB) == "512MiB");
  CHECK(ds4::format_size(3 * GiB / 2) == "1536MiB");  // exact where possible
  CHECK(ds4::format_size(3 * GiB / 2 + 1) == "1.5GiB");
  CHECK(ds4::format_size(1000) == "1000B");
  CHECK(ds4::format_size(1536) == "1.5KiB");
}

TEST_CASE("config: durations") {
  CHECK(ds4::parse_duration("0") == 0ms);
  CHECK(ds4::parse_duration("500ms") == 500ms);
  CHECK(ds4::parse_duration("30s") == 30s);
  CHECK(ds4::parse_duration("10m") == 10min);
  CHECK(ds4::parse_duration("2h") == 2h);
  CHECK(ds4::parse_duration("1.5s") == 1500ms);
  CHECK(ds4::parse_duration(" 10 m ") == 10min);
  std::string why;
  CHECK_FALSE(ds4::parse_duration("10", &why));
  CHECK(why == "missing unit: write ms, s, m or h (e.g. 30s)");
  CHECK_FALSE(ds4::parse_duration("10M"));
  CHECK_FALSE(ds4::parse_duration("1d"));
  CHECK_FALSE(ds4::parse_duration("-1s"));
  CHECK_FALSE(ds4::parse_duration("s"));

  CHECK(ds4::format_duration(0ms) == "0");
  CHECK(ds4::format_duration(500ms) == "500ms");
  CHECK(ds4::format_duration(1500ms) == "1500ms");
  CHECK(ds4::format_duration(30s) == "30s");
  CHECK(ds4::format_duration(10min) == "10m");
  CHECK(ds4::format_duration(2h) == "2h");
}

TEST_CASE("config: proxy.busy_poll") {
  const auto busy_poll = [](const char* v) { return parse(std::string("proxy:\n  busy_poll: ") + v + "\n").proxy.busy_poll; };
  CHECK(busy_poll("100us") == 100us);
  CHECK(busy_poll("1.5ms") == 1500us);
  CHECK(busy_poll("10ms") == 10000us);
  CHECK(busy_poll("off") == 0us);
  CHECK(busy_poll("0") == 0us);
  CHECK_FALSE(busy_poll("auto"));
  for (const char* bad : {"11ms", "1s", "100", "-5us", "fast"})
    CHECK(errors(std::string("proxy:\n  busy_poll: ") + bad + "\n") ==
          std::string("config/ds4.yaml:2:14: proxy.busy_poll: expected auto, off or a duration up to 10ms like 100us, got '") +
              bad + "'");

  // Set: as set. Auto: 100us with 8 or more cores, none on fewer.
  ds4::ProxyConfig p;
  p.busy_poll = 40us;
  CHECK(ds4::busy_poll_for(p.busy_poll) == 40us);
  p.busy_poll.reset();
  CHECK(ds4::busy_poll_for(p.busy_poll) == (std::thread::hardware_concurrency() >= 8 ? 100us : 0us));
}

TEST_CASE("config: workers.busy_poll reads as proxy.busy_poll, and a change restarts the workers") {
  CHECK(parse("workers:\n  busy_poll: 50us\n").workers.busy_poll == 50us);
  CHECK(parse("workers:\n  busy_poll: off\n").workers.busy_poll == 0us);
  CHECK_FALSE(parse("workers:\n  busy_poll: auto\n").workers.busy_poll);
  CHECK(errors("workers:\n  busy_poll: 1s\n") ==
        "config/ds4.yaml:2:14: workers.busy_poll: expected auto, off or a duration up to 10ms like 100us, got '1s'");
  const ds4::Config a = parse("model: {path: /m/a.gguf}\n");
  ds4::Config b = a;
  b.workers.busy_poll = 0us;
  const auto d = ds4::diff(a, b);
  CHECK(d.keys == std::vector<std::string>{"workers.busy_poll"});
  CHECK(d.worker_settings);
}

TEST_CASE("config: the supervisor's model.path must name a file") {
  TempDir dir;
  const fs::path real = dir.path / "m.gguf";
  std::ofstream(real) << "GGUF";
  const auto load = [&](const std::string& yaml) {
    try {
      ds4::parse_config(yaml, "config/ds4.yaml", {.mem_total = 64 * GiB, .model_file_must_exist = true});
    } catch (const ds4::Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  CHECK(load("model:\n  path: " + real.string() + "\n") == "");
  CHECK(load("model:\n  path: \"\"\n") == "");  // empty: the synthetic model
  // A typo is an error where it is written, not random weights served.
  CHECK(load("workers:\n  slots: 2\nmodel:\n  path: " + (dir.path / "typo.gguf").string() + "\n") ==
        "config/ds4.yaml:4:9: model.path: " + (dir.path / "typo.gguf").string() +
            ": no such file (leave it empty to serve a small synthetic model with random weights)");
  CHECK(load("model:\n  path: " + dir.path.string() + "\n").find("model.path: " + dir.path.string() + " is not a file") !=
        std::string::npos);
  // Without the option (a test's config), the path need not exist.
  CHECK(errors("model:\n  path: /no/such/m.gguf\n") == "");
}

TEST_CASE("config: edit distance") {
  CHECK(ds4::edit_distance("", "") == 0);
  CHECK(ds4::edit_distance("ladder", "ladder") == 0);
  CHECK(ds4::edit_distance("ladderr", "ladder") == 1);
  CHECK(ds4::edit_distance("sytemd", "systemd") == 1);
  CHECK(ds4::edit_distance("kitten", "sitting") == 3);
  CHECK(ds4::edit_distance("", "abc") == 3);
}

TEST_CASE("config: the shipped config/ds4.yaml loads and states the defaults") {
  const fs::path shipped = fs::path(DS4_SOURCE_DIR) / "config/ds4.yaml";
  REQUIRE(fs::exists(shipped));
  ds4::Config c;
  REQUIRE_NOTHROW(c = ds4::load_config(shipped, {.mem_total = 64 * GiB}));
  CHECK(c.file_found);
  // Every value in it is the default it documents.
  CHECK(c == ds4::Config{});
  // …and it loads on this machine too.
  CHECK_NOTHROW(ds4::load_config(shipped));
}

TEST_CASE("config: diff tells what a reload must do") {
  const ds4::Config a = parse("model: {path: /m/a.gguf}\n");
  CHECK_FALSE(ds4::diff(a, a).any());

  ds4::Config b = a;
  b.workers.slots = 4;
  b.headroom.for_ = 20s;
  auto d = ds4::diff(a, b);
  CHECK(d.keys == std::vector<std::string>{"workers.slots", "headroom.for"});
  CHECK(d.worker_settings);
  CHECK(d.in_place);
  CHECK_FALSE(d.worker_count);
  CHECK_FALSE(d.model);
  CHECK(d.changed("workers.slots"));

  b = a;
  b.workers.prefill_chunk = 64;  // ds4-worker serve --batch: the workers restart
  d = ds4::diff(a, b);
  CHECK(d.keys == std::vector<std::string>{"workers.prefill_chunk"});
  CHECK(d.worker_settings);

  b = a;
  b.workers.count = 2;
  d = ds4::diff(a, b);
  CHECK(d.worker_count);
  CHECK_FALSE(d.worker_settings);

  b = a;
  b.workers.reserve = 2 * GiB;
  b.proxy.queue.max_waiting = 1;
  d = ds4::diff(a, b);
  CHECK_FALSE(d.worker_settings);
  CHECK(d.in_place);
  CHECK(d.keys.size() == 2);

  b = a;
  b.model.path = "/m/b.gguf";
  b.proxy.listen.port = 9090;
  b.workers.ladder = {4096, 1024};
  d = ds4::diff(a, b);
  CHECK(d.keys == std::vector<std::string>{"model.path", "proxy.listen", "workers.context.ladder"});
  CHECK(d.model);
  CHECK(d.listen);
  CHECK(d.worker_settings);

  // Another backing: the model is loaded again into it.
  b = a;
  b.model.backing = ds4::ModelBacking::memfd;
  d = ds4::diff(a, b);
  CHECK(d.keys == std::vector<std::string>{"model.backing"});
  CHECK(d.model);

  // 2 MiB pages or not: the loaded segment stays as it is, the next load takes it.
  b = a;
  b.model.huge_pages = false;
  d = ds4::diff(a, b);
  CHECK(d.keys == std::vector<std::string>{"model.huge_pages"});
  CHECK_FALSE(d.model);
  CHECK(d.in_place);
}

TEST_CASE("config: status (what the status page keeps)") {
  ds4::Config c = parse("model:\n  path: \"\"\n");
  CHECK(c.status.sample_every == 5s);
  CHECK(c.status.history == 1h);
  CHECK(c.status.events_kept == 2000);
  c = parse("status:\n  sample_every: 1s\n  history: 10m\n  events_kept: 50\n");
  CHECK(c.status.sample_every == 1s);
  CHECK(c.status.history == 10min);
  CHECK(c.status.events_kept == 50);
  CHECK(errors("status:\n  sample_every: 10ms\n").find("status.sample_every: must be at least 100ms") != std::string::npos);
  CHECK(errors("status:\n  history: 1s\n").find("status.history") != std::string::npos);
  ds4::Config a, b;
  b.status.history = 5min;
  CHECK(ds4::diff(a, b).changed("status.history"));
}
