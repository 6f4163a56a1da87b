// A response body read in parts with progress reports, shared by the engine's worker (worker.js)
// and the CPU engine (cpu_engine.js): report(text, received, total) about every 100 ms while it
// downloads, then once at the end. Returns the parts (Uint8Arrays, in order) and their length.
export async function readWithProgress(response, label, report) {
  const total = Number(response.headers.get("content-length")) || null;
  if (!response.body) {
    const whole = new Uint8Array(await response.arrayBuffer());
    report(`Downloaded ${label}`, whole.byteLength, whole.byteLength);
    return { parts: [whole], received: whole.byteLength };
  }
  const reader = response.body.getReader();
  const parts = [];
  let received = 0;
  let last = 0;
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    parts.push(value);
    received += value.byteLength;
    if (performance.now() - last > 100) {
      last = performance.now();
      report(`Downloading ${label}`, received, total);
    }
  }
  report(`Downloaded ${label}`, received, total || received);
  return { parts, received };
}
