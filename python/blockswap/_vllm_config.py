"""The plug-in's options in vLLM's ``kv_connector_extra_config``, checked before anything is
allocated.

vLLM hands every offloading backend the whole ``kv_connector_extra_config`` and reads its own keys
from it (``spec_name``, ``cpu_bytes_to_use``, ``eviction_policy``, ...); blockswap's keys start
with ``blockswap_``. :func:`worker_options` checks them all when the spec is made: an unknown
``blockswap_*`` key (a misspelling) is refused with the known ones and what each takes, and a bad
value with the key's name and the values it takes, as a :class:`~blockswap.errors.ConfigError`
(or :class:`~blockswap.errors.ConfigTypeError`), before vLLM sizes or blockswap allocates the CPU
cache. :func:`check_fits` then refuses a cache larger than the host's available memory, naming
``cpu_bytes_to_use``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, get_args

import numpy as np

from . import _core, _vllm_logging
from ._checks import check_bool, check_choice, check_int, choice_text
from ._types import HandlerPath
from .engine import _is_int
from .errors import ConfigError, ConfigTypeError
from .hostmem import size_text

__all__ = [
    "OPTIONS",
    "check_chunks",
    "check_config",
    "check_fits",
    "check_worker_fits",
    "init_spec",
    "region_check",
    "worker_options",
]

_WHERE = "in kv_connector_extra_config"


@dataclass(frozen=True)
class Option:
    """A ``kv_connector_extra_config`` key: the worker's keyword it sets, what it takes (listed
    with each key when an unknown one is refused) and its check, which returns the value the
    worker gets."""

    param: str
    takes: str
    check: Callable[[str, Any], Any]


def _path(key: str, value: Any) -> Any:
    return check_choice(key, value, get_args(HandlerPath))


def _seconds(hi: float) -> Callable[[str, Any], Any]:
    def check(key: str, value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigTypeError(f"{key} must be a number of seconds, not {value!r}")
        if not 0 <= value <= hi:
            raise ConfigError(f"{key} must be a number of seconds from 0 to {hi:g}, not {value!r}")
        return float(value)

    return check


def _int(lo: int, hi: int) -> Callable[[str, Any], Any]:
    def check(key: str, value: Any) -> Any:
        return check_int(key, value, lo, hi, numpy=False)

    return check


#: The keys this backend reads, in the order the docs list them.
OPTIONS: dict[str, Option] = {
    "blockswap_path": Option("path", choice_text(get_args(HandlerPath)), _path),
    "blockswap_max_in_flight": Option(
        "max_in_flight", f"an int from 1 to {_core.MAX_IN_FLIGHT}", _int(1, _core.MAX_IN_FLIGHT)
    ),
    "blockswap_pin_piece_bytes": Option(
        "pin_piece_bytes",
        f"an int from 1 to {_core.REGISTRATION_LIMIT - 1}",
        _int(1, _core.REGISTRATION_LIMIT - 1),
    ),
    "blockswap_idle_issue": Option("idle_issue", "true or false", check_bool),
    "blockswap_keep_warm": Option(
        "keep_warm",
        f"a number of seconds from 0 to {_core.MAX_KEEP_WARM:g}",
        _seconds(_core.MAX_KEEP_WARM),
    ),
}


def worker_options(extra_config: Mapping[str, Any]) -> dict[str, Any]:
    """The worker's keyword options from ``extra_config``, every ``blockswap_*`` key checked
    first (see the module's documentation); ``cpu_bytes_to_use`` must be a positive number of
    bytes (vLLM's own check says only that it is missing)."""
    if not isinstance(extra_config, Mapping):
        raise ConfigTypeError(
            f"kv_connector_extra_config must be a dict, not {type(extra_config).__name__}"
        )
    unknown = sorted(k for k in extra_config if isinstance(k, str) and k.startswith("blockswap_"))
    unknown = [k for k in unknown if k not in OPTIONS]
    if unknown:
        raise ConfigError(
            f"unknown blockswap option{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(map(repr, unknown))} {_WHERE}; the known ones are "
            + "; ".join(f"{k} ({o.takes})" for k, o in OPTIONS.items())
        )
    out: dict[str, Any] = {}
    for key, opt in OPTIONS.items():
        if key in extra_config:
            try:
                out[opt.param] = opt.check(key, extra_config[key])
            except (ConfigError, ConfigTypeError) as e:
                raise type(e)(f"{e} {_WHERE}") from None
    cpu_bytes_to_use(extra_config)
    return out


def cpu_bytes_to_use(extra_config: Mapping[str, Any]) -> int:
    """vLLM's ``cpu_bytes_to_use`` (the CPU cache's size in bytes): present, a number > 0 (vLLM
    takes ``int()`` of it, so a float is fine), as an int."""
    key = "cpu_bytes_to_use"
    if key not in extra_config:
        raise ConfigError(f"{key} (the CPU cache's size in bytes) must be set {_WHERE}")
    value = extra_config[key]
    number: int | float | None = None
    if _is_int(value):
        number = int(value)  # a numpy int too, as vLLM's int() takes it
    elif isinstance(value, (float, np.floating)):
        if not math.isfinite(value):
            raise ConfigError(f"{key} must be a finite number of bytes {_WHERE}, not {value!r}")
        number = float(value)
    elif isinstance(value, str):  # vLLM's int() takes a string of digits as well
        with contextlib.suppress(ValueError):
            number = int(value)
    if number is None:
        raise ConfigTypeError(f"{key} must be a number of bytes {_WHERE}, not {value!r:.60}")
    if not number >= 1:
        raise ConfigError(f"{key} must be at least 1 byte {_WHERE}, not {value!r}")
    return int(number)


def check_fits(
    nbytes: int, extra_config: Mapping[str, Any], workers: int, *, region: bool = False
) -> None:
    """Refuses, before anything is allocated, a CPU cache of ``nbytes`` that is more than the host
    has available (``MemAvailable``): page-locked memory cannot be swapped out, so it would fail
    (or wake the OOM killer) after minutes of pinning. ``region``: ``nbytes`` is vLLM's shared
    region, the one copy of the tier that every worker of the host maps (:func:`region_check`);
    else a worker's private cache (:func:`check_worker_fits`). The message says it in GiB and
    names the key to lower."""
    available = _core.host_memory_available()
    if available is None or nbytes <= available:
        return
    asked = extra_config.get("cpu_bytes_to_use")
    if region:
        shared = f", one for the {workers} workers" if workers > 1 else ""
        what = f"(vLLM's shared region{shared}) needs {size_text(nbytes)} of host memory"
    else:
        share = f" (cpu_bytes_to_use={asked!r} over {workers} workers)" if workers > 1 else ""
        what = f"needs {size_text(nbytes)} of host memory on this worker{share}"
    raise ConfigError(
        f"the CPU KV cache {what}, but the host has {size_text(available)} available "
        f"(MemAvailable): lower cpu_bytes_to_use {_WHERE} (now {asked!r})"
    )


def init_spec(spec: Any, config: Any, base_init: Any, *, canonical: bool) -> None:
    """Both of blockswap's specs' construction: the config checked (:func:`check_config`;
    ``canonical``: whether the spec takes ``canonical_layout``), then vLLM's spec made
    (``base_init``: its ``__init__``, bound). The CPU tier is checked against the host's memory
    where a worker makes it (:func:`region_check`, :func:`check_worker_fits`), not here: vLLM
    makes the spec in the scheduler's process too, after the workers allocated the tier."""
    check_config(config, canonical=canonical)
    base_init(config)


def region_check(spec: Any) -> Callable[[int], None]:
    """vLLM's shared region's ``creator_memory_check``: :func:`check_fits` for the whole region
    (every worker's cells, or under ``replicated_layout`` the one copy), run by the worker that
    creates the region's file, before anything is faulted in. One region serves every worker of
    the host, and each maps all of it (under the tiering spec's ``replicated_layout`` each faults
    in all of it): a worker's share would admit a tier up to the workers' count times the
    host's memory. A worker that joins a region made by another is not checked again (the
    memory the region took is no longer available, and the tier was checked once)."""
    world = spec.config.parallel.world_size
    return lambda nbytes: check_fits(nbytes, spec.extra_config, world, region=True)


def check_worker_fits(spec: Any) -> None:
    """:func:`check_fits` for a worker's private CPU cache (where vLLM keeps no shared region:
    each worker allocates its own cells), called by the spec's ``create_worker`` before it
    allocates anything."""
    world = spec.config.parallel.world_size
    check_fits(spec.num_chunks * spec.cpu_page_size_per_worker, spec.extra_config, world)


def check_chunks(num_chunks: int) -> None:
    """Refuses a CPU cache of no chunk (``cpu_bytes_to_use`` under one chunk), before a region
    or cache is made for it."""
    if num_chunks < 1:
        raise ConfigError(
            f"the CPU cache holds {num_chunks} chunks: raise cpu_bytes_to_use (in "
            "kv_connector_extra_config) to at least one chunk per worker"
        )


def check_config(config: Any, *, canonical: bool) -> None:
    """What both specs do before vLLM sizes or blockswap allocates anything: blockswap's log
    lines joined to vLLM's log, every ``blockswap_*`` key checked, ``canonical_layout`` refused
    where the spec does not take it (the CPU spec: vLLM 0.33's own ignores it; the tiering spec
    takes it, as vLLM's does)."""
    # blockswap's log lines in vLLM's log, in its format, at INFO.
    _vllm_logging.attach()
    worker_options(config.extra_config)
    if config.canonical_layout and not canonical:
        raise ConfigError(
            "canonical_layout is taken by BlockswapTieringOffloadingSpec (vLLM 0.33 lays the "
            "canonical layout out in its tiering spec; its CPU spec ignores the option): set "
            "spec_name to BlockswapTieringOffloadingSpec, or remove canonical_layout from "
            "kv_connector_extra_config"
        )
