"""The code's shape: no import circle between the Rust core's modules, no source file (Rust or
the Python package) over 900 lines.

A module's dependencies are read from its ``use`` lines and the ``crate::`` paths in its code, as
a reader (or a tool) sees them. A module and its ancestors are one unit (a child names its
parent's items, a parent re-exports its child's): only edges between modules of which neither
contains the other count. A circle among the rest means two files that cannot be read, or
changed, one before the other.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

RUST = Path(__file__).resolve().parent.parent / "rust"
PYTHON = Path(__file__).resolve().parent.parent / "python" / "blockswap"
MAX_LINES = 900

Module = tuple[str, ...]


def _module_of(path: Path) -> Module:
    parts = list(path.relative_to(RUST).with_suffix("").parts)
    if parts[-1] in ("lib", "mod"):
        parts.pop()
    return tuple(parts)


def _strip(text: str) -> str:
    """The code without comments, string and character literals (where paths are prose)."""
    out, i, n = [], 0, len(text)
    while i < n:
        ch, nxt = text[i], text[i + 1 : i + 2]
        if ch == "/" and nxt == "/":
            i = text.find("\n", i)
            i = n if i < 0 else i
        elif ch == "/" and nxt == "*":
            end = text.find("*/", i + 2)
            i = n if end < 0 else end + 2
        elif ch == "r" and re.match(r'r#*"', text[i:]) and not (i and text[i - 1].isalnum()):
            hashes = re.match(r'r(#*)"', text[i:]).group(1)  # type: ignore[union-attr]
            end = text.find('"' + hashes, i + 2 + len(hashes))
            i = n if end < 0 else end + 1 + len(hashes)
            out.append('""')
        elif ch == '"':
            i += 1
            while i < n and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
            i += 1
            out.append('""')
        elif ch == "'" and (nxt == "\\" or text[i + 2 : i + 3] == "'"):
            end = text.find("'", i + 2)
            i = n if end < 0 else end + 1
        else:
            out.append(ch)
            i += 1
    return "".join(out)


def _expand(tree: str) -> list[list[str]]:
    """The paths a ``use`` tree names: ``a::{b, c::{d, e}}`` -> a::b, a::c::d, a::c::e."""
    tree = re.sub(r"\s+", "", tree)
    depth, start, items = 0, 0, []
    if "{" not in tree:
        return [tree.split("::")]
    head, _, rest = tree.partition("{")
    prefix = [p for p in head.split("::") if p]
    body = rest[: rest.rfind("}")]
    for i, ch in enumerate(body + ","):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        elif ch == "," and depth == 0:
            if body[start:i]:
                items.append(body[start:i])
            start = i + 1
    return [prefix + sub for item in items for sub in _expand(item)]


def _resolve(module: Module, path: list[str], modules: set[Module]) -> Module | None:
    """The module a path from ``module`` lands in (its longest prefix that is a module)."""
    path = [p.split(" as ")[0] for p in path if p not in ("", "*")]
    if not path:
        return None
    if path[0] == "crate":
        base: list[str] = []
        path = path[1:]
    elif path[0] in ("super", "self"):
        base = list(module)
        while path and path[0] in ("super", "self"):
            if path[0] == "super":
                base.pop()
            path = path[1:]
    else:
        return None  # another crate, or the standard library
    best: Module | None = tuple(base) if tuple(base) in modules else None
    for i in range(1, len(path) + 1):
        candidate = tuple(base + path[:i])
        if candidate in modules:
            best = candidate
    return best


def _graph() -> dict[Module, set[Module]]:
    files = {_module_of(p): p for p in RUST.rglob("*.rs")}
    modules = set(files)
    edges: dict[Module, set[Module]] = {m: set() for m in modules}
    for module, path in files.items():
        code = _strip(path.read_text())
        paths = [
            p
            for tree in re.findall(r"\buse\s+([^;]+);", code)
            for p in _expand(tree.replace("pub(crate)", ""))
        ]
        paths += [["crate", *m.split("::")] for m in re.findall(r"\bcrate((?:::\w+)+)", code)]
        paths = [[s for s in p if s] for p in paths]
        for p in paths:
            target = _resolve(module, p, modules)
            if target is None or target == module:
                continue
            related = target[: len(module)] == module or module[: len(target)] == target
            if not related:
                edges[module].add(target)
    return edges


def _circles(edges: dict[Module, set[Module]]) -> list[list[Module]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[Module, int] = {}
    low: dict[Module, int] = {}
    stack: list[Module] = []
    on: set[Module] = set()
    out: list[list[Module]] = []

    def visit(v: Module) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_reader_sees_the_edges_it_should():
    edges = _graph()
    assert ("engine",) in edges[("py",)]
    assert ("backend", "cuda", "shared") in edges[("backend", "cuda", "worker")]
    assert ("backend", "cuda", "lane") in edges[("backend", "cuda", "shared")]
    # A child naming its parent is not an edge between two modules.
    assert ("table",) not in edges[("table", "staged")]


def test_the_circle_finder_finds_a_circle():
    a, b, c = ("a",), ("b",), ("c",)
    assert _circles({a: {b}, b: {c}, c: {a}}) == [[a, b, c]]
    assert _circles({a: {b}, b: {c}, c: set()}) == []


def test_no_import_circle_between_rust_modules():
    circles = _circles(_graph())
    named = ["{" + ", ".join("::".join(m) for m in c) + "}" for c in circles]
    assert not circles, f"modules that use each other: {'; '.join(named)}"


@pytest.mark.parametrize("path", sorted(RUST.rglob("*.rs")), ids=lambda p: str(p.relative_to(RUST)))
def test_no_rust_source_file_over_900_lines(path: Path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(RUST)} has {lines} lines: split it by concern"


@pytest.mark.parametrize(
    "path", sorted(PYTHON.rglob("*.py")), ids=lambda p: str(p.relative_to(PYTHON))
)
def test_no_python_source_file_over_900_lines(path: Path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(PYTHON)} has {lines} lines: split it by concern"
