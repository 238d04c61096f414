"""Random-transfer stress of the engine on the host backend (or the GPU), every byte verified.

Run as a script (``python tests/reliability_stress.py``; ``BLOCKSWAP_STRESS_TRANSFERS`` sets the
count, 1,000,000 by default; ``BLOCKSWAP_STRESS_BACKEND=cuda`` runs it on the GPU) it prints one
JSON line of figures; ``tests/test_reliability_load.py`` and ``tests/test_cuda.py`` run the same
:func:`run_stress`.

Each round clears two destination regions (one registered as host memory, one as device memory),
then submits a few thousand transfers of random direction (``h2d``, ``d2h``, ``h2h``, ``d2d``),
each of 1-8 descriptors of random size (log-uniform 1 B - 4 KiB, and one in 200 up to 256 KiB),
scattered over the destination region in random order with random gaps (a gap of 0 lets two
descriptors of one transfer coalesce). A descriptor's source lies at its destination's offset plus
a random shift per direction and round in a source region of never-zero random bytes, so the whole
destination region after the round must equal, byte for byte, the shifted sources where a
descriptor landed and zero everywhere else: a lost, misplaced, stray or partial copy shows, and
the check is a handful of vectorised numpy passes. Results are polled in batches while submitting;
every job must be reported exactly once, successful, with its own byte count. At the end the
descriptor pool must be whole again and nothing in flight; resident memory is sampled after the
warm-up rounds, at the middle and at the end.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

import blockswap

KiB = 1 << 10
MiB = 1 << 20
DIRECTIONS = ("h2d", "d2h", "h2h", "d2d")
# (source region, destination region) of each direction: host src, device src; host dst, device dst.
_SRC = {"h2d": "hs", "d2h": "ds", "h2h": "hs", "d2d": "ds"}
_DST = {"h2d": "dd", "d2h": "hd", "h2h": "hd", "d2d": "dd"}
DEFAULT_TRANSFERS = 1_000_000
# Resident memory settles within the first rounds (the allocator's heap and the slab pool reach
# their working size); the start of the run is measured after these.
WARMUP_ROUNDS = 3


def rss_bytes() -> int:
    """Resident set size of this process, from /proc/self/statm (ru_maxrss where there is none)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: the peak, which is still an upper bound of growth
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclass
class StressReport:
    transfers: int
    descriptors: int = 0
    bytes: int = 0
    rounds: int = 0
    by_direction: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    rss_start: int = 0
    rss_middle: int = 0
    rss_end: int = 0
    pool_bytes_start: int = 0
    pool: dict[str, int] = field(default_factory=dict)
    max_in_flight: int = 0
    retries: int = 0

    @property
    def rss_growth(self) -> int:
        return self.rss_end - self.rss_start


class StressFailure(AssertionError):
    pass


class _GpuRegion:
    """A region of the CUDA run: pinned host or device memory, seen by the checks as the numpy
    array the host run uses (device memory is read back)."""

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor

    def fill(self, value: int) -> None:
        import torch

        self.tensor.fill_(value)
        torch.cuda.synchronize()  # the engine's streams do not wait for torch's

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        import torch

        torch.cuda.synchronize()
        return self.tensor.cpu().numpy()

    def __getitem__(self, index: Any) -> np.ndarray:
        return np.asarray(self)[index]


def _on_gpu(name: str, arr: np.ndarray) -> _GpuRegion:
    import torch

    t = torch.from_numpy(arr)
    return _GpuRegion(t.pin_memory() if name[0] == "h" else t.cuda())


def run_stress(
    transfers: int = DEFAULT_TRANSFERS,
    *,
    seed: int = 0,
    region: int = 8 * MiB,
    per_round: int = 4000,
    poll_every: int = 128,
    max_in_flight: int = 256,
    backend: str = "host",
) -> StressReport:
    """Submits ``transfers`` random transfers in rounds of ``per_round`` and checks everything
    (raises :class:`StressFailure` at the first discrepancy). Returns the figures.

    ``backend="cuda"``: the same on the GPU, the host regions pinned, the device regions in
    device memory (read back for the checks), every direction through the driver.

    ``max_in_flight`` per direction bounds the slab pool (it grows to the peak number of
    transfers in flight: at most 4 x 256 slabs of 6 KiB by default), so resident memory over
    the run shows leaks rather than the pool growing; a submit refused for it polls and
    retries."""
    rng = np.random.default_rng(seed)
    rep = StressReport(transfers=transfers, by_direction=dict.fromkeys(DIRECTIONS, 0))
    rep.max_in_flight = max_in_flight
    max_shift = 1 * MiB
    eng = blockswap.Engine(backend, max_in_flight=max_in_flight)
    try:
        mem: dict[str, Any] = {
            # sources: random bytes, never zero (a lost copy leaves a zero where one is expected)
            "hs": rng.integers(1, 256, region + max_shift, dtype=np.uint8),
            "ds": rng.integers(1, 256, region + max_shift, dtype=np.uint8),
            "hd": np.zeros(region, dtype=np.uint8),
            "dd": np.zeros(region, dtype=np.uint8),
        }
        if backend == "cuda":
            mem = {name: _on_gpu(name, arr) for name, arr in mem.items()}
            for arr in mem.values():
                eng.register(arr.tensor)
            base = {name: arr.tensor.data_ptr() for name, arr in mem.items()}
        else:
            for name, arr in mem.items():
                eng.register(arr, kind="host" if name[0] == "h" else "device")
            base = {name: arr.ctypes.data for name, arr in mem.items()}
        t0 = time.perf_counter()
        done = 0
        while done < transfers:
            n = min(per_round, transfers - done)
            _round(eng, rng, mem, base, n, region, max_shift, poll_every, rep)
            done += n
            rep.rounds += 1
            if rep.rounds == WARMUP_ROUNDS or (done >= transfers and not rep.rss_start):
                rep.rss_start = rss_bytes()
                rep.pool_bytes_start = eng.stats()["pool"]["bytes"]
            if done >= transfers // 2 and not rep.rss_middle:
                rep.rss_middle = rss_bytes()
        rep.seconds = time.perf_counter() - t0
        rep.rss_end = rss_bytes()
        stats = eng.stats()
        rep.pool = dict(stats["pool"])
        if stats["in_flight"] != 0:
            raise StressFailure(f"{stats['in_flight']} transfers still in flight at the end")
        if rep.pool["free"] != rep.pool["slabs"]:
            raise StressFailure(f"descriptor pool not whole at the end: {rep.pool}")
        for d in DIRECTIONS:
            lane = stats[d]
            if (lane["transfers"], lane["failed"]) != (rep.by_direction[d], 0):
                raise StressFailure(f"{d} stats {lane} disagree with {rep.by_direction[d]} sent")
        if sum(stats[d]["bytes"] for d in DIRECTIONS) != rep.bytes:
            raise StressFailure("the engine's byte counts disagree with the bytes submitted")
    finally:
        eng.shutdown()
    return rep


def _round(
    eng: blockswap.Engine,
    rng: np.random.Generator,
    mem: dict[str, np.ndarray],
    base: dict[str, int],
    n: int,
    region: int,
    max_shift: int,
    poll_every: int,
    rep: StressReport,
) -> None:
    mem["hd"].fill(0)
    mem["dd"].fill(0)
    # Transfers: a direction and 1-8 descriptors each (mostly few).
    dirs = rng.integers(0, 4, n)
    counts = np.minimum(rng.geometric(0.45, n), 8)
    job_of = np.repeat(np.arange(n), counts)
    m = int(job_of.shape[0])
    sizes = np.exp(rng.uniform(0.0, np.log(4 * KiB), m)).astype(np.int64)
    big = rng.random(m) < 1 / 200
    sizes[big] = np.exp(rng.uniform(np.log(4 * KiB), np.log(256 * KiB), int(big.sum()))).astype(
        np.int64
    )
    gaps = rng.integers(0, 64, m)
    gaps[rng.random(m) < 0.2] = 0  # adjacent descriptors: coalescing
    desc_dir = dirs[job_of]
    dst_region = np.where((desc_dir == 0) | (desc_dir == 3), 1, 0)  # 1: "dd", 0: "hd"
    shift = rng.integers(0, max_shift, 4)
    dst_off = np.empty(m, dtype=np.int64)
    src_ptr = np.empty(m, dtype=np.int64)
    dst_ptr = np.empty(m, dtype=np.int64)
    for code, dname in ((0, "hd"), (1, "dd")):
        idx = np.flatnonzero(dst_region == code)
        order = idx[rng.permutation(idx.shape[0])]  # scattered over the region
        span = sizes[order] + gaps[order]
        ends = np.cumsum(span)
        if ends.shape[0] and ends[-1] > region:
            raise ValueError(f"round does not fit: {int(ends[-1])} bytes > region {region}")
        dst_off[order] = ends - sizes[order]
        dst_ptr[idx] = base[dname] + dst_off[idx]
        # expected image of this region: the shifted source where a descriptor landed, else 0
        sel = np.zeros(region, dtype=np.int8)  # 0: gap, 1 + direction: written from its source
        seg_lens = np.empty(2 * order.shape[0] + 1, dtype=np.int64)
        seg_vals = np.zeros(2 * order.shape[0] + 1, dtype=np.int8)
        seg_lens[0:-1:2] = gaps[order]
        seg_lens[1::2] = sizes[order]
        seg_vals[1::2] = 1 + desc_dir[order]
        seg_lens[-1] = region - (int(ends[-1]) if ends.shape[0] else 0)
        sel[:] = np.repeat(seg_vals, seg_lens)
        mem[f"sel_{dname}"] = sel
    for d in range(4):
        name = DIRECTIONS[d]
        on = desc_dir == d
        src_ptr[on] = base[_SRC[name]] + dst_off[on] + int(shift[d])
    starts = np.concatenate(([0], np.cumsum(counts)))
    job_bytes = np.add.reduceat(sizes, starts[:-1])
    # Job ids: a random window, so ids are reused across rounds once reported.
    first_id = int(rng.integers(0, 1 << 40))
    seen = np.zeros(n, dtype=np.int64)
    names = [DIRECTIONS[int(d)] for d in dirs]

    def collect(results: list[Any]) -> None:
        for r in results:
            j = r.job_id - first_id
            if not 0 <= j < n:
                raise StressFailure(f"unknown job id {r.job_id} reported")
            if not r.success or r.bytes != job_bytes[j]:
                raise StressFailure(f"job {r.job_id}: {r!r}, expected {int(job_bytes[j])} bytes")
            seen[j] += 1

    submit, poll = eng.submit, eng.get_finished
    for t in range(n):
        a, b = starts[t], starts[t + 1]
        while True:
            try:
                submit(first_id + t, src_ptr[a:b], dst_ptr[a:b], sizes[a:b], names[t])
                break
            except blockswap.PoolExhaustedError:
                rep.retries += 1
                collect(poll())
        if t % poll_every == poll_every - 1:
            collect(poll())
    eng.wait(range(first_id, first_id + n))
    collect(poll())
    if (seen != 1).any():
        bad = int(np.flatnonzero(seen != 1)[0])
        raise StressFailure(f"job {first_id + bad} reported {int(seen[bad])} times")
    for dname in ("hd", "dd"):
        sel = mem.pop(f"sel_{dname}")
        got = mem[dname]
        want = np.zeros(region, dtype=np.uint8)
        for d in range(4):
            name = DIRECTIONS[d]
            if _DST[name] != dname:
                continue
            s = int(shift[d])
            src = mem[_SRC[name]][s : s + region]
            np.copyto(want, src, where=sel == 1 + d)
        if not np.array_equal(got, want):
            diff = np.flatnonzero(got != want)
            raise StressFailure(
                f"{dname}: {diff.shape[0]} bytes differ after round {rep.rounds}, first at "
                f"offset {int(diff[0])} (got {int(got[diff[0]])}, want {int(want[diff[0]])})"
            )
    rep.descriptors += m
    rep.bytes += int(sizes.sum())
    for d in range(4):
        rep.by_direction[DIRECTIONS[d]] += int((dirs == d).sum())


def main() -> int:
    n = int(os.environ.get("BLOCKSWAP_STRESS_TRANSFERS", DEFAULT_TRANSFERS))
    rep = run_stress(n, backend=os.environ.get("BLOCKSWAP_STRESS_BACKEND", "host"))
    out = asdict(rep)
    out["rss_growth"] = rep.rss_growth
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
