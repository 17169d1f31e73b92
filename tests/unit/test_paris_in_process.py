"""A tiny Paris release generated in-process through our one sampling loop (prompt encoded,
guided experts routed top-2 on FlowMatchEulerDiscrete's grid, latents decoded) equals Paris's
published sampler (tests/support/paris_reference.py, written apart from ddm's sampling code)
within 2/255 per pixel, in float32."""

from __future__ import annotations

import numpy as np
import pytest

from ddm.checkpoints.format import CheckpointError
from ddm.conditioning import Conditioning
from ddm.models.paris import ParisRouterConfig
from ddm.models.paris_ddm import load_paris_ddm
from ddm.sampling.pipeline import generate_text
from tests.support.paris_reference import ParisReference
from tests.support.paris_release import TinyParis, write_paris_release

PROMPT = "a photo of a red car on the beach"
STEPS = 6
#: Steps of the tests that compare our generations with each other only.
FEW = 3


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    sizes = TinyParis(experts=3, router=ParisRouterConfig(
        input_size=8, hidden_size=32, depth=2, num_heads=4, num_clusters=3))
    return write_paris_release(tmp_path_factory.mktemp("paris") / "release", sizes)


@pytest.fixture(scope="module")
def reference(release) -> ParisReference:
    return ParisReference(release)


@pytest.fixture(scope="module")
def paris(release):
    return load_paris_ddm(release)


def ours(paris, reference, seed: int, prompts=(PROMPT,), steps=STEPS, **options):
    """Our in-process generation from the reference's initial latents for ``seed``."""
    latents = reference.initial_latents(seed).numpy()
    return generate_text(paris, prompts, steps=steps, seed=seed, latents=latents, **options)


def test_guided_top2_image_equals_the_reference_samplers_within_2_of_255(paris, reference):
    seed = 3
    expected = reference.generate(PROMPT, routing="top2", cfg_scale=7.5, num_steps=STEPS,
                                  seed=seed)
    result = ours(paris, reference, seed, strategy="top2", guidance_scale=7.5)
    assert result.images is not None and result.images.shape == (1, 16, 16, 3)
    assert result.images.dtype == np.uint8
    difference = np.abs(result.images[0].astype(int) - expected.image.astype(int))
    assert difference.max() <= 2, f"max pixel difference {difference.max()}"
    np.testing.assert_allclose(result.state, expected.latents, atol=1e-4)
    # The same two experts ran every step, as the port chose them.
    chosen = [tuple(np.flatnonzero(step[0])) for step in result.usage.selections]
    assert chosen == [tuple(sorted(experts)) for experts in expected.experts]


def test_the_release_defaults_are_the_ports_top2_guidance_7_5_and_50_steps(paris):
    assert (paris.strategy, paris.guidance_scale, paris.steps) == ("top2", 7.5, 50)
    assert paris.latent_shape == (4, 8, 8)


def test_guidance_1_and_7_5_give_different_images(paris, reference):
    unguided = ours(paris, reference, 2, guidance_scale=1.0)
    guided = ours(paris, reference, 2, guidance_scale=7.5)
    assert np.abs(unguided.state - guided.state).max() > 0.1
    assert np.abs(unguided.images.astype(int) - guided.images.astype(int)).max() >= 2
    expected = reference.generate(PROMPT, cfg_scale=1.0, num_steps=STEPS, seed=2)
    assert np.abs(unguided.images[0].astype(int) - expected.image.astype(int)).max() <= 2


def test_same_seed_same_image_from_the_seeds_own_noise(paris):
    first = generate_text(paris, [PROMPT, "a cat"], steps=FEW, seed=9)
    again = generate_text(paris, [PROMPT, "a cat"], steps=FEW, seed=9)
    other = generate_text(paris, [PROMPT, "a cat"], steps=FEW, seed=10)
    assert first.images.shape == (2, 16, 16, 3)
    np.testing.assert_array_equal(first.images, again.images)
    assert np.abs(first.state - other.state).max() > 0.1


def test_precomputed_embeddings_and_latent_output_skip_the_text_encoder_and_decoder(
        paris, reference):
    text = reference.encode(PROMPT).numpy()
    conditioning = Conditioning(embeddings=text)
    from_prompt = ours(paris, reference, 4, steps=FEW, output="latent")
    from_embeddings = ours(paris, reference, 4, prompts=(), steps=FEW,
                           conditioning=conditioning, output="latent")
    assert from_prompt.images is None and from_embeddings.images is None
    np.testing.assert_allclose(from_embeddings.state, from_prompt.state, atol=1e-5)


def test_a_negative_prompt_replaces_the_empty_prompt_as_the_unconditional_half(paris,
                                                                              reference):
    plain = ours(paris, reference, 5, steps=FEW, output="latent")
    empty = ours(paris, reference, 5, steps=FEW, output="latent", negative_prompt="")
    negative = ours(paris, reference, 5, steps=FEW, output="latent", negative_prompt="a cat")
    np.testing.assert_allclose(empty.state, plain.state, atol=1e-5)
    assert np.abs(negative.state - plain.state).max() > 0.01


def test_guidance_cut_off_after_half_the_steps_lands_between(paris, reference):
    full = ours(paris, reference, 6, steps=4, output="latent")
    none = ours(paris, reference, 6, steps=4, output="latent", guidance_scale=1.0)
    half = ours(paris, reference, 6, steps=4, output="latent", guidance_cutoff=0.5)
    assert np.abs(half.state - full.state).max() > 1e-3
    assert np.abs(half.state - none.state).max() > 1e-3
    # Under one step of 4 guided: none is (0 itself is outside the one range, (0, 1]).
    under_one = ours(paris, reference, 6, steps=4, output="latent", guidance_cutoff=0.1)
    np.testing.assert_array_equal(under_one.state, none.state)
    with pytest.raises(ValueError, match=r"guidance_cutoff must be a number in \(0, 1\]"):
        ours(paris, reference, 6, steps=4, output="latent", guidance_cutoff=0.0)


@pytest.mark.parametrize("options, message", [
    ({"strategy": "oracle"}, "oracle strategy routes by label"),
    ({"guidance_scale": 51.0}, "guidance_scale"),
    ({"guidance_cutoff": 1.5}, "guidance_cutoff"),
    ({"latents": np.zeros((1, 4, 4, 4), np.float32)}, "latents must be float32 of shape"),
    ({"latents": np.full((1, 4, 8, 8), 3e38, np.float32)},
     r"latents must lie within \+-10000 \(MAX_STATE_MAGNITUDE\), got a value of magnitude "
     r"3e\+38"),
    ({"output": "pixels"}, "output must be one of"),
])
def test_bad_requests_are_refused_by_name_before_any_model_runs(paris, options, message):
    with pytest.raises(ValueError, match=message):
        generate_text(paris, [PROMPT], steps=2, **options)


def test_a_release_whose_decoder_takes_other_latents_is_refused(tmp_path):
    from tests.support.paris_release import tiny_vae

    root = write_paris_release(tmp_path / "release")
    tiny_vae(latent_channels=8).save_pretrained(root / "vae")
    with pytest.raises(CheckpointError, match="decoder takes 8-channel latents"):
        load_paris_ddm(root)


def test_stages_keep_their_weights_dtype_and_answer_float32(tmp_path):
    import torch

    from ddm.models.stages import VaeDecoder
    from tests.support.paris_release import tiny_vae

    tiny_vae(latent_channels=4).to(torch.bfloat16).save_pretrained(tmp_path / "vae")
    decoder = VaeDecoder(tmp_path / "vae")
    assert decoder.model.dtype == torch.bfloat16
    images = decoder(np.zeros((1, 4, 8, 8), np.float32))
    assert images.dtype == np.float32 and images.shape == (1, 3, 16, 16)
