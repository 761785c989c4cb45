#pragma once
/// The grammar in the sampler: per request, a grammar::Matcher advanced by
/// every token of the answer, and before each draw a mask that sets the logit
/// of every token the grammar cannot take next to -inf (greedy and sampling
/// alike).
///
/// Tokens are bytes to the grammar (TokenTable): a normal token its piece
/// (Tokenizer::piece), a byte token its byte, a control or user-defined token
/// its text in the GGUF vocabulary (`tokenizer.ggml.tokens`: Qwen's
/// "<tool_call>" is one token, and a grammar literal "<tool_call>" matches
/// it, as well as the same text spelled in plain tokens). End-of-generation
/// tokens stand for the end of the answer: allowed only where the grammar
/// accepts the end. BOS, unknown and unused tokens, and tokens with no
/// text, are never allowed.
///
/// A lazy grammar (triggers given) waits: the answer is free text until one
/// of its triggers appears, and from the trigger's first byte on the answer
/// must follow the grammar (a tool call the model may or may not make, kept
/// to its schema once it starts). Its state is a function of the answer's
/// tokens, as an eager grammar's, so a resumed request stays exact.
///
/// Speed: the engine tries the drawn token first (fits()) and masks only
/// when the grammar refuses it, as llama.cpp does. The mask walks the tokens sorted by their bytes (a trie, implicit)
/// with the matcher, so a prefix the grammar refuses rules out every token
/// that starts with it at once; masks are cached by the matcher's state
/// (Matcher::key), which repeats often (inside a string, between members).

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "text/grammar.h"

namespace ds4 {

class Tokenizer;
namespace gguf { class File; }

class TokenTable {
 public:
  /// Per token: its bytes (see above) and whether it ends generation.
  TokenTable(std::vector<std::string> texts, std::vector<bool> eog);
  /// From a model's vocabulary: `meta` for the control tokens' text and the
  /// token types, `tok` for pieces and end-of-generation ids.
  static std::shared_ptr<const TokenTable> from_model(const gguf::File& meta, const Tokenizer& tok);

  int32_t size() const { return int32_t(texts_.size()); }
  const std::string& text(int32_t t) const { return texts_[size_t(t)]; }
  bool eog(int32_t t) const { return eog_[size_t(t)]; }
  /// Token ids with text, sorted by their bytes (shorter first on a tie of prefix).
  const std::vector<int32_t>& sorted() const { return sorted_; }
  const std::vector<int32_t>& eog_tokens() const { return eog_ids_; }

 private:
  std::vector<std::string> texts_;
  std::vector<bool> eog_;
  std::vector<int32_t> sorted_;
  std::vector<int32_t> eog_ids_;
};

/// Where a lazy grammar starts (shared/protocol.h's GrammarTrigger).
struct GrammarTrigger {
  std::string text;
  bool at_start = false;  // only as the answer's first text after blanks
};

class GrammarSampler {
 public:
  GrammarSampler(std::shared_ptr<const grammar::Grammar> g, std::shared_ptr<const TokenTable> table,
                 bool allow_eog = true, std::vector<GrammarTrigger> triggers = {});

  /// Sets every token the grammar cannot take next to -inf in `logits`
  /// (TokenTable::size() floats). Returns how many tokens stay allowed (0:
  /// the grammar is stuck, no token continues it). Throws ds4::Error
  /// "grammar: ..." when a matcher limit is passed.
  size_t mask(std::span<float> logits);
  /// Advances by a chosen token (an end-of-generation token ends the
  /// answer). Returns false when the grammar cannot take it; the sampler
  /// is then dead.
  bool accept(int32_t token);
  /// Whether accept(token) would take it, without changing anything.
  bool fits(int32_t token) const;
  /// The answer so far is complete and nothing can follow: finish with stop.
  bool must_end() const { return active_ && matcher_.must_end(); }
  bool can_end() const { return !active_ || matcher_.can_end(); }
  /// The grammar applies: eager, or a trigger has appeared.
  bool active() const { return active_; }

  /// Masks computed (cache misses) and served from the cache, for the cost
  /// measurements.
  size_t computed() const { return computed_; }
  size_t cached() const { return cached_; }

 private:
  void compute(std::vector<uint64_t>& bits) const;
  void walk(size_t lo, size_t hi, size_t depth, std::vector<uint64_t>& bits) const;
  /// Where in `text` (the waiting answer's text) a trigger first appears,
  /// or npos.
  size_t trigger_at(std::string_view text) const;
  /// Lazy and waiting: whether `token`'s text may follow (a trigger it
  /// completes must be followed by bytes the grammar takes).
  bool fits_waiting(int32_t token) const;
  size_t mask_waiting(std::span<float> logits) const;

  std::shared_ptr<const grammar::Grammar> g_;
  std::shared_ptr<const TokenTable> table_;
  bool allow_eog_;
  grammar::Matcher matcher_;
  std::vector<GrammarTrigger> triggers_;
  bool active_ = true;
  std::string waiting_;  // lazy, no trigger yet: the answer's text a trigger could still start in
  bool start_settled_ = true;  // no at_start trigger can fire any more
  size_t start_len_ = 0;       // the longest at_start trigger
  size_t keep_ = 0;            // bytes of waiting_ kept: the longest other trigger's, less one
  mutable std::vector<grammar::Matcher> levels_;  // the walk's matcher per depth (reused buffers)
  std::unordered_map<std::string, std::vector<uint64_t>> cache_;  // Matcher::key → allowed bits
  size_t computed_ = 0, cached_ = 0;
};

}  // namespace ds4
