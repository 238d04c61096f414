"""Selection: which layers, and which of their parameters, are offloaded."""

from __future__ import annotations

from typing import Any

import numpy as np

from .errors import OffloadConfigError


def _check_int(name: str, value: Any, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise OffloadConfigError(f"{name} must be an int, not {value!r}")
    if value < lo:
        raise OffloadConfigError(f"{name} must be at least {lo}, not {value}")
    return int(value)


def _check_group(group_size: Any, num_in_group: Any) -> tuple[int, int]:
    g = _check_int("group_size", group_size, 1)
    m = _check_int("num_in_group", num_in_group, 1)
    if m > g:
        raise OffloadConfigError(
            f"num_in_group ({m}) is larger than group_size ({g}): a group of {g} layers "
            f"cannot offload {m}"
        )
    return g, m


def select_layers(num_layers: int, group_size: int, num_in_group: int) -> list[int]:
    """Indices of the layers chosen for offloading: the last ``num_in_group`` of every group of
    ``group_size``, i.e. ``i % group_size >= group_size - num_in_group``."""
    n = _check_int("num_layers", num_layers, 0)
    g, m = _check_group(group_size, num_in_group)
    return [i for i in range(n) if i % g >= g - m]


def matches_segment(name: str, segment: str) -> bool:
    """Whether the dotted parameter ``name`` contains ``segment`` as whole dotted segments."""
    return f".{segment}." in f".{name}."


def _segments(params: Any) -> list[str]:
    if params is None:
        return []
    items = [params] if isinstance(params, str) else list(params)
    out = []
    for s in items:
        if not isinstance(s, str) or not s.strip("."):
            raise OffloadConfigError(f"parameter name segments must be non-empty strings: {s!r}")
        out.append(s.strip("."))
    return out
