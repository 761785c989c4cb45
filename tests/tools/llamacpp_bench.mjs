// llama.cpp's speed on a GGUF file, measured like llama-bench through the
// prebuilt node-llama-cpp: a P-token prompt (pp), then N tokens generated one
// at a time from an empty cache (tg), repeated. Prints one JSON line with the
// same fields as `ds4-worker bench`.
//   node llamacpp_bench.mjs MODEL [P] [N] [REPS] [THREADS]
import {loadNodeLlamaCpp} from "./node_llama_cpp.mjs";

const [model, P = "128", N = "128", R = "3", T = "2"] = process.argv.slice(2);
const np = +P, ng = +N, reps = +R, threads = +T;
const {getLlama} = await loadNodeLlamaCpp();
const llama = await getLlama({gpu: false, build: "never", logLevel: "error"});
const m = await llama.loadModel({modelPath: model});
const nVocab = m.tokens.bos !== undefined ? 512 : 512;

let seed = 42;
const rand = () => (seed = (seed * 1103515245 + 12345) % 2147483648) % nVocab;

async function once(fn) {
  const ctx = await m.createContext({contextSize: Math.max(np, ng) + 16, batchSize: Math.max(np, 1), threads});
  const seq = ctx.getSequence();
  const t0 = process.hrtime.bigint();
  await fn(seq);
  const s = Number(process.hrtime.bigint() - t0) / 1e9;
  await ctx.dispose();
  return s;
}
const pp = async (seq) => {
  const toks = Array.from({length: np}, rand);
  await seq.evaluateWithoutGeneratingNewTokens(toks);
};
const tg = async (seq) => {
  let n = 0;
  for await (const t of seq.evaluate([rand()], {temperature: 0})) {
    if (++n >= ng) break;
  }
};
function stats(xs) {
  const mean = xs.reduce((a, b) => a + b, 0) / xs.length;
  const sd = xs.length > 1 ? Math.sqrt(xs.reduce((a, b) => a + (b - mean) ** 2, 0) / (xs.length - 1)) : 0;
  return [mean, sd];
}
const rates = {pp: [], tg: []};
for (const [name, fn, n] of [["pp", pp, np], ["tg", tg, ng]]) {
  if (n === 0) continue;
  await once(fn);  // warm-up
  for (let r = 0; r < reps; ++r) rates[name].push(n / (await once(fn)));
}
const [ppm, pps] = stats(rates.pp.length ? rates.pp : [0]);
const [tgm, tgs] = stats(rates.tg.length ? rates.tg : [0]);
console.log(JSON.stringify({engine: "llama.cpp (node-llama-cpp)", threads, n_prompt: np, n_gen: ng, repetitions: reps,
                            pp_tok_s: ppm, pp_sd: pps, tg_tok_s: tgm, tg_sd: tgs}));
process.exit(0);
