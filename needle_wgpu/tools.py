"""Python functions as tools: ``@tool`` reads a function's signature, type hints and docstring
into the tools JSON the engine takes (``{"name", "description", "parameters"}``, parameters a
JSON-schema object), and ``Tool.invoke`` calls it with a model's arguments (docs/api.md,
"Agents").

Type hints: ``str`` string, ``int`` integer, ``float`` number, ``bool`` boolean, ``list`` /
``list[T]`` array, ``dict`` / ``dict[str, T]`` object, ``Optional[T]`` (``T | None``) T and not
required, other unions ``anyOf``, ``Literal[...]`` and ``Enum`` subclasses ``enum``, ``Any``
any value, no hint a string; ``Annotated[T, Field(...)]`` (or ``= Field(...)`` as the default)
adds a description, enum, const and bounds. A parameter with a default is optional. Any other
hint is an ``InputError`` naming the parameter.
"""

from __future__ import annotations

import enum
import inspect
import re
import types
import typing

from .errors import InputError
from .inputs import whole_number

SCALARS = {str: "string", int: "integer", float: "number", bool: "boolean"}
UNIONS = (typing.Union, types.UnionType)
_MISSING = object()


class Field:
    """Extra schema for one parameter: ``Annotated[int, Field(ge=1, description="...")]`` or
    ``count: int = Field(3, ge=1)``. Bounds follow pydantic's names: ``ge``/``le`` (minimum,
    maximum), ``gt``/``lt`` (exclusive), ``min_length``/``max_length`` for strings,
    ``min_items``/``max_items`` for arrays."""

    NUMBER_BOUNDS = {"ge": "minimum", "le": "maximum", "gt": "exclusiveMinimum", "lt": "exclusiveMaximum"}
    COUNTS = {"min_length": ("minLength", "string"), "max_length": ("maxLength", "string"),
              "min_items": ("minItems", "array"), "max_items": ("maxItems", "array")}

    def __init__(self, default=_MISSING, *, description=None, enum=None, const=_MISSING, ge=None, le=None,
                 gt=None, lt=None, min_length=None, max_length=None, min_items=None, max_items=None):
        self.default = default
        self.description = description
        self.enum = enum
        self.const = const
        self.bounds = {"ge": ge, "le": le, "gt": gt, "lt": lt}
        self.counts = {"min_length": min_length, "max_length": max_length, "min_items": min_items,
                       "max_items": max_items}

    @property
    def has_default(self) -> bool:
        return self.default is not _MISSING

    def apply(self, schema: dict, where: str) -> dict:
        """``schema`` with this field's keywords; a bound that does not fit the type is an
        ``InputError`` naming the parameter (``where``)."""
        schema = dict(schema)
        kinds = schema.get("type")
        kinds = [kinds] if isinstance(kinds, str) else list(kinds or [])
        if self.description is not None:
            if not isinstance(self.description, str):
                raise InputError(f"{where}: Field description must be text")
            schema["description"] = self.description
        if self.enum is not None:
            if isinstance(self.enum, (str, bytes, dict)) or not hasattr(self.enum, "__iter__"):
                raise InputError(f"{where}: Field enum must be a list of values")
            schema["enum"] = [_json_value(v, where) for v in self.enum]
        if self.const is not _MISSING:
            schema["const"] = _json_value(self.const, where)
        for name, keyword in self.NUMBER_BOUNDS.items():
            value = self.bounds[name]
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
                raise InputError(f"{where}: Field {name} must be a number, got {value!r}")
            if not {"integer", "number"} & set(kinds):
                raise InputError(f"{where}: Field {name} bounds a number, but the parameter is {kinds or 'untyped'}")
            schema[keyword] = value
        for name, (keyword, kind) in self.COUNTS.items():
            value = self.counts[name]
            if value is None:
                continue
            count = whole_number(value)
            if count is None or count < 0 or isinstance(value, bool):
                raise InputError(f"{where}: Field {name} must be a whole number >= 0, got {value!r}")
            if kind not in kinds:
                raise InputError(f"{where}: Field {name} applies to {kind} parameters, not {kinds or 'untyped'}")
            schema[keyword] = count
        return schema


def _json_value(value, where: str):
    """An enum/const value as JSON takes it (an Enum member becomes its value)."""
    if isinstance(value, enum.Enum):
        value = value.value
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    raise InputError(f"{where}: enum and const values must be text, numbers, booleans or None, got {value!r}")


def _enum_schema(values: list, where: str) -> dict:
    values = [_json_value(v, where) for v in values]
    if not values:
        raise InputError(f"{where}: an enum needs at least one value")
    kinds = {"boolean" if isinstance(v, bool) else "null" if v is None else SCALARS[type(v)] for v in values}
    if kinds == {"integer", "number"}:
        kinds = {"number"}
    return {"type": kinds.pop(), "enum": values} if len(kinds) == 1 else {"enum": values}


def _optional(hint) -> bool:
    """Whether None is one of the hint's values (``Optional[T]``, ``T | None``)."""
    origin = typing.get_origin(hint)
    if origin is typing.Annotated:
        return _optional(typing.get_args(hint)[0])
    return origin in UNIONS and type(None) in typing.get_args(hint)


def schema_of(hint, where: str) -> dict:
    """The JSON schema of a type hint; ``where`` names the parameter in errors."""
    if hint is inspect.Parameter.empty:
        return {"type": "string"}
    if hint is typing.Any:
        return {}
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Annotated:
        schema = schema_of(args[0], where)
        for meta in args[1:]:
            if isinstance(meta, Field):
                schema = meta.apply(schema, where)
        return schema
    if hint in SCALARS:
        return {"type": SCALARS[hint]}
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return _enum_schema([member.value for member in hint], where)
    if origin is typing.Literal:
        return _enum_schema(list(args), where)
    if hint is list or origin is list:
        return {"type": "array", **({"items": schema_of(args[0], where + "[]")} if args else {})}
    if hint is dict or origin is dict:
        if args and args[0] is not str:
            raise InputError(f"{where}: dict keys must be str (JSON object keys), got {args[0]!r}")
        return {"type": "object", **({"additionalProperties": schema_of(args[1], where + "{}")} if args else {})}
    if origin in UNIONS:
        branches = [schema_of(a, where) for a in args if a is not type(None)]
        return branches[0] if len(branches) == 1 else {"anyOf": branches}
    raise InputError(f"{where}: the type {hint!r} has no JSON schema (supported: str, int, float, bool, "
                     "list[T], dict[str, T], Optional[T], unions, Literal, Enum, Any, Annotated[T, Field(...)])")


# ------------------------------------------------------------------------------ docstrings

_GOOGLE = re.compile(r"^(args|arguments|parameters|params|keyword args|keyword arguments):\s*$", re.I)
_ENTRY = re.compile(r"^\*{0,2}(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")
_NUMPY_ENTRY = re.compile(r"^(\w+)\s*(?::.*)?$")
_SPHINX = re.compile(r"^:param\s+(?:[^:]*\s)?(\w+)\s*:\s*(.*)$")


def parse_docstring(doc) -> tuple:
    """(summary, {parameter: description}) of a docstring: the summary is its first
    paragraph; parameters come from a Google ``Args:`` section, a NumPy ``Parameters`` section
    or Sphinx ``:param name:`` lines (continuation lines are joined)."""
    lines = inspect.cleandoc(doc or "").splitlines()
    summary = []
    for i, line in enumerate(lines):
        text = line.strip()
        if not text or _GOOGLE.match(text) or text.startswith(":") or _underlined(lines, i):
            break
        summary.append(text)
    described: dict = {}
    current, depth, section = None, 0, None  # section: ("google" | "numpy", its indentation)
    for i, line in enumerate(lines):
        text, indent = line.strip(), len(line) - len(line.lstrip())
        if not text or set(text) == {"-"}:
            continue
        sphinx = _SPHINX.match(text)
        if sphinx:
            current, depth, section = sphinx.group(1), indent, None
            described[current] = sphinx.group(2).strip()
        elif _GOOGLE.match(text):
            current, section = None, ("google", indent)
        elif _underlined(lines, i):
            current = None
            section = ("numpy", indent) if text.lower() in ("parameters", "other parameters") else None
        elif section is None:
            if current is not None and indent > depth:  # a Sphinx description's continuation
                described[current] += " " + text
        elif section[0] == "google":
            entry = _ENTRY.match(text)
            if indent <= section[1]:  # the next section (Returns:) or plain text: the arguments ended
                current = section = None
            elif entry and (current is None or indent <= depth):
                current, depth = entry.group(1), indent
                described[current] = entry.group(2).strip()
            elif current is not None:
                described[current] = (described[current] + " " + text).strip()
        else:  # NumPy: "name : type" at the header's indentation, the description under it
            entry = _NUMPY_ENTRY.match(text)
            if indent <= section[1] and entry:
                current, depth = entry.group(1), indent
                described[current] = ""
            elif current is not None and indent > section[1]:
                described[current] = (described[current] + " " + text).strip()
            else:
                current = section = None
    return " ".join(summary), {name: text for name, text in described.items() if text}


def _underlined(lines: list, i: int) -> bool:
    """A NumPy section header: a line with a line of dashes under it."""
    return i + 1 < len(lines) and bool(lines[i].strip()) and set(lines[i + 1].strip()) == {"-"}


# ------------------------------------------------------------------------------ tools


class Tool:
    """A Python function with its tool schema. Calling the Tool calls the function;
    ``invoke(arguments)`` calls it with a model's JSON arguments; ``schema`` is the entry of
    the tools JSON (``{"name", "description", "parameters"}``)."""

    def __init__(self, function, name=None, description=None):
        if not callable(function):
            raise InputError(f"tool: expected a function, got {type(function).__name__}")
        self.function = function
        self.name = _tool_name(function, name)
        summary, described = parse_docstring(getattr(function, "__doc__", None))
        if description is not None and not isinstance(description, str):
            raise InputError(f"tool {self.name!r}: description must be text")
        self.description = summary if description is None else description
        try:
            self.signature = inspect.signature(function)
        except (TypeError, ValueError) as exc:  # a builtin without a signature
            raise InputError(f"tool {self.name!r}: its signature cannot be read ({exc})") from None
        try:
            hints = typing.get_type_hints(function, include_extras=True)
        except Exception as exc:  # a forward reference that does not resolve
            raise InputError(f"tool {self.name!r}: its type hints cannot be read ({type(exc).__name__}: {exc})") from None
        properties, required = {}, []
        self.enums, self.defaults_none = {}, set()
        for parameter in self.signature.parameters.values():
            where = f"tool {self.name!r}, parameter {parameter.name!r}"
            if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
                continue  # the model passes named arguments only
            if parameter.kind is parameter.POSITIONAL_ONLY:
                raise InputError(f"{where}: positional-only parameters cannot take a model's named arguments")
            hint = hints.get(parameter.name, parameter.annotation)
            schema = schema_of(hint, where)
            default = parameter.default
            if isinstance(default, Field):
                schema = default.apply(schema, where)
                default = default.default if default.has_default else parameter.empty
            if parameter.name in described and "description" not in schema:
                schema = {**schema, "description": described[parameter.name]}
            properties[parameter.name] = schema
            if default is parameter.empty:
                if _optional(hint):
                    self.defaults_none.add(parameter.name)  # omitted: called with None
                else:
                    required.append(parameter.name)
            self.enums[parameter.name] = _enum_class(hint)
        self.parameters = {"type": "object", "properties": properties, "required": required}

    @property
    def schema(self) -> dict:
        out = {"name": self.name}
        if self.description:
            out["description"] = self.description
        out["parameters"] = self.parameters
        return out

    def __call__(self, *args, **kwargs):
        return self.function(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Tool({self.name!r})"

    def invoke(self, arguments):
        """Call the function with a model's arguments (a JSON object): Enum parameters get
        their members, omitted Optional parameters None. A mismatch with the signature is a
        ``TypeError`` (the agent feeds it back to the model as an error result)."""
        if not isinstance(arguments, dict):
            raise TypeError(f"{self.name}: arguments must be an object, got {type(arguments).__name__}")
        unknown = sorted(set(arguments) - set(self.parameters["properties"]))
        if unknown:
            raise TypeError(f"{self.name}: unknown arguments {unknown}")
        call = {name: None for name in self.defaults_none}
        for name, value in arguments.items():
            kind = self.enums.get(name)
            call[name] = kind(value) if kind is not None and value is not None else value
        self.signature.bind(**call)  # a missing required argument: TypeError before the call
        return self.function(**call)


def _enum_class(hint):
    """The Enum class a parameter's value converts to (``Color``, ``Optional[Color]``), or None."""
    if typing.get_origin(hint) is typing.Annotated:
        hint = typing.get_args(hint)[0]
    if typing.get_origin(hint) in UNIONS:
        rest = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = rest[0] if len(rest) == 1 else None
    return hint if isinstance(hint, type) and issubclass(hint, enum.Enum) else None


def _tool_name(function, name) -> str:
    name = getattr(function, "__name__", None) if name is None else name
    if not isinstance(name, str) or not name:
        raise InputError("tool: a tool needs a name (pass @tool(name=...))")
    return name


def tool(function=None, *, name=None, description=None):
    """``@tool`` or ``@tool(name=..., description=...)``: the function as a ``Tool``."""
    if function is None:
        return lambda target: Tool(target, name, description)
    if isinstance(function, str):
        raise InputError("tool: pass the name as a keyword, @tool(name=...)")
    return Tool(function, name, description)
