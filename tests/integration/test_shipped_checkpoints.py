"""The shipped digits DDM: complete, loadable by both frameworks, and good enough to ship.

The full quality figures (50 images per digit, every strategy) live in docs/quality-digits.md and
come from ``ddm report``; this test re-checks a smaller sample so that CI stays fast.
"""

from pathlib import Path

import numpy as np
import pytest

from ddm.checkpoints.format import read_meta
from ddm.evaluation.commands import evaluate_images
from ddm.evaluation.report import expert_parity
from ddm.checkpoints.discovery import default_checkpoints, discover
from ddm.deploy.spec import load_manifest
from ddm.models.ddm import load_ddm
from ddm.runtime.local import DEFAULT_MANIFEST, resolve_checkpoint
from ddm.sampling.pipeline import generate

SHIPPED = Path(__file__).resolve().parents[2] / "checkpoints" / "digits"


def test_every_command_defaults_to_the_ddm_make_demo_serves():
    """`ddm sample`, `eval` and `report` default to the checkpoints `ddm up` (make demo) serves
    from its default manifest: the served and the in-process images are the same model's."""
    spec = load_manifest(DEFAULT_MANIFEST).spec
    served = {resolve_checkpoint(e.checkpoint) for e in spec.experts}
    assert resolve_checkpoint(spec.router.checkpoint) == default_checkpoints() / "router"
    assert served == set(discover(default_checkpoints())["expert"])
    assert default_checkpoints() == SHIPPED.parent / "mnist"


def test_shipped_ddm_mirrors_the_reference_demo():
    found = discover(SHIPPED)
    assert {k: len(v) for k, v in found.items()} == {
        "expert": 2, "router": 1, "monolith": 1, "classifier": 1}
    experts = {read_meta(p).name: read_meta(p) for p in found["expert"]}
    assert experts["expert-0-4"].framework == "torch"
    assert experts["expert-0-4"].classes == (0, 1, 2, 3, 4)
    assert experts["expert-5-9"].framework == "jax"
    assert experts["expert-5-9"].classes == (5, 6, 7, 8, 9)
    size = sum(f.stat().st_size for f in SHIPPED.rglob("*") if f.is_file())
    assert size < 8_000_000


def test_torch_and_flax_agree_on_the_shipped_experts():
    parity = expert_parity(SHIPPED)
    assert set(parity) == {"expert-0-4", "expert-5-9"}
    assert max(parity.values()) <= 1e-4, parity


@pytest.mark.slow
def test_top1_samples_are_read_as_the_asked_digits():
    labels = np.repeat(np.arange(10), 10)
    out = generate(load_ddm(SHIPPED), labels, steps=40, seed=1, strategy="top1")
    metrics = evaluate_images(out.images, out.labels)
    assert metrics["accuracy"] >= 0.93, metrics
    assert np.all(out.expert_calls == 40)
