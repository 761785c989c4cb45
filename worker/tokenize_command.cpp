// ds4-worker tokenize: a model's tokenizer from the command line, to compare
// with llama.cpp's llama-tokenize (tests/integration/test_bpe_llamacpp.sh).
#include <cstdio>
#include <fstream>
#include <sstream>

#include "shared/error.h"
#include "shared/gguf.h"
#include "text/tokenizer.h"
#include "worker/cli.h"
#include "worker/commands.h"

namespace ds4 {

int cmd_tokenize(const std::vector<std::string>& argv) {
  Args a(argv, {"model", "prompt", "file"}, {"special", "no-bos", "escape"},
         {{"-m", "model"}, {"-p", "prompt"}, {"-f", "file"}});
  if (a.has("prompt") == a.has("file")) throw Error("give the text as one of --prompt and --file");
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
  const gguf::File file = gguf::File::open(a.required("model"));
  const Tokenizer tok = Tokenizer::from_gguf(file);
  if (a.has("escape")) text = tok.escape_special(text);
  const std::vector<int32_t> ids = tok.encode(text, !a.has("no-bos"), a.has("special"));
  std::string line;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i) line += ' ';
    line += std::to_string(ids[i]);
  }
  std::printf("%s\n", line.c_str());
  return 0;
}

}  // namespace ds4
