#include "worker/grammar_sampler.h"

#include <algorithm>
#include <limits>

#include "shared/error.h"
#include "shared/gguf.h"
#include "text/tokenizer.h"

namespace ds4 {

namespace {

// GGUF token types (llama.cpp's llama_token_type).
enum TokenType : int64_t { kNormal = 1, kUnknown = 2, kControl = 3, kUserDefined = 4, kUnused = 5, kByte = 6 };

// The most distinct grammar states whose masks one request keeps.
constexpr size_t kMaxCachedMasks = 256;

}  // namespace

TokenTable::TokenTable(std::vector<std::string> texts, std::vector<bool> eog)
    : texts_(std::move(texts)), eog_(std::move(eog)) {
  eog_.resize(texts_.size(), false);
  for (size_t i = 0; i < texts_.size(); ++i) {
    if (eog_[i]) {
      eog_ids_.push_back(int32_t(i));
      texts_[i].clear();  // the end, not text
    } else if (!texts_[i].empty()) {
      sorted_.push_back(int32_t(i));
    }
  }
  // std::string orders by unsigned bytes, the order the walk groups by.
  std::sort(sorted_.begin(), sorted_.end(), [this](int32_t a, int32_t b) {
    return texts_[size_t(a)] < texts_[size_t(b)] || (texts_[size_t(a)] == texts_[size_t(b)] && a < b);
  });
}

std::shared_ptr<const TokenTable> TokenTable::from_model(const gguf::File& meta, const Tokenizer& tok) {
  const auto tokens = meta.get_string_array("tokenizer.ggml.tokens");
  const auto types = meta.get_int_array("tokenizer.ggml.token_type");
  const int32_t n = tok.n_vocab();
  // A vocabulary without a BOS key still has llama.cpp's default BOS id (11
  // for BPE: ',' in Qwen's), an ordinary token there: only a named BOS is kept out.
  const bool named_bos = meta.get_int("tokenizer.ggml.bos_token_id").has_value();
  std::vector<std::string> texts(static_cast<size_t>(n));
  std::vector<bool> eog(static_cast<size_t>(n), false);
  for (int32_t i = 0; i < n; ++i) {
    const int64_t type = types && size_t(i) < types->size() ? (*types)[size_t(i)] : kNormal;
    if (tok.is_eog(i)) {
      eog[size_t(i)] = true;
    } else if ((named_bos && i == tok.bos()) || type == kUnknown || type == kUnused) {
      // never part of an answer
    } else if (type == kControl || type == kUserDefined) {
      if (tokens && size_t(i) < tokens->size()) texts[size_t(i)] = (*tokens)[size_t(i)];
    } else {
      texts[size_t(i)] = tok.piece(i);
    }
  }
  return std::make_shared<TokenTable>(std::move(texts), std::move(eog));
}

GrammarSampler::GrammarSampler(std::shared_ptr<const grammar::Grammar> g, std::shared_ptr<const TokenTable> table,
                               bool allow_eog, std::vector<GrammarTrigger> triggers)
    : g_(std::move(g)),
      table_(std::move(table)),
      allow_eog_(allow_eog),
      matcher_(g_),
      triggers_(std::move(triggers)) {
  std::erase_if(triggers_, [](const GrammarTrigger& t) { return t.text.empty(); });
  active_ = triggers_.empty();
  for (const GrammarTrigger& t : triggers_) {
    if (t.at_start) {
      start_settled_ = false;
      start_len_ = std::max(start_len_, t.text.size());
    } else {
      keep_ = std::max(keep_, t.text.size() - 1);
    }
  }
}

size_t GrammarSampler::trigger_at(std::string_view text) const {
  size_t best = std::string_view::npos;
  const size_t first = text.find_first_not_of(" \t\r\n");
  for (const GrammarTrigger& t : triggers_) {
    if (t.at_start) {
      if (!start_settled_ && first != std::string_view::npos && text.substr(first).starts_with(t.text))
        best = std::min(best, first);
    } else if (size_t at = text.find(t.text); at != std::string_view::npos) {
      best = std::min(best, at);
    }
  }
  return best;
}

bool GrammarSampler::fits_waiting(int32_t token) const {
  const std::string text = waiting_ + table_->text(token);
  const size_t at = trigger_at(text);
  return at == std::string::npos || matcher_.can_accept(std::string_view(text).substr(at));
}

bool GrammarSampler::fits(int32_t token) const {
  if (token < 0 || token >= table_->size()) return false;
  if (table_->eog(token)) return allow_eog_ && can_end();
  if (table_->text(token).empty()) return false;
  return active_ ? matcher_.can_accept(table_->text(token)) : fits_waiting(token);
}

bool GrammarSampler::accept(int32_t token) {
  if (token < 0 || token >= table_->size()) return false;
  if (table_->eog(token)) return allow_eog_ && can_end();
  const std::string& text = table_->text(token);
  if (text.empty()) return false;
  if (active_) return matcher_.accept(text);
  waiting_ += text;
  const size_t at = trigger_at(waiting_);
  if (at == std::string::npos) {
    // Keep only what a trigger could still start in.
    if (!start_settled_) {
      const size_t first = waiting_.find_first_not_of(" \t\r\n");
      start_settled_ = first != std::string::npos && waiting_.size() - first >= start_len_;
    }
    if (start_settled_ && waiting_.size() > keep_) waiting_.erase(0, waiting_.size() - keep_);
    return true;
  }
  active_ = true;
  const bool ok = matcher_.accept(std::string_view(waiting_).substr(at));
  waiting_.clear();
  return ok;
}

size_t GrammarSampler::mask(std::span<float> logits) {
  if (!active_) return mask_waiting(logits);
  const std::string key = matcher_.key();
  auto it = cache_.find(key);
  if (it == cache_.end()) {
    if (cache_.size() >= kMaxCachedMasks) cache_.clear();
    std::vector<uint64_t> bits((size_t(table_->size()) + 63) / 64, 0);
    compute(bits);
    it = cache_.emplace(key, std::move(bits)).first;
    ++computed_;
  } else {
    ++cached_;
  }
  const std::vector<uint64_t>& bits = it->second;
  constexpr float kOff = -std::numeric_limits<float>::infinity();
  size_t allowed = 0;
  const size_t n = std::min(logits.size(), size_t(table_->size()));
  for (size_t i = 0; i < n; ++i) {
    if (bits[i / 64] >> (i % 64) & 1) ++allowed;
    else logits[i] = kOff;
  }
  for (size_t i = n; i < logits.size(); ++i) logits[i] = kOff;  // padding past the vocabulary
  return allowed;
}

// Waiting for a trigger, every token is free but those that complete a
// trigger with bytes the grammar refuses. Rare (the engine asks only when the
// drawn token did not fit), so each token is tried.
size_t GrammarSampler::mask_waiting(std::span<float> logits) const {
  constexpr float kOff = -std::numeric_limits<float>::infinity();
  size_t allowed = 0;
  for (size_t i = 0; i < logits.size(); ++i) {
    if (int32_t(i) < table_->size() && fits(int32_t(i))) ++allowed;
    else logits[i] = kOff;
  }
  return allowed;
}

void GrammarSampler::compute(std::vector<uint64_t>& bits) const {
  if (levels_.empty()) levels_.push_back(matcher_);
  else levels_[0] = matcher_;
  if (!matcher_.dead()) walk(0, table_->sorted().size(), 0, bits);
  if (allow_eog_ && matcher_.can_end())
    for (int32_t t : table_->eog_tokens()) bits[size_t(t) / 64] |= uint64_t(1) << (size_t(t) % 64);
}

// Tokens sorted()[lo, hi) share their first `depth` bytes, which
// levels_[depth] has accepted: those that end there are allowed; the rest
// are grouped by their next byte, each group tried once.
void GrammarSampler::walk(size_t lo, size_t hi, size_t depth, std::vector<uint64_t>& bits) const {
  const std::vector<int32_t>& sorted = table_->sorted();
  size_t i = lo;
  for (; i < hi && table_->text(sorted[i]).size() == depth; ++i)
    bits[size_t(sorted[i]) / 64] |= uint64_t(1) << (size_t(sorted[i]) % 64);
  if (levels_.size() <= depth + 1) levels_.push_back(levels_[depth]);
  while (i < hi) {
    const auto b = uint8_t(table_->text(sorted[i])[depth]);
    const size_t j = size_t(std::partition_point(sorted.begin() + long(i), sorted.begin() + long(hi), [&](int32_t t) {
                              return uint8_t(table_->text(t)[depth]) == b;
                            }) - sorted.begin());
    levels_[depth + 1] = levels_[depth];
    if (levels_[depth + 1].accept_byte(b)) walk(i, j, depth + 1, bits);
    i = j;
  }
}

}  // namespace ds4
