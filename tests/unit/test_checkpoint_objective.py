"""A checkpoint declares its objective; none means our velocity; unconvertible ones are refused."""

import json

import numpy as np
import pytest

from ddm.checkpoints.format import CheckpointError, CheckpointMeta, read_meta, save_checkpoint
from ddm.models.config import UNET_CONFIGS
from ddm.objectives import NATIVE, Objective

EPSILON = Objective("epsilon", "vp-cosine", "discrete", timesteps=1000, time_scale=1e-3)


def _save(directory, objective=NATIVE):
    meta = CheckpointMeta(kind="expert", name=directory.name,
                          architecture=UNET_CONFIGS["smoke"].to_dict(), framework="torch",
                          classes=(0, 1), objective=objective)
    return save_checkpoint(directory, meta, {"w": np.zeros(2, np.float32)})


def _edit_config(path, edit):
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))


def test_the_declared_objective_round_trips(tmp_path):
    path = _save(tmp_path / "eps", EPSILON)
    assert json.loads((path / "config.json").read_text())["objective"] == {
        "prediction": "epsilon", "schedule": "vp-cosine", "time": "discrete",
        "timesteps": 1000, "time_scale": 0.001}
    assert read_meta(path).objective == EPSILON


def test_a_checkpoint_without_an_objective_predicts_our_velocity(tmp_path):
    path = _save(tmp_path / "old")
    _edit_config(path, lambda c: c.pop("objective"))
    assert read_meta(path).objective == NATIVE and read_meta(path).objective.is_native


def test_the_shipped_velocity_experts_still_load():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "checkpoints" / "digits"
    for name in ("expert-0-4", "expert-5-9", "monolith"):
        assert read_meta(root / name).objective == NATIVE


@pytest.mark.parametrize("declared, named", [
    ({"prediction": "score", "schedule": "ve"}, "prediction 'score' is not one we convert"),
    ({"prediction": "velocity", "schedule": "vp-cosine"}, "'velocity' on schedule 'vp-cosine'"),
    ("epsilon", "must be a JSON object"),
])
def test_an_objective_we_cannot_convert_is_refused_naming_it(tmp_path, declared, named):
    path = _save(tmp_path / "foreign")
    _edit_config(path, lambda c: c.update(objective=declared))
    with pytest.raises(CheckpointError, match="declared objective") as refused:
        read_meta(path)
    assert named in str(refused.value) and str(path) in str(refused.value)
