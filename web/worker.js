// The engine's thread: Pyodide, the needle_wgpu wheel and WebGPU, all inside this module worker.
//
// Protocol (see app.js): the page posts {id, type, ...}; the worker answers each with
// {id, type: "reply", ok, result | error}, and meanwhile posts events without an id:
// {type: "progress", stage, text, done, total}, {type: "token", id, text, count}, and {type: "fatal"}
// when the Python runtime died (the page then starts a new worker).
// Requests run one at a time, in order; "stop" is handled at once (it sets a flag that Python
// reads between tokens, which it can do because every token waits on the GPU through JSPI).
// Every Python entry point returns a JSON string and never raises (needle_worker.py); anything
// that still escapes is caught here and reported, so the worker keeps serving requests.

import { loadPyodide } from "./pyodide/pyodide.mjs";
import { readWithProgress } from "./download.js?b=__BUILD_ID__";

const BUILD = "__BUILD_ID__";
const CACHE_NAME = "needle-wgpu-models-v1";

let pyodide = null;
let manifest = null;    // build.json: wheel path, bundled models, versions
let glue = null;        // the needle_worker Python module
let bootError = null;
const queue = [];
let running = false;

globalThis.needleStopRequested = false;

function post(message, transfer) {
  self.postMessage(message, transfer || []);
}

function progress(stage, text, done = null, total = null) {
  post({ type: "progress", stage, text, done, total });
}

// Called from Python with a JSON string (tokens, progress, notes).
globalThis.needleEmit = (json) => post(JSON.parse(json));
// Python waits on this between prefill chunks: a macrotask turn, so a "stop" message is read.
globalThis.needleYield = () => new Promise((resolve) => setTimeout(resolve, 0));

async function boot() {
  const started = performance.now();
  const stages = {};
  const lap = (name, since) => {
    stages[name] = Math.round(performance.now() - since) / 1000;
    return performance.now();
  };
  progress("boot", "Loading the build manifest");
  manifest = await (await fetch(new URL(`build.json?b=${BUILD}`, import.meta.url), { cache: "no-store" })).json();
  progress("boot", `Starting Python (Pyodide ${manifest.pyodide})`);
  let at = performance.now();
  pyodide = await loadPyodide({
    indexURL: new URL("./pyodide/", import.meta.url).href,
    stdout: (line) => console.log(`[python] ${line}`),
    stderr: (line) => console.warn(`[python] ${line}`),
  });
  at = lap("pyodide", at);
  progress("boot", "Installing needle_wgpu");
  // jinja2 and MarkupSafe (a model's own chat template) first, then the engine: all from this
  // site, never a CDN. Without the template wheels the engine renders its built-in ChatML.
  const installed = () => Object.keys(pyodide.loadedPackages).map((name) => name.toLowerCase().replace(/[-_]/g, ""));
  const depProblems = [];
  const deps = (manifest.deps || []).map((path) => new URL(path, import.meta.url).href);
  if (deps.length) {
    await pyodide.loadPackage(deps, { errorCallback: (m) => depProblems.push(m), messageCallback: () => {} });
  }
  for (const path of manifest.deps || []) {
    const name = path.split("/").pop().split("-")[0].toLowerCase().replace(/[-_]/g, "");
    if (!installed().includes(name)) console.warn(`needle worker: ${path} did not install: ${depProblems.join("; ")}`);
  }
  const wheelURL = new URL(manifest.wheel, import.meta.url).href;
  const problems = [];
  await pyodide.loadPackage(wheelURL, { errorCallback: (m) => problems.push(m), messageCallback: () => {} });
  if (!installed().includes("needlewgpu")) {
    throw new Error(`could not install ${manifest.wheel}: ${problems.join("; ") || "unknown error"}`);
  }
  const glueSource = await (await fetch(new URL(`${manifest.glue}?b=${BUILD}`, import.meta.url))).text();
  pyodide.FS.writeFile("/home/pyodide/needle_worker.py", glueSource);
  glue = pyodide.pyimport("needle_worker");
  at = lap("wheel", at);
  progress("boot", "Opening the GPU");
  const device = JSON.parse(await glue.open_device.callPromising());
  lap("device", at);
  const seconds = (performance.now() - started) / 1000;
  return { bootSeconds: seconds, stages, manifest, device };
}

// ---------------------------------------------------------------------------- model bytes
async function fetchWithProgress(url, label) {
  const response = await fetch(url);
  if (!response.ok) throw new UserError(`${url}: download failed: HTTP ${response.status} ${response.statusText}`.trim());
  const { parts, received } = await readWithProgress(response, label,
    (text, done, total) => progress("download", text, done, total));
  const bytes = new Uint8Array(received);
  let at = 0;
  for (const part of parts) { bytes.set(part, at); at += part.byteLength; }
  return bytes;
}

async function cacheOpen() {
  return typeof caches === "undefined" ? null : caches.open(CACHE_NAME);
}

async function modelBytes(msg) {
  if (msg.source === "file") {
    if (!msg.file) throw new UserError("no file was given");
    progress("download", `Reading ${msg.file.name}`, 0, msg.file.size);
    let buffer;
    try {
      buffer = await msg.file.arrayBuffer();
    } catch (error) {
      throw new UserError(`${msg.file.name}: the browser could not read the file (${error.message})`);
    }
    return { bytes: new Uint8Array(buffer), name: msg.file.name, cacheKey: null, cached: false };
  }
  if (msg.source === "url" || msg.source === "default") {
    let url;
    if (msg.source === "default") {
      // A bundled model (the first of build.json unless the page names one): cached like a URL.
      const entry = manifest.models.find((m) => m.file === msg.file) || manifest.models[0];
      url = new URL(`${entry.file}?sha256=${entry.sha256}`, import.meta.url);  // a new file, a new cache entry
    } else {
      try {
        url = new URL(String(msg.url || "").trim(), self.location.href);
      } catch {
        throw new UserError(`not a valid URL: ${String(msg.url).slice(0, 200)}`);
      }
    }
    if (!/^https?:$/.test(url.protocol)) throw new UserError(`${url.href}: only http(s) URLs can be loaded, not ${url.protocol}`);
    const name = decodeURIComponent(url.pathname.split("/").pop() || url.host);
    const cache = await cacheOpen();
    const hit = cache ? await cache.match(url.href) : null;
    if (hit) {
      progress("download", `Reading ${name} from the browser cache`);
      return { bytes: new Uint8Array(await hit.arrayBuffer()), name, cacheKey: null, cached: true };
    }
    let bytes;
    try {
      bytes = await fetchWithProgress(url.href, name);
    } catch (error) {
      if (error instanceof UserError) throw error;
      throw new UserError(`${url.href}: download failed (${error.message}): the host could not be reached, ` +
        "or its server does not allow cross-origin requests (CORS); the browser does not say which");
    }
    return { bytes, name, cacheKey: url.href, cached: false };
  }
  throw new UserError(`unknown model source ${String(msg.source).slice(0, 40)}`);
}

class UserError extends Error {}

// ---------------------------------------------------------------------------- requests
async function callPython(name, ...args) {
  return JSON.parse(await glue[name].callPromising(...args));
}

const handlers = {
  async load(msg) {
    const model = await modelBytes(msg);
    const result = await callPython("load_model", model.bytes, model.name);
    if (result.ok && model.cacheKey) {
      const cache = await cacheOpen();
      if (cache) {
        await cache.put(model.cacheKey, new Response(model.bytes, {
          headers: { "content-type": "application/octet-stream", "content-length": String(model.bytes.byteLength) },
        }));
        result.result.cachedNow = true;
      }
    }
    if (result.ok) result.result.fromCache = model.cached;
    return result;
  },
  async generate(msg) {
    globalThis.needleStopRequested = false;
    return callPython("generate", JSON.stringify(msg.request || {}));
  },
  async render_chat(msg) {
    return callPython("render_chat", JSON.stringify({ messages: msg.messages || [] }));
  },
  async logits(msg) {
    const result = await callPython("logits", JSON.stringify(msg.ids || []));
    return result;
  },
  async cq_matmul(msg) {
    const synthetic = manifest.models.find((m) => m.synthetic);  // the bundled .cact
    const model = await modelBytes({ source: "default", file: synthetic.file });
    return callPython("cq_matmul", model.bytes, msg.tensor, Float32Array.from(msg.x), msg.positions);
  },
  async bench(msg) {
    return callPython("bench", msg.prompt || 16, msg.decode || 8);
  },
  async sampling_settings(msg) {
    return callPython("sampling_settings", JSON.stringify(msg.request || {}), msg.vocab || 1, msg.context || 0);
  },
  async gguf_layout(msg) {
    return callPython("gguf_layout", msg.head, msg.size);
  },
  async unload_model() {
    return callPython("unload_model");
  },
  async chat_reset() {
    return callPython("chat_reset");
  },
  async lose_device() {
    return callPython("lose_device");
  },
  async info() {
    return callPython("info");
  },
  async cache_list() {
    const cache = await cacheOpen();
    if (!cache) return { ok: true, result: { available: false, entries: [] } };
    const entries = [];
    for (const request of await cache.keys()) {
      const response = await cache.match(request);
      entries.push({ url: request.url, bytes: Number(response.headers.get("content-length")) || null });
    }
    return { ok: true, result: { available: true, entries } };
  },
  async cache_clear() {
    const available = typeof caches !== "undefined";
    if (available) await caches.delete(CACHE_NAME);
    return { ok: true, result: { available, cleared: available } };
  },
};

async function handle(msg) {
  if (msg.type === "boot") {
    try {
      return { ok: true, result: await booting };
    } catch {
      return { ok: false, error: { kind: "BootError", message: bootError } };
    }
  }
  if (!glue) {
    await booting.catch(() => {});
    if (!glue) return { ok: false, error: { kind: "BootError", message: bootError || "the engine failed to start" } };
  }
  const handler = Object.hasOwn(handlers, msg.type) ? handlers[msg.type] : null;
  if (!handler) return { ok: false, error: { kind: "InputError", message: `unknown request type ${msg.type}` } };
  return handler(msg);
}

async function drain() {
  if (running) return;
  running = true;
  while (queue.length) {
    const msg = queue.shift();
    let reply;
    try {
      reply = await handle(msg);
    } catch (error) {
      if (error instanceof UserError) {
        reply = { ok: false, error: { kind: "InputError", message: error.message } };
      } else if (/fatal(ly)? (error|failed)/i.test(String(error && error.message))) {
        // The Python runtime cannot be used again: answer, then ask the page for a new worker.
        console.error("needle worker: Pyodide failed fatally:", error);
        const message = "The Python runtime crashed; the engine is restarting.";
        post({ id: msg.id, type: "reply", ok: false, error: { kind: "FatalError", message } });
        post({ type: "fatal" });
        queue.length = 0;
        continue;
      } else {
        console.error("needle worker:", error);
        const message = `internal error in the worker (${(error && error.name) || "Error"}); ` +
          "details are in the browser console";
        reply = { ok: false, error: { kind: "InternalError", message } };
      }
    }
    post({ id: msg.id, type: "reply", ...reply });
  }
  running = false;
}

self.onmessage = (event) => {
  const msg = event.data || {};
  if (msg.type === "stop") {
    globalThis.needleStopRequested = true;
    post({ type: "stopping" });
    return;
  }
  queue.push(msg);
  drain();
};

const booting = boot().catch((error) => {
  bootError = `the engine failed to start: ${error && error.message ? error.message : error}`;
  console.error("needle worker boot:", error);
  throw new Error(bootError);
});
booting.catch(() => {});
