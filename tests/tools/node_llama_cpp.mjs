// Finds the npm package node-llama-cpp (a prebuilt llama.cpp) for the tools
// beside this file: in the folders of $DS4_NODE_MODULES (colon-separated),
// then tests/js/node_modules, then by Node's usual resolution.
import {createRequire} from "node:module";
import path from "node:path";
import {fileURLToPath} from "node:url";

export async function loadNodeLlamaCpp() {
  const here = path.dirname(fileURLToPath(import.meta.url));
  const dirs = [...(process.env.DS4_NODE_MODULES || "").split(":").filter(Boolean),
                path.join(here, "..", "js", "node_modules")];
  for (const dir of dirs) {
    let resolved;
    try {
      resolved = createRequire(path.join(path.resolve(dir), "noop.js")).resolve("node-llama-cpp");
    } catch {
      continue;  // not in this folder
    }
    return await import(resolved);
  }
  return await import("node-llama-cpp");
}
