"""Running a script of ``benches/`` from the tests: in a fresh interpreter, as a user would, its
exit status checked (the output's tail in the failure) and its JSON read back."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

BENCHES = Path(__file__).resolve().parents[1] / "benches"


def run_script(
    script: str, args: list[str], timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """Runs ``benches/<script>`` with ``args``; its output, once it exited 0."""
    p = subprocess.run(
        [sys.executable, str(BENCHES / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p


def run_with_json(
    script: str, args: list[str], out: Path, timeout: float = 600
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """Runs ``benches/<script>`` with ``args`` and ``--json out``; its output and figures."""
    p = run_script(script, [*args, "--json", str(out)], timeout)
    return p, json.loads(out.read_text())
