#pragma once
/// workers.engine: exec — the external server's command line. The template
/// (workers.exec.command) is split on blanks (no shell: no quoting, no
/// pipes, no variables) and {ctx} {port} {slots} {threads} {model} are
/// filled in, also inside a word ("--port={port}").

#include <cstdint>
#include <string>
#include <vector>

namespace ds4 {

struct ExecValues {
  int64_t ctx = 0;
  int port = 0;
  int64_t slots = 1;
  int64_t threads = 0;
  std::string model;
};

/// The argv of `tmpl` with `v` filled in. Throws ds4::Error naming the
/// placeholder or the character for an unknown placeholder, an unmatched '{',
/// a template without {port} or without any word.
std::vector<std::string> expand_exec_command(const std::string& tmpl, const ExecValues& v);

}  // namespace ds4
