"""What a request runs on its model's worker thread: the bodies of ``scheduler.Job``.

Each is a generator of payloads: the chunks of a streamed response (OpenAI's
``chat.completion.chunk`` / ``text_completion``), or the one response of a request that is not
streamed. The engine does the work (``openai.chat_completion``, ``Model.stream``,
``Model.embed``); a body only adds the served model's name, asks the job's ``should_stop``
before every prefill chunk and decode step, and reports the usage for the metrics.

A streamed body runs up to its first token before it yields anything, so a request the engine
refuses (a prompt longer than the context, a schema outside the grammar subset) is an HTTP
error, not a stream that ends in one.
"""

from __future__ import annotations

import base64
import itertools
import struct
import time
import uuid

from ..api import GenerationResult
from ..generation import openai_finish_reason
from ..openai import chat_completion, openai_logprobs
from .errors import bad_request

def chat_body(request: dict, *, served: str, stream: bool, include_usage: bool, context=None, kv=None):
    """``request``: ``Model.chat``'s keywords (messages, tools, tool_choice, response_format and
    the sampling options)."""

    def body(model, job):
        cache = job.prefix_cache
        conversation = None if cache is None else \
            cache.take(model, request.get("messages"), request.get("tools"), context=context, kv=kv)
        options = dict(request, context=context, kv=kv, should_stop=job.should_stop, conversation=conversation)
        try:
            yield from _chat(model, job, options)
        finally:
            if conversation is not None:
                cache.give(conversation, context=context, kv=kv)

    def _chat(model, job, options):
        if not stream:
            response = chat_completion(model, stream=False, **options)
            response["model"] = served
            _report(job, response["usage"], response.get("stats", {}))
            yield response
            return
        chunks = chat_completion(model, stream=True, **options)
        try:
            started = list(itertools.islice(chunks, 2))  # the role chunk, then the first token (or the end)
            for chunk in itertools.chain(started, chunks):
                chunk["model"] = served
                if chunk.get("usage") is not None:
                    _report(job, chunk["usage"], chunk.get("stats", {}))
                    if not include_usage:
                        continue
                yield chunk
        finally:
            chunks.close()

    return body


def completion_body(prompt, *, served: str, stream: bool, include_usage: bool, options: dict, logprobs: int | None,
                    context=None, kv=None):
    """A raw completion of ``prompt`` (text, or token ids): ``Model.stream``'s options."""

    def body(model, job):
        result = GenerationResult("", [], "empty", 0)
        source = {"ids": prompt} if isinstance(prompt, list) else {"prompt": prompt}
        extra = {"logprobs": True, "top_logprobs": logprobs} if logprobs is not None else {}
        events = model.stream(**source, result=result, should_stop=job.should_stop, context=context, kv=kv,
                              **options, **extra)
        header = {"id": "cmpl-" + uuid.uuid4().hex[:24], "object": "text_completion", "created": int(time.time()),
                  "model": served}

        def choice(text, finish=None, with_logprobs=False):
            return {"index": 0, "text": text,
                    "logprobs": _completion_logprobs(model, result.logprobs) if with_logprobs else None,
                    "finish_reason": finish}

        def usage():
            used = {"prompt_tokens": result.prompt_tokens, "completion_tokens": len(result.ids),
                    "total_tokens": result.prompt_tokens + len(result.ids)}
            _report(job, used, {"prefill_s": result.time_to_first_token_s,
                                "decode_tokens_per_s": result.decode_tokens_per_s})
            return used

        try:
            if not stream:
                for _ in events:
                    pass
                finish = openai_finish_reason(result.finish_reason)
                yield {**header, "choices": [choice(result.text, finish, logprobs is not None)], "usage": usage()}
                return
            started = list(itertools.islice(events, 1))  # up to the first token: refusals before the stream
            for event in itertools.chain(started, events):
                if event.text:
                    yield {**header, "choices": [choice(event.text)]}
            finish = openai_finish_reason(result.finish_reason)
            yield {**header, "choices": [choice("", finish, logprobs is not None)]}
            used = usage()
            if include_usage:
                yield {**header, "choices": [], "usage": used}
        finally:
            events.close()

    return body


def embeddings_body(inputs: list, *, served: str, encoding_format: str):
    """``inputs``: texts, or lists of token ids. ``Model.embed`` per input: a Needle 3 file's
    embedding head or a dense file's pooled last hidden states."""

    def body(model, job):
        if not model.capabilities.embeds:
            raise bad_request(f"the model {served!r} gives no embeddings (no embedding head, and a pooling "
                              "that is not mean, cls or last)", param="model", code="embeddings_unsupported")
        data, tokens = [], 0
        for index, item in enumerate(inputs):
            if job.should_stop(index, len(inputs)):
                break
            if isinstance(item, str):
                if model.tokenizer is None:
                    raise bad_request("this model file has no tokenizer: give token ids as input", param="input")
                ids = model.embedding_ids(item)  # as Model.embed(text) encodes it
            else:
                ids = list(item)
            vector = model.embed(ids=ids)
            tokens += len(ids)
            if encoding_format == "base64":
                vector = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
            data.append({"object": "embedding", "index": index, "embedding": vector})
        job.usage = {"prompt_tokens": tokens}
        yield {"object": "list", "data": data, "model": served,
               "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    return body


def _report(job, usage: dict, stats: dict) -> None:
    """The usage and latencies of a finished generation, for the metrics."""
    queued = (job.started or job.submitted) - job.submitted
    rate = stats.get("decode_tokens_per_s") or 0.0
    job.usage = {"prompt_tokens": usage.get("prompt_tokens", 0), "completion_tokens": usage.get("completion_tokens", 0),
                 "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                 "ttft_s": queued + stats.get("prefill_s", 0.0) if usage.get("completion_tokens") else None,
                 "per_token_s": 1.0 / rate if rate > 0 else None}


def _completion_logprobs(model, entries) -> dict | None:
    """The legacy completions ``logprobs``: tokens, their logprobs, the alternatives as
    {token: logprob} and each token's offset in the text."""
    chat_form = openai_logprobs(model, entries)
    if chat_form is None:
        return None
    tokens, offsets, offset = [], [], 0
    for entry in chat_form["content"]:
        tokens.append(entry["token"])
        offsets.append(offset)
        offset += len(entry["token"])
    return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in chat_form["content"]],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in chat_form["content"]],
            "text_offset": offsets}
