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
  deviceName: $("device-name"), bundled: $("bundled-select"), bundledNote: $("bundled-note"),
  modelError: $("model-error"), modelQueued: $("model-queued"), modelNote: $("model-note"),
  requestError: $("request-error"), requestNotice: $("request-notice"), runState: $("run-state"),
  chatLog: $("chat-log"), chatInput: $("chat-input"), chatReset: $("chat-reset"), chatSystem: $("chat-system"),
  chatStats: $("chat-stats"), constrained: $("constrained"), confidence: $("confidence"),
  advanced: $("advanced-sampling"), logitBias: $("logit-bias"), logitBiasError: $("logit-bias-error"),
  logitBiasNote: $("logit-bias-note"), engineNotice: $("engine-notice"), engineNoticeText: $("engine-notice-text"),
  engineSwitch: $("engine-switch"), requestWait: $("request-wait"),
};

let worker = null;
let nextId = 1;
const pending = new Map();
let mode = "tools";
let modelLoaded = false;
// One thing at a time: "booting", "loading", "generating" or "idle". Buttons follow it
// (updateButtons); a model picked while busy waits in queuedLoad and loads afterwards.
let phase = "booting";
let stopping = false;
let queuedLoad = null;
let droppedFile = null;
let pickedFile = null;   // the picker's last file (its input is cleared so the same file can be picked again)
let manifest = null;
let chatHistory = [];    // [{role, content}] of the conversation shown in the chat log
let chatId = 1;          // the worker keeps one conversation (and its KV cache) per chat id
// Which engine runs the model: "webgpu" (the worker: Pyodide + WGSL) or "cpu" (llama.cpp in
// WebAssembly through wllama, cpu_engine.js; GGUF files only). WebGPU is the default where there
// is a usable adapter; a software adapter gets a notice that offers the CPU engine.
let engine = "webgpu";
let cpu = null;          // the CpuEngine, made on first use
let gpuUsable = false;   // a WebGPU device opened
let lastSpec = null;     // the model the page loaded last (an engine switch loads it again)
let offerCpu = false;    // a software adapter: the notice's button offers the CPU engine
const busy = () => phase !== "idle";

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
  modelLoaded = false;
  phase = "booting";
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
  if (type === "load") needle.loadRequests += 1;
  if (type === "generate") needle.generateRequests += 1;
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
  } else if (msg.type === "stopping") {
    if (phase === "generating") ui.runState.textContent = "Stopping…";
  } else if (msg.type === "fatal") {
    showError("The Python runtime crashed; the engine is restarting (the model will be loaded again).");
    restart();
  } else if (msg.type === "token") {
    if (streamTarget) delete streamTarget.dataset.progress;
    (streamTarget || ui.output).append(document.createTextNode(msg.text));
    needle.streamedTokens = msg.count;
    if (!stopping) ui.runState.textContent = "Generating…";
    ui.stats.textContent = `${msg.count} token${msg.count === 1 ? "" : "s"}…`;
  }
}

let streamTarget = null;  // where streamed tokens go: the output, or the chat's assistant bubble

// ---------------------------------------------------------------------------- status and errors
function setStatus(state, text) {
  ui.status.dataset.state = state;
  ui.status.textContent = text;
  document.body.dataset.state = state;
}

// An error is shown next to the control that caused it ("model": the model card, "request":
// the request form), scrolled into view, so that on a phone it is not off-screen; errors of the
// engine itself go to the banner at the top.
function showError(message, where = null) {
  const target = where === "model" ? ui.modelError : where === "request" ? ui.requestError :
    where === "logit-bias" ? ui.logitBiasError : null;
  if (!target) {
    ui.bannerText.textContent = message;
    ui.banner.hidden = false;
    ui.banner.scrollIntoView({ block: "nearest" });
    return;
  }
  target.textContent = message;
  target.hidden = false;
  target.scrollIntoView({ block: "nearest" });
}

function clearError() {
  ui.banner.hidden = true;
  ui.bannerText.textContent = "";
  for (const el of [ui.modelError, ui.requestError, ui.logitBiasError]) {
    el.hidden = true;
    el.textContent = "";
  }
}

// The text of every visible error (tests read it).
function errorText() {
  return [ui.banner, ui.modelError, ui.requestError, ui.logitBiasError].filter((el) => !el.hidden)
    .map((el) => el.textContent.replace(/×$/, "").trim()).join(" | ");
}

$("banner-close").addEventListener("click", clearError);

function showProgress(msg) {
  const entry = { stage: msg.stage, text: msg.text, done: msg.done, total: msg.total, phase, shown: "",
                  at: performance.now() };
  needle.progressLog.push(entry);
  if (needle.onProgress) needle.onProgress(msg);
  if (phase === "idle") return;  // a test hook's request (logits, bench): nothing of the page's is running
  if (msg.stage === "prefill" || (phase === "generating" && msg.stage === "compile")) {
    // Progress of a request shows next to the request, not in the model card.
    const text = msg.stage === "compile" ? "Compiling GPU pipelines for this request…" : `${msg.text}…`;
    if (!stopping) ui.runState.textContent = text;
    // In a chat the pending reply's bubble says it too: on a phone it is what is on screen.
    if (streamTarget && streamTarget !== ui.output && !streamTarget.textContent) {
      streamTarget.dataset.progress = stopping ? "Stopping…" : text;
      streamTarget.scrollIntoView({ block: "nearest" });
    }
    entry.shown = ui.runState.textContent;
    return;
  }
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
  entry.shown = ui.progressStage.textContent;
}

function hideProgress() {
  ui.progress.hidden = true;
}

const mb = (bytes) => `${(bytes / 1e6).toFixed(bytes < 1e7 ? 2 : 1)} MB`;

function updateButtons() {
  ui.generate.disabled = busy() || !modelLoaded;
  ui.load.disabled = busy();
  ui.stop.disabled = phase !== "generating" || stopping;
  ui.chatReset.disabled = phase === "generating";
  ui.generate.textContent = mode === "chat" ? "Send" : "Generate";
  for (const radio of document.querySelectorAll('input[name="engine"]')) {
    radio.checked = radio.value === engine;
    radio.disabled = busy() || (radio.value === "webgpu" && !gpuUsable);
  }
  ui.engineSwitch.disabled = busy();
  ui.engineSwitch.hidden = !offerCpu || engine === "cpu";
  // The request form appears with a model; until then a note says why it is not there.
  ui.form.hidden = !modelLoaded;
  ui.requestWait.hidden = modelLoaded;
  ui.requestWait.textContent = phase === "booting" ? "The request form appears once a model is loaded (the engine is starting)." :
    phase === "loading" ? "The request form appears once the model is loaded." :
    "Load a model (above) to send requests.";
}

// ---------------------------------------------------------------------------- boot and load
function bundledEntry(file) {
  return manifest && manifest.models.find((m) => m.file === file || m.file.split("/").pop() === file);
}

function fillBundled() {
  ui.bundled.replaceChildren();
  for (const m of manifest.models) {
    const option = document.createElement("option");
    option.value = m.file;
    option.textContent = `${m.name}, ${mb(m.bytes)}`;
    ui.bundled.append(option);
  }
  const wanted = bundledEntry(new URLSearchParams(location.search).get("model") || "");
  if (wanted) ui.bundled.value = wanted.file;
  describeBundled();
}

function describeBundled() {
  // On the CPU engine the Needle 3 files are not choices (they run on WebGPU only).
  for (const option of ui.bundled.options) {
    const cact = option.value.endsWith(".cact");
    option.disabled = engine === "cpu" && cact;
    option.textContent = option.textContent.replace(/ \(WebGPU only\)$/, "") + (option.disabled ? " (WebGPU only)" : "");
  }
  const m = bundledEntry(ui.bundled.value);
  ui.bundledNote.textContent = !m ? "" : m.synthetic ?
    "A tiny Needle 3 with random weights: it shows the engine working, and its output is random text." :
    "A real instruction-tuned model: chat with it. The first visit downloads it once; the browser keeps it in its cache.";
}

ui.bundled.addEventListener("change", describeBundled);

async function boot() {
  phase = "booting";
  updateButtons();
  setStatus("busy", "Starting the engine…");
  const reply = await request("boot");
  if (!reply.ok) {
    phase = "idle";
    setStatus("error", "Engine failed");
    showError(reply.error.message);
    updateButtons();
    return;
  }
  const { device, bootSeconds, stages } = reply.result;
  manifest = reply.result.manifest;
  fillBundled();
  needle.bootSeconds = bootSeconds;
  needle.bootStages = stages;
  gpuUsable = Boolean(navigator.gpu) && device.ok;
  needle.adapter = device.ok ? device.result : null;
  phase = "idle";
  hideProgress();
  if (gpuUsable) {
    ui.deviceName.textContent = device.result.adapter;
    setStatus("ready", `Ready · engine started in ${bootSeconds.toFixed(1)} s`);
  }
  const wanted = new URLSearchParams(location.search).get("engine");
  engine = !gpuUsable || wanted === "cpu" || engine === "cpu" ? "cpu" : "webgpu";
  showEngineNotice(device);
  // A model picked while the engine was starting wins over the bundled one.
  let first = queuedLoad || { source: "default", file: ui.bundled.value };
  queuedLoad = null;
  if (engine === "cpu") first = cpuSpec(first);
  if (!first) {  // no WebGPU and no bundled GGUF: nothing can run
    setStatus("error", "No engine");
    updateButtons();
    return;
  }
  await loadModel(first);
  refreshCache();
}

// What the visitor should know about the engines here: a software adapter is slow (the CPU
// engine is offered); without WebGPU, GGUF models run on the CPU engine.
function showEngineNotice(device) {
  let text = "";
  if (!navigator.gpu) {
    text = "This browser has no WebGPU: GGUF models run on the CPU engine (llama.cpp in WebAssembly); Needle 3 " +
      "(.cact) files need WebGPU (a recent Chrome or Edge on a desktop or Android; on Linux it may have to be " +
      "enabled in chrome://flags).";
  } else if (!device.ok) {
    text = `WebGPU cannot be used here (${device.error.message}): GGUF models run on the CPU engine ` +
      "(llama.cpp in WebAssembly); Needle 3 (.cact) files need WebGPU.";
  } else if (device.result.softwareRasterizer) {
    text = `Software adapter: expect ~1 tok/s from the default model on WebGPU here (${device.result.adapter} draws on ` +
      "the CPU). The CPU engine (llama.cpp in WebAssembly) runs GGUF models about ten times faster on such a machine.";
  }
  ui.engineNoticeText.textContent = text;
  ui.engineNotice.hidden = !text;
  offerCpu = gpuUsable && device.result.softwareRasterizer;
  needle.engineNotice = text;
  describeBundled();
  updateButtons();
}

// The model spec to load on the CPU engine: a bundled Needle 3 file becomes the first bundled
// GGUF (null when none is bundled); other specs as they are (the engine refuses what is not GGUF).
function cpuSpec(spec) {
  if (spec.source !== "default" || !spec.file.endsWith(".cact")) return spec;
  const gguf = manifest.models.find((m) => m.file.endsWith(".gguf"));
  if (!gguf) {
    showError("The CPU engine runs GGUF files and this page bundles none: load a .gguf file or URL.", "model");
    return null;
  }
  ui.bundled.value = gguf.file;
  describeBundled();
  return { source: "default", file: gguf.file };
}

async function cpuEngine() {
  if (!cpu) {
    const { CpuEngine } = await import(`./cpu_engine.js?b=${BUILD}`);
    cpu = new CpuEngine(manifest, onWorkerMessage, (head, size) => request("gguf_layout", { head, size }));
  }
  return cpu;
}

// The engine radio or the notice's button: the current model is loaded again on the other engine
// (the engine left frees its model: GPU buffers or the WebAssembly heap).
async function switchEngine(value) {
  if (busy() || value === engine || (value === "webgpu" && !gpuUsable)) return updateButtons();
  engine = value;
  describeBundled();
  updateButtons();
  let spec = lastSpec || { source: "default", file: ui.bundled.value };
  if (value === "cpu") {
    spec = cpuSpec(spec);
    if (modelLoaded) request("unload_model");  // queued before the load; frees the GPU memory now
  } else if (cpu) {
    await cpu.unload();
  }
  modelLoaded = false;
  needle.model = null;
  updateButtons();
  return spec ? loadModel(spec) : null;
}

for (const radio of document.querySelectorAll('input[name="engine"]')) {
  radio.addEventListener("change", () => switchEngine(radio.value));
}
ui.engineSwitch.addEventListener("click", () => switchEngine("cpu"));

function selectedSource() {
  return document.querySelector('input[name="source"]:checked').value;
}

function describeSpec(spec) {
  return spec.source === "file" ? spec.file.name : spec.source === "url" ? spec.url :
    (bundledEntry(spec.file) || { name: "the bundled model" }).name;
}

async function loadModel(spec) {
  if (busy()) {
    // Never ignored, never run twice: the latest pick waits for the current work.
    queuedLoad = spec;
    ui.modelQueued.textContent = `${describeSpec(spec)} will be loaded when the ${phase === "booting" ?
      "engine has started" : phase === "generating" ? "current generation ends" : "current load ends"}.`;
    ui.modelQueued.hidden = false;
    return { ok: false, queued: true };
  }
  clearError();
  ui.modelQueued.hidden = true;
  phase = "loading";
  updateButtons();
  setStatus("busy", `Loading ${describeSpec(spec)}…`);
  const started = performance.now();
  let reply;
  if (engine === "cpu") {
    needle.loadRequests += 1;
    reply = await cpuEngine().then((cpuEngine) => cpuEngine.load(spec), (error) => {
      console.error("cpu engine:", error);
      return { ok: false, error: { kind: "CpuEngineError", message: `the CPU engine could not start (${error.message})` } };
    });
  } else {
    reply = await request("load", spec);
  }
  needle.lastLoad = reply;
  phase = "idle";
  hideProgress();
  if (reply.ok) {
    const m = reply.result;
    m.engine = m.engine || "webgpu";
    modelLoaded = true;
    lastSpec = spec;
    const seconds = (performance.now() - started) / 1000;
    ui.summary.textContent = `${m.name}: ${mb(m.bytes)}, ${m.layers} layers, d=${m.dModel}, vocab ${m.vocab}, ` +
      `context ${m.context}${m.fromCache ? " (from cache)" : ""} · ` +
      (m.engine === "cpu" ? `ready in ${seconds.toFixed(1)} s on the CPU engine · chat template: the file's own` :
        `ready in ${seconds.toFixed(1)} s, ${m.pipelines} pipelines` + describeTemplate(m.chatTemplate));
    ui.deviceName.textContent = m.device.adapter;
    setStatus("ready", "Ready");
    const entry = spec.source === "default" ? bundledEntry(spec.file) : null;
    m.synthetic = Boolean((entry && entry.synthetic) || m.synthetic);
    needle.model = m;
    ui.output.replaceChildren();  // the previous model's output and stats are not this one's
    delete ui.output.dataset.cut;
    ui.stats.textContent = "";
    ui.callsBlock.hidden = true;
    ui.requestNotice.hidden = true;
    showModelNote(m);
    chooseModes(m);
    if (m.cachedNow) refreshCache();
  } else {
    setStatus(modelLoaded ? "ready" : "idle", modelLoaded ? "Ready (previous model)" : "No model loaded");
    if (!modelLoaded) ui.summary.textContent = "";
    showError(reply.error.message, "model");
  }
  updateButtons();
  await runQueued();
  return reply;
}

function describeTemplate(t) {
  if (!t) return "";
  return t.kind === "jinja" ? " · chat template: the file's own (if it fails on a conversation, the turn says so " +
    "and uses built-in ChatML)" : ` · chat template: built-in ChatML (${t.note})`;
}

async function runQueued() {
  if (queuedLoad && !busy()) {
    const spec = queuedLoad;
    queuedLoad = null;
    await loadModel(spec);
  }
}

function showModelNote(m) {
  ui.modelNote.hidden = !m.synthetic;
  ui.modelNote.textContent = m.synthetic ? "This model is synthetic (random weights): its output is random text. " +
    "It is here to show the engine working; load SmolLM2 or your own .gguf for real answers." : "";
}

// Chat for models with a chat template (GGUF), the tool-calling form for Needle 3, a free
// prompt for both.
function chooseModes(m) {
  const dense = m.family === "dense";
  $("tab-chat").hidden = !dense;
  $("tab-tools").hidden = dense;
  // A new model opens on its own form (chat or tool call); a reload of the same one keeps the form.
  const fresh = needle.chatModel !== m.name;
  if (fresh || (dense && mode === "tools") || (!dense && mode === "chat")) selectMode(dense ? "chat" : "tools");
  if (fresh) resetChat();
  needle.chatModel = m.name;
}

function loadFromControls() {
  const source = selectedSource();
  if (source === "file") {
    const file = droppedFile || pickedFile;
    if (!file) return showError("Choose a .gguf or .cact file first.", "model");
    return loadModel({ source: "file", file });
  }
  if (source === "url") {
    if (!ui.url.value.trim()) return showError("Enter the URL of a .gguf or .cact file first.", "model");
    return loadModel({ source: "url", url: ui.url.value.trim() });
  }
  return loadModel({ source: "default", file: ui.bundled.value });
}

ui.load.addEventListener("click", () => {
  if (!busy()) loadFromControls();  // the button is disabled while busy; this guards a stale click
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
  const file = ui.fileInput.files[0];
  if (!file) return;
  pickedFile = file;
  loadModel({ source: "file", file });
  ui.fileInput.value = "";  // picking the same file again is a change too (a reload)
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
  loadModel({ source: "file", file });
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
function selectMode(value) {
  mode = value;
  for (const t of document.querySelectorAll('[role="tab"]')) {
    t.setAttribute("aria-selected", String(t.dataset.mode === mode));
    t.tabIndex = t.dataset.mode === mode ? 0 : -1;
  }
  for (const panel of document.querySelectorAll(".mode-panel")) panel.hidden = panel.dataset.mode !== mode;
  ui.output.hidden = mode === "chat";
  updateButtons();
}

for (const tab of document.querySelectorAll('[role="tab"]')) {
  tab.addEventListener("click", () => selectMode(tab.dataset.mode));
  // The tab list as ARIA describes it: arrows (and Home/End) move between the visible tabs.
  tab.addEventListener("keydown", (event) => {
    const tabs = [...document.querySelectorAll('[role="tab"]')].filter((t) => !t.hidden);
    const at = tabs.indexOf(tab);
    const to = { ArrowRight: at + 1, ArrowLeft: at - 1, Home: 0, End: tabs.length - 1 }[event.key];
    if (to === undefined) return;
    event.preventDefault();
    const next = tabs[(to + tabs.length) % tabs.length];
    selectMode(next.dataset.mode);
    next.focus();
  });
}

// The logit-bias field as the engine takes it: empty -> null (no bias), a JSON object -> that
// object (the engine saturates its keys and values); anything else -> {error} in words.
function readLogitBias() {
  const text = ui.logitBias.value.trim();
  if (!text) return { bias: null };
  let value;
  try {
    value = JSON.parse(text);
  } catch (error) {
    return { error: `Logit bias is not valid JSON (${error.message}). Write an object of token ids and ` +
                    'biases, e.g. {"42": -100}, or leave the field empty.' };
  }
  if (value === null || typeof value !== "object" || Array.isArray(value)) {
    const what = value === null ? "null" : Array.isArray(value) ? "an array" : `a ${typeof value}`;
    return { error: `Logit bias must be a JSON object of token ids and biases, e.g. {"42": -100}; ` +
                    `this is ${what}.` };
  }
  return { bias: value };
}

function readRequest(logitBias) {
  const value = (id) => $(id).value;
  const base = {
    mode, temperature: value("temperature"), top_k: value("top-k"), top_p: value("top-p"),
    max_tokens: value("max-tokens"), seed: value("seed"),
    min_p: value("min-p"), repetition_penalty: value("repetition-penalty"),
    presence_penalty: value("presence-penalty"), frequency_penalty: value("frequency-penalty"),
    penalty_last_n: value("penalty-last-n"), logit_bias: logitBias,
  };
  if (mode === "chat") {
    return { ...base, chat: chatId, system: ui.chatSystem.value,
             messages: [...chatHistory, { role: "user", content: ui.chatInput.value }] };
  }
  return mode === "tools" ? { ...base, tools: value("tools-input"), query: value("query-input"),
                              constrained: ui.constrained.checked }
                          : { ...base, prompt: value("prompt-input") };
}

function formatStats(r) {
  const parts = [];
  if (r.timeToFirstTokenSeconds != null) parts.push(`first token ${(r.timeToFirstTokenSeconds * 1000).toFixed(0)} ms`);
  if (r.decodeTokensPerSecond != null) parts.push(`${r.decodeTokensPerSecond.toFixed(1)} tokens/s`);
  parts.push(`${r.tokens} token${r.tokens === 1 ? "" : "s"}`);
  parts.push(`prompt ${r.promptTokens}`);
  if (r.turn) parts.push(`prefilled ${r.turn.prefilled}, reused ${r.turn.reused}`);
  parts.push(`context ${r.contextUsed} / ${r.context}`);
  parts.push(`finish: ${r.finishReason}`);
  if (r.tokens && !r.text.trim()) parts.push("the output is only whitespace");
  const s = r.settings;
  parts.push(`T=${s.temperature} k=${s.top_k} p=${s.top_p} seed=${s.seed} max=${s.max_tokens}`);
  const extras = [];  // the advanced options that are on
  if (s.min_p) extras.push(`min-p=${s.min_p}`);
  if (s.repetition_penalty !== 1) extras.push(`repetition=${s.repetition_penalty}`);
  if (s.presence_penalty) extras.push(`presence=${s.presence_penalty}`);
  if (s.frequency_penalty) extras.push(`frequency=${s.frequency_penalty}`);
  if (extras.length) extras.push(`window=${s.penalty_last_n === -1 ? "all" : s.penalty_last_n}`);
  const biased = Object.keys(s.logit_bias || {}).length;
  if (biased) extras.push(`${biased} biased token${biased === 1 ? "" : "s"}`);
  if (extras.length) parts.push(extras.join(" "));
  if (r.engine === "cpu") parts.push("CPU engine (llama.cpp, WebAssembly)");
  if (r.host) {
    // What each token cost the host (encode+submit, and reading back: CPU, then wall), and the
    // adapter: on a software one the GPU's own time dominates, on a real GPU the host's may.
    const h = r.host;
    parts.push(`host per token: encode ${h.encodeMs.toFixed(2)} ms, readback ${h.readbackCpuMs.toFixed(2)} ms CPU / ` +
               `${h.readbackWallMs.toFixed(1)} ms wall, ${h.dispatches} dispatches · ${h.adapterKind} adapter`);
  }
  return parts.join(" · ");
}

function chatBubble(role, text) {
  const li = document.createElement("li");
  li.dataset.role = role;
  li.textContent = text;
  ui.chatLog.append(li);
  li.scrollIntoView({ block: "nearest" });
  return li;
}

// What a chat turn cost: the ids it ran through the model and those the KV cache already held.
function formatTurn(r) {
  const t = r.turn;
  let text = `Turn ${t.number}: prefilled ${t.prefilled} new token${t.prefilled === 1 ? "" : "s"}, ` +
    `reused ${t.reused} from the cache · context ${r.contextUsed} / ${r.context}`;
  if (t.rewound) text += " · the history changed: re-read from where it differs";
  if (t.droppedMessages) text += ` · ${t.droppedMessages} oldest messages dropped`;
  if (t.template !== "jinja" && t.templateNote) text += ` · ${t.templateNote}`;
  return text;
}

function resetChat() {
  chatHistory = [];
  chatId += 1;  // the worker starts a new conversation (an empty cache) on the next turn
  ui.chatLog.replaceChildren();
  ui.chatStats.textContent = "";
  needle.chatId = chatId;
  if (engine === "cpu") {
    if (cpu) cpu.resetChat();
    return;
  }
  // Free the old conversation's KV cache now (requests run in order: never mid-generation).
  if (worker && modelLoaded) request("chat_reset").then(() => { needle.chatResets += 1; });
}

ui.chatReset.addEventListener("click", resetChat);

async function generate() {
  if (busy() || !modelLoaded) return;
  if (mode === "chat" && ui.chatInput.value.trim() === "/reset") {  // as the chat command's /reset
    resetChat();
    ui.chatInput.value = "";
    return { ok: true, reset: true };
  }
  clearError();
  ui.requestNotice.hidden = true;
  const logitBias = readLogitBias();
  if (logitBias.error) {  // nothing runs: the error shows next to the field
    ui.advanced.open = true;
    showError(logitBias.error, "logit-bias");
    needle.lastResult = { ok: false, error: { kind: "InputError", message: logitBias.error }, ran: false };
    return needle.lastResult;
  }
  phase = "generating";
  stopping = false;
  updateButtons();
  setStatus("busy", "Generating…");
  const payload = readRequest(logitBias.bias);
  let userBubble = null;
  if (mode === "chat") {
    userBubble = chatBubble("user", ui.chatInput.value);
    streamTarget = chatBubble("assistant", "");
  } else {
    ui.output.replaceChildren();
    delete ui.output.dataset.cut;
    streamTarget = ui.output;
  }
  needle.streamedTokens = 0;
  ui.stats.textContent = "";
  ui.runState.textContent = "Reading the prompt…";
  if (streamTarget !== ui.output) streamTarget.dataset.progress = "Reading the prompt…";
  // Screen readers hear the reply once it is complete, not every token; focus moves to Stop
  // (the Send button it was on is disabled meanwhile) and comes back to the message afterwards.
  for (const region of [ui.output, ui.chatLog]) region.setAttribute("aria-busy", "true");
  ui.stop.focus();
  ui.callsBlock.hidden = true;
  ui.confidence.textContent = "";
  const reply = engine === "cpu" ? await generateOnCpu(payload) : await request("generate", { request: payload });
  const bubble = streamTarget;
  streamTarget = null;
  if (bubble) delete bubble.dataset.progress;
  for (const region of [ui.output, ui.chatLog]) region.removeAttribute("aria-busy");
  phase = "idle";
  stopping = false;
  ui.runState.textContent = "";
  needle.lastResult = reply;
  needle.generations += 1;
  if (reply.ok) {
    const r = reply.result;
    if (mode === "chat") {
      bubble.textContent = r.text;
      if (r.finishReason === "length") bubble.dataset.cut = "true";  // a reply cut off by the budget
      if (r.tokens && !r.takenBack) {
        chatHistory.push({ role: "user", content: payload.messages.at(-1).content },
                         { role: "assistant", content: r.text });
        ui.chatInput.value = "";
      } else {
        userBubble.remove();
        bubble.remove();
      }
      ui.chatStats.textContent = formatTurn(r);
    } else {
      ui.output.textContent = r.text;
      if (r.finishReason === "length" && r.tokens) ui.output.dataset.cut = "true";
    }
    ui.stats.textContent = formatStats(r);
    if (r.notice) {
      ui.requestNotice.textContent = r.notice;
      ui.requestNotice.hidden = false;
      ui.requestNotice.scrollIntoView({ block: "nearest" });
    }
    if (r.completion) showCompletion(r.completion, r.confidence);
    showIgnoredBias(r.settings.logit_bias_ignored || []);
    setStatus("ready", "Ready");
  } else {
    if (userBubble) {
      userBubble.remove();
      bubble.remove();
    }
    ui.stats.textContent = "";
    showError(reply.error.message, "request");
    setStatus("ready", reply.error.kind === "DeviceLostError" ? "GPU lost · will recover" : "Ready");
  }
  updateButtons();
  if (!busy()) focusInput();
  await runQueued();
  return reply;
}

// A request on the CPU engine: the sampling fields saturated by the engine's own rules (the
// worker's Python, as on WebGPU), then llama.cpp.
async function generateOnCpu(payload) {
  needle.generateRequests += 1;
  const model = needle.model;
  let settings = null;
  if (worker) {
    const saturated = await request("sampling_settings", { request: payload, vocab: model.vocab, context: model.context });
    if (!saturated.ok) return saturated;
    settings = saturated.result;
  } else {
    return { ok: false, error: { kind: "BootError", message: "the engine's worker is not running" } };
  }
  if (!cpu) return { ok: false, error: { kind: "CpuEngineError", message: "the CPU engine has not started" } };
  return cpu.generate(payload, settings);
}

function focusInput() {
  const input = { chat: ui.chatInput, tools: $("query-input"), prompt: $("prompt-input") }[mode];
  if (input && !input.closest("[hidden]")) input.focus();
}

// Logit-bias entries the engine could not apply, listed by the field (not dropped silently).
function showIgnoredBias(ignored) {
  ui.logitBiasNote.hidden = !ignored.length;
  ui.logitBiasNote.textContent = ignored.length ?
    `Not applied: ${ignored.join("; ")}.` : "";
  if (ignored.length) ui.advanced.open = true;
}

function showCompletion(c, confidence) {
  ui.callsBlock.hidden = false;
  // The confidence head's probability that the answer is right (Needle 3 files that have one).
  ui.confidence.textContent = confidence == null ? "" : `confidence ${confidence.toFixed(3)}`;
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
// Enter sends a chat message (Shift+Enter is a new line; not while an IME composes); Escape
// stops a generation from anywhere on the page; Enter in the URL field loads it.
ui.chatInput.addEventListener("keydown", (event) => {
  if (event.key !== "Enter" || event.shiftKey || event.isComposing) return;
  event.preventDefault();
  generate();
});
document.addEventListener("keydown", (event) => {
  if (event.key === "Escape" && phase === "generating") ui.stop.click();
});
ui.url.addEventListener("keydown", (event) => {
  if (event.key !== "Enter") return;
  event.preventDefault();
  if (!busy()) loadFromControls();
});
ui.stop.addEventListener("click", () => {
  if (phase !== "generating" || stopping) return;
  stopping = true;
  ui.runState.textContent = "Stopping…";
  if (streamTarget && streamTarget !== ui.output && !streamTarget.textContent) streamTarget.dataset.progress = "Stopping…";
  setStatus("busy", "Stopping…");
  updateButtons();
  if (engine === "cpu") cpu.stop();
  else worker.postMessage({ type: "stop" });
});

// ---------------------------------------------------------------------------- start
// For the browser tests and the console: the request channel and the last results.
const needle = { request, generate, loadModel, errorText, bootSeconds: null, model: null, lastResult: null,
                 lastLoad: null, streamedTokens: 0, progressLog: [], loadRequests: 0, generateRequests: 0, generations: 0,
                 chatModel: null, chatId, chatResets: 0, onProgress: null, engineNotice: "", adapter: null,
                 switchEngine, state: () => ({ phase, stopping, queued: Boolean(queuedLoad), engine }) };
window.needle = needle;

// The worker starts even without WebGPU: its Python saturates the sampling fields for the CPU engine.
startWorker();
needle.ready = boot();
updateButtons();
