"""Runs ``mypy --strict`` over ``tests/typing/planted.py`` and checks that every planted mistake is
reported with its error code and that nothing else is: a typo in an option or a spec of the wrong
type is a type error. Exit status 0 when so; otherwise the lines that differ. (``make lint``.)"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PLANTED = HERE / "planted.py"
ERROR = re.compile(r"^[^:]*planted\.py:(\d+): error: .*\[([a-z-]+)\]$")


def main() -> int:
    expected: dict[int, str] = {}
    for i, line in enumerate(PLANTED.read_text().splitlines(), 1):
        m = re.search(r"# planted: ([a-z-]+)$", line)
        if m:
            expected[i] = m.group(1)
    p = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", "--config-file",
         str(HERE.parent.parent / "pyproject.toml"), str(PLANTED)],
        capture_output=True, text=True, cwd=HERE.parent.parent,
    )  # fmt: skip
    got: dict[int, set[str]] = {}
    for line in p.stdout.splitlines():
        m = ERROR.match(line)
        if m:
            got.setdefault(int(m.group(1)), set()).add(m.group(2))
    missed = {n: c for n, c in expected.items() if c not in got.get(n, set())}
    extra = {n: c for n, c in got.items() if n not in expected}
    if missed or extra or not expected:
        for n, c in sorted(missed.items()):
            print(f"planted.py:{n}: mypy --strict did not report [{c}]")
        for n, cs in sorted(extra.items()):
            print(f"planted.py:{n}: an error on a line with no planted mistake: {sorted(cs)}")
        print(p.stdout, p.stderr, sep="\n")
        return 1
    print(f"mypy --strict reported all {len(expected)} planted mistakes, and nothing else")
    return 0


if __name__ == "__main__":
    sys.exit(main())
