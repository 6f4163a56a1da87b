"""The Needle 3 tokenizer: a ``.cact`` container's RAW record, its encoder and decoder (§8, §9).

Pure Python (no numpy): this module also runs inside Pyodide. The container embeds a
SentencePiece-style vocabulary as a RAW blob; §8 gives its layout and the reference encoder
(upstream ``RefTokenizer``), which this module implements:

1. replace ' ' with '▁' (and prepend '▁' if ``add_dummy_prefix``);
2. split out USER_DEFINED markers, longest first;
3. in each remaining segment, repeatedly merge the adjacent pair whose concatenation is a piece
   with the highest score (ties: the leftmost pair);
4. symbols that are not pieces become ``<0xXX>`` byte pieces (``byte_fallback``) or ``<unk>``.

Only NORMAL pieces take part in merges and symbol look-ups, as in SentencePiece, so text that
happens to spell ``<s>`` or ``<0x41>`` is encoded as ordinary characters and round-trips.
"""

from __future__ import annotations

import math
import operator
import re
import struct
from heapq import heappop, heappush

from ..errors import ContainerError, InputError
from ..inputs import byte_view, checked, describe, iterable, whole_number
from .stream_decoder import StreamDecoder

# n_pieces, pad_id, eos_id, bos_id, unk_id, add_dummy_prefix, byte_fallback, padding
HEADER = struct.Struct("<IIIIIBBH")
RECORD = struct.Struct("<fBH")  # score, type, byte length of the UTF-8 text that follows

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = range(5)
TYPE_NAMES = ("NORMAL", "UNKNOWN", "CONTROL", "USER_DEFINED", "BYTE")

SPACE = "\u2581"  # '▁', SentencePiece's visible space
BYTE_PIECE = re.compile(r"<0x([0-9A-F]{2})>")

# User-defined markers in the order of the v3 vocabulary, from id 4 (§9).
MARKERS = (
    "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tools>", "</tools>",
    "<tool_call>", "</tool_call>", "<tool_result>", "</tool_result>", "<context>", "</context>",
    "<image>", "</image>", "<speech>", "</speech>", "<tts>", "</tts>",
    "<imagen>", "</imagen>", "<extract>", "</extract>", "<schema>", "</schema>",
)


def _fail(problem: str):
    raise ContainerError(f"tokenizer: {problem}")


def _as_f32(value: float) -> float:
    """The value a ``<f`` record stores, so that a written blob reads back identically."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


class Tokenizer:
    """A validated vocabulary with the §8 reference encoder and decoder.

    Build one with :meth:`from_blob` (the container's RAW record) or :func:`synthetic_tokenizer`.
    Every inconsistency raises ``ContainerError`` with a message starting ``tokenizer:``.
    """

    def __init__(self, pieces, scores, types, *, pad_id: int = 0, eos_id: int = 1,
                 bos_id: int = 2, unk_id: int = 3, add_dummy_prefix: bool = False,
                 byte_fallback: bool = True):
        self._pieces = tuple(pieces)
        self._types = tuple(types)
        n = len(self._pieces)
        if n == 0:
            _fail("the vocabulary has no pieces")
        if len(scores) != n or len(self._types) != n:
            _fail(f"{n} pieces but {len(scores)} scores and {len(self._types)} types")
        try:
            self._scores = tuple(_as_f32(float(s)) for s in scores)
        except (OverflowError, TypeError, ValueError):
            _fail("a score is not representable as f32")
        self.pad_id, self.eos_id, self.bos_id, self.unk_id = pad_id, eos_id, bos_id, unk_id
        self.add_dummy_prefix = bool(add_dummy_prefix)
        self.byte_fallback = bool(byte_fallback)
        self._check()
        self._index()

    # ------------------------------------------------------------------------- validation

    def _check(self):
        n = len(self._pieces)
        for name in ("pad_id", "eos_id", "bos_id", "unk_id"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 0 <= value < n:
                _fail(f"{name} {value} is out of range for {n} pieces")
        if self._types[self.unk_id] != UNKNOWN:
            _fail(f"unk_id {self.unk_id} is a {self._type_name(self.unk_id)} piece, not UNKNOWN")
        seen = {}
        byte_values = set()
        for i, (text, kind, score) in enumerate(zip(self._pieces, self._types, self._scores)):
            if kind not in range(len(TYPE_NAMES)):
                _fail(f"piece {i} has type {kind} (expected 0..4)")
            if not isinstance(text, str):
                _fail(f"piece {i} is not text")
            if len(text.encode("utf-8", "surrogatepass")) > 0xFFFF:
                _fail(f"piece {i} is longer than 65535 bytes")
            if math.isnan(score):
                _fail(f"piece {i} has a NaN score")
            # An empty marker would match everywhere; empty merge pieces are never produced.
            if not text and kind in (NORMAL, USER_DEFINED, BYTE):
                _fail(f"piece {i} ({TYPE_NAMES[kind]}) is empty")
            if text in seen:
                _fail(f"piece {i} {text!r} duplicates piece {seen[text]}")
            seen[text] = i
            if kind == BYTE:
                match = BYTE_PIECE.fullmatch(text)
                if match is None:
                    _fail(f"BYTE piece {i} is {text!r}, not of the form <0xXX>")
                byte_values.add(int(match.group(1), 16))
        if self.byte_fallback and len(byte_values) != 256:
            _fail(f"byte_fallback is set but only {len(byte_values)} of 256 byte pieces exist")

    def _type_name(self, i: int) -> str:
        return TYPE_NAMES[self._types[i]] if self._types[i] < len(TYPE_NAMES) else "unknown-type"

    def _index(self):
        self._id_of = {text: i for i, text in enumerate(self._pieces)}
        self._normal = {t: i for i, t in enumerate(self._pieces) if self._types[i] == NORMAL}
        self._byte_ids = [self.unk_id] * 256
        self._piece_bytes = []
        for i, (text, kind) in enumerate(zip(self._pieces, self._types)):
            if kind == BYTE:
                value = int(text[3:5], 16)
                self._byte_ids[value] = i
                self._piece_bytes.append(bytes((value,)))
            elif kind in (CONTROL, UNKNOWN):
                self._piece_bytes.append(b"")
            else:
                self._piece_bytes.append(text.encode("utf-8", "surrogatepass"))
        # Step 2 of §8: at the leftmost position where a marker starts, the longest marker there.
        # Markers are grouped by first character, longest first; a character class finds the
        # candidate positions. (One alternation regex of all markers costs superlinear time and
        # ~50x the markers' size in memory to compile when they are long.)
        self._markers_by_first = {}
        for text, kind in zip(self._pieces, self._types):
            if kind == USER_DEFINED:
                self._markers_by_first.setdefault(text[0], []).append(text)
        for group in self._markers_by_first.values():
            group.sort(key=len, reverse=True)
        firsts = "".join(re.escape(c) for c in sorted(self._markers_by_first))
        self._marker_starts = re.compile(f"[{firsts}]") if firsts else None

    # ------------------------------------------------------------------------- the RAW blob

    @classmethod
    @checked
    def from_blob(cls, blob) -> Tokenizer:
        """Parse and validate the §8 RAW blob (bytes, bytearray or memoryview)."""
        view = byte_view(blob)
        if view is None:
            _fail("the memoryview has been released" if isinstance(blob, memoryview)
                  else f"expected bytes, got {type(blob).__name__}")
        data = view.tobytes()
        if len(data) < HEADER.size:
            _fail(f"blob is {len(data)} bytes, shorter than the {HEADER.size}-byte header")
        n_pieces, pad_id, eos_id, bos_id, unk_id, dummy, fallback, _ = HEADER.unpack_from(data, 0)
        # Every record takes at least RECORD.size bytes: check the count before reading any.
        room = (len(data) - HEADER.size) // RECORD.size
        if not 0 < n_pieces <= room:
            _fail(f"n_pieces {n_pieces} cannot fit in a {len(data)}-byte blob (at most {room})")
        if dummy > 1 or fallback > 1:
            _fail(f"flags add_dummy_prefix={dummy} byte_fallback={fallback} are not 0 or 1")
        pieces, scores, types = [], [], []
        at = HEADER.size
        for i in range(n_pieces):
            if at + RECORD.size > len(data):
                _fail(f"truncated at piece {i} of {n_pieces} (offset {at})")
            score, kind, length = RECORD.unpack_from(data, at)
            at += RECORD.size
            if kind >= len(TYPE_NAMES):
                _fail(f"piece {i} has type {kind} (expected 0..4)")
            if at + length > len(data):
                _fail(f"piece {i} needs {length} bytes at offset {at}, blob ends at {len(data)}")
            try:
                text = data[at : at + length].decode("utf-8")
            except UnicodeDecodeError as exc:
                _fail(f"piece {i} is not valid UTF-8 ({exc.reason})")
            at += length
            pieces.append(text)
            scores.append(score)
            types.append(kind)
        if at != len(data):
            _fail(f"{len(data) - at} trailing bytes after {n_pieces} pieces")
        return cls(pieces, scores, types, pad_id=pad_id, eos_id=eos_id, bos_id=bos_id,
                   unk_id=unk_id, add_dummy_prefix=dummy, byte_fallback=fallback)

    def to_blob(self) -> bytes:
        """The §8 RAW blob; ``Tokenizer.from_blob(t.to_blob())`` reproduces ``t`` exactly."""
        parts = [HEADER.pack(len(self._pieces), self.pad_id, self.eos_id, self.bos_id, self.unk_id,
                             int(self.add_dummy_prefix), int(self.byte_fallback), 0)]
        for text, score, kind in zip(self._pieces, self._scores, self._types):
            raw = text.encode("utf-8")
            parts.append(RECORD.pack(score, kind, len(raw)))
            parts.append(raw)
        return b"".join(parts)

    def __eq__(self, other) -> bool:
        if not isinstance(other, Tokenizer):
            return NotImplemented
        return self.to_blob() == other.to_blob()

    __hash__ = None

    # ------------------------------------------------------------------------- look-ups

    @property
    def vocab_size(self) -> int:
        return len(self._pieces)

    def __len__(self) -> int:
        return len(self._pieces)

    def _vocabulary_id(self, token_id) -> int:
        """A looked-up id: a whole number (``inputs.whole_number``) in [0, vocab_size), else
        ``InputError`` (there is no piece to saturate to)."""
        whole = whole_number(token_id)
        if whole is None or not 0 <= whole < len(self._pieces):
            raise InputError(f"token id {describe(token_id)} is not an id in [0, {len(self._pieces)})")
        return whole

    @checked
    def piece(self, token_id) -> str:
        """The stored text of a piece (``<0x0A>`` for a byte piece, ``<s>`` for BOS ...)."""
        return self._pieces[self._vocabulary_id(token_id)]

    @checked
    def piece_type(self, token_id) -> int:
        return self._types[self._vocabulary_id(token_id)]

    @checked
    def score(self, token_id) -> float:
        return self._scores[self._vocabulary_id(token_id)]

    @checked
    def id_of(self, piece) -> int | None:
        """The id of a piece by its stored text (any type), or None (also for a non-str)."""
        return self._id_of.get(piece) if isinstance(piece, str) else None

    @checked
    def marker_id(self, marker) -> int | None:
        """The id of a USER_DEFINED marker such as ``<|im_end|>``, or None if the vocab lacks it."""
        i = self.id_of(marker)
        return i if i is not None and self._types[i] == USER_DEFINED else None

    im_start_id = property(lambda self: self.marker_id("<|im_start|>"))
    im_end_id = property(lambda self: self.marker_id("<|im_end|>"))
    think_start_id = property(lambda self: self.marker_id("<think>"))
    think_end_id = property(lambda self: self.marker_id("</think>"))
    tools_start_id = property(lambda self: self.marker_id("<tools>"))
    tools_end_id = property(lambda self: self.marker_id("</tools>"))
    tool_call_start_id = property(lambda self: self.marker_id("<tool_call>"))
    tool_call_end_id = property(lambda self: self.marker_id("</tool_call>"))

    @property
    def stop_ids(self) -> tuple:
        """Ids that end generation: EOS and ``<|im_end|>`` when present (§9)."""
        return tuple(i for i in (self.eos_id, self.im_end_id) if i is not None)

    # ------------------------------------------------------------------------- encoding

    @checked
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` per the §8 reference encoder (no BOS; see ``prompt_ids``).

        Never raises for any ``str``; a lone surrogate takes the byte fallback of its
        surrogate-pass bytes and decodes as U+FFFD. Anything but a ``str`` raises InputError.
        """
        if not isinstance(text, str):
            raise InputError(f"encode takes a str, got {type(text).__name__}")
        if not text:
            return []
        escaped = text.replace(" ", SPACE)
        if self.add_dummy_prefix:
            escaped = SPACE + escaped
        ids = []
        start = search_at = 0
        while self._marker_starts is not None:
            candidate = self._marker_starts.search(escaped, search_at)
            if candidate is None:
                break
            at = candidate.start()
            search_at = at + 1
            for marker in self._markers_by_first[escaped[at]]:
                if escaped.startswith(marker, at):
                    ids += self._encode_segment(escaped[start:at])
                    ids.append(self._id_of[marker])
                    start = search_at = at + len(marker)
                    break
        ids += self._encode_segment(escaped[start:])
        return ids

    def _encode_segment(self, segment: str) -> list[int]:
        ids = []
        for symbol in self._merge(segment):
            token_id = self._normal.get(symbol)
            if token_id is not None:
                ids.append(token_id)
            elif self.byte_fallback:
                ids += [self._byte_ids[b] for b in symbol.encode("utf-8", "surrogatepass")]
            else:
                ids.append(self.unk_id)
        return ids

    def _merge(self, segment: str) -> list[str]:
        """Step 3 of §8 in O(n log n): a heap of candidate merges over a linked list of symbols.

        Symbols are keyed by their start offset in ``segment``; the heap orders candidates by
        (-score, start), which is exactly "highest score, then leftmost". A candidate is stale
        when either symbol has changed since it was pushed; it is then skipped.
        """
        if len(segment) < 2:
            return [segment] if segment else []
        symbols = list(segment)  # the symbol starting at each offset; None once merged away
        following = list(range(1, len(segment))) + [-1]
        preceding = list(range(-1, len(segment) - 1))
        scores = self._scores
        candidates = []

        def propose(left: int):
            right = following[left]
            if right >= 0:
                merged = symbols[left] + symbols[right]
                token_id = self._normal.get(merged)
                if token_id is not None:
                    heappush(candidates, (-scores[token_id], left, merged))

        for left in range(len(segment) - 1):
            propose(left)
        while candidates:
            _, left, merged = heappop(candidates)
            right = following[left]
            if symbols[left] is None or right < 0 or symbols[left] + symbols[right] != merged:
                continue
            symbols[left], symbols[right] = merged, None
            following[left] = following[right]
            if following[right] >= 0:
                preceding[following[right]] = left
            if preceding[left] >= 0:
                propose(preceding[left])
            propose(left)
        return [s for s in symbols if s is not None]

    # ------------------------------------------------------------------------- decoding

    def piece_bytes(self, token_id) -> bytes:
        """The bytes one id contributes to decoded text (before '▁' becomes ' ').

        BYTE pieces give their byte, CONTROL and UNKNOWN give nothing (§8), and ids outside
        the vocabulary (including negative ones) and non-integers give nothing too: decoding
        never raises.
        """
        token_id = whole_number(token_id)
        if token_id is not None and 0 <= token_id < len(self._piece_bytes):
            return self._piece_bytes[token_id]
        return b""

    def token_bytes(self, token_id) -> bytes:
        """The bytes one id puts into decoded text: ``piece_bytes`` with '▁' as a space (what a
        grammar over the vocabulary reads; ``stream_decoder.StreamDecoder`` turns '▁' into a
        space after UTF-8 decoding, which is the same for every piece but a '▁' assembled from
        three BYTE pieces)."""
        return self.piece_bytes(token_id).replace(SPACE.encode(), b" ")

    def decode_piece(self, token_id) -> str:
        """One id's text in isolation; a lone byte of a multi-byte character gives U+FFFD."""
        return self.piece_bytes(token_id).decode("utf-8", "replace").replace(SPACE, " ")

    @checked
    def decode(self, ids) -> str:
        """Text of ``ids`` (§8): consecutive byte pieces are assembled before UTF-8 decoding
        (invalid sequences become U+FFFD), '▁' becomes ' ', and with ``add_dummy_prefix`` the
        one leading space the encoder added is removed. Out-of-range ids are skipped."""
        if isinstance(ids, (str, bytes, bytearray)):
            raise InputError(f"decode takes a sequence of ids, got {type(ids).__name__}")
        raw = b"".join(self.piece_bytes(i) for i in iterable(ids, "decode takes a sequence of ids"))
        text = raw.decode("utf-8", "replace").replace(SPACE, " ")
        if self.add_dummy_prefix and text.startswith(" "):
            text = text[1:]
        return text

    def stream_decoder(self, at_text_start: bool = True, *, stop_strings=()) -> StreamDecoder:
        """Decode one id at a time (``stream_decoder.StreamDecoder``): the chunks join to
        ``decode`` of the ids pushed, cut before the first of ``stop_strings``.
        ``at_text_start=False`` keeps the first piece's leading space (a completion that
        continues a prompt)."""
        return StreamDecoder(self.piece_bytes, strip_leading_space=at_text_start and self.add_dummy_prefix,
                             stop_strings=stop_strings, text_map=_spaces)


def _spaces(text: str) -> str:
    return text.replace(SPACE, " ")


# ----------------------------------------------------------------------------- synthetic vocab

# Common English and tool-calling words; each is added with every prefix so BPE can reach it.
_WORDS = (
    "the to of and in is for on with that it at from by as be this me my you what how when where "
    "who can please set get turn off weather city name arguments type string number integer "
    "boolean object array properties description required parameters location time date today "
    "tomorrow send message call play music song alarm timer light lights temperature search find "
    "book flight hotel email create add remove delete update list open close start stop Paris "
    "London New York true false null value query result tool user contact phone reminder event "
    "calendar note volume brightness unit celsius fahrenheit minutes hours seconds room bedroom "
    "kitchen living door lock unlock navigate route distance price order food restaurant news "
    "translate language text image file id count limit max min mode status enabled level"
).split()
_JSON_FRAGMENTS = ('{"', '":"', '","', '":', '"}', '"},', '}}', ']}', '":{"', '[{"', '"]',
                   'get_', 'set_', '_id', '_name')
_LOWER = "etaoinshrdlcumwfgypbvkjxqz"
_SINGLE_CHARS = (_LOWER + _LOWER.upper() + "0123456789" + ".,:;!?\"'()[]{}-_/@#$%&*+=<>|\\~`^")
SYNTHETIC_MIN_VOCAB = 300
SYNTHETIC_MAX_VOCAB = 16384


def _synthetic_normal_pieces():
    """NORMAL pieces, most frequent first: '▁', single characters, then prefix-closed words
    and JSON fragments, then letter pairs and triples as filler."""
    yield SPACE
    yield from _SINGLE_CHARS
    for letter in _LOWER + _LOWER.upper() + "0123456789":
        yield SPACE + letter
    for word in list(_JSON_FRAGMENTS) + [SPACE + w for w in _WORDS] + _WORDS:
        for end in range(2, len(word) + 1):
            yield word[:end]
    for first in _LOWER:
        for second in _LOWER:
            yield first + second
            yield SPACE + first + second
    for first in _LOWER.upper():
        for second in _LOWER:
            yield first + second
    for first in _LOWER:
        for second in _LOWER:
            for third in _LOWER:
                yield first + second + third


def synthetic_tokenizer(vocab_size: int, *, add_dummy_prefix: bool = True) -> Tokenizer:
    """A small valid v3-style vocabulary laid out like the real one (§9).

    0 ``<pad>``, 1 ``</s>``, 2 ``<s>`` (CONTROL), 3 ``<unk>`` (UNKNOWN), the 24 markers from 4
    (USER_DEFINED), 256 byte pieces from 28, then NORMAL pieces with strictly descending scores.
    ``add_dummy_prefix`` defaults to True like the fixture container's record.
    """
    vocab_size = operator.index(vocab_size)
    if not SYNTHETIC_MIN_VOCAB <= vocab_size <= SYNTHETIC_MAX_VOCAB:
        raise ValueError(f"synthetic vocab_size must be in [{SYNTHETIC_MIN_VOCAB}, "
                         f"{SYNTHETIC_MAX_VOCAB}], got {vocab_size}")
    pieces = ["<pad>", "</s>", "<s>", "<unk>", *MARKERS, *(f"<0x{b:02X}>" for b in range(256))]
    types = [CONTROL, CONTROL, CONTROL, UNKNOWN] + [USER_DEFINED] * len(MARKERS) + [BYTE] * 256
    scores = [0.0] * len(pieces)
    normal = {}  # insertion-ordered set
    for text in _synthetic_normal_pieces():
        if len(pieces) + len(normal) == vocab_size:
            break
        normal.setdefault(text, None)
    if len(pieces) + len(normal) != vocab_size:
        raise ValueError(f"the synthetic piece list cannot fill a vocab of {vocab_size}")
    for rank, text in enumerate(normal):
        pieces.append(text)
        types.append(NORMAL)
        scores.append(-float(rank))  # integers are exact in f32 and never tie
    return Tokenizer(pieces, scores, types, pad_id=0, eos_id=1, bos_id=2, unk_id=3,
                     add_dummy_prefix=add_dummy_prefix, byte_fallback=True)


def synthetic_tokenizer_blob(vocab_size: int) -> bytes:
    """The §8 RAW blob of :func:`synthetic_tokenizer`, for synthetic ``.cact`` writers."""
    return synthetic_tokenizer(vocab_size).to_blob()
