#pragma once
/// The tokenizer of a GGUF vocabulary, as llama.cpp tokenizes:
///
/// - SentencePiece (`tokenizer.ggml.model = llama`): a space is prepended
///   (add_space_prefix, default true), spaces become U+2581, pieces are merged
///   greedily by score, and a byte without a piece falls back to <0xNN>.
/// - Byte-level BPE (`tokenizer.ggml.model = gpt2`): the text is cut into
///   words by the pre-tokenizer that `tokenizer.ggml.pre` names (llama-bpe,
///   qwen2, deepseek-v3, gpt-2, default; text/bpe_pretokenizer.h), each word's
///   bytes are spelled in GPT-2's byte characters and merged by the rank of
///   `tokenizer.ggml.merges`.
///
/// Special tokens: user-defined tokens are always matched in the text; control
/// (and unknown) tokens only when encode() is asked to parse specials, which is
/// what a rendered chat template needs. Content that must stay text inside a
/// template goes through escape_special() first.

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "shared/gguf.h"
#include "text/bpe.h"
#include "text/bpe_pretokenizer.h"

namespace ds4 {

class Tokenizer {
 public:
  /// Throws ds4::Error naming the key when the vocabulary is missing, of an
  /// unsupported model, or inconsistent (for BPE: a missing merges array, a
  /// merge naming a token not in the vocabulary, an unknown pre-tokenizer).
  static Tokenizer from_gguf(const gguf::File& meta);

  /// Plain text in, tokens out: control tokens' texts are ordinary text.
  std::vector<int32_t> encode(std::string_view text, bool add_bos) const {
    return encode(text, add_bos, false);
  }
  /// With `parse_special`, the text of a control or unknown token is that token
  /// (a chat template's output). `add_bos` adds bos (and eos where the
  /// vocabulary says add_eos_token) when the vocabulary asks for it.
  std::vector<int32_t> encode(std::string_view text, bool add_bos, bool parse_special) const;

  /// The escape mark: U+FDD0, a Unicode noncharacter (reserved for a
  /// program's internal use, never meaningful in text). encode() drops every
  /// one it meets, in either mode; it never becomes a token.
  static constexpr std::string_view kEscapeMark = "\xEF\xB7\x90";
  /// Marks every special-token text in `content` so that encode(...,
  /// parse_special=true) treats it as ordinary text; applied to message
  /// contents before a template renders. It puts kEscapeMark after the first
  /// character of each place where a control or unknown token's text starts
  /// (user-defined tokens are matched in plain text too, so they stay). Hence
  ///   encode(escape_special(c), b, true) == encode(c, b, false)
  /// for any content c without kEscapeMark, except for a control token whose
  /// text is one character, which cannot be split.
  std::string escape_special(std::string_view content) const;

  /// The bytes a token stands for: U+2581 → ' ', <0xNN> → that byte, BPE byte
  /// characters → their bytes, control → "".
  std::string piece(int32_t token) const;
  /// Concatenated pieces; a leading space from the prefix is kept as llama.cpp does
  /// for detokenize(…, remove_special=false) on non-first chunks.
  std::string decode(std::span<const int32_t> tokens) const;

  int32_t n_vocab() const;
  int32_t bos() const;
  int32_t eos() const;
  int32_t eot() const { return eot_; }  // -1 when none
  bool add_bos() const;          // tokenizer.ggml.add_bos_token (SPM: default true)
  /// End of generation: eos, eot, eom and the tokens whose text ends a turn in
  /// the common chat formats (<|eot_id|>, <|im_end|>, <|endoftext|>, ...), as
  /// llama.cpp's special_eog_ids.
  bool is_eog(int32_t token) const;
  /// A control token (its text is matched only with parse_special).
  bool is_control(int32_t token) const;
  bool is_bpe() const { return bpe_ != nullptr; }
  bool valid(int32_t token) const { return token >= 0 && token < n_vocab(); }
  /// The id of the token whose text (as stored in the vocabulary) is `text`, -1 when none.
  int32_t find(std::string_view text) const;
  /// The most bytes of text one token stands for (at least 4: an unknown
  /// character becomes one token). A text of B bytes has at least
  /// B / max_token_bytes() tokens, known without encoding it (escape marks,
  /// three bytes per special text of escaped content, aside).
  size_t max_token_bytes() const { return max_token_bytes_; }

 private:
  struct Bpe;  // byte-level BPE state (text/tokenizer_bpe.cpp)
  struct Fragment {
    std::string_view text;  // raw text when token < 0
    int32_t token = -1;
  };

  void build_index();
  void mark_eog();
  void build_tables(bool bpe);
  /// Cuts `text` at special tokens in llama.cpp's order (longest text first;
  /// each one's occurrences left to right within what is still text).
  void partition(std::string_view text, bool parse_special, std::vector<Fragment>& out) const;
  void encode_spm(std::string_view escaped, std::vector<int32_t>& out) const;
  void encode_bpe(std::string_view text, std::vector<int32_t>& out) const;
  void load_bpe(const gguf::File& meta, const PreTokenizerInfo& pre);

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
  // Special tokens (control, user-defined, unknown), longest text first, and
  // for each first byte the indices into specials_ of those starting with it.
  std::vector<int32_t> specials_;
  std::vector<std::vector<uint32_t>> special_by_byte_;
  std::vector<int32_t> eog_;           // end-of-generation ids
  int32_t byte_tokens_[256];           // byte → <0xNN> token (or unk)
  int32_t bos_ = 1, eos_ = 2, unk_ = 0, eot_ = -1, eom_ = -1;
  bool add_bos_ = true, add_eos_ = false, add_space_prefix_ = true;
  size_t max_token_bytes_ = 4;
  std::shared_ptr<const Bpe> bpe_;     // set for byte-level BPE vocabularies
};

}  // namespace ds4
