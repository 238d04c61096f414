"""KV-cache offloading handlers: the API a KV-cache offloading connector calls.

Modelled on vLLM's CPU offloading worker (``CpuGpuOffloadingHandlers`` with one
``SingleDirectionOffloadingHandler`` per direction), so a connector adopts it with a small change::

    from blockswap.handler import CpuGpuHandlers

    handlers = CpuGpuHandlers(gpu_kv_caches, num_cpu_blocks, layout="kv_split",
                              block_size_factor=cpu_block_size // gpu_block_size)
    offload, onload = handlers.gpu_to_cpu_handler, handlers.cpu_to_gpu_handler
    offload.transfer_async(job_id, (gpu_block_ids, cpu_block_ids))   # GPU -> CPU ("d2h")
    onload.transfer_async(job_id, (cpu_block_ids, gpu_block_ids))    # CPU -> GPU ("h2d")
    for r in handlers.get_finished():                 # blockswap.TransferResult
        ...  # r.job_id, r.success, r.bytes, r.seconds, r.error
    handlers.shutdown()

Everything that can be computed once is computed at construction: the per-block address tables
(:class:`~blockswap.layout.BlockTable`) of the GPU tensors and of the CPU cache, and the memory
registrations with one :class:`~blockswap.Engine`, which holds both tables of every KV-cache
group. Per transfer, ``transfer_async`` hands the block ids to the engine, which maps CPU blocks
to sub-blocks, checks every id and writes the copies (:meth:`blockswap.Engine.submit_groups`);
``get_finished`` is the engine's own lock-free poll, which also logs each failed transfer.

Block ids and ``block_size_factor``
-----------------------------------
A CPU block holds ``f = block_size_factor`` GPU-sized *sub-blocks*: CPU block ``c`` is sub-blocks
``c * f .. c * f + f - 1``. A transfer of ``n`` GPU blocks names ``m = ceil(n / f)`` CPU blocks
``c_0 .. c_{m-1}``; the ``m * f`` sub-blocks they expand to, in order, form a run of which ``n``
are used, one per GPU block, in order:

* **GPU -> CPU (offload, store, "d2h")**: aligned to the **start** of the first CPU block
  (``skip = 0``): GPU block ``i`` goes to sub-block ``i % f`` of CPU block ``c_{i // f}``. When
  ``n % f != 0``, the last ``f - n % f`` sub-blocks of the last CPU block are not written.
* **CPU -> GPU (onload, load, "h2d")**: aligned to the **end** of the last CPU block: the first
  ``skip = (-n) % f`` sub-blocks of ``c_0`` are skipped and GPU block ``i`` receives sub-block
  ``(skip + i) % f`` of CPU block ``c_{(skip + i) // f}``. (vLLM's load semantics: the GPU already
  holds the leading part of the first CPU block, and the run ends with the last CPU block.)

When ``n`` is a multiple of ``f`` (vLLM's stores always are) both rules name the same
sub-blocks. The number of CPU blocks must be exactly ``ceil(n / f)``.

**With ``block_indices``** (vLLM 0.33's ``GPULoadStoreSpec.block_indices``: per group, the
position of the first GPU block in its request), both directions start ``skip = block_indices[g]
% f`` sub-blocks into the first CPU block, and take ``ceil((skip + n) / f)`` CPU blocks: the first
and the last may be partial. The rule lives in the engine (:func:`blockswap._core.chunk_blocks`
computes it for inspection).

For hybrid models (several KV-cache groups, each with its own tensors, page size and block-id
space) each side of a spec is a sequence with one block-id array per group; the rules above apply
per group, and one transfer moves all groups in one batch.

Results
-------
Both handlers share one engine, so ``get_finished`` (of either handler, or of
:class:`CpuGpuHandlers`) returns the finished transfers of *both* directions, each exactly once
over all calls: poll them all and concatenate, as vLLM's ``OffloadingWorker`` does. Job ids are
one space across the two directions. A result is a :class:`blockswap.TransferResult`
(``job_id``, ``success``, ``bytes``, ``seconds``, ``error``: vLLM's job id, success, transfer
size and transfer time). A failed transfer is also logged, once, as a warning on the
``blockswap.handler`` logger when ``get_finished`` returns it.

Host cost
---------
``transfer_async`` converts each side's ids to an int64 array (no copy where they are one) and
makes one call into the engine, which writes the copies straight into its descriptor pool with
the GIL released: no per-block Python work, whatever the layout.

Ordering (CUDA)
---------------
Both directions share one engine; its ``d2h`` and ``h2d`` lanes each keep their own transfers in
order on their own stream, so the two directions overlap. A GPU -> CPU transfer waits for the work
issued on the current torch stream of the handlers' device *before* ``transfer_async`` was called
(``wait_stream=torch.cuda.current_stream(device)``), so the bytes offloaded are those the model
wrote; ``transfer_async`` itself never waits on the GPU. CPU -> GPU transfers do not wait for the
compute stream unless ``load_waits_for_compute=True`` (vLLM 0.33 asks it: a load must not overtake
zeroing of its destination blocks still queued on the compute stream); the connector consumes
their blocks only after ``get_finished`` reported them. The engine runs on the tensors' device whatever torch's current device is, and
calls leave torch's current device as they found it.

``import blockswap`` does not import this module (torch is optional): import
``blockswap.handler``.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Callable, cast

import numpy as np
import numpy.typing as npt

from . import _optional

try:
    import torch
except ModuleNotFoundError as e:
    _optional.missing(e, __name__)

from ._checks import check_bool, check_choice, check_int
from ._core import (
    BlockswapError,
    Route,
    ShutdownError,
    TransferResult,
    chunk_skip,
    stage_slot,
)
from ._direction import (
    BlockIds,
    KVCaches,
    SingleDirectionHandler,
    TransferSpec,
    _KeepDevice,
    _logging_poll,
)
from ._kvcache import (
    allocate_cpu_cache,
    as_groups,
    cpu_tables_of,
    device_of,
    given_cpu_cache,
    gpu_tables_of,
    keyed_like,
    layouts_of,
    union_spans,
)
from ._types import BackendName, CpuLayout, Direction, HandlerPath, LaneStats, MemoryKind
from .engine import Engine, _is_int
from .errors import ConfigError, ConfigTypeError, refuses_with_config_errors
from .hostmem import DEFAULT_PIECE_BYTES, PinnedRows
from .layout import BlockTable, Layout, expand_sub_blocks
from .routing import (
    KERNEL_BLOCK_BYTES,
    KERNEL_LAUNCH_BYTES,
    RouteUnavailableError,
    calibrate,
    choose_routes,
)

__all__ = [
    "BlockIds",
    "CpuGpuHandlers",
    "KVCaches",
    "SingleDirectionHandler",
    "TransferResult",
    "TransferSpec",
    "load_sub_blocks",
    "store_sub_blocks",
]

#: Route choices, calibration results, descriptor-building fallbacks, the CPU cache's
#: allocation and shutdowns that timed out (see :mod:`blockswap.engine`).
log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# Construction helpers
# --------------------------------------------------------------------------------------------


def _stream_handle(s: Any, device_index: int | None, what: str) -> int:
    if _is_int(s):
        return int(s)
    handle = getattr(s, "cuda_stream", None)
    if handle is None:
        raise ConfigTypeError(
            f"{what} must be a torch.cuda.Stream or a raw CUstream int, not {type(s).__name__}"
        )
    dev = getattr(s, "device", None)
    if device_index is not None and dev is not None and torch.device(dev).index != device_index:
        raise ConfigError(
            f"{what} is a stream of {dev}, but the KV cache is on cuda:{device_index}"
        )
    return int(handle)


def _host_pieces(pieces: Any) -> list[tuple[int, int]]:
    """``host_pieces`` of :class:`CpuGpuHandlers` checked: a list or tuple of ``(address,
    bytes)`` pairs of ints."""
    if not isinstance(pieces, (list, tuple)):
        raise ConfigTypeError(
            "host_pieces must be a list or tuple of (address, bytes) pairs, not "
            f"{type(pieces).__name__}"
        )
    out = []
    for i, piece in enumerate(pieces):
        if not isinstance(piece, (list, tuple)) or len(piece) != 2:
            raise ConfigTypeError(
                f"host_pieces[{i}] must be an (address, bytes) pair, not {piece!r:.60}"
            )
        a, n = piece
        out.append(
            (
                check_int(f"host_pieces[{i}] address", a, 0),
                check_int(f"host_pieces[{i}] bytes", n, 1),
            )
        )
    return out


# --------------------------------------------------------------------------------------------
# Both directions of one device
# --------------------------------------------------------------------------------------------


def prepare_directions(prepare: Any) -> tuple[Direction, ...]:
    """``prepare`` of :class:`CpuGpuHandlers` checked: distinct directions, each ``"d2h"`` or
    ``"h2d"``, in a list or tuple."""
    if isinstance(prepare, str) or not isinstance(prepare, (list, tuple)):
        raise ConfigTypeError(
            f"prepare must be a list or tuple of 'd2h' and 'h2d', not {type(prepare).__name__}"
        )
    out = cast(
        "tuple[Direction, ...]",
        tuple(check_choice("prepare's directions", d, ("d2h", "h2d")) for d in prepare),
    )
    if len(set(out)) != len(out):
        raise ConfigError(f"prepare names a direction twice: {list(out)}")
    return out


class CpuGpuHandlers:
    """A GPU -> CPU and a CPU -> GPU handler for the KV cache of one device, over one engine.

    ``gpu_caches``: the KV-cache tensors (see :data:`KVCaches`): a list of per-layer tensors, a
    dict of them, one cross-layer tensor, or a list of KV-cache groups (hybrid models). On the
    host backend, CPU tensors stand in for the GPU side.

    ``num_cpu_blocks``: CPU blocks per group, each of ``block_size_factor`` GPU-sized
    sub-blocks (vLLM: ``cpu_block_size // gpu_block_size``).

    ``layout``: the layout name of :mod:`blockswap.layout` (``"kv_split"``, ``"kv_fused"``,
    ``"cross_layer"``, ``"mla"``), one for all groups or one per group. The layers of one group
    must share one shape and dtype where the CPU cache is allocated here (with ``cpu_caches``
    given, only their number of blocks); any dtype works (bytes are bytes), pages may be padded.

    ``cpu_caches``: the CPU cache, in the structure of ``gpu_caches``; by default it is allocated
    here (block-major, :func:`~blockswap.layout.make_block_major_cpu_cache`; ``cpu_layout=
    "mirror"``: :func:`~blockswap.layout.make_cpu_cache_like`) and freed by :meth:`shutdown`. It is
    allocated by :class:`~blockswap.hostmem.PinnedRows`: exactly the bytes it holds, page-locked
    on CUDA in pieces of whole sub-blocks (mirror: whole pages) of at most ``pin_piece_bytes``
    (:data:`~blockswap.hostmem.DEFAULT_PIECE_BYTES`; one driver registration of 512 GiB or more
    fails), each piece registered with the engine as a region of its own: no copy crosses from one
    piece into the next. A given cache must match the GPU tensors (dtype, and shape except the
    block dim, which holds ``num_cpu_blocks * block_size_factor`` sub-blocks, its pages' dims
    laid out in memory in the same order) and, on CUDA, be pinned; it stays the caller's (memory
    of a :class:`~blockswap.hostmem.PinnedRows` is registered piece by piece too). Given as dicts
    on both sides (vLLM keys its caches by layer name), tensors pair by name.

    The handlers hold the tensors, and their memory as it was when they were built: a storage
    freed or moved in place while they live (``untyped_storage().resize_(0)``, as FSDP frees
    parameters; ``resize_`` past its size; ``set_``) leaves the engine copying where it no longer
    is. Shut the handlers down first. (Checking each storage at every transfer would cost the
    caller's thread about as much as the transfer's submission.)

    ``backend``: ``"auto"`` (CUDA when the GPU tensors are on a CUDA device and a driver is
    present, else the host backend), ``"cuda"`` or ``"host"``. On CUDA the engine runs on the
    tensors' device (whatever torch's current device is).

    ``copy_streams``: CUDA streams the copies run on instead of the engine's own: one stream for
    both directions, or a ``{"h2d": stream, "d2h": stream}`` mapping (either key may be left
    out); ``torch.cuda.Stream`` objects (kept alive here) or raw ``CUstream`` ints.

    ``path``, ``kernel_ctas``, ``kernel_below``, ``kernel_launch_bytes``: the copy path per
    direction, chosen here once by the core's rule (``handlers.routes`` says what was chosen and
    why): ``"auto"``, or one of ``"blocks"``, ``"staged"``, ``"dma"`` and ``"kernel"`` insisted
    on; docs/tuning.md ("path", "The plans in detail") says which plan ``"auto"`` takes where,
    and why. The staged plan moves a block's row through a device staging ring of two
    ``stage_bytes`` slots (an engine option; by default :data:`~blockswap.routing.STAGE_BYTES`,
    grown to one block's row up to :data:`~blockswap.routing.STAGE_MAX_AUTO`).
    ``kernel_launch_bytes`` bounds what one launch of a copy kernel moves, and so how long it
    holds its SMs from the model (:data:`~blockswap.routing.KERNEL_LAUNCH_BYTES`; ``None``: one
    launch per transfer, the most bandwidth). A path that cannot run in this process is refused
    here with :class:`~blockswap.routing.RouteUnavailableError` naming it and why (``"kernel"``
    without a GPU, unless Triton's interpreter runs the kernel: ``TRITON_INTERPRET=1``);
    ``"auto"`` and ``calibrate=True`` use and measure only the routes that can.

    ``prepare``: the directions whose staging resources (on CUDA the ring's two slots in device
    memory, a stream and events) are made here, where the staged plan is their route, rather than
    by their first transfer, which would wait for them: 0.3-0.7 ms on an H200, a fresh engine's
    first staged transfer each way (each direction's issuing thread starts with the engine). Both
    by default; ``()`` leaves them to the first transfers (the vLLM worker's engine of expedited
    loads prepares ``("h2d",)``, the only way it moves).

    ``load_waits_for_compute``: CPU -> GPU transfers also wait for the work issued on the current
    torch stream before ``transfer_async`` (as GPU -> CPU ones always do): vLLM 0.33's rule, for
    loads into blocks a kernel may still be writing (zeroing). Off by default.

    ``host_pieces``: with ``cpu_caches`` given, the ``(address, bytes)`` ranges of host memory
    registered with the engine, one region each, instead of the CPU tables' spans: memory the
    caller page-locked in pieces (vLLM's shared offload region), which no copy may cross from one
    into the next. Every CPU table must lie in them.

    ``engine_options``: more options of :class:`~blockswap.Engine` (``max_in_flight``,
    ``pool_bytes``, ``copy_path``, ``timing``, ...).

    Construction validates everything, builds the block tables once and registers the GPU tensors
    as ``"device"`` memory and the CPU cache as ``"host"`` memory. Every error it raises is a
    :class:`~blockswap.BlockswapError`: a bad argument is a :class:`~blockswap.errors.ConfigError`
    (a ``ValueError``; :class:`~blockswap.layout.LayoutError` for tensors that do not fit their
    layout) or a :class:`~blockswap.errors.ConfigTypeError` (a ``TypeError``).
    """

    @refuses_with_config_errors
    def __init__(
        self,
        gpu_caches: KVCaches,
        num_cpu_blocks: int,
        *,
        layout: Layout | Sequence[Layout],
        block_size_factor: int = 1,
        cpu_caches: KVCaches | None = None,
        backend: BackendName = "auto",
        copy_streams: Any = None,
        path: HandlerPath = "auto",
        kernel_ctas: int = 16,
        kernel_below: int | None = None,
        kernel_launch_bytes: int | None = KERNEL_LAUNCH_BYTES,
        calibrate: bool = False,
        cpu_layout: CpuLayout = "block_major",
        load_waits_for_compute: bool = False,
        prepare: Sequence[str] = ("d2h", "h2d"),
        pin_piece_bytes: int = DEFAULT_PIECE_BYTES,
        host_pieces: Sequence[tuple[int, int]] | None = None,
        **engine_options: Any,
    ) -> None:
        self._lock = threading.Lock()
        check_choice("path", path, ("auto", "blocks", "staged", "dma", "kernel"))
        check_bool("calibrate", calibrate)
        self._shut = False
        check_int("num_cpu_blocks", num_cpu_blocks, 1)
        check_bool("load_waits_for_compute", load_waits_for_compute)
        prepared = prepare_directions(prepare)
        check_int("block_size_factor", block_size_factor, 1)
        for key in ("device", "h2d_stream", "d2h_stream"):
            if key in engine_options:
                raise ConfigTypeError(
                    f"{key!r} is set by CpuGpuHandlers (the tensors' device; copy_streams=)"
                )
        self.num_cpu_blocks = int(num_cpu_blocks)
        self.block_size_factor = f = int(block_size_factor)

        gpu_groups, grouped = as_groups(gpu_caches, "gpu_caches")
        ng = len(gpu_groups)
        if calibrate and ng != 1:
            # The page sizes of several groups are several size classes: one route each.
            raise ConfigError("calibrate=True needs a single KV-cache group")
        if calibrate and cpu_caches is not None:
            raise ConfigError(
                "calibrate=True moves blocks through the CPU cache's first blocks, which would "
                "overwrite what cpu_caches holds: calibrate handlers that allocate their own "
                "(no cpu_caches; handlers.calibration says what each direction chose), then "
                "give handlers over your cache that path="
            )
        layouts = layouts_of(layout, ng)

        device, resolved, device_index = device_of(gpu_groups, backend)
        on_cuda = resolved == "cuda"
        self.device = device
        #: The backend in use: ``"cuda"`` or ``"host"``.
        self.backend: str = resolved

        # GPU tables (validate layouts; layers of one shape where the CPU cache is made here).
        gpu_tables = gpu_tables_of(gpu_groups, layouts, uniform=cpu_caches is None)

        # CPU cache: allocated here, or the caller's, checked against the GPU tensors.
        #: The block-major CPU cache, one ``(num_cpu_blocks * block_size_factor, pages, page
        #: elements)`` tensor per group (see :func:`~blockswap.layout.make_block_major_cpu_cache`),
        #: where it was allocated here block-major; ``cpu_caches`` are per-layer views into it.
        self.cpu_chunks: list[torch.Tensor] | None = None
        check_choice("cpu_layout", cpu_layout, ("block_major", "mirror"))
        check_int("pin_piece_bytes", pin_piece_bytes, 1)
        #: The host memory of the CPU cache allocated here, unpinned by :meth:`shutdown`.
        self._host_memory: list[PinnedRows] = []
        if cpu_caches is None:
            self.cpu_chunks, cpu_groups = allocate_cpu_cache(
                gpu_groups,
                layouts,
                self.num_cpu_blocks,
                f,
                self._host_memory,
                cpu_layout=cpu_layout,
                pin_piece_bytes=pin_piece_bytes,
                on_cuda=on_cuda,
                device_index=device_index,
            )
        else:
            cpu_groups = given_cpu_cache(
                keyed_like(cpu_caches, gpu_caches),
                gpu_groups,
                grouped,
                layouts,
                self.num_cpu_blocks,
                f,
                on_cuda and host_pieces is None,
            )
        cpu_tables = cpu_tables_of(cpu_groups, layouts)
        if host_pieces is None:
            host_spans = union_spans(cpu_tables)
        elif cpu_caches is None:
            raise ConfigError("host_pieces describes a given CPU cache: pass cpu_caches too")
        else:
            host_spans = _host_pieces(host_pieces)

        # Streams and the engine.
        self._streams: list[Any] = []
        options = dict(engine_options)
        if copy_streams is not None:
            if not on_cuda:
                raise ConfigError("copy_streams needs the CUDA backend")
            if isinstance(copy_streams, Mapping):
                unknown = set(copy_streams) - {"h2d", "d2h"}
                if unknown:
                    raise ConfigError(f"copy_streams keys must be 'h2d' / 'd2h', not {unknown}")
                per = dict(copy_streams)
            else:
                per = {"h2d": copy_streams, "d2h": copy_streams}
            for key, s in per.items():
                if s is not None:
                    options[f"{key}_stream"] = _stream_handle(
                        s, device_index, f"copy_streams[{key!r}]"
                    )
                    self._streams.append(s)
        if "stage_bytes" not in options:
            # A staging slot holds at least one block's row, up to a bound (the core's rule).
            options["stage_bytes"] = stage_slot(max(int(t.nbytes.sum()) for t in gpu_tables))
        if on_cuda:
            options["device"] = device_index
        self._device_index = device_index
        #: The kernel route's bounds as given: calibration's candidates are built with them too,
        #: since the one it keeps serves.
        self._kernel_bounds = (kernel_below, kernel_launch_bytes)
        with _KeepDevice(device_index):
            self.engine = core = Engine("cuda" if on_cuda else "host", **options)
            #: What the engine's copies reach, registered by address below: held by the engine
            #: too, so that handlers collected while their transfers run (a caller keeping only
            #: ``get_finished``) do not free it under the copies; let go by a shutdown that
            #: drained.
            self._owned: list[Any] = [gpu_groups, cpu_groups, gpu_tables, cpu_tables]
            core._hold(self._owned)
            #: What was registered with the engine, in order, as the call that undoes each:
            #: undone last to first (tables before the regions they lie in) by shutdown and by
            #: a refused construction.
            self._undo: list[tuple[Callable[[int], None], int]] = []
            try:
                kinds: list[tuple[Iterable[tuple[int, int]], MemoryKind]] = [
                    (union_spans(gpu_tables), "device"),
                    (host_spans, "host"),
                ]
                for spans, kind in kinds:
                    for a, n in spans:
                        self._undo.append((core.unregister, core.register(a, n, kind)))
                # Per group, the GPU and the CPU table in the core, which maps block ids to
                # copies (see transfer_async); checked once against the memory registered above.
                # The CPU table counts sub-blocks, block_size_factor to a CPU block.
                self._table_ids: list[tuple[int, int]] = []
                for gt, ct in zip(gpu_tables, cpu_tables):
                    g = core.register_table(*gt.geometry(), "device", "GPU", 1)
                    self._undo.append((core.unregister_table, g))
                    c = core.register_table(*ct.geometry(), "host", "CPU", f)
                    self._undo.append((core.unregister_table, c))
                    self._table_ids.append((g, c))
            except BaseException:
                self._refused()
                raise

        self._gpu_caches: list[list[torch.Tensor]] | None = gpu_groups
        self._cpu_caches: list[list[torch.Tensor]] | None = cpu_groups
        self.gpu_tables: list[BlockTable] = gpu_tables
        self.cpu_tables: list[BlockTable] = cpu_tables
        self.num_groups = ng
        self.layouts = layouts

        wait_stream: Callable[[], int] | None = None
        if on_cuda:
            assert device_index is not None
            raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
            idx = device_index
            if raw is not None:
                wait_stream = lambda: raw(idx)  # noqa: E731
            else:  # pragma: no cover - older torch
                wait_stream = lambda: torch.cuda.current_stream(idx).cuda_stream  # noqa: E731
        tids = self._table_ids
        #: The compiled copy kernels the core launches (staged plan, kernel route), kept loaded
        #: while the engine may launch them; each loaded once, for the routes and calibration.
        self._kernels: list[dict[str, Any]] = []
        self._owned.append(self._kernels)
        self._load = functools.cache(self._load_kernel)
        # Path selection, once, here: which plan, and which descriptors a copy kernel moves.
        try:
            #: The block plan of each direction, per KV-cache group
            #: (:meth:`blockswap.Engine.block_runs`: one ``(first page, pages, page bytes, source
            #: pitch, destination pitch)`` per 2-D copy of a block), None for a group whose
            #: geometry gives none.
            self.block_plans: dict[str, list[list[tuple[int, int, int, int, int]] | None]] = {
                "d2h": [self.engine.block_runs(gt, ct, "d2h") for gt, ct in tids],
                "h2d": [self.engine.block_runs(ct, gt, "h2d") for gt, ct in tids],
            }
            self.routes: dict[str, Route] = choose_routes(
                self.engine,
                tids,
                gpu_tables,
                self._load,
                path=path,
                on_cuda=on_cuda,
                device_index=device_index,
                kernel_ctas=kernel_ctas,
                kernel_below=kernel_below,
                launch_bytes=kernel_launch_bytes,
            )
            for d in prepared:
                if self.routes[d].plan in ("staged", "direct"):
                    self.engine.prepare_staged(d, ring=self.routes[d].plan == "staged")
        except BaseException:
            # A path that cannot run here, or that the geometry gives no plan for, or a ring
            # the device cannot hold: the engine started above does not outlive the refused
            # construction.
            with _KeepDevice(device_index):
                self._refused()
            raise
        self.gpu_to_cpu_handler = SingleDirectionHandler(
            self, "d2h", tids, wait_stream, device_index, self.routes["d2h"]
        )
        self.cpu_to_gpu_handler = SingleDirectionHandler(
            self,
            "h2d",
            tids,
            wait_stream if load_waits_for_compute else None,
            device_index,
            self.routes["h2d"],
        )
        self.get_finished = _logging_poll(self.engine.get_finished)
        #: Set by a :meth:`shutdown` that could not release the memory (transfers still in flight
        #: after ``shutdown_timeout``): it is kept alive, and so must be the caller's.
        self.memory_kept = False
        self.calibration: dict[str, dict[str, Any]] | None = None
        if calibrate:
            try:
                self.calibration = self._calibrate(kernel_ctas)
            except BaseException:
                # Refused (a plan the limits given cannot hold) or interrupted: the engine, its
                # registrations and the CPU cache allocated here go with the construction.
                self.shutdown()
                raise

    # ---- construction helpers ------------------------------------------------------------------

    def _load_kernel(
        self, device_index: int | None, max_size: int, ctas: int, *, staged: bool = False
    ) -> tuple[int | None, str]:
        """The copy kernel for pages of at most ``max_size`` bytes on ``ctas`` CTAs (the page
        kernel, or with ``staged`` the staged plan's), compiled and loaded into the core (and
        kept alive with the handlers): ``(id, "")``, or ``(None, why not)`` where the core
        cannot launch it."""
        from .kernels import core_kernel

        try:
            k = core_kernel(
                device_index or 0,
                max_size=max_size,
                staged=staged,
                max_ctas=ctas,
                block_bytes=KERNEL_BLOCK_BYTES,
            )
            kid = None if k is None else self.engine.load_kernel(k)
        except (BlockswapError, RuntimeError) as e:
            return None, f"the core cannot launch the copy kernel: {e}"
        if kid is None:
            return None, "the copy kernel's build needs scratch memory the core does not pass"
        assert k is not None
        self._kernels.append(k)
        return kid, ""

    # ---- the API ----------------------------------------------------------------------------------

    @property
    def d2h(self) -> SingleDirectionHandler:
        """Alias of :attr:`gpu_to_cpu_handler`."""
        return self.gpu_to_cpu_handler

    @property
    def h2d(self) -> SingleDirectionHandler:
        """Alias of :attr:`cpu_to_gpu_handler`."""
        return self.cpu_to_gpu_handler

    @property
    def handlers(self) -> tuple[SingleDirectionHandler, SingleDirectionHandler]:
        """``(gpu_to_cpu_handler, cpu_to_gpu_handler)``."""
        return self.gpu_to_cpu_handler, self.cpu_to_gpu_handler

    @property
    def is_shut_down(self) -> bool:
        return self._shut

    @property
    def cpu_caches(self) -> list[list[torch.Tensor]]:
        """The CPU cache, one list of tensors per KV-cache group (even for one group)."""
        if self._cpu_caches is None:
            raise ShutdownError("the offloading handlers are shut down: the CPU cache is freed")
        return self._cpu_caches

    @property
    def host_memory(self) -> tuple[PinnedRows, ...]:
        """The host memory of the CPU cache allocated here (one
        :class:`~blockswap.hostmem.PinnedRows` per group, or per layer tensor of a mirrored
        cache), with its pieces; empty where the cache is the caller's or after
        :meth:`shutdown`."""
        return tuple(self._host_memory)

    @property
    def gpu_caches(self) -> list[list[torch.Tensor]]:
        """The GPU tensors, one list per KV-cache group (even for one group)."""
        if self._gpu_caches is None:
            raise ShutdownError("the offloading handlers are shut down")
        return self._gpu_caches

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> None:
        """Blocks until the listed transfers (either direction) finished; see
        :meth:`SingleDirectionHandler.wait`."""
        self.gpu_to_cpu_handler.wait(job_ids, timeout)

    def stats(self) -> dict[str, LaneStats]:
        """Per-direction totals: ``{"d2h": {...}, "h2d": {...}}`` with ``transfers``, ``failed``,
        ``bytes``, ``seconds``, ``gb_per_s``."""
        s = self.engine.stats()
        return {"d2h": s["d2h"].copy(), "h2d": s["h2d"].copy()}

    def _insisted(self, path: str, direction: str, kernel_ctas: int) -> Route | None:
        """The route ``path`` insists on in ``direction`` where the core's rule gives it to this
        cache here, else None (with why logged): a candidate for calibration."""
        try:
            return choose_routes(
                self.engine,
                self._table_ids,
                self.gpu_tables,
                self._load,
                path=path,
                on_cuda=self.backend == "cuda",
                device_index=self._device_index,
                kernel_ctas=kernel_ctas,
                kernel_below=self._kernel_bounds[0],
                launch_bytes=self._kernel_bounds[1],
                directions=(direction,),
            )[direction]
        except (ConfigError, RouteUnavailableError) as e:
            log.info("calibration leaves path=%r out: %s", path, e)
            return None

    def _calibrate(self, kernel_ctas: int, reps: int = 5) -> dict[str, dict[str, Any]]:
        """Measures the routes this cache can take on this machine, per direction, and keeps the
        fastest (:func:`~blockswap.routing.calibrate`): other GPUs, links and drivers need other
        choices than the built-in ones. One KV-cache group, and a CPU cache of the handlers' own
        (both checked when the handlers are built)."""
        return calibrate(
            self.handlers,
            self.routes,
            lambda path, direction: self._insisted(path, direction, kernel_ctas),
            self.gpu_tables[0],
            num_cpu_blocks=self.num_cpu_blocks,
            block_size_factor=self.block_size_factor,
            get_finished=self.get_finished,
            reps=reps,
        )

    def _refused(self) -> None:
        """A refused construction's engine shut down, and what was registered with it undone
        (nothing is in flight): host memory the caller gave is free to unpin."""
        self.engine.shutdown()
        if not self._unregister_all():
            self._unpin_host_memory()
            self._owned.clear()  # the engine holds this list: nothing of it now

    def _unpin_host_memory(self) -> None:
        """Lets the driver go of the CPU cache allocated here, where no registration of this
        engine reaches it any more (unless another engine was given it too; then the last user
        does)."""
        for buf in self._host_memory:
            try:
                buf.unpin()
            except BlockswapError as e:
                log.info("CPU cache kept pinned: %s", e)
        self._host_memory = []

    def _unregister_all(self) -> list[str]:
        """Undoes every registration with the engine, the last first (a region is refused while
        a table lies in it); returns why each refused one was refused."""
        failed = []
        for undo, what in reversed(self._undo):
            try:
                undo(what)
            except BlockswapError as e:
                failed.append(str(e))
        self._undo = []
        return failed

    def shutdown(self) -> None:
        """Drains the transfers in flight (both directions), then unregisters the memory and frees
        the CPU cache allocated here (unpinned at once; unmapped once no tensor views it), exactly
        once: a second call is a no-op. Results of every transfer, including those in flight at
        the call, are still returned by ``get_finished``; ``transfer_async`` raises
        :class:`~blockswap.ShutdownError` afterwards."""
        with self._lock:
            if self._shut:
                return
            self._shut = True
            self.gpu_to_cpu_handler._closed = True
            self.cpu_to_gpu_handler._closed = True
            with _KeepDevice(self._device_index):
                self.engine.shutdown()  # waits for every transfer in flight
                failed = self._unregister_all()
                self._table_ids = []
            if failed:
                # Copies may still touch the memory (shutdown timed out): keep it alive rather
                # than free memory a copy could write.
                log.warning(
                    "transfers still in flight after shutdown (shutdown_timeout): the KV-cache "
                    "memory is kept allocated (%s)",
                    failed[0],
                )
                _leaked.append(
                    (self._gpu_caches, self._cpu_caches, self.gpu_tables, self.cpu_tables)
                )
                self.memory_kept = True
            else:
                self._unpin_host_memory()
                self._owned.clear()  # the engine holds this list: nothing of it now
            self._host_memory = []
            self.cpu_chunks = None
            self.gpu_tables = []
            self.cpu_tables = []
            self._gpu_caches = None
            self._cpu_caches = None  # frees the CPU cache allocated here
            self._streams = []

    def __enter__(self) -> CpuGpuHandlers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return (
            f"CpuGpuHandlers(device={self.device}, backend={self.backend!r}, "
            f"groups={self.num_groups}, num_cpu_blocks={self.num_cpu_blocks}, "
            f"block_size_factor={self.block_size_factor}"
            f"{', shut down' if self._shut else ''})"
        )


_leaked: list[Any] = []
"""Memory a timed-out shutdown could not release safely (kept alive for the process)."""


def store_sub_blocks(
    cpu_block_ids: Any,
    num_gpu_blocks: int,
    block_size_factor: int,
    block_index: int | None = None,
) -> npt.NDArray[np.int64]:
    """The CPU sub-block ids a GPU -> CPU transfer of ``num_gpu_blocks`` blocks into
    ``cpu_block_ids`` writes, in GPU-block order: start-aligned, or from ``block_index %
    block_size_factor`` (see the module's documentation)."""
    return _sub_blocks(cpu_block_ids, num_gpu_blocks, block_size_factor, block_index, True)


def load_sub_blocks(
    cpu_block_ids: Any,
    num_gpu_blocks: int,
    block_size_factor: int,
    block_index: int | None = None,
) -> npt.NDArray[np.int64]:
    """The CPU sub-block ids a CPU -> GPU transfer of ``num_gpu_blocks`` blocks from
    ``cpu_block_ids`` reads, in GPU-block order: end-aligned (``skip = (-n) % f``), or from
    ``block_index % block_size_factor``."""
    return _sub_blocks(cpu_block_ids, num_gpu_blocks, block_size_factor, block_index, False)


def _sub_blocks(
    cpu_block_ids: Any, n: Any, factor: Any, block_index: Any, store: bool
) -> npt.NDArray[np.int64]:
    """:func:`store_sub_blocks` (``store``) or :func:`load_sub_blocks`, the counts checked first
    (the core's ``chunk_skip`` takes unsigned ints: a negative one raised ``OverflowError``)."""
    n = check_int("num_gpu_blocks", n, 0)
    f = check_int("block_size_factor", factor, 1)
    block_index = check_int("block_index", block_index, 0, optional=True)
    skip = chunk_skip(f, n, block_index, store)
    return expand_sub_blocks(cpu_block_ids, f, skip, n)
