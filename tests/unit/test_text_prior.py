"""The router's text prior: p(k | x_t, t, c) ∝ p(k | x_t, t) p(k | c) / p(k), on a tiny
text2img DDM (random weights) whose router declares a hand-made prior."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from ddm.checkpoints.format import CheckpointError
from ddm.conditioning import Conditioning
from ddm.models.ddm import load_ddm
from ddm.models.stages import load_stage
from ddm.models.text_prior import TextPrior, pooled_text
from ddm.training.text2img.prior import fit_text_prior
from tests.support.text_stages import (LATENT_SHAPE, SMOKE, hand_prior, with_prior,
                                      write_text_ddm)

WIDTH = SMOKE.text_width
RNG = np.random.default_rng(0)
X = RNG.standard_normal((3, *LATENT_SHAPE)).astype(np.float32)
T = np.array([0.1, 0.5, 0.9], np.float32)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return with_prior(write_text_ddm(tmp_path_factory.mktemp("prior") / "ddm"), hand_prior())


def test_the_prior_multiplies_the_networks_probabilities_by_p_k_given_c_over_p_k(root):
    router = load_stage(root / "router")
    alone = router.forward(X, T)  # no pooled text: the network's p(k | x_t, t)
    pooled = np.zeros((3, WIDTH), np.float32)
    pooled[:, 0] = [5.0, 0.5, 2.0]  # any length along dimension 0: p(k | c) = (3/4, 1/4)
    # p(k | c) / p(k) = (3/4 / 1/4, 1/4 / 3/4) = (3, 1/3), by hand
    expected = alone * np.array([3.0, 1.0 / 3.0])
    expected /= expected.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(router.forward(X, T, pooled), expected, rtol=1e-5)
    log_odds = TextPrior.from_declaration("hand", hand_prior()).log_odds(pooled[:1])
    np.testing.assert_allclose(log_odds, [[math.log(3.0), -math.log(3.0)]], atol=1e-12)


def test_a_uniform_network_gives_the_prior_over_the_frequencies(root):
    """With p(k | x_t, t) = (1/2, 1/2): (1/2 * 3, 1/2 * 1/3) normalised = (0.9, 0.1)."""
    prior = TextPrior.from_declaration("hand", hand_prior())
    pooled = np.zeros((1, WIDTH))
    pooled[0, 0] = 1.0
    logits = np.log([[0.5, 0.5]]) + prior.log_odds(pooled)
    np.testing.assert_allclose(np.exp(logits) / np.exp(logits).sum(), [[0.9, 0.1]], atol=1e-12)


def test_the_pooled_vector_is_clips_end_of_text_state_and_an_empty_prompt_has_none(root):
    from transformers import AutoTokenizer, CLIPTextModel

    encoder = load_stage(root / "text_encoder")
    prompts = ["a red car", "a blue cat on the beach", ""]
    pooled = pooled_text(encoder.forward(prompts))
    tokenizer = AutoTokenizer.from_pretrained(root / "text_encoder")
    ids = tokenizer(prompts, padding="max_length", max_length=tokenizer.model_max_length,
                    return_tensors="pt").input_ids
    clip = CLIPTextModel.from_pretrained(root / "text_encoder")
    reference = clip(ids).pooler_output.detach().numpy()
    np.testing.assert_allclose(pooled[:2], reference[:2], atol=1e-5)
    assert not pooled[2].any()
    assert pooled_text(Conditioning(embeddings=np.ones((1, 4, WIDTH), np.float32))) is None


def test_an_empty_prompt_routes_as_the_network_alone(root):
    with_the_prior, alone = load_ddm(root), load_ddm(root, text_prior=False)
    empty = with_the_prior.encode(["", ""])
    np.testing.assert_array_equal(with_the_prior.router(X[:2], T[:2], empty),
                                  alone.router(X[:2], T[:2], empty))
    worded = with_the_prior.encode(["a red car", "a photo"])
    assert not np.allclose(with_the_prior.router(X[:2], T[:2], worded),
                           alone.router(X[:2], T[:2], worded))


def test_the_ddm_routes_its_prompts_through_the_prior(root):
    ddm = load_ddm(root)
    cond = ddm.encode(["a red car", "a photo", ""])
    router = load_stage(root / "router")
    np.testing.assert_array_equal(ddm.router(X, T, cond),
                                  router.forward(X, T, pooled_text(cond)))


@pytest.mark.parametrize("change, field", [
    (lambda p: p.update(weights=[[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]),
     "_ddm.text_prior.weights has shape (2, 3); expected (2, 2)"),
    (lambda p: p.update(bias=[0.0, float("nan")]), "_ddm.text_prior.bias holds non-finite"),
    (lambda p: p.update(projection=[[1.0]]), "_ddm.text_prior.weights has shape (2, 2); "
                                             "expected (2, 1)"),
    (lambda p: p.update(log_frequencies=[0.0, 0.0]), "_ddm.text_prior.log_frequencies are "
                                                     "not the logs of frequencies"),
    (lambda p: p.update(bias="none"), "_ddm.text_prior.bias is not an array of numbers"),
    (lambda p: p.update(bias=[[0.0, 0.0]]), "_ddm.text_prior.bias must have 1 dimensions"),
    (lambda p: p.pop("bias"), "_ddm.text_prior must be an object with exactly"),
])
def test_a_malformed_prior_is_refused_naming_the_field(tmp_path, change, field):
    prior = hand_prior()
    change(prior)
    root = with_prior(write_text_ddm(tmp_path / "ddm"), prior)
    with pytest.raises(CheckpointError, match=field.replace("(", r"\(").replace(")", r"\)")):
        load_stage(root / "router")


def test_a_prior_must_fit_the_network_and_the_text_encoder(tmp_path):
    three = hand_prior()
    three.update(weights=[[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], bias=[0.0, 0.0, 0.0],
                 log_frequencies=np.log([0.5, 0.25, 0.25]).tolist())
    root = with_prior(write_text_ddm(tmp_path / "three"), three)
    with pytest.raises(CheckpointError, match="weighs 3 clusters, the router network has 2"):
        load_stage(root / "router")
    wide = hand_prior()
    wide["projection"] = np.zeros((2, WIDTH + 1)).tolist()
    root = with_prior(write_text_ddm(tmp_path / "wide"), wide)
    with pytest.raises(CheckpointError, match=f"takes text of width {WIDTH + 1}, the text "
                                              f"encoder makes {WIDTH}"):
        load_ddm(root)


def test_only_a_router_declares_a_prior(tmp_path):
    root = write_text_ddm(tmp_path / "ddm")
    path = root / "expert_0" / "config.json"
    config = json.loads(path.read_text())
    config["_ddm"]["text_prior"] = hand_prior()
    path.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="only a router declares _ddm.text_prior"):
        load_stage(root / "expert_0")


def test_the_fitted_prior_recovers_each_captions_cluster_frequencies():
    """Two captions along two text dimensions: the first's images are 3:1 in clusters 0:1,
    the second's 1:3; the empty caption (a zero pooled row) is left out of the fit."""
    projection = np.eye(2, 4)
    pooled = np.array([[0.0, 0.0, 0.0, 0.0], [2.0, 0.0, 0.0, 0.0], [0.0, 3.0, 0.0, 0.0]])
    caption_index = np.array([1, 1, 1, 1, 2, 2, 2, 2, 0, 0])
    clusters = np.array([0, 0, 0, 1, 0, 1, 1, 1, 0, 0])
    prior, nll = fit_text_prior(projection, pooled, caption_index, clusters, 2)
    probs = np.exp(prior.log_odds(pooled[1:]) + prior.log_frequencies)
    np.testing.assert_allclose(probs, [[0.75, 0.25], [0.25, 0.75]], atol=0.01)
    np.testing.assert_allclose(np.exp(prior.log_frequencies), [0.6, 0.4])  # 6 and 4 images
    assert nll == pytest.approx(-(0.75 * math.log(0.75) + 0.25 * math.log(0.25)), abs=0.01)
    again, _ = fit_text_prior(projection, pooled, caption_index, clusters, 2)
    np.testing.assert_array_equal(again.weights, prior.weights)  # deterministic
