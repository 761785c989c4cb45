// Real clients against the ds4 proxy: the official openai and @anthropic-ai/sdk
// packages, chat (stream and not), completions (stream and not), messages
// (stream and not). Checks texts, usage and event sequences.
//   node proxy_clients.mjs BASE_URL API_KEY EXPECTED_COMPLETION_TEXT
// EXPECTED_COMPLETION_TEXT: what `ds4-worker run -p "Once upon a time" -n 24 --temp 0` gives.
import assert from "node:assert/strict";
import OpenAI from "openai";
import Anthropic from "@anthropic-ai/sdk";
import {check, finish} from "./checks.mjs";

const [base, key, expected] = process.argv.slice(2);
const openai = new OpenAI({baseURL: `${base}/v1`, apiKey: key, maxRetries: 0, timeout: 60000});
const anthropic = new Anthropic({baseURL: base, apiKey: key, maxRetries: 0, timeout: 60000});

const messages = [{role: "system", content: "You tell stories."}, {role: "user", content: "Tell me about a cat."}];

await check("models lists the served model", async () => {
  const list = await openai.models.list();
  const ids = [];
  for await (const m of list) ids.push(m.id);
  assert.deepEqual(ids, ["stories"]);
});

let completionText;
await check("completions, not streamed, match ds4-worker run (greedy)", async () => {
  const r = await openai.completions.create({model: "stories", prompt: "Once upon a time", max_tokens: 24, temperature: 0});
  completionText = r.choices[0].text;
  assert.equal(completionText, expected);
  assert.equal(r.choices[0].finish_reason, "length");
  assert.equal(r.usage.completion_tokens, 24);
  assert.equal(r.usage.prompt_tokens, 5);
  assert.equal(r.usage.total_tokens, 29);
  assert.equal(r.timings.predicted_n, 24);
});

await check("completions, streamed, give the same text", async () => {
  const s = await openai.completions.create({model: "stories", prompt: "Once upon a time", max_tokens: 24, temperature: 0, stream: true});
  let text = "", reasons = [];
  for await (const c of s) {
    text += c.choices[0]?.text ?? "";
    if (c.choices[0]?.finish_reason) reasons.push(c.choices[0].finish_reason);
  }
  assert.equal(text, expected);
  assert.deepEqual(reasons, ["length"]);
});

let chatText;
await check("chat, not streamed: text, usage, timings", async () => {
  const r = await openai.chat.completions.create({model: "stories", messages, max_tokens: 30, temperature: 0});
  chatText = r.choices[0].message.content;
  assert.equal(r.object, "chat.completion");
  assert.equal(r.choices[0].message.role, "assistant");
  assert.ok(chatText.length > 0);
  assert.ok(r.usage.prompt_tokens > 10);
  assert.ok(r.usage.completion_tokens > 0 && r.usage.completion_tokens <= 30);
  assert.equal(r.usage.total_tokens, r.usage.prompt_tokens + r.usage.completion_tokens);
  assert.ok(r.timings.predicted_per_second > 0);
});

await check("chat, streamed with include_usage: same text, one role chunk, usage last", async () => {
  const s = await openai.chat.completions.create({model: "stories", messages, max_tokens: 30, temperature: 0, stream: true,
                                                  stream_options: {include_usage: true}});
  let text = "", roles = 0, usage = null, finish = null, afterUsage = 0;
  for await (const c of s) {
    if (usage) afterUsage++;
    if (c.usage) usage = c.usage;
    const ch = c.choices[0];
    if (!ch) continue;
    if (ch.delta?.role) roles++;
    text += ch.delta?.content ?? "";
    if (ch.finish_reason) finish = ch.finish_reason;
  }
  assert.equal(text, chatText);
  assert.equal(roles, 1);
  assert.ok(finish === "length" || finish === "stop");
  assert.ok(usage && usage.completion_tokens > 0);
  assert.equal(afterUsage, 0);
});

await check("chat: stop string ends the text before it (matched across tokens)", async () => {
  const cut = Math.floor(chatText.length / 2);
  const stop = chatText.slice(cut, cut + 3);
  const r = await openai.chat.completions.create({model: "stories", messages, max_tokens: 30, temperature: 0, stop: [stop]});
  assert.equal(r.choices[0].message.content, chatText.slice(0, chatText.indexOf(stop)));
  assert.equal(r.choices[0].finish_reason, "stop");
});

await check("chat: logprobs and top_logprobs", async () => {
  const r = await openai.chat.completions.create({model: "stories", messages, max_tokens: 5, temperature: 0, logprobs: true, top_logprobs: 3});
  const lp = r.choices[0].logprobs.content;
  assert.equal(lp.length, 5);
  assert.equal(lp.map((t) => t.token).join(""), r.choices[0].message.content);
  for (const t of lp) {
    assert.ok(t.logprob <= 0);
    assert.equal(t.top_logprobs.length, 3);
    assert.equal(t.top_logprobs[0].token, t.token);  // greedy: the best one
  }
});

await check("chat: seeded sampling with temperature repeats exactly", async () => {
  const req = {model: "stories", messages, max_tokens: 20, temperature: 1.0, seed: 42};
  const a = await openai.chat.completions.create(req);
  const b = await openai.chat.completions.create(req);
  assert.equal(a.choices[0].message.content, b.choices[0].message.content);
});

let messageText;
await check("messages, not streamed: content, stop_reason, usage", async () => {
  const r = await anthropic.messages.create({model: "stories", max_tokens: 30, temperature: 0, system: "You tell stories.",
                                             messages: [{role: "user", content: "Tell me about a cat."}]});
  assert.equal(r.type, "message");
  assert.equal(r.role, "assistant");
  assert.equal(r.content[0].type, "text");
  messageText = r.content[0].text;
  assert.equal(messageText, chatText);  // same prompt as the OpenAI chat
  assert.ok(["max_tokens", "end_turn"].includes(r.stop_reason));
  // The prompt is input_tokens plus what the slot's cache held (the OpenAI chat above sent the same one).
  assert.ok(r.usage.input_tokens + r.usage.cache_read_input_tokens > 10, JSON.stringify(r.usage));
  assert.ok(r.usage.input_tokens >= 1, JSON.stringify(r.usage));
  assert.equal(r.usage.cache_creation_input_tokens, 0);
  assert.ok(r.usage.output_tokens > 0);
});

await check("messages, streamed: the event sequence and the same text", async () => {
  const s = await anthropic.messages.create({model: "stories", max_tokens: 30, temperature: 0, system: "You tell stories.", stream: true,
                                             messages: [{role: "user", content: "Tell me about a cat."}]});
  const types = [];
  let text = "", stop = null, out = 0;
  for await (const ev of s) {
    if (types[types.length - 1] !== ev.type || ev.type !== "content_block_delta") types.push(ev.type);
    if (ev.type === "content_block_delta") text += ev.delta.text;
    if (ev.type === "message_delta") {
      stop = ev.delta.stop_reason;
      out = ev.usage.output_tokens;
    }
  }
  // (the SDK passes ping events over; curl checks them in the raw stream)
  assert.deepEqual(types.filter((t) => t !== "ping"),
                   ["message_start", "content_block_start", "content_block_delta", "content_block_stop", "message_delta",
                    "message_stop"]);
  assert.equal(text, messageText);
  assert.ok(["max_tokens", "end_turn"].includes(stop));
  assert.ok(out > 0);
});

await check("messages.stream helper: finalMessage and stop_sequences", async () => {
  const cut = Math.floor(messageText.length / 2);
  const stop = messageText.slice(cut, cut + 3);
  const stream = anthropic.messages.stream({model: "stories", max_tokens: 30, temperature: 0, system: "You tell stories.",
                                            stop_sequences: [stop], messages: [{role: "user", content: "Tell me about a cat."}]});
  const m = await stream.finalMessage();
  assert.equal(m.content[0].text, messageText.slice(0, messageText.indexOf(stop)));
  assert.equal(m.stop_reason, "stop_sequence");
  assert.equal(m.stop_sequence, stop);
});

await check("a bad key is refused by both SDKs with 401", async () => {
  const bad = new OpenAI({baseURL: `${base}/v1`, apiKey: "sk-wrong", maxRetries: 0});
  await assert.rejects(bad.chat.completions.create({model: "stories", messages, max_tokens: 2}),
                       (e) => e.status === 401 && e.error?.type === "authentication_error");
  const badA = new Anthropic({baseURL: base, apiKey: "sk-wrong", maxRetries: 0});
  await assert.rejects(badA.messages.create({model: "stories", max_tokens: 2, messages: [{role: "user", content: "x"}]}),
                       (e) => e.status === 401 && e.error?.error?.type === "authentication_error");
});

await check("a prompt over the context is 400 naming the context and the prompt length", async () => {
  const long = "Once upon a time there was a cat. ".repeat(60);
  await assert.rejects(openai.completions.create({model: "stories", prompt: long, max_tokens: 2}),
                       (e) => e.status === 400 && /context is 256 tokens/.test(e.message) && /prompt has \d+ tokens/.test(e.message));
});

finish();
