"""Cutting special tokens out of text before encoding (dense-gguf spec §5.1), exactly as
llama.cpp's ``tokenizer_st_partition`` does: each special token, longest first, is cut out of
every fragment the longer ones left, leftmost occurrence first.

That is not a longest-first regex alternation: where occurrences overlap, a longer token wins
even when a shorter one starts earlier ("XYZZ" with "XY" and "YZZ" gives X + YZZ). So the
splitter collects every occurrence and accepts them in llama.cpp's order.

Runs of one character are the expensive case (Gemma has tokens for 2..31 spaces, 1..31
newlines and tabs: every position of an indented line starts several). When the only special
tokens containing a character are runs of it, each maximal run of that character is cut on its
own, by arithmetic: llama.cpp's order takes as many of the longest fitting run as fit, from the
left, then the same on the remainder with shorter runs.

The other tokens sit in a compressed trie (one edge per token or branch point, labelled with its
text), so building it costs memory and time linear in the tokens' total length, however long one
token is, and finding every token that starts at a position walks only the edges it matches.
"""

from __future__ import annotations

import re


def _char_class(chars) -> re.Pattern | None:
    chars = sorted(set(chars))
    return re.compile("[" + "".join(f"\\U{ord(c):08X}" for c in chars) + "]") if chars else None


class SpecialTokenSplitter:
    """Splits text into plain fragments (str) and special-token ids (int).

    ``specials`` is (text, id) pairs in llama.cpp's order: longest first, ties by id.
    """

    def __init__(self, specials):
        specials = list(specials)
        in_run_only = {}  # character -> whether every special token containing it is a run of it
        for text, _ in specials:
            single = len(set(text)) == 1
            for c in set(text):
                in_run_only[c] = in_run_only.get(c, True) and single
        self._runs = {}   # character -> [(run length, id)], longest first
        others = []
        for rank, (text, token_id) in enumerate(specials):
            if in_run_only[text[0]]:
                self._runs.setdefault(text[0], []).append((len(text), token_id))
            else:
                others.append((rank, text, token_id))
        self._run_pattern = re.compile("|".join(f"\\U{ord(c):08X}+" for c in self._runs)) \
            if self._runs else None
        self._trie = {}
        for rank, text, token_id in others:
            _insert(self._trie, text, (rank, token_id))
        self._starts = _char_class(self._trie)

    def split(self, text: str) -> list:
        if not text:
            return []
        found = self._run_cuts(text) if self._run_pattern is not None else []
        if self._starts is not None:
            found += self._other_cuts(text)
        if not found:
            return [text]
        found.sort()
        parts, done = [], 0
        for at, stop, token_id in found:
            if at > done:
                parts.append(text[done:at])
            parts.append(token_id)
            done = stop
        if done < len(text):
            parts.append(text[done:])
        return parts

    def _run_cuts(self, text: str) -> list:
        cuts = []
        for match in self._run_pattern.finditer(text):
            at, left = match.start(), match.end() - match.start()
            for length, token_id in self._runs[text[at]]:
                if length <= left:
                    count, left = divmod(left, length)
                    cuts += [(at + i * length, at + (i + 1) * length, token_id)
                             for i in range(count)]
                    at += count * length
        return cuts

    def _other_cuts(self, text: str) -> list:
        """Every occurrence of the other tokens, then accepted in llama.cpp's order."""
        root, end = self._trie, len(text)
        found = []
        for match in self._starts.finditer(text):
            at = pos = match.start()
            node = root
            while pos < end:
                edge = node.get(text[pos])
                if edge is None or not text.startswith(edge[0], pos):
                    break
                pos += len(edge[0])
                if edge[2] is not None:
                    found.append((edge[2][0], at, pos, edge[2][1]))
                node = edge[1]
                if node is None:
                    break
        if not found:
            return []
        found.sort()
        taken = bytearray(end)
        accepted = []
        for _, at, stop, token_id in found:
            if taken.find(1, at, stop) == -1:
                taken[at:stop] = b"\x01" * (stop - at)
                accepted.append((at, stop, token_id))
        return accepted


def _insert(trie: dict, text: str, entry) -> None:
    """Adds ``text`` to a compressed trie: a node maps a first character to its edge
    ``[label, child node or None (a leaf), entry or None]``; an edge is split where a new text
    leaves it. Each character of ``text`` is compared once: building costs the texts' length."""
    node, pos, end = trie, 0, len(text)
    while True:
        edge = node.get(text[pos])
        if edge is None:
            node[text[pos]] = [text[pos:], None, entry]
            return
        label = edge[0]
        if text.startswith(label, pos):
            pos += len(label)
            if pos == end:
                edge[2] = entry
                return
            if edge[1] is None:
                edge[1] = {}
            node = edge[1]
            continue
        common = 1  # label[0] == text[pos]
        while pos + common < end and label[common] == text[pos + common]:
            common += 1
        middle = [label[:common], {label[common]: [label[common:], edge[1], edge[2]]}, None]
        node[text[pos]] = middle
        if pos + common == end:
            middle[2] = entry
        else:
            middle[1][text[pos + common]] = [text[pos + common:], None, entry]
        return
