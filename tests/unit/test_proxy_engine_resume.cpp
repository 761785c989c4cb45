// Resuming an exec engine's stream (engine_resume.h): which requests resume,
// the ids asked for and hidden again, the stream filter's record of them, and
// the continuation request and its answer in the client's protocol.
#include <doctest/doctest.h>

#include "supervisor/proxy/engine_resume.h"

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

json body(const EngineRequest& r) { return std::get<json>(parse_body(r.body)); }

// llama-server's chunks, as it writes them (with n_probs 1, post_sampling_probs).
std::string cmpl_chunk(const std::string& text, int id, const char* finish = nullptr, const char* extra = "") {
  std::string lp = id < 0 ? "null" : R"({"content":[{"id":)" + std::to_string(id) + R"(,"token":"x","bytes":[120],"prob":1.0,"top_probs":[]}]})";
  return R"(data: {"choices":[{"text":")" + text + R"(","index":0,"logprobs":)" + lp + R"(,"finish_reason":)" +
         (finish ? "\"" + std::string(finish) + "\"" : "null") + R"(}],"created":7,"model":"m","object":"text_completion",)" +
         extra + R"("id":"cmpl-B"})" + "\n\n";
}

std::string chat_chunk(const std::string& delta, int id) {
  return R"(data: {"choices":[{"finish_reason":null,"index":0,"delta":)" + delta +
         R"(,"logprobs":{"content":[{"id":)" + std::to_string(id) +
         R"(,"token":"x","bytes":[120],"prob":1.0,"top_probs":[]}]}}],"created":3,"id":"chatcmpl-A","model":"m","object":"chat.completion.chunk"})" +
         "\n\n";
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
  bool strip = false;
  EngineRequest r = with_token_ids(req("/v1/completions", R"({"prompt":"a","max_tokens":4})"), ResumeKind::completions, strip);
  CHECK(strip);
  CHECK(body(r)["n_probs"] == 1);
  CHECK(body(r)["post_sampling_probs"] == true);
  CHECK(body(r)["max_tokens"] == 4);
  r = with_token_ids(req("/v1/chat/completions", R"({"messages":[],"logprobs":true})"), ResumeKind::chat, strip);
  CHECK_FALSE(strip);  // its own log-probs carry the ids
  CHECK_FALSE(body(r).contains("n_probs"));

  ResumableStream s(ResumeKind::completions, true);
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
  ResumableStream a(ResumeKind::completions, true);
  a.feed(cmpl_chunk("x", -1));
  CHECK_FALSE(a.resumable());
  ResumableStream b(ResumeKind::chat, true);
  b.feed(chat_chunk(R"({"content":"Hi"})", 5));
  CHECK(b.resumable());
  b.feed(chat_chunk(R"({"reasoning_content":"hmm"})", 6));
  CHECK_FALSE(b.resumable());
  ResumableStream c(ResumeKind::chat, true);
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
  ResumableStream s(ResumeKind::completions, true);
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

  ResumableStream s(ResumeKind::chat, true, wants_usage_chunk(orig));
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
