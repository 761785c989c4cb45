// ds4-worker tokenize: a model's tokenizer from the command line, to compare
// with llama.cpp's llama-tokenize (tests/integration/test_bpe_llamacpp.sh).
// --lines FILE tokenizes many texts with one load: each line of FILE is a JSON
// string, and each gives one line of ids.
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "shared/error.h"
#include "shared/gguf.h"
#include "text/tokenizer.h"
#include "worker/cli.h"
#include "worker/commands.h"

namespace ds4 {

int cmd_tokenize(const std::vector<std::string>& argv) {
  Args a(argv, {"model", "prompt", "file", "lines"}, {"special", "no-bos", "escape"},
         {{"-m", "model"}, {"-p", "prompt"}, {"-f", "file"}});
  if (int(a.has("prompt")) + int(a.has("file")) + int(a.has("lines")) != 1)
    throw Error("give the text as one of --prompt, --file and --lines");
  const gguf::File file = gguf::File::open(a.required("model"));
  const Tokenizer tok = Tokenizer::from_gguf(file);
  auto print = [&](std::string text) {
    if (a.has("escape")) text = tok.escape_special(text);
    const std::vector<int32_t> ids = tok.encode(text, !a.has("no-bos"), a.has("special"));
    std::string line;
    for (size_t i = 0; i < ids.size(); ++i) {
      if (i) line += ' ';
      line += std::to_string(ids[i]);
    }
    std::printf("%s\n", line.c_str());
  };
  if (a.has("lines")) {
    std::ifstream in(a.str("lines"), std::ios::binary);
    if (!in) throw Error("--lines: cannot read '" + a.str("lines") + "'");
    std::string line;
    for (int n = 1; std::getline(in, line); ++n) {
      nlohmann::json j;
      try {
        j = nlohmann::json::parse(line);
      } catch (const nlohmann::json::parse_error& e) {
        throw Error(a.str("lines") + ":" + std::to_string(n) + ": not a JSON string: " + e.what());
      }
      if (!j.is_string()) throw Error(a.str("lines") + ":" + std::to_string(n) + ": not a JSON string");
      print(j.get<std::string>());
    }
    return 0;
  }
  std::string text;
  if (a.has("file")) {
    std::ifstream in(a.str("file"), std::ios::binary);
    if (!in) throw Error("--file: cannot read '" + a.str("file") + "'");
    std::stringstream ss;
    ss << in.rdbuf();
    text = ss.str();
  } else {
    text = a.str("prompt");
  }
  print(std::move(text));
  return 0;
}

}  // namespace ds4
