"""What a caller waits for: the wall clock from ``transfer_async`` to the result in
``get_finished``, per page size, beside one copy of the same bytes and the link.

    python benches/bench_wall.py [--pages 4,8,16,32,64,256,1024,4096] [--layers 80] [--blocks 32]
                                 [--reps 15] [--cpu-blocks random,adjacent,reversed]
                                 [--layouts separate,one-alloc,plugin] [--option KEY=VALUE ...]
                                 [--variants NAME:KEY=VALUE,... ...] [--sleep-ms 20]
                                 [--backend auto|cuda|host] [--quick] [--max-s 540]
                                 [--json out.json]

A KV cache of ``--layers`` layer tensors, one page of P bytes per block per layer, 2 x
``--blocks`` GPU blocks; a transfer moves ``--blocks`` random GPU blocks to or from ``--blocks``
CPU blocks (out of ``--blocks`` + 4), in the orders asked for: ``random`` (no two consecutive CPU
ids adjacent), ``adjacent`` (one after the other, as a fresh cache hands them out) and
``reversed`` (adjacent from the last one down, as vLLM's CPU manager hands a request the chunks
one eviction freed). Layouts:
``separate`` (per-layer tensors allocated one by one, vLLM's default), ``one-alloc`` (the layer
tensors views of one allocation), both through the default handler
(``blockswap.handler.CpuGpuHandlers(layers, num_cpu_blocks, layout="mla")``, its block-major CPU
cache); and ``plugin``: vLLM's canonical per-layer int8 tensors through the plug-in's worker
(``blockswap.vllm.BlockswapOffloadingWorker``, its CPU cache, one block per chunk; skipped, with
the reason, where vLLM cannot be imported). On CUDA the handlers run with ``timing=True`` (the GPU
time column; the plug-in sets it too), unless ``--option timing=false``.

Per page size, layout, CPU block order, direction and variant:

* ``iso %``: isolated wall clock, from ``transfer_async`` to its result seen by a caller polling
  ``get_finished`` in a loop (the previous transfer done first), median of ``--reps``, as % of the
  link; ``/1copy``: as % of one contiguous pinned copy of the same bytes timed the same way
  (``synchronize``, ``copy_``, ``synchronize``, wall clock; median; its own % of the link in
  ``1copy %``); the two medians in ``iso us`` and ``1copy us``;
* ``8q %``: 8 transfers queued back to back, bytes / wall time from the first submit to the last
  result seen, best of the rounds, % of the link;
* ``GPU %``: the engine's GPU time of the isolated transfers (its timing events), % of the link: a
  diagnostic (``n/a`` on the host backend, or with timing off);
* ``idle %``: the wall clock of a transfer submitted after the caller slept ``--sleep-ms``, % of the
  link (what an idle gap adds); the ``/1copy`` after it: as % of one contiguous pinned copy of the
  same bytes timed the same way after the same sleep (``one_copy_idle_us`` in the JSON: its
  median); ``first_wall_us`` in the JSON: the case's first transfer (a warm-up, not in the
  medians);
* host time of ``transfer_async``: ``b2b us``, back to back (median of the queued batches' later
  calls); ``slept us``, after the caller slept ``--sleep-ms`` (median); ``numpy us``, numpy
  computing the same transfer's per-page addresses (``bases + ids * strides`` for every layer,
  both sides, and the sizes: what a per-page DMA path computes) after the same sleep (median;
  ``numpy_b2b_us`` in the JSON: warm); ``ratio`` = slept / numpy; ``steps us``, after another
  such sleep, the steps any engine issuing off the caller's thread takes, without blockswap: the
  same addresses, one event recorded on the caller's stream through the driver (CUDA) and a
  token handed to a thread asleep on a queue (``blockswap_bench.hostfloor.Steps``); its
  ``ratio`` = slept / steps.

The link's ceiling: one 256 MiB pinned copy per direction (best of 5), measured at the start, the
middle (before the page size x layout group where about half the run's time, as estimated, has
passed) and the end of the run; the best of each direction is kept and every percentage is of it
(the rows printed as the run goes use the best so far; the final table, the best of all three).
The host backend (no GPU, or ``--backend host``) times everything by the wall clock, its copies
being ``memcpy``.

``--variants caller:idle_issue=true dma:path=dma`` builds, beside the default (``--option``s
alone), one handler per variant with those options added, all alive at once, and interleaves
their repetitions (and the one-copy reference's) so that drift hits them alike; their rows carry
the variant's name. A variant or case that fails (an unknown option, too little memory, a
transfer that fails or hangs) is reported in its rows (``error``) and the run goes on. Repetitions
shrink where a transfer is long (down to ``--min-reps``); ``--max-s`` bounds the run: cases that
would end past it (as estimated) are recorded as skipped. ``--quick``: a few page sizes, a few repetitions (under a minute on
the host backend). ``--json``: GPU, driver, date, command, the ceilings and every row, written
after each page size x layout group.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from blockswap._bench import resolve_backend
from blockswap._types import BackendName
from blockswap.handler import CpuGpuHandlers
from blockswap_bench.cli import choices, option
from blockswap_bench.common import Progress, run_metadata
from blockswap_bench.hostfloor import Addresses, Steps
from blockswap_bench.kvblocks import (
    DIRECTIONS,
    LINK_BYTES,
    Ceilings,
    Copier,
    cpu_block_ids,
    parser,
    write_figures,
)
from blockswap_bench.plugin import CPUSpec

DEFAULT_PAGES = "4,8,16,32,64,256,1024,4096"
QUICK_PAGES = {"cuda": "4,64,1024", "host": "4,64"}
LAYOUTS = ("separate", "one-alloc", "plugin")
#: CPU blocks beyond a transfer's: room for random subsets and for adjacent runs to move.
SPARE_CPU_BLOCKS = 4
QUEUED = 8

#: The fields of every measured row of the JSON (rows of failed or skipped cases carry the first
#: eight and ``error``).
ROW_FIELDS = (
    "page_kib", "layout", "cpu_blocks", "variant", "direction", "backend", "bytes", "options",
    "route", "plan", "ceiling_gbps", "reps",
    "isolated_wall_us", "isolated_wall_gbps", "isolated_pct_link", "first_wall_us",
    "one_copy_wall_us", "one_copy_gbps", "one_copy_pct_link", "isolated_pct_one_copy",
    "queued_gbps", "queued_pct_link",
    "gpu_gbps", "gpu_pct_link",
    "idle_wall_us", "idle_pct_link", "one_copy_idle_us", "idle_pct_one_copy",
    "async_polled_us", "async_b2b_us", "async_slept_us", "numpy_slept_us", "numpy_b2b_us",
    "slept_ratio", "steps_slept_us", "steps_ratio", "samples", "error",
)  # fmt: skip


@dataclass(frozen=True)
class Reps:
    """Repetitions: at most ``reps`` isolated (with the one-copy reference), ``queued`` rounds of
    8, ``slept`` submissions after a sleep; fewer where a case's transfers are long (each part
    aims at its budget, in seconds, over every variant), never under the minimums."""

    reps: int = 15
    min_reps: int = 5
    queued: int = 3
    slept: int = 10
    min_slept: int = 3
    warmup: int = 2
    iso_budget_s: float = 1.5
    queued_budget_s: float = 1.0
    slept_budget_s: float = 1.0

    def counts(self, est_s: float, variants: int, sleep_s: float) -> tuple[int, int, int]:
        def clamp(x: float, lo: int, hi: int) -> int:
            return max(lo, min(hi, int(x)))

        iso = clamp(self.iso_budget_s / ((variants + 1) * est_s), min(self.min_reps, self.reps),
                    self.reps)  # fmt: skip
        queued = clamp(self.queued_budget_s / (variants * QUEUED * est_s), 1, self.queued)
        slept = clamp(self.slept_budget_s / self.slept_round(est_s, variants, sleep_s),
                      min(self.min_slept, self.slept), self.slept)  # fmt: skip
        return iso, queued, slept

    def seconds(self, est_s: float, variants: int, sleep_s: float) -> float:
        """About how long one case (a direction and an order) takes with transfers of
        ``est_s``."""
        iso, queued, slept = self.counts(est_s, variants, sleep_s)
        return (
            (self.warmup * variants + 1 + iso * (variants + 1)) * est_s
            + queued * variants * QUEUED * est_s
            + slept * self.slept_round(est_s, variants, sleep_s)
        )

    @staticmethod
    def slept_round(est_s: float, variants: int, sleep_s: float) -> float:
        """One round after sleeps: a transfer per variant and one copy, each after a sleep, and
        the two host floors after theirs."""
        return (variants + 1) * (est_s + sleep_s) + 2 * sleep_s


QUICK = Reps(reps=5, min_reps=3, queued=1, slept=3, min_slept=3, warmup=1,
             iso_budget_s=0.3, queued_budget_s=0.3, slept_budget_s=0.3)  # fmt: skip


# ---- what a caller drives ---------------------------------------------------------------------

Result = tuple[int, bool, float, Any]
"""``(job id, success, seconds, error)``."""


class Target:
    """One variant of one layout: submits a transfer, polls results, says its route."""

    name: str
    options: dict[str, Any]
    poll: Callable[[], list[Any]]
    tables: tuple[Any, Any]
    """``(GPU BlockTable, CPU BlockTable)`` of the cache (one KV-cache group)."""

    def call(
        self, job: int, d: str, g: np.ndarray, c: np.ndarray
    ) -> tuple[Callable[..., Any], tuple]:
        """The bound call and its arguments that submit ``job`` (built before the clock runs)."""
        raise NotImplementedError

    def result(self, r: Any) -> Result:
        raise NotImplementedError

    def route(self, d: str) -> tuple[str, str]:
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError


class HandlerTarget(Target):
    def __init__(self, name: str, layers: list[torch.Tensor], num_cpu: int,
                 options: dict[str, Any]) -> None:  # fmt: skip
        self.name, self.options = name, options
        self.h = CpuGpuHandlers(layers, num_cpu, layout="mla", **options)
        self.poll = self.h.get_finished
        self.tables = (self.h.gpu_tables[0], self.h.cpu_tables[0])
        self._submit = {"d2h": self.h.d2h.transfer_async, "h2d": self.h.h2d.transfer_async}

    def call(
        self, job: int, d: str, g: np.ndarray, c: np.ndarray
    ) -> tuple[Callable[..., Any], tuple]:
        return self._submit[d], (job, (g, c) if d == "d2h" else (c, g))

    def result(self, r: Any) -> Result:
        return r.job_id, r.success, r.seconds, r.error

    def route(self, d: str) -> tuple[str, str]:
        return self.h.routes[d].reason, self.h.routes[d].plan

    def shutdown(self) -> None:
        self.h.shutdown()


class PluginTarget(Target):
    def __init__(self, name: str, kv: Any, num_cpu: int, backend: BackendName,
                 options: dict[str, Any]) -> None:  # fmt: skip
        from vllm.v1.kv_offload.base import GPULoadStoreSpec

        from blockswap.vllm import BlockswapOffloadingWorker

        self.name, self.options = name, options
        self._spec = GPULoadStoreSpec
        self.w = BlockswapOffloadingWorker(kv, 1, num_cpu, backend=backend, **options)
        self.poll = self.w.get_finished
        h = self.w.handlers[0]
        self.tables = (h.gpu_tables[0], h.cpu_tables[0])

    def call(
        self, job: int, d: str, g: np.ndarray, c: np.ndarray
    ) -> tuple[Callable[..., Any], tuple]:
        gspec = self._spec(g.tolist(), [len(g)], [0])
        if d == "d2h":
            return self.w.submit_store, (job, gspec, CPUSpec(c))
        return self.w.submit_load, (job, CPUSpec(c), gspec)

    def result(self, r: Any) -> Result:
        return r.job_id, r.success, r.transfer_time, None if r.success else "failed (see the log)"

    def route(self, d: str) -> tuple[str, str]:
        r = self.w.handlers[0].routes[d]
        return r.reason, r.plan

    def shutdown(self) -> None:
        self.w.shutdown()


def vllm_missing() -> str | None:
    """Why the plug-in cannot be measured here, or None."""
    try:
        import vllm.v1.kv_offload.base  # noqa: F401

        import blockswap.vllm  # noqa: F401
    except Exception as e:  # ImportError, or vLLM failing to import on this host
        return f"{type(e).__name__}: {e}"
    return None


# ---- measuring --------------------------------------------------------------------------------


class Failed(Exception):
    pass


def wait_for(t: Target, want: set[int], deadline: float) -> tuple[float, list[Result]]:
    """Polls ``t`` until every job in ``want`` reported: ``(the time the last was seen, their
    results)``. Results of other jobs (left over from a failure) are dropped."""
    pending = set(want)
    got: list[Result] = []
    poll = t.poll
    while True:
        res = poll()
        if res:
            now = time.perf_counter()
            for r in res:
                one = t.result(r)
                if one[0] in pending:
                    pending.discard(one[0])
                    got.append(one)
            if not pending:
                for job, ok, _, err in got:
                    if not ok:
                        raise Failed(f"transfer {job} failed: {err}")
                return now, got
        elif time.perf_counter() > deadline:
            raise Failed(f"transfers {sorted(pending)} not reported in time (hung?)")


class Jobs:
    def __init__(self) -> None:
        self.n = 0

    def __call__(self) -> int:
        self.n += 1
        return self.n


def rotated(xs: Sequence[Target], i: int) -> list[Target]:
    k = i % len(xs)
    return [*xs[k:], *xs[:k]]


def median_or_none(xs: Sequence[float]) -> float | None:
    return float(statistics.median(xs)) if xs else None


def measure(
    targets: list[Target],
    copier: Copier,
    d: str,
    order: str,
    *,
    blocks: int,
    n_gpu: int,
    n_cpu: int,
    nbytes: int,
    est_s: float,
    reps: Reps,
    sleep_s: float,
    jobs: Jobs,
    rng: np.random.Generator,
) -> dict[str, dict[str, Any]]:
    """One direction and CPU block order of a case, every target interleaved: per target name,
    its figures or ``{"error": ...}``."""
    out: dict[str, dict[str, Any]] = {}
    alive = list(targets)
    timeout = 30.0 + 100 * est_s
    samples: dict[str, dict[str, list[float]]] = {
        t.name: {
            k: [] for k in ("first", "wall", "polled", "gpu", "b2b", "slept", "idle", "queued")
        }
        for t in targets
    }

    def spec() -> tuple[np.ndarray, np.ndarray]:
        g = rng.permutation(n_gpu)[:blocks].astype(np.int64)
        return g, cpu_block_ids(rng, blocks, n_cpu, order)

    def guarded(t: Target, fn: Callable[..., None], *args: Any) -> None:
        """``fn(*args)``; a failure is ``t``'s, which is measured no further."""
        try:
            fn(*args)
        except Exception as e:
            out[t.name] = {"error": f"{type(e).__name__}: {e}"}
            alive.remove(t)

    def isolated(t: Target, record: bool) -> None:
        job = jobs()
        fn, args = t.call(job, d, *spec())
        t0 = time.perf_counter()
        ok = fn(*args)
        t1 = time.perf_counter()
        if ok is False:
            raise Failed(f"transfer {job} refused (see the log)")
        end, ((_, _, secs, _),) = wait_for(t, {job}, t0 + timeout)
        if not record and not samples[t.name]["first"]:
            samples[t.name]["first"].append(end - t0)
        if record:
            s = samples[t.name]
            s["wall"].append(end - t0)
            s["polled"].append(t1 - t0)
            s["gpu"].append(secs)

    def queued(t: Target) -> None:
        calls = [t.call(j, d, *spec()) for j in [jobs() for _ in range(QUEUED)]]
        want = {args[0] for _, args in calls}
        host = []
        t0 = time.perf_counter()
        for k, (fn, args) in enumerate(calls):
            a = time.perf_counter()
            if fn(*args) is False:
                raise Failed(f"transfer {args[0]} refused (see the log)")
            if k:
                host.append(time.perf_counter() - a)
        end, _ = wait_for(t, want, t0 + QUEUED * timeout)
        samples[t.name]["queued"].append(QUEUED * nbytes / (end - t0) / 1e9)
        samples[t.name]["b2b"].extend(host)

    def slept(t: Target, g: np.ndarray, c: np.ndarray) -> None:
        job = jobs()
        fn, args = t.call(job, d, g, c)
        time.sleep(sleep_s)
        t0 = time.perf_counter()
        ok = fn(*args)
        t1 = time.perf_counter()
        if ok is False:
            raise Failed(f"transfer {job} refused (see the log)")
        end, _ = wait_for(t, {job}, t0 + timeout)
        samples[t.name]["slept"].append(t1 - t0)
        samples[t.name]["idle"].append(end - t0)

    n_iso, n_queued, n_slept = reps.counts(est_s, len(targets), sleep_s)

    def warm(t: Target) -> None:  # the lanes, the kernels, the pages of the buffers
        for _ in range(reps.warmup):
            isolated(t, False)

    for t in list(alive):
        guarded(t, warm, t)
    copier.seconds(d, nbytes)
    copies: list[float] = []
    for i in range(n_iso):
        copies.append(copier.seconds(d, nbytes))
        for t in rotated(alive, i):
            guarded(t, isolated, t, True)
    for i in range(n_queued):
        for t in rotated(alive, i):
            guarded(t, queued, t)
    addresses = Addresses(targets[0].tables, blocks)
    steps = Steps(addresses, copier.cuda)
    numpy_slept: list[float] = []
    copies_slept: list[float] = []
    numpy_b2b: list[float] = []
    steps_slept: list[float] = []
    try:
        for i in range(n_slept):
            g, c = spec()
            for t in rotated(alive, i):
                guarded(t, slept, t, g, c)
            time.sleep(sleep_s)
            t0 = time.perf_counter()
            addresses(d, g, c)
            numpy_slept.append(time.perf_counter() - t0)
            for _ in range(3):
                t0 = time.perf_counter()
                addresses(d, g, c)
                numpy_b2b.append(time.perf_counter() - t0)
            time.sleep(sleep_s)
            t0 = time.perf_counter()
            steps(d, g, c)
            steps_slept.append(time.perf_counter() - t0)
            time.sleep(sleep_s)
            copies_slept.append(copier.seconds(d, nbytes))
    finally:
        steps.close()
    copy_s = median_or_none(copies)
    for t in targets:
        if t.name in out:
            continue
        s = samples[t.name]
        out[t.name] = {
            "reps": {"isolated": n_iso, "queued_rounds": n_queued, "slept": n_slept},
            "wall_s": median_or_none(s["wall"]),
            "first_s": median_or_none(s["first"]),
            "one_copy_s": copy_s,
            "queued_gbps": max(s["queued"]),
            "gpu_s": median_or_none(s["gpu"]),
            "idle_s": median_or_none(s["idle"]),
            "one_copy_idle_s": median_or_none(copies_slept),
            "async_polled_s": median_or_none(s["polled"]),
            "async_b2b_s": median_or_none(s["b2b"]),
            "async_slept_s": median_or_none(s["slept"]),
            "numpy_slept_s": median_or_none(numpy_slept),
            "numpy_b2b_s": median_or_none(numpy_b2b),
            "steps_slept_s": median_or_none(steps_slept),
            "samples": {
                "isolated_wall_s": s["wall"],
                "one_copy_wall_s": copies,
                "gpu_s": s["gpu"],
                "idle_wall_s": s["idle"],
                "one_copy_idle_wall_s": copies_slept,
                "queued_gbps": s["queued"],
                "async_slept_s": s["slept"],
                "numpy_slept_s": numpy_slept,
                "steps_slept_s": steps_slept,
            },
        }
    return out


# ---- rows -------------------------------------------------------------------------------------


def figures(row: dict[str, Any], m: dict[str, Any], gpu_time: bool) -> None:
    """The row's figures from ``measure``'s raw ones (percentages: see :func:`percent`)."""
    nbytes = row["bytes"]

    def us(x: float | None) -> float | None:
        return None if x is None else x * 1e6

    def gbps(s: float | None) -> float | None:
        return None if not s else nbytes / s / 1e9

    row.update(
        reps=m["reps"],
        isolated_wall_us=us(m["wall_s"]),
        isolated_wall_gbps=gbps(m["wall_s"]),
        first_wall_us=us(m["first_s"]),
        one_copy_wall_us=us(m["one_copy_s"]),
        one_copy_gbps=gbps(m["one_copy_s"]),
        isolated_pct_one_copy=(
            100 * m["one_copy_s"] / m["wall_s"] if m["wall_s"] and m["one_copy_s"] else None
        ),
        queued_gbps=m["queued_gbps"],
        gpu_gbps=gbps(m["gpu_s"]) if gpu_time else None,
        idle_wall_us=us(m["idle_s"]),
        one_copy_idle_us=us(m["one_copy_idle_s"]),
        idle_pct_one_copy=(
            100 * m["one_copy_idle_s"] / m["idle_s"]
            if m["idle_s"] and m["one_copy_idle_s"]
            else None
        ),
        async_polled_us=us(m["async_polled_s"]),
        async_b2b_us=us(m["async_b2b_s"]),
        async_slept_us=us(m["async_slept_s"]),
        numpy_slept_us=us(m["numpy_slept_s"]),
        numpy_b2b_us=us(m["numpy_b2b_s"]),
        slept_ratio=(
            m["async_slept_s"] / m["numpy_slept_s"]
            if m["async_slept_s"] and m["numpy_slept_s"]
            else None
        ),
        steps_slept_us=us(m["steps_slept_s"]),
        steps_ratio=(
            m["async_slept_s"] / m["steps_slept_s"]
            if m["async_slept_s"] and m["steps_slept_s"]
            else None
        ),
        samples=m["samples"],
        error=None,
    )


def percent(row: dict[str, Any], ceil: dict[str, float]) -> None:
    """Percentages of the link's ceiling ``ceil`` (the best so far, or of the whole run)."""
    c = ceil[row["direction"]]
    row["ceiling_gbps"] = c

    def pct(gbps: float | None) -> float | None:
        return None if gbps is None or not c or c != c else 100 * gbps / c

    row["isolated_pct_link"] = pct(row.get("isolated_wall_gbps"))
    row["one_copy_pct_link"] = pct(row.get("one_copy_gbps"))
    row["queued_pct_link"] = pct(row.get("queued_gbps"))
    row["gpu_pct_link"] = pct(row.get("gpu_gbps"))
    idle = row.get("idle_wall_us")
    row["idle_pct_link"] = pct(row["bytes"] / idle / 1e3 if idle else None)


HEAD = (
    f"{'page':>6} {'layout':<9} {'cpu':<8} {'variant':<10} {'dir':<4} {'iso %':>6} "
    f"{'/1copy':>6} {'1copy %':>7} {'8q %':>6} {'GPU %':>6} {'idle %':>6} {'/1copy':>6} "
    f"{'iso us':>9} "
    f"{'1copy us':>9} {'b2b us':>7} {'slept us':>8} {'numpy us':>8} {'ratio':>5} "
    f"{'steps us':>8} {'ratio':>5}  route"
)


def line(row: dict[str, Any]) -> str:
    def f(x: float | None, width: int, digits: int = 1) -> str:
        return f"{'n/a':>{width}}" if x is None else f"{x:>{width}.{digits}f}"

    lead = (f"{row['page_kib']:>5}K {row['layout']:<9} {row['cpu_blocks']:<8} "
            f"{row['variant']:<10} {row['direction']:<4}")  # fmt: skip
    if row.get("error"):
        return f"{lead} {'FAILED' if not row.get('skipped') else 'skipped'}: {row['error']}"
    return (
        f"{lead} {f(row['isolated_pct_link'], 6)} {f(row['isolated_pct_one_copy'], 6)} "
        f"{f(row['one_copy_pct_link'], 7)} {f(row['queued_pct_link'], 6)} "
        f"{f(row['gpu_pct_link'], 6)} {f(row['idle_pct_link'], 6)} "
        f"{f(row['idle_pct_one_copy'], 6)} "
        f"{f(row['isolated_wall_us'], 9)} {f(row['one_copy_wall_us'], 9)} "
        f"{f(row['async_b2b_us'], 7)} {f(row['async_slept_us'], 8)} "
        f"{f(row['numpy_slept_us'], 8)} {f(row['slept_ratio'], 5, 2)} "
        f"{f(row['steps_slept_us'], 8)} {f(row['steps_ratio'], 5, 2)}  "
        f"{row['route'].split(' (')[0][:60]}"
    )


# ---- the run ----------------------------------------------------------------------------------


def variant(text: str) -> tuple[str, dict[str, Any]]:
    """``NAME:KEY=VALUE,KEY=VALUE`` (``NAME:`` alone: the default's options under another name)."""
    name, sep, rest = text.partition(":")
    if not name or not sep or name == "default":
        raise argparse.ArgumentTypeError(
            f"a variant is NAME:KEY=VALUE,... with a name other than 'default', not {text!r}"
        )
    return name, dict(option(kv) for kv in rest.split(",") if kv)


def layer_tensors(layout: str, layers: int, nb: int, page: int, device: str) -> Any:
    """The GPU side: per-layer ``(nb, 1, page)`` uint8 tensors (``separate``, ``one-alloc``) or
    vLLM's ``CanonicalKVCaches`` of per-layer ``(nb, page)`` int8 tensors (``plugin``)."""
    make = torch.zeros if device == "cpu" else torch.empty  # host: no page faults in the clock
    if layout == "one-alloc":
        buf = make((layers, nb, 1, page), dtype=torch.uint8, device=device)
        return [buf[i] for i in range(layers)]
    if layout == "separate":
        return [make((nb, 1, page), dtype=torch.uint8, device=device) for _ in range(layers)]
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
    )

    ts = [make((nb, page), dtype=torch.int8, device=device) for _ in range(layers)]
    return CanonicalKVCaches(
        [CanonicalKVCacheTensor(t, page) for t in ts],
        [[CanonicalKVCacheRef(i, page) for i in range(layers)]],
    )


def main(argv: Sequence[str] | None = None) -> int:
    ap = parser(__doc__, pages=DEFAULT_PAGES, reps=15, cpu_blocks="random,adjacent", backend=True,
                quick="a few page sizes, a few repetitions", seed=True)  # fmt: skip
    ap.set_defaults(pages=None, reps=None)
    ap.add_argument("--layouts", type=choices(LAYOUTS), default=list(LAYOUTS),
                    help="separate, one-alloc, plugin (comma list; default all)")  # fmt: skip
    ap.add_argument("--variants", nargs="+", action="extend", type=variant, default=[],
                    metavar="NAME:KEY=VALUE,...",
                    help="handlers with more options, measured beside the default, "
                         "interleaved")  # fmt: skip
    ap.add_argument("--sleep-ms", type=float, default=20.0,
                    help="the caller's sleep before a submission (default 20)")  # fmt: skip
    ap.add_argument("--min-reps", type=int, default=None, help="fewest isolated repetitions")
    ap.add_argument("--max-s", type=float, default=540.0,
                    help="cases that would end past this many seconds (as estimated) are "
                         "skipped (default 540)")  # fmt: skip
    args = ap.parse_args(argv)
    log = Progress()
    try:
        backend = resolve_backend(args.backend)
    except ValueError as e:
        print(f"bench_wall: {e}", file=sys.stderr)
        return 2
    cuda = backend == "cuda"
    device = "cuda" if cuda else "cpu"
    base = Reps() if not args.quick else QUICK
    reps = Reps(**{**base.__dict__, **({"reps": args.reps} if args.reps else {}),
                   **({"min_reps": args.min_reps} if args.min_reps else {})})  # fmt: skip
    default_pages = QUICK_PAGES[backend] if args.quick else DEFAULT_PAGES
    pages: list[int] = args.pages or [int(x) for x in default_pages.split(",")]
    options: dict[str, Any] = ({"timing": True} if cuda else {}) | dict(args.option)
    gpu_time = cuda and options.get("timing") is not False
    variants = [("default", options)] + [(n, options | o) for n, o in args.variants]
    if len({n for n, _ in variants}) != len(variants):
        print("bench_wall: variant names must differ", file=sys.stderr)
        return 2
    layouts = list(args.layouts)
    skipped_layouts: dict[str, str] = {}
    if "plugin" in layouts and (why := vllm_missing()) is not None:
        skipped_layouts["plugin"] = f"vLLM's plug-in cannot be imported here ({why})"
        layouts.remove("plugin")
        print(f"# plugin layout skipped: {skipped_layouts['plugin']}", flush=True)
    blocks, layers = args.blocks, args.layers
    n_gpu, n_cpu = 2 * blocks, blocks + SPARE_CPU_BLOCKS
    sleep_s = args.sleep_ms / 1e3
    meta = run_metadata(
        ["python", "benches/bench_wall.py", *(sys.argv[1:] if argv is None else argv)]
    )
    gpu_name = meta.get("gpu") or "no GPU"
    print(f"# bench_wall: {gpu_name}, driver {meta.get('driver') or 'n/a'}; backend {backend}; "
          f"{layers} layers x {blocks} blocks ({n_gpu} GPU blocks, {n_cpu} CPU blocks); "
          f"pages {','.join(map(str, pages))} KiB; layouts {','.join(layouts)}; CPU blocks "
          f"{','.join(args.cpu_blocks)}; sleep {args.sleep_ms:g} ms; {reps}",
          flush=True)  # fmt: skip
    for n, o in variants:
        print(f"# variant {n}: {o}", flush=True)
    if not gpu_time:
        why = "host backend" if not cuda else "timing off"
        print(f"# GPU % is n/a ({why}); every time here is the wall clock", flush=True)

    max_bytes = layers * blocks * max(pages) * 1024
    copier = Copier(max(max_bytes, LINK_BYTES), cuda)
    ceilings = Ceilings(LINK_BYTES, copier)
    ceilings.measure("start")
    log(f"the link's ceiling at the start: {ceilings.describe()}")
    rows: list[dict[str, Any]] = []
    jobs = Jobs()
    rng = np.random.default_rng(args.seed)
    groups = [(kib, layout) for kib in pages for layout in layouts]
    # The middle measurement of the ceiling: before the group where half the run's time (as
    # estimated from the start's ceiling) has passed.
    cost = [
        len(args.cpu_blocks)
        * sum(
            reps.seconds(layers * blocks * kib * 1024 / (ceilings.best(d) * 1e9) + 50e-6,
                         len(variants), sleep_s)
            for d in DIRECTIONS
        )
        for kib, _ in groups
    ]  # fmt: skip
    middle = next((i for i in range(len(groups)) if sum(cost[: i + 1]) >= sum(cost) / 2), 0)
    middle = max(1, middle)
    log(f"about {sum(cost):.1f} s of measurements to come (besides building the caches)")
    extra: dict[str, Any] = {}

    def save(final: bool = False) -> None:
        if not args.json:
            return
        for r in rows:
            if not r.get("error"):
                percent(r, ceilings.gbps)
        write_figures(args.json, "bench_wall.py", ceilings.gbps, rows,
                      backend=backend, ceilings=ceilings.measured, best_from=ceilings.best_from(),
                      config={"layers": layers, "blocks": blocks, "gpu_blocks": n_gpu,
                              "cpu_blocks": n_cpu, "pages_kib": pages, "layouts": layouts,
                              "orders": args.cpu_blocks, "sleep_ms": args.sleep_ms,
                              "reps": reps.__dict__, "variants": dict(variants),
                              "gpu_time": gpu_time},
                      skipped_layouts=skipped_layouts, complete=final, **extra)  # fmt: skip

    def row_of(kib: int, layout: str, order: str, d: str, name: str) -> dict[str, Any]:
        """A row's key fields (every row has them)."""
        return {"page_kib": kib, "layout": layout, "cpu_blocks": order, "variant": name,
                "direction": d, "backend": backend, "bytes": layers * blocks * kib * 1024,
                "options": dict(variants)[name]}  # fmt: skip

    def fail_rows(kib: int, layout: str, names: Sequence[str], why: str,
                  skipped: bool = False) -> None:  # fmt: skip
        """Rows saying why ``names`` were not measured, for every order and direction not in
        ``rows`` yet."""
        done = {(r["cpu_blocks"], r["direction"], r["variant"]) for r in rows
                if r["page_kib"] == kib and r["layout"] == layout}  # fmt: skip
        for order in args.cpu_blocks:
            for d in DIRECTIONS:
                for name in names:
                    if (order, d, name) not in done:
                        row = row_of(kib, layout, order, d, name)
                        row.update(error=why, skipped=skipped)
                        rows.append(row)
                        print(line(row), flush=True)

    print(HEAD, flush=True)
    for gi, (kib, layout) in enumerate(groups):
        if gi == middle:
            ceilings.measure("middle")
            log(f"the link's ceiling in the middle: {ceilings.describe()}")
        if log.elapsed() + cost[gi] > args.max_s:
            fail_rows(kib, layout, [n for n, _ in variants],
                      f"would end past --max-s {args.max_s:g} s", skipped=True)  # fmt: skip
            continue
        page = kib * 1024
        nbytes = layers * blocks * page
        targets: list[Target] = []
        caches: Any = None
        try:
            caches = layer_tensors(layout, layers, n_gpu, page, device)
            for name, opts in variants:
                try:
                    if layout == "plugin":
                        targets.append(PluginTarget(name, caches, n_cpu, backend, opts))
                    else:
                        targets.append(HandlerTarget(name, caches, n_cpu, opts))
                except Exception as e:
                    fail_rows(kib, layout, [name], f"cannot build: {type(e).__name__}: {e}")
            dead: dict[str, str] = {}  # a target that failed is not measured again here
            for order in args.cpu_blocks if targets else []:
                for d in DIRECTIONS:
                    est_s = nbytes / (ceilings.best(d) * 1e9) + 50e-6
                    live = [t for t in targets if t.name not in dead]
                    res = {
                        n: {"error": f"not measured, failed before: {e}"} for n, e in dead.items()
                    }
                    try:
                        if live:
                            res |= measure(live, copier, d, order, blocks=blocks, n_gpu=n_gpu,
                                           n_cpu=n_cpu, nbytes=nbytes, est_s=est_s, reps=reps,
                                           sleep_s=sleep_s, jobs=jobs, rng=rng)  # fmt: skip
                    except Exception as e:
                        traceback.print_exc()
                        res |= {t.name: {"error": f"{type(e).__name__}: {e}"} for t in live}
                    for t in live:
                        if "error" in res[t.name]:
                            dead[t.name] = res[t.name]["error"]
                    for t in targets:
                        row = row_of(kib, layout, order, d, t.name)
                        row["route"], row["plan"] = t.route(d)
                        m = res[t.name]
                        if "error" in m:
                            row["error"] = m["error"]
                        else:
                            figures(row, m, gpu_time)
                            percent(row, ceilings.gbps)
                        rows.append(row)
                        print(line(row), flush=True)
        except Exception as e:  # the caches could not be made (memory), or a bug here
            traceback.print_exc()
            fail_rows(kib, layout, [n for n, _ in variants], f"{type(e).__name__}: {e}")
        finally:
            for t in targets:
                try:
                    t.shutdown()
                except Exception as e:
                    print(f"# {kib}K {layout} {t.name}: shutdown failed: {e}", flush=True)
            del targets, caches
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
        log(f"{kib} KiB {layout} done")
        save()
    if middle >= len(groups):
        ceilings.measure("middle")
    ceilings.measure("end")
    best = ceilings.best_from()
    names = [n for n, _ in variants]
    rows.sort(key=lambda r: (pages.index(r["page_kib"]), LAYOUTS.index(r["layout"]),
                             args.cpu_blocks.index(r["cpu_blocks"]),
                             DIRECTIONS.index(r["direction"]),
                             names.index(r["variant"])))  # fmt: skip
    log(f"the link's ceiling at the end: {ceilings.describe()}")
    for r in rows:
        if not r.get("error"):
            percent(r, ceilings.gbps)
    extra["elapsed_s"] = log.elapsed()
    save(final=True)
    print(f"\n# every row, % of the best ceiling of the run: h2d {ceilings.best('h2d'):.1f} GB/s "
          f"(from the {best['h2d']} measurement), d2h {ceilings.best('d2h'):.1f} GB/s (from the "
          f"{best['d2h']} measurement); one 256 MiB pinned copy per direction, best of 5, "
          f"measured at the start, middle and end", flush=True)  # fmt: skip
    print(HEAD)
    for r in rows:
        print(line(r))
    failed = sum(1 for r in rows if r.get("error") and not r.get("skipped"))
    skipped = sum(1 for r in rows if r.get("skipped"))
    print(f"# {len(rows)} rows, {failed} failed, {skipped} skipped; elapsed {log.elapsed():.1f} s",
          flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
