"""Reliability on the host backend: bad input, injected faults, shutdown, threads, load, and
property tests of the Python entry points. ``docs/reliability.md`` lists every case, the error a
user gets and the command that reproduces it.

Every refusal here is checked between two transfers that must come through intact: one submitted
before the bad call (in flight or finished, its result not yet reported) and one after it under
the job id the bad call used (so the refused call left nothing live behind), with every byte of
the destination memory accounted for.
"""

from __future__ import annotations

import gc
import itertools
import json
import logging
import math
import os
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from blockswap import (
    BackendError,
    BlockswapError,
    Engine,
    InvalidTransferError,
    PoolExhaustedError,
    ShutdownError,
)
from blockswap.handler import CpuGpuHandlers, _stream_handle
from blockswap.layout import LayoutError
from kv_helpers import assert_storage, block_bytes, fill_random, raw, snapshot, strided
from reliability_stress import DEFAULT_TRANSFERS, rss_bytes, run_stress

KiB = 1 << 10
MiB = 1 << 20
BEFORE, BAD = 1, 7  # job ids: the transfer before the bad call; the bad call's (reused after)
# A wait this long means a deadlock or a leak (what it waits for takes well under a second).
DEADLOCK = 300.0


def threads() -> frozenset[int]:
    """Task ids of this process's OS threads (the host backend runs one worker thread per
    engine). Ids, not a count: a thread of an earlier test may leave while a test measures.

    torch starts its intra-op thread pool at the first operation large enough to split (a
    block-major CPU cache is one such tensor): it is started here first, so that its threads are
    part of every baseline rather than counted as threads a test left behind (once: the RSS
    tests call this in their loops)."""
    if not _POOL_STARTED:
        torch.ones(1 << 20).add_(1)
        _POOL_STARTED.append(True)
    return frozenset(int(t) for t in os.listdir("/proc/self/task"))


_POOL_STARTED: list[bool] = []


def threads_settle(base: frozenset[int]) -> frozenset[int]:
    """The threads that are not in ``base`` once none is left, or after a deadlock-length wait:
    a joined thread leaves /proc/self/task a moment after the join returns."""
    deadline = time.monotonic() + DEADLOCK
    extra = threads() - base
    while extra and time.monotonic() < deadline:
        time.sleep(0.001)
        extra = threads() - base
    return extra


def drain(poll: Callable[[], list[Any]], want: int) -> list[Any]:
    """Polls until ``want`` results came (the caller waited for them first)."""
    out: list[Any] = []
    while len(out) < want:
        got = poll()
        assert got or len(out) < want, "results missing"
        out += got
    return out


# --------------------------------------------------------------------------------------------
# 1. Bad input: the engine (address batches, registration, block tables, options)
# --------------------------------------------------------------------------------------------


class Scene:
    """An engine (at most 16 descriptors per transfer) with a 1 MiB random host source and a
    zeroed 1 MiB "device" destination; the upper halves also carry block tables (64 blocks of
    4 KiB each side). :meth:`before` and :meth:`after` are the transfers around the bad call."""

    def __init__(self) -> None:
        self.eng = Engine("host", max_descriptors=16)
        rng = np.random.default_rng(5)
        self.src = rng.integers(1, 256, MiB, dtype=np.uint8)
        self.dst = np.zeros(MiB, dtype=np.uint8)
        self.eng.register(self.src, kind="host")
        self.eng.register(self.dst, kind="device")
        self.s, self.d = self.src.ctypes.data, self.dst.ctypes.data
        half = MiB // 2
        self.host_table = self.eng.register_table(
            [self.s + half], [4 * KiB], [4 * KiB], 64, "host", "CPU"
        )
        self.dev_table = self.eng.register_table(
            [self.d + half], [4 * KiB], [4 * KiB], 64, "device", "GPU"
        )

    def ids(self, *values: Any) -> np.ndarray:
        return np.array(values, dtype=np.int64)

    def before(self) -> None:
        self.eng.submit(BEFORE, [self.s], [self.d], [64 * KiB], "h2d")

    def after(self) -> None:
        """The job id of the bad call works now; both transfers report once, with their bytes;
        nothing else in the destination changed."""
        eng, s, d = self.eng, self.s, self.d
        eng.submit(BAD, [s + 64 * KiB], [d + 128 * KiB], [64 * KiB], "h2d")
        eng.wait([BEFORE, BAD])
        results = drain(eng.get_finished, 2)
        assert sorted((r.job_id, r.success, r.bytes) for r in results) == [
            (BEFORE, True, 64 * KiB),
            (BAD, True, 64 * KiB),
        ]
        assert eng.get_finished() == []
        assert np.array_equal(self.dst[: 64 * KiB], self.src[: 64 * KiB])
        assert np.array_equal(self.dst[128 * KiB : 192 * KiB], self.src[64 * KiB : 128 * KiB])
        assert not self.dst[64 * KiB : 128 * KiB].any(), "the bad call wrote"
        assert not self.dst[192 * KiB :].any(), "the bad call wrote"
        stats = eng.stats()
        assert stats["in_flight"] == 0
        assert stats["pool"]["free"] == stats["pool"]["slabs"], "a slab did not come home"
        # the block tables still work
        eng.submit_blocks(BAD, self.host_table, self.ids(3), self.dev_table, self.ids(5))
        eng.wait([BAD])
        assert [(r.job_id, r.success) for r in eng.get_finished()] == [(BAD, True)]
        half = MiB // 2
        got = self.dst[half + 5 * 4 * KiB : half + 6 * 4 * KiB]
        assert np.array_equal(got, self.src[half + 3 * 4 * KiB : half + 4 * 4 * KiB])


class StreamLike:
    """Stands in for a torch.cuda.Stream (an object, not the raw handle the core takes)."""

    cuda_stream = 12345


def _two_d(sc: Scene) -> None:
    sc.eng.submit(BAD, [[sc.s]], [[sc.d + 256 * KiB]], [[8]])


# (id, bad call, error type, message excerpt). Cases already in test_engine.py's
# test_bad_input_raises_and_leaves_earlier_transfers_intact are not repeated here.
ENGINE_CASES: list[tuple[str, Callable[[Scene], Any], type[Exception], str]] = [
    # address batches
    ("sizes-nan", lambda sc: sc.eng.submit(BAD, [sc.s], [sc.d + 256 * KiB], [math.nan]),
     InvalidTransferError, "sizes must hold integers, not float64"),
    ("src-nan", lambda sc: sc.eng.submit(BAD, [math.nan], [sc.d + 256 * KiB], [8]),
     InvalidTransferError, "src_ptrs must hold integers, not float64"),
    ("src-none-element", lambda sc: sc.eng.submit(BAD, [sc.s, None], [sc.d, sc.d + 8], [8, 8]),
     InvalidTransferError, "src_ptrs must hold integers, not object"),
    ("sizes-none", lambda sc: sc.eng.submit(BAD, [sc.s], [sc.d + 256 * KiB], None),
     InvalidTransferError, "sizes must be one-dimensional"),
    ("two-dimensional", _two_d, InvalidTransferError, "must be one-dimensional"),
    ("src-past-2**64", lambda sc: sc.eng.submit(BAD, [2**64], [sc.d + 256 * KiB], [8]),
     InvalidTransferError, r"src_ptrs holds 18446744073709551616, outside int64 \[-2\*\*63, 2\*\*63\)"),
    ("size-past-region", lambda sc: sc.eng.submit(BAD, [sc.s], [sc.d + 256 * KiB], [2**62]),
     InvalidTransferError, "not inside registered host memory"),
    ("size-uint64-max",
     lambda sc: sc.eng.submit(BAD, [sc.s], [sc.d + 256 * KiB], np.array([2**64 - 1], np.uint64)),
     InvalidTransferError, r"sizes holds values past 2\*\*63 - 1"),
    ("dst-address-overflow", lambda sc: sc.eng.submit(BAD, [sc.s], [-4], [8]),
     InvalidTransferError, "destination range of descriptor 0 overflows"),
    ("too-many-descriptors",
     lambda sc: sc.eng.submit(BAD, sc.s + np.arange(17) * 64, sc.d + 256 * KiB + np.arange(17) * 64,
                              [8] * 17),
     InvalidTransferError, "17 descriptors in one transfer; at most 16"),
    ("job-id-2**64", lambda sc: sc.eng.submit(2**64, [sc.s], [sc.d + 256 * KiB], [8]),
     InvalidTransferError, r"job_id must be a non-negative int below 2\*\*64, not 18446744073709551616"),
    ("job-id-none", lambda sc: sc.eng.submit(None, [sc.s], [sc.d + 256 * KiB], [8]),
     InvalidTransferError, "job_id must be a non-negative int, not None"),
    ("job-id-float", lambda sc: sc.eng.submit(7.0, [sc.s], [sc.d + 256 * KiB], [8]),
     InvalidTransferError, "job_id must be a non-negative int, not 7.0"),
    ("job-id-bool", lambda sc: sc.eng.submit(True, [sc.s], [sc.d + 256 * KiB], [8]),
     InvalidTransferError, "job_id must be a non-negative int, not True"),
    ("job-id-negative-numpy", lambda sc: sc.eng.submit(np.int64(-7), [sc.s], [sc.d], [8]),
     InvalidTransferError, "job_id must be a non-negative int"),
    ("job-id-reused-while-live", lambda sc: sc.eng.submit(BEFORE, [sc.s], [sc.d + 256 * KiB], [8]),
     InvalidTransferError, "job id 1 is still live"),
    ("direction-none", lambda sc: sc.eng.submit(BAD, [sc.s], [sc.d + 256 * KiB], [8], None),
     InvalidTransferError, "direction must be 'h2d', 'd2h', 'h2h' or 'd2d', not None"),
    ("direction-int", lambda sc: sc.eng.submit(BAD, [sc.s], [sc.d + 256 * KiB], [8], 0),
     InvalidTransferError, "direction must be"),
    ("direction-upper-case", lambda sc: sc.eng.submit(BAD, [sc.s], [sc.d + 256 * KiB], [8], "H2D"),
     InvalidTransferError, "direction must be"),
    ("device-address-as-host-source", lambda sc: sc.eng.submit(BAD, [sc.d + 300 * KiB], [sc.d + 256 * KiB], [8]),
     InvalidTransferError, "source range of descriptor 0 .* not inside registered host memory"),
    ("host-address-as-device-destination", lambda sc: sc.eng.submit(BAD, [sc.s], [sc.s + 8], [8]),
     InvalidTransferError, "destination range of descriptor 0 .* not inside registered device"),
    ("wait-stream-negative",
     lambda sc: sc.eng.submit(BAD, [sc.s], [sc.d + 256 * KiB], [8], wait_stream=-1),
     InvalidTransferError, "wait_stream must be a raw CUstream int"),
    ("wait-stream-object",
     lambda sc: sc.eng.submit(BAD, [sc.s], [sc.d + 256 * KiB], [8], wait_stream=StreamLike()),
     InvalidTransferError, r"wait_stream must be a raw CUstream int \(e.g. torch.cuda"),
    ("wait-stream-str",
     lambda sc: sc.eng.submit(BAD, [sc.s], [sc.d + 256 * KiB], [8], wait_stream="0"),
     InvalidTransferError, "wait_stream must be"),
    ("kernel-below-negative",
     lambda sc: sc.eng.submit(BAD, [sc.s], [sc.d + 256 * KiB], [8], kernel_below=-1),
     InvalidTransferError, "kernel_below must be a non-negative int"),
    ("launcher-not-callable",
     lambda sc: sc.eng.submit(BAD, [sc.s], [sc.d + 256 * KiB], [8], kernel_below=64, launcher=5),
     InvalidTransferError, "launcher must be callable or None, not 5"),
    # wait
    ("wait-negative-id", lambda sc: sc.eng.wait([-1]),
     InvalidTransferError, r"job_id must be a non-negative int below 2\*\*64, not -1"),
    ("wait-none-id", lambda sc: sc.eng.wait([None]), InvalidTransferError, "not None"),
    ("wait-float-id", lambda sc: sc.eng.wait([1.5]), InvalidTransferError, "not 1.5"),
    ("wait-not-iterable", lambda sc: sc.eng.wait(None),
     InvalidTransferError, "job_ids must be an iterable of job ids, not NoneType"),
    ("wait-negative-timeout", lambda sc: sc.eng.wait([BEFORE], timeout=-1),
     InvalidTransferError, "timeout must be a non-negative number"),
    ("wait-nan-timeout", lambda sc: sc.eng.wait([BEFORE], timeout=math.nan),
     InvalidTransferError, "timeout must be a non-negative number"),
    ("wait-str-timeout", lambda sc: sc.eng.wait([BEFORE], timeout="1"), TypeError,
     "timeout must be a number of seconds, not '1'"),
    # registration
    ("register-negative-address", lambda sc: sc.eng.register(-1, 8, "host"),
     InvalidTransferError, "ptr must be a non-negative int below 2\\*\\*64, not -1"),
    ("register-zero-bytes", lambda sc: sc.eng.register(4096, 0, "host"),
     InvalidTransferError, "nbytes must be a positive int"),
    ("register-negative-bytes", lambda sc: sc.eng.register(4096, -8, "host"),
     InvalidTransferError, "nbytes must be a positive int"),
    ("register-float-bytes", lambda sc: sc.eng.register(4096, 8.5, "host"),
     InvalidTransferError, "nbytes must be a positive int, not 8.5"),
    ("register-overflowing-range", lambda sc: sc.eng.register(2**64 - 8, 16, "host"),
     InvalidTransferError, "empty or overflowing range"),
    ("register-unknown-kind", lambda sc: sc.eng.register(np.zeros(8, np.uint8), kind="gpu"),
     InvalidTransferError, "kind must be 'host' or 'device'"),
    ("register-kind-none-raw", lambda sc: sc.eng.register(4096, 8, None),
     InvalidTransferError, "a raw address needs nbytes and kind"),
    ("register-overlap", lambda sc: sc.eng.register(sc.dst[100:200], kind="host"),
     InvalidTransferError, "overlaps the registered device region"),
    ("register-meta-tensor", lambda sc: sc.eng.register(torch.empty(16, device="meta")),
     InvalidTransferError, "cannot register a tensor on meta"),
    ("register-non-contiguous-tensor", lambda sc: sc.eng.register(torch.zeros(8, 8)[:, ::2]),
     InvalidTransferError, "a registered tensor must be contiguous"),
    ("register-more-than-the-object", lambda sc: sc.eng.register(np.zeros(8, np.uint8), 9),
     InvalidTransferError, "nbytes=9 is larger than the object"),
    ("register-none", lambda sc: sc.eng.register(None),
     InvalidTransferError, "cannot register NoneType"),
    ("register-bytes-object", lambda sc: sc.eng.register(b"abc"),
     InvalidTransferError, "cannot register bytes"),
    ("pin-meta-tensor", lambda sc: sc.eng.pin(torch.empty(16, device="meta")),
     InvalidTransferError, "cannot pin a tensor on meta"),
    ("pin-registered", lambda sc: sc.eng.pin(sc.src), InvalidTransferError, "overlaps"),
    ("unregister-unknown", lambda sc: sc.eng.unregister(sc.s + 1),
     InvalidTransferError, "no registered region starts at"),
    ("unregister-negative", lambda sc: sc.eng.unregister(-1),
     InvalidTransferError, "ptr must be a non-negative int"),
    ("unregister-none", lambda sc: sc.eng.unregister(None),
     InvalidTransferError, "cannot unregister NoneType"),
    ("unregister-used-by-table", lambda sc: sc.eng.unregister(sc.dst),
     InvalidTransferError, "block table 1 lies in the region"),
    ("alloc-zero", lambda sc: sc.eng.alloc_host(0), InvalidTransferError, "positive int"),
    ("alloc-negative", lambda sc: sc.eng.alloc_host(-1), InvalidTransferError, "positive int"),
    ("alloc-float", lambda sc: sc.eng.alloc_host(1.5), InvalidTransferError, "nbytes must be a positive int, not 1.5"),
    ("alloc-unsatisfiable", lambda sc: sc.eng.alloc_host(2**62),
     BackendError, "could not allocate 4611686018427387904 bytes"),
    ("free-host-not-allocated", lambda sc: sc.eng.free_host(np.zeros(8, np.uint8)),
     InvalidTransferError, "no registered region starts at"),
    ("free-host-list", lambda sc: sc.eng.free_host([1, 2]),
     InvalidTransferError, "free_host takes an array from alloc_host, not list"),
    ("inject-negative", lambda sc: sc.eng.inject_failures(-1),
     InvalidTransferError, "count must be a non-negative int"),
    # block tables
    ("table-negative-nbytes", lambda sc: sc.eng.register_table([sc.s], [64], [-1], 4, "host"),
     InvalidTransferError, r"nbytes holds a negative value \(-1\)"),
    ("table-negative-base", lambda sc: sc.eng.register_table([-64], [64], [64], 4, "host"),
     InvalidTransferError, r"bases holds a negative value \(-64\)"),
    ("table-zero-nbytes", lambda sc: sc.eng.register_table([sc.s], [64], [0], 4, "host"),
     InvalidTransferError, "zero bytes per page"),
    ("table-zero-blocks", lambda sc: sc.eng.register_table([sc.s], [64], [64], 0, "host"),
     InvalidTransferError, "num_blocks must be a positive int"),
    ("table-negative-blocks", lambda sc: sc.eng.register_table([sc.s], [64], [64], -1, "host"),
     InvalidTransferError, "num_blocks must be a positive int"),
    ("table-stride-below-page", lambda sc: sc.eng.register_table([sc.s], [32], [64], 4, "host"),
     InvalidTransferError, "stride between blocks is smaller than a page"),
    ("table-past-registered-memory",
     lambda sc: sc.eng.register_table([sc.s], [4 * KiB], [4 * KiB], 257, "host"),
     InvalidTransferError, "is not inside registered host memory"),
    ("table-host-over-device-memory",
     lambda sc: sc.eng.register_table([sc.d], [64], [64], 4, "host"),
     InvalidTransferError, "is not inside registered host memory"),
    ("table-device-over-host-memory",
     lambda sc: sc.eng.register_table([sc.s], [64], [64], 4, "device"),
     InvalidTransferError, "is not inside registered device memory"),
    ("table-unknown-kind", lambda sc: sc.eng.register_table([sc.s], [64], [64], 4, "cpu"),
     InvalidTransferError, "kind must be 'host' or 'device'"),
    ("table-lengths-differ",
     lambda sc: sc.eng.register_table([sc.s, sc.s + 64], [128], [64], 4, "host"),
     InvalidTransferError, "2 bases, 1 strides, 1 sizes"),
    ("table-float-bases", lambda sc: sc.eng.register_table([float(sc.s)], [64], [64], 4, "host"),
     InvalidTransferError, "bases must hold integers"),
    ("table-unit-zero", lambda sc: sc.eng.register_table([sc.s], [64], [64], 4, "host", "X", 0),
     InvalidTransferError, "unit must be a positive int"),
    ("table-span-overflows",
     lambda sc: sc.eng.register_table([sc.s], [2**62], [64], 8, "host"),
     InvalidTransferError, "span overflows the address space"),
    # block-id transfers
    ("blocks-out-of-range",
     lambda sc: sc.eng.submit_blocks(BAD, 0, sc.ids(64), 1, sc.ids(0)),
     InvalidTransferError, "CPU block ids hold block id 64, out of range"),
    ("blocks-negative",
     lambda sc: sc.eng.submit_blocks(BAD, 0, sc.ids(0), 1, sc.ids(-3)),
     InvalidTransferError, r"GPU block ids hold a negative block id \(-3"),
    ("blocks-float", lambda sc: sc.eng.submit_blocks(BAD, 0, [0.0], 1, [1]),
     InvalidTransferError, "src_ids must hold integers, not float64"),
    ("blocks-nan", lambda sc: sc.eng.submit_blocks(BAD, 0, [0], 1, [math.nan]),
     InvalidTransferError, "dst_ids must hold integers, not float64"),
    ("blocks-none", lambda sc: sc.eng.submit_blocks(BAD, 0, [None], 1, [1]),
     InvalidTransferError, "src_ids must hold integers, not object"),
    ("blocks-duplicate-destination",
     lambda sc: sc.eng.submit_blocks(BAD, 0, sc.ids(0, 1), 1, sc.ids(9, 9)),
     InvalidTransferError, "GPU block id 9 is a destination more than once"),
    ("blocks-lengths-differ",
     lambda sc: sc.eng.submit_blocks(BAD, 0, sc.ids(0, 1), 1, sc.ids(2)),
     InvalidTransferError, "2 source block ids but 1 destination block ids"),
    ("blocks-empty", lambda sc: sc.eng.submit_blocks(BAD, 0, [], 1, []),
     InvalidTransferError, "empty transfer"),
    ("blocks-wrong-direction",
     lambda sc: sc.eng.submit_blocks(BAD, 1, sc.ids(0), 0, sc.ids(1), "h2d"),
     InvalidTransferError, "block table 1 is device memory; this direction needs host"),
    ("blocks-unknown-table", lambda sc: sc.eng.submit_blocks(BAD, 0, sc.ids(0), 9, sc.ids(1)),
     InvalidTransferError, "no block table 9"),
    ("blocks-negative-table", lambda sc: sc.eng.submit_blocks(BAD, -1, sc.ids(0), 1, sc.ids(1)),
     InvalidTransferError, "no block table -1"),
    ("blocks-job-id-live",
     lambda sc: sc.eng.submit_blocks(BEFORE, 0, sc.ids(0), 1, sc.ids(1)),
     InvalidTransferError, "job id 1 is still live"),
    ("blocks-incompatible-tables",
     lambda sc: sc.eng.submit_blocks(
         BAD, sc.eng.register_table([sc.s], [64], [32], 4, "host"), sc.ids(0), 1, sc.ids(1)),
     InvalidTransferError, "block tables differ"),
    ("unregister-table-unknown", lambda sc: sc.eng.unregister_table(9),
     InvalidTransferError, "no block table 9"),
    ("unregister-table-negative", lambda sc: sc.eng.unregister_table(-1),
     InvalidTransferError, "no block table -1"),
    # engine options (a second engine; the scene's is a bystander)
    ("engine-negative-max-in-flight", lambda sc: Engine("host", max_in_flight=-1),
     InvalidTransferError, "max_in_flight must be an int from 1 to 16384, not -1"),
    ("engine-negative-pool", lambda sc: Engine("host", pool_bytes=-1),
     InvalidTransferError, "pool_bytes must be an int from 6144 to"),
    ("engine-nan-shutdown-timeout", lambda sc: Engine("host", shutdown_timeout=math.nan),
     InvalidTransferError, "shutdown_timeout must be a non-negative number"),
    ("engine-unknown-backend", lambda sc: Engine("gpu"),
     InvalidTransferError, "backend must be 'auto', 'host' or 'cuda'"),
    ("engine-unknown-option", lambda sc: Engine("host", streams=2), TypeError, "streams"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [c[1:] for c in ENGINE_CASES],
    ids=[c[0] for c in ENGINE_CASES],
)
def test_engine_bad_input_is_typed_and_transfers_around_it_are_unaffected(
    call: Callable[[Scene], Any], error: type[Exception], match: str
) -> None:
    sc = Scene()
    try:
        sc.before()
        with pytest.raises(error, match=match) as e:
            call(sc)
        if error is not TypeError:
            assert isinstance(e.value, BlockswapError)
        sc.after()
    finally:
        sc.eng.shutdown()


def test_strided_and_foreign_integer_arrays_are_accepted() -> None:
    """Valid inputs that are not plain int64 arrays: strided views, big-endian, int32, uint64."""
    sc = Scene()
    try:
        big = np.array([sc.s + 4096, sc.s + 8192], dtype=">i8")
        cases = [
            ((sc.s + np.arange(0, 4096, 64))[::16], (sc.d + 300 * KiB + np.arange(0, 4096, 64))[::16],
             np.full(8, 8, np.int64)[::2]),
            (big, np.array([sc.d + 400 * KiB, sc.d + 401 * KiB], dtype=">i8"),
             np.array([16, 16], np.int32)),
            (np.array([sc.s], np.uint64), np.array([sc.d + 402 * KiB], np.uint64),
             np.array([32], np.uint64)),
        ]  # fmt: skip
        for j, (s, d, z) in enumerate(cases, start=20):
            sc.eng.submit(j, s, d, z, "h2d")
            sc.eng.wait([j])
            (r,) = sc.eng.get_finished()
            assert (r.job_id, r.success, r.bytes) == (j, True, int(np.asarray(z).sum()))
            for a, b, n in zip(np.asarray(s), np.asarray(d), np.asarray(z)):
                so, do = int(a) - sc.s, int(b) - sc.d
                assert np.array_equal(sc.dst[do : do + int(n)], sc.src[so : so + int(n)])
                sc.dst[do : do + int(n)] = 0
        sc.before()
        sc.after()
    finally:
        sc.eng.shutdown()


# --------------------------------------------------------------------------------------------
# 1. Bad input: the offloading handlers
# --------------------------------------------------------------------------------------------

N_GPU, N_CPU = 16, 8


def kv_cache(layers: int = 2, blocks: int = N_GPU) -> list[torch.Tensor]:
    return [strided((2, blocks, 4, 2, 8), torch.bfloat16, 1) for _ in range(layers)]


@dataclass
class HandlerScene:
    """Handlers over a small kv_split cache with random bytes; ``grouped`` makes two KV-cache
    groups (the Python descriptor path) instead of one (the core's block tables)."""

    h: CpuGpuHandlers
    gpu: list[list[torch.Tensor]]
    grouped: bool

    @classmethod
    def make(cls, factor: int, grouped: bool) -> HandlerScene:
        gpu = [kv_cache(), kv_cache(3)] if grouped else [kv_cache()]
        arg: Any = gpu if grouped else gpu[0]
        h = CpuGpuHandlers(arg, N_CPU, layout="kv_split", block_size_factor=factor, backend="host")
        fill_random([t for g in gpu + h.cpu_caches for t in g], torch.Generator().manual_seed(9))
        return cls(h, gpu, grouped)

    def spec(self, src: Any, dst: Any) -> Any:
        """The spec naming ``src`` / ``dst`` in the last group (the first group moves nothing)."""
        return ([[], src], [[], dst]) if self.grouped else (src, dst)

    def all_tensors(self) -> list[torch.Tensor]:
        return [t for g in self.gpu + self.h.cpu_caches for t in g]

    def expect_stored(
        self, want: dict[int, Any], group: int, pairs: Sequence[tuple[int, int]]
    ) -> None:
        """Writes into ``want`` (a snapshot) what storing GPU block ``gb`` into CPU block ``cb``,
        for each ``(gb, cb)`` of ``pairs``, does to group ``group``'s CPU cache."""
        for t, c in zip(self.gpu[group], self.h.cpu_caches[group]):
            for gb, cb in pairs:
                want[raw(c).data_ptr()][block_bytes(c, 1, cb)] = want[raw(t).data_ptr()][
                    block_bytes(t, 1, gb)
                ]


class Sparse:
    @staticmethod
    def ids() -> torch.Tensor:
        return torch.tensor([1]).to_sparse()


# (id, GPU -> CPU spec (GPU ids, CPU ids), message excerpt); the handler's own table of bad
# specs (test_handler.py::test_bad_transfer_raises_typed_error_and_issues_nothing) is not repeated.
HANDLER_CASES: list[tuple[str, Callable[[], Any], str]] = [
    ("nan", lambda: ([math.nan], [2]), "GPU block ids must hold integers, got dtype float64"),
    ("float-list", lambda: ([4.0], [2]), "must hold integers, got dtype float64"),
    ("none-element", lambda: ([4, None], [2, 3]), "must hold integers, got dtype object"),
    ("none-side", lambda: (None, [2]), "must hold integers, got dtype object"),
    ("int-past-int64", lambda: ([2**70], [2]), "must hold integers, got dtype object"),
    ("int64-max-cpu", lambda: ([4], [2**63 - 1]), "CPU block ids hold block id 9223372036854775807"),
    ("int64-min-cpu", lambda: ([4], [-(2**63)]), "CPU block ids hold a negative block id"),
    ("strings", lambda: (["4"], [2]), "must hold integers, got dtype <U1"),
    ("scalar", lambda: (4, 2), "must be 1-D, got shape ()"),
    ("generator", lambda: ((i for i in [4]), [2]), "must hold integers, got dtype object"),
    ("meta-tensor", lambda: (torch.tensor([4], device="meta"), [2]), "cannot read ids from this tensor"),
    ("sparse-tensor", lambda: (Sparse.ids(), [2]), "cannot read ids from this tensor"),
    ("float-tensor", lambda: (torch.tensor([4.0], requires_grad=True), [2]), "torch dtype torch.float32"),
    ("cpu-duplicate", lambda: ([4, 5], [2, 2]), "CPU block id 2 is a destination more than once"),
]  # fmt: skip


@pytest.mark.parametrize("grouped", [False, True], ids=["tables", "two-groups"])
@pytest.mark.parametrize(
    ("spec", "match"), [c[1:] for c in HANDLER_CASES], ids=[c[0] for c in HANDLER_CASES]
)
def test_handler_bad_spec_is_typed_and_transfers_around_it_are_unaffected(
    spec: Callable[[], Any], match: str, grouped: bool
) -> None:
    sc = HandlerScene.make(1, grouped)
    h = sc.h
    try:
        want = snapshot(sc.all_tensors())
        h.d2h.transfer_async(BEFORE, sc.spec([0, 1], [0, 1]))
        src, dst = spec()
        with pytest.raises(InvalidTransferError, match=match) as e:
            h.d2h.transfer_async(BAD, sc.spec(src, dst))
        assert f"d2h job {BAD}" in str(e.value)
        h.d2h.transfer_async(BAD, sc.spec([6], [6]))  # the refused id was never live
        h.wait([BEFORE, BAD])
        results = drain(h.get_finished, 2)
        assert sorted((r.job_id, r.success) for r in results) == [(BEFORE, True), (BAD, True)]
        # expected: the two good stores, nothing else
        sc.expect_stored(want, -1, ((0, 0), (1, 1), (6, 6)))
        assert_storage(sc.all_tensors(), want)
    finally:
        h.shutdown()


@pytest.mark.parametrize("grouped", [False, True], ids=["tables", "two-groups"])
def test_handler_strided_block_ids_round_trip(grouped: bool) -> None:
    """Block ids given as strided views (``ids[::2]``, a stepped tensor) are valid input (they
    were refused as "src_ids must be a contiguous array" by the core's table path)."""
    sc = HandlerScene.make(1, grouped)
    h = sc.h
    try:
        want = snapshot(sc.all_tensors())
        gpu_ids = np.arange(16)[::4]  # 0, 4, 8, 12
        cpu_ids = torch.arange(8)[1::2]  # 1, 3, 5, 7
        h.d2h.transfer_async(3, sc.spec(gpu_ids, cpu_ids))
        h.wait([3])
        assert [(r.job_id, r.success) for r in h.get_finished()] == [(3, True)]
        sc.expect_stored(want, -1, list(zip(gpu_ids.tolist(), cpu_ids.tolist())))
        assert_storage(sc.all_tensors(), want)
    finally:
        h.shutdown()


def test_handler_wait_and_job_ids_are_typed() -> None:
    sc = HandlerScene.make(4, False)
    h = sc.h
    try:
        h.d2h.transfer_async(BEFORE, ([0, 1], [0]))
        for bad, match in ((-1, "not -1"), (None, "not None"), (1.5, "not 1.5")):
            with pytest.raises(InvalidTransferError, match=match):
                h.wait([bad])
        with pytest.raises(InvalidTransferError, match=r"below 2\*\*64, not 18446744073709551616"):
            h.h2d.transfer_async(2**64, ([0], [3]))
        with pytest.raises(InvalidTransferError, match=r"not np\.int64"):
            h.h2d.transfer_async(np.int64(-1), ([0], [3]))
        h.wait({BEFORE})
        assert [(r.job_id, r.success) for r in h.get_finished()] == [(BEFORE, True)]
    finally:
        h.shutdown()


def test_stream_arguments_of_the_wrong_kind() -> None:
    """copy_streams / streams: only torch.cuda.Stream objects (of the cache's device) or raw
    CUstream ints; the host backend refuses streams outright. (The CUDA backend's refusal of
    the legacy default stream is tested by test_cuda_streams_of_the_wrong_kind.)"""

    class OtherDeviceStream:
        cuda_stream = 99
        device = torch.device("cuda", 1)

    assert _stream_handle(7, 0, "copy_streams") == 7
    assert _stream_handle(StreamLike(), None, "copy_streams") == 12345
    with pytest.raises(TypeError, match=r"must be a torch\.cuda\.Stream or a raw CUstream int"):
        _stream_handle("7", 0, "copy_streams")
    with pytest.raises(TypeError, match="not bool"):
        _stream_handle(True, 0, "copy_streams")
    with pytest.raises(ValueError, match="a stream of cuda:1, but the KV cache is on cuda:0"):
        _stream_handle(OtherDeviceStream(), 0, "copy_streams")
    with pytest.raises(ValueError, match="copy_streams needs the CUDA backend"):
        CpuGpuHandlers(kv_cache(), 4, layout="kv_split", backend="host", copy_streams=12345)


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: CpuGpuHandlers([torch.empty(2, 4, 4, 2, 8, device="meta")], 4,
                                layout="kv_split", backend="host"), ValueError, "meta"),
        (lambda: CpuGpuHandlers([kv_cache()[0], kv_cache()[0].half()], 4, layout="kv_split",
                                backend="host"), LayoutError, "one shape and dtype"),
        (lambda: CpuGpuHandlers([torch.zeros(3, 16, 4, 2, 8)], 4, layout="kv_split",
                                backend="host"), LayoutError, r"expects \[2, num_blocks"),
        (lambda: CpuGpuHandlers([torch.zeros(2, 16, 4, 2, 16)[..., ::2]], 4, layout="kv_split",
                                backend="host"), LayoutError, "not contiguous in memory"),
        (lambda: CpuGpuHandlers(kv_cache(), 4, layout="kv_split", backend="host",
                                cpu_caches=[torch.zeros(2, 4, 4, 2, 8, dtype=torch.float16)] * 2),
         LayoutError, "is torch.float16, the GPU tensor torch.bfloat16"),
        (lambda: CpuGpuHandlers(kv_cache(), 4, layout="kv_split", backend="host",
                                cpu_caches=[torch.zeros(2, 5, 4, 2, 8, dtype=torch.bfloat16)] * 2),
         LayoutError, r"needs \(2, 4, 4, 2, 8\)"),
    ],
    ids=["meta-device", "mixed-dtypes", "wrong-shape", "non-contiguous-page",
         "cpu-cache-dtype", "cpu-cache-shape"],
)  # fmt: skip
def test_wrong_tensors_are_refused_and_a_running_handler_is_unaffected(
    make: Callable[[], Any], error: type[Exception], match: str
) -> None:
    sc = HandlerScene.make(1, False)
    h = sc.h
    try:
        before = threads()
        want = snapshot(sc.all_tensors())
        h.d2h.transfer_async(BEFORE, ([2, 3], [4, 5]))
        with pytest.raises(error, match=match):
            make()
        assert not threads_settle(before), "a refused construction left an engine thread behind"
        h.wait([BEFORE])
        assert [(r.job_id, r.success) for r in h.get_finished()] == [(BEFORE, True)]
        sc.expect_stored(want, 0, ((2, 4), (3, 5)))
        assert_storage(sc.all_tensors(), want)
    finally:
        h.shutdown()


def test_construction_failing_after_the_engine_started_shuts_it_down() -> None:
    gpu = kv_cache()
    before = threads()
    with pytest.raises(InvalidTransferError, match="overlaps"):
        CpuGpuHandlers(gpu, N_GPU, layout="kv_split", backend="host", cpu_caches=gpu)
    assert not threads_settle(before), "the engine of the failed construction still runs"


# --------------------------------------------------------------------------------------------
# Unpinned host memory and streams of the wrong kind on CUDA (run on a GPU machine)
# --------------------------------------------------------------------------------------------


@pytest.mark.cuda
def test_cuda_unpinned_and_misplaced_memory_is_refused_and_transfers_around_it_work() -> None:
    eng = Engine("cuda")
    try:
        host = torch.randint(0, 256, (1 * MiB,), dtype=torch.uint8).pin_memory()
        dev = torch.zeros(1 * MiB, dtype=torch.uint8, device="cuda")
        eng.register(host)
        eng.register(dev)
        eng.submit(BEFORE, [host.data_ptr()], [dev.data_ptr()], [64 * KiB], "h2d")
        with pytest.raises(BackendError, match="not page-locked host memory"):
            eng.register(torch.zeros(4096, dtype=torch.uint8))  # pageable
        with pytest.raises(BackendError, match="not host memory"):
            eng.register(torch.zeros(4096, dtype=torch.uint8, device="cuda"), kind="host")
        with pytest.raises(BackendError, match="not device memory"):
            eng.register(torch.zeros(4096, dtype=torch.uint8).pin_memory(), kind="device")
        eng.submit(BAD, [host.data_ptr() + 64 * KiB], [dev.data_ptr() + 64 * KiB], [64 * KiB])
        eng.wait([BEFORE, BAD])
        assert sorted((r.job_id, r.success) for r in drain(eng.get_finished, 2)) == [
            (BEFORE, True),
            (BAD, True),
        ]
        assert torch.equal(dev[: 128 * KiB].cpu(), host[: 128 * KiB])
        assert not dev[128 * KiB :].any()
    finally:
        eng.shutdown()


@pytest.mark.cuda
def test_cuda_streams_of_the_wrong_kind() -> None:
    with pytest.raises(BackendError, match="legacy or per-thread default stream"):
        Engine("cuda", h2d_stream=0)
    with pytest.raises(BackendError, match="legacy or per-thread default stream"):
        Engine("cuda", d2h_stream=2)


# --------------------------------------------------------------------------------------------
# Calls after shutdown; calls from a forked child
# --------------------------------------------------------------------------------------------


def test_every_engine_entry_point_after_shutdown() -> None:
    sc = Scene()
    eng, s, d = sc.eng, sc.s, sc.d
    buf = eng.alloc_host(64 * KiB)
    eng.submit(BEFORE, [s], [d], [MiB // 2], "h2d")  # in flight at shutdown
    eng.shutdown()
    refused: list[tuple[str, Callable[[], Any]]] = [
        ("submit", lambda: eng.submit(BAD, [s], [d], [8])),
        ("submit of a bad batch", lambda: eng.submit(BAD, [s], [d], [-8])),
        ("submit_blocks", lambda: eng.submit_blocks(BAD, 0, [0], 1, [0])),
        ("register", lambda: eng.register(np.zeros(8, np.uint8))),
        ("pin", lambda: eng.pin(np.zeros(8, np.uint8))),
        ("alloc_host", lambda: eng.alloc_host(8)),
        ("register_table", lambda: eng.register_table([s], [64], [64], 1, "host")),
    ]
    for name, call in refused:
        with pytest.raises(ShutdownError, match="the engine is shut down"):
            call()
        assert name
    # what still works: results, waiting, statistics, releasing memory, shutting down again
    assert [(r.job_id, r.success, r.bytes) for r in eng.get_finished()] == [
        (BEFORE, True, MiB // 2)
    ]
    assert np.array_equal(sc.dst[: MiB // 2], sc.src[: MiB // 2])
    eng.wait([BEFORE, BAD])
    assert eng.get_finished() == []
    assert eng.stats()["in_flight"] == 0 and eng.info()["backend"] == "host"
    eng.unregister_table(sc.dev_table)
    eng.unregister(sc.dst)
    eng.free_host(buf)
    with pytest.raises(InvalidTransferError, match="no registered region"):
        eng.free_host(buf)  # freed exactly once
    eng.shutdown()
    with eng:
        pass
    assert eng.is_shut_down


def test_handler_after_shutdown() -> None:
    sc = HandlerScene.make(4, False)
    h = sc.h
    h.d2h.transfer_async(BEFORE, ([0, 1, 2, 3], [1]))
    h.shutdown()
    for call in (
        lambda: h.d2h.transfer_async(BAD, ([0], [0])),
        lambda: h.h2d.transfer_async(BAD, ([0], [0])),
        lambda: h.cpu_caches,
        lambda: h.gpu_caches,
    ):
        with pytest.raises(ShutdownError, match="shut down"):
            call()
    assert [(r.job_id, r.success) for r in h.get_finished()] == [(BEFORE, True)]
    h.wait([BEFORE])
    assert h.stats()["d2h"]["transfers"] == 1
    h.shutdown()


def run_isolated(code: str) -> dict[str, Any]:
    """Runs ``code`` in a fresh interpreter (a crash there fails this test, not the run) and
    returns the JSON object its last output line holds."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert "panicked" not in proc.stderr, proc.stderr
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


FORK_CHILD = """
import json, os, gc
import numpy as np
import blockswap
from blockswap import Engine

eng = Engine("host")
src = np.random.default_rng(1).integers(1, 256, 1 << 20, dtype=np.uint8)
dst = np.zeros(1 << 20, dtype=np.uint8)
eng.register(src, kind="host")
eng.register(dst, kind="device")
s, d = src.ctypes.data, dst.ctypes.data
t_src = eng.register_table([s], [4096], [4096], 16, "host")
t_dst = eng.register_table([d + (1 << 19)], [4096], [4096], 16, "device")
eng.submit(1, [s], [d], [1 << 18], "h2d")  # before the fork, maybe in flight across it
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(r)
    out = {}
    calls = {
        "submit": lambda: eng.submit(2, [s], [d + 300000], [8]),
        "submit_blocks": lambda: eng.submit_blocks(2, t_src, [0], t_dst, [0]),
        "wait": lambda: eng.wait([1]),
        "register": lambda: eng.register(np.zeros(8, np.uint8)),
        "register_table": lambda: eng.register_table([s], [64], [64], 1, "host"),
        "alloc_host": lambda: eng.alloc_host(64),
    }
    for name, call in calls.items():
        try:
            call()
            out[name] = "accepted"
        except blockswap.BlockswapError as e:
            out[name] = [type(e).__name__, str(e)]
    # a new engine made in the child works
    e2 = Engine("host")
    a = np.arange(4096, dtype=np.uint8)
    b = np.zeros(4096, dtype=np.uint8)
    e2.register(a, kind="host")
    e2.register(b, kind="device")
    e2.submit(5, [a.ctypes.data], [b.ctypes.data], [4096])
    e2.wait([5])
    out["new_engine"] = [[r.job_id, r.success] for r in e2.get_finished()]
    out["new_engine_bytes"] = bool(np.array_equal(a, b))
    e2.shutdown()
    # the parent's engine can be dropped here without touching the parent's worker thread
    eng.shutdown()
    del eng
    gc.collect()
    out["dropped"] = True
    os.write(w, json.dumps(out).encode())
    os._exit(0)
os.close(w)
child = json.loads(os.read(r, 1 << 16).decode())
_, status = os.waitpid(pid, 0)
eng.submit(2, [s + (1 << 18)], [d + (1 << 18)], [1 << 18], "h2d")  # after the fork
eng.wait([1, 2])
res = sorted([r.job_id, r.success] for r in eng.get_finished())
ok = bool(np.array_equal(dst[: 1 << 19], src[: 1 << 19])) and not dst[1 << 19 :].any()
eng.shutdown()
print(json.dumps({"child": child, "status": status, "parent": res, "parent_bytes": ok}))
"""


def test_calls_from_a_forked_child() -> None:
    out = run_isolated(FORK_CHILD)
    child = out["child"]
    assert out["status"] == 0
    for name in ("submit", "submit_blocks", "wait", "register", "register_table", "alloc_host"):
        kind, msg = child[name]
        assert kind == "BackendError", (name, child[name])
        assert "created in another process" in msg and "create a new engine in the child" in msg
    assert child["new_engine"] == [[5, True]] and child["new_engine_bytes"]
    assert child["dropped"]
    # the parent: the transfer before the fork and the one after it, once each, every byte
    assert out["parent"] == [[1, True], [2, True]]
    assert out["parent_bytes"]


# --------------------------------------------------------------------------------------------
# 2. Injected faults
# --------------------------------------------------------------------------------------------


def test_injected_faults_in_a_stream_of_transfers() -> None:
    """Rounds of 24 transfers (all four directions, 2-9 scattered descriptors each), the first
    0-3 of each round failed on purpose: each failed job is reported once with success=False
    and its error, every other job once with its bytes; a failed job's descriptors are each
    copied whole or not at all, and nothing outside the destinations changes; the slabs of
    failed jobs go home, and the statistics count them."""
    rng = np.random.default_rng(11)
    eng = Engine("host")
    mem = {
        "hs": rng.integers(1, 256, MiB, dtype=np.uint8),
        "ds": rng.integers(1, 256, MiB, dtype=np.uint8),
        "hd": np.zeros(MiB, dtype=np.uint8),
        "dd": np.zeros(MiB, dtype=np.uint8),
    }
    for k, a in mem.items():
        eng.register(a, kind="host" if k[0] == "h" else "device")
    routes = {"h2d": ("hs", "dd"), "d2h": ("ds", "hd"), "h2h": ("hs", "hd"), "d2d": ("ds", "dd")}
    failed_total = 0
    job = 0
    try:
        for _ in range(40):
            mem["hd"].fill(0)
            mem["dd"].fill(0)
            k = int(rng.integers(0, 4))
            eng.inject_failures(k)  # nothing in flight: the next k transfers fail
            jobs = []
            cursor = {"hd": 0, "dd": 0}
            for _ in range(24):
                direction = str(rng.choice(list(routes)))
                sk, dk = routes[direction]
                n = int(rng.integers(2, 10))
                sizes = rng.integers(1, 2048, n)
                dst_off = cursor[dk] + np.cumsum(sizes + 16) - sizes  # gaps: no coalescing
                cursor[dk] = int(dst_off[-1] + sizes[-1])
                src_off = rng.integers(0, MiB - 2048, n)
                job += 1
                eng.submit(
                    job,
                    mem[sk].ctypes.data + src_off,
                    mem[dk].ctypes.data + dst_off,
                    sizes,
                    direction,
                )
                jobs.append((job, sk, dk, src_off, dst_off, sizes))
            eng.wait([j[0] for j in jobs])
            results = drain(eng.get_finished, len(jobs))
            assert eng.get_finished() == []
            assert Counter(r.job_id for r in results) == Counter(j[0] for j in jobs)
            by_id = {r.job_id: r for r in results}
            written = {"hd": np.zeros(MiB, bool), "dd": np.zeros(MiB, bool)}
            for i, (j, sk, dk, so, do, z) in enumerate(jobs):
                r = by_id[j]
                assert r.bytes == int(z.sum())
                if i < k:
                    assert not r.success and "injected failure at descriptor" in r.error
                else:
                    assert r.success and r.error is None, r
                copied = 0
                for a, b, n in zip(so.tolist(), do.tolist(), z.tolist()):
                    got = mem[dk][b : b + n]
                    whole = np.array_equal(got, mem[sk][a : a + n])
                    assert whole or (not r.success and not got.any()), (j, i, r)
                    copied += whole
                    written[dk][b : b + n] = True
                assert r.success or copied < len(z), "a failed transfer copied everything"
            for dk in ("hd", "dd"):
                assert not mem[dk][~written[dk]].any(), "a write outside the destinations"
            failed_total += k
            stats = eng.stats()
            assert stats["in_flight"] == 0
            assert stats["pool"]["free"] == stats["pool"]["slabs"], "a failed job's slab is out"
            assert sum(stats[d]["failed"] for d in routes) == failed_total
        assert sum(eng.stats()[d]["transfers"] for d in routes) == job
    finally:
        eng.shutdown()


def test_injected_faults_on_block_table_transfers_and_reset() -> None:
    sc = Scene()
    eng = sc.eng
    try:
        eng.inject_failures(5)  # more than will be used: reset to 0 below
        eng.submit_blocks(10, sc.host_table, sc.ids(0, 2, 4, 6), sc.dev_table, sc.ids(1, 3, 5, 7))
        eng.submit_blocks(11, sc.host_table, sc.ids(8), sc.dev_table, sc.ids(9))
        eng.wait([10, 11])
        res = {r.job_id: r for r in drain(eng.get_finished, 2)}
        assert not res[10].success and not res[11].success
        eng.inject_failures(0)
        sc.dst[MiB // 2 :] = 0
        sc.before()
        sc.after()  # transfers and tables work again; every slab home
        assert eng.stats()["h2d"]["failed"] == 2
    finally:
        eng.shutdown()


# --------------------------------------------------------------------------------------------
# 3. Shutdown with transfers in flight, from other threads, twice; memory freed once
# --------------------------------------------------------------------------------------------


def join_all(ts: list[threading.Thread]) -> None:
    for t in ts:
        t.join(DEADLOCK)
        assert not t.is_alive(), f"{t.name} deadlocked"


def two_lane_buffers(
    eng: Engine, rng: np.random.Generator, nbytes: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Random host and "device" sources and a zeroed "device" destination of ``nbytes`` each,
    registered with ``eng``: transfers from either source (h2d, d2d) run on two lanes."""
    src = rng.integers(1, 256, nbytes, dtype=np.uint8)
    dsrc = rng.integers(1, 256, nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    eng.register(src, kind="host")
    eng.register(dsrc, kind="device")
    eng.register(dst, kind="device")
    return src, dsrc, dst


def test_shutdown_from_two_threads_twice_while_transfers_are_in_flight() -> None:
    base = threads()
    eng = Engine("host")
    src, dsrc, dst = two_lane_buffers(eng, np.random.default_rng(3), 64 * MiB)
    s, d = src.ctypes.data, dst.ctypes.data
    for j in range(64):  # 64 MiB queued in 1 MiB transfers on two lanes
        off = j * MiB
        if j % 2:
            eng.submit(j, [s + off], [d + off], [MiB], "h2d")
        else:
            eng.submit(j, [dsrc.ctypes.data + off], [d + off], [MiB], "d2d")
    assert eng.stats()["in_flight"] > 0, "nothing was in flight: the test proves nothing"
    errors: list[BaseException] = []
    seen: list[int] = []

    def stop() -> None:
        try:
            eng.shutdown()
            eng.shutdown()
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    def poll() -> None:
        while not eng.is_shut_down or eng.stats()["in_flight"]:
            seen.extend(r.job_id for r in eng.get_finished() if r.success)

    ts = [threading.Thread(target=stop, name=f"stop{i}") for i in range(2)]
    ts.append(threading.Thread(target=poll, name="poll"))
    for t in ts:
        t.start()
    eng.shutdown()
    join_all(ts)
    assert not errors
    seen.extend(r.job_id for r in eng.get_finished() if r.success)
    assert sorted(seen) == list(range(64)), "a result lost or reported twice"
    want = np.where((np.arange(64 * MiB) // MiB) % 2 == 1, src, dsrc)
    assert np.array_equal(dst, want)
    with pytest.raises(ShutdownError):
        eng.submit(99, [s], [d], [8])
    stats = eng.stats()
    assert stats["in_flight"] == 0 and stats["pool"]["free"] == stats["pool"]["slabs"]
    assert not threads_settle(base), "the worker thread outlived shutdown"


def test_submitters_racing_shutdown_get_their_results_or_a_shutdown_error() -> None:
    """Four threads submit (two lanes) while a fifth polls and the main thread shuts the engine
    down: each submit either returns (its result is reported once, successful, its bytes there)
    or raises ShutdownError (nothing of it is reported or written)."""
    eng = Engine("host")
    src, dsrc, dst = two_lane_buffers(eng, np.random.default_rng(4), 16 * MiB)
    d = dst.ctypes.data
    accepted: dict[int, list[int]] = {t: [] for t in range(4)}
    refused: Counter[int] = Counter()
    reported: list[Any] = []
    started = threading.Barrier(6)
    enough = threading.Event()
    stop_polling = threading.Event()

    def submit(t: int) -> None:
        s, direction = (src.ctypes.data, "h2d") if t % 2 else (dsrc.ctypes.data, "d2d")
        started.wait()
        for i in itertools.count():  # until the shutdown stops it
            j = (t << 32) + i
            k = t * 4096 + i % 4096  # the thread's slots, rewritten with the same bytes
            while True:
                try:
                    eng.submit(j, [s + k * 1024], [d + k * 1024], [1024], direction)
                    break
                except PoolExhaustedError:
                    continue  # the poller catches up
                except ShutdownError:
                    refused[t] += 1
                    return
            accepted[t].append(j)
            if len(accepted[t]) == 256:
                enough.set()

    def poll() -> None:
        started.wait()
        while not stop_polling.is_set():
            reported.extend(eng.get_finished())

    ts = [threading.Thread(target=submit, args=(t,), name=f"submit{t}") for t in range(4)]
    ts.append(threading.Thread(target=poll, name="poll"))
    for t in ts:
        t.start()
    started.wait()
    enough.wait(DEADLOCK)
    eng.shutdown()
    join_all(ts[:4])
    stop_polling.set()
    join_all(ts[4:])
    reported.extend(eng.get_finished())
    assert refused == dict.fromkeys(range(4), 1)
    every = {j for a in accepted.values() for j in a}
    assert Counter(r.job_id for r in reported) == Counter(every), "lost or reported twice"
    assert all(r.success and r.bytes == 1024 for r in reported)
    want = np.zeros(16 * MiB, dtype=np.uint8)
    for t, jobs in accepted.items():
        slots = np.unique(t * 4096 + np.asarray(jobs, dtype=np.int64) % (1 << 32) % 4096)
        pos = (slots[:, None] * 1024 + np.arange(1024)).reshape(-1)
        want[pos] = (src if t % 2 else dsrc)[pos]
    assert np.array_equal(dst, want)


def test_handler_shutdown_from_other_threads_while_transferring(
    caplog: pytest.LogCaptureFixture,
) -> None:
    base = threads()
    gpu = kv_cache(layers=8, blocks=64)
    h = CpuGpuHandlers(gpu, 64, layout="kv_split", backend="host")
    fill_random(gpu + h.cpu_caches[0], torch.Generator().manual_seed(2))
    g0 = [t.clone() for t in gpu]
    owned = weakref.ref(h.cpu_caches[0][0])
    accepted: list[int] = []
    refused: list[int] = []
    go = threading.Barrier(3)

    def offload() -> None:
        go.wait()
        for j in range(100_000):
            try:
                h.d2h.transfer_async(j, (np.arange(j % 64, j % 64 + 1), np.array([j % 64])))
            except ShutdownError:
                refused.append(j)
                return
            except PoolExhaustedError:
                continue  # too many in flight: the poller catches up
            accepted.append(j)

    polled: list[int] = []

    def poll_then_stop() -> None:
        go.wait()
        while len(accepted) < 200:
            polled.extend(r.job_id for r in h.get_finished() if r.success)
        h.shutdown()
        h.shutdown()

    ts = [threading.Thread(target=offload), threading.Thread(target=poll_then_stop)]
    caplog.set_level(logging.WARNING, logger="blockswap")
    for t in ts:
        t.start()
    go.wait()
    join_all(ts)
    h.shutdown()
    polled.extend(r.job_id for r in h.get_finished() if r.success)
    assert [r.getMessage() for r in caplog.records] == [], "memory left registered at shutdown"
    assert refused, "shutdown did not stop the offloading thread"
    assert sorted(polled) == sorted(accepted), "a result lost or reported twice"
    for t, t0 in zip(gpu, g0):
        assert torch.equal(t.view(torch.int16), t0.view(torch.int16))  # sources untouched
    del t
    gc.collect()
    assert owned() is None, "the CPU cache was not freed"
    assert not threads_settle(base)


ALLOC_ONCE = """
import gc, json, threading
import numpy as np
from blockswap import Engine, InvalidTransferError
from reliability_stress import rss_bytes

MiB = 1 << 20
out = {}
eng = Engine("host")
r0 = rss_bytes()
buf = eng.alloc_host(256 * MiB)
buf[:] = 1  # resident now
pinned = np.ones(64 * MiB, np.uint8)
eng.pin(pinned)
dev = np.zeros(256 * MiB, np.uint8)
eng.register(dev, kind="device")
keep = eng.alloc_host(128 * MiB)  # freed with the engine, below
keep[:] = 2
gone = eng.alloc_host(128 * MiB)
gone[:] = 3
for j in range(8):  # in flight while two threads shut down, twice each
    eng.submit(j, [buf.ctypes.data + j * 32 * MiB], [dev.ctypes.data + j * 32 * MiB], [32 * MiB])
ts = [threading.Thread(target=lambda: (eng.shutdown(), eng.shutdown())) for _ in range(2)]
for t in ts:
    t.start()
for t in ts:
    t.join()
out["results"] = sorted([r.job_id, r.success] for r in eng.get_finished())
out["copied"] = bool((dev == 1).all())
r1 = rss_bytes()
eng.free_host(buf)
r2 = rss_bytes()
try:
    eng.free_host(buf)
    out["second_free"] = "accepted"
except InvalidTransferError as e:
    out["second_free"] = str(e)
eng.unregister(pinned)
try:
    eng.unregister(pinned)
    out["second_unpin"] = "accepted"
except InvalidTransferError as e:
    out["second_unpin"] = str(e)
del buf
# buffers still allocated when the engine goes are freed with it, once; one whose array is
# still held keeps the engine's memory alive until the array goes
del gone, eng, dev
gc.collect()
r3 = rss_bytes()
keep[:] = 4  # still valid memory
out["kept_valid"] = bool((keep == 4).all())
del keep
gc.collect()
r4 = rss_bytes()
out["rss_mib"] = [round(x / MiB) for x in (r0, r1, r2, r3, r4)]
print(json.dumps(out))
"""


def test_host_memory_is_freed_exactly_once_after_shutdown_from_threads() -> None:
    out = run_isolated(
        f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r})\n" + ALLOC_ONCE
    )
    assert out["results"] == [[j, True] for j in range(8)] and out["copied"]
    assert "no registered region" in out["second_free"]
    assert "no registered region" in out["second_unpin"]
    assert out["kept_valid"]
    r0, r1, r2, r3, r4 = out["rss_mib"]
    assert r1 - r0 >= 700, out  # buffers of 256 + 2 x 128 MiB, 256 MiB destination, 64 pinned
    assert r1 - r2 >= 200, f"free_host did not give the 256 MiB back: {out}"
    assert r3 - r4 >= 100, f"the kept buffer was not freed with its array: {out}"


GC_IN_FLIGHT = """
import gc, json
import numpy as np
import torch
import blockswap
from blockswap.handler import CpuGpuHandlers

# An engine collected with a 512 MiB copy in flight: its registered arrays must outlive the copy.
eng = blockswap.Engine("host")
n = 512 << 20
src = np.ones(n, np.uint8)
dst = np.zeros(n, np.uint8)
eng.register(src, kind="host")
eng.register(dst, kind="device")
eng.submit(1, [src.ctypes.data], [dst.ctypes.data], [n])
del src, dst, eng
gc.collect()
filler = [np.full(1 << 20, 9, np.uint8) for _ in range(600)]  # reuse the freed pages
# Handlers collected (never shut down) with offloads in flight.
gpu = [torch.ones(2, 64, 64, 8, 128, dtype=torch.bfloat16) for _ in range(16)]
h = CpuGpuHandlers(gpu, 64, layout="kv_split", backend="host")
for j in range(8):
    h.d2h.transfer_async(j, (np.arange(64), np.arange(64)))
del h
gc.collect()
filler += [np.full(1 << 20, 9, np.uint8) for _ in range(600)]
print(json.dumps({"ok": all(int(f[0]) == 9 for f in filler)}))
"""


def test_collecting_an_engine_or_handlers_with_transfers_in_flight_is_safe() -> None:
    """Both used to free the registered memory under the copy (SIGSEGV)."""
    assert run_isolated(GC_IN_FLIGHT) == {"ok": True}


def test_engines_made_and_shut_down_repeatedly_leak_no_thread_or_memory() -> None:
    src = np.ones(MiB, np.uint8)
    dst = np.zeros(MiB, np.uint8)

    def cycle(j: int) -> None:
        eng = Engine("host")
        eng.register(src, kind="host")
        eng.register(dst, kind="device")
        eng.register_table([src.ctypes.data], [4096], [4096], 256, "host")
        buf = eng.alloc_host(64 * KiB)
        for k in range(8):
            eng.submit(k, [src.ctypes.data + k * 4096], [dst.ctypes.data + k * 4096], [4096])
        if j % 2:
            eng.wait(range(8))
            eng.get_finished()
            eng.free_host(buf)
        eng.shutdown()  # with transfers in flight or their results unpolled
        eng.shutdown()

    base = threads()
    for j in range(20):
        cycle(j)
    gc.collect()
    r0 = rss_bytes()
    for j in range(300):
        cycle(j)
        assert not threads_settle(base)
    gc.collect()
    grown = rss_bytes() - r0
    assert grown < 8 * MiB, f"RSS grew {grown / MiB:.1f} MiB over 300 engines"


# --------------------------------------------------------------------------------------------
# 4. Threads submitting and polling one pair of handlers
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# 5. Load: a million random transfers
# --------------------------------------------------------------------------------------------

STRESS_TRANSFERS = int(os.environ.get("BLOCKSWAP_STRESS_TRANSFERS", DEFAULT_TRANSFERS))


def test_stress_random_transfers(capsys: pytest.CaptureFixture[str]) -> None:
    """``BLOCKSWAP_STRESS_TRANSFERS`` random transfers (1,000,000 unless set), every byte and
    result checked by run_stress; memory flat over the second half of the run."""
    rep = run_stress(STRESS_TRANSFERS)
    assert rep.transfers == STRESS_TRANSFERS
    assert sum(rep.by_direction.values()) == STRESS_TRANSFERS
    assert min(rep.by_direction.values()) > STRESS_TRANSFERS // 5  # all four directions
    assert rep.pool["free"] == rep.pool["slabs"]
    # Measured from the end of the warm-up rounds: a leak of 16 bytes per transfer would show.
    assert rep.rss_end - rep.rss_middle < 4 * MiB, rep
    assert rep.rss_growth < 8 * MiB, rep
    with capsys.disabled():
        print(
            f"\nstress: {rep.transfers:,} transfers ({rep.descriptors:,} descriptors, "
            f"{rep.bytes / 1e9:.2f} GB) in {rep.seconds:.1f} s; RSS {rep.rss_start / MiB:.1f} / "
            f"{rep.rss_middle / MiB:.1f} / {rep.rss_end / MiB:.1f} MiB (after warm-up / middle / "
            f"end); pool {rep.pool['slabs']} slabs, all free"
        )


# --------------------------------------------------------------------------------------------
# 6. Property tests of the entry points: accepted exactly when valid, typed refusals, and the
#    bytes of every accepted transfer
# --------------------------------------------------------------------------------------------

REGION = 8 * KiB


class Arena:
    """One engine over four registered arrays (two host, two "device") and one unregistered
    one, with a model of what a transfer over them may do."""

    kinds: ClassVar[dict[str, str]] = {"HA": "host", "HB": "host", "DA": "device", "DB": "device"}

    def __init__(self) -> None:
        self.eng = Engine("host", max_descriptors=32)
        rng = np.random.default_rng(8)
        self.init = {k: rng.integers(1, 256, REGION, dtype=np.uint8) for k in [*self.kinds, "UN"]}
        self.mem = {k: v.copy() for k, v in self.init.items()}
        for k, kind in self.kinds.items():
            self.eng.register(self.mem[k], kind=kind)
        self.base = {k: a.ctypes.data for k, a in self.mem.items()}
        self.next_job = 1

    def reset(self) -> None:
        for k, a in self.mem.items():
            a[:] = self.init[k]
        assert self.eng.get_finished() == []
        assert self.eng.stats()["in_flight"] == 0

    def region_of(self, addr: int, size: int, kind: str) -> str | None:
        """The registered array of ``kind`` holding [addr, addr + size), if one does."""
        for k, kd in self.kinds.items():
            if kd == kind and self.base[k] <= addr and addr + size <= self.base[k] + REGION:
                return k
        return None

    def snapshot(self) -> dict[str, np.ndarray]:
        return {k: a.copy() for k, a in self.mem.items()}

    def locate(self, addr: int) -> tuple[str, int]:
        for k in self.mem:
            if self.base[k] <= addr < self.base[k] + REGION:
                return k, addr - self.base[k]
        raise AssertionError(f"{addr:#x} is in no array")

    def expect_copies(self, copies: list[tuple[int, int, int]]) -> dict[str, np.ndarray] | None:
        """The arrays after ``(src, dst, size)`` copies (None when a source overlaps a
        destination: the order of the copies would matter, and nothing promises one)."""
        spans = [(d, d + z) for _, d, z in copies]
        for s, _, z in copies:
            if any(s < e and b < s + z for b, e in spans):
                return None
        want = self.snapshot()
        before = self.snapshot()
        for s, d, z in copies:
            (ks, os_), (kd, od) = self.locate(s), self.locate(d)
            want[kd][od : od + z] = before[ks][os_ : os_ + z]
        return want

    def check(self, want: dict[str, np.ndarray]) -> None:
        for k, a in self.mem.items():
            assert np.array_equal(a, want[k]), f"{k} differs"

    def run(self, job: Any, call: Callable[[], None], copies: list[tuple[int, int, int]] | None,
            nbytes: int) -> None:  # fmt: skip
        """``call`` must be accepted iff ``copies`` is not None (the model's verdict), and then
        move exactly those bytes; a refusal must be an InvalidTransferError that changed
        nothing."""
        before = self.snapshot()
        want = None if copies is None else self.expect_copies(copies)
        try:
            call()
        except InvalidTransferError:
            event("refused")
            assert copies is None, "a valid transfer was refused"
            self.check(before)
            assert self.eng.stats()["in_flight"] == 0
            return
        event("accepted" if want is not None else "accepted (sources overlap destinations)")
        assert copies is not None, "an invalid transfer was accepted"
        self.eng.wait([job])
        (r,) = drain(self.eng.get_finished, 1)
        assert (r.job_id, r.success, r.bytes) == (job, True, nbytes)
        if want is not None:
            self.check(want)


@pytest.fixture(scope="module")
def arena() -> Any:
    a = Arena()
    yield a
    a.eng.shutdown()


KINDS = {"h2d": ("host", "device"), "d2h": ("device", "host"), "h2h": ("host", "host"),
         "d2d": ("device", "device")}  # fmt: skip


def as_container(values: list[int], how: str) -> Any:
    if how == "list":
        return values
    if how == "float64":
        return np.asarray(values, dtype=np.float64)
    if how == "uint64" and all(v >= 0 for v in values):
        return np.asarray(values, dtype=np.uint64)
    if how == "strided":
        return np.repeat(np.asarray(values, dtype=np.int64), 2)[::2]
    return np.asarray(values, dtype=np.int64)


ENGINE_MUTATIONS = [
    "src-wrong-kind", "src-unregistered", "dst-past-end", "src-before-start", "size-zero",
    "size-negative", "size-huge", "dst-overlap", "raw-address", "direction", "lengths", "float",
    "empty",
]  # fmt: skip


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_property_engine_submit(arena: Arena, data: st.DataObject) -> None:
    """A well-formed random batch, or one with a random defect: accepted exactly when the model
    says it is valid (then every byte as the model says), otherwise an InvalidTransferError
    that changed nothing."""
    arena.reset()
    direction = data.draw(st.sampled_from(list(KINDS)), label="direction")
    sk, dk = KINDS[direction]
    src_arrays = [k for k, v in Arena.kinds.items() if v == sk]
    dst_arrays = [k for k, v in Arena.kinds.items() if v == dk]
    n = data.draw(st.integers(1, 6), label="descriptors")
    zs = data.draw(st.lists(st.integers(1, 600), min_size=n, max_size=n), label="sizes")
    slots = data.draw(st.permutations(range(16)), label="slots")[:n]  # 8 x 1 KiB per array
    src: list[int] = []
    dst: list[int] = []
    for z, slot in zip(zs, slots):
        k = data.draw(st.sampled_from(src_arrays))
        src.append(arena.base[k] + data.draw(st.integers(0, REGION - z)))
        k = dst_arrays[slot % len(dst_arrays)] if len(dst_arrays) > 1 else dst_arrays[0]
        dst.append(arena.base[k] + (slot // 2) * KiB + data.draw(st.integers(0, KiB - z)))
    hows = data.draw(st.lists(st.sampled_from(["list", "int64", "uint64", "strided"]),
                              min_size=3, max_size=3), label="containers")  # fmt: skip
    mutation = data.draw(st.sampled_from([None] * len(ENGINE_MUTATIONS) + ENGINE_MUTATIONS))
    i = data.draw(st.integers(0, n - 1), label="mutated descriptor")
    other = {"host": ["DA", "DB"], "device": ["HA", "HB"]}[sk]
    if mutation == "src-wrong-kind":
        src[i] = arena.base[data.draw(st.sampled_from(other))] + 16
    elif mutation == "src-unregistered":
        src[i] = arena.base["UN"] + 16
    elif mutation == "dst-past-end":
        base = max(b for b in arena.base.values() if b <= dst[i])
        dst[i] = base + REGION - zs[i] + data.draw(st.integers(1, 64))
    elif mutation == "src-before-start":
        base = max(b for b in arena.base.values() if b <= src[i])
        src[i] = base - data.draw(st.integers(1, 64))
    elif mutation == "size-zero":
        zs[i] = 0
    elif mutation == "size-negative":
        zs[i] = -data.draw(st.integers(1, 2**63))
    elif mutation == "size-huge":
        zs[i] = data.draw(st.sampled_from([REGION + 1, 2**62, 2**63 - 1]))
    elif mutation == "dst-overlap" and n > 1:
        j = (i + 1) % n
        dst[i] = dst[j] + data.draw(st.integers(-zs[i] + 1, zs[j] - 1))
    elif mutation == "raw-address":
        src[i] = data.draw(st.sampled_from([0, 8, 2**63 - 1]))
    elif mutation == "direction":
        direction = data.draw(st.sampled_from(["H2D", "sideways", ""]))
    elif mutation == "float":
        hows[data.draw(st.integers(0, 2))] = "float64"
    elif mutation == "empty":
        src, dst, zs, n = [], [], [], 0
    cols = [src, dst, list(zs)]
    if mutation == "lengths":
        c = data.draw(st.integers(0, 2))
        cols[c] = cols[c][:-1] if data.draw(st.booleans()) else [*cols[c], cols[c][-1] + 4096]
    # the model
    copies: list[tuple[int, int, int]] | None = []
    lengths = {len(c) for c in cols}
    if "float64" in hows or direction not in KINDS or lengths != {n} or n == 0:
        copies = None
    else:
        for s_, d_, z in zip(src, dst, zs):
            if z <= 0 or arena.region_of(s_, z, sk) is None or arena.region_of(d_, z, dk) is None:
                copies = None
                break
            copies.append((s_, d_, z))
        if copies is not None:
            spans = sorted((d_, d_ + z) for _, d_, z in copies)
            if any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
                copies = None  # destinations overlap
    job = arena.next_job
    arena.next_job += 1
    args = [as_container(c, h) for c, h in zip(cols, hows)]
    arena.run(job, lambda: arena.eng.submit(job, *args, direction),
              copies, sum(z for _, _, z in copies or []))  # fmt: skip


TABLE_MUTATIONS = ["zero-page", "stride-below-page", "past-end", "unregistered", "wrong-kind"]
ID_MUTATIONS = ["out-of-range", "negative", "duplicate", "lengths", "empty", "float", "swap",
                "incompatible"]  # fmt: skip


@st.composite
def table_specs(draw: st.DrawFn, kind: str, nbytes: list[int] | None = None) -> dict[str, Any]:
    """A block table over the arrays of ``kind``, valid unless a mutation was drawn. Bases are
    (array, offset) pairs."""
    if nbytes is None:
        nbytes = draw(st.lists(st.integers(1, 96), min_size=1, max_size=3))
    nb = draw(st.integers(1, 8))
    strides = [z + draw(st.sampled_from([0, 16, 64])) for z in nbytes]
    where = [k for k, v in Arena.kinds.items() if v == kind]
    bases = []
    for z, st_ in zip(nbytes, strides):
        span = (nb - 1) * st_ + z
        bases.append((draw(st.sampled_from(where)), draw(st.integers(0, REGION - span))))
    spec = {"bases": bases, "strides": strides, "nbytes": list(nbytes), "num_blocks": nb,
            "kind": kind}  # fmt: skip
    mutation = draw(st.sampled_from([None] * 20 + TABLE_MUTATIONS))
    s = draw(st.integers(0, len(nbytes) - 1))
    if mutation == "zero-page":
        spec["nbytes"][s] = 0
    elif mutation == "stride-below-page":
        spec["strides"][s] = max(spec["nbytes"][s] - draw(st.integers(1, 8)), 0)
    elif mutation == "past-end":
        k, _ = bases[s]
        span = (nb - 1) * strides[s] + nbytes[s]
        bases[s] = (k, REGION - span + draw(st.integers(1, 64)))
    elif mutation == "unregistered":
        bases[s] = ("UN", 0)
    elif mutation == "wrong-kind":
        bases[s] = ({"host": "DA", "device": "HA"}[kind], 0)
    return spec


def table_valid(arena: Arena, t: dict[str, Any]) -> bool:
    nb = t["num_blocks"]
    for (k, off), stride, z in zip(t["bases"], t["strides"], t["nbytes"]):
        if z <= 0 or (nb > 1 and stride < z):
            return False
        if arena.region_of(arena.base[k] + off, (nb - 1) * stride + z, t["kind"]) is None:
            return False
    return True


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_property_block_tables(arena: Arena, data: st.DataObject) -> None:
    """register_table accepts a table exactly when it is valid; submit_blocks over two tables
    accepts exactly the valid block-id transfers and moves the bytes the model says."""
    arena.reset()
    ids: list[int] = []
    tables: list[dict[str, Any]] = []
    try:
        for kind in ("host", "device"):
            spec = data.draw(table_specs(kind, tables[0]["nbytes"] if tables else None),
                             label=f"{kind} table")  # fmt: skip
            t = {**spec, "bases": [arena.base[k] + off for k, off in spec["bases"]]}
            try:
                tid = arena.eng.register_table(t["bases"], t["strides"], t["nbytes"],
                                               t["num_blocks"], t["kind"])  # fmt: skip
            except InvalidTransferError:
                event("table refused")
                assert not table_valid(arena, spec), f"a valid table was refused: {spec}"
                return
            assert table_valid(arena, spec), f"an invalid table was accepted: {spec}"
            tables.append(t)
            ids.append(tid)
        direction = data.draw(st.sampled_from(["h2d", "d2h"]), label="direction")
        (src_t, dst_t), (sid, did) = (
            (tables, ids) if direction == "h2d" else (tables[::-1], ids[::-1])
        )
        mutation = data.draw(st.sampled_from([None] * 8 + ID_MUTATIONS), label="id mutation")
        if mutation == "incompatible":
            other = {**src_t, "nbytes": [z + 1 for z in src_t["nbytes"]]}
            other["strides"] = [max(s_, z) for s_, z in zip(other["strides"], other["nbytes"])]
            try:
                sid = arena.eng.register_table(other["bases"], other["strides"], other["nbytes"],
                                               other["num_blocks"], other["kind"])  # fmt: skip
            except InvalidTransferError:
                return  # the larger pages ran past the memory: no table to try
            ids.append(sid)
            src_t = other
        n = data.draw(st.integers(1, 6), label="blocks")
        s_ids = data.draw(st.lists(st.integers(0, src_t["num_blocks"] - 1), min_size=n,
                                   max_size=n))  # fmt: skip
        d_ids = data.draw(st.permutations(range(dst_t["num_blocks"])))[:n]
        n = len(d_ids)
        s_ids = s_ids[:n]
        how = data.draw(st.sampled_from(["list", "int64", "strided"]), label="ids as")
        j = data.draw(st.integers(0, n - 1))
        if mutation == "out-of-range":
            s_ids[j] = src_t["num_blocks"] + data.draw(st.integers(0, 2**40))
        elif mutation == "negative":
            d_ids[j] = -data.draw(st.integers(1, 2**62))
        elif mutation == "duplicate":
            d_ids.append(d_ids[j])
            s_ids.append(s_ids[j])
        elif mutation == "lengths":
            d_ids = d_ids[:-1]
        elif mutation == "empty":
            s_ids, d_ids = [], []
        elif mutation == "float":
            how = "float64"
        a, b = (did, sid) if mutation == "swap" else (sid, did)
        # the model
        copies: list[tuple[int, int, int]] | None = []
        if (mutation == "swap" or how == "float64" or len(s_ids) != len(d_ids) or not s_ids
                or src_t["nbytes"] != dst_t["nbytes"]
                or not all(0 <= i < src_t["num_blocks"] for i in s_ids)
                or not all(0 <= i < dst_t["num_blocks"] for i in d_ids)
                or len(set(d_ids)) != len(d_ids)):  # fmt: skip
            copies = None
        else:
            for seg, z in enumerate(src_t["nbytes"]):
                for x, y in zip(s_ids, d_ids):
                    copies.append((src_t["bases"][seg] + x * src_t["strides"][seg],
                                   dst_t["bases"][seg] + y * dst_t["strides"][seg], z))  # fmt: skip
            spans = sorted((d_, d_ + z) for _, d_, z in copies)
            if any(p[1] > q[0] for p, q in zip(spans, spans[1:])):
                copies = None  # pages of different segments overlap
        job = arena.next_job
        arena.next_job += 1
        si, di = as_container(s_ids, how), as_container(d_ids, how)
        arena.run(job, lambda: arena.eng.submit_blocks(job, a, si, b, di, direction),
                  copies, sum(z for _, _, z in copies or []))  # fmt: skip
    finally:
        for tid in ids:
            arena.eng.unregister_table(tid)


HN_GPU, HN_CPU = 12, 6


@pytest.fixture(scope="module")
def handler_pair() -> Any:
    hs = {}
    for f in (1, 4):
        gpu = [strided((2, HN_GPU, 2, 2, 8), torch.float16, 1, pad=3) for _ in range(2)]
        hs[f] = (CpuGpuHandlers(gpu, HN_CPU, layout="kv_split", block_size_factor=f,
                                backend="host"), gpu)  # fmt: skip
    yield hs
    for h, _ in hs.values():
        h.shutdown()


ID_FORMS = ["list", "int64", "int32", "uint8", "tensor", "strided", "float64", "none-in-list"]


def id_container(values: list[int], how: str) -> Any:
    # A narrow dtype only where every value fits it: the out-of-range mutations draw ids up to
    # 2**40, which numpy refuses to put in an int32 (this once failed about one run in five).
    if how == "int32" and all(-(2**31) <= v < 2**31 for v in values):
        return np.asarray(values, dtype=np.int32)
    if how == "uint8" and all(0 <= v < 256 for v in values):
        return np.asarray(values, dtype=np.uint8)
    if how == "tensor":
        return torch.tensor(values, dtype=torch.int64)
    if how == "none-in-list":
        return [*values, None]
    return as_container(values, how)


HANDLER_MUTATIONS = ["gpu-out-of-range", "cpu-out-of-range", "negative", "duplicate-dest",
                     "cpu-count", "empty", "float", "none-in-list", "job-id"]  # fmt: skip


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_property_handler_transfer_async(handler_pair: Any, data: st.DataObject) -> None:
    """transfer_async with a random spec (block ids in any accepted form, or with a random
    defect), factor 1 and 4, both directions: accepted exactly when valid, and then the bytes of
    the blocks as the sub-block rules say; otherwise an InvalidTransferError and no change."""
    f = data.draw(st.sampled_from([1, 4]), label="block_size_factor")
    h, gpu = handler_pair[f]
    (cpu,) = h.cpu_caches
    assert h.get_finished() == []
    fill_random(gpu + cpu, torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1))))
    d2h = data.draw(st.booleans(), label="GPU -> CPU")
    n = data.draw(st.integers(1, 6), label="GPU blocks")
    if d2h:  # sources may repeat, destinations (CPU blocks) may not
        g_ids = data.draw(st.lists(st.integers(0, HN_GPU - 1), min_size=n, max_size=n))
    else:
        g_ids = data.draw(st.permutations(range(HN_GPU)))[:n]
    c_ids = data.draw(st.permutations(range(HN_CPU)))[: -(-n // f)]
    forms = list(data.draw(st.tuples(st.sampled_from(ID_FORMS[:6]), st.sampled_from(ID_FORMS[:6]))))
    job: Any = data.draw(st.integers(0, 2**64 - 1), label="job id")
    mutation = data.draw(st.sampled_from([None] * 9 + HANDLER_MUTATIONS), label="mutation")
    if mutation == "gpu-out-of-range":
        g_ids[data.draw(st.integers(0, n - 1))] = HN_GPU + data.draw(st.integers(0, 2**40))
    elif mutation == "cpu-out-of-range":
        c_ids[data.draw(st.integers(0, len(c_ids) - 1))] = HN_CPU + data.draw(st.integers(0, 9))
    elif mutation == "negative":
        side = g_ids if data.draw(st.booleans()) else c_ids
        side[data.draw(st.integers(0, len(side) - 1))] = -data.draw(st.integers(1, 2**40))
    elif mutation == "duplicate-dest":
        if d2h:
            c_ids = [*c_ids, c_ids[0]]
            g_ids = g_ids + g_ids[: f * (len(c_ids)) - len(g_ids)] if f > 1 else [*g_ids, 0]
        else:
            g_ids = [*g_ids[:-1], g_ids[0]] if n > 1 else g_ids
    elif mutation == "cpu-count":
        c_ids = [*c_ids, (c_ids[-1] + 1) % HN_CPU] if data.draw(st.booleans()) else c_ids[:-1]
    elif mutation == "empty":
        g_ids, c_ids = [], []
    elif mutation == "float":
        forms[data.draw(st.integers(0, 1))] = "float64"
    elif mutation == "none-in-list":
        forms[data.draw(st.integers(0, 1))] = "none-in-list"
    elif mutation == "job-id":
        job = data.draw(st.sampled_from([-1, 2**64, None, 1.0, True]))
    # the model
    n = len(g_ids)
    valid = (
        isinstance(job, int) and not isinstance(job, bool) and 0 <= job < 2**64
        and not {"float64", "none-in-list"} & set(forms) and n > 0
        and len(c_ids) == -(-n // f) and all(0 <= i < HN_GPU for i in g_ids)
        and all(0 <= c < HN_CPU for c in c_ids)
    )  # fmt: skip
    subs: list[int] = []
    if valid:
        skip = 0 if d2h else -n % f
        subs = [c_ids[(skip + i) // f] * f + (skip + i) % f for i in range(n)]
        dests = subs if d2h else g_ids
        valid = len(set(dests)) == len(dests)
    src_ids, dst_ids = (g_ids, c_ids) if d2h else (c_ids, g_ids)
    spec = (id_container(src_ids, forms[0]), id_container(dst_ids, forms[1]))
    handler = h.d2h if d2h else h.h2d
    before = snapshot(gpu + cpu)
    try:
        assert handler.transfer_async(job, spec) is True
    except InvalidTransferError:
        event("refused")
        assert not valid, "a valid transfer was refused"
        assert_storage(gpu + cpu, before)
        return
    event("accepted")
    assert valid, "an invalid transfer was accepted"
    h.wait([job])
    (r,) = drain(h.get_finished, 1)
    assert (r.job_id, r.success, r.bytes) == (job, True, n * h.gpu_tables[0].page_bytes)
    want = {k: v.clone() for k, v in before.items()}
    pairs = list(zip(g_ids, subs)) if d2h else list(zip(subs, g_ids))
    ts, td = (gpu, cpu) if d2h else (cpu, gpu)
    for a, b in zip(ts, td):
        for sb, db in pairs:
            want[raw(b).data_ptr()][block_bytes(b, 1, db)] = before[raw(a).data_ptr()][
                block_bytes(a, 1, sb)
            ]
    assert_storage(gpu + cpu, want)
