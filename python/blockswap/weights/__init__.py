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
  waited for at once (no overlap: the baseline prefetching is measured against); the forward's
  last layer also waits on the host for the forward's copies, so that a failed one is raised by
  the forward that ran on it. Onloads submitted and not yet reported are kept within the
  engine's ``max_in_flight`` (``engine_options``): where the GPU falls behind, the next one
  first waits on the host for the oldest, instead of being refused mid-forward.
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

Every configuration error is an :class:`OffloadConfigError` (a :class:`~blockswap.ConfigError`,
so a ``ValueError`` and a :class:`~blockswap.BlockswapError`; an argument of the wrong type, an
``engine_options`` value the engine refuses, and a ``max_in_flight`` not above
``prefetch_step``, included), or, for an unknown keyword or an ``engine_options`` value of the
wrong type, a :class:`~blockswap.ConfigTypeError` (a ``TypeError``), raised before anything is
changed: a failed construction leaves the model as it was.

Limits
------
* Inference only. An offloaded weight's slot is overwritten by the next layer that uses it, so
  a backward through an offloaded layer would read another layer's weights: where parameters
  require grad, each onload marks its slot's parameters as written in place, and such a
  backward raises autograd's "modified by an inplace operation" error instead.
* While the offloader is open, an offloaded parameter's ``.data`` is its slot, which the layers
  sharing the slot take turns in: ``state_dict()`` outside a forward reads whichever layer the
  slot holds, and ``load_state_dict`` or any write to an offloaded parameter is lost at the
  next onload (and ``close(restore=True)`` restores the weights offloaded at construction).
  Close the offloader before reading or replacing the weights.
* A parameter shared by two of ``layers`` is refused; one shared with a module outside
  ``layers`` (a tied embedding) is not seen, and that module would read the slot: keep tied
  weights out of ``params``.
* :class:`ZeroCopyOffloader` keeps its pinned buffer until the last tensor viewing it is gone,
  after :meth:`~ZeroCopyOffloader.close` too.
* After a :class:`WeightTransferError` every forward is refused until
  :meth:`~PrefetchOffloader.reset`. A failed onload that no forward raised (a forward's last
  prefetch, or one of a forward that stopped early) is raised by ``reset()``, before it starts
  again, or by ``close()``, once closed. Where the engine's CUDA lane itself failed (a driver
  error, which CUDA does not let a stream recover from), ``reset()`` raises the engine's error
  too: close the offloader and make a new one.
"""

from __future__ import annotations

from .. import _optional

# The submodules import torch directly: importing any of them runs this first, so that a
# missing torch gets the install command.
try:
    import torch  # noqa: F401
    from torch import nn  # noqa: F401
except ModuleNotFoundError as e:
    _optional.missing(e, __name__)

from .errors import (
    OffloadConfigError,
    OffloadDeviceError,
    OffloaderStateError,
    WeightTransferError,
)
from .offloaders import (
    BaseOffloader,
    NoopOffloader,
    PrefetchOffloader,
    ZeroCopyOffloader,
    create_offloader,
    get_offloader,
    set_offloader,
)

# Private names that the tests use through this module.
from .ops import _REGISTRY as _REGISTRY
from .ops import _make_forward as _make_forward
from .selection import matches_segment, select_layers

__all__ = [
    "BaseOffloader",
    "NoopOffloader",
    "OffloadConfigError",
    "OffloadDeviceError",
    "OffloaderStateError",
    "PrefetchOffloader",
    "WeightTransferError",
    "ZeroCopyOffloader",
    "create_offloader",
    "get_offloader",
    "matches_segment",
    "select_layers",
    "set_offloader",
]
