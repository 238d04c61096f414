"""Selection: which layers, and which of their parameters, are offloaded."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .._checks import check_int
from .errors import OffloadConfigError

#: A bad count is an OffloadConfigError, whether of the wrong type or out of range.
_CONFIG_ERRORS = (OffloadConfigError, OffloadConfigError)


def _check_group(group_size: Any, num_in_group: Any) -> tuple[int, int]:
    g = check_int("group_size", group_size, 1, errors=_CONFIG_ERRORS)
    m = check_int("num_in_group", num_in_group, 1, errors=_CONFIG_ERRORS)
    if m > g:
        raise OffloadConfigError(
            f"num_in_group ({m}) is larger than group_size ({g}): a group of {g} layers "
            f"cannot offload {m}"
        )
    return g, m


def select_layers(num_layers: int, group_size: int, num_in_group: int) -> list[int]:
    """Indices of the layers chosen for offloading: the last ``num_in_group`` of every group of
    ``group_size``, i.e. ``i % group_size >= group_size - num_in_group``."""
    n = check_int("num_layers", num_layers, 0, errors=_CONFIG_ERRORS)
    g, m = _check_group(group_size, num_in_group)
    return [i for i in range(n) if i % g >= g - m]


def matches_segment(name: str, segment: str) -> bool:
    """Whether the dotted parameter ``name`` contains ``segment`` as whole dotted segments."""
    return f".{segment}." in f".{name}."


def _segments(params: Any) -> list[str]:
    if params is None:
        return []
    if isinstance(params, str):
        items = [params]
    elif isinstance(params, Iterable) and not isinstance(params, bytes):
        items = list(params)
    else:
        raise OffloadConfigError(
            "params must be a str or a list of parameter name segments, not "
            f"{type(params).__name__}"
        )
    out = []
    for s in items:
        if not isinstance(s, str) or not s.strip("."):
            raise OffloadConfigError(f"parameter name segments must be non-empty strings: {s!r}")
        out.append(s.strip("."))
    return out
