"""``ddm expert check`` on text experts: the shipped text2img ones (PixArt, on torch and its
Flax port), each expert of an imported tiny Paris release, and broken ones (NaN weights, a
shape that disagrees, a misdeclared convention), each failing with its reason."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from ddm.models.paris_import import import_paris
from tests.integration.test_expert_check import SHIPPED, check
from tests.mnist_data import mnist_dir
from tests.support.paris_release import write_paris_release

TEXT2IMG = SHIPPED / "text2img"
WEIGHTS = "diffusion_pytorch_model.safetensors"
#: Every check, in the order the label experts' report lists them.
CHECKS = ["objective", "load", "shapes", "finite", "determinism", "behaviour", "parity"]


@pytest.fixture(scope="module")
def paris_import(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``ddm import paris`` of a tiny release (random weights: nothing to test behaviour on)."""
    release = write_paris_release(tmp_path_factory.mktemp("release") / "paris", seed=5)
    return import_paris(release, tmp_path_factory.mktemp("import") / "dst")


def beside(tmp_path: Path, expert: Path, ddm: Path = TEXT2IMG) -> Path:
    """A copy of ``expert`` as ``expert_0`` of a DDM whose other stages are ``ddm``'s."""
    root = tmp_path / "ddm"
    root.mkdir()
    for stage in ("text_encoder", "decoder", "router"):
        (root / stage).symlink_to(ddm / stage)
    shutil.copytree(expert, root / "expert_0")
    return root / "expert_0"


def declare(expert: Path, **fields: object) -> None:
    """Change what ``expert``'s config.json declares under ``_ddm``, its weights' digest
    recomputed (so that only the change is wrong)."""
    config = json.loads((expert / "config.json").read_text())
    digest = hashlib.sha256((expert / WEIGHTS).read_bytes()).hexdigest()
    config["_ddm"].update({"weights_sha256": digest, "files": {WEIGHTS: digest}}, **fields)
    (expert / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("expert, backend", [("expert_0", "native"), ("expert_1", "jax")])
def test_a_shipped_text_expert_predicts_our_velocity_on_coloured_digits_of_its_cluster(
        expert, backend, capsys):
    status, verdicts = check(TEXT2IMG / expert, capsys, "--backend", backend,
                             "--data", f"mnist:{mnist_dir()}")
    assert status == 0, verdicts
    assert list(verdicts) == CHECKS
    assert all(line.startswith("PASS") for line in verdicts.values()), verdicts
    cluster = expert.removeprefix("expert_")
    assert verdicts["behaviour"].startswith(
        "PASS behaviour: velocity explains the outputs on 192 "
        f"coloured-mnist-32x32/t10k/cluster={cluster} images"), verdicts["behaviour"]
    assert f"on {'jax' if backend == 'jax' else 'torch'}, latents 4x8x8, text width 128" in (
        verdicts["load"])
    assert "through its DDM's text encoder" in verdicts["load"]


def test_each_expert_of_an_imported_paris_release_passes(paris_import, capsys):
    experts = sorted(paris_import.glob("expert_*"))
    assert len(experts) == 2
    for expert in experts:
        status, verdicts = check(expert, capsys)
        assert status == 0, verdicts
        assert list(verdicts) == CHECKS
        assert verdicts["objective"].startswith("PASS objective: declares convention "
                                                "'flow-match-1000' (FlowMatchEulerDiscrete's")
        assert verdicts["load"].startswith(f"PASS load: expert {expert.name} (paris-dit) on "
                                           "torch, latents 4x8x8, text width 32")
        for name in ("shapes", "finite", "determinism"):
            assert verdicts[name].startswith("PASS"), verdicts[name]
        assert verdicts["behaviour"].startswith("SKIP behaviour: config.json records no data "
                                                "source")
        assert verdicts["parity"] == "SKIP parity: a paris-dit network runs on torch only"


def test_a_text_expert_with_nan_weights_fails_the_finite_check(tmp_path, capsys):
    expert = beside(tmp_path, TEXT2IMG / "expert_0")
    weights = load_file(str(expert / WEIGHTS))
    weights["proj_out.weight"] = np.full_like(weights["proj_out.weight"], np.nan)
    save_file(weights, str(expert / WEIGHTS))
    declare(expert)
    status, verdicts = check(expert, capsys)
    assert status == 1
    assert verdicts["load"].startswith("PASS")
    assert verdicts["finite"].startswith("FAIL finite: the velocity has NaN or inf values at "
                                         "t = 0, 0.01, 0.99, 1"), verdicts["finite"]
    assert verdicts["behaviour"] == "SKIP behaviour: the network's outputs are not usable"


def test_a_text_expert_declaring_a_latent_shape_its_network_lacks_fails_to_load(tmp_path,
                                                                                capsys):
    expert = beside(tmp_path, TEXT2IMG / "expert_0")
    declare(expert, latent_shape=[4, 16, 16])
    status, verdicts = check(expert, capsys)
    assert status == 1
    assert list(verdicts) == ["objective", "load"]
    assert verdicts["load"] == (f"FAIL load: CheckpointError: {expert}: _ddm.latent_shape says "
                                "(4, 16, 16), the network has (4, 8, 8)")


def test_a_text_expert_whose_text_width_its_ddm_does_not_make_fails_to_load(
        paris_import, tmp_path, capsys):
    """A Paris expert (32-wide text) beside text2img's text encoder (128 wide)."""
    expert = beside(tmp_path, paris_import / "expert_0")
    status, verdicts = check(expert, capsys)
    assert status == 1
    assert verdicts["load"] == (f"FAIL load: CheckpointError: {expert.parent}: the text "
                                "encoder's width is 128, the experts take [32]")


def test_a_text_expert_declaring_the_wrong_convention_fails_the_behaviour_check(tmp_path,
                                                                                capsys):
    """Our velocity read as FlowMatchEulerDiscrete's ``noise - data`` at ``sigma = 1 - t``:
    served, it would walk the wrong way."""
    expert = beside(tmp_path, TEXT2IMG / "expert_0")
    declare(expert, convention="flow-match-1000")
    status, verdicts = check(expert, capsys, "--data", f"mnist:{mnist_dir()}")
    assert status == 1
    line = verdicts["behaviour"]
    assert line.startswith("FAIL behaviour: config.json declares convention 'flow-match-1000' "
                           "(FlowMatchEulerDiscrete's"), line
    assert line.endswith("Declare the _ddm.convention the network was trained with"), line


def test_a_stage_of_another_role_is_not_an_expert(capsys):
    status, verdicts = check(TEXT2IMG / "router", capsys)
    assert status == 1
    assert verdicts == {"config": f"FAIL config: {TEXT2IMG / 'router'} is a stage of role "
                                  "router, not an expert"}
