"""Kernel parameters are declared once, as the kernel's WGSL struct (``gpu/shaders.py``): an op
names the values, ``UniformArena.struct`` lays them out as WGSL does and refuses what does not
match. No GPU: the arena writes into host memory here.
"""

import ast
import re
import struct
from pathlib import Path

import pytest

from needle_wgpu.gpu.device import Device, Limits, UniformArena
from needle_wgpu.gpu.shaders import parse_struct, shader_source, struct_layout


class MemoryDevice(Device):
    """Buffers in host memory: all a UniformArena needs."""

    limits = Limits(max_storage_binding=1 << 27, max_buffer=1 << 28, max_workgroup_storage=16384,
                    max_invocations=256, max_storage_buffers=10)

    def _create_buffer(self, size, usage, label):
        return bytearray(size)

    def _write(self, handle, data, offset):
        handle[offset : offset + len(data)] = bytes(data)

    def _read(self, handle, offset, size):
        return bytes(handle[offset : offset + size])


@pytest.fixture
def arena():
    return UniformArena(MemoryDevice(), capacity=4096)


def written(binding) -> bytes:
    return bytes(binding.buffer.handle[binding.offset : binding.offset + binding.size])


RMS_NORM = dict(x_stride=96, x_offset=32, y_stride=64, y_offset=0, w_at=7, eps=1e-6)


def test_values_are_packed_by_name_in_declaration_order(arena):
    shuffled = dict(reversed(RMS_NORM.items()))
    binding = arena.struct("rms_norm", **shuffled)
    assert written(binding) == struct.pack("<5If2I", 96, 32, 64, 0, 7, 1e-6, 0, 0)
    assert written(binding) == written(arena.add(96, 32, 64, 0, 7, 1e-6, 0, 0))  # the positional words


def test_vectors_and_arrays_take_the_uniform_layout(arena):
    source = """
    struct Params {
      a: u32,          // a comment, with a comma
      b: vec2f,
      c: i32,
      d: vec4<u32>,
      e: array<vec4<f32>, 2>,
      f: f32,
    }"""
    layout = parse_struct(source, "example")
    assert [(f.name, f.offset) for f in layout.fields] == [("a", 0), ("b", 8), ("c", 16), ("d", 32), ("e", 48),
                                                           ("f", 80)]
    assert layout.size == 96
    data = layout.pack(dict(a=1, b=(0.5, 2.0), c=-3, d=[4, 5, 6, 7], e=list(range(8)), f=1.5))
    assert data == (struct.pack("<I4x2f", 1, 0.5, 2.0) + struct.pack("<i12x", -3) + struct.pack("<4I", 4, 5, 6, 7)
                    + struct.pack("<8f", *range(8)) + struct.pack("<f12x", 1.5))


def test_engram_names_its_two_structs():
    fetch, conv = struct_layout("engram", "FetchParams"), struct_layout("engram", "ConvParams")
    assert fetch.fields[-1].name == "orders" and fetch.fields[-1].offset == 64 and fetch.size == 80
    assert conv.fields[-1].name == "taps_at" and conv.fields[-1].scalar_count == 16 and conv.size == 112


def test_the_step_uniform_is_pos0_in_16_bytes():
    """The session writes Step itself (models/session.py: ``struct.pack("<4I", pos0, 0, 0, 0)``)."""
    step = parse_struct(shader_source("attention"), "attention", "Step")
    assert step.names() == ("pos0",) and step.fields[0].offset == 0 and step.size == 16


@pytest.mark.parametrize("change, error, message", [
    (dict(eps=None), TypeError, "missing eps"),
    (dict(scale=1.0), TypeError, "no member scale"),
    (dict(_pad0=0), TypeError, "no member _pad0"),
    (dict(x_stride=96.0), TypeError, "x_stride is u32, not 96.0"),
    (dict(w_at=-1), ValueError, "w_at = -1 is out of the u32 range"),
    (dict(w_at=1 << 32), ValueError, "w_at = 4294967296 is out of the u32 range"),
    (dict(eps="1e-6"), TypeError, "eps is f32, not '1e-6'"),
])
def test_a_missing_unknown_or_mistyped_member_is_refused_by_name(arena, change, error, message):
    values = {**RMS_NORM, **change}
    values = {name: value for name, value in values.items() if value is not None}
    used = arena.used
    with pytest.raises(error, match=f"rms_norm.wgsl struct Params: {message}"):
        arena.struct("rms_norm", **values)
    assert arena.used == used  # nothing written


def test_a_vector_or_array_of_the_wrong_length_is_refused_by_name():
    layout = struct_layout("engram", "ConvParams")
    values = {name: 0 for name in layout.names()}
    with pytest.raises(ValueError, match=r"taps_at is array<vec4<u32>, 4>: 16 values, not 3"):
        layout.pack({**values, "taps_at": [0, 1, 2]})
    with pytest.raises(TypeError, match=r"taps_at\[2\] is u32, not 2.5"):
        layout.pack({**values, "taps_at": [0, 1, 2.5] + [0] * 13})
    with pytest.raises(TypeError, match="taps_at is array<vec4<u32>, 4>, a sequence of 16 values"):
        layout.pack({**values, "taps_at": 0})


def test_what_the_parser_cannot_lay_out_is_refused():
    with pytest.raises(ValueError, match="m has type mat4x4<f32>"):
        parse_struct("struct Params { m: mat4x4<f32>, }", "example")
    with pytest.raises(ValueError, match="0 declarations of struct Params"):
        parse_struct("struct Other { a: u32, }", "example")
    with pytest.raises(ValueError, match="cannot read member"):
        parse_struct("struct Params { @align(16) a: u32, }", "example")


# -------------------------------------------------------------- every op against its kernel's struct

KERNELS = Path(__file__).resolve().parents[1] / "needle_wgpu" / "kernels"
SHADERS = Path(__file__).resolve().parents[1] / "shaders"


def _calls(node: ast.AST, name: str) -> bool:
    """``node`` is a call of ``name`` (``name(...)`` or ``module.name(...)``)."""
    return isinstance(node, ast.Call) and name in (getattr(node.func, "id", None), getattr(node.func, "attr", None))


def _bindings(tree: ast.AST, name: str, function: str) -> list:
    """The calls of ``function`` that ``tree`` assigns to the variable ``name``."""
    return [node.value for node in ast.walk(tree) if isinstance(node, ast.Assign) and _calls(node.value, function)
            and any(isinstance(target, ast.Name) and target.id == name for target in node.targets)]


def _families(function: ast.FunctionDef, node: ast.expr) -> set:
    """The kernel families ``node`` (an ``arena.struct`` first argument) may name: a family
    string, or a variable the function binds to ``KernelKey("family", ...)`` (on any branch)."""
    if isinstance(node, ast.Constant):
        return {node.value}
    return {key.args[0].value for key in _bindings(function, node.id, "KernelKey")}


def _splatted(module: ast.Module, name: str) -> set:
    """The keys of ``**name``: the module binds ``name`` to ``dict(...)`` (the sampler's settings)."""
    return {keyword.arg for value in _bindings(module, name, "dict") for keyword in value.keywords}


def struct_calls():
    """(op file, line, families, struct name, member names) of every ``arena.struct`` call in the ops."""
    calls = []
    for path in sorted(KERNELS.rglob("*.py")):
        module = ast.parse(path.read_text())
        for function in [n for n in ast.walk(module) if isinstance(n, ast.FunctionDef)]:
            for call in ast.walk(function):
                if not (_calls(call, "struct") and getattr(call.func.value, "id", "") == "arena"):
                    continue
                struct_name = call.args[1].value if len(call.args) > 1 else "Params"
                names = set()
                for keyword in call.keywords:
                    names |= _splatted(module, keyword.value.id) if keyword.arg is None else {keyword.arg}
                calls.append((path.name, call.lineno, _families(function, call.args[0]), struct_name, names))
    return calls


def uniform_structs() -> set:
    """(family, struct name) of every ``var<uniform>`` of every kernel but the session's Step and
    a batch's ``sequences`` table (an array the batch writes before each step)."""
    found = set()
    for path in SHADERS.glob("*.wgsl"):
        for struct_name in re.findall(r"var<uniform>\s+\w+\s*:\s*(\w+)", shader_source(path.stem)):
            if struct_name not in ("Step", "array"):
                found.add((path.stem, struct_name))
    return found


def test_every_op_names_exactly_the_members_of_its_kernels_struct():
    calls = struct_calls()
    assert len(calls) >= 24
    for op_file, line, families, struct_name, names in calls:
        assert families, f"{op_file}:{line}: the kernel of an arena.struct call is not a KernelKey or family name"
        for family in families:
            want = set(struct_layout(family, struct_name).names())
            assert names == want, (f"{op_file}:{line} ({family}.wgsl {struct_name}): missing {sorted(want - names)}, "
                                   f"unknown {sorted(names - want)}")


def test_every_uniform_struct_of_a_kernel_is_filled_by_an_op():
    filled = {(family, struct_name) for _, _, families, struct_name, _ in struct_calls() for family in families}
    assert uniform_structs() - filled == set()
    assert len(uniform_structs()) == 28
