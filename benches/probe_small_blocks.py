"""What caps small blocks below the link, in steady state: transfers queued back to back.

    python benches/probe_small_blocks.py [--json out.json] [--depth 8]

For 4 KiB x 10,000, 16 KiB x 8,192 and 64 KiB x 2,560 blocks, each direction, `depth` transfers
queued back to back (CUDA events on one stream; median of 5 after one warm-up), as GB/s beside
the link's ceiling measured in the same run, on the same stream and buffers (256 MiB pinned
copies, 4 queued, best of 5: ``blockswap._bench.measure_ceiling``) and beside the transfers'
bytes as ``depth`` single copies queued the same way (``ceiling_same_bytes``):

- the copy kernel on 16 CTAs (32 KiB in flight per program) over scattered, sorted and contiguous
  blocks (does the address pattern matter: page translation, host memory locality?),
- the kernel on 24 CTAs, and on 16 CTAs with 8 warps and 64 KiB in flight (is it short of SMs or
  of loads in flight?),
- a fraction (5, 10, 20 %) of the blocks moved by DMA beside the kernel, on one or four streams
  of their own (does a copy engine add to what the kernel leaves of the link?),
- DMA alone, on one and on four streams (do more copy engines help?).

DMA goes through `cuda.bindings.driver.cuMemcpyBatchAsync` (NVIDIA's cuda-bindings, required), so
that it can be spread over several streams; the kernel is blockswap's `copy_blocks_raw`.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch

from blockswap._bench import measure_ceiling
from blockswap.kernels.copy import copy_blocks_raw
from blockswap_bench.cli import parser
from blockswap_bench.common import gpu_timed, median, run_metadata
from blockswap_bench.report import write_json

KiB = 1024
POINTS = ((4 * KiB, 10_000), (16 * KiB, 8192), (64 * KiB, 2560))


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--depth", type=int, default=8, help="transfers queued back to back")
    args = ap.parse_args()
    from cuda.bindings import driver

    depth = args.depth
    cap = 1 << 30
    host = torch.empty(cap, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(cap, dtype=torch.uint8, device="cuda")
    host.fill_(1)
    dev.fill_(2)
    main_s = torch.cuda.Stream()
    kernel_s = torch.cuda.Stream()
    dma_s = [torch.cuda.Stream() for _ in range(4)]
    rng = np.random.default_rng(0)

    def measure(fn, reps=6):
        return median([gpu_timed(main_s, fn)[0] for _ in range(reps)][1:])

    def attr(any_order):
        a = driver.CUmemcpyAttributes()
        order = driver.CUmemcpySrcAccessOrder
        a.srcAccessOrder = (
            order.CU_MEMCPY_SRC_ACCESS_ORDER_ANY
            if any_order
            else order.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
        )
        return a

    rows = []
    for direction in ("h2d", "d2h"):
        for size, n in POINTS:
            slots = cap // size
            src_t, dst_t = (host, dev) if direction == "h2d" else (dev, host)
            total = n * size
            big = 256 << 20

            def one_copy(nbytes, times, s=src_t, d=dst_t):
                return measure_ceiling(s, d, nbytes, main_s, 5, max_reps=5, copies=times)["gbps"]

            res = {
                "dir": direction,
                "size": size,
                "n": n,
                "ceiling_same_bytes": one_copy(total, depth),
                "link_256m": one_copy(big, 4),
            }

            def layout(kind, n=n, slots=slots, size=size, s_t=src_t, d_t=dst_t):
                if kind == "contiguous":
                    s_ids, d_ids = np.arange(n), np.arange(n)
                else:
                    s_ids = rng.choice(slots, n, replace=False)
                    d_ids = rng.choice(slots, n, replace=False)
                    if kind == "sorted":
                        s_ids.sort()
                        d_ids.sort()
                src = (s_t.data_ptr() + s_ids * size).astype(np.int64)
                dst = (d_t.data_ptr() + d_ids * size).astype(np.int64)
                return src, dst

            def run(
                src,
                dst,
                frac=0.0,
                dma_streams=1,
                ctas=16,
                warps=4,
                bb=32768,
                n=n,
                size=size,
                total=total,
                direction=direction,
            ):
                szs = np.full(n, size, np.int64)
                k = n - round(frac * n)  # the kernel's share; DMA takes the rest
                kd = [torch.from_numpy(x[:k].copy()).pin_memory() for x in (src, dst, szs)]
                calls = []
                if k < n:
                    for i, part in enumerate(np.array_split(np.arange(k, n), dma_streams)):
                        lists = (
                            [driver.CUdeviceptr(int(x)) for x in dst[part]],
                            [driver.CUdeviceptr(int(x)) for x in src[part]],
                            [int(x) for x in szs[part]],
                        )
                        calls.append((lists, driver.CUstream(dma_s[i].cuda_stream)))
                a = attr(direction == "h2d")

                def go():
                    kernel_s.wait_stream(main_s)
                    for s in dma_s:
                        s.wait_stream(main_s)
                    for _ in range(depth):
                        if k:
                            copy_blocks_raw(
                                kd[0].data_ptr(),
                                kd[1].data_ptr(),
                                kd[2].data_ptr(),
                                k,
                                max_ctas=ctas,
                                max_size=size,
                                alignment=16,
                                stream=kernel_s,
                                num_warps=warps,
                                block_bytes=bb,
                            )
                        for (dl, sl, zl), hs in calls:
                            (err, *_) = driver.cuMemcpyBatchAsync(
                                dl, sl, zl, len(zl), [a], [0], 1, hs
                            )
                            assert err == driver.CUresult.CUDA_SUCCESS, err
                    main_s.wait_stream(kernel_s)
                    for s in dma_s:
                        main_s.wait_stream(s)

                return depth * total / measure(go) / 1e9

            scattered = layout("scattered")
            res["kernel_scattered"] = run(*scattered)
            res["kernel_sorted"] = run(*layout("sorted"))
            res["kernel_contiguous"] = run(*layout("contiguous"))
            res["kernel_24cta"] = run(*scattered, ctas=24)
            res["kernel_w8_64k"] = run(*scattered, warps=8, bb=65536)
            for f in (0.05, 0.1, 0.2):
                res[f"split{f}_1s"] = run(*scattered, frac=f)
                res[f"split{f}_4s"] = run(*scattered, frac=f, dma_streams=4)
            res["dma_1s"] = run(*scattered, frac=1.0)
            res["dma_4s"] = run(*scattered, frac=1.0, dma_streams=4)
            rows.append(res)
            link = res["link_256m"]
            print(
                f"{direction} {size // KiB} KiB x {n}: "
                + " ".join(
                    f"{k}={v:.1f} ({100 * v / link:.0f}%)"
                    for k, v in res.items()
                    if isinstance(v, float)
                ),
                flush=True,
            )
    meta = run_metadata(["python", *sys.argv])
    print(json.dumps(meta))
    if args.json:
        write_json({"meta": meta, "rows": rows}, args.json)


if __name__ == "__main__":
    main()
