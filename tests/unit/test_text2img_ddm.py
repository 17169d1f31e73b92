"""A trained text2img directory runs in this process as a TextDDM, each expert on PyTorch or
JAX: the JAX expert equals the PyTorch one within 1e-4, loading refuses what is not an expert
of our convention, and the whole pipeline turns prompts into RGB images."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from ddm.checkpoints.format import CheckpointError
from ddm.conditioning import Conditioning
from ddm.models.flax_pixart import load_flax_expert
from ddm.models.text2img_ddm import load_text2img_ddm, load_torch_expert
from ddm.sampling.pipeline import generate_text
from tests.support.text2img_smoke import train_smoke_text2img

PARITY_TOL = 1e-4


@pytest.fixture(scope="module")
def smoke_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    _, root = train_smoke_text2img(tmp_path_factory.mktemp("text2img"))
    return root


def _randomised_expert(root: Path, out: Path) -> Path:
    """expert_0 with every weight drawn at a scale that keeps activations of order one
    (diffusers zero-initialises some outputs, and one training step moves them little)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(root / "expert_0", out)
    path = out / "diffusion_pytorch_model.safetensors"
    generator = torch.Generator().manual_seed(0)
    weights = {k: torch.randn(v.shape, generator=generator)
                  * (1.0 / v[0].numel() ** 0.5 if v.ndim > 1 else 0.1)
               for k, v in load_file(str(path)).items()}
    save_file(weights, str(path))
    return out


def _text(rows: int, width: int, seed: int = 1) -> Conditioning:
    rng = np.random.default_rng(seed)
    return Conditioning(embeddings=rng.standard_normal((rows, 32, width), dtype=np.float32))


def test_jax_expert_equals_the_torch_expert(smoke_root: Path, tmp_path: Path) -> None:
    expert = _randomised_expert(smoke_root, tmp_path / "expert")
    width = json.loads((expert / "config.json").read_text())["caption_channels"]
    rng = np.random.default_rng(0)
    for rows in (1, 5, 9):  # buckets of 8 and 16 rows, padded and cut back
        x = rng.standard_normal((rows, 4, 8, 8), dtype=np.float32)
        t = rng.random(rows, dtype=np.float32)
        cond = _text(rows, width, seed=rows)
        expected = load_torch_expert(expert)(x, t, cond)
        got = load_flax_expert(expert)(x, t, cond)
        assert got.shape == expected.shape == (rows, 4, 8, 8) and got.dtype == np.float32
        assert float(np.abs(expected).max()) > 0.1  # a real signal, not zeros
        np.testing.assert_allclose(got, expected, atol=PARITY_TOL, rtol=PARITY_TOL)


def test_an_expert_sees_time_as_our_t_times_its_declared_scale(smoke_root: Path,
                                                               tmp_path: Path) -> None:
    from diffusers import PixArtTransformer2DModel

    expert = _randomised_expert(smoke_root, tmp_path / "expert")
    network = PixArtTransformer2DModel.from_pretrained(expert, use_safetensors=True).eval()
    x = np.random.default_rng(2).standard_normal((2, 4, 8, 8), dtype=np.float32)
    cond = _text(2, network.config.caption_channels)
    with torch.no_grad():
        expected = network(torch.from_numpy(x), encoder_hidden_states=torch.from_numpy(
            cond.embeddings), timestep=torch.tensor([250.0, 900.0])).sample.numpy()
    for load in (load_torch_expert, load_flax_expert):
        got = load(expert)(x, np.array([0.25, 0.9], np.float32), cond)
        np.testing.assert_allclose(got, expected, atol=PARITY_TOL, rtol=PARITY_TOL)


@pytest.mark.parametrize("load", [load_torch_expert, load_flax_expert])
def test_loading_refuses_what_is_not_an_expert_of_our_convention(
        smoke_root: Path, tmp_path: Path, load) -> None:
    with pytest.raises(CheckpointError, match="not a text2img expert"):
        load(smoke_root / "router")
    expert = shutil.copytree(smoke_root / "expert_1", tmp_path / "other")
    config = json.loads((expert / "config.json").read_text())
    config["_ddm"]["convention"] = "flow-match-1000"
    (expert / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="declares convention 'flow-match-1000'"):
        load(expert)
    config["_ddm"]["convention"] = json.loads(
        (smoke_root / "expert_1" / "config.json").read_text())["_ddm"]["convention"]
    config["num_layers"] += 1  # the weights hold fewer blocks than the config says
    (expert / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="missing"):
        load(expert)


def test_an_expert_refuses_labels(smoke_root: Path) -> None:
    for load in (load_torch_expert, load_flax_expert):
        with pytest.raises(ValueError, match="text embeddings, not labels"):
            load(smoke_root / "expert_0")(np.zeros((1, 4, 8, 8), np.float32),
                                          np.zeros(1, np.float32), Conditioning.from_labels([3]))


def test_the_ddm_turns_prompts_into_rgb_images_with_experts_on_both_frameworks(
        smoke_root: Path) -> None:
    mixed = load_text2img_ddm(smoke_root, backends=("torch", "jax"))
    plain = load_text2img_ddm(smoke_root)
    assert mixed.expert_names == ("expert_0", "expert_1", "expert_2", "expert_3")
    assert mixed.latent_shape == (4, 8, 8) and mixed.router is not None
    prompts = ["a thick red seven", "the number 3 in blue", ""]
    for strategy in ("top1", "top2", "ensemble"):
        a = generate_text(mixed, prompts, steps=3, seed=4, strategy=strategy,
                          guidance_scale=2.0, output="latent")
        b = generate_text(plain, prompts, steps=3, seed=4, strategy=strategy,
                          guidance_scale=2.0, output="latent")
        np.testing.assert_allclose(a.state, b.state, atol=1e-4)
    images = generate_text(mixed, prompts, steps=3, seed=4).images
    assert images.shape == (3, 32, 32, 3) and images.dtype == np.uint8


def test_the_monolith_loads_as_a_one_expert_ddm(smoke_root: Path) -> None:
    monolith = load_text2img_ddm(smoke_root, experts=("monolith",))
    assert monolith.expert_names == ("monolith",) and monolith.router is None
    assert generate_text(monolith, ["a 4"], steps=2, seed=0).images.shape == (1, 32, 32, 3)


def test_unknown_backends_and_missing_experts_are_named(smoke_root: Path,
                                                        tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="backends must be some of torch, jax"):
        load_text2img_ddm(smoke_root, backends=("tpu",))
    gap = tmp_path / "gap"
    shutil.copytree(smoke_root, gap)
    shutil.rmtree(gap / "expert_1")
    with pytest.raises(CheckpointError, match=r"expert_0 \.\. expert_N-1, found experts "
                                              r"\[0, 2, 3\]"):
        load_text2img_ddm(gap)
