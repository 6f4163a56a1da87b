"""A byte automaton for constrained decoding: grammar nodes, and the matcher that runs them.

A grammar is a list of nodes; node ``i``'s state is a small hashable ``local`` value. A
configuration is a stack of frames ``(node, local)`` (a node that calls a child keeps, in its own
frame, the local it returns to); a matcher state is a frozenset of such stacks (several at once
where ``anyOf`` leaves the choice open), plus ``ACCEPT`` (the empty stack) once the whole grammar
may end. Every grammar is finite (no recursion; strings, thinking text, arrays and numbers are
bounded), so every output ends.

Each node answers, for one of its locals:
  ``start``               the local it begins in
  ``step(local, byte)``   the local after one more byte, or None (the byte is not allowed here)
  ``calls(local)``        children it may run next: (child index, the local to return to)
  ``final(local)``        whether this node's text may end here
  ``canon(local, span)``  the same local with counters clipped to what ``span`` bytes can reach:
                          two locals with the same canon allow the same tokens (mask cache key)
Pure Python (it runs in the browser).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from fractions import Fraction

from ..errors import InputError

ACCEPT = ()  # the empty stack: the grammar's text is complete


class GrammarError(InputError):
    """A schema (or grammar) the engine cannot compile, or one no text can satisfy."""


class Node:
    start = 0

    def step(self, local, byte):
        return None

    def calls(self, local):
        return ()

    def final(self, local) -> bool:
        return False

    def reads(self, local) -> bool:
        return True

    def canon(self, local, span: int):
        return local

    def rest(self, local, sizes) -> int:
        """The fewest bytes that finish this node from ``local`` (``sizes``: node -> fewest bytes
        of its whole text, for the children it still calls)."""
        return 0

    def sealed(self, local, plain) -> bool:
        """Whether bytes of ``plain`` alone can never finish this node from ``local`` (nor call
        a child): what follows the node cannot matter to a text of such bytes."""
        return False


class Literal(Node):
    """Exactly one byte string."""

    def __init__(self, text: bytes):
        self.text = bytes(text)

    def step(self, at, byte):
        return at + 1 if at < len(self.text) and self.text[at] == byte else None

    def final(self, at):
        return at == len(self.text)

    def reads(self, at):
        return at < len(self.text)

    def rest(self, at, sizes):
        return len(self.text) - at


class Options(Node):
    """One of several byte strings (enum, const, true/false). The options are sorted, so those
    that begin with the bytes read so far are a run of them: local = (first, end, bytes read),
    the run ``options[first:end]``. A state costs the same however long the options are."""

    def __init__(self, options):
        self.options = tuple(sorted(set(bytes(o) for o in options)))
        self.start = (0, len(self.options), 0)

    def step(self, local, byte):
        first, end, at = local
        options = self.options

        def key(option):  # within the run: the option equal to the prefix first, then by byte
            return option[at] if len(option) > at else -1

        low = bisect_left(options, byte, first, end, key=key)
        high = bisect_right(options, byte, low, end, key=key)
        return (low, high, at + 1) if low < high else None

    def final(self, local):
        first, end, at = local
        return first < end and len(self.options[first]) == at

    def rest(self, local, sizes):
        first, end, at = local
        return min(len(o) for o in self.options[first:end]) - at


class Sequence(Node):
    """Children one after another; local = the index of the next one."""

    def __init__(self, children):
        self.children = tuple(children)

    def calls(self, i):
        return ((self.children[i], i + 1),) if i < len(self.children) else ()

    def final(self, i):
        return i == len(self.children)

    def reads(self, i):
        return False

    def rest(self, i, sizes):
        return sum(sizes[c] for c in self.children[i:])


class Choice(Node):
    """Any one of its children (anyOf / oneOf: the text of one branch)."""

    def __init__(self, children):
        self.children = tuple(children)

    def calls(self, local):
        return tuple((c, 1) for c in self.children) if local == 0 else ()

    def final(self, local):
        return local == 1

    def reads(self, local):
        return False

    def rest(self, local, sizes):
        return min(sizes[c] for c in self.children) if local == 0 else 0


class FreeText(Node):
    """Any bytes not containing ``end``, then ``end``, at most ``max_bytes`` in all (``end``
    included); local = (bytes of ``end`` matched, bytes left). ``end`` must not repeat its first
    byte (true of tags such as ``</think>``), so a mismatch restarts the match at once."""

    def __init__(self, end: bytes, max_bytes: int):
        self.end = bytes(end)
        if self.end[0] in self.end[1:]:
            raise GrammarError("free text: the end marker repeats its first byte")
        self.start = (0, max_bytes)

    def step(self, local, byte):
        matched, room = local
        if matched == len(self.end) or room <= 0:
            return None
        if byte == self.end[matched]:
            matched += 1
        else:
            matched = 1 if byte == self.end[0] else 0
        room -= 1
        if room < len(self.end) - matched:  # no room left to finish with the end marker
            return None
        return matched, room

    def final(self, local):
        return local[0] == len(self.end)

    def canon(self, local, span):
        return local[0], min(local[1], span + len(self.end) + 1)

    def rest(self, local, sizes):
        return len(self.end) - local[0]

    def sealed(self, local, plain):
        return any(b not in plain for b in self.end[local[0]:])


# UTF-8: a lead byte -> (continuation bytes, the allowed range of the first of them)
def _lead(byte):
    if 0xC2 <= byte <= 0xDF:
        return 1, 0x80, 0xBF
    if 0xE0 <= byte <= 0xEF:
        return 2, (0xA0 if byte == 0xE0 else 0x80), (0x9F if byte == 0xED else 0xBF)
    if 0xF0 <= byte <= 0xF4:
        return 3, (0x90 if byte == 0xF0 else 0x80), (0x8F if byte == 0xF4 else 0xBF)
    return None


ESCAPES = frozenset(b'"\\/bfnrt')


class String(Node):
    """A JSON string of min_length .. max_length characters (code points): valid UTF-8, no control
    characters, the escapes \\" \\\\ \\/ \\b \\f \\n \\r \\t (each one character; no \\u).
    local = None before the opening quote, "end" after the closing one, else (characters still
    needed, characters still allowed, continuation bytes pending, their range, escaping)."""

    start = None

    def __init__(self, min_length: int, max_length: int):
        self.min_length, self.max_length = min_length, max_length

    def step(self, local, byte):
        if local is None:
            return (self.min_length, self.max_length, 0, 0x80, 0xBF, False) if byte == 0x22 else None
        if local == "end":
            return None
        need, room, pending, low, high, escaping = local
        if pending:
            return (need, room, pending - 1, 0x80, 0xBF, False) if low <= byte <= high else None
        if escaping:
            return (need, room, 0, 0x80, 0xBF, False) if byte in ESCAPES else None
        if byte == 0x22:
            return "end" if need == 0 else None
        if room == 0 or byte < 0x20:
            return None
        need, room = max(need - 1, 0), room - 1
        if byte == 0x5C:
            return need, room, 0, 0x80, 0xBF, True
        if byte < 0x80:
            return need, room, 0, 0x80, 0xBF, False
        lead = _lead(byte)
        return None if lead is None else (need, room) + lead + (False,)

    def final(self, local):
        return local == "end"

    def rest(self, local, sizes):
        if local is None:
            return self.min_length + 2
        if local == "end":
            return 0
        return local[0] + local[2] + local[5] + 1  # characters, pending bytes, an escape, the quote

    def sealed(self, local, plain):
        return local != "end" and 0x22 not in plain  # only a quote ends a string

    def canon(self, local, span):
        if local is None or local == "end":
            return local
        need, room = local[0], local[1]
        return (min(need, span + 1), min(room, span + 1)) + local[2:]


class Number(Node):
    """A JSON number in [low, high] (either may be None; ``exclusive_low``/``exclusive_high``
    make that end open): -?(0|[1-9][0-9]*)(.[0-9]+)?, no exponent, at most ``int_digits``
    digits before the point and ``frac_digits`` after it (``integer``: no point).
    local = the bytes so far; a prefix is kept only while some completion lies in range.

    Bounds are compared as a JSON parser and a validator do, on the float the text reads as;
    rounding to the nearest float is monotone, so on the grid of 10^-frac_digits that is one
    exact decimal threshold per end (``_grid_bound``)."""

    start = b""

    def __init__(self, integer: bool, low=None, high=None, exclusive_low=False, exclusive_high=False,
                 int_digits: int = 12, frac_digits: int = 6):
        self.integer = integer
        self.int_digits, self.frac_digits = int_digits, 0 if integer else frac_digits
        self.quantum = Fraction(1, 10 ** self.frac_digits)
        self.low = None if low is None else self._grid_bound(low, exclusive_low, upper=False)
        self.high = None if high is None else self._grid_bound(high, exclusive_high, upper=True)
        self._rests: dict = {}  # text -> fewest bytes that finish it
        self._live: dict = {}  # text -> whether it is a prefix of a number in range

    def _grid_bound(self, bound, exclusive: bool, upper: bool) -> Fraction:
        """The smallest grid value whose float is >= bound (> when exclusive), or for ``upper``
        the largest whose float is <= bound (<). A bound beyond what ``int_digits`` digits can
        write is clipped to 2·10^int_digits first (the same texts are allowed), so a bound of
        1e300 or 10**400 costs what a small one does; the threshold is found by galloping and
        bisection over grid steps (floats are sparse where the grid is fine)."""
        q, reach = self.quantum, 2 * 10 ** self.int_digits  # beyond every text's float
        bound = float(max(-reach, min(reach, bound)))  # an int of any size compares exactly

        def inside(k: int) -> bool:  # whether the grid value k·q satisfies the bound
            value = float(k * q)
            if upper:
                return value < bound if exclusive else value <= bound
            return value > bound if exclusive else value >= bound

        # inside(k) is monotone in k: true below the threshold for an upper bound, above it
        # for a lower one. Find one k on each side, then bisect.
        toward = -1 if upper else 1  # the direction in which inside() becomes true
        k = int(Fraction(bound) // q)
        step = 1
        while not inside(k):
            k += toward * step
            step *= 2
        outside, step = k - toward, 1
        while inside(outside):
            outside -= toward * step
            step *= 2
        while abs(k - outside) > 1:  # inside(k), not inside(outside)
            middle = (k + outside) // 2
            if inside(middle):
                k = middle
            else:
                outside = middle
        return k * q

    def _in_range(self, value: Fraction) -> bool:
        return (self.low is None or value >= self.low) and (self.high is None or value <= self.high)

    def _meets(self, a: Fraction, b: Fraction, step: Fraction) -> bool:
        """Whether some multiple of ``step`` in [a, b] lies in range."""
        lo = a if self.low is None else max(a, self.low)
        hi = b if self.high is None else min(b, self.high)
        return lo <= hi

    def feasible(self, text: bytes) -> bool:
        """Whether ``text`` is a prefix of a number in range (within the digit limits)."""
        negative = text.startswith(b"-")
        body = text[1:] if negative else text
        whole, dot, frac = body.partition(b".")
        if not whole.isdigit() and whole:
            return False
        if len(whole) > self.int_digits or len(frac) > self.frac_digits or (dot and not whole):
            return False
        if dot and self.integer or (frac and not frac.isdigit()):
            return False
        if whole.startswith(b"0") and len(whole) > 1 or self.integer and text == b"-0":
            return False
        quantum = self.quantum
        spans = []  # [a, b] magnitude ranges the completions cover, all on the quantum's grid
        if not whole:
            spans.append((Fraction(0), Fraction(10 ** self.int_digits) - quantum))
        elif dot:
            value = Fraction(int(whole + frac), 10 ** len(frac))
            spans.append((value, value + Fraction(1, 10 ** len(frac)) - quantum))
        elif whole == b"0":
            spans.append((Fraction(0), 1 - quantum))
        else:
            n = int(whole)
            for extra in range(self.int_digits - len(whole) + 1):
                scale = 10 ** extra
                spans.append((Fraction(n * scale), Fraction((n + 1) * scale) - quantum))
        for a, b in spans:
            if negative:
                a, b = -b, -a
            if self._meets(a, b, quantum):
                return True
            if not text:  # the empty prefix: the negative side too
                if self._meets(-b, -a, quantum):
                    return True
        return False

    def step(self, text, byte):
        if not (0x30 <= byte <= 0x39 or byte == 0x2D and not text or byte == 0x2E):
            return None
        longer = text + bytes((byte,))
        live = self._live.get(longer)
        if live is None:  # memoised: many states (and mask walks) share a number's prefixes
            live = self._live[longer] = self.feasible(longer)
        return longer if live else None

    def rest(self, text, sizes):
        """Breadth first over the next bytes (numbers are short; a wide search is cut off at a
        bound that is always enough: every digit allowed). Memoised: mask walks ask often."""
        known = self._rests.get(text)
        if known is None:
            known = self._rests[text] = self._search_rest(text)
        return known

    def _search_rest(self, text):
        frontier, depth = [text], 0
        while frontier and depth <= self.int_digits + self.frac_digits + 3:
            if any(self.final(t) for t in frontier):
                return depth
            frontier = [n for t in frontier[:256] for b in b"0123456789-." for n in (self.step(t, b),) if n]
            depth += 1
        return self.int_digits + self.frac_digits + 3

    def final(self, text):
        body = text[1:] if text.startswith(b"-") else text
        if not body or body.endswith(b".") or body == b"0" and text.startswith(b"-"):
            return False
        whole, _, frac = body.partition(b".")
        value = Fraction(int(whole + frac), 10 ** len(frac))
        return self._in_range(-value if text.startswith(b"-") else value)


class JsonObject(Node):
    """``{"k":v,...}`` with the properties in their declared order, each optional one skippable,
    no others (additionalProperties false). local: ("open",), (1, i, first) before a key or
    "}", (2, i, key bytes so far), (3, j) before ":", (4, j) the value of property j,
    (5, i) after a value, ("end",)."""

    start = ("open",)

    def __init__(self, keys, values, required):
        self.keys = tuple(keys)  # each key's JSON text, quotes included
        self.values = tuple(values)
        self.required = tuple(required)  # bool per property

    def _candidates(self, i):
        out = []
        for j in range(i, len(self.keys)):
            out.append(j)
            if self.required[j]:
                break
        return out

    def _may_close(self, i):
        return not any(self.required[i:])

    def step(self, local, byte):
        phase = local[0]
        if phase == "open":
            return (1, 0, True) if byte == 0x7B else None
        if phase == 1:
            _, i, first = local
            if byte == 0x7D and first and self._may_close(i):
                return ("end",)
            return self._key(i, b"", byte)
        if phase == 2:
            return self._key(local[1], local[2], byte)
        if phase == 3:
            return (4, local[1]) if byte == 0x3A else None
        if phase == 5:
            i = local[1]
            if byte == 0x2C and i < len(self.keys):
                return 1, i, False
            if byte == 0x7D and self._may_close(i):
                return ("end",)
        return None

    def _key(self, i, prefix, byte):
        longer = prefix + bytes((byte,))
        for j in self._candidates(i):
            if self.keys[j] == longer:
                return 3, j
        if any(self.keys[j].startswith(longer) for j in self._candidates(i)):
            return 2, i, longer
        return None

    def calls(self, local):
        return ((self.values[local[1]], (5, local[1] + 1)),) if local[0] == 4 else ()

    def reads(self, local):
        return local[0] != 4 and local[0] != "end"

    def final(self, local):
        return local[0] == "end"

    def _required_rest(self, i, sizes):
        """Bytes of the required properties from i on, each with its comma, and the "}"."""
        return sum(len(self.keys[j]) + 2 + sizes[self.values[j]] for j in range(i, len(self.keys))
                   if self.required[j]) + 1

    def rest(self, local, sizes):
        phase = local[0]
        if phase == "end":
            return 0
        if phase == "open":
            return 1 + max(self._required_rest(0, sizes) - 1, 1)
        if phase == 1:
            i = local[1]
            if any(self.required[i:]):  # the required keys, values and commas between, then "}"
                return self._required_rest(i, sizes) - 1
            if local[2]:
                return 1
            return min(len(self.keys[j]) + 1 + sizes[self.values[j]] for j in self._candidates(i)) + 1
        if phase == 2:
            i, prefix = local[1], local[2]
            return min(len(self.keys[j]) - len(prefix) + 1 + sizes[self.values[j]] + self._required_rest(j + 1, sizes)
                       for j in self._candidates(i) if self.keys[j].startswith(prefix))
        if phase == 3:
            j = local[1]
            return 1 + sizes[self.values[j]] + self._required_rest(j + 1, sizes)
        if phase == 4:
            return self._required_rest(local[1] + 1, sizes)  # after the value (the frame resumes at 5)
        return self._required_rest(local[1], sizes)  # phase 5


class JsonArray(Node):
    """``[item,...]`` with min_items .. max_items items. local: ("open",), (1, n) after "[",
    (2, n) after an item, (3, n) after ",", ("end",)."""

    start = ("open",)

    def __init__(self, item: int, min_items: int, max_items: int):
        self.item, self.min_items, self.max_items = item, min_items, max_items

    def step(self, local, byte):
        phase = local[0]
        if phase == "open":
            return (1, 0) if byte == 0x5B else None
        if phase == 1 and byte == 0x5D and self.min_items == 0:
            return ("end",)
        if phase == 2:
            n = local[1]
            if byte == 0x2C and n < self.max_items:
                return 3, n
            if byte == 0x5D and n >= self.min_items:
                return ("end",)
        return None

    def calls(self, local):
        if local[0] in (1, 3) and local[1] < self.max_items:
            return ((self.item, (2, local[1] + 1)),)
        return ()

    def reads(self, local):
        return local[0] != "end" and local[0] != 3

    def final(self, local):
        return local[0] == "end"

    def rest(self, local, sizes):
        phase, item = local[0], sizes[self.item]
        if phase == "end":
            return 0
        if phase == "open":
            return 2 + self.min_items * item + max(self.min_items - 1, 0)
        n = local[1]
        if phase == 1:
            return 1 + self.min_items * item + max(self.min_items - 1, 0)
        if phase == 2:
            more = max(self.min_items - n, 0)
            return 1 + more * (item + 1)
        return max(self.min_items - n, 1) * (item + 1)  # phase 3: after a comma, inside the call


class JsonMap(Node):
    """``{key:value,...}`` with any keys (``key``: a String node) and at most ``max_items``
    entries, each value the ``value`` node's text (a generic object: ``{"type": "json_object"}``).
    local: ("open",), (1, n) after "{", (2, n) after a key, (3, n) after ":", (4, n) after a
    value, (5, n) after ",", ("end",)."""

    start = ("open",)

    def __init__(self, key: int, value: int, max_items: int):
        self.key, self.value, self.max_items = key, value, max_items

    def step(self, local, byte):
        phase = local[0]
        if phase == "open":
            return (1, 0) if byte == 0x7B else None
        if phase == 1 and byte == 0x7D:
            return ("end",)
        if phase == 2:
            return (3, local[1]) if byte == 0x3A else None
        if phase == 4:
            n = local[1]
            if byte == 0x2C and n < self.max_items:
                return 5, n
            if byte == 0x7D:
                return ("end",)
        return None

    def calls(self, local):
        phase, n = local[0], local[1] if len(local) > 1 else 0
        if phase in (1, 5) and n < self.max_items:
            return ((self.key, (2, n)),)
        if phase == 3:
            return ((self.value, (4, n + 1)),)
        return ()

    def reads(self, local):
        return local[0] in ("open", 1, 2, 4)

    def final(self, local):
        return local[0] == "end"

    def rest(self, local, sizes):
        phase = local[0]
        if phase == "end":
            return 0
        if phase == "open":
            return 2
        if phase == 2:
            return 2 + sizes[self.value]  # ":", the value, "}"
        if phase == 3:
            return 1 + sizes[self.value]
        if phase == 5:
            return sizes[self.key] + 2 + sizes[self.value]
        return 1  # phases 1 and 4: "}"


class Automaton:
    """A compiled grammar: its nodes (the root is node 0) and the matcher states over them.

    States are interned frozensets of stacks, so equal states are one object; transitions are
    memoised per (state, byte).
    """

    def __init__(self, nodes: list):
        self.nodes = nodes
        self._interned: dict = {}
        self._moves: dict = {}
        self.dead = self._intern(frozenset())
        self.initial = self._intern(self._expand_all([((0, nodes[0].start),)]))
        # Fewest bytes of each node's text; a node's children come before it, the root (0) last.
        self.sizes = [0] * len(nodes)
        for index in list(range(1, len(nodes))) + [0]:
            self.sizes[index] = nodes[index].rest(nodes[index].start, self.sizes)
        self._finish: dict = {}

    def finish(self, state: frozenset) -> int:
        """The fewest bytes that complete the text from ``state`` (0 where it may end now)."""
        known = self._finish.get(state)
        if known is None:
            best = None
            for stack in state:
                cost = sum(self.nodes[n].rest(local, self.sizes) for n, local in stack)
                best = cost if best is None else min(best, cost)
            known = self._finish[state] = (1 << 30) if best is None else best
        return known

    def _intern(self, state: frozenset) -> frozenset:
        return self._interned.setdefault(state, state)

    def interned(self, state: frozenset) -> frozenset:
        """The one object of states equal to ``state`` (made from stacks elsewhere)."""
        return self._intern(state)

    def _expand_all(self, stacks) -> frozenset:
        out: set = set()
        for stack in stacks:
            self._expand(stack, out)
        return frozenset(out)

    def _expand(self, stack: tuple, out: set) -> None:
        node_index, local = stack[-1]
        node = self.nodes[node_index]
        if node.reads(local):
            out.add(stack)
        for child, back in node.calls(local):
            self._expand(stack[:-1] + ((node_index, back), (child, self.nodes[child].start)), out)
        if node.final(local):
            if len(stack) == 1:
                out.add(ACCEPT)
            else:
                self._expand(stack[:-1], out)

    def advance(self, state: frozenset, byte: int) -> frozenset:
        """The state after one byte (``dead``, the empty state, where it is not allowed)."""
        key = (state, byte)
        moved = self._moves.get(key)
        if moved is None:
            out: set = set()
            for stack in state:
                if stack:
                    node_index, local = stack[-1]
                    after = self.nodes[node_index].step(local, byte)
                    if after is not None:
                        self._expand(stack[:-1] + ((node_index, after),), out)
            moved = self._moves[key] = self._intern(frozenset(out))
        return moved

    def advance_bytes(self, state: frozenset, data: bytes) -> frozenset:
        for byte in data:
            if not state:
                return state
            state = self.advance(state, byte)
        return state

    def accepts(self, state: frozenset) -> bool:
        return ACCEPT in state

    def canon(self, state: frozenset, span: int) -> frozenset:
        """``state`` with each top frame's counters clipped to what ``span`` bytes can reach."""
        out = set()
        for stack in state:
            if stack:
                node_index, local = stack[-1]
                stack = stack[:-1] + ((node_index, self.nodes[node_index].canon(local, span)),)
            out.add(stack)
        return self._intern(frozenset(out))

    def matches(self, data: bytes) -> bool:
        """Whether ``data`` is a complete text of the grammar."""
        return self.accepts(self.advance_bytes(self.initial, data))
