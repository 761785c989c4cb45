#pragma once
/// The pre-tokenizers of byte-level BPE vocabularies: they cut a text into
/// words before merges, each family by its own rules (`tokenizer.ggml.pre`).
/// Written by hand after the regular expressions that llama.cpp applies for
/// each name, with llama.cpp's own readings of them where it departs from the
/// expression (its hand-written GPT-2 and Llama 3 splitters; its class tables,
/// in which '~' is neither \p{P} nor \p{S} for the DeepSeek V3 expression).

#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

namespace ds4 {

enum class PreTokenizer {
  kDefault,    // llama.cpp's fallback: punctuation runs, GPT-2's words, digit runs in threes
  kGpt2,       // 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)
  kLlama3,     // (?i:'s|…)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
  kQwen2,      // Llama 3's with \p{N} one digit at a time
  kDeepSeek3,  // \p{N}{1,3}, then [一-龥぀-ゟ゠-ヿ]+, then its own word expression
};

struct PreTokenizerInfo {
  PreTokenizer kind;
  bool ignore_merges;  // a word that is a token as a whole is that token (Llama 3)
  bool add_bos;        // the default of tokenizer.ggml.add_bos_token
};

/// The pre-tokenizer llama.cpp picks for `tokenizer.ggml.pre` = `name` (its
/// names: "llama-bpe", "qwen2", "deepseek-v3", "gpt-2", "default", and their
/// aliases); nullopt for a name ds4 does not know.
std::optional<PreTokenizerInfo> pre_tokenizer_named(std::string_view name);

/// Cuts `cpts` (code points) into words: appends the length, in code points,
/// of each word in order; the lengths add up to cpts.size().
void pre_tokenize(PreTokenizer kind, std::span<const uint32_t> cpts, std::vector<uint32_t>& lengths);

}  // namespace ds4
