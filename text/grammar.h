#pragma once
/// Constrained decoding: a context-free grammar over characters (GBNF, the
/// notation llama.cpp uses: `root ::= "{" ws members "}"`, alternatives `|`,
/// groups, `* + ?`, `{m,n}`, character classes `[a-z]`, `[^"\\]`, literals),
/// compiled from JSON Schema when a request asks for JSON, and a matcher that
/// says which tokens may come next.
///
/// The proxy compiles schemas (and refuses bad ones with a 400 naming why);
/// the worker parses the grammar text it is sent and, per slot, keeps a
/// matcher advanced by every generated token. The matcher's state is a pure
/// function of the grammar and the tokens accepted so far, so a resumed
/// request replays `generated` and continues exactly.
///
/// Notation (as llama.cpp's GBNF):
///   name ::= sequence ( "|" sequence )*        one rule; the start is `root`
///   "text"  literal, escapes \n \r \t \\ \" \[ \] \xHH \uHHHH \UHHHHHHHH
///   [a-z_] [^"\\]  classes of code points (ranges, negation, the same escapes)
///   .  any code point;   ( ... ) a group;   x* x+ x? x{m} x{m,} x{m,n}
///   # a comment to the end of the line
/// Rule names are [A-Za-z0-9_-]+. A rule may be used before it is defined, but
/// every used rule must be defined, and no rule may be left-recursive (the
/// matcher would never end): both are errors naming the place.

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace ds4::grammar {

/// Bounds on a grammar and on a matcher's work, so that a hostile grammar ends
/// with an error instead of using all memory or time.
struct Limits {
  size_t max_bytes = 1u << 20;   // grammar text (the protocol's kMaxGrammarBytes)
  size_t max_rules = 20'000;     // rules, counting those `* + ? {m,n}` and groups create
  size_t max_elements = 1u << 20;  // elements of all rules together
  size_t max_repeat = 1'000;     // m and n of x{m,n}
  size_t max_stacks = 4'096;     // matcher: parse stacks alive at once
  size_t max_depth = 1'024;      // matcher: depth of one stack (nesting of rules)
};

struct SchemaLimits {
  size_t max_depth = 64;          // nesting of objects/arrays/refs
  size_t max_rules = 10'000;      // rules of the generated grammar
  size_t max_bytes = 1u << 20;    // the schema's own size, as JSON text
};

/// One element of a rule's alternative (a flat array, as llama.cpp's).
struct Element {
  enum Type : uint8_t {
    end,       // the end of a rule's last alternative
    alt,       // the end of an alternative, another follows
    rule_ref,  // value: the rule's id
    chars,     // value: index of a character class in Grammar::classes
  };
  Type type = end;
  uint32_t value = 0;
};

/// A parsed grammar: every rule's alternatives as elements in one array.
class Grammar {
 public:
  /// Parses GBNF text. Throws ds4::Error "grammar:LINE:COL: what" for bad
  /// syntax, an undefined rule, no `root`, left recursion or a limit passed.
  static std::shared_ptr<const Grammar> parse(std::string_view text, const Limits& limits = {});

  /// A character class: sorted, disjoint, inclusive code point ranges
  /// (negation already applied).
  using Class = std::vector<std::pair<uint32_t, uint32_t>>;

  std::vector<Element> elements;
  std::vector<uint32_t> rule_start;   // per rule: index of its first element
  std::vector<std::vector<uint32_t>> alts;  // per rule: index of each alternative's first element
  std::vector<std::string> rule_names;
  std::vector<Class> classes;
  uint32_t root = 0;
  Limits limits;

  bool class_has(uint32_t cls, uint32_t cp) const;
  /// Whether the class holds any code point of [lo, hi].
  bool class_meets(uint32_t cls, uint32_t lo, uint32_t hi) const;
};

/// Where the parse may be: a set of stacks of element positions (the top is
/// the last; every top is a `chars` element; an empty stack means the text so
/// far is a complete sentence), plus the bytes of an unfinished UTF-8
/// character. A value: copying it is how a caller tries text without
/// committing to it.
class Matcher {
 public:
  using Stack = std::vector<uint32_t>;

  explicit Matcher(std::shared_ptr<const Grammar> g);

  /// Feeds bytes (UTF-8, possibly ending inside a character). Returns false
  /// when the grammar cannot continue with them; the matcher is then left
  /// dead (no stacks). Throws ds4::Error "grammar: ..." when a limit of the
  /// grammar's Limits is passed.
  bool accept(std::string_view bytes);
  /// The same test on a copy: whether `bytes` could follow.
  bool can_accept(std::string_view bytes) const;
  /// One byte, the unit the worker's token trie walks by.
  bool accept_byte(uint8_t b);

  /// The text so far is a complete sentence of the grammar.
  bool can_end() const;
  /// Complete, and no character can follow.
  bool must_end() const;
  bool dead() const { return stacks_.empty(); }

  const std::vector<Stack>& stacks() const { return stacks_; }
  /// A byte string that identifies the state (stacks and unfinished bytes):
  /// equal keys, equal futures. The worker caches token masks by it.
  std::string key() const;
  const Grammar& grammar() const { return *g_; }

 private:
  void advance_code_point(uint32_t cp);
  void expand(Stack& s, std::vector<Stack>& out, size_t& n, size_t depth) const;

  // Buffers reused from one character to the next (the token walk feeds
  // millions): not part of the state, so a copy does not copy them.
  struct Scratch {
    std::vector<Stack> out;
    Stack tmp;
    Scratch() = default;
    Scratch(const Scratch&) {}
    Scratch& operator=(const Scratch&) { return *this; }
  };

  std::shared_ptr<const Grammar> g_;
  std::vector<Stack> stacks_;
  Scratch scratch_;
  uint32_t partial_cp_ = 0;   // bits of the unfinished character so far
  uint8_t partial_n_ = 0;     // bytes of it seen
  uint8_t partial_len_ = 0;   // bytes it has in all (0: none pending)
};

/// A GBNF literal for `text`: "..." with the characters that need it escaped.
std::string literal(std::string_view text);

/// Builds one grammar from several parts: JSON Schemas, each under a name,
/// and rules of the caller's own that use them. The proxy uses it to wrap a
/// tool's arguments in a family's call syntax:
///
///   GrammarBuilder b;
///   std::string args = b.add_schema(tool.parameters, "args");
///   b.add_rule("root", grammar::literal("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": ") +
///                      " " + args + " " + grammar::literal("}\n</tool_call>"));
///   std::string text = b.text();
///
/// Rules shared by schemas (ws, string, number, value, …) are added once.
class GrammarBuilder {
 public:
  explicit GrammarBuilder(SchemaLimits limits = {});

  /// Adds the rules for the JSON values `schema` allows and returns the name
  /// of the rule that matches one (`name` itself, or a fresh name based on it
  /// when taken). Throws ds4::Error naming the schema path
  /// ("schema.properties.x.type: ...") for what is too deep, too large or not
  /// supported; the builder is then unchanged.
  std::string add_schema(const nlohmann::ordered_json& schema, const std::string& name);
  /// Adds `name ::= body` (body in GBNF). Throws ds4::Error when `name` is
  /// not a valid rule name or already has another body.
  void add_rule(const std::string& name, const std::string& body);
  /// A name no rule has yet, based on `base`.
  std::string fresh_name(const std::string& base) const;
  bool has_rule(const std::string& name) const { return rules_.count(name) != 0; }

  /// The grammar text, `root` first. Throws ds4::Error when no `root` rule
  /// was added or the text does not parse (a caller's rule is wrong).
  std::string text() const;

  const SchemaLimits& limits() const { return limits_; }

 private:
  friend class SchemaCompiler;
  SchemaLimits limits_;
  std::map<std::string, std::string> rules_;
  std::vector<std::string> order_;  // names in the order added
};

/// The GBNF text accepting exactly the JSON values `schema` allows, written in
/// compact style (the whitespace rule allows at most a little whitespace, so
/// that a small model cannot wander off in spaces); supported: type,
/// properties (in the order the schema gives them: an ordered_json keeps the
/// client's order), required, additionalProperties (false, true, a schema; absent:
/// no other properties are generated, which is still valid), items,
/// prefixItems, minItems/maxItems (up to 1000), enum, const, anyOf, oneOf
/// (as anyOf: give disjoint alternatives), allOf of objects, $ref to
/// #/$defs or #/definitions (recursion allowed, as grammar recursion),
/// string minLength/maxLength (up to 1000), simple patterns (ECMAScript
/// literals, classes, groups, | and repetitions), formats date, time,
/// date-time and uuid (others are any string), integer with any
/// minimum/maximum (exclusive too; 16 digits at most), number (only
/// minimum 0 as a bound). Keywords that would constrain in other ways (not,
/// if/then/else, patternProperties, uniqueItems, multipleOf, …) are refused
/// rather than ignored. `{}` or `true` is any JSON value. Throws ds4::Error naming the
/// schema path ("schema.properties.x.type: ...") for what is too deep, too
/// large or not supported. Equal to a GrammarBuilder's add_schema(schema,
/// "root") and text().
std::string schema_to_gbnf(const nlohmann::ordered_json& schema, const SchemaLimits& limits = {});

}  // namespace ds4::grammar
