"""Build the published images with buildah, tagged for a registry, and push them.

What the release workflow (.github/workflows/release.yml) runs per image, and what `make images
REGISTRY=... [PUSH=1]` runs for people who publish their own builds. Names and tag come from the
chart: each image is REGISTRY/<the last path part of the chart's default> (ddm-operator, ddm,
ddm-cuda, ddm-neuron) tagged with the chart's appVersion, so what is pushed is what `helm
install` pulls. The Dockerfiles take their base images as build arguments (PYTHON_IMAGE, and
NEURON_IMAGE for the Neuron one): pass `--build-arg PYTHON_IMAGE=...` to build from a mirror.

    python scripts/release_images.py --registry registry.example.com/me --push
    python scripts/release_images.py --only cpu --dry-run     # prints the commands, runs none
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Sequence

import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "ddm-operator"
#: The chart's ``images`` key -> the Dockerfile of that image (from the repository root). The
#: tpu image has no Dockerfile yet, so it is not published.
DOCKERFILES = {"operator": "images/operator/Dockerfile", "cpu": "images/cpu/Dockerfile",
               "cuda": "Dockerfile.cuda", "neuron": "Dockerfile.neuron"}


def chart_version(chart: Path = CHART) -> str:
    """The chart's appVersion: the tag of every image and the release's git tag without 'v'."""
    return str(yaml.safe_load((chart / "Chart.yaml").read_text())["appVersion"])


def chart_images(chart: Path = CHART) -> dict[str, str]:
    """The chart's default image of each published key, e.g. ``ghcr.io/ddm-operator/ddm``."""
    images = yaml.safe_load((chart / "values.yaml").read_text())["images"]
    return {key: images[key] for key in DOCKERFILES}


def default_registry(chart: Path = CHART) -> str:
    """The registry the chart's defaults name (one for all of them, or an error naming them)."""
    registries = {image.rpartition("/")[0] for image in chart_images(chart).values()}
    if len(registries) != 1:
        raise ValueError(f"{chart / 'values.yaml'}: images name several registries "
                         f"{sorted(registries)}; the release publishes to one")
    return registries.pop()


def commands(registry: str, tag: str, families: Sequence[str], push: bool,
             build_args: Sequence[str] = ()) -> list[list[str]]:
    """The buildah command lines that build (and with ``push`` push) each family's image."""
    found: list[list[str]] = []
    for family in families:
        name = f"{registry.rstrip('/')}/{chart_images()[family].rpartition('/')[2]}:{tag}"
        found.append(["buildah", "bud", "--layers", "-f", DOCKERFILES[family],
                      "--build-arg", f"VERSION={tag}",
                      *(a for arg in build_args for a in ("--build-arg", arg)),
                      "-t", name, "."])
        if push:
            found.append(["buildah", "push", name, f"docker://{name}"])
    return found


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--registry", help="where to tag and push, e.g. ghcr.io/me "
                        "(default: the chart's, where releases go)")
    parser.add_argument("--tag", help="the images' tag (default: the chart's appVersion)")
    parser.add_argument("--only", action="append", choices=sorted(DOCKERFILES),
                        help="build this image only (repeatable; default: all four)")
    parser.add_argument("--build-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="passed to every build, e.g. PYTHON_IMAGE=mirror/python:3.12-slim")
    parser.add_argument("--push", action="store_true", help="push after building (log in "
                        "first: buildah login REGISTRY_HOST)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run none")
    parser.add_argument("--print-version", action="store_true",
                        help="print the chart's appVersion and exit")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.print_version:
        print(chart_version())
        return 0
    for arg in args.build_arg:
        if "=" not in arg:
            print(f"release_images: --build-arg {arg!r} is not KEY=VALUE", file=sys.stderr)
            return 2
    planned = commands(args.registry or default_registry(), args.tag or chart_version(),
                       args.only or list(DOCKERFILES), args.push, args.build_arg)
    for command in planned:
        print(shlex.join(command), flush=True)
        if not args.dry_run:
            result = subprocess.run(command, cwd=ROOT)
            if result.returncode != 0:
                print(f"release_images: {command[0]} {command[1]} failed "
                      f"(exit {result.returncode})", file=sys.stderr)
                return result.returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
