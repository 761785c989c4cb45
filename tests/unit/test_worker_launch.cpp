// A worker launch goes through one encoding: struct -> command line or
// environment file -> struct gives it back; a bad value names its setting.
#include <doctest/doctest.h>

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "shared/error.h"
#include "shared/worker_launch.h"

using ds4::WorkerLaunch;

namespace {

WorkerLaunch every_setting_changed() {
  WorkerLaunch l;
  l.id = 3;
  l.segment = "memfd:ds4-model-abc";
  l.segment_socket = "/run/user/1000/ds4/segments.sock";
  l.model = "/models/with space/$HOME \"quoted\" `tick` back\\slash.gguf";
  l.socket = "/run/user/1000/ds4/worker-3.sock";
  l.context = 8192;
  l.slots = 4;
  l.device = "cuda:1";
  l.threads = 12;
  l.prefill_chunk = 512;
  l.busy_poll_us = 50;
  l.control = "ds4-control-1000";
  l.gpu_weights = "host-mapped";
  l.holder_socket = "/run/user/1000/ds4/holder-cuda1.sock";
  l.host_experts = 8;
  l.holder_experts = 16;
  l.kv_cache = "q8_0";
  l.dies_with = 4242;
  l.exec_command = "llama-server -m {model} --port {port} -c {ctx}";
  l.port = 18080;
  l.start_timeout_ms = 70000;
  return l;
}

std::string error_of(const std::vector<std::string>& args, const std::vector<std::string>& env = {}) {
  try {
    ds4::parse_worker_launch(args, env);
  } catch (const ds4::Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("worker launch: every setting survives the command line") {
  const WorkerLaunch l = every_setting_changed();
  CHECK(ds4::parse_worker_launch(l.to_args(), {}) == l);
  CHECK(l.subcommand() == "engine");
  CHECK(WorkerLaunch{}.subcommand() == "serve");
  // Every setting but the empty ones, defaults too: the whole launch shows.
  WorkerLaunch c;
  c.context = 256;
  const std::vector<std::string> args = c.to_args();
  REQUIRE(args.size() >= 4);
  CHECK(std::vector<std::string>(args.begin(), args.begin() + 2) == std::vector<std::string>{"--id", "0"});
  CHECK(std::find(args.begin(), args.end(), "--context") + 1 < args.end());
  CHECK(*(std::find(args.begin(), args.end(), "--context") + 1) == "256");
  CHECK(std::find(args.begin(), args.end(), "--busy-poll-us") != args.end());
  CHECK(std::find(args.begin(), args.end(), "--command") == args.end());  // empty: left out
  CHECK(ds4::parse_worker_launch(args, {}) == c);
  // The environment form: every variable, unquoted.
  const std::vector<std::string> env = every_setting_changed().to_env();
  CHECK(std::find(env.begin(), env.end(), "DS4_KV_CACHE=q8_0") != env.end());
  CHECK(ds4::parse_worker_launch({"--id", "3"}, env) == every_setting_changed());
}

TEST_CASE("worker launch: every setting survives the environment file") {
  const WorkerLaunch l = every_setting_changed();
  const std::string file = "# a comment\n" + l.to_env_file();
  WorkerLaunch back = ds4::parse_worker_launch({"--id", "3"}, ds4::decode_env_file(file));
  CHECK(back == l);
  // Quoted where systemd would read it otherwise.
  CHECK(file.find("DS4_MODEL=\"/models/with space/\\$HOME \\\"quoted\\\" \\`tick\\` back\\\\slash.gguf\"") !=
        std::string::npos);
  CHECK(file.find("DS4_CONTEXT=8192\n") != std::string::npos);
  // The defaults round-trip too (empty values are the defaults).
  CHECK(ds4::parse_worker_launch({}, ds4::decode_env_file(WorkerLaunch{}.to_env_file())) == WorkerLaunch{});
}

TEST_CASE("worker launch: the command line wins over the environment; --ctx is --context") {
  const WorkerLaunch l =
      ds4::parse_worker_launch({"--ctx", "512", "--slots=3"}, {"DS4_CONTEXT=4096", "DS4_SLOTS=2", "DS4_KV_CACHE=q8_0",
                                                               "PATH=/bin", "DS4_UNRELATED=x", "DS4_THREADS="});
  CHECK(l.context == 512);
  CHECK(l.slots == 3);
  CHECK(l.kv_cache == "q8_0");
  CHECK(l.threads == 0);
  CHECK(ds4::parse_worker_launch({"--ctx=300"}, {}).context == 300);
}

TEST_CASE("worker launch: a bad value names its setting and where it came from") {
  CHECK(error_of({"--context", "abc"}) == "--context: 'abc' is not an integer");
  CHECK(error_of({"--ctx", "12"}) == "--ctx: 12 is out of range [16, 16777216]");
  CHECK(error_of({"--slots", "0"}) == "--slots: 0 is out of range [1, 256]");
  CHECK(error_of({}, {"DS4_PREFILL_CHUNK=lots"}) == "DS4_PREFILL_CHUNK=lots (--batch): 'lots' is not an integer");
  CHECK(error_of({}, {"DS4_BUSY_POLL_US=20000"}) == "DS4_BUSY_POLL_US=20000 (--busy-poll-us): 20000 is out of range [0, 10000]");
  CHECK(error_of({"--gpu-weights", "vram"}) == "--gpu-weights: 'vram': expected auto, holder, copy or host-mapped");
  CHECK(error_of({"--contxt", "5"}) == "unknown option '--contxt'");
  CHECK(error_of({"--context"}) == "option '--context' needs a value");
  CHECK(error_of({"serve"}) == "unexpected argument 'serve'");
}

TEST_CASE("worker launch: one table, each flag and variable once") {
  std::set<std::string> flags, envs;
  for (const auto& s : ds4::worker_launch_settings()) {
    CHECK(flags.insert(s.flag).second);
    if (!s.env.empty()) CHECK(envs.insert(s.env).second);
    CHECK(!s.what.empty());
  }
  CHECK(flags.count("context"));
  CHECK(envs.count("DS4_PREFILL_CHUNK"));
  CHECK(envs.count("DS4_EXEC_COMMAND"));
  const auto names = ds4::worker_launch_env_names();
  CHECK(std::set<std::string>(names.begin(), names.end()) == envs);
  for (const auto& s : ds4::worker_launch_settings())
    if (s.flag == "context") CHECK(s.default_text == "4096");
}

TEST_CASE("worker launch: an environment file's quoting as systemd reads it") {
  const auto lines = ds4::decode_env_file("A=plain  \n  B=\"a \\\"b\\\" c\"\n# C=no\nD='single $x'\n\nE=\n");
  CHECK(lines == std::vector<std::string>{"A=plain", "B=a \"b\" c", "D=single $x", "E="});
}
