"""The reference Paris sampler (tests/support/paris_reference.py) on a tiny random release:
deterministic, guided, routed as the port routes, and reproduced by Euler steps in our own
time and velocity convention."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ddm.convention import flow_match_sigma_grid, flow_match_timestep, velocity_from_flow_match
from ddm.models.paris import ParisRouterConfig
from tests.support.paris_reference import ParisReference
from tests.support.paris_release import TinyParis, write_paris_release

PROMPT = "a photo of a red car on the beach"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> ParisReference:
    sizes = TinyParis(experts=3, router=ParisRouterConfig(
        input_size=8, hidden_size=32, depth=2, num_heads=4, num_clusters=3))
    return ParisReference(write_paris_release(tmp_path_factory.mktemp("paris") / "release",
                                              sizes))


def test_same_seed_same_image_and_routing(reference):
    first = reference.generate(PROMPT, num_steps=8, seed=5)
    again = reference.generate(PROMPT, num_steps=8, seed=5)
    assert first.image.shape == (16, 16, 3) and first.image.dtype == np.uint8
    np.testing.assert_array_equal(first.image, again.image)
    assert first.experts == again.experts and first.weights == again.weights


def test_another_seed_gives_another_image(reference):
    one = reference.generate(PROMPT, num_steps=8, seed=5).image.astype(float)
    other = reference.generate(PROMPT, num_steps=8, seed=6).image.astype(float)
    assert np.abs(one - other).mean() > 1.0


def test_guidance_1_and_7_5_give_different_images(reference):
    unguided = reference.generate(PROMPT, cfg_scale=1.0, num_steps=8, seed=5)
    guided = reference.generate(PROMPT, cfg_scale=7.5, num_steps=8, seed=5)
    assert np.abs(unguided.latents - guided.latents).max() > 0.1
    assert np.abs(unguided.image.astype(float) - guided.image.astype(float)).max() >= 2


def test_given_latents_replace_the_seeds_noise(reference):
    noise = reference.initial_latents(11)
    from_seed = reference.generate(PROMPT, num_steps=4, seed=11)
    from_latents = reference.generate(PROMPT, num_steps=4, seed=0, latents=noise)
    np.testing.assert_array_equal(from_seed.latents, from_latents.latents)


@pytest.mark.parametrize("routing, experts_per_step", [("top1", 1), ("top2", 2), ("full", 3)])
def test_routing_runs_the_ports_number_of_experts_with_weights_summing_to_one(
        reference, routing, experts_per_step):
    result = reference.generate(PROMPT, routing=routing, num_steps=4, seed=1)
    assert [len(chosen) for chosen in result.experts] == [experts_per_step] * 4
    for chosen, weights in zip(result.experts, result.weights):
        assert len(set(chosen)) == len(chosen)
        assert sum(weights) == pytest.approx(1.0, abs=1e-6)
    if routing == "top2":
        assert all(w[0] >= w[1] for w in result.weights)


def test_a_bad_routing_is_refused(reference):
    with pytest.raises(ValueError, match="routing"):
        reference.generate(PROMPT, routing="top3")


def test_euler_steps_in_our_convention_reproduce_the_reference_latents(reference):
    """t = 1 - sigma, the expert's time input sigma * 1000, our velocity -output: integrating
    the same guided top-1 experts from t = 0 to 1 lands where Paris's sampler does."""
    steps, scale, seed = 6, 7.5, 3
    expected = reference.generate(PROMPT, routing="top1", cfg_scale=scale, num_steps=steps,
                                  seed=seed)
    text = torch.cat([reference.encode(PROMPT), reference.encode("")])
    x = reference.initial_latents(seed).numpy()
    times = flow_match_sigma_grid(steps).times
    with torch.no_grad():
        for (expert,), t, t_next in zip(expected.experts, times[:-1], times[1:]):
            timestep = torch.from_numpy(flow_match_timestep(np.repeat(t, 2)))
            both = reference.experts[expert](torch.from_numpy(np.concatenate([x, x])), timestep,
                                             text).numpy()
            guided = both[1:] + scale * (both[:1] - both[1:])
            x = x + (t_next - t) * velocity_from_flow_match(guided)
    np.testing.assert_allclose(x, expected.latents, atol=1e-4)
