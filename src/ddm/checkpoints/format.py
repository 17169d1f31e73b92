"""The framework-neutral checkpoint: ``config.json`` plus ``weights.safetensors`` in a directory.

An expert's ``model`` (:class:`ModelSpec`) says which network the weights belong to: our UNet
(the default, so older checkpoints load as before), a user's network built by an importable
factory (``package.module:function``; its weights in the same safetensors file, in its own
framework's naming), or a self-contained exported program of its framework
(:data:`EXPORTED_PROGRAMS`: ``torch.export``'s ``.pt2`` or ``jax.export``'s serialized
StableHLO, kept beside config.json with its SHA-256 recorded; its weights file is empty).
docs/experts.md.

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
import re
import reprlib
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from ddm.checkpoints.declared import load_config_json
from ddm.convention import CONVENTION_NAME
from ddm.fileio import open_regular, share_as_new, staging_directory
from ddm.objective_names import FRAMEWORKS as FRAMEWORKS
from ddm.objectives import NATIVE, Objective, ObjectiveError

FORMAT_VERSION = 1
#: The config.json key that marks this format (a stage's config.json has ``_ddm`` instead).
FORMAT_KEY = "format_version"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "weights.safetensors"
KINDS = ("expert", "monolith", "router", "classifier")
#: ``unet``: ours (``architecture`` is a ``UNetConfig``); ``import``: a factory the serving
#: image can import, called with ``architecture``; ``exported``: a program of its framework.
MODEL_KINDS = ("unet", "import", "exported")
#: framework -> the file an ``exported`` expert's program is in: ``torch.export``'s archive
#: (``ddm.models.torch_io.export_program``) or ``jax.export``'s serialized StableHLO
#: (``ddm.models.jax_export.export_program``), each read by a strict reader
#: (``ddm.models.torch_program``, ``jax_export.check_custom_calls``) that runs none of it.
EXPORTED_PROGRAMS = {"torch": "program.pt2", "jax": "program.jaxexport"}
#: Every file a checkpoint directory holds: saving replaces only a directory of these.
CHECKPOINT_FILES = frozenset({CONFIG_FILE, WEIGHTS_FILE, *EXPORTED_PROGRAMS.values()})
_FACTORY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*")


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, or does not match what it claims to be."""


@dataclass(frozen=True)
class ModelSpec:
    """Which network an expert's weights belong to (see :data:`MODEL_KINDS`).

    ``factory`` (``import`` only): ``package.module:function``, called with the architecture
    dict; ``image_shape`` ``(C, H, W)`` (``import`` and ``exported``: our UNet's comes from
    its architecture) is what the network takes and returns.
    """

    kind: str = "unet"
    factory: str | None = None
    image_shape: tuple[int, int, int] | None = None

    def __post_init__(self) -> None:
        if self.kind not in MODEL_KINDS:
            raise CheckpointError(f"unknown model kind {self.kind!r}; known: "
                                  f"{', '.join(MODEL_KINDS)}")
        if (self.kind == "import") != (self.factory is not None):
            raise CheckpointError("a model of kind 'import' needs a factory "
                                  "('package.module:function'), and only it takes one")
        if self.factory is not None and not _FACTORY.fullmatch(str(self.factory)):
            raise CheckpointError(f"model factory {self.factory!r} is not "
                                  "'package.module:function'")
        if self.kind == "unet":
            if self.image_shape is not None:
                raise CheckpointError("our UNet's image shape comes from its architecture; "
                                      "drop model.image_shape")
            return
        shape = tuple(self.image_shape or ())
        if len(shape) != 3 or not all(_is_int(n) and n > 0 for n in shape):
            raise CheckpointError(f"a model of kind {self.kind!r} needs image_shape "
                                  f"[C, H, W] of positive integers, got {self.image_shape!r}")
        object.__setattr__(self, "image_shape", shape)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"kind": self.kind}
        if self.factory is not None:
            d["factory"] = self.factory
        if self.image_shape is not None:
            d["image_shape"] = list(self.image_shape)
        return d

    @classmethod
    def from_dict(cls, d: Any) -> "ModelSpec":
        if not isinstance(d, Mapping):
            raise CheckpointError(f"model must be a JSON object, got {d!r}")
        unknown = sorted(set(d) - {"kind", "factory", "image_shape"})
        if unknown:
            raise CheckpointError(f"model has unknown keys: {', '.join(unknown)}")
        shape = d.get("image_shape")
        return cls(kind=d.get("kind", "unet"), factory=d.get("factory"),
                   image_shape=tuple(shape) if isinstance(shape, list) else shape)


#: Our UNet: what a checkpoint without ``model`` holds.
UNET = ModelSpec()


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
    model: ModelSpec = UNET

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise CheckpointError(f"unknown checkpoint kind {self.kind!r}; "
                                  f"known: {', '.join(KINDS)}")
        if self.framework not in FRAMEWORKS:
            raise CheckpointError(
                f"unknown framework {self.framework!r}; known: {', '.join(FRAMEWORKS)}")
        classes = tuple(int(c) for c in self.classes)
        object.__setattr__(self, "classes", classes)
        _check_classes(classes, self.architecture.get("num_classes")
                       if isinstance(self.architecture, dict) else None)
        if self.model != UNET and self.kind not in ("expert", "monolith"):
            raise CheckpointError(f"a {self.kind} checkpoint is always our own network; "
                                  f"model {self.model.kind!r} is for experts and monoliths")

    def to_dict(self) -> dict[str, Any]:
        return {
            FORMAT_KEY: FORMAT_VERSION,
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
            "model": self.model.to_dict(),
        }


@dataclass(frozen=True)
class Checkpoint:
    meta: CheckpointMeta
    weights: dict[str, np.ndarray]
    path: Path


def save_checkpoint(directory: str | os.PathLike, meta: CheckpointMeta,
                    weights: Mapping[str, np.ndarray], program: bytes | None = None) -> Path:
    """Write ``weights`` and ``meta`` to ``directory`` atomically, replacing an old checkpoint;
    ``program``: the serialized exported program of a ``model.kind == "exported"`` expert."""
    if (program is not None) != (meta.model.kind == "exported"):
        raise CheckpointError("an exported model needs its program, and only it takes one")
    from safetensors.numpy import save_file

    target = Path(directory)
    check_checkpoint_output(target, "output")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_directory(target)
    try:
        arrays = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in weights.items()}
        save_file(arrays, str(staging / WEIGHTS_FILE))
        share_as_new(staging)
        config = meta.to_dict()
        config["weights_sha256"] = _sha256(staging / WEIGHTS_FILE)
        if program is not None:
            program_file = staging / program_file_name(meta)
            program_file.write_bytes(program)
            config["program_sha256"] = _sha256(program_file)
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


def check_checkpoint_output(directory: str | os.PathLike, flag: str = "--out") -> None:
    """Fail unless ``directory`` (given as ``flag``) is new, empty or a checkpoint, before the
    training that fills it: :func:`save_checkpoint` replaces it whole, so a directory of other
    files (the experts a router is trained for, a typo) would be deleted."""
    target = Path(directory)
    if not target.exists() or (target.is_dir() and all(
            entry.name in CHECKPOINT_FILES for entry in target.iterdir())):
        return
    kind = "a directory" if target.is_dir() else "a file"
    raise CheckpointError(f"{flag} {target} is {kind}, not a checkpoint: saving would replace "
                          "it whole (name a new directory, or an existing checkpoint to "
                          "replace)")


def read_config(path: Path) -> dict[str, Any]:
    """The JSON object in ``path`` (a checkpoint's or a component's config.json, which a
    checkpoint store sent), read within :data:`~ddm.checkpoints.declared.MAX_CONFIG_BYTES`;
    a ``CheckpointError`` saying why it is unreadable or not an object."""
    try:
        config = load_config_json(path)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} must hold a JSON object, got {type(config).__name__}")
    return config


def read_meta(directory: str | os.PathLike) -> CheckpointMeta:
    """Read and validate ``config.json`` alone (cheap: no weights are loaded)."""
    path = Path(directory)
    config_path = path / CONFIG_FILE
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    if not config_path.is_file():
        raise CheckpointError(f"checkpoint {path} has no {CONFIG_FILE}")
    config = read_config(config_path)
    version = config.get(FORMAT_KEY)
    if not _is_int(version) or version != FORMAT_VERSION:
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
        model = ModelSpec.from_dict(config.get("model", UNET.to_dict()))
    except CheckpointError as exc:
        raise CheckpointError(f"checkpoint {path}: {exc}") from None
    try:
        return CheckpointMeta(
            kind=config["kind"], name=config["name"], architecture=config["architecture"],
            framework=config["framework"], classes=_integers("classes", config["classes"]),
            partition=config.get("partition"), data=config.get("data", {}),
            training=config.get("training", {}), convention=config["convention"],
            objective=objective, model=model)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path}: {exc}") from None


def _check_classes(classes: tuple[int, ...], num_classes: Any) -> None:
    """Classes are labels the network embeds: distinct, from 0, and under the architecture's
    ``num_classes`` where it records one (a label past it fails deep in the model, as an
    index error, at the first request that names it)."""
    if len(set(classes)) != len(classes):
        duplicated = sorted({c for c in classes if classes.count(c) > 1})
        raise CheckpointError(f"classes list {duplicated[0]} more than once")
    if any(c < 0 for c in classes):
        raise CheckpointError(f"classes must be labels from 0, got {min(classes)}")
    if _is_int(num_classes) and classes and max(classes) >= num_classes:
        raise CheckpointError(f"class {max(classes)} is beyond the architecture's "
                              f"num_classes of {num_classes} (labels 0..{num_classes - 1})")


def _is_int(value: Any) -> bool:
    """A JSON integer. Python's ``==`` and ``int()`` would take ``true`` or ``1.0`` for 1 (and
    ``int()`` 1.5 too), reading an untrusted config.json as something it never said."""
    return isinstance(value, int) and not isinstance(value, bool)


def _integers(name: str, value: Any) -> tuple[int, ...]:
    """config.json's list ``name`` of integers, or a ``CheckpointError`` naming what was found
    (``tuple(int(c) for c in "0123")`` would be four classes)."""
    if isinstance(value, list):
        wrong = [item for item in value if not _is_int(item)]
        if not wrong:
            return tuple(value)
        found = f"{reprlib.repr(wrong[0])} in it"
    else:
        found = reprlib.repr(value)
    raise CheckpointError(f"{name} must be a list of integers, got {found}")


def load_checkpoint(directory: str | os.PathLike) -> Checkpoint:
    """Read a checkpoint, verifying its config and the checksums of its weights (and of its
    exported program)."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    path = Path(directory)
    meta = read_meta(path)
    weights_path = path / WEIGHTS_FILE
    config = read_config(path / CONFIG_FILE)
    check_sha256(path, WEIGHTS_FILE, config.get("weights_sha256"))
    if meta.model.kind == "exported":
        check_sha256(path, program_file_name(meta), config.get("program_sha256"))
    try:
        weights = load_file(str(weights_path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path}: cannot read {WEIGHTS_FILE} ({exc})") from None
    return Checkpoint(meta=meta, weights=weights, path=path)


def program_file_name(meta: CheckpointMeta) -> str:
    """The file an ``exported`` expert's program is in, by its framework."""
    assert meta.model.kind == "exported", "only an exported model has a program"
    return EXPORTED_PROGRAMS[meta.framework]


def check_weight_shapes(path: str | os.PathLike, expected: Mapping[str, tuple[int, ...]],
                        actual: Mapping[str, np.ndarray]) -> None:
    """Raise a ``CheckpointError`` naming every missing, unexpected or misshapen tensor."""
    check_shapes(path, expected, {name: tuple(array.shape) for name, array in actual.items()})


def check_shapes(path: str | os.PathLike, expected: Mapping[str, tuple[int, ...]],
                 actual: Mapping[str, tuple[int, ...]]) -> None:
    """:func:`check_weight_shapes` of the shapes ``actual`` (a safetensors header's,
    :func:`safetensors_header`): before any tensor is read."""
    problems = []
    for name in sorted(set(expected) - set(actual)):
        problems.append(f"missing {name}")
    for name in sorted(set(actual) - set(expected)):
        problems.append(f"unexpected {name}")
    for name in sorted(set(expected) & set(actual)):
        if tuple(actual[name]) != tuple(expected[name]):
            problems.append(f"{name} has shape {tuple(actual[name])}, "
                            f"the architecture needs {tuple(expected[name])}")
    if problems:
        more = f"; and {len(problems) - 5} more" if len(problems) > 5 else ""
        shown = "; ".join(problems[:5]) + more
        raise CheckpointError(
            f"checkpoint {path}: weights do not match the architecture in {CONFIG_FILE}: {shown}")


def check_sha256(path: Path, name: str, expected: Any) -> None:
    """``path/name`` exists and its SHA-256 (streamed) is ``expected`` (config.json's)."""
    if not (path / name).is_file():
        raise CheckpointError(f"checkpoint {path} has no {name}")
    try:
        actual = _sha256(path / name)
    except ValueError as exc:  # a link or a FIFO in its place
        raise CheckpointError(f"checkpoint {path}: {exc}") from None
    if expected != actual:
        raise CheckpointError(
            f"checkpoint {path}: {name} is corrupt (sha256 {actual[:12]}..., "
            f"config.json records {str(expected)[:12]}...)")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open_regular(path) as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def safetensors_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Tensor name -> (dtype, shape) from ``path``'s header, parsed by safetensors itself over
    a memory map (no tensor is read: dtypes known, byte ranges matching shapes and tiling the
    file); a ``CheckpointError`` naming the file when it is not a valid safetensors file."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy") as weights:
            return {name: (weights.get_slice(name).get_dtype(),
                           tuple(weights.get_slice(name).get_shape()))
                    for name in weights.keys()}
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is not a valid safetensors file ({exc})") from None


#: Safetensors' floating dtype codes a checkpoint may store, by our precision names.
_FLOATING_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def stored_precision(path: Path) -> str | None:
    """The precision name of safetensors file ``path``'s floating weights, read from its
    header; None when it holds none; a ``CheckpointError`` naming the file when they mix."""
    dtypes = {dtype for dtype, _ in safetensors_header(path).values()}
    floating = {_FLOATING_DTYPES[d] for d in dtypes if d in _FLOATING_DTYPES}
    if len(floating) > 1:
        raise CheckpointError(f"{path} mixes floating dtypes {sorted(floating)}")
    return floating.pop() if floating else None


def one_safetensors(directory: Path) -> Path:
    """The one safetensors file of a library's component directory (never pickled weights)."""
    files = sorted(directory.glob("*.safetensors"))
    if len(files) != 1:
        pickled = sorted(p.name for p in directory.glob("*.bin"))
        hint = f" (pickled weights {pickled} are never loaded)" if pickled else ""
        raise CheckpointError(f"{directory} must hold exactly one .safetensors file, found "
                              f"{[f.name for f in files]}{hint}")
    return files[0]
