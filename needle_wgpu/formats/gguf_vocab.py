"""What the two GGUF tokenizers share (dense-gguf spec §5.1): the vocabulary as llama.cpp reads
it from ``tokenizer.ggml.*``, its special tokens, end-of-generation ids, BOS/EOS rules, the
special-token partition that runs before either encoder (``special_tokens``), and decoding
(whole or streamed, ``stream_decoder``).

Pure Python (no numpy, no ``regex``): this runs in Pyodide. ``bpe_tokenizer.BpeTokenizer``
(``gpt2`` files) and ``gguf_spm_tokenizer.SpmTokenizer`` (``llama`` files) add the encoder of one
text fragment; ``gguf_tokenizer.tokenizer_from_gguf`` picks one.

Token attributes follow ``src/llama-vocab.cpp``: the file's ``token_type`` (1 normal, 2 unknown,
3 control, 4 user-defined, 5 unused, 6 byte), then the fixes llama.cpp applies by token text
(end-of-generation and fill-in-the-middle tokens become control tokens). Those attributes decide
which tokens are cut out of the text before encoding and what each token decodes to.
"""

from __future__ import annotations

import operator
import re
from array import array
from collections.abc import Mapping, Sequence

from ..errors import ContainerError, InputError
from .special_tokens import SpecialTokenSplitter
from .stream_decoder import StreamDecoder

# llama.cpp's token attributes (a bit set; the file stores one type per token).
UNDEFINED, UNKNOWN, UNUSED, NORMAL, CONTROL, USER_DEFINED, BYTE = 0, 1, 2, 4, 8, 16, 32
# GGUF token_type value -> attribute
_TYPE_ATTR = {1: NORMAL, 2: UNKNOWN, 3: CONTROL, 4: USER_DEFINED, 5: UNUSED, 6: BYTE}
_SPECIAL = CONTROL | USER_DEFINED | UNKNOWN   # cut out before encoding (§5.1)
_HIDDEN = CONTROL | UNKNOWN                   # decode to nothing unless special=True

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")

# End of generation by token text (llama-vocab.cpp, "maintain a list of tokens that cause
# end-of-generation"): each becomes a control token as well.
EOG_TEXTS = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[",
))
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
              "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]",
              "<\uff5cend\u2581of\u2581sentence\uff5c>", "<end_of_utterance>")
# Fill-in-the-middle tokens by text, with the key that names them when the file does. The last
# three also end generation.
_FIM_TEXTS = {
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<\uff5cfim\u2581begin\uff5c>",
                "<PRE>", "\u2581<PRE>", "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<\uff5cfim\u2581hole\uff5c>",
                "<SUF>", "\u2581<SUF>", "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<\uff5cfim\u2581end\uff5c>",
                "<MID>", "\u2581<MID>", "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
_FIM_EOG = ("fim_pad", "fim_rep", "fim_sep")
# gpt-oss: llama.cpp always renders these, as user-defined tokens.
_ALWAYS_USER_DEFINED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")

KEY = "tokenizer.ggml."


def _fail(problem: str):
    raise ContainerError(f"tokenizer: {problem}")


def _sequence(metadata: Mapping, key: str, required: bool = False):
    value = metadata.get(KEY + key)
    if value is None:
        if required:
            _fail(f"{KEY}{key} is missing")
        return None
    if isinstance(value, (str, bytes, bytearray)) or not isinstance(value, Sequence):
        _fail(f"{KEY}{key} is a {type(value).__name__}, not an array")
    return value


def _flag(metadata: Mapping, key: str, default: bool) -> bool:
    value = metadata.get(KEY + key)
    if value is None:
        return default
    if not isinstance(value, (bool, int)):
        _fail(f"{KEY}{key} is a {type(value).__name__}, not a bool")
    return bool(value)


def _token_id(metadata: Mapping, key: str, default: int | None, n: int) -> int | None:
    """A special id as llama.cpp reads it: the file's value when in range, else the default
    (itself dropped when out of range)."""
    if default is not None and not 0 <= default < n:
        default = None
    value = metadata.get(KEY + key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(f"{KEY}{key} is a {type(value).__name__}, not an integer")
    return value if 0 <= value < n else default


_TYPE_TABLE = bytes(_TYPE_ATTR.get(t, UNDEFINED) for t in range(256))
_SPECIAL_MASK = bytes(int(bool(a & _SPECIAL)) for a in range(256))


def _attributes(types, n: int) -> bytearray:
    """One attribute byte per token from ``token_type`` (all NORMAL when absent)."""
    if types is None:
        return bytearray([NORMAL]) * n
    if len(types) < n:
        _fail(f"{len(types)} token types for {n} tokens")
    try:
        return bytearray(bytes(types[:n]).translate(_TYPE_TABLE))  # C speed for 0..255
    except (TypeError, ValueError):
        pass
    try:
        return bytearray(_TYPE_ATTR.get(t, UNDEFINED) for t in types[:n])
    except TypeError:
        _fail("tokenizer.ggml.token_type holds a value that is not an integer")


class GgufTokenizer:
    """The vocabulary part of a GGUF tokenizer; subclasses encode one text fragment.

    Public surface (the engine's tokenizer protocol, shared with the Needle 3 tokenizer):
    ``encode``, ``decode``, ``stream_decoder``, ``bos_id``, ``add_bos``, ``eos_id``,
    ``stop_ids``, ``token_bytes``, ``vocab_size``, plus ``piece``, ``id_of``, ``is_control``.
    """

    # set by subclasses: defaults llama.cpp uses when the file names no id
    _DEFAULT_BOS: int | None = None
    _DEFAULT_EOS: int | None = None
    _DEFAULT_UNK: int | None = None

    def __init__(self, metadata: Mapping, *, add_bos_default: bool):
        if not isinstance(metadata, Mapping):
            _fail(f"metadata is a {type(metadata).__name__}, not a mapping")
        tokens = _sequence(metadata, "tokens", required=True)
        n = len(tokens)
        if n == 0:
            _fail("tokenizer.ggml.tokens is empty")
        try:
            "".join(tokens)  # a type check of every token at C speed
        except TypeError:
            bad = next(i for i, t in enumerate(tokens) if not isinstance(t, str))
            _fail(f"token {bad} is a {type(tokens[bad]).__name__}, not a string")
        tokens = tuple(tokens)
        if "" in tokens:  # llama.cpp renames empty tokens so they cannot match anything
            tokens = tuple(t or f"[EMPTY_{i}]" for i, t in enumerate(tokens))
        self._tokens = tokens
        self._id_of = dict(zip(tokens, range(n)))
        if len(self._id_of) != n:
            seen = {}
            for i, t in enumerate(tokens):
                if t in seen:
                    _fail(f"duplicate token {t!r} at ids {seen[t]} and {i}")
                seen[t] = i

        types = _sequence(metadata, "token_type")
        self._attrs = _attributes(types, n)

        self.unk_id = _token_id(metadata, "unknown_token_id", self._DEFAULT_UNK, n)
        self.bos_token_id = _token_id(metadata, "bos_token_id", self._DEFAULT_BOS, n)
        self.eos_id = _token_id(metadata, "eos_token_id", self._DEFAULT_EOS, n)
        self.add_bos = _flag(metadata, "add_bos_token", add_bos_default)
        self.add_eos = _flag(metadata, "add_eos_token", False)
        if self.add_bos and self.bos_token_id is None:
            _fail("add_bos_token is true but there is no BOS token")
        if self.add_eos and self.eos_id is None:
            _fail("add_eos_token is true but there is no EOS token")
        self._mark_by_text(metadata, n)
        self._build_special_index()

    # ------------------------------------------------------------------------ attributes

    def _mark_by_text(self, metadata: Mapping, n: int):
        """llama.cpp's fixes by token text: EOT/EOM/FIM/EOG tokens become control tokens and
        the EOG set is assembled (spec §5.1, "End of generation")."""
        attrs, id_of = self._attrs, self._id_of

        def find(texts):  # the lowest id among the texts present (llama.cpp: hash order)
            found = [id_of[t] for t in texts if t in id_of]
            return min(found) if found else None

        named = {"eot": _token_id(metadata, "eot_token_id", None, n),
                 "eom": _token_id(metadata, "eom_token_id", None, n)}
        by_text = {"eot": _EOT_TEXTS, "eom": ("<|eom_id|>",), **_FIM_TEXTS}
        for kind, texts in by_text.items():
            token_id = named.get(kind)
            if token_id is None:
                token_id = _token_id(metadata, f"{kind}_token_id", None, n)
            if token_id is None:
                token_id = find(texts)
                if token_id is not None:
                    attrs[token_id] |= CONTROL
            named[kind] = token_id

        eog = {named[kind] for kind in _FIM_EOG if named[kind] is not None}
        for text in EOG_TEXTS:
            token_id = id_of.get(text)
            if token_id is not None:
                eog.add(token_id)
                attrs[token_id] |= CONTROL
        for text in _ALWAYS_USER_DEFINED:
            if text in id_of:
                attrs[id_of[text]] = USER_DEFINED
        eog.update(i for i in (self.eos_id, named["eot"], named["eom"]) if i is not None)

        texts = {self._tokens[i] for i in eog}
        # o200k_harmony / solar-open: "<|end|>" ends a message, not the generation.
        if "<|end|>" in texts and (("<|return|>" in texts and ({"<|call|>", "<|calls|>"} & texts))
                                   or ({"<|call|>", "<|calls|>"} & texts and "<|flush|>" in texts)):
            eog.discard(id_of["<|end|>"])
            attrs[id_of["<|end|>"]] = USER_DEFINED
        # gemma4 / paddleocr: "</s>" is text there.
        if "<|tool_response>" in texts and "</s>" in texts:
            eog.discard(id_of["</s>"])
            attrs[id_of["</s>"]] = NORMAL
        self.eot_id = named["eot"]
        self.stop_ids = tuple(sorted(eog))

    def _build_special_index(self):
        """The special tokens in llama.cpp's cache_special_tokens order (longest first; ties
        by id), and a splitter for each partition mode."""
        attrs, tokens = self._attrs, self._tokens
        special, mask = [], attrs.translate(_SPECIAL_MASK)
        at = mask.find(1)
        while at >= 0:
            special.append(at)
            at = mask.find(1, at + 1)
        special.sort(key=lambda i: (-len(tokens[i]), i))
        self._special_splitters = {
            parse_special: SpecialTokenSplitter(
                (tokens[i], i) for i in special if parse_special or not attrs[i] & _HIDDEN)
            for parse_special in (False, True)}

    # ------------------------------------------------------------------------ look-ups

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    def __len__(self) -> int:
        return len(self._tokens)

    @property
    def bos_id(self) -> int | None:
        """The BOS id to put before a prompt, or None when the file says not to (add_bos)."""
        return self.bos_token_id if self.add_bos else None

    def piece(self, token_id: int) -> str:
        """The token's stored text (byte-level characters for BPE, '▁' for SPM spaces)."""
        try:
            index = operator.index(token_id)
        except TypeError:
            index = -1
        if not 0 <= index < len(self._tokens):
            raise InputError(f"token id {token_id!r} is out of range for "
                             f"{len(self._tokens)} tokens")
        return self._tokens[index]

    def id_of(self, text: str) -> int | None:
        """The id of a token by its stored text (any type), or None."""
        return self._id_of.get(text)

    def is_control(self, token_id: int) -> bool:
        """True for control and unknown tokens: they decode to nothing (unless special)."""
        return bool(self._attr(token_id) & _HIDDEN)

    def _attr(self, token_id) -> int:
        try:
            token_id = operator.index(token_id)
        except TypeError:
            return UNDEFINED
        return self._attrs[token_id] if 0 <= token_id < len(self._attrs) else UNDEFINED

    # ------------------------------------------------------------------------ encoding

    def encode(self, text: str, *, parse_special: bool = False,
               add_special: bool = False) -> list[int]:
        """Token ids of ``text``, as llama.cpp's ``llama_tokenize`` gives them.

        User-defined tokens are always cut out first; control tokens only with
        ``parse_special`` (template output). ``add_special`` adds BOS (and EOS) as the file
        says (``add_bos``); a text that already starts with BOS gets no second one. Never
        raises for a ``str``; anything else raises InputError.
        """
        if not isinstance(text, str):
            raise InputError(f"encode takes a str, got {type(text).__name__}")
        ids = []
        after_special = True  # SPM adds its space prefix at the start and after a special
        for fragment in self._special_splitters[bool(parse_special)].split(text):
            if isinstance(fragment, int):
                ids.append(fragment)
                after_special = True
            else:
                ids += self._encode_fragment(fragment, after_special)
                after_special = False
        if add_special:
            if self.add_bos and (not ids or ids[0] != self.bos_token_id):
                ids.insert(0, self.bos_token_id)
            if self.add_eos:
                ids.append(self.eos_id)
        return ids

    def _encode_fragment(self, text: str, after_special: bool) -> list[int]:
        raise NotImplementedError

    def split_special(self, text: str, *, parse_special: bool = False) -> list:
        """``text`` as a list of plain-text fragments (str) and special-token ids (int), as
        llama.cpp's ``tokenizer_st_partition`` cuts it (``special_tokens``)."""
        return self._special_splitters[bool(parse_special)].split(text)

    # ------------------------------------------------------------------------ decoding

    def _normal_bytes(self, text: str) -> bytes:
        """The bytes a NORMAL token's stored text stands for (subclass: BPE vs SPM)."""
        raise NotImplementedError

    def token_bytes(self, token_id, *, special: bool = False) -> bytes:
        """The bytes one id contributes to decoded text (llama.cpp's ``token_to_piece``).

        Byte tokens give their byte; user-defined tokens their text; control and unknown
        tokens nothing unless ``special``; unused tokens and ids outside the vocabulary
        (or not integers) nothing. Never raises.
        """
        attr = self._attr(token_id)
        if attr & _HIDDEN and not special:
            return b""
        if attr & (_HIDDEN | USER_DEFINED):
            return self._tokens[token_id].encode("utf-8", "surrogatepass")
        if attr & NORMAL:
            return self._normal_bytes(self._tokens[token_id])
        if attr & BYTE:
            match = _BYTE_PIECE.fullmatch(self._tokens[token_id])
            return bytes((int(match.group(1), 16),)) if match else b""
        return b""

    @property
    def _strips_leading_space(self) -> bool:
        return False

    def decode(self, ids, *, special: bool = False) -> str:
        """Text of ``ids``: token bytes joined, then UTF-8 (invalid sequences become U+FFFD).
        With an SPM space prefix, the one leading space the encoder added is removed.
        llama.cpp's clean-up of spaces before punctuation is not applied, as its server does
        not apply it to streamed text either."""
        if isinstance(ids, (str, bytes, bytearray)):
            raise InputError(f"decode takes a sequence of ids, got {type(ids).__name__}")
        try:
            raw = b"".join(self.token_bytes(i, special=special) for i in ids)
        except TypeError:
            raise InputError(f"decode takes a sequence of ids, got {type(ids).__name__}") from None
        text = raw.decode("utf-8", "replace")
        if self._strips_leading_space and text.startswith(" "):
            text = text[1:]
        return text

    def stream_decoder(self, at_text_start: bool = True, *, stop_strings=(),
                       special: bool = False) -> StreamDecoder:
        """Decode one id at a time (``stream_decoder.StreamDecoder``); ``at_text_start=False``
        keeps an SPM first piece's leading space (a completion that continues a prompt)."""
        return StreamDecoder(lambda token_id: self.token_bytes(token_id, special=special),
                             strip_leading_space=at_text_start and self._strips_leading_space,
                             stop_strings=stop_strings)


def merge_adjacent(symbols: list, value, stop) -> list:
    """The merge loop of both tokenizers (dense spec §5.2, §5.3): while the best adjacent pair
    merges, merge the leftmost best one. ``value(left, right)`` rates a pair, lower is better
    (BPE: its merge rank; SPM: minus the merged token's score); ``stop`` is the value of a pair
    that does not merge. ``symbols`` is merged in place and returned."""
    values = [value(a, b) for a, b in zip(symbols, symbols[1:])]
    while values:
        best = min(values)
        if best == stop:
            break
        at = values.index(best)  # the leftmost pair of the best value
        merged = symbols[at] + symbols[at + 1]
        symbols[at : at + 2] = [merged]
        del values[at]
        if at > 0:
            values[at - 1] = value(symbols[at - 1], merged)
        if at < len(values):
            values[at] = value(merged, symbols[at + 1])
    return symbols


def scores_of(metadata: Mapping, n: int) -> array:
    """``tokenizer.ggml.scores`` as doubles (exact copies of the file's f32), 0 if absent."""
    scores = _sequence(metadata, "scores")
    if scores is None:
        return array("d", bytes(8 * n))
    if len(scores) < n:
        _fail(f"{len(scores)} scores for {n} tokens")
    try:
        return array("d", scores[:n])
    except TypeError:
        _fail("tokenizer.ggml.scores holds a value that is not a number")
