#include "shared/exec_command.h"

#include "shared/error.h"

namespace ds4 {

namespace {

std::string fill(const std::string& word, const ExecValues& v, bool& has_port) {
  std::string out;
  for (size_t i = 0; i < word.size();) {
    if (word[i] != '{') {
      out += word[i++];
      continue;
    }
    const size_t close = word.find('}', i);
    if (close == std::string::npos)
      throw Error("workers.exec.command: unmatched '{' in '" + word + "'");
    const std::string name = word.substr(i + 1, close - i - 1);
    if (name == "ctx") out += std::to_string(v.ctx);
    else if (name == "port") out += std::to_string(v.port), has_port = true;
    else if (name == "slots") out += std::to_string(v.slots);
    else if (name == "threads") out += std::to_string(v.threads);
    else if (name == "model") out += v.model;
    else throw Error("workers.exec.command: unknown placeholder {" + name + "} (known: {ctx}, {port}, {slots}, {threads}, {model})");
    i = close + 1;
  }
  return out;
}

}  // namespace

std::vector<std::string> expand_exec_command(const std::string& tmpl, const ExecValues& v) {
  std::vector<std::string> argv;
  bool has_port = false;
  size_t i = 0;
  while (i < tmpl.size()) {
    while (i < tmpl.size() && (tmpl[i] == ' ' || tmpl[i] == '\t' || tmpl[i] == '\n')) ++i;
    const size_t start = i;
    while (i < tmpl.size() && tmpl[i] != ' ' && tmpl[i] != '\t' && tmpl[i] != '\n') ++i;
    if (i > start) argv.push_back(fill(tmpl.substr(start, i - start), v, has_port));
  }
  if (argv.empty()) throw Error("workers.exec.command is empty: give the server's command line with {port}");
  if (!has_port) throw Error("workers.exec.command: needs {port}, where the supervisor reaches the server");
  return argv;
}

}  // namespace ds4
