// A capture server: answers whatever an agent client asks in the protocol it
// speaks, with a minimal valid answer ("ok"), and writes every request down.
//   node capture_server.mjs --out DIR [--port N] [--host 127.0.0.1] [--text ok]
//                           [--tool-file PATH] [--forward http://HOST:PORT]
// Prints "listening on http://HOST:PORT" once it accepts (port 0: any free one).
//
// Contract:
// - every request, whatever its path, is written to DIR/NNNN.json as
//   {seq, method, path, headers, body}: headers lower-cased, with the values
//   of secrets (authorization, cookies, *api-key*, *token*, *secret*)
//   replaced by "<redacted>"; body parsed as JSON when it is JSON, else the
//   text, else null when empty. Nothing else is trimmed.
// - answers:
//     GET|HEAD /                         200 "ok"
//     GET /v1/models, /models            an OpenAI list that is also an Anthropic list
//     GET /v1/models/NAME                that model
//     POST /v1/chat/completions          chat.completion, or its SSE chunks (stream: true),
//                                        usage included when stream_options.include_usage
//     POST /v1/completions               text_completion (stream or not)
//     POST /v1/messages                  an Anthropic message, or its SSE events
//     POST /v1/messages/count_tokens     {"input_tokens": N} (N: a rough count of the body)
//     POST /v1/responses                 a Responses object, or its SSE events
//   the same paths without /v1 as well (some clients put /v1 in their base URL,
//   some do not); anything else is a 404 in OpenAI's error shape (and still written).
// - the answer never asks for a tool (a client's turn ends after one request),
//   unless --tool-file PATH: then a request that offers tools and holds no
//   tool result yet is answered with one call, so that the client's next
//   request carries a tool call and its result in the history: a call of
//   the tool named read (any case) with PATH in its one required property,
//   else of exec_command/bash with "cat PATH" in its required cmd/command;
//   a request with neither tool, or with a tool result, gets the text.
// - --forward URL: answers nothing itself; every request goes on to URL as it
//   came (once its body is in; the answer comes back as it streams) and its
//   file gets "response": {status, headers,
//   body} (the body only for a status of 400 or more, as text, at most 64 KiB);
//   a line "METHOD PATH -> STATUS [body]" is printed per request. This shows
//   what a real server refused a client, without changing what either sends.
import http from "node:http";
import fs from "node:fs";
import path from "node:path";
import {parseArgs} from "node:util";

const {values: opt} = parseArgs({
  options: {
    out: {type: "string"},
    port: {type: "string", default: "0"},
    host: {type: "string", default: "127.0.0.1"},
    text: {type: "string", default: "ok"},
    forward: {type: "string"},
    "tool-file": {type: "string"},
  },
});
if (!opt.out) {
  console.error("capture_server: --out DIR is required");
  process.exit(2);
}
fs.mkdirSync(opt.out, {recursive: true});
const TEXT = opt.text;
let seq = 0;

const SECRET_HEADER = /^(authorization|proxy-authorization|cookie|set-cookie)$|api[-_]?key|token|secret/i;
function redactHeaders(raw) {
  const out = {};
  for (const [k, v] of Object.entries(raw)) out[k] = SECRET_HEADER.test(k) ? "<redacted>" : v;
  return out;
}

function parseBody(buf) {
  if (buf.length === 0) return null;
  const text = buf.toString("utf8");
  try {
    return JSON.parse(text);
  } catch {
    return text;
  }
}

function record(req, body, response) {
  const n = ++seq;
  const entry = {seq: n, method: req.method, path: req.url, headers: redactHeaders(req.headers), body};
  const file = path.join(opt.out, `${String(n).padStart(4, "0")}.json`);
  const write = (r) => fs.writeFileSync(file, JSON.stringify(r ? {...entry, response: r} : entry, null, 2) + "\n");
  write(response);
  return write;
}

const now = () => Math.floor(Date.now() / 1000);
const id = (prefix) => `${prefix}_${Date.now().toString(36)}${seq}`;
const modelOf = (body) => (body && typeof body === "object" && typeof body.model === "string" ? body.model : "capture");
const roughTokens = (body) => Math.max(1, Math.ceil(JSON.stringify(body ?? "").length / 4));

function sendJson(res, status, obj) {
  const data = JSON.stringify(obj);
  res.writeHead(status, {"content-type": "application/json", "content-length": Buffer.byteLength(data)});
  res.end(data);
}

function startSse(res) {
  res.writeHead(200, {"content-type": "text/event-stream", "cache-control": "no-cache", connection: "keep-alive"});
}
const sseData = (res, obj) => res.write(`data: ${JSON.stringify(obj)}\n\n`);
const sseEvent = (res, obj) => res.write(`event: ${obj.type}\ndata: ${JSON.stringify(obj)}\n\n`);

// The function tools a request offers, as [{name, schema}], whatever its protocol.
function toolsOf(body) {
  return (Array.isArray(body?.tools) ? body.tools : []).flatMap((t) => {
    if (t?.type === "function" && t.function) return [{name: t.function.name, schema: t.function.parameters}];
    if (t?.type === "function") return [{name: t.name, schema: t.parameters}];    // Responses
    if (t?.name && t?.input_schema) return [{name: t.name, schema: t.input_schema}];  // Anthropic
    return [];
  });
}

function hasToolResult(body) {
  const items = [...(Array.isArray(body?.messages) ? body.messages : []), ...(Array.isArray(body?.input) ? body.input : [])];
  return items.some((m) => m?.role === "tool" || /_call_output$/.test(m?.type ?? "") ||
    (Array.isArray(m?.content) && m.content.some((c) => c?.type === "tool_result")));
}

// The call to answer with ({id, name, args}), or null for a text answer.
function pickCall(body) {
  const file = opt["tool-file"];
  if (!file || hasToolResult(body)) return null;
  const tools = toolsOf(body);
  const read = tools.find((t) => /^read$/i.test(t.name) && t.schema?.required?.length === 1);
  if (read) return {id: `call_${seq}`, name: read.name, args: {[read.schema.required[0]]: file}};
  const shell = tools.find((t) => /^(exec_command|bash)$/i.test(t.name));
  const key = shell?.schema?.required?.find((k) => k === "cmd" || k === "command");
  if (key) return {id: `call_${seq}`, name: shell.name, args: {[key]: `cat ${file}`}};
  return null;
}

function models(res) {
  const m = {id: "capture", object: "model", created: now(), owned_by: "capture", type: "model",
             display_name: "capture", created_at: new Date().toISOString()};
  sendJson(res, 200, {object: "list", data: [m], has_more: false, first_id: m.id, last_id: m.id});
}

function chat(res, body) {
  const base = {id: id("chatcmpl"), created: now(), model: modelOf(body)};
  const usage = {prompt_tokens: roughTokens(body), completion_tokens: 1, total_tokens: roughTokens(body) + 1};
  const call = pickCall(body);
  const tc = call && {id: call.id, type: "function", function: {name: call.name, arguments: JSON.stringify(call.args)}};
  const finish = call ? "tool_calls" : "stop";
  if (!body?.stream) {
    const message = call ? {role: "assistant", content: null, tool_calls: [tc]} : {role: "assistant", content: TEXT};
    return sendJson(res, 200, {...base, object: "chat.completion", usage,
      choices: [{index: 0, message, finish_reason: finish, logprobs: null}]});
  }
  startSse(res);
  const chunk = (choices, extra = {}) => sseData(res, {...base, object: "chat.completion.chunk", choices, ...extra});
  chunk([{index: 0, delta: {role: "assistant", content: call ? null : ""}, finish_reason: null}]);
  if (call) chunk([{index: 0, delta: {tool_calls: [{index: 0, ...tc}]}, finish_reason: null}]);
  else chunk([{index: 0, delta: {content: TEXT}, finish_reason: null}]);
  chunk([{index: 0, delta: {}, finish_reason: finish}]);
  if (body.stream_options?.include_usage) chunk([], {usage});
  res.end("data: [DONE]\n\n");
}

function completion(res, body) {
  const base = {id: id("cmpl"), object: "text_completion", created: now(), model: modelOf(body)};
  if (!body?.stream) {
    return sendJson(res, 200, {...base, choices: [{index: 0, text: TEXT, finish_reason: "stop", logprobs: null}],
      usage: {prompt_tokens: 1, completion_tokens: 1, total_tokens: 2}});
  }
  startSse(res);
  sseData(res, {...base, choices: [{index: 0, text: TEXT, finish_reason: null}]});
  sseData(res, {...base, choices: [{index: 0, text: "", finish_reason: "stop"}]});
  res.end("data: [DONE]\n\n");
}

function messages(res, body) {
  const usage = {input_tokens: roughTokens(body), output_tokens: 1, cache_creation_input_tokens: 0, cache_read_input_tokens: 0};
  const msg = {id: id("msg"), type: "message", role: "assistant", model: modelOf(body), content: [],
               stop_reason: null, stop_sequence: null, usage: {...usage, output_tokens: 0}};
  const call = pickCall(body);
  const stop = call ? "tool_use" : "end_turn";
  const block = call ? {type: "tool_use", id: `toolu_${call.id}`, name: call.name, input: call.args} : {type: "text", text: TEXT};
  if (!body?.stream) return sendJson(res, 200, {...msg, content: [block], stop_reason: stop, usage});
  startSse(res);
  sseEvent(res, {type: "message_start", message: msg});
  sseEvent(res, {type: "content_block_start", index: 0, content_block: call ? {...block, input: {}} : {type: "text", text: ""}});
  sseEvent(res, {type: "ping"});
  sseEvent(res, {type: "content_block_delta", index: 0, delta: call
    ? {type: "input_json_delta", partial_json: JSON.stringify(call.args)} : {type: "text_delta", text: TEXT}});
  sseEvent(res, {type: "content_block_stop", index: 0});
  sseEvent(res, {type: "message_delta", delta: {stop_reason: stop, stop_sequence: null}, usage: {output_tokens: 1}});
  sseEvent(res, {type: "message_stop"});
  res.end();
}

function responses(res, body) {
  const respId = id("resp"), itemId = id("msg");
  const part = {type: "output_text", text: TEXT, annotations: []};
  const call = pickCall(body);
  const item = call
    ? {id: itemId, type: "function_call", status: "completed", call_id: call.id, name: call.name, arguments: JSON.stringify(call.args)}
    : {id: itemId, type: "message", status: "completed", role: "assistant", content: [part]};
  const usage = {input_tokens: roughTokens(body), input_tokens_details: {cached_tokens: 0}, output_tokens: 1,
                 output_tokens_details: {reasoning_tokens: 0}, total_tokens: roughTokens(body) + 1};
  const resp = (status, output, u) => ({id: respId, object: "response", created_at: now(), status, model: modelOf(body),
    output, parallel_tool_calls: true, tool_choice: body?.tool_choice ?? "auto", tools: body?.tools ?? [],
    previous_response_id: body?.previous_response_id ?? null, usage: u, error: null, incomplete_details: null});
  if (!body?.stream) return sendJson(res, 200, {...resp("completed", [item], usage), output_text: call ? "" : TEXT});
  startSse(res);
  let n = 0;
  const ev = (obj) => sseEvent(res, {...obj, sequence_number: n++});
  ev({type: "response.created", response: resp("in_progress", [], null)});
  ev({type: "response.in_progress", response: resp("in_progress", [], null)});
  if (call) {
    ev({type: "response.output_item.added", output_index: 0, item: {...item, status: "in_progress", arguments: ""}});
    ev({type: "response.function_call_arguments.delta", item_id: itemId, output_index: 0, delta: item.arguments});
    ev({type: "response.function_call_arguments.done", item_id: itemId, output_index: 0, arguments: item.arguments});
    ev({type: "response.output_item.done", output_index: 0, item});
    ev({type: "response.completed", response: resp("completed", [item], usage)});
    return res.end();
  }
  ev({type: "response.output_item.added", output_index: 0, item: {...item, status: "in_progress", content: []}});
  ev({type: "response.content_part.added", item_id: itemId, output_index: 0, content_index: 0, part: {...part, text: ""}});
  ev({type: "response.output_text.delta", item_id: itemId, output_index: 0, content_index: 0, delta: TEXT});
  ev({type: "response.output_text.done", item_id: itemId, output_index: 0, content_index: 0, text: TEXT});
  ev({type: "response.content_part.done", item_id: itemId, output_index: 0, content_index: 0, part});
  ev({type: "response.output_item.done", output_index: 0, item});
  ev({type: "response.completed", response: resp("completed", [item], usage)});
  res.end();
}

function route(req, res, body) {
  const p = new URL(req.url, "http://x").pathname.replace(/\/+$/, "") || "/";
  const api = p.startsWith("/v1/") ? p.slice(3) : p;
  if (p === "/" && (req.method === "GET" || req.method === "HEAD")) {
    res.writeHead(200, {"content-type": "text/plain", "content-length": 2});
    return res.end(req.method === "HEAD" ? undefined : "ok");
  }
  if (req.method === "GET" && api === "/models") return models(res);
  if (req.method === "GET" && api.startsWith("/models/")) {
    const name = decodeURIComponent(api.slice(8));
    return sendJson(res, 200, {id: name, object: "model", created: now(), owned_by: "capture", type: "model", display_name: name});
  }
  if (req.method === "POST") {
    if (api === "/chat/completions") return chat(res, body);
    if (api === "/completions") return completion(res, body);
    if (api === "/messages") return messages(res, body);
    if (api === "/messages/count_tokens") return sendJson(res, 200, {input_tokens: roughTokens(body)});
    if (api === "/responses") return responses(res, body);
  }
  sendJson(res, 404, {error: {message: `capture server: no ${req.method} ${p}`, type: "not_found_error", param: null, code: null}});
}

const MAX_ERROR_BODY = 64 * 1024;
function forward(req, res, raw, body) {
  const write = record(req, body);
  const up = http.request(new URL(req.url, opt.forward), {method: req.method, headers: req.headers}, (ur) => {
    res.writeHead(ur.statusCode, ur.headers);
    const kept = [];
    let size = 0;
    ur.on("data", (c) => {
      res.write(c);
      if (ur.statusCode >= 400 && size < MAX_ERROR_BODY) {
        kept.push(c);
        size += c.length;
      }
    });
    ur.on("end", () => {
      res.end();
      const text = ur.statusCode >= 400 ? Buffer.concat(kept).subarray(0, MAX_ERROR_BODY).toString("utf8") : undefined;
      write({status: ur.statusCode, headers: redactHeaders(ur.headers), body: text});
      console.log(`${req.method} ${req.url} -> ${ur.statusCode}${text ? " " + text.replace(/\s+/g, " ") : ""}`);
    });
  });
  up.on("error", (e) => {
    write({status: null, error: String(e)});
    console.log(`${req.method} ${req.url} -> no answer: ${e}`);
    if (!res.headersSent) sendJson(res, 502, {error: {message: `capture server: ${opt.forward}: ${e}`, type: "server_error"}});
    else res.end();
  });
  up.end(raw);
}

const server = http.createServer((req, res) => {
  const chunks = [];
  req.on("data", (c) => chunks.push(c));
  req.on("end", () => {
    const raw = Buffer.concat(chunks);
    const body = parseBody(raw);
    if (opt.forward) return forward(req, res, raw, body);
    record(req, body);
    try {
      route(req, res, body);
    } catch (e) {
      console.error(`capture_server: ${req.method} ${req.url}: ${e.stack || e}`);
      if (!res.headersSent) sendJson(res, 500, {error: {message: String(e), type: "server_error"}});
      else res.end();
    }
  });
});
server.listen(Number(opt.port), opt.host, () => {
  const a = server.address();
  console.log(`listening on http://${a.address}:${a.port}`);
});
for (const sig of ["SIGTERM", "SIGINT"]) process.on(sig, () => server.close(() => process.exit(0)));
