"""Offloaders: the interface, the process's current offloader, the prefetching offloader and
the zero-copy one."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from .._checks import check_bool, check_int
from .._core import BackendError, BlockswapError, InvalidTransferError, cuda_device_pointer
from .._types import BackendName
from ..engine import Engine, _is_int
from ..errors import refuses_with_config_errors
from .errors import (
    OffloadConfigError,
    OffloadDeviceError,
    OffloaderStateError,
    WeightTransferError,
)
from .ops import _IDS, _REGISTRY, _make_forward
from .plan import (
    _MARK,
    _bytes_of,
    _make_plan,
    _mark_params,
    _Plan,
    _typed_view,
    _unmark_params,
)
from .selection import _CONFIG_ERRORS, _check_group
from .sync import _CudaSync, _HostSync

# A module without an instance-level forward before the offloader wrapped it.
_NO_FORWARD = object()


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


def _no_version(t: torch.Tensor) -> None:
    """Older torch has no public way to mark a tensor written: nothing is marked."""


#: Marks a tensor as written in place, for autograd (torch 2.1+).
_increment_version: Callable[[torch.Tensor], None] = getattr(
    torch.autograd.graph, "increment_version", _no_version
)


def _engine(backend: BackendName, **options: Any) -> Engine:
    """The offloader's engine; an option value it refuses (``engine_options``) is an
    :class:`OffloadConfigError` naming it (one of the wrong type, or an unknown option, stays a
    ``TypeError``)."""
    try:
        return Engine(backend, **options)
    except InvalidTransferError as e:
        if isinstance(e, TypeError):  # ArgumentTypeError
            raise
        raise OffloadConfigError(f"engine_options: {e}") from e


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
        _unmark_params(self._plan)
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
    forward and wait for it at once (no prefetch; the baseline); outside a CUDA graph capture
    the forward's last layer also waits on the host for the forward's copies, so that a copy
    that failed is raised by the forward that ran on it. ``engine_options``: extra keyword
    options of :class:`blockswap.Engine` (CUDA). Its ``max_in_flight`` (more than
    ``prefetch_step``) bounds the onloads submitted and not yet reported: an onload that would
    pass it first waits on the host for the oldest (backpressure, where the GPU falls behind the
    host; a forward itself needs at most ``prefetch_step + 1`` in flight), instead of being
    refused. ``trace``: a list the offloader appends its steps to (``("wait", k, how)``,
    ``("onload", k, slot, path, after)``, ``("backpressure", k)`` (waited on the host for layer
    ``k``'s onload), ``("join", k)``, ``("sync_prev", how)``; in the host test mode also the
    stream operations), for tests.

    Raises :class:`OffloadConfigError` / :class:`OffloadDeviceError` before changing anything.
    A failed onload is a :class:`WeightTransferError`, raised by the forward that collects its
    result, else by :meth:`reset` or :meth:`close`: none goes unreported.
    """

    @refuses_with_config_errors
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
        step = check_int("prefetch_step", prefetch_step, 1, errors=_CONFIG_ERRORS)
        check_bool("synchronous", synchronous, OffloadConfigError)
        if trace is not None and not isinstance(trace, list):
            raise OffloadConfigError(f"trace must be a list or None, not {type(trace).__name__}")
        plan = _make_plan(layers, group_size, num_in_group, params, device)
        n = len(plan.offloaded)
        if step > n:
            raise OffloadConfigError(
                f"prefetch_step ({step}) is larger than the number of offloaded layers ({n}): "
                f"there would be more prefetch slots than layers to fill them"
            )
        if engine_options is not None and not isinstance(engine_options, dict):
            raise OffloadConfigError(
                f"engine_options must be a dict or None, not {type(engine_options).__name__}"
            )
        opts = dict(engine_options or {})
        for reserved in ("h2d_stream", "device"):
            if reserved in opts:
                raise OffloadConfigError(
                    f"engine_options must not set {reserved!r}: the offloader sets it"
                )
        flight: Any = opts.get("max_in_flight")
        if _is_int(flight) and flight <= step:
            raise OffloadConfigError(
                f"engine_options max_in_flight ({flight}) must be more than prefetch_step "
                f"({step}): a forward keeps up to prefetch_step + 1 onloads in flight"
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
        #: An onload failed: forwards are refused until reset().
        self._failed = False
        try:
            self._setup(opts)
        except BaseException:
            self._teardown_resources()
            raise
        originals = [(t.param, t.param.data) for lay in plan.offloaded for t in lay.tensors]
        self._install()
        try:
            self._start()
        except BaseException:
            # The first onloads refused (the engine's limits): the model as it was.
            self._uninstall()
            _unmark_params(self._plan)
            for param, data in originals:
                param.data = data
            self._views.clear()
            self._teardown_resources()
            raise

    # -- construction ---------------------------------------------------------------------

    def _setup(self, opts: dict[str, Any]) -> None:
        plan, step = self._plan, self.prefetch_step
        sync: Any
        if plan.device.type == "cuda":
            sync = _CudaSync(plan.device)
            opts.setdefault("h2d_order", "stream")
            self.engine = _engine(
                "cuda",
                device=int(plan.device.index or 0),
                h2d_stream=int(sync.copy_stream.cuda_stream),
                **opts,
            )
        else:
            self.engine = _engine("host", **opts)
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
        # Every layer's onload within the engine's limit, checked here: the first onloads
        # (`_start`) reach only the first layers.
        most = max(len(src) for src, _, _ in self._descs)
        info = self.engine.info()
        limit = int(info["max_descriptors"])
        #: Onloads submitted and not yet reported that the engine accepts (`_onload` keeps
        #: below it).
        self._max_in_flight = int(info["max_in_flight"])
        if most > limit:
            raise OffloadConfigError(
                f"an offloaded layer's onload is {most} copies (one per tensor), more than the "
                f"engine takes in one transfer (max_descriptors={limit}): raise "
                "engine_options max_descriptors"
            )
        n = len(plan.offloaded)
        #: Per slot, its layers' parameters that require grad (none in inference, where
        #: onloads mark nothing for autograd).
        self._slot_grads: list[list[nn.Parameter]] = [[] for _ in range(step)]
        for lay in plan.offloaded:
            grads = [t.param for t in lay.tensors if t.param.requires_grad]
            self._slot_grads[lay.k % step] += grads
        self._copy_done = [sync.new_event(f"copy_done[{k}]") for k in range(n)]
        self._fork = [sync.new_event(f"fork[{k}]") for k in range(n)]
        self._states = [_OnloadState() for _ in range(n)]
        self._cursor = 0

    def _install(self) -> None:
        """Points the parameters at their slots and wraps the layers' forwards (nothing here
        fails on valid input; what can fail happened before, but the first onloads, after)."""
        _mark_params(self._plan)
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

    def _uninstall(self) -> None:
        """Undoes :meth:`_install`'s wrapping of the forwards and its registration."""
        for mod, prev, fn in self._wrapped:
            if mod.__dict__.get("forward") is fn:
                if prev is _NO_FORWARD:
                    del mod.__dict__["forward"]
                else:
                    object.__setattr__(mod, "forward", prev)
            with contextlib.suppress(AttributeError):
                delattr(mod, _MARK)
        self._wrapped.clear()
        _REGISTRY.pop(self._oid, None)

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
        forward that did not run every layer, or a :class:`WeightTransferError`).

        An onload that failed and that nothing raised yet (a forward that stopped before
        collecting its result) is raised here as a :class:`WeightTransferError`, before
        anything is started again: a forward that ran on its slot may have returned wrong
        output. Forwards stay refused; the next ``reset()`` starts again. Failures of onloads
        after one that was raised are not raised again."""
        self._check_open()
        if self._sync.capturing():
            raise OffloaderStateError("reset() cannot run during a CUDA graph capture")
        self._sync.drain()
        self._reap_unreported("found by reset(): call reset() again before the next forward")
        for st in self._states:
            st.joined = True
        self._cursor = 0
        self._failed = False
        self._start()

    @contextlib.contextmanager
    def emulate_capture(self) -> Iterator[None]:
        """Host test mode only: runs the block as if a CUDA graph were being captured on the
        compute stream, checking the capture rules (isolation, every fork joined)."""
        self._check_open()
        if not isinstance(self._sync, _HostSync):
            raise OffloaderStateError(
                "emulate_capture() is for the host test mode; capture a real graph"
            )
        with self._sync.capture():
            yield

    def close(self, restore: bool = True) -> None:
        """As :meth:`BaseOffloader.close`, after waiting for every onload. An onload that failed
        and that nothing raised yet is raised as a :class:`WeightTransferError` once the
        offloader is closed (a forward that ran on its slot may have returned wrong output)."""
        if self._closed:
            return
        self._sync.drain()
        unreported: WeightTransferError | None = None
        try:
            self._reap_unreported("found by close(); the offloader is closed")
        except WeightTransferError as e:
            unreported = e
        self._uninstall()
        self._restore_params(restore)
        self._views.clear()
        self._teardown_resources()
        self._closed = True
        if unreported is not None:
            raise unreported

    # -- the wrappers' work ---------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise OffloaderStateError("this offloader is closed")

    def _log(self, *entry: Any) -> None:
        if self.trace is not None:
            self.trace.append(entry)

    def _reap(
        self, after: str = "its slot holds unknown data (call reset() before the next forward)"
    ) -> None:
        """Collects the engine's results; raises a :class:`WeightTransferError` for the first
        failed onload among them (``after`` ends its message), and forwards are refused."""
        failed = []
        for r in self.engine.get_finished():
            k = self._job_layer.pop(r.job_id, None)
            if not r.success:
                failed.append((k, r.error))
        if failed:
            self._failed = True
            k, err = failed[0]
            lay = self._plan.offloaded[k].index if k is not None else "?"
            raise WeightTransferError(
                f"onload of offloaded layer {k} (layers[{lay}]) failed: {err}; {after}"
            )

    def _reap_unreported(self, found_by: str) -> None:
        """Every onload done: collects the results, and raises a failure only where none was
        raised before (an onload failing after one was raised belongs to what that reported)."""
        told = self._failed
        try:
            self._reap(
                "no forward raised it, and one that ran on its slot may have returned wrong "
                f"output ({found_by})"
            )
        except WeightTransferError:
            if not told:
                raise

    def _pre(self, k: int) -> None:
        self._check_open()
        if self._failed:
            raise WeightTransferError(
                "an onload failed in an earlier forward, and some slots hold unknown data: call "
                "reset() before the next forward"
            )
        if k != self._cursor:
            raise OffloaderStateError(
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
            if not self._sync.capturing():
                if k == len(self._plan.offloaded) - 1 and self._job_layer:
                    # The forward's last layer: on CUDA nothing so far has waited on the host
                    # for a copy (the compute stream's waits are the GPU's), so the last ones
                    # may not be reported yet. Waited for here, every failed copy of the
                    # forward is raised in it, not blamed on the next forward (or lost).
                    self.engine.wait(list(self._job_layer))
                # This layer's own copy, issued in its _pre: a failure the engine has reported
                # by now is raised in this forward, not blamed on a layer of the next.
                self._reap()
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
            # Backpressure: on CUDA the host waits for no copy (its waits are the GPU's), so
            # where the GPU falls behind, the onloads in flight would pile up until the engine
            # refused one (PoolExhaustedError, mid-forward). At the engine's limit the host waits
            # for the oldest (one lane's copies finish in order) and collects it.
            while len(self._job_layer) >= self._max_in_flight:
                oldest = next(iter(self._job_layer))
                self._log("backpressure", self._job_layer[oldest])
                self.engine.wait([oldest])
                self._reap()
            job = next(self._jobs)
            src, dst, sizes = self._descs[j]
            try:
                self.engine.submit(job, src, dst, sizes, "h2d")
            except BaseException:
                # The slot keeps the layer it held, and layer j's state its last onload: the next
                # forward must not run j on it as if its copy had been issued.
                self._failed = True
                raise
            self._job_layer[job] = j
            sync.note_job(job)
            self.submissions += 1
            path = "engine"
            # The engine writes the slot behind autograd's back: a weight of this slot that a
            # forward saved for its backward is stale now, and backward says so, as after any
            # in-place write, instead of computing gradients from another layer's weights.
            for param in self._slot_grads[j % self.prefetch_step]:
                _increment_version(param)
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
            raise OffloaderStateError(
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


# Zero-copy offloaders whose device view does not keep them alive, until close().
_KEEP: dict[int, BaseOffloader] = {}
# Their buffers after close(): views that do not own them may still read them.
_UNOWNED: list[Any] = []


class ZeroCopyOffloader(_OffloaderCore):
    """Keeps the chosen layers' parameters in pinned host memory that the GPU reads directly
    over unified addressing (every forward reads the weights across the link; nothing is
    copied). For comparison with :class:`PrefetchOffloader`; same selection and validation.

    In the host test mode the parameters simply point into the host buffer.
    """

    @refuses_with_config_errors
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
        _mark_params(plan)
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
        """As :meth:`BaseOffloader.close`. The pinned buffer is not freed here: a tensor taken
        from a parameter before (a view a cache kept, say) still reads it. It goes with the last
        such view: the buffer's array holds it, and, on the device, the view holds the array.
        Where torch could view it on the device only through a storage that does not own it,
        it is kept for the life of the process."""
        if self._closed:
            return
        if self._plan.device.type == "cuda":
            torch.cuda.synchronize(self._plan.device)
        self._restore_params(restore)
        self._device_view = torch.empty(0, dtype=torch.uint8)
        if _KEEP.pop(id(self), None) is not None:
            _UNOWNED.append(self._host_arr)
        self._host = torch.empty(0, dtype=torch.uint8)
        self._host_arr = None
        self.engine.shutdown()
        # The engine owns the pinned buffer: a view still taken from a parameter keeps it (and
        # so the buffer) alive through the array; with none, the buffer goes now.
        del self.engine
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
        dptr = cuda_device_pointer(host_ptr)
    except BackendError as e:
        raise OffloadDeviceError(
            f"{e}: the pinned buffer is not mapped into the device's address space"
        ) from e
    return host_ptr if dptr is None else dptr  # no driver: unified addressing, the same address


OffloaderKind = Literal["prefetch", "sync", "zero_copy", "none"]
"""The offloaders :func:`create_offloader` makes."""


@refuses_with_config_errors
def create_offloader(
    kind: OffloaderKind, layers: Sequence[nn.Module] = (), **options: Any
) -> BaseOffloader:
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
