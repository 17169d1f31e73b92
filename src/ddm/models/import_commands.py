"""``ddm import paris`` and ``ddm import text2img``: their arguments, next to the importers
they drive.

``ddm.cli`` adds them with :func:`add_import_command`. Importing this module is cheap (no
framework, no NumPy): the importers are imported only when a command runs. A bad argument, or
an ``--out`` that exists, is a ``ValueError`` (``ddm.cli`` reports it, exit status 2).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ddm.deploy.accelerators import ACCELERATORS, HOST
from ddm.deploy.limits import PRECISIONS


def add_import_command(commands: argparse._SubParsersAction) -> None:
    """Add ``import`` (``paris``, ``text2img``) to the ``ddm`` command's subcommands."""
    p = commands.add_parser("import", help="convert a DDM published in another layout into our "
                                           "stage checkpoints and a DDMDeployment (ddm.yaml) "
                                           "that ddm up and the operator serve")
    sources = p.add_subparsers(dest="source", required=True, metavar="SOURCE")
    paris = sources.add_parser("paris", help="a Paris release directory (expert_0..N-1, router, "
                                             "vae, text_encoder, tokenizer): docs/paris.md")
    paris.add_argument("release", type=Path, help="the release's directory")
    paris.set_defaults(handler=_import, name="paris")
    text2img = sources.add_parser("text2img", help="the text2img training's directory "
                                                   "(scripts/train_text2img.sh): "
                                                   "docs/text2img.md")
    text2img.add_argument("training", type=Path, help="the training's directory (its OUT)")
    text2img.set_defaults(handler=_import, name="text2img")
    for source in (paris, text2img):
        source.add_argument("--out", type=Path, required=True,
                            help="the new directory to write (refused if it exists)")
        source.add_argument("--name", help="the DDMDeployment's name in ddm.yaml (default: "
                                           "the source's)")
        source.add_argument("--accelerator", default=HOST, type=_accelerators,
                            metavar="TYPE[,TYPE...]",
                            help=f"where the stages run ({', '.join(ACCELERATORS)}): "
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


def _import(args: argparse.Namespace) -> int:
    """Run the importer of ``args.source`` (the subcommand) on its directory."""
    if args.source == "paris":
        from ddm.models.paris_import import import_paris as importer
        source = args.release
    else:
        from ddm.models.text2img_import import import_text2img as importer
        source = args.training
    try:
        out = importer(source, args.out, name=args.name, accelerators=args.accelerator,
                       precision=args.precision, checkpoint_base=args.checkpoint_base)
    except FileExistsError as exc:  # the user's --out: a usage error, not a failure
        raise ValueError(str(exc)) from None
    print(f"imported {source} into {out}; serve it with: ddm up {out}/ddm.yaml")
    return 0
