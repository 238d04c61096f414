"""``benches/bench_vllm.py`` end to end on the GPU (one model, one chunk size, few repetitions):
each case's row, the ceiling measured at the run's start and end, and every figure of the final
table and the JSON taken against the best of the two. Figures are checked for sanity, never for
speed."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench_helpers import run_with_json


@pytest.mark.cuda
def test_bench_vllm_takes_the_best_ceiling_of_its_start_and_end_cuda(tmp_path: Path) -> None:
    args = ["--models", "qwen2.5-7b", "--bpc", "1", "--reps", "2"]
    p, saved = run_with_json("bench_vllm.py", args, tmp_path / "vllm.json")
    assert [m["when"] for m in saved["ceilings"]] == ["start", "end"]
    for d in ("h2d", "d2h"):
        best = max(m[d] for m in saved["ceilings"])
        assert saved["ceiling_gbps"][d] == best > 0
        assert saved["best_from"][d] in ("start", "end")
    rows = saved["rows"]
    # Per-layer and cross-layer tensors, both directions, one chunk size.
    assert len(rows) == 4, rows
    for r in rows:
        assert r["ceiling_gbps"] == saved["ceiling_gbps"][r["direction"]]
        bs = r["blockswap"]
        assert bs["isolated_gbps"] > 0 and bs["queued_gbps"] > 0 and bs["wall_gbps"] > 0, bs
        assert r["rows_floor"]["isolated_gbps"] > 0 and r["vllm_dma"]["isolated_gbps"] > 0, r
    # The rows as they went, then the final table: each case printed twice.
    assert "# every row, % of the best ceiling of the run" in p.stdout
    qwen = [ln for ln in p.stdout.splitlines() if ln.startswith("Qwen2.5-7B")]
    assert len(qwen) == 2 * len(rows), p.stdout
