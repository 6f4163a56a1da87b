"""The NumPy reference's error boundary: its public methods raise ``NeedleError`` subclasses only
(docs/api.md). A file whose records pass the container's checks but do not fit together (a
mutated record width) makes NumPy raise ``ValueError``/``IndexError`` deep inside an op; at the
boundary that becomes a ``ContainerError`` naming the method and NumPy's message."""

from __future__ import annotations

import functools

from ..errors import ContainerError, NeedleError

_NUMPY_ERRORS = (ValueError, IndexError, TypeError, ArithmeticError, AttributeError, KeyError)


def raises_container_errors(cls):
    """Wraps every public method (and ``__init__``) of ``cls``."""
    for name, method in list(vars(cls).items()):
        if callable(method) and (not name.startswith("_") or name == "__init__"):
            setattr(cls, name, _bounded(name, method))
    return cls


def _bounded(name, method):
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        except NeedleError:
            raise
        except _NUMPY_ERRORS as exc:
            raise ContainerError(f"reference {name}: the file's records do not fit together "
                                 f"({type(exc).__name__}: {exc})") from exc
    return wrapper
