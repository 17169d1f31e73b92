"""The text-to-image DDM's stages, each run by its CLI on tiny IDX files at the smoke size:
tokenizer, small CLIP (and its text tower as the text encoder), VAE with its scaling factor,
CLIP-feature partition, latents, experts, router and monolith."""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path

import numpy as np
import pytest
import torch

from ddm.cli import main
from ddm.training.text2img.clip import contrastive_loss
from ddm.training.text2img.layout import LATENTS
from ddm.training.text2img.tokenizer import build_tokenizer, tokenize
from tests.support.bars_mnist import write_bars_mnist
from tests.support.text2img_smoke import train_smoke_text2img


def test_tokenizer_wraps_lowercases_pads_and_truncates_as_clip(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    build_tokenizer(["a thick red seven", "the number 7 in red"], max_length=6).save_pretrained(
        tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    vocab = tokenizer.get_vocab()
    ids = tokenize(tokenizer, ["A Thick RED seven", "", "a purple 7", "a thick red seven 7 7"])
    bos, eos, pad, unk = (vocab[t] for t in ("<|startoftext|>", "<|endoftext|>", "<|pad|>",
                                             "<|unk|>"))
    assert ids.tolist() == [
        [bos, vocab["a"], vocab["thick"], vocab["red"], vocab["seven"], eos],
        [bos, eos, pad, pad, pad, pad],
        [bos, vocab["a"], unk, vocab["7"], eos, pad],
        [bos, vocab["a"], vocab["thick"], vocab["red"], vocab["seven"], eos]]


def test_contrastive_loss_counts_repeated_captions_as_positives() -> None:
    ids = torch.tensor([4, 4, 9])
    assert contrastive_loss(torch.zeros(3, 3), ids).item() == pytest.approx(math.log(3))
    same = (ids[:, None] == ids[None, :]).float()
    assert contrastive_loss(40.0 * same, ids).item() == pytest.approx(2 / 3 * math.log(2))


#: The umask the smoke DDM is trained under: not the usual 022, so modes come from it.
UMASK = 0o027


@pytest.fixture(scope="module")
def smoke_root(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    previous = os.umask(UMASK)
    try:
        return train_smoke_text2img(tmp_path_factory.mktemp("text2img"))
    finally:
        os.umask(previous)


def test_stages_write_diffusers_layout_and_index(smoke_root: tuple[Path, Path]) -> None:
    _, root = smoke_root
    index = json.loads((root / "model_index.json").read_text())
    assert index["tokenizer"] == ["transformers", "PreTrainedTokenizerFast"]
    assert index["text_encoder"] == ["transformers", "CLIPTextModel"]
    assert index["vae"] == ["diffusers", "AutoencoderKL"]
    assert index["router"] == ["ddm", "LatentRouter"]
    assert [k for k in index if k.startswith("expert_")] == [f"expert_{i}" for i in range(4)]
    assert all(index[f"expert_{i}"] == ["diffusers", "PixArtTransformer2DModel"]
               for i in range(4))
    assert "monolith" not in index and "clip" not in index  # training aids, not the DDM
    ours = json.loads((root / "ddm_index.json").read_text())  # by role, the decoder in vae/
    assert ours == {"ddm_index": 1, "expert": [f"expert_{i}" for i in range(4)],
                    "router": "router", "text_encoder": "text_encoder", "decoder": "vae"}
    assert (root / "text_encoder" / "model.safetensors").is_file()
    assert (root / "vae" / "diffusion_pytorch_model.safetensors").is_file()
    assert not list(root.glob(".*.partial"))


def test_every_file_a_stage_writes_gets_the_mode_the_umask_gives_anything_new(
        smoke_root: tuple[Path, Path]) -> None:
    # Servers run as another user (the images' uid 10001) than whoever trained the DDM: a
    # private file (safetensors writes its weights 0600) would be unreadable to them.
    _, root = smoke_root
    modes = {str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode) for p in root.rglob("*")}
    assert "expert_0/diffusion_pytorch_model.safetensors" in modes and LATENTS in modes
    wrong = {name: oct(mode) for name, mode in modes.items()
             if mode != (0o777 if (root / name).is_dir() else 0o666) & ~UMASK}
    assert wrong == {}


def test_text_encoder_is_the_clip_text_tower(smoke_root: tuple[Path, Path]) -> None:
    from transformers import AutoTokenizer, CLIPModel, CLIPTextModel

    _, root = smoke_root
    tokenizer = AutoTokenizer.from_pretrained(root / "tokenizer")
    encoder = CLIPTextModel.from_pretrained(root / "text_encoder")
    clip = CLIPModel.from_pretrained(root / "clip")
    ids = torch.from_numpy(tokenize(tokenizer, ["a thick red seven", ""]))
    hidden = encoder(input_ids=ids).last_hidden_state
    assert hidden.shape == (2, tokenizer.model_max_length, clip.config.text_config.hidden_size)
    torch.testing.assert_close(hidden, clip.text_model(input_ids=ids).last_hidden_state)


def test_vae_maps_32x32_rgb_to_4x8x8_with_its_measured_scale(
        smoke_root: tuple[Path, Path]) -> None:
    from diffusers import AutoencoderKL

    from ddm.data.colored_mnist import load_colored_mnist

    mnist, root = smoke_root
    vae = AutoencoderKL.from_pretrained(root / "vae")
    images = load_colored_mnist(mnist).float_images()
    with torch.no_grad():
        means = vae.encode(torch.from_numpy(images)).latent_dist.mean
        decoded = vae.decode(means).sample
    assert means.shape == (40, 4, 8, 8) and decoded.shape == (40, 3, 32, 32)
    assert vae.config.scaling_factor == pytest.approx(1 / float(np.std(means.numpy())), rel=1e-4)


def test_experts_declare_our_convention_and_their_cluster(smoke_root: tuple[Path, Path]) -> None:
    from diffusers import PixArtTransformer2DModel

    from ddm.convention import CONVENTION_NAME
    from ddm.training.text2img.partition import read_embedding_partition

    _, root = smoke_root
    sha = read_embedding_partition(root / "partition.json")["sha256"]
    for index in range(4):
        declared = json.loads((root / f"expert_{index}" / "config.json").read_text())["_ddm"]
        assert declared["convention"] == CONVENTION_NAME and declared["timestep_scale"] == 1000
        assert declared["cluster"] == index and declared["partition_sha256"] == sha
    model = PixArtTransformer2DModel.from_pretrained(root / "expert_0")
    text = json.loads((root / "text_encoder" / "config.json").read_text())
    with torch.no_grad():
        out = model(torch.zeros(2, 4, 8, 8), encoder_hidden_states=torch.zeros(
            2, 32, text["hidden_size"]), timestep=torch.tensor([0.0, 1000.0])).sample
    assert out.shape == (2, 4, 8, 8)
    monolith = json.loads((root / "monolith" / "config.json").read_text())["_ddm"]
    assert monolith["role"] == "monolith" and "cluster" not in monolith


def test_router_sees_only_the_latent_and_time(smoke_root: tuple[Path, Path]) -> None:
    from ddm.models.latent_router import LatentRouter

    _, root = smoke_root
    router = LatentRouter.from_pretrained(root / "router")
    with torch.no_grad():
        logits = router(torch.randn(3, 4, 8, 8), torch.tensor([0.0, 0.5, 1.0]))
    assert logits.shape == (3, 4)
    declared = json.loads((root / "router" / "config.json").read_text())["_ddm"]
    assert set(declared["accuracy_by_time"]) == {"t=0", "t=0.25", "t=0.5", "t=0.75", "t=1"}


def test_latents_hold_each_image_its_cluster_and_caption(smoke_root: tuple[Path, Path]) -> None:
    from diffusers import AutoencoderKL

    from ddm.data.colored_mnist import load_colored_mnist
    from ddm.training.text2img.flow import LatentSet

    mnist, root = smoke_root
    data = load_colored_mnist(mnist)
    latents = LatentSet.load(root / "latents.safetensors")
    vae = AutoencoderKL.from_pretrained(root / "vae")
    with torch.no_grad():
        expected = vae.encode(torch.from_numpy(data.float_images())).latent_dist.mean
    np.testing.assert_allclose(latents.latents, expected.numpy() * vae.config.scaling_factor,
                               atol=1e-5)
    assert latents.clusters.shape == (40,) and set(latents.clusters) <= {0, 1, 2, 3}
    assert len(latents.text_embeddings) == len(set(data.captions) | {""})


def test_a_stage_resumes_only_its_own_run(tmp_path: Path) -> None:
    write_bars_mnist(tmp_path / "mnist", per_class=2)
    args = ["train", "text2img", "vae", "--mnist", str(tmp_path / "mnist"), "--root",
            str(tmp_path / "ddm"), "--size", "smoke", "--batch-size", "4", "--save-every", "1",
            "--quiet"]
    assert main([*args, "--steps", "2"]) == 0
    saved = json.loads((tmp_path / "ddm" / "vae.training" / "identity.json").read_text())
    assert saved["step"] == 2 and saved["stage"] == "vae" and saved["size"] == "smoke"
    assert main([*args, "--steps", "2"]) == 2  # a saved state is never overwritten silently
    assert main([*args, "--steps", "3", "--resume"]) == 2  # nor continued by another run
    assert main([*args, "--steps", "2", "--resume"]) == 0
