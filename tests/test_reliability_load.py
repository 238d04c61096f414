"""Reliability, 5. Load: a million random transfers."""

from __future__ import annotations

import os

import pytest

from reliability_helpers import MiB
from reliability_stress import DEFAULT_TRANSFERS, run_stress

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
