"""The dense family's ``ChatFormat`` (api.Model): raw completion of a prompt, BOS as the file
says (spec dense-gguf §5.1), stops at EOS and the end-of-generation tokens."""

from __future__ import annotations

from ..errors import InputError


class DenseChat:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def request_ids(self, tokenizer, *, prompt=None, query=None, tools=None, system=None) -> list:
        """A raw prompt: BOS (when the file asks for it) + the text's ids, special tokens parsed
        as llama.cpp's completion endpoint parses them."""
        if query is not None or tools is not None:
            raise InputError("query/tools: tool-calling prompts need the model's chat template; "
                             "pass prompt= for a raw completion")
        return tokenizer.encode(str(prompt), parse_special=True, add_special=True)

    @staticmethod
    def stop_ids(tokenizer) -> set:
        return set(tokenizer.stop_ids) if tokenizer is not None else set()

    @staticmethod
    def parse(text):
        return None
