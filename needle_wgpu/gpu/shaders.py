"""The WGSL sources of the kernels: one file per kernel family in shaders/, read from the source
tree or from the installed wheel (``needle_wgpu.shaders``), with the shared helpers of
shaders/include/ pasted in; and the layout of each family's uniform parameter struct, parsed from
that source so that an op names its parameters instead of listing them in the struct's order.

Plain Python (no numpy): it also runs in the browser.
"""

from __future__ import annotations

import numbers
import re
import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path


def _read_shader_file(name: str) -> str:
    here = Path(__file__).resolve().parents[2] / "shaders" / name
    if here.exists():
        return here.read_text()
    from importlib import resources

    return resources.files("needle_wgpu.shaders").joinpath(name).read_text()


def shader_source(family: str) -> str:
    """The WGSL text of one kernel family, from the source tree or the installed wheel.

    A line ``//#include include/NAME.wgsl`` (a path under shaders/) is replaced by that file, a
    shared helper such as the FWHT: WGSL has no includes, and one copy of each helper keeps
    desktop and browser in step. An included file may include others; each file is pasted once,
    at its first include.
    """
    lines: list = []
    _paste(f"{family}.wgsl", lines, set())
    return "\n".join(lines) + "\n"


def _paste(name: str, lines: list, seen: set) -> None:
    seen.add(name)
    for line in _read_shader_file(name).splitlines():
        if line.startswith("//#include "):
            include = line.split()[1]
            if include not in seen:
                _paste(include, lines, seen)
        else:
            lines.append(line)


# -- the uniform parameter structs ----------------------------------------------------------------
# A kernel's parameters are declared once, as a WGSL struct (``struct Params`` by default); the op
# names its values and ``StructLayout.pack`` lays them out as the uniform address space does.

SCALARS = {"u32": "<I", "i32": "<i", "f32": "<f"}
_VECTOR_ALIGN = {1: 4, 2: 8, 3: 16, 4: 16}
_STRUCT = re.compile(r"\bstruct\s+(\w+)\s*\{(.*?)\}", re.S)
_MEMBER = re.compile(r"^(\w+)\s*:\s*(.+)$", re.S)
_VECTOR = re.compile(r"^vec([234])(?:<(\w+)>|([fiu]))$")  # vec4<f32> or its alias vec4f
_ALIASES = {"f": "f32", "i": "i32", "u": "u32"}
_ARRAY = re.compile(r"^array<(.+),\s*(\d+)u?>$")


@dataclass(frozen=True)
class Field:
    """One member: ``lanes`` scalars of type ``scalar`` (a vector when lanes > 1), ``count`` times
    ``stride`` bytes apart when it is an array, at byte ``offset``."""

    name: str
    scalar: str
    lanes: int = 1
    count: int | None = None
    offset: int = 0
    stride: int = 0

    @property
    def scalar_count(self) -> int:
        """How many scalars the member holds (a vector or an array is given as a flat sequence)."""
        return self.lanes * (self.count or 1)

    @property
    def padding(self) -> bool:
        """``_pad0``, ``_a``: members that only fill the layout, always written as zeros."""
        return self.name.startswith("_")

    def type_name(self) -> str:
        element = self.scalar if self.lanes == 1 else f"vec{self.lanes}<{self.scalar}>"
        return element if self.count is None else f"array<{element}, {self.count}>"


@dataclass(frozen=True)
class StructLayout:
    """A WGSL struct of a kernel family as the uniform address space lays it out."""

    family: str
    name: str
    fields: tuple
    size: int

    def names(self) -> tuple:
        """The members an op gives, in declaration order (padding left out)."""
        return tuple(f.name for f in self.fields if not f.padding)

    def pack(self, values: dict) -> bytes:
        """The struct's bytes from ``values`` by member name; padding is zero.

        Refuses (naming the member) a missing or an unknown member, a value of the wrong type
        (a float for a u32, say) or out of its type's range, and a vector or array of the wrong
        length.
        """
        where = f"{self.family}.wgsl struct {self.name}"
        names = self.names()
        missing = [n for n in names if n not in values]
        if missing:
            raise TypeError(f"{where}: missing {', '.join(missing)}")
        extra = [n for n in values if n not in names]
        if extra:
            raise TypeError(f"{where}: no member {', '.join(extra)} (members: {', '.join(names)})")
        out = bytearray(self.size)
        for f in self.fields:
            if f.padding:
                continue
            value = values[f.name]
            if f.scalar_count == 1:
                scalars = [value]
            else:
                if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
                    raise TypeError(f"{where}: {f.name} is {f.type_name()}, a sequence of {f.scalar_count} values, "
                                    f"not {value!r}")
                if len(value) != f.scalar_count:
                    raise ValueError(f"{where}: {f.name} is {f.type_name()}: {f.scalar_count} values, "
                                     f"not {len(value)}")
                scalars = list(value)
            for i, scalar in enumerate(scalars):
                label = f.name if f.scalar_count == 1 else f"{f.name}[{i}]"
                at = f.offset + i // f.lanes * f.stride + 4 * (i % f.lanes)
                struct.pack_into(SCALARS[f.scalar], out, at, _checked(where, label, f.scalar, scalar))
        return bytes(out)


def _checked(where: str, label: str, scalar: str, value):
    if scalar == "f32":
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{where}: {label} is f32, not {value!r}")
        return float(value)
    if isinstance(value, float) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{where}: {label} is {scalar}, not {value!r}")
    low, high = (0, 1 << 32) if scalar == "u32" else (-(1 << 31), 1 << 31)
    if not low <= value < high:
        raise ValueError(f"{where}: {label} = {value} is out of the {scalar} range")
    return int(value)


def _member(family: str, struct_name: str, name: str, wgsl_type: str) -> Field:
    """A member's type, without its offset: a scalar, a vector of one, or an array of either."""
    count = None
    array = _ARRAY.match(wgsl_type)
    if array:
        wgsl_type, count = array.group(1).strip(), int(array.group(2))
    lanes, scalar = 1, wgsl_type
    vector = _VECTOR.match(wgsl_type)
    if vector:
        lanes, scalar = int(vector.group(1)), vector.group(2) or _ALIASES[vector.group(3)]
    if scalar not in SCALARS:
        raise ValueError(f"{family}.wgsl struct {struct_name}: {name} has type {wgsl_type}, which uniform "
                         f"parameters do not support (u32, i32, f32, their vectors and arrays)")
    return Field(name, scalar, lanes, count)


def _members(body: str) -> list:
    """The member declarations of a struct body: split at commas outside ``<...>``."""
    members, depth, start = [], 0, 0
    for i, char in enumerate(body + ","):
        depth += {"<": 1, ">": -1}.get(char, 0)
        if char == "," and depth == 0:
            members.append(body[start:i].strip())
            start = i + 1
    return [m for m in members if m]


def parse_struct(source: str, family: str, struct_name: str = "Params") -> StructLayout:
    """The layout of ``struct_name`` in a WGSL source, by WGSL's uniform address space rules:
    a member at its alignment (4 for a scalar, 8 for vec2, 16 for vec3/vec4 and every array),
    array elements 16 bytes apart at least, the size rounded up to the largest alignment."""
    text = re.sub(r"//[^\n]*", "", source)
    bodies = [body for name, body in _STRUCT.findall(text) if name == struct_name]
    if len(bodies) != 1:
        raise ValueError(f"{family}.wgsl: {len(bodies)} declarations of struct {struct_name}, expected one")
    fields, offset, struct_align = [], 0, 4
    for declaration in _members(bodies[0]):
        member = _MEMBER.match(declaration)
        if member is None or "@" in declaration:
            raise ValueError(f"{family}.wgsl struct {struct_name}: cannot read member {declaration!r}")
        field = _member(family, struct_name, member.group(1), " ".join(member.group(2).split()))
        align = _VECTOR_ALIGN[field.lanes]
        if field.count is None:
            size, stride = 4 * field.lanes, 0
        else:
            align = max(align, 16)
            stride = max(16, -(-4 * field.lanes // align) * align)
            size = stride * field.count
        offset = -(-offset // align) * align
        fields.append(Field(field.name, field.scalar, field.lanes, field.count, offset, stride))
        offset += size
        struct_align = max(struct_align, align)
    return StructLayout(family, struct_name, tuple(fields), -(-offset // struct_align) * struct_align)


@lru_cache(maxsize=None)
def struct_layout(family: str, struct_name: str = "Params") -> StructLayout:
    """``struct_name`` of a kernel family's source (its includes pasted), parsed once per family."""
    return parse_struct(shader_source(family), family, struct_name)
