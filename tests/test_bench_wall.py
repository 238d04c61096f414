"""benches/bench_wall.py end to end on the host backend (``--quick``, a small cache): it runs, goes
on past a variant that cannot be built, and writes a JSON whose rows carry every field; on a GPU,
the same on the CUDA backend, the GPU time included. Figures are checked for sanity, never for
speed."""

from __future__ import annotations

import math
import subprocess
from pathlib import Path
from typing import Any

import pytest

from bench_helpers import run_with_json
from bench_wall import DIRECTIONS, LAYOUTS, ROW_FIELDS, vllm_missing

ARGS = ["--quick", "--backend", "host", "--layers", "8", "--blocks", "4"]
VARIANTS = ["--variants", "twin:", "bad:no_such_option=1"]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], dict]:
    out = tmp_path_factory.mktemp("wall") / "wall.json"
    return run_with_json("bench_wall.py", [*ARGS, *VARIANTS], out, timeout=300)


def _positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_the_run_is_described(run: tuple[subprocess.CompletedProcess[str], dict]) -> None:
    p, saved = run
    assert saved["backend"] == "host" and saved["gpu"] == "none (host backend)"
    assert saved["date"] and "driver" in saved
    assert saved["command"].startswith("python benches/bench_wall.py --quick")
    assert saved["command"].endswith("--json wall.json")  # the machine's folder left out
    assert saved["complete"] is True and _positive(saved["elapsed_s"])
    assert [m["when"] for m in saved["ceilings"]] == ["start", "middle", "end"]
    for d in DIRECTIONS:
        assert saved["ceiling_gbps"][d] == max(m[d] for m in saved["ceilings"])
        assert saved["best_from"][d] in ("start", "middle", "end")
    assert saved["config"]["pages_kib"] == [4, 64]
    assert set(saved["config"]["variants"]) == {"default", "twin", "bad"}
    assert "elapsed" in p.stdout and "n/a" in p.stdout  # GPU time: none on the host backend


def test_every_case_has_its_rows(run: tuple[subprocess.CompletedProcess[str], dict]) -> None:
    _, saved = run
    layouts = [x for x in LAYOUTS if x != "plugin" or vllm_missing() is None]
    if vllm_missing() is not None:
        assert "plugin" in saved["skipped_layouts"]
    keys = {
        (r["page_kib"], r["layout"], r["cpu_blocks"], r["direction"], r["variant"])
        for r in saved["rows"]
    }
    want = {
        (kib, layout, order, d, v)
        for kib in (4, 64)
        for layout in layouts
        for order in ("random", "adjacent")
        for d in DIRECTIONS
        for v in ("default", "twin", "bad")
    }
    assert keys == want and len(saved["rows"]) == len(want)


def test_measured_rows_carry_every_field(
    run: tuple[subprocess.CompletedProcess[str], dict],
) -> None:
    _, saved = run
    measured = [r for r in saved["rows"] if r["variant"] != "bad"]
    for r in measured:
        assert r["error"] is None, r
        assert set(ROW_FIELDS) <= set(r), set(ROW_FIELDS) - set(r)
        assert r["backend"] == "host" and r["bytes"] == 8 * 4 * r["page_kib"] * 1024
        for key in (
            "isolated_wall_us",
            "isolated_pct_link",
            "one_copy_wall_us",
            "isolated_pct_one_copy",
            "queued_pct_link",
            "idle_pct_link",
            "one_copy_idle_us",
            "idle_pct_one_copy",
            "async_b2b_us",
            "async_slept_us",
            "numpy_slept_us",
            "numpy_b2b_us",
            "slept_ratio",
        ):
            assert _positive(r[key]), (key, r)
        assert r["gpu_gbps"] is None and r["gpu_pct_link"] is None  # n/a without CUDA
        assert r["ceiling_gbps"] == saved["ceiling_gbps"][r["direction"]]
        assert math.isclose(
            r["isolated_pct_link"], 100 * r["isolated_wall_gbps"] / r["ceiling_gbps"]
        )
        assert len(r["samples"]["isolated_wall_s"]) == r["reps"]["isolated"] >= 3
        # One copy after each round's sleep, beside the transfers after theirs.
        assert len(r["samples"]["one_copy_idle_wall_s"]) == r["reps"]["slept"] >= 3
        assert len(r["samples"]["idle_wall_s"]) == r["reps"]["slept"]
        assert r["route"]


def test_a_variant_that_cannot_be_built_is_reported(
    run: tuple[subprocess.CompletedProcess[str], dict],
) -> None:
    p, saved = run
    bad = [r for r in saved["rows"] if r["variant"] == "bad"]
    assert bad and all("no_such_option" in r["error"] for r in bad)
    assert all(r["options"]["no_such_option"] == 1 for r in bad)
    assert "FAILED: cannot build" in p.stdout


@pytest.mark.cuda
def test_on_cuda_every_row_has_the_gpu_time_too(tmp_path: Path) -> None:
    args = ["--quick", "--backend", "cuda", "--layers", "8", "--blocks", "4", "--pages", "4,64"]
    _, saved = run_with_json("bench_wall.py", args, tmp_path / "wall.json")
    assert saved["backend"] == "cuda" and saved["gpu"] != "none (host backend)"
    assert saved["config"]["gpu_time"] is True
    assert saved["rows"]
    for r in saved["rows"]:
        assert r["error"] is None, r
        assert set(ROW_FIELDS) <= set(r)
        for key in ("isolated_pct_link", "isolated_pct_one_copy", "queued_pct_link",
                    "gpu_pct_link", "async_slept_us", "numpy_slept_us"):  # fmt: skip
            assert _positive(r[key]), (key, r)
        assert r["options"]["timing"] is True
