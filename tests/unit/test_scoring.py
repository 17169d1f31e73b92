"""The evaluation protocol: FD on Gaussians, manifold metrics, matched subsets, and on real
MNIST with the shipped classifier, that the metrics tell blur and dropped modes apart."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ddm.cli import main
from ddm.evaluation.corruptions import blurred, dropped_modes
from ddm.evaluation.frechet import frechet_distance, frechet_distance_from_stats
from ddm.evaluation.manifold import manifold_metrics
from ddm.data import LabelPartition, load_partition
from ddm.evaluation.scoring import SEEDS, Scores, cluster_agreement, matched_subsets, summarise
from tests.mnist_data import mnist_dir

REPOSITORY = Path(__file__).resolve().parents[2]
MNIST_CLASSIFIER = REPOSITORY / "checkpoints" / "mnist" / "classifier"
PER_CLASS = 100  # 1,000 images per run, the size the MNIST report evaluates at


# --- Frechet distance on Gaussians -----------------------------------------------------------

def _rotated_covariance() -> np.ndarray:
    angle = 0.6
    rotation = np.array([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]])
    return rotation @ np.diag([4.0, 9.0]) @ rotation.T


def test_frechet_closed_form_for_a_non_diagonal_covariance() -> None:
    """N(mu_a, I) vs N(mu_b, R diag(4, 9) R^T): the trace root is tr(S_b^1/2) = 2 + 3, so
    FD = |mu_a - mu_b|^2 + 2 + 13 - 2 * 5."""
    mu_a, mu_b = np.array([1.0, -2.0]), np.array([0.5, 1.0])
    expected = float((mu_a - mu_b) @ (mu_a - mu_b)) + 5.0
    assert frechet_distance_from_stats(mu_a, np.eye(2), mu_b, _rotated_covariance()) == \
        pytest.approx(expected, rel=1e-12)
    rng = np.random.default_rng(0)
    a = rng.multivariate_normal(mu_a, np.eye(2), 400_000)
    b = rng.multivariate_normal(mu_b, _rotated_covariance(), 400_000)
    assert frechet_distance(a, b) == pytest.approx(expected, rel=0.01)


# --- manifold metrics ------------------------------------------------------------------------

def _two_blobs(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centres = np.repeat([[-6.0, 0, 0, 0], [6.0, 0, 0, 0]], n // 2, axis=0)
    return centres + rng.standard_normal((n, 4))


def test_manifold_metrics_tell_off_manifold_from_missing_modes() -> None:
    real, same = _two_blobs(600, 0), _two_blobs(600, 1)
    matched = manifold_metrics(real, same)
    assert matched.precision > 0.8 and matched.recall > 0.8 and matched.coverage > 0.8
    assert 0.7 < matched.density < 1.3
    between = np.random.default_rng(2).standard_normal((600, 4))  # blurs the two blobs together
    blurry = manifold_metrics(real, between)
    assert blurry.precision < 0.2 and blurry.density < 0.2
    one_mode = _two_blobs(1200, 3)[:600]  # all from the first blob
    dropped = manifold_metrics(real, one_mode)
    assert dropped.precision > 0.8 and dropped.recall < 0.55 and dropped.coverage < 0.55
    assert manifold_metrics(real, same) == matched  # deterministic


def test_manifold_metrics_reject_bad_inputs() -> None:
    with pytest.raises(ValueError, match="more than 5 points"):
        manifold_metrics(np.zeros((5, 2)), np.zeros((9, 2)))
    with pytest.raises(ValueError, match="one D"):
        manifold_metrics(np.zeros((9, 2)), np.zeros((9, 3)))


# --- matched subsets and summaries -------------------------------------------------------------

def test_matched_subsets_are_disjoint_class_matched_and_seeded() -> None:
    pool = np.repeat(np.arange(3), 10)
    labels = np.array([0, 0, 1, 2, 2, 2])
    a, b = matched_subsets(pool, labels, seed=4)
    assert not set(a) & set(b)
    for rows in (a, b):
        np.testing.assert_array_equal(np.sort(pool[rows]), np.sort(labels))
    again = matched_subsets(pool, labels, seed=4)
    np.testing.assert_array_equal(again[0], a)
    assert not np.array_equal(matched_subsets(pool, labels, seed=5)[0], a)
    with pytest.raises(ValueError, match="holds 10 images of class 2; two disjoint subsets "
                                         "of 6 need 12"):
        matched_subsets(pool, np.full(6, 2), seed=0)


def test_summarise_gives_mean_and_sample_spread() -> None:
    scores = [Scores(fd=float(v), precision=0.5, recall=0.5, density=1.0, coverage=0.9)
              for v in (1.0, 2.0, 3.0)]
    summary = summarise(scores)
    assert summary["fd"] == {"mean": 2.0, "std": 1.0, "values": [1.0, 2.0, 3.0]}
    assert summary["precision"]["std"] == 0.0


def test_corruptions() -> None:
    images = np.zeros((2, 16, 16), np.uint8)
    images[:, 4:12, 7:9] = 255
    soft = blurred(images, sigma=1.0)
    assert soft.dtype == np.uint8 and soft.max() < 255 and (soft[:, 8, 6] > 0).all()
    assert abs(int(soft.astype(int).sum()) - int(images.astype(int).sum())) < 0.02 * int(
        images.astype(int).sum())
    np.testing.assert_array_equal(dropped_modes(np.arange(10).repeat(3), range(5)),
                                  np.arange(5).repeat(6))


def test_cluster_agreement_counts_choices_matching_the_final_images_cluster() -> None:
    images = np.zeros((4, 8, 8), np.uint8)
    labels = np.array([0, 1, 5, 6])
    partition = LabelPartition(((0, 1, 2, 3, 4), (5, 6, 7, 8, 9)))
    assert cluster_agreement(partition, images, labels, np.array([0, 0, 1, 0])) == 0.75
    with pytest.raises(ValueError, match="one choice per image"):
        cluster_agreement(partition, images, labels, np.array([0, 1]))


# --- real MNIST, the shipped classifier --------------------------------------------------------

@pytest.fixture(scope="module")
def judge():
    from ddm.evaluation.commands import load_judge

    directory = mnist_dir()
    return load_judge(MNIST_CLASSIFIER, f"mnist:{directory}")


@pytest.fixture(scope="module")
def labels() -> np.ndarray:
    return np.repeat(np.arange(10), PER_CLASS)


def _mean(scores: list[Scores], metric: str) -> float:
    return float(np.mean([getattr(s, metric) for s in scores]))


def test_mnist_metrics_tell_real_blurry_and_mode_dropped_apart(judge, labels) -> None:
    """Both damages raise FD far above the floor; blur costs precision and density (images
    off the real manifold), dropping half the classes costs recall and coverage only."""
    floor = judge.floor(labels)
    blurry = [judge.score(blurred(judge.real_images(labels, labels, s), 1.5), labels, s)
              for s in SEEDS]
    dropped = [judge.score(judge.real_images(dropped_modes(labels, range(5)), labels, s),
                           labels, s) for s in SEEDS]
    floor_fd = _mean(floor, "fd")
    assert _mean(blurry, "fd") > 10 * floor_fd and _mean(dropped, "fd") > 10 * floor_fd
    assert _mean(blurry, "precision") < _mean(floor, "precision") - 0.05
    assert _mean(blurry, "density") < 0.8 * _mean(floor, "density")
    assert _mean(dropped, "precision") > _mean(floor, "precision") - 0.03
    assert _mean(dropped, "density") > 0.9 * _mean(floor, "density")
    assert _mean(dropped, "recall") < _mean(floor, "recall") - 0.3
    assert _mean(dropped, "coverage") < 0.7 * _mean(floor, "coverage")
    assert judge.floor(labels) == floor  # deterministic


def test_real_digits_agree_with_their_own_cluster(judge, labels) -> None:
    partition = load_partition(REPOSITORY / "checkpoints" / "mnist" / "partition.json")
    images = judge.real_images(labels, labels, 0)
    clusters = partition.assign(images[:, None].astype(np.float32) / 255.0, np.sort(labels))
    assert cluster_agreement(partition, images, np.sort(labels), clusters) == 1.0
    assert cluster_agreement(partition, images, np.sort(labels), (clusters + 1) % 4) == 0.0


def test_ddm_eval_scores_sample_files_against_the_floor(judge, labels, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture) -> None:
    files = []
    for seed in SEEDS:
        files.append(tmp_path / f"real-{seed}.npz")
        np.savez(files[-1], images=judge.real_images(labels, labels, seed), labels=labels)
    assert main(["eval", *map(str, files), "--classifier", str(MNIST_CLASSIFIER),
                 "--data", f"mnist:{mnist_dir()}", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["n"] == 1000 and result["runs"] == 3 and result["cpu_seconds"] > 0
    assert result["accuracy"]["mean"] > 0.97
    floor = result["floor"]["fd"]
    assert len(floor["values"]) == 3 and floor["std"] > 0
    # real images not in the reference subset score like the floor
    assert result["fd"]["mean"] < floor["mean"] + 4 * floor["std"] + 0.5 * floor["mean"]
