"""blockswap.hostmem: exactly sized host memory, registered with engines in pieces of whole rows.
On the host backend nothing is page-locked, but the pieces and the registrations cut at them are
the same code as on CUDA (without the driver calls)."""

from __future__ import annotations

import gc
import logging

import numpy as np
import pytest
import torch

import blockswap
from blockswap import ConfigError, ConfigTypeError, InvalidTransferError
from blockswap.hostmem import DEFAULT_PIECE_BYTES, REGISTRATION_LIMIT, PinnedRows

PAGE = 4096


def test_pieces_are_whole_rows_and_the_size_is_not_rounded(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="blockswap.hostmem"):
        p = PinnedRows(10, PAGE, piece_bytes=3 * PAGE + 100, backend="host")
    assert p.nbytes == p.array.nbytes == 10 * PAGE and p.array.shape == (10, PAGE)
    assert [n for _, n in p.pieces] == [3 * PAGE] * 3 + [PAGE]
    starts = [a for a, _ in p.pieces]
    assert starts == [p.addr + k * 3 * PAGE for k in range(4)]
    assert not p.pinned and p.backend == "host" and p.users == 0
    assert not p.array.any()  # zeroed
    assert (
        "40960 bytes (10 rows of 4096 bytes) not pinned (host backend) in 4 pieces of at most "
        "12288 bytes in" in caplog.text
    )
    t = p.tensor()
    assert t.dtype == torch.int8 and t.shape == (10, PAGE) and t.data_ptr() == p.addr
    t[9, -1] = 5
    assert p.array[9, -1] == 5
    # By default one piece up to 4 GiB (far below what one driver registration can take).
    assert DEFAULT_PIECE_BYTES == 4 << 30 and REGISTRATION_LIMIT == 512 << 30
    q = PinnedRows(3, 1000, backend="host", log_line=False)
    assert q.pieces == [(q.addr, 3000)]
    # Rows of 1,536 bytes end on a page every 8 rows: 16 rows per piece, not 19.
    r = PinnedRows(20, 1536, piece_bytes=30_000, backend="host", log_line=False)
    assert [n for _, n in r.pieces] == [16 * 1536, 4 * 1536]


def test_sizes_that_cannot_make_a_buffer_are_refused_by_name() -> None:
    """The core checks the sizes; what it refuses leaves the constructor as a ConfigError (a
    ConfigTypeError for a wrong type), as every constructor's bad argument does."""

    def refused(match: str, *args: int, **kw: int) -> None:
        with pytest.raises(ConfigError, match=match) as e:
            PinnedRows(*args, backend="host", log_line=False, **kw)
        assert str(e.value).startswith("PinnedRows: ")
        assert isinstance(e.value.__cause__, InvalidTransferError)

    refused("does not fit in a piece", 4, 100, piece_bytes=99)
    refused("every 8 rows", 20, 1536, piece_bytes=10_000)
    refused("or more fails", 4, 100, piece_bytes=REGISTRATION_LIMIT)
    refused(r"rows must be an int from 1 to 2\*\*64 - 1, not 0", 0, 100)
    refused("more than the address space", 1 << 62, 1 << 10)
    with pytest.raises(ConfigTypeError, match=r"row_bytes must be an int, not 1\.5"):
        PinnedRows(4, 1.5, backend="host")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="backend must be"):
        PinnedRows(4, 100, backend="gpu")  # type: ignore[arg-type]


def test_an_engine_registers_the_memory_piece_by_piece() -> None:
    p = PinnedRows(10, PAGE, piece_bytes=3 * PAGE, backend="host", log_line=False)
    p.array[:] = np.arange(10, dtype=np.uint8)[:, None]
    dev = np.zeros(2 * PAGE, np.uint8)
    e = blockswap.Engine("host")
    try:
        assert e.register(p.array) == p.addr
        e.register(dev, kind="device")
        assert p.users == 1
        with pytest.raises(InvalidTransferError, match="registered with 1 engine"):
            p.unpin()
        second = p.pieces[1][0]
        with pytest.raises(InvalidTransferError, match=f"piece of the registration at {p.addr:#x}"):
            e.unregister(second)
        # A descriptor across two pieces is refused; one per piece moves the same bytes.
        with pytest.raises(InvalidTransferError, match="one region: no copy crosses"):
            e.submit(1, [second - PAGE], [dev.ctypes.data], [2 * PAGE], "h2d")
        e.submit(1, [second - PAGE, second], [dev.ctypes.data, dev.ctypes.data + PAGE],
                 [PAGE, PAGE], "h2d")  # fmt: skip
        e.wait([1])
        assert [r.success for r in e.get_finished()] == [True]
        assert (dev[:PAGE] == 2).all() and (dev[PAGE:] == 3).all()
        e.unregister(p.array)
        assert p.users == 0
        p.unpin()
        p.unpin()
    finally:
        e.shutdown()
    # An engine collected with a registration lets go of the buffer.
    q = PinnedRows(4, PAGE, piece_bytes=2 * PAGE, backend="host", log_line=False)
    e = blockswap.Engine("host")
    e.register(q.array)
    assert q.users == 1
    e.shutdown()
    del e
    gc.collect()
    assert q.users == 0


def test_a_table_may_span_the_pieces_but_no_page_may_cross_one() -> None:
    p = PinnedRows(10, PAGE, piece_bytes=3 * PAGE, backend="host", log_line=False)
    with blockswap.Engine("host") as e:
        e.register(p.array)
        # Two pages a row, over all four pieces: fine.
        t = e.register_table([p.addr, p.addr + PAGE // 2], [PAGE, PAGE], [PAGE // 2] * 2, 10,
                             "host")  # fmt: skip
        e.unregister_table(t)
        # Pages of 5,000 bytes: block 2's holds the first boundary, 3 rows in.
        boundary = p.pieces[1][0]
        with pytest.raises(
            InvalidTransferError,
            match=rf"block table segment 0: the page of block 2 \(\[{p.addr + 10_000:#x}, "
            rf"\+5000\)\) crosses the boundary at {boundary:#x} between two registered regions",
        ):
            e.register_table([p.addr], [5000], [5000], 8, "host")
        # A second segment whose pages straddle while the first one's do not: named too.
        with pytest.raises(InvalidTransferError, match="segment 1: the page of block 2"):
            e.register_table([p.addr, p.addr + PAGE - 100], [PAGE] * 2, [100, 200], 9, "host")
        e.unregister(p.array)
