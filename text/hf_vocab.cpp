#include "text/hf_vocab.h"

#include <cctype>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "shared/error.h"

namespace ds4 {

namespace {

using nlohmann::json;

json read_json(const std::string& path, bool required) {
  std::ifstream in(path);
  if (!in) {
    if (!required) return json();
    throw Error(path + ": cannot read it (a Hugging Face tokenizer folder holds tokenizer.json)");
  }
  std::stringstream ss;
  ss << in.rdbuf();
  try {
    return json::parse(ss.str());
  } catch (const json::parse_error& e) {
    throw Error(path + ": not valid JSON: " + e.what());
  }
}

// The Split patterns of a pre_tokenizer, in order, and whether a ByteLevel
// step with its own (GPT-2) expression is there.
void collect(const json& p, std::vector<std::string>& splits, bool& byte_level, bool& byte_regex) {
  if (!p.is_object()) return;
  const std::string type = p.value("type", "");
  if (type == "Sequence" && p.contains("pretokenizers") && p["pretokenizers"].is_array()) {
    for (const json& q : p["pretokenizers"]) collect(q, splits, byte_level, byte_regex);
  } else if (type == "Split" && p.contains("pattern") && p["pattern"].is_object()) {
    const json& pat = p["pattern"];
    if (pat.contains("Regex") && pat["Regex"].is_string()) splits.push_back(pat["Regex"]);
    else if (pat.contains("String") && pat["String"].is_string()) splits.push_back(pat["String"]);
  } else if (type == "ByteLevel") {
    byte_level = true;
    byte_regex = byte_regex || p.value("use_regex", true);
  }
}

bool has(const std::string& s, std::string_view part) { return s.find(part) != std::string::npos; }

// A special token named in tokenizer_config.json: a string, an AddedToken
// object ({"content": ...}) or null.
std::optional<std::string> token_text(const json& cfg, const char* key) {
  if (!cfg.is_object() || !cfg.contains(key)) return std::nullopt;
  const json& v = cfg[key];
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string()) return v["content"].get<std::string>();
  return std::nullopt;
}

// convert_hf_to_gguf.py's does_token_look_special.
bool looks_special(const std::string& t) {
  auto wrapped = [&](std::string_view open, std::string_view close) {
    return t.size() >= open.size() + close.size() && t.starts_with(open) && t.ends_with(close);
  };
  return t == "<pad>" || t == "<mask>" || t == "<2mass>" || t == "[@BOS@]" || wrapped("<|", "|>") ||
         wrapped("<\xef\xbd\x9c", "\xef\xbd\x9c>") || wrapped("<unused", ">");
}

}  // namespace

std::string detect_pre_tokenizer(std::string_view text) {
  json p;
  try {
    p = json::parse(text);
  } catch (const json::parse_error& e) {
    throw Error(std::string("pre_tokenizer: not valid JSON: ") + e.what());
  }
  std::vector<std::string> splits;
  bool byte_level = false, byte_regex = false;
  collect(p, splits, byte_level, byte_regex);
  if (!byte_level) {
    throw Error("pre_tokenizer has no ByteLevel step: not a byte-level BPE vocabulary");
  }
  const bool contractions = splits.size() == 1 && has(splits[0], "(?i:'s|'t|'re|'ve|'m|'ll|'d)") &&
                            has(splits[0], "[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|");
  if (contractions && has(splits[0], "\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|")) return "llama-bpe";
  if (contractions && has(splits[0], "\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|")) return "qwen2";
  if (splits.size() == 3 && splits[0] == "\\p{N}{1,3}" &&
      splits[1] == "[\xe4\xb8\x80-\xe9\xbe\xa5\xe3\x81\x80-\xe3\x82\x9f\xe3\x82\xa0-\xe3\x83\xbf]+" &&
      has(splits[2], "[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+")) {
    return "deepseek-v3";
  }
  if (splits.empty() && byte_regex) return "gpt-2";
  throw Error("pre_tokenizer " + std::string(text.substr(0, 200)) +
              " is none that ds4 knows (llama-bpe, qwen2, deepseek-v3, gpt-2); name one with --pre");
}

HfVocab read_hf_vocab(const std::string& dir, std::string_view pre) {
  const std::string tok_path = dir + "/tokenizer.json";
  const std::string cfg_path = dir + "/tokenizer_config.json";
  const json tok = read_json(tok_path, true);
  const json cfg = read_json(cfg_path, false);
  auto field_error = [&](const std::string& what) { return Error(tok_path + ": " + what); };

  if (!tok.is_object() || !tok.contains("model") || !tok["model"].is_object()) {
    throw field_error("missing object 'model'");
  }
  const json& model = tok["model"];
  const std::string type = model.value("type", "");
  if (type != "BPE") throw field_error("'model.type' is '" + type + "'; only 'BPE' is supported");
  if (!model.contains("vocab") || !model["vocab"].is_object()) throw field_error("missing object 'model.vocab'");
  if (!model.contains("merges") || !model["merges"].is_array()) throw field_error("missing array 'model.merges'");

  HfVocab v;
  try {
    v.pre = pre.empty() ? detect_pre_tokenizer(tok.contains("pre_tokenizer") ? tok["pre_tokenizer"].dump() : "null")
                        : std::string(pre);
  } catch (const Error& e) {
    throw field_error(e.what());
  }

  // Ids: the vocabulary's, then the added tokens' (their text wins).
  std::map<int64_t, std::string> by_id;
  for (const auto& [text, id] : model["vocab"].items()) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= (int64_t(1) << 24)) {
      throw field_error("'model.vocab' entry '" + text + "' has no valid id");
    }
    by_id[id.get<int64_t>()] = text;
  }
  struct Added {
    std::string content;
    bool special;
  };
  std::map<int64_t, Added> added;
  if (tok.contains("added_tokens") && tok["added_tokens"].is_array()) {
    size_t i = 0;
    for (const json& a : tok["added_tokens"]) {
      if (!a.is_object() || !a.contains("id") || !a["id"].is_number_integer() || !a.contains("content") ||
          !a["content"].is_string() || a["id"].get<int64_t>() < 0 || a["id"].get<int64_t>() >= (int64_t(1) << 24)) {
        throw field_error("'added_tokens' entry " + std::to_string(i) + " needs an 'id' and a 'content'");
      }
      added[a["id"].get<int64_t>()] = {a["content"].get<std::string>(), a.value("special", false)};
      ++i;
    }
  }
  int64_t n = 0;
  if (!by_id.empty()) n = std::max(n, by_id.rbegin()->first + 1);
  if (!added.empty()) n = std::max(n, added.rbegin()->first + 1);
  v.tokens.resize(size_t(n));
  v.types.assign(size_t(n), 1);
  for (int64_t id = 0; id < n; ++id) {
    if (auto a = added.find(id); a != added.end()) {
      std::string text = a->second.content;
      if (a->second.special || looks_special(text)) {
        v.types[size_t(id)] = 3;
      } else {
        v.types[size_t(id)] = 4;
        // user-defined spaces are written pre-normalized (U+2581 → ' '), as the converter does
        for (size_t p; (p = text.find("\xe2\x96\x81")) != std::string::npos;) text.replace(p, 3, " ");
      }
      v.tokens[size_t(id)] = std::move(text);
    } else if (auto t = by_id.find(id); t != by_id.end()) {
      v.tokens[size_t(id)] = t->second;
    } else {
      v.tokens[size_t(id)] = "[PAD" + std::to_string(id) + "]";
      v.types[size_t(id)] = 5;
    }
  }

  size_t i = 0;
  for (const json& m : model["merges"]) {
    if (m.is_string()) {
      v.merges.push_back(m.get<std::string>());
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      v.merges.push_back(m[0].get<std::string>() + " " + m[1].get<std::string>());
    } else {
      throw field_error("'model.merges' entry " + std::to_string(i) + " is neither \"a b\" nor [\"a\", \"b\"]");
    }
    ++i;
  }

  // Special ids from tokenizer_config.json's texts.
  auto id_of = [&](const char* key) -> std::optional<int32_t> {
    const auto text = token_text(cfg, key);
    if (!text) return std::nullopt;
    for (const auto& [id, a] : added) {
      if (a.content == *text) return int32_t(id);
    }
    const auto& vocab = model["vocab"];
    if (vocab.contains(*text)) return vocab[*text].get<int32_t>();
    throw Error(cfg_path + ": '" + key + "' is '" + *text + "', which is not in the vocabulary");
  };
  v.bos = id_of("bos_token");
  v.eos = id_of("eos_token");
  v.pad = id_of("pad_token");
  v.unk = id_of("unk_token");
  // add_bos as the converter tells it: a post-processor template that starts
  // with bos, overridden by tokenizer_config.json's add_bos_token.
  if (tok.contains("post_processor") && tok["post_processor"].is_object()) {
    const json& pp = tok["post_processor"];
    if (pp.value("type", "") == "TemplateProcessing" && pp.contains("single") && pp["single"].is_array() &&
        !pp["single"].empty() && v.bos) {
      const json& first = pp["single"][0];
      const bool starts_bos = first.contains("SpecialToken") && first["SpecialToken"].value("id", "") ==
                                                                      v.tokens[size_t(*v.bos)];
      v.add_bos = starts_bos;
    }
  }
  if (cfg.is_object() && cfg.contains("add_bos_token") && cfg["add_bos_token"].is_boolean()) {
    v.add_bos = cfg["add_bos_token"].get<bool>();
  }
  if (cfg.is_object() && cfg.contains("add_eos_token") && cfg["add_eos_token"].is_boolean()) {
    v.add_eos = cfg["add_eos_token"].get<bool>();
  }

  if (cfg.is_object() && cfg.contains("chat_template")) {
    const json& t = cfg["chat_template"];
    if (t.is_string()) {
      v.chat_template = t.get<std::string>();
    } else if (t.is_array()) {
      for (const json& e : t) {
        if (!e.is_object() || !e.contains("name") || !e.contains("template") || !e["name"].is_string() ||
            !e["template"].is_string()) {
          throw Error(cfg_path + ": 'chat_template' list entries need a 'name' and a 'template'");
        }
        // The converter keeps letters and digits of a name, '_' for the rest.
        std::string name = e["name"].get<std::string>();
        for (char& c : name) {
          if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
        }
        if (name.empty()) continue;
        if (name == "default") v.chat_template = e["template"].get<std::string>();
        else v.named_templates.emplace_back(name, e["template"].get<std::string>());
      }
    } else if (!t.is_null()) {
      throw Error(cfg_path + ": 'chat_template' is neither a string nor a list of named templates");
    }
  }
  return v;
}

void write_hf_vocab(const HfVocab& v, gguf::Writer& w) {
  w.set_string("tokenizer.ggml.model", "gpt2");
  w.set_string("tokenizer.ggml.pre", v.pre);
  w.set_string_array("tokenizer.ggml.tokens", v.tokens);
  w.set_i32_array("tokenizer.ggml.token_type", v.types);
  w.set_string_array("tokenizer.ggml.merges", v.merges);
  if (v.bos) w.set_u32("tokenizer.ggml.bos_token_id", uint32_t(*v.bos));
  if (v.eos) w.set_u32("tokenizer.ggml.eos_token_id", uint32_t(*v.eos));
  if (v.unk) w.set_u32("tokenizer.ggml.unknown_token_id", uint32_t(*v.unk));
  if (v.pad) w.set_u32("tokenizer.ggml.padding_token_id", uint32_t(*v.pad));
  if (v.add_bos) w.set_bool("tokenizer.ggml.add_bos_token", *v.add_bos);
  if (v.add_eos) w.set_bool("tokenizer.ggml.add_eos_token", *v.add_eos);
  if (!v.chat_template.empty()) w.set_string("tokenizer.chat_template", v.chat_template);
  std::vector<std::string> names;
  for (const auto& [name, text] : v.named_templates) {
    w.set_string("tokenizer.chat_template." + name, text);
    names.push_back(name);
  }
  if (!names.empty()) w.set_string_array("tokenizer.chat_templates", names);
}

}  // namespace ds4
