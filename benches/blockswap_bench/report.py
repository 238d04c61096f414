"""The suite's output: tables a person reads at a glance (markdown, printed and saved as
``summary.md``), the JSON of every row (``results.json``), and PNG plots (matplotlib, Agg)."""

from __future__ import annotations

import json
import os
import re
import textwrap
from collections.abc import Iterable, Sequence
from typing import Any

from blockswap._bench import DIRECTION, fmt_gbps, fmt_pct, table

from .common import fmt_bytes, fmt_count
from .sweep import LABELS as SWEEP_LABELS

TABLE_PATHS = ("one_copy", "per_block_copy", "dma", "kernel", "auto")


# ---- small helpers ----------------------------------------------------------------------------

#: Widest line of a table or paragraph in the summary: it reads in a terminal as it is.
WIDTH = 100

#: Column heads of the sweep's paths (short: five of them share a 100-column table).
SWEEP_HEAD = {
    "one_copy": "one copy",
    "per_block_copy": "copy_ per block",
    "dma": "DMA batch",
    "kernel": "kernel",
    "auto": "auto",
}


def _direction(d: str) -> str:
    return f"{DIRECTION.get(d, d)} ({d})"


def _table(
    head: Sequence[str],
    rows: Iterable[Sequence[str]],
    right: Sequence[bool],
    *,
    keys: int = 1,
    width: int = WIDTH,
    breaks: Sequence[int] = (),
) -> list[str]:
    """A markdown table. A row of one cell is a note (a skipped or failed point): it is listed
    under the table, not drawn as a row of it. A table wider than ``width`` is split into tables
    that each fit, every one starting with the first ``keys`` columns; a new one also starts at
    each column index in ``breaks`` (columns that belong together stay together)."""
    all_rows = [list(r) for r in rows]
    body = [r for r in all_rows if len(r) == len(head)]
    notes = [r[0] for r in all_rows if len(r) != len(head)]
    widths = [max([len(h)] + [len(r[i]) for r in body]) for i, h in enumerate(head)]

    def span(cols: Sequence[int]) -> int:
        return sum(widths[c] for c in cols) + 3 * len(cols) + 1

    groups: list[list[int]] = []
    cols = list(range(keys))
    for c in range(keys, len(head)):
        if (c in breaks or span([*cols, c]) > width) and len(cols) > keys:
            groups.append(cols)
            cols = list(range(keys))
        cols.append(c)
    groups.append(cols)
    out: list[str] = []
    for g in groups:
        if out:
            out.append("")
        out += table([head[c] for c in g], [[r[c] for c in g] for r in body], [right[c] for c in g])
    if notes:
        out.append("")
        out += [f"- {n}" for n in notes]
    return out


def _wrap(lines: list[str], width: int = WIDTH) -> list[str]:
    """Paragraphs and list items wrapped to ``width`` (table lines are left alone)."""
    out = []
    for line in lines:
        if len(line) <= width or line.startswith("|"):
            out.append(line)
            continue
        indent = len(line) - len(line.lstrip(" "))
        lead = " " * indent + ("  " if line.lstrip().startswith("- ") else "")
        out += textwrap.wrap(
            line, width, subsequent_indent=lead, break_long_words=False, break_on_hyphens=False
        )
    return out


def ok_rows(section: dict[str, Any] | None) -> list[dict[str, Any]]:
    return [r for r in (section or {}).get("rows", []) if r.get("status") == "ok"]


# ---- sweep analysis ---------------------------------------------------------------------------


def sweep_points(
    rows: list[dict[str, Any]],
) -> dict[tuple[str, int, int], dict[str, dict[str, Any]]]:
    """``{(direction, N, block): {path: row}}``."""
    out: dict[tuple[str, int, int], dict[str, dict[str, Any]]] = {}
    for r in rows:
        out.setdefault((r["direction"], r["blocks"], r["block_bytes"]), {})[r["path"]] = r
    return out


def auto_vs_best(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per point where auto and both batched paths ran: auto's bandwidth over the better of
    DMA and kernel."""
    out = []
    for (d, n, size), paths in sorted(sweep_points(rows).items()):
        a, k, m = paths.get("auto"), paths.get("kernel"), paths.get("dma")
        if not (a and k and m) or any(x["gbps"] is None for x in (a, k, m)):
            continue
        best = "kernel" if k["gbps"] >= m["gbps"] else "dma"
        out.append(
            {
                "direction": d,
                "blocks": n,
                "block_bytes": size,
                "chosen": a.get("chosen"),
                "best": best,
                "of_best": a["gbps"] / max(k["gbps"], m["gbps"]),
            }
        )
    return out


def crossovers(rows: list[dict[str, Any]]) -> dict[str, int | None]:
    """Per ``"<dir> N=<n>"``: the smallest block size from which DMA is at least as fast as the
    kernel at every larger size measured (``None``: the kernel stays ahead)."""
    by: dict[tuple[str, int], list[tuple[int, float, float]]] = {}
    for (d, n, size), paths in sweep_points(rows).items():
        k, m = paths.get("kernel"), paths.get("dma")
        if k and m and k["gbps"] is not None and m["gbps"] is not None:
            by.setdefault((d, n), []).append((size, m["gbps"], k["gbps"]))
    out: dict[str, int | None] = {}
    for (d, n), pts in sorted(by.items()):
        pts.sort()
        cross = None
        for size, dma, kern in reversed(pts):
            if dma >= kern:
                cross = size
            else:
                break
        out[f"{d} N={n}"] = cross
    return out


# ---- tables -----------------------------------------------------------------------------------


def format_summary(res: dict[str, Any]) -> str:
    meta = res.get("meta", {})
    prof = res.get("profile", {})
    lines = [
        f"# blockswap benchmark suite: {prof.get('name')} profile, {res.get('backend')} backend",
        "",
        f"- machine: {meta.get('gpu') or 'no GPU'}"
        + (f", driver {meta['driver']}" if meta.get("driver") else "")
        + (
            f", PCIe gen {meta['nvidia_smi'].get('pcie.link.gen.max')} x"
            f"{meta['nvidia_smi'].get('pcie.link.width.max')}"
            if meta.get("nvidia_smi")
            else ""
        )
        + f"; {meta.get('cpu_count')} CPUs",
        f"- versions: blockswap {meta.get('blockswap', {}).get('version')}, torch "
        f"{meta.get('torch')}, triton {meta.get('triton')}, numpy {meta.get('numpy')}, Python "
        f"{meta.get('python')}",
        f"- date: {meta.get('time')}; command: `{meta.get('command')}`",
    ]
    ceil = res.get("ceiling", {})
    after = res.get("ceiling_after", {})
    if ceil:
        what = next(iter(ceil.values())).get("what", "")
        c = ", ".join(f"{DIRECTION.get(d, d)} {v['gbps']:.2f} GB/s" for d, v in ceil.items())
        lines.append(f"- the link's ceiling ({what}): {c}")
        if after:
            a = ", ".join(f"{DIRECTION.get(d, d)} {v['gbps']:.2f}" for d, v in after.items())
            drift = max(abs(after[d]["gbps"] / ceil[d]["gbps"] - 1) for d in after if d in ceil)
            note = (
                f" (moved by up to {100 * drift:.0f} %: something else used the machine or the "
                "link during the run; compare with care)"
                if drift > 0.1
                else ""
            )
            lines.append(f"  - measured again after the run: {a} GB/s{note}")
    secs = res.get("sections", {})
    if secs:
        parts = []
        for name, s in secs.items():
            txt = f"{name} {s['seconds']:.1f} s" if s.get("seconds") is not None else name
            if s.get("status") != "ok":
                txt += f" ({s['status']}: {s.get('reason')})"
            parts.append(txt)
        lines.append(f"- sections: {'; '.join(parts)}; total {meta.get('wall_s', 0):.1f} s")
    for name, fmt in (
        ("sweep", _sweep_tables),
        ("handler", _handler_table),
        ("bidir", _bidir_table),
        ("interference", _interference_table),
    ):
        sec = res.get(name)
        if sec is None:
            continue
        lines.append("")
        if sec.get("skipped"):
            lines.append(f"## {name}: skipped ({sec['skipped']})")
            continue
        if sec.get("failed"):
            lines.append(f"## {name}: failed ({sec['failed']})")
            continue
        lines.extend(fmt(sec, res))
    return "\n".join(_wrap(lines)) + "\n"


_CAP = re.compile(r"^(?P<total>.+) per transfer is over the (?P<cap>.+) cap$")


def _unmeasured(points: list[tuple[int, str]], n: int) -> str:
    """One note for the block sizes of a table that were not measured at all."""
    caps = [_CAP.match(reason) for _, reason in points]
    if all(caps) and len({m["cap"] for m in caps if m}) == 1:
        cap = caps[0]["cap"] if caps[0] else ""
        sizes = ", ".join(fmt_bytes(size) for size, _ in points)
        return (
            f"Not measured: {sizes} (x {fmt_count(n)} blocks is over the {cap} cap per transfer)."
        )
    return "Not measured: " + "; ".join(f"{fmt_bytes(z)}: {why}" for z, why in points) + "."


def _sweep_tables(sec: dict[str, Any], res: dict[str, Any]) -> list[str]:
    rows = sec["rows"]
    points = sweep_points(rows)
    host = res.get("backend") == "host"
    timing = "CUDA events" if sec.get("timing") == "cuda_events" else "wall clock"
    out = [
        "## Sweep: GB/s (percent of the link's ceiling)",
        "",
        f"Scattered blocks, {timing}; medians. 'one copy' moves the same bytes in one contiguous "
        "copy; 'copy_ per block' is one copy call per block; 'auto' is the handler's own choice "
        "(the last table names it, with its bandwidth over the better of DMA and kernel, and the "
        "host time to submit).",
    ]
    if host:
        out += [
            "",
            "Host backend: 'GPU' memory is a second host buffer and every path is memcpy; the "
            "ceiling is one large memcpy through DRAM, and transfers small enough to stay in the "
            "CPU's caches beat it (over 100 %). The kernel runs under Triton's interpreter.",
        ]
    notes: dict[str, int] = {}

    def cell(r: dict[str, Any] | None) -> str:
        if r is None:
            return "-"
        if r["status"] == "ok":
            return f"{fmt_gbps(r['gbps'])} ({fmt_pct(r.get('fraction_of_ceiling'))})"
        reason = str(r.get("reason"))
        if reason not in notes:
            notes[reason] = len(notes) + 1
        return f"{r['status']} [{notes[reason]}]"

    combos = sorted({(d, n) for d, n, _ in points}, key=lambda x: (x[0] != "h2d", x[1]))
    for d, n in combos:
        ceiling = next((r["ceiling_gbps"] for r in rows if r["direction"] == d), None)
        out += [
            "",
            f"### {_direction(d)}, N = {fmt_count(n)} (ceiling {fmt_gbps(ceiling)} GB/s)",
            "",
        ]
        body, skipped = [], []
        for size in sorted(s for dd, nn, s in points if (dd, nn) == (d, n)):
            paths = points[(d, n, size)]
            if (
                all(r["status"] == "skipped" for r in paths.values())
                and len({r["reason"] for r in paths.values()}) == 1
            ):
                skipped.append((size, str(next(iter(paths.values()))["reason"])))
                continue
            body.append([fmt_bytes(size)] + [cell(paths.get(p)) for p in TABLE_PATHS])
        head = ["block"] + [SWEEP_HEAD[p] for p in TABLE_PATHS]
        if body:
            out += _table(head, body, [True] * len(head))
        if skipped:
            out += [*([""] if body else []), _unmeasured(skipped, n)]
    if notes:
        out += [""] + [f"[{i}] {reason}" for reason, i in notes.items()]

    vs = {(v["direction"], v["blocks"], v["block_bytes"]): v for v in auto_vs_best(rows)}
    body = []
    for (d, n, size), paths in sorted(
        points.items(), key=lambda x: (x[0][0] != "h2d", x[0][1], x[0][2])
    ):
        a = paths.get("auto")
        if not any(r["status"] == "ok" for r in paths.values()):
            continue
        v = vs.get((d, n, size))
        body.append(
            [
                DIRECTION.get(d, d),
                fmt_count(n),
                fmt_bytes(size),
                (a or {}).get("chosen") or "-",
                fmt_pct(v["of_best"]) if v else "-",
                *(
                    f"{paths[p]['submit_us']:.0f}"
                    if paths.get(p) and paths[p].get("submit_us") is not None
                    else "-"
                    for p in ("dma", "kernel", "auto")
                ),
            ]
        )
    if body:
        out += [
            "",
            "### auto's choice, and host time to submit one transfer (µs)",
            "",
            "'of best': auto's bandwidth over the better of DMA and kernel at that point.",
            "",
        ]
        head = [
            "direction",
            "N",
            "block",
            "auto chose",
            "of best",
            "DMA µs",
            "kernel µs",
            "auto µs",
        ]
        out += _table(head, body, [False, True, True, False, True, True, True, True], keys=3)
    summary = auto_vs_best(rows)
    if summary:
        good = [v for v in summary if v["of_best"] >= 0.9]
        worst = min(summary, key=lambda v: v["of_best"])
        out += [
            "",
            f"- auto reached at least 90 % of the better batched path at {len(good)} of "
            f"{len(summary)} points (worst: {fmt_pct(worst['of_best'])}, "
            f"{DIRECTION.get(worst['direction'])} {fmt_bytes(worst['block_bytes'])} x "
            f"{fmt_count(worst['blocks'])}: chose {worst['chosen']}, the faster batched path "
            f"there was {worst['best']}).",
        ]
    cross = crossovers(rows)
    if cross and not host:  # under the interpreter the kernel is never the faster path
        txt = "; ".join(f"{k}: {fmt_bytes(v) if v else 'never'}" for k, v in cross.items())
        out.append(f"- DMA at least as fast as the kernel from this block size up: {txt}.")
    return out


def _handler_table(sec: dict[str, Any], res: dict[str, Any]) -> list[str]:
    rows = sec["rows"]
    out = ["## Handler level: real models' KV caches", ""]
    ok = [r for r in rows if r.get("status") == "ok"]
    if ok:
        reps = next((r["reps"] for r in ok if r["path"] == "auto"), None)
        warm = ok[0].get("warmup")
        out.append(
            f"{ok[0]['blocks_per_transfer']} scattered blocks per transfer, every layer; "
            f"`transfer_async` host time, then `get_finished` polled until done (end to end, "
            f"wall clock); {warm} warm-up + {reps} measured (auto). Baselines, same process: "
            f"{sec.get('baseline')} ('per page'); {sec.get('baseline_block')} ('per block')."
        )
        out.append("")
    body = []
    for r in rows:
        what = f"{r['name']}"
        d = DIRECTION.get(r["direction"], r["direction"])
        path = r["path"] + (f" -> {r['chosen']}" if r["path"] == "auto" and r.get("chosen") else "")
        if r["status"] != "ok":
            body.append([f"{what} {d} {path}: {r['status']}, {r['reason']}"])
            continue
        shape = f"{r['layers']} x {fmt_bytes(r['page_bytes'])}" + (
            f", {r['groups']} groups" if r.get("groups", 1) > 1 else ""
        )
        body.append(
            [
                what,
                d,
                path,
                fmt_gbps(r["gbps"]),
                fmt_pct(r.get("fraction_of_ceiling")),
                shape,
                fmt_bytes(r["bytes_per_transfer"]),
                f"{r['transfer_async_us_median']:.1f} / {r['transfer_async_us_p90']:.1f}",
                f"{r['get_finished_empty_us']:.2f}" if r.get("get_finished_empty_us") else "",
                fmt_gbps(r.get("baseline_gbps")),
                f"{r['speedup_vs_baseline']:.1f}x" if r.get("speedup_vs_baseline") else "-",
                fmt_gbps(r.get("baseline_block_gbps")),
                f"{r['speedup_vs_block_loop']:.1f}x" if r.get("speedup_vs_block_loop") else "-",
            ]
        )
    head = [
        "model",
        "direction",
        "path",
        "GB/s",
        "of ceiling",
        "layers x page",
        "per transfer",
        "submit µs med / p90",
        "empty poll µs",
        "per page GB/s",
        "speedup",
        "per block GB/s",
        "speedup",
    ]
    right = [False, False, False, True, True, False, True, True, True, True, True, True, True]
    out += _table(head, body, right, keys=3, breaks=(7, 9))
    return out


def _bidir_table(sec: dict[str, Any], res: dict[str, Any]) -> list[str]:
    h2d, d2h = DIRECTION["h2d"], DIRECTION["d2h"]
    out = [
        "## Bidirectional: onload and offload at once (GB/s)",
        "",
        "'both' runs the two directions together (their own streams); 'aggregate' is the bytes of "
        "both over the time until the later one ended; 'duplex gain' is the aggregate over the "
        "faster direction alone (2: full duplex). 'handler': the default handler, the block its "
        "page size, over separately allocated layer tensors (on a GPU the staged plan at small "
        "pages), wall clock as a caller waits.",
        "",
    ]
    body = []
    for r in sec["rows"]:
        block = fmt_bytes(r["block_bytes"]) if r.get("block_bytes") else "one copy"
        if r["status"] != "ok":
            body.append(
                [f"{r['path']} {block} x {fmt_count(r['blocks'])}: {r['status']}, {r['reason']}"]
            )
            continue
        body.append(
            [
                r["path"],
                block,
                fmt_count(r["blocks"]),
                fmt_bytes(r["bytes_per_direction"]),
                fmt_gbps(r.get("h2d_alone_gbps")),
                fmt_gbps(r.get("d2h_alone_gbps")),
                fmt_gbps(r.get("both_h2d_gbps")),
                fmt_gbps(r.get("both_d2h_gbps")),
                fmt_gbps(r.get("aggregate_gbps")),
                fmt_pct(r.get("aggregate_fraction_of_ceiling")),
                f"{r['duplex_gain']:.2f}" if r.get("duplex_gain") else "-",
            ]
        )
    head = [
        "path",
        "block",
        "N",
        "per direction",
        f"{h2d} alone",
        f"{d2h} alone",
        f"both: {h2d}",
        f"both: {d2h}",
        "aggregate",
        "of both ceilings",
        "duplex gain",
    ]
    out += _table(head, body, [False] + [True] * 10, keys=2, breaks=(6,))
    return out


def _interference_table(sec: dict[str, Any], res: dict[str, Any]) -> list[str]:
    out = [
        f"## Interference: a GEMM on the compute stream beside a {DIRECTION['h2d']} onload",
        "",
        f"{sec.get('gemm')}; copies: {sec.get('copies')}. auto: {sec.get('auto_route')}. "
        "'outlasted': the copies were still running when the GEMMs ended (so every GEMM ran "
        "beside them).",
        "",
    ]
    body = []
    for r in sec["rows"]:
        first = [
            r["path"],
            str(r["ctas"]) if r.get("ctas") else "-",
            fmt_bytes(r["launch_bytes"]) if r.get("launch_bytes") else "-",
        ]
        if r["status"] != "ok":
            body.append([f"{' '.join(first)}: {r['status']}, {r['reason']}"])
            continue
        body.append(
            [
                *first,
                f"{r['gemm_alone_ms']:.3f}",
                f"{r['gemm_with_copy_ms']:.3f}",
                f"{r['slowdown_pct']:+.1f} %",
                fmt_gbps(r["copy_gbps_wall"]),
                "yes" if r.get("copies_outlasted_gemms") else "no",
            ]
        )
    head = [
        "path",
        "CTAs",
        "per launch",
        "GEMM ms alone",
        "GEMM ms beside",
        "slowdown",
        "copies GB/s",
        "outlasted",
    ]
    out += _table(head, body, [False, True, True, True, True, True, True, False])
    return out


# ---- files ------------------------------------------------------------------------------------


def remove_previous(out_dir: str) -> list[str]:
    """Removes the files an earlier run wrote into ``out_dir`` (those its ``results.json``
    names: the summary, the JSON, its plots), so that a rerun leaves no stale plot behind.
    Nothing else in the folder is touched. Returns the names removed."""
    path = os.path.join(out_dir, "results.json")
    try:
        with open(path) as f:
            plots = json.load(f).get("plots") or []
    except (OSError, ValueError, AttributeError):
        plots = []
    removed = []
    for name in ["summary.md", "results.json", *plots]:
        if not isinstance(name, str) or os.path.basename(name) != name:
            continue  # only plain file names of this folder
        try:
            os.remove(os.path.join(out_dir, name))
        except OSError:
            continue
        removed.append(name)
    return removed


def write_json(res: dict[str, Any], path: str) -> None:
    with open(path, "w") as f:
        json.dump(res, f, indent=1, default=str)
        f.write("\n")


def write_plots(res: dict[str, Any], out_dir: str) -> tuple[list[str], str | None]:
    """PNG files written (names relative to ``out_dir``), or why none could be."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return [], f"matplotlib is not installed ({e}): pip install 'blockswap[bench]'"
    files: list[str] = []
    for fn in (_plot_sweep, _plot_handler, _plot_bidir, _plot_interference):
        for name, fig in fn(res, plt):
            fig.savefig(os.path.join(out_dir, name), dpi=110, bbox_inches="tight")
            plt.close(fig)
            files.append(name)
    return files, None


_STYLE = {
    "one_copy": {"color": "0.6", "linestyle": ":", "marker": "."},
    "per_block_copy": {"color": "tab:red", "marker": "v"},
    "dma": {"color": "tab:blue", "marker": "s"},
    "kernel": {"color": "tab:green", "marker": "^"},
    "auto": {"color": "black", "marker": "o", "markerfacecolor": "none", "linestyle": "--"},
}


def _backend_note(res: dict[str, Any]) -> str:
    return " (host backend: memcpy, no GPU)" if res.get("backend") == "host" else ""


def _footnote(ax: Any, lines: list[str], below: float) -> None:
    """Notes ``below`` points under the axes (clear of their labels and legend): what the
    figure leaves out, and why. The saved figure grows to hold them (``bbox_inches="tight"``)."""
    if lines:
        ax.annotate(
            "\n".join(lines),
            xy=(0, 0),
            xycoords="axes fraction",
            xytext=(0, -below),
            textcoords="offset points",
            ha="left",
            va="top",
            fontsize=7.5,
            color="0.3",
        )


#: A series whose best point is this many times below the worst point of the others is left out
#: of a log-scale sweep plot (it would squash them into the top of the figure) and named in a note.
OFF_CHART = 30.0


def _plot_sweep(res: dict[str, Any], plt: Any) -> list[tuple[str, Any]]:
    import matplotlib.ticker

    sec = res.get("sweep") or {}
    rows = sec.get("rows", [])
    points = sweep_points(rows)
    host = res.get("backend") == "host"
    out = []
    for d, n in sorted({(d, n) for d, n, _ in points}):
        all_sizes = sorted(s for dd, nn, s in points if (dd, nn) == (d, n))
        series: dict[str, tuple[list[int], list[float]]] = {}
        for path in TABLE_PATHS:
            xs, ys = [], []
            for s in all_sizes:
                r = points[(d, n, s)].get(path)
                if r and r["status"] == "ok" and r["gbps"]:
                    xs.append(s)
                    ys.append(float(r["gbps"]))
            if xs:
                series[path] = (xs, ys)
        if not series:
            continue
        notes = []
        for path, (_, ys) in list(series.items()):
            others = [y for p, (_, v) in series.items() if p != path for y in v]
            if others and max(ys) * OFF_CHART < min(others):
                del series[path]
                why = " (Triton's interpreter: no GPU)" if host and path == "kernel" else ""
                notes.append(
                    f"{SWEEP_LABELS[path]} left out, {fmt_gbps(min(ys))}-{fmt_gbps(max(ys))} GB/s{why}: over "
                    f"{min(others) / max(ys):.0f}x below every other point"
                )
        sizes = sorted({x for xs, _ in series.values() for x in xs})
        missing = [s for s in all_sizes if s not in sizes]
        if missing:
            reasons = {
                str(r.get("reason"))
                for s in missing
                for r in points[(d, n, s)].values()
                if r.get("reason")
            }
            cap = {m["cap"] for m in map(_CAP.match, reasons) if m}
            why = f"over the {cap.pop()} cap per transfer" if len(cap) == 1 else "see summary.md"
            notes.append(f"not measured: {', '.join(fmt_bytes(s) for s in missing)} ({why})")
        fig, ax = plt.subplots(figsize=(7.5, 4.5))
        for path, (xs, ys) in series.items():
            ax.plot(xs, ys, label=SWEEP_LABELS[path], **_STYLE[path])
        ceiling = next((r["ceiling_gbps"] for r in rows if r["direction"] == d), None)
        if ceiling:
            ax.axhline(ceiling, color="tab:purple", linestyle="-.", linewidth=1)
            ax.annotate(
                f"{'memcpy ' if host else ''}ceiling {ceiling:.1f} GB/s",
                (sizes[0], ceiling),
                xytext=(2, 3),
                textcoords="offset points",
                color="tab:purple",
                fontsize=8,
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        lo, hi = ax.get_ylim()
        few = hi / max(lo, 1e-12) <= 300  # label 2 and 5 between the decades when few decades
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(
            matplotlib.ticker.FuncFormatter(
                lambda v, _, few=few: f"{v:g}" if few and f"{v:.0e}"[0] in "25" else ""
            )
        )
        ax.tick_params(axis="y", which="minor", labelsize=7)
        ax.set_xticks(sizes)
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_xticklabels([fmt_bytes(s).replace(" ", "") for s in sizes], rotation=45, fontsize=8)
        if len(sizes) == 1:
            ax.set_xlim(sizes[0] / 2, sizes[0] * 2)
        ax.set_xlabel("block size")
        ax.set_ylabel("GB/s")
        ax.set_title(
            f"{_direction(d)}, N = {fmt_count(n)} scattered blocks{_backend_note(res)}", fontsize=10
        )
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
        _footnote(ax, notes, below=62)
        out.append((f"sweep_{d}_n{n}.png", fig))
    return out


def _plot_handler(res: dict[str, Any], plt: Any) -> list[tuple[str, Any]]:
    rows = [r for r in ok_rows(res.get("handler")) if r["path"] == "auto"]
    if not rows:
        return []
    models = list(dict.fromkeys(r["name"] for r in rows))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.38
    colors = {"d2h": "tab:blue", "h2d": "tab:orange"}
    for i, d in enumerate(("d2h", "h2d")):
        by = {r["name"]: r for r in rows if r["direction"] == d}
        xs = [k + (i - 0.5) * width for k in range(len(models))]
        sp = [by[m]["speedup_vs_baseline"] or 0 if m in by else 0 for m in models]
        bars = ax1.bar(xs, sp, width, label=DIRECTION[d], color=colors[d])
        ax1.bar_label(
            bars, labels=[f"{v:.0f}x" if v >= 10 else f"{v:.1f}x" for v in sp], fontsize=7
        )
        gb = [by[m]["gbps"] if m in by else 0 for m in models]
        base = [by[m].get("baseline_gbps") or 0 if m in by else 0 for m in models]
        ax2.bar(xs, gb, width, label=DIRECTION[d], color=colors[d])
        ax2.scatter(
            xs,
            base,
            marker="_",
            s=200,
            color="black",
            zorder=3,
            label="one copy per page" if i else None,
        )
    for ax in (ax1, ax2):
        ax.set_xticks(range(len(models)))
        ax.set_xticklabels(models, rotation=20, ha="right", fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    ax1.axhline(1, color="black", linewidth=0.8)
    ax1.set_ylabel("speedup over one copy per page")
    ax1.set_title(f"handler speedup per model{_backend_note(res)}", fontsize=10)
    ax1.legend(fontsize=8)
    ceil = res.get("ceiling", {})
    for d, style in (("d2h", ":"), ("h2d", "-.")):
        if d in ceil:
            ax2.axhline(
                ceil[d]["gbps"],
                color=colors[d],
                linestyle=style,
                linewidth=1,
                label=f"ceiling {DIRECTION[d]}",
            )
    ax2.set_ylabel("GB/s end to end")
    ax2.set_title(f"handler bandwidth per model{_backend_note(res)}", fontsize=10)
    ax2.legend(fontsize=7, bbox_to_anchor=(1.01, 1), loc="upper left")
    return [("handler_speedup.png", fig)]


def _plot_bidir(res: dict[str, Any], plt: Any) -> list[tuple[str, Any]]:
    sec = res.get("bidir") or {}
    rows = ok_rows(sec)
    if not rows:
        return []
    labels = [
        r["path"] if not r.get("block_bytes") else f"{r['path']}\n{fmt_bytes(r['block_bytes'])}"
        for r in rows
    ]
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(rows)), 4.5))
    width = 0.27
    for i, (key, name, color) in enumerate(
        (
            ("h2d_alone_gbps", f"{DIRECTION['h2d']} alone", "tab:orange"),
            ("d2h_alone_gbps", f"{DIRECTION['d2h']} alone", "tab:blue"),
            ("aggregate_gbps", "both at once (aggregate)", "tab:green"),
        )
    ):
        xs = [k + (i - 1) * width for k in range(len(rows))]
        ax.bar(xs, [r.get(key) or 0 for r in rows], width, label=name, color=color)
    ceil = sec.get("ceiling_gbps", {})
    if ceil:
        ax.axhline(
            sum(ceil.values()),
            color="tab:purple",
            linestyle="-.",
            linewidth=1,
            label="sum of both ceilings",
        )
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("GB/s")
    ax.set_title(f"bidirectional transfers{_backend_note(res)}", fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    left_out = [
        f"{r['path']} {fmt_bytes(r['block_bytes']) if r.get('block_bytes') else ''}: "
        f"{r['status']} ({r.get('reason')})"
        for r in sec.get("rows", [])
        if r.get("status") != "ok"
    ]
    _footnote(ax, left_out, below=80)
    return [("bidir.png", fig)]


def _plot_interference(res: dict[str, Any], plt: Any) -> list[tuple[str, Any]]:
    rows = ok_rows(res.get("interference"))
    if not rows:
        return []
    labels = [
        r["path"]
        + (f"\n{r['ctas']} CTAs" if r.get("ctas") else "")
        + (f"\n{fmt_bytes(r['launch_bytes'])}/launch" if r.get("launch_bytes") else "")
        for r in rows
    ]
    fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(rows)), 4))
    bars = ax.bar(range(len(rows)), [r["slowdown_pct"] for r in rows], color="tab:orange")
    ax.bar_label(bars, labels=[f"{r['slowdown_pct']:+.1f} %" for r in rows], fontsize=8)
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("GEMM slowdown beside the copies, %")
    ax.set_title(f"a GEMM beside a {DIRECTION['h2d']} onload", fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    return [("interference.png", fig)]
