"""The WGSL sources of the kernels: one file per kernel family in shaders/, read from the source
tree or from the installed wheel (``needle_wgpu.shaders``), with shared helpers pasted in.

Plain Python (no numpy): it also runs in the browser.
"""

from __future__ import annotations

from pathlib import Path


def _read_shader_file(name: str) -> str:
    here = Path(__file__).resolve().parents[2] / "shaders" / name
    if here.exists():
        return here.read_text()
    from importlib import resources

    return resources.files("needle_wgpu.shaders").joinpath(name).read_text()


def shader_source(family: str) -> str:
    """The WGSL text of one kernel family, from the source tree or the installed wheel.

    A line ``//#include NAME.wgsl`` is replaced by that file (shared helpers such as the FWHT):
    WGSL has no includes, and one copy of each helper keeps desktop and browser in step. An
    included file may include others; each file is pasted once, at its first include.
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
