"""``@tool``: the schema a function's signature, hints and docstring give, and how a model's
arguments call it (``needle_wgpu.tools``)."""

import enum
from typing import Annotated, Any, Literal, Optional, Union

import pytest

from needle_wgpu import Field, InputError, Tool, tool
from needle_wgpu.grammar.tool_calls import tool_call_grammar
from needle_wgpu.tools import parse_docstring


class Unit(enum.Enum):
    CELSIUS = "c"
    FAHRENHEIT = "f"


def test_scalars_defaults_and_the_docstring():
    @tool
    def weather(city: str, days: int, ratio: float, metric: bool = True):
        """Get the forecast.

        Longer text that stays out of the description.

        Args:
            city: The city,
                as written on a map.
            days (int): How many days.
        """

    assert isinstance(weather, Tool) and weather.name == "weather"
    assert weather.schema == {
        "name": "weather", "description": "Get the forecast.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "The city, as written on a map."},
            "days": {"type": "integer", "description": "How many days."},
            "ratio": {"type": "number"}, "metric": {"type": "boolean"}},
            "required": ["city", "days", "ratio"]}}


def test_name_and_description_override_and_the_function_still_calls():
    @tool(name="add_numbers", description="Adds.")
    def add(a: int, b: int = 2) -> int:
        """Ignored summary."""
        return a + b

    assert add.schema["name"] == "add_numbers" and add.schema["description"] == "Adds."
    assert add(1) == 3 and add.invoke({"a": 4}) == 6


def test_literal_enum_optional_union_list_dict_any():
    @tool
    def f(mode: Literal["fast", "slow"], unit: Unit, level: Literal[1, 2, 3], mixed: Literal["a", 1],
          maybe: Optional[int], either: Union[int, str], names: list[str], table: dict[str, int],
          raw: list, blob: dict, anything: Any, untyped):
        pass

    p = f.parameters["properties"]
    assert p["mode"] == {"type": "string", "enum": ["fast", "slow"]}
    assert p["unit"] == {"type": "string", "enum": ["c", "f"]}
    assert p["level"] == {"type": "integer", "enum": [1, 2, 3]}
    assert p["mixed"] == {"enum": ["a", 1]}
    assert p["maybe"] == {"type": "integer"}
    assert p["either"] == {"anyOf": [{"type": "integer"}, {"type": "string"}]}
    assert p["names"] == {"type": "array", "items": {"type": "string"}}
    assert p["table"] == {"type": "object", "additionalProperties": {"type": "integer"}}
    assert p["raw"] == {"type": "array"} and p["blob"] == {"type": "object"}
    assert p["anything"] == {} and p["untyped"] == {"type": "string"}
    assert "maybe" not in f.parameters["required"] and "either" in f.parameters["required"]


def test_field_bounds_enum_and_default():
    @tool
    def g(n: Annotated[int, Field(ge=1, lt=10, description="A count")],
          name: Annotated[str, Field(min_length=1, max_length=8)],
          tags: Annotated[list[str], Field(max_items=3)],
          color: str = Field("red", enum=["red", "blue"])):
        """G.

        Args:
            n: overridden by the Field's description
        """
        return n, color

    p = g.parameters["properties"]
    assert p["n"] == {"type": "integer", "minimum": 1, "exclusiveMaximum": 10, "description": "A count"}
    assert p["name"] == {"type": "string", "minLength": 1, "maxLength": 8}
    assert p["tags"] == {"type": "array", "items": {"type": "string"}, "maxItems": 3}
    assert p["color"] == {"type": "string", "enum": ["red", "blue"]}
    assert g.parameters["required"] == ["n", "name", "tags"]
    tool_call_grammar([g.schema])  # the grammar's subset takes it


def test_invoke_converts_enums_and_fills_omitted_optionals():
    seen = []

    @tool
    def h(unit: Unit, maybe: Optional[str], other: Optional[Unit] = None):
        seen.append((unit, maybe, other))

    h.invoke({"unit": "f", "other": "c"})
    assert seen == [(Unit.FAHRENHEIT, None, Unit.CELSIUS)]
    with pytest.raises(TypeError):
        h.invoke({"maybe": "x"})  # unit is required
    with pytest.raises(TypeError):
        h.invoke({"unit": "c", "nope": 1})
    with pytest.raises(ValueError):
        h.invoke({"unit": "kelvin"})


@pytest.mark.parametrize("hint", [set, bytes, complex, tuple, dict[int, str], object])
def test_unsupported_hints_name_the_parameter(hint):
    def bad(x: hint):
        pass

    with pytest.raises(InputError, match="parameter 'x'"):
        tool(bad)


def test_bad_fields_and_misuse_are_input_errors():
    with pytest.raises(InputError, match="parameter 's'.*bounds a number"):
        tool(_with(Annotated[str, Field(ge=1)]))
    with pytest.raises(InputError, match="applies to string"):
        tool(_with(Annotated[int, Field(max_length=3)]))
    with pytest.raises(InputError, match="whole number"):
        tool(_with(Annotated[str, Field(max_length=-1)]))
    with pytest.raises(InputError, match="name as a keyword"):
        tool("weather")
    with pytest.raises(InputError, match="expected a function"):
        Tool(3)
    with pytest.raises(InputError, match="signature cannot be read"):
        Tool(max)  # a builtin without a signature

    def positional(a: int, /):
        pass

    with pytest.raises(InputError, match="positional-only"):
        tool(positional)

    def forward(a: "Missing"):  # noqa: F821
        pass

    with pytest.raises(InputError, match="type hints cannot be read"):
        tool(forward)


def _with(hint):
    def f(s: hint):
        pass

    return f


def test_docstring_styles():
    numpy = """Sum two numbers.

    Parameters
    ----------
    a : int
        The first
        number.
    b : int
        The second.

    Returns
    -------
    int
    """
    assert parse_docstring(numpy) == ("Sum two numbers.", {"a": "The first number.", "b": "The second."})
    sphinx = """Sum.

    :param a: The first.
    :param int b: The second,
        continued.
    :returns: the sum
    """
    assert parse_docstring(sphinx) == ("Sum.", {"a": "The first.", "b": "The second, continued."})
    google = """Two line
    summary.

    Args:
        a: First.
        b: Second.
    Raises:
        ValueError: never an argument.
    """
    assert parse_docstring(google) == ("Two line summary.", {"a": "First.", "b": "Second."})
    assert parse_docstring(None) == ("", {})
