// Sends captured agent requests (tests/data/agent_requests/*.json) to a
// server as the client sent them, and prints what it answered.
//   node replay.mjs [--status-only] BASE_URL API_KEY FILE...
// Per file one line: "FILE: METHOD PATH -> STATUS" and, for a status of 400 or
// more, the answer's body. --status-only: an answer below 400 is dropped once
// its status came (the server sees the client go away), so that a model that
// never stops costs nothing. The captured headers are sent again except the
// redacted ones, host, content-length and accept-encoding; the key goes as
// both x-api-key and Authorization: Bearer. A streamed answer is read to its
// end (its last event is shown). Exit status: 0 when every answer was below
// 400, 1 otherwise.
import fs from "node:fs";
import path from "node:path";

const args = process.argv.slice(2);
const statusOnly = args[0] === "--status-only";
if (statusOnly) args.shift();
const [base, key, ...files] = args;
if (!base || !key || files.length === 0) {
  console.error("usage: node replay.mjs [--status-only] BASE_URL API_KEY FILE...");
  process.exit(2);
}
const SKIP = new Set(["host", "content-length", "accept-encoding", "connection"]);
let bad = 0;
for (const file of files) {
  const req = JSON.parse(fs.readFileSync(file, "utf8"));
  const headers = {};
  for (const [k, v] of Object.entries(req.headers ?? {})) {
    if (!SKIP.has(k) && v !== "<redacted>") headers[k] = v;
  }
  headers["x-api-key"] = key;
  headers.authorization = `Bearer ${key}`;
  const hasBody = req.body !== null && req.body !== undefined;
  if (hasBody) headers["content-type"] ??= "application/json";
  const name = path.basename(file);
  const stop = new AbortController();
  const timer = setTimeout(() => stop.abort(new Error("no answer within 300 s")), 300000);
  try {
    const r = await fetch(new URL(req.path, base), {
      method: req.method, headers,
      body: hasBody ? (typeof req.body === "string" ? req.body : JSON.stringify(req.body)) : undefined,
      signal: stop.signal,
    });
    let line = `${name}: ${req.method} ${req.path} -> ${r.status}`;
    if (statusOnly && r.status < 400) {
      stop.abort();
      console.log(line);
      continue;
    }
    const text = await r.text();
    if (r.status >= 400) {
      bad++;
      line += ` ${text.replace(/\s+/g, " ").slice(0, 600)}`;
    } else if ((r.headers.get("content-type") ?? "").includes("event-stream")) {
      const events = text.trim().split(/\n\n/);
      line += ` (${events.length} events, last: ${events.at(-1).replace(/\s+/g, " ").slice(0, 200)})`;
    }
    console.log(line);
  } catch (e) {
    bad++;
    console.log(`${name}: ${req.method} ${req.path} -> no answer: ${e.message}`);
  } finally {
    clearTimeout(timer);
  }
}
process.exit(bad ? 1 : 0);
