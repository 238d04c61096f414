"""What is validated is what is used: another thread writing a submit's arrays cannot get an
unchecked address or block id to a copy.

Each case runs a thread that flips one destination (an address, or a block id) between a valid
value and one the engine must refuse (an unregistered address, an id past the table) while the
main thread submits the same arrays again and again for over a second. Every submit must either
be refused with a typed error or move the valid bytes; memory outside what the transfer may
write (an unregistered buffer, the block just past a table) never changes; no panic; the
descriptor pool is whole at the end. Before the bindings copied the caller's arrays, the address
case wrote into the unregistered buffer within a second, and the block-id cases wrote past the
table or panicked.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import pytest

import blockswap
from blockswap import Route

SECONDS = 1.5
# Enough work per submit that the flipping thread runs while the core reads the arrays.
SEG = 64  # bytes of one page
N = 2048  # blocks in each table; the buffers hold one more, the canary


@contextmanager
def _fast_switching() -> Iterator[None]:
    """Python threads take turns far more often than every 5 ms, so the flipper runs between
    a submit's steps as often as it can."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


def _flip(
    arr: np.ndarray, index: np.ndarray, bad: np.ndarray, stop: threading.Event, count: list[int]
) -> None:
    # Scalar stores, many per second: each element spends as little time as possible in either
    # state, so that a check and a later read of the same element see different values.
    flips = [(int(i), int(b), int(arr[i])) for i, b in zip(index, bad)]
    while not stop.is_set():
        for _ in range(100):
            for i, b, g in flips:
                arr[i] = b
                arr[i] = g
        count[0] += 1


def _hammer(
    eng: blockswap.Engine,
    submit: Callable[[int], None],
    arr: np.ndarray,
    index: np.ndarray,
    bad: np.ndarray,
) -> tuple[int, int]:
    """Submits for SECONDS while another thread flips ``arr[index]`` between its values and
    ``bad``; returns (submits accepted, rounds of flips made meanwhile)."""
    stop = threading.Event()
    count = [0]
    flipper = threading.Thread(target=_flip, args=(arr, index, bad, stop, count))
    accepted = 0
    with _fast_switching():
        flipper.start()
        try:
            job, end = 0, time.monotonic() + SECONDS
            while time.monotonic() < end:
                job += 1
                try:
                    submit(job)
                except blockswap.InvalidTransferError:
                    continue
                accepted += 1
                eng.wait([job])
                results = eng.get_finished()
                assert [r.job_id for r in results] == [job]
                assert results[0].success, results[0].error
        finally:
            stop.set()
            flipper.join()
    eng.get_finished()
    pool = eng.stats()["pool"]
    assert pool["free"] == pool["slabs"], f"the descriptor pool is not whole: {pool}"
    return accepted, count[0]


def test_a_flipped_destination_address_never_reaches_a_copy() -> None:
    n = 16384
    src = (np.arange(n * 64) % 251 + 1).astype(np.uint8)
    dst = np.zeros_like(src)
    outside = np.zeros(n * 64, np.uint8)  # never registered
    with blockswap.Engine("host") as eng:
        eng.register(src, kind="host")
        eng.register(dst, kind="device")
        srcs = src.ctypes.data + np.arange(n, dtype=np.int64) * 64
        # In reverse order, so no descriptor continues its predecessor (nothing to coalesce):
        # the batch takes the validation's fast pass, which checked a block, then copied it.
        dsts = dst.ctypes.data + np.arange(n, dtype=np.int64)[::-1] * 64
        sizes = np.full(n, 64, np.int64)
        # A few destinations, at different places in the validation's blocks of 64, flip into
        # the unregistered buffer.
        i = np.array([n // 4 + 17, n // 2 - 192, 3 * n // 4 + 40])
        bad = outside.ctypes.data + 64 * i

        def submit(job: int) -> None:
            eng.submit(job, srcs, dsts, sizes, "h2d")

        accepted, flips = _hammer(eng, submit, dsts, i, bad)
    assert not outside.any(), "bytes were written into unregistered memory"
    assert accepted > 0 and flips > 0, (accepted, flips)
    assert (dst.reshape(n, 64)[::-1] == src.reshape(n, 64)).all()


@dataclass
class Tables:
    eng: blockswap.Engine
    host: np.ndarray  # block-major: N + 1 blocks of two segments
    device: np.ndarray  # two layers of N + 1 pages, in one allocation
    host_table: int
    device_table: int

    def device_canary(self) -> np.ndarray:
        return self.device.reshape(2, N + 1, SEG)[:, N]

    def host_canary(self) -> np.ndarray:
        return self.host.reshape(N + 1, 2 * SEG)[N]


@pytest.fixture
def tables() -> Iterator[Tables]:
    host = (np.arange((N + 1) * 2 * SEG) % 251 + 1).astype(np.uint8)
    host[N * 2 * SEG :] = 0  # the canary block
    device = np.zeros(2 * (N + 1) * SEG, np.uint8)
    with blockswap.Engine("host") as eng:
        eng.register(host, kind="host")
        eng.register(device, kind="device")
        h, d = host.ctypes.data, device.ctypes.data
        host_table = eng.register_table([h, h + SEG], [2 * SEG] * 2, [SEG] * 2, N, "host")
        device_table = eng.register_table([d, d + (N + 1) * SEG], [SEG] * 2, [SEG] * 2, N, "device")
        yield Tables(eng, host, device, host_table, device_table)


def _h2d_cases(t: Tables) -> dict[str, Callable[[np.ndarray, np.ndarray, int], None]]:
    eng, h, d = t.eng, t.host_table, t.device_table
    return {
        "submit_blocks": lambda s, x, job: eng.submit_blocks(job, h, s, d, x, "h2d"),
        "submit_block_runs": lambda s, x, job: eng.submit_block_runs(job, h, s, d, x, "h2d"),
        "submit_groups": lambda s, x, job: eng.submit_groups(job, [(h, s, d, x, None)], "h2d"),
        "submit_group": lambda s, x, job: eng.submit_group(job, h, s, d, x, None, "h2d"),
        "submit_spec": lambda s, x, job: eng.submit_spec(
            job, x, s, [len(x)], [0], [((h, d),)], 1, "h2d"
        ),
        "submit_groups runs": lambda s, x, job: eng.submit_groups(
            job, [(h, s, d, x, None)], "h2d", route=Route.blocks()
        ),
        "submit_groups staged": lambda s, x, job: eng.submit_groups(
            job, [(h, s, d, x, None)], "h2d", route=Route.staged()
        ),
    }


@pytest.mark.parametrize(
    "entry",
    [
        "submit_blocks",
        "submit_block_runs",
        "submit_groups",
        "submit_group",
        "submit_spec",
        "submit_groups runs",
        "submit_groups staged",
    ],
)
def test_a_flipped_destination_block_id_never_reaches_a_copy(tables: Tables, entry: str) -> None:
    submit = _h2d_cases(tables)[entry]
    src_ids = np.arange(N, dtype=np.int64)
    dst_ids = np.arange(N, dtype=np.int64)[::-1].copy()
    # A few destination ids flip to one past the table (the canary page of each layer).
    i = np.array([N // 4 + 5, N // 2, 3 * N // 4 + 9])
    accepted, flips = _hammer(
        tables.eng, lambda job: submit(src_ids, dst_ids, job), dst_ids, i, np.full(len(i), N)
    )
    assert not tables.device_canary().any(), "bytes were written past the table"
    assert accepted > 0 and flips > 0, (accepted, flips)


@pytest.mark.parametrize("one", ["groups", "group", "spec"])
def test_a_flipped_chunk_id_never_reaches_a_copy(one: str) -> None:
    host = np.zeros((N + 2) * 2 * SEG, np.uint8)
    device = (np.arange(2 * N * SEG) % 251 + 1).astype(np.uint8)
    with blockswap.Engine("host") as eng:
        eng.register(host, kind="host")
        eng.register(device, kind="device")
        h, d = host.ctypes.data, device.ctypes.data
        # Chunks of two sub-blocks: N // 2 chunks in the table, one more in the buffer.
        host_table = eng.register_table([h, h + SEG], [2 * SEG] * 2, [SEG] * 2, N, "host", unit=2)
        device_table = eng.register_table([d, d + N * SEG], [SEG] * 2, [SEG] * 2, N, "device")
        gpu_ids = np.arange(N, dtype=np.int64)
        chunk_ids = np.arange(N // 2, dtype=np.int64)
        i = np.array([N // 8, N // 4 + 3])

        def submit(job: int) -> None:
            if one == "group":
                eng.submit_group(job, device_table, gpu_ids, host_table, chunk_ids, 0, "d2h")
            elif one == "spec":
                pairs = [((device_table, host_table),)]
                eng.submit_spec(job, gpu_ids, chunk_ids, [N], [0], pairs, 2, "d2h")
            else:
                eng.submit_groups(job, [(device_table, gpu_ids, host_table, chunk_ids, 0)], "d2h")

        accepted, flips = _hammer(eng, submit, chunk_ids, i, np.full(len(i), N // 2))
    assert not host[N * 2 * SEG :].any(), "bytes were written past the table"
    assert accepted > 0 and flips > 0, (accepted, flips)
