"""The Python side of the demo's worker (web/worker.js): model loading, generation, test hooks.

Every entry point is a plain function that worker.js calls with ``callPromising`` (so the GPU
readbacks inside can wait through JSPI) and returns a JSON string
``{"ok": true, "result": ...}`` or ``{"ok": false, "error": {"kind", "message"}}``. Nothing
raises out of here: a ``NeedleError`` becomes its message, anything else a generic message with
the traceback in the browser console, and the worker serves the next request either way.
Events (progress, tokens) go to the page through ``needleEmit`` as they happen.
"""

from __future__ import annotations

import functools
import json
import math
import time
import traceback

import js
from pyodide.ffi import run_sync

from needle_wgpu.api import GenerationResult, Model
from needle_wgpu.generation import round_tokens
from needle_wgpu.chat.template import check_messages
from needle_wgpu.errors import DeviceLostError, InputError, NeedleError
from needle_wgpu.families import FAMILIES
from needle_wgpu.gpu.browser import create_browser_device
from needle_wgpu.grammar import GrammarError
from needle_wgpu.models.dense_session import PREFILL_CHUNK
from needle_wgpu.sampling import Sampling, bias_token, clamp_budget

MAX_PROMPT_CHARS = 200_000  # far beyond any context; keeps a pasted novel from stalling the tokenizer


class State:
    device = None       # BrowserDevice
    model = None        # api.Model
    model_bytes = None  # kept to reload after a device loss
    model_name = ""
    summary = None
    loss_reported = False  # a lost device is reported once, then replaced on the next request
    conversation = None  # the page's chat: one Model.conversation(), its KV cache kept across turns
    sizer = None         # ChunkSizer of the loaded model on this device
    chat_id = None       # the page's chat it belongs to (a new chat on the page, a new conversation)


def emit(**event) -> None:
    sink = getattr(js, "needleEmit", None)
    if sink is not None:
        sink(json.dumps(event, allow_nan=False, default=str))


def progress(stage: str, text: str, done=None, total=None) -> None:
    emit(type="progress", stage=stage, text=text, done=done, total=total)


def finite(value, digits: int = 4):
    return round(value, digits) if isinstance(value, float) and math.isfinite(value) else None


def entry(fn):
    """Wrap an entry point: JSON in the worker's reply format, and no exception escapes."""

    @functools.wraps(fn)
    def wrapper(*args):
        try:
            return json.dumps({"ok": True, "result": fn(*args)}, allow_nan=False)
        except NeedleError as exc:
            if isinstance(exc, DeviceLostError) or (State.device is not None and State.device.lost_reason):
                State.loss_reported = True
                message = (f"The GPU device was lost ({getattr(State.device, 'lost_reason', None) or exc}). "
                           "The model will be uploaded again on the next request.")
                return json.dumps({"ok": False, "error": {"kind": "DeviceLostError", "message": message}})
            return json.dumps({"ok": False, "error": {"kind": type(exc).__name__, "message": str(exc)}})
        except Exception as exc:
            traceback.print_exc()
            message = (f"Something went wrong inside the engine ({type(exc).__name__}); "
                       "details are in the browser console.")
            return json.dumps({"ok": False, "error": {"kind": "InternalError", "message": message}})

    return wrapper


# ---------------------------------------------------------------------------- device and model
def _open_device():
    if State.device is not None:
        State.device.destroy()
        State.device = None
    device = run_sync(create_browser_device())
    State.loss_reported = False
    device.on_pipeline = lambda count, label: progress("compile", f"Compiling GPU pipelines ({label})", count, None)
    State.device = device
    return device


def _device_summary(device) -> dict:
    lim = device.limits
    return {"adapter": device.adapter_name, "softwareRasterizer": device.software_rasterizer,
            "maxStorageBinding": lim.max_storage_binding,
            "maxBuffer": lim.max_buffer, "workgroupStorage": lim.max_workgroup_storage,
            "storageBuffers": lim.max_storage_buffers}


@entry
def open_device() -> dict:
    return _device_summary(_open_device())


# What a file that is not a model usually is, by its first bytes (for the error message).
NOT_A_MODEL = ((b"\x89PNG", "a PNG image"), (b"\xff\xd8\xff", "a JPEG image"), (b"GIF8", "a GIF image"),
               (b"PK\x03\x04", "a ZIP archive"), (b"\x1f\x8b", "a gzip archive"), (b"%PDF", "a PDF document"),
               (b"<", "an HTML or XML page"), (b"{", "a JSON file"), (b"[", "a JSON file"))


def _sniff(data: bytes, name: str):
    """The model family of ``data``, or an InputError that names the file and says in words
    what it is instead (a picked PNG should not read as 'wrong tag 0x474E5089')."""
    head = bytes(data[:8])
    for family in FAMILIES.values():
        if family.sniff(head[:4]):
            return family
    text = head.lstrip()
    what = next((kind for magic, kind in NOT_A_MODEL if text.startswith(magic)), None)
    if what is None and len(data) >= 10 and data[8:10] == b'{"':
        what = "a safetensors file (convert it to GGUF first)"
    if what is None:
        raise InputError(f"{name}: this is not a model file (it starts with the bytes {head[:4].hex(' ')}); "
                         "the page loads GGUF (.gguf) and Needle 3 (.cact) files")
    raise InputError(f"{name}: this is {what}, not a model: the page loads GGUF (.gguf) and Needle 3 "
                     f"(.cact) files")


def _upload(data: bytes, name: str) -> dict:
    """Validate, then upload. The old model's buffers are freed first; a healthy device (with its
    compiled pipelines) is kept, a lost one replaced."""
    started = time.perf_counter()
    family = _sniff(data, name)
    try:
        model_file = family.read(data)  # raises ContainerError before the loaded model is touched
    except NeedleError as exc:
        raise type(exc)(f"{name}: {_cut_short(data, exc) or exc}") from None
    parsed = time.perf_counter()
    close_chat()  # its session lives in the old model's buffers
    State.model = None  # if this upload fails, the next request re-uploads the previous model
    device = State.device
    if device is None or device.lost_reason:
        device = _open_device()
    else:
        device.release_dropped()  # the old model's memory, now rather than at JS garbage collection
    layers = model_file.geometry.num_layers

    def report(stage, done, total):
        progress("upload", f"Uploading weights (layer {done} of {layers})", done, total)

    model = Model(family.open(model_file, device, progress=report))
    device.check("uploading the weights")
    uploaded = time.perf_counter()
    progress("compile", "Compiling GPU pipelines and running a first step", 0, None)
    session = model.gpu.session()
    try:
        # A two-token prefill and one decode step build both plans (prefill and decode use
        # different kernel variants), so every pipeline is compiled before the first request.
        bos = model.tokenizer.bos_id if model.tokenizer is not None else 1
        session.prefill([bos, bos], Sampling())
        session.step(Sampling())
    finally:
        session.close()
    compiled = time.perf_counter()
    g = model.geometry
    State.model, State.model_bytes, State.model_name = model, data, name
    State.sizer = ChunkSizer(device.software_rasterizer)
    State.summary = {
        "name": name, "bytes": len(data), "layers": g.num_layers, "dModel": g.d_model, "vocab": g.vocab,
        "context": session_context(model), "maxContext": g.max_seq_len, "tokenizer": model.tokenizer is not None,
        "family": model.describe().get("family", ""), "chatTemplate": _template_summary(model),
        "parseSeconds": round(parsed - started, 3), "uploadSeconds": round(uploaded - parsed, 3),
        "compileSeconds": round(compiled - uploaded, 3), "pipelines": device.pipeline_count,
        "device": _device_summary(device), "synthetic": _synthetic(model_file),
    }
    return State.summary


def _cut_short(data: bytes, exc: NeedleError, size: int | None = None):
    """A GGUF file that ends early (an incomplete download or copy), said in words and sizes
    rather than the reader's byte offsets; None for other problems. ``data``: the file, or its
    first bytes when ``size`` says how long it is."""
    from needle_wgpu.errors import ContainerError
    from needle_wgpu.formats import gguf

    text = str(exc)
    if not isinstance(exc, ContainerError) or not bytes(data[:4]) == b"GGUF" or \
            not any(words in text for words in ("truncated", "past the end of the file", "cannot fit")):
        return None
    size = len(data) if size is None else size
    try:
        needed = gguf._bytes_needed(memoryview(data), size)
    except NeedleError:
        needed = size
    if needed > size:
        return (f"the file is cut short: it has {_megabytes(size)} but its header describes "
                f"{_megabytes(needed)} of weights (an incomplete download or copy?)")
    return (f"the file is cut short: it ends inside its header, after {_megabytes(size)} "
            "(an incomplete download or copy?)")


def _megabytes(size: int) -> str:
    return f"{size:,} bytes" if size < 100_000 else f"{size / 1e6:.1f} MB"


def _synthetic(model_file) -> bool:
    """Whether the file is one of the project's synthetic models (random weights: its output is
    random text): a GGUF that synth_gguf named "synthetic ...", or a Needle 3 file whose
    tokenizer is the synthetic one."""
    from needle_wgpu.formats.needle3_tokenizer import SYNTHETIC_MAX_VOCAB, SYNTHETIC_MIN_VOCAB, synthetic_tokenizer_blob

    gguf_file = getattr(model_file, "gguf", None)
    if gguf_file is not None:
        field = gguf_file.fields.get("general.name")
        return isinstance(getattr(field, "value", None), str) and field.value.startswith("synthetic ")
    tokenizer, vocab = getattr(model_file, "tokenizer", None), model_file.geometry.vocab
    if tokenizer is None or not SYNTHETIC_MIN_VOCAB <= vocab <= SYNTHETIC_MAX_VOCAB:
        return False
    try:
        return bytes(tokenizer) == synthetic_tokenizer_blob(vocab)
    except ValueError:
        return False


def _template_summary(model: Model):
    """How the chat renders: the file's own template (jinja) or the built-in ChatML, and why."""
    template = model.chat_format.template
    if template is None:
        return None
    try:
        import jinja2
        version = jinja2.__version__
    except ImportError:
        version = None
    return {**template.describe(), "jinja2": version}


@entry
def load_model(js_bytes, name) -> dict:
    data = js_bytes.to_bytes()  # the one copy from JS memory into Python's; uploads then go without copies
    if not data:
        raise InputError(f"{name}: the file is empty")
    return _upload(data, str(name))


def _ready_model() -> Model:
    if State.model is None and State.model_bytes is None:
        raise NeedleError("no model is loaded yet: load the bundled model, a file or a URL first")
    lost = State.device is not None and State.device.lost_reason
    if lost and not State.loss_reported:
        raise DeviceLostError(f"the GPU device was lost ({lost})")
    if State.model is None or State.device is None or lost:
        progress("upload", "Recovering: opening a new GPU device and uploading the model again")
        _upload(State.model_bytes, State.model_name)
    return State.model


PAGE_CONTEXT = 4096  # positions of a request's session (the KV cache the page allocates)


def session_context(model: Model) -> int:
    return min(model.geometry.max_seq_len, PAGE_CONTEXT)


# ---------------------------------------------------------------------------- chat
CHAT_ROLES = ("system", "user", "assistant")


def chat_messages(messages) -> list:
    """The page's conversation (a list of {role, content}, the new user message last), checked
    here, so the page can send whatever its form holds."""
    if not isinstance(messages, list) or not messages:
        raise InputError("messages: the conversation is empty")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in CHAT_ROLES:
            raise InputError(f"messages[{i}]: each message needs a role ({', '.join(CHAT_ROLES)}) and content")
    checked = check_messages([{"role": m["role"], "content": m.get("content")} for m in messages])
    if checked[-1]["role"] != "user" or not checked[-1]["content"].strip():
        raise InputError("the message is empty")
    size = sum(len(m["content"]) for m in checked)
    if size > MAX_PROMPT_CHARS:
        raise InputError(f"the conversation is {size:,} characters long (at most {MAX_PROMPT_CHARS:,}): "
                         "start a new chat")
    return checked


def close_chat() -> None:
    if State.conversation is not None:
        State.conversation.close()
    State.conversation, State.chat_id = None, None


def chat_conversation(model: Model, chat_id):
    """The conversation of the page's chat ``chat_id``: kept while the page keeps the chat and
    the model; a new chat (or a new model) starts a new one, with an empty cache."""
    conversation = State.conversation
    if conversation is None or conversation.model is not model or State.chat_id != chat_id:
        close_chat()
        conversation = model.conversation(context=session_context(model))
        State.conversation, State.chat_id = conversation, chat_id
    return conversation


@entry
def render_chat(request_json: str) -> dict:
    """The prompt text the chat renders for ``messages`` (the model's template, or ChatML where
    the file has none), without running the model."""
    request = _request(request_json)
    model = _ready_model()
    template = model.chat_format.template
    if template is None:
        raise InputError("this model has no chat template (a Needle 3 file): use the tool-call form")
    messages = request.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InputError("messages: the conversation is empty")
    text = template.render(messages, add_generation_prompt=bool(request.get("add_generation_prompt", True)))
    return {"text": text, "kind": template.kind, "note": template.last_note or template.note,
            "tokens": len(model.chat_format.text_ids(model.tokenizer, text))}


# ---------------------------------------------------------------------------- generation
def _request(request_json: str) -> dict:
    try:
        request = json.loads(request_json)
    except ValueError:
        raise InputError("the request is not valid JSON") from None
    if not isinstance(request, dict):
        raise InputError("the request must be a JSON object")
    return request


def _text(request: dict, key: str) -> str:
    value = request.get(key)
    value = "" if value is None else str(value)
    if len(value) > MAX_PROMPT_CHARS:
        raise InputError(f"{key}: {len(value):,} characters is too long (at most {MAX_PROMPT_CHARS:,})")
    return value


def stop_requested() -> bool:
    return bool(getattr(js, "needleStopRequested", False))


# A prefill chunk's target time: Stop is read between chunks, so it takes effect within about
# this long. On a software adapter a one-position step may itself take longer: a chunk may then
# take up to twice that step (below it, shorter chunks only cost throughput).
CHUNK_SECONDS = 0.4
FIRST_SOFTWARE_CHUNK = 8  # before anything was measured on a software adapter


class ChunkSizer:
    """The prefill chunk for the adapter at hand, from the chunk times measured so far (one per
    model): the time of a chunk of T positions is fitted as a + b·T over the fastest time seen
    for each T, and the chunk is the largest power of two whose predicted time stays within
    ``max(CHUNK_SECONDS, 2a)``."""

    def __init__(self, software: bool):
        self.software = software
        self.fastest = {}  # positions -> the fastest seconds a chunk of that length took

    def record(self, positions: int, seconds: float) -> None:
        if positions > 0 and seconds > 0:
            self.fastest[positions] = min(self.fastest.get(positions, math.inf), seconds)

    def fit(self) -> tuple:
        points = sorted(self.fastest.items())
        if not points:
            return None
        if len(points) == 1:
            (t, s), = points
            return 0.0, s / t
        n = len(points)
        mean_t = sum(t for t, _ in points) / n
        mean_s = sum(s for _, s in points) / n
        spread = sum((t - mean_t) ** 2 for t, _ in points)
        slope = max(sum((t - mean_t) * (s - mean_s) for t, s in points) / spread, 1e-9)
        return max(mean_s - slope * mean_t, 0.0), slope

    def choose(self, limit: int) -> int:
        fitted = self.fit()
        if fitted is None:
            return min(limit, FIRST_SOFTWARE_CHUNK) if self.software else limit
        fixed, per_position = fitted
        allowed = max(CHUNK_SECONDS, 2 * fixed)
        size = 1
        while size * 2 <= limit and fixed + per_position * size * 2 <= allowed:
            size *= 2
        return size


class HostCost:
    """What a request cost the host per token, from the device's counters (as
    ``needle_wgpu.cli.bench.host_cost`` splits it): encoding and submitting the passes, and
    reading back (the CPU time, mostly waiting for the GPU, and the wall time)."""

    def __init__(self, device):
        self.device, self.start = device, None

    def mark(self) -> None:
        """The first token came: what follows is the decode's cost."""
        c = self.device.counters
        self.start = (c.encode_cpu_s, c.read_cpu_s, c.read_wall_s, c.dispatches, c.submits)

    def per_token(self, tokens: int):
        """The decode's cost per token after the first (None without two tokens)."""
        tokens -= 1
        if tokens <= 0 or self.start is None:
            return None
        c = self.device.counters
        encode, read_cpu, read_wall, dispatches, submits = (
            (now - then) / tokens for now, then in zip((c.encode_cpu_s, c.read_cpu_s, c.read_wall_s, c.dispatches,
                                                         c.submits), self.start))
        return {"encodeMs": round(1000 * encode, 3), "readbackCpuMs": round(1000 * read_cpu, 3),
                "readbackWallMs": round(1000 * read_wall, 3), "dispatches": round(dispatches, 1),
                "submits": round(submits, 2),
                "adapterKind": "software" if self.device.software_rasterizer else "hardware"}


class StopCheck:
    """``should_stop`` for the page (``Model.stream``, ``Conversation.stream``). Before each
    prefill chunk it waits until the GPU has finished the chunk before (``wait_idle``: at most
    one chunk is ever in flight, the progress counts positions done, and the page's Stop
    message is read meanwhile), times it, sizes the next chunk (``ChunkSizer``) and reads the
    Stop flag. Between decode steps the token's readback has already waited: it only reads the
    flag. ``sampled`` (optional) says whether the first token has come (a chat turn's stats)."""

    def __init__(self, device, sampled=None):
        self.device, self.sampled = device, sampled
        self.decoding = False  # set by generate() when the first token arrives
        self.stop_seen_in_prefill = False
        self.started, self.done = None, 0
        self.chunks = 0

    def __call__(self, done: int, total: int) -> bool:
        if self.decoding or (self.sampled is not None and self.sampled()):
            return stop_requested()
        device = self.device
        if done:
            device.wait_idle("prefill")
            if self.started is not None:
                State.sizer.record(done - self.done, time.perf_counter() - self.started)
            self.chunks += 1
        run_sync(js.needleYield())  # one macrotask turn: the worker reads the page's "stop"
        text = (f"Reading the prompt ({done:,} of {total:,} tokens)" if done else
                f"Reading the prompt ({total:,} token{'s' if total != 1 else ''})")
        progress("prefill", text, done, total)
        if stop_requested():
            self.stop_seen_in_prefill = True
            return True
        device.prefill_chunk = State.sizer.choose(PREFILL_CHUNK)
        self.started, self.done = time.perf_counter(), done
        return False

    def finish(self) -> None:
        """The request is over: later prefills (tests, the benchmark) use the family's chunk."""
        self.device.prefill_chunk = None


KNOBS = ("max_tokens", "temperature", "top_k", "top_p", "seed", "min_p", "repetition_penalty",
         "presence_penalty", "frequency_penalty", "penalty_last_n", "logit_bias", "tokens_per_round")


def _settings(model: Model, request: dict, context: int, prompt_tokens: int = 0) -> tuple:
    """The request's sampling knobs as given (the engine saturates them), and as the engine will
    use them. The page's fields arrive as text; a missing one is None (the engine's default,
    max_tokens's 0). logit_bias: a JSON object or nothing (the page checks its field; anything
    else is refused here rather than read as "no bias")."""
    knobs, effective = _saturate(request, model.geometry.head_rows, context - prompt_tokens)
    effective["tokens_per_round"] = round_tokens(knobs["tokens_per_round"], model.gpu.device)
    return knobs, effective


def _saturate(request: dict, vocab: int, room: int) -> tuple:
    """``_settings`` for a vocabulary of ``vocab`` ids and ``room`` positions left."""
    knobs = {k: request.get(k) for k in KNOBS}
    bias = knobs["logit_bias"]
    if bias is not None and not isinstance(bias, dict):
        raise InputError("logit_bias: must be a JSON object of token ids and biases, e.g. {\"42\": -100}")
    sampling = Sampling.saturate(**{k: v for k, v in knobs.items() if k not in ("max_tokens", "tokens_per_round")},
                                 vocab=vocab)
    effective = {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p,
                 "seed": sampling.seed, "max_tokens": clamp_budget(knobs["max_tokens"], room),
                 "min_p": sampling.min_p, "repetition_penalty": sampling.repetition_penalty,
                 "presence_penalty": sampling.presence_penalty, "frequency_penalty": sampling.frequency_penalty,
                 "penalty_last_n": sampling.penalty_last_n,
                 "logit_bias": {str(token): bias for token, bias in sampling.logit_bias}}
    effective["logit_bias_ignored"] = _bias_ignored(bias, vocab)
    return knobs, effective


def _bias_ignored(bias, vocab: int) -> list:
    """The logit-bias entries the engine drops, each with why (the page lists them by the field)."""
    ignored = []
    for key, value in (bias or {}).items():
        token = bias_token(key)
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = math.nan
        if token is None:
            why = "not a token id"
        elif token >= vocab:
            why = f"past the vocabulary ({vocab:,} ids)"
        elif math.isnan(number):
            why = "the bias is not a number"
        elif number == 0:
            why = "a bias of 0 changes nothing"
        else:
            continue
        ignored.append(f"{str(key)[:40]}: {why}")
    return ignored


@entry
def generate(request_json: str) -> dict:
    request = _request(request_json)
    model = _ready_model()
    mode = request.get("mode", "prompt")
    if mode not in ("tools", "prompt", "chat"):
        raise InputError(f"unknown mode {mode!r} (expected 'tools', 'prompt' or 'chat')")
    if mode == "chat":
        return chat_turn(model, request)
    if mode == "tools":
        # Constrained by default (the engine's default for tool calls): every answer is a call
        # list of the given tools, or [] (the model declining).
        inputs = {"query": _text(request, "query"), "tools": _text(request, "tools") or "[]",
                  "system": _text(request, "system") or None,
                  "constrained": request.get("constrained") is not False}
    else:
        prompt = _text(request, "prompt")
        if not prompt.strip():
            raise InputError("the prompt is empty")
        inputs = {"prompt": prompt}
    context = session_context(model)
    prompt_ids = model.encode_request(**{k: v for k, v in inputs.items() if k != "constrained"})
    knobs, effective = _settings(model, request, context, len(prompt_ids))
    # The KV cache holds what this request can use (prompt + budget), not the whole context;
    # a prompt that leaves no room runs nothing, over a one-position session.
    kv_positions = len(prompt_ids) + effective["max_tokens"] if len(prompt_ids) < context else 1

    result = GenerationResult("", [], "empty", 0)
    pieces, ids = [], []
    started = time.perf_counter()
    first = last = None
    should_stop = StopCheck(State.device)
    host = HostCost(State.device)
    if mode == "prompt":
        inputs = {"ids": prompt_ids}  # tokenised once (a long paste takes a while in Pyodide)
    stream = model.stream(**inputs, result=result, context=max(1, kv_positions), should_stop=should_stop, **knobs)
    try:
        for event in stream:
            should_stop.decoding = True
            pieces.append(event.text)
            if event.id is not None:  # None: the text held back at the end (generation.TokenEvent)
                last = time.perf_counter()
                first = first or last
                ids.append(event.id)
                if len(ids) == 1:
                    host.mark()
            emit(type="token", id=event.id, text=event.text, count=len(ids))
    except GrammarError as exc:  # raised before the first token: the tools' schemas
        raise GrammarError(f"{exc} (constrained decoding takes a JSON-schema subset: untick "
                           "'Constrain the answer' to run these tools unconstrained)") from None
    finally:
        stream.close()
        should_stop.finish()
    stopped = result.finish_reason == "stopped"
    text = result.text if not stopped and result.text else "".join(pieces)
    decode_seconds = (last - first) if first is not None else 0.0
    decode_rate = (len(ids) - 1) / decode_seconds if len(ids) > 1 and decode_seconds > 0 else None
    out = {
        "text": text, "tokens": len(ids), "ids": ids, "promptTokens": result.prompt_tokens,
        "context": context, "contextUsed": min(context, result.prompt_tokens + len(ids)),
        "finishReason": result.finish_reason,
        "timeToFirstTokenSeconds": finite(first - started) if first is not None else None,
        "decodeTokensPerSecond": finite(decode_rate) if decode_rate is not None else None,
        "prefillTokensPerSecond": finite(result.prefill_tokens_per_s, 1),
        "clampedIds": result.clamped_ids, "settings": effective, "mode": mode, "notice": None,
        "confidence": finite(result.confidence), "constrained": bool(inputs.get("constrained")),
        "host": host.per_token(len(ids)),
    }
    if result.prompt_tokens >= context:
        out["notice"] = (f"The prompt is {result.prompt_tokens:,} tokens but the context holds {context:,}: "
                         f"nothing could be generated. Shorten it by at least "
                         f"{result.prompt_tokens - context + 1:,} tokens.")
    elif result.finish_reason == "length" and out["tokens"] == 0 and effective["max_tokens"] == 0:
        out["notice"] = "Max tokens is 0: nothing was generated."
    elif stopped and not pieces:
        out["notice"] = "Stopped while reading the prompt: nothing was generated."
    elif out["constrained"] and result.finish_reason == "length" and not pieces:
        out["notice"] = (f"No answer of the tools' grammar fits in {effective['max_tokens']} tokens: "
                         "raise Max tokens (even the empty answer <tool_call>[]</tool_call> takes some).")
    if mode == "tools":
        completion = model.chat_format.parse(text)
        if completion is not None:
            out["completion"] = {"toolCalls": completion.tool_calls, "thinking": completion.thinking,
                                 "problems": completion.problems, "abstained": completion.abstained}
    return out


def chat_turn(model: Model, request: dict) -> dict:
    """One turn of the page's chat over the chat's conversation: the page sends the whole
    history (it is what the page shows), the conversation keeps the KV cache of what it already
    ran, so the turn prefills only the ids after the longest common prefix."""
    messages = chat_messages(request.get("messages"))
    system = _text(request, "system").strip() or None
    conversation = chat_conversation(model, request.get("chat"))
    context = conversation.context
    knobs, effective = _settings(model, request, context)
    history = [m for m in messages[:-1] if m["role"] != "system"]
    system = system or next((m["content"] for m in messages if m["role"] == "system"), None)
    conversation.reset()  # the history as the page shows it; the cache stays for reuse
    if system is not None:
        conversation.set_system(system)
    conversation.add(history)

    started = time.perf_counter()
    first = None
    pieces = []
    def turn():  # the turn's stats: stream() appends them first, then updates them as it goes
        return conversation.turns[-1]

    should_stop = StopCheck(State.device, sampled=lambda: turn().completion_tokens > 0)
    host = HostCost(State.device)
    stream = conversation.stream(messages[-1]["content"], should_stop=should_stop, **knobs)
    # Stop pressed before the reply's first token showed (during the prompt's last chunk, so
    # that token was sampled before the flag was read): the message is taken back, as a Stop
    # during the prefill does; the page resends its own history next turn, so the cache rewinds.
    taken_back = False
    try:
        for piece in stream:
            if not pieces and not taken_back and stop_requested():
                taken_back = True
            if taken_back:
                continue
            if first is None:
                first = time.perf_counter()
                host.mark()
            pieces.append(piece)
            emit(type="token", id=None, text=piece, count=turn().completion_tokens)
    finally:
        stream.close()
        should_stop.finish()
    stats = turn()
    template = conversation.model.chat_format.template
    kept = conversation.messages and conversation.messages[-1]["role"] == "assistant"
    text = conversation.messages[-1]["content"] if kept and stats.completion_tokens else "".join(pieces)
    if taken_back:
        text = ""
    out = {
        "text": text, "tokens": 0 if taken_back else stats.completion_tokens, "promptTokens": stats.prompt_tokens,
        "takenBack": taken_back or (stats.finish_reason == "stopped" and not stats.completion_tokens),
        "context": stats.context or context, "contextUsed": stats.context_used,
        "finishReason": stats.finish_reason,
        "timeToFirstTokenSeconds": finite(first - started) if first is not None else None,
        "decodeTokensPerSecond": finite(stats.decode_tokens_per_s) if stats.decode_tokens_per_s else None,
        "prefillTokensPerSecond": finite(stats.prefilled / stats.prefill_s, 1) if stats.prefill_s > 0 else None,
        "settings": effective, "mode": "chat", "notice": None, "host": host.per_token(stats.completion_tokens),
        "turn": {"number": len(conversation.turns), "prefilled": stats.prefilled, "reused": stats.reused,
                 "rewound": stats.rewound, "newSession": stats.new_session,
                 "droppedMessages": stats.dropped_messages, "notices": list(stats.notices),
                 "template": None if template is None else template.kind if template.last_note is None else "chatml",
                 "templateNote": None if template is None else template.last_note or template.note},
    }
    if out["takenBack"]:
        out["notice"] = "Stopped while reading the prompt: nothing was generated, and the message was taken back."
    elif stats.finish_reason == "length" and not stats.completion_tokens and effective["max_tokens"] == 0:
        out["notice"] = "Max tokens is 0: nothing was generated."
    elif stats.notices:
        out["notice"] = "; ".join(stats.notices).capitalize() + "."
    return out


@entry
def sampling_settings(request_json: str, vocab, context) -> dict:
    """The page's sampling fields as the engine saturates them, for a model of ``vocab`` ids and
    ``context`` positions: the CPU engine (web/cpu_engine.js) takes these, so both engines read
    the same fields the same way."""
    return _saturate(_request(request_json), max(1, int(vocab)), max(0, int(context)))[1]


@entry
def gguf_layout(js_head, size) -> dict:
    """The CPU engine's check of a GGUF file before llama.cpp reads it (which takes a file cut
    short and would read past its end): the first bytes of a file of ``size`` bytes, read as the
    engine's own reader does. {"more": true}: the header runs past these bytes, send more;
    {"problem": text}: refused, in the WebGPU engine's words; else {"needed": bytes}."""
    from needle_wgpu.errors import ContainerError
    from needle_wgpu.formats import gguf

    head, size = js_head.to_bytes(), int(size)
    view = memoryview(head)
    try:
        gguf._read_layout(view, size)
    except gguf._NeedMore:
        return {"more": True}
    except ContainerError as exc:
        return {"problem": _cut_short(head, exc, size) or str(exc)}
    needed = gguf._bytes_needed(view, size)
    if needed > size:
        return {"problem": (f"the file is cut short: it has {_megabytes(size)} but its header describes "
                            f"{_megabytes(needed)} of weights (an incomplete download or copy?)"), "needed": needed}
    return {"needed": needed}


@entry
def unload_model() -> dict:
    """The page switched to the CPU engine: the model's GPU memory is freed now; the next
    WebGPU request loads a model again."""
    had = State.model is not None
    close_chat()
    State.model = State.model_bytes = State.summary = None
    if State.device is not None and not State.device.lost_reason:
        State.device.release_dropped()
    return {"unloaded": had}


# ---------------------------------------------------------------------------- test hooks
@entry
def logits(ids_json: str) -> dict:
    """All-position logits of ``ids`` (the cross-backend parity tests read these)."""
    ids = json.loads(ids_json)
    if not isinstance(ids, list):
        raise InputError("ids must be a JSON array of token ids")
    rows = _ready_model().logits(ids)
    return {"rows": [[v if math.isfinite(v) else None for v in row] for row in rows]}


@entry
def cq_matmul(js_bytes, tensor_name, js_x, positions) -> dict:
    """One CQ tensor of a container times ``x`` (positions x cols) through cq_prepare + cq_matmul."""
    import struct

    from needle_wgpu.formats import cact
    from needle_wgpu.gpu import Plan, UniformArena
    from needle_wgpu.kernels import cq

    device = State.device or _open_device()
    container = cact.load(js_bytes.to_bytes())
    tensor = container[str(tensor_name)]
    T, cols = int(positions), tensor.cols
    x = js_x.to_bytes()
    if len(x) != 4 * T * cols:
        raise InputError(f"x has {len(x)} bytes, expected {4 * T * cols}")
    levels = device.buffer(cq.LEVELS_BYTES, label="levels", data=cq.levels_bytes(container))
    pack = cq.upload_pack(device, "test", [tensor])
    xb = device.buffer(len(x), label="x", data=x)
    xh = device.buffer(4 * T * pack.in_pad, label="xh")
    y = device.buffer(4 * T * pack.rows, label="y")
    arena, plan = UniformArena(device), Plan(device, "cq test")
    cq.prepare(plan, arena, xb, xh, width=cols, group=pack.group, positions=T, x_stride=cols)
    cq.matmul(plan, arena, pack, levels, xh, y, positions=T, x_stride=pack.in_pad, y_stride=pack.rows)
    device.run(plan)
    values = struct.unpack(f"<{T * pack.rows}f", device.read(y, 4 * T * pack.rows))
    return {"rows": pack.rows, "y": list(values)}


@entry
def chat_reset() -> dict:
    """The page started a new chat: close the conversation now (its KV cache is freed)."""
    had = State.conversation is not None
    close_chat()
    return {"closed": had}


@entry
def lose_device() -> dict:
    """Destroy the GPU device, as a driver reset would (tests the recovery path)."""
    if State.device is not None:
        State.device.destroy()
    return {"lost": True}


@entry
def info() -> dict:
    device = State.device
    return {"device": _device_summary(device) if device is not None else None, "model": State.summary,
            "counters": vars(device.counters) if device is not None else None,
            # Which kernel shapes were compiled: q_matmul_rows / cq_matmul_rows on a CPU adapter (§8).
            "kernels": sorted({key.family for key in device._pipelines}) if device is not None else [],
            "pipelines": device.pipeline_count if device is not None else 0,
            "chat": _chat_summary()}


def _chat_summary():
    conversation = State.conversation
    if conversation is None:
        return None
    session = conversation.session
    return {"id": State.chat_id, "turns": len(conversation.turns),
            "contextUsed": session.position if session is not None else 0}


@entry
def bench(prompt_tokens, decode_tokens) -> dict:
    """Prefill and decode speed on this GPU: ``prompt_tokens`` ids, then up to ``decode_tokens``
    greedy steps (the counters say what each step costs in dispatches and readbacks)."""
    model = _ready_model()
    g = model.geometry
    prompt = max(1, min(int(prompt_tokens), g.max_seq_len - 2))
    ids = [2] + [4 + (7 * i) % (g.vocab - 4) for i in range(prompt - 1)]
    device = State.device
    before = dict(dispatches=device.counters.dispatches, submits=device.counters.submits,
                  read=device.counters.bytes_read)
    started = time.perf_counter()
    result = model.generate(ids=ids, max_tokens=max(1, int(decode_tokens)))
    elapsed = time.perf_counter() - started
    host = None
    if decode_tokens and int(decode_tokens) >= 3:
        # The host's cost per token through the generation loop, split as the desktop's
        # ``needle-wgpu bench`` splits it (needle_wgpu.cli.bench.host_cost), one step a round.
        from needle_wgpu.cli.bench import host_cost

        host = host_cost(model, ids[: max(1, min(prompt, 16))], max(3, int(decode_tokens)), round_tokens=1)
        host["adapterKind"] = "software" if device.software_rasterizer else "hardware"
    return {"promptTokens": prompt, "decodeTokens": len(result.ids), "seconds": round(elapsed, 3), "hostCost": host,
            "timeToFirstTokenSeconds": finite(result.time_to_first_token_s),
            "prefillTokensPerSecond": finite(result.prefill_tokens_per_s, 2),
            "decodeTokensPerSecond": finite(result.decode_tokens_per_s, 2),
            "dispatches": device.counters.dispatches - before["dispatches"],
            "submits": device.counters.submits - before["submits"],
            "bytesRead": device.counters.bytes_read - before["read"]}
