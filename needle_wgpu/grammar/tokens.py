"""From a byte automaton to the token ids a model may sample next.

``Vocabulary`` holds a tokenizer's token byte strings once, as byte tries by token length (ids
of at most 4 bytes, at most 8, ...). A ``Constraint`` (automaton + vocabulary) finds the allowed
ids of a state by walking each trie against the automaton, dropping a branch at its first
disallowed byte, and caches each trie's answer per state with counters clipped to that trie's
longest token: a long string's characters share one mask, and near the string's end only the
tries of the tokens that no longer fit are walked again (each small). The token budget reuses
those answers: each groups its ids by the bytes the text needs after them, so a step near the
end of the budget only clears the groups that no longer fit. A ``Matcher`` follows one
generation: its state, the allowed ids, the bitmask the GPU sampler reads (bit i of u32 word
i // 32 = id i allowed; vocab/8 bytes), and the accepted tokens.

Tokenizer-neutral: it takes the bytes each id decodes to and the EOS ids. EOS is allowed exactly
where the grammar may end; ids with no bytes (BOS, pad, control tokens) never are. Every state the
matcher reaches has a non-empty mask provided the vocabulary spells every single byte (byte-level
BPE and byte-fallback vocabularies do).
"""

from __future__ import annotations

from .automaton import Automaton, GrammarError

# The longest token of each trie; longer tokens go to a last trie of their own.
TRIE_SPANS = (4, 8, 12, 16, 24, 32, 48, 64)
# Bytes that never end a string or free text (no quote, no tag bracket) nor build JSON structure:
# a token made of these alone, inside a string, cannot reach what follows the string.
PLAIN = frozenset(range(0x20, 0x100)) - frozenset(b'"\\<>{}[],:')


class Trie:
    """The tokens of at most ``span`` bytes as a byte trie; ``plain``: only tokens of PLAIN bytes."""

    def __init__(self, span: int, plain: bool):
        self.span, self.plain = span, plain
        self.children: list = [{}]  # node -> {byte: child node}
        self.ends: list = [[]]  # node -> ids whose bytes end here

    def add(self, token_id: int, data: bytes) -> None:
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


class Vocabulary:
    """A tokenizer's token byte strings as tries by length (built once per tokenizer)."""

    def __init__(self, token_bytes, eos_ids=(), rows: int | None = None):
        self.token_bytes = [bytes(b) for b in token_bytes]
        self.rows = len(self.token_bytes) if rows is None else int(rows)
        if self.rows < len(self.token_bytes):
            raise GrammarError(f"vocabulary: {len(self.token_bytes)} tokens but {self.rows} rows")
        self.eos_ids = tuple(sorted({int(i) for i in eos_ids if 0 <= int(i) < self.rows}))
        self.longest = max((len(b) for b in self.token_bytes), default=1)
        spans = [s for s in TRIE_SPANS if s < self.longest] + [self.longest]
        tries = {(span, plain): Trie(span, plain) for span in spans for plain in (False, True)}
        eos = set(self.eos_ids)
        for token_id, data in enumerate(self.token_bytes):
            if data and token_id not in eos:
                span = next(s for s in spans if len(data) <= s)
                tries[span, PLAIN.issuperset(data)].add(token_id, data)
        # the first trie is kept even if empty: EOS goes with it
        self.tries = tuple(t for i, t in enumerate(tries.values()) if i == 0 or len(t.children) > 1)
        self.mask_bytes = 4 * (-(-self.rows // 32))

    @classmethod
    def of_tokenizer(cls, tokenizer, rows: int | None = None, eos_ids=None) -> "Vocabulary":
        """The vocabulary of a tokenizer: each id's ``token_bytes`` (every family's tokenizer
        has it: the bytes the id puts into decoded text)."""
        pieces = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        stops = tokenizer.stop_ids if eos_ids is None else eos_ids
        return cls(pieces, stops, rows)


class Mask:
    """The allowed ids of one state as the bitmask integer ``value`` (bit i = id i allowed), and,
    for the token budget, ``worst``: the most bytes the text still needs after any allowed id (-1
    for EOS). A walk's mask groups its ids by that need (``needs``: need -> ids; worked out from
    the states after each id the first time a budget asks); a state's mask is the union of its
    tries' masks (``parts``)."""

    __slots__ = ("value", "parts", "_size", "_afters", "_finish", "_needs", "_worst", "_bits", "_ids", "_cuts")

    def __init__(self, value: int, size: int, *, parts=None, needs=None, afters=None, finish=None):
        self.value, self._size, self.parts = value, size, parts
        self._needs, self._afters, self._finish = needs, afters, finish  # afters: state (None: EOS) -> ids
        self._worst = self._bits = self._ids = None
        self._cuts: dict = {}

    @classmethod
    def union(cls, parts, size: int) -> "Mask":
        value = 0
        for part in parts:
            value |= part.value
        return cls(value, size, parts=tuple(parts))

    @property
    def bits(self) -> bytes:
        """The bitmask the sampler reads: bit i of byte i // 8 (little-endian u32 words)."""
        if self._bits is None:
            self._bits = self.value.to_bytes(self._size, "little")
        return self._bits

    @property
    def ids(self) -> tuple:
        if self._ids is None:
            if self.parts is not None:
                groups = [p.ids for p in self.parts]
            else:
                groups = (self._needs if self._needs is not None else self._afters).values()
            self._ids = tuple(sorted(i for group in groups for i in group))
        return self._ids

    @property
    def needs(self) -> dict:
        if self._needs is None:
            needs: dict = {}
            for after, ids in self._afters.items():
                needs.setdefault(-1 if after is None else self._finish(after), []).extend(ids)
            self._needs, self._afters = needs, None
        return self._needs

    @property
    def worst(self) -> int:
        if self._worst is None:
            if self.parts is not None:
                self._worst = max((p.worst for p in self.parts), default=-1)
            else:
                self._worst = max(self.needs, default=-1)
        return self._worst

    def within(self, room: int) -> "Mask":
        """Only the ids after which the text needs at most ``room`` bytes: the cached answer with
        the too-costly groups cleared (work in proportion to the ids cleared, not the vocabulary)."""
        if room >= self.worst:
            return self
        cut = self._cuts.get(room)
        if cut is None:
            if self.parts is not None:
                cut = Mask.union([p.within(room) for p in self.parts], self._size)
            else:
                dropped = bytearray(self._size)
                for need, ids in self.needs.items():
                    if need > room:
                        for i in ids:
                            dropped[i >> 3] |= 1 << (i & 7)
                value = self.value & ~int.from_bytes(dropped, "little")
                cut = Mask(value, self._size, needs={n: ids for n, ids in self.needs.items() if n <= room})
            self._cuts[room] = cut
        return cut


class Constraint:
    """One grammar over one vocabulary: the mask of every state, computed once and cached.

    Each trie's answer is cached under a key of the state (``_key``): counters clipped to that
    trie's longest token, and for plain tokens inside a string, the string alone. The token
    budget costs no walk: each answer knows how many bytes the text needs after each allowed
    id, and a step near the end of the budget clears the ids that would not fit from the cached
    bits."""

    def __init__(self, automaton: Automaton, vocabulary: Vocabulary):
        self.automaton, self.vocabulary = automaton, vocabulary
        self._tries: dict = {}  # (trie, clipped state) -> Mask of that trie's ids
        self._masks: dict = {}  # the tuple of a state's trie keys -> their union
        self._exact: dict = {}  # (trie, exact state) -> Mask, where a tight budget meets an inexact key
        self._keys: dict = {}  # state -> (its trie keys, their slacks)
        self.walks = 0  # how many trie walks were run (every other answer came from the cache)
        self.nodes_visited = 0  # trie nodes those walks visited
        self.lookups = 0  # how many masks were asked for

    def matcher(self) -> "Matcher":
        return Matcher(self)

    def allowed(self, state, budget: int | None = None) -> tuple:
        """(sorted allowed ids, their bitmask as bytes) for a state (``entry`` for the rules)."""
        entry = self.entry(state, budget)
        return entry.ids, entry.bits

    def entry(self, state, budget: int | None = None) -> Mask:
        """The ``Mask`` of a state; with ``budget`` (the ids that may still be sampled, this one
        included), only ids after which the text can still be finished, EOS included, within the
        budget (every byte is a token, so k bytes take at most k ids: an id is kept when the
        bytes needed after it are at most budget - 2, EOS when budget >= 1)."""
        self.lookups += 1
        keys, slacks = self._key(state)
        entry = self._masks.get(keys)
        if entry is None:
            size = self.vocabulary.mask_bytes
            entry = self._masks[keys] = Mask.union([self._trie_mask(key) for key in keys], size)
        if budget is None:
            return entry
        room = budget - 2
        parts = entry.parts
        if all(room - slack >= part.worst for part, (slack, _) in zip(parts, slacks)):
            return entry  # no id can overrun the budget: the cached mask serves
        cuts = []
        for (trie, _), part, (slack, exact) in zip(keys, parts, slacks):
            if not exact:  # the key's stacks hide different amounts: this trie from the exact state
                part = self._exact.get((trie, state))
                if part is None:
                    part = self._exact[trie, state] = self._walk(trie, state)
                slack = 0
            cuts.append(part.within(room - slack))
        return Mask.union(cuts, self.vocabulary.mask_bytes)

    def _key(self, state) -> tuple:
        """The cache key of ``state`` in each trie, and each key's (slack, exact): how many
        bytes the key may hide of what the text still needs. A key clips the counters of each
        stack's top frame to the trie's longest token, and in a trie of plain tokens keeps only
        the top frame of a stack whose node no plain byte can finish (a string's characters:
        their mask is the same in every object and array). After any one token of the trie, the
        exact state needs at most ``slack`` more bytes than the key's state, and exactly that
        many where every stack hides the same (``exact``)."""
        known = self._keys.get(state)
        if known is None:
            automaton = self.automaton
            nodes, sizes = automaton.nodes, automaton.sizes
            keys, slacks = [], []
            for trie in self.vocabulary.tries:
                stacks, hiddens = set(), set()
                for stack in state:
                    if not stack:
                        stacks.add(stack)
                        continue
                    node_index, local = stack[-1]
                    node = nodes[node_index]
                    clipped = node.canon(local, trie.span)
                    hidden = 0 if clipped == local else node.rest(local, sizes) - node.rest(clipped, sizes)
                    top = ((node_index, clipped),)
                    if trie.plain and len(stack) > 1 and node.sealed(local, PLAIN):
                        hidden += sum(nodes[n].rest(at, sizes) for n, at in stack[:-1])
                        stacks.add(top)
                    else:
                        stacks.add(stack[:-1] + top)
                    hiddens.add(hidden)
                keys.append((trie, automaton.interned(frozenset(stacks))))
                slacks.append((max(hiddens, default=0), len(hiddens) <= 1))
            known = self._keys[state] = (tuple(keys), tuple(slacks))
        return known

    def _trie_mask(self, key) -> Mask:
        entry = self._tries.get(key)
        if entry is None:
            entry = self._tries[key] = self._walk(*key)
        return entry

    def _walk(self, trie: Trie, state) -> Mask:
        """One trie against the automaton from ``state``: a branch is dropped at its first
        disallowed byte; the ids that end on an allowed byte are kept with the state after them
        (for the budget). EOS goes with the first trie."""
        self.walks += 1
        automaton = self.automaton
        advance, children, ends = automaton.advance, trie.children, trie.ends
        afters: dict = {}
        words = bytearray(self.vocabulary.mask_bytes)
        visited = 0
        todo = [(0, state)]
        while todo:
            node, at = todo.pop()
            for byte, child in children[node].items():
                visited += 1
                after = advance(at, byte)
                if after:
                    if ends[child]:
                        afters.setdefault(after, []).extend(ends[child])
                        for i in ends[child]:
                            words[i >> 3] |= 1 << (i & 7)
                    if children[child]:
                        todo.append((child, after))
        self.nodes_visited += visited
        if trie is self.vocabulary.tries[0] and automaton.accepts(state) and self.vocabulary.eos_ids:
            afters[None] = list(self.vocabulary.eos_ids)
            for i in self.vocabulary.eos_ids:
                words[i >> 3] |= 1 << (i & 7)
        return Mask(int.from_bytes(words, "little"), self.vocabulary.mask_bytes, afters=afters,
                    finish=automaton.finish)


class Matcher:
    """One generation under a constraint: feed it each sampled id, ask it for the next mask."""

    def __init__(self, constraint: Constraint):
        self.constraint = constraint
        self.state = constraint.automaton.initial
        self.ended = False  # an EOS id was accepted
        self.text = bytearray()

    def allowed_ids(self, budget: int | None = None) -> tuple:
        return () if self.ended else self.constraint.entry(self.state, budget).ids

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
