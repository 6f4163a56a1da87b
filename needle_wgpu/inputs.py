"""Reading what callers pass: numbers, text, ids, keywords and objects (docs/api.md).

The no-panic contract has two halves, and this module holds the readers both rest on. A number
is *read* here (``whole_number``, ``real_number``) and *saturated* by the rules in
``sampling.py``; reading never raises. Everything structural (text that is not text, an
unknown keyword, an object of the wrong kind) raises one ``InputError`` that names the argument.
Pure Python (no numpy): NumPy values are recognised by their ``ndim`` and ``item()``.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import math
import numbers
import operator
from fractions import Fraction

from .errors import ContainerError, InputError
from .formats.source import as_byte_view
from .request_limits import LIMITS, check_text_length

TEXT_TYPES = (str, bytes, bytearray)
_BIG = 1 << 64  # beyond this a non-int number only keeps its sign (see whole_number)


# ----------------------------------------------------------------------------------- numbers


def _plain(value):
    """A NumPy scalar or 0-d array (anything with ``ndim == 0`` and ``item()``) as its Python
    value (``np.bool_`` -> bool, ``np.float32`` -> float, ``np.timedelta64`` -> timedelta)."""
    if value is None or type(value) in (int, float, str, bool):
        return value
    try:
        if getattr(value, "ndim", None) == 0 and callable(getattr(value, "item", None)):
            return value.item()
    except MemoryError:
        raise
    except Exception:  # a broken attribute is "not a number", never an escape
        pass
    return value


def _is_array(value) -> bool:
    try:
        return isinstance(getattr(value, "ndim", None), int) and value.ndim > 0
    except MemoryError:
        raise
    except Exception:
        return False


def whole_number(value) -> int | None:
    """The integer a number stands for, or None when it is not a whole number.

    Integers of any type (``int``, ``bool``, NumPy integers and bools, anything with
    ``__index__``) are exact at any size. Other numbers count when their value is whole
    (``7.0``, ``Fraction(14, 2)``, ``Decimal("7")``); beyond ±2^64 those keep only their sign
    (±2^64), so a ``Decimal("1e999999999")`` costs nothing. NaN, infinities, fractions,
    complex numbers, strings, None, arrays and durations are None. Never raises.
    """
    if type(value) is int:
        return value
    value = _plain(value)
    if isinstance(value, TEXT_TYPES) or value is None or _is_array(value):
        return None
    try:
        return operator.index(value)
    except MemoryError:
        raise
    except Exception:
        pass
    if not isinstance(value, numbers.Number):
        return None
    try:
        if not isinstance(value, (float, Fraction)):  # Decimal, NumPy long double ...: no float()
            if value - value != 0:  # NaN or an infinity (a Decimal one raises: the same answer)
                return None
            if not -_BIG < value < _BIG:  # compared, not abs(): Decimal arithmetic rounds
                return _BIG if value > 0 else -_BIG
        whole = int(value)  # truncates; ValueError for NaN, OverflowError for inf, TypeError for complex
        return whole if whole == value else None
    except MemoryError:
        raise
    except Exception:  # decimal.InvalidOperation (a NaN compared), a number type that refuses
        return None


def real_number(value) -> float | None:
    """A number as a float, or None when it cannot be read as one. Never raises.

    Anything ``float()`` reads counts (ints, floats, Fractions, Decimals, NumPy scalars and
    0-d arrays, and strings such as ``"0.7"`` or ``"inf"``); a number too large for a float is
    ±inf. None, lists, arrays of more than one dimension, complex numbers and durations are None.
    """
    if type(value) is float:
        return value
    value = _plain(value)
    if value is None or _is_array(value):
        return None
    try:
        return float(value)
    except OverflowError:  # an int or Fraction beyond the float range
        try:
            return math.inf if value > 0 else -math.inf
        except MemoryError:
            raise
        except Exception:
            return None
    except MemoryError:
        raise
    except Exception:  # TypeError, ValueError, decimal signalling NaN, an exotic __float__
        return None


# ----------------------------------------------------------------------------------- ids and text


def describe(value, limit: int = 40) -> str:
    """A short description of a caller's value for a message: its repr when short, else its
    type's name. Never raises (a broken ``__repr__`` gives the type's name too)."""
    try:
        shown = repr(value)
    except MemoryError:
        raise
    except Exception:
        return type(value).__name__
    return shown if len(shown) <= limit else type(value).__name__


def id_list(ids, name: str = "ids") -> list:
    """A caller's token ids as a list (items are saturated later, ``sampling.as_u32``).

    Any iterable counts (list, tuple, range, generator, NumPy array); a string, bytes, a 0-d
    array or a non-iterable is an ``InputError``. An iterator's own exceptions propagate.
    """
    if isinstance(ids, TEXT_TYPES):
        raise InputError(f"{name} must be a sequence of integers, got {type(ids).__name__}")
    return list(iterable(ids, f"{name} must be a sequence of integers"))


def iterable(value, problem: str):
    """``iter(value)``, or ``InputError(problem, got <type>)`` when it has none (a number, a
    released memoryview). The iterator's own exceptions, later, are the caller's."""
    try:
        if isinstance(value, memoryview):
            value.nbytes  # a released one iterates, then fails at its first item
        return iter(value)
    except (TypeError, ValueError):  # ValueError: a released memoryview
        raise InputError(f"{problem}, got {type(value).__name__}") from None


def as_text(value, name: str) -> str:
    """Text a caller passed: a ``str`` as it is (lone surrogates included), bytes decoded as
    UTF-8 (invalid sequences -> U+FFFD), None -> ``""``. Anything else (a number, a list, an
    array), or a text longer than ``request_limits.LIMITS.text_chars``, is an ``InputError``
    naming the argument."""
    value = _plain(value)
    if isinstance(value, str):
        return check_text_length(value, name)
    if value is None:
        return ""
    if isinstance(value, (bytes, bytearray)):
        return bytes(check_text_length(value, name)).decode("utf-8", "replace")
    raise InputError(f"{name} must be text (str), got {type(value).__name__}")


def optional_text(value, name: str) -> str | None:
    """As ``as_text``, but None stays None (an argument whose absence means something)."""
    return None if value is None else as_text(value, name)


def wants_int8(kv) -> bool:
    """The KV-cache choice: the text ``"int8"`` in any case; anything else means f32."""
    kv = _plain(kv)
    return isinstance(kv, TEXT_TYPES) and as_text(kv, "kv").lower() == "int8"


def stop_strings(stop) -> list:
    """Stop strings: one text or an iterable of them. Empty strings and items that are not text
    are ignored; None -> none; anything else, or more than ``LIMITS.stop_strings`` strings ->
    ``InputError``."""
    stop = _plain(stop)
    if stop is None:
        return []
    if isinstance(stop, TEXT_TYPES):
        stop = [stop]
    strings = []
    for item in iterable(stop, "stop must be a string or a list of strings"):
        item = _plain(item)
        if isinstance(item, TEXT_TYPES):
            item = as_text(item, "stop")
            if item:
                strings.append(item)
                if len(strings) > LIMITS.stop_strings:
                    raise InputError(f"stop: more than {LIMITS.stop_strings} stop strings")
    return strings


# ----------------------------------------------------------------------------------- objects


def byte_view(value) -> memoryview | None:
    """The bytes of a buffer (bytes, bytearray, memoryview, a NumPy array) as a flat
    unsigned-byte memoryview (``formats.source.as_byte_view``); None when ``value`` is not a
    live buffer (not one at all, or a released memoryview)."""

    try:
        return as_byte_view(value)
    except ContainerError:
        return None


def instance_or_none(value, kind: type, name: str, hint: str = ""):
    """``value`` when it is None or a ``kind``; otherwise an ``InputError`` naming ``name``."""
    if value is None or isinstance(value, kind):
        return value
    raise InputError(f"{name} must be a {kind.__name__} or None, got {type(value).__name__}{hint}")


def flag(value, name: str) -> bool:
    """A yes/no argument: a bool, None (no), or a whole number (0 is no); anything else, an
    array included, is an ``InputError`` (its truth value is not a yes or a no)."""
    value = _plain(value)
    if value is None or isinstance(value, bool):
        return bool(value)
    whole = whole_number(value)
    if whole is None:
        raise InputError(f"{name} must be True or False, got {type(value).__name__}")
    return whole != 0


def callback_or_none(value, name: str):
    """A function the engine will call (``progress``): None or a callable, else ``InputError``."""
    if value is None or callable(value):
        return value
    raise InputError(f"{name} must be a function or None, got {type(value).__name__}")


# ----------------------------------------------------------------------------------- keywords


def _accepted(parameters) -> list:
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in parameters if p.kind in kinds and p.name not in ("self", "cls")]


def check_keywords(where: str, given, accepted) -> None:
    """Every key of ``given`` must be in ``accepted``; else ``InputError`` naming the first
    unknown keyword, the closest accepted one and all the accepted ones."""
    accepted = list(accepted)
    for key in given:
        if key not in accepted:
            close = difflib.get_close_matches(str(key), accepted, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise InputError(f"{where}: unknown keyword {key!r}{hint}; accepted: {', '.join(accepted)}")


def checked(function):
    """A public function whose calls are checked against its signature first: an unknown
    keyword, a missing argument or too many positional ones is an ``InputError`` naming it,
    never Python's ``TypeError``. A generator function is checked when it is called."""
    signature = inspect.signature(function)
    parameters = list(signature.parameters.values())
    takes_any_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
    accepted = _accepted(parameters)
    where = function.__qualname__

    @functools.wraps(function)
    def call(*args, **kwargs):
        try:
            signature.bind(*args, **kwargs)
        except TypeError as exc:
            if not takes_any_keyword:
                check_keywords(where, kwargs, accepted)
            raise InputError(f"{where}: {exc}; accepted: {', '.join(accepted)}") from None
        return function(*args, **kwargs)

    call.__signature__ = signature
    return call


def checked_methods(cls):
    """Class decorator: ``checked`` on every public method defined in the class (plain methods,
    classmethods and staticmethods; properties and names starting with ``_`` are left alone)."""
    for name, member in list(vars(cls).items()):
        if name.startswith("_"):
            continue
        if isinstance(member, (classmethod, staticmethod)):
            setattr(cls, name, type(member)(checked(member.__func__)))
        elif inspect.isfunction(member):
            setattr(cls, name, checked(member))
    return cls
