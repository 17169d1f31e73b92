"""``ddm expert check`` and ``ddm expert export``: their arguments, next to the checks and the
exporter they drive.

``ddm.cli`` adds them with :func:`add_expert_command`. Importing this module is cheap (no
framework, no NumPy): the check and the exporter are imported only when a command runs. A
failed check is a ``RuntimeError`` (``ddm.cli`` reports it, exit status 1).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ddm.objective_names import FRAMEWORKS


def add_expert_command(commands: argparse._SubParsersAction) -> None:
    """Add ``expert`` (``check``, ``export``) to the ``ddm`` command's subcommands."""
    expert = commands.add_parser("expert", help="work with one expert checkpoint")
    actions = expert.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = actions.add_parser("check", help="check that an expert (label or text) behaves as "
                                         "its config.json declares: shapes, dtypes, "
                                         "finiteness, determinism, objective, torch/JAX parity "
                                         "(docs/experts.md)")
    p.add_argument("checkpoint", type=Path, help="the expert's checkpoint directory")
    p.add_argument("--backend", default="native",
                   help="run it on its own framework (native; torch for a text expert), torch "
                        "or jax")
    p.add_argument("--device", default=None)
    p.add_argument("--data", default=None,
                   help="data for the objective check: digits or mnist:DIR, images of a label "
                        "expert's classes (default: the source its config.json records); "
                        "mnist:DIR, coloured digits of a text expert's cluster")
    p.set_defaults(handler=_expert_check)
    p = actions.add_parser("export", help="write an expert as a self-contained exported "
                                          "program (torch.export .pt2 or jax.export StableHLO) "
                                          "that needs no Python code of its author where it "
                                          "is served (docs/experts.md)")
    p.add_argument("checkpoint", type=Path, help="the expert's checkpoint directory")
    p.add_argument("--out", type=Path, required=True,
                   help="the exported checkpoint's directory (an old one there is replaced)")
    p.add_argument("--format", choices=FRAMEWORKS, default=None,
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
    failed = [verdict.name for verdict in verdicts if verdict.failed]
    if failed:
        raise RuntimeError(f"{args.checkpoint} failed {len(failed)} of {len(verdicts)} checks: "
                           f"{', '.join(failed)}")
    return 0
