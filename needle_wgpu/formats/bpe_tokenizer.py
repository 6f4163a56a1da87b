"""Byte-level BPE from GGUF metadata (``tokenizer.ggml.model = gpt2``; dense-gguf spec §5.2).

Per text fragment (special tokens are already cut out, ``gguf_vocab``): split it with the
pre-tokenizer expressions of ``tokenizer.ggml.pre``, each splitting every piece the previous one
left; map each piece's UTF-8 bytes to GPT-2's byte-to-unicode characters; merge adjacent
symbols by lowest merge rank (ties: the leftmost pair) as llama.cpp's ``llm_tokenizer_bpe``.

Python's ``re`` has no ``\\p{..}``: the expressions are written as llama.cpp has them and
``_expand`` substitutes the generated code-point ranges of ``unicode_ranges`` for ``\\p{L}``,
``\\p{N}``, ``\\p{P}`` and llama.cpp's ``\\s`` (which, unlike Python's, excludes U+001C..U+001F).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from . import unicode_ranges
from .gguf_vocab import KEY, GgufTokenizer, _fail, _sequence, merge_adjacent

GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_QWEN2_TAIL = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2_HEAD = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
QWEN2 = _QWEN2_HEAD + r"|\p{N}" + _QWEN2_TAIL
LLAMA3 = _QWEN2_HEAD + r"|\p{N}{1,3}" + _QWEN2_TAIL

# name -> (expressions applied in sequence, ignore_merges, add_bos default); llama-vocab.cpp.
PRE_TOKENIZERS = {
    "default": ((r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"), False, False),
    "gpt2": ((GPT2,), False, False),
    "smollm": ((r"\p{N}", GPT2), False, False),
    "qwen2": ((QWEN2,), False, False),
    "llama-bpe": ((LLAMA3,), True, True),
}
# Other names llama.cpp gives the same expressions.
PRE_ALIASES = {
    "gpt-2": "gpt2", "mpt": "gpt2", "olmo": "gpt2", "phi-2": "gpt2", "jina-es": "gpt2",
    "jina-de": "gpt2", "jina-v2-es": "gpt2", "jina-v2-de": "gpt2", "exaone4": "gpt2",
    "starcoder": "smollm", "refact": "smollm", "command-r": "smollm", "codeshell": "smollm",
    "exaone": "smollm", "minerva-7b": "smollm", "mellum2": "smollm",
    "deepseek-r1-qwen": "qwen2", "stablelm2": "qwen2", "megrez": "qwen2", "hunyuan": "qwen2",
    "llama3": "llama-bpe", "llama-v3": "llama-bpe", "falcon3": "llama-bpe",
    "pixtral": "llama-bpe", "lfm2": "llama-bpe",
}


def _ranges(spans) -> str:
    return "".join(f"\\U{a:08X}" if a == b else f"\\U{a:08X}-\\U{b:08X}" for a, b in spans)


_CLASS = {
    "L": _ranges(unicode_ranges.LETTER),
    "N": _ranges(unicode_ranges.NUMBER),
    "P": _ranges(unicode_ranges.PUNCTUATION),
    "s": _ranges(unicode_ranges.WHITESPACE),
}
_TOKEN = re.compile(r"\\p\{([LNP])\}|\\([sS])|\\.|[\[\]]|[^\\\[\]]+")


def _expand(expression: str) -> str:
    """Rewrite ``\\p{L}``, ``\\p{N}``, ``\\p{P}``, ``\\s`` and ``\\S`` as explicit classes,
    inside or outside brackets (the expressions never nest brackets)."""
    out, inside = [], False
    for match in _TOKEN.finditer(expression):
        category, space, piece = match.group(1), match.group(2), match.group()
        if category or space == "s":
            body = _CLASS[category or "s"]
            out.append(body if inside else f"[{body}]")
        elif space == "S":
            if inside:
                raise ValueError("\\S inside brackets is not supported")
            out.append(f"[^{_CLASS['s']}]")
        else:
            if piece == "[":
                inside = True
            elif piece == "]":
                inside = False
            out.append(piece)
    return "".join(out)


def _compile(expression: str) -> re.Pattern:
    # One capturing group around everything: re.split then returns matches and gaps in order.
    return re.compile("(" + _expand(expression) + ")")


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters: the printable Latin-1 bytes
    stand for themselves, the rest for U+0100 upwards in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(0x100 + extra)
            extra += 1
    return table


_BYTE_CHAR = byte_to_unicode()
_TO_BYTE_CHARS = str.maketrans({chr(b): c for b, c in _BYTE_CHAR.items()})
# Back to bytes, as Latin-1 characters. A Latin-1 character that is not one of GPT-2's (a raw
# space, say) maps to its own UTF-8 bytes, so that what remains above U+00FF is exactly the
# characters outside the map, which _normal_bytes keeps as UTF-8.
_FROM_BYTE_CHARS = str.maketrans({
    **{chr(c): chr(c).encode("utf-8").decode("latin-1") for c in range(256)},
    **{c: chr(b) for b, c in _BYTE_CHAR.items()},
})
_NO_RANK = 1 << 62
_CACHE_LIMIT = 1 << 16


class BpeTokenizer(GgufTokenizer):
    """A ``gpt2`` GGUF vocabulary with its merges and pre-tokenizer (see the module docstring).

    ``pre_tokenizer`` is the name used: the file's ``tokenizer.ggml.pre`` or an alias of it,
    else ``default`` (absent or unknown names, as the spec says).
    """

    _DEFAULT_BOS = 11  # llama.cpp's defaults for BPE vocabularies
    _DEFAULT_EOS = 11

    def __init__(self, metadata: Mapping):
        pre = metadata.get(KEY + "pre")
        pre = pre if isinstance(pre, str) else "default"
        pre = PRE_ALIASES.get(pre, pre)
        self.pre_tokenizer = pre if pre in PRE_TOKENIZERS else "default"
        expressions, self._ignore_merges, add_bos = PRE_TOKENIZERS[self.pre_tokenizer]
        super().__init__(metadata, add_bos_default=add_bos)
        self._pre_splitters = tuple(_compile(e) for e in expressions)

        merges = _sequence(metadata, "merges", required=True)
        try:
            "".join(merges)  # a type check of every merge at C speed
        except TypeError:
            _fail("tokenizer.ggml.merges holds a value that is not a string")
        # Keyed by the merge's own text "left right" (no copies). Filled from the end, so the
        # first of duplicate pairs keeps its rank, as in llama.cpp.
        self._ranks = dict(zip(reversed(merges), range(len(merges) - 1, -1, -1)))
        self._word_cache = {}

    # ------------------------------------------------------------------------ encoding

    def pre_tokenize(self, text: str) -> list[str]:
        """The pieces ``text`` is split into before merging (as text, not byte characters)."""
        pieces = [text]
        for splitter in self._pre_splitters:
            pieces = [p for piece in pieces for p in splitter.split(piece) if p]
        return pieces

    def _encode_fragment(self, text: str, after_special: bool) -> list[int]:
        ids = []
        cache = self._word_cache
        for word in self.pre_tokenize(text):
            word_ids = cache.get(word)
            if word_ids is None:
                if len(cache) >= _CACHE_LIMIT:
                    cache.clear()
                word_ids = cache[word] = self._encode_word(word)
            ids += word_ids
        return ids

    def _encode_word(self, word: str) -> tuple[int, ...]:
        id_of, ranks = self._id_of, self._ranks
        symbols_text = word.encode("utf-8", "surrogatepass").decode("latin-1").translate(
            _TO_BYTE_CHARS)
        if self._ignore_merges and symbols_text in id_of:
            return (id_of[symbols_text],)
        symbols = merge_adjacent(list(symbols_text), lambda a, b: ranks.get(a + " " + b, _NO_RANK), _NO_RANK)
        ids = []
        for symbol in symbols:
            token_id = id_of.get(symbol)
            if token_id is not None:
                ids.append(token_id)
            else:
                # llama.cpp looks each UTF-8 byte up as a one-byte token: only ASCII can match.
                ids += [id_of[c] for c in symbol if c < "\x80" and c in id_of]
        return tuple(ids)

    # ------------------------------------------------------------------------ decoding

    def _normal_bytes(self, text: str) -> bytes:
        latin = text.translate(_FROM_BYTE_CHARS)
        try:
            return latin.encode("latin-1")
        except UnicodeEncodeError:  # a character outside GPT-2's map: keep it as UTF-8
            return b"".join(c.encode("latin-1") if c < "\u0100" else c.encode("utf-8")
                            for c in latin)
