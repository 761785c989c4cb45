// Records llama.cpp's behaviour on stories260K.gguf as reference data for
// ds4's tests: tokenization (no BOS) of varied prompts, the detokenized text,
// 32 greedy tokens generated after [BOS] + prompt, and the next-token
// probabilities (temperature 1, no truncation) after the prompt.
//
// Usage: node tests/tools/make_refs.mjs \
//          ../shared/models/stories260K.gguf tests/data/stories260K_refs.json
// llama.cpp comes from the npm package node-llama-cpp (see node_llama_cpp.mjs),
// run on the CPU with one thread.
import {writeFileSync} from "node:fs";
import path from "node:path";

import {loadNodeLlamaCpp} from "./node_llama_cpp.mjs";

const [modelPath, outPath] = process.argv.slice(2);
if (!modelPath || !outPath) {
  console.error("usage: make_refs.mjs MODEL.gguf OUT.json");
  process.exit(2);
}

const PROMPTS = [
  "Once upon a time",
  "Hello world",
  " leading space",
  "trailing space ",
  "multiple   spaces   between",
  "  two leading spaces",
  "line one\nline two",
  "\n\nnewlines first",
  "tabs\tand\ttabs",
  "numbers 1234567890 and 3.14159",
  "Punctuation!? (yes), [no]; {maybe}: \"quoted\" 'single' - dash -- end...",
  "café naïve résumé Zürich",
  "Ελληνικά γράμματα",
  "中文字符测试",
  "日本語のテキスト",
  "emoji 😀🎉 and 👍🏽",
  "",
  " ",
  "a",
  "supercalifragilisticexpialidociousantidisestablishmentarianismpneumonoultramicroscopic",
  "Lily and Tom went to the park. They saw a big dog.",
  "UPPER lower MiXeD",
  "<s> and </s> are plain text here",
  "email@example.com http://x.y/z?q=1&r=2",
  "€100 £50 ¥30 ±5 ∞",
  "Привет мир",
  "x\r\ny\tz",
];
const N_GEN = 32;
const N_TOP = 8;

const t0 = Date.now();
const log = (msg) => console.error(`[${((Date.now() - t0) / 1000).toFixed(1)}s] ${msg}`);
const {getLlama} = await loadNodeLlamaCpp();
const llama = await getLlama({gpu: false, build: "never", logLevel: "error"});
log("llama ready");
const model = await llama.loadModel({modelPath});
const ctx = await model.createContext({contextSize: 512, sequences: 1, threads: 1});
const seq = ctx.getSequence();
const bos = model.tokens.bos;
log("model ready");

const cases = [];
for (const prompt of PROMPTS) {
  const tokens = Array.from(model.tokenize(prompt, false));
  const input = [bos, ...tokens];

  await seq.clearHistory();
  const gen = [];
  for await (const t of seq.evaluate(input, {temperature: 0})) {
    gen.push(t);
    if (gen.length >= N_GEN) break;
  }

  // Next-token distribution after the prompt, untruncated, temperature 1.
  await seq.clearHistory();
  let top = [];
  for await (const out of seq.evaluateWithMetadata(input, {probabilities: true},
                                                   {temperature: 1, topK: 0, topP: 1, minP: 0})) {
    top = Array.from(out.probabilities.entries()).slice(0, N_TOP)
      .map(([token, p]) => ({token, prob: p}));
    break;
  }

  cases.push({
    prompt,
    tokens,
    detokenized: model.detokenize(tokens),
    generated: gen,
    generated_text: model.detokenize(gen, false, input),
    next_top: top,
  });
  log(`${JSON.stringify(prompt)}: ${tokens.length} tokens`);
}

const out = {
  model: path.basename(modelPath),
  source: "llama.cpp via node-llama-cpp (CPU), tests/tools/make_refs.mjs",
  bos,
  eos: model.tokens.eos,
  add_bos: true,
  n_generated: N_GEN,
  cases,
};
writeFileSync(outPath, JSON.stringify(out, null, 1) + "\n");
log(`wrote ${outPath}`);
await model.dispose();
await llama.dispose();
