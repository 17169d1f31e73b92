"""The checkpoint format: atomic writes, integrity checks, and errors that name the problem."""

import json
import os
import re
import stat
from pathlib import Path

import numpy as np
import pytest
import torch

from ddm.checkpoints.declared import MAX_CONFIG_BYTES
from ddm.checkpoints.format import (EXPORTED_PROGRAMS, FRAMEWORKS, CheckpointError,
                                    CheckpointMeta, ModelSpec, load_checkpoint, read_meta,
                                    save_checkpoint)
from ddm.checkpoints.verify import verify_checkpoint
from ddm.models.config import UNET_CONFIGS, ConfigError, UNetConfig, unet_config
from ddm.models.torch_io import canonical_weights, unet_from_checkpoint
from ddm.models.torch_unet import UNet, count_parameters

SMOKE = UNET_CONFIGS["smoke"]


def _meta(**overrides):
    fields = dict(kind="expert", name="e0", architecture=SMOKE.to_dict(), framework="torch",
                  classes=(0, 1), partition={"scheme": {"method": "labels",
                                                         "groups": [[0, 1], [2]]}, "index": 0})
    return CheckpointMeta(**(fields | overrides))


@pytest.fixture()
def smoke_checkpoint(tmp_path):
    torch.manual_seed(0)
    model = UNet(SMOKE)
    return save_checkpoint(tmp_path / "e0", _meta(), canonical_weights(model)), model


def test_round_trip_restores_identical_weights(smoke_checkpoint):
    path, model = smoke_checkpoint
    restored = unet_from_checkpoint(load_checkpoint(path))
    for name, value in model.state_dict().items():
        assert torch.equal(restored.state_dict()[name], value), name
    assert read_meta(path).classes == (0, 1)


def test_missing_directory_and_files(tmp_path, smoke_checkpoint):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nowhere")
    path, _ = smoke_checkpoint
    (path / "weights.safetensors").unlink()
    with pytest.raises(CheckpointError, match="has no weights.safetensors"):
        load_checkpoint(path)


def test_corrupt_weights_are_detected(smoke_checkpoint):
    path, _ = smoke_checkpoint
    data = bytearray((path / "weights.safetensors").read_bytes())
    data[-10] ^= 0xFF
    (path / "weights.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt"):
        load_checkpoint(path)


def test_corrupt_config_is_detected(smoke_checkpoint):
    path, _ = smoke_checkpoint
    (path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_checkpoint(path)


def test_an_oversized_config_is_refused_unread(smoke_checkpoint):
    # A hostile checkpoint store's config.json: valid JSON, padded past the cap every
    # config.json is read within (a stage's and a label expert's alike).
    path, _ = smoke_checkpoint
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config) + " " * MAX_CONFIG_BYTES)
    for read in (read_meta, load_checkpoint, verify_checkpoint):
        with pytest.raises(CheckpointError, match=f"larger than {MAX_CONFIG_BYTES}"):
            read(path)


def test_foreign_convention_is_refused(smoke_checkpoint):
    path, _ = smoke_checkpoint
    config = json.loads((path / "config.json").read_text())
    config["convention"] = "ddpm/epsilon"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="convention"):
        load_checkpoint(path)


@pytest.mark.parametrize("field, value, found", [
    ("classes", "0123", "'0123'"),
    ("classes", [1.5], "1.5"),
    ("classes", [True], "True"),
    ("classes", ["1"], "'1'"),
    ("classes", {"0": 1}, r"\{'0': 1\}"),
    ("format_version", True, "True"),
    ("format_version", 1.0, "1.0"),
])
def test_a_config_of_the_wrong_json_types_is_refused_naming_the_field(smoke_checkpoint, field,
                                                                       value, found):
    # config.json comes from a checkpoint store: "0123" is no (0, 1, 2, 3), and JSON's true
    # or 1.5 no class 1, though Python's int() and == would read them so
    path, _ = smoke_checkpoint
    config = json.loads((path / "config.json").read_text())
    config[field] = value
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError,
                       match=f"checkpoint {re.escape(str(path))}: {field} .*{found}"):
        read_meta(path)


@pytest.mark.parametrize("classes, message", [
    ([0, -1], "classes must be labels from 0, got -1"),
    ([0, 1, 1], "classes list 1 more than once"),
    ([0, SMOKE.num_classes], f"class {SMOKE.num_classes} is beyond the architecture's "
                             f"num_classes of {SMOKE.num_classes}"),
])
def test_classes_the_network_cannot_embed_are_refused_naming_the_class(smoke_checkpoint,
                                                                       classes, message):
    # else the server starts, and the first request naming the class fails in the model
    path, _ = smoke_checkpoint
    config = json.loads((path / "config.json").read_text())
    config["classes"] = classes
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError,
                       match=f"checkpoint {re.escape(str(path))}: {re.escape(message)}"):
        read_meta(path)


def test_architecture_mismatch_names_the_tensor(tmp_path):
    wider = UNetConfig(**(SMOKE.to_dict() | {"base_channels": 16, "channel_mults": (1, 2)}))
    path = save_checkpoint(tmp_path / "e0", _meta(), canonical_weights(UNet(wider)))
    with pytest.raises(CheckpointError, match=r"conv_in.weight has shape \(16, 1, 3, 3\)"):
        unet_from_checkpoint(load_checkpoint(path))


def test_failed_save_leaves_the_old_checkpoint(smoke_checkpoint):
    path, _ = smoke_checkpoint
    before = (path / "weights.safetensors").read_bytes()
    with pytest.raises(Exception):
        save_checkpoint(path, _meta(), {"bad": object()})
    assert (path / "weights.safetensors").read_bytes() == before
    assert sorted(p.name for p in path.parent.iterdir()) == ["e0"]


@pytest.mark.parametrize("umask, directory_mode", [(0o022, 0o755), (0o027, 0o750)],
                         ids=["umask-022", "umask-027"])
def test_a_saved_checkpoint_gets_the_modes_the_umask_gives_anything_new(tmp_path, umask,
                                                                        directory_mode):
    # Servers run as another user (the images' uid 10001) than whoever trained or exported
    # the checkpoint: a private directory or weights file (a temporary's 0700 and 0600) would
    # be unreadable to them. A replaced checkpoint gets the same modes as a new one.
    previous = os.umask(umask)
    try:
        for _ in range(2):  # new, then replaced
            path = save_checkpoint(tmp_path / "e0", _meta(), canonical_weights(UNet(SMOKE)))
            assert stat.S_IMODE(path.stat().st_mode) == directory_mode
            for name in ("config.json", "weights.safetensors"):
                assert stat.S_IMODE((path / name).stat().st_mode) == directory_mode & 0o666, name
    finally:
        os.umask(previous)
    assert [p.name for p in tmp_path.iterdir()] == ["e0"]  # no staging or backup left


def test_a_save_replaces_a_checkpoint_or_an_empty_directory_and_nothing_else(smoke_checkpoint):
    path, model = smoke_checkpoint
    weights = canonical_weights(model)
    assert save_checkpoint(path, _meta(name="again"), weights) == path  # a checkpoint: replaced
    assert read_meta(path).name == "again"
    (path.parent / "empty").mkdir()
    save_checkpoint(path.parent / "empty", _meta(), weights)
    (path.parent / "empty" / "notes.txt").write_text("mine")  # no longer only a checkpoint
    (path.parent / "file").write_text("mine")
    for target, kind in ((path.parent / "empty", "a directory"), (path.parent / "file", "a file"),
                         (path.parent, "a directory")):
        with pytest.raises(CheckpointError, match=f"output {target} is {kind}, not a checkpoint"):
            save_checkpoint(target, _meta(), weights)
    assert (path.parent / "empty" / "notes.txt").read_text() == "mine"
    assert (path.parent / "file").read_text() == "mine"
    assert sorted(p.name for p in path.parent.iterdir()) == ["e0", "empty", "file"]


def test_meta_rejects_unknown_kind_and_framework():
    with pytest.raises(CheckpointError, match="unknown checkpoint kind"):
        _meta(kind="painting")
    with pytest.raises(CheckpointError, match="unknown framework"):
        _meta(framework="tensorflow")


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_an_exported_program_is_kept_in_its_frameworks_file_and_pinned(framework, tmp_path):
    """Every framework has an exported format; the file name says which, config.json its
    SHA-256. A program in the other framework's file is a missing program."""
    assert set(EXPORTED_PROGRAMS) == set(FRAMEWORKS)
    meta = _meta(framework=framework, model=ModelSpec("exported", image_shape=(1, 8, 8)))
    path = save_checkpoint(tmp_path / framework, meta, {}, program=b"program bytes")
    assert (path / EXPORTED_PROGRAMS[framework]).read_bytes() == b"program bytes"
    assert load_checkpoint(path).meta.model.kind == "exported"
    config = json.loads((path / "config.json").read_text())
    other = "jax" if framework == "torch" else "torch"
    (path / "config.json").write_text(json.dumps(config | {"framework": other}))
    with pytest.raises(CheckpointError, match=f"has no {EXPORTED_PROGRAMS[other]}"):
        load_checkpoint(path)


def test_named_configs_have_the_documented_sizes():
    assert 200_000 < count_parameters(UNet(unet_config("digits-small"))) < 300_000
    reference = unet_config("reference")
    assert reference.level_channels == (64, 128, 256) and reference.image_size == 32
    assert 6_000_000 < count_parameters(UNet(reference)) < 7_000_000


def test_configs_reject_bad_values():
    with pytest.raises(ConfigError, match="unknown UNet config 'huge'"):
        unet_config("huge")
    with pytest.raises(ConfigError, match="unknown keys: depth"):
        UNetConfig.from_dict(SMOKE.to_dict() | {"depth": 3})
    with pytest.raises(ConfigError, match="not divisible"):
        UNetConfig(image_size=10, channel_mults=(1, 2, 4))
    # a config.json's depth is built before the weights can disagree: bounded
    with pytest.raises(ConfigError, match="2 levels of 20000 residual blocks; a network has "
                                          "at most 256"):
        UNetConfig.from_dict(SMOKE.to_dict() | {"num_res_blocks": 20000})


def test_a_ddm_is_its_experts_and_router_only(tmp_path, smoke_checkpoint):
    """What ``load_ddm`` assembles (and what ``ddm report --cache`` fingerprints): a classifier
    or monolith beside the experts is not part of the DDM; a second router is refused."""
    from ddm.models.ddm import ddm_layout

    def ddm_members(root):
        layout = ddm_layout(root)
        return list(layout.experts), layout.router

    path, model = smoke_checkpoint
    assert ddm_members(path) == ([path], None)  # one model alone
    weights = canonical_weights(model)
    save_checkpoint(tmp_path / "e1", _meta(name="e1", classes=(2,), partition={
        "scheme": {"method": "labels", "groups": [[0, 1], [2]]}, "index": 1}), weights)
    save_checkpoint(tmp_path / "mono", _meta(kind="monolith", name="mono", partition={}),
                    weights)
    assert ddm_members(tmp_path) == ([tmp_path / "e0", tmp_path / "e1"], None)
    for name in ("router", "router2"):  # weights of the right kind do not matter here
        save_checkpoint(tmp_path / name, _meta(kind="router", name=name, partition={}), weights)
        if name == "router":
            assert ddm_members(tmp_path) == ([tmp_path / "e0", tmp_path / "e1"],
                                             tmp_path / "router")
    with pytest.raises(CheckpointError, match="holds 2 routers; keep exactly one"):
        ddm_members(tmp_path)
    lone = tmp_path / "lone"
    save_checkpoint(lone / "mono", _meta(kind="monolith", name="mono", partition={}), weights)
    with pytest.raises(CheckpointError, match="holds no expert checkpoints \\(found: monolith\\)"):
        ddm_members(lone)


def test_the_stored_precision_is_read_from_the_header_and_a_mix_is_refused(tmp_path: Path):
    """One rule for every loader (label checkpoints and library components): the floating
    dtype stored, None where there is none, a mix of floating dtypes refused naming the file."""
    import ml_dtypes
    from safetensors.numpy import save_file

    from ddm.checkpoints.format import stored_precision

    cases = {"half.safetensors": {"w": np.zeros(2, np.float16), "n": np.zeros(2, np.int64)},
             "bf16.safetensors": {"w": np.zeros(2, ml_dtypes.bfloat16)},
             "ints.safetensors": {"n": np.zeros(2, np.int64)},
             "mixed.safetensors": {"w": np.zeros(2, np.float32), "v": np.zeros(2, np.float16)}}
    for name, tensors in cases.items():
        save_file(tensors, str(tmp_path / name))
    assert stored_precision(tmp_path / "half.safetensors") == "float16"
    assert stored_precision(tmp_path / "bf16.safetensors") == "bfloat16"
    assert stored_precision(tmp_path / "ints.safetensors") is None
    with pytest.raises(CheckpointError, match=r"mixed\.safetensors mixes floating dtypes"):
        stored_precision(tmp_path / "mixed.safetensors")
