"""The index of ops in ``needle_wgpu/kernels/__init__.py`` is whole and true: every kernel (a
WGSL file with an entry point) is listed, and every op, file and reference function it names exists."""

import importlib
import re
from pathlib import Path

import pytest

import needle_wgpu.kernels

ROOT = Path(__file__).resolve().parents[1]
SHADERS = ROOT / "shaders"


def rows() -> list:
    """(op, WGSL files, reference functions, test files) of each index line."""
    out = []
    for line in needle_wgpu.kernels.__doc__.splitlines():
        if " -> " in line and not line.startswith("("):
            op, wgsl, reference, tests = line.split(" -> ")
            out.append((op, wgsl.split(", "), re.sub(r"\(.*?\)", "", reference).split(", "), tests.split(", ")))
    return out


def resolve(package: str, dotted: str) -> tuple:
    """(the module a dotted name starts with, the rest): ``needle3.embed.embed`` under
    ``needle_wgpu.kernels`` is the module ``needle3.embed`` and ``embed``."""
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            return importlib.import_module(".".join([package] + parts[:cut])), ".".join(parts[cut:])
        except ModuleNotFoundError:
            continue
    raise AssertionError(f"no module of {package} starts {dotted}")


def kernel_files() -> set:
    return {p.name for p in SHADERS.glob("*.wgsl") if "@compute" in p.read_text()}


def test_every_kernel_is_in_the_index():
    listed = {name for _, wgsl, _, _ in rows() for name in wgsl}
    assert kernel_files() - listed == set()
    assert len(rows()) >= 24


def test_shaders_holds_kernels_only_and_include_holds_helpers_only():
    assert {p.name for p in SHADERS.glob("*.wgsl")} == kernel_files()
    assert [p.name for p in (SHADERS / "include").glob("*.wgsl") if "@compute" in p.read_text()] == []


@pytest.mark.parametrize("op, wgsl, reference, tests", rows(), ids=[row[0].split()[0] for row in rows()])
def test_every_name_in_the_index_exists(op, wgsl, reference, tests):
    dotted, _, aliases = op.partition(" ")
    module, function = resolve("needle_wgpu.kernels", dotted)
    for name in [function] + re.findall(r"\w+", aliases):  # the op, then any aliases in parentheses
        assert callable(getattr(module, name, None)), f"{module.__name__}.{name}"
    for name in wgsl:
        assert (SHADERS / name).is_file(), name
    for dotted in filter(None, (name.strip() for name in reference)):
        target, rest = resolve("needle_wgpu.reference", dotted)
        for attribute in rest.split("."):
            target = getattr(target, attribute, None)
        assert callable(target), f"needle_wgpu.reference.{dotted}"
    for name in tests:
        assert (ROOT / "tests" / "gpu" / name).is_file(), name
