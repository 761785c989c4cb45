// libFuzzer entry for the proxy's request parsing and protocol translation:
// any body, for any endpoint, must give a Plan or an ApiError (never a crash,
// a sanitizer report or an escaping exception); a Plan is then answered with
// the fuzz bytes as token pieces, through the stop-string matcher and each
// responder, whole and streamed. A body read without a JSON tree
// (parse_common_request) must give the plan of the full parse. The body as
// forwarded to an exec engine (forward_request) is checked too, and so is the
// Anthropic-to-chat bridge (engine_anthropic.h), request and stream.
//
// The first input byte picks the endpoint; the rest is the body. The model
// (its vocabulary and template) is stories260K: $DS4_MODELS/stories260K.gguf,
// else ../shared/models beside the source tree.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>

#include "shared/gguf.h"
#include "supervisor/proxy/api_request.h"
#include "supervisor/proxy/api_response.h"
#include "supervisor/proxy/engine_anthropic.h"
#include "supervisor/proxy/router.h"
#include "supervisor/proxy/text_stream.h"

namespace {

const ds4::proxy::ModelText* model = nullptr;

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const char* dir = std::getenv("DS4_MODELS");
  const std::string path = std::string(dir ? dir : DS4_FUZZ_MODELS) + "/stories260K.gguf";
  static const ds4::gguf::File file = ds4::gguf::File::open(path);
  static const ds4::proxy::ModelText m = ds4::proxy::ModelText::from_gguf(file, "stories");
  model = &m;
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace ds4::proxy;
  if (size < 1) return 0;
  const Endpoint ep = static_cast<Endpoint>(data[0] % 3);
  const std::string_view body(reinterpret_cast<const char*>(data + 1), size - 1);
  PlanLimits limits;
  limits.context = 256;
  limits.max_tokens_per_request = 1024;
  // The same body forwarded to an exec engine: an EngineRequest carrying it
  // unchanged, or an ApiError.
  {
    HttpRequest req{boost::beast::http::verb::post, "/v1/chat/completions", 11};
    req.body() = std::string(body);
    auto f = forward_request(req);
    if (auto* fr = std::get_if<EngineRequest>(&f); fr && fr->body != body) std::abort();
    (void)sse_error_event(Api::anthropic, body);
    // As an Anthropic stream to an engine that resumes chat (engine_anthropic.h):
    // a chat request or nothing; and the bytes as the engine's chat stream.
    EngineRequest m;
    m.target = "/v1/messages";
    m.stream = true;
    m.body = std::string(body);
    if (auto chat = anthropic_as_chat(m); chat && chat->target != "/v1/chat/completions") std::abort();
    AnthropicFromChat a("m");
    for (size_t i = 0; i < body.size(); i += 7) (void)a.feed(body.substr(i, 7));
    (void)a.feed("\n\ndata: [DONE]\n\n");
  }
  auto result = parse_request(ep, body, *model, limits);
  // The tree-free reading of the common shape gives the full parse's plan (a
  // field no parser reads sends a body the full way).
  if (auto fast = parse_common_request(ep, body, *model, limits)) {
    auto full = parse_request(ep, "{\"x_unread\":null," + std::string(body.substr(body.find('{') + 1)), *model, limits);
    if (!std::holds_alternative<Plan>(full) || !(*fast == std::get<Plan>(full))) std::abort();
  }
  if (auto* e = std::get_if<ApiError>(&result)) {
    (void)error_body(Api::openai, *e);
    (void)error_body(Api::anthropic, *e);
    return 0;
  }
  Plan plan = std::get<Plan>(result);
  for (bool stream : {false, true}) {
    plan.stream = stream;
    auto r = make_responder(plan, model->tokenizer(), "id", 0);
    TextStream ts(plan.stop);
    std::string out = r->open();
    // The body's bytes as pieces of 1..4 bytes: split characters, partial stops.
    for (size_t i = 0; i < body.size();) {
      const size_t n = 1 + (body[i] & 3);
      auto o = ts.push(body.substr(i, n));
      out += r->text(o.text, {{int32_t(uint8_t(body[i])) % model->tokenizer().n_vocab(), -1.0f, {}}});
      if (o.stopped) break;
      i += n;
    }
    out += r->text(ts.flush(), {});
    Finish f;
    f.stop_sequence = ts.matched();
    out += r->finish(f);
    out += r->stream_error({ErrorKind::timeout, "t"});
  }
  return 0;
}
