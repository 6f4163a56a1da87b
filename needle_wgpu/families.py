"""The one place that maps a model file to its family, by the file's magic (never its name).

A family is a module with ``sniff(head) -> bool``, ``read(source)`` (parse and validate the
file, no GPU), ``open(parsed, device, progress, numerics[, depth]) -> GpuModel``, ``describe(parsed) -> dict``
and ``NUMERICS`` (the numerics it runs: "float", and for Needle 3 "deploy", ``models.needle3_numerics``);
``api.Model`` drives the GpuModel.
"""

from __future__ import annotations

from .errors import DepthError
from .formats.source import Source
from .models import dense, needle3
from .models.needle3_numerics import choice

FAMILIES = {"needle3": needle3, "dense": dense}


def magic(source) -> bytes:
    """The first four bytes of a path or buffer (fewer if it is shorter); only a regular file
    is opened (``formats.source``: a FIFO or device is refused, never waited on)."""
    with Source(source) as src:
        return bytes(src.prefix(4))


def family_of(source):
    """The family module for a source; unknown magics go to the .cact reader, whose error
    names the tag it found."""
    head = magic(source)
    for family in FAMILIES.values():
        if family.sniff(head):
            return family
    return needle3


def open_gpu_model(source, device=None, progress=None, numerics="float", depth=None):
    """Read, validate and upload a model file; ``device`` defaults to the native one.
    ``numerics`` ("float" or "deploy", ``needle_wgpu.models.needle3_numerics``) is checked before anything is read;
    a family that has only float numerics refuses "deploy" with ``UnsupportedModelError``.
    ``depth`` (None: the file's own) is for families with an elastic-depth ladder (Needle 3);
    any other family refuses it with ``DepthError``."""
    numerics = choice(numerics)
    family = family_of(source)
    parsed = family.read(source)  # a bad file fails before any device is opened
    if numerics not in family.NUMERICS:
        from .errors import UnsupportedModelError

        raise UnsupportedModelError(f"numerics={numerics!r}: {family.__name__.rsplit('.', 1)[-1]} models run "
                                    f"only {', '.join(family.NUMERICS)} numerics")
    if depth is not None and family is not needle3:
        raise DepthError(f"depth={depth!r}: only Needle 3 files have an elastic-depth ladder")
    if depth is not None:
        needle3.rung(parsed.geometry, depth)  # refused before any device is opened
    if device is None:
        from .gpu import open_device

        device = open_device()
    if depth is None:
        return family.open(parsed, device, progress=progress, numerics=numerics)
    return family.open(parsed, device, progress=progress, numerics=numerics, depth=depth)


def describe(source, context=None, depth=None) -> dict:
    """A model file's family, geometry and sizes without a GPU (``context``: what a session of
    that many positions would allocate, where the family sizes its cache by it; ``depth``: the
    rung of a Needle 3 file's ladder, ``DepthError`` for another family)."""
    family = family_of(source)
    if depth is not None and family is not needle3:
        raise DepthError(f"depth={depth!r}: only Needle 3 files have an elastic-depth ladder")
    parsed = family.read(source)
    if depth is None:
        return family.describe(parsed, context=context)
    return family.describe(parsed, context=context, depth=depth)
