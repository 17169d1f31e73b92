"""`ddm-dev-cluster {build,up,images,down,status,packages}`: argument parsing only; the work is in
`cluster`, `images` and `apt`."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from ddm_devcluster import images
from ddm_devcluster.apt import AptError, ensure_apt_packages
from ddm_devcluster.build import BuildError, ensure_binaries, log_stderr
from ddm_devcluster.cluster import down, node_layout, status, up
from ddm_devcluster.processes import StartupError


def build_parser(prog: str = "ddm-dev-cluster") -> argparse.ArgumentParser:
    """The dev-cluster argument parser (a CLI can also mount its subcommands)."""
    parser = argparse.ArgumentParser(prog=prog, description="A local Kubernetes control plane.")
    sub = parser.add_subparsers(dest="action", required=True)
    for name, helptext in (
        ("build", "find or build the control plane's binaries, the kubelet and kube-proxy"),
        ("up", "start the control plane, fake nodes and a real node; prints export KUBECONFIG"),
        ("images", "build the chart's images (operator, CPU) with buildah and import them "
                   "into the node"),
        ("down", "stop the cluster and remove the real node's namespaces"),
        ("status", "print the state of the control plane as JSON"),
        ("packages", "install those of the named Debian packages that are missing (as root), "
                     "waiting for apt's and dpkg's locks"),
    ):
        action = sub.add_parser(name, help=helptext)
        if name == "images":
            action.add_argument("--cuda", action="store_true",
                                help="build Dockerfile.cuda (several GB) instead of the chart's "
                                     "images")
            action.add_argument("--no-import", action="store_true",
                                help="only build; do not import into a running node")
        if name == "packages":
            action.add_argument("names", nargs="+", metavar="PACKAGE")
        if name not in ("build", "packages"):
            action.add_argument("--dir", type=Path, default=None, help="state directory")
        if name == "up":
            action.add_argument("--timeout", type=float, default=180.0, help="seconds to wait")
            action.add_argument(
                "--no-build", action="store_true", help="fail instead of building the binaries"
            )
            action.add_argument("--no-real-node", action="store_true",
                                help="only the control plane and fake nodes (no kubelet)")
        if name == "down":
            action.add_argument("--purge", action="store_true", help="also delete its files")
    return parser


def _raise_system_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one dev-cluster action; returns the exit status (0 ok, 1 failed, 3 not running)."""
    args = build_parser().parse_args(argv)
    try:
        if args.action == "build":
            found = ensure_binaries()
            print(f"binaries from {found.origin}:")
            for name, path in found.__dict__.items():
                if name != "origin":
                    print(f"  {name.replace('_', '-')}: {path}")
        elif args.action == "up":
            # SIGTERM (like Ctrl-C) interrupts `up`, which then stops what it started.
            previous = signal.signal(signal.SIGTERM, _raise_system_exit)
            try:
                up(args.dir, timeout_s=args.timeout, allow_build=not args.no_build,
                   real_node=not args.no_real_node)
            finally:
                signal.signal(signal.SIGTERM, previous)
        elif args.action == "images":
            wanted = [images.CUDA] if args.cuda else list(images.CHART_IMAGES)
            built = {image.name: images.build_project_image(image, log=log_stderr)
                     for image in wanted}
            if args.no_import:
                return 0
            if not status(args.dir).running:
                log_stderr("no dev cluster runs: built only (`ddm-dev-cluster up` then run "
                           "this again to import it; the build is cached)")
                return 0
            images.import_into_containerd(list(built), node_layout(args.dir).ctr(), ids=built,
                                          log=log_stderr)
        elif args.action == "down":
            down(args.dir, purge=args.purge)
        elif args.action == "packages":
            ensure_apt_packages(args.names, log=log_stderr)
        else:
            found = status(args.dir)
            print(
                json.dumps(
                    {
                        "state_dir": str(found.state_dir),
                        "running": found.running,
                        "ready": found.ready,
                        "components": found.components,
                        "server": found.info.server if found.info else None,
                        "kubeconfig": str(found.info.kubeconfig) if found.info else None,
                    },
                    indent=2,
                )
            )
            return 0 if found.running else 3
    except (BuildError, StartupError, AptError, images.ImageError) as error:
        print(f"ddm-dev-cluster {args.action}: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
