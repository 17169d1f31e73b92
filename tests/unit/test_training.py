"""Training commands end to end at smoke size: experts, router, provenance, and refusals."""

import json

import numpy as np
import pytest

from ddm.checkpoints.format import read_meta
from ddm.checkpoints.index import read_index
from ddm.cli import main
from ddm.models.config import UNET_CONFIGS
from ddm.training.config import TrainConfig
from ddm.training.torch_expert import train_torch_unet

# the models run on two cores shared with everything else
pytestmark = pytest.mark.usefixtures("one_torch_thread")




def _train(*argv):
    return main(["train", *map(str, argv), "--steps", "3", "--batch-size", "8", "--quiet"])


def test_torch_training_is_deterministic_and_learns():
    rng = np.random.default_rng(0)
    images = rng.uniform(-1, 1, (32, 1, 8, 8)).astype(np.float32)
    labels = rng.integers(0, 10, 32)
    train = TrainConfig(steps=4, batch_size=8, warmup_steps=1, ema_decay=0.0)
    a = train_torch_unet(UNET_CONFIGS["smoke"], train, images, labels)
    b = train_torch_unet(UNET_CONFIGS["smoke"], train, images, labels)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_learning_rate_schedule_warms_up_then_decays_to_zero():
    train = TrainConfig(steps=10, warmup_steps=2, learning_rate=1.0)
    rates = [train.learning_rate_at(s) for s in range(10)]
    assert rates[:2] == [0.5, 1.0] and rates[2] == 1.0
    assert all(x >= y for x, y in zip(rates[2:], rates[3:])) and rates[-1] < 0.05


def test_experts_and_router_record_their_partition(tmp_path):
    for index in (0, 1):
        assert _train("expert", "--config", "smoke", "--partition", "kmeans:2", "--index", index,
                      "--out", tmp_path / f"e{index}") == 0
    assert _train("router", "--experts", tmp_path, "--out", tmp_path / "router") == 0
    expert, router = read_meta(tmp_path / "e1"), read_meta(tmp_path / "router")
    assert expert.partition["index"] == 1 and expert.partition["scheme"]["method"] == "kmeans"
    assert router.partition["scheme"] == expert.partition["scheme"]
    assert router.architecture["num_experts"] == 2
    index = read_index(tmp_path)  # saved among its experts, the router completes the DDM
    assert index.experts == ("e0", "e1") and dict(index.stages) == {"router": "router"}
    recorded = json.loads((tmp_path / "e1" / "config.json").read_text())
    assert recorded["training"]["steps"] == 3 and recorded["data"]["source"] == "digits"


def test_router_refuses_experts_of_different_partitions(tmp_path, capsys):
    _train("expert", "--config", "smoke", "--partition", "labels:0-4,5-9", "--index", 0,
           "--out", tmp_path / "e0")
    _train("expert", "--config", "smoke", "--partition", "labels:0-2,3-9", "--index", 1,
           "--out", tmp_path / "e1")
    assert _train("router", "--experts", tmp_path, "--out", tmp_path / "router") == 2
    err = capsys.readouterr().err
    assert "do not share one partition" in err
    for index in (0, 1):
        sha = read_meta(tmp_path / f"e{index}").partition["scheme"]["sha256"]
        assert f"e{index}: sha256 {sha}" in err
    assert not (tmp_path / "router").exists()


def test_a_router_trained_beside_the_experts_is_the_one_trained_after_them(tmp_path):
    """Given the partition and the experts' config instead of their checkpoints, the router
    network trains the same weights into the same checkpoint (the partition and image shape
    are the same facts); a router beside experts of another partition is refused by the check
    the outputs pass, naming both partitions."""
    from ddm.checkpoints.format import CheckpointError
    from ddm.data import PartitionMismatchError
    from ddm.training.commands import check_router_partition

    experts = [tmp_path / "experts" / f"e{index}" for index in (0, 1)]
    for index, out in enumerate(experts):
        assert _train("expert", "--config", "smoke", "--partition", "labels:0-4,5-9",
                      "--index", index, "--out", out) == 0
    assert _train("router", "--experts", tmp_path / "experts", "--out", tmp_path / "after") == 0
    assert _train("router", "--partition", "labels:0-4,5-9", "--config", "smoke",
                  "--out", tmp_path / "beside") == 0
    after, beside = read_meta(tmp_path / "after"), read_meta(tmp_path / "beside")
    for field in ("kind", "architecture", "framework", "classes", "partition", "data"):
        assert getattr(beside, field) == getattr(after, field), field
    assert ((tmp_path / "beside" / "weights.safetensors").read_bytes()
            == (tmp_path / "after" / "weights.safetensors").read_bytes())
    check_router_partition(tmp_path / "beside", experts)

    assert _train("router", "--partition", "labels:0-2,3-9", "--config", "smoke",
                  "--out", tmp_path / "other") == 0
    with pytest.raises(PartitionMismatchError) as refused:
        check_router_partition(tmp_path / "other", experts)
    ours = read_meta(experts[0]).partition["scheme"]["sha256"]
    theirs = read_meta(tmp_path / "other").partition["scheme"]["sha256"]
    assert f"router {tmp_path / 'other'} was made for partition sha256 {theirs}" in str(
        refused.value) and f"partition sha256 {ours} is expected" in str(refused.value)
    with pytest.raises(CheckpointError, match="parts \\[0\\] of a 2-part partition"):
        check_router_partition(tmp_path / "beside", experts[:1])


@pytest.mark.parametrize("argv,message", [
    ((), "a router needs --experts DIR, or --partition and --config"),
    (("--partition", "labels:0-4,5-9"), "a router needs --experts DIR, or --partition and "
                                        "--config"),
    (("--partition", "kmeans:2", "--config", "smoke"), "a router's --partition is 'file:PATH' "
                                                       "or 'labels:GROUPS', got 'kmeans:2'"),
    (("--partition", "labels:0-4,5-9", "--config", "huge"), "unknown UNet config"),
    (("--partition", "labels:0-4,5-9", "--config", "smoke", "--config", "smoke", "--config",
      "digits-small"), "--config smoke (image_size 8, in_channels 1, num_classes 10) and "
                       "--config digits-small (image_size 16, in_channels 1, num_classes 10) "
                       "disagree: one router routes between experts of one image shape"),
])
def test_a_router_beside_the_experts_refuses_what_it_cannot_train_on(tmp_path, capsys, argv,
                                                                      message, termination_log):
    assert _train("router", *argv, "--out", tmp_path / "router") == 2
    assert message in capsys.readouterr().err
    assert message in termination_log.read_text()  # what a training job's pod shows
    assert not (tmp_path / "router").exists()


def _fit(path, seed: int, features: str = "hog") -> str:
    assert main(["partition", "fit", "--data", "digits", "--kmeans", "2", "--features", features,
                 "--image-size", "8", "--seed", str(seed), "--out", str(path)]) == 0
    return json.loads(path.read_text())["partition"]["sha256"]


def test_experts_of_different_seeds_share_a_partition_file_and_its_router(tmp_path):
    """A k-means partition fitted once: experts trained with seeds 0 and 1 (PyTorch and JAX)
    record the file's hash, and a router checked against the file is trained for them."""
    sha = _fit(tmp_path / "partition.json", seed=0)
    spec = f"file:{tmp_path / 'partition.json'}"
    for index, framework in ((0, "torch"), (1, "jax")):
        assert _train("expert", "--config", "smoke", "--framework", framework, "--partition",
                      spec, "--index", index, "--seed", index,
                      "--out", tmp_path / "experts" / f"e{index}") == 0
    assert {read_meta(tmp_path / "experts" / f"e{i}").partition["scheme"]["sha256"]
            for i in (0, 1)} == {sha}
    assert _train("router", "--experts", tmp_path / "experts", "--partition", spec,
                  "--out", tmp_path / "router") == 0
    assert read_meta(tmp_path / "router").partition["scheme"]["sha256"] == sha


def test_router_refuses_a_partition_file_its_experts_do_not_share(tmp_path, capsys):
    used = _fit(tmp_path / "used.json", seed=0)
    other = _fit(tmp_path / "other.json", seed=1, features="pixels")
    for index in (0, 1):
        _train("expert", "--config", "smoke", "--partition", f"file:{tmp_path / 'used.json'}",
               "--index", index, "--out", tmp_path / "experts" / f"e{index}")
    assert _train("router", "--experts", tmp_path / "experts", "--partition",
                  f"file:{tmp_path / 'other.json'}", "--out", tmp_path / "router") == 2
    err = capsys.readouterr().err
    assert f"made for partition sha256 {used}" in err and f"partition sha256 {other} is " in err
    assert not (tmp_path / "router").exists()


@pytest.mark.parametrize("argv,message", [
    (("--partition", "labels:0-4,5-9", "--index", 2), "--index 2 is outside the 2 parts"),
    (("--partition", "colour:3", "--index", 0), "unknown partition 'colour:3'"),
    (("--partition", "labels:0-4,4-9", "--index", 0), "label 4 is in groups 0 and 1"),
    (("--partition", "labels:0-4", "--index", 0, "--data", "imagenet"), "unknown data source"),
    (("--partition", "labels:0-4", "--index", 0, "--config", "huge"), "unknown UNet config"),
])
def test_expert_training_rejects_bad_input(tmp_path, capsys, argv, message):
    code = _train("expert", "--config", "smoke", *argv, "--out", tmp_path / "e")
    assert code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "e").exists()


def test_training_refuses_an_out_that_is_not_a_checkpoint_before_training(tmp_path, capsys):
    """Saving replaces ``--out`` whole: a directory of other files (the experts' own directory,
    a typo) would be deleted. It is refused before any training, and nothing is touched."""
    for index in (0, 1):
        assert _train("expert", "--config", "smoke", "--partition", "labels:0-4,5-9",
                      "--index", index, "--out", tmp_path / "experts" / f"e{index}") == 0
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    notes = tmp_path / "notes.txt"
    for argv, out in (
            (("router", "--experts", tmp_path / "experts"), tmp_path / "experts"),
            (("monolith", "--config", "smoke"), tmp_path),
            (("expert", "--config", "smoke", "--partition", "labels:0-4,5-9", "--index", 0),
             notes)):
        notes.write_text("mine")
        assert _train(*argv, "--out", out) == 2
        kind = "a file" if out == notes else "a directory"
        assert capsys.readouterr().err.strip() == (
            f"ddm: error: --out {out} is {kind}, not a checkpoint: saving would replace it "
            "whole (name a new directory, or an existing checkpoint to replace)")
        assert notes.read_text() == "mine"
        notes.unlink()
        assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    assert main(["train", "classifier", "--steps", "1", "--quiet", "--out", str(tmp_path)]) == 2
    assert "not a checkpoint" in capsys.readouterr().err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
