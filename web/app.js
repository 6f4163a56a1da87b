// The page: forms, progress and output. The engine itself runs in worker.js.
// Model output is only ever inserted as text (textContent / Text nodes), never as HTML.

const BUILD = "__BUILD_ID__";
const $ = (id) => document.getElementById(id);

const ui = {
  status: $("engine-status"), banner: $("banner"), bannerText: $("banner-text"),
  load: $("load-button"), summary: $("model-summary"), fileInput: $("file-input"), drop: $("drop-zone"),
  url: $("url-input"), progress: $("progress"), progressStage: $("progress-stage"),
  progressDetail: $("progress-detail"), progressBar: $("progress-bar"), cacheList: $("cache-list"),
  cacheClear: $("cache-clear"), form: $("request-form"), generate: $("generate-button"), stop: $("stop-button"),
  output: $("output"), stats: $("stats"), callsBlock: $("calls-block"), calls: $("calls"), problems: $("problems"),
  deviceName: $("device-name"),
};

let worker = null;
let nextId = 1;
const pending = new Map();
let mode = "tools";
let modelLoaded = false;
let busy = false;        // a load or a generation is running
let generating = false;
let droppedFile = null;

// ---------------------------------------------------------------------------- worker plumbing
function startWorker() {
  worker = new Worker(`worker.js?b=${BUILD}`, { type: "module" });
  worker.onmessage = (event) => onWorkerMessage(event.data);
  worker.onerror = (event) => {
    event.preventDefault();
    console.error("worker error:", event.message);
    failAll("The engine stopped unexpectedly; it is restarting.");
    restart();
  };
}

function failAll(message) {
  for (const { resolve } of pending.values()) resolve({ ok: false, error: { kind: "WorkerError", message } });
  pending.clear();
}

let restarts = 0;

function restart() {
  if (worker) worker.terminate();
  modelLoaded = busy = generating = false;
  updateButtons();
  if (++restarts > 2) {  // a worker that cannot even start would otherwise loop forever
    setStatus("error", "Engine failed");
    showError("The engine failed repeatedly and was stopped; reload the page to try again (details in the console).");
    return;
  }
  startWorker();
  boot();
}

function request(type, payload = {}, transfer = []) {
  const id = nextId++;
  return new Promise((resolve) => {
    pending.set(id, { resolve });
    worker.postMessage({ id, type, ...payload }, transfer);
  });
}

function onWorkerMessage(msg) {
  if (msg.type === "reply") {
    const entry = pending.get(msg.id);
    if (entry) {
      pending.delete(msg.id);
      entry.resolve(msg);
    }
  } else if (msg.type === "progress") {
    showProgress(msg);
  } else if (msg.type === "fatal") {
    showError("The Python runtime crashed; the engine is restarting (the model will be loaded again).");
    restart();
  } else if (msg.type === "token") {
    ui.output.append(document.createTextNode(msg.text));
    needle.streamedTokens = msg.count;
    ui.stats.textContent = `${msg.count} token${msg.count === 1 ? "" : "s"}…`;
  }
}

// ---------------------------------------------------------------------------- status and errors
function setStatus(state, text) {
  ui.status.dataset.state = state;
  ui.status.textContent = text;
  document.body.dataset.state = state;
}

function showError(message) {
  ui.bannerText.textContent = message;
  ui.banner.hidden = false;
}

function clearError() {
  ui.banner.hidden = true;
  ui.bannerText.textContent = "";
}

$("banner-close").addEventListener("click", clearError);

function showProgress(msg) {
  ui.progress.hidden = false;
  ui.progressStage.textContent = msg.text || msg.stage;
  let detail = "";
  if (msg.stage === "download" && msg.done != null) {
    detail = msg.total ? `${mb(msg.done)} of ${mb(msg.total)}` : mb(msg.done);
  } else if (msg.stage === "compile" && msg.done) {
    detail = `${msg.done} pipeline${msg.done === 1 ? "" : "s"}`;
  }
  ui.progressDetail.textContent = detail ? ` · ${detail}` : "";
  if (msg.total) {
    ui.progressBar.max = msg.total;
    ui.progressBar.value = Math.min(msg.done || 0, msg.total);
  } else {
    ui.progressBar.removeAttribute("value");  // indeterminate
  }
}

function hideProgress() {
  ui.progress.hidden = true;
}

const mb = (bytes) => `${(bytes / 1e6).toFixed(bytes < 1e7 ? 2 : 1)} MB`;

function updateButtons() {
  ui.generate.disabled = busy || !modelLoaded;
  ui.load.disabled = busy;
  ui.stop.disabled = !generating;
}

// ---------------------------------------------------------------------------- boot and load
async function boot() {
  setStatus("busy", "Starting the engine…");
  const reply = await request("boot");
  if (!reply.ok) {
    setStatus("error", "Engine failed");
    showError(reply.error.message);
    return;
  }
  const { device, bootSeconds, stages } = reply.result;
  needle.bootSeconds = bootSeconds;
  needle.bootStages = stages;
  if (!device.ok) {
    setStatus("error", "No GPU");
    showError(device.error.message);
    hideProgress();
    return;
  }
  ui.deviceName.textContent = device.result.adapter;
  setStatus("ready", `Ready · engine started in ${bootSeconds.toFixed(1)} s`);
  await loadModel({ source: "default" });
  refreshCache();
}

function selectedSource() {
  return document.querySelector('input[name="source"]:checked').value;
}

async function loadModel(spec) {
  clearError();
  busy = true;
  updateButtons();
  setStatus("busy", "Loading the model…");
  const started = performance.now();
  const reply = await request("load", spec);
  needle.lastLoad = reply;
  busy = false;
  hideProgress();
  if (reply.ok) {
    const m = reply.result;
    modelLoaded = true;
    const seconds = (performance.now() - started) / 1000;
    ui.summary.textContent = `${m.name}: ${mb(m.bytes)}, ${m.layers} layers, d=${m.dModel}, vocab ${m.vocab}, ` +
      `context ${m.context}${m.fromCache ? " (from cache)" : ""} · ` +
      `ready in ${seconds.toFixed(1)} s, ${m.pipelines} pipelines`;
    ui.deviceName.textContent = m.device.adapter;
    setStatus("ready", "Ready");
    needle.model = m;
    if (m.cachedNow) refreshCache();
  } else {
    setStatus(modelLoaded ? "ready" : "idle", modelLoaded ? "Ready (previous model)" : "No model loaded");
    showError(reply.error.message);
  }
  updateButtons();
  return reply;
}

ui.load.addEventListener("click", () => {
  const source = selectedSource();
  if (source === "file") {
    const file = droppedFile || ui.fileInput.files[0];
    if (!file) return showError("Choose a .cact file first.");
    return loadModel({ source: "file", file });
  }
  if (source === "url") {
    if (!ui.url.value.trim()) return showError("Enter the URL of a .cact file first.");
    return loadModel({ source: "url", url: ui.url.value.trim() });
  }
  return loadModel({ source: "default" });
});

for (const radio of document.querySelectorAll('input[name="source"]')) {
  radio.addEventListener("change", () => pickSource(selectedSource()));
}

function pickSource(value) {
  document.querySelector(`input[name="source"][value="${value}"]`).checked = true;
  for (const panel of document.querySelectorAll(".source-panel")) panel.hidden = panel.dataset.source !== value;
}

ui.fileInput.addEventListener("change", () => {
  droppedFile = null;
  if (ui.fileInput.files[0] && !busy) loadModel({ source: "file", file: ui.fileInput.files[0] });
});

const modelCard = $("model-card");
modelCard.addEventListener("dragover", (event) => {
  event.preventDefault();
  modelCard.classList.add("dragging");
});
modelCard.addEventListener("dragleave", () => modelCard.classList.remove("dragging"));
modelCard.addEventListener("drop", (event) => {
  event.preventDefault();
  modelCard.classList.remove("dragging");
  const file = event.dataTransfer.files[0];
  if (!file) return;
  droppedFile = file;
  pickSource("file");
  if (!busy) loadModel({ source: "file", file });
});

async function refreshCache() {
  const reply = await request("cache_list");
  ui.cacheList.replaceChildren();
  if (!reply.ok || !reply.result.available) {
    const li = document.createElement("li");
    li.textContent = "The Cache API is not available here (it needs https or localhost).";
    ui.cacheList.append(li);
    ui.cacheClear.disabled = true;
    return;
  }
  for (const entry of reply.result.entries) {
    const li = document.createElement("li");
    li.textContent = `${entry.url}${entry.bytes ? ` (${mb(entry.bytes)})` : ""}`;
    ui.cacheList.append(li);
  }
  if (!reply.result.entries.length) {
    const li = document.createElement("li");
    li.textContent = "Nothing cached yet.";
    ui.cacheList.append(li);
  }
  ui.cacheClear.disabled = !reply.result.entries.length;
}

ui.cacheClear.addEventListener("click", async () => {
  await request("cache_clear");
  refreshCache();
});

// ---------------------------------------------------------------------------- generation
for (const tab of document.querySelectorAll('[role="tab"]')) {
  tab.addEventListener("click", () => {
    mode = tab.dataset.mode;
    for (const t of document.querySelectorAll('[role="tab"]')) t.setAttribute("aria-selected", String(t === tab));
    for (const panel of document.querySelectorAll(".mode-panel")) panel.hidden = panel.dataset.mode !== mode;
  });
}

function readRequest() {
  const value = (id) => $(id).value;
  const base = {
    mode, temperature: value("temperature"), top_k: value("top-k"), top_p: value("top-p"),
    max_tokens: value("max-tokens"), seed: value("seed"),
  };
  return mode === "tools" ? { ...base, tools: value("tools-input"), query: value("query-input") }
                          : { ...base, prompt: value("prompt-input") };
}

function formatStats(r) {
  const parts = [];
  if (r.timeToFirstTokenSeconds != null) parts.push(`first token ${(r.timeToFirstTokenSeconds * 1000).toFixed(0)} ms`);
  if (r.decodeTokensPerSecond != null) parts.push(`${r.decodeTokensPerSecond.toFixed(1)} tokens/s`);
  parts.push(`${r.tokens} token${r.tokens === 1 ? "" : "s"}`);
  parts.push(`prompt ${r.promptTokens}`);
  parts.push(`finish: ${r.finishReason}`);
  if (r.tokens && !r.text.trim()) parts.push("the output is only whitespace");
  const s = r.settings;
  parts.push(`T=${s.temperature} k=${s.top_k} p=${s.top_p} seed=${s.seed} max=${s.max_tokens}`);
  return parts.join(" · ");
}

async function generate() {
  if (busy || !modelLoaded) return;
  clearError();
  busy = generating = true;
  updateButtons();
  setStatus("busy", "Generating…");
  ui.output.replaceChildren();
  needle.streamedTokens = 0;
  ui.stats.textContent = "Prefilling the prompt…";
  ui.callsBlock.hidden = true;
  const reply = await request("generate", { request: readRequest() });
  busy = generating = false;
  hideProgress();
  needle.lastResult = reply;
  if (reply.ok) {
    const r = reply.result;
    ui.output.textContent = r.text;
    ui.stats.textContent = formatStats(r);
    if (r.completion) showCompletion(r.completion);
    setStatus("ready", "Ready");
  } else {
    ui.stats.textContent = "";
    showError(reply.error.message);
    setStatus("ready", reply.error.kind === "DeviceLostError" ? "GPU lost · will recover" : "Ready");
  }
  updateButtons();
  return reply;
}

function showCompletion(c) {
  ui.callsBlock.hidden = false;
  ui.calls.textContent = c.toolCalls === null ? "(no tool call could be read)" :
    c.abstained ? "[]  (the model chose not to call a tool)" : JSON.stringify(c.toolCalls, null, 2);
  ui.problems.replaceChildren();
  for (const problem of c.problems) {
    const li = document.createElement("li");
    li.textContent = problem;
    ui.problems.append(li);
  }
}

ui.form.addEventListener("submit", (event) => {
  event.preventDefault();
  generate();
});
ui.stop.addEventListener("click", () => worker.postMessage({ type: "stop" }));

// ---------------------------------------------------------------------------- start
// For the browser tests and the console: the request channel and the last results.
const needle = { request, generate, loadModel, bootSeconds: null, model: null, lastResult: null, lastLoad: null,
                 streamedTokens: 0 };
window.needle = needle;

if (!navigator.gpu) {
  setStatus("error", "No WebGPU");
  showError("This browser has no WebGPU, which the engine needs. Use a recent Chrome or Edge on a desktop or Android " +
            "(on Linux, WebGPU may have to be enabled in chrome://flags).");
} else {
  startWorker();
  needle.ready = boot();
}
updateButtons();
