#include "text/chat_template.h"

#include "shared/error.h"

namespace ds4 {

const char* family_name(ChatFamily f) {
  switch (f) {
    case ChatFamily::chatml: return "chatml";
    case ChatFamily::llama2: return "llama2";
    case ChatFamily::llama3: return "llama3";
    case ChatFamily::mistral: return "mistral";
    case ChatFamily::deepseek: return "deepseek";
  }
  return "chatml";
}

ChatFamily detect_family(std::string_view t) {
  auto has = [&](std::string_view s) { return t.find(s) != std::string_view::npos; };
  if (has("<|im_start|>")) return ChatFamily::chatml;
  if (has("<|start_header_id|>")) return ChatFamily::llama3;
  if (has("<\xef\xbd\x9cUser\xef\xbd\x9c>") || has("<\xef\xbd\x9c" "Assistant\xef\xbd\x9c>")) return ChatFamily::deepseek;
  if (has("[INST]")) return has("<<SYS>>") ? ChatFamily::llama2 : ChatFamily::mistral;
  return ChatFamily::chatml;
}

namespace {

// The system text (all system messages joined) and the rest, in order.
std::pair<std::string, std::vector<const ChatMessage*>> split_system(const std::vector<ChatMessage>& ms) {
  std::string sys;
  std::vector<const ChatMessage*> rest;
  for (const ChatMessage& m : ms) {
    if (m.role == "system") {
      if (!sys.empty()) sys += "\n\n";
      sys += m.content;
    } else {
      rest.push_back(&m);
    }
  }
  return {sys, rest};
}

std::string chatml(const std::vector<ChatMessage>& ms) {
  std::string out;
  for (const ChatMessage& m : ms) out += "<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n";
  return out + "<|im_start|>assistant\n";
}

std::string llama3(const std::vector<ChatMessage>& ms) {
  std::string out;
  for (const ChatMessage& m : ms)
    out += "<|start_header_id|>" + m.role + "<|end_header_id|>\n\n" + m.content + "<|eot_id|>";
  return out + "<|start_header_id|>assistant<|end_header_id|>\n\n";
}

// Llama 2 and Mistral: [INST] blocks; the system text goes into the first one.
std::string inst(const std::vector<ChatMessage>& ms, bool llama2) {
  auto [sys, rest] = split_system(ms);
  std::string out;
  bool first = true;
  for (const ChatMessage* m : rest) {
    if (m->role == "assistant") {
      out += (llama2 ? " " : " ") + m->content + (llama2 ? " </s><s>" : "</s>");
      continue;
    }
    std::string user = m->content;
    if (first && !sys.empty()) user = llama2 ? "<<SYS>>\n" + sys + "\n<</SYS>>\n\n" + user : sys + "\n\n" + user;
    first = false;
    out += llama2 ? "[INST] " + user + " [/INST]" : "[INST] " + user + "[/INST]";
  }
  return out;
}

std::string deepseek(const std::vector<ChatMessage>& ms) {
  static const std::string kUser = "<\xef\xbd\x9cUser\xef\xbd\x9c>";
  static const std::string kAssistant = "<\xef\xbd\x9c" "Assistant\xef\xbd\x9c>";
  static const std::string kEnd = "<\xef\xbd\x9c" "end\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>";
  auto [sys, rest] = split_system(ms);
  std::string out = sys;
  for (const ChatMessage* m : rest)
    out += m->role == "assistant" ? kAssistant + m->content + kEnd : kUser + m->content;
  return out + kAssistant;
}

}  // namespace

std::string apply_chat_template(const jinja::Template& t, const ChatTemplateInput& in, const jinja::Limits& limits) {
  nlohmann::ordered_json ctx = nlohmann::ordered_json::object();
  if (in.kwargs.is_object())
    for (const auto& [k, v] : in.kwargs.items()) ctx[k] = v;
  else if (!in.kwargs.is_null())
    throw Error("chat_template_kwargs must be an object");
  ctx["messages"] = in.messages;
  ctx["tools"] = in.tools;
  ctx["add_generation_prompt"] = in.add_generation_prompt;
  ctx["bos_token"] = in.bos_token;
  ctx["eos_token"] = in.eos_token;
  return t.render(ctx, limits);
}

std::string render_chat(ChatFamily family, const std::vector<ChatMessage>& messages) {
  switch (family) {
    case ChatFamily::chatml: return chatml(messages);
    case ChatFamily::llama3: return llama3(messages);
    case ChatFamily::llama2: return inst(messages, true);
    case ChatFamily::mistral: return inst(messages, false);
    case ChatFamily::deepseek: return deepseek(messages);
  }
  return chatml(messages);
}

}  // namespace ds4
