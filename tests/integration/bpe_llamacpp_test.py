#!/usr/bin/env python3
"""Tokens of ds4 against llama.cpp's for one GGUF (test_bpe_llamacpp.sh).

usage: bpe_llamacpp_test.py DS4_WORKER MODEL TOKENIZER_JSON PORT

llama.cpp answers through llama-server's /tokenize (already started on PORT
with MODEL); ds4 through `ds4-worker tokenize --lines`. Every case is tried
with add_special on, with parse_special false and true, and escape_special
(ds4 --escape --special) must give llama.cpp's parse_special=false tokens.
Prints one line per case and mode: ok, or FAIL with the first difference.
Exit status 1 when any case fails.
"""
import json
import os
import subprocess
import sys
import tempfile
import urllib.request

CORPUS = [
    # code
    'def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n',
    '#include <vector>\nint main() { std::vector<int> v{1, 2, 3}; for (auto& x : v) x *= 2; return 0; }\n',
    '{"name": "ds4", "ids": [1, 22, 333], "ok": true, "nested": {"k": null}}',
    '\tif (a != b && c <= d) { x->y[i] = ~z; } // done\r\n',
    # numbers
    '1234567', '3.14159', '1,000,000', 'pi=3.14159265358979 and e=2.718', '0x1F 1e-10 -42 +7',
    '١٢٣ ४५६ ½ ² Ⅻ',
    # CJK
    '中文、日本語、한국어', '我喜欢编程。今天天气很好！', 'ひらがなとカタカナ、漢字。', '안녕하세요 세계',
    '数字123和中文混合abc',
    # emoji
    'hello 👋 world 🌍', '👨‍👩‍👧‍👦 family', '🇫🇷🇩🇪🇯🇵 flags', '👍🏽 skin tone', '❤️‍🔥',
    # accents and combining marks
    'é ñ ü ç ø å', 'e\u0301 n\u0303 a\u0308', 'Crème brûlée à la carte, façade, naïve', 'Ἑλληνικά Кириллица',
    # spaces, tabs, newlines
    'a  b\t\tc\n\n\nd   ', '   leading', 'trailing   ', '\n\n\n', ' \t \n \r\n ', 'x\u00a0y\u2003z\u3000w',
    'line1\r\nline2\rline3\n', '        indented code',
    # URLs and mixed
    'https://example.com/path?q=1&r=two#frag', 'mailto:someone@example.org', 'C:\\Users\\ds4\\file.txt',
    "I'm you're they've we'll he'd it's DON'T I'M",
    '~~~ ~/.bashrc a~b ~é', '<<< >>> ||| ``` ***',
    'Hello, world! How are you today?',
    '',
    ' ',
    'a',
    '\u200b\u200d\ufeff zero width',
]


def specials(tokenizer_json):
    with open(tokenizer_json, encoding='utf-8') as f:
        t = json.load(f)
    return [a['content'] for a in t.get('added_tokens', [])]


def llama_tokenize(port, text, parse_special):
    body = json.dumps({'content': text, 'add_special': True, 'parse_special': parse_special}).encode()
    req = urllib.request.Request(f'http://127.0.0.1:{port}/tokenize', data=body,
                                 headers={'Content-Type': 'application/json'})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)['tokens']


def ds4_tokenize(worker, model, texts, flags):
    with tempfile.NamedTemporaryFile('w', suffix='.jsonl', delete=False, encoding='utf-8') as f:
        for t in texts:
            f.write(json.dumps(t) + '\n')
        path = f.name
    try:
        out = subprocess.run([worker, 'tokenize', '-m', model, '--lines', path] + flags,
                             check=True, capture_output=True, text=True).stdout
    finally:
        os.unlink(path)
    lines = out.split('\n')[:len(texts)]
    return [[int(x) for x in line.split()] for line in lines]


def first_difference(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f'at {i}: llama.cpp {a[i:i + 6]} ds4 {b[i:i + 6]}'
    return f'lengths: llama.cpp {len(a)} ds4 {len(b)} (tail llama.cpp {a[len(b):][:6]} ds4 {b[len(a):][:6]})'


def main():
    worker, model, tokenizer_json, port = sys.argv[1:5]
    name = os.path.basename(model)
    texts = list(CORPUS)
    for s in specials(tokenizer_json):
        texts.append(s)
        texts.append(f'say {s} now{s}{s}\n')
    modes = [
        ('plain', [], False),
        ('special', ['--special'], True),
        ('escaped', ['--special', '--escape'], False),
    ]
    failures = 0
    for mode, flags, parse_special in modes:
        ours = ds4_tokenize(worker, model, texts, flags)
        ok = 0
        for text, mine in zip(texts, ours):
            ref = llama_tokenize(port, text, parse_special)
            if ref == mine:
                ok += 1
                if len(texts) <= 80 or text in CORPUS:
                    print(f'ok: {name} {mode} {json.dumps(text)[:60]}')
            else:
                failures += 1
                print(f'FAIL: {name} {mode} {json.dumps(text)[:80]}: {first_difference(ref, mine)}')
        print(f'{name} {mode}: {ok}/{len(texts)} equal')
    return 1 if failures else 0


if __name__ == '__main__':
    sys.exit(main())
