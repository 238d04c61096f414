"""How fast can a CPU tier of tens of GiB be made page-locked? A probe, driver calls by ctypes.

    python benches/probe_pinning.py [--gib 16] [--threads 16] [--parts cases,floor,rows,region]
                                    [--json out.json]

One mapping of ``--gib`` GiB per case, anonymous (blockswap's PinnedRows) or a file in /dev/shm
mapped shared (vLLM's SharedOffloadRegion), filled with pages (``populate``: MADV_POPULATE_WRITE
over the whole range, from one thread or from ``--threads`` threads each taking a slice) and
page-locked with ``cuMemHostRegister`` (one call over the whole range, or one call per slice from
that many threads at once). Without ``populate`` the register call faults the pages in itself.
Prints seconds per phase and GiB/s over both; the mapping is unmapped between cases.

Then the floor under the fill: one anonymous mapping filled from ``--threads`` threads (its
pages touched for the first time), its pages handed back (``MADV_DONTNEED``) and filled again
(the same threads; the kernel hands back memory this process just freed), then written over with
``memset`` (pages already there): first touch against refill against the host's write bandwidth,
all in the same run.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from blockswap_bench.cli import parser
from blockswap_bench.kvblocks import write_figures

MADV_DONTNEED = 4
MADV_HUGEPAGE = 14
MADV_POPULATE_WRITE = 23  # Linux 5.14
CU_MEMHOSTREGISTER_PORTABLE = 1

libc = ctypes.CDLL("libc.so.6", use_errno=True)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
#: The CUDA driver, loaded by ``main`` (``--help`` works where there is none).
cuda: Any = None


def check(call: str, r: int) -> None:
    if r != 0:
        raise RuntimeError(f"{call} failed: CUresult {r}")


def parallel(n: int, fn: Callable[[int], None]) -> None:
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            fn(i)
        except BaseException as e:  # reported after the join
            errors.append(e)

    ts = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        raise errors[0]


def slices(addr: int, size: int, n: int) -> list[tuple[int, int]]:
    step = (size // n + (2 << 20) - 1) // (2 << 20) * (2 << 20)
    return [(addr + o, min(step, size - o)) for o in range(0, size, step)]


def one_case(
    kind: str, size: int, populate: int, register: int, huge: bool, ctx: ctypes.c_void_p
) -> dict[str, Any]:
    fd, path = -1, ""
    if kind == "shm":
        path = f"/dev/shm/probe_pinning_{os.getpid()}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(fd, size)
        flags = mmap.MAP_SHARED
    else:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    addr = libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        raise RuntimeError(f"mmap failed: errno {ctypes.get_errno()}")
    try:
        if huge:
            libc.madvise(addr, size, MADV_HUGEPAGE)
        t0 = time.perf_counter()
        if populate:
            fills = slices(addr, size, populate)

            def fill(i: int) -> None:
                if i < len(fills) and libc.madvise(fills[i][0], fills[i][1], MADV_POPULATE_WRITE):
                    raise OSError(ctypes.get_errno(), "madvise(MADV_POPULATE_WRITE)")

            parallel(populate, fill)
        t1 = time.perf_counter()
        parts = slices(addr, size, register)

        def reg(i: int) -> None:
            if i < len(parts):
                check("cuCtxSetCurrent", cuda.cuCtxSetCurrent(ctx))
                check(
                    "cuMemHostRegister",
                    cuda.cuMemHostRegister_v2(
                        ctypes.c_void_p(parts[i][0]),
                        ctypes.c_size_t(parts[i][1]),
                        ctypes.c_uint(CU_MEMHOSTREGISTER_PORTABLE),
                    ),
                )

        parallel(register, reg)
        t2 = time.perf_counter()
        for p, _ in parts:
            check("cuMemHostUnregister", cuda.cuMemHostUnregister(ctypes.c_void_p(p)))
    finally:
        libc.munmap(addr, size)
        if fd >= 0:
            os.close(fd)
            os.unlink(path)
    gib = size / (1 << 30)
    return {
        "kind": kind,
        "huge": huge,
        "populate_threads": populate,
        "register_threads": register,
        "populate_s": t1 - t0,
        "register_s": t2 - t1,
        "gib_per_s": gib / (t2 - t0),
    }


def fill_floor(size: int, threads: int) -> dict[str, Any]:
    """First touch, refill after MADV_DONTNEED, and memset over pages already there, of one
    anonymous mapping with huge pages, each from ``threads`` threads (see the module's doc)."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    addr = libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        raise RuntimeError(f"mmap failed: errno {ctypes.get_errno()}")
    parts = slices(addr, size, threads)

    def timed(fn: Callable[[int, int], int]) -> float:
        def one(i: int) -> None:
            if i < len(parts) and fn(*parts[i]):
                raise OSError(ctypes.get_errno(), "madvise")

        t0 = time.perf_counter()
        parallel(threads, one)
        return time.perf_counter() - t0

    try:
        libc.madvise(addr, size, MADV_HUGEPAGE)
        first = timed(lambda a, n: libc.madvise(a, n, MADV_POPULATE_WRITE))
        if libc.madvise(addr, size, MADV_DONTNEED):
            raise OSError(ctypes.get_errno(), "madvise(MADV_DONTNEED)")
        refill = timed(lambda a, n: libc.madvise(a, n, MADV_POPULATE_WRITE))
        write = timed(lambda a, n: libc.memset(a, 1, n) and 0)
    finally:
        libc.munmap(addr, size)
    # The same first touch by blockswap's fill (items of 64 MiB handed out to the threads).
    from blockswap import _core

    addr = libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        raise RuntimeError(f"mmap failed: errno {ctypes.get_errno()}")
    try:
        libc.madvise(addr, size, MADV_HUGEPAGE)
        t0 = time.perf_counter()
        _core.fill_and_pin([(addr, size)], [], None, threads)
        items = time.perf_counter() - t0
    finally:
        libc.munmap(addr, size)
    gib = size / (1 << 30)
    return {
        "threads": threads,
        "blockswap_fill_gib_per_s": gib / items,
        "first_touch_gib_per_s": gib / first,
        "refill_gib_per_s": gib / refill,
        "memset_gib_per_s": gib / write,
    }


def vllm_region(size: int, cell: int, piece: int | None) -> dict[str, Any] | None:
    """vLLM's own region as ``CPUOffloadingSpec.create_worker`` makes it for one rank (cells of
    ``cell`` bytes, its 32 segment files), made ready the way blockswap's plug-in does: with
    ``piece`` None, filled by vLLM's constructor (one ``MADV_POPULATE_WRITE`` per cell, one
    thread) then page-locked by ``pin_region``; otherwise made by blockswap's spec
    (``new_region``: vLLM's loop left to the worker) and filled from several threads while
    pieces of ``piece`` bytes are locked (``pin_region`` with the rank's slots). The time a vLLM
    user waits for the CPU tier. None without vLLM."""
    try:
        from vllm.v1.kv_offload.cpu import spec as cpu_spec
        from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

        from blockswap import _vllm_region as vr
    except ImportError:
        return None

    kwargs = {
        "engine_id": f"probe_pinning_{os.getpid()}",
        "num_chunks": size // cell,
        "rank": 0,
        "kv_bytes_per_chunk": cell,
        "cpu_page_size": cell,
        "barrier": lambda: None,
        "num_segments": cpu_spec._REGION_SEGMENTS,
    }
    t0 = time.perf_counter()
    region = SharedOffloadRegion(**kwargs) if piece is None else vr.new_region(**kwargs)
    t1 = time.perf_counter()
    device = torch.cuda.current_device()
    try:
        total = region.total_size_bytes
        # The plug-in's pieces (whole rows) and, where the region left it, the rank's fill and
        # its files.
        pieces, fill, files = vr.pieces_and_fill(region, piece or total)
        pinned = vr.pin_region(pieces, device, fill, files)
        vr.close_files(region)
        t2 = time.perf_counter()
        vr.unpin_region(pinned, device)
    finally:
        region.cleanup()
    gib = total / (1 << 30)
    return {
        "cell": cell,
        "piece": piece,
        "construct_s": t1 - t0,
        "fill_and_pin_s": t2 - t1,
        "gib_per_s": gib / (t2 - t0),
    }


def pinned_rows(size: int, piece: int) -> dict[str, Any]:
    """blockswap's ``PinnedRows`` of ``size`` bytes (rows of 2 MiB) in pieces of ``piece``: the
    time its constructor takes (fill from threads, pieces locked as each is in)."""
    from blockswap.hostmem import PinnedRows

    t0 = time.perf_counter()
    rows = PinnedRows(size >> 21, 2 << 20, piece_bytes=piece, backend="cuda", log_line=False)
    t1 = time.perf_counter()
    rows.unpin()
    del rows
    return {"piece": piece, "s": t1 - t0, "gib_per_s": size / (1 << 30) / (t1 - t0)}


def read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return "?"


def main() -> None:
    global cuda
    ap = parser(__doc__)
    ap.add_argument("--gib", type=float, default=16)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--parts", default="cases,floor,rows,region",
                    help="what to run: cases (mapping x fill x register), floor, rows, region")  # fmt: skip
    a = ap.parse_args()
    cuda = ctypes.CDLL("libcuda.so.1")
    torch.cuda.init()
    torch.empty(1, device="cuda")
    ctx = ctypes.c_void_p()
    check("cuCtxGetCurrent", cuda.cuCtxGetCurrent(ctypes.byref(ctx)))
    size = int(a.gib * (1 << 30)) // (2 << 20) * (2 << 20)
    t = a.threads
    st = os.statvfs("/dev/shm")
    print(
        f"{torch.cuda.get_device_name()}, {a.gib} GiB a case, /dev/shm free "
        f"{st.f_bavail * st.f_frsize / (1 << 30):.1f} GiB, THP: "
        + read("/sys/kernel/mm/transparent_hugepage/enabled")
        + " / shmem "
        + read("/sys/kernel/mm/transparent_hugepage/shmem_enabled"),
        flush=True,
    )
    cases = [
        ("anon", 0, 1, True),  # PinnedRows today: the driver faults the pages in
        ("anon", 1, 1, True),
        ("anon", t, 1, True),
        ("anon", t, t, True),
        ("anon", 0, t, True),
        ("anon", t, t, False),
        ("shm", 0, 1, False),  # vLLM's region, registered whole
        ("shm", t, 1, False),
        ("shm", t, t, False),
        ("shm", 0, t, False),
    ]
    rows = []
    print(
        f"{'kind':5} {'huge':5} {'fill thr':>8} {'reg thr':>7} {'fill s':>7} {'reg s':>7} {'GiB/s':>7}"
    )
    parts = set(a.parts.split(","))
    for kind, populate, register, huge in cases if "cases" in parts else []:
        try:
            r = one_case(kind, size, populate, register, huge, ctx)
        except Exception as e:  # a case that cannot run here is reported, the rest go on
            print(f"{kind:5} {huge!s:5} {populate:8} {register:7} failed: {e}", flush=True)
            continue
        rows.append(r)
        print(
            f"{kind:5} {huge!s:5} {populate:8} {register:7} {r['populate_s']:7.2f} "
            f"{r['register_s']:7.2f} {r['gib_per_s']:7.1f}",
            flush=True,
        )
    floors = []
    for n in sorted({1, t}) if "floor" in parts else []:
        f = fill_floor(size, n)
        floors.append(f)
        print(
            f"fill floor, {n} thread(s), anonymous, huge pages: first touch "
            f"{f['first_touch_gib_per_s']:.1f} GiB/s, refill after MADV_DONTNEED "
            f"{f['refill_gib_per_s']:.1f} GiB/s, memset over pages already there "
            f"{f['memset_gib_per_s']:.1f} GiB/s; blockswap's fill (items of 64 MiB) "
            f"{f['blockswap_fill_gib_per_s']:.1f} GiB/s",
            flush=True,
        )
    rows_figures = []
    for piece in (256 << 30, 4 << 30, 1 << 30) if "rows" in parts else []:
        r = pinned_rows(size, piece)
        rows_figures.append(r)
        print(
            f"PinnedRows, pieces of {piece >> 30} GiB: {r['s']:.2f} s, {r['gib_per_s']:.1f} GiB/s",
            flush=True,
        )
    regions = []
    for piece in (None, 32 << 30, 4 << 30, 2 << 30, 1 << 30) if "region" in parts else []:
        region = vllm_region(size, 5 << 20, piece)
        if region is None:
            break
        regions.append(region)
        how = (
            "vLLM fills, then blockswap locks"
            if piece is None
            else f"blockswap fills from threads, locking pieces of {piece >> 30} GiB"
        )
        print(
            f"vLLM's region (one rank, cells of 5 MiB, its segments), {how}: made in "
            f"{region['construct_s']:.2f} s, filled and locked in {region['fill_and_pin_s']:.2f} s:"
            f" {region['gib_per_s']:.1f} GiB/s",
            flush=True,
        )
    if a.json:
        write_figures(
            a.json,
            "probe_pinning.py",
            None,
            rows,
            gib=a.gib,
            floors=floors,
            vllm_region=regions,
            pinned_rows=rows_figures,
        )


if __name__ == "__main__":
    main()
