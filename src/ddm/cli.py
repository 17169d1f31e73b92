"""The ``ddm`` command. Thin: parses arguments and delegates; heavy imports happen per command.

Exit status: 0 done; 2 a usage or input error (a bad flag, spec, file or value: the user can
fix it); 1 a failure (an operation that could not complete: a process died, a download or an
API call failed) or an internal error (a bug: its type is named, ``ddm --debug`` prints the
traceback); 130 interrupted (Ctrl-C); 143 terminated (SIGTERM) before the command was done. A
server (``ddm serve``) that drains and stops on SIGTERM is done: it exits 0.

SIGTERM ends every command from the first line of :func:`main` on, before any heavy import.
In a container ``ddm`` is PID 1, and the kernel gives PID 1 no default action for a signal it
has no handler for: without one, a pod deleted while its server still imports PyTorch or JAX
(before uvicorn, kopf or ``ddm up`` install their own handlers) would ignore the SIGTERM and
wait for the SIGKILL at the end of its grace period. A handler in ``ddm`` itself rather than an
init process (tini) as the images' entry point, because the operator's pods and the chart name
their ``command`` (``ddm ...``), which replaces an image's entry point, and because it holds in
every image (the Neuron one's base is AWS's) and outside containers. No ``ddm`` process leaves
orphans for PID 1 to reap: ``ddm up`` waits for its servers, and the servers' own children
(compilers) are waited for by whoever started them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import threading
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from ddm.checkpoints.shipped import DEFAULT_DDM
from ddm.objective_names import PREDICTIONS, SCHEDULES
from ddm.operator.commands import add_operator_commands
from ddm.runtime.commands import add_up_command
from ddm.serving.commands import add_serve_commands
from ddm.training.resume import SAVE_EVERY

EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 128 + signal.SIGTERM  # 143, as a shell reports a process SIGTERM ended


class UserError(Exception):
    """A problem with the user's input: reported as one line, exit status 2, no traceback."""


class Terminated(SystemExit):
    """SIGTERM arrived before the command was done (raised by the handler :func:`main`
    installs). A ``SystemExit`` with status 143, so that ``except Exception`` lets it through
    and ``finally`` blocks run (``ddm up`` stops its servers, a fetch removes its partial file)."""

    def __init__(self) -> None:
        super().__init__(EXIT_TERMINATED)


def main(argv: Sequence[str] | None = None) -> int:
    with _sigterm_terminates():
        parser = build_parser()
        return run(parser.parse_args(argv))


@contextlib.contextmanager
def _sigterm_terminates() -> Iterator[None]:
    """SIGTERM raises :class:`Terminated` until the block ends (then the previous handler is
    back: tests call :func:`main` in-process). Servers, kopf and ``ddm up`` replace it with
    their own while they run. Signals are the main thread's: elsewhere, nothing to do."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _terminate(signum: int, frame: object) -> None:
    raise Terminated()


def run(args: argparse.Namespace) -> int:
    """Run the parsed command's handler; its errors become a message and an exit status."""
    handler: Callable[[argparse.Namespace], int | None] = args.handler
    try:
        return int(handler(args) or 0)
    except KeyboardInterrupt:
        print("ddm: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Terminated:
        print("ddm: terminated (SIGTERM)", file=sys.stderr)
        return EXIT_TERMINATED
    except (UserError, ValueError, FileNotFoundError) as exc:
        return _fail(args, f"ddm: error: {exc}", EXIT_USAGE)
    except (RuntimeError, OSError) as exc:
        return _fail(args, f"ddm: error: {exc}", EXIT_FAILURE)
    except Exception as exc:  # a bug: say so, and where to find the details
        hint = "" if args.debug else " (run ddm --debug ... for the traceback)"
        return _fail(args, f"ddm: internal error: {type(exc).__name__}: {exc}{hint}",
                       EXIT_FAILURE)


def _fail(args: argparse.Namespace, message: str, status: int) -> int:
    """Print ``message`` (after the traceback with ``--debug``); returns ``status``."""
    if args.debug:
        traceback.print_exc()
    print(message, file=sys.stderr)
    return status


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddm", description="Decentralized Diffusion Models: train, sample, evaluate, serve.")
    parser.add_argument("--debug", action="store_true",
                        help="print the traceback of an error (before the subcommand)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_partition(commands)
    _add_train(commands)
    _add_sample(commands)
    _add_eval(commands)
    _add_report(commands)
    add_serve_commands(commands)
    _add_expert(commands)
    _add_import(commands)
    add_up_command(commands)
    add_operator_commands(commands)
    _add_fetch_checkpoint(commands)
    _add_serve_checkpoints(commands)
    return parser


# -- partition ----------------------------------------------------------------------------------

def _add_partition(commands: argparse._SubParsersAction) -> None:
    partition = commands.add_parser("partition", help="fit the data partition that experts and "
                                                      "router share, or show one")
    actions = partition.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = actions.add_parser("fit", help="k-means on the training split, written as one file "
                                       "that trainers take as --partition file:PATH")
    p.add_argument("--data", required=True,
                   help="'digits' (embedded) or 'mnist:DIR' with the four IDX files")
    p.add_argument("--kmeans", type=int, required=True, metavar="K", help="number of clusters")
    p.add_argument("--features", choices=("hog", "pixels"), default="hog",
                   help="what k-means clusters: HOG stroke directions (default) or raw pixels")
    p.add_argument("--image-size", type=int, required=True,
                   help="image side the experts train at (MNIST 32: padded 28x28)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, type=Path, help="partition JSON file to write")
    p.set_defaults(handler=_partition_fit)
    p = actions.add_parser("show", help="check a partition file's hash and print its summary")
    p.add_argument("file", type=Path)
    p.set_defaults(handler=_partition_show)


def _partition_fit(args: argparse.Namespace) -> int:
    from ddm.data.features import features_spec
    from ddm.data.partition_file import fit_partition_command

    summary = fit_partition_command(
        data=args.data, k=args.kmeans, features=features_spec(args.features),
        image_size=args.image_size, seed=args.seed, out=args.out)
    print(json.dumps(summary))
    return 0


def _partition_show(args: argparse.Namespace) -> int:
    from ddm.data.partition_file import read_partition_file

    content = read_partition_file(args.file)
    partition = {k: v for k, v in content["partition"].items() if k != "centroids"}
    print(json.dumps({"partition": partition, "fit": content.get("fit", {})}, indent=1))
    return 0


# -- train --------------------------------------------------------------------------------------

def _add_train(commands: argparse._SubParsersAction) -> None:
    train = commands.add_parser("train", help="train an expert, the monolith, the router or the "
                                              "evaluation classifier")
    kinds = train.add_subparsers(dest="kind", required=True, metavar="KIND")

    def common(p: argparse.ArgumentParser, steps: int) -> None:
        p.add_argument("--data", default="digits",
                       help="'digits' (embedded) or 'mnist:DIR' with the four IDX files")
        p.add_argument("--steps", type=int, default=steps)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--out", required=True, type=Path, help="checkpoint directory to write")
        p.add_argument("--quiet", action="store_true",
                       help="no progress bar (none either when stderr is not a terminal)")

    def optimisation(p: argparse.ArgumentParser, steps: int, batch: int, lr: float) -> None:
        common(p, steps)
        p.add_argument("--batch-size", type=int, default=batch)
        p.add_argument("--lr", type=float, default=lr, help="peak learning rate")
        p.add_argument("--save-every", type=int, default=SAVE_EVERY, metavar="STEPS",
                       help="save the training state (weights, EMA, optimiser, step) to "
                            "OUT.training/ every STEPS steps")
        p.add_argument("--resume", action="store_true",
                       help="continue from the state saved in OUT.training/")

    for kind, about in (("expert", "a UNet on one partition of the data"),
                        ("monolith", "one UNet on all the data (the baseline)")):
        p = kinds.add_parser(kind, help=f"train {about}")
        p.add_argument("--framework", choices=("torch", "jax"), default="torch")
        p.add_argument("--config", default="digits-small", help="named UNet config")
        p.add_argument("--device", default=None,
                       help="torch: cpu, cuda[:N] or xla; jax: cpu, gpu or tpu (default: best)")
        p.add_argument("--name", default=None, help="checkpoint name (default: directory name)")
        p.add_argument("--objective", choices=PREDICTIONS, default="velocity",
                       help="what the UNet predicts (default: our velocity x1 - x0)")
        p.add_argument("--schedule", choices=SCHEDULES, default="linear",
                       help="noise schedule of its inputs (default: our linear path)")
        p.add_argument("--time", choices=("continuous", "discrete"), default="continuous",
                       help="discrete: DDPM's steps k = 0..T-1, drawn uniformly")
        p.add_argument("--timesteps", type=int, default=1000, help="T, with --time discrete")
        if kind == "expert":
            p.add_argument("--partition", required=True,
                           help="'file:PATH' (from `ddm partition fit`: experts of any seed "
                                "share it), 'labels:0-4,5-9' (label groups) or 'kmeans:K' "
                                "(legacy: refitted per run)")
            p.add_argument("--index", type=int, required=True, help="which part this expert owns")
        optimisation(p, steps=1500, batch=128, lr=2e-3)
        p.set_defaults(handler=_train_unet)

    p = kinds.add_parser("router", help="train the learned router over existing experts")
    p.add_argument("--experts", required=True, type=Path,
                   help="directory holding the expert checkpoints (one subdirectory each)")
    p.add_argument("--no-labels", action="store_true", help="route on (x_t, t) alone")
    p.add_argument("--partition", default=None,
                   help="'file:PATH': refuse experts whose partition's sha256 differs from it")
    p.add_argument("--device", default=None)
    optimisation(p, steps=1500, batch=256, lr=2e-3)
    p.set_defaults(handler=_train_router)

    p = kinds.add_parser("classifier", help="train the evaluation classifier")
    p.add_argument("--image-size", type=int, default=16)
    p.add_argument("--split", choices=("train", "heldout"), default="train",
                   help="the split it learns (MNIST: train, so the test split stays unseen)")
    p.add_argument("--channels", default="32,64", help="the two conv stages' widths")
    common(p, steps=1500)
    p.set_defaults(handler=_train_classifier)
    _add_train_text2img(kinds)


def _add_train_text2img(kinds: argparse._SubParsersAction) -> None:
    from ddm.training.text2img import STAGES

    p = kinds.add_parser("text2img", help="train one stage of the text-to-image DDM (coloured "
                                          "MNIST) into a diffusers-style directory")
    p.add_argument("stage", choices=STAGES, help="what to train; each reads the stages before "
                                                 "it from --root (see scripts/train_text2img.sh)")
    p.add_argument("--mnist", required=True, type=Path,
                   help="directory with MNIST's four IDX files (coloured and captioned here)")
    p.add_argument("--root", required=True, type=Path, help="the DDM's directory")
    p.add_argument("--size", default="small", help="network sizes: small, or smoke (tests)")
    p.add_argument("--data-seed", type=int, default=0, help="seed of colours and captions")
    p.add_argument("--index", type=int, default=None, help="expert: which cluster it learns")
    p.add_argument("--steps", type=int, default=None, help="default: the stage's own")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--lr", type=float, default=None, help="peak learning rate")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--save-every", type=int, default=250, metavar="STEPS",
                   help="save the training state to ROOT/COMPONENT.training/ every STEPS steps")
    p.add_argument("--resume", action="store_true", help="continue a saved training state")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(handler=_train_text2img)


def _train_text2img(args: argparse.Namespace) -> int:
    from ddm.training.text2img.commands import StageRun, default_train, run_stage

    train = default_train(args.stage, {"steps": args.steps, "batch_size": args.batch_size,
                                       "learning_rate": args.lr, "seed": args.seed})
    run = StageRun(root=args.root, mnist=args.mnist, size=args.size, train=train,
                   data_seed=args.data_seed, index=args.index, save_every=args.save_every,
                   resume=args.resume,
                   progress=None if args.stage == "tokenizer" else _progress(
                       args, train.steps, f"text2img {args.stage}"))
    print(f"wrote {run_stage(args.stage, run)}")
    return 0


def _progress(args: argparse.Namespace, total: int, what: str):
    """A training step callback driving a progress bar (none with --quiet, or when stderr is
    not a terminal)."""
    from ddm.progress import progress_bar

    bar = progress_bar(total, what, "step", args.quiet)
    if bar.disable:
        return None

    def update(step: int, loss: float) -> None:
        bar.update(step - bar.n)
        bar.set_postfix(loss=f"{loss:.4f}")
        if step >= total:
            bar.close()

    return update


def _train_config(args: argparse.Namespace):
    from ddm.training.config import TrainConfig

    optimiser = {"batch_size": args.batch_size, "learning_rate": args.lr} if hasattr(
        args, "lr") else {}
    return TrainConfig(steps=args.steps, seed=args.seed, **optimiser)


def _train_unet(args: argparse.Namespace) -> int:
    from ddm.training.commands import train_unet, unet_objective

    objective = unet_objective(args.objective, args.schedule, args.time, args.timesteps)
    path = train_unet(
        kind=args.kind, framework=args.framework, data=args.data, model_config=args.config,
        train=_train_config(args), out=args.out, name=args.name, device=args.device,
        partition=getattr(args, "partition", None), index=getattr(args, "index", None),
        progress=_progress(args, args.steps, f"{args.kind} ({args.framework})"),
        objective=objective, save_every=args.save_every, resume=args.resume)
    print(f"wrote {path}")
    return 0


def _train_router(args: argparse.Namespace) -> int:
    from ddm.training.commands import train_router_command

    path = train_router_command(
        experts=args.experts, data=args.data, train=_train_config(args), out=args.out,
        use_labels=not args.no_labels, device=args.device,
        progress=_progress(args, args.steps, "router"), partition=args.partition,
        save_every=args.save_every, resume=args.resume)
    print(f"wrote {path}")
    return 0


def _train_classifier(args: argparse.Namespace) -> int:
    from ddm.evaluation.commands import train_classifier_command

    path = train_classifier_command(
        data=args.data, image_size=args.image_size, steps=args.steps, seed=args.seed,
        out=args.out, split=args.split, channels=_parse_channels(args.channels),
        progress=_progress(args, args.steps, "classifier"))
    print(f"wrote {path}")
    return 0


def _parse_channels(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise UserError(f"--channels must be two comma-separated integers, got {text!r}") from None


# -- sample, eval, report -----------------------------------------------------------------------

def _add_sample(commands: argparse._SubParsersAction) -> None:
    from ddm.deploy.limits import MAX_GUIDANCE_SCALE

    p = commands.add_parser(
        "sample", help="generate digits of labels, or images of prompts (a text DDM), "
                       "in-process from checkpoints, or from a running router (--router)",
        description="A label DDM: generate N_PER_LABEL images of each label and write them as "
                    "a samples .npz file (for ddm eval) and, with --png, a grid. By default "
                    "the models run in this process from the DDM make demo serves "
                    "(checkpoints/mnist, 32x32); --router asks a running router for the same "
                    "images instead. A text DDM (ddm import paris|text2img): one RGB image per "
                    "--prompt, written as a PNG (the image, or a row of them) or a samples "
                    ".npz with the prompts; the same pixels its router gives for the same "
                    "request.")
    p.add_argument("ddm", nargs="?", type=Path, default=None, metavar="DIR_OR_DDM.yaml",
                   help="the DDM to sample: its directory, or the ddm.yaml ddm import wrote "
                        "beside its stages (same as --checkpoints)")
    p.add_argument("--checkpoints", type=Path, default=None,
                   help="a DDM directory (experts + router) or one model's checkpoint "
                        f"(default: the shipped {DEFAULT_DDM} DDM, the one make demo serves)")
    p.add_argument("--router", default=None, metavar="URL",
                   help="ask the router serving at URL (`ddm up`, a cluster Service) instead: "
                        "the same images as in-process for the same arguments")
    p.add_argument("--token-file", type=Path, default=None,
                   help="with --router: a file holding the router's bearer token")
    p.add_argument("--strategy", default=None,
                   help="how each step picks experts: oracle (by label; label-partitioned "
                        "DDMs only), top1, top2, topk:K, threshold:P, ensemble, or random "
                        "(the evaluation's baseline, in-process only); default top1 (a text "
                        "DDM: the release's, e.g. Paris's top2)")
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
    p.add_argument("--guidance-scale", type=_bounded("--guidance-scale", 0.0,
                                                     MAX_GUIDANCE_SCALE),
                   default=None, metavar="SCALE",
                   help=f"a text DDM: classifier-free guidance, 0 to {MAX_GUIDANCE_SCALE:g} "
                        "(1: none; default: the release's, e.g. 7.5)")
    p.add_argument("--guidance-cutoff", type=_bounded("--guidance-cutoff", 0.0, 1.0),
                   default=1.0, metavar="FRACTION",
                   help="a text DDM: guide only the first fraction of the steps, 0 to 1 "
                        "(default 1: every step)")
    p.add_argument("--steps", type=int, default=None,
                   help="solver steps from noise to image (default 40; a text DDM: the "
                        "release's)")
    p.add_argument("--solver", default="euler",
                   help="euler (one velocity per step) or heun (two; default euler)")
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
    p.set_defaults(handler=_sample)


#: ``ddm sample``'s flags that only a text DDM takes (flag, argparse destination).
_TEXT_FLAGS = (("--prompt", "prompts"), ("--negative-prompt", "negative_prompt"),
               ("--guidance-scale", "guidance_scale"), ("--guidance-cutoff", "guidance_cutoff"))


def _bounded(flag: str, low: float, high: float) -> Callable[[str], float]:
    """An argparse type: a number in [low, high], or an error naming ``flag`` and the range."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{flag} must be a number in [{low:g}, {high:g}], "
                                             f"got {text!r}")
        return value
    return parse


def _sample(args: argparse.Namespace) -> int:
    from ddm.sampling.commands import ddm_root, is_text_ddm

    if args.ddm is not None and args.checkpoints is not None:
        raise UserError("give the DDM once: DIR_OR_DDM.yaml or --checkpoints")
    if args.router is not None:
        return _sample_router(args)
    if args.token_file is not None:
        raise UserError("--token-file goes with --router")
    source = args.ddm if args.ddm is not None else args.checkpoints
    root = None if source is None else ddm_root(source)
    if root is not None and is_text_ddm(root):
        _refuse_label_flags(args, str(root))
        from ddm.sampling.commands import sample_text_command

        return _print(sample_text_command(root, args.prompts, **_text_settings(args),
                                          backend=args.backend, device=args.device))
    _refuse_text_flags(args, str(source or DEFAULT_DDM))
    from ddm.sampling.commands import sample_command

    return _print(sample_command(
        checkpoints=root, strategy=args.strategy or "top1", labels=_parse_labels(args.labels),
        n_per_label=args.n_per_label, steps=40 if args.steps is None else args.steps,
        solver=args.solver, seed=args.seed, backend=args.backend, device=args.device,
        batch_size=256 if args.batch_size is None else args.batch_size, out=args.out,
        png=args.png, quiet=args.quiet))


def _sample_router(args: argparse.Namespace) -> int:
    local_only = [flag for flag, value in (("--checkpoints", args.checkpoints),
                                           ("DIR_OR_DDM.yaml", args.ddm),
                                           ("--device", args.device)) if value is not None]
    if args.backend != "native":
        local_only.append("--backend")
    if local_only:
        raise UserError(f"{', '.join(local_only)} run models in-process and cannot go with "
                        "--router (the router's experts run where they are served)")
    from ddm.serving.router.client import (read_token, router_info, sample_router_command,
                                           sample_router_text_command)

    token = read_token(args.token_file)
    info = router_info(args.router, token)
    what = f"the DDM at {args.router}"
    if info.get("conditioning") == "text":
        _refuse_label_flags(args, what)
        return _print(sample_router_text_command(info, args.router, args.prompts,
                                                 **_text_settings(args), token=token))
    _refuse_text_flags(args, what)
    return _print(sample_router_command(
        url=args.router, strategy=args.strategy or "top1", labels=_parse_labels(args.labels),
        n_per_label=args.n_per_label, steps=40 if args.steps is None else args.steps,
        solver=args.solver, seed=args.seed, batch_size=args.batch_size,
        token_file=args.token_file, out=args.out, png=args.png, quiet=args.quiet))


def _refuse_text_flags(args: argparse.Namespace, ddm: str) -> None:
    given = [flag for flag, dest in _TEXT_FLAGS if getattr(args, dest) not in (None, [], 1.0)]
    if given:
        raise UserError(f"{ddm} is a label DDM (conditioned on class labels): it takes "
                        f"--labels, not {', '.join(given)}")


def _refuse_label_flags(args: argparse.Namespace, ddm: str) -> None:
    given = [flag for flag, value in (("--labels", args.labels is not None),
                                      ("--n-per-label", args.n_per_label != 1)) if value]
    if given:
        raise UserError(f"{ddm} is a text DDM (conditioned on prompts): it takes --prompt, "
                        f"not {', '.join(given)}")


def _text_settings(args: argparse.Namespace) -> dict[str, Any]:
    """``ddm sample``'s settings of a text DDM's request and output, in-process or served."""
    return {"steps": args.steps, "strategy": args.strategy,
            "guidance_scale": args.guidance_scale, "negative_prompt": args.negative_prompt,
            "guidance_cutoff": args.guidance_cutoff, "seed": args.seed, "solver": args.solver,
            "batch_size": args.batch_size, "out": args.out, "png": args.png,
            "quiet": args.quiet}


def _print(summary: dict[str, Any]) -> int:
    print(json.dumps(summary))
    return 0


def _add_eval(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("eval", help="score samples .npz files (one per seed): accuracy, "
                                         "Frechet distance, precision/recall, density/coverage "
                                         "and the real-vs-real floor")
    p.add_argument("samples", type=Path, nargs="+", help="samples files, one per seed")
    p.add_argument("--classifier", type=Path, default=None,
                   help="classifier checkpoint (default: the shipped one for the samples' "
                        f"size: the {DEFAULT_DDM} DDM's for 32x32, digits' for 16x16)")
    p.add_argument("--data", default=None,
                   help="where the reference (held-out) images are, e.g. mnist:DIR "
                        "(default: the source the classifier recorded)")
    p.add_argument("--json", action="store_true", help="print JSON only")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(handler=_eval)


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


def _add_report(commands: argparse._SubParsersAction) -> None:
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
    p.add_argument("--steps", type=int, default=None,
                   help="sampling steps (default 40; a text2img DDM: its default, 30)")
    p.add_argument("--solver", default="euler", help="euler or heun")
    p.add_argument("--compare", type=Path, action="append", default=[], metavar="DIR",
                   help="another DDM directory (e.g. checkpoints/digits-heterogeneous) judged "
                        "at top-1 beside the DDM's own top-1; repeatable")
    p.add_argument("--out", type=Path, required=True,
                   help="the Markdown file to write, e.g. docs/quality.md (MNIST) or "
                        "docs/quality-digits.md (digits)")
    p.add_argument("--cache", type=Path, default=None, metavar="DIR",
                   help="keep every sampled run in DIR and reuse those already there: a "
                        "stopped report resumes, and a new monolith samples only its own rows "
                        "(keyed by the checkpoints and settings, not the code: use a fresh DIR "
                        "after changing the sampler)")
    p.add_argument("--quiet", action="store_true",
                   help="no progress bar (with stderr not a terminal: a line per run instead)")
    p.set_defaults(handler=_report)


def _report(args: argparse.Namespace) -> int:
    from ddm.evaluation.report import write_report
    from ddm.evaluation.text2img_report import is_text2img
    from ddm.progress import progress_bar

    with progress_bar(None, "report runs", "run", args.quiet) as bar:
        def progress(line: str) -> None:
            if bar.disable:  # a log, not a terminal: one line per run
                print(f"ddm report: {line}", file=sys.stderr)
            else:
                bar.update(1)
                bar.set_postfix_str(line)

        if args.checkpoints is not None and is_text2img(args.checkpoints):
            path = _report_text2img(args, progress)
            print(f"wrote {path}")
            return 0
        path = write_report(checkpoints=args.checkpoints, n_per_label=args.n_per_label,
                            steps=args.steps or 40, out=args.out, solver=args.solver,
                            data=args.data, compare=args.compare, cache=args.cache,
                            progress=progress)
    print(f"wrote {path}")
    return 0


def _report_text2img(args: argparse.Namespace, progress: Callable[[str], None]) -> Path:
    """``ddm report --checkpoints DIR`` of an imported text2img DDM (docs/quality-text2img.md),
    judged by the shipped MNIST classifier and the import's small CLIP."""
    from ddm.checkpoints.discovery import shipped_checkpoints
    from ddm.evaluation.text2img_report import mnist_directory, write_text2img_report
    from ddm.models.text2img import DEFAULT_STEPS

    if args.compare or args.solver != "euler":
        raise UserError("--compare and --solver are for label DDMs' reports")
    classifier = shipped_checkpoints(DEFAULT_DDM) / "classifier"
    return write_text2img_report(args.checkpoints, args.out, classifier,
                                 mnist_directory(classifier, args.data),
                                 steps=args.steps or DEFAULT_STEPS, cache=args.cache,
                                 progress=progress)


# -- expert -------------------------------------------------------------------------------------

def _add_expert(commands: argparse._SubParsersAction) -> None:
    expert = commands.add_parser("expert", help="work with one expert checkpoint")
    actions = expert.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = actions.add_parser("check", help="check that an expert behaves as its config.json "
                                         "declares: shapes, dtypes, finiteness, determinism, "
                                         "objective, torch/JAX parity (docs/experts.md)")
    p.add_argument("checkpoint", type=Path, help="the expert's checkpoint directory")
    p.add_argument("--backend", default="native",
                   help="run it on its own framework (native), torch or jax")
    p.add_argument("--device", default=None)
    p.add_argument("--data", default=None,
                   help="images of its classes for the objective check: digits or mnist:DIR "
                        "(default: the source its config.json records)")
    p.set_defaults(handler=_expert_check)
    p = actions.add_parser("export", help="write an expert as a self-contained exported "
                                          "program (torch.export .pt2 or jax.export StableHLO) "
                                          "that needs no Python code of its author where it "
                                          "is served (docs/experts.md)")
    p.add_argument("checkpoint", type=Path, help="the expert's checkpoint directory")
    p.add_argument("--out", type=Path, required=True,
                   help="the exported checkpoint's directory (an old one there is replaced)")
    p.add_argument("--format", choices=("torch", "jax"), default=None,
                   help="the program's framework (default: the checkpoint's; our UNet "
                        "exports to either)")
    p.set_defaults(handler=_expert_export)


def _expert_export(args: argparse.Namespace) -> int:
    from ddm.experts.export import export_expert

    done = export_expert(args.checkpoint, args.out, args.format)
    print(f"wrote {done.path} ({done.program_file}, {done.program_bytes / 1e6:.2f} MB); its "
          f"outputs match {args.checkpoint}'s network within {done.max_difference:.2g}")
    return 0


def _expert_check(args: argparse.Namespace) -> int:
    from ddm.experts.check import check_checkpoint

    verdicts = check_checkpoint(args.checkpoint, args.backend, args.device, args.data)
    for verdict in verdicts:
        print(verdict.line())
    return EXIT_FAILURE if any(v.failed for v in verdicts) else 0


# -- import ----------------------------------------------------------------------------------

def _add_import(commands: argparse._SubParsersAction) -> None:
    from ddm.deploy.limits import ACCELERATOR_TYPES, PRECISIONS

    p = commands.add_parser("import", help="convert a DDM published in another layout into our "
                                           "stage checkpoints and a DDMDeployment (ddm.yaml) "
                                           "that ddm up and the operator serve")
    sources = p.add_subparsers(dest="source", required=True, metavar="SOURCE")
    paris = sources.add_parser("paris", help="a Paris release directory (expert_0..N-1, router, "
                                             "vae, text_encoder, tokenizer): docs/paris.md")
    paris.add_argument("release", type=Path, help="the release's directory")
    paris.set_defaults(handler=_import_paris, name="paris")
    text2img = sources.add_parser("text2img", help="the text2img training's directory "
                                                   "(scripts/train_text2img.sh): "
                                                   "docs/text2img.md")
    text2img.add_argument("training", type=Path, help="the training's directory (its OUT)")
    text2img.set_defaults(handler=_import_text2img, name="text2img")
    for source in (paris, text2img):
        source.add_argument("--out", type=Path, required=True,
                            help="the new directory to write (refused if it exists)")
        source.add_argument("--name", help="the DDMDeployment's name in ddm.yaml (default: "
                                           "the source's)")
        source.add_argument("--accelerator", default="cpu", type=_accelerators,
                            metavar="TYPE[,TYPE...]",
                            help=f"where the stages run ({', '.join(ACCELERATOR_TYPES)}): "
                                 "experts cycle through the list (nvidia,neuron alternates "
                                 "them); the text encoder, decoder and router network run on "
                                 "the first, in pods of their own (in the router on cpu)")
        source.add_argument("--precision", choices=PRECISIONS, default=None,
                            help="the dtype every stage's server casts its weights to "
                                 "(default: as stored)")
        source.add_argument("--checkpoint-base", default=None, metavar="URI/",
                            help="where the DDM reads the written directory from, e.g. "
                                 "pvc://models/paris/ after copying it there (default: "
                                 "file:// and its absolute path)")


def _accelerators(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(","))


def _import_paris(args: argparse.Namespace) -> int:
    from ddm.models.paris_import import import_paris

    try:
        out = import_paris(args.release, args.out, name=args.name,
                           accelerators=args.accelerator, precision=args.precision,
                           checkpoint_base=args.checkpoint_base)
    except FileExistsError as exc:
        raise UserError(str(exc)) from None
    print(f"imported {args.release} into {out}; serve it with: ddm up {out}/ddm.yaml")
    return 0


def _import_text2img(args: argparse.Namespace) -> int:
    from ddm.models.text2img_import import import_text2img

    try:
        out = import_text2img(args.training, args.out, name=args.name,
                              accelerators=args.accelerator, precision=args.precision,
                              checkpoint_base=args.checkpoint_base)
    except FileExistsError as exc:
        raise UserError(str(exc)) from None
    print(f"imported {args.training} into {out}; serve it with: ddm up {out}/ddm.yaml")
    return 0


# -- local runtime ------------------------------------------------------------------------------

# -- checkpoints --------------------------------------------------------------------------------

def _add_fetch_checkpoint(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("fetch-checkpoint",
                            help="download and verify a checkpoint (the operator's init "
                                 "container runs this)")
    p.add_argument("uri", nargs="?",
                   help="http(s)://... (a checkpoint directory or a .tar.gz of it), "
                        "s3://BUCKET/KEY or gs://BUCKET/KEY; default $DDM_CHECKPOINT_URI (from a "
                        "Secret: a pre-signed URL's signature stays off the command line)")
    p.add_argument("dest", type=Path,
                   help="directory to create, or an empty one (a volume's mount point)")
    p.add_argument("--sha256", metavar="HEX",
                   help="pin the download: the SHA-256 of the archive, or of config.json for a "
                        "directory (default $DDM_CHECKPOINT_SHA256); needed for plain http")
    p.add_argument("--headers-file", type=Path, metavar="PATH",
                   help="HTTP headers sent to the store ('Name: value' lines, e.g. "
                        "'Authorization: Bearer ...'; a mounted Secret; default "
                        "$DDM_FETCH_HEADERS_FILE)")
    p.add_argument("--allow-network", action="append", metavar="CIDR",
                   help="a non-public network the store is in (repeatable; e.g. 10.0.3.7/32 "
                        "for an on-prem store; default $DDM_FETCH_ALLOW_NETWORKS, "
                        "comma-separated); cloud metadata addresses stay refused")
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="a host name that may resolve to a non-public address (repeatable; the "
                        "DDM's checkpoint stager Service); cloud metadata addresses stay refused")
    p.add_argument("--max-bytes", type=int, metavar="BYTES",
                   help="cap on everything downloaded and extracted (default "
                        "$DDM_FETCH_MAX_BYTES, else 16 GiB)")
    p.add_argument("--deadline", type=float, metavar="SECONDS",
                   help="time for the whole download, every file and retry included "
                        "(default: an hour)")
    p.set_defaults(handler=_fetch_checkpoint)


def _fetch_checkpoint(args: argparse.Namespace) -> int:
    import dataclasses
    import os

    from ddm.checkpoints.destinations import parse_networks
    from ddm.checkpoints.fetch import (ENV_ALLOW_NETWORKS, ENV_HEADERS_FILE, ENV_MAX_BYTES,
                                       ENV_SHA256, ENV_URI, FetchError, FetchPolicy,
                                       fetch_checkpoint, read_headers_file)
    from ddm.checkpoints.uri import redact_uri
    from ddm.serving.termination import write_termination_message

    try:
        uri = args.uri or os.environ.get(ENV_URI)
        if not uri:
            raise UserError(f"give the checkpoint URI as an argument or in ${ENV_URI}")
        if args.deadline is not None and not args.deadline > 0:
            raise UserError(f"--deadline must be a positive number of seconds, "
                            f"got {args.deadline:g}")
        networks = (args.allow_network if args.allow_network is not None
                    else os.environ.get(ENV_ALLOW_NETWORKS, "").split(","))
        try:
            policy = FetchPolicy(allowed_networks=parse_networks(networks),
                                 allowed_hosts=tuple(args.allow_host))
        except ValueError as exc:
            raise UserError(f"--allow-network: {exc}") from None
        max_bytes = (args.max_bytes if args.max_bytes is not None
                     else os.environ.get(ENV_MAX_BYTES))
        if max_bytes is not None:
            if not str(max_bytes).isdigit() or int(max_bytes) <= 0:
                raise UserError(f"--max-bytes must be a positive number of bytes, "
                                f"got {max_bytes}")
            policy = dataclasses.replace(policy, max_bytes=int(max_bytes))
        if args.deadline is not None:
            policy = dataclasses.replace(policy, deadline_s=args.deadline)
        headers_file = args.headers_file or os.environ.get(ENV_HEADERS_FILE)
        dest = fetch_checkpoint(uri, args.dest, policy,
                                sha256=args.sha256 or os.environ.get(ENV_SHA256) or None,
                                headers=read_headers_file(headers_file) if headers_file else None)
    except (UserError, FetchError) as exc:
        write_termination_message(str(exc))  # the pod's status shows it; redacted already
        raise
    print(f"fetched {redact_uri(uri)} into {dest}")
    return 0


def _add_serve_checkpoints(commands: argparse._SubParsersAction) -> None:
    from ddm.checkpoints.uri import STAGER_PORT

    p = commands.add_parser("serve-checkpoints",
                            help="serve fetched checkpoints read-only to the DDM's pods (the "
                                 "operator's checkpoint stager runs this)")
    p.add_argument("root", type=Path, help="the directory holding one checkpoint per key")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on")
    p.add_argument("--port", type=int, default=STAGER_PORT, help="port to listen on")
    p.set_defaults(handler=_serve_checkpoints)


def _serve_checkpoints(args: argparse.Namespace) -> int:
    from ddm.checkpoints.serve import serve_checkpoints

    try:
        serve_checkpoints(args.root, args.host, args.port)
    except FileNotFoundError as exc:
        raise UserError(str(exc)) from None
    return 0


def _parse_labels(text: str | None) -> list[int]:
    if text is None:
        return list(range(10))
    try:
        labels = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UserError(f"--labels must be comma-separated integers, got {text!r}") from None
    if not labels:
        raise UserError("--labels is empty")
    return labels


if __name__ == "__main__":
    sys.exit(main())
