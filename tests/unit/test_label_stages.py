"""Format-1 label checkpoints load through the one stage loader (``load_stage``), behind the
same interface as a text stage: our UNet on either framework, an exported JAX program, the
label router network."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddm.checkpoints.format import (CheckpointError, CheckpointMeta, ModelSpec, load_checkpoint,
                                    save_checkpoint)
from ddm.conditioning import Conditioning
from ddm.models.jax_export import export_program
from ddm.models.loading import expert_network, expert_velocity
from ddm.models.ddm import load_ddm
from ddm.models.stages import load_stage
from tests.support.tiny_flax import build as build_mlp

DIGITS = Path(__file__).resolve().parents[2] / "checkpoints" / "digits"
SHAPE = (1, 16, 16)


def inputs(seed: int = 0, batch: int = 3) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((batch, *SHAPE), dtype=np.float32),
            rng.uniform(0, 1, batch).astype(np.float32), rng.integers(0, 10, batch))


def test_a_label_expert_is_a_stage_whose_velocity_takes_labels():
    stage = load_stage(DIGITS / "expert-0-4")
    declared = stage.declaration
    assert (declared.role, declared.family, declared.latent_shape) == ("expert", "unet", SHAPE)
    assert (declared.classes, declared.num_classes, declared.cluster) == ((0, 1, 2, 3, 4), 10, 0)
    assert stage.dtype == "float32"  # as stored
    x, t, y = inputs()
    reference = load_ddm(DIGITS).experts[0](x, t, Conditioning.from_labels(y))
    np.testing.assert_array_equal(stage.forward(x, t, Conditioning.from_labels(y)), reference)
    with pytest.raises(ValueError, match="conditioned on labels, not text embeddings"):
        stage.forward(x, t, Conditioning(embeddings=np.zeros((3, 4, 8), np.float32)))


def test_a_label_expert_stage_exposes_its_own_prediction_beside_our_velocity():
    """What ``ddm expert check`` tests the declared objective against: the epsilon expert's
    raw output, which ``forward`` converts to our velocity."""
    path = DIGITS.parent / "digits-heterogeneous" / "expert-0-4-epsilon"
    stage = load_stage(path)
    x, t, y = inputs()
    cond = Conditioning.from_labels(y)
    raw = stage.prediction(x, t, cond)
    ckpt = load_checkpoint(path)
    np.testing.assert_array_equal(raw, expert_network(ckpt)(x, t, y))
    np.testing.assert_array_equal(stage.forward(x, t, cond), expert_velocity(ckpt)(x, t, y))
    assert not np.allclose(stage.forward(x, t, cond), raw, atol=1e-2)
    assert load_stage(DIGITS / "router").prediction is None


def test_our_unet_runs_on_either_framework_behind_the_same_interface():
    x, t, y = inputs(1)
    cond = Conditioning.from_labels(y)
    on_torch = load_stage(DIGITS / "expert-5-9", backend="torch").forward(x, t, cond)
    with jax.default_matmul_precision("highest"):
        on_jax = load_stage(DIGITS / "expert-5-9", backend="jax").forward(x, t, cond)
    np.testing.assert_allclose(on_jax, on_torch, atol=1e-4)


def test_the_label_router_network_is_a_router_stage():
    stage = load_stage(DIGITS / "router")
    assert (stage.declaration.role, stage.declaration.family) == ("router", "label-router")
    assert (stage.clusters, stage.declaration.latent_shape) == (2, SHAPE)
    x, t, y = inputs(2)
    np.testing.assert_array_equal(stage.forward(x, t, y),
                                  load_ddm(DIGITS).router(x, t, Conditioning.from_labels(y)))


def test_an_exported_jax_program_loads_behind_the_stage_interface(tmp_path):
    module = build_mlp({"hidden": 16, "num_classes": 10})
    x, t, y = inputs(3)
    params = module.init(jax.random.PRNGKey(0), jnp.asarray(x), jnp.asarray(t),
                         jnp.asarray(y, jnp.int32))["params"]
    apply = functools.partial(module.apply, {"params": params})
    meta = CheckpointMeta(kind="expert", name="mlp", architecture={}, framework="jax",
                          classes=(5, 6, 7, 8, 9), model=ModelSpec("exported", image_shape=SHAPE))
    path = save_checkpoint(tmp_path / "mlp", meta, {},
                           program=export_program(apply, SHAPE))
    stage = load_stage(path)
    assert (stage.declaration.family, stage.declaration.latent_shape) == ("label-program", SHAPE)
    with jax.default_matmul_precision("highest"):
        expected = np.asarray(apply(jnp.asarray(x), jnp.asarray(t), jnp.asarray(y, jnp.int32)))
    np.testing.assert_allclose(stage.forward(x, t, Conditioning.from_labels(y)), expected,
                               atol=1e-5)


def test_a_classifier_or_another_precision_is_refused_naming_the_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="classifier checkpoint, not a stage of a DDM"):
        load_stage(DIGITS / "classifier")
    with pytest.raises(CheckpointError, match=r"expert-0-4: a label checkpoint runs in its "
                                              r"stored dtype \(float32\), not bfloat16"):
        load_stage(DIGITS / "expert-0-4", "bfloat16")
    with pytest.raises(CheckpointError, match="runs on torch only"):
        load_stage(DIGITS / "router", backend="jax")


def test_a_format_1_checkpoint_of_another_version_is_refused(tmp_path):
    ckpt = load_checkpoint(DIGITS / "expert-0-4")
    path = save_checkpoint(tmp_path / "e", dataclasses.replace(ckpt.meta), ckpt.weights)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "format_version": 2}))
    with pytest.raises(CheckpointError, match="format_version 2 is not supported"):
        load_stage(path)
