"""Datasets, the MNIST IDX reader (on small files written here), resizing and partitions."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from ddm.data import (
    Dataset,
    IDXError,
    KMeansPartition,
    LabelPartition,
    classes_of,
    fit_kmeans,
    load_dataset,
    load_digits_dataset,
    parse_label_groups,
    partition_from_dict,
    resize_images,
    split_holdout,
    subset_by_classes,
)
from ddm.data.datasets import recorded_source
from ddm.data.partition_file import fit_partition_command
from ddm.models.config import ConfigError


@pytest.fixture(scope="module")
def digits() -> Dataset:
    return load_digits_dataset(16)


# --- digits, splits, subsets -------------------------------------------------------------

def test_digits_shape_range_and_labels(digits: Dataset) -> None:
    assert digits.images.shape == (1797, 1, 16, 16) and digits.images.dtype == np.float32
    assert digits.images.min() == 0.0 and digits.images.max() == 1.0
    assert digits.labels.dtype == np.int64 and set(digits.labels.tolist()) == set(range(10))


def test_the_embedded_digits_are_scikit_learns_exactly() -> None:
    """The package carries its own copy (no scikit-learn where experts are served); it is
    the one scikit-learn returns, so every training run and check reads the same images."""
    sklearn_datasets = pytest.importorskip("sklearn.datasets")
    digits = sklearn_datasets.load_digits()
    np.testing.assert_array_equal(load_digits_dataset(8).images[:, 0] * 16.0, digits.images)
    np.testing.assert_array_equal(load_digits_dataset(8).labels, digits.target)
    scaled = np.clip(resize_images(digits.images / 16.0, 16), 0.0, 1.0)[:, None]
    np.testing.assert_array_equal(load_digits_dataset(16).images, scaled)


def test_the_digits_load_without_scikit_learn(monkeypatch) -> None:
    """As in the serving images: a blocked import of sklearn changes nothing."""
    monkeypatch.setitem(sys.modules, "sklearn", None)
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    assert len(subset_by_classes(load_dataset("digits", 16, "heldout"), (0, 1, 2, 3, 4))) == 225


def test_resize_is_identity_at_same_size_and_keeps_constants_and_range() -> None:
    rng = np.random.default_rng(0)
    images = rng.random((3, 28, 28)).astype(np.float32)
    np.testing.assert_allclose(resize_images(images, 28), images, atol=1e-6)
    for size in (16, 32):
        np.testing.assert_allclose(resize_images(np.full((2, 28, 28), 0.7), size), 0.7, atol=1e-6)
        out = resize_images(images, size)
        assert out.shape == (3, size, size) and out.min() >= 0.0 and out.max() <= 1.0 + 1e-6


def test_split_is_stratified_disjoint_and_deterministic(digits: Dataset) -> None:
    train, heldout = split_holdout(digits, fraction=0.25, seed=0)
    for label in range(10):
        n = int((digits.labels == label).sum())
        assert (heldout.labels == label).sum() == round(0.25 * n)
    assert len(train) + len(heldout) == len(digits)
    def rows(ds: Dataset) -> set[bytes]:
        return {r.tobytes() for r in ds.images}

    assert rows(train) | rows(heldout) == rows(digits)
    again, _ = split_holdout(digits, fraction=0.25, seed=0)
    other, _ = split_holdout(digits, fraction=0.25, seed=1)
    np.testing.assert_array_equal(again.images, train.images)
    assert not np.array_equal(other.images, train.images)
    assert (train.name, heldout.name) == ("digits-16x16/train", "digits-16x16/heldout")


def test_load_dataset_digits_splits_match_split_holdout(digits: Dataset) -> None:
    train, heldout = split_holdout(digits)
    np.testing.assert_array_equal(load_dataset("digits", 16, "heldout").labels, heldout.labels)
    assert len(load_dataset("digits", 16)) == len(train)


@pytest.mark.parametrize("source, split, problem", [
    ("cifar", "train", "unknown data source 'cifar'"),
    ("mnist:", "train", "unknown data source 'mnist:'"),
    ("mnist", "train", "does not say where MNIST's IDX files are on this machine: pass "
                       "mnist:DIR"),
    ("digits", "test", "unknown split 'test'"),
])
def test_load_dataset_rejects_unknown_sources_and_splits(source: str, split: str,
                                                         problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        load_dataset(source, 16, split)


def test_subset_by_classes(digits: Dataset) -> None:
    subset = subset_by_classes(digits, [5, 3])
    assert set(subset.labels.tolist()) == {3, 5}
    assert len(subset) == int(np.isin(digits.labels, [3, 5]).sum())
    with pytest.raises(ValueError, match="no images of class"):
        subset_by_classes(subset, [3, 4])


def test_dataset_rejects_malformed_arrays() -> None:
    with pytest.raises(ValueError, match="float32"):
        Dataset(np.zeros((2, 1, 4, 4), np.uint8), np.zeros(2, np.int64), "bad")
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        Dataset(np.full((2, 1, 4, 4), 2.0, np.float32), np.zeros(2, np.int64), "bad")


# --- MNIST IDX files -------------------------------------------------------------------

def _idx(magic: int, dims: tuple[int, ...], payload: bytes) -> bytes:
    return magic.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in dims) + payload


def _write_mnist(root: Path, part: str = "train", n: int = 5, *, dotted: bool = False,
                 gz: bool = False, labels: np.ndarray | None = None) -> np.ndarray:
    """Write ``n`` 28x28 images (image ``i`` is all ``25 * i``) and their labels."""
    root.mkdir(parents=True, exist_ok=True)
    pixels = np.repeat(np.arange(n, dtype=np.uint8) * 25, 28 * 28).reshape(n, 28, 28)
    labels = np.arange(n, dtype=np.uint8) % 10 if labels is None else labels
    sep = "." if dotted else "-"
    for kind, rank, magic, data in (("images", 3, 0x803, pixels), ("labels", 1, 0x801, labels)):
        content = _idx(magic, data.shape, data.tobytes())
        name = f"{part}-{kind}{sep}idx{rank}-ubyte" + (".gz" if gz else "")
        (root / name).write_bytes(gzip.compress(content) if gz else content)
    return pixels


@pytest.mark.parametrize("dotted", [False, True])
@pytest.mark.parametrize("gz", [False, True])
def test_mnist_reads_raw_and_gzip_in_both_namings(tmp_path: Path, dotted: bool, gz: bool) -> None:
    pixels = _write_mnist(tmp_path, dotted=dotted, gz=gz)
    ds = load_dataset(f"mnist:{tmp_path}", 16)
    assert ds.images.shape == (5, 1, 16, 16) and ds.name == "mnist-16x16/train"
    np.testing.assert_array_equal(ds.labels, np.arange(5))
    np.testing.assert_allclose(ds.images[:, 0, 3, 3], pixels[:, 0, 0] / 255.0, atol=1e-6)


def test_mnist_heldout_is_the_t10k_part_and_32px_pads(tmp_path: Path) -> None:
    pixels = _write_mnist(tmp_path, part="t10k", n=3)
    ds = load_dataset(f"mnist:{tmp_path}", 32, "heldout")
    assert ds.images.shape == (3, 1, 32, 32) and ds.name == "mnist-32x32/heldout"
    np.testing.assert_array_equal(ds.images[:, 0, 2:30, 2:30], pixels / np.float32(255.0))
    border = np.ones((32, 32), bool)
    border[2:30, 2:30] = False
    assert not ds.images[:, 0][:, border].any()  # the 2-pixel margin is background


def test_a_partition_file_records_mnist_without_this_machines_path(tmp_path: Path) -> None:
    """A file that is shared or shipped says which data it came from, not where it lay."""
    _write_mnist(tmp_path / "idx", n=20)
    fit_partition_command(f"mnist:{tmp_path / 'idx'}", 2, "pixels", 16, 0,
                          tmp_path / "partition.json")
    content = (tmp_path / "partition.json").read_text()
    assert json.loads(content)["fit"]["source"] == "mnist" and str(tmp_path) not in content
    assert recorded_source("digits") == "digits"


def test_mnist_gzip_is_detected_by_content_not_name(tmp_path: Path) -> None:
    _write_mnist(tmp_path, gz=True)
    for path in tmp_path.iterdir():
        path.rename(path.with_suffix(""))  # gzip bytes under the raw name
    assert len(load_dataset(f"mnist:{tmp_path}", 16)) == 5


def _corrupt(root: Path, kind: str, content: bytes) -> str:
    name = f"train-{kind}-idx{3 if kind == 'images' else 1}-ubyte"
    (root / name).write_bytes(content)
    return name


@pytest.mark.parametrize("kind, content, problem", [
    ("images", _idx(0x801, (5,), bytes(5)), "bad magic number 0x00000801, expected 0x00000803"),
    ("labels", _idx(0x803, (5, 1, 1), bytes(5)),
     "bad magic number 0x00000803, expected 0x00000801"),
    ("images", b"\x00\x00", "too short for an IDX header"),
    ("images", _idx(0x803, (5, 28), b""), "truncated header"),
    ("images", _idx(0x803, (5, 28, 28), bytes(28 * 28 * 5 - 1)), "truncated data"),
    ("labels", _idx(0x801, (5,), bytes(7)), "2 unexpected bytes"),
    ("images", b"\x1f\x8b" + b"not really gzip", "corrupt gzip data"),
    ("labels", gzip.compress(_idx(0x801, (5,), bytes(5)), mtime=0)[:-6], "corrupt gzip data"),
])
def test_mnist_corrupt_files_name_file_and_problem(tmp_path: Path, kind: str, content: bytes,
                                                   problem: str) -> None:
    _write_mnist(tmp_path)
    name = _corrupt(tmp_path, kind, content)
    with pytest.raises(IDXError, match=problem) as info:
        load_dataset(f"mnist:{tmp_path}", 16)
    assert name in str(info.value)


def test_mnist_count_mismatch_names_both_files(tmp_path: Path) -> None:
    _write_mnist(tmp_path)
    _corrupt(tmp_path, "labels", _idx(0x801, (4,), bytes(4)))
    with pytest.raises(IDXError, match=r"train-images-idx3-ubyte holds 5 images but .*"
                                       r"train-labels-idx1-ubyte holds 4 labels"):
        load_dataset(f"mnist:{tmp_path}", 16)


def test_mnist_label_above_nine_is_rejected(tmp_path: Path) -> None:
    _write_mnist(tmp_path, labels=np.array([1, 2, 12, 3, 4], np.uint8))
    with pytest.raises(IDXError, match="train-labels-idx1-ubyte: label 12 at index 2"):
        load_dataset(f"mnist:{tmp_path}", 16)


def test_mnist_missing_files_and_directory(tmp_path: Path) -> None:
    _write_mnist(tmp_path, part="t10k")
    with pytest.raises(IDXError, match="no MNIST train images file .* train-images.idx3-ubyte.gz"):
        load_dataset(f"mnist:{tmp_path}", 16)
    with pytest.raises(IDXError, match="does not exist"):
        load_dataset(f"mnist:{tmp_path / 'absent'}", 16)


# --- partitions --------------------------------------------------------------------------

def test_label_partition_assigns_and_round_trips() -> None:
    partition = LabelPartition(((0, 1, 2, 3, 4), (5, 6, 7, 8, 9)))
    labels = np.array([0, 9, 4, 5])
    ids = partition.assign(np.zeros((4, 1, 2, 2)), labels)
    np.testing.assert_array_equal(ids, [0, 1, 0, 1])
    assert partition.num_partitions == 2 and classes_of(ids, labels, 1) == (5, 9)
    restored = partition_from_dict(json.loads(json.dumps(partition.to_dict())))
    assert restored == partition and restored.to_dict()["method"] == "labels"


def test_label_partition_rejects_overlap_empty_groups_and_stray_labels() -> None:
    with pytest.raises(ConfigError, match="label 3 is in groups 0 and 1"):
        LabelPartition(((0, 1, 3), (3, 4)))
    with pytest.raises(ConfigError, match="non-empty"):
        LabelPartition(((0, 1), ()))
    with pytest.raises(ValueError, match="label.s. 7 belong to no group"):
        LabelPartition(((0,), (1,))).assign(np.zeros((2, 1, 2, 2)), np.array([0, 7]))


@pytest.mark.parametrize("spec, groups", [
    ("0-4,5-9", ((0, 1, 2, 3, 4), (5, 6, 7, 8, 9))),
    ("0,1,2;3,4", ((0, 1, 2), (3, 4))),
    ("0-1, 2 ; 3-5", ((0, 1, 2), (3, 4, 5))),
    ("7", ((7,),)),
])
def test_parse_label_groups(spec: str, groups: tuple[tuple[int, ...], ...]) -> None:
    assert parse_label_groups(spec) == groups


@pytest.mark.parametrize("spec, problem", [
    ("0-4,a", "'a' is not a label"), ("4-0", "range 4-0 is empty"), ("0-4,3-9", "label 3"),
    ("", "'' is not a label"), ("0;;1", "'' is not a label"),
])
def test_parse_label_groups_errors(spec: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        parse_label_groups(spec)


def _blobs() -> tuple[np.ndarray, np.ndarray]:
    """20 dark and 20 bright noisy 4x4 images: two obvious clusters."""
    rng = np.random.default_rng(0)
    truth = np.repeat([0, 1], 20)
    images = 0.1 + 0.8 * truth[:, None, None, None] + 0.05 * rng.standard_normal((40, 1, 4, 4))
    return images.astype(np.float32), truth


def test_kmeans_finds_clusters_deterministically_and_round_trips() -> None:
    images, truth = _blobs()
    partition = fit_kmeans(images, 2, seed=3)
    ids = partition.assign(images, truth)
    assert len(set(zip(ids.tolist(), truth.tolist()))) == 2  # a relabelling of the truth
    np.testing.assert_array_equal(fit_kmeans(images, 2, seed=3).centroids, partition.centroids)
    restored = partition_from_dict(json.loads(json.dumps(partition.to_dict())))
    assert isinstance(restored, KMeansPartition) and restored.num_partitions == 2
    np.testing.assert_array_equal(restored.centroids, partition.centroids)
    np.testing.assert_array_equal(restored.assign(images, truth), ids)


def test_kmeans_on_digits_is_deterministic(digits: Dataset) -> None:
    images = digits.images[:400]
    a, b = fit_kmeans(images, 3, seed=0), fit_kmeans(images, 3, seed=0)
    np.testing.assert_array_equal(a.centroids, b.centroids)
    assert np.bincount(a.assign(images, digits.labels[:400]), minlength=3).min() > 0


def test_kmeans_rejects_bad_k_and_mismatched_images() -> None:
    images, truth = _blobs()
    with pytest.raises(ValueError, match="k must be an integer between 1 and the 40 images"):
        fit_kmeans(images, 41, seed=0)
    with pytest.raises(ValueError, match="give 64 features; the k-means centroids were fitted "
                                         "on 16"):
        fit_kmeans(images, 2, seed=0).assign(np.zeros((1, 1, 8, 8)), truth[:1])


@pytest.mark.parametrize("d, problem", [
    ({"method": "spectral"}, "unknown partition method 'spectral'"),
    ({"groups": [[0]]}, "unknown partition method None"),
    ({"method": "labels", "groups": [[0]], "k": 2}, r"unknown keys \['k'\]"),
    ({"method": "kmeans", "centroids": [[0.0]]}, r"missing keys \['features'\]"),
    ({"method": "kmeans", "features": "dino", "centroids": [[0.0]]}, "unknown features 'dino'"),
    ({"method": "kmeans", "features": "pixels", "centroids": [1.0, 2.0]}, r"\(K, D\) array"),
    ({"method": "labels", "groups": [[0, "1"]]}, "non-negative integer"),
    ([("method", "labels")], "must be a mapping"),
])
def test_partition_from_dict_rejects_bad_dicts(d: object, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        partition_from_dict(d)  # type: ignore[arg-type]
