"""Integration test of constrained decoding in `ds4-worker serve` (see test_worker_grammar.sh)."""
import json
import os
import re
import struct
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "lib"))
from ds4test import *  # noqa: F401,F403

if not os.path.exists(STORIES):
    skip(f"{STORIES} is missing")


def vocabulary(path):
    """Token bytes from the GGUF's tokenizer.ggml.tokens (SentencePiece: U+2581 is a
    space, <0xNN> a byte, control tokens no text): a reader of its own."""
    with open(path, "rb") as f:
        data = f.read(1 << 20)
    pos = 4 + 4
    n_tensors, n_kv = struct.unpack_from("<QQ", data, pos)
    pos += 16
    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def string(p):
        (n,) = struct.unpack_from("<Q", data, p)
        return data[p + 8:p + 8 + n], p + 8 + n

    def value(t, p):
        if t == 8:
            return string(p)
        if t == 9:
            (et, n) = struct.unpack_from("<IQ", data, p)
            p += 12
            out = []
            for _ in range(n):
                v, p = value(et, p)
                out.append(v)
            return out, p
        return data[p:p + sizes[t]], p + sizes[t]

    kv = {}
    for _ in range(n_kv):
        key, pos = string(pos)
        (t,) = struct.unpack_from("<I", data, pos)
        kv[key.decode()], pos = value(t, pos + 4)
    types = [struct.unpack("<i", v)[0] for v in kv["tokenizer.ggml.token_type"]]
    out = []
    for text, ty in zip(kv["tokenizer.ggml.tokens"], types):
        s = text.decode("utf-8", "replace")
        if ty == 6:
            out.append(bytes([int(s[3:5], 16)]))
        elif ty == 1:
            out.append(s.replace("\u2581", " ").encode())
        else:
            out.append(b"")
    return out


VOCAB = vocabulary(STORIES)
text_of = lambda events: b"".join(VOCAB[t] for t in tokens_of(events)).decode()

# An object with a short name, a small number and a mood, in a grammar as the
# proxy's schema compiler writes them (compact, a little whitespace allowed).
GRAMMAR = r'''root ::= "{" ws "\"name\"" ws ":" ws name ws "," ws "\"n\"" ws ":" ws n ws ("," ws "\"mood\"" ws ":" ws mood ws)? "}"
name ::= "\"" [a-zA-Z ]{1,8} "\""
n ::= [0-9] | [1-9] [0-9]
mood ::= "\"happy\"" | "\"sad\""
ws ::= | " " | "\n" [ \t]{0,4}
'''

seg = load_segment()
d = Daemon(seg, context=256, slots=2)


def generate(seed, temperature=1.0, **extra):
    return request(d.sock, {"op": "generate", "prompt": ONCE, "max_tokens": 200, "temperature": temperature,
                            "top_k": 0, "top_p": 1, "min_p": 0, "seed": seed, "grammar": GRAMMAR, **extra})


answers = []
for seed in range(1, 9):
    ev = generate(seed)
    answers.append(ev)
    try:
        v = json.loads(text_of(ev))
        ok = (ev[-1]["ev"] == "done" and ev[-1]["reason"] == "stop" and isinstance(v, dict)
              and re.fullmatch(r"[a-zA-Z ]{1,8}", v["name"]) and 0 <= v["n"] <= 99
              and v.get("mood", "sad") in ("happy", "sad") and set(v) <= {"name", "n", "mood"})
    except (ValueError, KeyError, TypeError) as e:
        ok = False
    check(ok, f"seed {seed}: the answer at temperature 1 is inside the grammar and ends with stop: {text_of(ev)!r}")
check(len({text_of(a) for a in answers}) > 1, "different seeds give different answers")

# Resume: the rest of an answer from its first tokens equals the undisturbed one.
whole = tokens_of(answers[0])
for cut in (1, len(whole) // 2, len(whole) - 1):
    ev = generate(1, generated=whole[:cut])
    check(tokens_of(ev) == whole[cut:] and ev[-1].get("reason") == "stop",
          f"resumed after {cut} of {len(whole)} tokens, the answer continues exactly")

# Greedy too.
g = generate(0, temperature=0)
check(g[-1].get("reason") == "stop" and json.loads(text_of(g))["n"] >= 0, f"greedy answer inside the grammar: {text_of(g)!r}")

# A bad grammar: an error event that names the place; the daemon serves on.
ev = request(d.sock, {"op": "generate", "prompt": ONCE, "max_tokens": 8, "grammar": 'root ::= "a" [b-'})
check(len(ev) == 1 and ev[0]["ev"] == "error" and ev[0]["message"].startswith("grammar:1:"),
      f"a bad grammar is an error event naming line:column: {ev}")
ev = request(d.sock, {"op": "generate", "prompt": ONCE, "max_tokens": 8, "grammar": "root ::= root \"x\" | \"y\""})
check(ev and ev[-1]["ev"] == "error" and "left-recursive" in ev[-1]["message"], "a left-recursive grammar is refused")
check(tokens_of(generate(3)) == tokens_of(answers[2]), "the daemon keeps serving: the same seed, the same answer")
d.stop()
finish()
