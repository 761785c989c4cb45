#pragma once
/// SentencePiece-style tokenizer (`tokenizer.ggml.model = llama`) built from a
/// GGUF vocabulary: tokens, scores and token types. Matches llama.cpp's SPM
/// tokenizer: a space is prepended (add_space_prefix, default true), spaces
/// become U+2581, pieces are merged greedily by score (bigram merges), and any
/// byte without a piece falls back to the <0xNN> byte tokens. Control tokens in
/// the text are not parsed as special (plain text in, plain tokens out).

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "shared/gguf.h"

namespace ds4 {

class Tokenizer {
 public:
  /// Throws ds4::Error naming the key when the vocabulary is missing, of an
  /// unsupported model (anything but `llama`), or inconsistent.
  static Tokenizer from_gguf(const gguf::File& meta);

  std::vector<int32_t> encode(std::string_view text, bool add_bos) const;
  /// The bytes a token stands for: U+2581 → ' ', <0xNN> → that byte, control → "".
  std::string piece(int32_t token) const;
  /// Concatenated pieces; a leading space from the prefix is kept as llama.cpp does
  /// for detokenize(…, remove_special=false) on non-first chunks.
  std::string decode(std::span<const int32_t> tokens) const;

  int32_t n_vocab() const;
  int32_t bos() const;
  int32_t eos() const;
  bool add_bos() const;          // tokenizer.ggml.add_bos_token, default true for SPM
  bool is_eog(int32_t token) const;  // eos / eot
  bool valid(int32_t token) const { return token >= 0 && token < n_vocab(); }
  /// The most bytes of text one token stands for (at least 4: an unknown
  /// character becomes one token). A text of B bytes has at least
  /// B / max_token_bytes() tokens, known without encoding it.
  size_t max_token_bytes() const { return max_token_bytes_; }

 private:
  void build_tables();
  void encode_spm(std::string_view escaped, std::vector<int32_t>& out) const;
  /// The id of the token whose text is `text`, -1 when none.
  int32_t find(std::string_view text) const;

  std::vector<std::string> tokens_;
  std::vector<float> scores_;
  std::vector<int32_t> types_;
  // text → id by open addressing (a lookup per merge candidate is encoding's
  // inner loop): a power-of-two table of {hash, id}, id -1 when empty.
  struct Slot {
    uint32_t hash = 0;
    int32_t id = -1;
  };
  std::vector<Slot> index_;
  std::vector<std::string> pieces_;    // what piece() returns, per id
  std::vector<int32_t> user_defined_;  // matched in raw text, longest first
  std::vector<int32_t> eog_;           // end-of-generation ids
  int32_t byte_tokens_[256];           // byte → <0xNN> token (or unk)
  int32_t bos_ = 1, eos_ = 2, unk_ = 0, eot_ = -1;
  bool add_bos_ = true, add_space_prefix_ = true;
  size_t max_token_bytes_ = 4;
};

}  // namespace ds4
