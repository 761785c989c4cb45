#!/usr/bin/env python3
"""Greedy answers of ds4-worker against llama.cpp's llama-server, prompt by prompt.

usage: arch_compare.py WORKER MODEL PEER N_PREDICT NEAR_TIE PROMPT...
       arch_compare.py --record OUT.json PORT N_PREDICT PROMPT...

PEER is llama-server's port, or a file --record wrote from one earlier (the
reference taken on one machine, checked on another: the CUDA backend on the
GPU machine, which has no llama.cpp build). DS4_DEVICE, when set, is passed
to ds4-worker as --device; DS4_WORKER_ARGS adds options (--kv-cache q8_0). DS4_ROUTER_TIE, when set (a mixture of experts),
is the router's near tie in nats (below).

For each prompt: the prompt tokens of `ds4-worker run --json` must equal
llama-server's /tokenize (with the special tokens), and the greedy tokens
(--temp 0, against /completion with temperature 0 and n_probs 2; the end
of the text is a token too) must be equal up to the end, or part only at a position where
llama.cpp's own two best candidates are a near tie: their log-probabilities
differ by less than NEAR_TIE nats. Prints one line per prompt; exits 1 on a
disagreement, naming the prompt, the position and both tokens.

The thresholds (test_arch_llamacpp.sh): the two engines round differently.
F16, 0.1 nats: llama.cpp rounds a product's activations to f16 for F16
weights, ds4 keeps them f32, and sums go in other orders; that moves a
logit by a few 1e-3 (f16's 2^-11 relative error times logits of ~10,
carried through the layers), and 0.1 is some 20 times that. Q8_0, 0.25
nats: both engines round activations to 8 bits per block of 32, a grid
(1/254 of the block's largest value) 8 times coarser than f16's, and two
inputs that differ by any rounding land on different steps near a boundary.
Both stay far below the gaps the generator's weights leave between a clear
winner and the next (a nat or more), so a real error in an op (a missing
bias, a wrong RoPE pairing or head size) cannot hide under them; and most
tokens must agree before any near tie (below).

A mixture of experts chooses each token's experts by the router's scores:
where the last chosen expert and the best unchosen one are nearly tied, two
engines that round differently may choose differently, and the answers
part without a near tie in the output. With DS4_ROUTER_TIE, ds4 reports its
own router margins (`run --router-gaps`), and a parting is also accepted
when, at the position that produced the token or the three before it, a
layer's margin was below DS4_ROUTER_TIE nats. The rule that most tokens
agree still holds, so a real error in the experts cannot hide under it.
"""
import json
import os
import subprocess
import sys
import urllib.request

def post(port, path, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.read().decode("utf-8", "replace")


END = "<end>"


def peer_completion(port, prompt, n):
    """The streamed greedy completion: [(token, [(id, logprob), ...]), ...];
    the end of generation token is END."""
    body = {"prompt": prompt, "n_predict": n, "temperature": 0, "stream": True, "n_probs": 2,
            "cache_prompt": False, "return_tokens": True}
    out = []
    for line in post(port, "/completion", body).splitlines():
        if not line.startswith("data: "):
            continue
        ev = json.loads(line[6:])
        if "error" in ev:
            raise RuntimeError(f"llama-server: {ev['error']}")
        if ev.get("stop") and ev.get("stop_type") == "eos" and out:
            out[-1] = (END, out[-1][1])
        probs = ev.get("completion_probabilities") or []
        toks = ev.get("tokens") or []
        for i, p in enumerate(probs):
            top = [(t["id"], t["logprob"]) for t in p.get("top_logprobs", [])]
            out.append((p.get("id", toks[i] if i < len(toks) else None), top))
    return out


def peer_reference(port, prompt, n):
    """llama-server's prompt tokens and greedy answer for one prompt."""
    tokens = json.loads(post(port, "/tokenize", {"content": prompt, "add_special": True}))["tokens"]
    return {"prompt_tokens": tokens, "answer": peer_completion(port, prompt, n)}


def record(out, port, n, prompts):
    refs = {"n_predict": n, "prompts": {p: peer_reference(port, p, n) for p in prompts}}
    with open(out, "w") as f:
        json.dump(refs, f)
    return 0


def main():
    if sys.argv[1] == "--record":
        return record(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:])
    worker, model, source, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    near_tie = float(sys.argv[5])
    prompts = sys.argv[6:]
    recorded = None
    if source.endswith(".json"):
        with open(source) as f:
            recorded = json.load(f)
        if recorded["n_predict"] != n:
            print(f"FAIL: {source} holds answers of {recorded['n_predict']} tokens, not {n}")
            return 1
    device = ["--device", os.environ["DS4_DEVICE"]] if os.environ.get("DS4_DEVICE") else []
    device += os.environ.get("DS4_WORKER_ARGS", "").split()
    router_tie = float(os.environ["DS4_ROUTER_TIE"]) if os.environ.get("DS4_ROUTER_TIE") else None
    if router_tie is not None:
        device.append("--router-gaps")
    agreed = compared = 0
    for prompt in prompts:
        ref = recorded["prompts"][prompt] if recorded else peer_reference(int(source), prompt, n)
        want_prompt = ref["prompt_tokens"]
        r = subprocess.run([worker, "run", "--model", model, "-p", prompt, "-n", str(n), "--temp", "0",
                            "--json", "--threads", "2"] + device, capture_output=True, text=True)
        if r.returncode != 0:
            print(f"FAIL: ds4-worker run on {prompt!r}: {r.stderr.strip()}")
            return 1
        got = json.loads(r.stdout.strip().splitlines()[-1])
        if got["prompt_tokens"] != want_prompt:
            print(f"FAIL: {prompt!r}: prompt tokens {got['prompt_tokens']} but llama.cpp has {want_prompt}")
            return 1
        peer = [(t, [tuple(c) for c in top]) for t, top in ref["answer"]]
        mine = got["tokens"] + ([END] if got["finish_reason"] == "stop" else [])
        m = min(len(mine), len(peer))
        same = 0
        while same < m and mine[same] == peer[same][0]:
            same += 1
        compared += len(peer)
        agreed += same
        if same == len(mine) == len(peer):
            print(f"ok: {prompt!r}: the same {same} tokens" + (" (the last the end)" if mine[-1] == END else ""))
            continue
        if same == m:
            print(f"FAIL: {prompt!r}: {len(mine)} tokens from ds4, {len(peer)} from llama.cpp, the same up to the shorter")
            return 1
        top = peer[same][1]
        gap = top[0][1] - top[1][1] if len(top) >= 2 else float("inf")
        if gap >= near_tie and router_tie is not None:
            # Answer token `same` comes from position len(prompt) + same - 1.
            last = len(want_prompt) + same - 1
            window = got["router_gaps"][max(0, last - 3):last + 1]
            if window and min(window) < router_tie:
                where = last - len(window) + 1 + window.index(min(window))
                print(f"ok: {prompt!r}: the same {same} tokens, then a router near tie in ds4 "
                      f"({min(window):.4f} nats at position {where})")
                continue
        if gap >= near_tie:
            print(f"FAIL: {prompt!r}: token {same} is {mine[same]} from ds4, {peer[same][0]} from llama.cpp, "
                  f"whose two best ({top}) are {gap:.3f} nats apart (a near tie is < {near_tie})")
            print(f"  ds4:       {mine}\n  llama.cpp: {[t for t, _ in peer]}")
            return 1
        print(f"ok: {prompt!r}: the same {same} tokens, then a near tie ({gap:.4f} nats) in llama.cpp")
    # Ties everywhere would make the comparison empty: most tokens must agree
    # (DS4_MIN_AGREED: another share, where the caller says why).
    min_share = float(os.environ.get("DS4_MIN_AGREED") or 0.5)
    if agreed < min_share * compared:
        print(f"FAIL: only {agreed} of {compared} tokens agreed before a near tie (at least {min_share:.0%} must)")
        return 1
    print(f"agreed on {agreed} of {compared} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
