// Loads a GGUF model with llama.cpp (through the npm package node-llama-cpp)
// and generates greedily, to check that llama.cpp accepts a file.
//
// Usage: node tests/tools/llamacpp_generate.mjs MODEL.gguf [N] [PROMPT]
// Prints one JSON line: {"prompt_tokens":[…],"tokens":[…],"text":"…"}.
// node-llama-cpp is found as node_llama_cpp.mjs describes.
import {loadNodeLlamaCpp} from "./node_llama_cpp.mjs";

const [modelPath, nArg = "8", prompt = "Once upon a time"] = process.argv.slice(2);
if (!modelPath) {
  console.error("usage: llamacpp_generate.mjs MODEL.gguf [N] [PROMPT]");
  process.exit(2);
}
const n = Number(nArg);

const {getLlama} = await loadNodeLlamaCpp();
const llama = await getLlama({gpu: false, build: "never", logLevel: "error"});
const model = await llama.loadModel({modelPath});
// One thread: with more, llama.cpp's threads spin against each other on a
// small, busy machine and a tiny model runs a hundred times slower.
const ctx = await model.createContext({contextSize: 256, sequences: 1, threads: 1});
const seq = ctx.getSequence();
const promptTokens = [model.tokens.bos, ...model.tokenize(prompt, false)];
const tokens = [];
for await (const t of seq.evaluate(promptTokens, {temperature: 0})) {
  tokens.push(t);
  if (tokens.length >= n) break;
}
console.log(JSON.stringify({prompt_tokens: promptTokens, tokens,
                            text: model.detokenize(tokens, false, promptTokens)}));
await ctx.dispose();
await model.dispose();
await llama.dispose();
