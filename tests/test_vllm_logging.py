"""blockswap's log lines inside vLLM: configured by vLLM's own logging code (``configure_logging``,
``init_logger``), the plug-in's lines appear in vLLM's log, in vLLM's format, at INFO, without the
user configuring anything; at ``VLLM_LOGGING_LEVEL=WARNING`` they are hidden like vLLM's; and
standalone blockswap prints nothing unless the application configures logging.

Each case runs in a fresh interpreter: vLLM's logging configuration is process-wide."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.kv_offload.base", reason="vLLM is not installed")

TESTS = Path(__file__).resolve().parent

# vLLM's line: "(<process> pid=<pid>) INFO <mm-dd hh:mm:ss> [<file>:<line>] <message>".
VLLM_LINE = re.compile(r"^\((?P<proc>[^)]*) pid=\d+\) (?P<level>[A-Z]+) \d\d-\d\d \d\d:\d\d:\d\d "
                       r"\[(?P<file>[^\]]+):\d+\] (?P<msg>.*)$")  # fmt: skip

RUN_PLUGIN = """
    import torch
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging, init_logger
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor,
    )
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory
    from test_vllm_spec import offloading_config

    configure_logging(LoggingConfig())  # what vLLM's entry points do, from its environment
    init_logger("vllm.plugin_test").info("vLLM's own line")
    spec = OffloadingSpecFactory.create_spec(offloading_config())
    ts = [torch.zeros((16, 256), dtype=torch.int8) for _ in range(2)]
    kv = CanonicalKVCaches(
        [CanonicalKVCacheTensor(t, 256) for t in ts],
        [[CanonicalKVCacheRef(0, 256), CanonicalKVCacheRef(1, 256)]],
    )
    w = spec.get_worker(kv)
    import logging
    logging.getLogger("blockswap.vllm").warning("a warning of the plug-in")
    w.shutdown()
"""


def run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    e = {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    for k in ("VLLM_LOGGING_LEVEL", "VLLM_CONFIGURE_LOGGING", "VLLM_LOGGING_CONFIG_PATH"):
        e.pop(k, None)
    e.update(env)
    e["VLLM_LOGGING_COLOR"] = "0"
    p = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, env=e, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    return p


def lines_of(out: str) -> list[dict[str, str]]:
    return [m.groupdict() for m in map(VLLM_LINE.match, out.splitlines()) if m]


def test_inside_vllm_blockswaps_lines_are_vllms_at_info() -> None:
    p = run(RUN_PLUGIN)
    lines = lines_of(p.stdout)
    own = [ln for ln in lines if ln["msg"] == "vLLM's own line"]
    assert len(own) == 1, p.stdout
    mine = [ln for ln in lines if ln["file"] == "vllm.py" and ln["proc"] == own[0]["proc"]]
    msgs = [ln["msg"] for ln in mine]
    # The CPU cache's size and pinning time, and the routes, as the README promises.
    assert any(m.startswith("CPU KV cache: ") and " in " in m for m in msgs), p.stdout
    assert any(m.startswith("blockswap offloading worker: ") for m in msgs), p.stdout
    assert ("WARNING", "a warning of the plug-in") in [(ln["level"], ln["msg"]) for ln in lines]
    assert {ln["level"] for ln in mine} >= {"INFO"}
    # Each line once, and nothing of blockswap's unformatted on stderr.
    assert len(msgs) == len(set(msgs))
    assert "blockswap" not in p.stderr and "CPU KV cache" not in p.stderr, p.stderr


def test_vllms_level_applies_to_blockswaps_lines() -> None:
    p = run(RUN_PLUGIN, VLLM_LOGGING_LEVEL="WARNING")
    msgs = [ln["msg"] for ln in lines_of(p.stdout)]
    assert "vLLM's own line" not in msgs
    assert not any(m.startswith("CPU KV cache") for m in msgs), p.stdout
    assert "a warning of the plug-in" in msgs


def test_standalone_blockswap_prints_nothing_unless_configured() -> None:
    code = """
        import logging
        import torch
        import blockswap
        from blockswap.handler import CpuGpuHandlers
        h = CpuGpuHandlers([torch.zeros(2, 8, 4, 2, 8)], 4, layout="kv_split", backend="host")
        h.shutdown()
        logging.getLogger("blockswap.handler").warning("a warning standalone")
        print("done")
    """
    p = run(code)
    assert p.stdout == "done\n" and p.stderr == "", (p.stdout, p.stderr)
    configured = "import logging; logging.basicConfig(level=logging.INFO)\n" + textwrap.dedent(code)
    p = run(configured)
    assert "a warning standalone" in p.stderr and "blockswap.handler" in p.stderr
