"""The dense family's ``ChatFormat`` (api.Model): raw completion of a prompt, BOS as the file
says (spec dense-gguf §5.1), the file's chat template for conversations and tool-calling
requests (§5.5, ``template.py``), stops at EOS and the end-of-generation tokens."""

from __future__ import annotations

from .template import ChatTemplate
from .tools import Completion, call_arguments, check_tools
from .tool_calls import TAGGED, parse_reply


def _token_text(tokenizer, token_id) -> str:
    try:
        return tokenizer.piece(token_id) if token_id is not None else ""
    except Exception:  # an id the vocabulary lacks: the template gets no such token
        return ""


class DenseChat:
    renders_reply_ids = False  # a conversation re-renders replies from their text

    def __init__(self, tokenizer, template_source: str | None = None):
        self.tokenizer = tokenizer
        bos = _token_text(tokenizer, tokenizer.bos_token_id)
        eos = _token_text(tokenizer, tokenizer.eos_id)
        self.template = ChatTemplate(template_source, bos_token=bos, eos_token=eos)
        # the template's tool-call format, where the engine can constrain it (else None)
        self.tool_calls = TAGGED if self.template.tool_call_format == "tagged" else None

    def request_ids(self, tokenizer, *, prompt=None, query=None, tools=None, system=None) -> list:
        """A raw prompt: BOS (when the file asks for it) + the text's ids, special tokens parsed
        as llama.cpp's completion endpoint parses them. With query/tools: the chat template's
        rendering of [system,] user query, tools passed to it."""
        if query is not None or tools is not None:
            messages = ([{"role": "system", "content": system}] if system is not None else [])
            messages.append({"role": "user", "content": query or ""})
            return self.render_ids(tokenizer, messages, check_tools(tools) or None)
        return self.text_ids(tokenizer, str(prompt))

    @staticmethod
    def text_ids(tokenizer, text: str) -> list:
        """A text's ids with special tokens parsed, BOS/EOS as the file says (never BOS twice)."""
        return tokenizer.encode(text, parse_special=True, add_special=True)

    def render_ids(self, tokenizer, messages, tools=None, add_generation_prompt: bool = True) -> list:
        """Ids of the rendered conversation (a rendered BOS is not doubled)."""
        return self.text_ids(tokenizer, self.template.render(messages, tools, add_generation_prompt))

    @staticmethod
    def stop_ids(tokenizer) -> set:
        return set(tokenizer.stop_ids) if tokenizer is not None else set()

    @staticmethod
    def parse(text):
        """Tool calls of an answer as a ``Completion`` (``tool_calls`` as name + arguments)."""
        reply = parse_reply(text)
        calls = [{"name": c["function"]["name"], "arguments": call_arguments(c["function"]["arguments"])}
                 for c in reply.tool_calls]
        return Completion(None, calls if calls else None, str(text), reply.problems)

