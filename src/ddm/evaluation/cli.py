"""``ddm eval`` and ``ddm report``: their arguments, next to the evaluation they run.

``ddm.cli`` adds them with :func:`add_eval_command` and :func:`add_report_command`. Importing
this module is cheap (no framework, no NumPy): the evaluation is imported only when a command
runs. A bad argument is a ``ValueError`` (``ddm.cli`` reports it, exit status 2).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ddm.checkpoints.shipped import DEFAULT_DDM
from ddm.fileio import check_output, existing_path
from ddm.progress import JobProgress, progress_bar
from ddm.sampling_params import (DEFAULT_SOLVER, DEFAULT_STEPS, SOLVER, STEPS,
                                 add_sampling_flags)


def add_eval_command(commands: argparse._SubParsersAction) -> None:
    """Add ``eval`` to the ``ddm`` command's subcommands."""
    p = commands.add_parser("eval", help="score samples .npz files (one per seed): accuracy, "
                                         "Frechet distance, precision/recall, density/coverage "
                                         "and the real-vs-real floor")
    p.add_argument("samples", type=existing_path, nargs="+", help="samples files, one per seed")
    p.add_argument("--classifier", type=Path, default=None,
                   help="classifier checkpoint (default: the shipped one for the samples' "
                        f"size: the {DEFAULT_DDM} DDM's for 32x32, digits' for 16x16)")
    p.add_argument("--data", default=None,
                   help="where the reference (held-out) images are, e.g. mnist:DIR "
                        "(default: the source the classifier recorded)")
    p.add_argument("--json", action="store_true", help="print JSON only")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(handler=_eval, computes_in_process=True)


def _eval(args: argparse.Namespace) -> int:
    from ddm.evaluation.commands import eval_command

    result = eval_command(args.samples, args.classifier, args.data, quiet=args.quiet)
    for warning in result["warnings"]:
        print(f"ddm eval: warning: {warning}", file=sys.stderr)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"n {result['n']} per run, {result['runs']} run(s), judged by {result['classifier']}, "
          f"cpu {result['cpu_seconds']} s")
    for metric in ("accuracy", "fd", "precision", "recall", "density", "coverage"):
        floor = result["floor"].get(metric)
        real = f"   real-vs-real {_spread(floor, 3)}" if floor else ""
        print(f"{metric:<10} {_spread(result[metric], result['runs'])}{real}")
    return 0


def _spread(summary: dict[str, Any], runs: int) -> str:
    """``mean +/- std`` over runs; the mean alone for one run, which has no spread."""
    mean = f"{summary['mean']:.4f}"
    return f"{mean} +/- {summary['std']:.4f}" if runs > 1 else mean


def add_report_command(commands: argparse._SubParsersAction) -> None:
    """Add ``report`` to the ``ddm`` command's subcommands."""
    p = commands.add_parser("report", help="write a quality table (docs/quality.md): monolith "
                                           "vs DDM strategies, three seeds each, with the "
                                           "real-vs-real floor")
    p.add_argument("--checkpoints", type=Path, default=None,
                   help="a DDM directory with its monolith(s) and classifier "
                        f"(default: the shipped {DEFAULT_DDM} DDM), or an imported text2img "
                        "DDM (checkpoints/text2img: docs/quality-text2img.md)")
    p.add_argument("--data", default=None,
                   help="where the reference images are, e.g. mnist:DIR (default: the source "
                        "the classifier recorded)")
    p.add_argument("--n-per-label", type=int, default=20)
    add_sampling_flags(p, (STEPS, SOLVER), default=f"{DEFAULT_STEPS} steps, "
                       f"{DEFAULT_SOLVER}; a text2img DDM: its own steps")
    p.add_argument("--compare", type=Path, action="append", default=[], metavar="DIR",
                   help="another DDM directory (e.g. checkpoints/digits-heterogeneous) judged "
                        "at top-1 beside the DDM's own top-1; repeatable")
    p.add_argument("--out", type=Path, required=True,
                   help="the Markdown file to write, e.g. docs/quality.md (MNIST) or "
                        "docs/quality-digits.md (digits)")
    cache = p.add_mutually_exclusive_group()
    cache.add_argument("--cache", type=Path, default=None, metavar="DIR",
                       help="where every sampled run is kept and those already there reused: "
                            "a stopped report resumes, and a new monolith samples only its own "
                            "rows (keyed by the checkpoints and settings, not the code: use "
                            "--no-cache or a fresh DIR after changing the sampler; default: "
                            "$XDG_CACHE_HOME/ddm/report, else ~/.cache/ddm/report)")
    cache.add_argument("--no-cache", action="store_true",
                       help="sample every run, keep none")
    p.add_argument("--quiet", action="store_true",
                   help="no progress bar (with stderr not a terminal: a line per run, with "
                        "the samples done and the time left, instead)")
    p.set_defaults(handler=_report, computes_in_process=True)


def report_cache(args: argparse.Namespace, env: Mapping[str, str] = os.environ
                 ) -> Path | None:
    """Where ``ddm report`` keeps its runs: ``--cache DIR``, none with ``--no-cache``, else
    the user's cache directory (XDG's, as pip and Hugging Face use)."""
    if args.no_cache:
        return None
    if args.cache is not None:
        return args.cache
    return Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ddm" / "report"


def _report(args: argparse.Namespace) -> int:
    from ddm.evaluation.report import write_report
    from ddm.evaluation.text2img_report import is_text2img

    check_output(args.out, ".md", "--out")  # a typo fails now, before the cache line
    cache = report_cache(args)
    print("ddm report: " + (f"keeping sampled runs in {cache} (--no-cache: none)" if cache
                            else "keeping no sampled runs (--no-cache)"), file=sys.stderr)
    with progress_bar(None, "report", "sample", args.quiet) as bar:
        progress = JobProgress(bar, "sample",
                               log=lambda line: print(f"ddm report: {line}", file=sys.stderr))
        if args.checkpoints is not None and is_text2img(args.checkpoints):
            path = _report_text2img(args, cache, progress)
            print(f"wrote {path}")
            return 0
        path = write_report(checkpoints=args.checkpoints, n_per_label=args.n_per_label,
                            steps=args.steps or DEFAULT_STEPS, out=args.out,
                            solver=args.solver or DEFAULT_SOLVER,
                            data=args.data, compare=args.compare, cache=cache,
                            progress=progress)
    print(f"wrote {path}")
    return 0


def _report_text2img(args: argparse.Namespace, cache: Path | None,
                     progress: JobProgress) -> Path:
    """``ddm report --checkpoints DIR`` of an imported text2img DDM (docs/quality-text2img.md),
    judged by the shipped MNIST classifier and the import's small CLIP."""
    from ddm.checkpoints.discovery import shipped_checkpoints
    from ddm.evaluation.text2img_report import mnist_directory, write_text2img_report
    from ddm.models.text2img import DEFAULT_STEPS as TEXT2IMG_STEPS

    if args.compare or args.solver not in (None, DEFAULT_SOLVER):
        raise ValueError("--compare and --solver are for label DDMs' reports")
    classifier = shipped_checkpoints(DEFAULT_DDM) / "classifier"
    return write_text2img_report(args.checkpoints, args.out, classifier,
                                 mnist_directory(classifier, args.data),
                                 steps=args.steps or TEXT2IMG_STEPS, cache=cache,
                                 progress=progress)
