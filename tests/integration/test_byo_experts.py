"""Experts whose network is not our UNet: a tiny DiT (tests/support/tiny_dit.py) named by
import path, and the same network as a torch.export program, loaded and served by ddm's own
code with no change to it."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from ddm.checkpoints.format import CheckpointError, CheckpointMeta, ModelSpec, save_checkpoint
from ddm.checkpoints.format import load_checkpoint
from ddm.models.imports import ENV_ALLOW_IMPORT
from ddm.models.loading import expert_network
from ddm.models.torch_io import canonical_weights, export_program
from ddm.serving.wire.protocol import decode_response
from tests.support.label_wire import post_call, velocity_call
from tests.integration.servers import running, wait_ready
from tests.support.tiny_dit import SMALL, build

FACTORY = "tests.support.tiny_dit:build"
SHAPE = (1, 16, 16)


@pytest.fixture
def dit() -> torch.nn.Module:
    """A tiny DiT with every weight random (its zero-initialised gates too), so that its
    outputs depend on all of them."""
    torch.manual_seed(0)
    model = build(SMALL)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(0.1 * torch.randn_like(parameter))
    return model.eval()


def dit_meta(kind: str, name: str = "dit-5-9") -> CheckpointMeta:
    return CheckpointMeta(kind="expert", name=name, architecture=dict(SMALL), framework="torch",
                          classes=(5, 6, 7, 8, 9),
                          model=ModelSpec(kind=kind, factory=FACTORY if kind == "import" else None,
                                          image_shape=SHAPE))


def inputs(seed: int = 0, batch: int = 3) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((batch, *SHAPE), dtype=np.float32),
            rng.uniform(0, 1, batch).astype(np.float32), rng.integers(5, 10, batch))


def direct(model: torch.nn.Module, x: np.ndarray, t: np.ndarray, y: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(x), torch.from_numpy(t), torch.from_numpy(y)).numpy()


def test_a_network_named_by_import_path_loads_with_its_weights(dit, tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_ALLOW_IMPORT, "tests.support")
    path = save_checkpoint(tmp_path / "dit", dit_meta("import"), canonical_weights(dit))
    network = expert_network(load_checkpoint(path))
    x, t, y = inputs()
    np.testing.assert_array_equal(network(x, t, y), direct(dit, x, t, y))
    assert np.abs(direct(dit, x, t, y)).mean() > 0.01


def test_importing_a_network_is_refused_unless_allowed(dit, tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_ALLOW_IMPORT, raising=False)
    path = save_checkpoint(tmp_path / "dit", dit_meta("import"), canonical_weights(dit))
    with pytest.raises(CheckpointError, match=r"names the model factory 'tests.support.tiny_dit"
                                              r":build'; importing it runs its code, so allow "
                                              r"it with DDM_ALLOW_IMPORT=tests"):
        expert_network(load_checkpoint(path))
    monkeypatch.setenv(ENV_ALLOW_IMPORT, "tests.support.elsewhere")
    with pytest.raises(CheckpointError, match="allowed now: tests.support.elsewhere"):
        expert_network(load_checkpoint(path))


def test_weights_that_do_not_fit_the_named_network_are_refused(dit, tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_ALLOW_IMPORT, "tests.support")
    weights = canonical_weights(dit)
    del weights["head.bias"]
    path = save_checkpoint(tmp_path / "dit", dit_meta("import"), weights)
    with pytest.raises(CheckpointError, match="missing head.bias"):
        expert_network(load_checkpoint(path))


def test_an_exported_program_loads_without_its_source(dit, tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_ALLOW_IMPORT, raising=False)  # nothing is imported by name
    path = save_checkpoint(tmp_path / "exported", dit_meta("exported"), {},
                           program=export_program(dit, SHAPE))
    network = expert_network(load_checkpoint(path))
    for batch in (1, 5):  # the batch size is free
        x, t, y = inputs(batch, batch)
        np.testing.assert_allclose(network(x, t, y), direct(dit, x, t, y), atol=1e-5)
    program = bytearray((path / "program.pt2").read_bytes())
    program[-1] ^= 0xFF
    (path / "program.pt2").write_bytes(bytes(program))
    with pytest.raises(CheckpointError, match=r"program.pt2 is corrupt \(sha256"):
        load_checkpoint(path)


def test_a_network_of_one_framework_is_not_offered_to_the_other(dit, tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_ALLOW_IMPORT, "tests.support")
    path = save_checkpoint(tmp_path / "dit", dit_meta("import"), canonical_weights(dit))
    with pytest.raises(CheckpointError, match="serve it with backend torch or native"):
        expert_network(load_checkpoint(path), "jax")


@pytest.mark.parametrize("kind", ["import", "exported"])
def test_the_expert_server_serves_them_through_its_backend(kind, dit, tmp_path, monkeypatch):
    """Batching, buckets and limits as for our UNet: the server cannot tell them apart."""
    from ddm.serving.model.options import ServingOptions
    from ddm.serving.model.server import create_model_app

    monkeypatch.setenv(ENV_ALLOW_IMPORT, "tests.support")
    program = export_program(dit, SHAPE) if kind == "exported" else None
    path = save_checkpoint(tmp_path / kind, dit_meta(kind), canonical_weights(dit)
                           if kind == "import" else {}, program=program)
    with running(create_model_app(path, ServingOptions(max_batch=4))) as base:
        wait_ready(base)
        info = httpx.get(f"{base}/v1/info").json()
        assert info["image_shape"] == list(SHAPE) and info["classes"] == [5, 6, 7, 8, 9]
        x, t, y = inputs(1, 3)
        reply = post_call(base, velocity_call(4, x, t, y))
        assert reply.status_code == 200, reply.content
        np.testing.assert_allclose(decode_response(reply.content, 4), direct(dit, x, t, y),
                                   atol=1e-5)
        too_many = inputs(2, 5)
        refused = post_call(base, velocity_call(5, *too_many))
        assert refused.status_code == 422


def test_old_checkpoints_are_our_unet(tmp_path):
    """config.json without ``model``: our UNet, as before the field existed."""
    meta = load_checkpoint(Path(__file__).resolve().parents[2] / "checkpoints" / "digits"
                           / "expert-0-4").meta
    assert meta.model == ModelSpec() and meta.model.kind == "unet"


def test_a_flax_network_named_by_import_path_loads_with_its_params(tmp_path, monkeypatch):
    import jax
    import jax.numpy as jnp

    from ddm.models.imports import flax_weights
    from tests.support.tiny_flax import build as build_flax

    monkeypatch.setenv(ENV_ALLOW_IMPORT, "tests.support.tiny_flax")
    architecture = {"hidden": 32, "num_classes": 10}
    module = build_flax(architecture)
    x, t, y = inputs()
    params = module.init(jax.random.PRNGKey(0), jnp.asarray(x), jnp.asarray(t),
                         jnp.asarray(y))["params"]
    meta = CheckpointMeta(kind="expert", name="mlp", architecture=architecture, framework="jax",
                          classes=(5, 6, 7, 8, 9),
                          model=ModelSpec("import", factory="tests.support.tiny_flax:build",
                                          image_shape=SHAPE))
    path = save_checkpoint(tmp_path / "mlp", meta, flax_weights(params))
    network = expert_network(load_checkpoint(path))
    expected = np.asarray(module.apply({"params": params}, jnp.asarray(x), jnp.asarray(t),
                                       jnp.asarray(y)))
    np.testing.assert_allclose(network(x, t, y), expected, atol=1e-6)
    with pytest.raises(CheckpointError, match="serve it with backend jax or native"):
        expert_network(load_checkpoint(path), "torch")
