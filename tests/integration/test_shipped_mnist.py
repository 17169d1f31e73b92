"""The shipped MNIST DDM (issue 15): four experts on one k-means partition, alternating PyTorch
and JAX, a router trained for them, and digits the MNIST classifier reads.

Nothing here trains or reads MNIST itself: the checkpoints are what `scripts/train_mnist.sh`
made, and the classifier judges the samples alone (the full table, Frechet distances against
MNIST's test set included, is docs/quality.md, made by ``ddm report``).
"""

from pathlib import Path

import numpy as np
import pytest

from ddm.checkpoints.discovery import discover
from ddm.checkpoints.format import read_meta
from ddm.data import partition_sha256
from ddm.data.partition_file import read_partition_file
from ddm.evaluation.classifier import load_classifier
from ddm.evaluation.report import expert_parity
from ddm.models.ddm import load_ddm
from ddm.sampling.pipeline import generate

MNIST = Path(__file__).resolve().parents[2] / "checkpoints" / "mnist"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_experts_alternate_frameworks_and_share_the_shipped_partition():
    found = discover(MNIST)
    assert {k: len(v) for k, v in found.items()} == {
        "expert": 4, "router": 1, "classifier": 1, "monolith": 1}
    shipped = read_partition_file(MNIST / "partition.json")["partition"]
    metas = sorted((read_meta(p) for p in found["expert"]), key=lambda m: m.partition["index"])
    assert [m.partition["index"] for m in metas] == [0, 1, 2, 3]
    assert [m.framework for m in metas] == ["torch", "jax", "torch", "jax"]
    assert len({m.training["seed"] for m in metas}) == 4  # trained apart, one seed each
    for meta in [*metas, read_meta(found["router"][0])]:
        assert partition_sha256(meta.partition["scheme"]) == shipped["sha256"], meta.name
    for meta in metas:  # every expert draws every digit: only the image says which cluster
        assert meta.classes == tuple(range(10))
    size = sum(f.stat().st_size for f in MNIST.rglob("*") if f.is_file())
    assert size < 8_000_000


def test_the_monolith_has_the_experts_network_and_their_total_compute():
    """docs/quality.md's baseline: the same UNet and batch on all the data, as many steps as
    the four experts together."""
    found = discover(MNIST)
    experts = [read_meta(p) for p in found["expert"]]
    monolith = read_meta(found["monolith"][0])
    assert monolith.classes == tuple(range(10)) and not monolith.partition
    assert all(monolith.architecture == e.architecture for e in experts)
    assert all(monolith.training["batch_size"] == e.training["batch_size"] for e in experts)
    assert monolith.training["steps"] == sum(e.training["steps"] for e in experts)
    assert monolith.data["images"] == sum(e.data["images"] for e in experts) == 60000


def test_torch_and_flax_agree_on_the_shipped_mnist_experts():
    parity = expert_parity(MNIST)
    assert set(parity) == {"expert-0", "expert-1", "expert-2", "expert-3"}
    assert max(parity.values()) <= 1e-4, parity


@pytest.mark.slow
def test_top1_mnist_digits_are_read_as_the_asked_class():
    labels = np.repeat(np.arange(10), 10)
    out = generate(load_ddm(MNIST), labels, steps=40, seed=1, strategy="top1")
    assert out.images.shape == (100, 32, 32)
    accuracy = float((load_classifier(MNIST / "classifier").predict(out.images) == labels).mean())
    assert accuracy >= 0.95, accuracy
    # the router sends images to every cluster's expert, not one expert per label
    used = out.usage.calls_per_expert() > 0
    assert used.any(axis=0).all()
    assert any(len(set(np.flatnonzero(used[labels == label].any(axis=0)))) > 1
               for label in range(10))
