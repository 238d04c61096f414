"""stats() per direction: p50 and p99 of transfers' wall-clock time (submission to the poll that
reports it) and of submissions' host time, and counts of refused and failed submissions."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import blockswap
from blockswap import InvalidTransferError, PoolExhaustedError
from blockswap.handler import CpuGpuHandlers

KEYS = ("wall_p50", "wall_p99", "submit_p50", "submit_p99", "refused", "submit_failed")


def test_an_idle_engine_has_no_percentiles_and_nothing_refused() -> None:
    with blockswap.Engine("host") as e:
        for d in ("h2d", "d2h", "h2h", "d2d"):
            s = e.stats()[d]
            assert {k: s[k] for k in KEYS} == dict.fromkeys(KEYS[:4]) | {
                "refused": 0,
                "submit_failed": 0,
            }


def test_percentiles_and_refusals_on_the_host_backend() -> None:
    a = np.zeros(1 << 16, np.uint8)
    b = np.zeros(1 << 16, np.uint8)
    with blockswap.Engine("host", max_in_flight=8) as e:
        e.register(a, kind="host")
        e.register(b, kind="host")
        src, dst = a.ctypes.data, b.ctypes.data
        with pytest.raises(InvalidTransferError):  # outside registered memory
            e.submit(9, [src], [16], [4096], "h2h")
        for j in range(8):
            e.submit(j, [src + 4096 * j], [dst + 4096 * j], [4096], "h2h")
        with pytest.raises(PoolExhaustedError):  # 8 in flight or not yet polled
            e.submit(8, [src], [dst], [4096], "h2h")
        e.wait(range(8))
        time.sleep(0.05)  # reported 50 ms or more after submission
        assert len(e.get_finished()) == 8
        s = e.stats()["h2h"]
        assert s["refused"] == 2 and s["submit_failed"] == 0
        assert 0.05 * (1 - 1 / 32) <= s["wall_p50"] <= s["wall_p99"] < 5.0
        assert 0 < s["submit_p50"] <= s["submit_p99"] < 1.0
        assert e.stats()["d2h"]["refused"] == 0  # per direction


def test_the_handlers_stats_carry_them() -> None:
    caches = [torch.zeros(2, 8, 4, 2, 8) for _ in range(2)]
    with CpuGpuHandlers(caches, 8, layout="kv_split", backend="host", max_in_flight=1) as h:
        h.d2h.transfer_async(1, ([0], [0]))
        with pytest.raises(PoolExhaustedError):
            h.d2h.transfer_async(2, ([1], [1]))
        h.wait([1])
        h.get_finished()
        s = h.stats()["d2h"]
        assert s["refused"] == 1 and s["wall_p50"] is not None and s["submit_p99"] is not None
        assert h.d2h.stats()["refused"] == 1 and h.h2d.stats()["refused"] == 0
