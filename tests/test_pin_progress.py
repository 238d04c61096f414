"""Pinning a large cache reports progress: a line at least every PROGRESS_SECONDS with the share
done, the bytes faulted in and page-locked of the total, and the rate; the final line has the
total, the time and the rate."""

from __future__ import annotations

import logging
import re
import time

import pytest

from blockswap import _core, hostmem
from blockswap.hostmem import PinnedRows, PinProgress

LINE = re.compile(
    r"^pinning (?P<total>[\d.]+ GiB) of host memory: (?P<pct>\d+)% after \d+ s "
    r"\((?P<faulted>[\d.]+ \w+|\d+ bytes) faulted in, (?P<locked>[\d.]+ \w+|\d+ bytes) "
    r"page-locked; (?P<rate>\d+\.\d\d) GiB/s\)$"
)


class Steps:
    """Counts that grow by 4 GiB each time they are read (64 GiB faulted in, then locked): each
    line reports more than the one before, however late the reporting thread runs (counts
    driven by the clock read 100 % on every line where it ran late on a loaded machine)."""

    def __init__(self) -> None:
        self.reads = 0

    def get(self) -> tuple[int, int, int, int]:
        self.reads += 1
        total = 64 << 30
        done = self.reads * (4 << 30)
        return total, min(done, total), max(0, min(done - total, total)), total


def test_a_line_every_interval_with_the_share_the_bytes_and_the_rate(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="blockswap.hostmem")
    report = PinProgress(Steps(), interval=0.01).start()
    deadline = time.monotonic() + 30
    while report.lines < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    report.stop()
    lines = [r.getMessage() for r in caplog.records if r.name == "blockswap.hostmem"]
    assert len(lines) >= 5 and report.lines == len(lines), lines
    parsed = [LINE.match(ln) for ln in lines]
    assert all(parsed), lines
    assert {m["total"] for m in parsed if m} == {"64.00 GiB"}
    pcts = [int(m["pct"]) for m in parsed if m]
    assert pcts == sorted(pcts) and pcts[-1] > pcts[0]
    assert all(float(m["rate"]) > 0 for m in parsed if m)
    # Stopped: no more lines.
    n = len(caplog.records)
    time.sleep(0.05)
    assert len(caplog.records) == n


def test_a_quick_allocation_logs_no_progress(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="blockswap.hostmem")
    PinnedRows(4, 4096, backend="host")
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("pinning")] == []


def test_the_core_counts_the_total_and_nothing_to_pin_on_the_host_backend() -> None:
    counts = _core.AllocProgress()
    assert counts.get() == (0, 0, 0, 0)
    _core.HostBuffer(4, 4096, backend="host", progress=counts)
    assert counts.get() == (4 * 4096, 0, 0, 0)


@pytest.mark.cuda
def test_pinning_on_the_gpu_reports_progress_and_the_rate(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.INFO, logger="blockswap.hostmem")
    monkeypatch.setattr(hostmem, "PROGRESS_SECONDS", 0.05)
    buf = PinnedRows(2048, 2 << 20, piece_bytes=1 << 30, backend="cuda")  # 4 GiB in 4 pieces
    try:
        msgs = [r.getMessage() for r in caplog.records if r.name == "blockswap.hostmem"]
        progress = [m for m in msgs if m.startswith("pinning ")]
        assert progress and all(LINE.match(m) for m in progress), msgs
        assert re.search(r"pinned in 4 pieces .* in \d+\.\d\d s \(\d+\.\d\d GiB/s\)$", msgs[-1])
    finally:
        buf.unpin()
    # Unpinned on CUDA, not "not pinned (host backend)".
    assert buf.how() == "unpinned in 4 pieces of at most 1.00 GiB"
    assert buf.array.nbytes == 4 << 30  # still mapped
