"""The benchmark suite: one command, four sections, one results folder.

    python benches/suite.py [--quick | --tiny] [--out DIR] [--only sweep,handler,bidir,interference]

Sections (each beside the link's ceiling, one large copy measured in the same run):

1. ``sweep``: block size x blocks per transfer x direction x path (one copy per block, DMA
   batch, copy kernel, the handler's automatic choice), :mod:`blockswap_bench.sweep`.
2. ``handler``: the handler with the KV-cache shapes of real models against one ``copy_`` per
   page, :mod:`blockswap_bench.handlers`.
3. ``bidir``: offload and onload at once, :mod:`blockswap_bench.bidir`.
4. ``interference``: a GEMM on the compute stream beside an onload, per path (GPU only),
   :mod:`blockswap_bench.interference`.

Output, under ``--out`` (default ``results/<date>-<gpu>[-<profile>]``): ``summary.md`` (the
tables, also printed), ``results.json`` (metadata and every row, skipped and failed ones
included, with the reason) and PNG plots. On a GPU it runs the CUDA backend; elsewhere the host
backend (memcpy), with the Triton kernel under the interpreter at tiny sizes only.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from blockswap._bench import resolve_backend
from blockswap.engine import Engine

from . import cli
from .common import Progress, run_metadata, slug
from .context import SECTIONS, Context, Profile, profile

SCHEMA = 1


def _runners() -> dict[str, Callable[..., dict[str, Any]]]:
    from . import bidir, handlers, interference, sweep

    return {
        "sweep": sweep.run,
        "handler": handlers.run,
        "bidir": bidir.run,
        "interference": interference.run,
    }


def default_out_dir(meta: dict[str, Any], backend: str, profile_name: str) -> str:
    where = slug(meta.get("gpu") or "") if backend == "cuda" else "host"
    suffix = "" if profile_name == "full" else f"-{profile_name}"
    return os.path.join("results", f"{meta['date']}-{where}{suffix}")


def run_suite(
    profile_name: str = "quick",
    *,
    backend: str = "auto",
    sections: Sequence[str] = SECTIONS,
    out_dir: str | None = None,
    overrides: dict[str, Any] | None = None,
    plots: bool = True,
    verbose: bool = True,
    argv: Sequence[str] | None = None,
    section_options: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Runs ``sections`` and returns the results (the JSON's content). With ``out_dir``, writes
    ``results.json``, ``summary.md`` and the plots there (``out_dir="default"``: the default
    folder). ``overrides`` replace fields of the :class:`~blockswap_bench.context.Profile`."""
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        raise ValueError(f"unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    backend = resolve_backend(backend)
    if backend == "host" and "blockswap.kernels.copy" not in sys.modules:
        # No GPU: Triton's kernels can only run under its interpreter, which is chosen when the
        # kernel module is imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    prof: Profile = profile(profile_name, backend)
    if overrides:
        prof = dataclasses.replace(prof, **overrides)
    log = Progress(enabled=verbose)
    meta = run_metadata(argv)
    res: dict[str, Any] = {
        "schema": SCHEMA,
        "backend": backend,
        "meta": meta,
        "profile": dataclasses.asdict(prof),
        "sections": {},
    }
    log(
        f"blockswap suite: {prof.name} profile, {backend} backend"
        f"{' on ' + meta['gpu'] if meta.get('gpu') else ''}; sections {', '.join(sections)}"
    )
    ctx = Context(prof, backend, log)
    try:  # the driver, batch-copy ABI and completion mechanism this machine gives the engine
        eng = Engine(backend)
        meta["engine"] = dict(eng.info())
        eng.shutdown()
    except Exception as e:
        meta["engine"] = {"error": f"{type(e).__name__}: {e}"}
    runners = _runners()
    t_run = time.perf_counter()
    try:
        for name in SECTIONS:
            if name not in sections:
                continue
            ctx.start_section()
            t0 = time.perf_counter()
            status, reason = "ok", None
            try:
                out = runners[name](ctx, **(section_options or {}).get(name, {}))
            except Exception as e:
                traceback.print_exc()
                status, reason = "failed", f"{type(e).__name__}: {e}"
                out = {"failed": reason, "rows": []}
            if out.get("skipped"):
                status, reason = "skipped", out["skipped"]
            failed_rows = sum(1 for r in out.get("rows", []) if r.get("status") == "failed")
            res[name] = out
            res["sections"][name] = {
                "status": status,
                "reason": reason,
                "seconds": time.perf_counter() - t0,
                "rows": len(out.get("rows", [])),
                "failed_rows": failed_rows,
            }
            log(f"{name}: {status} in {time.perf_counter() - t0:.1f} s")
        res["ceiling"] = ctx.ceilings
        if ctx.ceilings:
            # The same copies again at the end: a ceiling that moved says the run was disturbed.
            res["ceiling_after"] = {d: ctx.measure_ceiling(d) for d in ctx.ceilings}
    finally:
        ctx.free_pools()
    meta["wall_s"] = time.perf_counter() - t_run
    if out_dir is not None:
        from . import report

        if out_dir == "default":
            out_dir = default_out_dir(meta, backend, prof.name)
        os.makedirs(out_dir, exist_ok=True)
        report.remove_previous(out_dir)
        res["out_dir"] = out_dir
        if plots:
            files, why = report.write_plots(res, out_dir)
            res["plots"] = files
            res["plots_skipped"] = why
        else:
            res["plots"], res["plots_skipped"] = [], "--no-plots"
        with open(os.path.join(out_dir, "summary.md"), "w") as f:
            f.write(report.format_summary(res))
        report.write_json(res, os.path.join(out_dir, "results.json"))
    return res


def failures(res: dict[str, Any]) -> int:
    """Failed sections and failed rows of a run."""
    return sum(
        (s["status"] == "failed") + s.get("failed_rows", 0)
        for s in res.get("sections", {}).values()
    )


DESCRIPTION = (
    "blockswap's benchmark suite: sweep, handler level, bidirectional, interference; tables, "
    "JSON and PNG plots in one folder."
)


def build_parser(prog: str | None = None, default_profile: str = "full") -> argparse.ArgumentParser:
    ap = cli.parser(DESCRIPTION, json=False, backend=True, prog=prog)
    g = ap.add_mutually_exclusive_group()
    for name, what in (
        ("full", "every size, count, model and path (a few minutes on a GPU)"),
        ("quick", "the short version (under a minute)"),
        ("tiny", "seconds: a smoke test of the whole pipeline"),
    ):
        g.add_argument(
            f"--{name}",
            dest="profile",
            action="store_const",
            const=name,
            help=what + (" [default]" if name == default_profile else ""),
        )
    ap.set_defaults(profile=default_profile)
    ap.add_argument(
        "--out",
        default="default",
        help="results folder (default: results/<date>-<gpu or host>[-<profile>]); the files of "
        "an earlier run there are replaced",
    )
    ap.add_argument(
        "--only",
        default=",".join(SECTIONS),
        help=f"comma-separated sections (default: all: {','.join(SECTIONS)})",
    )
    ap.add_argument("--models", default=None, help="comma-separated model keys (handler section)")
    ap.add_argument("--no-plots", action="store_true", help="write no PNG")
    return ap


def main(
    argv: Sequence[str] | None = None, *, prog: str | None = None, default_profile: str = "full"
) -> int:
    args = build_parser(prog, default_profile).parse_args(argv)
    head = ["python", prog] if prog else [sys.argv[0]]
    return run_args(args, prog=prog, argv=[*head, *(sys.argv[1:] if argv is None else argv)])


def run_args(args: argparse.Namespace, *, prog: str | None, argv: Sequence[str]) -> int:
    """Runs the suite for parsed ``args`` (:func:`build_parser`); ``argv`` is the command line
    recorded in the results. A bad argument is one line on stderr and exit status 2."""
    name = prog or "suite"

    def error(msg: object) -> int:
        print(f"{name}: error: {msg}", file=sys.stderr)
        return 2

    sections = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown or not sections:
        return error(
            f"unknown section(s) {', '.join(map(repr, unknown)) or '(none given)'}; "
            f"choose from {', '.join(SECTIONS)}"
        )
    overrides: dict[str, Any] = {}
    if args.models:
        from .models import select

        try:
            overrides["models"] = tuple(m.key for m in select(args.models))
        except ValueError as e:
            return error(e)
    try:
        backend = resolve_backend(args.backend)
    except ValueError as e:
        return error(e)
    try:
        res = run_suite(
            args.profile,
            backend=backend,
            sections=sections,
            out_dir=args.out,
            overrides=overrides,
            plots=not args.no_plots,
            argv=list(argv),
        )
    except (ValueError, OSError) as e:
        return error(e)
    from .report import format_summary

    print()
    print(format_summary(res))
    out = res.get("out_dir")
    if out:
        files = ["summary.md", "results.json", *res.get("plots", [])]
        print(f"written to {out}/: {', '.join(files)}")
        if res.get("plots_skipped"):
            print(f"no plots: {res['plots_skipped']}")
    bad = failures(res)
    if bad:
        print(
            f"{bad} failed section(s) or row(s): see the tables and results.json", file=sys.stderr
        )
        return 1
    return 0


__all__ = ["DESCRIPTION", "SCHEMA", "build_parser", "failures", "main", "run_args", "run_suite"]
