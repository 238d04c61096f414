"""The check of an int argument, one for the whole package, with one message:
``"<name> must be an int >= 1, not 0"`` (``"... must be an int, not 2.0"`` for a value of another
type). A caller may name the exceptions it raises (the engine's typed errors in
:mod:`blockswap.engine`). The Rust core words its own range errors the same way
(``"max_in_flight must be an int from 1 to 16384, not 0"``).

By default a refused int is a :class:`~blockswap.errors.ConfigTypeError` or
:class:`~blockswap.errors.ConfigError` (a ``TypeError`` / ``ValueError`` and a
:class:`~blockswap.BlockswapError`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, overload

import numpy as np

from .errors import ConfigError, ConfigTypeError

Errors = tuple[type[Exception], type[Exception]]
"""The exception for a value that is not an int, and the one for an int out of range."""

_DEFAULT_ERRORS: Errors = (ConfigTypeError, ConfigError)


@overload
def check_int(
    name: str,
    value: Any,
    lo: int | None = None,
    hi: int | None = None,
    *,
    optional: Literal[False] = False,
    numpy: bool = True,
    what: str = "an int",
    errors: Errors = _DEFAULT_ERRORS,
) -> int: ...


@overload
def check_int(
    name: str,
    value: Any,
    lo: int | None = None,
    hi: int | None = None,
    *,
    optional: Literal[True],
    numpy: bool = True,
    what: str = "an int",
    errors: Errors = _DEFAULT_ERRORS,
) -> int | None: ...


def check_int(
    name: str,
    value: Any,
    lo: int | None = None,
    hi: int | None = None,
    *,
    optional: bool = False,
    numpy: bool = True,
    what: str = "an int",
    errors: Errors = _DEFAULT_ERRORS,
) -> int | None:
    """``value`` of argument ``name`` as an int, if it is one (Python's, or numpy's unless
    ``numpy=False``; a bool is not) within ``[lo, hi]`` (either bound may be left out).
    Otherwise ``errors[0]`` for a value of another type, ``errors[1]`` for one out of range.
    ``optional``: None passes too (and is returned). ``what`` names the int in the message (``"a
    raw CUstream int"``)."""
    n = value
    if type(value) is not int:
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, np.integer) if numpy else int):
            alt = " or None" if optional else ""
            raise errors[0](f"{name} must be {what}{alt}, not {_shown(value)}")
        n = int(value)
    if (lo is not None and n < lo) or (hi is not None and n > hi):
        raise errors[1](f"{name} must be {what}{_range(lo, hi)}, not {_shown(value)}")
    return n


def _range(lo: int | None, hi: int | None) -> str:
    if lo is not None and hi is not None:
        return f" from {_bound(lo)} to {_bound(hi)}"
    if lo is not None:
        return f" >= {_bound(lo)}"
    if hi is not None:
        return f" <= {_bound(hi)}"
    return ""


def _bound(n: int) -> str:
    """``n``, where it is a power of two from 2**31 up (or one less, or its negative) as one:
    ``2**64 - 1``, ``-2**127``."""
    for k, rest in ((n, ""), (n + 1, " - 1")):
        a = abs(k)
        if a >= 1 << 31 and a & (a - 1) == 0:
            return f"{'-' if k < 0 else ''}2**{a.bit_length() - 1}{rest}"
    return str(n)


def _shown(value: Any) -> str:
    """A refused value: its repr where that is plain (``0``, ``2.0``, ``True``, ``np.int64(-1)``,
    a short string such as ``'8'``), else its type (``a Tensor``)."""
    if value is None or isinstance(value, (int, float, complex, np.generic)):
        return repr(value)
    if isinstance(value, (str, bytes)) and len(value) <= 40:
        return repr(value)
    return f"a {type(value).__name__}"


def check_bool(name: str, value: Any, errors: type[Exception] = ConfigTypeError) -> bool:
    """``value`` of argument ``name`` if it is a bool (Python's or numpy's), else ``errors``
    saying ``"<name> must be a bool, not <value>"`` (an array or a string is not taken for its
    truth)."""
    if not isinstance(value, (bool, np.bool_)):
        raise errors(f"{name} must be a bool, not {_shown(value)}")
    return bool(value)


def check_choice(name: str, value: Any, choices: Sequence[str]) -> str:
    """``value`` of argument ``name`` if it is one of the strings ``choices``, else a
    :class:`~blockswap.errors.ConfigError` (a :class:`~blockswap.errors.ConfigTypeError` for a
    value that is not a str) saying ``"<name> must be 'a', 'b' or 'c', not <value>"``."""
    if isinstance(value, str) and value in choices:
        return value
    names = [repr(c) for c in choices]
    one_of = ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]
    kind = ConfigError if isinstance(value, str) else ConfigTypeError
    raise kind(f"{name} must be {one_of}, not {_shown(value)}")
