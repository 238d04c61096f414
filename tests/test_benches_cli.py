"""The scripts in benches/ on one command line and one link ceiling: every script's ``--help``
parses and comes from the shared parser (``blockswap_bench.cli``), no script builds a parser of
its own, and the link's ceiling is measured in one place (``blockswap._bench.measure_ceiling``,
wrapped for the benchmarks' buffers by ``blockswap_bench.kvblocks``). The scripts need a GPU to
run; their command lines and the shared ceiling's host-backend path are checked here on the CPU.
"""

from __future__ import annotations

import argparse
import ast
import re
import runpy
import shlex
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import blockswap._bench as bench
from blockswap_bench import cli, kvblocks

ROOT = Path(__file__).resolve().parents[1]
BENCHES = ROOT / "benches"
SCRIPTS = sorted(BENCHES.glob("*.py"))
MODULES = sorted(BENCHES.rglob("*.py"))

#: Where a function or class named after the ceiling may be defined, by file and qualified
#: name: the one measurement (in the package, which ``blockswap bench`` runs), its wrapper for
#: the benchmarks' buffers, and the suite's per-run cache of it.
CEILING_DEFS = {
    ("python/blockswap/_bench.py", "measure_ceiling"),
    ("benches/blockswap_bench/kvblocks.py", "ceiling"),
    ("benches/blockswap_bench/kvblocks.py", "bidir_ceiling"),
    ("benches/blockswap_bench/kvblocks.py", "Ceilings"),
    ("benches/blockswap_bench/context.py", "Context.ceiling"),
    ("benches/blockswap_bench/context.py", "Context.measure_ceiling"),
}


def _defs(path: Path) -> list[tuple[str, ast.AST]]:
    """Every function and class defined in ``path``, with its qualified name."""
    out: list[tuple[str, ast.AST]] = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                out.append((name, child))
                walk(child, f"{name}.")
            else:
                walk(child, prefix)

    walk(ast.parse(path.read_text()), "")
    return out


def test_scripts_found() -> None:
    # The globs see the scripts this file is about (a moved folder fails here, not silently).
    names = {p.name for p in SCRIPTS}
    assert {"bench_blocks.py", "bench_wall.py", "bench_dma.py", "probe_staged.py"} <= names
    assert len(SCRIPTS) >= 20


def test_one_ceiling() -> None:
    """No copy of the ceiling's measurement: a function or class named after it exists only
    where :data:`CEILING_DEFS` says (adding one elsewhere fails here)."""
    found = set()
    for path in [*MODULES, ROOT / "python/blockswap/_bench.py"]:
        rel = path.relative_to(ROOT).as_posix()
        for name, _ in _defs(path):
            if re.search("ceil", name.rsplit(".", 1)[-1], re.IGNORECASE):
                found.add((rel, name))
    assert found == CEILING_DEFS


def test_package_does_not_import_benches() -> None:
    for path in (ROOT / "python/blockswap").rglob("*.py"):
        assert "blockswap_bench" not in path.read_text(), path


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.relative_to(BENCHES).as_posix())
def test_no_parser_of_its_own(path: Path) -> None:
    """Only ``blockswap_bench.cli`` constructs an ``ArgumentParser``."""
    if path == BENCHES / "blockswap_bench" / "cli.py":
        return
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            assert name != "ArgumentParser", f"{path.name}:{node.lineno} builds its own parser"


def _run(path: Path, argv: list[str], monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Runs the script ``path`` as ``__main__`` with ``argv``; the parsers whose help it printed."""
    shown: list[Any] = []
    real = argparse.ArgumentParser.print_help

    def print_help(self: argparse.ArgumentParser, file: Any = None) -> None:
        shown.append(self)
        real(self, file)

    monkeypatch.setattr(argparse.ArgumentParser, "print_help", print_help)
    monkeypatch.setattr(sys, "argv", [str(path), *argv])
    monkeypatch.setattr(sys, "path", [str(BENCHES), *sys.path])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(path), run_name="__main__")
    assert e.value.code == 0
    return shown


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_help(path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """``--help`` exits 0, printed by the shared parser, with the script's docstring."""
    shown = _run(path, ["--help"], monkeypatch)
    out = capsys.readouterr().out
    assert len(shown) == 1 and isinstance(shown[0], cli.Parser), shown
    assert out.startswith("usage:")
    first = ast.get_docstring(ast.parse(path.read_text()))
    if first:  # the docstring's first line is the help's description
        assert first.splitlines()[0].split()[0] in out


def _commands_in(text: str) -> list[str]:
    """The ``python benches/X.py ...`` commands in markdown ``text``: in fenced blocks one per
    line, in inline code a span's whole text (a span may go over a line break)."""
    spans = []
    for block in re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.DOTALL):
        spans += block.splitlines()
    text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    spans += [s.replace("\n", " ") for s in re.findall(r"`([^`]+)`", text)]
    return [s for s in spans if "python benches/" in s]


def _quoted_commands() -> list[tuple[str, tuple[str, ...]]]:
    """Every ``python benches/X.py ...`` command quoted in the docs and README (and recorded in
    the raw results' ``command``), with its arguments (``[...]`` usage and shell pipes cut off)."""
    found: list[str] = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        found += _commands_in(doc.read_text())
    for raw in sorted((ROOT / "docs").rglob("*.json")):
        found += re.findall(r'"command": "(python benches/[^"]*)"', raw.read_text())
    out = set()
    for line in found:
        for m in re.finditer(r"python (benches/\w+\.py)([^|;&]*)", line):
            script, rest = m.group(1), m.group(2)
            rest = rest.split("[", 1)[0].split("#", 1)[0]
            rest = re.split(r"\s[>(]|\)|\bpython\b", rest, maxsplit=1)[0]
            try:
                out.add((script, tuple(shlex.split(rest))))
            except ValueError:
                continue
    return sorted(out)


QUOTED = _quoted_commands()


def test_quoted_commands_found() -> None:
    assert len(QUOTED) >= 10


@pytest.mark.parametrize(("script", "args"), QUOTED, ids=[f"{s} {' '.join(a)}" for s, a in QUOTED])
def test_quoted_command_parses(
    script: str, args: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A command the docs quote still parses: its arguments, then ``--help`` (which exits 0 only
    where every argument before it was accepted)."""
    path = ROOT / script
    assert path.exists(), script
    _run(path, [*args, "--help"], monkeypatch)


# ---- the shared ceiling ------------------------------------------------------------------------


def test_measure_ceiling_is_the_best(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ceiling is the best sample after two discarded, over the copies queued per sample."""
    times = iter([9.0, 9.0, 2.0, 1.0, 4.0])

    def fake_timer(stream: Any) -> Any:
        return lambda issue, finish=None: (issue(), (next(times), 0.0))[1]

    monkeypatch.setattr(bench, "timer", fake_timer)
    src, dst = np.ones(1 << 20, np.uint8), np.zeros(1 << 20, np.uint8)
    c = bench.measure_ceiling(src, dst, 1 << 20, None, 3, max_reps=3, copies=2)
    assert c["reps"] == 3
    assert c["gbps"] == pytest.approx(2 * (1 << 20) / 1.0 / 1e9)
    assert "2 queued" in c["what"]
    assert (dst == 1).all()


def test_ceiling_host_backend() -> None:
    copier = kvblocks.Copier(4 << 20, cuda=False)
    c = kvblocks.ceiling(4 << 20, 2, copier=copier)
    assert set(c) == {"h2d", "d2h"} and all(v > 0 for v in c.values())
    assert set(kvblocks.ceiling(1 << 20, 2, copier=copier, directions=("d2h",))) == {"d2h"}
    assert kvblocks.bidir_ceiling(1 << 20, 2) > 0


def test_argument_types() -> None:
    assert cli.option("max_batch=16") == ("max_batch", 16)
    assert cli.option("timing=false") == ("timing", False)
    assert cli.option("x=none") == ("x", None)
    assert cli.int_list("1,2, 4") == [1, 2, 4]
    assert cli.kib_list("4,16") == [4, 16]
    assert cli.choices(("a", "b"))("b,a") == ["b", "a"]
    for bad in (lambda: cli.option("x"), lambda: cli.kib_list("0"), lambda: cli.int_list("a")):
        with pytest.raises(argparse.ArgumentTypeError):
            bad()
    with pytest.raises(argparse.ArgumentTypeError):
        cli.choices(("a",))("c")


def test_shared_options() -> None:
    ap = cli.parser("doc", reps=7, backend=True, quick="fast", seed=True)
    a = ap.parse_args([])
    assert (a.reps, a.backend, a.quick, a.seed, a.json) == (7, "auto", False, 0, None)
    a = ap.parse_args(["--reps", "3", "--backend", "host", "--quick", "--json", "x.json"])
    assert (a.reps, a.backend, a.quick, a.json) == (3, "host", True, "x.json")
    assert not hasattr(cli.parser(None, json=False).parse_args([]), "json")


@pytest.mark.cuda
def test_ceiling_cuda() -> None:
    c = kvblocks.ceiling(64 << 20, 3)
    assert set(c) == {"h2d", "d2h"} and all(1 < v < 1000 for v in c.values())
    both = kvblocks.bidir_ceiling(64 << 20, 3)
    assert 1 < both < 2000


@pytest.mark.cuda
def test_gated_gpu_seconds_cuda() -> None:
    """The gate's spin (about 10 ms) is not in the time: a 64 MiB copy behind it times as the
    copy alone does (about 1 ms), and the copy has landed."""
    import torch

    from blockswap_bench.common import cuda_time_on, gated_gpu_seconds

    n = 64 << 20
    host = torch.full((n,), 7, dtype=torch.uint8).pin_memory()
    dev = torch.zeros(n, dtype=torch.uint8, device="cuda")
    s = torch.cuda.Stream()

    def issue() -> None:
        with torch.cuda.stream(s):
            dev.copy_(host, non_blocking=True)

    alone = min(cuda_time_on(s, lambda: dev.copy_(host, non_blocking=True)) for _ in range(3))
    t = gated_gpu_seconds(issue, [s], 20_000_000)
    assert 1 < n / t / 1e9 < 1000
    assert t < 2 * alone + 1e-3
    assert int(dev[-1].item()) == 7
