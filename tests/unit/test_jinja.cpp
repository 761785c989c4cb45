// The Jinja interpreter (text/jinja.h): each construct real chat templates
// use, with the results Python's Jinja (as transformers configures it:
// trim_blocks, lstrip_blocks) gives; errors with line:col; every limit ends
// a hostile template with a clear ds4::Error. The real templates themselves
// are compared with @huggingface/jinja in tests/integration/test_jinja_reference.sh.
#include <doctest/doctest.h>

#include <ctime>
#include <nlohmann/json.hpp>
#include <string>

#include "shared/error.h"
#include "text/chat_template.h"
#include "text/jinja.h"

using ds4::jinja::Limits;
using ds4::jinja::Template;
using OJ = nlohmann::ordered_json;

namespace {

std::string R(const std::string& src, const OJ& ctx = OJ::object(), const Limits& limits = {}) {
  return Template::parse(src).render(ctx, limits);
}

// The message of the ds4::Error that parsing or rendering throws ("" if none).
std::string error_of(const std::string& src, const OJ& ctx = OJ::object(), const Limits& limits = {}) {
  try {
    R(src, ctx, limits);
  } catch (const ds4::Error& e) {
    return e.what();
  }
  return "";
}

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("jinja: text, output, comments and literals") {
  CHECK(R("plain text") == "plain text");
  CHECK(R("a{# a comment #}b") == "ab");
  CHECK(R("{{ 'x' }}{{ \"y\" }}{{ 'a' 'b' }}") == "xyab");
  CHECK(R("{{ 42 }} {{ 1.5 }} {{ 2.0 }} {{ -3 }}") == "42 1.5 2.0 -3");
  CHECK(R("{{ true }} {{ none }}|{{ undefined_name }}|") == "True |" "|");
  CHECK(R("{{ 'tab\\tnew\\nq\\'uote\\u00e9' }}") == "tab\tnew\nq'uote\xc3\xa9");
  CHECK(R("{{ [1, 'a'] }} {{ {'k': 1} }}") == "[1, \"a\"] {\"k\": 1}");
  CHECK(R("{% raw %}{{ not parsed }}{% endraw %}") == "{{ not parsed }}");
  CHECK(R("{% generation %}answer{% endgeneration %}") == "answer");
  CHECK(R("line\n") == "line");  // the trailing newline goes, as keep_trailing_newline=False
}

TEST_CASE("jinja: whitespace control, trim_blocks and lstrip_blocks") {
  CHECK(R("a  {{- 'b' -}}  c") == "abc");
  CHECK(R("a\n  {%- if true -%}\n  b\n  {%- endif -%}\n  c") == "abc");
  // trim_blocks drops the newline after a block tag; lstrip_blocks the indentation before it.
  CHECK(R("  {% if true %}\n  x\n  {% endif %}\n") == "  x\n");
  CHECK(R("{# note #}\nx") == "x");
  CHECK(R("{{ 'v' }}\nx") == "v\nx");  // not after an expression
  CHECK(R("a {% if true %}b{% endif %}") == "a b");  // not stripped mid-line
  CHECK(R("  {%+ if true %}x{% endif %}") == "  x");
}

TEST_CASE("jinja: if, elif, else and the ternary") {
  const std::string t = "{% if n > 2 %}big{% elif n == 2 %}two{% else %}small{% endif %}";
  CHECK(R(t, {{"n", 5}}) == "big");
  CHECK(R(t, {{"n", 2}}) == "two");
  CHECK(R(t, {{"n", 0}}) == "small");
  CHECK(R("{{ 'y' if x else 'n' }}{{ 'z' if not x }}", {{"x", false}}) == "nz");
  CHECK(R("{% if [] or {} or '' or 0 or none %}t{% else %}f{% endif %}") == "f");
}

TEST_CASE("jinja: for loops, loop.*, else, filters and unpacking") {
  CHECK(R("{% for x in xs %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 }}"
          "{{ 'F' if loop.first }}{{ 'L' if loop.last }}{{ loop.length }};{% endfor %}",
          {{"xs", {"a", "b"}}}) == "1021F2;2110L2;");
  CHECK(R("{% for x in xs %}{{ loop.previtem }}>{{ x }}<{{ loop.nextitem }} {% endfor %}", {{"xs", {1, 2, 3}}}) ==
        ">1<2 1>2<3 2>3< ");
  CHECK(R("{% for x in [] %}x{% else %}empty{% endfor %}") == "empty");
  CHECK(R("{% for x in xs if x % 2 %}{{ x }}/{{ loop.length }} {% endfor %}", {{"xs", {1, 2, 3, 4, 5}}}) == "1/3 3/3 5/3 ");
  CHECK(R("{% for k, v in d.items() %}{{ k }}={{ v }},{% endfor %}", {{"d", {{"z", 1}, {"a", 2}}}}) == "z=1,a=2,");
  CHECK(R("{% for k in d %}{{ k }}{% endfor %}", {{"d", {{"b", 1}, {"a", 2}}}}) == "ba");
  CHECK(R("{% for (a, b) in [[1, 2], [3, 4]] %}{{ a + b }}{% endfor %}") == "37");
  CHECK(R("{% for x in range(10) %}{% if x == 3 %}{% break %}{% endif %}{% if x == 1 %}{% continue %}{% endif %}{{ x }}{% endfor %}") == "02");
  CHECK(R("{% for x in 'hé' %}[{{ x }}]{% endfor %}") == "[h][\xc3\xa9]");
  CHECK(R("{% for x in missing %}x{% else %}none{% endfor %}") == "none");
  CHECK(R("{% for a in [1,2] %}{% for b in [3,4] %}{{ loop.index }}{% endfor %}{{ loop.index }}{% endfor %}") == "121122");
  CHECK(R("{% for x in [1,2,3] %}{{ loop.cycle('a', 'b') }}{% endfor %}") == "aba");
  CHECK(has(error_of("{% for x in 5 %}{% endfor %}"), "cannot loop over a integer"));
}

TEST_CASE("jinja: set, scoping, namespace and block set") {
  CHECK(R("{% set x = 1 %}{% for i in [1, 2] %}{% set x = i %}{% endfor %}{{ x }}") == "1");  // no leak
  CHECK(R("{% set ns = namespace(x=1, y='a') %}{% for i in [1, 2] %}{% set ns.x = ns.x + i %}{% endfor %}{{ ns.x }}{{ ns.y }}") == "4a");
  CHECK(R("{% set a, b = 1, 2 %}{{ b }}{{ a }}") == "21");
  CHECK(R("{% set x %}in {{ 'block' }}{% endset %}[{{ x }}]") == "[in block]");
  CHECK(R("{% set x | upper %}shout{% endset %}{{ x }}") == "SHOUT");
  CHECK(R("{% if true %}{% set y = 5 %}{% endif %}{{ y }}") == "5");  // if opens no scope
  CHECK(R("{% set ns = namespace(items=[]) %}{% for i in [1, 2] %}{% do ns.items.append(i * 10) %}{% endfor %}{{ ns.items }}") == "[10, 20]");
  CHECK(has(error_of("{% set d = {} %}{% set d.x = 1 %}"), "only of a namespace()"));
}

TEST_CASE("jinja: macros and call blocks") {
  CHECK(R("{% macro greet(name, punct='!') %}Hi {{ name }}{{ punct }}{% endmacro %}{{ greet('Ann') }} {{ greet('Bo', punct='?') }}") ==
        "Hi Ann! Hi Bo?");
  CHECK(R("{% macro m() %}{{ varargs|length }}{{ kwargs.k }}{% endmacro %}{{ m(1, 2, k='v') }}") == "2v");
  CHECK(R("{% macro box() %}[{{ caller() }}]{% endmacro %}{% call box() %}inside{% endcall %}") == "[inside]");
  CHECK(R("{% macro each(xs) %}{% for x in xs %}{{ caller(x) }}{% endfor %}{% endmacro %}"
          "{% call(item) each([1, 2]) %}<{{ item }}>{% endcall %}") == "<1><2>");
  CHECK(R("{% macro f(n) %}{% if n > 0 %}{{ n }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(3) }}") == "321");
}

TEST_CASE("jinja: expressions") {
  CHECK(R("{{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ -7 % 3 }} {{ 7 / 2 }} {{ 2 ** 10 }} {{ 1 + 2 * 3 }}") == "3 -4 1 2 3.5 1024 7");
  CHECK(R("{{ 'a' ~ 1 ~ none }} {{ 'n' + 1 }} {{ [1] + [2] }} {{ 'ab' * 3 }}") == "a1None n1 [1, 2] ababab");
  CHECK(R("{{ 1 < 2 and 2 <= 2 and 3 > 2 and 3 >= 4 }} {{ 'a' < 'b' }} {{ 1 == 1.0 }} {{ [1, 2] == [1, 2] }}") ==
        "False True True True");
  CHECK(R("{{ 0 or 'x' }} {{ 1 and 'y' }} {{ not 0 }}") == "x y True");
  CHECK(R("{{ 'ell' in 'hello' }} {{ 2 in [1, 2] }} {{ 'k' in {'k': 1} }} {{ 3 not in [1] }} {{ 'x' in missing }}") ==
        "True True True True False");
  CHECK(R("{{ xs[0] }}{{ xs[-1] }}{{ xs[1:] }}{{ xs[::-1] }}{{ xs[:-1] }}{{ xs[10] }}", {{"xs", {1, 2, 3}}}) == "13[2, 3][3, 2, 1][1, 2]");
  CHECK(R("{{ 'h\xc3\xa9llo'[::-1] }} {{ 'hello'[1:-1] }} {{ 'hello'[0] }} {{ 'abcdef'[::2] }}") == "oll\xc3\xa9h ell h ace");
  CHECK(R("{{ m.role }} {{ m['role'] }} {{ m.missing }}|{{ m.missing.deeper }}|{{ m.missing is defined }}",
          {{"m", {{"role", "user"}}}}) == "user user ||False");
  CHECK(R("{{ d.get('a') }} {{ d.get('zz', 'def') }} {{ d.get('zz') }} {{ d.keys()|list }} {{ d.values()|list }}",
          {{"d", {{"a", 1}, {"b", 2}}}}) == "1 def  [\"a\", \"b\"] [1, 2]");  // none renders empty
  CHECK(R("{{ {'a': 1, 'b': [1, 2]}.b[1] }} {{ (1, 2)[0] }} {{ [[1, 2]][0][1] }}") == "2 1 2");
  CHECK(has(error_of("{{ 1 / 0 }}"), "division by zero"));
  CHECK(has(error_of("{{ 9223372036854775807 + 1 }}"), "integer overflow"));
  CHECK(has(error_of("{{ 'a' + none }}"), "cannot apply '+'"));
  CHECK(has(error_of("{{ x + 1 }}"), "cannot apply '+' to undefined"));
}

TEST_CASE("jinja: string methods") {
  CHECK(R("{{ s.startswith('ab') }} {{ s.endswith('ef') }} {{ s.startswith(('x', 'a')) }}", {{"s", "abcdef"}}) == "True True True");
  CHECK(R("{{ '  x  '.strip() }}|{{ '\\n\\nx\\n'.strip('\\n') }}|{{ ' x '.lstrip() }}|{{ ' x '.rstrip() }}|{{ 'xxhixx'.strip('x') }}") ==
        "x|x|x | x|hi");
  CHECK(R("{{ 'a,b,,c'.split(',') }} {{ ' a  b '.split() }} {{ 'a,b,c'.split(',', 1) }}") ==
        "[\"a\", \"b\", \"\", \"c\"] [\"a\", \"b\"] [\"a\", \"b,c\"]");
  CHECK(R("{{ 'x</think>y'.split('</think>')[-1] }}{{ 'x</think>y'.split('</think>')[0] }}") == "yx");
  CHECK(R("{{ 'Hi'.upper() }} {{ 'Hi'.lower() }} {{ 'hello world'.title() }} {{ 'hELLO'.capitalize() }}") == "HI hi Hello World Hello");
  CHECK(R("{{ 'aaa'.replace('a', 'b') }} {{ 'aaa'.replace('a', 'b', 2) }} {{ 'hello'.find('l') }} {{ 'hello'.find('z') }} {{ 'a-b'.count('-') }}") ==
        "bbb bba 2 -1 1");
  CHECK(R("{{ ', '.join(['a', 'b']) }}") == "a, b");
  CHECK(has(error_of("{{ 'x'.nosuch() }}"), "cannot call 'nosuch'"));
}

TEST_CASE("jinja: filters") {
  const OJ users = {{"users", {{{"name", "b"}, {"age", 3}, {"role", "user"}},
                               {{"name", "A"}, {"age", 1}, {"role", "assistant"}},
                               {{"name", "c"}, {"age", 2}, {"role", "user"}}}}};
  CHECK(R("{{ '  x '|trim }}|{{ 'abc'|length }} {{ [1, 2]|count }} {{ {'a': 1}|length }} {{ 'h\xc3\xa9'|length }}") == "x|3 2 1 2");
  CHECK(R("{{ {'a': 1, 'b': 2}|items|list }}") == "[[\"a\", 1], [\"b\", 2]]");
  CHECK(R("{{ ['a', 'b']|join }} {{ ['a', 'b']|join('-') }} {{ [1, 2]|join(', ') }}") == "ab a-b 1, 2");
  CHECK(R("{{ 'ab'|upper }} {{ 'AB'|lower }} {{ 'ab cd'|title }} {{ 'ab'|capitalize }} {{ 'aXa'|replace('a', 'b') }}") == "AB ab Ab Cd Ab bXb");
  CHECK(R("{{ missing|default('d') }} {{ ''|default('d') }}|{{ ''|default('d', true) }} {{ missing|d('e') }} {{ 0|default(5) }}") ==
        "d |d e 0");
  CHECK(R("{{ [3, 1, 2]|first }} {{ [3, 1, 2]|last }} {{ 'abc'|first }} {{ []|first }}|") == "3 2 a |");
  CHECK(R("{{ users|map(attribute='name')|join(',') }}", users) == "b,A,c");
  CHECK(R("{{ users|selectattr('role', 'equalto', 'user')|map(attribute='name')|list }}", users) == "[\"b\", \"c\"]");
  CHECK(R("{{ users|rejectattr('role', 'equalto', 'user')|map(attribute='name')|list }}", users) == "[\"A\"]");
  CHECK(R("{{ users|selectattr('age', 'gt', 1)|list|length }} {{ users|selectattr('missing', 'undefined')|list|length }}", users) == "2 3");
  CHECK(R("{{ [1, 2, 3, 4]|select('even')|list }} {{ [1, 2, 3, 4]|reject('even')|list }} {{ [0, 1, '', 'a']|select|list }}") ==
        "[2, 4] [1, 3] [1, \"a\"]");
  CHECK(R("{{ ['1', '2']|map('int')|sum }} {{ [1, 2, 1, 3]|unique|list }} {{ [3, 1, 2]|sort }} {{ ['b', 'A', 'c']|sort }} {{ [1, 2]|reverse|list }}") ==
        "3 [1, 2, 3] [1, 2, 3] [\"A\", \"b\", \"c\"] [2, 1]");
  CHECK(R("{{ users|sort(attribute='age')|map(attribute='name')|join }} {{ users|sort(attribute='age', reverse=true)|map(attribute='name')|join }}", users) ==
        "Acb bcA");
  CHECK(R("{{ {'b': 1, 'a': 2}|dictsort }}") == "[[\"a\", 2], [\"b\", 1]]");
  CHECK(R("{{ '42'|int + 1 }} {{ 'x'|int }} {{ 'x'|int(7) }} {{ '2.5'|float }} {{ 3|float }} {{ 2.7|int }} {{ -3|abs }} {{ 2.567|round(2) }}") ==
        "43 0 7 2.5 3.0 2 3 2.57");
  CHECK(R("{{ 5|string ~ 'x' }} {{ true|string }} {{ [1]|list }} {{ 'ab'|list }} {{ '<b>'|safe }}") == "5x True [1] [\"a\", \"b\"] <b>");
  CHECK(R("{{ 'a\\nb\\n\\nc'|indent(2) }}|{{ 'a\\nb'|indent(2, true) }}|{{ 'a\\n\\nb'|indent(width=1, blank=true) }}") == "a\n  b\n\n  c|  a\n  b|a\n \n b");
  CHECK(R("{{ [1, 5, 3]|max }} {{ [4, 2, 8]|min }} {{ 'one two  three'|wordcount }}") == "5 2 3");
  CHECK(has(error_of("{{ 1|nosuchfilter }}"), "unknown filter 'nosuchfilter'"));
}

TEST_CASE("jinja: tojson as transformers' (Python json.dumps, ensure_ascii off)") {
  const OJ ctx = {{"t", OJ::parse(R"({"type": "function", "b": [1, 2.5, true, null], "s": "é \"q\" \n 😀", "e": {}, "l": []})")}};
  CHECK(R("{{ t|tojson }}", ctx) == R"({"type": "function", "b": [1, 2.5, true, null], "s": "é \"q\" \n 😀", "e": {}, "l": []})");
  CHECK(R("{{ t.b|tojson(indent=2) }}", ctx) == "[\n  1,\n  2.5,\n  true,\n  null\n]");
  CHECK(R("{{ {'a': {'b': 1}, 'c': []}|tojson(indent=2) }}") == "{\n  \"a\": {\n    \"b\": 1\n  },\n  \"c\": []\n}");
  CHECK(R("{{ 'é😀'|tojson(ensure_ascii=true) }}") == "\"\\u00e9\\ud83d\\ude00\"");
  CHECK(R("{{ {'b': 1, 'a': 2}|tojson(sort_keys=true) }} {{ {'a': [1, 2]}|tojson(separators=(',', ':')) }}") ==
        "{\"a\": 2, \"b\": 1} {\"a\":[1,2]}");
  CHECK(R("{{ missing|tojson }} {{ 'tab\\there'|tojson }} {{ '\\u0001'|tojson }}") == "null \"tab\\there\" \"\\u0001\"");
}

TEST_CASE("jinja: tests") {
  CHECK(R("{{ x is defined }} {{ y is undefined }} {{ n is none }} {{ x is not none }}", {{"x", 1}, {"n", nullptr}}) == "True True True True");
  CHECK(R("{{ 's' is string }} {{ {} is mapping }} {{ [] is mapping }} {{ [] is sequence }} {{ 's' is iterable }} {{ 1 is iterable }}") ==
        "True True False True True False");
  CHECK(R("{{ 1 is number }} {{ 1.5 is number }} {{ 1 is integer }} {{ 1.5 is integer }} {{ 1.5 is float }} {{ true is boolean }} {{ 1 is boolean }}") ==
        "True True True False True True False");
  CHECK(R("{{ false is false }} {{ 0 is false }} {{ true is true }} {{ 3 is odd }} {{ 4 is even }} {{ 9 is divisibleby 3 }} {{ 9 is divisibleby(2) }}") ==
        "True False True True True True False");
  CHECK(R("{{ 'a' is equalto 'a' }} {{ 1 is eq 2 }} {{ 2 is in [1, 2] }} {{ 'ab' is lower }} {{ 'AB' is upper }} {{ range is callable }}") ==
        "True False True True True True");
  CHECK(R("{{ m.content is defined and m.content is not none }}", {{"m", {{"content", nullptr}}}}) == "False");
  CHECK(has(error_of("{{ 1 is nosuchtest }}"), "unknown test 'nosuchtest'"));
}

TEST_CASE("jinja: globals: raise_exception, range, namespace, strftime_now, dict") {
  CHECK(R("{{ range(3)|list }} {{ range(1, 7, 2)|list }} {{ range(3, 0, -1)|list }} {{ range(0)|list }}") == "[0, 1, 2] [1, 3, 5] [3, 2, 1] []");
  CHECK(R("{{ dict(a=1).a }}") == "1");
  // raise_exception: its message is the error's, as the proxy shows it.
  CHECK(error_of("{% if messages[0].role != 'user' %}{{ raise_exception('Conversations must start with a user message') }}{% endif %}",
                 {{"messages", {{{"role", "assistant"}}}}}) == "Conversations must start with a user message");
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  localtime_r(&now, &tm);
  CHECK(R("{{ strftime_now('%Y') }}") == std::to_string(1900 + tm.tm_year));
}

TEST_CASE("jinja: parse errors name line and column") {
  CHECK(error_of("hello\n{{ 1 + }}") == "template:2:8: expected an expression, got '}}'");
  CHECK(error_of("{% if x %}no end") == "template:1:17: expected {% 'elif' or 'else' or 'endif' %}, got end of template");
  CHECK(error_of("{% for x y %}{% endfor %}") == "template:1:10: expected 'in', got 'y'");
  CHECK(error_of("{{ 'open }}") == "template:1:4: unterminated string: expected '");
  CHECK(error_of("{{ x ") == "template:1:1: unterminated '{{': expected '}}'");
  CHECK(error_of("{# never closed") == "template:1:1: unterminated comment: expected '#}'");
  CHECK(error_of("{% include 'x' %}") == "template:1:4: 'include' is not supported in chat templates");
  CHECK(error_of("{% frobnicate %}") == "template:1:4: expected a statement (if, for, set, macro, call, filter, break, continue, do), got 'frobnicate'");
  CHECK(error_of("{{ a $ b }}") == "template:1:6: unexpected character '$'");
  // Runtime errors name the place too.
  CHECK(error_of("line one\n{{ 'a' + none }}") == "template:2:8: cannot apply '+' to a string and a none");
}

TEST_CASE("jinja: limits end hostile templates with a clear error") {
  Limits small;
  small.max_steps = 100'000;
  small.max_output = 1 << 20;
  small.max_depth = 50;
  SUBCASE("a loop that never ends in time") {
    const std::string e = error_of("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", {}, small);
    CHECK(has(e, "max_steps"));
  }
  SUBCASE("a macro that recurses") {
    CHECK(has(error_of("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", {}, small), "macro calls nest deeper than 50 (limit max_depth)"));
    CHECK(has(error_of("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"), "limit max_depth"));  // default limits
  }
  SUBCASE("a string that doubles") {
    Limits out_only;
    out_only.max_output = 1 << 20;
    CHECK(has(error_of("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", {}, out_only), "max_output"));
    // With few steps, the work of building it ends it first.
    CHECK(has(error_of("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", {}, small), "limit max_"));
    CHECK(has(error_of("{{ 'x' * 100000000000 }}", {}, small), "max_output"));
    CHECK(has(error_of("{{ range(100000000000)|length }}", {}, small), "max_output"));
  }
  SUBCASE("output past max_output") {
    CHECK(has(error_of("{% for i in range(2000) %}" + std::string(1000, 'x') + "{% endfor %}", {}, small), "max_output"));
  }
  SUBCASE("nesting in the source") {
    const std::string parens = "{{ " + std::string(100000, '(') + "1" + std::string(100000, ')') + " }}";
    CHECK(has(error_of(parens), "nests deeper"));
    std::string ifs;
    for (int k = 0; k < 20000; ++k) ifs += "{% if true %}";
    CHECK(has(error_of(ifs), "nests deeper"));
    std::string chain = "{{ 1";
    for (int k = 0; k < 100000; ++k) chain += " + 1";
    CHECK(has(error_of(chain + " }}"), "nests deeper"));
    std::string attrs = "{{ x";
    for (int k = 0; k < 50000; ++k) attrs += ".a";
    CHECK(has(error_of(attrs + " }}"), "nests deeper"));
    CHECK(has(error_of("{{ " + std::string(100000, '[') + " }}"), "nests deeper"));
    CHECK(has(error_of("{{ " + std::string(100000, '-') + "1 }}"), "nests deeper"));
  }
  SUBCASE("nesting in the context and in values the template builds") {
    OJ deep = OJ::array();
    for (int k = 0; k < 5000; ++k) {
      OJ next = OJ::array();
      next.push_back(std::move(deep));
      deep = std::move(next);
    }
    CHECK(has(error_of("{{ x|length }}", {{"x", deep}}), "nest deeper than"));
    CHECK(has(error_of("{% set ns = namespace() %}{% set ns.me = ns %}{{ ns|tojson }}"), "nests deeper than"));
    CHECK(has(error_of("{% set l = [] %}{% do l.append(l) %}{{ l == l }}{{ l|string }}"), "nests deeper than"));
    CHECK(has(error_of("{% set ns = namespace(l=[]) %}{% for i in range(2000) %}{% set ns.l = [ns.l] %}{% endfor %}"), "nest deeper than"));
  }
  SUBCASE("raise_exception") {
    CHECK(error_of("{{ raise_exception('bad role: ' ~ role) }}", {{"role", "robot"}}) == "bad role: robot");
  }
}

TEST_CASE("apply_chat_template gives the template transformers' names") {
  const auto t = Template::parse(
      "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}{% endfor %}"
      "{% if tools %}[{{ tools|map(attribute='function.name')|join(',') }}]{% endif %}{% if tools is none %}(no tools){% endif %}"
      "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and enable_thinking is false %}<think></think>{% endif %}{% endif %}"
      "{{ custom | default('') }}");
  ds4::ChatTemplateInput in;
  in.messages = nlohmann::json::parse(R"([{"role":"system","content":"S"},{"role":"user","content":"U"}])");
  in.bos_token = "<s>";
  in.eos_token = "</s>";
  CHECK(ds4::apply_chat_template(t, in) == "<s><|system|>S</s><|user|>U</s>(no tools)<|assistant|>");
  in.add_generation_prompt = false;
  in.tools = nlohmann::json::parse(R"([{"type":"function","function":{"name":"f"}},{"type":"function","function":{"name":"g"}}])");
  in.kwargs = {{"enable_thinking", false}, {"custom", "!"}, {"messages", "ignored"}};
  CHECK(ds4::apply_chat_template(t, in) == "<s><|system|>S</s><|user|>U</s>[f,g]!");
  in.add_generation_prompt = true;
  CHECK(ds4::apply_chat_template(t, in) == "<s><|system|>S</s><|user|>U</s>[f,g]<|assistant|><think></think>!");
  // The template's own refusal reaches the caller as its message.
  const auto strict = Template::parse("{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}{{ raise_exception('role ' + m.role + ' is not supported') }}{% endif %}{% endfor %}");
  CHECK_THROWS_WITH_AS(ds4::apply_chat_template(strict, in), "role system is not supported", ds4::Error);
}
