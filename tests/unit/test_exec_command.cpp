#include <doctest/doctest.h>

#include "shared/error.h"
#include "shared/exec_command.h"

using namespace ds4;

TEST_CASE("exec command: placeholders are filled in, words split on blanks") {
  ExecValues v{4096, 18123, 2, 8, "/m/x.gguf"};
  auto argv = expand_exec_command("llama-server  -m {model} -c {ctx}\t--port={port} -np {slots} -t {threads}", v);
  CHECK(argv == std::vector<std::string>{"llama-server", "-m", "/m/x.gguf", "-c", "4096", "--port=18123", "-np", "2",
                                         "-t", "8"});
}

TEST_CASE("exec command: a placeholder twice in one word, no shell quoting") {
  ExecValues v{512, 9, 1, 0, ""};
  auto argv = expand_exec_command("sh -c 'echo {port}:{port}'", v);
  CHECK(argv == std::vector<std::string>{"sh", "-c", "'echo", "9:9'"});
}

TEST_CASE("exec command: errors name the problem") {
  ExecValues v;
  CHECK_THROWS_WITH_AS(expand_exec_command("srv --port {prt}", v), doctest::Contains("unknown placeholder {prt}"), Error);
  CHECK_THROWS_WITH_AS(expand_exec_command("srv --port {port", v), doctest::Contains("unmatched '{'"), Error);
  CHECK_THROWS_WITH_AS(expand_exec_command("srv -c {ctx}", v), doctest::Contains("needs {port}"), Error);
  CHECK_THROWS_WITH_AS(expand_exec_command("   ", v), doctest::Contains("empty"), Error);
}
