"""Planning: everything is validated and laid out before anything is changed."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..engine import info as _blockswap_info
from .errors import OffloadConfigError, OffloadDeviceError
from .selection import _check_group, _segments, matches_segment, select_layers

# Byte alignment of every tensor in the pinned buffer and in a slot.
_ALIGN = 512
# Attribute set on each offloaded module (refuses a second offloader on the same layer).
_MARK = "_blockswap_offloader"
#: Set on each parameter an offloader points into its memory, until it restores it: a second
#: offloader reaching the same parameter through another module (a layer's submodule, or its
#: parent) would copy from memory the first one reuses.
_PARAM_MARK = "_blockswap_offloaded"


def _mark_params(plan: _Plan) -> None:
    for lay in plan.offloaded:
        for t in lay.tensors:
            setattr(t.param, _PARAM_MARK, True)


def _unmark_params(plan: _Plan) -> None:
    for lay in plan.offloaded:
        for t in lay.tensors:
            if hasattr(t.param, _PARAM_MARK):
                delattr(t.param, _PARAM_MARK)


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
        if getattr(p, _PARAM_MARK, False):
            raise OffloadConfigError(
                f"parameter {qual} is already offloaded by another offloader (through a "
                "submodule or a parent of this layer): close that one first"
            )
        if p.is_inference():
            # torch refuses every later use of a parameter made under inference_mode whose
            # data was replaced ("Inference tensors do not track version counter").
            raise OffloadConfigError(
                f"parameter {qual} was made under torch.inference_mode(), and torch cannot "
                "point it at other memory: make the model outside inference_mode (under "
                "torch.no_grad(), say)"
            )
        if p.is_quantized or p.layout != torch.strided:
            kind = "quantized" if p.is_quantized else str(p.layout)
            raise OffloadConfigError(
                f"parameter {qual} is a {kind} tensor: only plain (strided, not quantized) "
                "tensors can be offloaded"
            )
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
