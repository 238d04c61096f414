"""The declared minimum Rust version against the locked dependencies' own.

    python .ci/msrv.py

Reads ``cargo metadata`` (locked, for this machine's platform), walks every dependency the crate
builds with (normal, build and dev: the tests are built too), and fails if one declares a
``rust-version`` newer than Cargo.toml's. Model-checking dependencies (``cfg(loom)``) are not
part of a normal build and drop out with the platform filter. It says nothing about the crate's
own code: ``make msrv`` also builds it with that toolchain where rustup can install it.
"""

from __future__ import annotations

import json
import subprocess
import sys


def version(v: str) -> tuple[int, int, int]:
    """``"1.85"`` and ``"1.85.0"`` alike as ``(1, 85, 0)``."""
    major, minor, patch = ([*map(int, v.split(".")), 0, 0])[:3]
    return major, minor, patch


def main() -> int:
    host = next(
        line.split(":", 1)[1].strip()
        for line in subprocess.run(
            ["rustc", "-vV"], capture_output=True, text=True, check=True
        ).stdout.splitlines()
        if line.startswith("host:")
    )
    # Every feature: the bindings (pyo3, numpy) are behind the "python" feature.
    cmd = ["cargo", "metadata", "--format-version", "1", "--locked", "--all-features"]
    cmd += ["--filter-platform", host]
    meta = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    packages = {p["id"]: p for p in meta["packages"]}
    nodes = {n["id"]: n for n in meta["resolve"]["nodes"]}
    root = meta["resolve"]["root"]
    declared = packages[root]["rust_version"]
    seen, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in seen:
            seen.add(pid)
            todo.extend(d["pkg"] for d in nodes[pid]["deps"])
    deps = sorted(
        (version(p["rust_version"]), p["name"], p["version"])
        for pid in seen - {root}
        if (p := packages[pid]).get("rust_version")
    )
    newest = deps[-1]
    print(
        f"rust-version {declared}; {len(seen) - 1} locked dependencies, the newest requirement: "
        f"{'.'.join(map(str, newest[0]))} ({newest[1]} {newest[2]})"
    )
    too_new = [d for d in deps if d[0] > version(declared)]
    for v, name, ver in too_new:
        print(f"  {name} {ver} needs Rust {'.'.join(map(str, v))}", file=sys.stderr)
    if too_new:
        print(f"Cargo.toml's rust-version {declared} is too old: raise it", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
