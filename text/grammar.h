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

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace ds4::grammar {

struct SchemaLimits {
  size_t max_depth = 64;          // nesting of objects/arrays/refs
  size_t max_rules = 10'000;      // rules of the generated grammar
  size_t max_bytes = 1u << 20;    // the schema's own size, as JSON text
};

/// The GBNF text accepting exactly the JSON values `schema` allows (within
/// what is supported: type, properties, required, additionalProperties,
/// items, enum, const, anyOf/oneOf, $ref to #/$defs or #/definitions,
/// string formats and lengths, minItems/maxItems, number bounds as types).
/// `{}` or `true` is any JSON value. Throws ds4::Error naming the schema path
/// ("schema.properties.x.type: ...") for what is too deep, too large,
/// recursive without end, or not supported.
std::string schema_to_gbnf(const nlohmann::json& schema, const SchemaLimits& limits = {});

}  // namespace ds4::grammar
