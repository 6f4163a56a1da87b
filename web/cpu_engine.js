// The CPU engine: GGUF models on llama.cpp compiled to WebAssembly (wllama, bundled by build.py),
// for visitors whose WebGPU adapter draws on the CPU (SwiftShader, llvmpipe) or who have none.
// It answers the page's requests in the worker's reply format ({ok, result | error}) and emits
// the same events (progress, token), so the chat, the free prompt, the sampling options and Stop
// work as they do on WebGPU. wllama runs llama.cpp in a worker of its own; this module only drives it.
// Needle 3 (.cact) files stay on WebGPU. Nothing here throws to the page: every failure is a reply.

import { readWithProgress } from "./download.js?b=__BUILD_ID__";

const BUILD = "__BUILD_ID__";
const CACHE_NAME = "needle-wgpu-models-v1";  // shared with worker.js: a model downloaded once serves both
const CONTEXT = 4096;                        // llama.cpp's KV cache, as the WebGPU page's session
const GGUF_MAGIC = "GGUF";
// Prompt positions per llama.cpp batch: wllama reads Stop between batches, and one thread reads
// about 20 positions a second of SmolLM2 here, so a batch takes under 2 s.
const PROMPT_BATCH = 32;

class UserError extends Error {}

const failure = (kind, message) => ({ ok: false, error: { kind, message } });

export class CpuEngine {
  // manifest: build.json; emit(event): the page's handler of worker events; layout(head, size):
  // the worker's gguf_layout check ({ok, result}), or null.
  constructor(manifest, emit, layout = null) {
    this.manifest = manifest;
    this.emit = emit;
    this.layout = layout;
    this.wllama = null;      // the loaded model's instance (one model per instance)
    this.summary = null;
    this.abort = null;       // the running request's AbortController
    this.chat = { id: null, turns: 0 };
    this.library = null;     // the wllama module, imported on first use
  }

  progress(stage, text, done = null, total = null) {
    this.emit({ type: "progress", stage, text, done, total });
  }

  async module() {
    if (!this.library) {
      const wllama = this.manifest.wllama;
      if (!wllama) throw new UserError("this build of the page has no CPU engine (build.py bundles wllama)");
      this.library = await import(new URL(`${wllama.module}?b=${BUILD}`, import.meta.url).href);
    }
    return this.library;
  }

  // ------------------------------------------------------------------ model bytes (as worker.js)
  async modelBlob(spec) {
    if (spec.source === "file") {
      if (!spec.file) throw new UserError("no file was given");
      return { blob: spec.file, name: spec.file.name, cacheKey: null, cached: false };
    }
    let url;
    if (spec.source === "default") {
      const entry = this.manifest.models.find((m) => m.file === spec.file) || this.manifest.models[0];
      url = new URL(`${entry.file}?sha256=${entry.sha256}`, import.meta.url);
    } else {
      try {
        url = new URL(String(spec.url || "").trim(), location.href);
      } catch {
        throw new UserError(`not a valid URL: ${String(spec.url).slice(0, 200)}`);
      }
    }
    if (!/^https?:$/.test(url.protocol)) throw new UserError(`${url.href}: only http(s) URLs can be loaded, not ${url.protocol}`);
    const name = decodeURIComponent(url.pathname.split("/").pop() || url.host);
    const cache = typeof caches === "undefined" ? null : await caches.open(CACHE_NAME);
    const hit = cache ? await cache.match(url.href) : null;
    if (hit) {
      this.progress("download", `Reading ${name} from the browser cache`);
      return { blob: await hit.blob(), name, cacheKey: null, cached: true };
    }
    let response;
    try {
      response = await fetch(url.href);
    } catch (error) {
      throw new UserError(`${url.href}: download failed (${error.message}): the host could not be reached, ` +
        "or its server does not allow cross-origin requests (CORS); the browser does not say which");
    }
    if (!response.ok) throw new UserError(`${url.href}: download failed: HTTP ${response.status} ${response.statusText}`.trim());
    const { parts } = await readWithProgress(response, name,
      (text, done, total) => this.progress("download", text, done, total));
    return { blob: new Blob(parts), name, cacheKey: url.href, cached: false };
  }

  // ------------------------------------------------------------------ requests
  async load(spec) {
    try {
      return { ok: true, result: await this.loadModel(spec) };
    } catch (error) {
      return this.failed(error, spec.source === "file" && spec.file ? spec.file.name : "the model");
    }
  }

  async loadModel(spec) {
    const started = performance.now();
    const { Wllama } = await this.module();
    const model = await this.modelBlob(spec);
    if (!model.blob.size) throw new UserError(`${model.name}: the file is empty`);
    const magic = new TextDecoder().decode(await model.blob.slice(0, 4).arrayBuffer());
    if (magic !== GGUF_MAGIC) {
      throw new UserError(`${model.name}: the CPU engine loads GGUF (.gguf) files only` +
        (magic === "CACT" || model.name.endsWith(".cact") ? "; Needle 3 (.cact) files run on WebGPU" :
          " (this file does not start with GGUF)"));
    }
    await this.checkLayout(model);
    this.progress("upload", "Loading the model into llama.cpp (WebAssembly)");
    const wasm = new URL(this.manifest.wllama.wasm, import.meta.url).href;
    const quiet = { debug() {}, log() {}, warn: (...a) => console.warn("[wllama]", ...a),
                    error: (...a) => console.error("[wllama]", ...a) };
    const instance = new Wllama({ default: wasm }, { suppressNativeLog: true, logger: quiet });
    instance.setCompat(null);  // never the CDN: everything the page runs comes from this site
    try {
      // n_gpu_layers 0: llama.cpp's own WebGPU back end is not used (on a software adapter it is
      // what this engine avoids); one thread, as the page is not cross-origin isolated; batches
      // of PROMPT_BATCH positions, so a Stop during a long prompt waits for one batch at most.
      await instance.loadModel([model.blob], { n_gpu_layers: 0, n_ctx: CONTEXT, n_threads: 1,
                                               n_batch: PROMPT_BATCH, n_ubatch: PROMPT_BATCH });
    } catch (error) {
      instance.exit().catch(() => {});
      throw new UserError(`${model.name}: llama.cpp could not load this GGUF file ` +
        `(${String(error && error.message || error).slice(0, 300)})`);
    }
    // The new model is loaded: the previous one (if any) is let go only now, so a bad file
    // leaves the loaded model in place, as on WebGPU.
    await this.unload();
    this.wllama = instance;
    this.spec = spec;
    this.broken = false;
    this.chat = { id: null, turns: 0 };
    let cachedNow = false;
    if (model.cacheKey && typeof caches !== "undefined") {
      const cache = await caches.open(CACHE_NAME);
      await cache.put(model.cacheKey, new Response(model.blob, {
        headers: { "content-type": "application/octet-stream", "content-length": String(model.blob.size) },
      }));
      cachedNow = true;
    }
    const hp = instance.getModelMetadata().hparams;
    const info = instance.getLoadedContextInfo();
    this.summary = {
      name: model.name, bytes: model.blob.size, layers: hp.nLayer, dModel: hp.nEmbd, vocab: hp.nVocab,
      context: info.n_ctx || CONTEXT, maxContext: hp.nCtxTrain, tokenizer: true, family: "dense", engine: "cpu",
      chatTemplate: instance.getChatTemplate() ? { kind: "jinja", note: "the file's own, rendered by llama.cpp" } : null,
      pipelines: 0, fromCache: model.cached, cachedNow,
      loadSeconds: Math.round(performance.now() - started) / 1000,
      device: { adapter: `CPU: llama.cpp (WebAssembly, wllama ${this.manifest.wllama.version}, ` +
                         `${instance.getNumThreads()} thread${instance.getNumThreads() === 1 ? "" : "s"})`,
                softwareRasterizer: null },
    };
    return this.summary;
  }

  // The engine's own GGUF reader checks the header and the file's length first (through the
  // page's worker): llama.cpp would take a file cut short and read past its end later.
  async checkLayout(model) {
    if (!this.layout) return;
    for (let head = 1 << 20; ; head *= 4) {
      const bytes = new Uint8Array(await model.blob.slice(0, Math.min(head, model.blob.size)).arrayBuffer());
      const reply = await this.layout(bytes, model.blob.size);
      if (!reply.ok) return;  // the check itself failed (no worker): llama.cpp's own checks remain
      if (reply.result.problem) throw new UserError(`${model.name}: ${reply.result.problem}`);
      if (!reply.result.more || head >= model.blob.size) return;
    }
  }

  async unload() {
    const old = this.wllama;
    this.wllama = null;
    this.summary = null;
    if (old) {
      try {
        await old.exit();
      } catch (error) {
        console.warn("[wllama] exit:", error);
      }
    }
  }

  stop() {
    if (this.abort) this.abort.abort();
  }

  resetChat() {
    this.chat = { id: null, turns: 0 };
  }

  // payload: the page's request (readRequest in app.js); settings: the engine's sampling values
  // after saturation (the WebGPU worker's sampling_settings), so both engines take the same ones.
  async generate(payload, settings) {
    try {
      return { ok: true, result: await this.run(payload, settings) };
    } catch (error) {
      if (!(error instanceof UserError)) this.broken = true;  // the next request starts llama.cpp again
      return this.failed(error, "the request");
    } finally {
      this.abort = null;
    }
  }

  async run(payload, settings) {
    if (this.broken && this.spec) {  // llama.cpp failed in the last request: a fresh instance
      this.progress("upload", "Recovering: loading the model into llama.cpp again");
      await this.loadModel(this.spec);
    }
    if (!this.wllama) throw new UserError("no model is loaded yet: load the bundled model, a file or a URL first");
    if (payload.mode !== "prompt" && payload.mode !== "chat") {
      throw new UserError("the CPU engine runs chats and free prompts (tool calls are a Needle 3 form, on WebGPU)");
    }
    const options = {
      max_tokens: settings.max_tokens, temperature: settings.temperature, top_k: settings.top_k,
      top_p: settings.top_p, min_p: settings.min_p, seed: settings.seed,
      repeat_penalty: settings.repetition_penalty, presence_penalty: settings.presence_penalty,
      frequency_penalty: settings.frequency_penalty, repeat_last_n: settings.penalty_last_n,
      logit_bias: settings.logit_bias, cache_prompt: true,
      // llama.cpp's other samplers off: the page offers only the engine's options
      typical_p: 1, dry_multiplier: 0, xtc_probability: 0, top_n_sigma: -1,
    };
    let messages = null;
    if (payload.mode === "chat") {
      const last = payload.messages && payload.messages.at(-1);
      if (!last || !String(last.content || "").trim()) throw new UserError("the message is empty");
      messages = payload.messages.map((m) => ({ role: m.role, content: String(m.content ?? "") }));
      if (String(payload.system || "").trim()) messages.unshift({ role: "system", content: payload.system.trim() });
      if (this.chat.id !== payload.chat) this.chat = { id: payload.chat, turns: 0 };
    } else if (!String(payload.prompt || "").trim()) {
      throw new UserError("the prompt is empty");
    }
    if (settings.max_tokens === 0) {
      return { text: "", tokens: 0, promptTokens: null, context: this.summary.context, contextUsed: 0,
               finishReason: "length", mode: payload.mode, engine: "cpu", settings, host: null,
               notice: "Max tokens is 0: nothing was generated.", timeToFirstTokenSeconds: null,
               decodeTokensPerSecond: null, prefillTokensPerSecond: null, takenBack: Boolean(messages),
               turn: messages ? { number: this.chat.turns, prefilled: 0, reused: 0, notices: [] } : undefined };
    }
    this.progress("prefill", "Reading the prompt");
    const abort = new AbortController();
    this.abort = abort;
    const started = performance.now();
    let first = null;
    let text = "";
    let count = 0;
    let final = null;
    const onData = (chunk) => {
      final = chunk;
      const choice = chunk.choices && chunk.choices[0];
      const piece = choice ? (messages ? (choice.delta && choice.delta.content) || "" : choice.text || "") : "";
      if (!piece) return;
      first = first ?? performance.now();
      count += 1;
      text += piece;
      this.emit({ type: "token", id: null, text: piece, count });
    };
    let stopped = false;
    try {
      const request = { ...options, stream: true, stream_options: { include_usage: true }, onData,
                        abortSignal: abort.signal };
      if (messages) await this.wllama.createChatCompletion({ ...request, messages });
      else await this.wllama.createCompletion({ ...request, prompt: payload.prompt });
    } catch (error) {
      if (!abort.signal.aborted) throw error;
      stopped = true;  // Stop: wllama ends at the next token and frees llama.cpp's slot
    }
    const usage = (final && final.usage) || {};
    const timings = (final && final.timings) || {};
    const reason = stopped ? "stopped" : (final && final.choices && final.choices[0] &&
      final.choices[0].finish_reason) || "stop";
    const finishReason = { stop: "eos", length: "length" }[reason] || reason;
    const tokens = usage.completion_tokens ?? timings.predicted_n ?? count;
    const promptTokens = usage.prompt_tokens ??
      (timings.prompt_n != null ? timings.prompt_n + (timings.cache_n || 0) : null);
    const takenBack = Boolean(messages) && stopped && count === 0;
    const result = {
      text: takenBack ? "" : text, tokens: takenBack ? 0 : tokens, promptTokens,
      context: this.summary.context, contextUsed: Math.min(this.summary.context, (promptTokens || 0) + tokens),
      finishReason, mode: payload.mode, engine: "cpu", settings, notice: null, host: null,
      timeToFirstTokenSeconds: first === null ? null : Math.round(first - started) / 1000,
      decodeTokensPerSecond: timings.predicted_per_second && tokens > 1 ? timings.predicted_per_second : null,
      prefillTokensPerSecond: timings.prompt_per_second || null,
    };
    if (messages) {
      if (!takenBack) this.chat.turns += 1;
      result.takenBack = takenBack;
      result.turn = { number: this.chat.turns, prefilled: timings.prompt_n ?? promptTokens ?? 0,
                      reused: timings.cache_n ?? 0, rewound: false, newSession: this.chat.turns === 1,
                      droppedMessages: 0, notices: [], template: "jinja", templateNote: null };
      if (takenBack) result.notice = "Stopped while reading the prompt: nothing was generated, and the message was taken back.";
    } else if (stopped && count === 0) {
      result.notice = "Stopped while reading the prompt: nothing was generated.";
    }
    return result;
  }

  failed(error, what) {
    if (error instanceof UserError) return failure("InputError", error.message);
    console.error("cpu engine:", error);
    const message = String(error && error.message || error).slice(0, 300);
    return failure("CpuEngineError", `the CPU engine failed on ${what} (${message}); details are in the browser console`);
  }
}
