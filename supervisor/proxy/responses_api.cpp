// The Responses API's answers (POST /v1/responses): the response object and
// its stream of typed events, as the openai SDK's `responses.create` and
// Codex read them. Output items in order: a reasoning item for the thought,
// a message for the text, a function_call per call.
#include "supervisor/proxy/api_response.h"
#include "supervisor/proxy/json_util.h"

namespace ds4::proxy {

namespace {

class ResponsesResponder : public Responder {
 public:
  ResponsesResponder(const Plan& p, std::string id, int64_t created)
      : plan_(p), id_(std::move(id)), created_(created) {
    suffix_ = id_.starts_with("resp_") ? id_.substr(5) : id_;
  }

  std::string open() override {
    if (!plan_.stream) return {};
    json r = response("in_progress", nullptr);
    std::string out = event("response.created", {{"response", r}});  // in order: each takes the next sequence number
    return out + event("response.in_progress", {{"response", r}});
  }

  std::string text(std::string_view delta, std::vector<TokenInfo>) override {
    if (delta.empty()) return {};
    std::string out = begin("message");
    current()["content"][0]["text"] = current()["content"][0]["text"].get<std::string>() + std::string(delta);
    if (plan_.stream)
      out += event("response.output_text.delta",
                   {{"item_id", current()["id"]}, {"output_index", index()}, {"content_index", 0}, {"delta", delta}, {"logprobs", json::array()}});
    return out;
  }

  std::string reasoning(std::string_view delta) override {
    if (delta.empty()) return {};
    std::string out = begin("reasoning");
    current()["content"][0]["text"] = current()["content"][0]["text"].get<std::string>() + std::string(delta);
    if (plan_.stream)
      out += event("response.reasoning_text.delta",
                   {{"item_id", current()["id"]}, {"output_index", index()}, {"content_index", 0}, {"delta", delta}});
    return out;
  }

  std::string tool_call(const std::string& id, const tools::ToolCall& c) override {
    std::string out = end_item();
    json item = {{"type", "function_call"}, {"id", "fc_" + suffix_ + "_" + std::to_string(output_.size())},
                 {"call_id", id},           {"name", c.name},
                 {"arguments", ""},         {"status", "in_progress"}};
    output_.push_back(item);
    if (plan_.stream) {
      out += event("response.output_item.added", {{"output_index", index()}, {"item", item}});
      out += event("response.function_call_arguments.delta",
                   {{"item_id", item["id"]}, {"output_index", index()}, {"delta", c.arguments}});
      out += event("response.function_call_arguments.done",
                   {{"item_id", item["id"]}, {"output_index", index()}, {"arguments", c.arguments}});
    }
    current()["arguments"] = c.arguments;
    current()["status"] = "completed";
    if (plan_.stream) out += event("response.output_item.done", {{"output_index", index()}, {"item", current()}});
    return out;
  }

  std::string finish(const Finish& f) override {
    std::string out = end_item();
    const bool cut = f.reason == FinishReason::length;
    json usage = {{"input_tokens", f.prompt_tokens},
                  {"input_tokens_details", {{"cached_tokens", f.timings.cache_n}}},
                  {"output_tokens", f.completion_tokens},
                  {"output_tokens_details", {{"reasoning_tokens", 0}}},
                  {"total_tokens", f.prompt_tokens + f.completion_tokens}};
    json r = response(cut ? "incomplete" : "completed", std::move(usage));
    if (cut) r["incomplete_details"] = {{"reason", "max_output_tokens"}};
    if (!plan_.stream) return dump(r);
    return out + event(cut ? "response.incomplete" : "response.completed", {{"response", r}});
  }

  std::string stream_error(const ApiError& e) override {
    json err = json::parse(error_body(Api::openai, e))["error"];
    return event("error", {{"code", err["code"]}, {"message", err["message"]}, {"param", err["param"]}});
  }

 private:
  json& current() { return output_.back(); }
  int64_t index() const { return int64_t(output_.size()) - 1; }

  // The item of `type` open (a message or a reasoning item), the one before done.
  std::string begin(const char* type) {
    if (open_ && current()["type"] == type) return {};
    std::string out = end_item();
    const bool message = std::string_view(type) == "message";
    json item = message ? json{{"type", "message"}, {"id", "msg_" + suffix_ + "_" + std::to_string(output_.size())},
                               {"status", "in_progress"}, {"role", "assistant"}, {"content", json::array()}}
                        : json{{"type", "reasoning"}, {"id", "rs_" + suffix_ + "_" + std::to_string(output_.size())},
                               {"summary", json::array()}, {"content", json::array()}};
    output_.push_back(item);
    open_ = true;
    json part = message ? json{{"type", "output_text"}, {"text", ""}, {"annotations", json::array()}}
                        : json{{"type", "reasoning_text"}, {"text", ""}};
    if (plan_.stream) {
      out += event("response.output_item.added", {{"output_index", index()}, {"item", item}});
      out += event(message ? "response.content_part.added" : "response.reasoning_part.added",
                   {{"item_id", item["id"]}, {"output_index", index()}, {"content_index", 0}, {"part", part}});
    }
    current()["content"].push_back(std::move(part));
    return out;
  }

  std::string end_item() {
    if (!open_) return {};
    open_ = false;
    json& item = current();
    const bool message = item["type"] == "message";
    if (message) item["status"] = "completed";
    if (!plan_.stream) return {};
    const json& part = item["content"][0];
    std::string out = event(message ? "response.output_text.done" : "response.reasoning_text.done",
                            {{"item_id", item["id"]}, {"output_index", index()}, {"content_index", 0}, {"text", part["text"]}});
    out += event(message ? "response.content_part.done" : "response.reasoning_part.done",
                 {{"item_id", item["id"]}, {"output_index", index()}, {"content_index", 0}, {"part", part}});
    return out + event("response.output_item.done", {{"output_index", index()}, {"item", item}});
  }

  json response(const char* status, json usage) const {
    json r = {{"id", id_},
              {"object", "response"},
              {"created_at", created_},
              {"status", status},
              {"error", nullptr},
              {"incomplete_details", nullptr},
              {"model", plan_.model},
              {"output", output_},
              {"parallel_tool_calls", plan_.tool_choice.parallel},
              {"tool_choice", tool_choice()},
              {"tools", json::array()},
              {"temperature", plan_.gen.sampling.temperature},
              {"top_p", plan_.gen.sampling.top_p},
              {"max_output_tokens", plan_.gen.max_tokens},
              {"previous_response_id", nullptr},
              {"instructions", nullptr},
              {"metadata", json::object()},
              {"store", plan_.store},
              {"text", {{"format", {{"type", "text"}}}}},
              {"truncation", "disabled"},
              {"usage", std::move(usage)}};
    for (auto& [k, v] : plan_.echo.items()) r[k] = v;
    return r;
  }

  json tool_choice() const {
    switch (plan_.tool_choice.mode) {
      case ToolChoice::Mode::automatic: return "auto";
      case ToolChoice::Mode::none: return "none";
      case ToolChoice::Mode::required: return "required";
      case ToolChoice::Mode::named: return {{"type", "function"}, {"name", plan_.tool_choice.name}};
    }
    return "auto";
  }

  std::string event(const char* type, json data) {
    data["type"] = type;
    data["sequence_number"] = seq_++;
    return std::string("event: ") + type + "\ndata: " + dump(data) + "\n\n";
  }

  const Plan& plan_;
  std::string id_, suffix_;
  int64_t created_;
  json output_ = json::array();
  bool open_ = false;  // the last output item (message or reasoning) takes more text
  int64_t seq_ = 0;
};

}  // namespace

std::unique_ptr<Responder> make_responses_responder(const Plan& plan, std::string id, int64_t created) {
  return std::make_unique<ResponsesResponder>(plan, std::move(id), created);
}

}  // namespace ds4::proxy
