"""A JSON-schema subset compiled to automaton nodes (automaton.py).

Supported: ``type`` (one or a list), ``enum``, ``const``; objects with ``properties``,
``required`` and ``additionalProperties`` (false or absent: only declared properties are written,
in their declared order); strings with ``minLength``/``maxLength``; ``number``/``integer`` with
``minimum``, ``maximum``, ``exclusiveMinimum``, ``exclusiveMaximum``; ``boolean``; ``null``; arrays
with ``items``, ``minItems``, ``maxItems``; ``anyOf``/``oneOf`` (oneOf compiles as anyOf: give it
disjoint branches); nesting of all of these. Annotations (title, description, default, examples,
$schema, $id, $comment) are ignored. An empty schema (or one without a type) is any scalar. An
object with no ``properties`` whose ``additionalProperties`` is true or a schema is a map: any
keys, each value of that schema (true: any JSON value, ``SchemaCompiler.any_value``).
Anything else raises ``GrammarError``, as does a schema no value satisfies.

The text is compact JSON (no whitespace) and bounded, so every output ends: strings hold at most
``Limits.string`` characters unless maxLength says fewer, arrays ``Limits.items`` items, numbers
``Limits.int_digits`` digits before the point and ``Limits.frac_digits`` after it (no exponent).

Compiling is bounded too (docs/api.md, "Limits"): at most ``Limits.nodes`` grammar nodes (a
type list is read as a set, so ``["array", "array"]`` nested 24 deep is 24 arrays, not 2^24),
``Limits.depth_limit`` levels of nesting and ``Limits.option_bytes`` bytes of ``enum``/``const``
text; beyond them the schema is refused with ``GrammarError``. A numeric bound beyond what
``int_digits`` digits can write (1e300, 10**400) is clipped to 2·10^int_digits: same texts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..inputs import describe
from .automaton import (Choice, GrammarError, JsonArray, JsonMap, JsonObject, Literal, Node, Number, Options,
                        Sequence, String)

ANNOTATIONS = frozenset(("title", "description", "default", "examples", "$schema", "$id", "$comment"))
KEYWORDS = frozenset(("type", "enum", "const", "properties", "required", "additionalProperties", "minLength",
                      "maxLength", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "items",
                      "minItems", "maxItems", "anyOf", "oneOf")) | ANNOTATIONS
TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")


@dataclass(frozen=True)
class Limits:
    """Bounds that keep every output finite where the schema sets none."""

    string: int = 256
    items: int = 16
    int_digits: int = 12
    frac_digits: int = 6
    depth: int = 3  # nesting of a generic JSON value (any_value, {"type": "json_object"})
    nodes: int = 20_000  # grammar nodes one compilation may build
    depth_limit: int = 32  # nesting of the schema itself
    option_bytes: int = 1 << 18  # bytes of enum and const text in one grammar


def json_text(value) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def _is_type(value, kind: str) -> bool:
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool) or isinstance(value, float) and value.is_integer()
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, {"object": dict, "array": list, "string": str, "boolean": bool,
                              "null": type(None)}[kind])


def _count(schema: dict, name: str, default: int) -> int:
    value = schema.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or value < 0:
        raise GrammarError(f"schema: {name} must be a non-negative number, got {describe(value)}")
    return int(min(value, 1 << 30))  # inf and 10**400 too: no text is that long


class SchemaCompiler:
    """Builds the node list of one grammar; ``add`` returns a node's index."""

    def __init__(self, limits: Limits = Limits()):
        self.limits = limits
        self.nodes: list = []
        self.option_bytes = 0

    def add(self, node: Node) -> int:
        if len(self.nodes) >= self.limits.nodes:
            raise GrammarError(f"schema: compiles to more than {self.limits.nodes} grammar nodes")
        self.nodes.append(node)
        return len(self.nodes) - 1

    def reserve(self) -> int:
        return self.add(Node())

    def literal(self, text: bytes) -> int:
        return self.add(Literal(text))

    def any_value(self, depth: int | None = None) -> int:
        """Any JSON value nested at most ``depth`` containers deep (default ``Limits.depth``):
        strings, numbers, true/false/null at the bottom; arrays and maps of the level below."""
        limits = self.limits
        depth = limits.depth if depth is None else depth
        scalars = [self.add(String(0, limits.string)), self._number(False, {}),
                   self.add(Options((b"true", b"false", b"null")))]
        value = self.add(Choice(scalars))
        for _ in range(max(depth, 0)):
            value = self.add(Choice(scalars + [self.add(JsonArray(value, 0, limits.items)),
                                               self.add(JsonMap(scalars[0], value, limits.items))]))
        return value

    def any_object(self, depth: int | None = None) -> int:
        """Any JSON object (``{"type": "json_object"}``): a map whose values nest at most
        ``depth`` - 1 containers deep."""
        depth = self.limits.depth if depth is None else depth
        return self.add(JsonMap(self.add(String(0, self.limits.string)), self.any_value(depth - 1),
                                self.limits.items))

    def schema(self, schema, depth: int = 0) -> int:
        """The node of a value matching ``schema``."""
        if depth > self.limits.depth_limit:
            raise GrammarError(f"schema: nested deeper than {self.limits.depth_limit} levels")
        if schema is True or schema == {}:
            schema = {}
        if not isinstance(schema, dict):
            raise GrammarError(f"schema: expected an object, got {type(schema).__name__}")
        unknown = sorted(set(schema) - KEYWORDS)
        if unknown:
            raise GrammarError(f"schema: unsupported keywords {describe(unknown, 200)}")
        kinds = schema.get("type", None)
        kinds = list(TYPES[2:]) if kinds is None and not {"properties", "items"} & set(schema) else kinds
        if kinds is None:
            kinds = ["object"] if "properties" in schema else ["array"]
        if not isinstance(kinds, (str, list, tuple)) or any(not isinstance(k, str) for k in kinds):
            raise GrammarError(f"schema: type must be a name or a list of names, got {describe(kinds)}")
        kinds = list(dict.fromkeys([kinds] if isinstance(kinds, str) else kinds))  # a set, in order
        if not kinds or any(k not in TYPES for k in kinds):
            raise GrammarError(f"schema: unknown type {describe(schema.get('type'))}")
        if "number" in kinds and "integer" in kinds:
            kinds.remove("integer")  # every integer is a number
        for word in ("anyOf", "oneOf"):
            if word in schema:
                branches = schema[word]
                if not isinstance(branches, list) or not branches:
                    raise GrammarError(f"schema: {word} must be a non-empty list")
                rest = {k: v for k, v in schema.items() if k not in ("anyOf", "oneOf")}
                if set(rest) - ANNOTATIONS:
                    raise GrammarError(f"schema: {word} next to other keywords is not supported")
                return self._choice([self.schema(b, depth + 1) for b in branches])
        if "const" in schema or "enum" in schema:
            values = [schema["const"]] if "const" in schema else schema["enum"]
            if not isinstance(values, list):
                raise GrammarError("schema: enum must be a list")
            if "type" in schema:
                values = [v for v in values if any(_is_type(v, k) for k in kinds)]
            if not values:
                raise GrammarError("schema: no enum value has the schema's type")
            try:
                texts = [json_text(v) for v in values]
            except (TypeError, ValueError, RecursionError) as exc:
                raise GrammarError(f"schema: enum value not JSON ({type(exc).__name__})") from None
            self.option_bytes += sum(map(len, texts))
            if self.option_bytes > self.limits.option_bytes:
                raise GrammarError(f"schema: enum and const values hold more than "
                                   f"{self.limits.option_bytes} bytes of JSON")
            return self.add(Options(texts))
        return self._choice([self._typed(k, schema, depth) for k in kinds])

    def _choice(self, children: list) -> int:
        return children[0] if len(children) == 1 else self.add(Choice(children))

    def _typed(self, kind: str, schema: dict, depth: int) -> int:
        limits = self.limits
        if kind == "null":
            return self.literal(b"null")
        if kind == "boolean":
            return self.add(Options((b"true", b"false")))
        if kind == "string":
            low = _count(schema, "minLength", 0)
            high = min(_count(schema, "maxLength", limits.string), max(limits.string, low))
            if low > high:
                raise GrammarError(f"schema: minLength {low} > maxLength {high}")
            return self.add(String(low, high))
        if kind in ("number", "integer"):
            return self._number(kind == "integer", schema)
        if kind == "array":
            low = _count(schema, "minItems", 0)
            high = min(_count(schema, "maxItems", limits.items), max(limits.items, low))
            if low > high:
                raise GrammarError(f"schema: minItems {low} > maxItems {high}")
            item = self.schema(schema.get("items", {}), depth + 1) if high > 0 else self.literal(b"")
            return self.add(JsonArray(item, low, high))
        return self._object(schema, depth)

    def _number(self, integer: bool, schema: dict) -> int:
        bounds = {}
        for name in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            value = schema.get(name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
                raise GrammarError(f"schema: {name} must be a number, got {describe(value)}")
            if abs(value) == float("inf"):
                continue
            bounds[name] = value
        low, exclusive_low = bounds.get("minimum"), False
        if "exclusiveMinimum" in bounds and (low is None or bounds["exclusiveMinimum"] >= low):
            low, exclusive_low = bounds["exclusiveMinimum"], True
        high, exclusive_high = bounds.get("maximum"), False
        if "exclusiveMaximum" in bounds and (high is None or bounds["exclusiveMaximum"] <= high):
            high, exclusive_high = bounds["exclusiveMaximum"], True
        node = Number(integer, low, high, exclusive_low, exclusive_high, self.limits.int_digits,
                      self.limits.frac_digits)
        if not node.feasible(b""):
            raise GrammarError(f"schema: no {'integer' if integer else 'number'} in the bounds {describe(bounds, 200)}")
        return self.add(node)

    def _object(self, schema: dict, depth: int) -> int:
        properties = schema.get("properties", {})
        required = schema.get("required", [])
        if not isinstance(properties, dict) or not isinstance(required, list) \
                or not all(isinstance(name, str) for name in required):
            raise GrammarError("schema: properties must be an object and required a list of names")
        extra = schema.get("additionalProperties", False)
        if extra not in (False, True, {}) and not isinstance(extra, dict):
            raise GrammarError("schema: additionalProperties must be a boolean or a schema")
        missing = [name for name in required if name not in properties]
        if missing:
            raise GrammarError(f"schema: required properties {describe(missing, 200)} are not declared")
        if not properties and (extra is True or isinstance(extra, dict)):  # a map: any keys, values of the extra schema
            value = self.any_value(max(self.limits.depth - 1, 0)) if extra is True or extra == {} else \
                self.schema(extra, depth + 1)
            return self.add(JsonMap(self.add(String(0, self.limits.string)), value, self.limits.items))
        names = list(properties)
        values = [self.schema(properties[n], depth + 1) for n in names]
        keys = [json_text(str(n)) for n in names]
        return self.add(JsonObject(keys, values, [n in required for n in names]))


def compile_json_object(limits: Limits = Limits()) -> list:
    """The nodes of a grammar whose texts are JSON objects (any keys and values, bounded by
    ``limits``): ``response_format={"type": "json_object"}``."""
    compiler = SchemaCompiler(limits)
    root = compiler.reserve()
    compiler.nodes[root] = Sequence([compiler.any_object()])
    return compiler.nodes


def compile_schema(schema, limits: Limits = Limits()) -> list:
    """The nodes of a grammar whose texts are the JSON values matching ``schema`` (root: node 0)."""
    compiler = SchemaCompiler(limits)
    root = compiler.reserve()
    compiler.nodes[root] = Sequence([compiler.schema(schema)])
    return compiler.nodes
