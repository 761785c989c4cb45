// Sends captured agent requests (tests/data/agent_requests/*.json) to a
// server as the client sent them, and prints what it answered.
//   node replay.mjs BASE_URL API_KEY FILE...
// Per file one line: "FILE: METHOD PATH -> STATUS" and, for a status of 400 or
// more, the answer's body. The captured headers are sent again except the
// redacted ones, host, content-length and accept-encoding; the key goes as
// both x-api-key and Authorization: Bearer. A streamed answer is read to its
// end (its last event is shown). Exit status: 0 when every answer was below
// 400, 1 otherwise.
import fs from "node:fs";
import path from "node:path";

const [base, key, ...files] = process.argv.slice(2);
if (!base || !key || files.length === 0) {
  console.error("usage: node replay.mjs BASE_URL API_KEY FILE...");
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
  try {
    const r = await fetch(new URL(req.path, base), {
      method: req.method, headers,
      body: hasBody ? (typeof req.body === "string" ? req.body : JSON.stringify(req.body)) : undefined,
      signal: AbortSignal.timeout(300000),
    });
    const text = await r.text();
    let line = `${name}: ${req.method} ${req.path} -> ${r.status}`;
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
  }
}
process.exit(bad ? 1 : 0);
