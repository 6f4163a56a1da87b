"""Reading a model source (a path or a bytes-like object) without surprises (docs/api.md).

Every format reader turns its source into bytes through ``read_source``:

* a path is opened without blocking and only a regular file is read: a FIFO, a device
  (``/dev/zero``), a directory or a socket is refused with ``ContainerError`` before any read;
* only what the format says it needs is read, in rounds: the reader's ``needed(view, size)``
  looks at the bytes read so far (the first ``first`` bytes, then more) and returns how many
  bytes the whole input takes according to its own header; it raises ``ContainerError`` as soon
  as those bytes are wrong (a bad tag after the first bytes, a bad directory after the
  directory), so a huge or endless file costs no more than its header claims;
* a bytes-like source is used in place (zero-copy), except a strided view, which is compacted.

Pure Python: this runs in Pyodide too.
"""

from __future__ import annotations

import os
import stat

from ..errors import ContainerError

# Flags of the one open(): never wait for a writer (FIFO) or a carrier (tty), never adopt a
# terminal, binary mode on Windows. The flags a platform lacks are 0.
OPEN_FLAGS = (os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
              | getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0))


def as_byte_view(source, what: str = "source") -> memoryview:
    """A bytes-like object as a 1-D unsigned-byte memoryview (zero-copy when contiguous).

    Not a path: the caller decides that. A non-buffer or a released memoryview raises
    ``ContainerError``.
    """
    try:
        data = memoryview(source)
    except TypeError:
        raise ContainerError(f"expected a path or bytes, got {type(source).__name__}") from None
    except ValueError:  # "operation forbidden on released memoryview object"
        raise ContainerError(f"{what}: the memoryview has been released") from None
    try:
        if not data.c_contiguous:  # a strided view: take a compact copy of its bytes
            return memoryview(data.tobytes())
        if data.format != "B" or data.ndim != 1:
            return data.cast("B")
    except (TypeError, ValueError):  # a format cast() refuses (structured NumPy dtypes ...)
        return memoryview(data.tobytes())
    return data


class Source:
    """An opened source: its size and its first bytes, read on demand.

    ``prefix(n)`` returns the first min(n, size) bytes. For a file, bytes already read are kept
    and only the missing ones are read; each call returns a view of one buffer, so a reader
    that grows its prefix should grow it geometrically (or in a few known steps) to stay
    linear. Use as a context manager (the file is closed on exit).
    """

    def __init__(self, source, label: str = "file"):
        self._file = None
        self._buffer = memoryview(b"")
        if isinstance(source, (str, os.PathLike)):
            self.name = f"{label} {_path_name(source)}"
            self._open(source)
        else:
            self.name = label
            self._buffer = as_byte_view(source, label)
            self.size = len(self._buffer)

    def _open(self, path) -> None:
        try:
            fd = os.open(path, OPEN_FLAGS)
        except (OSError, ValueError, TypeError) as exc:  # ValueError: a NUL in the path
            raise ContainerError(f"{self.name}: cannot read ({getattr(exc, 'strerror', None) or exc})") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise ContainerError(f"{self.name}: cannot read (not a regular file: {_kind(info.st_mode)})")
            self.size = info.st_size
            self._file = os.fdopen(fd, "rb", buffering=0)
        except BaseException:
            os.close(fd)
            raise

    @property
    def is_file(self) -> bool:
        return self._file is not None

    def prefix(self, n: int) -> memoryview:
        n = max(0, min(int(n), self.size))
        if n <= len(self._buffer):
            return self._buffer[:n]
        buffer = bytearray(n)
        have = len(self._buffer)
        buffer[:have] = self._buffer
        view = memoryview(buffer)
        try:
            self._file.seek(have)
            while have < n:
                got = self._file.readinto(view[have:])
                if not got:  # the file shrank since fstat: the reader reports the truncation
                    break
                have += got
        except OSError as exc:
            raise ContainerError(f"{self.name}: cannot read ({exc.strerror or exc})") from None
        self._buffer = view[:have]
        return self._buffer

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> "Source":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _path_name(path) -> str:
    """A path for messages; an ``os.PathLike`` whose ``__fspath__`` is broken still gets one."""
    if isinstance(path, str):
        return path
    try:
        return os.fsdecode(path)
    except (TypeError, ValueError):
        return repr(path)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a plain file"


def read_source(source, needed, *, first: int, label: str = "file") -> memoryview:
    """The bytes of ``source`` that its format needs, as a 1-D unsigned-byte memoryview.

    ``needed(view, size)`` gets the bytes read so far (at first the first ``first`` bytes, or
    the whole file when it is shorter) and the source's total size, and returns the number of
    bytes the input takes (it may raise ``ContainerError``). While that is more than has been
    read and the source has more, the missing bytes are read and ``needed`` is asked again.
    The result holds exactly min(needed, size) bytes for a file; a bytes-like source is
    returned whole (it is already in memory). A short result is the reader's to report as a
    truncation.
    """
    with Source(source, label) as src:
        if not src.is_file:
            return src.prefix(src.size)
        view = src.prefix(first)
        while True:
            want = needed(view, src.size)
            if want <= len(view):
                return view[:want]
            longer = src.prefix(want)
            if len(longer) == len(view):  # at the end (or the file shrank): nothing more to read
                return view
            view = longer
