"""HOG features, partition hashes, and the partition file that experts and router share."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from ddm.cli import main
from ddm.data import (
    KMeansPartition,
    LabelPartition,
    PartitionMismatchError,
    check_partition_hash,
    features_spec,
    fit_kmeans,
    load_dataset,
    load_partition,
    partition_from_dict,
    partition_from_spec,
    read_partition_file,
)
from ddm.data.features import extract
from ddm.data.partition_file import conditional_entropy_bits
from ddm.models.config import ConfigError
from tests.mnist_data import mnist_dir

REPOSITORY = Path(__file__).resolve().parents[2]
SHIPPED = REPOSITORY / "checkpoints" / "mnist" / "partition.json"
HOG = features_spec("hog", cell=4, bins=4)


def _bars(n: int = 12, size: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """Vertical (0) and horizontal (1) bars of random position, width and darkness."""
    rng = np.random.default_rng(0)
    truth = np.repeat([0, 1], n)
    images = np.zeros((2 * n, 1, size, size), np.float32)
    for i, kind in enumerate(truth):
        start, width, ink = rng.integers(1, 4), rng.integers(1, 3), rng.uniform(0.3, 1.0)
        if kind == 0:
            images[i, 0, :, start:start + width] = ink
        else:
            images[i, 0, start:start + width, :] = ink
    return images, truth


# --- features ----------------------------------------------------------------------------

def test_hog_sees_stroke_direction_not_darkness() -> None:
    images, truth = _bars()
    features = extract(HOG, images)
    assert features.shape == (24, 2 * 2 * 4)
    np.testing.assert_allclose(np.linalg.norm(features, axis=1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(extract(HOG, images * 0.5), features, atol=1e-6)
    # bins centred on 22.5, 67.5, 112.5 and 157.5 degrees: a vertical bar's gradient points
    # along x (0 degrees, split between the first and last bins), a horizontal bar's along y
    per_bin = features.reshape(24, 4, 4).sum(axis=1)
    vertical, horizontal = per_bin[truth == 0].mean(0), per_bin[truth == 1].mean(0)
    assert vertical[[0, 3]].sum() > 5 * vertical[[1, 2]].sum()
    assert horizontal[[1, 2]].sum() > 5 * horizontal[[0, 3]].sum()


def test_features_reject_bad_specs_and_shapes() -> None:
    with pytest.raises(ConfigError, match="unknown features 'dino'"):
        features_spec("dino")
    with pytest.raises(ConfigError, match=r"unknown keys \['sigma'\]"):
        extract({"name": "hog", "cell": 4, "bins": 9, "sigma": 1}, np.zeros((1, 1, 8, 8)))
    with pytest.raises(ConfigError, match="cell must be a positive integer"):
        features_spec("hog", cell=0)
    with pytest.raises(ValueError, match="divide by the cell size 4"):
        extract(HOG, np.zeros((1, 1, 10, 10)))


# --- k-means on features, hashes -----------------------------------------------------------

def test_kmeans_on_hog_separates_bar_directions_and_round_trips() -> None:
    images, truth = _bars()
    partition = fit_kmeans(images, 2, seed=0, features=HOG)
    ids = partition.assign(images, truth)
    assert len(set(zip(ids.tolist(), truth.tolist()))) == 2
    assert partition.image_size == 8 and partition.features == HOG
    record = json.loads(json.dumps(partition.to_dict()))
    restored = partition_from_dict(record)
    assert restored.sha256 == partition.sha256 == record["sha256"]
    np.testing.assert_array_equal(restored.assign(images, truth), ids)
    with pytest.raises(ValueError, match="fitted on 8x8 images"):
        partition.assign(np.zeros((1, 1, 16, 16)), truth[:1])


def test_hash_covers_what_decides_assignment() -> None:
    centroids = np.eye(2, 16, dtype=np.float32)
    base = KMeansPartition(centroids, "pixels", 4)
    assert KMeansPartition(centroids.copy(), "pixels", 4).sha256 == base.sha256
    moved = KMeansPartition(centroids * 2, "pixels", 4)
    assert len({base.sha256, moved.sha256, KMeansPartition(centroids).sha256,
                LabelPartition(((0,), (1,))).sha256}) == 4


def test_edited_record_is_refused_naming_both_hashes() -> None:
    record = KMeansPartition(np.eye(2, 16, dtype=np.float32), "pixels", 4).to_dict()
    tampered = {**record, "centroids": [[0.5] * 16, [0.0] * 16]}
    content_hash = KMeansPartition(np.array(tampered["centroids"]), "pixels", 4).sha256
    with pytest.raises(ConfigError, match=f"recorded sha256 {record['sha256']} does not match "
                                          f"its content's sha256 {content_hash}"):
        partition_from_dict(tampered)


def test_check_partition_hash_names_both_hashes_and_who() -> None:
    check_partition_hash("a" * 64, "a" * 64, "expert e0")
    with pytest.raises(PartitionMismatchError,
                       match=f"expert e0 was made for partition sha256 {'b' * 64}, but "
                             f"partition sha256 {'a' * 64} is expected"):
        check_partition_hash("a" * 64, "b" * 64, "expert e0")


def test_legacy_records_without_hash_still_load() -> None:
    legacy = {"method": "kmeans", "features": "pixels", "centroids": [[0.0, 1.0], [1.0, 0.0]]}
    partition = partition_from_dict(legacy)
    assert isinstance(partition, KMeansPartition) and partition.image_size is None
    assert partition_from_dict({"method": "labels", "groups": [[0], [1]]}).num_partitions == 2


@pytest.mark.parametrize("counts, bits", [
    (np.eye(4, 10, dtype=np.int64) * 7 + np.eye(4, 10, 4, dtype=np.int64) * 3, 0.0),
    (np.ones((4, 10), np.int64), 2.0),
    (np.array([[5, 0], [5, 10]]), 0.5),
])
def test_conditional_entropy_known_answers(counts: np.ndarray, bits: float) -> None:
    assert conditional_entropy_bits(counts) == pytest.approx(bits)


# --- the partition file and the CLI --------------------------------------------------------

@pytest.fixture(scope="module")
def fitted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("partition") / "digits.json"
    assert main(["partition", "fit", "--data", "digits", "--kmeans", "3", "--image-size", "16",
                 "--seed", "1", "--out", str(out)]) == 0
    return out


def test_fit_writes_a_file_every_trainer_assigns_with(fitted: Path,
                                                      capsys: pytest.CaptureFixture) -> None:
    content = read_partition_file(fitted)
    fit = content["fit"]
    assert content["partition"]["features"] == features_spec("hog")
    assert fit["k"] == 3 and sum(fit["cluster_sizes"]) == fit["images"] == 1347
    assert np.array(fit["classes_per_cluster"]).sum(axis=0).tolist() == np.bincount(
        load_dataset("digits", 16).labels).tolist()
    assert 0.0 <= fit["label_to_cluster_entropy_bits"] <= math.log2(3)
    train = load_dataset("digits", 16)
    a = partition_from_spec(f"file:{fitted}", train, seed=0)
    b = partition_from_spec(f"file:{fitted}", train, seed=99)  # the seed no longer matters
    np.testing.assert_array_equal(a.assign(train.images, train.labels),
                                  b.assign(train.images, train.labels))
    assert main(["partition", "show", str(fitted)]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["partition"]["sha256"] == a.sha256 and "centroids" not in shown["partition"]


def test_refit_with_same_seed_gives_same_hash(fitted: Path, tmp_path: Path) -> None:
    again = tmp_path / "again.json"
    main(["partition", "fit", "--data", "digits", "--kmeans", "3", "--image-size", "16",
          "--seed", "1", "--out", str(again)])
    assert load_partition(again).sha256 == load_partition(fitted).sha256


def test_partition_file_errors(fitted: Path, tmp_path: Path,
                               capsys: pytest.CaptureFixture) -> None:
    content = json.loads(fitted.read_text())
    content["partition"]["centroids"][0][0] += 0.25
    (tmp_path / "edited.json").write_text(json.dumps(content))
    with pytest.raises(ConfigError, match="edited.json: kmeans partition: recorded sha256"):
        load_partition(tmp_path / "edited.json")
    (tmp_path / "other.json").write_text(json.dumps({"format": "something/2"}))
    with pytest.raises(ConfigError, match="format 'something/2', expected 'ddm-partition/1'"):
        load_partition(tmp_path / "other.json")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ConfigError, match="not readable JSON"):
        load_partition(tmp_path / "broken.json")
    with pytest.raises(FileNotFoundError, match="absent.json does not exist"):
        load_partition(tmp_path / "absent.json")
    assert main(["partition", "show", str(tmp_path / "edited.json")]) == 2
    assert "does not match its content" in capsys.readouterr().err


@pytest.mark.parametrize("out, problem", [
    ("missing/digits.json", "--out {out}: directory {parent} does not exist (create it first)"),
    ("digits.txt", "--out must name a .json file, got {out}"),
])
def test_fit_checks_its_output_before_loading_the_data(tmp_path: Path, out: str, problem: str,
                                                        capsys: pytest.CaptureFixture) -> None:
    # the data is absent too: checked first, it would be named instead (after minutes of
    # loading and fitting MNIST, had it been there)
    out_path = tmp_path / out
    assert main(["partition", "fit", "--data", f"mnist:{tmp_path / 'absent'}", "--kmeans",
                 "4", "--image-size", "32", "--out", str(out_path)]) == 2
    expected = problem.format(out=out_path, parent=out_path.parent)
    assert capsys.readouterr().err.strip() == f"ddm: error: {expected}"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("spec, problem", [
    ("colour:3", "unknown partition 'colour:3'; use 'file:PATH'"),
    ("file:", "unknown partition 'file:'"),
    ("kmeans:0", "unknown partition 'kmeans:0'"),
])
def test_partition_spec_errors(spec: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        partition_from_spec(spec, load_dataset("digits", 16), seed=0)


def test_partition_spec_labels_and_legacy_kmeans() -> None:
    train = load_dataset("digits", 16)
    assert partition_from_spec("labels:0-4,5-9", train, 0) == LabelPartition(
        ((0, 1, 2, 3, 4), (5, 6, 7, 8, 9)))
    legacy = partition_from_spec("kmeans:2", train, 0)
    assert isinstance(legacy, KMeansPartition) and legacy.features == "pixels"


# --- the shipped MNIST partition on real MNIST ---------------------------------------------

def test_shipped_mnist_partition_cuts_across_classes() -> None:
    """Each digit spreads over several clusters, so the router must look at the image."""
    test = load_dataset(f"mnist:{mnist_dir()}", 32, "heldout")
    partition = load_partition(SHIPPED)
    ids = partition.assign(test.images, test.labels)
    counts = np.zeros((partition.num_partitions, 10), np.int64)
    np.add.at(counts, (ids, test.labels), 1)
    assert partition.num_partitions == 4 and counts.sum(axis=1).min() > 1000
    assert conditional_entropy_bits(counts) > 0.5
