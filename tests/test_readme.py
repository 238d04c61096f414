"""The README's first example runs as it is pasted (host backend, no GPU)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
MARKER = "<!-- README example: tests/test_readme.py runs this block as it is -->"


def example() -> str:
    text = README.read_text()
    after = text[text.index(MARKER) + len(MARKER) :].lstrip("\n")
    assert after.startswith("```python\n"), "the marker must sit right above a python block"
    return after[len("```python\n") : after.index("\n```")]


def test_readme_example_runs_as_pasted(tmp_path: Path) -> None:
    code = example()
    assert code.startswith("import"), "the example brings its own imports"
    p = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120
    )
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0] == "1 True 1048576"
    assert lines[1].startswith("refused: ")
    assert "'version'" in lines[2]
    assert list(tmp_path.iterdir()) == []
