#pragma once
/// Resuming an exec engine's stream mid-answer (workers.engine: exec): the
/// pure part. What an engine can do is probed once per engine start
/// (engine_probe.h); a stream that the engine can resume asks it for each
/// generated token's id (n_probs 1 with post_sampling_probs: the sampler's
/// candidates, not the vocabulary sorted), the ResumableStream filter records
/// the ids and hides them from a client that did not ask, and when the
/// engine dies the continuation is the prompt's ids plus the generated ids as
/// a prompt of ids to /v1/completions (the chat prompt from the engine's own
/// /apply-template), whose stream the filter turns into the client's
/// protocol, with the first answer's id, created and usage. Nothing depends
/// on tokenising text twice: with greedy decoding the resumed answer is the
/// undisturbed one.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "supervisor/proxy/engine_call.h"
#include "supervisor/proxy/json_util.h"

namespace ds4::proxy {

/// What an exec engine can do for a resume (llama-server: all of it).
struct EngineCaps {
  bool probed = false;
  bool tokenize = false;        // POST /tokenize {"content","add_special"} → {"tokens":[ids]}
  bool apply_template = false;  // POST /apply-template {"messages"} → {"prompt": text}
  bool token_ids = false;       // /v1/completions takes a prompt of ids, its stream gives each token's id
  bool resumes_completions() const { return tokenize && token_ids; }
  bool resumes_chat() const { return resumes_completions() && apply_template; }
  /// "completions and chat", "completions", "none (…)", for the log.
  std::string describe() const;
};

/// The probe's requests, in order (engine_probe.cpp sends them).
EngineRequest probe_tokenize_request();
EngineRequest probe_template_request();
EngineRequest probe_ids_request(const std::vector<int32_t>& prompt);
/// {"tokens":[ids]} → the ids; nullopt for anything else.
std::optional<std::vector<int32_t>> read_tokens(std::string_view body);
/// {"prompt":"text"} → the text.
std::optional<std::string> read_prompt(std::string_view body);
/// True when an event of this SSE body carries a token id (choices[0].logprobs.content[0].id).
bool stream_has_ids(std::string_view sse);

enum class ResumeKind { none, completions, chat };

/// How `req` resumes on an engine with `caps`: streams of /v1/completions
/// (one prompt, a string or ids) and /v1/chat/completions (no tools,
/// grammar or response_format: a continuation would restart them), n 1.
/// Non-streams are replayed whole instead; Anthropic message streams resume
/// as the chat stream they are sent as (engine_anthropic.h).
ResumeKind resume_kind(const EngineRequest& req, const EngineCaps& caps);

/// What with_token_ids added to the client's request, for the filter to
/// take out again.
struct Added {
  bool ids = false;      // n_probs 1, post_sampling_probs: the client asked no log-probs
  bool timings = false;  // timings_per_token: the client did not ask it
};

/// `req` asking for the generated ids (n_probs 1, post_sampling_probs) when
/// the client asked no log-probs itself, and for the count of generated
/// tokens in each event (timings_per_token: predicted_n). llama-server's
/// chat stream leaves out the ids of a token whose text adds nothing to the
/// message (a control token such as a BOS in the answer): the count shows
/// where one is missing.
EngineRequest with_token_ids(const EngineRequest& req, ResumeKind kind, Added& added);

/// The engine's stream on its way to the client (SSE events, split anywhere).
class ResumableStream {
 public:
  /// `usage_chunk`: a chat client asked stream_options.include_usage.
  ResumableStream(ResumeKind kind, Added added, bool usage_chunk = false)
      : kind_(kind), strip_(added.ids), strip_timings_(added.timings), usage_chunk_(usage_chunk) {}
  /// A generated token whose id the engine's stream left out (its count
  /// showed it): the resume asks the engine for it (hole_request).
  static constexpr int32_t kHole = -1;
  /// Bytes of the engine's answer in; the bytes for the client out.
  std::string feed(std::string_view bytes);
  /// The next bytes come from a continuation (a /v1/completions stream).
  void begin_continuation();
  /// The ids generated so far, kHole where the stream left one out.
  const std::vector<int32_t>& generated() const { return generated_; }
  /// The first position whose id is missing.
  std::optional<size_t> first_hole() const;
  void fill_hole(size_t at, int32_t id) { generated_.at(at) = id; }
  bool finished() const { return finished_; }  // a finish_reason went out
  bool ended() const { return ended_; }        // [DONE] went out
  /// Every token that went out has its id, and nothing went out that a
  /// continuation could not go on from (tool calls, a thought).
  bool resumable() const { return resumable_ && kind_ != ResumeKind::none; }
  int top_logprobs() const { return top_; }   // entries the client's log-probs had (chat)
  /// The end of a stream whose engine died after its last token but before
  /// its finish: finish_reason "length", usage, [DONE].
  std::string end_length(int64_t prompt_tokens);
  /// The [DONE] of a stream whose finish went out but whose engine died
  /// before its own [DONE].
  std::string close();

 private:
  std::string event(std::string_view data);
  void take_ids(const json& choice);
  void count_tokens(const json& event, size_t before);
  bool strip_event_timings(json& event) const;
  std::string continued(json& j);
  ResumeKind kind_;
  bool strip_, strip_timings_, usage_chunk_;
  std::string pending_;  // an event not yet complete
  std::vector<int32_t> generated_;
  bool continuing_ = false, finished_ = false, ended_ = false, resumable_ = true;
  int64_t base_ = 0;     // tokens generated before the current continuation
  int top_ = -1;
  json id_, created_, model_, fingerprint_;  // the first answer's
};

/// One change to a forwarded stream's filter (ResumableStream), as the
/// scheduler makes it. The session journals each with the bytes it sends
/// the client, so that a supervisor restarted mid-answer rebuilds the filter
/// from them (Scheduler::restore) and an engine continues the answer.
struct EngineOp {
  enum class Kind : uint8_t {
    feed = 0,          // the engine's bytes
    continuation = 1,  // a continuation's stream follows (begin_continuation)
    hole = 2,          // fill_hole(at, id)
    end = 3,           // end_length(at)
    close = 4,         // close()
  };
  Kind kind = Kind::feed;
  ResumeKind resume = ResumeKind::none;  // the stream's: none when it cannot be resumed
  bool as_chat = false;                  // an Anthropic stream sent to the engine as chat
  std::string bytes;
  int64_t at = 0;
  int32_t id = 0;
  bool operator==(const EngineOp&) const = default;
};

/// The chat client asked stream_options.include_usage.
bool wants_usage_chunk(const EngineRequest& req);
/// The body for /tokenize: `text` with the special tokens the engine adds
/// to a prompt (BOS), as its completions tokenise it.
std::string tokenize_body(const std::string& text);
/// A completions request's prompt: its ids when it is an array of ids,
/// else nullopt (then `text` is set to the prompt string).
std::optional<std::vector<int32_t>> prompt_ids(const EngineRequest& req, std::string& text);
/// The chat request as /apply-template takes it (the same body).
EngineRequest apply_template_request(const EngineRequest& req);
/// The continuation: prompt + generated ids as the prompt of a
/// /v1/completions stream with what is left of max_tokens and the client's
/// sampling; ids asked again (n_probs) the way the first request had them.
/// `top`: the chat client's top_logprobs seen (ResumableStream::top_logprobs).
/// nullopt when nothing is left to generate (max_tokens reached).
std::optional<EngineRequest> continuation_request(const EngineRequest& req, ResumeKind kind, const std::vector<int32_t>& prompt,
                                   const std::vector<int32_t>& generated, int top);
/// The request for the id missing at generated[at] (a ResumableStream
/// hole): one greedy token after the prompt and generated[0, at), with the
/// request's other sampling settings (logit_bias, ignore_eos). Greedy: the
/// token left out carried no text, and the most likely one is the token
/// an undisturbed greedy answer had there.
EngineRequest hole_request(const EngineRequest& req, ResumeKind kind, const std::vector<int32_t>& prompt,
                           const std::vector<int32_t>& generated, size_t at);
/// The first token id of a /v1/completions stream asked with ids.
std::optional<int32_t> first_token_id(std::string_view sse);

}  // namespace ds4::proxy
