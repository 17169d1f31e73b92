"""Experts as ``jax.export`` programs (serialized StableHLO): a Flax network exported by its
author with a symbolic batch size, loaded without its source, checked by ``ddm expert check``
and served by a real expert server over HTTP; a program that is corrupt, has another
signature or was exported for other platforms is refused, naming what is wrong."""

from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from ddm.checkpoints.format import (CheckpointError, CheckpointMeta, ModelSpec, load_checkpoint,
                                    save_checkpoint)
from ddm.cli import main
from ddm.models import flax_unet
from ddm.models.config import UNetConfig
from ddm.models.imports import ENV_ALLOW_IMPORT
from ddm.models.jax_export import EXPORT_PLATFORMS, export_program
from ddm.models.loading import expert_network
from ddm.serving.wire.protocol import decode_response
from tests.support.label_wire import post_call, velocity_call
from tests.integration.servers import running, wait_ready
from tests.support.tiny_flax import build as build_mlp

ROOT = Path(__file__).resolve().parents[2]
SHIPPED_EXPERT = ROOT / "checkpoints" / "digits" / "expert-0-4"
SHAPE = (1, 16, 16)


@dataclasses.dataclass(frozen=True)
class FlaxNet:
    """A Flax network and its parameters, as its author holds them."""

    module: object
    params: dict

    def __call__(self, x: np.ndarray, t: np.ndarray, y: np.ndarray) -> np.ndarray:
        with jax.default_matmul_precision("highest"):
            return np.asarray(self.module.apply({"params": self.params}, jnp.asarray(x),
                                                jnp.asarray(t), jnp.asarray(y, jnp.int32)))

    def program(self, platforms: tuple[str, ...] = EXPORT_PLATFORMS) -> bytes:
        """What its author runs to publish it: ``ddm.models.jax_export.export_program``."""
        return export_program(functools.partial(self.module.apply, {"params": self.params}),
                              SHAPE, platforms)


@pytest.fixture(scope="module")
def mlp() -> FlaxNet:
    """A small Flax network that is not our UNet (tests/support/tiny_flax.py), seeded."""
    module = build_mlp({"hidden": 32, "num_classes": 10})
    x, t, y = inputs()
    return FlaxNet(module, module.init(jax.random.PRNGKey(0), jnp.asarray(x), jnp.asarray(t),
                                       jnp.asarray(y, jnp.int32))["params"])


@pytest.fixture(scope="module")
def unet() -> FlaxNet:
    """The shipped expert for digits 0-4 (trained in torch) as its author's Flax model."""
    ckpt = load_checkpoint(SHIPPED_EXPERT)
    config = UNetConfig.from_dict(ckpt.meta.architecture)
    return FlaxNet(flax_unet.FlaxUNet(config),
                   flax_unet.params_from_canonical(ckpt.weights, config, ckpt.path))


@pytest.fixture(scope="module")
def exported_unet(unet: FlaxNet, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """That expert as an exported checkpoint: its config.json's declarations (objective,
    classes, partition, data source), its network a jax.export program."""
    meta = dataclasses.replace(load_checkpoint(SHIPPED_EXPERT).meta, framework="jax",
                               model=ModelSpec("exported", image_shape=SHAPE))
    return save_checkpoint(tmp_path_factory.mktemp("exported") / "unet-0-4", meta, {},
                           program=unet.program())


def exported_meta(name: str = "mlp") -> CheckpointMeta:
    return CheckpointMeta(kind="expert", name=name, architecture={}, framework="jax",
                          classes=(5, 6, 7, 8, 9), model=ModelSpec("exported", image_shape=SHAPE))


def inputs(seed: int = 0, batch: int = 3, classes: tuple[int, int] = (5, 10)
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((batch, *SHAPE), dtype=np.float32),
            rng.uniform(0, 1, batch).astype(np.float32), rng.integers(*classes, batch))


def test_an_exported_flax_network_loads_without_its_source_for_any_batch(mlp, tmp_path,
                                                                         monkeypatch):
    monkeypatch.delenv(ENV_ALLOW_IMPORT, raising=False)  # nothing is imported by name
    path = save_checkpoint(tmp_path / "mlp", exported_meta(), {}, program=mlp.program())
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "program.jaxexport",
                                                      "weights.safetensors"]
    network = expert_network(load_checkpoint(path))
    for batch in (1, 5, 8):  # the batch size is symbolic: one program serves every size
        x, t, y = inputs(batch, batch)
        np.testing.assert_allclose(network(x, t, y), mlp(x, t, y), atol=1e-6)
    with pytest.raises(CheckpointError, match="serve it with backend jax or native"):
        expert_network(load_checkpoint(path), "torch")


def test_a_program_whose_sha256_differs_from_config_json_is_refused(mlp, tmp_path):
    path = save_checkpoint(tmp_path / "mlp", exported_meta(), {}, program=mlp.program())
    program = bytearray((path / "program.jaxexport").read_bytes())
    program[len(program) // 2] ^= 0xFF
    (path / "program.jaxexport").write_bytes(bytes(program))
    with pytest.raises(CheckpointError, match=r"program.jaxexport is corrupt \(sha256 "
                                              r"[0-9a-f]{12}\.\.\., config.json records"):
        load_checkpoint(path)


def _exported(function, x_shape: tuple, y_dtype=jnp.int32) -> bytes:
    """``function`` exported directly with ``jax.export``, bypassing ddm's helper (as an
    author could), for inputs of ``x_shape`` (a symbolic batch where it says ``"b"``)."""
    b, = export.symbolic_shape("b")
    x_shape = tuple(b if d == "b" else d for d in x_shape)
    specs = (jax.ShapeDtypeStruct(x_shape, jnp.float32),
             jax.ShapeDtypeStruct(x_shape[:1], jnp.float32),
             jax.ShapeDtypeStruct(x_shape[:1], y_dtype))
    return bytes(export.export(jax.jit(function))(*specs).serialize())


def _network(x: jax.Array, t: jax.Array, y: jax.Array) -> jax.Array:
    return x * t[:, None, None, None] + y[:, None, None, None]


@pytest.mark.parametrize("program, signature, problem", [
    (lambda: _exported(_network, (2, *SHAPE)), "(float32[2,1,16,16], float32[2], int32[2]) "
     "-> float32[2,1,16,16]", "its batch size is fixed at 2; export it with a symbolic batch"),
    (lambda: _exported(_network, ("b", *SHAPE), jnp.float32), "(float32[b,1,16,16], "
     "float32[b], float32[b]) -> float32[b,1,16,16]", "y is float32, not int32"),
    (lambda: _exported(_network, ("b", 1, 8, 8)), "(float32[b,1,8,8], float32[b], int32[b]) "
     "-> float32[b,1,8,8]", "x must be (B, 1, 16, 16) (model.image_shape)"),
    (lambda: _exported(lambda x, t, y: (x, x), ("b", *SHAPE)), "(float32[b,1,16,16], "
     "float32[b], int32[b]) -> float32[b,1,16,16], float32[b,1,16,16]", "it returns"),
])
def test_a_program_with_another_signature_is_refused_naming_it(program, signature, problem,
                                                               tmp_path):
    path = save_checkpoint(tmp_path / "wrong", exported_meta(), {}, program=program())
    with pytest.raises(CheckpointError) as refused:
        expert_network(load_checkpoint(path))
    message = str(refused.value)
    assert message.startswith(f"checkpoint {path}: program.jaxexport computes {signature}, "
                              "but an expert's network is (float32[B,1,16,16], float32[B], "
                              "int32[B]) -> float32[B,1,16,16] for every batch size B: "), message
    assert problem in message, message


def test_the_export_helper_refuses_a_network_of_another_signature():
    with pytest.raises(CheckpointError, match=r"^the exported network computes \(float32\[batch,"
                                              r"1,16,16\], float32\[batch\], int32\[batch\]\) -> "
                                              r"float32\[batch,16,16\], .*: the output must have "
                                              r"x's shape"):
        export_program(lambda x, t, y: x[:, 0], SHAPE)


def _cholesky(x: jax.Array, t: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.linalg.cholesky(x @ jnp.swapaxes(x, -1, -2) + 16 * jnp.eye(SHAPE[-1]))


def _hidden_cholesky(x: jax.Array, t: jax.Array, y: jax.Array) -> jax.Array:
    """The same call inside a loop body inside a jitted function inside a branch taken for no
    label: nested regions of private functions of the module."""
    def loop(x: jax.Array) -> jax.Array:
        return jax.lax.while_loop(lambda c: c[1] < 1, lambda c: (_cholesky(c[0], t, y),
                                                                 c[1] + 1), (x, 0))[0]
    return jax.lax.cond(jnp.all(y > 100), jax.jit(loop), lambda x: x, x)


@pytest.mark.parametrize("network", [_cholesky, _hidden_cholesky])
def test_a_program_calling_native_code_outside_the_allow_list_is_refused_naming_it(tmp_path,
                                                                                   network):
    """A Cholesky factorisation lowers to LAPACK through a custom_call (one JAX exports as
    stable); no expert needs it, and a served program calls only JAX's shape checks."""
    path = save_checkpoint(tmp_path / "lapack", exported_meta(), {},
                           program=export_program(network, SHAPE))
    with pytest.raises(CheckpointError, match=r"program.jaxexport calls custom_call target "
                                              r"'lapack_spotrf_ffi', native code outside the "
                                              r"program; exported experts may call only "):
        expert_network(load_checkpoint(path))


def test_a_program_exported_for_other_platforms_is_refused(mlp, tmp_path):
    path = save_checkpoint(tmp_path / "tpu", exported_meta(), {}, program=mlp.program(("tpu",)))
    with pytest.raises(CheckpointError, match=r"program.jaxexport was exported for tpu, not for "
                                              r"this cpu device \(cpu\)"):
        expert_network(load_checkpoint(path), device="cpu")


@pytest.mark.slow
def test_ddm_expert_check_passes_an_exported_trained_expert(exported_unet, unet, capsys):
    """Every check but parity (one framework) runs, behaviour on real held-out digits."""
    x, t, y = inputs(1, 4, (0, 5))
    np.testing.assert_allclose(expert_network(load_checkpoint(exported_unet))(x, t, y),
                               unet(x, t, y), atol=1e-5)
    status = main(["expert", "check", str(exported_unet)])
    lines = capsys.readouterr().out.strip().splitlines()
    verdicts = {re.match(r"[A-Z]+ ([a-z]+):", line)[1]: line for line in lines}
    assert status == 0, lines
    assert [v.split(" ")[0] for v in verdicts.values()] == ["PASS"] * 6 + ["SKIP"], lines
    assert verdicts["load"] == "PASS load: expert expert-0-4 on native, images 1x16x16"
    assert verdicts["behaviour"].startswith("PASS behaviour: velocity explains the outputs "
                                            "on 192 digits-16x16/heldout/classes=0,1,2,3,4")
    assert verdicts["parity"] == "SKIP parity: a jax network (exported) runs on jax only"


@pytest.mark.slow
def test_the_expert_server_serves_an_exported_program_over_http(exported_unet, unet):
    """Its own checks, JAX's batch buckets and the server's limits, as for our UNet."""
    from ddm.serving.model.options import ServingOptions
    from ddm.serving.model.server import create_model_app

    with running(create_model_app(exported_unet,
                                  ServingOptions(backend="jax", max_batch=4))) as base:
        wait_ready(base)
        info = httpx.get(f"{base}/v1/info").json()
        assert info["image_shape"] == list(SHAPE) and info["classes"] == [0, 1, 2, 3, 4]
        x, t, y = inputs(2, 3, (0, 5))
        reply = post_call(base, velocity_call(4, x, t, y))
        assert reply.status_code == 200, reply.content
        np.testing.assert_allclose(decode_response(reply.content, 4), unet(x, t, y), atol=1e-5)
        refused = post_call(base, velocity_call(5, *inputs(3, 5, (0, 5))))
        assert refused.status_code == 422


def test_ddm_expert_export_turns_an_imported_flax_network_into_a_program(mlp, tmp_path,
                                                                         monkeypatch, capsys):
    """The author's module is needed once, to export; never where the program is served."""
    from ddm.models.imports import flax_weights

    monkeypatch.setenv(ENV_ALLOW_IMPORT, "tests.support.tiny_flax")
    meta = dataclasses.replace(exported_meta(), architecture={"hidden": 32, "num_classes": 10},
                               model=ModelSpec("import", factory="tests.support.tiny_flax:build",
                                               image_shape=SHAPE))
    source = save_checkpoint(tmp_path / "mlp", meta, flax_weights(mlp.params))
    assert main(["expert", "export", str(source), "--out", str(tmp_path / "mlp-exported")]) == 0
    assert re.fullmatch(rf"wrote {tmp_path}/mlp-exported \(program.jaxexport, [0-9.]+ MB\); its "
                        rf"outputs match {source}'s network within [0-9.e-]+\n",
                        capsys.readouterr().out)
    monkeypatch.delenv(ENV_ALLOW_IMPORT)
    exported = load_checkpoint(tmp_path / "mlp-exported")
    assert exported.meta.model == ModelSpec("exported", image_shape=SHAPE)
    assert exported.meta.framework == "jax" and exported.meta.classes == (5, 6, 7, 8, 9)
    x, t, y = inputs(4, 6)
    np.testing.assert_allclose(expert_network(exported)(x, t, y), mlp(x, t, y), atol=1e-6)


@pytest.mark.slow
def test_ddm_expert_export_writes_our_unet_for_either_framework(exported_unet, tmp_path):
    x, t, y = inputs(5, 2, (0, 5))
    expected = expert_network(load_checkpoint(exported_unet))(x, t, y)
    for framework, program in (("jax", "program.jaxexport"), ("torch", "program.pt2")):
        out = tmp_path / framework
        assert main(["expert", "export", str(SHIPPED_EXPERT), "--out", str(out),
                     "--format", framework]) == 0
        assert (out / program).is_file()
        np.testing.assert_allclose(expert_network(load_checkpoint(out))(x, t, y), expected,
                                   atol=1e-5)
    assert main(["expert", "export", str(tmp_path / "jax"), "--out", str(tmp_path / "x")]) == 2
    assert not (tmp_path / "x").exists()
