"""The one place that maps a model file to its family, by the file's magic (never its name).

A family is a module with ``NAME``, ``sniff(head) -> bool``, ``read(source)`` (parse and
validate the file, no GPU), ``open(parsed, device, progress, numerics, depth) -> GpuModel``,
``describe(parsed, context, depth) -> dict``, ``NUMERICS`` (the numerics it runs: "float", and
for Needle 3 "deploy", ``models.needle3_numerics``), ``LADDER`` (whether its files have an
elastic-depth ladder) and, where they do, ``check_depth(parsed, depth)``. ``api.Model`` drives
the GpuModel (``models.protocols``).
"""

from __future__ import annotations

from .errors import DepthError, UnsupportedModelError
from .formats.source import Source
from .gpu import open_device
from .models import dense, needle3
from .models.needle3_numerics import choice

FAMILIES = {family.NAME: family for family in (needle3, dense)}
FALLBACK = needle3.NAME  # an unknown magic is read as a .cact, whose reader names the tag it found


def magic(source) -> bytes:
    """The first four bytes of a path or buffer (fewer if it is shorter); only a regular file
    is opened (``formats.source``: a FIFO or device is refused, never waited on)."""
    with Source(source) as src:
        return bytes(src.prefix(4))


def family_of(source):
    """The family module for a source; an unknown magic goes to ``FALLBACK``'s reader, whose
    error names the tag it found."""
    head = magic(source)
    for family in FAMILIES.values():
        if family.sniff(head):
            return family
    return FAMILIES[FALLBACK]


def _checked(family, parsed, numerics, depth) -> None:
    """What the family declares it runs: its ``NUMERICS``, and a depth only where it has a
    ladder (``LADDER``; the family's ``check_depth`` says which depths the file can give)."""
    if numerics not in family.NUMERICS:
        raise UnsupportedModelError(f"numerics={numerics!r}: {family.NAME} models run only "
                                    f"{', '.join(family.NUMERICS)} numerics")
    if depth is not None:
        if not family.LADDER:
            raise DepthError(f"depth={depth!r}: only Needle 3 files have an elastic-depth ladder "
                             f"(this is a {family.NAME} model)")
        family.check_depth(parsed, depth)  # refused before any device is opened


def open_gpu_model(source, device=None, progress=None, numerics="float", depth=None):
    """Read, validate and upload a model file; ``device`` defaults to the native one.
    ``numerics`` ("float" or "deploy", ``models.needle3_numerics``) is checked before anything is
    read; a family that runs only float numerics refuses "deploy" with ``UnsupportedModelError``.
    ``depth`` (None: the file's own) is for families with an elastic-depth ladder (Needle 3);
    any other family refuses it with ``DepthError``."""
    numerics = choice(numerics)
    family = family_of(source)
    parsed = family.read(source)  # a bad file fails before any device is opened
    _checked(family, parsed, numerics, depth)
    if device is None:
        device = open_device()
    return family.open(parsed, device, progress=progress, numerics=numerics, depth=depth)


def describe(source, context=None, depth=None) -> dict:
    """A model file's family, geometry and sizes without a GPU (``context``: what a session of
    that many positions would allocate, where the family sizes its cache by it; ``depth``: the
    rung of a Needle 3 file's ladder, ``DepthError`` for another family)."""
    family = family_of(source)
    if depth is not None and not family.LADDER:
        raise DepthError(f"depth={depth!r}: only Needle 3 files have an elastic-depth ladder "
                         f"(this is a {family.NAME} model)")
    return family.describe(family.read(source), context=context, depth=depth)
