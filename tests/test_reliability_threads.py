"""Reliability, 4. Threads submitting and polling one pair of handlers; threads registering and
unregistering one engine's memory."""

from __future__ import annotations

import contextlib
import sys
import threading
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch

from blockswap import Engine, InvalidTransferError
from blockswap.handler import CpuGpuHandlers
from kv_helpers import fill_random
from reliability_helpers import join_all, kv_cache


@pytest.mark.parametrize("factor", [1, 4])
def test_threads_submit_and_poll_one_handler(factor: int) -> None:
    """Six threads share one CpuGpuHandlers: each owns 8 GPU blocks and 4 CPU blocks, offloads
    blocks of its own to its CPU blocks and loads them back into its other GPU blocks, 60 rounds,
    polling get_finished itself while two more threads poll too; bytes are checked after each
    round, every result is reported exactly once over all pollers."""
    nthreads, rounds = 6, 60
    gpu = kv_cache(layers=4, blocks=8 * nthreads)
    h = CpuGpuHandlers(gpu, 4 * nthreads, layout="kv_split", block_size_factor=factor,
                       backend="host")  # fmt: skip
    (cpu,) = h.cpu_caches
    fill_random(gpu + cpu, torch.Generator().manual_seed(6))
    reported: list[Any] = []
    lock = threading.Lock()
    errors: list[BaseException] = []
    barrier = threading.Barrier(nthreads + 2)
    done = threading.Event()

    def record(results: list[Any]) -> None:
        if results:
            with lock:
                reported.extend(results)

    def work(t: int) -> None:
        try:
            rng = np.random.default_rng(t)
            mine = np.arange(8 * t, 8 * t + 8)
            cpu_mine = np.arange(4 * t, 4 * t + 4)
            barrier.wait()
            for i in range(rounds):
                n = factor if factor > 1 else int(rng.integers(1, 5))  # at most half of 8
                src = rng.permutation(mine)[:n]
                cblocks = rng.permutation(cpu_mine)[: -(-n // factor)]
                rest = np.setdiff1d(mine, src)
                back = rng.permutation(rest)[:n]
                jo, jl = (t << 32) + 2 * i, (t << 32) + 2 * i + 1
                before = [t_.view(torch.int16)[:, src].clone() for t_ in gpu]
                h.d2h.transfer_async(jo, (src, cblocks))
                record(h.get_finished())
                h.wait([jo])
                h.h2d.transfer_async(jl, (cblocks, back))
                record(h.h2d.get_finished())
                h.wait([jl])
                for t_, b in zip(gpu, before):
                    assert torch.equal(t_.view(torch.int16)[:, back], b), (t, i)
        except BaseException as e:
            errors.append(e)

    def poll() -> None:
        barrier.wait()
        while not done.is_set():
            record(h.get_finished())

    workers = [threading.Thread(target=work, args=(t,)) for t in range(nthreads)]
    pollers = [threading.Thread(target=poll) for _ in range(2)]
    try:
        for t in workers + pollers:
            t.start()
        join_all(workers)
        done.set()
        join_all(pollers)
        record(h.get_finished())
        assert not errors, errors[0]
        want = Counter((t << 32) + k for t in range(nthreads) for k in range(2 * rounds))
        assert Counter(r.job_id for r in reported) == want, "a result lost or reported twice"
        assert all(r.success for r in reported)
        page = h.gpu_tables[0].page_bytes
        assert all(r.bytes % page == 0 and r.bytes > 0 for r in reported)
        stats = h.stats()
        assert stats["d2h"]["transfers"] == stats["h2d"]["transfers"] == nthreads * rounds
    finally:
        h.shutdown()


def test_an_array_unregistered_and_registered_at_once_is_kept_while_registered() -> None:
    """Two threads unregister an array while a third registers it again, 5,000 times: whichever
    wins, the engine keeps the array alive exactly while the core holds its registration (it
    once let go of an array the core still held: a later copy wrote into freed memory)."""
    eng = Engine("host")
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(5000):
            arr = np.zeros(4096, np.uint8)
            p = eng.register(arr)
            barrier = threading.Barrier(3)

            def call(f: Any, arr: np.ndarray = arr, barrier: Any = barrier) -> None:
                barrier.wait()
                with contextlib.suppress(InvalidTransferError):  # the other call came first
                    f(arr)

            calls = (eng.unregister, eng.unregister, eng.register)
            ts = [threading.Thread(target=call, args=(f,)) for f in calls]
            for t in ts:
                t.start()
            join_all(ts)
            kept = eng._kept.get(p) is arr
            try:
                eng._unregister(p)  # the core's registration alone
                registered = True
            except InvalidTransferError:
                registered = False
            assert registered == kept, (registered, kept)
            eng._kept.pop(p, None)
    finally:
        sys.setswitchinterval(interval)
        eng.shutdown()
