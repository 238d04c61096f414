"""``blockswap bench``: a short transfer benchmark that checks an installation, and the pieces it
shares with the repository's benchmark suite (``benches/suite.py``, which imports them from here).

Per direction, the link's ceiling (one large copy), then scattered blocks of a few sizes moved
three ways: one copy of the same bytes (what they cost without the blocks), the engine's DMA
batch, and the offloading handler's own choice (``auto``, where torch is installed). On a GPU it
runs the CUDA backend, timed by CUDA events; elsewhere the host backend (memcpy), timed by the wall
clock. It prints one table and writes nothing.

Nothing here imports torch at module import: the engine and this benchmark need numpy only.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import statistics
import sys
import textwrap
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeVar

import numpy as np

from . import __version__
from .engine import Engine, info
from .routing import HOST_ROUTE

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

T = TypeVar("T")
Timer = Callable[..., tuple[float, float]]
"""``timer(issue, finish=None)``: ``(seconds of the work, host seconds of issue())``."""

#: One name per direction, in tables and plots alike.
DIRECTION = {"h2d": "CPU->GPU", "d2h": "GPU->CPU"}


# ---- formatting -------------------------------------------------------------------------------


def fmt_bytes(n: int) -> str:
    """``4 KiB``, ``2 MiB``, ``2.5 GiB``: binary units, no decimals where the value is whole."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            v = n / size
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.3g} {unit}"
    return f"{n} B"


def fmt_gbps(x: float | None) -> str:
    """GB/s and friends: three significant digits, at most two decimals."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if x >= 100:
        return f"{x:.0f}"
    if x >= 10:
        return f"{x:.1f}"
    if x >= 0.1:
        return f"{x:.2f}"
    return f"{x:.2g}"


def fmt_pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f} %"


def table(head: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[bool]) -> list[str]:
    """One markdown table, its columns as wide as their widest cell."""
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(head)]

    def line(cells: Sequence[str]) -> str:
        out = [c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right)]
        return "| " + " | ".join(out) + " |"

    sep = "|".join(
        ("-" * (w + 1) + ":") if r else (":" + "-" * (w + 1)) for w, r in zip(widths, right)
    )
    return [line(head), f"|{sep}|", *(line(r) for r in rows)]


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


# ---- repetition, buffers, timing --------------------------------------------------------------


def repeat(
    measure: Callable[[], T],
    *,
    warmup: int = 1,
    min_reps: int = 3,
    max_reps: int = 20,
    budget_s: float = 0.25,
    hurry: bool = False,
) -> list[T]:
    """Samples of ``measure()``: ``warmup`` discarded calls, then as many as fit in ``budget_s``
    (judged from the first measured call's wall time), at least ``min_reps`` and at most
    ``max_reps``. ``hurry``: only ``min_reps`` (a section past its time budget)."""
    for _ in range(warmup):
        measure()
    t0 = time.perf_counter()
    first = measure()
    cost = time.perf_counter() - t0
    reps = min_reps if hurry else max(min_reps, min(max_reps, int(budget_s / max(cost, 1e-9))))
    return [first] + [measure() for _ in range(max(0, reps - 1))]


def address(buf: Any) -> int:
    """Address of a torch tensor's or a numpy array's first byte."""
    return int(buf.data_ptr()) if hasattr(buf, "data_ptr") else int(buf.ctypes.data)


def scatter(rng: np.random.Generator, n: int, slots: int) -> tuple[np.ndarray, np.ndarray]:
    """Source and destination block ids: ``n`` distinct slots out of ``slots`` on each side, in
    random order (consecutive descriptors are not contiguous, so nothing coalesces)."""
    if n > slots:
        raise ValueError(f"{n} blocks do not fit in {slots} slots")
    return (
        rng.permutation(slots)[:n].astype(np.int64),
        rng.permutation(slots)[:n].astype(np.int64),
    )


def cuda_ready() -> bool:
    """Whether blockswap's CUDA backend and torch's CUDA can both be used here."""
    if not info()["cuda"]:
        return False
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def resolve_backend(backend: str) -> Literal["cuda", "host"]:
    if backend == "auto":
        return "cuda" if cuda_ready() else "host"
    if backend == "cuda" and not cuda_ready():
        raise ValueError("--backend cuda: no usable GPU here (`blockswap info` says why)")
    if backend not in ("cuda", "host"):
        raise ValueError(f"backend must be auto, cuda or host, not {backend!r}")
    return "cuda" if backend == "cuda" else "host"


def buffers(nbytes: int, cuda: bool) -> tuple[Any, Any]:
    """``(host, device)`` buffers of ``nbytes`` each: pinned host memory and device memory as
    uint8 tensors on CUDA; two numpy arrays otherwise (the second stands in for device memory)."""
    if not cuda:
        return np.full(nbytes, 1, dtype=np.uint8), np.full(nbytes, 2, dtype=np.uint8)
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host.fill_(1)
    dev.fill_(2)
    torch.cuda.synchronize()
    return host, dev


def engine_over(
    host: Any, dev: Any, cuda: bool, h2d_stream: int | None = None, d2h_stream: int | None = None
) -> Engine:
    """An engine with :func:`buffers` registered: on CUDA with the given raw lane streams
    (``None``: its own), on the host backend with ``dev`` standing in for device memory."""
    if cuda:
        eng = Engine("cuda", h2d_stream=h2d_stream, d2h_stream=d2h_stream)
        eng.register(host)
        eng.register(dev)
    else:
        eng = Engine("host")
        eng.register(host, kind="host")
        eng.register(dev, kind="device")
    return eng


def gpu_timed(
    stream: Any, issue: Callable[[], None], finish: Callable[[], None] | None = None
) -> tuple[float, float]:
    """``(GPU seconds, host seconds)`` of one piece of work issued on ``stream``: CUDA events
    recorded on ``stream`` before and after ``issue()`` (the events time what the stream ran,
    including any wait for the host to submit), ``perf_counter`` around ``issue()`` alone (the
    host's submission). ``finish()`` then waits for the work by its own means (an engine's
    ``wait``), before the end event is synchronised."""
    import torch

    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record(stream)
    t0 = time.perf_counter()
    issue()
    t1 = time.perf_counter()
    end.record(stream)
    if finish is not None:
        finish()
    end.synchronize()
    return start.elapsed_time(end) / 1e3, t1 - t0


def wall_timed(issue: Callable[[], None], finish: Callable[[], None]) -> tuple[float, float]:
    """``(wall seconds of issue + finish, host seconds of issue)``: the host backend's timing."""
    t0 = time.perf_counter()
    issue()
    t1 = time.perf_counter()
    finish()
    return time.perf_counter() - t0, t1 - t0


def timer(stream: Any) -> Timer:
    """:func:`gpu_timed` on the CUDA ``stream``; :func:`wall_timed` where it is ``None``."""
    if stream is not None:
        return lambda issue, finish=None: gpu_timed(stream, issue, finish)
    return lambda issue, finish=None: wall_timed(issue, finish or (lambda: None))


def one_copy(src: Any, dst: Any, nbytes: int, stream: Any) -> Callable[[], None]:
    """Issues one copy of the first ``nbytes``: a ``copy_`` on the CUDA ``stream`` (tensors), one
    ``memcpy`` (numpy ``copyto``) where it is ``None``."""
    if stream is None:
        return lambda: np.copyto(dst[:nbytes], src[:nbytes])
    import torch

    def issue() -> None:
        with torch.cuda.stream(stream):
            dst[:nbytes].copy_(src[:nbytes], non_blocking=True)

    return issue


def measure_ceiling(
    src: Any,
    dst: Any,
    nbytes: int,
    stream: Any,
    min_reps: int = 5,
    *,
    max_reps: int = 20,
    copies: int = 1,
) -> dict[str, Any]:
    """The link's ceiling: one large copy of ``nbytes`` (:func:`one_copy`; ``copies`` of them
    queued back to back per sample), timed by CUDA events on ``stream`` or by the wall clock where
    it is ``None``; two samples discarded, then ``min_reps`` to ``max_reps`` of them (as many as
    fit in 0.3 s), and the best: what the link moves when nothing is in its way.

    Every ceiling the benchmarks print is measured here (``benches/`` builds on it for its own
    buffers, directions and runs)."""
    timed, copy = timer(stream), one_copy(src, dst, nbytes, stream)

    def issue() -> None:
        for _ in range(copies):
            copy()

    times = repeat(
        lambda: timed(issue)[0], warmup=2, min_reps=min_reps, max_reps=max_reps, budget_s=0.3
    )
    what = (
        f"one pinned copy_ of {fmt_bytes(nbytes)} (CUDA events)"
        if stream is not None
        else f"one memcpy (numpy copyto) of {fmt_bytes(nbytes)}, one thread"
    )
    if copies > 1:
        what += f", {copies} queued back to back"
    gbps = copies * nbytes / min(times) / 1e9
    return {"bytes": nbytes, "gbps": gbps, "reps": len(times), "what": what}


def check_result(results: list[Any], job: int) -> None:
    """Raises unless ``results`` holds ``job``'s result, successful."""
    for r in results:
        if r.job_id == job:
            if not r.success:
                raise RuntimeError(f"transfer {job} failed: {r.error}")
            return
    raise RuntimeError(f"transfer {job}: no result among {results}")


def engine_measure(
    eng: Engine, job: Callable[[], int], timed: Timer, *args: Any, **kw: Any
) -> Callable[[], tuple[float, float]]:
    """One timed ``eng.submit(job(), *args, **kw)`` to its checked result, per call."""

    def measure() -> tuple[float, float]:
        j = job()

        def finish() -> None:
            eng.wait([j])
            check_result(eng.get_finished(), j)

        return timed(lambda: eng.submit(j, *args, **kw), finish)

    return measure


# ---- the handler's choice ---------------------------------------------------------------------


def handler_route(h: Any, direction: str) -> Any:
    """The route (``kernel_below``, ``launcher``, ``reason``) a
    :class:`~blockswap.handler.CpuGpuHandlers` took for ``direction``."""
    return (h.gpu_to_cpu_handler if direction == "d2h" else h.cpu_to_gpu_handler).route


def route_choice(route: Any, page_bytes: int) -> str:
    """What ``route`` does with pages of ``page_bytes``: ``"memcpy"`` on the host backend, the
    plan (``"blocks"``, ``"staged"``, ``"direct"``) where it is not per page, else ``"kernel"`` or ``"dma"``."""
    if route is None:
        return "unknown"
    if str(route.reason).endswith(HOST_ROUTE):
        return "memcpy"
    if getattr(route, "plan", "pages") != "pages":
        return str(route.plan)
    if not route.kernel_below:
        return "dma"
    return "kernel" if page_bytes < route.kernel_below else "dma"


class AutoHandler:
    """A ``CpuGpuHandlers(path="auto")`` over :func:`buffers` seen as a one-layer MLA-style cache
    of ``size``-byte pages: the path the handler chooses, as ``auto`` measures it. ``error``
    says why there is none (no torch, a handler that could not be built)."""

    def __init__(self, host: Any, dev: Any, size: int, stream: Any) -> None:
        self.h: Any = None
        self.chosen: dict[str, str] = {}
        self.route: dict[str, str] = {}
        self.error: str | None = None
        try:
            import torch

            from .handler import CpuGpuHandlers
        except ImportError as e:
            self.error = f"needs torch ({e})"
            return
        slots = len(host) // size
        if stream is not None:
            gpu = dev[: slots * size].view(slots, 1, size)
            cpu = host[: slots * size].view(slots, 1, size)
            opts: dict[str, Any] = {"backend": "cuda", "copy_streams": stream}
        else:
            gpu = torch.from_numpy(dev[: slots * size]).view(slots, 1, size)
            cpu = torch.from_numpy(host[: slots * size]).view(slots, 1, size)
            opts = {"backend": "host"}
        try:
            self.h = CpuGpuHandlers(gpu, slots, layout="mla", cpu_caches=cpu, path="auto", **opts)
        except Exception as e:
            self.error = f"the handler could not be built: {type(e).__name__}: {e}"
            return
        for d in ("h2d", "d2h"):
            route = handler_route(self.h, d)
            self.chosen[d] = route_choice(route, size)
            self.route[d] = "the handler does not say" if route is None else str(route.reason)

    def measure(
        self, job: Callable[[], int], timed: Timer, direction: str, ids: tuple[Any, Any]
    ) -> Callable[[], tuple[float, float]]:
        """One timed ``transfer_async`` of ``ids`` (source, destination block ids), per call."""
        h = self.h
        one = h.gpu_to_cpu_handler if direction == "d2h" else h.cpu_to_gpu_handler

        def measure() -> tuple[float, float]:
            j = job()

            def finish() -> None:
                h.wait([j])
                check_result(h.get_finished(), j)

            return timed(lambda: one.transfer_async(j, ids), finish)

        return measure

    def shutdown(self) -> None:
        if self.h is not None:
            self.h.shutdown()
            self.h = None


# ---- `blockswap bench` ------------------------------------------------------------------------

#: Block sizes, blocks per transfer, and :func:`repeat`'s bounds for each path at each size (the
#: ceiling takes at least ``min(5, max_reps)`` copies).
PROFILES: dict[str, dict[str, Any]] = {
    "quick": {
        "sizes": (4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, 1 * MiB),
        "blocks": 256,
        "reps": {"min_reps": 3, "max_reps": 8, "budget_s": 0.1},
    },
    "tiny": {
        "sizes": (4 * KiB, 64 * KiB),
        "blocks": 16,
        "reps": {"min_reps": 1, "max_reps": 2, "budget_s": 0.0},
    },
}
PATHS = {"one_copy": "one copy", "dma": "DMA batch", "auto": "auto"}


def run(profile: str = "quick", backend: str = "auto") -> dict[str, Any]:
    """Measures the ceiling and every path at every size of ``profile``, both directions."""
    cuda = resolve_backend(backend) == "cuda"
    p = PROFILES[profile]
    sizes, n, reps = p["sizes"], p["blocks"], p["reps"]
    stream = None
    if cuda:
        import torch

        stream = torch.cuda.Stream()
    host, dev = buffers(max(sizes) * n, cuda)
    raw = stream.cuda_stream if stream is not None else None
    eng = engine_over(host, dev, cuda, raw, raw)
    res: dict[str, Any] = {"backend": "cuda" if cuda else "host", "blocks": n, "engine": eng.info()}
    res["ceiling"] = {
        d: measure_ceiling(*_src_dst(host, dev, d), len(host), stream, min(5, reps["max_reps"]))
        for d in DIRECTION
    }
    rng, job, timed = np.random.default_rng(0), itertools.count(1).__next__, timer(stream)

    def point(handler: AutoHandler, d: str, size: int) -> dict[str, Any]:
        src_t, dst_t = _src_dst(host, dev, d)
        ids = scatter(rng, n, min(len(host) // size, 4 * n))
        src, dst = (address(t) + i * size for t, i in zip((src_t, dst_t), ids))
        measures: dict[str, Any] = {
            "one_copy": functools.partial(timed, one_copy(src_t, dst_t, n * size, stream)),
            "dma": engine_measure(eng, job, timed, src, dst, np.full(n, size, dtype=np.int64), d),
            "auto": handler.error or handler.measure(job, timed, d, ids),
        }
        row: dict[str, Any] = {"direction": d, "block_bytes": size, "notes": {}}
        for path, m in measures.items():
            if isinstance(m, str):
                row["notes"][path] = m
                continue
            try:
                samples = repeat(m, **reps)
            except Exception as e:
                row["notes"][path] = f"failed: {type(e).__name__}: {e}"
                continue
            row[path] = n * size / median([s[0] for s in samples]) / 1e9
        row["auto_chose"] = handler.chosen.get(d)
        return row

    rows: list[dict[str, Any]] = []
    try:
        for size in sizes:
            handler = AutoHandler(host, dev, size, stream)
            try:
                rows += [point(handler, d, size) for d in DIRECTION]
            finally:
                handler.shutdown()
    finally:
        eng.shutdown()
    res["rows"] = rows
    return res


def _src_dst(host: Any, dev: Any, direction: str) -> tuple[Any, Any]:
    return (host, dev) if direction == "h2d" else (dev, host)


def format_results(res: dict[str, Any]) -> str:
    e, n, cuda = res["engine"], res["blocks"], res["backend"] == "cuda"
    ceiling = {d: c["gbps"] for d, c in res["ceiling"].items()}
    c = ", ".join(f"{DIRECTION[d]} {fmt_gbps(v)} GB/s" for d, v in ceiling.items())
    lines = [
        f"blockswap {__version__}: {res['backend']} backend, {e.get('device') or 'no GPU'}, "
        f"copy path {e.get('copy_path')}",
        f"ceiling, {next(iter(res['ceiling'].values()))['what']}: {c}",
        "",
        *textwrap.wrap(
            f"GB/s (percent of the ceiling) moving {n} scattered blocks, medians. 'one copy' moves "
            "the same bytes at once; 'auto' is the offloading handler's own choice."
            + (
                ""
                if cuda
                else " Host backend: 'GPU' memory is a second host buffer, every path is memcpy, "
                "and transfers that fit in the CPU's caches beat the ceiling."
            ),
            100,
        ),
        "",
    ]
    body: list[list[str]] = []
    notes: dict[str, int] = {}
    for r in sorted(res["rows"], key=lambda r: r["direction"] != "h2d"):
        d = r["direction"]
        cells = [f"{DIRECTION[d]} ({d})", fmt_bytes(r["block_bytes"])]
        cells.append(fmt_bytes(r["block_bytes"] * n))
        for p in PATHS:
            if p in r:
                cells.append(f"{fmt_gbps(r[p])} ({fmt_pct(r[p] / ceiling[d])})")
            else:
                cells.append(f"[{notes.setdefault(r['notes'][p], len(notes) + 1)}]")
        body.append([*cells, r.get("auto_chose") or "-"])
    head = ["direction", "block", "transfer", *PATHS.values(), "auto chose"]
    lines += table(head, body, [False, True, True, True, True, True, False])
    lines += [f"[{i}] {why}" for why, i in notes.items()]
    lines += ["", "The full suite is benches/suite.py in blockswap's source repository."]
    return "\n".join(lines)


DESCRIPTION = (
    "A short transfer benchmark: per direction the link's ceiling, then scattered blocks of a "
    "few sizes as one copy, the engine's DMA batch and the handler's choice. Prints a table, "
    "writes nothing. The full suite is benches/suite.py in the source repository."
)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    g = ap.add_mutually_exclusive_group()
    for name, what in (
        ("quick", "five block sizes, 4 KiB to 1 MiB (seconds) [default]"),
        ("tiny", "two block sizes, a few blocks: a smoke test"),
    ):
        g.add_argument(f"--{name}", dest="profile", action="store_const", const=name, help=what)
    ap.set_defaults(profile="quick")
    ap.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "cuda", "host"],
        help="auto (the default): the GPU where there is one, the host backend otherwise",
    )


def main(args: argparse.Namespace, prog: str = "blockswap bench") -> int:
    """Runs ``blockswap bench`` for parsed ``args`` (:func:`add_arguments`) and prints its table;
    a bad argument is one line on stderr and exit status 2, a failed measurement exit status 1."""
    try:
        backend = resolve_backend(args.backend)
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    sizes = ", ".join(fmt_bytes(s) for s in PROFILES[args.profile]["sizes"])
    print(f"{prog}: {backend} backend, blocks of {sizes}, both directions...", file=sys.stderr)
    res = run(args.profile, backend)
    print(format_results(res))
    return 1 if any(n.startswith("failed") for r in res["rows"] for n in r["notes"].values()) else 0
