// Grammars: the GBNF parser and its errors, the matcher (accepts, rejects,
// UTF-8 split anywhere, limits), and JSON Schema → GBNF checked both ways:
// random sentences of each schema's grammar are valid JSON of the schema
// (by a validator written apart, in grammar_testing.h), and known-invalid
// texts are refused.
#include <doctest/doctest.h>

#include <random>
#include <string>

#include "grammar_testing.h"
#include "shared/error.h"
#include "text/grammar.h"

using namespace ds4;
using namespace ds4::grammar;
using nlohmann::json;

namespace {

std::string parse_error(std::string_view text, const Limits& lim = {}) {
  try {
    Grammar::parse(text, lim);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// Whether the whole `text` is a sentence of `g`.
bool full(const std::shared_ptr<const Grammar>& g, std::string_view text) {
  Matcher m(g);
  return m.accept(text) && m.can_end();
}

bool matches(std::string_view gbnf, std::string_view text) { return full(Grammar::parse(gbnf), text); }

std::string schema_error(const json& schema, const SchemaLimits& lim = {}) {
  try {
    schema_to_gbnf(schema, lim);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("grammar: literals, classes, groups and repetitions") {
  CHECK(matches(R"(root ::= "ab" [c-e] "\n")", "abd\n"));
  CHECK_FALSE(matches(R"(root ::= "ab" [c-e])", "abf"));
  CHECK_FALSE(matches(R"(root ::= "ab" [c-e])", "ab"));  // a prefix is not a sentence
  CHECK(matches(R"(root ::= [^"\\]+)", "x y"));
  CHECK_FALSE(matches(R"(root ::= [^"\\]+)", "x\"y"));
  CHECK(matches(R"(root ::= ("a" | "b")* "c")", "ababc"));
  CHECK(matches(R"(root ::= ("a" | "b")* "c")", "c"));
  CHECK(matches(R"(root ::= "x"+)", "xxx"));
  CHECK_FALSE(matches(R"(root ::= "x"+)", ""));
  CHECK(matches(R"(root ::= "x"? "y")", "y"));
  for (const char* ok : {"aa", "aaa", "aaaa"}) CHECK(matches(R"(root ::= "a"{2,4})", ok));
  for (const char* bad : {"a", "aaaaa"}) CHECK_FALSE(matches(R"(root ::= "a"{2,4})", bad));
  CHECK(matches(R"(root ::= "a"{3})", "aaa"));
  CHECK(matches(R"(root ::= "a"{2,} "b")", "aaaaab"));
  CHECK_FALSE(matches(R"(root ::= "a"{2,} "b")", "ab"));
  CHECK(matches("root ::= . .", "\xC3\xA9z"));  // any code point, UTF-8
  CHECK(matches(R"(root ::= "\x41\u00e9\U0001F600")", "A\xC3\xA9\xF0\x9F\x98\x80"));
  // Rules used before they are defined, comments, rules spread over lines.
  CHECK(matches("# a comment\nroot ::= item (\",\" item)*  # trailing\n"
                "item ::=\n  [0-9]+\n  | \"x\"\n",
                "1,x,23"));
  // Empty alternatives and right recursion.
  CHECK(matches(R"g(root ::= "(" root ")" | )g", "((()))"));
  CHECK_FALSE(matches(R"g(root ::= "(" root ")" | )g", "(()"));
}

TEST_CASE("grammar: syntax errors say line:column and what") {
  CHECK(parse_error("root ::= \"abc") == "grammar:1:14: unterminated literal");
  CHECK(parse_error("root ::= [a-z") == "grammar:1:10: unterminated character class");
  CHECK(parse_error("root ::= x\n") == "grammar:1:10: undefined rule 'x'");
  CHECK(parse_error("item ::= \"a\"\n") == "grammar:2:1: no 'root' rule");
  CHECK(parse_error("root ::= \"\\q\"") == "grammar:1:12: unknown escape '\\q'");
  CHECK(parse_error("root ::= \"a\"\nroot ::= \"b\"") == "grammar:2:1: rule 'root' is defined twice");
  CHECK(parse_error("root ::= (\"a\"") == "grammar:1:10: unclosed '('");
  CHECK(parse_error("root ::= * \"a\"") == "grammar:1:10: '*' without an item before it");
  CHECK(parse_error("root ::= \"a\"{3,2}") == "grammar:1:18: repetition {m,n} with n < m");
  CHECK(parse_error("root ::= [z-a]") == "grammar:1:14: range end below its start");
  CHECK(parse_error("root = \"a\"") == "grammar:1:6: expected '::=' after the rule name 'root'");
  CHECK(parse_error("root ::= \"a\" )") == "grammar:1:14: unmatched ')'");
  // Left recursion, direct and through a nullable rule, would never end.
  CHECK(parse_error("root ::= root \"a\" | \"b\"") == "grammar:1:1: rule 'root' is left-recursive");
  CHECK(parse_error("root ::= opt x\nopt ::= \"o\"?\nx ::= root \"a\" | \"b\"").find("left-recursive") !=
        std::string::npos);
}

TEST_CASE("grammar: limits end a hostile grammar with an error") {
  Limits lim;
  lim.max_bytes = 20;
  CHECK(parse_error("root ::= \"aaaaaaaaaaaaaaaaaaaa\"", lim).find("more than 20") != std::string::npos);
  CHECK(parse_error("root ::= \"a\"{5000}").find("repetition count above 1000") != std::string::npos);
  lim = {};
  lim.max_rules = 3;
  CHECK(parse_error("root ::= a b c\na ::= \"a\"\nb ::= \"b\"\nc ::= \"c\"", lim).find("more than 3 rules") !=
        std::string::npos);
  // An ambiguous grammar: after n "(" every mix of pending ")" and "]" is a stack (2^n).
  lim = {};
  lim.max_stacks = 64;
  auto g = Grammar::parse(R"g(root ::= "(" root ")" | "(" root "]" | "")g", lim);
  Matcher m(g);
  CHECK_THROWS_WITH_AS(m.accept(std::string(10, '(')), doctest::Contains("parse stacks"), Error);
  // Deep nesting.
  lim = {};
  lim.max_depth = 50;
  auto deep = Grammar::parse(R"g(root ::= "(" root ")" | "x")g", lim);
  Matcher d(deep);
  CHECK_THROWS_WITH_AS(d.accept(std::string(100, '(')), doctest::Contains("deeper than 50"), Error);
}

TEST_CASE("matcher: UTF-8 split anywhere, state keys, end") {
  auto g = Grammar::parse(R"(root ::= "\u00e9t\u00e9" | "\U0001F600")");
  const std::string ete = "\xC3\xA9t\xC3\xA9";
  for (size_t cut = 0; cut <= ete.size(); ++cut) {
    Matcher m(g);
    CHECK(m.accept(ete.substr(0, cut)));
    CHECK(m.accept(ete.substr(cut)));
    CHECK(m.can_end());
    CHECK(m.must_end());
  }
  Matcher m(g);
  CHECK(m.accept("\xF0\x9F"));          // could still be U+1F600
  CHECK_FALSE(m.can_end());
  CHECK_FALSE(m.can_accept("\x98\x81"));  // U+1F601 is not in the grammar
  CHECK_FALSE(Matcher(g).can_accept("\xF0\x9E"));  // no code point starting so is
  CHECK_FALSE(Matcher(g).can_accept("\xFF"));      // not UTF-8
  CHECK_FALSE(Matcher(g).can_accept("\xC3"
                                    "t"));  // a lead byte then no continuation
  // Equal keys for equal states, reached by different texts.
  auto star = Grammar::parse(R"(root ::= ("ab" | "a" "b")* "c")");
  Matcher a(star), b(star);
  a.accept("ab");
  b.accept("abab");
  CHECK(a.key() == b.key());
  b.accept("a");
  CHECK(a.key() != b.key());
  CHECK_FALSE(a.can_end());
  a.accept("c");
  CHECK(a.must_end());
}

namespace {

struct SchemaCase {
  const char* name;
  json schema;
  std::vector<std::string> invalid;  // texts the grammar must refuse
};

std::vector<SchemaCase> schema_suite() {
  return {
      {"object with required and optional properties",
       json::parse(R"({"type":"object","properties":{"name":{"type":"string","maxLength":12},
                    "age":{"type":"integer","minimum":0,"maximum":150},"nick":{"type":"string"},
                    "tags":{"type":"array","items":{"type":"string","maxLength":5},"maxItems":3}},
                    "required":["name","age"],"additionalProperties":false})"),
       {R"({"age":3})", R"({"name":"x"})", R"({"name":"x","age":151})", R"({"name":"x","age":-1})",
        R"({"name":"x","age":3,"other":1})", R"({"name":"x","age":3,})",
        R"({"name":"x","age":3,"tags":["a","b","c","d"]})", R"({"name":1,"age":3})"}},
      {"all optional", json::parse(R"({"type":"object","properties":{"a":{"type":"boolean"},"b":{"type":"null"}}})"),
       {R"({,"b":null})", R"({"a":1})"}},
      {"additionalProperties schema",
       json::parse(R"({"type":"object","properties":{"id":{"type":"integer"}},"required":["id"],
                    "additionalProperties":{"type":"number"}})"),
       {R"({"id":1,"x":"s"})", R"({"x":1})"}},
      {"enum and const", json::parse(R"({"type":"object","properties":{"unit":{"enum":["celsius","fahrenheit",3,null]},
                    "v":{"const":{"k":[1,2]}}},"required":["unit","v"]})"),
       {R"({"unit":"kelvin","v":{"k":[1,2]}})", R"({"unit":3,"v":{"k":[1]}})"}},
      {"anyOf, oneOf and type lists",
       json::parse(R"({"type":"array","items":{"anyOf":[{"type":"integer","minimum":10,"maximum":99},{"type":"string","maxLength":3}]},
                    "minItems":1,"maxItems":4})"),
       {"[]", "[1]", "[100]", R"(["abcd"])", "[10,11,12,13,14]"}},
      {"oneOf disjoint", json::parse(R"({"oneOf":[{"type":"boolean"},{"type":["null","integer"],"maximum":5}]})"), {"6", "\"x\""}},
      {"prefixItems", json::parse(R"({"type":"array","prefixItems":[{"type":"string","maxLength":4},{"type":"integer","minimum":-20,"maximum":-3}],
                    "items":false})"),
       {R"(["a",-2])", R"(["a",-21])", R"(["a",-5,1])", R"([-5,"a"])"}},
      {"string formats", json::parse(R"({"type":"object","properties":{"d":{"type":"string","format":"date"},
                    "t":{"type":"string","format":"time"},"u":{"type":"string","format":"uuid"}},"required":["d","t","u"]})"),
       {R"({"d":"2024-13-01","t":"10:00:00Z","u":"00000000-0000-0000-0000-000000000000"})",
        R"({"d":"2024-01-01","t":"25:00:00Z","u":"00000000-0000-0000-0000-000000000000"})",
        R"({"d":"2024-01-01","t":"10:00:00Z","u":"0000-0000"})"}},
      {"patterns", json::parse(R"({"type":"object","properties":{"code":{"type":"string","pattern":"^[A-Z]{2}-\\d{3}$"},
                    "q":{"type":"string","pattern":"^(yes|no)\"?$"}},"required":["code","q"]})"),
       {R"({"code":"AB-12","q":"yes"})", R"({"code":"ab-123","q":"no"})", R"({"code":"AB-123","q":"maybe"})"}},
      {"string lengths", json::parse(R"({"type":"string","minLength":2,"maxLength":4})"), {"\"a\"", "\"abcde\""}},
      {"numbers", json::parse(R"({"type":"array","items":{"type":"number","minimum":0},"maxItems":5})"),
       {"[-1]", "[01]", "[1.]", "[.5]"}},
      {"$defs and recursion",
       json::parse(R"({"$ref":"#/$defs/node","$defs":{"node":{"type":"object","properties":{"v":{"type":"integer","minimum":0,"maximum":9},
                    "kids":{"type":"array","items":{"$ref":"#/$defs/node"},"maxItems":2}},"required":["v"],"additionalProperties":false}}})"),
       {R"({"v":1,"kids":[{"v":10}]})", R"({"kids":[]})"}},
      {"definitions and allOf",
       json::parse(R"({"allOf":[{"$ref":"#/definitions/base"},{"properties":{"extra":{"type":"boolean"}},"required":["extra"]}],
                    "definitions":{"base":{"type":"object","properties":{"id":{"type":"string","maxLength":6}},"required":["id"]}}})"),
       {R"({"id":"a"})", R"({"extra":true})"}},
      {"any value", json::parse("{}"), {"{", "[1,]", "tru", "01", "\"\\q\""}},
  };
}

}  // namespace

TEST_CASE("schema_to_gbnf: random sentences of each grammar are valid JSON of the schema; invalid texts are refused") {
  std::mt19937 rng(12345);
  for (const SchemaCase& c : schema_suite()) {
    CAPTURE(c.name);
    const std::string gbnf = schema_to_gbnf(c.schema);
    CAPTURE(gbnf);
    auto g = Grammar::parse(gbnf);
    int ended = 0;
    for (int i = 0; i < 300; ++i) {
      auto s = testing::random_sentence(g, rng);
      if (!s) continue;
      ++ended;
      CAPTURE(*s);
      json v;
      REQUIRE_NOTHROW(v = json::parse(*s));
      std::string why;
      CHECK_MESSAGE(testing::validate(v, c.schema, c.schema, why), why);
    }
    CHECK(ended >= 100);  // most walks end (bounded lengths, p_end)
    for (const std::string& bad : c.invalid) {
      CAPTURE(bad);
      CHECK_FALSE(full(g, bad));
    }
  }
}

TEST_CASE("schema_to_gbnf: a valid compact or lightly indented answer is accepted") {
  const json schema = json::parse(R"({"type":"object","properties":{"city":{"type":"string"},"days":{"type":"integer"}},
                                    "required":["city"]})");
  auto g = Grammar::parse(schema_to_gbnf(schema));
  CHECK(full(g, R"({"city":"Paris","days":3})"));
  CHECK(full(g, "{\n  \"city\": \"Paris\",\n  \"days\": -12\n}"));
  CHECK(full(g, R"({ "city" : "a\"b\\c\u00e9\n" })"));
  CHECK_FALSE(full(g, "{\"city\":\"x\"          }"));  // more whitespace than the rule allows
}

TEST_CASE("schema_to_gbnf: errors name the schema path") {
  CHECK(schema_error(json::parse(R"({"type":"object","properties":{"x":{"type":"strin"}}})")) ==
        "schema.properties.x.type: unknown type 'strin'");
  CHECK(schema_error(json::parse(R"({"properties":{"a":{"not":{}}}})")) == "schema.properties.a.not: not supported");
  CHECK(schema_error(json::parse(R"({"$ref":"#/$defs/missing"})")) == "schema.$ref: $ref '#/$defs/missing' does not resolve");
  CHECK(schema_error(json::parse(R"({"$ref":"http://x/y"})")).find("only local $ref") != std::string::npos);
  CHECK(schema_error(json::parse(R"g({"type":"string","pattern":"(?=a)"})g")).rfind("schema.pattern: lookaround", 0) == 0);
  CHECK(schema_error(json::parse(R"({"type":"integer","minimum":5,"maximum":4})")) ==
        "schema: no integer lies within minimum and maximum");
  CHECK(schema_error(false) == "schema: the schema false allows no value");
  CHECK(schema_error(json::parse(R"({"type":"object","required":["a"],"additionalProperties":false})")) ==
        "schema.required: 'a' is required but not among the properties");
  // Too deep: the path of where it passed the limit.
  json deep = {{"type", "string"}};
  for (int i = 0; i < 70; ++i) deep = {{"type", "array"}, {"items", deep}};
  const std::string e = schema_error(deep);
  CHECK(e.rfind("schema.items.items.items", 0) == 0);
  CHECK(e.find("nested deeper than 64") != std::string::npos);
  // Recursive without end: a value that is itself, nothing consumed.
  CHECK(schema_error(json::parse(R"({"$ref":"#/$defs/a","$defs":{"a":{"anyOf":[{"$ref":"#/$defs/a"},{"type":"null"}]}}})"))
            .find("a $ref cycle comes back to itself") != std::string::npos);
  // Too large.
  SchemaLimits small;
  small.max_bytes = 100;
  json big = {{"type", "object"}, {"properties", json::object()}};
  for (int i = 0; i < 20; ++i) big["properties"]["p" + std::to_string(i)] = {{"type", "string"}};
  CHECK(schema_error(big, small).find("more than 100") != std::string::npos);
  small = {};
  small.max_rules = 10;
  CHECK(schema_error(big, small).find("more than 10 rules") != std::string::npos);
}

TEST_CASE("GrammarBuilder: a schema inside a family's call syntax") {
  GrammarBuilder b;
  const json params = json::parse(R"({"type":"object","properties":{"city":{"type":"string","maxLength":20}},"required":["city"]})");
  const std::string args = b.add_schema(params, "args");
  CHECK(args == "args");
  b.add_rule("root", literal("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": ") + " " + args + " " +
                         literal("}\n</tool_call>"));
  // A second schema shares the primitives and gets a fresh name.
  CHECK(b.add_schema(params, "args") == "args-2");
  auto g = Grammar::parse(b.text());
  CHECK(full(g, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\":\"Oslo\"}}\n</tool_call>"));
  CHECK_FALSE(full(g, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {}}\n</tool_call>"));
  CHECK_THROWS_WITH_AS(b.add_rule("root", "\"x\""), "grammar: rule 'root' is already defined", Error);
  CHECK_THROWS_WITH_AS(b.add_rule("bad name", "\"x\""), doctest::Contains("not a rule name"), Error);
  // A failed schema leaves the builder as it was.
  GrammarBuilder c;
  CHECK_THROWS_AS(c.add_schema(json::parse(R"({"type":"nope"})"), "x"), Error);
  CHECK_FALSE(c.has_rule("x"));
  CHECK_THROWS_WITH_AS(c.text(), "grammar: no 'root' rule was added", Error);
  c.add_rule("root", "undefined-rule");
  CHECK_THROWS_WITH_AS(c.text(), doctest::Contains("undefined rule 'undefined-rule'"), Error);
}
