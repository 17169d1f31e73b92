"""Stage checkpoints (DESIGN-22 section 1) load by their declared role and family into NumPy
callables in our convention: a PixArt expert in our convention and a Paris expert in
FlowMatchEulerDiscrete's give what their networks give, converted exactly; precision casts the
weights and answers stay float32; a directory of stages samples in-process; bad declarations
are refused by name."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

from ddm.checkpoints.format import CheckpointError
from ddm.conditioning import Conditioning
from ddm.deploy.limits import MAX_TEXT_TOKENS
from ddm.models.ddm import load_ddm
from ddm.models.stages import load_stage
from ddm.sampling.pipeline import generate_text
from tests.support.paris_release import TinyParis, write_paris_release
from tests.support.text_stages import LATENT_SHAPE, write_paris_stages, write_text_ddm

RNG = np.random.default_rng(0)
X = RNG.standard_normal((2, *LATENT_SHAPE)).astype(np.float32)
T = np.array([0.25, 0.9], np.float32)


@pytest.fixture(scope="module")
def text_ddm(tmp_path_factory):
    return write_text_ddm(tmp_path_factory.mktemp("stages") / "ddm")


@pytest.fixture(scope="module")
def paris_stages(tmp_path_factory):
    root = tmp_path_factory.mktemp("paris")
    return write_paris_stages(write_paris_release(root / "release", TinyParis()),
                              root / "stages")


def test_a_pixart_expert_answers_its_networks_output_at_t_times_1000(text_ddm):
    from diffusers import PixArtTransformer2DModel

    stage = load_stage(text_ddm / "expert_1")
    assert (stage.role, stage.dtype, stage.declaration.latent_shape,
            stage.declaration.text_width) == ("expert", "float32", (4, 8, 8), 16)
    text = RNG.standard_normal((2, 12, 16)).astype(np.float32)
    v = stage.forward(X, T, Conditioning(embeddings=text))
    network = PixArtTransformer2DModel.from_pretrained(text_ddm / "expert_1").eval()
    with torch.no_grad():
        expected = network(torch.from_numpy(X), encoder_hidden_states=torch.from_numpy(text),
                           timestep=torch.tensor([250.0, 900.0]),
                           added_cond_kwargs={"resolution": None, "aspect_ratio": None}).sample
    assert v.dtype == np.float32
    np.testing.assert_allclose(v, expected.numpy(), atol=1e-5)


def test_a_paris_expert_sees_sigma_times_1000_and_its_output_is_negated(paris_stages):
    from ddm.models.paris_loading import load_paris_expert

    stage = load_stage(paris_stages / "expert_0")
    assert (stage.declaration.family, stage.declaration.text_width) == ("paris-dit", 32)
    text = RNG.standard_normal((2, 77, 32)).astype(np.float32)
    v = stage.forward(X, T, Conditioning(embeddings=text))
    network = load_paris_expert(paris_stages / "expert_0")
    with torch.no_grad():
        output = network(torch.from_numpy(X), torch.tensor([750.0, 100.0]),
                         torch.from_numpy(text))
    np.testing.assert_allclose(v, -output.numpy(), atol=1e-4)


def test_routers_answer_probabilities_over_their_clusters(text_ddm, paris_stages):
    for directory in (text_ddm / "router", paris_stages / "router"):
        stage = load_stage(directory)
        probabilities = stage.forward(X, T)
        assert stage.clusters == 2 and probabilities.shape == (2, 2)
        np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, atol=1e-6)


@pytest.mark.parametrize("precision, tolerance", [("bfloat16", 0.1), ("float16", 0.01)])
def test_precision_casts_the_weights_and_answers_stay_float32(text_ddm, precision, tolerance):
    text = RNG.standard_normal((2, 12, 16)).astype(np.float32)
    full = load_stage(text_ddm / "expert_0").forward(X, T, Conditioning(embeddings=text))
    stage = load_stage(text_ddm / "expert_0", dtype=precision)
    v = stage.forward(X, T, Conditioning(embeddings=text))
    assert stage.dtype == precision and v.dtype == np.float32
    assert 0 < np.abs(v - full).max() < tolerance * np.abs(full).max()


def test_text_encoder_pads_to_its_length_and_counts_what_truncation_cut(text_ddm):
    stage = load_stage(text_ddm / "text_encoder")
    cond = stage.forward(["a red car", "a red car " * 5])
    assert cond.embeddings.shape == (2, 12, 16) and cond.embeddings.dtype == np.float32
    assert cond.mask[0].sum() == 5  # start, three words, end
    # 15 words + start + end = 17 tokens, 12 kept.
    assert stage.tokens_cut(["a red car", "a red car " * 5]).tolist() == [0, 5]


def test_counting_a_long_prompts_cut_leaves_the_log_alone(text_ddm, caplog):
    """The answer says a prompt was cut; transformers' "longer than the specified maximum"
    warning would say it again in every server's log."""
    stage = load_stage(text_ddm / "text_encoder")
    with caplog.at_level(logging.WARNING):
        assert stage.tokens_cut(["a red car " * 5]).tolist() == [5]
    assert caplog.records == []


def test_decoder_maps_latents_to_rgb_images(text_ddm):
    stage = load_stage(text_ddm / "decoder")
    images = stage.forward(X)
    assert stage.image_shape == (3, 32, 32) and images.shape == (2, 3, 32, 32)
    assert images.dtype == np.float32


def test_a_directory_of_stages_samples_in_process(text_ddm, paris_stages):
    for root, side in ((text_ddm, 32), (paris_stages, 16)):
        ddm = load_ddm(root)
        result = generate_text(ddm, ["a red car"], steps=2, seed=0, guidance_scale=3.0,
                               strategy="top1")
        assert result.images is not None and result.images.shape == (1, side, side, 3)
    assert load_ddm(paris_stages).grid.kind == "flow-match"
    assert load_ddm(text_ddm).grid.kind == "uniform"


def _edit(directory, **changes):
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config["_ddm"].update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        del config["_ddm"][key]
    path.write_text(json.dumps(config))


@pytest.mark.parametrize("changes, message", [
    ({"role": "decoder"}, "a pixart network plays the role expert, not decoder"),
    ({"family": "stylegan"}, "family is 'stylegan'"),
    ({"convention": None}, "must declare _ddm.convention"),
    ({"convention": "flow-match-x"}, "unknown network convention"),
    ({"latent_shape": [4, 16, 16]}, r"latent_shape says \(4, 16, 16\), the network has"),
    ({"latent_shape": [4, 8, 1 << 40]}, "latent_shape must be"),
    ({"text_width": 32}, "text_width says 32"),
    ({"weights_sha256": "0" * 64}, "corrupt"),
])
def test_bad_declarations_are_refused_by_name(tmp_path, text_ddm, changes, message):
    import shutil

    directory = shutil.copytree(text_ddm / "expert_0", tmp_path / "expert_0")
    _edit(directory, **changes)
    with pytest.raises(CheckpointError, match=message):
        load_stage(directory)


def _library_config(directory, **changes):
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize("stage, field", [("expert_0", "num_layers"), ("router", "depth"),
                                          ("text_encoder", "num_hidden_layers"),
                                          ("decoder", "layers_per_block")])
def test_a_library_networks_depth_is_bounded_before_the_library_builds_it(
        tmp_path, text_ddm, monkeypatch, stage, field):
    # the libraries allocate every block's weights before reading one: 20000 blocks of a
    # 1 kB config.json would be built before the weights could disagree
    import shutil

    directory = shutil.copytree(text_ddm / stage, tmp_path / stage)
    _library_config(directory, **{field: 20000})
    monkeypatch.setattr("ddm.models.stages._LOADERS", {})  # no loader may run
    with pytest.raises(CheckpointError, match=f"config.json: {field} gives 20000 blocks; a "
                                              "network has at most 256"):
        load_stage(directory)


@pytest.mark.parametrize("length", [None, MAX_TEXT_TOKENS + 1])
def test_a_tokenizer_that_pads_past_the_text_limit_is_refused(tmp_path, text_ddm, length):
    # Prompts are padded to model_max_length: without one, transformers pads to 1e30.
    import shutil

    directory = shutil.copytree(text_ddm / "text_encoder", tmp_path / "text_encoder")
    path = directory / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config.pop("model_max_length", None)
    if length is not None:
        config["model_max_length"] = length
    path.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="model_max_length is .* must be 1..512"):
        load_stage(directory)


def test_a_component_without_declarations_is_refused(tmp_path, text_ddm):
    import shutil

    directory = shutil.copytree(text_ddm / "decoder", tmp_path / "vae")
    config = json.loads((directory / "config.json").read_text())
    del config["_ddm"]
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="declares no '_ddm' object"):
        load_stage(directory)


def test_unknown_precision_and_jax_for_other_families_are_refused(text_ddm):
    with pytest.raises(CheckpointError, match="unknown precision 'int8'"):
        load_stage(text_ddm / "expert_0", dtype="int8")
    with pytest.raises(CheckpointError, match="jax backend serves pixart experts only"):
        load_stage(text_ddm / "router", backend="jax")
