// Resuming an exec engine's stream (engine_resume.h): which requests resume,
// the ids asked for and hidden again, the stream filter's record of them, and
// the continuation request and its answer in the client's protocol.
#include <doctest/doctest.h>

#include "supervisor/proxy/engine_anthropic.h"
#include "supervisor/proxy/engine_resume.h"
#include "supervisor/proxy/scheduler.h"
#include "supervisor/proxy/session_journal.h"

using namespace ds4::proxy;

namespace {

EngineCaps llama_server() {
  EngineCaps c;
  c.probed = c.tokenize = c.apply_template = c.token_ids = true;
  return c;
}

EngineRequest req(std::string target, std::string body, bool stream = true) {
  EngineRequest r;
  r.target = std::move(target);
  r.body = std::move(body);
  r.stream = stream;
  return r;
}

const Added kIds{true, false};

json body(const EngineRequest& r) { return std::get<json>(parse_body(r.body)); }

// llama-server's chunks, as it writes them (with n_probs 1, post_sampling_probs).
std::string cmpl_chunk(const std::string& text, int id, const char* finish = nullptr, const char* extra = "") {
  std::string lp = id < 0 ? "null" : R"({"content":[{"id":)" + std::to_string(id) + R"(,"token":"x","bytes":[120],"prob":1.0,"top_probs":[]}]})";
  return R"(data: {"choices":[{"text":")" + text + R"(","index":0,"logprobs":)" + lp + R"(,"finish_reason":)" +
         (finish ? "\"" + std::string(finish) + "\"" : "null") + R"(}],"created":7,"model":"m","object":"text_completion",)" +
         extra + R"("id":"cmpl-B"})" + "\n\n";
}

std::string chat_chunk(const std::string& delta, int id, int predicted_n = -1) {
  const std::string timings =
      predicted_n < 0 ? "" : R"(,"timings":{"prompt_n":5,"predicted_n":)" + std::to_string(predicted_n) + "}";
  return R"(data: {"choices":[{"finish_reason":null,"index":0,"delta":)" + delta +
         R"(,"logprobs":{"content":[{"id":)" + std::to_string(id) +
         R"(,"token":"x","bytes":[120],"prob":1.0,"top_probs":[]}]}}],"created":3,"id":"chatcmpl-A","model":"m","object":"chat.completion.chunk")" +
         timings + "}\n\n";
}

}  // namespace

TEST_CASE("engine resume: which requests resume, by API and engine") {
  const EngineCaps all = llama_server();
  CHECK(resume_kind(req("/v1/completions", R"({"prompt":"Once"})"), all) == ResumeKind::completions);
  CHECK(resume_kind(req("/v1/completions", R"({"prompt":[1,2,3]})"), all) == ResumeKind::completions);
  CHECK(resume_kind(req("/v1/completions", R"({"prompt":["Once"]})"), all) == ResumeKind::completions);
  CHECK(resume_kind(req("/v1/chat/completions", R"({"messages":[]})"), all) == ResumeKind::chat);
  // Replayed whole instead, or not resumable: a grammar would restart with it.
  CHECK(resume_kind(req("/v1/completions", R"({"prompt":"Once"})", false), all) == ResumeKind::none);
  CHECK(resume_kind(req("/v1/completions", R"({"prompt":["a","b"]})"), all) == ResumeKind::none);
  CHECK(resume_kind(req("/v1/completions", R"({"prompt":"a","n":2})"), all) == ResumeKind::none);
  CHECK(resume_kind(req("/v1/chat/completions", R"({"messages":[],"tools":[{}]})"), all) == ResumeKind::none);
  CHECK(resume_kind(req("/v1/chat/completions", R"({"messages":[],"response_format":{"type":"json_object"}})"), all) ==
        ResumeKind::none);
  CHECK(resume_kind(req("/v1/messages", R"({"messages":[]})"), all) == ResumeKind::none);
  EngineCaps no_template = all;
  no_template.apply_template = false;
  CHECK(resume_kind(req("/v1/chat/completions", R"({"messages":[]})"), no_template) == ResumeKind::none);
  CHECK(resume_kind(req("/v1/completions", R"({"prompt":"a"})"), no_template) == ResumeKind::completions);
  CHECK(resume_kind(req("/v1/completions", R"({"prompt":"a"})"), EngineCaps{}) == ResumeKind::none);
  CHECK(EngineCaps{}.describe().starts_with("none"));
  CHECK(all.describe() == "completions and chat");
}

TEST_CASE("engine resume: ids are asked for, and hidden again from a client that did not ask") {
  Added added;
  EngineRequest r = with_token_ids(req("/v1/completions", R"({"prompt":"a","max_tokens":4})"), ResumeKind::completions, added);
  CHECK(added.ids);
  CHECK(added.timings);
  CHECK(body(r)["n_probs"] == 1);
  CHECK(body(r)["post_sampling_probs"] == true);
  CHECK(body(r)["timings_per_token"] == true);
  CHECK(body(r)["max_tokens"] == 4);
  r = with_token_ids(req("/v1/chat/completions", R"({"messages":[],"logprobs":true,"timings_per_token":true})"),
                     ResumeKind::chat, added);
  CHECK_FALSE(added.ids);  // its own log-probs carry the ids
  CHECK_FALSE(added.timings);
  CHECK_FALSE(body(r).contains("n_probs"));

  ResumableStream s(ResumeKind::completions, kIds);
  const std::string all = cmpl_chunk("Once", 10) + cmpl_chunk(" upon", 11);
  // Split anywhere: nothing goes out before an event is whole.
  std::string out = s.feed(all.substr(0, 30));
  CHECK(out.empty());
  out += s.feed(all.substr(30));
  CHECK(s.generated() == std::vector<int32_t>{10, 11});
  CHECK(out.find("\"logprobs\":null") != std::string::npos);
  CHECK(out.find("prob") == out.find("\"logprobs\":null") + 4);  // no other log-prob left
  CHECK(s.resumable());
  CHECK_FALSE(s.finished());
}

TEST_CASE("engine resume: text without ids, a thought or a tool call cannot be continued") {
  ResumableStream a(ResumeKind::completions, kIds);
  a.feed(cmpl_chunk("x", -1));
  CHECK_FALSE(a.resumable());
  ResumableStream b(ResumeKind::chat, kIds);
  b.feed(chat_chunk(R"({"content":"Hi"})", 5));
  CHECK(b.resumable());
  b.feed(chat_chunk(R"({"reasoning_content":"hmm"})", 6));
  CHECK_FALSE(b.resumable());
  ResumableStream c(ResumeKind::chat, kIds);
  c.feed(chat_chunk(R"({"tool_calls":[{"index":0}]})", 6));
  CHECK_FALSE(c.resumable());
}

TEST_CASE("engine resume: a completions continuation is the prompt's ids plus the generated ids, what is left of max_tokens") {
  std::string text;
  const EngineRequest orig = req("/v1/completions", R"({"prompt":"Once","max_tokens":10,"temperature":0,"stop":["."]})");
  CHECK_FALSE(prompt_ids(orig, text));
  CHECK(text == "Once");
  CHECK(json::parse(tokenize_body(text)) == json::parse(R"({"content":"Once","add_special":true,"parse_special":true})"));
  std::string none;
  CHECK(prompt_ids(req("/v1/completions", R"({"prompt":[1,5]})"), none) == std::vector<int32_t>{1, 5});

  auto c = continuation_request(orig, ResumeKind::completions, {1, 403}, {10, 11, 12}, -1);
  REQUIRE(c);
  CHECK(c->target == "/v1/completions");
  CHECK(c->stream);
  const json b = body(*c);
  CHECK(b["prompt"] == json::parse("[1,403,10,11,12]"));
  CHECK(b["max_tokens"] == 7);
  CHECK(b["temperature"] == 0);
  CHECK(b["stop"] == json::parse(R"(["."])"));
  CHECK(b["n_probs"] == 1);
  // Nothing left to generate: no request, the stream's end is written instead.
  CHECK_FALSE(continuation_request(orig, ResumeKind::completions, {1}, std::vector<int32_t>(10, 3), -1));
}

TEST_CASE("engine resume: the continuation's stream goes on as the first answer's (id, created, usage)") {
  ResumableStream s(ResumeKind::completions, kIds);
  s.feed(cmpl_chunk("Once", 10));
  s.feed(cmpl_chunk(" up", 11).substr(0, 20));  // the engine died in the middle of an event
  s.begin_continuation();
  std::string out = s.feed(cmpl_chunk(" upon", 11) +
                           cmpl_chunk("", -1, "length", R"("usage":{"completion_tokens":2,"prompt_tokens":5,"total_tokens":7},)") +
                           "data: [DONE]\n\n");
  CHECK(s.generated() == std::vector<int32_t>{10, 11});
  CHECK(out.find(R"("id":"cmpl-B")") != std::string::npos);
  CHECK(out.find(R"("completion_tokens":3,"prompt_tokens":4,"total_tokens":7)") != std::string::npos);
  CHECK(s.finished());
  CHECK(s.ended());
}

TEST_CASE("engine resume: a chat continuation is the template's prompt plus the answer, in chat chunks") {
  const EngineRequest orig = req("/v1/chat/completions",
                                 R"({"messages":[{"role":"user","content":"hi"}],"max_tokens":5,"stream":true,)"
                                 R"("stream_options":{"include_usage":true},"chat_template_kwargs":{"enable_thinking":false}})");
  CHECK(apply_template_request(orig).target == "/apply-template");
  CHECK_FALSE(apply_template_request(orig).stream);
  auto c = continuation_request(orig, ResumeKind::chat, {1, 2}, {5}, -1);
  REQUIRE(c);
  const json b = body(*c);
  CHECK(b["prompt"] == json::parse("[1,2,5]"));
  CHECK(b["max_tokens"] == 4);
  CHECK_FALSE(b.contains("messages"));
  CHECK_FALSE(b.contains("chat_template_kwargs"));

  ResumableStream s(ResumeKind::chat, kIds, wants_usage_chunk(orig));
  std::string first = s.feed(chat_chunk(R"({"content":"Hi"})", 5));
  CHECK(first.find("logprobs") == std::string::npos);
  CHECK(first.find(R"("delta":{"content":"Hi"})") != std::string::npos);
  s.begin_continuation();
  const std::string out =
      s.feed(cmpl_chunk(" there", 6) +
             cmpl_chunk("", -1, "length", R"("usage":{"completion_tokens":1,"prompt_tokens":3,"total_tokens":4},)") +
             "data: [DONE]\n\n");
  CHECK(out.find(R"({"choices":[{"finish_reason":null,"index":0,"delta":{"content":" there"}}],"created":3,"id":"chatcmpl-A","model":"m","object":"chat.completion.chunk"})") !=
        std::string::npos);
  CHECK(out.find(R"("finish_reason":"length","index":0,"delta":{})") != std::string::npos);
  CHECK(out.find(R"({"choices":[],"created":3,"id":"chatcmpl-A")") != std::string::npos);
  CHECK(out.find(R"("completion_tokens":2,"prompt_tokens":2,"total_tokens":4)") != std::string::npos);
  CHECK(out.ends_with("data: [DONE]\n\n"));
  CHECK(s.generated() == std::vector<int32_t>{5, 6});
}

TEST_CASE("engine resume: a token whose event the chat stream left out is a hole, asked for before the continuation") {
  // llama-server's chat stream has no event for a token that adds no text
  // (here a BOS in the answer, id 1): its id is missing, the count shows it.
  ResumableStream s(ResumeKind::chat, Added{true, true});
  std::string out = s.feed(chat_chunk(R"({"content":"."})", 426, 1) + chat_chunk(R"({"content":" Once"})", 403, 3) +
                           chat_chunk(R"({"content":" upon"})", 407, 4));
  CHECK(out.find("timings") == std::string::npos);  // asked by the filter, not by the client
  CHECK(s.generated() == std::vector<int32_t>{426, ResumableStream::kHole, 403, 407});
  REQUIRE(s.first_hole() == 1u);
  CHECK(s.resumable());

  const EngineRequest orig = req("/v1/chat/completions",
                                 R"({"messages":[{"role":"user","content":"hi"}],"max_tokens":50,"temperature":0.8,"ignore_eos":true})");
  const EngineRequest h = hole_request(orig, ResumeKind::chat, {1, 2}, s.generated(), 1);
  CHECK(h.target == "/v1/completions");
  const json b = body(h);
  CHECK(b["prompt"] == json::parse("[1,2,426]"));  // the prompt and the ids before the hole
  CHECK(b["max_tokens"] == 1);
  CHECK(b["temperature"] == 0);  // the most likely token: the greedy answer's
  CHECK(b["ignore_eos"] == true);
  CHECK_FALSE(b.contains("messages"));
  CHECK(first_token_id(cmpl_chunk("", 1) + "data: [DONE]\n\n") == 1);
  CHECK_FALSE(first_token_id(R"(data: {"error":"x"})"));
  s.fill_hole(1, 1);
  CHECK_FALSE(s.first_hole());
  // The continuation counts its own tokens from its start.
  s.begin_continuation();
  s.feed(cmpl_chunk(" a", 264, nullptr, R"("timings":{"predicted_n":2},)"));
  CHECK(s.generated() == std::vector<int32_t>{426, 1, 403, 407, ResumableStream::kHole, 264});

  // The client asked the timings itself: they stay; the last event keeps them either way.
  ResumableStream own(ResumeKind::chat, Added{true, false});
  CHECK(own.feed(chat_chunk(R"({"content":"a"})", 5, 1)).find("predicted_n") != std::string::npos);
  ResumableStream last(ResumeKind::completions, Added{true, true});
  CHECK(last.feed(cmpl_chunk("", -1, "stop", R"("timings":{"predicted_n":0},)")).find("predicted_n") != std::string::npos);
}

TEST_CASE("engine resume: probe answers") {
  CHECK(read_tokens(R"({"tokens":[1,403]})") == std::vector<int32_t>{1, 403});
  CHECK_FALSE(read_tokens(R"({"tokens":[]})"));
  CHECK_FALSE(read_tokens(R"({"tokens":["a"]})"));
  CHECK_FALSE(read_tokens("not json"));
  CHECK(read_prompt(R"({"prompt":"<s>x"})") == "<s>x");
  CHECK_FALSE(read_prompt(R"({"error":"x"})"));
  CHECK(stream_has_ids(cmpl_chunk("x", 4) + "data: [DONE]\n\n"));
  CHECK_FALSE(stream_has_ids(cmpl_chunk("x", -1)));
  CHECK(body(probe_ids_request({1, 2}))["prompt"] == json::parse("[1,2]"));
}

// ---- Anthropic streams sent to the engine as chat (engine_anthropic.h) ------

TEST_CASE("engine resume: an Anthropic text stream goes to the engine as a chat stream, anything else as it came") {
  const EngineRequest msgs = req("/v1/messages",
                                 R"({"model":"m","max_tokens":50,"system":[{"type":"text","text":"Be brief."}],)"
                                 R"("messages":[{"role":"user","content":"hi"},{"role":"assistant","content":[{"type":"text","text":"Hello"}]},)"
                                 R"({"role":"user","content":[{"type":"text","text":"more","cache_control":{"type":"ephemeral"}}]}],)"
                                 R"("temperature":0,"top_k":1,"stream":true,"metadata":{"user_id":"u"},)"
                                 R"("thinking":{"type":"disabled"},"chat_template_kwargs":{"enable_thinking":false}})");
  auto chat = anthropic_as_chat(msgs);
  REQUIRE(chat);
  CHECK(chat->target == "/v1/chat/completions");
  CHECK(chat->stream);
  const json b = body(*chat);
  CHECK(b["messages"] == json::parse(R"([{"role":"system","content":"Be brief."},{"role":"user","content":"hi"},)"
                                     R"({"role":"assistant","content":"Hello"},{"role":"user","content":"more"}])"));
  CHECK(b["max_tokens"] == 50);
  CHECK(b["temperature"] == 0);
  CHECK(b["top_k"] == 1);
  CHECK(b["chat_template_kwargs"]["enable_thinking"] == false);
  CHECK(b["stream_options"]["include_usage"] == true);
  CHECK_FALSE(b.contains("metadata"));
  CHECK_FALSE(b.contains("thinking"));
  // The chat request resumes on llama-server like any chat stream.
  CHECK(resume_kind(*chat, llama_server()) == ResumeKind::chat);

  // What the translation does not carry exactly stays an Anthropic request.
  for (const char* other :
       {R"({"model":"m","max_tokens":5,"stream":true,"messages":[{"role":"user","content":"hi"}],"tools":[]})",
        R"({"model":"m","max_tokens":5,"stream":true,"messages":[{"role":"user","content":"hi"}],"stop_sequences":["x"]})",
        R"({"model":"m","max_tokens":5,"stream":true,"messages":[{"role":"user","content":[{"type":"image","source":{}}]}]})",
        R"({"model":"m","max_tokens":5,"stream":true,"messages":[{"role":"user","content":[{"type":"tool_result","tool_use_id":"a","content":"x"}]}]})",
        R"({"model":"m","max_tokens":5,"stream":true,"messages":[]})", R"([1,2])", R"(not json)"}) {
    const std::string text = other;
    CAPTURE(text);
    CHECK_FALSE(anthropic_as_chat(req("/v1/messages", other)));
  }
  CHECK_FALSE(anthropic_as_chat(req("/v1/messages", R"({"model":"m","max_tokens":5,"messages":[{"role":"user","content":"hi"}]})",
                                    false)));  // whole answers are replayed, not resumed
  CHECK_FALSE(anthropic_as_chat(req("/v1/chat/completions", R"({"messages":[{"role":"user","content":"hi"}],"stream":true})")));
}

TEST_CASE("engine resume: the chat stream reaches an Anthropic client as its message events, split anywhere") {
  const std::string chat =
      R"(data: {"choices":[{"finish_reason":null,"index":0,"delta":{"role":"assistant","content":null}}],"id":"chatcmpl-Q","object":"chat.completion.chunk"})"
      "\n\n"
      R"(data: {"choices":[{"finish_reason":null,"index":0,"delta":{"reasoning_content":"hmm"}}],"id":"chatcmpl-Q"})"
      "\n\n"
      R"(data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"Hi"}}],"id":"chatcmpl-Q"})"
      "\n\n"
      R"(data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":" there"}}],"id":"chatcmpl-Q"})"
      "\n\n"
      R"(data: {"choices":[{"finish_reason":"length","index":0,"delta":{}}],"id":"chatcmpl-Q"})"
      "\n\n"
      R"(data: {"choices":[],"id":"chatcmpl-Q","usage":{"completion_tokens":3,"prompt_tokens":7,"total_tokens":10,"prompt_tokens_details":{"cached_tokens":4}}})"
      "\n\n"
      "data: [DONE]\n\n";
  for (size_t piece : {chat.size(), size_t(1), size_t(7)}) {
    CAPTURE(piece);
    AnthropicFromChat a("claude-like");
    std::string out;
    for (size_t at = 0; at < chat.size(); at += piece) out += a.feed(std::string_view(chat).substr(at, piece));
    std::vector<json> events;
    std::vector<std::string> names;
    for (size_t at = 0; at < out.size();) {
      const size_t end = out.find("\n\n", at);
      REQUIRE(end != std::string::npos);
      const std::string ev = out.substr(at, end - at);
      at = end + 2;
      const size_t nl = ev.find('\n');
      REQUIRE(ev.rfind("event: ", 0) == 0);
      names.push_back(ev.substr(7, nl - 7));
      REQUIRE(ev.compare(nl + 1, 6, "data: ") == 0);
      events.push_back(json::parse(ev.substr(nl + 7)));
      CHECK(events.back()["type"] == names.back());
    }
    CHECK(names == std::vector<std::string>{"message_start", "content_block_start", "ping", "content_block_delta",
                                            "content_block_stop", "content_block_start", "content_block_delta",
                                            "content_block_delta", "content_block_stop", "message_delta", "message_stop"});
    CHECK(events[0]["message"]["id"] == "msg_Q");
    CHECK(events[0]["message"]["model"] == "claude-like");
    CHECK(events[1]["content_block"]["type"] == "thinking");
    CHECK(events[3]["delta"] == json::parse(R"({"type":"thinking_delta","thinking":"hmm"})"));
    CHECK(events[5]["index"] == 1);
    CHECK(events[6]["delta"] == json::parse(R"({"type":"text_delta","text":"Hi"})"));
    CHECK(events[7]["delta"]["text"] == " there");
    CHECK(events[9]["delta"]["stop_reason"] == "max_tokens");
    CHECK(events[9]["usage"] == json::parse(R"({"input_tokens":3,"cache_creation_input_tokens":0,)"
                                            R"("cache_read_input_tokens":4,"output_tokens":3})"));
  }
}

TEST_CASE("engine resume: an Anthropic stream from chat ends well with no text, and passes errors and comments") {
  AnthropicFromChat a("m");
  std::string out = a.feed(": waiting, position 1\n\n");
  CHECK(out == ": waiting, position 1\n\n");
  out = a.feed(R"(data: {"choices":[{"finish_reason":"stop","index":0,"delta":{}}],"id":"chatcmpl-Z"})"
               "\n\ndata: [DONE]\n\n");
  CHECK(out.find("event: message_start") != std::string::npos);
  CHECK(out.find(R"("content_block":{"type":"text","text":""})") != std::string::npos);
  CHECK(out.find(R"("stop_reason":"end_turn")") != std::string::npos);
  CHECK(out.find("event: message_stop") != std::string::npos);
  CHECK(a.feed("data: [DONE]\n\n").empty());  // ended once

  AnthropicFromChat e("m");
  out = e.feed(R"(data: {"error":{"code":500,"message":"boom","type":"server_error"}})" "\n\n");
  CHECK(out.rfind("event: error\ndata: ", 0) == 0);
  CHECK(out.find(R"("message":"boom")") != std::string::npos);
}

TEST_CASE("engine resume: hostile Anthropic bodies and engine chunks give no exception") {
  for (const char* b :
       {R"({"model":1,"max_tokens":5,"stream":true,"messages":[{"role":"user","content":[{"type":7,"text":"x"}]}]})",
        R"({"model":"m","max_tokens":5,"stream":true,"messages":[{"role":3,"content":"x"}]})",
        R"({"model":"m","max_tokens":5,"stream":true,"messages":[{"role":"user","content":[{"type":"text","text":9}]}]})",
        R"({"model":"m","max_tokens":5,"stream":true,"system":5,"messages":[{"role":"user","content":"x"}]})",
        R"({"model":"m","max_tokens":5,"stream":true,"messages":[7]})"}) {
    const std::string text = b;
    CAPTURE(text);
    CHECK_NOTHROW((void)anthropic_as_chat(req("/v1/messages", b)));
  }
  AnthropicFromChat a("m");
  CHECK_NOTHROW(a.feed(R"(data: {"id":5,"choices":[{"delta":{"content":7,"reasoning_content":[]},"finish_reason":3}]})" "\n\n"
                       R"(data: {"choices":[],"usage":{"prompt_tokens":"x","completion_tokens":null,"prompt_tokens_details":[]}})" "\n\n"
                       R"(data: {"error":{"message":4}})" "\n\n" "data: [1,2]\n\n" "data: nonsense\n\ndata: [DONE]\n\n"));
}

namespace {

// A sink that keeps what a journaling session keeps: each change to the
// stream, and the client's bytes.
struct Recorder : JobSink {
  std::vector<EngineOp> ops;
  std::vector<size_t> sent_after;  // bytes sent once each op was applied
  std::string sent;
  bool done = false;
  void on_waiting(int64_t) override {}
  bool on_token(const ds4::proto::TokenEvent&) override { return true; }
  void on_done(const JobResult& r) override { done = r.ok; }
  void on_engine_data(std::string_view b) override { sent += b; }
  void on_engine_op(const EngineOp& op, const std::function<void()>& apply) override {
    ops.push_back(*decode_engine_op(encode_engine_op(op)));  // as the journal gives it back
    apply();
    sent_after.push_back(sent.size());
  }
};

// A live stream: the engine's first answer (cut mid-event), a hole filled, a
// continuation to its end, as the scheduler drives it.
void live_stream(Job& job, Recorder& rec) {
  job.sink = &rec;
  auto feed = [&](std::string bytes) {
    for (size_t at = 0; at < bytes.size(); at += 37) {  // the engine's reads, split anywhere
      EngineOp op;
      op.bytes = bytes.substr(at, 37);
      Scheduler::engine_op(job, std::move(op));
    }
  };
  const std::string first = R"(data: {"choices":[{"finish_reason":null,"index":0,"delta":{"role":"assistant","content":null}}],"created":3,"id":"chatcmpl-A","model":"m","object":"chat.completion.chunk"})"
                            "\n\n";
  feed(first + chat_chunk(R"({"content":"Once"})", 403, 1) + chat_chunk(R"({"content":" upon"})", 407, 3) +
       chat_chunk(R"({"content":" a"})", 264, 4).substr(0, 50));
  EngineOp hole;
  hole.kind = EngineOp::Kind::hole;
  hole.at = 1;
  hole.id = 1;
  Scheduler::engine_op(job, hole);
  EngineOp cont;
  cont.kind = EngineOp::Kind::continuation;
  Scheduler::engine_op(job, cont);
  feed(cmpl_chunk(" a", 264) + cmpl_chunk(" time", 882) +
       cmpl_chunk("", -1, "length", R"("usage":{"completion_tokens":2,"prompt_tokens":9,"total_tokens":11},)"));
  EngineOp close;
  close.kind = EngineOp::Kind::close;  // the engine died before its [DONE]
  Scheduler::engine_op(job, close);
}

}  // namespace

TEST_CASE("engine resume: a stream restored from its journaled changes at any cut goes on as the live one") {
  const EngineRequest chat = req("/v1/chat/completions",
                                 R"({"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":6,"stream":true,"temperature":0})");
  const EngineRequest msgs = req("/v1/messages",
                                 R"({"model":"claude-like","max_tokens":6,"stream":true,"temperature":0,)"
                                 R"("messages":[{"role":"user","content":"hi"}]})");
  for (const bool anthropic : {false, true}) {
    CAPTURE(anthropic);
    const EngineRequest& client = anthropic ? msgs : chat;
    Job live;
    live.forward = std::make_shared<const EngineRequest>(anthropic ? *anthropic_as_chat(client) : client);
    Scheduler::resumable_request(live, ResumeKind::chat, anthropic);
    Recorder rec;
    live_stream(live, rec);
    REQUIRE(rec.ops.size() > 10);
    CHECK(rec.sent.ends_with(anthropic ? "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n" : "data: [DONE]\n\n"));
    CHECK(live.resumable->generated() == std::vector<int32_t>{403, 1, 407, 264, 882});
    for (size_t cut = 0; cut <= rec.ops.size(); ++cut) {
      CAPTURE(cut);
      // A restarted supervisor: the client's request routed again, the journal's changes up to the cut.
      Job back;
      back.forward = std::make_shared<const EngineRequest>(client);
      const std::vector<EngineOp> kept(rec.ops.begin(), rec.ops.begin() + ptrdiff_t(cut));
      REQUIRE(Scheduler::restore(back, kept) == "");
      if (cut == 0) {
        CHECK_FALSE(back.resumable);  // nothing went out: the request starts again
        continue;
      }
      REQUIRE(back.resumable);
      CHECK(bool(back.anthropic) == anthropic);
      CHECK(back.forward->target == "/v1/chat/completions");
      // The rest of the stream through the restored filter: the client gets
      // exactly the bytes the live stream sent after the cut.
      Recorder more;
      back.sink = &more;
      for (size_t i = cut; i < rec.ops.size(); ++i) Scheduler::engine_op(back, rec.ops[i]);
      CHECK(rec.sent.substr(0, rec.sent_after[cut - 1]) + more.sent == rec.sent);
      CHECK(back.resumable->generated() == live.resumable->generated());
    }
  }

  // A stream the engine could not resume (tools: it went out as it came) is not continued.
  Job tools;
  tools.forward = std::make_shared<const EngineRequest>(chat);
  Recorder rec;
  tools.sink = &rec;
  EngineOp op;
  op.bytes = chat_chunk(R"({"content":"x"})", 5);
  Scheduler::engine_op(tools, op);
  CHECK(rec.sent == op.bytes);
  Job back;
  back.forward = std::make_shared<const EngineRequest>(chat);
  CHECK(Scheduler::restore(back, rec.ops).find("no engine can continue") != std::string::npos);

  // Its finish went out and the supervisor died before the [DONE]: only the end is sent.
  Job live;
  live.forward = std::make_shared<const EngineRequest>(chat);
  Scheduler::resumable_request(live, ResumeKind::chat, false);
  Recorder fin;
  live.sink = &fin;
  op.bytes = chat_chunk(R"({"content":"x"})", 5) +
             R"(data: {"choices":[{"finish_reason":"stop","index":0,"delta":{}}],"created":3,"id":"chatcmpl-A","model":"m","object":"chat.completion.chunk"})" "\n\n";
  Scheduler::engine_op(live, op);
  Job whole;
  whole.forward = std::make_shared<const EngineRequest>(chat);
  REQUIRE(Scheduler::restore(whole, fin.ops) == "");
  CHECK(Scheduler::whole(whole));
  Recorder end;
  whole.sink = &end;
  Scheduler::end_restored(whole);
  CHECK(end.sent == "data: [DONE]\n\n");
  CHECK(end.done);
}
