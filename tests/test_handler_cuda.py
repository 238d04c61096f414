"""Tests of blockswap.handler on CUDA: round trips of KV caches shaped like published model
configs, partial CPU blocks, ordering against the compute stream, copy streams, shutdown with
transfers in flight, tensors on another device than the current one. The conftest skips them
where there is no GPU."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from blockswap import InvalidTransferError, ShutdownError
from blockswap.handler import CpuGpuHandlers
from kv_helpers import F8, FACTORS, all_tensors, ref_store_subs

# --------------------------------------------------------------------------------------------
# CUDA: KV caches shaped like published model configs
# --------------------------------------------------------------------------------------------

BLOCK_SIZE = 16
GPU_BLOCKS = 64
CPU_BLOCKS = 64


@dataclass
class Model:
    name: str
    layers: int
    kv_heads: int = 0
    head_dim: int = 0
    mla_dim: int = 0  # kv_lora_rank + qk_rope_head_dim (MLA)
    dtype: torch.dtype = torch.bfloat16
    groups: int = 1  # KV-cache groups (gpt-oss: sliding window + full attention)

    @property
    def layout(self) -> str:
        return "mla" if self.mla_dim else "kv_split"

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        if self.mla_dim:
            return (num_blocks, BLOCK_SIZE, self.mla_dim)
        return (2, num_blocks, BLOCK_SIZE, self.kv_heads, self.head_dim)


MODELS = [
    Model("llama-3.1-8b", 32, 8, 128),
    Model("llama-3.1-70b-tp4", 80, 2, 128),  # 8 KV heads / TP 4
    Model("qwen2.5-7b", 28, 4, 128),
    Model("mistral-7b", 32, 8, 128),
    Model("deepseek-v3-mla", 61, mla_dim=512 + 64),
    Model("gpt-oss-120b", 36, 8, 64, groups=2),
    Model("llama-3.1-8b-fp8", 32, 8, 128, dtype=F8),
]


def cuda_cache(m: Model, device: torch.device | str = "cuda") -> list[list[torch.Tensor]]:
    """Random per-layer KV tensors (bytes drawn as uint8, viewed as the model's dtype)."""
    isz = torch.empty(0, dtype=m.dtype).element_size()
    shape = list(m.shape(GPU_BLOCKS))
    shape[-1] *= isz
    layers = [
        torch.randint(0, 256, shape, dtype=torch.uint8, device=device).view(m.dtype)
        for _ in range(m.layers)
    ]
    # hybrid: alternate layers in two groups (gpt-oss: sliding window / full attention)
    return [layers[g :: m.groups] for g in range(m.groups)]


def sel(t: torch.Tensor, layout: str, ids: Sequence[int]) -> torch.Tensor:
    """Blocks ``ids`` of ``t`` as uint8 (on t's device)."""
    idx = torch.as_tensor(list(ids), device=t.device)
    u = t.view(torch.uint8)
    return u[:, idx] if layout == "kv_split" else u[idx]


@pytest.mark.cuda
@pytest.mark.parametrize("factor", FACTORS)
@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.name)
def test_cuda_model_roundtrip(model: Model, factor: int) -> None:
    groups = cuda_cache(model)
    arg = groups if model.groups > 1 else groups[0]
    h = CpuGpuHandlers(arg, CPU_BLOCKS, layout=model.layout, block_size_factor=factor)
    try:
        assert h.backend == "cuda" and h.device == groups[0][0].device
        assert h.engine.info()["backend"] == "cuda"
        assert all(c.is_pinned() and c.device.type == "cpu" for c in all_tensors(h.cpu_caches))
        rng = np.random.default_rng(len(model.name) * 10 + factor)
        n = 32
        perm = [rng.permutation(GPU_BLOCKS) for _ in groups]
        srcs = [p[:n] for p in perm]  # GPU blocks offloaded
        dsts = [p[n : 2 * n] for p in perm]  # other GPU blocks, onloaded into
        cpus = [rng.permutation(CPU_BLOCKS)[: n // factor] for _ in groups]
        before = [[sel(t, model.layout, s).clone() for t in g] for g, s in zip(groups, srcs)]
        spec = (srcs, cpus) if model.groups > 1 else (srcs[0], cpus[0])
        assert h.gpu_to_cpu_handler.transfer_async(1, spec) is True
        h.wait([1])
        (r,) = h.get_finished()
        assert r.success, r.error
        assert r.bytes == n * sum(t.page_bytes for t in h.gpu_tables)
        for g, cg in enumerate(h.cpu_caches):
            subs = ref_store_subs(cpus[g].tolist(), n, factor)
            for t_cpu, b in zip(cg, before[g]):
                assert torch.equal(sel(t_cpu, model.layout, subs), b.cpu())
        spec = (cpus, dsts) if model.groups > 1 else (cpus[0], dsts[0])
        assert h.cpu_to_gpu_handler.transfer_async(2, spec) is True
        h.wait([2])
        (r,) = h.get_finished()
        assert r.success, r.error
        for g, ts in enumerate(groups):
            for t, b in zip(ts, before[g]):
                assert torch.equal(sel(t, model.layout, dsts[g].tolist()), b)
        s = h.stats()
        assert s["d2h"]["bytes"] == s["h2d"]["bytes"] > 0
        assert s["d2h"]["gb_per_s"] > 0 and s["h2d"]["gb_per_s"] > 0
    finally:
        h.shutdown()


ISSUE_OPTIONS = [{"idle_issue": True}, {"idle_issue": False}, {"early_wake": False}]


@pytest.mark.cuda
@pytest.mark.parametrize("factor", [1, 4])
@pytest.mark.parametrize("path", ["auto", "staged", "dma", "kernel"])
@pytest.mark.parametrize(
    "options", ISSUE_OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items())
)
def test_cuda_transfers_issued_by_the_caller_or_the_lanes_thread(
    options: dict[str, object], path: str, factor: int
) -> None:
    """Isolated transfers (issued on the caller's thread with ``idle_issue``) and bursts that
    fill the ring (issued by the lane's thread), alternating, byte-exact both ways."""
    model = Model("llama-3.1-70b-tp4", 80, 2, 128)
    (gpu,) = cuda_cache(model)
    ring = 8
    h = CpuGpuHandlers(
        gpu,
        CPU_BLOCKS,
        layout="kv_split",
        path=path,
        block_size_factor=factor,
        max_in_flight=ring,
        **options,
    )
    rng = np.random.default_rng(factor)
    n = 8  # GPU blocks a transfer
    layers = (0, len(gpu) - 1)  # the first and the last layer are checked
    job = 0
    try:
        for burst in (1, ring, 1, ring):
            # Offload `burst` transfers to disjoint CPU blocks, then onload them into disjoint
            # GPU blocks, each batch queued at once.
            cpu = rng.permutation(CPU_BLOCKS)[: burst * n // factor].reshape(burst, -1)
            src = [rng.permutation(GPU_BLOCKS)[:n] for _ in range(burst)]
            before = [[sel(gpu[i], "kv_split", s.tolist()).clone() for i in layers] for s in src]
            jobs = []
            for k in range(burst):
                job += 1
                assert h.gpu_to_cpu_handler.transfer_async(job, (src[k], cpu[k])) is True
                jobs.append(job)
            h.wait(jobs)
            assert all(r.success for r in h.get_finished())
            for k in range(burst):
                subs = ref_store_subs(cpu[k].tolist(), n, factor)
                for i, b in zip(layers, before[k]):
                    assert torch.equal(sel(h.cpu_caches[0][i], "kv_split", subs), b.cpu())
            dst = rng.permutation(GPU_BLOCKS)[: burst * n].reshape(burst, n)
            jobs = []
            for k in range(burst):
                job += 1
                assert h.cpu_to_gpu_handler.transfer_async(job, (cpu[k], dst[k])) is True
                jobs.append(job)
            h.wait(jobs)
            assert all(r.success for r in h.get_finished())
            for k in range(burst):
                for i, b in zip(layers, before[k]):
                    assert torch.equal(sel(gpu[i], "kv_split", dst[k].tolist()), b)
    finally:
        h.shutdown()


@pytest.mark.cuda
@pytest.mark.parametrize("early_wake", [True, False])
def test_cuda_a_woken_thread_whose_transfer_is_refused_sleeps_and_takes_the_next(
    early_wake: bool,
) -> None:
    """``transfer_async`` wakes its direction's thread before it builds the tables
    (``early_wake``): where the transfer is then refused, the thread polls for a job that never
    comes and sleeps again; transfers after a gap longer than that poll, and one right after a
    refusal, run byte-exact."""
    m = Model("llama-3.1-8b", 4, 8, 128)
    (gpu,) = cuda_cache(m)
    h = CpuGpuHandlers(gpu, CPU_BLOCKS, layout="kv_split", early_wake=early_wake)
    try:
        job = 0
        for gap in (0.0, 0.005, 0.0):
            for handler in (h.d2h, h.h2d):
                with pytest.raises(InvalidTransferError):
                    handler.transfer_async(1000 + job, ([GPU_BLOCKS + 5], [0]))
            time.sleep(gap)
            src, cpu, dst = [2 * job + 1, 2 * job], [job, job + 9], [40 + job, 50 + job]
            job += 1
            h.d2h.transfer_async(job, (src, cpu))
            h.wait([job])
            time.sleep(gap)
            job += 1
            h.h2d.transfer_async(job, (cpu, dst))
            h.wait([job])
            assert [r.success for r in h.get_finished()] == [True, True]
            for t in gpu:
                assert torch.equal(sel(t, "kv_split", dst), sel(t, "kv_split", src))
    finally:
        h.shutdown()


@pytest.mark.cuda
def test_cuda_partial_cpu_blocks_factor_4() -> None:
    m = Model("llama-3.1-8b", 4, 8, 128)
    (gpu,) = cuda_cache(m)
    h = CpuGpuHandlers(gpu, CPU_BLOCKS, layout="kv_split", block_size_factor=4)
    try:
        src = [3, 0, 7, 5, 1, 9]
        h.d2h.transfer_async(1, (src, [4, 1]))  # sub-blocks 16..19, 4, 5
        h.wait([1])
        assert h.get_finished()[0].success
        for t, c in zip(gpu, h.cpu_caches[0]):
            assert torch.equal(
                sel(c, "kv_split", [16, 17, 18, 19, 4, 5]), sel(t, "kv_split", src).cpu()
            )
        h.h2d.transfer_async(2, ([4, 1], [20, 21, 22, 23, 24]))  # skip 3: 19, 4, 5, 6, 7
        h.wait([2])
        assert h.get_finished()[0].success
        for t, c in zip(gpu, h.cpu_caches[0]):
            want = sel(c, "kv_split", [19, 4, 5, 6, 7])
            assert torch.equal(sel(t, "kv_split", [20, 21, 22, 23, 24]).cpu(), want)
    finally:
        h.shutdown()


@pytest.mark.cuda
@pytest.mark.parametrize("blocks", [1, 16], ids=["one-step", "four-steps"])
@pytest.mark.parametrize(
    "options", ISSUE_OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items())
)
def test_cuda_a_staged_fault_fails_its_transfer_wherever_its_step_was_issued(
    options: dict[str, object], blocks: int
) -> None:
    """A driver fault in a staged transfer's middle step (the test hook's null address), issued
    on the caller's thread (a transfer of one step, ``idle_issue``) or by the lane's thread (the
    third of four): that transfer is reported failed, the transfers before and after it move
    every byte, both ways."""
    model = Model("llama-3.1-70b-tp4", 80, 2, 128)
    (gpu,) = cuda_cache(model)
    h = CpuGpuHandlers(gpu, CPU_BLOCKS, layout="kv_split", path="staged", **options)
    rng = np.random.default_rng(blocks)
    layers = (0, len(gpu) - 1)
    try:
        cpu = rng.permutation(CPU_BLOCKS)[: 3 * blocks].reshape(3, blocks)
        gpu_src = rng.permutation(GPU_BLOCKS)[: 3 * blocks].reshape(3, blocks)
        gpu_dst = rng.permutation(GPU_BLOCKS)[: 3 * blocks].reshape(3, blocks)
        # The loads may land on blocks the stores read: their bytes as they were.
        before = [
            [sel(gpu[i], "kv_split", gpu_src[k].tolist()).clone() for i in layers] for k in range(3)
        ]
        for base, handler, pairs in (
            (0, h.gpu_to_cpu_handler, [(gpu_src[k], cpu[k]) for k in range(3)]),
            (100, h.cpu_to_gpu_handler, [(cpu[k], gpu_dst[k]) for k in range(3)]),
        ):
            for k, pair in enumerate(pairs):
                if k == 1:
                    h.engine.inject_failures(1)
                assert handler.transfer_async(base + k, pair)
                h.wait([base + k])
            done = {r.job_id % 100: r for r in h.get_finished()}
            assert sorted(done) == [0, 1, 2]
            assert done[0].success and done[2].success, (done[0].error, done[2].error)
            assert not done[1].success
        for k in (0, 2):
            for i, want in zip(layers, before[k]):
                got_cpu = sel(h.cpu_caches[0][i], "kv_split", cpu[k].tolist())
                assert torch.equal(got_cpu, want.cpu()), (k, i)
                assert torch.equal(sel(gpu[i], "kv_split", gpu_dst[k].tolist()), want), (k, i)
    finally:
        h.shutdown()


@pytest.mark.cuda
@pytest.mark.parametrize("side_stream", [False, True], ids=["default-stream", "side-stream"])
def test_cuda_offload_waits_for_the_compute_stream(side_stream: bool) -> None:
    m = Model("llama-3.1-8b", 8, 8, 128)
    (gpu,) = cuda_cache(m)
    src = list(range(8, 40))
    idx = torch.tensor(src, device="cuda")
    for t in gpu:
        t.view(torch.uint8).fill_(0x11)
    # The compute's kernels once, on scratch memory: torch loads a kernel's module at its first
    # launch, which waits for the device (the default stream's spin included) and would end the
    # compute before the transfer is submitted.
    warm = torch.randn(64, 64, device="cuda")
    torch.tanh(warm @ warm)
    torch.cuda._sleep(1)
    torch.zeros_like(gpu[0]).view(torch.uint8).index_fill_(1, idx, 0x5A)
    torch.cuda.synchronize()
    h = CpuGpuHandlers(gpu, CPU_BLOCKS, layout="kv_split")
    stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
    try:
        with torch.cuda.stream(stream):
            # The model still computing: a long matmul chain and a spin, then the KV write.
            a = torch.randn(4096, 4096, device="cuda")
            for _ in range(8):
                a = torch.tanh(a @ a)
            torch.cuda._sleep(200_000_000)
            for t in gpu:
                # index_fill_ takes the value as a kernel argument: a Python scalar assigned
                # through indexing would be copied from pageable host memory, which syncs the
                # stream and defeats the test.
                t.view(torch.uint8).index_fill_(1, idx, 0x5A)
            h.d2h.transfer_async(1, (np.asarray(src), np.arange(32)))
            still_running = not stream.query()
        h.wait([1], timeout=120)
        (r,) = h.get_finished()
        assert r.success, r.error
        assert still_running, "the compute finished before transfer_async: the test proves nothing"
        for c in h.cpu_caches[0]:
            got = c.view(torch.uint8)[:, :32]
            assert bool((got == 0x5A).all()), "offloaded bytes predate the compute stream's writes"
        torch.cuda.synchronize()
        assert bool(torch.isfinite(a).all())
    finally:
        h.shutdown()


@pytest.mark.cuda
def test_cuda_both_directions_in_flight_and_copy_streams() -> None:
    m = Model("qwen2.5-7b", 28, 4, 128)
    (gpu,) = cuda_cache(m)
    s_h2d, s_d2h = torch.cuda.Stream(), torch.cuda.Stream()
    h = CpuGpuHandlers(
        gpu, CPU_BLOCKS, layout="kv_split", copy_streams={"h2d": s_h2d, "d2h": s_d2h}
    )
    try:
        (cpu,) = h.cpu_caches
        for c in cpu:
            c.view(torch.uint8).copy_(
                torch.randint(0, 256, c.view(torch.uint8).shape, dtype=torch.uint8)
            )
        c0 = [c.clone() for c in cpu]
        g0 = [t.clone() for t in gpu]
        h.d2h.transfer_async(1, (np.arange(32), np.arange(32, 64)))
        h.h2d.transfer_async(2, (np.arange(32), np.arange(32, 64)))
        s_h2d.synchronize()  # the onload ran on the given stream
        for t, c in zip(gpu, c0):
            assert torch.equal(
                sel(t, "kv_split", range(32, 64)).cpu(), sel(c, "kv_split", range(32))
            )
        h.wait([1, 2])
        assert sorted((r.job_id, r.success) for r in h.get_finished()) == [(1, True), (2, True)]
        for t0, c in zip(g0, cpu):
            assert torch.equal(
                sel(c, "kv_split", range(32, 64)), sel(t0, "kv_split", range(32)).cpu()
            )
    finally:
        h.shutdown()


@pytest.mark.cuda
def test_cuda_shutdown_with_transfers_in_flight() -> None:
    m = Model("llama-3.1-70b-tp4", 80, 2, 128)
    (gpu,) = cuda_cache(m)
    h = CpuGpuHandlers(gpu, CPU_BLOCKS, layout="kv_split")
    g0 = [t.clone() for t in gpu]
    torch.cuda.synchronize()
    for j in range(3):  # GPU 0..47 -> CPU 0..47, while CPU 48..63 -> GPU 48..63
        h.d2h.transfer_async(j, (np.arange(16 * j, 16 * j + 16), np.arange(16 * j, 16 * j + 16)))
    h.h2d.transfer_async(10, (np.arange(48, 64), np.arange(48, 64)))
    h.shutdown()
    h.shutdown()
    res = h.get_finished()
    assert sorted(r.job_id for r in res) == [0, 1, 2, 10] and all(r.success for r in res)
    with pytest.raises(ShutdownError):
        h.d2h.transfer_async(20, ([0], [0]))
    torch.cuda.synchronize()
    for t, t0 in zip(gpu, g0):  # the offloaded blocks are untouched
        assert torch.equal(sel(t, "kv_split", range(48)), sel(t0, "kv_split", range(48)))


@pytest.mark.cuda
def test_cuda_refuses_unpinned_cpu_cache_and_host_backend() -> None:
    (gpu,) = cuda_cache(Model("mistral-7b", 2, 8, 128))
    cpu = [torch.empty(2, CPU_BLOCKS, BLOCK_SIZE, 8, 128, dtype=torch.bfloat16) for _ in gpu]
    with pytest.raises(ValueError, match="not pinned"):
        CpuGpuHandlers(gpu, CPU_BLOCKS, layout="kv_split", cpu_caches=cpu)
    with pytest.raises(ValueError, match="host backend copies host memory only"):
        CpuGpuHandlers(gpu, CPU_BLOCKS, layout="kv_split", backend="host")
    pinned = [c.pin_memory() for c in cpu]
    h = CpuGpuHandlers(gpu, CPU_BLOCKS, layout="kv_split", cpu_caches=pinned)
    try:
        h.d2h.transfer_async(1, ([5, 6], [0, 1]))
        h.wait([1])
        assert h.get_finished()[0].success
        assert torch.equal(
            sel(pinned[1], "kv_split", [0, 1]), sel(gpu[1], "kv_split", [5, 6]).cpu()
        )
    finally:
        h.shutdown()


@pytest.mark.cuda
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"
)
def test_cuda_tensors_on_another_device_than_the_current_one() -> None:
    dev = torch.device("cuda", torch.cuda.device_count() - 1)
    (gpu,) = cuda_cache(Model("llama-3.1-8b", 4, 8, 128), device=dev)
    with torch.cuda.device(0):
        h = CpuGpuHandlers(gpu, CPU_BLOCKS, layout="kv_split")
        try:
            assert h.device == dev
            assert torch.cuda.current_device() == 0
            h.d2h.transfer_async(1, ([1, 2], [3, 4]))
            assert torch.cuda.current_device() == 0
            h.wait([1])
            h.h2d.transfer_async(2, ([3, 4], [10, 11]))
            assert torch.cuda.current_device() == 0
            h.wait([2])
            assert all(r.success for r in h.get_finished())
            for t in gpu:
                assert torch.equal(sel(t, "kv_split", [10, 11]), sel(t, "kv_split", [1, 2]))
        finally:
            h.shutdown()


@pytest.mark.cuda
def test_staging_rings_made_when_built_where_asked() -> None:
    """Where the staged plan is a direction's route, the handlers make its staging ring (two
    ``stage_bytes`` slots of device memory) when built, for the directions in ``prepare`` (both
    by default), not on that direction's first transfer; ``()`` leaves them to the first
    transfers. Round trips after either are byte-exact."""
    layers = [torch.zeros((16, 1, 16384), dtype=torch.uint8, device="cuda") for _ in range(8)]

    def free() -> int:
        # Memory another object lets go of between the two readings (an earlier test's engine
        # collected, torch's cached blocks) would read as negative memory taken.
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return int(torch.cuda.mem_get_info()[0])

    def roundtrip(h: CpuGpuHandlers, job: int) -> None:
        for t in layers:
            t[:8].random_(0, 256)
        h.d2h.transfer_async(job, (np.arange(8), np.arange(8)))
        h.wait([job])
        h.h2d.transfer_async(job + 1, (np.arange(8), np.arange(8, 16)))
        h.wait([job + 1])
        assert all(r.success for r in h.get_finished())
        for t in layers:
            assert torch.equal(t[8:], t[:8])

    roundtrip(h := CpuGpuHandlers(layers, 8, layout="mla", prepare=()), 1)  # kernels loaded
    h.shutdown()
    del h  # its memory goes before the first reading, not while the next handlers are built
    for prepare in ((), ("h2d",), ("d2h", "h2d")):
        before = free()
        h = CpuGpuHandlers(layers, 8, layout="mla", prepare=prepare)
        try:
            assert {h.routes[d].plan for d in ("d2h", "h2d")} == {"staged"}
            took, ring = before - free(), 2 * h.engine.stage_bytes
            assert len(prepare) * ring <= took < (len(prepare) + 1) * ring, (prepare, took, ring)
            roundtrip(h, 10)
        finally:
            h.shutdown()
            del h


@pytest.mark.cuda
def test_prepare_staged_beside_running_transfers() -> None:
    """``Engine.prepare_staged`` called from a second thread, over and over, while the lanes run
    staged transfers (the first of them making the stage that the calls race to make): every
    call succeeds, every transfer succeeds and moves its bytes exactly, and the stage is made
    once (its ring's device memory is held once)."""
    layers = [torch.zeros((32, 1, 16384), dtype=torch.uint8, device="cuda") for _ in range(8)]
    rng = np.random.default_rng(7)
    h = CpuGpuHandlers(layers, 32, layout="mla", prepare=())
    stop, errors, calls = threading.Event(), [], [0]

    def prepare() -> None:
        try:
            while not stop.is_set():
                for d in ("h2d", "d2h"):
                    h.engine.prepare_staged(d)
                    calls[0] += 1
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    try:
        assert {h.routes[d].plan for d in ("d2h", "h2d")} == {"staged"}
        racer = threading.Thread(target=prepare)
        racer.start()
        try:
            for job in range(1, 41, 2):
                gpu, cpu = rng.permutation(16), rng.permutation(32)[:16]
                for t in layers:
                    t[:16].random_(0, 256)
                h.d2h.transfer_async(job, (gpu, cpu))
                h.wait([job])
                h.h2d.transfer_async(job + 1, (cpu, 16 + np.arange(16)))
                h.wait([job + 1])
                assert all(r.success for r in h.get_finished()), job
                for t in layers:
                    assert torch.equal(t[16:], t[torch.as_tensor(gpu, device=t.device)]), job
        finally:
            stop.set()
            racer.join()
        assert not errors, errors
        assert calls[0] > 0
        torch.cuda.synchronize()
        before = int(torch.cuda.mem_get_info()[0])
        h.engine.prepare_staged("h2d")
        h.engine.prepare_staged("d2h")
        assert int(torch.cuda.mem_get_info()[0]) == before, "a made stage is made again"
    finally:
        h.shutdown()
