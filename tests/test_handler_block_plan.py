"""Tests of blockswap.handler's block-major CPU cache and the plans it allows: a block as 2-D
copies (the block plan), each block's row through a device staging ring (the staged plan), the
copy kernel launched by the core, and which route ``path="auto"`` takes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from blockswap import InvalidTransferError
from blockswap.handler import CpuGpuHandlers
from kv_helpers import FACTORS, N_CPU, N_GPU, ref_load_subs, ref_store_subs

# --------------------------------------------------------------------------------------------
# The block-major CPU cache and the block plan
# --------------------------------------------------------------------------------------------

#: (layout, per-layer shape with block dim of N blocks) for layer tensors that are views of one
#: allocation, as serving engines allocate them.
ONE_ALLOCATION = {
    "kv_split": lambda n: (2, n, 4, 2, 8),
    "kv_fused": lambda n: (n, 2, 4, 2, 8),
    "mla": lambda n: (n, 4, 24),
}


def one_allocation(layout: str, layers: int, n: int, device: str = "cpu") -> list[torch.Tensor]:
    shape = ONE_ALLOCATION[layout](n)
    buf = torch.randint(0, 256, (layers, *shape), dtype=torch.uint8, device=device)
    return [buf[i].view(torch.float16) for i in range(layers)]


def page_of(t: torch.Tensor, layout: str, b: int) -> list[torch.Tensor]:
    """The pages of block ``b`` of one layer tensor as uint8, in block-table order."""
    u = t.view(torch.uint8)
    return [u[0, b], u[1, b]] if layout == "kv_split" else [u[b]]


@pytest.mark.parametrize("factor", FACTORS)
@pytest.mark.parametrize("layout", sorted(ONE_ALLOCATION))
def test_block_major_cache_moves_blocks_as_one_copy_each(layout: str, factor: int) -> None:
    layers = 5
    gpu = one_allocation(layout, layers, N_GPU)
    h = CpuGpuHandlers(
        gpu, N_CPU, layout=layout, block_size_factor=factor, backend="host", path="blocks"
    )
    mirror = CpuGpuHandlers(
        [t.clone() for t in gpu],
        N_CPU,
        layout=layout,
        block_size_factor=factor,
        backend="host",
        cpu_layout="mirror",
    )
    try:
        # One 2-D copy per block, both directions: every page of a layer at one pitch.
        for d in ("d2h", "h2d"):
            assert h.routes[d].plan == "blocks", h.routes[d]
            (plan,) = h.block_plans[d]
            assert plan is not None and len(plan) == 1
        assert mirror.cpu_chunks is None and mirror.routes["d2h"].plan == "pages"
        (chunks,) = h.cpu_chunks
        segs = len(page_of(gpu[0], layout, 0))
        assert chunks.shape[:2] == (N_CPU * factor, layers * segs)
        assert chunks.is_contiguous()
        rng = np.random.default_rng(factor)
        n = 8
        perm = rng.permutation(N_GPU)
        src, dst = perm[:n], perm[n : 2 * n]
        cpu = rng.permutation(N_CPU)[: -(-n // factor)]
        for k, hh in enumerate((h, mirror)):
            assert hh.d2h.transfer_async(10 + k, (src, cpu)) is True
            hh.wait([10 + k])
            assert [r.success for r in hh.get_finished()] == [True]
        # The views read what a per-layer cache holds, and the chunk of sub-block s holds the
        # block's pages in table order, one after another.
        stored = ref_store_subs(cpu.tolist(), n, factor)
        for tv, tm in zip(h.cpu_caches[0], mirror.cpu_caches[0]):
            for s in stored:
                for a, b in zip(page_of(tv, layout, s), page_of(tm, layout, s)):
                    assert torch.equal(a, b)
        flat = chunks.view(torch.uint8).reshape(N_CPU * factor, -1)
        for i, s in enumerate(ref_store_subs(cpu.tolist(), n, factor)):
            pages = [p for t in gpu for p in page_of(t, layout, int(src[i]))]
            assert torch.equal(flat[s], torch.cat([p.reshape(-1) for p in pages]))
        # Back into other GPU blocks (end-aligned when n is not a multiple of the factor).
        n2 = n - 1 if factor > 1 else n
        for k, hh in enumerate((h, mirror)):
            assert hh.h2d.transfer_async(20 + k, (cpu, dst[:n2])) is True
            hh.wait([20 + k])
            assert [r.success for r in hh.get_finished()] == [True]
        for ta, tb in zip(gpu, mirror.gpu_caches[0]):
            assert torch.equal(ta.view(torch.uint8), tb.view(torch.uint8))
        subs = ref_load_subs(cpu.tolist(), n2, factor)
        for t in gpu:
            for i, s in enumerate(subs):
                j = ref_store_subs(cpu.tolist(), n, factor).index(s)
                for a, b in zip(page_of(t, layout, int(dst[i])), page_of(t, layout, int(src[j]))):
                    assert torch.equal(a, b)
        # A failed block-plan transfer is reported failed, once; the next one works.
        h.engine.inject_failures(1)
        assert h.d2h.transfer_async(30, (src, cpu)) is True
        h.wait([30])
        (r,) = h.get_finished()
        assert not r.success and "injected" in (r.error or "")
        assert h.d2h.transfer_async(31, (src, cpu)) is True
        h.wait([31])
        assert [r.success for r in h.get_finished()] == [True]
        # Bad ids are refused as on the page route, naming the block.
        with pytest.raises(InvalidTransferError, match="out of range"):
            h.d2h.transfer_async(32, ([N_GPU], [0]))
    finally:
        h.shutdown()
        mirror.shutdown()


def test_auto_takes_the_block_plan_from_block_min_page() -> None:
    from blockswap._core import BLOCK_MIN_PAGE

    def route(page: int, layers: int = 4) -> str:
        buf = torch.zeros((layers, N_GPU, 1, page), dtype=torch.uint8)
        gpu = [buf[i] for i in range(layers)]
        h = CpuGpuHandlers(gpu, N_CPU, layout="mla", backend="host")
        try:
            assert h.routes["d2h"].plan == h.routes["h2d"].plan
            return h.routes["d2h"].plan
        finally:
            h.shutdown()

    assert route(BLOCK_MIN_PAGE) == "blocks"
    # Below it, the staged plan: a copy per block row through the staging ring.
    assert route(BLOCK_MIN_PAGE // 4) == "staged"
    # The mirrored CPU cache keeps the page route.
    gpu = [torch.zeros((N_GPU, 1, BLOCK_MIN_PAGE), dtype=torch.uint8)]
    h = CpuGpuHandlers(gpu, N_CPU, layout="mla", backend="host", cpu_layout="mirror")
    try:
        assert h.routes["d2h"].plan == "pages"
    finally:
        h.shutdown()


def test_block_route_is_chosen_only_where_it_saves_copies_and_path_blocks_insists() -> None:
    # Two KV-cache groups, each its own allocation: a plan per group; pages of 128 bytes take the
    # page route by default, path="blocks" takes the plans, and moves both groups in one batch.
    g = [one_allocation("kv_fused", 2, N_GPU), one_allocation("kv_fused", 3, N_GPU)]
    h = CpuGpuHandlers(g, N_CPU, layout="kv_fused", backend="host")
    try:
        assert h.routes["d2h"].plan == "staged"
        assert [len(p or []) for p in h.block_plans["d2h"]] == [1, 1]
    finally:
        h.shutdown()
    h = CpuGpuHandlers(
        g, N_CPU, layout="kv_fused", backend="host", path="blocks", block_size_factor=2
    )
    try:
        assert h.routes["d2h"].plan == h.routes["h2d"].plan == "blocks"
        assert h.routes["d2h"].reason.startswith("group 0: blocks: 1 2-D copy per block")
        before = [[page_of(t, "kv_fused", b)[0].clone() for b in (1, 2, 3)] for t in g[1]]
        h.d2h.transfer_async(1, ([[4], [1, 2, 3]], [[0], [5, 6]]), block_indices=[0, 3])
        h.wait([1])  # the directions run on their own lanes
        h.h2d.transfer_async(2, ([[], [5, 6]], [[], [7, 8, 9]]),
                             block_indices=[0, 3])  # fmt: skip
        h.wait([1, 2])
        assert [r.success for r in h.get_finished()] == [True, True]
        # Group 1 stored blocks 1, 2, 3 from sub-block 1 of CPU block 5 and loaded them back.
        for t, pages in zip(g[1], before):
            for b, page in zip((7, 8, 9), pages):
                assert torch.equal(page_of(t, "kv_fused", b)[0], page)
    finally:
        h.shutdown()
    # Groups sharing memory (the same tensors twice): no block plan can prove their 2-D copies
    # disjoint, so path="blocks" is refused; the staged plan checks its pages as the page route
    # does, and a transfer writing one page twice is refused.
    shared = [g[0], g[0]]
    h = CpuGpuHandlers(shared, N_CPU, layout="kv_fused", backend="host")
    try:
        assert h.routes["d2h"].plan == "staged"
        with pytest.raises(InvalidTransferError, match="overlap"):
            h.h2d.transfer_async(3, ([[1], [2]], [[5], [5]]))
        h.h2d.transfer_async(4, ([[1], [2]], [[5], [6]]))
        h.wait([4])
        assert [r.success for r in h.get_finished()] == [True]
    finally:
        h.shutdown()
    with pytest.raises(ValueError, match="path='blocks'"):
        CpuGpuHandlers(shared, N_CPU, layout="kv_fused", backend="host", path="blocks")
    # path="dma" keeps the page route even where a block plan exists.
    h = CpuGpuHandlers(one_allocation("mla", 3, N_GPU), N_CPU, layout="mla", path="dma",
                       backend="host")  # fmt: skip
    try:
        assert h.routes["h2d"].plan == "pages" and h.block_plans["h2d"][0] is not None
    finally:
        h.shutdown()
    with pytest.raises(ValueError, match="cpu_layout"):
        CpuGpuHandlers(one_allocation("mla", 1, N_GPU), N_CPU, layout="mla", cpu_layout="x")


def _roundtrip_on_gpu(
    h: CpuGpuHandlers,
    gpu: list,
    layout: str,
    factor: int,
    seed: int,
    pieces: int,
    cpu_order: str = "random",
) -> None:
    """Moves 32 random GPU blocks to random CPU blocks (``adjacent``: CPU blocks one after the
    other, from a random first one; ``reversed``: the same from the last one down, as vLLM's
    CPU manager hands a request chunks freed by one eviction) and back to 32 other GPU blocks,
    each way as ``pieces`` queued transfers, and checks every result, the bytes reported and
    the pages."""
    rng = np.random.default_rng(seed)
    perm = rng.permutation(64)
    n = 32
    src, dst = perm[:n], perm[n:]
    if cpu_order != "random":
        first = int(rng.integers(0, 32 - n // factor + 1))
        cpu = np.arange(first, first + n // factor)
        if cpu_order == "reversed":
            cpu = cpu[::-1].copy()
    else:
        cpu = rng.permutation(32)[: n // factor]
    before = [torch.stack([p for p in page_of(t, layout, int(b))]) for t in gpu for b in src]
    per, cper = n // pieces, n // pieces // factor
    for j in range(pieces):
        s, c = src[j * per : (j + 1) * per], cpu[j * cper : (j + 1) * cper]
        assert h.d2h.transfer_async(1 + j, (s, c)) is True
    h.wait(range(1, pieces + 1))
    res = h.get_finished()
    assert [r.success for r in res] == [True] * pieces, [r.error for r in res]
    assert sum(r.bytes for r in res) == n * int(h.gpu_tables[0].nbytes.sum())
    for j in range(pieces):
        c, d = cpu[j * cper : (j + 1) * cper], dst[j * per : (j + 1) * per]
        assert h.h2d.transfer_async(1 + pieces + j, (c, d)) is True
    h.wait(range(pieces + 1, 2 * pieces + 1))
    res = h.get_finished()
    assert [r.success for r in res] == [True] * pieces, [r.error for r in res]
    after = [torch.stack([p for p in page_of(t, layout, int(b))]) for t in gpu for b in dst]
    for a, b in zip(after, before):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("path", ["auto", "staged", "dma", "blocks", "kernel"])
def test_layers_sharing_one_gpu_tensor_store_and_refuse_loads_on_every_path(
    path: str, device: str
) -> None:
    # Two layers viewing one GPU tensor (KV sharing) in one group: their K pages are one memory,
    # and so are their V pages. A load would write each of them twice, from two CPU pages, in
    # no fixed order (on the GPU, a race between the kernel's CTAs), so every plan refuses it;
    # a store reads them twice, which is well-defined.
    t = one_allocation("kv_split", 1, N_GPU, device)[0]
    kw = {"backend": "host"} if device == "cpu" else {}
    h = CpuGpuHandlers([t, t], N_CPU, layout="kv_split", path=path, **kw)
    try:
        plan = {"auto": "staged", "dma": "pages", "kernel": "pages"}.get(path, path)
        assert h.routes["h2d"].plan == h.routes["d2h"].plan == plan
        before = t.clone()
        h.d2h.transfer_async(1, ([3, 9], [2, 5]))
        h.wait([1])
        assert [r.success for r in h.get_finished()] == [True]
        cpu = h.cpu_caches[0]
        for layer in cpu:  # both layers' CPU pages hold the tensor's pages
            for g, c in ((3, 2), (9, 5)):
                assert torch.equal(
                    page_of(layer, "kv_split", c)[0].cpu(), page_of(t, "kv_split", g)[0].cpu()
                )
                assert torch.equal(
                    page_of(layer, "kv_split", c)[1].cpu(), page_of(t, "kv_split", g)[1].cpu()
                )
        with pytest.raises(
            InvalidTransferError,
            match=r"h2d job 2: destination pages overlap: segments 0 and 2 of the GPU table "
            r"share memory",
        ):
            h.h2d.transfer_async(2, ([2, 5], [0, 1]))
        assert torch.equal(t.view(torch.uint8), before.view(torch.uint8))  # nothing written
        # The handler goes on: stores still work.
        h.d2h.transfer_async(3, ([0], [7]))
        h.wait([3])
        assert [r.success for r in h.get_finished()] == [True]
    finally:
        h.shutdown()


@pytest.mark.cuda
@pytest.mark.parametrize("factor", FACTORS)
@pytest.mark.parametrize("layout", sorted(ONE_ALLOCATION))
def test_cuda_block_plan_roundtrip(layout: str, factor: int) -> None:
    """On the GPU: one cuMemcpy2DAsync per block both ways, byte-exact, 80 layers."""
    gpu = one_allocation(layout, 80, 64, device="cuda")
    h = CpuGpuHandlers(gpu, 32, layout=layout, block_size_factor=factor, path="blocks")
    try:
        assert h.backend == "cuda" and h.routes["d2h"].plan == "blocks"
        assert h.routes["h2d"].plan == "blocks"
        _roundtrip_on_gpu(h, gpu, layout, factor, 7 + factor, 1)
    finally:
        h.shutdown()


#: ``stage_step_bytes``: the default (a transfer behind a running one in as few steps as its
#: bytes allow: one, at these sizes) and 1 (four full steps behind one too).
STEP_BYTES = [None, 1]


@pytest.mark.parametrize("step_bytes", STEP_BYTES)
@pytest.mark.parametrize("cpu_order", ["random", "adjacent", "reversed"])
@pytest.mark.parametrize("factor", FACTORS)
def test_staged_roundtrip_in_any_cpu_order_on_the_host_backend(
    factor: int, cpu_order: str, step_bytes: int | None
) -> None:
    """The staged plan both ways on the host backend, byte-exact, with slots of 3 rows (steps
    within a transfer, four queued): adjacent CPU blocks in either order take their rows in
    host order, joined, and every page still goes to its own block."""
    gpu = [t.clone() for t in one_allocation("kv_split", 80, 64, device="cpu")]
    row = 80 * sum(p.numel() for p in page_of(gpu[0], "kv_split", 0))
    kw = {} if step_bytes is None else {"stage_step_bytes": step_bytes}
    h = CpuGpuHandlers(
        gpu, 32, layout="kv_split", block_size_factor=factor, path="staged",
        stage_bytes=3 * row, backend="host", **kw,
    )  # fmt: skip
    try:
        assert h.routes["d2h"].plan == h.routes["h2d"].plan == "staged"
        _roundtrip_on_gpu(h, gpu, "kv_split", factor, 5 + factor, 4, cpu_order)
    finally:
        h.shutdown()


@pytest.mark.cuda
@pytest.mark.parametrize("step_bytes", STEP_BYTES)
@pytest.mark.parametrize("cpu_order", ["random", "adjacent", "reversed"])
@pytest.mark.parametrize("slot_rows", [None, 3])
@pytest.mark.parametrize("separate", [False, True])
@pytest.mark.parametrize("factor", FACTORS)
@pytest.mark.parametrize("layout", sorted(ONE_ALLOCATION))
def test_cuda_staged_roundtrip(
    layout: str,
    factor: int,
    separate: bool,
    slot_rows: int | None,
    cpu_order: str,
    step_bytes: int | None,
) -> None:
    """On the GPU: the staged plan both ways, byte-exact, 80 layers one allocation or each its
    own; with slots of 3 rows a transfer of 8 blocks takes 3 steps and four queued transfers
    cycle the two slots many times (more blocks in flight than the ring holds); with adjacent
    CPU blocks, in either order, their rows cross PCIe joined. Queued transfers behind a
    running one take one step by default at these sizes, four full ones with
    ``stage_step_bytes=1``."""
    gpu = one_allocation(layout, 80, 64, device="cuda")
    if separate:
        gpu = [t.clone() for t in gpu]
    kw: dict = {} if step_bytes is None else {"stage_step_bytes": step_bytes}
    if slot_rows is not None:
        row = 80 * sum(p.numel() for p in page_of(gpu[0], layout, 0))
        kw["stage_bytes"] = slot_rows * row
    h = CpuGpuHandlers(gpu, 32, layout=layout, block_size_factor=factor, path="staged", **kw)
    try:
        assert h.backend == "cuda" and h.routes["d2h"].plan == h.routes["h2d"].plan == "staged"
        assert h.routes["h2d"].kernel is not None
        _roundtrip_on_gpu(h, gpu, layout, factor, 11 + factor, 4, cpu_order)
    finally:
        h.shutdown()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("step_bytes", STEP_BYTES)
def test_staged_transfers_of_mixed_sizes_queued_hand_each_other_the_slots(
    step_bytes: int | None, device: str
) -> None:
    """On the GPU (and the host backend): staged transfers of 2-24 blocks queued one after the other, each way, through
    slots of 12 block rows (4 KiB pages, 80 layers each its own tensor): the small ones take one
    step or a few within one slot, the larger ones several through both slots in turn, so each
    transfer starts on whichever slot the one before left it, mid-cycle. Every transfer must
    wait for the work of the transfers before it on the slots it fills, and the bytes must
    arrive exactly; GPU blocks no transfer wrote stay as they were. With ``stage_step_bytes=1``
    the transfers behind a running one take several steps too."""
    layers, pages, cpu_blocks, kib = 80, 96, 96, 4
    gpu = [
        torch.randint(0, 256, (pages, 1, kib * 1024), dtype=torch.uint8, device=device)
        for _ in range(layers)
    ]
    kw: dict = {} if step_bytes is None else {"stage_step_bytes": step_bytes}
    if device == "cpu":
        kw["backend"] = "host"
    h = CpuGpuHandlers(
        gpu, cpu_blocks, layout="mla", path="staged", stage_bytes=12 * layers * kib * 1024, **kw
    )
    try:
        assert h.routes["h2d"].plan == h.routes["d2h"].plan == "staged"
        rng = np.random.default_rng(23)
        sizes = [4, 20, 8, 12, 2, 24, 6, 13]  # from 13 blocks, more rows than a slot holds
        src_perm, cpu_perm = rng.permutation(pages), rng.permutation(cpu_blocks)
        cuts = np.cumsum([0, *sizes])
        src = [src_perm[a:b] for a, b in zip(cuts, cuts[1:])]
        cpu = [cpu_perm[a:b] for a, b in zip(cuts, cuts[1:])]
        before = [torch.stack([t[torch.as_tensor(s, device=device)] for t in gpu]) for s in src]
        for j, (s, c) in enumerate(zip(src, cpu)):
            assert h.d2h.transfer_async(1 + j, (s, c)) is True
        h.wait(range(1, len(sizes) + 1))
        res = h.get_finished()
        assert [r.success for r in res] == [True] * len(sizes), [r.error for r in res]
        for t in gpu:  # what comes back must come from the CPU cache
            t.zero_()
        dst_perm = rng.permutation(pages)
        dst = [dst_perm[a:b] for a, b in zip(cuts, cuts[1:])]
        for j, (c, d) in enumerate(zip(cpu, dst)):
            assert h.h2d.transfer_async(100 + j, (c, d)) is True
        h.wait(range(100, 100 + len(sizes)))
        res = h.get_finished()
        assert [r.success for r in res] == [True] * len(sizes), [r.error for r in res]
        for j, d in enumerate(dst):
            after = torch.stack([t[torch.as_tensor(d, device=device)] for t in gpu])
            assert torch.equal(after, before[j]), f"transfer {j} of {sizes[j]} blocks"
        untouched = np.setdiff1d(np.arange(pages), dst_perm[: cuts[-1]])
        assert all(not t[torch.as_tensor(untouched, device=device)].any() for t in gpu)
    finally:
        h.shutdown()


@pytest.mark.cuda
@pytest.mark.parametrize("launch_bytes", [None, 20000])
@pytest.mark.parametrize("factor", FACTORS)
@pytest.mark.parametrize("layout", sorted(ONE_ALLOCATION))
def test_cuda_kernel_route_launched_by_the_core(
    layout: str, factor: int, launch_bytes: int | None
) -> None:
    """On the GPU: the per-page kernel route (a mirrored CPU cache, every page by the copy
    kernel) launched by the core, not from Python, both ways, byte-exact, 8 layers; with
    ``kernel_launch_bytes=20000`` each transfer takes many launches one after the other."""
    gpu = one_allocation(layout, 8, 64, device="cuda")
    h = CpuGpuHandlers(
        gpu,
        32,
        layout=layout,
        block_size_factor=factor,
        cpu_layout="mirror",
        path="kernel",
        kernel_launch_bytes=launch_bytes,
    )
    try:
        for r in h.routes.values():
            assert r.plan == "pages" and r.kernel_below > 0
            assert r.launcher is None and r.kernel is not None, r
            assert r.launch_bytes == launch_bytes and "launched by the core" in r.reason
        _roundtrip_on_gpu(h, gpu, layout, factor, 3 + factor, 4)
    finally:
        h.shutdown()


@pytest.mark.cuda
@pytest.mark.parametrize(("page", "blocks"), [(4100, 4), (1 << 20, 1)])
def test_cuda_core_kernel_route_odd_and_large_pages(page: int, blocks: int) -> None:
    """On the GPU: the core's kernel route for pages that are no multiple of 16 bytes (the
    any-alignment path) and for a few 1 MiB pages (each cut into slices across CTAs), byte-exact
    both ways."""
    layers = 3
    gpu = [
        torch.randint(0, 256, (8, 1, page), dtype=torch.uint8, device="cuda") for _ in range(layers)
    ]
    h = CpuGpuHandlers(gpu, 8, layout="mla", cpu_layout="mirror", path="kernel")
    try:
        assert all(r.kernel is not None and r.launcher is None for r in h.routes.values())
        rng = np.random.default_rng(page)
        perm = rng.permutation(8)
        src, dst = perm[:blocks], perm[blocks : 2 * blocks]
        cpu = rng.permutation(8)[:blocks]
        before = [t[torch.as_tensor(src, device="cuda")].clone() for t in gpu]
        assert h.d2h.transfer_async(1, (src, cpu)) is True
        h.wait([1])
        assert all(r.success for r in h.get_finished())
        for t in gpu:  # what comes back must come from the CPU cache
            t[torch.as_tensor(dst, device="cuda")] = 0
        assert h.h2d.transfer_async(2, (cpu, dst)) is True
        h.wait([2])
        assert all(r.success for r in h.get_finished())
        for t, b in zip(gpu, before):
            assert torch.equal(t[torch.as_tensor(dst, device="cuda")], b)
    finally:
        h.shutdown()


@pytest.mark.cuda
def test_cuda_staged_results_keep_their_order_beside_plain_transfers() -> None:
    """On the GPU: a staged CPU->GPU transfer ends with kernels on the stage's stream while the
    direction's copy stream goes on to the next transfer; a plain transfer queued behind it on
    one engine is never reported before it. Each staged transfer (40 MiB, 16 KiB pages, slots
    of 3 rows: many steps) is followed by a 4 KiB plain copy; waiting for the plain one alone,
    the staged one must be reported too, its bytes already in place. Both directions, queued."""
    layers, pages, kib = 80, 64, 16
    gpu = [
        torch.randint(0, 256, (pages, 1, kib * 1024), dtype=torch.uint8, device="cuda")
        for _ in range(layers)
    ]
    h = CpuGpuHandlers(gpu, 32, layout="mla", path="staged", stage_bytes=3 * layers * kib * 1024)
    host = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8).pin_memory()
    dev = torch.zeros(1 << 16, dtype=torch.uint8, device="cuda")
    try:
        assert h.routes["h2d"].plan == h.routes["d2h"].plan == "staged"
        e = h.engine
        hp, dp = e.register(host), e.register(dev)
        rng = np.random.default_rng(5)
        job = 0
        for rnd in range(4):
            src = rng.permutation(pages)[:32]
            before = torch.stack([t[int(b)] for t in gpu for b in src])
            job += 1
            assert h.d2h.transfer_async(job, (src, np.arange(32))) is True
            e.submit(job + 1, [dp + 4096 * (12 + rnd)], [hp + 4096 * (12 + rnd)], [4096], "d2h")
            job += 1
            h.wait([job])
            assert sorted(r.job_id for r in h.get_finished()) == [job - 1, job]
            dst = rng.permutation(pages)[:32]
            job += 1
            assert h.h2d.transfer_async(job, (np.arange(32), dst)) is True
            e.submit(job + 1, [hp + 4096 * rnd], [dp + 4096 * (rnd + 8)], [4096], "h2d")
            job += 1
            h.wait([job])
            res = h.get_finished()
            assert sorted(r.job_id for r in res) == [job - 1, job]
            assert all(r.success for r in res), [r.error for r in res]
            # Read at once, on torch's stream: the staged bytes must have landed.
            after = torch.stack([t[int(b)] for t in gpu for b in dst])
            assert torch.equal(after, before)
        torch.cuda.synchronize()
        assert torch.equal(dev[8 * 4096 : 12 * 4096].cpu(), host[: 4 * 4096])
    finally:
        h.shutdown()
