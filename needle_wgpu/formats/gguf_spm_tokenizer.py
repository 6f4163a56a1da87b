"""SentencePiece-style tokenizer from GGUF metadata (``tokenizer.ggml.model = llama``, as Gemma
uses; dense-gguf spec §5.3), per llama.cpp's ``llm_tokenizer_spm``.

Per text fragment (special tokens are already cut out, ``gguf_vocab``): spaces become U+2581,
with one in front when ``add_space_prefix`` (default true; Gemma false) and the fragment starts
the text or follows a special token; starting from single characters, repeatedly merge the
adjacent pair whose concatenation is a token with the highest score (ties: the leftmost pair);
a symbol that is not a token becomes its UTF-8 bytes as ``<0xNN>`` tokens. No regex.

As in llama.cpp, and unlike SentencePiece itself, every token of the vocabulary takes part in
merges, whatever its type. This differs from the Needle 3 tokenizer (``tokenizer.py``), which
reads a ``.cact`` record and follows SentencePiece.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from heapq import heappop, heappush

from .gguf_vocab import GgufTokenizer, _flag, merge_adjacent, scores_of

SPACE = "\u2581"  # '▁', SentencePiece's visible space
_BEFORE_SPACE = re.compile(SPACE)
_NO_PAIR = float("-inf")
_SHORT = 24            # words up to this many characters merge by rescanning a list
_MAX_BRIDGING = 256    # more tokens than this with an inner '▁': merge whole fragments
_CACHE_LIMIT = 1 << 16


class SpmTokenizer(GgufTokenizer):
    """A ``llama`` GGUF vocabulary with its scores (see the module docstring)."""

    _DEFAULT_BOS = 1  # llama.cpp's defaults for SPM vocabularies
    _DEFAULT_EOS = 2
    _DEFAULT_UNK = 0

    def __init__(self, metadata: Mapping):
        super().__init__(metadata, add_bos_default=True)
        self.add_space_prefix = _flag(metadata, "add_space_prefix", True)
        self._scores = scores_of(metadata, len(self._tokens))
        # byte -> "<0xNN>" token, else the one-character token, else unknown (llama.cpp's
        # byte_to_token; it would throw where this falls back to the unknown token).
        id_of = self._id_of
        self._byte_ids = []
        for b in range(256):
            token_id = id_of.get(f"<0x{b:02X}>")
            if token_id is None:
                token_id = id_of.get(chr(b)) if b < 0x80 else None
            self._byte_ids.append(self.unk_id if token_id is None else token_id)
        # Words: a merge can cross the boundary before a '▁' only by making a token with a
        # '▁' after its first character ("bridging"; Gemma has one, '>▁</'). Where no such
        # token occurs in the text, each '▁'-led word merges on its own, with the same
        # result, so words can be cached.
        bridging = [t for t in self._tokens if t.find(SPACE, 1) > 0]
        self._bridging = re.compile("(?=(" + "|".join(map(re.escape, bridging)) + "))") \
            if 0 < len(bridging) <= _MAX_BRIDGING else None
        self._words_ok = len(bridging) <= _MAX_BRIDGING
        self._word_cache = {}

    @property
    def _strips_leading_space(self) -> bool:
        return self.add_space_prefix

    def _encode_fragment(self, text: str, after_special: bool) -> list[int]:
        if self.add_space_prefix and after_special:
            text = " " + text
        text = text.replace(" ", SPACE)
        cache, ids = self._word_cache, []
        for word in self._words(text):
            word_ids = cache.get(word)
            if word_ids is None:
                if len(cache) >= _CACHE_LIMIT:
                    cache.clear()
                word_ids = cache[word] = self._symbol_ids(self._merge(word))
            ids += word_ids
        return ids

    def _words(self, text: str) -> list[str]:
        """``text`` cut before every '▁' that no bridging token occurrence spans."""
        if not self._words_ok:
            return [text]
        cuts = [m.start() for m in _BEFORE_SPACE.finditer(text, 1)]
        if self._bridging is not None:
            spanned = set()
            for match in self._bridging.finditer(text):
                spanned.update(range(match.start() + 1, match.start() + len(match.group(1))))
            if spanned:
                cuts = [c for c in cuts if c not in spanned]
        return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)]) if a < b]

    def _symbol_ids(self, symbols: list[str]) -> tuple[int, ...]:
        ids = []
        id_of, byte_ids = self._id_of, self._byte_ids
        for symbol in symbols:
            token_id = id_of.get(symbol)
            if token_id is not None:
                ids.append(token_id)
            else:
                ids += [byte_ids[b] for b in symbol.encode("utf-8", "surrogatepass")
                        if byte_ids[b] is not None]
        return tuple(ids)

    def _merge(self, text: str) -> list[str]:
        """llama.cpp's merge loop: while some adjacent pair concatenates to a token, merge
        the pair whose token has the highest score (ties: the leftmost pair)."""
        n = len(text)
        if n < 2:
            return [text] if text else []
        if n <= _SHORT:
            return self._merge_short(text)
        return self._merge_long(text)

    def _merge_short(self, text: str) -> list[str]:
        """For short words: rescan a list of pair scores (max() and index() run at C speed)."""
        id_of, scores = self._id_of, self._scores
        symbols = list(text)

        def score(merged: str) -> float:
            token_id = id_of.get(merged)
            return _NO_PAIR if token_id is None else scores[token_id]

        # max score, leftmost on ties == min of minus the score, leftmost on ties
        return merge_adjacent(symbols, lambda a, b: -score(a + b), -_NO_PAIR)

    def _merge_long(self, text: str) -> list[str]:
        """For long runs (CJK text has no spaces): a linked list of symbols and a heap of
        candidate pairs ordered (-score, left start). A candidate is stale when either side
        has been merged since it was pushed (llama.cpp compares sizes)."""
        n = len(text)
        symbols = list(text)  # the symbol starting at each offset; None once merged away
        following = list(range(1, n)) + [-1]
        preceding = list(range(-1, n - 1))
        id_of, scores = self._id_of, self._scores
        heap = []

        def propose(left: int):
            right = following[left]
            if right >= 0:
                merged = symbols[left] + symbols[right]
                token_id = id_of.get(merged)
                if token_id is not None:
                    heappush(heap, (-scores[token_id], left, right, len(merged)))

        for left in range(n - 1):
            propose(left)
        while heap:
            _, left, right, size = heappop(heap)
            left_text, right_text = symbols[left], symbols[right]
            if left_text is None or right_text is None or len(left_text) + len(right_text) != size:
                continue
            symbols[left], symbols[right] = left_text + right_text, None
            following[left] = after = following[right]
            if after >= 0:
                preceding[after] = left
            if preceding[left] >= 0:
                propose(preceding[left])
            propose(left)
        return [s for s in symbols if s is not None]

    def _normal_bytes(self, text: str) -> bytes:
        return text.replace(SPACE, " ").encode("utf-8", "surrogatepass")
