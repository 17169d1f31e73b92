"""A pool server refuses members that cannot serve one DDM together (issue 37 item 1): the
shipped text-to-image checkpoints, one copy's declaration changed, rejected before anything
loads, naming both members and their values."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ddm.serving.model.server import create_model_app

CHECKPOINTS = Path(__file__).resolve().parents[2] / "checkpoints" / "text2img"


def _copy(name: str, tmp_path: Path, **declared: object) -> Path:
    """``checkpoints/text2img/name`` under ``tmp_path``, its ``_ddm`` block updated."""
    directory = tmp_path / name
    shutil.copytree(CHECKPOINTS / name, directory)
    config = json.loads((directory / "config.json").read_text())
    config["_ddm"].update(declared)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_members_whose_shapes_or_conventions_disagree_are_refused_by_name(
        tmp_path: Path) -> None:
    members = {"expert-0": CHECKPOINTS / "expert_0",
               "text-encoder": _copy("text_encoder", tmp_path, text_width=256),
               "expert-3": _copy("expert_3", tmp_path, latent_shape=[4, 16, 16],
                                 convention="flow-match-1000"),
               "decoder": CHECKPOINTS / "decoder"}
    with pytest.raises(ValueError) as caught:
        create_model_app(members)
    assert str(caught.value) == (
        "members expert-0 and expert-3 disagree on latent_shape: [4, 8, 8] for expert-0, "
        "[4, 16, 16] for expert-3; members expert-0 and text-encoder disagree on text_width: "
        "128 for expert-0, 256 for text-encoder; members expert-0 and expert-3 disagree on "
        "convention: ours for expert-0, flow-match-1000 for expert-3")


def test_the_shipped_members_agree() -> None:
    create_model_app({name: CHECKPOINTS / name for name in
                     ("expert_0", "expert_3", "text_encoder", "decoder")})
