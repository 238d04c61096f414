"""The probes that call private methods of the handler and the plug-in, end to end: a rename there
breaks them, and this is what says so. ``probe_submit.py`` on the host backend (a small cache):
every piece it wraps is still there to wrap, and each case prints its pieces and the whole call;
``probe_host_cold.py`` and ``probe_host_time.py`` (CUDA only) run to their end. Figures are
checked for sanity, never for speed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench_wall import vllm_missing

BENCHES = Path(__file__).resolve().parents[1] / "benches"
SCRIPT = BENCHES / "probe_submit.py"
ARGS = ["--backend", "host", "--pages", "4", "--layers", "8", "--blocks", "4", "--reps", "3"]


def test_probe_submit_runs_on_the_host_backend() -> None:
    p = subprocess.run(
        [sys.executable, str(SCRIPT), *ARGS, "--sleep-ms", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    lines = [line.split() for line in p.stdout.splitlines() if "KiB" in line]
    layouts = ["separate"] + (["plugin"] if vllm_missing() is None else [])
    for layout in layouts:
        for d in ("d2h", "h2d"):
            for way in ("b2b", "slept"):
                (row,) = [r for r in lines if r[2:5] == [layout, d, way]]
                pieces = dict(zip(row[5::2], map(float, row[6::2])))
                want = {"issue", "core", "total"} | ({"split"} if layout == "plugin" else set())
                assert want <= set(pieces), (layout, d, way, row)
                assert all(v > 0 for v in pieces.values()), row
                # The pieces are nested in the whole call.
                assert pieces["core"] <= pieces["issue"] <= pieces["total"], row
    floors = [r for r in lines if r[2] == "floor"]
    assert len(floors) == 2, lines


@pytest.mark.cuda
@pytest.mark.parametrize(
    "script, args",
    [("probe_host_cold.py", ["--rounds", "1"]), ("probe_host_time.py", ["--pages", "4"])],
)
def test_host_time_probes_run_cuda(script: str, args: list[str]) -> None:
    p = subprocess.run(
        [sys.executable, str(BENCHES / script), *args], capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "core submit" in p.stdout, p.stdout[-3000:]
