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
from typing import Callable, Iterator, Sequence

from ddm.evaluation.cli import add_eval_command, add_report_command
from ddm.operator.commands import add_operator_commands
from ddm.runtime.commands import add_up_command
from ddm.serving.commands import add_serve_commands
from ddm.serving.sample_command import add_sample_command
from ddm.training.cli import add_train_command

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
    add_train_command(commands)
    add_sample_command(commands)
    add_eval_command(commands)
    add_report_command(commands)
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


if __name__ == "__main__":
    sys.exit(main())
