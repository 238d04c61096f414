"""Where a submission's host time goes: ``transfer_async`` through the handler and the vLLM
plug-in's ``submit_store`` / ``submit_load``, cut into the pieces each calls, each timed by a
wrapper around it: ``issue``, the handler's ``_issue_group`` (the usual call: one group, two id
arrays, at most one block index) or ``_issue`` (anything else), which hold the caller's stream
and the core's call; ``core``, that call (``submit_group`` or ``submit_groups``); and off the
usual call, the handler's ``_groups`` and ``_wake`` and the plug-in's cut of vLLM's specs
(``split``: ``GroupMap.plain_groups`` or ``GroupMap.split``). 80 layers x 32 random blocks per
transfer, per-layer tensors (``bench_wall.py``'s ``separate`` and ``plugin`` layouts).

    python benches/probe_submit.py [--pages 4,16] [--reps 25] [--sleep-ms 20] [--backend auto]
                                   [--caller-stream default|side]

Three ways of calling, as ``bench_wall.py`` times them (``--ways``, default ``b2b,slept``):
``b2b``, 8 transfers submitted back to back (the later 7 of each round kept: the engine's thread
is busy issuing the earlier ones); ``slept``, one transfer after the caller slept ``--sleep-ms``
(its caches and core gone cold); ``alone``, one transfer right after the previous one was seen
done and one contiguous copy of the same bytes timed (``bench_wall.py``'s isolated transfer),
with ``wall`` (from the call to the result seen in ``get_finished``), ``gpu`` (the transfer's
GPU time) and ``rest`` (``wall`` less ``gpu`` and the whole call: the hand-off to the engine's
thread, its calls before the transfer's first GPU work, the completion seen) beside the pieces.
``--caller-stream side``: the caller's current stream is one it made (``torch.cuda.Stream()``),
not the default stream; transfers that wait for the caller's stream record their event there.
Printed, not saved: the median µs of each piece and of the whole call, per page size, layout,
direction and way; and per page size and direction a ``floor`` line, the host steps of a
transfer without blockswap after the same sleep (see :func:`floor`).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from blockswap_bench.cli import choices, kib_list, parser

QUEUED = 8
WAYS = ("b2b", "slept", "alone")


class Pieces:
    """Wrappers that time named methods of objects, undone by :meth:`undo`; set in the object's
    ``__dict__``, so a frozen dataclass's methods (the plug-in's ``GroupMap``) are wrapped too."""

    def __init__(self) -> None:
        self.times: dict[str, list[int]] = {}
        self._undo: list[tuple[Any, str, Any]] = []

    def wrap(self, obj: Any, name: str, key: str) -> None:
        f = getattr(obj, name)
        self._undo.append((obj, name, obj.__dict__.get(name)))
        times = self.times.setdefault(key, [])

        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter_ns()
            try:
                return f(*a, **k)
            finally:
                times.append(time.perf_counter_ns() - t0)

        obj.__dict__[name] = timed

    def mark(self) -> dict[str, int]:
        return {k: len(v) for k, v in self.times.items()}

    def drop_since(self, mark: dict[str, int]) -> None:
        for k, v in self.times.items():
            del v[mark.get(k, 0) :]

    def undo(self) -> None:
        for obj, name, orig in reversed(self._undo):
            if orig is None:
                del obj.__dict__[name]
            else:
                obj.__dict__[name] = orig
        self._undo.clear()


def main() -> int:
    ap = parser(__doc__, json=False, reps=25, reps_help="rounds per case", backend=True)
    ap.add_argument("--pages", type=kib_list, default=[4, 16], help="page sizes in KiB")
    ap.add_argument("--layers", type=int, default=80)
    ap.add_argument("--blocks", type=int, default=32)
    ap.add_argument("--sleep-ms", type=float, default=20.0)
    ap.add_argument("--caller-stream", choices=("default", "side"), default="default")
    ap.add_argument("--ways", type=choices(WAYS), default=["b2b", "slept"],
                    help="b2b, slept, alone (comma list; default b2b,slept)")  # fmt: skip
    args = ap.parse_args()

    import numpy as np
    import torch

    from bench_wall import HandlerTarget, PluginTarget, layer_tensors, vllm_missing
    from blockswap_bench.kvblocks import Copier

    cuda = args.backend == "cuda" or (args.backend == "auto" and torch.cuda.is_available())
    backend = "cuda" if cuda else "host"
    device = "cuda" if cuda else "cpu"
    layouts = ["separate"] + (["plugin"] if vllm_missing() is None else [])
    name = torch.cuda.get_device_name() if cuda else "host backend"
    print(f"# {name}; {args.layers} layers x {args.blocks} random blocks; µs, median")
    rng = np.random.default_rng(0)
    n_gpu, n_cpu = 2 * args.blocks, args.blocks + 4
    if cuda and args.caller_stream == "side":
        torch.cuda.set_stream(torch.cuda.Stream())
    for kib in args.pages:
        # ``alone``'s one copy of the same bytes before each call: one pinned pair per page size.
        copier = Copier(args.layers * args.blocks * kib * 1024) if "alone" in args.ways else None
        for layout in layouts:
            kv = layer_tensors(layout, args.layers, n_gpu, kib * 1024, device)
            opts: dict[str, Any] = {} if cuda else {"backend": "host"}
            t: Any = (
                PluginTarget("plugin", kv, n_cpu, backend, {})
                if layout == "plugin"
                else HandlerTarget("handler", kv, n_cpu, opts)
            )
            hs = t.w.handlers[0] if layout == "plugin" else t.h
            try:
                for d in ("d2h", "h2d"):
                    for way in args.ways:
                        one_copy = copier if way == "alone" else None
                        line = measure(t, hs, d, way, args, rng, n_gpu, n_cpu, layout, one_copy)
                        print(f"{kib:5d} KiB  {layout:8s}  {d}  {way:5s}  {line}", flush=True)
                    if layout == "separate":
                        line = floor(t.tables, d, args, rng, n_gpu, n_cpu, cuda)
                        print(f"{kib:5d} KiB  {'floor':8s}  {d}  slept  {line}", flush=True)
            finally:
                t.shutdown()
    return 0


def measure(
    t: Any,
    hs: Any,
    d: str,
    way: str,
    args: Any,
    rng: Any,
    n_gpu: int,
    n_cpu: int,
    layout: str,
    copier: Any,
) -> str:
    """One case's pieces, timed over ``args.reps`` rounds after two discarded; ``copier`` (a
    ``Copier`` of the transfer's bytes, ``alone`` only): one copy timed before each call."""
    p = Pieces()
    hd = hs.d2h if d == "d2h" else hs.h2d
    if layout == "plugin":
        m = t.w._map
        p.wrap(m, "plain_groups" if m.plain is not None else "split", "split")
    p.wrap(hd, "_issue", "issue")
    p.wrap(hd, "_issue_group", "issue")
    p.wrap(hd, "_wake", "wake")
    p.wrap(hd, "_groups", "groups")
    if hd._wait_stream is not None:
        p.wrap(hd, "_wait_stream", "stream")
    p.wrap(hd, "_submit_groups", "core")
    p.wrap(hd, "_submit_group", "core")
    total: list[int] = []
    ends: dict[str, list[float]] = {"wall": [], "gpu": [], "rest": []}
    job = iter(range(1, 1 << 30))
    try:
        for rnd in range(args.reps + 2):
            n = QUEUED if way == "b2b" else 1
            calls: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
            for _ in range(n):
                g = rng.permutation(n_gpu)[: args.blocks]
                c = rng.permutation(n_cpu)[: args.blocks]
                calls.append(t.call(next(job), d, g, c))
            if way == "slept":
                time.sleep(args.sleep_ms / 1e3)
            elif copier is not None:
                copier.seconds(d, copier.nbytes)
            for k, (f, a) in enumerate(calls):
                mark = p.mark()
                t0 = time.perf_counter_ns()
                f(*a)
                took = time.perf_counter_ns() - t0
                if rnd < 2 or (way == "b2b" and k == 0):
                    p.drop_since(mark)  # warm-up rounds; a batch's first call finds the lane idle
                else:
                    total.append(took)
            want = {a[0] for _, a in calls}
            while want:
                for r in t.poll():
                    job_id, _, secs, _ = t.result(r)
                    want.discard(job_id)
                    if copier is not None and rnd >= 2:
                        wall = (time.perf_counter_ns() - t0) / 1e9
                        ends["wall"].append(wall)
                        ends["gpu"].append(secs)
                        ends["rest"].append(wall - secs - took / 1e9)
    finally:
        p.undo()
    parts = {**p.times, "total": total, **{k: [x * 1e9 for x in v] for k, v in ends.items()}}
    return "  ".join(f"{k} {statistics.median(v) / 1e3:6.1f}" for k, v in parts.items() if v)


def floor(tables: Any, d: str, args: Any, rng: Any, n_gpu: int, n_cpu: int, cuda: bool) -> str:
    """The host steps of a transfer without blockswap (``bench_wall.py``'s ``steps us``), each
    after its own sleep: numpy's page addresses (``numpy``), ``cuEventRecord`` on the caller's
    stream (``event``, CUDA only), a token to a thread asleep on a queue (``handoff``), and the
    three in a row (``steps``); medians over ``args.reps`` rounds after two discarded."""
    from blockswap_bench.hostfloor import Addresses, Steps

    addresses = Addresses(tables, args.blocks)
    steps = Steps(addresses, cuda)
    parts: dict[str, Callable[[Any, Any], None]] = {
        "numpy": lambda g, c: addresses(d, g, c),
        **({"event": lambda g, c: steps.record()} if cuda else {}),
        "handoff": lambda g, c: steps.hand_off(),
        "steps": lambda g, c: steps(d, g, c),
    }
    times: dict[str, list[int]] = {k: [] for k in parts}
    try:
        for rnd in range(args.reps + 2):
            for k, f in parts.items():
                g = rng.permutation(n_gpu)[: args.blocks]
                c = rng.permutation(n_cpu)[: args.blocks]
                time.sleep(args.sleep_ms / 1e3)
                t0 = time.perf_counter_ns()
                f(g, c)
                took = time.perf_counter_ns() - t0
                if rnd >= 2:
                    times[k].append(took)
    finally:
        steps.close()
    return "  ".join(f"{k} {statistics.median(v) / 1e3:6.1f}" for k, v in times.items())


if __name__ == "__main__":
    sys.exit(main())
