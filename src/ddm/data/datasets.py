"""Labelled digit image sets: the embedded digits and MNIST, one in-memory form.

Every source becomes a :class:`Dataset` of ``(N, 1, H, W)`` float32 images in ``[0, 1]``
with ink at 1 (``ddm.convention.to_model_space`` maps them to model space). The split
names mean the same for every source: ``train`` is what diffusion models learn from;
``heldout`` is never shown to them and is where the evaluation classifier is trained,
so that its judgement of generated samples is not biased toward memorised images.

The digits are embedded in the package (``digits.npz``, 45 KB): the 1797 8x8 images of the
test set of E. Alpaydin and C. Kaynak's "Optical Recognition of Handwritten Digits" (UCI
Machine Learning Repository, 1998, doi:10.24432/C50P49, CC BY 4.0), ink counted 0..16 per
cell, exactly as scikit-learn's ``load_digits`` returns them (a test checks it where
scikit-learn is installed). So every install has them, the serving images included, where
``ddm expert check`` tests an expert's objective on them.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from typing import Iterable

import numpy as np

from ddm.data.mnist import load_mnist
from ddm.data.resize import resize_images

SPLITS = ("train", "heldout")
#: The MNIST source's name: ``mnist:DIR`` reads the IDX files in DIR.
MNIST = "mnist"
#: The digits set has no official split: this stratified fraction of it is held out.
HELDOUT_FRACTION = 0.25
SPLIT_SEED = 0
_DIGITS_MAX = 16.0  # the digits count ink in 0..16 per 8x8 cell
_DIGITS_FILE = "digits.npz"  # images (1797, 8, 8) uint8 in 0..16, labels (1797,) uint8


@dataclass(frozen=True, eq=False)
class Dataset:
    """``images`` ``(N, 1, H, W)`` float32 in ``[0, 1]`` (ink = 1), ``labels`` ``(N,)`` int64."""

    images: np.ndarray
    labels: np.ndarray
    name: str

    def __post_init__(self) -> None:
        if self.images.ndim != 4 or self.images.shape[1] != 1:
            raise ValueError(f"dataset {self.name}: images must be (N, 1, H, W), "
                             f"got {self.images.shape}")
        if self.images.dtype != np.float32:
            raise ValueError(f"dataset {self.name}: images must be float32, "
                             f"got {self.images.dtype}")
        if self.labels.dtype != np.int64 or self.labels.shape != self.images.shape[:1]:
            raise ValueError(f"dataset {self.name}: labels must be int64 of shape "
                             f"{self.images.shape[:1]}, "
                             f"got {self.labels.dtype} {self.labels.shape}")
        if self.images.size and (self.images.min() < 0.0 or self.images.max() > 1.0):
            raise ValueError(f"dataset {self.name}: pixels must lie in [0, 1]")

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @property
    def image_size(self) -> int:
        return int(self.images.shape[-1])

    def select(self, indices: np.ndarray, name: str) -> "Dataset":
        """The rows ``indices`` (in that order) as a new dataset called ``name``."""
        return Dataset(self.images[indices], self.labels[indices], name)


def load_dataset(source: str, image_size: int, split: str = "train") -> Dataset:
    """``source`` is ``digits`` or ``mnist:PATH`` (a directory of the four MNIST IDX files).

    For MNIST, ``train`` is its 60k training part and ``heldout`` its 10k test part; for
    digits they are the two sides of :func:`split_holdout` with the module defaults.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; known: {', '.join(SPLITS)}")
    if source == "digits":
        train, heldout = split_holdout(load_digits_dataset(image_size))
        return train if split == "train" else heldout
    if source == MNIST:
        raise ValueError("data source 'mnist' does not say where MNIST's IDX files are on this "
                         "machine: pass mnist:DIR, a directory holding the four IDX files")
    if source.startswith(f"{MNIST}:") and source[len(f"{MNIST}:"):]:
        part = "train" if split == "train" else "t10k"
        images, labels = load_mnist(source[len("mnist:"):], image_size, part)
        return Dataset(images, labels, f"mnist-{image_size}x{image_size}/{split}")
    raise ValueError(f"unknown data source {source!r}; use 'digits' or 'mnist:PATH' "
                     "(PATH a directory holding the MNIST IDX files)")


def recorded_source(source: str) -> str:
    """``source`` as a file we ship or share records it: ``digits`` as it is, ``mnist:PATH``
    as ``mnist``. Where the IDX files lay is the writer's machine's business: a path recorded
    names a directory nobody else has (a reader passes ``--data mnist:DIR``)."""
    return MNIST if source.startswith(f"{MNIST}:") else source


def load_digits_dataset(image_size: int = 16) -> Dataset:
    """The embedded 1797 8x8 digits (module doc), resized to ``image_size``
    (``ddm.data.resize``)."""
    with resources.files("ddm.data").joinpath(_DIGITS_FILE).open("rb") as file:
        with np.load(file, allow_pickle=False) as digits:
            raw, labels = digits["images"], digits["labels"]
    images = resize_images(raw.astype(np.float64) / _DIGITS_MAX, image_size)
    return Dataset(np.clip(images, 0.0, 1.0)[:, None], labels.astype(np.int64),
                   f"digits-{image_size}x{image_size}")


def split_holdout(ds: Dataset, fraction: float = HELDOUT_FRACTION,
                  seed: int = SPLIT_SEED) -> tuple[Dataset, Dataset]:
    """``(train, heldout)``: ``round(fraction * n_c)`` of every label ``c`` go to heldout.

    Stratified so both sides keep the class balance; deterministic in ``seed``; rows keep
    their original order within each side.
    """
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"heldout fraction must lie strictly between 0 and 1, got {fraction}")
    rng = np.random.default_rng(seed)
    held = np.zeros(len(ds), dtype=bool)
    for label in np.unique(ds.labels):
        rows = np.flatnonzero(ds.labels == label)
        held[rng.permutation(rows)[:round(fraction * rows.size)]] = True
    return (ds.select(np.flatnonzero(~held), f"{ds.name}/train"),
            ds.select(np.flatnonzero(held), f"{ds.name}/heldout"))


def subset_by_classes(ds: Dataset, classes: Iterable[int]) -> Dataset:
    """The rows whose label is in ``classes``; every class asked for must be present."""
    wanted = tuple(sorted({int(c) for c in classes}))
    if not wanted:
        raise ValueError(f"dataset {ds.name}: no classes given")
    missing = [c for c in wanted if not np.any(ds.labels == c)]
    if missing:
        raise ValueError(f"dataset {ds.name} has no images of class(es) "
                         f"{', '.join(map(str, missing))}")
    rows = np.flatnonzero(np.isin(ds.labels, wanted))
    return ds.select(rows, f"{ds.name}/classes={','.join(map(str, wanted))}")
