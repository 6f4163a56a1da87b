"""From a byte automaton to the token ids a model may sample next.

``Vocabulary`` holds a tokenizer's token byte strings once as a byte trie. A ``Constraint``
(automaton + vocabulary) finds the allowed ids of a state by walking the trie against the
automaton, dropping a branch at its first disallowed byte, and caches the answer per state (with
counters clipped to the longest token, so a long string's characters share one mask). The token
budget reuses that answer: each cached mask groups its ids by the bytes the text needs after
them, so a step near the end of the budget only clears the groups that no longer fit. A
``Matcher`` follows one generation: its state, the allowed ids, the bitmask the GPU sampler reads
(bit i of u32 word i // 32 = id i allowed; vocab/8 bytes), and the accepted tokens.

Tokenizer-neutral: it takes the bytes each id decodes to and the EOS ids. EOS is allowed exactly
where the grammar may end; ids with no bytes (BOS, pad, control tokens) never are. Every state the
matcher reaches has a non-empty mask provided the vocabulary spells every single byte (byte-level
BPE and byte-fallback vocabularies do).
"""

from __future__ import annotations

from .automaton import Automaton, GrammarError


class Vocabulary:
    """A tokenizer's token byte strings as a trie (built once per tokenizer)."""

    def __init__(self, token_bytes, eos_ids=(), rows: int | None = None):
        self.token_bytes = [bytes(b) for b in token_bytes]
        self.rows = len(self.token_bytes) if rows is None else int(rows)
        if self.rows < len(self.token_bytes):
            raise GrammarError(f"vocabulary: {len(self.token_bytes)} tokens but {self.rows} rows")
        self.eos_ids = tuple(sorted({int(i) for i in eos_ids if 0 <= int(i) < self.rows}))
        eos = set(self.eos_ids)
        self.children: list = [{}]  # node -> {byte: child node}
        self.ends: list = [[]]  # node -> ids whose bytes end here
        for token_id, data in enumerate(self.token_bytes):
            if not data or token_id in eos:
                continue
            node = 0
            for byte in data:
                child = self.children[node].get(byte)
                if child is None:
                    child = len(self.children)
                    self.children[node][byte] = child
                    self.children.append({})
                    self.ends.append([])
                node = child
            self.ends[node].append(token_id)
        self.longest = max((len(b) for b in self.token_bytes), default=1)

    @classmethod
    def of_tokenizer(cls, tokenizer, rows: int | None = None, eos_ids=None) -> "Vocabulary":
        """A Needle tokenizer (``piece_bytes``, '▁' read as a space) or a GGUF one (``token_bytes``)."""
        if hasattr(tokenizer, "token_bytes"):
            size = tokenizer.vocab_size
            pieces = [tokenizer.token_bytes(i) for i in range(size)]
        else:
            size = len(tokenizer._piece_bytes) if hasattr(tokenizer, "_piece_bytes") else tokenizer.vocab_size
            pieces = [tokenizer.piece_bytes(i).replace("▁".encode(), b" ") for i in range(size)]
        stops = tokenizer.stop_ids if eos_ids is None else eos_ids
        return cls(pieces, stops, rows)


class Mask:
    """The allowed ids of one state: sorted ``ids``, the ``bits`` the GPU sampler reads (bit i of
    byte i // 8), and, for the token budget, ``worst``: the most bytes the text still needs after
    any allowed id (-1 for EOS), with the ids grouped by that need (``needs``: need -> ids)."""

    __slots__ = ("ids", "bits", "worst", "needs", "_cuts")

    def __init__(self, ids, bits: bytes, needs: dict):
        self.ids, self.bits, self.needs = ids, bits, needs
        self.worst = max(needs, default=-1)
        self._cuts: dict = {}

    def within(self, room: int) -> "Mask":
        """Only the ids after which the text needs at most ``room`` bytes: the cached answer with
        the too-costly groups cleared (work in proportion to the ids cleared, not the vocabulary)."""
        if room >= self.worst:
            return self
        cut = self._cuts.get(room)
        if cut is None:
            kept = {need: ids for need, ids in self.needs.items() if need <= room}
            dropped = [i for need, ids in self.needs.items() if need > room for i in ids]
            bits = bytearray(self.bits)
            for i in dropped:
                bits[i >> 3] &= ~(1 << (i & 7)) & 0xFF
            gone = set(dropped)
            cut = self._cuts[room] = Mask(_LazyIds(self.ids, gone), bytes(bits), kept)
        return cut


class _LazyIds:
    """The ids of a cut mask, sorted only when asked for (the sampler reads the bits)."""

    def __init__(self, ids, gone):
        self._source, self._gone, self._ids = ids, gone, None

    def get(self) -> tuple:
        if self._ids is None:
            self._ids = tuple(i for i in _ids(self._source) if i not in self._gone)
        return self._ids


def _ids(ids) -> tuple:
    return ids.get() if isinstance(ids, _LazyIds) else ids


class Constraint:
    """One grammar over one vocabulary: the mask of every state, computed once and cached.

    The cache key is the state with counters clipped to the longest token (``Automaton.canon``),
    so a long string's characters share one mask. The token budget costs no walk: each mask knows
    how many bytes the text needs after each allowed id, and a step near the end of the budget
    clears the ids that would not fit from the cached bits."""

    def __init__(self, automaton: Automaton, vocabulary: Vocabulary):
        self.automaton, self.vocabulary = automaton, vocabulary
        self._masks: dict = {}  # canonical state -> Mask
        self._exact: dict = {}  # exact state -> Mask, only where clipping hid bytes still needed
        self._keys: dict = {}  # state -> (canonical state, slack)
        self.walks = 0  # how many masks were computed by a trie walk
        self.nodes_visited = 0  # trie nodes those walks visited
        self.lookups = 0  # how many masks were asked for

    def matcher(self) -> "Matcher":
        return Matcher(self)

    def allowed(self, state, budget: int | None = None) -> tuple:
        """(sorted allowed ids, their bitmask as bytes) for a state (``entry`` for the rules)."""
        entry = self.entry(state, budget)
        return _ids(entry.ids), entry.bits

    def entry(self, state, budget: int | None = None) -> Mask:
        """The ``Mask`` of a state; with ``budget`` (the ids that may still be sampled, this one
        included), only ids after which the text can still be finished, EOS included, within the
        budget (every byte is a token, so k bytes take at most k ids: an id is kept when the
        bytes needed after it are at most budget - 2, EOS when budget >= 1)."""
        self.lookups += 1
        key, slack = self._key(state)
        entry = self._masks.get(key)
        if entry is None:
            entry = self._masks[key] = self._walk(key)
        if budget is None:
            return entry
        room = budget - 2
        if room - slack >= entry.worst:  # no id can overrun the budget: the cached mask serves
            return entry
        if slack:  # clipping hid bytes still needed: the exact state's own walk (rare: long minLength)
            entry = self._exact.get(state)
            if entry is None:
                entry = self._exact[state] = self._walk(state)
        return entry.within(room)

    def _key(self, state) -> tuple:
        """The cache key of ``state`` and its slack: by how many bytes clipping may have lowered
        what the text still needs (0 unless a string's minLength reaches past the longest token).
        After any one token, the exact state needs at most ``slack`` bytes more than the key's."""
        known = self._keys.get(state)
        if known is None:
            automaton = self.automaton
            key = automaton.canon(state, self.vocabulary.longest)
            slack = 0
            for stack in state:
                if stack:
                    node_index, local = stack[-1]
                    node = automaton.nodes[node_index]
                    slack = max(slack, node.rest(local, automaton.sizes) -
                                node.rest(node.canon(local, self.vocabulary.longest), automaton.sizes))
            known = self._keys[state] = (key, slack)
        return known

    def _walk(self, state) -> Mask:
        """The trie against the automaton from ``state``: a branch is dropped at its first
        disallowed byte; each id that ends on an allowed byte is grouped by the bytes the text
        needs after it."""
        self.walks += 1
        automaton = self.automaton
        advance, finish = automaton.advance, automaton.finish
        children, ends = self.vocabulary.children, self.vocabulary.ends
        needs: dict = {}
        visited = 0
        todo = [(0, state)]
        while todo:
            node, at = todo.pop()
            for byte, child in children[node].items():
                visited += 1
                after = advance(at, byte)
                if after:
                    if ends[child]:
                        needs.setdefault(finish(after), []).extend(ends[child])
                    if children[child]:
                        todo.append((child, after))
        self.nodes_visited += visited
        if automaton.accepts(state) and self.vocabulary.eos_ids:
            needs.setdefault(-1, []).extend(self.vocabulary.eos_ids)
        ids = sorted(i for group in needs.values() for i in group)
        words = bytearray(4 * (-(-self.vocabulary.rows // 32)))
        for i in ids:
            words[i >> 3] |= 1 << (i & 7)
        return Mask(tuple(ids), bytes(words), needs)


class Matcher:
    """One generation under a constraint: feed it each sampled id, ask it for the next mask."""

    def __init__(self, constraint: Constraint):
        self.constraint = constraint
        self.state = constraint.automaton.initial
        self.ended = False  # an EOS id was accepted
        self.text = bytearray()

    def allowed_ids(self, budget: int | None = None) -> tuple:
        return () if self.ended else _ids(self.constraint.entry(self.state, budget).ids)

    def mask(self, budget: int | None = None) -> bytes:
        """The allowed ids as a bitmask: bit i of byte i // 8 (little-endian u32 words).
        ``budget``: the ids that may still be sampled, this one included (``Constraint.entry``)."""
        return self.constraint.entry(self.state, budget).bits

    def fits(self, budget: int) -> bool:
        """Whether the text can still be finished (EOS included) within ``budget`` ids."""
        return self.constraint.automaton.finish(self.state) + 1 <= budget

    @property
    def accepting(self) -> bool:
        return self.constraint.automaton.accepts(self.state)

    def accept(self, token_id: int) -> None:
        """Advance by one sampled id; raises ``GrammarError`` for an id the mask did not allow."""
        vocabulary = self.constraint.vocabulary
        if self.ended:
            raise GrammarError("the constrained text has already ended")
        if token_id in vocabulary.eos_ids:
            if not self.accepting:
                raise GrammarError("end of text at a place the grammar does not allow it")
            self.ended = True
            return
        data = vocabulary.token_bytes[token_id] if 0 <= token_id < len(vocabulary.token_bytes) else b""
        after = self.constraint.automaton.advance_bytes(self.state, data) if data else None
        if not after:
            raise GrammarError(f"token {token_id} ({data!r}) is not allowed here")
        self.state = after
        self.text += data
