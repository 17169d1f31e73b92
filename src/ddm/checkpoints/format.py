"""The framework-neutral checkpoint: ``config.json`` plus ``weights.safetensors`` in a directory.

Weights use one canonical naming and layout, PyTorch's ``state_dict`` (conv kernels
``(O, I, kH, kW)``, linear ``(out, in)``), as float32 NumPy arrays; ``ddm.models.flax_unet``
converts to and from Flax's layout losslessly. The JSON records everything needed to rebuild
and trust the weights: kind, architecture, flow-matching convention, the objective the model
was trained with (``ddm.objectives``; absent in old checkpoints, meaning our velocity),
partition, classes, training framework, data and steps, and the SHA-256 of the weights file.

Writes are atomic: a checkpoint directory either appears complete or not at all.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from ddm.convention import CONVENTION_NAME
from ddm.objectives import NATIVE, Objective, ObjectiveError

FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "weights.safetensors"
KINDS = ("expert", "monolith", "router", "classifier")
FRAMEWORKS = ("torch", "jax")


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, or does not match what it claims to be."""


@dataclass(frozen=True)
class CheckpointMeta:
    """What a checkpoint is. ``architecture``: a ``UNetConfig``/``RouterNetworkConfig`` dict."""

    kind: str
    name: str
    architecture: dict[str, Any]
    framework: str
    classes: tuple[int, ...]
    partition: dict[str, Any] | None = None
    data: dict[str, Any] = field(default_factory=dict)
    training: dict[str, Any] = field(default_factory=dict)
    convention: str = CONVENTION_NAME
    objective: Objective = NATIVE

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise CheckpointError(f"unknown checkpoint kind {self.kind!r}; "
                                  f"known: {', '.join(KINDS)}")
        if self.framework not in FRAMEWORKS:
            raise CheckpointError(
                f"unknown framework {self.framework!r}; known: {', '.join(FRAMEWORKS)}")
        object.__setattr__(self, "classes", tuple(int(c) for c in self.classes))

    def to_dict(self) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "kind": self.kind,
            "name": self.name,
            "convention": self.convention,
            "framework": self.framework,
            "classes": list(self.classes),
            "architecture": self.architecture,
            "partition": self.partition,
            "data": self.data,
            "training": self.training,
            "objective": self.objective.to_dict(),
        }


@dataclass(frozen=True)
class Checkpoint:
    meta: CheckpointMeta
    weights: dict[str, np.ndarray]
    path: Path


def save_checkpoint(directory: str | os.PathLike, meta: CheckpointMeta,
                    weights: Mapping[str, np.ndarray]) -> Path:
    """Write ``weights`` and ``meta`` to ``directory`` atomically, replacing an old checkpoint."""
    from safetensors.numpy import save_file

    target = Path(directory)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        arrays = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in weights.items()}
        save_file(arrays, str(staging / WEIGHTS_FILE))
        config = meta.to_dict()
        config["weights_sha256"] = _sha256(staging / WEIGHTS_FILE)
        (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if target.exists():
            backup = target.with_name(f".{target.name}.old")
            shutil.rmtree(backup, ignore_errors=True)
            target.rename(backup)
            staging.rename(target)
            shutil.rmtree(backup)
        else:
            staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def read_meta(directory: str | os.PathLike) -> CheckpointMeta:
    """Read and validate ``config.json`` alone (cheap: no weights are loaded)."""
    path = Path(directory)
    config_path = path / CONFIG_FILE
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    if not config_path.is_file():
        raise CheckpointError(f"checkpoint {path} has no {CONFIG_FILE}")
    try:
        config = json.loads(config_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(
            f"checkpoint {path}: {CONFIG_FILE} is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"checkpoint {path}: {CONFIG_FILE} must hold a JSON object")
    version = config.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {path}: format_version {version!r} is not supported "
            f"(expected {FORMAT_VERSION})")
    if config.get("convention") != CONVENTION_NAME:
        raise CheckpointError(
            f"checkpoint {path}: convention {config.get('convention')!r} differs from "
            f"{CONVENTION_NAME!r}; its velocities would be misread")
    missing = [k for k in ("kind", "name", "architecture", "framework", "classes")
               if k not in config]
    if missing:
        raise CheckpointError(f"checkpoint {path}: {CONFIG_FILE} lacks {', '.join(missing)}")
    try:
        objective = Objective.from_dict(config.get("objective", NATIVE.to_dict()))
    except ObjectiveError as exc:
        raise CheckpointError(f"checkpoint {path}: declared objective "
                              f"{config.get('objective')!r} cannot be converted to our "
                              f"velocity: {exc}") from None
    try:
        return CheckpointMeta(
            kind=config["kind"], name=config["name"], architecture=config["architecture"],
            framework=config["framework"], classes=config["classes"],
            partition=config.get("partition"), data=config.get("data", {}),
            training=config.get("training", {}), convention=config["convention"],
            objective=objective)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path}: {exc}") from None


def load_checkpoint(directory: str | os.PathLike) -> Checkpoint:
    """Read a checkpoint, verifying its config and the weights' checksum."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    path = Path(directory)
    meta = read_meta(path)
    weights_path = path / WEIGHTS_FILE
    if not weights_path.is_file():
        raise CheckpointError(f"checkpoint {path} has no {WEIGHTS_FILE}")
    expected = json.loads((path / CONFIG_FILE).read_text()).get("weights_sha256")
    actual = _sha256(weights_path)
    if expected != actual:
        raise CheckpointError(
            f"checkpoint {path}: {WEIGHTS_FILE} is corrupt (sha256 {actual[:12]}..., "
            f"config.json records {str(expected)[:12]}...)")
    try:
        weights = load_file(str(weights_path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path}: cannot read {WEIGHTS_FILE} ({exc})") from None
    return Checkpoint(meta=meta, weights=weights, path=path)


def check_weight_shapes(path: str | os.PathLike, expected: Mapping[str, tuple[int, ...]],
                        actual: Mapping[str, np.ndarray]) -> None:
    """Raise a ``CheckpointError`` naming every missing, unexpected or misshapen tensor."""
    problems = []
    for name in sorted(set(expected) - set(actual)):
        problems.append(f"missing {name}")
    for name in sorted(set(actual) - set(expected)):
        problems.append(f"unexpected {name}")
    for name in sorted(set(expected) & set(actual)):
        if tuple(actual[name].shape) != tuple(expected[name]):
            problems.append(f"{name} has shape {tuple(actual[name].shape)}, "
                            f"the architecture needs {tuple(expected[name])}")
    if problems:
        more = f"; and {len(problems) - 5} more" if len(problems) > 5 else ""
        shown = "; ".join(problems[:5]) + more
        raise CheckpointError(
            f"checkpoint {path}: weights do not match the architecture in {CONFIG_FILE}: {shown}")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
