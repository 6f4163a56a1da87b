"""The constrained-decoding engine (needle_wgpu/grammar): schema compilation, masks, and 1,000
random schemas x random vocabularies x random-logit models run through the reference sampler with
the mask applied: every output parses and validates, every mask is non-empty, and greedy
constrained output equals greedy unconstrained output whenever the latter already conforms."""

from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import pytest

from needle_wgpu.grammar import Automaton, Constraint, GrammarError, Limits, Vocabulary, compile_schema
from needle_wgpu.reference.sampling import allowed_ids, sample

VALIDATOR = jsonschema.Draft7Validator


def automaton(schema, limits=Limits()):
    return Automaton(compile_schema(schema, limits))


# ----------------------------------------------------------------------------- compilation


def test_objects_keep_declared_order_and_required():
    a = automaton({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
                   "required": ["b"], "additionalProperties": False})
    assert a.matches(b'{"a":1,"b":true}')
    assert a.matches(b'{"b":false}')
    assert not a.matches(b'{"a":1}')  # b is required
    assert not a.matches(b'{"b":true,"a":1}')  # declared order
    assert not a.matches(b'{"b":true,"c":1}')  # no other properties
    assert not a.matches(b'{"b":true,}')


def test_strings_count_characters_and_escapes():
    a = automaton({"type": "string", "minLength": 2, "maxLength": 3})
    assert a.matches('"é\\n"'.encode()) and a.matches(b'"abc"')
    assert not a.matches(b'"a"') and not a.matches(b'"abcd"')
    assert not a.matches(b'"a\nb"')  # a raw control character
    assert not a.matches(b'"\xc3"') and not a.matches(b'"\xed\xa0\x80"')  # invalid UTF-8, a surrogate
    assert automaton({"type": "string", "enum": ["x", "y\"z", 3]}).matches(b'"y\\"z"')
    assert automaton({"enum": ["x", 3]}).matches(b"3")
    assert automaton({"const": {"k": [1, None]}}).matches(b'{"k":[1,null]}')


@pytest.mark.parametrize("schema,good,bad", [
    ({"type": "integer", "minimum": -5, "maximum": 120}, [b"-5", b"0", b"120", b"99"], [b"-6", b"121", b"-0", b"01", b"1.0"]),
    ({"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 13}, [b"11", b"12"], [b"10", b"13"]),
    ({"type": "number", "minimum": 0.1, "maximum": 0.25}, [b"0.1", b"0.25", b"0.2", b"0.100001"],
     [b"0.09", b"0.250001", b"0.1000001", b".2", b"1e-1", b"0.3"]),
    ({"type": "number", "exclusiveMaximum": 0}, [b"-0.5", b"-3"], [b"0", b"0.0", b"-0.0", b"1"]),
])
def test_number_bounds(schema, good, bad):
    a = automaton(schema)
    for text in good:
        assert a.matches(text), text
        VALIDATOR(schema).validate(json.loads(text))
    for text in bad:
        assert not a.matches(text), text


def test_a_live_prefix_always_has_a_completion():
    """Every prefix the number automaton keeps leads to a complete number in range."""
    a = automaton({"type": "integer", "minimum": 37, "maximum": 41})
    state = a.advance(a.initial, ord("3"))
    assert state and not a.accepts(state)
    assert not a.advance(state, ord("6")) and a.accepts(a.advance(state, ord("7")))
    assert not a.advance(a.initial, ord("5"))  # 5 and 5x are all out of range


def test_arrays_and_choices():
    a = automaton({"type": "array", "items": {"anyOf": [{"type": "null"}, {"type": "integer", "maximum": 3}]},
                   "minItems": 1, "maxItems": 2})
    assert a.matches(b"[null]") and a.matches(b"[3,null]")
    assert not a.matches(b"[]") and not a.matches(b"[1,2,3]") and not a.matches(b"[4]")


@pytest.mark.parametrize("schema", [
    {"type": "string", "minLength": 5, "maxLength": 2}, {"type": "integer", "minimum": 3, "maximum": 2},
    {"type": "integer", "minimum": 0.2, "maximum": 0.8}, {"enum": []}, {"type": "string", "pattern": "a+"},
    {"type": "object", "properties": {}, "required": ["x"]}, {"type": "thing"}, "string",
    {"type": "array", "minItems": 3, "maxItems": 1},
])
def test_unsatisfiable_or_unsupported_schemas_raise(schema):
    with pytest.raises(GrammarError):
        compile_schema(schema)


def test_masks_are_cached_and_eos_only_where_accepting():
    vocab = Vocabulary([b"<eos>", b"{", b"}", b'"', b"a", b"ab", b'"a"', b':', b'{"k":', b""] +
                       [bytes((i,)) for i in range(256)], eos_ids=[0])
    constraint = Constraint(automaton({"type": "object", "properties": {"k": {"type": "string", "maxLength": 40}},
                                       "required": ["k"]}), vocab)
    m = constraint.matcher()
    assert 0 not in m.allowed_ids() and 9 not in m.allowed_ids()  # no EOS, no empty token
    assert set(m.allowed_ids()) == {1, 8, 10 + ord("{")}
    m.accept(8)
    m.accept(3)
    inside = m.allowed_ids()
    walks = constraint.walks
    for _ in range(20):
        m.accept(4)  # "a": the string's counter moves, its mask (far from the limit) stays cached
        assert m.allowed_ids() == inside
    assert constraint.walks == walks
    m.accept(3)
    m.accept(2)
    assert m.allowed_ids() == (0,) and m.accepting
    with pytest.raises(GrammarError):
        constraint.matcher().accept(2)


# ----------------------------------------------------------------------------- random schemas

WORDS = ["id", "name", "q", "é", 'a"b', "x y", "ünï", "k\\", "data", "n"]


def random_schema(rng: random.Random, depth: int = 0, kind: str | None = None) -> dict:
    kinds = ["string", "integer", "number", "boolean", "null", "enum", "const"]
    if depth < 3:
        kinds += ["object", "object", "array", "anyOf", "oneOf"]
    kind = kind or rng.choice(kinds)
    if kind == "string":
        schema = {"type": "string"}
        low = rng.choice([None, 0, 1, 3])
        if low is not None:
            schema["minLength"] = low
        schema["maxLength"] = (low or 0) + rng.randint(0, 6)
        return schema
    if kind in ("integer", "number"):
        schema = {"type": kind}
        low = rng.choice([None, rng.randint(-1000, 1000), round(rng.uniform(-50, 50), rng.randint(0, 3))])
        if low is not None:
            schema[rng.choice(["minimum", "exclusiveMinimum"])] = low
        if rng.random() < 0.7:
            span = rng.choice([0, 1, 2, 5, 100, 1e5]) + (0 if kind == "integer" else rng.random())
            high = (low if low is not None else rng.randint(-100, 100)) + span
            name = "maximum" if span < 2 and kind == "integer" else rng.choice(["maximum", "exclusiveMaximum"])
            schema[name] = high
        if kind == "integer" and "minimum" not in schema and schema.get("exclusiveMinimum") is not None:
            schema["exclusiveMinimum"] = int(schema["exclusiveMinimum"] // 1)
        try:
            compile_schema(schema)
        except GrammarError:  # an empty range: widen it
            schema = {"type": kind, "minimum": -3, "maximum": 3}
        return schema
    if kind in ("boolean", "null"):
        return {"type": kind}
    if kind == "enum":
        return {"enum": rng.sample(["a", "ab", "b\"", 1, 12, 2.5, True, None, "é", [1], {"z": 0}], rng.randint(1, 4))}
    if kind == "const":
        return {"const": rng.choice(["on", 0, -7.25, False, None, ["x", 2]])}
    if kind == "object":
        names = rng.sample(WORDS, rng.randint(0, 4))
        properties = {n: random_schema(rng, depth + 1) for n in names}
        return {"type": "object", "properties": properties, "required": [n for n in names if rng.random() < 0.5],
                "additionalProperties": False}
    if kind == "array":
        low = rng.randint(0, 2)
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": low,
                "maxItems": low + rng.randint(0, 3)}
    if kind == "anyOf":
        return {"anyOf": [random_schema(rng, depth + 1) for _ in range(rng.randint(1, 3))]}
    # oneOf: branches of disjoint types, so exactly one matches any value
    kinds = rng.sample(["string", "boolean", "null", "array", "integer"], rng.randint(1, 3))
    return {"oneOf": [random_schema(rng, depth + 1, k) for k in kinds]}


PIECES = [b'{"', b'":', b'","', b'"}', b"},", b"],", b"[", b"]", b"null", b"true", b"false", b"12", b"-1",
          b"0.", b"25", b'"a', b'ab"', b"\\n", b'\\"', "é".encode(), "ü".encode(), b"id", b"name", b'name":',
          b'"x y":', b"  ", b",", b":", b"1,", b"0]", b'"}]']


def random_vocabulary(rng: random.Random) -> Vocabulary:
    """EOS (id 0), an empty control token, every single byte, JSON-ish pieces and random ones."""
    pieces = [b"</s>", b""] + [bytes((i,)) for i in range(256)] + PIECES
    alphabet = b'abxyz019-.,:{}[]" \\'
    pieces += [bytes(rng.choice(alphabet) for _ in range(rng.randint(2, 5))) for _ in range(rng.randint(20, 120))]
    order = list(range(2, len(pieces)))
    rng.shuffle(order)
    pieces = pieces[:2] + [pieces[i] for i in order]
    return Vocabulary(pieces, eos_ids=[0])


class RandomModel:
    """Random logits that depend only on the prefix, optionally biased toward one target."""

    def __init__(self, seed: int, rows: int, target=None, bonus: float = 0.0, scale: float = 3.0):
        self.seed, self.rows, self.target, self.bonus, self.scale = seed, rows, target, bonus, scale

    def logits(self, prefix: list) -> np.ndarray:
        rng = np.random.default_rng([self.seed, len(prefix)] + prefix[-3:])
        logits = (rng.standard_normal(self.rows) * self.scale).astype(np.float32)
        if self.target is not None and prefix == self.target[: len(prefix)] and len(prefix) < len(self.target):
            logits[self.target[len(prefix)]] += self.bonus
        return logits


def decode(model, constraint, temperature=0.0, top_k=0, top_p=1.0, seed=0, limit=3000):
    """Ids until EOS through the reference sampler; with a constraint, under its masks."""
    matcher = constraint.matcher() if constraint is not None else None
    ids = []
    for position in range(1, limit):
        mask = None
        if matcher is not None:
            assert matcher.allowed_ids(), "an empty mask"
            mask = matcher.mask()
            assert allowed_ids(mask, model.rows).sum() == len(matcher.allowed_ids())
        token = sample(model.logits(ids), temperature, top_k, top_p, seed, position, mask=mask)
        if matcher is not None:
            matcher.accept(token)
        if token == 0:
            return ids, True
        ids.append(token)
    return (ids, False) if matcher is None else pytest.fail("a constrained output did not end")


def text_of(vocab, ids) -> bytes:
    return b"".join(vocab.token_bytes[i] for i in ids)


SETTINGS = [(0.0, 0, 1.0), (0.7, 0, 1.0), (1.5, 0, 0.9), (1.0, 5, 1.0), (100.0, 0, 1.0), (0.4, 3, 0.5)]


def test_random_schemas_always_parse_and_validate():
    rng = random.Random(1234)
    vocabularies = [random_vocabulary(rng) for _ in range(8)]
    conforming = 0
    for trial in range(1000):
        schema = random_schema(rng)
        vocab = vocabularies[trial % len(vocabularies)]
        constraint = Constraint(automaton(schema), vocab)
        temperature, top_k, top_p = SETTINGS[trial % len(SETTINGS)]
        model = RandomModel(trial, vocab.rows)
        ids, _ = decode(model, constraint, temperature, top_k, top_p, seed=trial)
        text = text_of(vocab, ids)
        VALIDATOR(schema).validate(json.loads(text.decode("utf-8")))

        if trial % 2 == 0:  # greedy: a model that prefers a conforming text, with noise
            target = ids + [0]
            biased = RandomModel(trial + 7, vocab.rows, target, bonus=rng.choice([4.0, 7.0, 30.0]))
            free, ended = decode(biased, None, limit=len(target) + 20)
            if ended and constraint.automaton.matches(text_of(vocab, free)):
                conforming += 1
                assert decode(biased, constraint) == (free, True)
    assert conforming >= 100  # the greedy comparison ran often enough to mean something


def test_tokens_longer_than_the_remaining_room_are_refused():
    vocab = Vocabulary([b"</s>", b'"', b"abcd", b"ab", b"a"], eos_ids=[0])
    m = Constraint(automaton({"type": "string", "maxLength": 5}), vocab).matcher()
    m.accept(1)
    m.accept(2)
    assert set(m.allowed_ids()) == {1, 4}  # one character left: "a" or the closing quote


def test_a_token_budget_always_ends_inside_the_grammar():
    """With the budget passed to the mask, the text ends (EOS) within it whenever it fits at all."""
    rng = random.Random(99)
    vocabulary = random_vocabulary(rng)
    done = 0
    for trial in range(150):
        schema = random_schema(rng)
        constraint = Constraint(automaton(schema), vocabulary)
        matcher = constraint.matcher()
        budget = constraint.automaton.finish(matcher.state) + 1 + rng.randint(0, 6)
        model = RandomModel(trial, vocabulary.rows)
        ids = []
        for position in range(1, budget + 1):
            left = budget - position + 1
            assert matcher.fits(left)
            mask = matcher.mask(left)
            assert matcher.allowed_ids(left)
            token = sample(model.logits(ids), 1.0, 0, 1.0, trial, position, mask=mask)
            matcher.accept(token)
            if token == 0:
                break
            ids.append(token)
        assert matcher.ended, (schema, text_of(vocabulary, ids))
        VALIDATOR(schema).validate(json.loads(text_of(vocabulary, ids)))
        done += 1
    assert done == 150


def test_mask_work_per_step_is_bounded():
    """A long constrained generation (8 strings of up to 80 characters), the budget passed at
    every step: its trie walks add up to a few walks of the whole vocabulary, not one per step
    (a string's characters share their masks in every array item; the budget's last steps
    filter cached masks), and a second generation over the same grammar walks almost nothing."""
    rng = random.Random(5)
    letters = b"abcdefghij klmno"
    words = sorted({bytes(rng.choice(letters) for _ in range(rng.randint(2, 12))) for _ in range(600)})
    vocab = Vocabulary([b"</s>"] + [bytes((i,)) for i in range(256)] + words + [b'","', b'"]', b'["', b'":"'],
                       eos_ids=[0])
    plain = range(257, 257 + len(words))
    schema = {"type": "object", "properties": {
        "a": {"type": "array", "items": {"type": "string", "maxLength": 80}, "minItems": 8, "maxItems": 8},
        "b": {"type": "string", "maxLength": 60}}, "required": ["a", "b"]}
    constraint = Constraint(automaton(schema), vocab)
    whole_vocabulary = sum(len(trie.children) for trie in vocab.tries)  # one walk of every trie
    first = constraint.automaton.finish(constraint.automaton.initial) + 1
    for budget, walks_allowed in [(400, 12), (first + 40, 12), (400, 3)]:  # the last: a warm cache
        matcher, visited, steps = constraint.matcher(), constraint.nodes_visited, 0
        while not matcher.ended:
            allowed = matcher.allowed_ids(budget - steps)
            assert allowed and steps < budget
            words_allowed = [i for i in allowed if i in plain]
            matcher.accept(rng.choice(words_allowed) if words_allowed and rng.random() < 0.97 else rng.choice(allowed))
            steps += 1
        value = json.loads(bytes(matcher.text))
        VALIDATOR(schema).validate(value)
        assert steps >= (60 if budget == 400 else 20)  # long enough for per-step walks to show
        assert constraint.nodes_visited - visited <= walks_allowed * whole_vocabulary, (budget, steps)


def brute_force_allowed(constraint, state, budget):
    """Every id tried on its own: its bytes allowed from ``state``, and (with a budget) the text
    still finishable after it, EOS within the budget (the rule of ``Constraint.entry``)."""
    automaton, vocab = constraint.automaton, constraint.vocabulary
    out = set()
    for token_id, data in enumerate(vocab.token_bytes):
        if token_id in vocab.eos_ids:
            if automaton.accepts(state) and (budget is None or budget >= 1):
                out.add(token_id)
        elif data:
            after = automaton.advance_bytes(state, data)
            if after and (budget is None or automaton.finish(after) <= budget - 2):
                out.add(token_id)
    return out


def test_cached_masks_equal_a_walk_of_every_id():
    """The cached, clipped and budget-filtered masks are exactly the ids a direct check of each
    id allows, at random states and budgets (tight ones included); every fourth schema has
    strings whose minLength reaches past the longest token (keys that hide bytes still needed)."""
    rng = random.Random(77)
    long_strings = {"type": "object", "properties": {
        "s": {"type": "string", "minLength": 9, "maxLength": 14},
        "a": {"type": "array", "items": {"anyOf": [{"type": "string", "minLength": 7, "maxLength": 9},
                                                   {"type": "string", "minLength": 11, "maxLength": 12}]},
              "maxItems": 2}}, "required": ["s", "a"]}
    checked = 0
    for trial in range(80):
        vocab = random_vocabulary(rng)
        schema = long_strings if trial % 4 == 0 else random_schema(rng)
        constraint = Constraint(automaton(schema), vocab)
        matcher = constraint.matcher()
        budget = constraint.automaton.finish(matcher.state) + 1 + rng.randint(0, 12)
        for step in range(budget):
            left = budget - step
            for asked in (None, left, rng.randint(1, left)):
                want = brute_force_allowed(constraint, matcher.state, asked)
                got = matcher.allowed_ids(asked)
                assert set(got) == want and list(got) == sorted(got), (schema, step, asked)
                assert int.from_bytes(matcher.mask(asked), "little") == sum(1 << i for i in want)
                checked += 1
            allowed = matcher.allowed_ids(left)
            token = rng.choice(allowed)
            matcher.accept(token)
            if matcher.ended:
                break
    assert checked > 800  # states x budgets compared


# ------------------------------------------------------------------------------ compile cost


def _nested_type_lists(levels: int) -> dict:
    schema = {}
    for _ in range(levels):
        schema = {"type": ["array", "array"], "items": schema}
    return schema


@pytest.mark.parametrize("schema, text", [
    ({"type": "number", "maximum": 1e300}, b"-12.5"),
    ({"type": "number", "minimum": -1e300, "exclusiveMaximum": 1e300}, b"999999999999"),
    ({"type": "integer", "maximum": 10 ** 400}, b"7"),
    ({"type": "integer", "minimum": -(10 ** 400), "maximum": 3}, b"-999999999999"),
    ({"type": "string", "maxLength": float("inf")}, b'"abc"'),
    (_nested_type_lists(24), b"[[]]"),
    ({"enum": ["x" * 100_000]}, json.dumps("x" * 100_000).encode()),
])
def test_hostile_bounds_and_shapes_compile_fast(schema, text):
    """Bounds beyond what the digits can write allow what 10^int_digits does (once a walk
    without end), a type list is a set (once 2^24 nodes), an enum state is a run of options
    (once every prefix of a 100 KB string)."""
    import time
    started = time.perf_counter()
    automaton = Automaton(compile_schema(schema))
    assert automaton.matches(text)
    assert time.perf_counter() - started < 5.0


def test_a_bound_beyond_the_digits_refuses_what_no_text_reaches():
    with pytest.raises(GrammarError, match="no number"):
        compile_schema({"type": "number", "minimum": 1e300})
    with pytest.raises(GrammarError, match="no integer"):
        compile_schema({"type": "integer", "maximum": -(10 ** 400)})


@pytest.mark.parametrize("schema, problem", [
    ({"type": "object", "properties": {}, "required": [{}]}, "list of names"),
    ({"type": [["array"]]}, "list of names"),
    ({"type": {"a": 1}}, "list of names"),
    ({"enum": [[[[]]]] * 3 + ["x" * (1 << 18)]}, "bytes of JSON"),
    ({"anyOf": [{"type": "string"}] * 30_000}, "grammar nodes"),
    ({"type": "number", "maximum": "big"}, "must be a number"),
])
def test_schemas_beyond_the_limits_are_refused_by_name(schema, problem):
    with pytest.raises(GrammarError, match=problem):
        compile_schema(schema)


def test_an_enum_of_deeply_nested_values_is_refused_not_a_recursion_error():
    value = []
    for _ in range(100_000):
        value = [value]
    with pytest.raises(GrammarError, match="not JSON"):
        compile_schema({"enum": [value]})


def test_fuzz_schemas_compile_or_raise_a_grammar_error():
    """Random schemas (hostile bounds, type lists, enums, nesting) through the compiler and the
    matcher: a GrammarError or an automaton whose texts the schema accepts, within a bound."""
    import time

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from test_request_limits import _schema

    @settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
    @given(_schema, st.binary(max_size=12))
    def run(schema, text):
        started = time.perf_counter()
        try:
            automaton = Automaton(compile_schema(schema))
        except GrammarError:
            return
        automaton.advance_bytes(automaton.initial, text)
        assert automaton.finish(automaton.initial) >= 0
        assert time.perf_counter() - started < 5.0

    run()
