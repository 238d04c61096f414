"""How the KV-cache handlers' transfers move (:mod:`blockswap.handler`): the routes one direction
can take, the constants that choose between them (each with the run that set it), the choice
made once when the handlers are built, and the opt-in calibration that measures the routes on
this machine and keeps the fastest.

A :class:`RouteChoice` per direction: ``"pages"`` (a descriptor per page, those below a size by the
Triton copy kernel: :func:`choose_route`), ``"blocks"`` (a few 2-D copies per block on the copy
engines: :func:`block_route`) or ``"staged"`` (each block's host row as one copy through a
device staging ring: :func:`staged_route`). Nothing here holds a handler: the handler passes its
block tables, its engine's core and the function that loads the copy kernel into the core, and
:func:`calibrate` drives its two direction handlers.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Protocol

import numpy as np

from ._checks import check_int
from ._core import BackendError, BlockswapError, TransferResult
from ._core import Route as CoreRoute
from ._types import Direction
from .errors import ConfigError

if TYPE_CHECKING:
    from ._core import Engine as CoreEngine
    from .layout import BlockTable

__all__ = [
    "KERNEL_BELOW",
    "KERNEL_BLOCK_BYTES",
    "KERNEL_LAUNCH_BYTES",
    "STAGED_CTAS",
    "STAGE_BYTES",
    "STAGE_MAX_AUTO",
    "DirectionHandler",
    "LoadKernel",
    "RouteChoice",
    "RouteUnavailableError",
    "block_route",
    "calibrate",
    "choose_route",
    "choose_routes",
    "core_page_route",
    "staged_route",
]

_SHORT = {"d2h": "GPU -> CPU", "h2d": "CPU -> GPU"}
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
#: per direction. Chosen on an H200 (driver 580, 2026-11-21) from the suite's sweep
#: (`python benches/suite.py`, docs/benchmarks.md), one transfer of N scattered blocks at a
#: time, as fractions of the link's ceiling measured in the same run:
#:
#: - CPU -> GPU, N = 2,560: kernel 74-91 % from 4 to 128 KiB against DMA 8-87 % (the batch
#:   call's host cost, ~0.3-1.9 us per descriptor, holds DMA back); at 256 KiB DMA 93 %, kernel
#:   92 %. With 8 transfers queued back to back DMA catches up earlier (95 % at 64 KiB) because
#:   its submission then overlaps the copies; the threshold follows the isolated case.
#: - GPU -> CPU, N = 2,560: kernel 74-94 % from 4 to 128 KiB against DMA 18-85 %; at 256 KiB
#:   DMA 91 %, kernel 94 % (N = 256: both 93 %), and DMA, which takes no SM, is kept.
#:
#: With few blocks (N = 16) DMA is ahead of the kernel from 4 KiB, but such transfers move
#: little and are latency-bound either way.
KERNEL_BELOW: dict[str, int] = {"h2d": 256 * 1024, "d2h": 256 * 1024}

#: Bytes one kernel program keeps in flight per step on the handler's kernel route: 32 KiB
#: took CPU -> GPU 16 KiB pages from 90 to 92 % of the link with transfers queued back to back
#: (H200, 2026-11-21; 64 KiB was worse at 4 KiB pages, 87 %); the kernel's own default
#: (16 KiB) suits device-side callers.
KERNEL_BLOCK_BYTES = 32 * 1024

#: The most one launch of the handler's copy kernel moves (``kernel_launch_bytes``). A launch
#: holds the SMs of its CTAs until it ends, and a model kernel that wants every SM waits for
#: them: cuBLAS's bf16 8192^3 GEMM on H100/H200 is one persistent CTA per SM using the whole
#: register file, and one CTA of another long kernel slowed it by 14-18 % (H100), a copy launch
#: per 128 MiB transfer on 16 CTAs by 15-18 %. Shorter launches bound that wait but each costs
#: ~5 us of pipeline refill. Measured on an H200, 2026-11-21 (16 KiB x 8,192 onloads beside the
#: GEMM, two runs; then isolated transfers, 4-64 KiB pages): GEMM slowdown / bandwidth lost
#: against one launch (+15-21 %): 16 MiB +11-14 % / 0-2 points; 8 MiB +9-10 % / 0-4 points;
#: 4 MiB +5-12 % / 1-9 points; 1 MiB +1 % / 10-25 points (docs/benchmarks.md, "Kernel
#: launches and the model's SMs").
KERNEL_LAUNCH_BYTES = 8 * 1024 * 1024

#: CTAs of the staged plan's kernel, which moves pages between the staging ring and the GPU
#: pages inside HBM: 32 reached 97-99 % of the link from 32 KiB pages where 132 gained nothing
#: (H100, 2026-11-23, ``benches/probe_staged.py``).
STAGED_CTAS = 32

#: Bytes of a staging slot by default (two per direction, in device memory): 16 MiB steps
#: reached 97-99 % of the link from 32 KiB pages (H100, ``benches/probe_staged.py``). A slot
#: grows to one block's row where that is larger, up to ``STAGE_MAX_AUTO``; past it the staged
#: plan is not taken unless ``stage_bytes`` is given.
STAGE_BYTES = 16 << 20
STAGE_MAX_AUTO = 64 << 20


#: The route of every transfer on the host backend, as the handler (``routes[...].reason``),
#: ``blockswap info`` and ``blockswap bench`` say it.
HOST_ROUTE = "host backend: memcpy (no GPU to run a kernel on)"


class RouteChoice(NamedTuple):
    """A direction's route and why it was chosen: ``route`` the core's
    :class:`blockswap.Route` the handler submits with (``plan`` ``"pages"``, ``"blocks"`` or
    ``"staged"``; its kernel, where it has one), ``reason`` what chose it."""

    route: CoreRoute
    reason: str

    @property
    def plan(self) -> str:
        return self.route.plan

    @property
    def kernel_below(self) -> int:
        return self.route.kernel_below

    @property
    def launcher(self) -> Callable[[int, int, int, int, int, int, int], object] | None:
        return self.route.launcher

    @property
    def kernel(self) -> int | None:
        return self.route.kernel

    @property
    def launch_bytes(self) -> int | None:
        return self.route.launch_bytes


def _dma(reason: str) -> RouteChoice:
    return RouteChoice(CoreRoute.pages(), reason)


def choose_route(
    gpu_tables: Sequence[BlockTable],
    *,
    on_cuda: bool,
    direction: str = "h2d",
    path: str = "auto",
    kernel_ctas: int = 16,
    below: int | None = None,
    launch_bytes: int | None = KERNEL_LAUNCH_BYTES,
) -> RouteChoice:
    """Picks the copy path of one direction once, from the page sizes the handler will move.

    ``"dma"``: copy engines only (no SM is taken from the model). ``"kernel"``: every page by
    the Triton copy kernel on at most ``kernel_ctas`` CTAs. ``"auto"``: pages below
    ``below`` (default :data:`KERNEL_BELOW` of ``direction``) to the kernel and larger ones to
    DMA, in the same transfer where a model mixes both (hybrid groups). On the host backend,
    ``"auto"`` is DMA (memcpy): there is no GPU to run a kernel on. ``launch_bytes``: the most
    one kernel launch moves (:data:`KERNEL_LAUNCH_BYTES`; ``None``: one launch per transfer).

    Where the copy kernel cannot run in this process
    (:func:`~blockswap.kernels.kernel_unavailable`: no GPU driver for Triton and no
    interpreter), ``"kernel"`` raises :class:`RouteUnavailableError` and ``"auto"`` is DMA.
    """
    if direction not in KERNEL_BELOW:
        raise ConfigError(f"direction must be 'h2d' or 'd2h', not {direction!r}")
    check_int("kernel_launch_bytes", launch_bytes, 1, optional=True)
    if path == "dma" or (path == "auto" and not on_cuda):
        return _dma("dma" if path == "dma" else HOST_ROUTE)
    default = KERNEL_BELOW[direction]
    threshold = (1 << 62) if path == "kernel" else (default if below is None else below)
    sizes = sorted({int(n) for t in gpu_tables for n in t.nbytes.tolist()})
    if not any(n < threshold for n in sizes):
        return _dma(f"dma: every page is >= {threshold} bytes")
    from .kernels import engine_launcher, kernel_unavailable

    why = kernel_unavailable()
    if why is not None:
        if path == "kernel":
            raise RouteUnavailableError(path, why)
        return _dma(f"dma: {why}")

    launcher = engine_launcher(
        max_ctas=kernel_ctas,
        block_bytes=KERNEL_BLOCK_BYTES,
        launch_bytes=None if launch_bytes is None else int(launch_bytes),
    )
    route = CoreRoute.pages(threshold, launcher=launcher)
    if all(n < threshold for n in sizes):
        return RouteChoice(route, f"kernel ({kernel_ctas} CTAs): pages {sizes} bytes")
    return RouteChoice(route, f"hybrid: pages < {threshold} bytes by kernel, the rest by DMA")


def block_route(
    core: CoreEngine,
    tables: Sequence[tuple[int, int]],
    direction: Direction,
    *,
    insist: bool = False,
) -> RouteChoice | None:
    """The block route of a cache's KV-cache groups (``tables``: each group's ids in ``core`` of
    its GPU table and its CPU table) in ``direction``, where the core takes it (see
    ``BLOCK_MAX_COPIES`` and ``BLOCK_MIN_PAGE`` in ``rust/table/runs.rs``; ``insist``,
    ``path="blocks"``: wherever the plan saves a copy); else None, with the core's reason
    logged."""
    pairs = [(g, c) if direction == "d2h" else (c, g) for g, c in tables]
    taken, why = core.block_route(pairs, direction, insist)
    if not taken:
        log.info("%s: no block route: %s", _SHORT.get(direction, direction), why)
        return None
    return RouteChoice(CoreRoute.blocks(), why)


def core_page_route(
    route: RouteChoice,
    gpu_tables: Sequence[BlockTable],
    device_index: int | None,
    kernel_ctas: int,
    launch_bytes: int | None,
    load_kernel: LoadKernel,
) -> RouteChoice:
    """``route`` (the kernel route, with a Python launcher) with its kernel launched by the
    core instead: no Python and no GIL on the way, and the transfer issued from the lane's
    own thread. ``route`` unchanged where the core cannot launch it."""
    sizes = [int(n) for t in gpu_tables for n in t.nbytes.tolist()]
    small = [n for n in sizes if n < route.kernel_below]
    kid, why = load_kernel(device_index, max(small or sizes), kernel_ctas)
    if kid is None:
        log.info("the kernel route keeps its Python launcher: %s", why)
        return route
    core = CoreRoute.pages(route.kernel_below, kernel=kid, launch_bytes=launch_bytes)
    return RouteChoice(core, f"{route.reason}, launched by the core")


def staged_route(
    core: CoreEngine,
    cpu_tables: Sequence[int],
    gpu_tables: Sequence[BlockTable],
    device_index: int | None,
    on_cuda: bool,
    load_kernel: LoadKernel,
    *,
    insist: bool,
) -> RouteChoice | None:
    """The staged route where every group's CPU table (``cpu_tables``: their ids in ``core``)
    is block-major with rows that fit a staging slot, and (on CUDA) the core can launch the copy
    kernel; else None, or with ``insist`` (``path="staged"``) a ``ValueError`` naming why."""
    slot = core.stage_bytes
    row, refused = core.staged_route(list(cpu_tables))
    why = refused or None
    kernel = None
    if why is None and on_cuda:
        page = max(int(n) for t in gpu_tables for n in t.nbytes.tolist())
        kernel, why = load_kernel(device_index, page, STAGED_CTAS, staged=True)
        why = why or None
    if why is not None:
        if insist:
            raise ConfigError(f"path='staged' is not possible here: {why}")
        log.info("no staged route: %s", why)
        return None
    how = (
        f"pages moved inside the GPU by the core's kernel on {STAGED_CTAS} CTAs"
        if on_cuda
        else HOST_ROUTE
    )
    return RouteChoice(
        CoreRoute.staged(kernel),
        f"staged: a copy per block row (up to {row} B) through a ring of 2 x {slot} B, {how}",
    )


def choose_routes(
    core: CoreEngine,
    tables: Sequence[tuple[int, int]],
    gpu_tables: Sequence[BlockTable],
    load_kernel: LoadKernel,
    *,
    path: str,
    on_cuda: bool,
    block_major: bool,
    device_index: int | None,
    kernel_ctas: int,
    kernel_below: int | None,
    launch_bytes: int | None,
) -> dict[str, RouteChoice]:
    """The route of each direction of a handler (``{"d2h": ..., "h2d": ...}``), chosen once from
    its caches' geometry: ``tables`` holds the ids in ``core`` of each group's (GPU table, CPU
    table), ``block_major`` whether the CPU cache was allocated here block-major. See :class:`~blockswap.handler.CpuGpuHandlers` for
    ``path`` and the kernel's options."""
    routes = {
        d: choose_route(
            gpu_tables,
            on_cuda=on_cuda,
            direction=d,
            path="auto" if path in ("blocks", "staged") else path,
            kernel_ctas=kernel_ctas,
            below=kernel_below,
            launch_bytes=launch_bytes,
        )
        for d in ("d2h", "h2d")
    }
    if path == "blocks" or (path == "auto" and block_major):
        # The block plan, where the two sides' geometry gives one (see block_route). A CPU
        # cache laid out as a mirror of the GPU (the caller's, or cpu_layout="mirror") keeps
        # the page route by default: pitched copies into it measured 10-25 % slower below
        # 32 KiB pages than into a block-major cache (H100, 2026-11-23).
        for direction in _DIRECTIONS:
            blk = block_route(core, tables, direction, insist=path == "blocks")
            if blk is not None:
                routes[direction] = blk
    if path == "staged" or (
        path == "auto" and block_major and any(r.plan != "blocks" for r in routes.values())
    ):
        staged = staged_route(
            core,
            [ct for _, ct in tables],
            gpu_tables,
            device_index,
            on_cuda,
            load_kernel,
            insist=path == "staged",
        )
        if staged is not None:
            for d, r in routes.items():
                if r.plan != "blocks":
                    routes[d] = staged
    if on_cuda:
        for d, r in routes.items():
            if r.plan == "pages" and r.launcher is not None:
                routes[d] = core_page_route(
                    r, gpu_tables, device_index, kernel_ctas, launch_bytes, load_kernel
                )
    for d, r in routes.items():
        log.info("%s route (path=%r): %s", _SHORT[d], path, r.reason)
    if path == "blocks" and any(r.plan != "blocks" for r in routes.values()):
        raise ConfigError(
            "path='blocks' needs KV-cache groups whose pages lie at one pitch on both sides, "
            f"in memory no other group shares; here: {routes['d2h'].reason}"
        )
    return routes


# --------------------------------------------------------------------------------------------
# Calibration
# --------------------------------------------------------------------------------------------


class DirectionHandler(Protocol):
    """What :func:`calibrate` uses of a handler of one direction
    (:class:`~blockswap.handler.SingleDirectionHandler`)."""

    direction: Direction
    route: RouteChoice

    def _use(self, route: RouteChoice) -> None: ...

    def transfer_async(self, job_id: int, spec: Any, *, block_indices: Any = None) -> bool: ...

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> None: ...


def _seconds_per_transfer(
    h: DirectionHandler,
    route: RouteChoice,
    spec: tuple[Any, Any],
    job: int,
    reps: int,
    get_finished: Callable[[], list[TransferResult]],
) -> float:
    """The median seconds of ``reps`` transfers of ``spec`` by ``h`` on ``route``, one at a time,
    the first left out (it warms up); ``h`` keeps ``route``."""
    h._use(route)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        h.transfer_async(job, spec)
        h.wait([job])
        times.append(time.perf_counter() - t0)
        results = get_finished()
        if not all(r.success for r in results):
            raise BlockswapError(f"calibration transfer failed: {results}")
    return statistics.median(times[1:])


def calibrate(
    handlers: Sequence[DirectionHandler],
    routes: dict[str, RouteChoice],
    gpu_table: BlockTable,
    blocks: Mapping[str, RouteChoice | None],
    *,
    num_cpu_blocks: int,
    block_size_factor: int,
    kernel: int | None,
    kernel_ctas: int,
    staged: RouteChoice | None,
    get_finished: Callable[[], list[TransferResult]],
    reps: int = 5,
) -> dict[str, dict[str, Any]]:
    """Measures the routes a cache of one KV-cache group (``gpu_table``) can take, per direction,
    and keeps the fastest: each of ``handlers`` (GPU -> CPU, then CPU -> GPU) takes the route
    that won, which ``routes`` records. Returns per direction the blocks moved, the route chosen
    and each candidate's GB/s.

    The candidates: per-page DMA, the copy kernel for every page (the core's ``kernel`` where
    it loaded one, else launched from Python on ``kernel_ctas`` CTAs, where it can run here:
    see :func:`~blockswap.kernels.kernel_unavailable`), and where the geometry gives them, the block plan (``blocks``, per direction) and the staged plan
    (``staged``). Only routes that can run here are measured. Runs a
    GPU -> CPU transfer of up to 256 scattered blocks, then CPU -> GPU of the same blocks back
    into place, so the KV cache's bytes are unchanged.
    """
    from .kernels import engine_launcher, kernel_unavailable

    f = block_size_factor
    num_gpu = gpu_table.num_blocks
    # Whole CPU blocks (the load then reads back exactly the sub-blocks the store wrote), and
    # scattered GPU blocks: consecutive ones would coalesce and flatter DMA.
    n = max(f, min(num_gpu, num_cpu_blocks * f, 256) // f * f)
    n = min(n, num_gpu)
    gpu_ids = np.random.default_rng(0).permutation(num_gpu)[:n].astype(np.int64)
    cpu_ids = np.arange(-(-n // f), dtype=np.int64)
    nbytes = n * int(gpu_table.nbytes.sum())
    every = 1 << 62
    kernel_route = None
    why = None if kernel is not None else kernel_unavailable()
    if kernel is not None:
        kernel_route = RouteChoice(CoreRoute.pages(every, kernel=kernel), "kernel: every page")
    elif why is None:
        launcher = next(
            (r.launcher for r in routes.values() if r.launcher is not None), None
        ) or engine_launcher(max_ctas=kernel_ctas, block_bytes=KERNEL_BLOCK_BYTES)
        kernel_route = RouteChoice(CoreRoute.pages(every, launcher=launcher), "kernel: every page")
    else:
        log.info("calibration leaves the copy kernel out: %s", why)
    report: dict[str, dict[str, Any]] = {}
    job = (1 << 64) - 1
    d2h, h2d = handlers
    for h, spec in ((d2h, (gpu_ids, cpu_ids)), (h2d, (cpu_ids, gpu_ids))):
        candidates = {"dma": _dma("dma: every page")}
        if kernel_route is not None:
            candidates["kernel"] = kernel_route
        block = blocks.get(h.direction)
        if block is not None:
            candidates["blocks"] = block
        if staged is not None:
            candidates["staged"] = staged
        speeds = {
            name: nbytes / _seconds_per_transfer(h, route, spec, job, reps, get_finished) / 1e9
            for name, route in candidates.items()
        }
        chosen = max(speeds, key=speeds.__getitem__)
        won = candidates[chosen]
        h._use(won._replace(reason=f"calibrated: {chosen} ({won.reason})"))
        routes[h.direction] = h.route
        report[h.direction] = {
            "blocks": n,
            "chosen": chosen,
            **{f"{k}_gbps": v for k, v in speeds.items()},
        }
        log.info(
            "calibration %s, %d blocks: %s: %s",
            _SHORT[h.direction],
            n,
            ", ".join(f"{k} {v:.2f} GB/s" for k, v in speeds.items()),
            chosen,
        )
    return report
