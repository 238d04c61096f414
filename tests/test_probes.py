"""The probes that call private methods of the handler and the plug-in, end to end: a rename there
breaks them, and this is what says so. ``probe_submit.py`` on the host backend (a small cache):
every piece it wraps is still there to wrap, and each case prints its pieces and the whole call
(and, called ``alone``, the wall clock to the result and the transfer's own time);
``probe_host_cold.py``, ``probe_host_time.py``, ``probe_step_gaps.py`` (both modes) and
``probe_split.py`` (CUDA only) run to their end. Figures are checked for sanity, never for
speed."""

from __future__ import annotations

import pytest

from bench_helpers import run_script
from bench_wall import vllm_missing

ARGS = ["--backend", "host", "--pages", "4", "--layers", "8", "--blocks", "4", "--reps", "3"]


def test_probe_submit_runs_on_the_host_backend() -> None:
    p = run_script("probe_submit.py", [*ARGS, "--sleep-ms", "1", "--ways", "b2b,slept,alone"])
    lines = [line.split() for line in p.stdout.splitlines() if "KiB" in line]
    layouts = ["separate"] + (["plugin"] if vllm_missing() is None else [])
    for layout in layouts:
        for d in ("d2h", "h2d"):
            for way in ("b2b", "slept", "alone"):
                (row,) = [r for r in lines if r[2:5] == [layout, d, way]]
                pieces = dict(zip(row[5::2], map(float, row[6::2])))
                # The usual call goes to the core in one call: no spec cut in Python.
                want = {"issue", "core", "total"}
                ends = {"wall", "gpu", "rest"}
                assert want | (ends if way == "alone" else set()) <= set(pieces), (way, row)
                rest = pieces.pop("rest", None)  # a difference: of either sign
                assert all(v > 0 for v in pieces.values()), row
                # The pieces are nested in the whole call, the whole call in the wall clock.
                assert pieces["core"] <= pieces["issue"] <= pieces["total"], row
                if way == "alone":
                    assert pieces["total"] < pieces["wall"], row
                    assert rest is not None and rest < pieces["wall"], row
    floors = [r for r in lines if r[2] == "floor"]
    assert len(floors) == 2, lines


@pytest.mark.cuda
@pytest.mark.parametrize(
    "script, args",
    [("probe_host_cold.py", ["--rounds", "1"]), ("probe_host_time.py", ["--pages", "4"])],
)
def test_host_time_probes_run_cuda(script: str, args: list[str]) -> None:
    p = run_script(script, args)
    assert "core submit" in p.stdout, p.stdout[-3000:]


@pytest.mark.cuda
@pytest.mark.parametrize("isolated", [True, False], ids=["isolated", "queued"])
def test_step_gaps_runs_cuda(isolated: bool) -> None:
    """``probe_step_gaps.py``: a line per direction and step count; ``--isolated``, one copy's time
    and the two variants' share of it, else every variant's share of the link."""
    args = ["--mib", "4", "--row-kib", "256", "--steps", "1,2", "--reps", "3"]
    p = run_script("probe_step_gaps.py", args + (["--isolated"] if isolated else []))
    rows = [line.split() for line in p.stdout.splitlines() if line[:3] in ("d2h", "h2d")]
    assert sorted((r[0], r[1]) for r in rows) == [
        ("d2h", "1"), ("d2h", "2"), ("h2d", "1"), ("h2d", "2")
    ], p.stdout  # fmt: skip
    for r in rows:
        pcts = r[4:] if isolated else r[3:]
        assert len(pcts) == (3 if isolated else 6), r
        assert all(0 < float(x.rstrip("%")) < 1000 for x in pcts), r
        if isolated:
            assert float(r[3]) > 0, r  # one copy's µs


@pytest.mark.cuda
def test_split_runs_cuda() -> None:
    """``probe_split.py``: per direction a wall and a GPU line, each one copy's µs and its own
    share of the link, then the rows, the staged steps, the kernel alone and each split as a
    share of that copy."""
    args = ["--mib", "2", "--row-kib", "256", "--steps", "2", "--splits", "0.25/2", "--reps", "2"]
    p = run_script("probe_split.py", args)
    rows = [line.split() for line in p.stdout.splitlines() if line[:3] in ("d2h", "h2d")]
    assert sorted((r[0], r[1]) for r in rows) == [
        ("d2h", "gpu"), ("d2h", "wall"), ("h2d", "gpu"), ("h2d", "wall")
    ], p.stdout  # fmt: skip
    for r in rows:
        assert float(r[2]) > 0, r  # one copy's µs
        assert len(r[3:]) == 5, r  # its % of the link; rows, staged, kernel16, the split
        assert all(0 < float(x.rstrip("%")) < 1000 for x in r[3:]), r
