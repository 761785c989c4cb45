// ds4-template: renders a Jinja chat template with a JSON context.
//   ds4-template --template FILE --context FILE.json
//   ds4-template --gguf MODEL.gguf --context FILE.json   (tokenizer.chat_template)
// Options --max-steps N, --max-output N, --max-depth N set the limits.
// The rendering goes to stdout; an error to stderr, with exit status 1.
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>

#include "shared/error.h"
#include "shared/gguf.h"
#include "text/jinja.h"

namespace {

const char kUsage[] =
    "usage: ds4-template (--template FILE | --gguf MODEL.gguf) --context FILE.json\n"
    "                    [--max-steps N] [--max-output BYTES] [--max-depth N]\n";

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ds4::Error(path + ": cannot read");
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

size_t number(const char* opt, const char* v) {
  char* end = nullptr;
  errno = 0;
  const unsigned long long x = std::strtoull(v, &end, 10);
  if (!*v || *end || errno || v[0] == '-') throw ds4::Error(std::string(opt) + ": expected a whole number, got '" + v + "'");
  return size_t(x);
}

int run(int argc, char** argv) {
  std::string tpl_path, gguf_path, ctx_path;
  ds4::jinja::Limits limits;
  for (int k = 1; k < argc; ++k) {
    const std::string a = argv[k];
    if (a == "-h" || a == "--help") {
      std::fputs(kUsage, stdout);
      return 0;
    }
    if (k + 1 >= argc) throw ds4::Error(a + ": expected a value\n" + kUsage);
    const char* v = argv[++k];
    if (a == "--template") tpl_path = v;
    else if (a == "--gguf") gguf_path = v;
    else if (a == "--context") ctx_path = v;
    else if (a == "--max-steps") limits.max_steps = number("--max-steps", v);
    else if (a == "--max-output") limits.max_output = number("--max-output", v);
    else if (a == "--max-depth") limits.max_depth = number("--max-depth", v);
    else throw ds4::Error("unknown option '" + a + "'\n" + kUsage);
  }
  if (tpl_path.empty() == gguf_path.empty()) throw ds4::Error(std::string("give one of --template or --gguf\n") + kUsage);
  if (ctx_path.empty()) throw ds4::Error(std::string("--context is required\n") + kUsage);
  std::string source;
  if (!tpl_path.empty()) {
    source = read_file(tpl_path);
  } else {
    const auto file = ds4::gguf::File::open(gguf_path);
    auto t = file.get_string("tokenizer.chat_template");
    if (!t) throw ds4::Error(gguf_path + ": no tokenizer.chat_template");
    source = *t;
  }
  nlohmann::ordered_json ctx;
  try {
    ctx = nlohmann::ordered_json::parse(read_file(ctx_path));
  } catch (const nlohmann::json::parse_error& e) {
    throw ds4::Error(ctx_path + ": " + e.what());
  }
  if (!ctx.is_object()) throw ds4::Error(ctx_path + ": expected a JSON object");
  const auto tpl = ds4::jinja::Template::parse(source);
  const std::string out = tpl.render(ctx, limits);
  std::fwrite(out.data(), 1, out.size(), stdout);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ds4-template: %s\n", e.what());
    return 1;
  }
}
