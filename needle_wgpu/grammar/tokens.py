"""From a byte automaton to the token ids a model may sample next.

``Vocabulary`` holds a tokenizer's token byte strings once as a byte trie. A ``Constraint``
(automaton + vocabulary) finds the allowed ids of a state by walking the trie against the
automaton, dropping a branch at its first disallowed byte, and caches the answer per state (with
counters clipped to the longest token, so a long string's characters share one mask). A
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


class Constraint:
    """One grammar over one vocabulary: the mask of every state, computed once and cached."""

    def __init__(self, automaton: Automaton, vocabulary: Vocabulary):
        self.automaton, self.vocabulary = automaton, vocabulary
        self._masks: dict = {}
        self.walks = 0  # how many masks were computed (the rest came from the cache)

    def matcher(self) -> "Matcher":
        return Matcher(self)

    def allowed(self, state, budget: int | None = None) -> tuple:
        """(sorted allowed ids, their bitmask as bytes) for a state; with ``budget`` (the ids
        that may still be sampled, this one included), only ids after which the text can still
        be finished, EOS included, within the budget (every byte is a token, so k bytes take at
        most k ids). Far from the end of the budget no token can break that and the cached
        mask serves; near it the masks are walked from the exact state."""
        automaton = self.automaton
        if budget is not None and budget - 1 < automaton.finish(state) + self._reach():
            key = (state, budget)
            entry = self._masks.get(key)
            if entry is None:
                entry = self._masks[key] = self._walk(state, budget)
            return entry
        key = automaton.canon(state, self.vocabulary.longest)
        entry = self._masks.get(key)
        if entry is None:
            entry = self._masks[key] = self._walk(key)
        return entry

    def _reach(self) -> int:
        """How much one token can raise the bytes still needed: each byte can enter nested
        values, none needing more than the largest node's fewest bytes."""
        return self.vocabulary.longest * (max(self.automaton.sizes[1:], default=0) + 1) + 1  # the root is never entered

    def _walk(self, state, budget: int | None = None) -> tuple:
        self.walks += 1
        automaton = self.automaton
        advance, children, ends = automaton.advance, self.vocabulary.children, self.vocabulary.ends
        ids = []
        todo = [(0, state)]
        while todo:
            node, at = todo.pop()
            for byte, child in children[node].items():
                after = advance(at, byte)
                if after:
                    if ends[child] and (budget is None or automaton.finish(after) <= budget - 2):
                        ids.extend(ends[child])
                    if children[child]:
                        todo.append((child, after))
        if automaton.accepts(state) and (budget is None or budget >= 1):
            ids.extend(self.vocabulary.eos_ids)
        ids.sort()
        words = bytearray(4 * (-(-self.vocabulary.rows // 32)))
        for i in ids:
            words[i >> 3] |= 1 << (i & 7)
        return tuple(ids), bytes(words)


class Matcher:
    """One generation under a constraint: feed it each sampled id, ask it for the next mask."""

    def __init__(self, constraint: Constraint):
        self.constraint = constraint
        self.state = constraint.automaton.initial
        self.ended = False  # an EOS id was accepted
        self.text = bytearray()

    def allowed_ids(self, budget: int | None = None) -> tuple:
        return () if self.ended else self.constraint.allowed(self.state, budget)[0]

    def mask(self, budget: int | None = None) -> bytes:
        """The allowed ids as a bitmask: bit i of byte i // 8 (little-endian u32 words).
        ``budget``: the ids that may still be sampled, this one included (``Constraint.allowed``)."""
        return self.constraint.allowed(self.state, budget)[1]

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
