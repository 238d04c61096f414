"""The checks of an argument, one set for the whole package, worded one way: ``"<name> must be
an int >= 1, not 0"`` (``"... must be an int, not 2.0"`` for a value of another type). The core
words them (``rust/py/args.rs``), its own settings' as well as these, so that ints are refused in
the same words everywhere (``"max_in_flight must be an int from 1 to 16384, not 0"``).

By default a refused int is a :class:`~blockswap.errors.ConfigTypeError` or
:class:`~blockswap.errors.ConfigError` (a ``TypeError`` / ``ValueError`` and a
:class:`~blockswap.BlockswapError`); the engine's are :data:`ENGINE_ERRORS`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, overload

import numpy as np

from . import _core
from ._core import ArgumentTypeError, InvalidTransferError
from .errors import ConfigError, ConfigTypeError

Errors = tuple[type[Exception], type[Exception]]
"""The exception for a value that is not an int, and the one for an int out of range."""

_DEFAULT_ERRORS: Errors = (ConfigTypeError, ConfigError)

#: The engine's: an :class:`~blockswap.ArgumentTypeError` for a value of another type, an
#: :class:`~blockswap.InvalidTransferError` for an int out of range.
ENGINE_ERRORS: Errors = (ArgumentTypeError, InvalidTransferError)


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
    raw CUstream int"``). The core's check (``rust/py/args.rs``), which words every int
    argument of the package."""
    if type(value) is int and (lo is None or value >= lo) and (hi is None or value <= hi):
        return value
    return _core.check_int(name, value, lo, hi, optional, numpy, what, errors[0], errors[1])


_shown = _core.shown


def check_bool(name: str, value: Any, errors: type[Exception] = ConfigTypeError) -> bool:
    """``value`` of argument ``name`` if it is a bool (Python's or numpy's), else ``errors``
    saying ``"<name> must be a bool, not <value>"`` (an array or a string is not taken for its
    truth)."""
    if not isinstance(value, (bool, np.bool_)):
        raise errors(f"{name} must be a bool, not {_shown(value)}")
    return bool(value)


def choice_text(choices: Sequence[str]) -> str:
    """``'a', 'b' or 'c'``: what :func:`check_choice` says a value must be."""
    names = [repr(c) for c in choices]
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]


def check_choice(name: str, value: Any, choices: Sequence[str]) -> str:
    """``value`` of argument ``name`` if it is one of the strings ``choices``, else a
    :class:`~blockswap.errors.ConfigError` (a :class:`~blockswap.errors.ConfigTypeError` for a
    value that is not a str) saying ``"<name> must be 'a', 'b' or 'c', not <value>"``."""
    if isinstance(value, str) and value in choices:
        return value
    one_of = choice_text(choices)
    kind = ConfigError if isinstance(value, str) else ConfigTypeError
    raise kind(f"{name} must be {one_of}, not {_shown(value)}")
