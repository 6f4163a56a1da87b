"""OpenAI request fields -> the engine's keywords (``Model.chat``, ``Model.stream``), with the
defaults of OpenAI's API where they differ from the library's: temperature 1.0, a fresh seed per
request unless one is given, and no token limit but the context's."""

from __future__ import annotations

import secrets

from .config import Limits
from .errors import bad_request

UNLIMITED = 1 << 31  # max_tokens absent: the engine clamps it to the room the context leaves


def sampling(request, *, penalty_last_n_default) -> dict:
    """The sampling keywords shared by chat and raw completions."""
    if request.n not in (None, 1):
        raise bad_request("n: only one choice per request is served (n=1)", param="n")
    seed = request.seed if request.seed is not None else secrets.randbits(32)
    options = {"temperature": _or(request.temperature, 1.0), "top_p": _or(request.top_p, 1.0),
               "top_k": _or(request.top_k, 0), "min_p": _or(request.min_p, 0.0),
               "repetition_penalty": _or(request.repetition_penalty, 1.0),
               "presence_penalty": _or(request.presence_penalty, 0.0),
               "frequency_penalty": _or(request.frequency_penalty, 0.0),
               "penalty_last_n": _or(request.penalty_last_n, penalty_last_n_default),
               "logit_bias": logit_bias(request.logit_bias), "stop": stop(request.stop), "seed": seed}
    return options


def chat_request(request, limits: Limits) -> dict:
    """``Model.chat``'s keywords for a ``ChatCompletionRequest``."""
    if len(request.messages) > limits.max_messages:
        raise bad_request(f"messages: at most {limits.max_messages} in one request", param="messages")
    max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    return {"messages": [message(m, i) for i, m in enumerate(request.messages)], "tools": request.tools,
            "tool_choice": request.tool_choice if request.tool_choice is not None else "auto",
            "response_format": request.response_format, "max_tokens": _or(max_tokens, UNLIMITED),
            "logprobs": bool(request.logprobs), "top_logprobs": _or(request.top_logprobs, 0),
            **sampling(request, penalty_last_n_default=None)}


def completion_request(request, limits: Limits) -> tuple:
    """(prompt: text or ids, ``Model.stream``'s keywords, logprobs count or None)."""
    if request.echo:
        raise bad_request("echo is not served", param="echo")
    if request.best_of not in (None, 1):
        raise bad_request("best_of: only 1 is served", param="best_of")
    if request.suffix:
        raise bad_request("suffix (insertion) is not served", param="suffix")
    prompt = request.prompt
    if isinstance(prompt, list):
        if prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise bad_request("prompt: one prompt per request (a list of one is fine)", param="prompt")
            prompt = prompt[0]
        if len(prompt) > (1 << 20):
            raise bad_request("prompt: too many token ids", param="prompt")
    options = sampling(request, penalty_last_n_default=64)
    options["max_tokens"] = _or(request.max_tokens, UNLIMITED)
    return prompt, options, request.logprobs


def embedding_inputs(request, limits: Limits) -> list:
    """The inputs of an ``EmbeddingRequest`` as a list of texts or id lists."""
    if request.dimensions is not None:
        raise bad_request("dimensions: the embedding head's own width is the only one served", param="dimensions")
    given = request.input
    if isinstance(given, str):
        inputs = [given]
    elif given and all(isinstance(i, int) for i in given):
        inputs = [given]
    else:
        inputs = list(given)
    if not inputs:
        raise bad_request("input: at least one text or list of token ids", param="input")
    if len(inputs) > limits.max_messages:
        raise bad_request(f"input: at most {limits.max_messages} items in one request", param="input")
    for i, item in enumerate(inputs):
        if isinstance(item, list) and not item:
            raise bad_request(f"input[{i}]: an empty list of token ids", param="input")
    return inputs


def message(m, index: int) -> dict:
    """A message as ``Model.chat`` reads it: text parts joined, "developer" read as "system"."""
    out = m.model_dump(exclude_none=True)
    if out.get("role") == "developer":
        out["role"] = "system"
    content = out.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"messages[{index}].content: only text parts ({{'type': 'text', 'text': ...}}) "
                                  f"are served, got {str(part.get('type'))[:40]!r}", param=f"messages[{index}].content")
            texts.append(part["text"])
        out["content"] = "".join(texts)
    return out


def logit_bias(bias) -> dict | None:
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        try:
            out[int(key)] = value
        except ValueError:
            raise bad_request(f"logit_bias: keys are token ids, got {key[:40]!r}", param="logit_bias") from None
    return out


def stop(value) -> list:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def _or(value, default):
    return default if value is None else value
