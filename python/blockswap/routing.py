"""How the KV-cache handlers' transfers move (:mod:`blockswap.handler`): the routes one direction
can take, built from the core's ranking of them, and the opt-in calibration that measures the
routes on this machine and keeps the fastest.

A :class:`blockswap.Route` per direction, with its ``reason``: ``"pages"`` (a descriptor per
page, those below a size by the Triton copy kernel), ``"blocks"`` (a few 2-D copies per block on
the copy engines) or ``"staged"`` (each block's host row as one copy through a device staging
ring) or ``"direct"`` (the staged plan's kernel on host pages in place: vLLM's canonical
fragments). Which one is the core's rule and choice (:func:`blockswap._core.choose_route`,
``rust/plan/choice.rs``): it ranks the routes a direction can take and takes the first it can
build here, loading a copy kernel into the core where one needs it (Triton compiles it, in
:mod:`blockswap.kernels`). Nothing here holds a handler: the handler passes its block tables,
its engine's core and the function that loads the copy kernel into the core, and
:func:`calibrate` drives its two direction handlers."""

from __future__ import annotations

import functools
import logging
import statistics
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable, Protocol

import numpy as np

from . import _core
from ._checks import check_int
from ._core import BackendError, BlockswapError, Route, TransferResult
from ._types import SHORT, Direction
from .errors import ConfigError

if TYPE_CHECKING:
    from ._core import Engine as CoreEngine
    from ._direction import SingleDirectionHandler
    from .layout import BlockTable

__all__ = [
    "HOST_ROUTE",
    "KERNEL_BELOW",
    "KERNEL_BLOCK_BYTES",
    "KERNEL_LAUNCH_BYTES",
    "STAGED_CTAS",
    "STAGE_BYTES",
    "STAGE_MAX_AUTO",
    "LoadKernel",
    "RouteUnavailableError",
    "calibrate",
    "choose_routes",
]

_DIRECTIONS: tuple[Direction, Direction] = ("d2h", "h2d")

#: The handler's logger: route choices and calibration results are part of what a handler logs
#: (``logging.getLogger("blockswap.handler")`` keeps covering them).
log = logging.getLogger("blockswap.handler")


class RouteUnavailableError(BackendError, ValueError):
    """A copy path asked for (``path=``) that cannot run in this process, refused when the
    handlers are built: ``path`` names it, ``reason`` says why (the Triton copy kernel without a
    GPU, outside Triton's interpreter)."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"path={path!r} cannot run here: {reason}")
        self.path = path
        self.reason = reason


class LoadKernel(Protocol):
    """The handler's copy kernel for pages of at most ``max_size`` bytes on ``ctas`` CTAs (the page
    kernel, or with ``staged`` the staged plan's), compiled, loaded into the core and kept alive
    with the handler: ``(kernel id, "")``, or ``(None, why not)`` where the core cannot launch
    it."""

    def __call__(
        self, device_index: int | None, max_size: int, ctas: int, *, staged: bool = False
    ) -> tuple[int | None, str]: ...


# --------------------------------------------------------------------------------------------
# The routes, and the choice of one per direction
# --------------------------------------------------------------------------------------------


#: Pages below this many bytes go to the copy kernel, the rest to DMA, when ``path="auto"``,
#: per direction: the core's rule (``KERNEL_BELOW_H2D`` / ``KERNEL_BELOW_D2H`` in
#: ``rust/plan/choice.rs``, with the runs that set them).
KERNEL_BELOW: dict[str, int] = {"h2d": _core.KERNEL_BELOW_H2D, "d2h": _core.KERNEL_BELOW_D2H}

#: Bytes one kernel program keeps in flight per step on the handler's kernel route: 32 KiB
#: took CPU -> GPU 16 KiB pages from 90 to 92 % of the link with transfers queued back to back
#: (H200, 2026-11-21; 64 KiB was worse at 4 KiB pages, 87 %); the kernel's own default
#: (16 KiB) suits device-side callers.
KERNEL_BLOCK_BYTES = 32 * 1024

#: The most one launch of the handler's copy kernel moves (``kernel_launch_bytes``): a launch
#: holds the SMs of its CTAs until it ends, and a model kernel that wants every SM waits for them;
#: shorter launches bound that wait, each at a pipeline refill's cost. The measurements that set
#: it: docs/tuning.md, "kernel_launch_bytes".
KERNEL_LAUNCH_BYTES = 8 * 1024 * 1024

#: CTAs of the staged plan's kernel; the staging slot's default bytes, and the most a slot grows
#: to for one block's row (:func:`blockswap._core.stage_slot`): the core's constants, with the
#: runs that set them, in ``rust/plan/choice.rs``.
STAGED_CTAS: int = _core.STAGED_CTAS
STAGE_BYTES: int = _core.STAGE_BYTES
STAGE_MAX_AUTO: int = _core.STAGE_MAX_AUTO

#: The route of every transfer on the host backend, as the handler (``routes[...].reason``),
#: ``blockswap info`` and ``blockswap bench`` say it.
HOST_ROUTE: str = _core.HOST_ROUTE


def _kernel_unavailable() -> str | None:
    from .kernels import kernel_unavailable

    return kernel_unavailable()


def _kernel_options(
    kernel_ctas: int, kernel_below: int | None, launch_bytes: int | None
) -> tuple[int, int | None, int | None]:
    """The kernel's options as ints, or the typed error naming the one out of its domain."""
    return (
        check_int("kernel_ctas", kernel_ctas, 1, (1 << 32) - 1),
        check_int("kernel_below", kernel_below, 0, (1 << 64) - 1, optional=True),
        check_int("kernel_launch_bytes", launch_bytes, 1, (1 << 64) - 1, optional=True),
    )


def _launcher(kernel_ctas: int, launch_bytes: int | None) -> Callable[[], object]:
    """The page kernel's Python launcher, made where a page route has no core to launch it."""

    def make() -> object:
        from .kernels import engine_launcher

        return engine_launcher(
            max_ctas=kernel_ctas, block_bytes=KERNEL_BLOCK_BYTES, launch_bytes=launch_bytes
        )

    return make


def choose_routes(
    core: CoreEngine | None,
    tables: Sequence[tuple[int, int]],
    gpu_tables: Sequence[BlockTable],
    load_kernel: LoadKernel | None,
    *,
    path: str,
    on_cuda: bool,
    device_index: int | None,
    kernel_ctas: int,
    kernel_below: int | None,
    launch_bytes: int | None,
    directions: Sequence[str] = _DIRECTIONS,
) -> dict[str, Route]:
    """The route of each of ``directions`` of a handler (``{"d2h": ..., "h2d": ...}``), chosen
    once from its caches' geometry by the core's rule
    (:func:`blockswap._core.choose_route`): ``tables`` holds the ids in ``core`` of each
    group's (GPU table, CPU table); the core reads from them whether the CPU cache is block-major.
    A kernel a route needs is loaded into the core once, by ``load_kernel`` (None, with no
    ``core``: a page route's kernel is launched from Python). See
    :class:`~blockswap.handler.CpuGpuHandlers` for ``path`` and the kernel's options."""
    kernel_ctas, kernel_below, launch_bytes = _kernel_options(
        kernel_ctas, kernel_below, launch_bytes
    )
    load = None
    if load_kernel is not None:
        load = functools.cache(lambda m, c, s: load_kernel(device_index, m, c, staged=s))
    sizes = sorted({int(n) for t in gpu_tables for n in t.nbytes.tolist()})
    routes: dict[str, Route] = {}
    for d in directions:
        short = SHORT.get(d, d)
        routes[d] = _core.choose_route(
            d,
            path,
            on_cuda=on_cuda,
            page_sizes=sizes,
            errors=(RouteUnavailableError, ConfigError),
            kernel_below=kernel_below,
            kernel_ctas=kernel_ctas,
            launch_bytes=launch_bytes,
            kernel_unavailable=_kernel_unavailable,
            engine=core,
            tables=list(tables),
            load_kernel=load,
            launcher=_launcher(kernel_ctas, launch_bytes),
            note=functools.partial(log.info, "%s: %s", short),
        )
        log.info("%s route (path=%r): %s", short, path, routes[d].reason)
    return routes


# --------------------------------------------------------------------------------------------
# Calibration
# --------------------------------------------------------------------------------------------


def _seconds_per_transfer(
    h: SingleDirectionHandler,
    route: Route,
    spec: tuple[Any, Any],
    job: int,
    reps: int,
    get_finished: Callable[[], list[TransferResult]],
) -> float:
    """The median seconds of ``reps`` transfers of ``spec`` by ``h`` on ``route``, one at a time,
    the first left out (it warms up); ``h`` keeps ``route``. The GPU blocks start a CPU block
    (``block_indices=[0]``) both ways, so a load reads back the very sub-blocks the store wrote,
    whole CPU blocks or not."""
    h._use(route)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        h.transfer_async(job, spec, block_indices=[0])
        h.wait([job])
        times.append(time.perf_counter() - t0)
        results = get_finished()
        if not all(r.success for r in results):
            raise BlockswapError(f"calibration transfer failed: {results}")
    return statistics.median(times[1:])


#: The routes calibration measures, each as ``path=`` insists on it.
CALIBRATED_PATHS: tuple[str, ...] = ("dma", "kernel", "blocks", "staged")


def calibrate(
    handlers: Sequence[SingleDirectionHandler],
    routes: dict[str, Route],
    insist: Callable[[str, str], Route | None],
    gpu_table: BlockTable,
    *,
    num_cpu_blocks: int,
    block_size_factor: int,
    get_finished: Callable[[], list[TransferResult]],
    reps: int = 5,
) -> dict[str, dict[str, Any]]:
    """Measures the routes a cache of one KV-cache group (``gpu_table``) can take, per direction,
    and keeps the fastest: each of ``handlers`` (GPU -> CPU, then CPU -> GPU) takes the route
    that won, which ``routes`` records. Returns per direction the blocks moved, the route chosen
    and each candidate's GB/s.

    The candidates are :data:`CALIBRATED_PATHS`, each as ``insist(path, direction)`` builds it
    (the core's choice for that ``path=``), or None where the cache cannot take it here (the
    copy kernel where it cannot run, the block plan where the geometry gives none). Runs a
    GPU -> CPU transfer of up to 256 scattered blocks, then CPU -> GPU of the same blocks back
    into place, so the KV cache's bytes are unchanged.
    """
    f = block_size_factor
    num_gpu = gpu_table.num_blocks
    # Whole CPU blocks where the cache has them (fewer GPU blocks than a CPU block holds: a
    # part of one), and scattered GPU blocks: consecutive ones would coalesce and flatter DMA.
    n = max(f, min(num_gpu, num_cpu_blocks * f, 256) // f * f)
    n = min(n, num_gpu)
    gpu_ids = np.random.default_rng(0).permutation(num_gpu)[:n].astype(np.int64)
    cpu_ids = np.arange(-(-n // f), dtype=np.int64)
    nbytes = n * int(gpu_table.nbytes.sum())
    report: dict[str, dict[str, Any]] = {}
    job = (1 << 64) - 1
    d2h, h2d = handlers
    for h, spec in ((d2h, (gpu_ids, cpu_ids)), (h2d, (cpu_ids, gpu_ids))):
        built = {path: insist(path, h.direction) for path in CALIBRATED_PATHS}
        candidates = {path: r for path, r in built.items() if r is not None}
        speeds = {
            name: nbytes / _seconds_per_transfer(h, route, spec, job, reps, get_finished) / 1e9
            for name, route in candidates.items()
        }
        chosen = max(speeds, key=speeds.__getitem__)
        won = candidates[chosen]
        h._use(won.with_reason(f"calibrated: {chosen} ({won.reason})"))
        routes[h.direction] = h.route
        report[h.direction] = {
            "blocks": n,
            "chosen": chosen,
            **{f"{k}_gbps": v for k, v in speeds.items()},
        }
        log.info(
            "calibration %s, %d blocks: %s: %s",
            SHORT[h.direction],
            n,
            ", ".join(f"{k} {v:.2f} GB/s" for k, v in speeds.items()),
            chosen,
        )
    return report
