"""``ddm expert export``: an expert checkpoint as a self-contained ``exported`` one.

An author whose checkpoint names a network ddm can build (our UNet, or their own module by
import path, with ``DDM_ALLOW_IMPORT``) turns it into a program that needs neither their code
nor the allowance where it is served: ``torch.export``'s ``.pt2`` (``ddm.models.torch_io``)
or ``jax.export``'s serialized StableHLO (``ddm.models.jax_export``), for every batch size.
config.json keeps every declaration (objective, classes, partition, data); the program is
loaded back and compared with the network it came from before anything is written.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ddm.checkpoints.format import (FRAMEWORKS, Checkpoint, CheckpointError, ModelSpec,
                                    load_checkpoint, program_file_name, save_checkpoint)
from ddm.models.config import UNetConfig
from ddm.models.loading import ModelFn, expert_image_shape, expert_network

#: The largest difference tolerated between the program and the network it came from.
EXPORT_TOLERANCE = 1e-4
SEED = 0


@dataclass(frozen=True)
class ExportedExpert:
    """What :func:`export_expert` wrote: where, in which file, and how closely the program
    reproduces the network it came from (max absolute difference, output units)."""

    path: Path
    program_file: str
    program_bytes: int
    max_difference: float


def export_expert(source: str | Path, out: str | Path,
                  framework: str | None = None) -> ExportedExpert:
    """Write ``source``'s network as an ``exported`` checkpoint at ``out`` (replacing one
    there), for ``framework`` (default: the checkpoint's own; our UNet exports to either).
    A program that does not reproduce the network within :data:`EXPORT_TOLERANCE` is a
    ``CheckpointError`` and nothing is written."""
    ckpt = load_checkpoint(source)
    framework = framework or ckpt.meta.framework
    if framework not in FRAMEWORKS:
        raise ValueError(f"unknown framework {framework!r}; known: {', '.join(FRAMEWORKS)}")
    if ckpt.meta.model.kind == "exported":
        raise CheckpointError(f"checkpoint {ckpt.path} is already an exported program")
    if ckpt.meta.model.kind != "unet" and framework != ckpt.meta.framework:
        raise CheckpointError(f"checkpoint {ckpt.path} names a {ckpt.meta.framework} network "
                              f"({ckpt.meta.model.factory}); only our UNet exports to either "
                              "framework")
    image_shape = expert_image_shape(ckpt.meta)
    program = _program(ckpt, framework, image_shape)
    meta = dataclasses.replace(ckpt.meta, framework=framework,
                               model=ModelSpec("exported", image_shape=image_shape))
    target = Path(out)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.export.", dir=target.parent))
    try:
        trial = save_checkpoint(staging / "checkpoint", meta, {}, program=program)
        difference = _max_difference(expert_network(load_checkpoint(trial)),
                                     expert_network(ckpt, framework), image_shape,
                                     ckpt.meta.classes)
        if not difference <= EXPORT_TOLERANCE:
            raise CheckpointError(
                f"the {framework} program exported from {ckpt.path} differs from its network "
                f"by up to {difference:.3g} (tolerance {EXPORT_TOLERANCE:g}); not written")
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    save_checkpoint(target, meta, {}, program=program)
    return ExportedExpert(target, program_file_name(meta), len(program), difference)


def _program(ckpt: Checkpoint, framework: str, image_shape: tuple[int, int, int]) -> bytes:
    if framework == "torch":
        from ddm.models.torch_io import expert_module, export_program

        return export_program(expert_module(ckpt), image_shape)
    from ddm.models.jax_export import export_program as export_jax_program

    return export_jax_program(_jax_function(ckpt), image_shape)


def _jax_function(ckpt: Checkpoint) -> Any:
    """The checkpoint's network as a traceable ``(x, t, y) -> out`` of ``jax.Array``s, its
    weights bound (they become the program's constants)."""
    import functools

    if ckpt.meta.model.kind == "import":
        from ddm.models.imports import flax_model

        apply, params = flax_model(ckpt)
        return functools.partial(apply, params)
    from ddm.models import flax_unet

    config = UNetConfig.from_dict(ckpt.meta.architecture)
    params = flax_unet.params_from_canonical(ckpt.weights, config, ckpt.path)
    unet = flax_unet.FlaxUNet(config)
    return lambda x, t, y: unet.apply({"params": params}, x, t, y)


def _max_difference(exported: ModelFn, original: ModelFn, image_shape: tuple[int, int, int],
                    classes: tuple[int, ...]) -> float:
    rng = np.random.default_rng(SEED)
    worst = 0.0
    for batch in (1, 3):
        x = rng.standard_normal((batch, *image_shape)).astype(np.float32)
        t = np.linspace(0.05, 0.95, batch, dtype=np.float32)
        y = np.resize(np.asarray(classes or (0,), np.int64), batch)
        worst = max(worst, float(np.max(np.abs(exported(x, t, y) - original(x, t, y)))))
    return worst
