"""``tokenizer_from_gguf``: the tokenizer a GGUF file's ``tokenizer.ggml.*`` metadata describes
(dense-gguf spec §5). ``gpt2`` files get byte-level BPE (``bpe_tokenizer``), ``llama`` files the
SentencePiece-style encoder (``gguf_spm_tokenizer``); both share ``gguf_vocab``.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..errors import ContainerError, UnsupportedModelError
from .bpe_tokenizer import BpeTokenizer
from .gguf_spm_tokenizer import SpmTokenizer
from .gguf_vocab import GgufTokenizer
from .stream_decoder import StreamDecoder

__all__ = ["tokenizer_from_gguf", "GgufTokenizer", "BpeTokenizer", "SpmTokenizer",
           "StreamDecoder"]

_MODELS = {"gpt2": BpeTokenizer, "llama": SpmTokenizer}


def tokenizer_from_gguf(metadata: Mapping[str, object]) -> GgufTokenizer:
    """Build the tokenizer from GGUF metadata: a mapping of keys to plain values (str, int,
    float, bool, lists of them), as the GGUF reader returns them.

    Raises ContainerError when the tokenizer keys are missing or malformed, and
    UnsupportedModelError for a tokenizer model other than ``gpt2`` and ``llama``.
    """
    if not isinstance(metadata, Mapping):
        raise ContainerError(f"tokenizer: metadata is a {type(metadata).__name__}, not a mapping")
    model = metadata.get("tokenizer.ggml.model")
    if model is None:
        raise ContainerError("tokenizer: tokenizer.ggml.model is missing")
    cls = _MODELS.get(model) if isinstance(model, str) else None
    if cls is None:
        raise UnsupportedModelError(
            f"tokenizer: model {model!r} is not supported (only 'gpt2' and 'llama')")
    return cls(metadata)
