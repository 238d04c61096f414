"""Batched block copy: N jobs ``(src address, dst address, size in bytes)`` in one launch.

This is the GPU-side copy engine of blockswap. One Triton kernel moves every block of a
swap batch (KV-cache blocks between pinned host memory and GPU memory, or any other pair of
GPU-addressable buffers) with a small, persistent grid:

* ``_copy_blocks_kernel`` -- the kernel. Descriptors are three int64 arrays
  ``srcs[N]``, ``dsts[N]``, ``sizes[N]`` that the kernel reads *directly* through unified
  virtual addressing (UVA): they may live in device memory or in pinned host memory (a slab
  owned by the Rust core, say), and no host-to-device copy of the descriptors is made.
  Data addresses are raw integers that the kernel turns into pointers
  (``addr.to(tl.pointer_type(tl.int64))``); since pinned host memory has the same address on
  host and device under UVA, host->device, device->host, device->device (and pinned
  host->pinned host) copies are all the same code.
* ``copy_blocks`` -- launcher for int64 torch tensors (CUDA or pinned CPU; plain CPU under
  Triton's interpreter). Validates, derives the specialisation, launches.
* ``copy_blocks_raw`` -- launcher for raw descriptor addresses; builds no tensor and never
  reads the descriptors on the host.
* ``copy_blocks_reference`` -- plain per-job reference (``ctypes.memmove`` between host
  addresses, ``cuMemcpy`` from the CUDA driver where device memory is involved).

Work decomposition
------------------
Each job is cut into ``SPLIT`` interleaved slices (slice ``p`` owns the chunks
``p, p + SPLIT, p + 2 * SPLIT, ...`` of the job), giving ``N * SPLIT`` work items, taken
``ROWS`` consecutive items at a time. ``min(max_ctas, groups)`` programs walk the groups
grid-stride, so neighbouring programs work on neighbouring jobs at the same time. Each step
of a program moves a ``[ROWS, BLOCK_BYTES]`` tile -- one chunk of each of its ROWS items --
so that ``ROWS * BLOCK_BYTES`` (``block_bytes``, 16 KiB by default) of loads are in flight
per program even when the jobs are small: over PCIe that, not the number of programs, is
what sets the bandwidth. ``ROWS`` is ``block_bytes / max_size`` rounded to a power of two
(1..64; 4 when the sizes are unknown). ``SPLIT`` is 1 when there are enough jobs to keep
every program busy (the usual KV-cache case: thousands of equal blocks) and grows when
there are few large ones (one 1 GiB job is cut into ``4 * max_ctas`` slices). The
descriptors of a program's next group are loaded before the current one is copied, so
their latency (a PCIe round trip when they are in pinned host memory) is hidden.

Access width
------------
Rows whose ``src``, ``dst`` and ``size`` are all multiples of 16 are copied as int64 pairs
that Triton turns into 128-bit ``ld/st.global.v2.b64``. A row that is not takes, one at a
time, the any-alignment path: ``w`` is the largest of 16, 8, 4, 1 with
``src == dst (mod w)``; up to ``w - 1`` head bytes are copied bytewise until ``src`` is
``w``-aligned, the body with ``w``-byte accesses (int64 pairs, int64, int32 or bytes) and the
tail bytewise. The branches depend on values loaded at run time but are uniform over a
program, so they cost no divergence. When the caller promises that every ``src``, ``dst``
and ``size`` is a multiple of 16 (``alignment=16``, or found so by ``copy_blocks`` on
host-resident descriptors) a smaller specialisation (``ALIGNED16``) without the
any-alignment path is used; a false promise faults with a misaligned address.

Triton learns nothing about the alignment of a pointer made from an integer
(``int_to_ptr``), not even through arithmetic such as ``(a // 16) * 16``: the width is
given with ``tl.multiple_of`` on the pointer made inside each width branch. (The hint is
attached to the op that defines its operand, so hinting an integer shared by several
branches would claim the alignment in all of them.)

Launch overhead and measurements
--------------------------------
A launch is one kernel whatever N is. Host cost per call, measured on an H200 host with
N = 1000 (Triton 3.6, PyTorch 2.11): ``copy_blocks_raw`` ~13 us (Triton's Python launch
path), ``copy_blocks`` ~32 us with ``max_size``, ``alignment`` and ``check_values=False``
given (descriptor checks, an event to keep pinned descriptors alive) and ~66 us without
(vectorised value checks and hint derivation over N with torch on the host).
With descriptors in device memory the value checks need a device->host sync;
``check_values=False`` skips them (the kernel treats a non-positive size as an empty job).
Each (``ALIGNED16``, ``ROWS``, ``BLOCK_BYTES``, ``num_warps``) combination is compiled once
(about a second, then cached); the integer arguments are excluded from Triton's value
specialisation (``do_not_specialize``) so addresses and N never cause a recompile.

Bandwidth, same H200 host, 16 programs, defaults, pinned host <-> device, 128-256 MiB per
batch of equal blocks (``cudaMemcpy`` of one contiguous buffer: 50-55 GB/s each way):
1 KiB blocks 45-50 / 49-52 GB/s (H2D / D2H), 4 KiB 49-51 / 50-52, 16 KiB 50 / 52,
64 KiB 49-51 / 52.
Blocks of 4097 bytes (misaligned addresses: 4-, 1-byte paths) reach only 14 / 26 GB/s.
Without a ``max_size`` hint (``copy_blocks_raw`` or device-resident descriptors) 1 KiB
blocks drop to as low as 22 GB/s (4 rows instead of 16); from 4 KiB up it makes no
difference. More programs (``max_ctas=32``) help only the bytewise path (26 / 42 GB/s).

Contract (like ``memcpy``): source and destination ranges must not overlap; every address
must be accessible from the GPU (device memory, or host memory allocated pinned through
CUDA -- ``cudaHostAlloc`` / ``torch.Tensor.pin_memory`` -- or registered with
``cudaHostRegister`` on a system whose device can use host pointers for registered memory);
the data, and with ``copy_blocks_raw`` the descriptor arrays, must stay valid until the
kernel has finished (the launch is asynchronous on the current or given stream).
``copy_blocks`` keeps its descriptor tensors alive itself: pinned ones until an event
recorded after the launch has completed (PyTorch's caching host allocator would otherwise
hand a freed pinned block to the next ``pin_memory()`` while the kernel still reads it),
CUDA ones through ``record_stream``.

Under Triton's interpreter (``TRITON_INTERPRET=1`` set before this module is imported,
the way the tests run without a GPU) the kernel runs on the CPU and dereferences the raw
addresses in this process, so every address must then be host memory.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
from collections.abc import Callable, Sequence
from typing import Any, Union

from blockswap import _core, _optional
from blockswap._checks import check_int
from blockswap._core import launch_plan
from blockswap.errors import ConfigError, ConfigTypeError

try:
    import torch
    import triton
    import triton.language as tl
except ModuleNotFoundError as e:
    _optional.missing(e, "blockswap.kernels")

__all__ = [
    "copy_blocks",
    "copy_blocks_raw",
    "copy_blocks_reference",
    "engine_launcher",
    "interpreter_mode",
    "kernel_unavailable",
]

DEFAULT_MAX_CTAS = 16
DEFAULT_NUM_WARPS = 4
DEFAULT_BLOCK_BYTES = 16384


# --------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------


@triton.jit
def _copy_span(
    src,
    dst,
    nbytes,
    part,
    split,
    ELEM: tl.constexpr,
    ELEM_BYTES: tl.constexpr,
    VEC: tl.constexpr,
    BLOCK_BYTES: tl.constexpr,
):
    """Copy slice ``part`` of ``split`` of the ``nbytes`` bytes at ``src`` to ``dst``.

    src, dst: int64 scalars, multiples of VEC (the caller guarantees it).
    nbytes:   int64 scalar, the length of the span (<= 0: nothing to do).
    ELEM:     element type of the accesses, ELEM_BYTES wide; VEC is a multiple of
              ELEM_BYTES and at most 16 -- the width the compiler may merge into one access.
    The span is cut into chunks of BLOCK_BYTES; this slice copies chunks
    part, part + split, part + 2 * split, ...
    """
    BLOCK: tl.constexpr = BLOCK_BYTES // ELEM_BYTES
    # Triton's axis analysis knows nothing about a pointer made from an integer: the hint
    # goes on the int_to_ptr op made here (tl.multiple_of marks its operand's defining op,
    # so hinting the shared integer would leak into the other width branches).
    s = tl.multiple_of(src.to(tl.pointer_type(ELEM)), VEC)
    d = tl.multiple_of(dst.to(tl.pointer_type(ELEM)), VEC)
    n = (nbytes // VEC) * (VEC // ELEM_BYTES)  # elements, visibly a multiple of VEC // ELEM_BYTES
    offs = tl.arange(0, BLOCK)
    n_steps = tl.cdiv(n - part * BLOCK, split * BLOCK)
    # ``while`` rather than ``range``: the interpreter cannot take tensors as range bounds
    # under NumPy >= 2.3. The chunk start is recomputed from the counter (not carried) so
    # that the axis analysis sees a multiple of BLOCK.
    k = 0
    while k < n_steps:
        idx = (k * split + part) * BLOCK + offs
        mask = idx < n
        x = tl.load(s + idx, mask=mask)
        tl.store(d + idx, x, mask=mask)
        k += 1


@triton.jit
def _copy_job(src, dst, size, part, split, BLOCK_BYTES: tl.constexpr):
    """Copy slice ``part`` of ``split`` of one job: ``size`` bytes from ``src`` to ``dst``.

    All arguments are int64 scalars; any alignment.
    """
    # Bytewise accesses take a register each: smaller chunks for that path.
    BYTE_BLOCK: tl.constexpr = BLOCK_BYTES // 8 if BLOCK_BYTES >= 128 else 16
    # w: widest access such that src and dst are equally misaligned modulo w.
    rel = src ^ dst
    w = tl.where((rel & 15) == 0, 16, tl.where((rel & 7) == 0, 8, tl.where((rel & 3) == 0, 4, 1)))
    head = tl.minimum((w - (src & (w - 1))) & (w - 1), size)
    rest = size - head
    body = rest - rest % w
    tail = rest - body
    _copy_span(src, dst, head, part, split, tl.uint8, 1, 1, BYTE_BLOCK)
    if w == 16:
        _copy_span(src + head, dst + head, body, part, split, tl.int64, 8, 16, BLOCK_BYTES)
    elif w == 8:
        _copy_span(src + head, dst + head, body, part, split, tl.int64, 8, 8, BLOCK_BYTES)
    elif w == 4:
        _copy_span(src + head, dst + head, body, part, split, tl.int32, 4, 4, BLOCK_BYTES)
    else:
        _copy_span(src + head, dst + head, body, part, split, tl.uint8, 1, 1, BYTE_BLOCK)
    _copy_span(src + head + body, dst + head + body, tail, part, split, tl.uint8, 1, 1, BYTE_BLOCK)


@triton.jit
def _copy_rows16(src, dst, size, part, split, BLOCK_BYTES: tl.constexpr):
    """Copy one slice of each of ROWS jobs at once, 16 bytes per access.

    src, dst, size, part: int64 [ROWS], src, dst and size multiples of 16 (size 0: no job).
    Each step moves a [ROWS, BLOCK_BYTES] tile: one chunk of every row, all loads in flight
    together -- what keeps a PCIe link busy with few programs when the jobs are small.
    """
    BLOCK: tl.constexpr = BLOCK_BYTES // 8
    s = tl.multiple_of(src.to(tl.pointer_type(tl.int64)), [16])
    d = tl.multiple_of(dst.to(tl.pointer_type(tl.int64)), [16])
    n = (size // 16) * 2  # int64 elements per row, visibly even
    offs = tl.arange(0, BLOCK)
    n_steps = tl.max(tl.cdiv(n - part * BLOCK, split * BLOCK), axis=0)
    k = 0
    while k < n_steps:
        idx = ((k * split + part) * BLOCK)[:, None] + offs[None, :]
        mask = idx < n[:, None]
        x = tl.load(s[:, None] + idx, mask=mask)
        tl.store(d[:, None] + idx, x, mask=mask)
        k += 1


@triton.jit
def _load_items(srcs, dsts, sizes, items, n_items, split, src_base, dst_base):
    """Descriptors of work items ``items`` [ROWS]: (src, dst, size, part), the bases added, zeros
    past the end."""
    valid = items < n_items
    job = items // split
    part = items - job * split
    src = tl.load(srcs + job, mask=valid, other=0) + src_base
    dst = tl.load(dsts + job, mask=valid, other=0) + dst_base
    size = tl.load(sizes + job, mask=valid, other=0)
    return src, dst, size, part


@triton.jit(
    do_not_specialize=[
        "srcs_addr", "dsts_addr", "sizes_addr", "n_jobs", "split", "src_base", "dst_base"
    ]
)  # fmt: skip
def _copy_blocks_kernel(
    srcs_addr,
    dsts_addr,
    sizes_addr,
    n_jobs,
    split,
    src_base,
    dst_base,
    ALIGNED16: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_BYTES: tl.constexpr,
):
    """Copy ``sizes[j]`` bytes from ``srcs[j]`` to ``dsts[j]`` for every job ``j < n_jobs``.

    srcs_addr, dsts_addr, sizes_addr: addresses (Python ints) of three int64 arrays [n_jobs],
        GPU-addressable (device or pinned host memory); the kernel reads them directly.
    split: slices per job (>= 1); work item i is slice i % split of job i // split.
    src_base, dst_base: added to every source / destination address (0 but for the core's staged
        plan, whose descriptors give offsets into a staging slot on one side).
    ALIGNED16: the caller promises that every src, dst and size is a multiple of 16: only
        the 16-byte path is built. Otherwise each row is checked and the misaligned ones
        take the any-alignment path (a false promise faults with a misaligned address).
    ROWS: work items copied side by side per step (power of two).
    BLOCK_BYTES: bytes per chunk, what one row moves per step (power of two, >= 16); the
        any-alignment path uses chunks of ROWS * BLOCK_BYTES.
    grid: (G,) with G <= cdiv(n_jobs * split, ROWS); program p takes the groups of ROWS
        consecutive items p, p + G, p + 2G, ...
    """
    srcs = srcs_addr.to(tl.int64).to(tl.pointer_type(tl.int64))
    dsts = dsts_addr.to(tl.int64).to(tl.pointer_type(tl.int64))
    sizes = sizes_addr.to(tl.int64).to(tl.pointer_type(tl.int64))
    n_items = n_jobs.to(tl.int64) * split
    n_groups = tl.cdiv(n_items, ROWS)
    nprog = tl.num_programs(0)
    rows = tl.arange(0, ROWS)
    group = tl.program_id(0).to(tl.int64)
    src, dst, size, part = _load_items(
        srcs, dsts, sizes, group * ROWS + rows, n_items, split, src_base, dst_base
    )
    while group < n_groups:
        # Prefetch the next group's descriptors before copying this one.
        nxt = group + nprog
        nsrc, ndst, nsize, npart = _load_items(
            srcs, dsts, sizes, nxt * ROWS + rows, n_items, split, src_base, dst_base
        )
        _copy_items(src, dst, size, part, split, rows, ALIGNED16, ROWS, BLOCK_BYTES)
        src = nsrc
        dst = ndst
        size = nsize
        part = npart
        group = nxt


@triton.jit
def _copy_items(src, dst, size, part, split, rows, ALIGNED16: tl.constexpr, ROWS: tl.constexpr,
                BLOCK_BYTES: tl.constexpr):  # fmt: skip
    """Copy slice ``part`` of ``split`` of each of ROWS work items ``(src, dst, size)`` [ROWS]
    (size 0: no item); ``rows`` is ``tl.arange(0, ROWS)``. See ``_copy_blocks_kernel``."""
    if ALIGNED16:
        _copy_rows16(src, dst, size, part, split, BLOCK_BYTES)
    else:
        # Rows whose src, dst and size are all multiples of 16 go through the tile; the
        # others (rare in practice) one at a time through the any-alignment path.
        ok = ((src | dst | size) & 15) == 0
        _copy_rows16(
            tl.where(ok, src, 0), tl.where(ok, dst, 0), tl.where(ok, size, 0), part, split,
            BLOCK_BYTES,
        )  # fmt: skip
        if tl.sum(tl.where(ok, 0, 1), axis=0) > 0:
            r = 0
            while r < ROWS:
                pick = (rows == r) & (ok == 0)
                _copy_job(
                    tl.sum(tl.where(pick, src, 0), axis=0),
                    tl.sum(tl.where(pick, dst, 0), axis=0),
                    tl.sum(tl.where(pick, size, 0), axis=0),
                    tl.sum(tl.where(pick, part, 0), axis=0),
                    split,
                    ROWS * BLOCK_BYTES,
                )
                r += 1


# --------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------


def interpreter_mode() -> bool:
    """True when this module's kernels were built for Triton's CPU interpreter."""
    return not isinstance(_copy_blocks_kernel, triton.runtime.JITFunction)


def kernel_unavailable() -> str | None:
    """Why this module's copy kernel cannot run in this process, or None where it can: built for
    the GPU, it needs a GPU driver Triton can use (without one every launch raises
    ``RuntimeError: 0 active drivers``); under Triton's interpreter it runs on the CPU."""
    if interpreter_mode():
        return None
    try:
        triton.runtime.driver.active  # noqa: B018 - made on first use; raises where none is
    except RuntimeError as e:
        return (
            f"the copy kernel needs a GPU driver Triton can use, and Triton has none here ({e}); "
            "without a GPU it runs only under Triton's interpreter (TRITON_INTERPRET=1 set "
            "before blockswap.kernels is imported)"
        )
    return None


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_launch_params(max_ctas: int, num_warps: int, block_bytes: int) -> None:
    check_int("max_ctas", max_ctas, 1, 2**31 - 1, numpy=False)  # a launch's grid at most
    check_int("num_warps", num_warps, 1, numpy=False)
    if num_warps & (num_warps - 1) or num_warps > 32:
        raise ConfigError(f"num_warps must be a power of two <= 32, got {num_warps}")
    check_int("block_bytes", block_bytes, 1, numpy=False)
    if block_bytes & (block_bytes - 1) or not 16 <= block_bytes <= 1 << 20:
        raise ConfigError(f"block_bytes must be a power of two in [16, 1 MiB], got {block_bytes}")


def _check_hints(max_size: int | None, alignment: int | None) -> None:
    if max_size is not None:
        check_int("max_size", max_size, 1, numpy=False)
    if alignment is not None:
        check_int("alignment", alignment, 1, numpy=False)
        if alignment & (alignment - 1):
            raise ConfigError(f"alignment must be a power of two, got {alignment}")


_held: collections.deque[tuple[torch.cuda.Event, tuple[torch.Tensor, ...]]] = collections.deque()


def _hold_until_done(tensors: tuple[torch.Tensor, ...], stream: torch.cuda.Stream) -> None:
    """Keep ``tensors`` alive until the work queued on ``stream`` so far has completed.

    Pinned host tensors go back to PyTorch's caching host allocator when freed, which hands
    the block out again at once unless the block was used by a ``copy_``: the kernel would
    then read descriptors that a later ``pin_memory()`` overwrote.
    """
    while _held and _held[0][0].query():
        _held.popleft()
    event = torch.cuda.Event()
    event.record(stream)
    _held.append((event, tensors))


def _launch(
    srcs_addr: int,
    dsts_addr: int,
    sizes_addr: int,
    n: int,
    *,
    max_ctas: int,
    num_warps: int,
    block_bytes: int,
    max_size: int | None,
    total_bytes: int | None,
    aligned16: bool,
    device: Any,
    stream: Any,
    hold: tuple[torch.Tensor, ...] = (),
) -> None:
    grid, split, rows, row_bytes = launch_plan(n, max_ctas, block_bytes, max_size, total_bytes)
    args = (srcs_addr, dsts_addr, sizes_addr, n, split, 0, 0)
    meta = {"ALIGNED16": aligned16, "ROWS": rows, "BLOCK_BYTES": row_bytes, "num_warps": num_warps}
    if interpreter_mode():
        _copy_blocks_kernel[(grid,)](*args, **meta)
        return
    # Triton launches on the current device's current stream: switch only when asked to.
    with contextlib.ExitStack() as ctx:
        if device is not None:
            ctx.enter_context(torch.cuda.device(device))
        if stream is not None:
            ctx.enter_context(torch.cuda.stream(stream))
        _copy_blocks_kernel[(grid,)](*args, **meta)
        if hold:
            launched_on = torch.cuda.current_stream()
            for t in hold:
                if t.device.type == "cuda":
                    t.record_stream(launched_on)
            host = tuple(t for t in hold if t.device.type == "cpu")
            if host:
                _hold_until_done(host, launched_on)


def copy_blocks_raw(
    srcs_addr: int,
    dsts_addr: int,
    sizes_addr: int,
    n: int,
    *,
    max_ctas: int = DEFAULT_MAX_CTAS,
    max_size: int | None = None,
    alignment: int | None = None,
    device: torch.device | int | str | None = None,
    stream: torch.cuda.Stream | None = None,
    num_warps: int = DEFAULT_NUM_WARPS,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
) -> None:
    """Launch the batched copy on raw descriptor addresses (nothing is read on the host).

    srcs_addr, dsts_addr, sizes_addr: addresses of three int64 arrays [n] in GPU-addressable
        memory (device memory, or pinned host memory read through UVA), e.g. a descriptor
        slab owned by the Rust core. They are not read here.
    n: number of jobs; 0 is a no-op.
    max_ctas: cap on the persistent grid (grid = min(max_ctas, work items)).
    max_size: the largest size, if known. A tuning hint only (a wrong value changes the
        speed, never the bytes): it sets how many small jobs share a step (ROWS) and how
        finely large jobs are split across programs. Without it: 4 rows, and the split is
        guessed from n alone.
    alignment: a power of two dividing every src, dst and size, if known. A promise: a
        multiple of 16 selects the kernel without the any-alignment path, and then a
        misaligned job faults (misaligned address, which poisons the CUDA context).
        Without it each job is checked at run time (same bytes, a little more code).
    device: CUDA device to launch on (default: the current one); ignored by the interpreter.
    stream: CUDA stream to launch on (default: the current stream of ``device``).
    num_warps, block_bytes: kernel shape; block_bytes (power of two, 16 B .. 1 MiB) is how
        many bytes one program moves per step -- the loads it has in flight at once.

    The launch is asynchronous: the descriptor arrays and the data must stay valid until
    the kernel completes on ``stream``. Sizes must be positive (non-positive ones are
    skipped); ranges must not overlap. Nothing but the arguments themselves is validated.
    """
    addrs = {"srcs_addr": srcs_addr, "dsts_addr": dsts_addr, "sizes_addr": sizes_addr}
    for name, value in addrs.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigTypeError(f"{name} must be an int address, got {type(value).__name__}")
    check_int("n", n, 0, numpy=False)
    _check_launch_params(max_ctas, num_warps, block_bytes)
    _check_hints(max_size, alignment)
    if n == 0:
        return
    for name, value in addrs.items():
        if value <= 0 or value % 8:
            raise ConfigError(f"{name} must be a non-null, 8-byte aligned address, got {value:#x}")
    _launch(
        srcs_addr,
        dsts_addr,
        sizes_addr,
        n,
        max_ctas=max_ctas,
        num_warps=num_warps,
        block_bytes=block_bytes,
        max_size=max_size,
        total_bytes=None,
        aligned16=alignment is not None and alignment % 16 == 0,
        device=device,
        stream=stream,
    )


def engine_launcher(
    *,
    max_ctas: int = 16,
    num_warps: int = 4,
    block_bytes: int = 16384,
    launch_bytes: int | None = None,
) -> Callable[[int, int, int, int, int, int, int], None]:
    """A launcher for :meth:`blockswap.Engine.submit`'s kernel route.

    The engine calls it with the addresses of a pinned descriptor slab's three columns, the
    count, the largest size, the common alignment (computed from the descriptors, so the
    16-byte promise is true) and the raw ``CUstream`` of the transfer's lane (0 on the host
    backend, where the kernel runs under Triton's interpreter). It launches
    :func:`copy_blocks_raw` there; nothing is read on the host.

    ``launch_bytes``: the most one launch moves (counted as descriptors of the largest size, and
    at least one descriptor per launch); a transfer over it is copied by several launches one
    after the other on its stream. A launch holds the SMs of its CTAs until it ends, and a
    model's kernel that needs those SMs waits for them: shorter launches bound that wait (see
    ``KERNEL_LAUNCH_BYTES`` in :mod:`blockswap.handler`). ``None``: one launch per transfer.
    """
    _check_launch_params(max_ctas, num_warps, block_bytes)
    if launch_bytes is not None:
        check_int("launch_bytes", launch_bytes, 1, numpy=False)
    streams: dict[int, torch.cuda.ExternalStream] = {}
    compiled: dict[tuple[bool, int, int], Any] = {}

    def launch(
        srcs: int, dsts: int, sizes: int, n: int, max_size: int, alignment: int, stream: int
    ) -> None:
        per = n if launch_bytes is None else max(1, launch_bytes // max(1, max_size))
        if per >= n:
            one(srcs, dsts, sizes, n, max_size, alignment, stream)
            return
        # Descriptors are int64 columns: launch i takes rows [i * per, (i + 1) * per).
        for start in range(0, n, per):
            off = 8 * start
            one(
                srcs + off,
                dsts + off,
                sizes + off,
                min(per, n - start),
                max_size,
                alignment,
                stream,
            )

    def one(
        srcs: int, dsts: int, sizes: int, n: int, max_size: int, alignment: int, stream: int
    ) -> None:
        if not stream or interpreter_mode():
            copy_blocks_raw(
                srcs,
                dsts,
                sizes,
                n,
                max_ctas=max_ctas,
                max_size=max_size,
                alignment=alignment,
                num_warps=num_warps,
                block_bytes=block_bytes,
            )
            return
        grid, split, rows, row_bytes = launch_plan(n, max_ctas, block_bytes, max_size)
        aligned16 = alignment % 16 == 0
        key = (aligned16, rows, row_bytes)
        kernel = compiled.get(key)
        if kernel is None:
            # First launch of this specialisation: through the JIT, which compiles it, on the
            # lane's stream and device.
            ext = streams.get(stream)
            if ext is None:
                ext = streams[stream] = torch.cuda.ExternalStream(stream)
            with torch.cuda.device(ext.device), torch.cuda.stream(ext):
                compiled[key] = _copy_blocks_kernel[(grid,)](
                    srcs,
                    dsts,
                    sizes,
                    n,
                    split,
                    0,
                    0,
                    ALIGNED16=aligned16,
                    ROWS=rows,
                    BLOCK_BYTES=row_bytes,
                    num_warps=num_warps,
                )
            return
        # Then straight to the compiled kernel's launcher: no argument binding, no device or
        # stream switch. The engine calls this with its own context current, on the lane's raw
        # stream. This took the launcher from ~28 us to a few us of host time per transfer.
        args = (srcs, dsts, sizes, n, split, 0, 0, aligned16, rows, row_bytes)
        meta = kernel.launch_metadata((grid, 1, 1), stream, *args)
        kernel.run(
            grid,
            1,
            1,
            stream,
            kernel.function,
            kernel.packed_metadata,
            meta,
            triton.knobs.runtime.launch_enter_hook,
            triton.knobs.runtime.launch_exit_hook,
            *args,
        )

    return launch


def _check_descriptor(name: str, t: Any, interpret: bool) -> None:
    if not isinstance(t, torch.Tensor):
        raise ConfigTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int64:
        raise ConfigTypeError(f"{name} must have dtype torch.int64, got {t.dtype}")
    if t.dim() != 1:
        raise ConfigError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ConfigError(f"{name} must be contiguous")
    if interpret:
        if t.device.type != "cpu":
            raise ConfigError(
                f"{name} is on {t.device}; under Triton's interpreter descriptors must be on the CPU"
            )
    elif t.device.type == "cpu":
        if t.numel() and not t.is_pinned():
            raise ConfigError(
                f"{name} is in pageable CPU memory; use a CUDA or a pinned CPU tensor"
            )
    elif t.device.type != "cuda":
        raise ConfigError(f"{name} must be a CUDA or a pinned CPU tensor, got device {t.device}")


def copy_blocks(
    src_ptrs: torch.Tensor,
    dst_ptrs: torch.Tensor,
    sizes: torch.Tensor,
    *,
    max_ctas: int = DEFAULT_MAX_CTAS,
    num_warps: int = DEFAULT_NUM_WARPS,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    stream: torch.cuda.Stream | None = None,
    max_size: int | None = None,
    alignment: int | None = None,
    check_values: bool = True,
) -> None:
    """Copy ``sizes[j]`` bytes from address ``src_ptrs[j]`` to address ``dst_ptrs[j]``, all j.

    src_ptrs, dst_ptrs, sizes: int64 tensors [N], 1-D and contiguous, each on a CUDA device
        or in pinned CPU memory (the kernel reads them in place); plain CPU tensors under
        Triton's interpreter. N == 0 is a no-op.
    max_ctas: cap on the persistent grid (default 16).
    num_warps, block_bytes: kernel shape, see ``copy_blocks_raw``.
    stream: CUDA stream to launch on (default: the current stream of the descriptors'
        device, or of the current device when they are all in host memory).
    max_size, alignment: hints as in ``copy_blocks_raw`` (``alignment`` is trusted);
        derived here from host-resident descriptors when not given, never from
        device-resident ones (that would need a sync).
    check_values: check that every size is positive and every address non-null (for
        device-resident descriptors this synchronises the device). Everything is checked
        before anything is launched: invalid input raises and copies nothing.

    Raises :class:`~blockswap.errors.ConfigTypeError` (a ``TypeError``) for a non-tensor or a
    dtype other than int64, :class:`~blockswap.errors.ConfigError` (a ``ValueError``) for a
    wrong shape, a length mismatch, an unsupported device, a non-positive size or a null
    address.
    """
    interpret = interpreter_mode()
    named = (("src_ptrs", src_ptrs), ("dst_ptrs", dst_ptrs), ("sizes", sizes))
    for name, t in named:
        _check_descriptor(name, t, interpret)
    n = src_ptrs.numel()
    if dst_ptrs.numel() != n or sizes.numel() != n:
        raise ConfigError(
            "length mismatch: src_ptrs has "
            f"{n}, dst_ptrs {dst_ptrs.numel()}, sizes {sizes.numel()} elements"
        )
    _check_launch_params(max_ctas, num_warps, block_bytes)
    _check_hints(max_size, alignment)
    cuda_devices = {t.device for _, t in named if t.device.type == "cuda"}
    if len(cuda_devices) > 1:
        raise ConfigError(f"descriptors are on several devices: {sorted(map(str, cuda_devices))}")
    if n == 0:
        return

    on_host = not cuda_devices
    total_bytes = None
    if check_values:
        if bool((sizes <= 0).any()):
            j = int(torch.nonzero(sizes <= 0)[0, 0])
            raise ConfigError(f"sizes must be positive: sizes[{j}] = {int(sizes[j])}")
        for name, t in named[:2]:
            if bool((t == 0).any()):
                j = int(torch.nonzero(t == 0)[0, 0])
                raise ConfigError(f"{name}[{j}] is a null address")
    if on_host:
        if max_size is None:
            max_size = int(sizes.max())
            total_bytes = int(sizes.sum())
        if alignment is None:
            aligned16 = not bool(((src_ptrs | dst_ptrs | sizes) & 15).any())
        else:
            aligned16 = alignment % 16 == 0
    else:
        aligned16 = alignment is not None and alignment % 16 == 0
    device = next(iter(cuda_devices)) if cuda_devices else None
    _launch(
        src_ptrs.data_ptr(),
        dst_ptrs.data_ptr(),
        sizes.data_ptr(),
        n,
        max_ctas=max_ctas,
        num_warps=num_warps,
        block_bytes=block_bytes,
        max_size=max_size,
        total_bytes=total_bytes,
        aligned16=aligned16,
        device=device,
        stream=stream,
        hold=(src_ptrs, dst_ptrs, sizes),
    )


# --------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------


def _is_host_address(addr: int) -> bool:
    """True for memory the CPU can read directly (pageable or pinned host memory)."""
    # Memory unknown to CUDA (None, also the answer without a driver) is ordinary host memory.
    return _core.cuda_memory_kind(addr) != "device"


_IntSeq = Union[torch.Tensor, Sequence[int]]


def _to_list(name: str, x: _IntSeq) -> list[int]:
    if isinstance(x, torch.Tensor):
        if x.dtype != torch.int64:
            raise ConfigTypeError(f"{name} must have dtype torch.int64, got {x.dtype}")
        return [int(v) for v in x.reshape(-1).tolist()]
    return [int(v) for v in x]


def copy_blocks_reference(src_ptrs: _IntSeq, dst_ptrs: _IntSeq, sizes: _IntSeq) -> None:
    """Reference for ``copy_blocks``: the same copies, one job at a time, synchronously.

    src_ptrs, dst_ptrs, sizes: int64 tensors (any device) or sequences of ints [N].
    When CUDA is initialised in this process, jobs that touch device memory go through the
    driver's ``cuMemcpy``, called by the core (direction inferred from the addresses under UVA),
    and the device is synchronised before and after; jobs between host addresses use
    ``ctypes.memmove``.
    """
    srcs = _to_list("src_ptrs", src_ptrs)
    dsts = _to_list("dst_ptrs", dst_ptrs)
    lens = _to_list("sizes", sizes)
    if not len(srcs) == len(dsts) == len(lens):
        raise ConfigError(
            f"length mismatch: src_ptrs has {len(srcs)}, dst_ptrs {len(dsts)}, "
            f"sizes {len(lens)} elements"
        )
    for j, n in enumerate(lens):
        if n <= 0:
            raise ConfigError(f"sizes must be positive: sizes[{j}] = {n}")
    use_driver = torch.cuda.is_available() and torch.cuda.is_initialized()
    if use_driver:
        torch.cuda.synchronize()
    for src, dst, n in zip(srcs, dsts, lens):
        if not use_driver or (_is_host_address(src) and _is_host_address(dst)):
            ctypes.memmove(dst, src, n)
        else:
            try:
                _core.cuda_memcpy(dst, src, n)
            except _core.BackendError as e:
                raise _core.BackendError(
                    f"{e} (copying {n} bytes from {src:#x} to {dst:#x})"
                ) from e
    if use_driver:
        torch.cuda.synchronize()
