"""The one place that maps a model file to its family, by the file's magic (never its name).

A family is a module with ``sniff(head) -> bool``, ``read(source)`` (parse and validate the
file, no GPU), ``open(parsed, device, progress) -> GpuModel`` and ``describe(parsed) -> dict``;
``api.Model`` drives the GpuModel.
"""

from __future__ import annotations

import os

from .errors import ContainerError
from .models import needle3

FAMILIES = {"needle3": needle3}


def magic(source) -> bytes:
    """The first four bytes of a path or buffer (fewer if it is shorter)."""
    if isinstance(source, (str, os.PathLike)):
        try:
            with open(source, "rb") as f:
                return f.read(4)
        except (OSError, ValueError) as exc:  # ValueError: a NUL character in the path
            raise ContainerError(f"file {source!s}: cannot read ({getattr(exc, 'strerror', None) or exc})") from None
    try:
        return bytes(memoryview(source)[:4].cast("B"))
    except (TypeError, ValueError):
        raise ContainerError(f"expected a path or bytes, got {type(source).__name__}") from None


def family_of(source):
    """The family module for a source; unknown magics go to the .cact reader, whose error
    names the tag it found."""
    head = magic(source)
    for family in FAMILIES.values():
        if family.sniff(head):
            return family
    return needle3


def open_gpu_model(source, device=None, progress=None):
    """Read, validate and upload a model file; ``device`` defaults to the native one."""
    family = family_of(source)
    parsed = family.read(source)  # a bad file fails before any device is opened
    if device is None:
        from .gpu import open_device

        device = open_device()
    return family.open(parsed, device, progress=progress)


def describe(source) -> dict:
    """A model file's family, geometry and sizes without a GPU."""
    family = family_of(source)
    return family.describe(family.read(source))
