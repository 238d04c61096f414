"""Reliability, 1. Bad input: the offloading handlers."""

from __future__ import annotations

import gc
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from blockswap import ConfigError, InvalidTransferError
from blockswap.handler import CpuGpuHandlers, _stream_handle
from blockswap.hostmem import PinnedRows
from blockswap.layout import LayoutError
from kv_helpers import assert_storage, snapshot
from reliability_helpers import (
    BAD,
    BEFORE,
    N_GPU,
    HandlerScene,
    StreamLike,
    drain,
    kv_cache,
    threads,
    threads_settle,
)


class Sparse:
    @staticmethod
    def ids() -> torch.Tensor:
        return torch.tensor([1]).to_sparse()


# (id, GPU -> CPU spec (GPU ids, CPU ids), message excerpt); the handler's own table of bad
# specs (test_handler_validation.py::test_bad_transfer_raises_typed_error_and_issues_nothing) is not repeated.
HANDLER_CASES: list[tuple[str, Callable[[], Any], str]] = [
    ("nan", lambda: ([math.nan], [2]), "GPU block ids must hold integers, not float64"),
    ("float-list", lambda: ([4.0], [2]), "must hold integers, not float64"),
    # 1-D arrays go to the core as given: its words, its name for the side
    ("float-array", lambda: (np.array([4.0]), [2]), "GPU block ids must hold integers, not float64"),
    ("bool-array-cpu", lambda: ([4], np.array([True])), "CPU block ids must hold integers, not bool"),
    ("uint64-array", lambda: (np.array([2**63], dtype=np.uint64), [2]), r"GPU block ids holds values past 2\*\*63 - 1"),
    ("strided-array", lambda: (np.arange(8)[::2], np.array([2, 3, 4, 2**40])), "CPU block ids hold block id 1099511627776"),
    ("none-element", lambda: ([4, None], [2, 3]), "must hold integers, not object"),
    ("none-side", lambda: (None, [2]), "must hold integers, not object"),
    ("int-past-int64", lambda: ([2**70], [2]), r"GPU block ids holds integers outside \[-2\*\*63, 2\*\*63\)"),
    ("int-below-int64", lambda: ([4], [-(2**70)]), r"CPU block ids holds integers outside \[-2\*\*63, 2\*\*63\)"),
    ("int64-max-cpu", lambda: ([4], [2**63 - 1]), "CPU block ids hold block id 9223372036854775807"),
    ("int64-min-cpu", lambda: ([4], [-(2**63)]), "CPU block ids hold a negative block id"),
    ("strings", lambda: (["4"], [2]), "must hold integers, not <U1"),
    ("scalar", lambda: (4, 2), "must be one-dimensional, not of shape ()"),
    ("generator", lambda: ((i for i in [4]), [2]), "must hold integers, not object"),
    ("meta-tensor", lambda: (torch.tensor([4], device="meta"), [2]), "cannot read ids from this tensor"),
    ("sparse-tensor", lambda: (Sparse.ids(), [2]), "cannot read ids from this tensor"),
    ("float-tensor", lambda: (torch.tensor([4.0], requires_grad=True), [2]), "must hold integers, not torch.float32"),
    ("cpu-duplicate", lambda: ([4, 5], [2, 2]), "CPU block id 2 is a destination more than once"),
    # int32 ids (vLLM's) reach the core as they are: its checks are the same
    ("int32-negative", lambda: (np.array([4, -2], dtype=np.int32), [2, 3]), "GPU block ids hold a negative block id"),
    ("int32-max-cpu", lambda: ([4], np.array([2**31 - 1], dtype=np.int32)), "CPU block ids hold block id 2147483647"),
]  # fmt: skip


def refused_between_good_stores(
    grouped: bool, refuse: Callable[[HandlerScene], None], indices: Any = None
) -> None:
    """A store, ``refuse(scene)`` (which checks the refusal), then a store under the refused job
    id (it was never live): both stores run and nothing else is written. ``indices``: the good
    stores' ``block_indices``."""
    sc = HandlerScene.make(1, grouped)
    h = sc.h
    try:
        want = snapshot(sc.all_tensors())
        h.d2h.transfer_async(BEFORE, sc.spec([0, 1], [0, 1]), block_indices=indices)
        refuse(sc)
        h.d2h.transfer_async(BAD, sc.spec([6], [6]), block_indices=indices)
        h.wait([BEFORE, BAD])
        results = drain(h.get_finished, 2)
        assert sorted((r.job_id, r.success) for r in results) == [(BEFORE, True), (BAD, True)]
        # expected: the two good stores, nothing else
        sc.expect_stored(want, -1, ((0, 0), (1, 1), (6, 6)))
        assert_storage(sc.all_tensors(), want)
    finally:
        h.shutdown()


@pytest.mark.parametrize("grouped", [False, True], ids=["tables", "two-groups"])
@pytest.mark.parametrize(
    ("spec", "match"), [c[1:] for c in HANDLER_CASES], ids=[c[0] for c in HANDLER_CASES]
)
def test_handler_bad_spec_is_typed_and_transfers_around_it_are_unaffected(
    spec: Callable[[], Any], match: str, grouped: bool
) -> None:
    def refuse(sc: HandlerScene) -> None:
        src, dst = spec()
        with pytest.raises(InvalidTransferError, match=match) as e:
            sc.h.d2h.transfer_async(BAD, sc.spec(src, dst))
        assert f"d2h job {BAD}" in str(e.value)

    refused_between_good_stores(grouped, refuse)


# (id, block_indices for `ng` groups, message excerpt): Python lists take a fast path, anything
# else numpy's; both give the same refusals.
BLOCK_INDEX_CASES: list[tuple[str, Callable[[int], Any], str]] = [
    ("negative", lambda ng: [-1] * ng, "block_indices must be >= 0, got -1"),
    ("negative-array", lambda ng: np.full(ng, -3), "block_indices must be >= 0, got -3"),
    ("float", lambda ng: [1.5] * ng, "block_indices must hold integers, not float64"),
    ("bool", lambda ng: [True] * ng, "block_indices must hold integers, not bool"),
    ("past-int64", lambda ng: [2**70] * ng, r"block_indices holds integers outside \[-2\*\*63, 2\*\*63\)"),
    ("uint64", lambda ng: [2**63] * ng, r"block_indices holds values past 2\*\*63 - 1"),
    ("one-too-many", lambda ng: [0] * (ng + 1), "block_indices holds .* entries for"),
    ("none-entry", lambda ng: [None] * ng, "block_indices must hold integers, not object"),
]  # fmt: skip


@pytest.mark.parametrize("grouped", [False, True], ids=["tables", "two-groups"])
@pytest.mark.parametrize("good", [list, tuple])
@pytest.mark.parametrize(
    ("starts", "match"), [c[1:] for c in BLOCK_INDEX_CASES], ids=[c[0] for c in BLOCK_INDEX_CASES]
)
def test_handler_bad_block_indices_are_typed_and_issue_nothing(
    starts: Callable[[int], Any], match: str, good: type, grouped: bool
) -> None:
    ng = 2 if grouped else 1

    def refuse(sc: HandlerScene) -> None:
        with pytest.raises(InvalidTransferError, match=match):
            sc.h.d2h.transfer_async(BAD, sc.spec([0, 1], [0, 1]), block_indices=starts(ng))

    refused_between_good_stores(grouped, refuse, good([0] * ng))


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


def test_handler_object_arrays_of_small_ints_are_ids() -> None:
    """Python ints that numpy keeps as objects are ids like any others where they fit in 64 bits
    (one past it is refused as out of range, above, not as a type)."""
    sc = HandlerScene.make(1, False)
    h = sc.h
    try:
        want = snapshot(sc.all_tensors())
        h.d2h.transfer_async(3, sc.spec(np.array([4, 9], dtype=object), [2, 6]))
        h.wait([3])
        assert [(r.job_id, r.success) for r in h.get_finished()] == [(3, True)]
        sc.expect_stored(want, -1, [(4, 2), (9, 6)])
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
        with pytest.raises(InvalidTransferError, match=r"to 2\*\*64 - 1, not 18446744073709551616"):
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


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"cpu_caches": "gpu"}, "overlaps"),
        # Refused by its calibration, the last step: the engine ran, and the CPU cache
        # allocated here was pinned and registered.
        ({"calibrate": True, "cpu_layout": "mirror", "max_descriptors": 1}, "at most 1 are"),
    ],
    ids=["given-cache-overlaps", "calibration"],
)
def test_construction_failing_after_the_engine_started_shuts_it_down(
    options: dict[str, Any], match: str
) -> None:
    """Without waiting for a collection (the handlers hold reference cycles), a construction
    refused after its engine started leaves no engine thread running and no CPU cache it
    allocated pinned."""
    gpu = kv_cache()
    if options.get("cpu_caches") == "gpu":
        options = {**options, "cpu_caches": gpu}
    before = threads()
    gc.disable()
    try:
        kept = {id(o) for o in gc.get_objects() if isinstance(o, PinnedRows)}
        with pytest.raises(ConfigError, match=match):
            CpuGpuHandlers(gpu, N_GPU, layout="kv_split", backend="host", **options)
        assert not threads_settle(before), "the engine of the failed construction still runs"
        pinned = [
            o.users
            for o in gc.get_objects()
            if isinstance(o, PinnedRows) and id(o) not in kept and o.users
        ]
        assert not pinned, f"the CPU cache of the failed construction is still pinned: {pinned}"
    finally:
        gc.enable()
