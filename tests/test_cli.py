"""The command line (``python -m blockswap``) and the library's logging, on the host backend."""

from __future__ import annotations

import ast
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import blockswap
from blockswap.__main__ import describe, main
from blockswap.engine import _log_start


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "blockswap", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=120,
    )


def test_version(tmp_path: Path) -> None:
    p = cli("--version", cwd=tmp_path)
    assert p.returncode == 0 and p.stdout.strip() == f"blockswap {blockswap.__version__}"


def test_no_command_prints_info_and_writes_nothing(tmp_path: Path) -> None:
    p = cli(cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stdout == cli("info", cwd=tmp_path).stdout
    assert p.stdout.startswith(f"blockswap {blockswap.__version__}\n") and p.stderr == ""
    assert list(tmp_path.iterdir()) == []


def test_a_reader_that_went_away_ends_the_command_without_a_traceback(tmp_path: Path) -> None:
    """``blockswap info --json | head -c 10``: the pipe closed before the output is written
    ends the command as a shell expects (141), with no traceback."""
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first write
    try:
        p = subprocess.run(
            [sys.executable, "-m", "blockswap", "info", "--json"],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
            timeout=120,
        )
    finally:
        os.close(write)
    assert p.returncode == 141, p.stderr
    assert "Traceback" not in p.stderr and "BrokenPipeError" not in p.stderr, p.stderr


def test_info_says_torch_triton_and_whether_the_copy_kernel_can_run(tmp_path: Path) -> None:
    import importlib.metadata

    plain = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run(
        [sys.executable, "-m", "blockswap", "info"],
        capture_output=True, text=True, cwd=tmp_path, timeout=120, env=plain,
    )  # fmt: skip
    lines = p.stdout.splitlines()
    assert f"torch:           {importlib.metadata.version('torch')}" in lines
    assert f"triton:          {importlib.metadata.version('triton')}" in lines
    kernel = next(ln for ln in lines if ln.startswith("copy kernel:"))
    if blockswap.cuda_status()[0]:
        assert kernel == "copy kernel:     yes (on the GPU)"
    else:
        assert kernel.startswith("copy kernel:     no (no CUDA GPU here"), kernel
        assert "TRITON_INTERPRET=1" in kernel
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    p = subprocess.run(
        [sys.executable, "-m", "blockswap", "info", "--json"],
        capture_output=True, text=True, cwd=tmp_path, timeout=120, env=env,
    )  # fmt: skip
    d = json.loads(p.stdout)
    assert d["copy_kernel"]["can_run"] is True and "interpreter" in d["copy_kernel"]["why"]
    assert d["torch"] == importlib.metadata.version("torch")
    # Without Triton, the kernel cannot run, whatever the GPU.
    from blockswap.__main__ import copy_kernel_status

    real = importlib.util.find_spec
    try:
        importlib.util.find_spec = lambda name, *a: None if name == "triton" else real(name, *a)  # type: ignore[assignment]
        assert copy_kernel_status(True) == (
            False, "triton not installed (pip install 'blockswap[torch]')"
        )  # fmt: skip
    finally:
        importlib.util.find_spec = real


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["frob"], "invalid choice: 'frob'"),
        # The benchmark suite's options are benches/suite.py's, not the package's short benchmark.
        (["bench", "--full"], "unrecognized arguments: --full"),
        (["bench", "--out", "here"], "unrecognized arguments: --out here"),
        (["bench", "--backend", "tpu"], "invalid choice: 'tpu'"),
        (["bench", "--tiny", "--quick"], "not allowed with argument"),
        (["info", "--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_a_bad_argument_is_one_line_and_exit_2(tmp_path: Path, args: list[str], said: str) -> None:
    p = cli(*args, cwd=tmp_path)
    assert p.returncode == 2
    assert p.stderr.count("\n") == 1 and said in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and p.stdout == ""
    assert list(tmp_path.iterdir()) == [], "an error wrote files"


def test_info(tmp_path: Path) -> None:
    p = cli("info", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    for what in ("default backend:", "copy path:", "GPU->CPU (d2h):", "CPU->GPU (h2d):"):
        assert what in p.stdout, what
    d = json.loads(cli("info", "--json", cwd=tmp_path).stdout)
    assert d["version"] == blockswap.__version__ and d["engine"]["backend"] in ("cuda", "host")
    assert set(d["routes"]) == {"d2h", "h2d"}
    assert list(tmp_path.iterdir()) == []


def test_info_routes_on_the_host_backend() -> None:
    if blockswap.info()["cuda"]:
        pytest.skip("the default backend here is CUDA")
    d = describe()
    assert d["default_backend"] == "host" and d["engine"]["copy_path"]
    assert all("memcpy" in r for r in d["routes"].values())


def test_info_on_a_cuda_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """What `blockswap info` says where the CUDA backend starts (the engine is a stand-in)."""
    pytest.importorskip("torch")
    import importlib.util

    import blockswap.__main__ as cli

    class FakeEngine:
        def __init__(self, backend: str) -> None:
            assert backend == "cuda"

        def info(self) -> dict[str, object]:
            return {
                "backend": "cuda",
                "driver_version": 13000,
                "device": "cuda:0 (NVIDIA H100 80GB HBM3)",
                "copy_path": "cuMemcpyBatchAsync (13.0 ABI)",
                "completion": "cuStreamWriteValue64 into mapped pinned memory",
            }

        def shutdown(self) -> None:
            pass

    monkeypatch.setattr(cli, "Engine", FakeEngine)
    monkeypatch.setattr(
        cli,
        "info",
        lambda: {
            "version": "0",
            "cuda": True,
            "cuda_status": "CUDA driver 13000",
            "default_backend": "cuda",
        },
    )
    text = cli.format_info(cli.describe())
    assert "driver:          CUDA 13.0 (13000)" in text
    assert "copy path:       cuMemcpyBatchAsync (13.0 ABI)" in text
    kernel = "Triton copy kernel (16 CTAs, at most 8 MiB per launch)"
    if importlib.util.find_spec("triton") is None:
        kernel = "DMA: triton is not installed"
    # The handler's default CPU cache is block-major: its plans first, a mirror's after.
    staged = "else the staged plan"
    if importlib.util.find_spec("triton") is None:
        staged = "else per-page DMA (triton is not installed"
    for d in ("GPU->CPU (d2h)", "CPU->GPU (h2d)"):
        assert f"{d}: block-major CPU cache (the default): the block plan" in text
        assert f"pages lie at one pitch and are >= 64 KiB, {staged}" in text
        assert f"mirrored CPU cache: pages < 256 KiB: {kernel}\n" in text
    assert text.count("larger pages: cuMemcpyBatchAsync (13.0 ABI)") == 2


def test_bench_prints_a_table_and_writes_nothing(tmp_path: Path) -> None:
    p = cli("bench", "--tiny", "--backend", "host", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].startswith(f"blockswap {blockswap.__version__}: host backend")
    assert lines[1].startswith("ceiling, one memcpy") and "CPU->GPU" in lines[1]
    assert max(len(line) for line in lines) <= 100
    rows = [line.split("|")[1:-1] for line in lines if line.startswith("| ")]
    assert [c.strip() for c in rows[0]] == [
        "direction",
        "block",
        "transfer",
        "one copy",
        "DMA batch",
        "auto",
        "auto chose",
    ]
    body = [[c.strip() for c in r] for r in rows[1:]]
    assert [(r[0], r[1]) for r in body] == [
        (f"{d}", size) for d in ("CPU->GPU (h2d)", "GPU->CPU (d2h)") for size in ("4 KiB", "64 KiB")
    ]
    for r in body:
        for cell in r[3:6]:  # "12.3 (45 %)": GB/s, then the percent of the ceiling
            gbps, pct = cell.split(" (")
            assert float(gbps) > 0 and pct.endswith(" %)"), r
        assert r[6] == "memcpy", r  # the host backend's one path
    assert "benches/suite.py" in p.stdout
    assert list(tmp_path.iterdir()) == []


def test_bench_names_a_failed_measurement_and_exits_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from blockswap import _bench

    def broken(*_args: object, **_kw: object) -> object:
        def measure() -> tuple[float, float]:
            raise RuntimeError("no transfer today")

        return measure

    monkeypatch.setattr(_bench, "engine_measure", broken)
    assert main(["bench", "--tiny", "--backend", "host"]) == 1
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "KiB" in line]
    assert len(rows) == 4 and all(r.split("|")[5].strip() == "[1]" for r in rows), out
    assert "[1] failed: RuntimeError: no transfer today" in out


# ---- logging ----------------------------------------------------------------------------------


def test_engine_start_and_host_allocation_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="blockswap")
    with blockswap.Engine("host") as eng:
        eng.alloc_host(3 << 20)
    msgs = [r.getMessage() for r in caplog.records if r.name.startswith("blockswap")]
    assert any(m.startswith("engine: host backend, copy path memcpy") for m in msgs), msgs
    assert any(m.startswith("alloc_host: 3.0 MiB of host memory") for m in msgs), msgs


def test_the_loop_fallback_is_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="blockswap")
    info = {
        "backend": "cuda",
        "device": "cuda:0 (test)",
        "driver_version": 12040,
        "copy_path": "cuMemcpyAsync loop",
        "completion": "event query",
    }
    _log_start(info, "auto")
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "driver (12.4) has no batch copy" in warned[0].getMessage()
    caplog.clear()
    _log_start(info, "loop")  # asked for: no warning
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def test_a_shutdown_past_its_timeout_is_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="blockswap")
    n = 256 << 20
    src, dst = np.ones(n, dtype=np.uint8), np.zeros(n, dtype=np.uint8)
    # 256 MiB takes milliseconds: still in flight at a zero timeout, unless this thread was kept
    # from running for all of them (a loaded machine), where the shutdown drains and says
    # nothing; then again, a few times at most.
    for _ in range(5):
        caplog.clear()
        eng = blockswap.Engine("host", shutdown_timeout=0.0)
        eng.register(src)
        eng.register(dst)
        eng.submit(1, [src.ctypes.data], [dst.ctypes.data], [n], "h2h")
        eng.shutdown()
        eng.shutdown()  # logged once
        msgs = [r.getMessage() for r in caplog.records]
        if eng.stats()["shutdown_timed_out"]:
            break
        assert msgs == []
    assert eng.stats()["shutdown_timed_out"], "five 256 MiB copies each done at a zero timeout"
    assert len(msgs) == 1 and "shutdown timed out" in msgs[0], msgs


def test_handler_routes_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    torch = pytest.importorskip("torch")
    from blockswap.handler import CpuGpuHandlers

    caplog.set_level(logging.INFO, logger="blockswap")
    gpu = [torch.zeros(2, 8, 4, 16, dtype=torch.float16) for _ in range(2)]
    with CpuGpuHandlers(gpu, 8, layout="kv_split", backend="host"):
        pass
    msgs = [r.getMessage() for r in caplog.records]
    # Two separately allocated layers: no block plan joins them; the staged plan moves them.
    assert any(m.startswith("GPU -> CPU route (path='auto'): staged") for m in msgs), msgs
    assert any(m.startswith("CPU cache: ") for m in msgs), msgs


def test_the_library_prints_nothing() -> None:
    """Only the command line and its benchmark (``blockswap bench``) print; the library logs."""
    root = Path(blockswap.__file__).parent
    printing = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        if rel in ("__main__.py", "_bench.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "print"
            ):
                printing.append(f"{rel}:{node.lineno}")
    assert printing == []
    assert os.path.exists(root / "py.typed")
