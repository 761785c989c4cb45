// The check lines of the client tests: "ok   - NAME" or "FAIL - NAME: why",
// counted; finish() exits 1 when any failed.
let failures = 0;
export async function check(name, fn) {
  try {
    await fn();
    console.log(`ok   - ${name}`);
  } catch (e) {
    failures++;
    console.log(`FAIL - ${name}: ${e.stack || e}`);
  }
}
export function finish() {
  if (failures) console.log(`${failures} failed`);
  process.exit(failures ? 1 : 0);
}
