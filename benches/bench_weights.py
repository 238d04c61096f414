"""Forward latency of a model whose MLP weights are offloaded to pinned host memory.

    python benches/bench_weights.py [--json out.json] [--tokens 1,16,64,256,1024,4096,8192]
    python benches/bench_weights.py --small          # a tiny model; runs on the CPU too

The model: a stack of 32 SwiGLU MLP layers in bf16 (hidden 4096, intermediate 14336:
w13 [2 * 14336, 4096], w2 [4096, 14336], 352 MiB per layer, 11.3 GiB in all), half of the layers
offloaded (group_size=2, num_in_group=1: 5.6 GiB in host memory). For each batch size (tokens),
the median forward time (CUDA events between back-to-back forwards after a warm-up, so that
prefetches that straddle two forwards are counted) of:

  resident     every weight on the GPU,
  prefetch1/2  PrefetchOffloader, prefetch_step 1 and 2 (copies overlap the layers before),
  sync         the same copies issued right before each offloaded layer and waited for
               (onload, wait, compute: no overlap),
  zero_copy    ZeroCopyOffloader (the kernels read the weights over PCIe; skipped above
               --zero-copy-max-tokens, as GEMMs re-read weight tiles across the link once per
               row block and take seconds per forward at large batches).

Ratios: prefetch/resident (the cost of offloading with prefetch) and sync/prefetch (what the
prefetch saves). And per layer: one layer's compute time at each batch size against one
layer's weight-transfer time (one batched blockswap submission of its two tensors, pinned host
to device), and the batch size where the compute reaches the transfer (interpolated in log
space): past it a layer's copy can hide behind one layer of compute; with group_size=2 a copy
has two layers (one resident, one offloaded) to hide behind, the second crossover.
"""

from __future__ import annotations

import copy
import gc
import json
import math
import statistics
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import blockswap
from blockswap.weights import PrefetchOffloader, ZeroCopyOffloader
from blockswap_bench.cli import parser

MiB, GiB = 1 << 20, 1 << 30


def rms_norm(y: torch.Tensor) -> torch.Tensor:
    v = y.float()
    v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)
    return v.to(y.dtype)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inter: int, dtype: torch.dtype, device: Any) -> None:
        super().__init__()
        kw: dict[str, Any] = {"dtype": dtype, "device": device}
        self.w13_weight = nn.Parameter(torch.empty(2 * inter, hidden, **kw), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(hidden, inter, **kw), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.w13_weight).chunk(2, dim=-1)
        return rms_norm(x + F.linear(F.silu(gate) * up, self.w2_weight))


class Stack(nn.Module):
    def __init__(self, n: int, hidden: int, inter: int, dtype: torch.dtype, device: Any) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SwiGLU(hidden, inter, dtype, device) for _ in range(n))
        g = torch.Generator(device=device).manual_seed(0)
        with torch.no_grad():
            for layer in self.layers:
                for p, fan_in in ((layer.w13_weight, hidden), (layer.w2_weight, inter)):
                    p.normal_(0.0, fan_in**-0.5, generator=g)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class Timer:
    """Wall time between marks: CUDA events on the current stream, or perf_counter on the CPU."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def laps(self, fn: Any, n: int) -> list[float]:
        """Milliseconds of each of ``n`` back-to-back calls of ``fn``."""
        if self.cuda:
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
            ev[0].record()
            for i in range(n):
                fn()
                ev[i + 1].record()
            torch.cuda.synchronize()
            return [ev[i].elapsed_time(ev[i + 1]) for i in range(n)]
        marks = [time.perf_counter()]
        for _ in range(n):
            fn()
            marks.append(time.perf_counter())
        return [(b - a) * 1e3 for a, b in zip(marks, marks[1:])]


def time_forward(
    timer: Timer, model: nn.Module, x: torch.Tensor, warmup: int, iters: int, cell_s: float
) -> float:
    """Median forward milliseconds; fewer iterations for slow cells (at least 3)."""
    first = timer.laps(lambda: model(x), max(warmup, 1))
    per = max(first[-1], 1e-3)
    n = int(max(3, min(iters, cell_s * 1e3 / per)))
    return statistics.median(timer.laps(lambda: model(x), n))


def layer_transfer_ms(layer: SwiGLU, device: torch.device, reps: int) -> tuple[float, float]:
    """(milliseconds, GB/s) of one batched host-to-device submission of a layer's weights."""
    tensors = [layer.w13_weight, layer.w2_weight]
    sizes = [t.numel() * t.element_size() for t in tensors]
    total = sum(sizes)
    cuda = device.type == "cuda"
    if cuda:
        stream = torch.cuda.Stream(device=device)
        eng = blockswap.Engine("cuda", device=device.index or 0, h2d_stream=stream.cuda_stream)
    else:
        eng = blockswap.Engine("host")
    host = eng.alloc_host(total)
    dev = torch.empty(total, dtype=torch.uint8, device=device)
    eng.register(dev, kind="device")
    src = np.array([host.ctypes.data, host.ctypes.data + sizes[0]], dtype=np.int64)
    dst = np.array([dev.data_ptr(), dev.data_ptr() + sizes[0]], dtype=np.int64)
    szs = np.array(sizes, dtype=np.int64)
    times = []
    try:
        for job in range(reps + 2):
            if cuda:
                a = torch.cuda.Event(enable_timing=True)
                b = torch.cuda.Event(enable_timing=True)
                a.record(stream)
                eng.submit(job, src, dst, szs, "h2d")
                b.record(stream)
                b.synchronize()
                ms = a.elapsed_time(b)
            else:
                t0 = time.perf_counter()
                eng.submit(job, src, dst, szs, "h2d")
                eng.wait([job])
                ms = (time.perf_counter() - t0) * 1e3
            for r in eng.get_finished():
                if not r.success:
                    raise RuntimeError(f"transfer failed: {r.error}")
            if job >= 2:
                times.append(ms)
    finally:
        eng.get_finished()
        eng.unregister(dev)
        eng.free_host(host)
        eng.shutdown()
    ms = statistics.median(times)
    return ms, total / (ms / 1e3) / 1e9


def crossover(tokens: list[int], compute_ms: list[float], target_ms: float) -> float | None:
    """Smallest batch (log-linear interpolation) at which compute_ms reaches target_ms."""
    for i, (t, c) in enumerate(zip(tokens, compute_ms)):
        if c >= target_ms:
            if i == 0:
                return float(t)
            t0, c0 = tokens[i - 1], compute_ms[i - 1]
            if c == c0:
                return float(t)
            f = (target_ms - c0) / (c - c0)
            return math.exp(math.log(t0) + f * (math.log(t) - math.log(t0)))
    return None


def dispose(*objs: Any) -> None:
    del objs
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def fmt(v: float | None, nd: int = 2) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--tokens", default="1,16,64,256,1024,4096,8192")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=14336)
    ap.add_argument("--group-size", type=int, default=2)
    ap.add_argument("--num-in-group", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--cell-seconds", type=float, default=1.5, help="time per cell, roughly")
    ap.add_argument("--zero-copy-max-tokens", type=int, default=1024)
    ap.add_argument("--budget", type=float, default=170.0, help="seconds; later cells skipped")
    ap.add_argument("--small", action="store_true", help="a tiny model (runs on the CPU)")
    ap.add_argument("--device", default=None, help="cuda (default where present) or cpu")
    args = ap.parse_args()
    if args.small:
        args.layers, args.hidden, args.inter = 4, 64, 128
        args.tokens = "1,16,64"
    tokens = [int(t) for t in args.tokens.split(",")]
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    if cuda and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = torch.bfloat16 if cuda else torch.float32
    timer = Timer(cuda)
    t_start = time.perf_counter()

    def over_budget() -> bool:
        return time.perf_counter() - t_start > args.budget

    torch.set_grad_enabled(False)
    resident = Stack(args.layers, args.hidden, args.inter, dtype, device)
    layer_bytes = sum(p.numel() * p.element_size() for p in resident.layers[0].parameters())
    xs = {t: torch.randn(t, args.hidden, device=device).to(dtype) for t in tokens}
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    print(
        f"{name}: {args.layers} SwiGLU layers, hidden {args.hidden}, intermediate {args.inter}, "
        f"{dtype}, {layer_bytes / MiB:.0f} MiB per layer; offloaded: group_size="
        f"{args.group_size}, num_in_group={args.num_in_group}"
    )

    # Per layer: compute time by batch, and the transfer of its weights.
    layer = resident.layers[0]
    layer_ms = [time_forward(timer, layer, xs[t], args.warmup, args.iters * 3, 0.3) for t in tokens]
    xfer_ms, xfer_gbps = layer_transfer_ms(layer, device, reps=10)

    results: dict[str, dict[int, float | None]] = {}
    sel = {
        "group_size": args.group_size,
        "num_in_group": args.num_in_group,
        "params": ["w13_weight", "w2_weight"],
    }
    variants: list[tuple[str, Any]] = [
        ("resident", None),
        ("prefetch1", lambda m: PrefetchOffloader(m.layers, prefetch_step=1, **sel)),
        ("prefetch2", lambda m: PrefetchOffloader(m.layers, prefetch_step=2, **sel)),
        ("sync", lambda m: PrefetchOffloader(m.layers, synchronous=True, **sel)),
        ("zero_copy", lambda m: ZeroCopyOffloader(m.layers, **sel)),
    ]
    info: dict[str, Any] = {}
    for vname, make in variants:
        row: dict[int, float | None] = {}
        if make is None:
            model, off = resident, None
        else:
            model = copy.deepcopy(resident)
            t0 = time.perf_counter()
            off = make(model)
            info[vname] = {
                "setup_s": time.perf_counter() - t0,
                "offloaded_layers": len(off.offloaded_layers),
                "offloaded_gib": off.offloaded_bytes / GiB,
                "slot_gib": getattr(off, "device_bytes", 0) / GiB,
            }
        for t in tokens:
            skip = over_budget() and vname != "resident"
            if vname == "zero_copy" and t > args.zero_copy_max_tokens:
                skip = True
            warmup = 1 if vname == "zero_copy" else args.warmup
            row[t] = (
                None
                if skip
                else time_forward(timer, model, xs[t], warmup, args.iters, args.cell_seconds)
            )
            if vname == "zero_copy" and row[t] is not None and row[t] > 3e3:
                args.zero_copy_max_tokens = t  # the next sizes would take too long
        results[vname] = row
        if off is not None:
            if hasattr(off, "submissions"):
                info[vname]["submissions"] = off.submissions
            off.close(restore=False)
            dispose(model, off)
        print(f"  {vname:10s} done ({time.perf_counter() - t_start:.0f} s)")

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None or b == 0 else a / b

    rows = []
    for i, t in enumerate(tokens):
        r = {v: results[v][t] for v, _ in variants}
        rows.append(
            {
                "tokens": t,
                **{f"{v}_ms": r[v] for v, _ in variants},
                "prefetch1_over_resident": ratio(r["prefetch1"], r["resident"]),
                "prefetch2_over_resident": ratio(r["prefetch2"], r["resident"]),
                "sync_over_prefetch1": ratio(r["sync"], r["prefetch1"]),
                "sync_over_prefetch2": ratio(r["sync"], r["prefetch2"]),
                "zero_copy_over_resident": ratio(r["zero_copy"], r["resident"]),
                "layer_compute_ms": layer_ms[i],
            }
        )
    cross1 = crossover(tokens, layer_ms, xfer_ms)
    cross_group = crossover(tokens, [args.group_size * c for c in layer_ms], xfer_ms)

    head = (
        f"{'tokens':>7} {'resident':>9} {'prefetch1':>9} {'prefetch2':>9} {'sync':>9} "
        f"{'zero_copy':>9} {'p1/res':>7} {'p2/res':>7} {'sync/p1':>7} {'sync/p2':>7} "
        f"{'zc/res':>7} {'layer':>8}"
    )
    print("\nforward latency, ms (median); layer = one layer's compute, ms")
    print(head)
    for r in rows:
        print(
            f"{r['tokens']:>7} {fmt(r['resident_ms']):>9} {fmt(r['prefetch1_ms']):>9} "
            f"{fmt(r['prefetch2_ms']):>9} {fmt(r['sync_ms']):>9} {fmt(r['zero_copy_ms']):>9} "
            f"{fmt(r['prefetch1_over_resident']):>7} {fmt(r['prefetch2_over_resident']):>7} "
            f"{fmt(r['sync_over_prefetch1']):>7} {fmt(r['sync_over_prefetch2']):>7} "
            f"{fmt(r['zero_copy_over_resident']):>7} {fmt(r['layer_compute_ms'], 3):>8}"
        )
    print(
        f"\none layer's weights ({layer_bytes / MiB:.0f} MiB, one batched submission): "
        f"{xfer_ms:.2f} ms, {xfer_gbps:.1f} GB/s"
    )
    print(
        "a layer's compute reaches its transfer at "
        + (f"~{cross1:.0f} tokens" if cross1 else f"more than {tokens[-1]} tokens")
        + f"; {args.group_size} layers' compute (the window a copy hides behind) at "
        + (f"~{cross_group:.0f} tokens" if cross_group else f"more than {tokens[-1]} tokens")
    )
    print(f"total {time.perf_counter() - t_start:.0f} s")
    if args.json:
        out = {
            "device": name,
            "blockswap": blockswap.__version__,
            "torch": torch.__version__,
            "config": {
                "layers": args.layers,
                "hidden": args.hidden,
                "intermediate": args.inter,
                "dtype": str(dtype),
                "group_size": args.group_size,
                "num_in_group": args.num_in_group,
                "layer_bytes": layer_bytes,
            },
            "layer_transfer_ms": xfer_ms,
            "layer_transfer_gbps": xfer_gbps,
            "crossover_tokens_one_layer": cross1,
            "crossover_tokens_group": cross_group,
            "offloaders": info,
            "rows": rows,
        }
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
