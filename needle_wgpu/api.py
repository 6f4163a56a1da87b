"""The public surface, the same for every model family: load a model, generate (streamed or
whole), logits, tool calls, confidence.

A ``Model`` drives a family's GPU model through a small protocol (``families.py`` says which
family a file is): ``geometry`` (vocab, head_rows, max_seq_len), ``tokenizer``, ``chat`` (how a
request becomes ids, which ids stop, how a completion is parsed; ``Model.chat_format``), ``session(context, kv)``
(a ``models.session.ChunkedSession``) and ``describe()``.

The no-panic contract (docs/api.md) is enforced here: every number is saturated
(``sampling.py``), every structural problem is a ``NeedleError``, and a failed request leaves the
engine usable for the next one.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

from .chat.tools import Completion, tools_json
from .conversation import Conversation
from .errors import ContextFullError, DepthError, InputError, NeedleError, UnsupportedModelError
from .families import open_gpu_model
from .formats.cact import CONFIDENCE_HEAD
from .generation import Decoded, Steps, TokenEvent, decode, round_tokens  # noqa: F401  TokenEvent: part of this surface
from .gpu.device import Device
from .grammar import Automaton, Constraint, GrammarError, Vocabulary
from .inputs import (as_text, callback_or_none, check_keywords, checked_methods, flag, id_list, instance_or_none,
                     optional_text, stop_strings)
from .logprobs import probability_of_logit, saturate_top_logprobs
from .openai import chat_completion
from .sampling import Sampling, clamp_budget, saturate_ids
from .speculative import SpeculativeDecoder, speculative_option


@dataclass
class GenerationResult:
    text: str
    ids: list
    finish_reason: str  # "eos", "stop", "length" (budget or context), "empty", "stopped" (should_stop)
    prompt_tokens: int
    clamped_ids: int = 0
    time_to_first_token_s: float = 0.0
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    completion: Completion | None = None
    timings: dict = field(default_factory=dict)
    # Probability from the confidence head over prompt + completion, computed by the same
    # forward (the probe pool runs alongside prefill and decode); None without such a head.
    confidence: float | None = None
    # With logprobs=True: per produced token (as ``ids``) {"token", "logprob", "top_logprobs":
    # [{"token", "logprob"}]} (``logprobs.TokenLogprob.as_dict``); None otherwise.
    logprobs: list | None = None


@dataclass
class RouteResult:
    """The router head's output (§U a): three raw logits and the calibration stored with them
    (the decision rule is the closed engine's)."""

    logits: list
    calibration: list


@checked_methods
class Model:
    """A model on a GPU device. ``Model.load(source)`` (or ``needle_wgpu.load``) opens a .cact or
    GGUF file; a session (KV cache) is made per call."""

    def __init__(self, gpu_model):
        self.gpu = gpu_model
        self.geometry = gpu_model.geometry
        self.tokenizer = gpu_model.tokenizer
        self.chat_format = gpu_model.chat  # the family's prompt/stop/parse rules
        self.capabilities = gpu_model.capabilities  # models.protocols.Capabilities: what it can do
        self._vocabulary = None  # the grammar's byte trie of the vocabulary, built at the first constraint
        self._constraints: dict = {}  # Model.constraint's cache

    @classmethod
    def load(cls, source, device=None, progress=None, numerics="float", depth=None) -> "Model":
        """Open a model file (path or bytes; the family is told by its magic) on ``device``
        (default: the native device). ``numerics``: "float" or "deploy" (Needle 3 only:
        upstream's quant=True arithmetic, docs/api.md "Numerics"). ``depth``: run that rung of
        a Needle 3 file's ladder (§10) over the uploaded full-depth weights; ``DepthError``
        where the file has none."""

        instance_or_none(device, Device, "device", " (open one with needle_wgpu.gpu.open_device())")
        callback_or_none(progress, "progress")
        return cls(open_gpu_model(source, device=device, progress=progress, numerics=numerics, depth=depth))

    def describe(self) -> dict:
        """What the model is: family, geometry, sizes (the ``info`` command prints it)."""
        return self.gpu.describe()

    @property
    def warnings(self) -> list:
        """What is wrong with the loaded file (non-finite weights): empty for a sound model."""
        return list(self.gpu.warnings)

    # ------------------------------------------------------------------ prompts
    def encode_request(self, prompt=None, *, query=None, tools=None, system=None, ids=None) -> list:
        """Token ids of a request: explicit ids, a tool-calling prompt (query + tools), or free text."""
        if ids is not None:
            return id_list(ids)
        if query is not None or tools is not None:
            query, system = as_text(query, "query"), optional_text(system, "system")
            return self.chat_format.request_ids(self._need_tokenizer(), query=query, tools=tools, system=system)
        prompt = as_text(prompt, "prompt")
        if not prompt:
            return []
        return self.chat_format.request_ids(self._need_tokenizer(), prompt=prompt)

    def encode(self, text) -> list:
        """The tokenizer's ids of ``text`` (no BOS, no template)."""
        return self._need_tokenizer().encode(str(text))

    def decode(self, ids) -> str:
        """Text of token ids: each saturated to u32, then ids >= vocab read as vocab - 1."""
        tokenizer = self._need_tokenizer()
        request, _ = saturate_ids(id_list(ids))
        last = self.geometry.vocab - 1  # as the embedding lookup clamps them
        decoder = tokenizer.stream_decoder(at_text_start=True)
        return "".join(decoder.push(min(i, last)) for i in request) + decoder.finish()

    def _need_tokenizer(self):
        if self.tokenizer is None:
            raise NeedleError("this model file has no tokenizer record: pass token ids instead of text")
        return self.tokenizer

    # ------------------------------------------------------------------ generation
    def stream(self, prompt=None, *, query=None, tools=None, system=None, ids=None, max_tokens=256,
               temperature=0.0, top_k=0, top_p=1.0, seed=0, stop=(), kv=None, context=None,
               constrained=None, result: GenerationResult | None = None, should_stop=None, min_p=0.0,
               repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, penalty_last_n=64,
               logit_bias=None, logprobs=False, top_logprobs=0, speculative=None, tokens_per_round=None):
        """Yield ``TokenEvent`` as tokens are produced; fills ``result`` (if given) at the end.

        Sampling options saturate as ``Sampling.saturate`` says (docs/api.md). ``logprobs``:
        ``result.logprobs`` gets each produced token's logprob and its ``top_logprobs`` (0 to 20)
        most likely alternatives, from one readback of the logits row per token
        (``needle_wgpu.logprobs``); without it a step reads back only the id.

        ``speculative=(depth, k)`` (Needle 3): self-speculative decoding, the depth-``depth``
        rung of the same weights drafting ``k`` ids per round for the full model to verify
        (``needle_wgpu.speculative``); greedy output is unchanged, sampled output follows the
        speculative-sampling rule. Not with constrained decoding, logprobs, penalties,
        logit_bias or min_p.

        ``constrained`` (default: on for tool calls, where the family has an answer grammar):
        every sampled id keeps the answer inside the grammar (tool names, schema-valid
        arguments, ``[]`` allowed), the mask applied on the GPU before sampling. A
        ``grammar.Constraint`` (``Model.constraint``, e.g. over ``compile_schema``) keeps the
        completion inside that grammar instead.

        ``should_stop(done, total)`` (optional) is asked before each prefill chunk (prompt
        positions done, prompt length) and before each decode step (tokens produced, budget);
        a true answer ends the request with finish reason "stopped".

        ``tokens_per_round`` (None: the device's ``round_tokens``): decode steps per submit and
        readback (``generation.Steps``); the ids are the same for every value.
        """
        g = self.geometry
        instance_or_none(result, GenerationResult, "result")
        callback_or_none(should_stop, "should_stop")
        matcher = self._matcher(tools, constrained, query is not None or tools is not None)
        spec = self._speculative(speculative, matcher)
        request = self.encode_request(prompt, query=query, tools=tools, system=system, ids=ids)
        request, clamped = saturate_ids(request, vocab=g.vocab)
        sampling = Sampling.saturate(temperature, top_k, top_p, seed, vocab=g.head_rows, min_p=min_p,
                                     repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                                     frequency_penalty=frequency_penalty, penalty_last_n=penalty_last_n,
                                     logit_bias=logit_bias)
        top = saturate_top_logprobs(top_logprobs) if flag(logprobs, "logprobs") else None
        if spec is not None and (top is not None or sampling.processes_logits or sampling.min_p > 0):
            raise InputError("speculative decoding takes temperature, top_k, top_p and seed only (no logprobs, "
                             "penalties, logit_bias or min_p)")
        stops = self.chat_format.stop_ids(self.tokenizer)
        stop_texts = stop_strings(stop)
        out = GenerationResult("", [], "empty", len(request), clamped)
        if result is not None:  # the caller's result starts afresh, whatever it held
            for name, value in vars(out).items():
                setattr(result, name, value)
            out = result
        if not request:
            out.finish_reason = "empty"
            return
        # Tool-call requests score confidence in the same forward, when the model has a head
        # it can finish (a head over the host budget leaves generation unscored, not refused).
        scored = (query is not None or tools is not None) and self.capabilities.confidence
        pooled = scored and spec is None  # speculative sessions rewind: they score afterwards
        session = self.gpu.session(context=context, kv=kv, confidence=True) if pooled else \
            self.gpu.session(context=context, kv=kv)
        steps = Steps(session, round_tokens=round_tokens(tokens_per_round, self.gpu.device))
        try:
            # prompt + completion <= context. A prompt that fills the context (or is longer),
            # or max_tokens <= 0, leaves no room: finish "length" without running the model.
            budget = clamp_budget(max_tokens, session.context - len(request))
            if spec is not None and budget > 0:
                draft = self.gpu.at_depth(spec[0]).session(context=session.context, kv=kv)
                steps.speculator = SpeculativeDecoder(session, draft, spec[1], sampling)
            decoder = self.tokenizer.stream_decoder(at_text_start=False, stop_strings=stop_texts) \
                if self.tokenizer else None
            decoded = Decoded(ids=out.ids)  # shared: a device lost mid-way leaves the ids so far
            yield from decode(steps, request, decoded, sampling=sampling, budget=budget, stop_ids=stops,
                              decoder=decoder, matcher=matcher, should_stop=should_stop, top_logprobs=top)
            out.ids, out.text, out.finish_reason = decoded.ids, decoded.text, decoded.finish_reason
            out.logprobs, out.timings = decoded.logprobs, decoded.timings
            if not decoded.sampled:  # nothing ran (no room), or stopped during the prefill
                return
            out.time_to_first_token_s = decoded.prefill_s
            out.prefill_tokens_per_s = len(request) / max(decoded.prefill_s, 1e-9)
            out.decode_tokens_per_s = decoded.decode_tokens_per_s
            speculator = steps.speculator
            if speculator is not None:
                out.timings["speculative"] = {"depth": spec[0], "k": speculator.k, "rounds": speculator.rounds,
                                              "drafted": speculator.drafted, "accepted": speculator.accepted,
                                              "acceptance": round(speculator.acceptance, 4)}
            if scored and not pooled:
                out.confidence = self.confidence(request + out.ids)
            elif scored:
                # The pool holds every position fed so far; the last kept id is fed unless it
                # was sampled and never run (budget or stop text): one position, no second pass.
                fed = session.position - len(request)
                if fed < len(out.ids) and session.position < session.context:
                    session.prefill(out.ids[fed:][: session.context - session.position])
                out.confidence = probability_of_logit(session.confidence_logit_so_far())
        finally:
            session.close()
            if steps.speculator is not None:
                steps.speculator.draft.close()

    def _speculative(self, speculative, matcher):
        """``stream``'s speculative option checked: None, or (draft depth, k)."""
        if speculative is None:
            return None
        if not self.capabilities.depth_ladder:
            raise DepthError("speculative decoding drafts with a rung: only Needle 3 files have a ladder")
        if not self.capabilities.verify:
            raise UnsupportedModelError("this model's sessions cannot verify drafts")
        if matcher is not None:
            raise InputError("speculative decoding does not take constrained decoding (pass constrained=False)")

        return speculative_option(speculative, self.gpu.full.stored_geometry.num_layers, self.geometry.num_layers)

    def _matcher(self, tools, constrained, tool_request: bool):
        """A grammar matcher for a constrained request, or None (vocabulary trie built once).
        ``constrained`` may be a ``grammar.Constraint`` (``Model.constraint``): that grammar."""

        if isinstance(constrained, Constraint):
            return constrained.matcher()
        constraint = self._answer_constraint(tools, constrained, tool_request)
        return None if constraint is None else constraint.matcher()

    def _answer_constraint(self, tools, constrained, tool_request: bool):
        """The ``grammar.Constraint`` of a tool request's answer in the chat format's tool-call
        format (``chat.tool_calls.ToolCallFormat``; built once per tools JSON), or None where
        the request is not constrained. ``constrained`` None: on for tool requests where the
        format has an answer grammar (one that may decline: Needle 3), off when the schemas are
        outside the grammar's subset; True: the answer grammar, else at least one call (as
        ``Model.chat``'s ``tool_choice="required"``), and raises for either problem."""
        calls = self.chat_format.tool_calls
        answer = calls.answer_grammar if calls is not None else None
        wanted = tool_request and answer is not None if constrained is None else bool(constrained)
        if not wanted:
            return None
        if calls is None:
            raise UnsupportedModelError("this model's chat template writes tool calls in a format the engine "
                                        "cannot constrain (only <tool_call> blocks and Needle 3's answer)")
        grammar_of = answer or calls.required_grammar

        try:
            return self.constraint(f"{calls.name}:{'answer' if answer else 'required'}:{compact_key(tools)}",
                                   lambda: grammar_of(tools))
        except GrammarError:
            if constrained:  # asked for: the schema's problem is the caller's
                raise
            return None  # the default: tools outside the schema subset run unconstrained

    def constraint(self, key: str, nodes):
        """The ``grammar.Constraint`` of a grammar over this model's vocabulary, built once per
        ``key`` (``nodes()`` gives the grammar's automaton nodes, e.g. ``compile_schema``'s);
        the vocabulary's byte trie is built once per model. Its ``matcher()`` drives one
        generation (``Conversation.stream(constraint=...)``)."""
        if not self.capabilities.mask or self.tokenizer is None:
            raise UnsupportedModelError("this model cannot decode under a grammar (no mask support or tokenizer)")

        cache = self._constraints
        constraint = cache.get(key)
        if constraint is None:
            vocabulary = self._vocabulary
            if vocabulary is None:
                stops = self.chat_format.stop_ids(self.tokenizer)
                vocabulary = self._vocabulary = Vocabulary.of_tokenizer(self.tokenizer, rows=self.geometry.head_rows,
                                                                        eos_ids=stops)
            constraint = cache[key] = Constraint(Automaton(nodes()), vocabulary)
        return constraint

    def generate(self, prompt=None, **options) -> GenerationResult:
        """Run a whole request; returns text, ids, finish reason, timing and parsed tool calls."""
        check_keywords("generate", options, GENERATE_OPTIONS)
        result = GenerationResult("", [], "empty", 0)
        for _ in self.stream(prompt, result=result, **options):
            pass
        if options.get("query") is not None or options.get("tools") is not None:
            result.completion = self.chat_format.parse(result.text)
        return result

    # ------------------------------------------------------------------ conversations
    def conversation(self, system=None, *, tools=None, context=None, kv=None, confidence=False):
        """A ``conversation.Conversation``: messages rendered with the model's chat template
        over one session whose KV cache is kept across turns (``confidence``: the session
        runs the confidence head, ``Conversation.confidence()``)."""

        return Conversation(self, system=system, tools=tools, context=context, kv=kv, confidence=confidence)

    def chat(self, messages, tools=None, *, tool_choice="auto", response_format=None, stream=False, max_tokens=256,
             temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0,
             frequency_penalty=0.0, penalty_last_n=None, logit_bias=None, stop=(), seed=0, logprobs=False,
             top_logprobs=0, kv=None, context=None, tokens_per_round=None):
        """An OpenAI-style chat completion of ``messages`` (``openai.py``): a
        ``chat.completion`` dict (``choices[0].message`` with ``content`` and ``tool_calls``,
        ``finish_reason`` stop/length/tool_calls, ``usage``), or with ``stream=True`` an
        iterator of ``chat.completion.chunk`` dicts ending with one that carries ``usage``.
        ``tool_choice`` "required" or a named function and ``response_format`` JSON constrain
        the reply to the format (docs/api.md)."""

        return chat_completion(self, messages, tools, tool_choice=tool_choice, response_format=response_format,
                               stream=stream, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                               top_k=top_k, min_p=min_p, repetition_penalty=repetition_penalty,
                               presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                               penalty_last_n=penalty_last_n, logit_bias=logit_bias, stop=stop, seed=seed,
                               logprobs=logprobs, top_logprobs=top_logprobs, kv=kv, context=context,
                               tokens_per_round=tokens_per_round)

    # ------------------------------------------------------------------ analysis
    def confidence(self, ids=None, *, prompt=None, completion=None) -> float:
        """Probability from the confidence head (§7) for prompt + completion ids (BOS first).

        Pass ``ids`` directly, or a prompt and a completion as text. Empty input -> 0.5 (no
        evidence either way). Raises UnsupportedModelError when the file has no such head.
        """
        if CONFIDENCE_HEAD not in self.capabilities.heads:
            raise UnsupportedModelError("this model has no confidence head")
        if ids is None:
            scored = as_text(prompt, "prompt") + as_text(completion, "completion")
            tokenizer = self._need_tokenizer()
            ids = [tokenizer.bos_id] + tokenizer.encode(scored)
        request, _ = saturate_ids(id_list(ids))
        if not request:
            return 0.5
        # the heads' pass: pad ids (0) masked as in upstream's hidden cells (§U a)
        session = self.gpu.session(context=min(len(request), self.geometry.max_seq_len), confidence=True,
                                   pad_masked=True)
        try:
            logit = session.confidence_logit(request[: session.context])
        finally:
            session.close()
        return probability_of_logit(logit)

    def embed(self, text=None, *, ids=None) -> list:
        """An L2-normalised embedding of ``text`` (``embedding_ids`` encodes it) or explicit
        ``ids``: a Needle 3 file's embedding head (§7, §U a), or a dense file's final hidden
        states pooled as the file says (``needle_wgpu.pooling``: mean unless it says cls or
        last). Raises UnsupportedModelError for a model with neither (a reranker's rank pooling)."""
        if not self.capabilities.embeds:
            raise UnsupportedModelError("this model gives no embeddings (no embedding head, no pooling)")
        if not self.capabilities.pooling:
            return self._head_output(1, "embedding", text, ids)
        request, _ = saturate_ids(id_list(ids if ids is not None else self.embedding_ids(text)))
        if not request:
            raise NeedleError("embedding needs at least one token")
        if len(request) > self.geometry.max_seq_len:  # never cut silently
            raise ContextFullError(f"embedding: {len(request)} ids, more than the context of "
                                   f"{self.geometry.max_seq_len}")
        session = self.gpu.session(context=len(request))
        try:
            return session.embedding(request)
        finally:
            session.close()

    def embedding_ids(self, text) -> list:
        """The ids ``embed(text)`` runs: BOS + the text's ids for a Needle 3 head; a dense file's
        plain prompt encoding (BOS as the file says, special tokens parsed)."""
        tokenizer = self._need_tokenizer()
        text = as_text(text, "text")
        if self.capabilities.pooling:
            return self.chat_format.request_ids(tokenizer, prompt=text)
        return [tokenizer.bos_id] + tokenizer.encode(text)

    def route(self, text=None, *, ids=None) -> "RouteResult":
        """The router head's three raw logits and its stored calibration (§U a)."""
        logits = self._head_output(3, "router", text, ids)
        return RouteResult(logits, list(self.gpu.heads[3].calibration))

    def _head_output(self, code: int, name: str, text, ids) -> list:
        """One probe head over BOS + text (or ``ids``): one prefill, its pool read back."""
        if code not in self.capabilities.heads:
            raise UnsupportedModelError(f"this model has no {name} head")
        request, _ = saturate_ids(id_list(ids if ids is not None else self.embedding_ids(text)))
        if not request:
            raise NeedleError(f"{name} needs at least one token")
        session = self.gpu.session(context=min(len(request), self.geometry.max_seq_len), heads=(code,),
                                   pad_masked=True)  # pad ids (0) masked as in upstream's hidden cells (§U a)
        try:
            session.prefill(request[: session.context])
            return list(session.head_output(code))
        finally:
            session.close()


    def logits(self, ids, kv=None, context=None):
        """Logits of every position as a list of float lists (rows = head_rows); [] when empty."""
        request, _ = saturate_ids(id_list(ids))
        if not request:
            return []
        session = self.gpu.session(context=context, kv=kv)
        try:
            if len(request) > session.context:  # never cut silently (a file's context_length may be 1)
                raise ContextFullError(f"logits: {len(request)} ids, more than the context of {session.context}")
            return session.all_logits(request)
        finally:
            session.close()


def compact_key(tools) -> str:
    return tools_json(tools)


# generate's options: stream's keywords except ``result`` (generate returns its own).
GENERATE_OPTIONS = tuple(name for name in inspect.signature(Model.stream).parameters
                         if name not in ("self", "prompt", "result"))

Needle3 = Model  # the first family's name for the same surface
