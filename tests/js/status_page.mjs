// The status page in a real browser (headless Chromium driven by
// playwright-core; Debian's chromium, never a downloaded one):
//   node status_page.mjs URL KEY DS4CTL ARTIFACTS_DIR
// URL: the proxy; KEY: an API key (the browser gives it as Basic auth, the
// password its prompt would ask for). With the page open it SIGKILLs worker
// 0 and then forces an OOM kill (ds4ctl context 0 2048, a rung that cannot
// fit the worker's memory limit), and checks that the page shows each
// within a few seconds: the restart, then the OOM kill and the step down to
// 256. Then at phone width (390 px) the page must not scroll sideways.
// Screenshots go to ARTIFACTS_DIR.
import { execFileSync } from "node:child_process";
import { mkdirSync, mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { chromium } from "playwright-core";
import { check, finish } from "./checks.mjs";

const [url, key, ds4ctl, artifacts] = process.argv.slice(2);
const SHOW_WITHIN_MS = 8000;  // the page refreshes every second here; the restart itself takes well under one
mkdirSync(artifacts, { recursive: true });
const profile = mkdtempSync(join(tmpdir(), "ds4-chromium-"));

const status = () => JSON.parse(execFileSync(ds4ctl, ["status", "--json"], { encoding: "utf8" }));
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

// A fresh profile (--user-data-dir, which playwright passes for a persistent context).
const context = await chromium.launchPersistentContext(profile, {
  executablePath: "/usr/bin/chromium",
  args: ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"],
  viewport: { width: 1200, height: 900 },
  httpCredentials: { username: "ds4", password: key },
});
let failedOut = false;
try {
  const page = context.pages()[0] || await context.newPage();
  const errors = [];
  page.on("pageerror", (e) => errors.push(String(e)));
  page.on("console", (m) => { if (m.type() === "error") errors.push(m.text()); });
  // Every request the page makes stays on the proxy (no external assets).
  const elsewhere = [];
  page.on("request", (r) => { if (!r.url().startsWith(url)) elsewhere.push(r.url()); });

  const worker = () => page.evaluate(() => {
    const w = document.querySelector('[data-worker="0"]');
    return w && { state: w.dataset.state, restarts: Number(w.dataset.restarts), oom: Number(w.dataset.oomKills),
                  context: Number(w.dataset.context) };
  });
  const events = (kind) => page.evaluate((k) =>
    [...document.querySelectorAll(`#events li[data-event="${k}"]`)].map((li) => li.textContent), kind);
  // Polls `cond` on the page until it holds; the milliseconds it took.
  async function until(what, cond) {
    const t0 = Date.now();
    while (Date.now() - t0 < SHOW_WITHIN_MS) {
      if (await cond()) return Date.now() - t0;
      await sleep(100);
    }
    throw new Error(`${what}: not on the page within ${SHOW_WITHIN_MS} ms; the page has ${JSON.stringify(await worker())}`);
  }

  const res = await page.goto(`${url}/status?refresh=1`);
  await check("GET /status answers 200 with the key given as Basic auth", () => {
    if (res.status() !== 200) throw new Error(`status ${res.status()}`);
  });
  await check("the page draws worker 0 ready at 256 after the OOM kill at start", async () => {
    await until("worker 0 ready at 256", async () => { const w = await worker(); return w && w.state === "ready" && w.context === 256; });
    const w = await worker();
    if (w.oom !== 1) throw new Error(`oom kills ${w.oom}`);
    if ((await events("oom")).length < 1) throw new Error("no oom event in the timeline");
  });
  await check("the page has its four graphs and the model", async () => {
    const n = await page.locator(".chart svg").count();
    if (n !== 4) throw new Error(`${n} graphs`);
    const model = await page.textContent("#model");
    if (!model.includes("stories")) throw new Error(`model: ${model}`);
  });

  // 1. A worker SIGKILLed: a restart at the same context.
  const before = status().workers[0];
  process.kill(before.pid, "SIGKILL");
  const tKill = Date.now();
  await check("SIGKILL of the worker: the page shows the restart", async () => {
    const ms = await until("the restart", async () => {
      const w = await worker();
      return w && w.restarts === before.restarts + 1 && w.state === "ready";
    });
    if ((await events("restart")).length < 1) throw new Error("no restart event in the timeline");
    console.log(`measured: worker SIGKILLed -> the page shows it restarted and ready: ${Date.now() - tKill} ms (${ms} ms of polling)`);
  });

  // 2. An OOM kill forced: 2048 cannot fit workers.memory_max; the worker
  // comes back one rung lower.
  const oomBefore = status().workers[0].oom_kills;
  execFileSync(ds4ctl, ["context", "0", "2048"]);
  const tOom = Date.now();
  await check("forced OOM kill: the page shows it and the step down 2048 -> 256", async () => {
    const ms = await until("the OOM kill and the step down", async () => {
      const w = await worker();
      if (!w || w.oom !== oomBefore + 1 || w.context !== 256) return false;
      return (await events("oom")).some((t) => t.includes("2048 → 256"));
    });
    const up = await events("upgrade");
    if (!up.some((t) => t.includes("256 → 2048"))) throw new Error(`no upgrade 256 -> 2048 in the timeline: ${up}`);
    console.log(`measured: OOM kill forced -> the page shows it and context 256: ${Date.now() - tOom} ms (${ms} ms of polling)`);
  });
  await until("ready again", async () => (await worker())?.state === "ready").catch(() => {});
  await page.screenshot({ path: join(artifacts, "status-desktop.png"), fullPage: true });

  await check("no script errors and nothing fetched from elsewhere", () => {
    if (errors.length) throw new Error(errors.join("; "));
    if (elsewhere.length) throw new Error(elsewhere.join(", "));
  });

  // 3. A phone: 390 px wide, no sideways scroll.
  await page.setViewportSize({ width: 390, height: 844 });
  await page.reload();
  await until("drawn at phone width", async () => (await worker()) !== null);
  await sleep(300);
  await check("at 390 px the page does not scroll sideways", async () => {
    const m = await page.evaluate(() => ({ scroll: document.scrollingElement.scrollWidth,
                                           client: document.scrollingElement.clientWidth }));
    if (m.scroll > m.client) throw new Error(`scrollWidth ${m.scroll} > clientWidth ${m.client}`);
  });
  await page.screenshot({ path: join(artifacts, "status-phone.png"), fullPage: true });
  console.log(`screenshots: ${join(artifacts, "status-desktop.png")}, ${join(artifacts, "status-phone.png")}`);
} catch (e) {
  console.log(`FAIL - the browser run: ${e.stack || e}`);
  failedOut = true;
} finally {
  await context.close();
  rmSync(profile, { recursive: true, force: true });
}
if (failedOut) process.exit(1);
finish();
