"""The text2img training's directory, imported (`ddm import text2img`), runs in this process as
a DDM with each expert on PyTorch or JAX: the JAX expert equals the PyTorch one within
1e-4, the import writes stage checkpoints that declare themselves and a ddm.yaml whose experts
alternate frameworks, and the whole pipeline turns prompts into RGB images."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from ddm.checkpoints.format import CheckpointError
from ddm.deploy.spec import load_manifest
from ddm.models.flax_pixart import load_flax_expert
from ddm.models.ddm import load_ddm
from ddm.models.stages import load_stage
from ddm.data.colored_mnist import EXAMPLE_PROMPT
from ddm.models.text2img_import import import_text2img
from ddm.models.trained_on import TrainedOn
from ddm.sampling.pipeline import generate_text
from tests.support.text2img_smoke import train_smoke_text2img

PARITY_TOL = 1e-4


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The smoke training's root, expert_0's weights redrawn at a scale that keeps activations
    of order one (diffusers zero-initialises some outputs; one step moves them little)."""
    from safetensors.torch import load_file, save_file

    _, root = train_smoke_text2img(tmp_path_factory.mktemp("text2img"))
    path = root / "expert_0" / "diffusion_pytorch_model.safetensors"
    generator = torch.Generator().manual_seed(0)
    save_file({k: torch.randn(v.shape, generator=generator)
               * (1.0 / v[0].numel() ** 0.5 if v.ndim > 1 else 0.1)
               for k, v in load_file(str(path)).items()}, str(path))
    return root


@pytest.fixture(scope="module")
def imported(trained: Path) -> Path:
    from ddm.cli import main

    out = trained.parent / "imported"
    assert main(["import", "text2img", str(trained), "--out", str(out)]) == 0
    return out


def _inputs(rows: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, list[str]]:
    rng = np.random.default_rng(seed)
    prompts = ["a thick red seven", "the number 3 in blue", "", "a thin 4"] * 4
    return (rng.standard_normal((rows, 4, 8, 8), dtype=np.float32),
            rng.random(rows, dtype=np.float32), prompts[:rows])


def test_jax_expert_equals_the_torch_expert(imported: Path) -> None:
    encode = load_stage(imported / "text_encoder").forward
    on_torch = load_stage(imported / "expert_0").forward
    on_jax = load_stage(imported / "expert_0", backend="jax").forward
    for rows in (1, 5, 9):  # buckets of 8 and 16 rows, padded and cut back
        x, t, prompts = _inputs(rows, seed=rows)
        cond = encode(prompts)
        expected, got = on_torch(x, t, cond), on_jax(x, t, cond)
        assert got.shape == expected.shape == (rows, 4, 8, 8) and got.dtype == np.float32
        assert float(np.abs(expected).max()) > 0.1  # a real signal, not zeros
        np.testing.assert_allclose(got, expected, atol=PARITY_TOL, rtol=PARITY_TOL)


def test_the_flax_forward_is_the_diffusers_network_at_its_own_timestep(imported: Path) -> None:
    from diffusers import PixArtTransformer2DModel

    network = PixArtTransformer2DModel.from_pretrained(imported / "expert_0",
                                                       use_safetensors=True).eval()
    x, _, _ = _inputs(2)
    text = np.random.default_rng(3).standard_normal((2, 32, network.config.caption_channels),
                                                    dtype=np.float32)
    timestep = np.array([250.0, 900.0], np.float32)
    with torch.no_grad():
        expected = network(torch.from_numpy(x), encoder_hidden_states=torch.from_numpy(text),
                           timestep=torch.from_numpy(timestep)).sample.numpy()
    forward, config = load_flax_expert(imported / "expert_0")
    assert config["caption_channels"] == network.config.caption_channels
    np.testing.assert_allclose(forward(x, text, timestep), expected, atol=PARITY_TOL,
                               rtol=PARITY_TOL)


def test_the_flax_loader_refuses_other_networks_and_other_weights(imported: Path,
                                                                  tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="runs PixArtTransformer2DModel experts, not "
                                              "'LatentRouter'"):
        load_flax_expert(imported / "router")
    expert = shutil.copytree(imported / "expert_1", tmp_path / "deeper")
    config = json.loads((expert / "config.json").read_text())
    config["num_layers"] += 1  # the weights hold fewer blocks than the config says
    (expert / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="missing"):
        load_flax_expert(expert)


def test_the_import_writes_declared_stages_and_a_deployment(trained: Path,
                                                            imported: Path) -> None:
    assert sorted(p.name for p in imported.iterdir()) == [
        "clip", "ddm.yaml", "ddm_index.json", "decoder", "expert_0", "expert_1", "expert_2",
        "expert_3", "monolith", "router", "text_encoder"]
    assert json.loads((imported / "ddm_index.json").read_text()) == {  # no monolith, no aid
        "ddm_index": 1, "expert": [f"expert_{k}" for k in range(4)], "router": "router",
        "text_encoder": "text_encoder", "decoder": "decoder"}
    width = json.loads((trained / "text_encoder" / "config.json").read_text())["hidden_size"]
    for name, role, family in (("expert_2", "expert", "pixart"),
                               ("monolith", "expert", "pixart"),
                               ("router", "router", "latent-router"),
                               ("text_encoder", "text_encoder", "clip-text"),
                               ("decoder", "decoder", "autoencoder-kl")):
        declared = json.loads((imported / name / "config.json").read_text())["_ddm"]
        assert (declared["role"], declared["family"]) == (role, family)
        [weights] = (imported / name).glob("*.safetensors")
        assert declared["weights_sha256"] == hashlib.sha256(weights.read_bytes()).hexdigest()
        source = "vae" if name == "decoder" else name
        assert weights.read_bytes() == (trained / source / weights.name).read_bytes()
    expert = json.loads((imported / "expert_2" / "config.json").read_text())["_ddm"]
    assert expert["cluster"] == 2 and expert["convention"] == "ours"
    assert expert["latent_shape"] == [4, 8, 8] and expert["text_width"] == width
    assert expert["train"]["steps"] == 1  # the training's provenance is kept
    # what its cluster holds, summarised from the partition's fit, for the page's card
    fit = json.loads((trained / "partition.json").read_text())["fit"]
    assert expert["trained_on"] == TrainedOn.from_fit(fit, 2).declaration()
    assert expert["trained_on"]["images"] == fit["cluster_sizes"][2]
    assert load_stage(imported / "expert_2").declaration.trained_on == TrainedOn.from_fit(fit, 2)
    fitted = json.loads((trained / "text_prior.json").read_text())
    router = json.loads((imported / "router" / "config.json").read_text())["_ddm"]
    assert router["text_prior"] == fitted["text_prior"]  # the text-prior stage's, declared
    assert load_stage(imported / "router").declaration.text_prior.clusters == 4
    assert {"tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in (imported / "text_encoder").iterdir()}
    # the training's example prompt (the caption generator's), declared for the page
    assert load_stage(imported / "text_encoder").declaration.example_prompt == EXAMPLE_PROMPT
    parsed = load_manifest(imported / "ddm.yaml").spec  # the spec's own parser accepts it
    assert [e.framework for e in parsed.experts] == ["torch", "jax", "torch", "jax"]
    spec = yaml.safe_load((imported / "ddm.yaml").read_text())["spec"]
    assert [e["framework"] for e in spec["experts"]] == ["torch", "jax", "torch", "jax"]
    assert spec["experts"][3]["checkpoint"]["uri"] == (imported / "expert_3").as_uri()
    assert spec["conditioning"] == "text"
    assert spec["textEncoder"]["placement"] == spec["decoder"]["placement"] == "separate"


def test_the_import_refuses_an_existing_target_and_names_a_missing_stage(
        trained: Path, imported: Path, tmp_path: Path) -> None:
    with pytest.raises(FileExistsError, match="exists"):
        import_text2img(trained, imported)
    partial = shutil.copytree(trained, tmp_path / "partial",
                              ignore=shutil.ignore_patterns("latents.safetensors"))
    shutil.rmtree(partial / "vae")
    with pytest.raises(CheckpointError, match="has no vae/"):
        import_text2img(partial, tmp_path / "out")
    assert not list(tmp_path.glob(".out.*")) and not (tmp_path / "out").exists()


def test_the_ddm_turns_prompts_into_rgb_images_with_experts_on_both_frameworks(
        imported: Path) -> None:
    mixed = load_ddm(imported, backends=("torch", "jax"))
    plain = load_ddm(imported)
    assert mixed.expert_names == ("expert_0", "expert_1", "expert_2", "expert_3")
    assert mixed.latent_shape == (4, 8, 8) and mixed.router is not None
    prompts = ["a thick red seven", "the number 3 in blue", ""]
    for strategy in ("top1", "top2", "ensemble"):
        a, b = (generate_text(ddm, prompts, steps=3, seed=4, strategy=strategy,
                              guidance_scale=2.0, output="latent") for ddm in (mixed, plain))
        np.testing.assert_allclose(a.state, b.state, atol=1e-4)
    images = generate_text(mixed, prompts, steps=3, seed=4, strategy="top2").images
    assert images.shape == (3, 32, 32, 3) and images.dtype == np.uint8


def test_the_monolith_loads_as_a_one_expert_ddm(imported: Path) -> None:
    monolith = load_ddm(imported, experts=("monolith",))
    assert monolith.expert_names == ("monolith",) and monolith.router is None
    images = generate_text(monolith, ["a 4"], steps=2, seed=0, strategy="top1").images
    assert images.shape == (1, 32, 32, 3)


def test_a_monolith_snapshot_is_its_training_state_declared_as_such(trained: Path) -> None:
    """While the monolith trains, `monolith-snapshot` exports its saved EMA weights; the
    one-step smoke monolith's snapshot is the monolith itself."""
    from ddm.cli import main
    from safetensors.torch import load_file

    assert main(["train", "text2img", "monolith-snapshot", "--mnist", str(trained.parent /
                 "mnist"), "--root", str(trained), "--quiet"]) == 0
    snapshot = trained / "monolith-snapshot"
    declared = json.loads((snapshot / "config.json").read_text())["_ddm"]
    assert declared["trained_steps"] == declared["train"]["steps"] == 1
    got, expected = (load_file(str(d / "diffusion_pytorch_model.safetensors"))
                     for d in (snapshot, trained / "monolith"))
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in got)


def test_ddm_sample_draws_one_rgb_image_per_prompt(imported: Path, tmp_path: Path) -> None:
    from PIL import Image

    from ddm.cli import main

    out, png = tmp_path / "samples.npz", tmp_path / "samples.png"
    assert main(["sample", "--checkpoints", str(imported), "--prompt", "a thick red 3",
                 "--prompt", "a thin blue seven", "--steps", "2", "--guidance-scale", "2",
                 "--backend", "jax", "--out", str(out), "--png", str(png)]) == 0
    with np.load(out) as samples:
        assert samples["images"].shape == (2, 32, 32, 3)
        assert samples["prompts"].tolist() == ["a thick red 3", "a thin blue seven"]
    assert Image.open(png).mode == "RGB"
