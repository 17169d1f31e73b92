"""The text-to-image DDM's first stages, each run by its CLI on tiny IDX files at the smoke size:
tokenizer, small CLIP (and its text tower as the text encoder), VAE with its scaling factor."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from ddm.cli import main
from ddm.training.text2img.clip import contrastive_loss
from ddm.training.text2img.tokenizer import build_tokenizer, tokenize
from tests.support.bars_mnist import write_bars_mnist


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


@pytest.fixture(scope="module")
def smoke_root(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("text2img")
    write_bars_mnist(base / "mnist", per_class=4)
    root = base / "ddm"
    for stage in ("tokenizer", "clip", "vae"):
        assert main(["train", "text2img", stage, "--mnist", str(base / "mnist"), "--root",
                     str(root), "--size", "smoke", "--steps", "1", "--batch-size", "4",
                     "--quiet"]) == 0
    return base / "mnist", root


def test_stages_write_diffusers_layout_and_index(smoke_root: tuple[Path, Path]) -> None:
    _, root = smoke_root
    index = json.loads((root / "model_index.json").read_text())
    assert index["tokenizer"] == ["transformers", "PreTrainedTokenizerFast"]
    assert index["text_encoder"] == ["transformers", "CLIPTextModel"]
    assert index["vae"] == ["diffusers", "AutoencoderKL"]
    assert (root / "text_encoder" / "model.safetensors").is_file()
    assert (root / "vae" / "diffusion_pytorch_model.safetensors").is_file()
    assert not list(root.glob(".*.partial"))


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
