"""The request bodies as pydantic models: they make the server's OpenAPI schema, and a body that
does not fit one (a string where a number goes, no ``messages``) is a 422. What the engine
checks itself (a message's role and content, tools, ``tool_choice``, ``response_format``, every
number's range) is left loose here and refused by it with a 400 that names the problem.

Fields OpenAI defines and the engine does not use (``user``, ``metadata``, ``store``,
``parallel_tool_calls``, ...) are accepted and ignored; ``n`` above 1, ``echo``, ``best_of`` and
``suffix`` are refused.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Request):
    include_usage: Optional[bool] = None


class Message(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(
        description="developer is read as system")
    content: Union[str, list[dict[str, Any]], None] = Field(
        default=None, description="text, or a list of {'type': 'text', 'text': ...} parts")
    name: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None
    tool_call_id: Optional[str] = None


Stop = Union[str, list[str], None]


class Sampling(_Request):
    """The sampling options shared by chat and raw completions (docs/api.md, ``Model.stream``)."""

    max_tokens: Optional[int] = Field(default=None, description="generated tokens at most (default: the "
                                      "rest of the context)")
    temperature: Optional[float] = Field(default=None, description="default 1.0, as OpenAI's")
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    penalty_last_n: Optional[int] = None
    logit_bias: Optional[dict[str, float]] = Field(default=None, description="token id (as text) -> bias")
    stop: Stop = None
    seed: Optional[int] = Field(default=None, description="default: a fresh random seed per request")
    n: Optional[int] = Field(default=None, description="1 (the only value served)")
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None


class ChatCompletionRequest(Sampling):
    model: str
    messages: list[Message]
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Union[Literal["none", "auto", "required"], dict[str, Any], None] = None
    response_format: Optional[dict[str, Any]] = None
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None


class CompletionRequest(Sampling):
    model: str
    prompt: Union[str, list[str], list[int], list[list[int]]] = Field(
        description="text or token ids (one prompt: a list holds one)")
    logprobs: Optional[int] = Field(default=None, description="alternatives per token, 0 to 20")
    echo: Optional[bool] = None
    best_of: Optional[int] = None
    suffix: Optional[str] = None


class EmbeddingRequest(_Request):
    model: str
    input: Union[str, list[str], list[int], list[list[int]]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = None
