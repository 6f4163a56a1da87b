"""Turning a model source (a path or a bytes-like object) into a memoryview of its bytes."""

from __future__ import annotations

import os

from ..errors import ContainerError


def read_source(source) -> memoryview:
    """The bytes of a path, bytes, bytearray or memoryview, as a 1-D unsigned-byte memoryview."""
    if isinstance(source, (str, os.PathLike)):
        try:
            with open(source, "rb") as f:
                data = memoryview(f.read())
        except (OSError, ValueError) as exc:  # ValueError: a NUL character in the path
            raise ContainerError(f"file {source!s}: cannot read ({getattr(exc, 'strerror', None) or exc})") from None
    else:
        # Bytes or any buffer (memoryview, NumPy array). Not open(): an int is a file descriptor.
        try:
            data = memoryview(source)
        except TypeError:
            raise ContainerError(f"expected a path or bytes, got {type(source).__name__}") from None
        if not data.c_contiguous:  # a strided view: take a compact copy of its bytes
            data = memoryview(data.tobytes())
        elif data.format != "B" or data.ndim != 1:
            data = data.cast("B")
    return data
