"""The README's examples run as they are pasted (host backend, no GPU)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
MARKER = "<!-- README example: tests/test_readme.py runs this block as it is -->"


HANDLER_MARKER = "<!-- handler example: tests/test_readme.py runs this block as it is -->"


def example(marker: str = MARKER) -> str:
    text = README.read_text()
    after = text[text.index(marker) + len(marker) :].lstrip("\n")
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


def test_the_handler_example_runs_as_pasted(tmp_path: Path) -> None:
    """Every name it uses is defined, and it shows a result's ``.error``."""
    code = example(HANDLER_MARKER)
    assert code.startswith("import") and ".error" in code
    p = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120
    )
    assert p.returncode == 0, p.stderr
    page = 16 * 8 * 128 * 2  # bytes of one K or V page
    lines = p.stdout.splitlines()
    # The two directions' results, in either order.
    assert sorted(lines[:2]) == [
        f"1 True {3 * 2 * 4 * page} None",
        f"2 True {3 * 2 * 4 * page} None",
    ]
    assert lines[2:] == ["True", "1"]
