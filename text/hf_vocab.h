#pragma once
/// A byte-level BPE vocabulary read from a Hugging Face tokenizer folder
/// (tokenizer.json + tokenizer_config.json) and written as GGUF keys the way
/// llama.cpp's convert_hf_to_gguf.py writes them, so that llama.cpp and ds4
/// load it alike.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shared/gguf_writer.h"

namespace ds4 {

struct HfVocab {
  std::vector<std::string> tokens;   // by id; ids nobody names are "[PAD<id>]"
  std::vector<int32_t> types;        // 1 normal, 3 control, 4 user-defined, 5 unused
  std::vector<std::string> merges;   // "left right", by rank
  std::string pre;                   // tokenizer.ggml.pre
  std::optional<int32_t> bos, eos, pad, unk;
  std::optional<bool> add_bos, add_eos;
  std::string chat_template;         // "" when the folder has none
  std::vector<std::pair<std::string, std::string>> named_templates;  // the others, by name
};

/// Reads `dir`/tokenizer.json and `dir`/tokenizer_config.json (the latter
/// optional). The pre-tokenizer is `pre` when given, else told from
/// tokenizer.json's pre_tokenizer as llama.cpp's converter names it
/// (llama-bpe, qwen2, deepseek-v3, gpt-2). Throws ds4::Error naming the file
/// and the field when it is not a byte-level BPE vocabulary ds4 can use.
HfVocab read_hf_vocab(const std::string& dir, std::string_view pre = {});

/// The pre-tokenizer name for a tokenizer.json "pre_tokenizer" value (as JSON
/// text); throws ds4::Error when it is none that ds4 knows.
std::string detect_pre_tokenizer(std::string_view pre_tokenizer_json);

/// Sets the tokenizer.* keys of `v` on `w` (model gpt2, pre, tokens,
/// token_type, merges, special ids, add_bos/add_eos, chat templates).
void write_hf_vocab(const HfVocab& v, gguf::Writer& w);

}  // namespace ds4
