"""Weight offloading: keep chosen layers' parameters in pinned host memory and stream them into
static GPU slots just before the layers run (after vLLM's prefetch offloader, PR 29941).

Three offloaders share one interface (``sync_prev_onload``, ``join_after_forward``, ``close``):

* :class:`PrefetchOffloader` -- the parameters of the chosen layers live in one pinned host
  buffer. ``prefetch_step`` static GPU *slots* hold the layers currently on the device; each
  offloaded parameter's ``.data`` points into a slot, so the model only ever sees fixed
  addresses. Layer ``k`` (in offload order) uses slot ``k % prefetch_step``. After offloaded
  layer ``k`` has run, the next layer that uses its slot is copied in on a copy stream with ONE
  blockswap batched submission (``Engine.submit`` of all of that layer's tensors): layer
  ``k + prefetch_step``, or, for the last ``prefetch_step`` layers, the first layers of the next
  forward. With ``synchronous=True`` each layer is instead copied in right before it runs and
  waited for at once (no overlap: the baseline prefetching is measured against).
* :class:`ZeroCopyOffloader` -- the layers read their weights straight from pinned host memory
  over PCIe (unified addressing); nothing is copied, every forward pays the link.
* :class:`NoopOffloader` -- does nothing; the default of :func:`get_offloader`.

Layer selection (``group_size``, ``num_in_group``): layer ``i`` is offloaded when
``i % group_size >= group_size - num_in_group`` (the last ``num_in_group`` of every group), and
it has at least one parameter matching ``params``: dotted name segments such as
``"w13_weight"`` or ``"mlp.w2"``; a name matches when ``".{segment}."`` occurs in
``".{name}."``. Without ``params`` every parameter of a chosen layer is offloaded.

Each offloaded layer gets an instance-level ``forward`` that wraps its own: a pre-step (wait for
the layer's weights), the layer, a post-step (release its slot, start the next copy into it).
Not ``register_forward_pre_hook`` / ``register_forward_hook``: Dynamo does not guard on module
hooks (``torch._dynamo.config.skip_nnmodule_hook_guards`` defaults to True), so code compiled
before hooks were added -- the same model, or another instance of its class -- would silently
run without them; an instance ``forward`` is guarded on. Forward hooks a user registers on an
offloaded layer run outside the wrapper, before the wait and after the release: they must not
read the offloaded weights.

Ordering (stream semantics, eager)
----------------------------------
* The copy of a layer into slot ``s`` waits (``copy_stream.wait_event``) for an event recorded
  on the compute stream right after the forward of the slot's previous occupant: no copy
  overwrites weights a kernel still reads.
* The pre-step of layer ``k`` makes the compute stream wait for an event recorded on the copy
  stream right after layer ``k``'s submission. The engine's host-to-device lane runs on the
  offloader's torch copy stream (``Engine(h2d_stream=copy_stream.cuda_stream)``), and
  ``Engine.submit`` enqueues the copies before it returns, so torch events recorded on that
  stream order against blockswap's copies.

CUDA graphs
-----------
``cuMemcpyBatchAsync`` cannot be captured, and nothing may poll the engine while a capture is
in progress. Under capture a layer is copied in with ``Tensor.copy_(non_blocking=True)`` from
the pinned buffer on the copy stream, one copy per contiguous run of the layer's tensors (host
and slot layouts mirror each other, so that is one copy per layer in the usual case). Each is
captured as a memcpy node that runs on the copy engines at link speed and takes no SMs; the
Triton copy kernel (``blockswap.kernels.copy``) would also be capturable, but it takes SMs from
the model's kernels and reaches no more than the DMA path for multi-megabyte tensors. The
copy stream joins the capture through an event recorded on the capturing stream (the same fork
that orders the copy after the slot's previous reader); the pre-steps wait on copy events
recorded inside the capture; copies started before the capture are not waited on inside it.
A model runner calls:

* :meth:`~PrefetchOffloader.sync_prev_onload` before a capture and before each replay: the
  current stream waits for every onload issued so far (outside a capture; inside one it does
  nothing, as pre-capture work cannot be part of the graph);
* :meth:`~PrefetchOffloader.join_after_forward` after the forward, before the capture ends: the
  capturing stream waits for the prefetches started during the capture (the next forward's
  first layers), which CUDA requires of every stream that joined a capture.

A replayed graph ends with the first ``prefetch_step`` layers in their slots, as an eager forward
does, so eager forwards and replays can be mixed on one stream. The pinned buffer must outlive
every graph captured with it (do not :meth:`close` while such graphs may be replayed).

torch.compile
-------------
The wrapper calls two custom ops (``torch.ops.blockswap.offload_wait`` and
``torch.ops.blockswap.offload_done``, ``torch.library.custom_op`` with fake implementations)
while Dynamo traces, and the Python methods directly in eager mode. Each op declares the
layer's input (``offload_wait``) or output (``offload_done``) as mutated: the compiler can then
neither move the layer's kernels above the wait, nor the prefetch above the layer's kernels,
nor the next layer's kernels above the prefetch. Computations that read only weights (not the
layer's input) are not ordered by this; no such op runs in the layers this targets (linear
layers, MoE experts), and a model that precomputes from weights must keep that out of the
offloaded layers' compiled region.

Zero-copy route
---------------
A pinned CPU tensor cannot be handed to CUDA kernels in torch (it stays a CPU tensor), and torch
2.x has no public helper that views pinned memory as a CUDA tensor (vLLM ships its own C++ op
for that). The route used here needs no extension: the pinned buffer comes from
``Engine.alloc_host`` (``cuMemHostAlloc`` with ``DEVICEMAP``), its device address from
``cuMemHostGetDevicePointer`` (the same address under UVA), and ``torch.as_tensor`` of an object
exposing ``__cuda_array_interface__`` over that address gives a CUDA tensor that does not own
the memory (torch keeps the object alive, and the object keeps the engine that owns the buffer
alive). The view is checked to be on the device at that exact address, else construction fails.

CPU test mode
-------------
Parameters on the CPU select the host backend (``Engine("host")``): CPU tensors stand in for the
slots (registered as ``"device"`` memory), and streams and events are replaced by a small
interface that waits for the host engine's jobs where CUDA would wait for an event, keeps a
trace, and emulates the capture rules (:meth:`PrefetchOffloader.emulate_capture`). Everything
else -- selection, slot assignment, validation, the wrappers, submissions -- is the code the GPU
runs.

Every configuration error is an :class:`OffloadConfigError` (a ``ValueError`` and a
:class:`~blockswap.BlockswapError`), raised before anything is changed: a failed construction
leaves the model as it was.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import _optional

try:
    import torch
    from torch import nn
except ModuleNotFoundError as e:
    _optional.missing(e, __name__)

from ._core import BlockswapError
from .engine import Engine
from .engine import info as _blockswap_info

__all__ = [
    "BaseOffloader",
    "NoopOffloader",
    "OffloadConfigError",
    "OffloadDeviceError",
    "PrefetchOffloader",
    "WeightTransferError",
    "ZeroCopyOffloader",
    "create_offloader",
    "get_offloader",
    "matches_segment",
    "select_layers",
    "set_offloader",
]

# Byte alignment of every tensor in the pinned buffer and in a slot.
_ALIGN = 512
# Attribute set on each offloaded module (refuses a second offloader on the same layer).
_MARK = "_blockswap_offloader"
# A module without an instance-level forward before the offloader wrapped it.
_NO_FORWARD = object()


class OffloadConfigError(BlockswapError, ValueError):
    """A configuration the offloader refuses (raised before the model is changed)."""


class OffloadDeviceError(OffloadConfigError):
    """Tensors on the wrong device, or a device the offloader cannot use."""


class WeightTransferError(BlockswapError):
    """An onload of a layer's weights failed; the layer's slot holds unknown data."""


# --------------------------------------------------------------------------------------------
# Selection
# --------------------------------------------------------------------------------------------


def _check_int(name: str, value: Any, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise OffloadConfigError(f"{name} must be an int, not {value!r}")
    if value < lo:
        raise OffloadConfigError(f"{name} must be at least {lo}, not {value}")
    return int(value)


def _check_group(group_size: Any, num_in_group: Any) -> tuple[int, int]:
    g = _check_int("group_size", group_size, 1)
    m = _check_int("num_in_group", num_in_group, 1)
    if m > g:
        raise OffloadConfigError(
            f"num_in_group ({m}) is larger than group_size ({g}): a group of {g} layers "
            f"cannot offload {m}"
        )
    return g, m


def select_layers(num_layers: int, group_size: int, num_in_group: int) -> list[int]:
    """Indices of the layers chosen for offloading: the last ``num_in_group`` of every group of
    ``group_size``, i.e. ``i % group_size >= group_size - num_in_group``."""
    n = _check_int("num_layers", num_layers, 0)
    g, m = _check_group(group_size, num_in_group)
    return [i for i in range(n) if i % g >= g - m]


def matches_segment(name: str, segment: str) -> bool:
    """Whether the dotted parameter ``name`` contains ``segment`` as whole dotted segments."""
    return f".{segment}." in f".{name}."


def _segments(params: Any) -> list[str]:
    if params is None:
        return []
    items = [params] if isinstance(params, str) else list(params)
    out = []
    for s in items:
        if not isinstance(s, str) or not s.strip("."):
            raise OffloadConfigError(f"parameter name segments must be non-empty strings: {s!r}")
        out.append(s.strip("."))
    return out


# --------------------------------------------------------------------------------------------
# Planning: everything is validated and laid out before anything is changed
# --------------------------------------------------------------------------------------------


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _is_dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill exactly ``numel`` consecutive elements of its storage."""
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride()) if s != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 view of a dense tensor's bytes."""
    flat = torch.as_strided(t, (t.numel(),), (1,), t.storage_offset())
    return flat.view(torch.uint8)


def _typed_view(buf: torch.Tensor, off: int, t: _TensorPlan) -> torch.Tensor:
    """The tensor of ``t``'s shape, stride and dtype at byte ``off`` of the uint8 buffer ``buf``."""
    typed = buf.view(t.dtype)
    return torch.as_strided(typed, t.shape, t.stride, off // t.itemsize)


@dataclass
class _TensorPlan:
    name: str
    param: nn.Parameter
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    itemsize: int
    nbytes: int
    key: tuple[Any, ...] = ()
    host_off: int = 0
    slot_off: int = 0

    @property
    def span(self) -> int:
        return _align(self.nbytes)


@dataclass
class _LayerPlan:
    index: int  # position in `layers`
    k: int  # offload order
    module: nn.Module
    tensors: list[_TensorPlan]
    # Contiguous (host offset, slot offset, bytes) runs, in host order.
    runs: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass
class _Plan:
    layers: list[nn.Module]
    offloaded: list[_LayerPlan]
    device: torch.device
    slot_bytes: int
    host_bytes: int
    keys: dict[tuple[Any, ...], int]


def _resolve_device(device: Any, tensors: Sequence[tuple[str, torch.Tensor]]) -> torch.device:
    if device is None:
        dev = tensors[0][1].device
    else:
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise OffloadDeviceError(f"device {device!r} is not a torch device: {e}") from None
    if dev.type not in ("cuda", "cpu"):
        raise OffloadDeviceError(
            f"offloading needs the weights on a CUDA device (or on the CPU, the host test "
            f"mode), not on {dev}"
        )
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise OffloadDeviceError(f"device {dev} requested, but torch sees no CUDA device")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    for name, t in tensors:
        if t.device != dev:
            raise OffloadDeviceError(
                f"parameter {name!r} is on {t.device}, but the offloaded weights must all be "
                f"on {dev}"
            )
    if dev.type == "cuda":
        status = _blockswap_info()
        if not status["cuda"]:
            raise OffloadDeviceError(
                f"blockswap cannot use CUDA here ({status['cuda_status']}), so weights on {dev} "
                "cannot be offloaded"
            )
    return dev


def _make_plan(
    layers: Any,
    group_size: Any,
    num_in_group: Any,
    params: Any,
    device: Any,
) -> _Plan:
    if isinstance(layers, nn.Module) and not isinstance(layers, (nn.ModuleList, nn.Sequential)):
        raise OffloadConfigError(
            "layers must be a sequence of modules (e.g. an nn.ModuleList), not a single "
            f"{type(layers).__name__}"
        )
    try:
        mods = list(layers)
    except TypeError:
        raise OffloadConfigError(
            f"layers must be a sequence of nn.Module, not {type(layers).__name__}"
        ) from None
    if not mods:
        raise OffloadConfigError("layers is empty: there is nothing to offload")
    seen: dict[int, int] = {}
    for i, m in enumerate(mods):
        if not isinstance(m, nn.Module):
            raise OffloadConfigError(f"layers[{i}] is a {type(m).__name__}, not an nn.Module")
        if id(m) in seen:
            raise OffloadConfigError(f"layers[{i}] is the same module as layers[{seen[id(m)]}]")
        seen[id(m)] = i
    g, m_in = _check_group(group_size, num_in_group)
    segs = _segments(params)
    chosen = select_layers(len(mods), g, m_in)
    for i in chosen:
        if getattr(mods[i], _MARK, None) is not None:
            raise OffloadConfigError(f"layers[{i}] is already offloaded by another offloader")

    # Where every parameter of every layer appears (tied weights are refused when offloaded).
    owners: dict[int, list[str]] = {}
    for i, mod in enumerate(mods):
        for name, p in mod.named_parameters(remove_duplicate=False):
            owners.setdefault(id(p), []).append(f"layers[{i}].{name}")

    hits = dict.fromkeys(segs, 0)
    picked: list[tuple[int, list[tuple[str, nn.Parameter]]]] = []
    for i in chosen:
        sel = []
        for name, p in mods[i].named_parameters(remove_duplicate=False):
            matched = [s for s in segs if matches_segment(name, s)]
            for s in matched:
                hits[s] += 1
            if (matched or not segs) and p.numel() > 0:
                sel.append((name, p))
        if sel:
            picked.append((i, sel))
    missing = [s for s, c in hits.items() if c == 0]
    if missing:
        names = sorted({n for i in chosen for n, _ in mods[i].named_parameters()})
        shown = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
        raise OffloadConfigError(
            f"parameter name segment(s) {missing} match no parameter of the selected layers "
            f"{chosen[:8]}{'...' if len(chosen) > 8 else ''} (their parameters: {shown or 'none'})"
        )
    if not picked:
        raise OffloadConfigError(
            f"nothing to offload: group_size={g}, num_in_group={m_in} select layers "
            f"{chosen} of {len(mods)}, and none of them has a parameter to offload"
        )

    flat = [(f"layers[{i}].{n}", p) for i, sel in picked for n, p in sel]
    for qual, p in flat:
        where = owners[id(p)]
        if len(where) > 1:
            raise OffloadConfigError(
                f"parameter {qual} is shared ({', '.join(where)}): a tied weight cannot be "
                "offloaded"
            )
    dev = _resolve_device(device, flat)
    for qual, p in flat:
        if not _is_dense(p.data):
            raise OffloadConfigError(
                f"parameter {qual} (shape {tuple(p.shape)}, stride {p.stride()}) is not dense: "
                "only tensors whose elements fill a contiguous range can be offloaded"
            )

    offloaded: list[_LayerPlan] = []
    for k, (i, sel) in enumerate(picked):
        tensors = []
        count: dict[tuple[Any, ...], int] = {}
        for name, p in sel:
            d = p.data
            t = _TensorPlan(
                name=name,
                param=p,
                shape=tuple(d.shape),
                stride=tuple(d.stride()),
                dtype=d.dtype,
                itemsize=d.element_size(),
                nbytes=d.numel() * d.element_size(),
            )
            base = (t.shape, t.stride, t.dtype)
            occurrence = count.get(base, 0)
            count[base] = occurrence + 1
            t.key = (*base, occurrence)
            tensors.append(t)
        offloaded.append(_LayerPlan(index=i, k=k, module=mods[i], tensors=tensors))

    # Slot layout: one buffer per distinct (shape, stride, dtype, occurrence in a layer).
    keys: dict[tuple[Any, ...], int] = {}
    off = 0
    for lay in offloaded:
        for t in lay.tensors:
            if t.key not in keys:
                keys[t.key] = off
                off += t.span
            t.slot_off = keys[t.key]
    slot_bytes = off
    # Host layout: each layer's tensors in slot order, so that host and slot runs coincide.
    host = 0
    for lay in offloaded:
        for t in sorted(lay.tensors, key=lambda t: t.slot_off):
            t.host_off = host
            host += t.span
        runs: list[list[int]] = []
        for t in sorted(lay.tensors, key=lambda t: t.host_off):
            if (
                runs
                and runs[-1][0] + runs[-1][2] == t.host_off
                and (runs[-1][1] + runs[-1][2] == t.slot_off)
            ):
                runs[-1][2] += t.span
            else:
                runs.append([t.host_off, t.slot_off, t.span])
        lay.runs = [(a, b, c) for a, b, c in runs]
    return _Plan(
        layers=mods,
        offloaded=offloaded,
        device=dev,
        slot_bytes=slot_bytes,
        host_bytes=host,
        keys=keys,
    )


# --------------------------------------------------------------------------------------------
# Streams and events: CUDA, or the host stand-in of the CPU test mode
# --------------------------------------------------------------------------------------------


class _CudaSync:
    """torch CUDA streams and events."""

    is_cuda = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.copy_stream = torch.cuda.Stream(device=device)

    def current(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def new_event(self, name: str) -> Any:
        del name
        return torch.cuda.Event()

    def record(self, event: Any, stream: Any) -> None:
        event.record(stream)

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def wait_stream(self, stream: Any, other: Any) -> None:
        stream.wait_stream(other)

    def capturing(self) -> bool:
        return bool(torch.cuda.is_current_stream_capturing())

    def on(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)

    def note_job(self, job: int) -> None:
        del job

    def drain(self) -> None:
        torch.cuda.synchronize(self.device)


class _HostStream:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<host stream {self.name}>"


class _HostEvent:
    __slots__ = ("capture_seq", "job", "name", "recorded")

    def __init__(self, name: str) -> None:
        self.name = name
        self.recorded = False
        self.job: int | None = None
        # None: recorded outside a capture; else its position in the capture.
        self.capture_seq: int | None = None


class _HostSync:
    """Stand-in for streams and events on the host backend (CPU test mode).

    Compute is synchronous on the CPU; the host engine copies on a worker thread. An event
    recorded on the copy stream remembers the last job submitted before it, and waiting on it
    waits for that job (jobs of one lane finish in order). While :meth:`capture` is open the
    CUDA capture rules are checked: no wait on an event recorded outside the capture, no
    ``wait_stream``, and every event recorded on the copy stream inside the capture must be
    waited on by the capturing stream before the capture ends.
    """

    is_cuda = False

    def __init__(self, engine: Engine, trace: list[Any] | None) -> None:
        self.engine = engine
        self.trace = trace
        self.compute = _HostStream("compute")
        self.copy_stream = _HostStream("copy")
        self._last_job: int | None = None
        self._capturing = False
        self._copy_joined = False
        self._seq = 0
        self._copy_last = 0
        self._joined = 0

    def _log(self, *entry: Any) -> None:
        if self.trace is not None:
            self.trace.append(entry)

    def current(self) -> _HostStream:
        return self.compute

    def new_event(self, name: str) -> _HostEvent:
        return _HostEvent(name)

    def record(self, event: _HostEvent, stream: _HostStream) -> None:
        event.recorded = True
        event.job = self._last_job if stream is self.copy_stream else None
        event.capture_seq = None
        if self._capturing and (stream is self.compute or self._copy_joined):
            self._seq += 1
            event.capture_seq = self._seq
            if stream is self.copy_stream:
                self._copy_last = self._seq
        self._log("record", event.name, stream.name)

    def wait_event(self, stream: _HostStream, event: _HostEvent) -> None:
        if not event.recorded:
            raise RuntimeError(f"{stream.name} waits on {event.name}, which was never recorded")
        if self._capturing:
            if event.capture_seq is None:
                raise RuntimeError(
                    f"capture isolation: {stream.name} waits on {event.name}, recorded outside "
                    "the capture"
                )
            if stream is self.copy_stream:
                self._copy_joined = True
            else:
                self._joined = max(self._joined, event.capture_seq)
        elif event.capture_seq is not None:
            raise RuntimeError(
                f"{event.name} was last recorded during a capture: it cannot be waited on "
                "outside it"
            )
        if event.job is not None:
            self.engine.wait([event.job])
        self._log("wait_event", stream.name, event.name)

    def wait_stream(self, stream: _HostStream, other: _HostStream) -> None:
        if self._capturing:
            raise RuntimeError(
                f"capture isolation: {stream.name} waits for all of {other.name}, whose work "
                "was issued outside the capture"
            )
        if other is self.copy_stream and self._last_job is not None:
            self.engine.wait([self._last_job])
        self._log("wait_stream", stream.name, other.name)

    def capturing(self) -> bool:
        return self._capturing

    def on(self, stream: _HostStream) -> Any:
        del stream
        return contextlib.nullcontext()

    def note_job(self, job: int) -> None:
        self._last_job = job

    def drain(self) -> None:
        if self._last_job is not None:
            self.engine.wait([self._last_job])

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        if self._capturing:
            raise RuntimeError("a capture is already open")
        self._capturing = True
        self._copy_joined = False
        self._seq = self._copy_last = self._joined = 0
        self._log("capture_begin")
        try:
            yield
        finally:
            self._capturing = False
            self._copy_joined = False
        self._log("capture_end")
        if self._copy_last > self._joined:
            raise RuntimeError(
                "the capture ended with copy-stream work the capturing stream never waited for "
                "(cudaErrorStreamCaptureUnjoined on a GPU): call join_after_forward() before "
                "the capture ends"
            )


# --------------------------------------------------------------------------------------------
# Custom ops (torch.compile) and the forward wrapper
# --------------------------------------------------------------------------------------------

_REGISTRY: dict[int, PrefetchOffloader] = {}
_IDS = itertools.count(1)
# Zero-copy offloaders whose device view does not keep them alive, until close().
_KEEP: dict[int, BaseOffloader] = {}


def _lookup(oid: int) -> PrefetchOffloader:
    off = _REGISTRY.get(oid)
    if off is None:
        raise RuntimeError(f"blockswap weight offloader #{oid} is closed")
    return off


@torch.library.custom_op("blockswap::offload_wait", mutates_args=("x",))
def _offload_wait(x: torch.Tensor, offloader: int, layer: int) -> None:
    """Waits for offloaded layer ``layer``'s weights (``x``, its input, is declared mutated so
    that the compiler keeps the layer's kernels after this op)."""
    del x
    _lookup(offloader)._pre(layer)


@_offload_wait.register_fake
def _offload_wait_fake(x: torch.Tensor, offloader: int, layer: int) -> None:
    del x, offloader, layer


@torch.library.custom_op("blockswap::offload_done", mutates_args=("x",))
def _offload_done(x: torch.Tensor, offloader: int, layer: int) -> None:
    """Layer ``layer`` has been issued: release its slot and start the next onload into it
    (``x``, its output, is declared mutated so that the compiler keeps this op after the
    layer's kernels and before the next layer's)."""
    del x
    _lookup(offloader)._post(layer)


@_offload_done.register_fake
def _offload_done_fake(x: torch.Tensor, offloader: int, layer: int) -> None:
    del x, offloader, layer


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        for v in value:
            if isinstance(v, torch.Tensor):
                return v
    if isinstance(value, dict):
        for v in value.values():
            if isinstance(v, torch.Tensor):
                return v
    return None


def _make_forward(orig: Any, oid: int, k: int) -> Any:
    """The offloaded layer's forward: wait for its weights, run it, release its slot.

    Installed as the module's instance attribute ``forward`` rather than as forward hooks:
    Dynamo does not guard on module hooks (``torch._dynamo.config.skip_nnmodule_hook_guards``
    is True by default), so code compiled before hooks were added would silently run without
    them; an instance ``forward`` is guarded on.
    """

    def forward(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            x = _first_tensor(args)
            if x is None:
                x = _first_tensor(kwargs)
            if x is None:
                raise RuntimeError(
                    "an offloaded layer compiled with torch.compile needs a tensor argument "
                    "(its input orders the weight wait)"
                )
            torch.ops.blockswap.offload_wait(x, oid, k)
            out = orig(*args, **kwargs)
            y = _first_tensor(out)
            if y is None:
                raise RuntimeError(
                    "an offloaded layer compiled with torch.compile must return a tensor (its "
                    "output orders the next prefetch)"
                )
            torch.ops.blockswap.offload_done(y, oid, k)
            return out
        off = _lookup(oid)
        off._pre(k)
        out = orig(*args, **kwargs)
        off._post(k)
        return out

    return forward


# --------------------------------------------------------------------------------------------
# Offloaders
# --------------------------------------------------------------------------------------------


class BaseOffloader:
    """The interface every offloader has; every method is a no-op here."""

    def __init__(self, layers: Sequence[nn.Module] = ()) -> None:
        self._layers = list(layers)
        self._closed = False

    @property
    def layers(self) -> list[nn.Module]:
        return list(self._layers)

    @property
    def offloaded_layers(self) -> list[int]:
        """Indices (into ``layers``) of the offloaded layers, in offload order."""
        return []

    @property
    def offloaded_bytes(self) -> int:
        """Bytes of parameters kept in host memory."""
        return 0

    @property
    def closed(self) -> bool:
        return self._closed

    def sync_prev_onload(self) -> None:
        """Makes the current stream wait for every onload issued so far. Call before a CUDA
        graph capture and before each replay."""

    def join_after_forward(self) -> None:
        """Inside a CUDA graph capture, after the forward and before the capture ends: joins
        the prefetches started during the capture."""

    def close(self, restore: bool = True) -> None:
        """Undoes the offload (``restore``: parameters get device copies of their weights
        again; otherwise they are left empty, for a model that is being discarded) and frees
        the host memory."""
        del restore
        self._closed = True

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self.offloaded_layers)} layers offloaded"
        return f"{type(self).__name__}({state}, {self.offloaded_bytes / 2**20:.1f} MiB)"


class NoopOffloader(BaseOffloader):
    """Offloads nothing; the default offloader."""


_current: BaseOffloader = NoopOffloader()


def get_offloader() -> BaseOffloader:
    """The process's current offloader (a :class:`NoopOffloader` unless one was set)."""
    return _current


def set_offloader(offloader: BaseOffloader) -> None:
    """Makes ``offloader`` the one :func:`get_offloader` returns."""
    global _current
    if not isinstance(offloader, BaseOffloader):
        raise OffloadConfigError(f"not an offloader: {offloader!r}")
    _current = offloader


@dataclass
class _OnloadState:
    issued: bool = False
    in_capture: bool = False  # the latest onload was issued during a capture
    joined: bool = True  # ... and the capturing stream has waited for it
    valid_for_eager: bool = False  # the copy event may be waited on outside a capture


class _OffloaderCore(BaseOffloader):
    """Planning, the pinned buffer and parameter restore, shared by the real offloaders."""

    _plan: _Plan
    _host: torch.Tensor
    engine: Engine

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        super().__init__(layers)
        self._host_arr: np.ndarray | None = None
        self._installed = False

    @property
    def device(self) -> torch.device:
        return self._plan.device

    @property
    def offloaded_layers(self) -> list[int]:
        return [lay.index for lay in self._plan.offloaded]

    @property
    def offloaded_bytes(self) -> int:
        return sum(lay.nbytes for lay in self._plan.offloaded)

    @property
    def host_bytes(self) -> int:
        """Size of the pinned host buffer (tensors aligned to 512 bytes)."""
        return self._plan.host_bytes

    def _fill_host(self) -> None:
        """Allocates the pinned buffer and copies every offloaded tensor into it (reads only)."""
        arr = self.engine.alloc_host(max(self._plan.host_bytes, 1))
        self._host_arr = arr
        self._host = torch.from_numpy(arr)
        for lay in self._plan.offloaded:
            for t in lay.tensors:
                self._host[t.host_off : t.host_off + t.nbytes].copy_(_bytes_of(t.param.data))

    def _restore_params(self, restore: bool) -> None:
        for lay in self._plan.offloaded:
            for t in lay.tensors:
                if restore:
                    fresh = torch.empty_strided(
                        t.shape, t.stride, dtype=t.dtype, device=self._plan.device
                    )
                    _bytes_of(fresh).copy_(self._host[t.host_off : t.host_off + t.nbytes])
                    t.param.data = fresh
                else:
                    t.param.data = torch.empty(0, dtype=t.dtype, device=self._plan.device)
            with contextlib.suppress(AttributeError):
                delattr(lay.module, _MARK)

    def _free_host(self) -> None:
        if self._host_arr is not None:
            self._host = torch.empty(0, dtype=torch.uint8)  # no view of freed memory survives
            with contextlib.suppress(BlockswapError):
                self.engine.free_host(self._host_arr)
            self._host_arr = None


class PrefetchOffloader(_OffloaderCore):
    """Offloads the chosen layers' parameters to pinned host memory and prefetches them into
    ``prefetch_step`` static device slots, ``prefetch_step`` offloaded layers ahead.

    ``layers``: the model's repeated layers (a sequence of ``nn.Module``, e.g. an
    ``nn.ModuleList``), in execution order; every forward must run all of them in that order.
    ``group_size``, ``num_in_group``: layer ``i`` is chosen when
    ``i % group_size >= group_size - num_in_group``. ``params``: name segments of the parameters
    to offload (``None``: all); a chosen layer with no match stays resident. ``prefetch_step``:
    slots, i.e. how many offloaded layers ahead the copies run (at most the number of
    offloaded layers). ``device``: where the weights are (default: where the first offloaded
    parameter is); CPU selects the host test mode. ``synchronous``: copy each layer in its own
    forward and wait for it at once (no prefetch; the baseline). ``engine_options``: extra
    keyword options of :class:`blockswap.Engine` (CUDA). ``trace``: a list the offloader appends
    its steps to (``("wait", k, how)``, ``("onload", k, slot, path, after)``, ``("join", k)``,
    ``("sync_prev", how)``; in the host test mode also the stream operations), for tests.

    Raises :class:`OffloadConfigError` / :class:`OffloadDeviceError` before changing anything.
    """

    def __init__(
        self,
        layers: Sequence[nn.Module],
        *,
        group_size: int = 1,
        num_in_group: int = 1,
        prefetch_step: int = 1,
        params: Iterable[str] | None = None,
        device: Any = None,
        synchronous: bool = False,
        engine_options: dict[str, Any] | None = None,
        trace: list[Any] | None = None,
    ) -> None:
        step = _check_int("prefetch_step", prefetch_step, 1)
        plan = _make_plan(layers, group_size, num_in_group, params, device)
        n = len(plan.offloaded)
        if step > n:
            raise OffloadConfigError(
                f"prefetch_step ({step}) is larger than the number of offloaded layers ({n}): "
                f"there would be more prefetch slots than layers to fill them"
            )
        opts = dict(engine_options or {})
        for reserved in ("h2d_stream", "device"):
            if reserved in opts:
                raise OffloadConfigError(
                    f"engine_options must not set {reserved!r}: the offloader sets it"
                )
        super().__init__(plan.layers)
        self._plan = plan
        self.group_size, self.num_in_group = _check_group(group_size, num_in_group)
        self.prefetch_step = step
        self.synchronous = bool(synchronous)
        self.trace = trace
        self.submissions = 0
        self._jobs = itertools.count(1)
        self._job_layer: dict[int, int] = {}
        self._wrapped: list[tuple[nn.Module, Any, Any]] = []
        self._oid = next(_IDS)
        self._views: list[list[torch.Tensor]] = []
        try:
            self._setup(opts)
        except BaseException:
            self._teardown_resources()
            raise
        self._install()

    # -- construction ---------------------------------------------------------------------

    def _setup(self, opts: dict[str, Any]) -> None:
        plan, step = self._plan, self.prefetch_step
        sync: Any
        if plan.device.type == "cuda":
            sync = _CudaSync(plan.device)
            opts.setdefault("h2d_order", "stream")
            self.engine = Engine(
                "cuda",
                device=int(plan.device.index or 0),
                h2d_stream=int(sync.copy_stream.cuda_stream),
                **opts,
            )
        else:
            self.engine = Engine("host", **opts)
            sync = _HostSync(self.engine, self.trace)
        self._sync = sync
        self._fill_host()
        self._arena = torch.empty(
            max(step * plan.slot_bytes, 1), dtype=torch.uint8, device=plan.device
        )
        self.engine.register(self._arena, kind="device")
        host_base = int(self._host.data_ptr())
        arena_base = int(self._arena.data_ptr())
        self._descs: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        for lay in plan.offloaded:
            slot = lay.k % step
            ts = sorted(lay.tensors, key=lambda t: t.host_off)
            src = np.array([host_base + t.host_off for t in ts], dtype=np.int64)
            dst = np.array(
                [arena_base + slot * plan.slot_bytes + t.slot_off for t in ts], dtype=np.int64
            )
            sizes = np.array([t.span for t in ts], dtype=np.int64)
            self._descs.append((src, dst, sizes))
            self._views.append(
                [
                    _typed_view(self._arena, slot * plan.slot_bytes + t.slot_off, t)
                    for t in lay.tensors
                ]
            )
        n = len(plan.offloaded)
        self._copy_done = [sync.new_event(f"copy_done[{k}]") for k in range(n)]
        self._fork = [sync.new_event(f"fork[{k}]") for k in range(n)]
        self._states = [_OnloadState() for _ in range(n)]
        self._cursor = 0

    def _install(self) -> None:
        """Points the parameters at their slots and wraps the layers' forwards (nothing here
        fails on valid input; everything that can fail happened before)."""
        for lay, views in zip(self._plan.offloaded, self._views):
            for t, v in zip(lay.tensors, views):
                t.param.data = v
            mod = lay.module
            object.__setattr__(mod, _MARK, self._oid)
            prev = mod.__dict__.get("forward", _NO_FORWARD)
            fn = _make_forward(mod.forward, self._oid, lay.k)
            object.__setattr__(mod, "forward", fn)
            self._wrapped.append((mod, prev, fn))
        _REGISTRY[self._oid] = self
        self._installed = True
        self._start()

    def _start(self) -> None:
        """Onloads the first ``prefetch_step`` layers, as a forward's end would have."""
        if self.synchronous:
            return
        for k in range(self.prefetch_step):
            self._onload(k, after=None)

    def _teardown_resources(self) -> None:
        sync = getattr(self, "_sync", None)
        if sync is not None:
            with contextlib.suppress(Exception):
                sync.drain()
        if hasattr(self, "engine"):
            with contextlib.suppress(Exception):
                self.engine.get_finished()
            if getattr(self, "_arena", None) is not None and self._arena.numel() > 1:
                with contextlib.suppress(Exception):
                    self.engine.unregister(self._arena)
            self._free_host()
            self.engine.shutdown()
        self._arena = torch.empty(0, dtype=torch.uint8)

    # -- public ---------------------------------------------------------------------------

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot (every distinct parameter buffer of a layer)."""
        return self._plan.slot_bytes

    @property
    def device_bytes(self) -> int:
        """Device memory of the static slots: ``prefetch_step * slot_bytes``."""
        return self.prefetch_step * self._plan.slot_bytes

    @property
    def layer_slots(self) -> dict[int, int]:
        """Slot of each offloaded layer (index into ``layers`` -> slot)."""
        return {lay.index: lay.k % self.prefetch_step for lay in self._plan.offloaded}

    def sync_prev_onload(self) -> None:
        """Outside a capture: the current stream waits for every onload issued so far (call it
        before capturing a CUDA graph and before each replay). Inside a capture: nothing."""
        self._check_open()
        sync = self._sync
        if sync.capturing():
            self._log("sync_prev", "capturing")
            return
        sync.wait_stream(sync.current(), sync.copy_stream)
        for st in self._states:
            st.joined = True
        self._reap()
        self._log("sync_prev", "stream")

    def join_after_forward(self) -> None:
        """Inside a capture, after the forward: the capturing stream waits for the onloads
        started during the capture and not waited for yet. Outside a capture: nothing."""
        self._check_open()
        sync = self._sync
        if not sync.capturing():
            return
        cur = sync.current()
        for k, st in enumerate(self._states):
            if st.in_capture and not st.joined:
                sync.wait_event(cur, self._copy_done[k])
                st.joined = True
                self._log("join", k)

    def reset(self) -> None:
        """Waits for every onload and starts again from the state a forward ends in (after a
        forward that did not run every layer, or a :class:`WeightTransferError`)."""
        self._check_open()
        if self._sync.capturing():
            raise RuntimeError("reset() cannot run during a CUDA graph capture")
        self._sync.drain()
        with contextlib.suppress(WeightTransferError):
            self._reap()
        for st in self._states:
            st.joined = True
        self._cursor = 0
        self._start()

    @contextlib.contextmanager
    def emulate_capture(self) -> Iterator[None]:
        """Host test mode only: runs the block as if a CUDA graph were being captured on the
        compute stream, checking the capture rules (isolation, every fork joined)."""
        self._check_open()
        if not isinstance(self._sync, _HostSync):
            raise RuntimeError("emulate_capture() is for the host test mode; capture a real graph")
        with self._sync.capture():
            yield

    def close(self, restore: bool = True) -> None:
        if self._closed:
            return
        self._sync.drain()
        with contextlib.suppress(WeightTransferError):
            self._reap()
        for mod, prev, fn in self._wrapped:
            if mod.__dict__.get("forward") is fn:
                if prev is _NO_FORWARD:
                    del mod.__dict__["forward"]
                else:
                    object.__setattr__(mod, "forward", prev)
        self._wrapped.clear()
        _REGISTRY.pop(self._oid, None)
        self._restore_params(restore)
        self._views.clear()
        self._teardown_resources()
        self._closed = True

    # -- the wrappers' work ---------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this offloader is closed")

    def _log(self, *entry: Any) -> None:
        if self.trace is not None:
            self.trace.append(entry)

    def _reap(self) -> None:
        failed = []
        for r in self.engine.get_finished():
            k = self._job_layer.pop(r.job_id, None)
            if not r.success:
                failed.append((k, r.error))
        if failed:
            k, err = failed[0]
            lay = self._plan.offloaded[k].index if k is not None else "?"
            raise WeightTransferError(
                f"onload of offloaded layer {k} (layers[{lay}]) failed: {err}; its slot holds "
                "unknown data (call reset() before the next forward)"
            )

    def _pre(self, k: int) -> None:
        self._check_open()
        if k != self._cursor:
            raise RuntimeError(
                f"offloaded layer {k} (layers[{self._plan.offloaded[k].index}]) runs, but "
                f"offloaded layer {self._cursor} was expected: every forward must run all "
                "offloaded layers in order (call reset() after a forward that did not)"
            )
        if self.synchronous:
            self._onload(k, after=None)
        self._wait(k)

    def _post(self, k: int) -> None:
        self._check_open()
        self._cursor = (k + 1) % len(self._plan.offloaded)
        if self.synchronous:
            return
        n, step = len(self._plan.offloaded), self.prefetch_step
        # The next occupant of slot k % step: this forward's layer k + step, or, for the last
        # `step` layers, the next forward's layer k % step.
        nxt = k + step if k + step < n else k % step
        self._onload(nxt, after=k)

    def _onload(self, j: int, after: int | None) -> None:
        sync = self._sync
        cur = sync.current()
        st = self._states[j]
        capturing = sync.capturing()
        # Fork: the copy waits for the compute stream's work so far (the slot's previous
        # reader, layer `after`, has been issued); under capture this joins the copy stream.
        fork = self._fork[j]
        sync.record(fork, cur)
        sync.wait_event(sync.copy_stream, fork)
        if capturing:
            with sync.on(sync.copy_stream):
                for s, d, nb in self._plan.offloaded[j].runs:
                    base = (j % self.prefetch_step) * self._plan.slot_bytes
                    self._arena[base + d : base + d + nb].copy_(
                        self._host[s : s + nb], non_blocking=True
                    )
            path = "capture"
        else:
            self._reap()
            job = next(self._jobs)
            src, dst, sizes = self._descs[j]
            self.engine.submit(job, src, dst, sizes, "h2d")
            self._job_layer[job] = j
            sync.note_job(job)
            self.submissions += 1
            path = "engine"
        sync.record(self._copy_done[j], sync.copy_stream)
        st.issued = True
        st.in_capture = capturing
        st.joined = not capturing
        st.valid_for_eager = not capturing
        self._log("onload", j, j % self.prefetch_step, path, after)

    def _wait(self, k: int) -> None:
        sync = self._sync
        st = self._states[k]
        if not st.issued:
            raise RuntimeError(
                f"offloaded layer {k} was never loaded: a forward must run every layer in order "
                "(call reset() after one that did not)"
            )
        cur = sync.current()
        if sync.capturing():
            if st.in_capture and not st.joined:
                sync.wait_event(cur, self._copy_done[k])
                st.joined = True
                how = "captured-event"
            else:
                # Loaded before the capture began: the runner's sync_prev_onload() orders the
                # replay after it; nothing inside the graph may wait for pre-capture work.
                how = "skip"
        elif st.valid_for_eager:
            sync.wait_event(cur, self._copy_done[k])
            how = "event"
        else:
            # The copy event was last recorded during a capture (unusable outside it).
            sync.wait_stream(cur, sync.copy_stream)
            how = "stream"
        if not sync.is_cuda:
            self._reap()
        self._log("wait", k, how)


class ZeroCopyOffloader(_OffloaderCore):
    """Keeps the chosen layers' parameters in pinned host memory that the GPU reads directly
    over unified addressing (every forward reads the weights across the link; nothing is
    copied). For comparison with :class:`PrefetchOffloader`; same selection and validation.

    In the host test mode the parameters simply point into the host buffer.
    """

    def __init__(
        self,
        layers: Sequence[nn.Module],
        *,
        group_size: int = 1,
        num_in_group: int = 1,
        params: Iterable[str] | None = None,
        device: Any = None,
    ) -> None:
        plan = _make_plan(layers, group_size, num_in_group, params, device)
        super().__init__(plan.layers)
        self._plan = plan
        self.group_size, self.num_in_group = _check_group(group_size, num_in_group)
        try:
            if plan.device.type == "cuda":
                self.engine = Engine("cuda", device=int(plan.device.index or 0))
            else:
                self.engine = Engine("host")
            self._fill_host()
            self._device_view = self._map_host()
            views = [
                [_typed_view(self._device_view, t.host_off, t) for t in lay.tensors]
                for lay in plan.offloaded
            ]
        except BaseException:
            if hasattr(self, "engine"):
                self._free_host()
                self.engine.shutdown()
            raise
        for lay, vs in zip(plan.offloaded, views):
            for t, v in zip(lay.tensors, vs):
                t.param.data = v
            object.__setattr__(lay.module, _MARK, -1)
        self._installed = True

    def _map_host(self) -> torch.Tensor:
        """The pinned buffer as a uint8 tensor on the device (the host tensor in test mode)."""
        if self._plan.device.type != "cuda":
            return self._host
        assert self._host_arr is not None
        dev = self._plan.device
        nbytes = int(self._host_arr.nbytes)
        dptr = _device_pointer(int(self._host_arr.ctypes.data))
        problems = []
        # 1. __cuda_array_interface__: torch keeps the holder (and so the engine) alive.
        try:
            holder = _CudaArray(dptr, nbytes, keep=(self.engine, self._host_arr))
            view = torch.as_tensor(holder, device=dev)
            if view.device == dev and int(view.data_ptr()) == dptr:
                return view
            problems.append(f"__cuda_array_interface__ gave {view.device} at {view.data_ptr():#x}")
        except Exception as e:
            problems.append(f"__cuda_array_interface__: {e}")
        # 2. A storage over the address (what inductor's CUDA graph trees use); it does not own
        #    the memory, so the offloader keeps itself alive until close().
        try:
            storage = torch._C._construct_storage_from_data_pointer(dptr, dev, nbytes)
            view = torch.empty(0, dtype=torch.uint8, device=dev).set_(storage)
            if view.device == dev and int(view.data_ptr()) == dptr and view.numel() == nbytes:
                _KEEP[id(self)] = self
                return view
            problems.append(f"storage route gave {view.device} at {view.data_ptr():#x}")
        except Exception as e:
            problems.append(f"storage route: {e}")
        raise OffloadDeviceError(
            f"torch could not view the pinned buffer in place on {dev} ({'; '.join(problems)}): "
            "zero-copy is not available with this torch"
        )

    def close(self, restore: bool = True) -> None:
        if self._closed:
            return
        if self._plan.device.type == "cuda":
            torch.cuda.synchronize(self._plan.device)
        self._restore_params(restore)
        self._device_view = torch.empty(0, dtype=torch.uint8)
        self._free_host()
        self.engine.shutdown()
        _KEEP.pop(id(self), None)
        self._closed = True


class _CudaArray:
    """``__cuda_array_interface__`` over device-accessible memory, keeping its owner alive."""

    def __init__(self, ptr: int, nbytes: int, keep: Any) -> None:
        self._keep = keep
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 2,
            "strides": None,
        }


def _device_pointer(host_ptr: int) -> int:
    """The device address of mapped pinned host memory (``cuMemHostGetDevicePointer``)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return host_ptr  # unified addressing: the same address
    fn = lib.cuMemHostGetDevicePointer_v2
    fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    out = ctypes.c_uint64(0)
    rc = fn(ctypes.byref(out), ctypes.c_void_p(host_ptr), 0)
    if rc != 0:
        raise OffloadDeviceError(
            f"cuMemHostGetDevicePointer failed with CUresult {rc}: the pinned buffer is not "
            "mapped into the device's address space"
        )
    return int(out.value)


def create_offloader(kind: str, layers: Sequence[nn.Module] = (), **options: Any) -> BaseOffloader:
    """``"prefetch"`` (:class:`PrefetchOffloader`), ``"sync"`` (the same with
    ``synchronous=True``), ``"zero_copy"`` (:class:`ZeroCopyOffloader`) or ``"none"``
    (:class:`NoopOffloader`)."""
    if kind == "prefetch":
        return PrefetchOffloader(layers, **options)
    if kind == "sync":
        return PrefetchOffloader(layers, synchronous=True, **options)
    if kind == "zero_copy":
        return ZeroCopyOffloader(layers, **options)
    if kind == "none":
        return NoopOffloader(layers)
    raise OffloadConfigError(
        f"kind must be 'prefetch', 'sync', 'zero_copy' or 'none', not {kind!r}"
    )
