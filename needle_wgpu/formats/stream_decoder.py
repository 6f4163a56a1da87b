"""Streamed decoding: token ids in, final text out (dense-gguf spec §5.1, "Streamed text holds
back incomplete UTF-8 sequences and partial stop-string matches"). Pure Python; it only needs a
function giving each id's bytes.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable


class StreamDecoder:
    """Decode one id at a time, returning only text that is final.

    Held back: an incomplete UTF-8 sequence (until it completes, or :meth:`finish`), and a
    tail that may be the beginning of one of ``stop_strings``. When a stop string completes,
    the text before it is returned, ``stopped`` becomes True and every later push returns "".
    Without stop strings the chunks join to the decoded text of all the ids pushed.
    ``strip_leading_space`` drops one space at the very start (SPM's space prefix);
    ``text_map`` rewrites decoded text before anything else sees it (a SentencePiece
    vocabulary's '▁' becomes ' ', after UTF-8 decoding as its ``decode`` does).
    """

    def __init__(self, token_bytes: Callable[[int], bytes], *, strip_leading_space=False,
                 stop_strings=(), text_map: Callable[[str], str] | None = None):
        if isinstance(stop_strings, str):
            stop_strings = (stop_strings,)
        self._token_bytes = token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._strip_space = bool(strip_leading_space)
        self._text_map = text_map
        self._stops = tuple(s for s in stop_strings if isinstance(s, str) and s)
        self._pending = ""
        self.stopped = False

    def push(self, token_id) -> str:
        if self.stopped:
            return ""
        return self._emit(self._utf8.decode(self._token_bytes(token_id)))

    def finish(self) -> str:
        """Flush held-back text (an incomplete sequence at the end becomes U+FFFD)."""
        if self.stopped:
            return ""
        return self._emit(self._utf8.decode(b"", final=True), final=True)

    def _emit(self, chunk: str, final: bool = False) -> str:
        if self._text_map is not None:
            chunk = self._text_map(chunk)
        if self._strip_space and chunk:
            self._strip_space = False
            if chunk[0] == " ":
                chunk = chunk[1:]
        if not self._stops:
            return chunk
        text = self._pending + chunk
        hits = [at for at in (text.find(s) for s in self._stops) if at >= 0]
        if hits:
            self.stopped = True
            self._pending = ""
            return text[: min(hits)]
        keep = 0 if final else partial_tail(text, self._stops)
        self._pending = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep]


def partial_tail(text: str, marks) -> int:
    """The length of the longest tail of ``text`` that is a proper prefix of one of ``marks``:
    what a stream holds back until more text says whether the mark completes."""
    return max((k for mark in marks for k in range(min(len(mark) - 1, len(text)), 0, -1)
                if text.endswith(mark[:k])), default=0)
