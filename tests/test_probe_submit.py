"""benches/probe_submit.py end to end on the host backend (a small cache): every piece it wraps
is still there to wrap, and each case prints its pieces and the whole call. The wrappers name
private methods of the handler and the plug-in, so a rename there breaks the probe; this is what
says so. Figures are checked for sanity, never for speed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bench_wall import vllm_missing

SCRIPT = Path(__file__).resolve().parents[1] / "benches" / "probe_submit.py"
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
