"""Kernel + DMA routing inside one transfer: small descriptors to the copy kernel, the rest to
DMA, one submission, one completion. On CPU the kernel runs under Triton's interpreter and the
host backend copies the rest."""

from __future__ import annotations

import numpy as np
import pytest

import blockswap
from blockswap.errors import ConfigError
from blockswap.kernels import engine_launcher

KiB = 1024


def mixed_batch(rng, n, small, large, src_cap, dst_cap):
    sizes = np.where(rng.random(n) < 0.5, small, large).astype(np.int64)
    slot = max(small, large)
    src_off = rng.permutation(src_cap // slot)[:n].astype(np.int64) * slot
    dst_off = rng.permutation(dst_cap // slot)[:n].astype(np.int64) * slot
    return src_off, dst_off, sizes


def host_engine(rng):
    """A host engine over 1 MiB of random "host" bytes and 1 MiB of zeroed "device" bytes."""
    eng = blockswap.Engine("host")
    src = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    dst = np.zeros(1 << 20, dtype=np.uint8)
    eng.register(src, kind="host")
    eng.register(dst, kind="device")
    return eng, src, dst


def check(dst, src, src_off, dst_off, sizes):
    for s, d, z in zip(src_off.tolist(), dst_off.tolist(), sizes.tolist()):
        assert np.array_equal(dst[d : d + z], src[s : s + z])


@pytest.mark.parametrize("kernel_below", [1, 8 * KiB, 1 << 40])
def test_host_backend_routes_small_blocks_to_the_kernel(rng, kernel_below):
    eng, src, dst = host_engine(rng)
    # Odd small sizes exercise the kernel's unaligned paths.
    s_off, d_off, sizes = mixed_batch(rng, 24, 3 * KiB + 5, 16 * KiB, src.nbytes, dst.nbytes)
    calls = []
    launch = engine_launcher(max_ctas=2)

    def counting(*args):
        calls.append(args)
        launch(*args)

    eng.submit(
        1,
        src.ctypes.data + s_off,
        dst.ctypes.data + d_off,
        sizes,
        "h2d",
        kernel_below=kernel_below,
        launcher=counting,
    )
    eng.wait([1])
    (r,) = eng.get_finished()
    assert r.success, r.error
    assert r.bytes == int(sizes.sum())
    check(dst, src, s_off, d_off, sizes)
    small = int((sizes < kernel_below).sum())
    if small == 0:
        assert calls == []
    else:
        (args,) = calls
        _, _, _, n, max_size, alignment, stream = args
        assert n == small and stream == 0
        assert max_size == int(sizes[sizes < kernel_below].max())
        assert alignment == 1  # odd sizes
    eng.shutdown()


def test_a_failing_kernel_fails_its_transfer_only(rng):
    eng, src, dst = host_engine(rng)

    def broken(*_args):
        raise RuntimeError("no kernel today")

    eng.submit(1, [src.ctypes.data], [dst.ctypes.data], [100], kernel_below=4096, launcher=broken)
    eng.submit(2, [src.ctypes.data + 4096], [dst.ctypes.data + 4096], [100])
    eng.wait([1, 2])
    results = {r.job_id: r for r in eng.get_finished()}
    assert not results[1].success and "no kernel today" in results[1].error
    assert not dst[:100].any(), "a failed kernel route issues no DMA either"
    assert results[2].success and np.array_equal(dst[4096:4196], src[4096:4196])
    eng.shutdown()


@pytest.mark.parametrize("launch_bytes", [1, 7 * KiB, 40 * KiB, 1 << 40])
def test_launches_of_bounded_bytes_cover_every_descriptor_once(rng, monkeypatch, launch_bytes):
    import blockswap.kernels.copy as kc

    launches = []
    original = kc.copy_blocks_raw

    def recording(srcs, dsts, sizes, n, **kw):
        launches.append((srcs, dsts, sizes, n))
        original(srcs, dsts, sizes, n, **kw)

    monkeypatch.setattr(kc, "copy_blocks_raw", recording)
    eng, src, dst = host_engine(rng)
    s_off, d_off, sizes = mixed_batch(rng, 21, 2 * KiB + 1, 4 * KiB, src.nbytes, dst.nbytes)
    eng.submit(
        1,
        src.ctypes.data + s_off,
        dst.ctypes.data + d_off,
        sizes,
        "h2d",
        kernel_below=1 << 40,
        launcher=engine_launcher(max_ctas=2, launch_bytes=launch_bytes),
    )
    eng.wait([1])
    (r,) = eng.get_finished()
    assert r.success, r.error
    check(dst, src, s_off, d_off, sizes)
    # Each launch takes the next rows of the slab, at most launch_bytes / largest size of them
    # (at least one), and together they take every row once.
    per = max(1, launch_bytes // int(sizes.max()))
    assert [n for *_, n in launches] == [min(per, 21 - i) for i in range(0, 21, per)]
    base = launches[0][:3]
    for k, (s, d, z, _) in enumerate(launches):
        assert (s - base[0], d - base[1], z - base[2]) == (8 * k * per,) * 3
    eng.shutdown()


@pytest.mark.parametrize("bad", [0, -1, True, 2.5, "1"])
def test_handler_refuses_a_bad_kernel_launch_bytes(bad):
    import torch

    from blockswap.handler import CpuGpuHandlers

    gpu = torch.zeros(4, 1, 64, dtype=torch.uint8)
    with pytest.raises(
        ValueError if isinstance(bad, int) and not isinstance(bad, bool) else TypeError
    ):
        CpuGpuHandlers(gpu, 4, layout="mla", backend="host", kernel_launch_bytes=bad)


@pytest.mark.cuda
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize(
    ("kernel_below", "launch_bytes"), [(64 * KiB, None), (1 << 40, None), (1 << 40, 100 * KiB)]
)
def test_cuda_hybrid_transfer_is_byte_exact(direction, kernel_below, launch_bytes):
    import torch

    rng = np.random.default_rng(5)
    host = torch.randint(0, 256, (256 << 20,), dtype=torch.uint8).pin_memory()
    dev = torch.randint(0, 256, (256 << 20,), dtype=torch.uint8, device="cuda")
    src_t, dst_t = (host, dev) if direction == "h2d" else (dev, host)
    with blockswap.Engine("cuda") as eng:
        eng.register(host)
        eng.register(dev)
        s_off, d_off, sizes = mixed_batch(rng, 1000, 4 * KiB + 3, 256 * KiB, 256 << 20, 256 << 20)
        before = dst_t.cpu().numpy().copy()
        eng.submit(
            1,
            src_t.data_ptr() + s_off,
            dst_t.data_ptr() + d_off,
            sizes,
            direction,
            kernel_below=kernel_below,
            launcher=engine_launcher(max_ctas=16, launch_bytes=launch_bytes),
        )
        eng.wait([1])
        (r,) = eng.get_finished()
        assert r.success, r.error
        torch.cuda.synchronize()
        got = dst_t.cpu().numpy()
        srcn = src_t.cpu().numpy()
        check(got, srcn, s_off, d_off, sizes)
        mask = np.ones(got.size, dtype=bool)
        for d, z in zip(d_off.tolist(), sizes.tolist()):
            mask[d : d + z] = False
        assert np.array_equal(got[mask], before[mask]), "nothing outside the blocks was written"


def _tables(*page_bytes):
    import torch

    from blockswap.layout import BlockTable

    return [
        BlockTable.from_tensors(torch.zeros(8, 1, n, dtype=torch.uint8), layout="mla")
        for n in page_bytes
    ]


def choose_route(tables, *, on_cuda, direction="h2d", path="auto", below=None):
    """The route of one direction from page sizes alone (no engine: a page route)."""
    from blockswap.routing import KERNEL_LAUNCH_BYTES, choose_routes

    return choose_routes(None, [], tables, None, path=path, on_cuda=on_cuda, device_index=None,
                         kernel_ctas=16, kernel_below=below, launch_bytes=KERNEL_LAUNCH_BYTES,
                         directions=(direction,))[direction]  # fmt: skip


def test_route_is_chosen_once_from_page_sizes():
    from blockswap.routing import KERNEL_BELOW

    small, large = _tables(8 * KiB), _tables(1 << 20)
    assert choose_route(small, on_cuda=False).launcher is None  # host backend: memcpy
    assert choose_route(small, on_cuda=True, path="dma").launcher is None
    for direction in ("h2d", "d2h"):
        r = choose_route(small, on_cuda=True, direction=direction)
        assert r.kernel_below == KERNEL_BELOW[direction] and r.launcher is not None
        assert "kernel" in r.reason
    # A threshold per direction: the kernel below it, DMA from it.
    for direction, below in KERNEL_BELOW.items():
        assert choose_route(_tables(below // 2), on_cuda=True, direction=direction).launcher
        assert choose_route(_tables(below), on_cuda=True, direction=direction).launcher is None
    with pytest.raises(ValueError, match="direction"):
        choose_route(small, on_cuda=True, direction="h2h")
    r = choose_route(large, on_cuda=True)
    assert r.launcher is None and r.reason.startswith("dma")
    r = choose_route(_tables(8 * KiB, 1 << 20), on_cuda=True)
    assert r.launcher is not None and r.reason.startswith("hybrid")
    r = choose_route(large, on_cuda=True, path="kernel")
    assert r.launcher is not None and r.kernel_below >= 1 << 40
    assert choose_route(small, on_cuda=True, below=4 * KiB).launcher is None


def test_handler_kernel_path_round_trip_on_cpu():
    import torch

    from blockswap.handler import CpuGpuHandlers

    torch.manual_seed(0)
    gpu = [torch.randint(0, 255, (2, 16, 4, 1, 8), dtype=torch.uint8) for _ in range(3)]
    h = CpuGpuHandlers(gpu, 16, layout="kv_split", backend="host", path="kernel", kernel_ctas=2)
    try:
        assert all(r.launcher is not None for r in h.routes.values())
        assert h.cpu_to_gpu_handler.route is h.routes["h2d"]
        h.gpu_to_cpu_handler.transfer_async(1, ([3, 9, 4], [0, 5, 7]))
        h.wait([1])
        assert all(r.success for r in h.get_finished())
        h.cpu_to_gpu_handler.transfer_async(2, ([0, 5, 7], [12, 13, 1]))
        h.wait([2])
        assert all(r.success for r in h.get_finished())
        for t in gpu:
            assert torch.equal(t[:, [12, 13, 1]], t[:, [3, 9, 4]])
    finally:
        h.shutdown()


def test_calibration_measures_every_route_and_keeps_the_cache_intact():
    import torch

    from blockswap.handler import CpuGpuHandlers

    torch.manual_seed(1)
    gpu = [torch.randint(0, 255, (2, 8, 4, 1, 8), dtype=torch.uint8) for _ in range(2)]
    before = [t.clone() for t in gpu]
    h = CpuGpuHandlers(gpu, 8, layout="kv_split", backend="host", calibrate=True)
    try:
        report = h.calibration
        assert report is not None and set(report) == {"d2h", "h2d"}
        for r in report.values():
            assert r["blocks"] == 8 and r["chosen"] in ("dma", "kernel", "blocks", "staged")
            assert r["dma_gbps"] > 0 and r["kernel_gbps"] > 0
            # The block plan is measured where the geometry gives one (a block-major CPU cache
            # against layer tensors at one pitch: how the allocator placed these two), the
            # staged plan wherever the CPU cache is block-major (allocated here).
            assert ("blocks_gbps" in r) == (h.block_plans["d2h"][0] is not None)
            assert r["staged_gbps"] > 0 and h.cpu_chunks is not None
        # The route each direction took is the one measured fastest, and says so.
        for d, r in report.items():
            chosen = max((k[: -len("_gbps")] for k in r if k.endswith("_gbps")),
                         key=lambda k: r[f"{k}_gbps"])  # fmt: skip
            assert r["chosen"] == chosen
            assert h.routes[d].reason.startswith(f"calibrated: {chosen}")
            assert h.routes[d].plan == {"blocks": "blocks", "staged": "staged"}.get(chosen, "pages")
        for t, b in zip(gpu, before):
            assert torch.equal(t, b), "calibration put every block back"
        # Transfers after calibration use the chosen paths and stay exact.
        h.gpu_to_cpu_handler.transfer_async(1, ([1, 2], [3, 4]))
        h.wait([1])
        h.cpu_to_gpu_handler.transfer_async(2, ([3, 4], [6, 7]))
        h.wait([2])
        assert all(r.success for r in h.get_finished())
        for t in gpu:
            assert torch.equal(t[:, [6, 7]], t[:, [1, 2]])
    finally:
        h.shutdown()


def test_calibration_builds_its_candidates_with_the_kernel_bounds_given(monkeypatch):
    """The route calibration keeps serves: its candidates are built with the handler's
    kernel_below and kernel_launch_bytes (a kept kernel route once ran one launch a transfer,
    whatever kernel_launch_bytes said, holding its SMs from the model that long)."""
    import torch

    from blockswap import handler as handler_mod
    from blockswap.handler import CpuGpuHandlers

    seen = []
    real = handler_mod.choose_routes

    def spy(*args, **kwargs):
        seen.append((kwargs["path"], kwargs["kernel_below"], kwargs["launch_bytes"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(handler_mod, "choose_routes", spy)
    gpu = [torch.zeros((2, 8, 4, 1, 8), dtype=torch.uint8) for _ in range(2)]
    h = CpuGpuHandlers(
        gpu,
        8,
        layout="kv_split",
        backend="host",
        calibrate=True,
        kernel_below=1024,
        kernel_launch_bytes=4096,
    )
    h.shutdown()
    candidates = [s for s in seen if s[0] != "auto"]
    assert {s[0] for s in candidates} >= {"dma", "kernel"}, seen
    assert all(s[1:] == (1024, 4096) for s in seen), seen


def test_calibration_with_fewer_gpu_blocks_than_a_cpu_block_holds_keeps_the_cache_intact():
    """Two GPU blocks and four a CPU block: calibration moves part of one CPU block, and the
    load reads back the very sub-blocks the store wrote (it read the block's last ones, and wrote
    their stale bytes over the GPU cache)."""
    import torch

    from blockswap.handler import CpuGpuHandlers

    torch.manual_seed(2)
    gpu = torch.randint(0, 255, (2, 2, 4, 2, 8), dtype=torch.uint8)
    before = gpu.clone()
    h = CpuGpuHandlers(
        [gpu], 4, layout="kv_split", backend="host", block_size_factor=4, calibrate=True
    )
    try:
        assert h.calibration is not None and h.calibration["d2h"]["blocks"] == 2
        assert torch.equal(gpu, before)
    finally:
        h.shutdown()


def test_calibration_is_refused_before_anything_is_built_where_it_cannot_run(monkeypatch):
    """Several KV-cache groups (several size classes), or the caller's CPU cache (calibration
    writes its first blocks): refused before an engine is made or a CPU cache allocated."""
    import torch

    import blockswap.handler as handler_module
    from blockswap.handler import CpuGpuHandlers

    def no_engine(*a, **k):
        raise AssertionError("an engine was made before the refusal")

    monkeypatch.setattr(handler_module, "Engine", no_engine)
    groups = [[torch.zeros(2, 8, 4, 2, 8)], [torch.zeros(8, 4, 24)]]
    with pytest.raises(ConfigError, match="needs a single KV-cache group"):
        CpuGpuHandlers(groups, 4, layout=["kv_split", "mla"], backend="host", calibrate=True)
    gpu = torch.zeros(2, 8, 4, 2, 8)
    cpu = torch.full((2, 4, 4, 2, 8), 42.0)
    with pytest.raises(ConfigError, match="overwrite what cpu_caches holds"):
        CpuGpuHandlers(
            [gpu], 4, layout="kv_split", backend="host", cpu_caches=[cpu], calibrate=True
        )
    assert bool((cpu == 42).all())


# Run in a fresh interpreter without TRITON_INTERPRET (which conftest.py sets for the rest of
# the suite) and without a visible GPU: the process a user without a GPU has.
_NO_GPU_SCRIPT = r"""
import os
import time

import torch

assert "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available()
import blockswap
from blockswap.handler import CpuGpuHandlers
from blockswap.kernels import interpreter_mode, kernel_unavailable
from blockswap.routing import RouteUnavailableError

assert not interpreter_mode()
assert "TRITON_INTERPRET=1" in kernel_unavailable()

torch.manual_seed(2)
gpu = [torch.randint(0, 255, (2, 8, 4, 1, 8), dtype=torch.uint8) for _ in range(2)]
before = [t.clone() for t in gpu]
# Calibration measures the routes that can run here: not the Triton kernel.
h = CpuGpuHandlers(gpu, 8, layout="kv_split", calibrate=True)
try:
    assert h.backend == "host"
    for d, r in h.calibration.items():
        assert "kernel_gbps" not in r and r["dma_gbps"] > 0 and r["chosen"] != "kernel", r
        assert h.routes[d].launcher is None and h.routes[d].kernel is None
    for t, b in zip(gpu, before):
        assert torch.equal(t, b), "calibration put every block back"
    # Then transfers run, byte-exact, both ways.
    h.d2h.transfer_async(1, ([1, 2, 5], [3, 4, 0]))
    h.wait([1])
    h.h2d.transfer_async(2, ([3, 4, 0], [6, 7, 0]))
    h.wait([2])
    assert [r.success for r in h.get_finished()] == [True, True]
    for t, b in zip(gpu, before):
        assert torch.equal(t[:, [6, 7, 0]], b[:, [1, 2, 5]])
finally:
    h.shutdown()
# path="auto" on the host backend never needs the kernel; path="kernel" is refused up front,
# naming the path and why, and leaves no engine behind.
h = CpuGpuHandlers(gpu, 8, layout="kv_split", path="auto", kernel_below=1 << 20)
assert all(r.launcher is None for r in h.routes.values())
h.shutdown()
tasks = set(os.listdir("/proc/self/task"))
try:
    CpuGpuHandlers(gpu, 8, layout="kv_split", path="kernel")
except RouteUnavailableError as e:
    refused = e  # its traceback keeps the half-built handler alive
    assert isinstance(e, blockswap.BackendError) and isinstance(e, ValueError), type(e).__mro__
    assert e.path == "kernel" and "0 active drivers" in e.reason, e
    assert str(e).startswith("path='kernel' cannot run here: the copy kernel needs a GPU"), e
    assert "TRITON_INTERPRET=1" in str(e), e
else:
    raise AssertionError("path='kernel' was accepted without a GPU")
# A joined thread leaves /proc/self/task a moment after the join returns.
deadline = time.monotonic() + 10
while not set(os.listdir("/proc/self/task")) <= tasks and time.monotonic() < deadline:
    time.sleep(0.001)
assert set(os.listdir("/proc/self/task")) <= tasks, "the refused handler's engine still runs"
assert refused.__traceback__ is not None
print("ok")
"""


def test_without_a_gpu_or_interpreter_only_routes_that_run_are_taken_or_measured():
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    r = subprocess.run(
        [sys.executable, "-c", _NO_GPU_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr


def test_failed_transfers_are_logged_by_the_handler(caplog):
    import logging

    import torch

    from blockswap.handler import CpuGpuHandlers

    gpu = [torch.zeros(2, 8, 4, 1, 8, dtype=torch.uint8) for _ in range(2)]
    h = CpuGpuHandlers(gpu, 8, layout="kv_split", backend="host", path="dma")
    try:
        for job, poll in ((1, h.get_finished), (2, h.d2h.get_finished), (3, h.h2d.get_finished)):
            h.engine.inject_failures(1)
            h.d2h.transfer_async(job, ([1], [2]))
            h.wait([job])
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="blockswap"):
                results = poll()
            assert [r.success for r in results] == [False]
            failed = [r for r in caplog.records if r.levelno == logging.WARNING]
            assert len(failed) == 1, caplog.records
            assert failed[0].name.startswith("blockswap")
            msg = failed[0].getMessage()
            assert msg.startswith(f"transfer job {job} failed:") and "injected" in msg, msg
        # Successes are not logged.
        h.d2h.transfer_async(4, ([1], [2]))
        h.wait([4])
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="blockswap"):
            assert [r.success for r in h.get_finished()] == [True]
        assert not caplog.records
    finally:
        h.shutdown()


@pytest.mark.cuda
def test_cuda_calibration_reports_both_paths():
    import torch

    from blockswap.handler import CpuGpuHandlers

    gpu = [torch.randn(2, 512, 16, 2, 128, dtype=torch.bfloat16, device="cuda") for _ in range(8)]
    before = [t.clone() for t in gpu]
    h = CpuGpuHandlers(gpu, 512, layout="kv_split", calibrate=True)
    try:
        report = h.calibration
        assert report is not None
        print("calibration", report)
        for r in report.values():
            assert r["dma_gbps"] > 0 and r["kernel_gbps"] > 0
        # Each kernel compiled and loaded into the engine once, for the routes and calibration
        # alike: the staged plan's and the page kernel.
        assert len(h._kernels) == 2, [(k["ctas"], k["row_bytes"]) for k in h._kernels]
        torch.cuda.synchronize()
        for t, b in zip(gpu, before):
            assert torch.equal(t, b)
    finally:
        h.shutdown()


def test_routes_on_cuda_are_the_first_of_the_cores_ranking_that_builds():
    """The CUDA side of the choice, without a GPU: the core's ranking read against a host
    engine's tables, with a kernel loader that refuses what the test says."""
    import torch

    from blockswap.handler import CpuGpuHandlers
    from blockswap.routing import KERNEL_BELOW, STAGED_CTAS, choose_routes

    gpu = [torch.zeros(2, 8, 4, 1, 8, dtype=torch.uint8) for _ in range(3)]
    h = CpuGpuHandlers(gpu, 8, layout="kv_split", backend="host", path="dma")
    try:
        calls: list[tuple[int, int, bool]] = []

        def routes(path="auto", refuse=(), handlers=h, **kw):
            def load(device, max_size, ctas, *, staged=False):
                calls.append((max_size, ctas, staged))
                return (None, "refused here") if staged in refuse else (7 if staged else 9, "")

            calls.clear()
            options = dict(path=path, on_cuda=True, device_index=0, kernel_ctas=4,
                           kernel_below=None, launch_bytes=1 << 20)  # fmt: skip
            options.update(kw)
            core, tables = handlers.engine, handlers._table_ids
            return choose_routes(core, tables, handlers.gpu_tables, load, **options)

        # Layer tensors allocated one by one give no block plan: the staged plan, its kernel
        # loaded once for both directions.
        r = routes()
        assert {d: (c.plan, c.kernel) for d, c in r.items()} == {
            "d2h": ("staged", 7),
            "h2d": ("staged", 7),
        }
        assert calls == [(32, STAGED_CTAS, True)]
        # The staged kernel refused: the page kernel launched by the core, below the threshold.
        r = routes(refuse=(True,))
        for d, c in r.items():
            assert (c.plan, c.kernel, c.kernel_below, c.launch_bytes) == (
                "pages",
                9,
                KERNEL_BELOW[d],
                1 << 20,
            )
            assert c.reason.endswith("launched by the core")
        assert calls == [(32, STAGED_CTAS, True), (32, 4, False)]
        # Both refused: the page kernel launched from Python.
        r = routes(refuse=(True, False))
        assert all(c.launcher is not None and c.kernel is None for c in r.values())
        # A mirrored cache (a block's pages not one chunk of host memory) is not offered the
        # staged plan.
        mirror = CpuGpuHandlers(gpu, 8, layout="kv_split", backend="host", cpu_layout="mirror")
        try:
            r = routes(handlers=mirror)
        finally:
            mirror.shutdown()
        assert [c.kernel for c in r.values()] == [9, 9] and calls == [(32, 4, False)]
        # A block-major cache given by the caller (as vLLM's offload region lays out a chunk of
        # one block) is: the core reads it from the CPU tables, not from who allocated them.
        given = CpuGpuHandlers([gpu], 8, layout="kv_split", backend="host", cpu_caches=h.cpu_caches)
        try:
            assert given.cpu_chunks is None
            r = routes(handlers=given)
        finally:
            given.shutdown()
        assert [c.plan for c in r.values()] == ["staged", "staged"]
        # Insisted on, the staged plan that cannot be built is a refusal naming why.
        with pytest.raises(ConfigError, match="path='staged' is not possible here: refused here"):
            routes("staged", refuse=(True,))
        # Insisted on, the block plan wherever the core's plan saves a copy (how the allocator
        # placed the layers decides it), else a refusal.
        if h.block_plans["d2h"][0] is None:
            with pytest.raises(ConfigError, match="path='blocks' needs"):
                routes("blocks")
        else:
            assert [c.plan for c in routes("blocks").values()] == ["blocks", "blocks"]
        assert routes("dma")["h2d"].plan == "pages" and not calls
    finally:
        h.shutdown()
