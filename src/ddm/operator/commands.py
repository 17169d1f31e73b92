"""``ddm operator``, ``ddm diagram`` and ``ddm render``: their arguments, next to the operator
they run.

``ddm.cli`` adds these with :func:`add_operator_commands`, as each area adds its own
(``ddm.serving.commands``). Importing this module is cheap (no kopf, no Kubernetes client):
the operator is imported only when a command runs.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ddm.fileio import existing_path


def add_operator_commands(commands: argparse._SubParsersAction) -> None:
    """Add ``operator``, ``diagram`` and ``render`` to the ``ddm`` command's subcommands."""
    p = commands.add_parser("operator", help="run the Kubernetes operator (kopf)")
    p.add_argument("--namespace", action="append", default=None,
                   help="watch this namespace (repeatable); default: the comma-separated "
                        "list in $DDM_WATCH_NAMESPACES, or the whole cluster when it is unset "
                        "or empty")
    p.add_argument("--liveness-port", type=int, default=None,
                   help="serve kopf's liveness probe on this port")
    p.add_argument("--kubeconfig", type=Path, default=None,
                   help="default: in-cluster credentials, else $KUBECONFIG")
    p.set_defaults(handler=_operator)

    p = commands.add_parser("diagram", help="render a DDMDeployment's topology as Mermaid")
    p.add_argument("file", type=Path)
    p.set_defaults(handler=_diagram)

    p = commands.add_parser(
        "render", help="print, as YAML, every object the operator would create for a "
                       "DDMDeployment (its pods, Secrets, Services and NetworkPolicies), or "
                       "the jobs of a DDMTraining (Jobs or TrainJobs) and its DDMDeployment",
        description="Under the operator's settings from the same DDM_* variables, with router "
                    "authentication and NetworkPolicies on unless set (the chart's defaults).")
    p.add_argument("file", type=existing_path,
                   help="a DDMDeployment or DDMTraining manifest (YAML)")
    p.add_argument("--namespace", default=None,
                   help="the namespace it would live in (default: its own, else default)")
    p.set_defaults(handler=_render)


def _operator(args: argparse.Namespace) -> int:
    from ddm.operator.runner import run_operator

    run_operator(args.namespace or None, liveness_port=args.liveness_port,
                 kubeconfig=args.kubeconfig)
    return 0


def _diagram(args: argparse.Namespace) -> int:
    from ddm.operator.diagram import diagram_file

    print(diagram_file(args.file), end="")
    return 0


def _render(args: argparse.Namespace) -> int:
    from ddm.operator.render import render_file

    print(render_file(args.file, os.environ, args.namespace), end="")
    return 0
