"""``ddm sample``: its arguments, and the choice between sampling in this process
(``ddm.sampling.commands``) and asking a running router (``ddm.serving.router.api.client``).

It lives in ``serving``, the lowest area that may import both. ``ddm.cli`` adds it with
:func:`add_sample_command`. Importing this module is cheap (no framework, no NumPy): the
models or the router's client are imported only when the command runs. A bad argument is a
``ValueError`` (``ddm.cli`` reports it, exit status 2).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ddm.checkpoints.shipped import DEFAULT_DDM
from ddm.fileio import existing_path
from ddm.sampling_params import PARAMS, SamplingParams, add_sampling_flags


def add_sample_command(commands: argparse._SubParsersAction) -> None:
    """Add ``sample`` to the ``ddm`` command's subcommands."""
    p = commands.add_parser(
        "sample", help="generate digits of labels, or images of prompts (a text DDM), "
                       "in-process from checkpoints, or from a running router (--router)",
        description="Sample a DDM named by a DDMDeployment YAML (any ddm up takes: "
                    "examples/text2img.yaml, which make demo serves, examples/mnist.yaml, or "
                    "the ddm.yaml ddm import writes) or by its directory; with neither, the "
                    f"shipped {DEFAULT_DDM} DDM (checkpoints/{DEFAULT_DDM}, 32x32 digits). "
                    "Steps, solver, strategy and guidance not given are the DDM's own (its "
                    "YAML's spec.sampling), so the images are the pixels ddm up answers for "
                    "the same request. A label DDM: N_PER_LABEL images of each label, written "
                    "as a samples .npz file (for ddm eval) and, with --png, a grid. A text "
                    "DDM: one RGB image per --prompt, written as a PNG (the image, or a row "
                    "of them) or a samples .npz with the prompts. --router asks a running "
                    "router for the same images instead.")
    p.add_argument("ddm", nargs="?", type=existing_path, default=None, metavar="DIR_OR_DDM.yaml",
                   help="the DDM to sample: a DDMDeployment YAML (any ddm up takes, e.g. "
                        "examples/text2img.yaml, or the ddm.yaml ddm import wrote), or its "
                        "directory (same as --checkpoints); its sampling defaults apply")
    p.add_argument("--checkpoints", type=Path, default=None,
                   help="a DDM directory (experts + router) or one model's checkpoint "
                        f"(default: the shipped {DEFAULT_DDM} DDM)")
    p.add_argument("--router", default=None, metavar="URL",
                   help="ask the router serving at URL (`ddm up`, a cluster Service) instead: "
                        "the same images as in-process for the same arguments")
    p.add_argument("--token-file", type=Path, default=None,
                   help="with --router: a file holding the router's bearer token")
    p.add_argument("--labels", default=None,
                   help="a label DDM: comma-separated class labels to draw (default: every "
                        "digit, 0,1,...,9)")
    p.add_argument("--n-per-label", type=int, default=1,
                   help="a label DDM: images per label (default 1)")
    p.add_argument("--prompt", action="append", default=[], dest="prompts", metavar="PROMPT",
                   help="a text DDM: a prompt; one image per --prompt, in order (repeat it)")
    p.add_argument("--negative-prompt", default=None, metavar="PROMPT",
                   help="a text DDM: what guidance steers away from (default: the empty "
                        "prompt)")
    add_sampling_flags(p, default="the DDM's own: its YAML's spec.sampling, the router's "
                                  "with --router, else the declared default", evaluation=True)
    p.add_argument("--seed", type=int, default=0,
                   help="noise seed: image i of a run gets the noise (seed, i) (default 0)")
    p.add_argument("--backend", default="native",
                   help="native: each expert on the framework it was trained with (default); "
                        "torch or jax: every expert on that one (weights convert losslessly)")
    p.add_argument("--device", default=None,
                   help="torch: cpu, cuda[:N] or xla; jax: cpu, gpu or tpu (default: the "
                        "framework's best; a text DDM: cpu)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="images generated at once (default: 256; with --router, the router's "
                        "batch limit)")
    p.add_argument("--out", required=True, type=Path,
                   help="samples .npz to write (its directory must exist); a text DDM: .npz "
                        "or .png")
    p.add_argument("--png", type=Path, default=None,
                   help="also write the images as a PNG grid, one row per label (a text DDM: "
                        "one row)")
    p.add_argument("--quiet", action="store_true",
                   help="no progress bar (there is none anyway when stderr is not a terminal)")
    p.set_defaults(handler=_sample, computes_in_process=True)


#: ``ddm sample``'s flags that only a text DDM takes (flag, argparse destination).
_TEXT_FLAGS = (("--prompt", "prompts"), ("--negative-prompt", "negative_prompt"),
               ("--guidance-scale", "guidance_scale"), ("--guidance-cutoff", "guidance_cutoff"))


def _sample(args: argparse.Namespace) -> int:
    from ddm.sampling.commands import sample_source

    if args.ddm is not None and args.checkpoints is not None:
        raise ValueError("give the DDM once: DIR_OR_DDM.yaml or --checkpoints")
    if args.router is not None:
        return _sample_router(args)
    if args.token_file is not None:
        raise ValueError("--token-file goes with --router")
    source = sample_source(args.ddm if args.ddm is not None else args.checkpoints)
    if source.text:
        _refuse_label_flags(args, source.name)
        from ddm.sampling.commands import sample_text_command

        return _print(sample_text_command(source, args.prompts,
                                          **_text_settings(args, source.defaults),
                                          backend=args.backend, device=args.device))
    _refuse_text_flags(args, source.name)
    from ddm.sampling.commands import sample_command

    chosen = _chosen(args, source.defaults or SamplingParams())
    return _print(sample_command(
        source, strategy=chosen["strategy"], labels=_parse_labels(args.labels),
        n_per_label=args.n_per_label, steps=chosen["steps"], solver=chosen["solver"],
        seed=args.seed, backend=args.backend, device=args.device,
        batch_size=256 if args.batch_size is None else args.batch_size, out=args.out,
        png=args.png, quiet=args.quiet))


def _sample_router(args: argparse.Namespace) -> int:
    local_only = [flag for flag, value in (("--checkpoints", args.checkpoints),
                                           ("DIR_OR_DDM.yaml", args.ddm),
                                           ("--device", args.device)) if value is not None]
    if args.backend != "native":
        local_only.append("--backend")
    if local_only:
        raise ValueError(f"{', '.join(local_only)} run models in-process and cannot go with "
                        "--router (the router's experts run where they are served)")
    from ddm.serving.router.api.client import (read_token, router_info, sample_router_command,
                                               sample_router_text_command)

    token = read_token(args.token_file)
    info = router_info(args.router, token)
    served = info.get("defaults", {})
    defaults = SamplingParams(**{p.name: served[p.name] for p in PARAMS if p.name in served})
    what = f"the DDM at {args.router}"
    if info.get("conditioning") == "text":
        _refuse_label_flags(args, what)
        return _print(sample_router_text_command(info, args.router, args.prompts,
                                                 **_text_settings(args, defaults),
                                                 token=token))
    _refuse_text_flags(args, what)
    chosen = _chosen(args, defaults)
    return _print(sample_router_command(
        url=args.router, strategy=chosen["strategy"], labels=_parse_labels(args.labels),
        n_per_label=args.n_per_label, steps=chosen["steps"], solver=chosen["solver"],
        seed=args.seed, batch_size=args.batch_size, token_file=args.token_file, out=args.out,
        png=args.png, quiet=args.quiet))


def _chosen(args: argparse.Namespace, defaults: SamplingParams | None) -> dict[str, Any]:
    """Each sampling parameter: its flag's value, else the DDM's default (None: the
    checkpoints' own, which the in-process loader reads)."""
    return {p.name: getattr(defaults, p.name) if getattr(args, p.name) is None and defaults
            else getattr(args, p.name) for p in PARAMS}


def _refuse_text_flags(args: argparse.Namespace, ddm: str) -> None:
    given = [flag for flag, dest in _TEXT_FLAGS if getattr(args, dest) not in (None, [], 1.0)]
    if given:
        raise ValueError(f"{ddm} is a label DDM (conditioned on class labels): it takes "
                        f"--labels, not {', '.join(given)}")


def _refuse_label_flags(args: argparse.Namespace, ddm: str) -> None:
    given = [flag for flag, value in (("--labels", args.labels is not None),
                                      ("--n-per-label", args.n_per_label != 1)) if value]
    if given:
        raise ValueError(f"{ddm} is a text DDM (conditioned on prompts): it takes --prompt, "
                        f"not {', '.join(given)}")


def _text_settings(args: argparse.Namespace, defaults: SamplingParams | None
                   ) -> dict[str, Any]:
    """``ddm sample``'s settings of a text DDM's request and output, in-process or served."""
    return {**_chosen(args, defaults), "negative_prompt": args.negative_prompt,
            "seed": args.seed, "batch_size": args.batch_size, "out": args.out, "png": args.png,
            "quiet": args.quiet}


def _print(summary: dict[str, Any]) -> int:
    print(json.dumps(summary))
    return 0


def _parse_labels(text: str | None) -> list[int]:
    if text is None:
        return list(range(10))
    try:
        labels = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--labels must be comma-separated integers, got {text!r}") from None
    if not labels:
        raise ValueError("--labels is empty")
    return labels
