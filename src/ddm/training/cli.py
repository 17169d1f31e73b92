"""``ddm train`` and ``ddm partition``: their arguments, next to the trainers they drive.

``ddm.cli`` adds them with :func:`add_train_command` and :func:`add_partition_command`.
Importing this module is cheap (no framework, no NumPy): the trainers are imported only when a
command runs. A bad argument is a ``ValueError`` (``ddm.cli`` reports it, exit status 2). A
training command that fails also leaves its error as the termination message
(``ddm.termination``), which a DDMTraining's status repeats.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ddm.objective_names import PREDICTIONS, SCHEDULES
from ddm.training.resume import SAVE_EVERY

if TYPE_CHECKING:  # imported where a command runs, so that this module stays cheap
    from ddm.training.config import TrainConfig


Handler = Callable[[argparse.Namespace], int]


def _says_why_it_failed(handler: Handler) -> Handler:
    """``handler``, whose error is also left as the termination message (``ddm.termination``:
    a training job's pod shows it, and the operator copies it into the DDMTraining's status),
    then raised for ``ddm.cli`` to report as any command's."""
    @functools.wraps(handler)
    def run(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except Exception as exc:
            from ddm.termination import write_termination_message

            write_termination_message(f"{type(exc).__name__}: {exc}")
            raise
    return run


def add_train_command(commands: argparse._SubParsersAction) -> None:
    """Add ``train`` (and its kinds) to the ``ddm`` command's subcommands."""
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
        _progress_log_option(p)
        p.add_argument("--upload", metavar="URI",
                       help="s3://BUCKET/KEY or gs://BUCKET/KEY: once trained, upload the "
                            "checkpoint there as KEY.tar.gz, then its marker KEY.tar.gz.json "
                            "(rank 0; ddm.checkpoints.upload)")
        p.add_argument("--store-credentials-file", type=Path, metavar="PATH",
                       help="the store's own credentials for --upload (an AWS shared "
                            "credentials file, a Google service-account key); default: the "
                            "cloud's credential chain")

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
        p.set_defaults(handler=_says_why_it_failed(_train_unet))

    p = kinds.add_parser("router", help="train the learned router, over existing experts or "
                                        "beside them (--partition and --config)")
    p.add_argument("--experts", default=None, type=Path,
                   help="directory holding the expert checkpoints (one subdirectory each), "
                        "which give the partition and the image shape")
    p.add_argument("--no-labels", action="store_true", help="route on (x_t, t) alone")
    p.add_argument("--partition", default=None,
                   help="without --experts: what the experts train on, 'file:PATH' or "
                        "'labels:0-4,5-9'; with --experts: 'file:PATH', refusing experts "
                        "whose partition's sha256 differs from it")
    p.add_argument("--config", action="append", default=None,
                   help="without --experts: the experts' named UNet config (their image "
                        "side, channels and classes); repeated, every distinct one of the "
                        "experts', which must agree on those")
    p.add_argument("--device", default=None)
    optimisation(p, steps=1500, batch=256, lr=2e-3)
    p.set_defaults(handler=_says_why_it_failed(_train_router))

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
    p.add_argument("--clusters", type=int, default=None,
                   help="partition: k, the clusters of k-means, one expert each (default 4)")
    p.add_argument("--steps", type=int, default=None, help="default: the stage's own")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--lr", type=float, default=None, help="peak learning rate")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--save-every", type=int, default=250, metavar="STEPS",
                   help="save the training state to ROOT/COMPONENT.training/ every STEPS steps")
    p.add_argument("--resume", action="store_true", help="continue a saved training state")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    _progress_log_option(p)
    p.set_defaults(handler=_says_why_it_failed(_train_text2img))


def _progress_log_option(p: argparse.ArgumentParser) -> None:
    """``--progress-log SECONDS``, which :func:`_progress` reads."""
    p.add_argument("--progress-log", type=float, default=None, metavar="SECONDS",
                   help="print 'ddm-progress step DONE/TOTAL' on stderr at most every "
                        "SECONDS and at the end (a supervisor reads it from the logs)")


def _train_text2img(args: argparse.Namespace) -> int:
    from ddm.training.distributed import torch_world
    from ddm.training.text2img.commands import StageRun, default_train, run_stage

    train = default_train(args.stage, {"steps": args.steps, "batch_size": args.batch_size,
                                       "learning_rate": args.lr, "seed": args.seed})
    with torch_world("cpu") as (world, _):  # the stages train on the CPU
        run = StageRun(root=args.root, mnist=args.mnist, size=args.size, train=train,
                       data_seed=args.data_seed, index=args.index,
                       **({"clusters": args.clusters} if args.clusters is not None else {}),
                       save_every=args.save_every,
                       resume=args.resume, world=world,
                       progress=None if args.stage == "tokenizer" or not world.writer else
                       _progress(args, train.steps, f"text2img {args.stage}"))
        _report(run_stage(args.stage, run), args)
    return 0


def _progress(args: argparse.Namespace, total: int,
              what: str) -> Callable[[int, float], None] | None:
    """A training step callback driving a progress bar (none with --quiet, or when stderr is
    not a terminal) and, with ``--progress-log SECONDS``, printing a progress line on stderr
    at most every SECONDS (and at the last step) for a supervisor to read from the logs."""
    import sys
    import time

    from ddm.progress import progress_bar, progress_line

    bar = progress_bar(total, what, "step", args.quiet)
    every = getattr(args, "progress_log", None)
    if bar.disable and every is None:
        return None
    logged = [-float("inf")]  # when the last line was printed (monotonic seconds)

    def update(step: int, loss: float) -> None:
        if not bar.disable:
            bar.update(step - bar.n)
            bar.set_postfix(loss=f"{loss:.4f}")
            if step >= total:
                bar.close()
        if every is not None and (step >= total or time.monotonic() - logged[0] >= every):
            logged[0] = time.monotonic()
            print(progress_line(step, total), file=sys.stderr, flush=True)

    return update


def _train_config(args: argparse.Namespace) -> TrainConfig:
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
    _report(path, args)
    return 0


def _train_router(args: argparse.Namespace) -> int:
    from ddm.training.commands import train_router_command

    path = train_router_command(
        experts=args.experts, data=args.data, train=_train_config(args), out=args.out,
        use_labels=not args.no_labels, device=args.device,
        progress=_progress(args, args.steps, "router"), partition=args.partition,
        save_every=args.save_every, resume=args.resume, model_config=args.config)
    _report(path, args)
    return 0


def _report(path: Path | None, args: argparse.Namespace) -> None:
    """Say what was written and upload it (``--upload``); data-parallel ranks other than 0
    write nothing (None), so they say and upload nothing."""
    if path is None:
        return
    print(f"wrote {path}")
    if getattr(args, "upload", None):  # the text-to-image stages take no --upload
        from ddm.checkpoints.upload import upload_checkpoint

        uploaded = upload_checkpoint(path, args.upload,
                                     credentials_file=args.store_credentials_file)
        print(f"uploaded {path} to {uploaded.uri} (sha256 {uploaded.sha256})")


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
        raise ValueError(f"--channels must be two comma-separated integers, got {text!r}") from None


def add_partition_command(commands: argparse._SubParsersAction) -> None:
    """Add ``partition`` (``fit``, ``show``) to the ``ddm`` command's subcommands: the data
    partition every expert of a DDM trains on, and its router learns."""
    partition = commands.add_parser("partition", help="fit the data partition that experts and "
                                                      "router share, or show one")
    actions = partition.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = actions.add_parser("fit", help="k-means on the training split, written as one file "
                                       "that trainers take as --partition file:PATH")
    p.add_argument("--data", required=True,
                   help="'digits' (embedded) or 'mnist:DIR' with the four IDX files")
    p.add_argument("--kmeans", type=int, required=True, metavar="K", help="number of clusters")
    p.add_argument("--features", default="hog",
                   help="what k-means clusters: hog, stroke directions (default), or pixels")
    p.add_argument("--image-size", type=int, required=True,
                   help="image side the experts train at (MNIST 32: padded 28x28)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, type=Path, help="partition JSON file to write")
    p.set_defaults(handler=_says_why_it_failed(_partition_fit))
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


def add_fetch_data_command(commands: argparse._SubParsersAction) -> None:
    """Add ``fetch-data``: MNIST from an object store or a web server through the checkpoint
    fetcher (its destination rules, credential chains, caps, pin and atomic install); a
    DDMTraining whose data is in a store has its data job run it once into the output
    volume, and the experts read the copy."""
    from ddm.checkpoints.commands import add_fetch_options

    p = commands.add_parser("fetch-data", help="download and check MNIST's four IDX files "
                                               "(a DDMTraining's data job runs this)")
    p.add_argument("uri", help="s3://BUCKET/KEY, gs://BUCKET/KEY or https://...: a directory "
                               "holding LeCun's four files (train-images-idx3-ubyte.gz, "
                               "train-labels-idx1-ubyte.gz, t10k-...), or a .tar.gz of them")
    p.add_argument("dest", type=Path,
                   help="directory to create, or an empty one (a volume's mount point)")
    add_fetch_options(p)
    p.set_defaults(handler=_fetch_data)


def _fetch_data(args: argparse.Namespace) -> int:
    from ddm.checkpoints.commands import fetch_from_args
    from ddm.data.mnist import FETCHED

    return fetch_from_args(args, FETCHED)
