"""Reliability, 1. Bad input: the engine (address batches, registration, block tables, options)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from blockswap import BackendError, BlockswapError, Engine, InvalidTransferError
from reliability_helpers import BAD, BEFORE, KiB, MiB, Scene, StreamLike


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
    ("size-big-endian-uint64-max",
     lambda sc: sc.eng.submit(BAD, [sc.s], [sc.d + 256 * KiB], np.array([2**64 - 1], ">u8")),
     InvalidTransferError, r"sizes holds values past 2\*\*63 - 1"),
    ("dst-address-overflow", lambda sc: sc.eng.submit(BAD, [sc.s], [-4], [8]),
     InvalidTransferError, "destination range of descriptor 0 overflows"),
    ("too-many-descriptors",
     lambda sc: sc.eng.submit(BAD, sc.s + np.arange(17) * 64, sc.d + 256 * KiB + np.arange(17) * 64,
                              [8] * 17),
     InvalidTransferError, "17 descriptors in one transfer; at most 16"),
    ("job-id-2**64", lambda sc: sc.eng.submit(2**64, [sc.s], [sc.d + 256 * KiB], [8]),
     InvalidTransferError, r"job_id must be an int from 0 to 2\*\*64 - 1, not 18446744073709551616"),
    ("job-id-none", lambda sc: sc.eng.submit(None, [sc.s], [sc.d + 256 * KiB], [8]),
     InvalidTransferError, "job_id must be an int, not None"),
    ("job-id-float", lambda sc: sc.eng.submit(7.0, [sc.s], [sc.d + 256 * KiB], [8]),
     InvalidTransferError, "job_id must be an int, not 7.0"),
    ("job-id-bool", lambda sc: sc.eng.submit(True, [sc.s], [sc.d + 256 * KiB], [8]),
     InvalidTransferError, "job_id must be an int, not True"),
    ("job-id-negative-numpy", lambda sc: sc.eng.submit(np.int64(-7), [sc.s], [sc.d], [8]),
     InvalidTransferError, r"job_id must be an int from 0 to 2\*\*64 - 1, not np.int64\(-7\)"),
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
     InvalidTransferError, r"kernel_below must be an int from 0 to 2\*\*64 - 1, not -1"),
    ("launcher-not-callable",
     lambda sc: sc.eng.submit(BAD, [sc.s], [sc.d + 256 * KiB], [8], kernel_below=64, launcher=5),
     InvalidTransferError, "launcher must be callable or None, not 5"),
    # wait
    ("wait-negative-id", lambda sc: sc.eng.wait([-1]),
     InvalidTransferError, r"job_id must be an int from 0 to 2\*\*64 - 1, not -1"),
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
     InvalidTransferError, "ptr must be an int from 0 to 2\\*\\*64 - 1, not -1"),
    ("register-zero-bytes", lambda sc: sc.eng.register(4096, 0, "host"),
     InvalidTransferError, r"nbytes must be an int from 1 to 2\*\*64 - 1, not 0"),
    ("register-negative-bytes", lambda sc: sc.eng.register(4096, -8, "host"),
     InvalidTransferError, r"nbytes must be an int from 1 to 2\*\*64 - 1, not -8"),
    ("register-float-bytes", lambda sc: sc.eng.register(4096, 8.5, "host"),
     InvalidTransferError, "nbytes must be an int, not 8.5"),
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
     InvalidTransferError, r"ptr must be an int from 0 to 2\*\*64 - 1, not -1"),
    ("unregister-none", lambda sc: sc.eng.unregister(None),
     InvalidTransferError, "cannot unregister NoneType"),
    ("unregister-used-by-table", lambda sc: sc.eng.unregister(sc.dst),
     InvalidTransferError, "block table 1 lies in the region"),
    ("register-read-only-array",
     lambda sc: sc.eng.register(np.frombuffer(bytes(4 * KiB), np.uint8)),
     InvalidTransferError, "cannot register a read-only array"),
    ("pin-read-only-array", lambda sc: sc.eng.pin(np.frombuffer(bytes(4 * KiB), np.uint8)),
     InvalidTransferError, "cannot pin a read-only array"),
    ("register-object-array", lambda sc: sc.eng.register(np.array([None] * 8, dtype=object)),
     InvalidTransferError, "cannot register an array of Python objects"),
    ("pin-record-with-object-field",
     lambda sc: sc.eng.pin(np.zeros(4, dtype=[("a", "O"), ("b", "i8")])),
     InvalidTransferError, "cannot pin an array of Python objects"),
    ("register-sparse-tensor", lambda sc: sc.eng.register(torch.zeros(4, 4).to_sparse()),
     InvalidTransferError, "cannot register a tensor of layout torch.sparse_coo"),
    ("alloc-zero", lambda sc: sc.eng.alloc_host(0), InvalidTransferError, "an int from 1 to"),
    ("alloc-negative", lambda sc: sc.eng.alloc_host(-1), InvalidTransferError, "an int from 1 to"),
    ("alloc-float", lambda sc: sc.eng.alloc_host(1.5), InvalidTransferError, "nbytes must be an int, not 1.5"),
    ("alloc-unsatisfiable", lambda sc: sc.eng.alloc_host(2**62),
     BackendError, "could not allocate 4611686018427387904 bytes"),
    ("free-host-not-allocated", lambda sc: sc.eng.free_host(np.zeros(8, np.uint8)),
     InvalidTransferError, "no registered region starts at"),
    ("free-host-list", lambda sc: sc.eng.free_host([1, 2]),
     InvalidTransferError, "free_host takes an array from alloc_host, not list"),
    ("inject-negative", lambda sc: sc.eng.inject_failures(-1),
     InvalidTransferError, r"count must be an int from 0 to 2\*\*64 - 1, not -1"),
    # block tables
    ("table-negative-nbytes", lambda sc: sc.eng.register_table([sc.s], [64], [-1], 4, "host"),
     InvalidTransferError, r"nbytes holds a negative value \(-1\)"),
    ("table-negative-base", lambda sc: sc.eng.register_table([-64], [64], [64], 4, "host"),
     InvalidTransferError, r"bases holds a negative value \(-64\)"),
    ("table-zero-nbytes", lambda sc: sc.eng.register_table([sc.s], [64], [0], 4, "host"),
     InvalidTransferError, "zero bytes per page"),
    ("table-zero-blocks", lambda sc: sc.eng.register_table([sc.s], [64], [64], 0, "host"),
     InvalidTransferError, r"num_blocks must be an int from 1 to 2\*\*64 - 1, not 0"),
    ("table-negative-blocks", lambda sc: sc.eng.register_table([sc.s], [64], [64], -1, "host"),
     InvalidTransferError, r"num_blocks must be an int from 1 to 2\*\*64 - 1, not -1"),
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
     InvalidTransferError, r"unit must be an int from 1 to 2\*\*64 - 1, not 0"),
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


def test_an_allocated_buffer_is_not_freed_under_a_block_table() -> None:
    """A table is checked against registered memory when it is registered, not at each transfer:
    freeing (or unregistering) an ``alloc_host`` buffer a table lies in is refused, as
    unregistering any other region a table lies in is, and the table's transfers still move the
    right bytes afterwards. Once the table is gone the buffer frees."""
    sc = Scene()
    try:
        buf = sc.eng.alloc_host(64 * KiB)
        buf[:] = 0
        table = sc.eng.register_table([buf.ctypes.data], [4 * KiB], [4 * KiB], 16, "host", "CPU")
        for free in (sc.eng.free_host, sc.eng.unregister):
            with pytest.raises(
                InvalidTransferError, match=f"block table {table} lies in the region"
            ):
                free(buf)
        half = MiB // 2
        sc.dst[half:] = np.random.default_rng(7).integers(1, 256, half, dtype=np.uint8)
        ids = np.arange(16, dtype=np.int64)
        sc.eng.submit_blocks(BAD, sc.dev_table, ids, table, ids[::-1].copy(), "d2h")
        sc.eng.wait([BAD])
        assert [(r.job_id, r.success, r.bytes) for r in sc.eng.get_finished()] == [
            (BAD, True, 64 * KiB)
        ]
        want = sc.dst[half : half + 64 * KiB].reshape(16, 4 * KiB)[::-1]
        assert np.array_equal(buf.reshape(16, 4 * KiB), want)
        sc.eng.unregister_table(table)
        sc.eng.free_host(buf)
        with pytest.raises(InvalidTransferError, match="no registered region starts at"):
            sc.eng.free_host(buf)
    finally:
        sc.eng.shutdown()


def _packed_field(values: list[int], dtype: str) -> np.ndarray:
    """``values`` as a field of a packed record array: a view whose stride (the record's size)
    is not a whole number of items."""
    rec = np.zeros(len(values), dtype=np.dtype([("pad", "i4"), ("v", dtype)], align=False))
    rec["v"] = values
    return rec["v"]


def _unaligned(values: list[int], dtype: str) -> np.ndarray:
    """``values`` in a contiguous view at an odd offset of a buffer: not aligned."""
    a = np.frombuffer(b"\0" + np.array(values, dtype).tobytes(), dtype, offset=1)
    assert not a.flags.aligned
    return a


def test_strided_and_foreign_integer_arrays_are_accepted() -> None:
    """Valid inputs that are not plain int64 arrays: strided views, big-endian, int32, uint64,
    fields of packed records (a stride of no whole number of items) and unaligned views."""
    sc = Scene()
    try:
        big = np.array([sc.s + 4096, sc.s + 8192], dtype=">i8")
        packed = _packed_field([sc.s + 12 * KiB, sc.s + 16 * KiB], "i8")
        assert packed.strides == (12,)
        cases = [
            ((sc.s + np.arange(0, 4096, 64))[::16], (sc.d + 300 * KiB + np.arange(0, 4096, 64))[::16],
             np.full(8, 8, np.int64)[::2]),
            (big, np.array([sc.d + 400 * KiB, sc.d + 401 * KiB], dtype=">i8"),
             np.array([16, 16], np.int32)),
            (np.array([sc.s], np.uint64), np.array([sc.d + 402 * KiB], np.uint64),
             np.array([32], np.uint64)),
            (packed, _packed_field([sc.d + 403 * KiB, sc.d + 404 * KiB], "i8"),
             _packed_field([24, 40], "i4")),
            (_unaligned([sc.s + 20 * KiB, sc.s + 24 * KiB], "i8"),
             _unaligned([sc.d + 405 * KiB, sc.d + 406 * KiB], "i8"), _unaligned([8, 48], "i4")),
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
