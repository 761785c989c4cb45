// Proxy text handling: stop strings across token boundaries, UTF-8 held back
// until complete, chat template detection and rendering, API keys.
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <unistd.h>

#include "shared/error.h"
#include "supervisor/proxy/api_keys.h"
#include "text/chat_template.h"
#include "supervisor/proxy/text_stream.h"

using namespace ds4;
using namespace ds4::proxy;

namespace {
// Feeds pieces; returns everything sent and whether it stopped.
std::pair<std::string, bool> run(TextStream& ts, std::initializer_list<std::string_view> pieces) {
  std::string sent;
  for (auto p : pieces) {
    auto out = ts.push(p);
    sent += out.text;
    if (out.stopped) return {sent, true};
  }
  sent += ts.flush();
  return {sent, false};
}
}  // namespace

TEST_CASE("TextStream: a stop string split across tokens is matched and not sent") {
  TextStream ts({"\nUser:"});
  auto [sent, stopped] = run(ts, {"Hello", " there", "\nUs", "er", ":", " more"});
  CHECK(stopped);
  CHECK(sent == "Hello there");
  CHECK(ts.matched() == "\nUser:");
}

TEST_CASE("TextStream: a partial match that does not complete is sent later, in order") {
  TextStream ts({"STOP"});
  auto o1 = ts.push("ab ST");
  CHECK(o1.text == "ab ");  // "ST" held back
  auto o2 = ts.push("ART");
  CHECK(o2.text == "START");
  CHECK_FALSE(o2.stopped);
  CHECK(ts.flush().empty());
  CHECK(ts.sent() == "ab START");
}

TEST_CASE("TextStream: a multi-byte character split across tokens is held until complete") {
  TextStream ts;
  const std::string euro = "\xe2\x82\xac";  // €
  auto o1 = ts.push("a" + euro.substr(0, 1));
  CHECK(o1.text == "a");
  auto o2 = ts.push(euro.substr(1, 1));
  CHECK(o2.text.empty());
  auto o3 = ts.push(euro.substr(2) + "b");
  CHECK(o3.text == euro + "b");
}

TEST_CASE("TextStream: the earliest of several stop strings wins; empty stops are ignored") {
  TextStream ts({"", "cd", "bc"});
  auto [sent, stopped] = run(ts, {"a", "b", "c", "d"});
  CHECK(stopped);
  CHECK(sent == "a");
  CHECK(ts.matched() == "bc");
}

TEST_CASE("TextStream: at the end, what was held back is flushed") {
  TextStream ts({"xyz"});
  auto [sent, stopped] = run(ts, {"hello x", "y"});
  CHECK_FALSE(stopped);
  CHECK(sent == "hello xy");
}

TEST_CASE("chat templates: families are recognised by their markers") {
  CHECK(detect_family("") == ChatFamily::chatml);
  CHECK(detect_family("{% for m in messages %}<|im_start|>{{m.role}}") == ChatFamily::chatml);
  CHECK(detect_family("{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>' }}") == ChatFamily::llama3);
  CHECK(detect_family("{{ bos_token + '[INST] ' + '<<SYS>>\\n' }}") == ChatFamily::llama2);
  CHECK(detect_family("{{ '[INST] ' + message['content'] + '[/INST]' }}") == ChatFamily::mistral);
  CHECK(detect_family("{{'<\xef\xbd\x9cUser\xef\xbd\x9c>' + message['content']}}") == ChatFamily::deepseek);
  CHECK(detect_family("something else entirely") == ChatFamily::chatml);
}

TEST_CASE("chat templates: rendering") {
  const std::vector<ChatMessage> ms = {{"system", "Be brief."}, {"user", "Hi"}, {"assistant", "Hello!"}, {"user", "Bye"}};
  CHECK(render_chat(ChatFamily::chatml, ms) ==
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n");
  CHECK(render_chat(ChatFamily::llama3, {{"user", "Hi"}}) ==
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n");
  CHECK(render_chat(ChatFamily::llama2, ms) ==
        "[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST] Hello! </s><s>[INST] Bye [/INST]");
  CHECK(render_chat(ChatFamily::mistral, ms) == "[INST] Be brief.\n\nHi[/INST] Hello!</s>[INST] Bye[/INST]");
  CHECK(render_chat(ChatFamily::deepseek, {{"system", "S"}, {"user", "Hi"}}) ==
        "S<\xef\xbd\x9cUser\xef\xbd\x9c>Hi<\xef\xbd\x9c" "Assistant\xef\xbd\x9c>");
}

TEST_CASE("api keys: constant-time compare, Bearer and x-api-key, reload from the file") {
  CHECK(constant_time_equal("abc", "abc"));
  CHECK_FALSE(constant_time_equal("abc", "abd"));
  CHECK_FALSE(constant_time_equal("abc", "abcd"));
  CHECK_FALSE(constant_time_equal("", "a"));
  CHECK(ApiKeys::presented("Bearer sk-1", "") == "sk-1");
  CHECK(ApiKeys::presented("bearer  sk-1 ", "") == "sk-1");
  CHECK(ApiKeys::presented("", "sk-2") == "sk-2");

  ApiKeys none;
  none.reload();
  CHECK_FALSE(none.enabled());
  CHECK(none.accepts(""));

  const auto dir = std::filesystem::temp_directory_path() / ("ds4-keys-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const auto file = dir / "keys";
  std::ofstream(file) << "# comment\n  sk-one  \n\nsk-two\n";
  ApiKeys keys(file);
  keys.reload();
  CHECK(keys.enabled());
  CHECK(keys.size() == 2);
  CHECK(keys.accepts("sk-one"));
  CHECK(keys.accepts("sk-two"));
  CHECK_FALSE(keys.accepts("sk-three"));
  CHECK_FALSE(keys.accepts(""));
  std::ofstream(file) << "sk-three\n";
  keys.reload();
  CHECK(keys.accepts("sk-three"));
  CHECK_FALSE(keys.accepts("sk-one"));
  std::filesystem::remove_all(dir);
  CHECK_THROWS_AS(keys.reload(), ds4::Error);
  CHECK(keys.accepts("sk-three"));  // kept
}
